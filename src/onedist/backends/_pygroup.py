"""What onedist's Python process groups (``shm``, ``mpi`` over mpi4py) share.

torch lets Python register a process group backend; ``DistributedDataParallel`` and every
``dist.*`` call then use it like gloo. Three things every such group needs, kept here:

* :class:`PyWork`: torch's own future-backed ``Work`` returns from ``wait()`` even when the
  future failed; this one raises the failure (and can carry a ``recv`` sender).
* :class:`OrderedGroup`: collectives complete in call order, run here and now when small and
  nothing is queued, else on the group's thread (a Work that completes later), so that DDP's
  backward goes on computing while large gradient buckets are reduced, as with gloo's threads.
* flat, stride-1 views of the tensors a collective is given (:func:`flat`).
* the argument checks every rank makes before anything moves (:class:`ArgCheck`): a wrong
  root or tensor size raises a ValueError naming it, and the group stays usable, as gloo's does.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = [
    "ArgCheck",
    "NamedGroup",
    "OrderedGroup",
    "PyWork",
    "all_cpu",
    "averages",
    "done",
    "flat",
    "for_each",
    "op_name",
    "opts_or",
]

_Work: Any = dist.distributed_c10d.Work
# torch's stubs type ProcessGroup's methods with overloads a Python override cannot match one by one
_ProcessGroup: Any = dist.ProcessGroup

#: collectives moving at least this many bytes run on the group's thread
ASYNC_BYTES = 1 << 20


class PyWork(_Work):  # type: ignore[misc]
    """A Work over a future that the group completes; ``wait()`` raises the collective's error."""

    def __init__(self, fut: torch.futures.Future[Any], source: int = -1) -> None:
        super().__init__()
        self._fut = fut
        self._source = source

    def wait(self, timeout: Any = None) -> bool:
        self._fut.wait()  # raises the collective's error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def _source_rank(self) -> int:  # dist.recv(src=None) asks the work who sent
        return self._source


def done(result: Any, source: int = -1) -> PyWork:
    """A completed work whose future holds ``result``."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(result)
    return PyWork(fut, source)


#: groups whose thread runs, stopped at exit (see OrderedGroup._stop_thread)
_threaded: weakref.WeakSet[OrderedGroup] = weakref.WeakSet()


def _stop_threads_at_exit() -> None:
    for group in list(_threaded):
        group._stop_thread()


class NamedGroup(_ProcessGroup):  # type: ignore[misc]
    """A Python process group that keeps the name and description torch gives it."""

    # torch names a group through its backends' ids (ProcessGroup::getGroupName), and a Python
    # group has none: without these, ``group.group_name`` raised "ProcessGroup name not set",
    # and so did DeviceMesh, FSDP2 and the functional collectives, which find groups by name
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_group_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "")


class OrderedGroup(NamedGroup):
    """A process group whose collectives run one at a time, in call order (see the module doc)."""

    _thread_name = "onedist-group"

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._lock = threading.Lock()  # guards _pending
        self._exec = threading.Lock()  # held while a collective runs (one at a time)
        self._pending = 0
        #: how many collectives this process started on the group: the stall check's call number
        #: for plain torch.distributed calls (torch numbers only its C++ groups' calls)
        self.collectives = 0
        self._queue: Optional[queue.SimpleQueue[Any]] = None
        self._thread: Optional[threading.Thread] = None

    # the coalesced forms (FSDP, DTensor and the functional collectives call them from C++,
    # where a Python group without them failed with "No backend type associated with device
    # type cpu"): each pair in call order, one Work over them all
    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._each(self.all_gather_single, outputs, inputs, opts)

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._each(self.reduce_scatter_single, outputs, inputs, opts)

    # torch's names for them before 2.13
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _each(self, call: Callable[..., Any], outputs: Any, inputs: Any, opts: Any) -> PyWork:
        if len(outputs) != len(inputs):
            raise ValueError(
                f"onedist {self.getBackendName()}: {len(outputs)} output tensors for {len(inputs)} inputs; "
                "a coalesced collective takes one output per input"
            )
        works = [call(o, i, opts) for o, i in zip(outputs, inputs)]
        return PyWork(torch.futures.collect_all([w.get_future() for w in works]))

    def _execute(self, job: Callable[[], Any]) -> Any:
        """Run one queued job on the group's thread (a subclass adds its failure handling)."""
        return job()

    def _run(self, job: Callable[[], Any], inputs: list[torch.Tensor], result: Any) -> Any:
        """Run ``job`` in call order: inline when nothing is queued and it is small, else queued."""
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        with self._lock:
            self.collectives += 1
            inline = nbytes < ASYNC_BYTES and self._pending == 0
            if inline:
                self._exec.acquire()  # the thread is idle (pending 0): this cannot wait long
            else:
                self._pending += 1
        if inline:
            try:
                with torch.no_grad():  # data movement, as c10d's: tensors that require grad too
                    job()
            finally:
                self._exec.release()
            return done(result)
        fut: torch.futures.Future[Any] = torch.futures.Future()
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, name=self._thread_name, daemon=True)
            self._thread.start()
            if not _threaded:
                atexit.unregister(_stop_threads_at_exit)  # once, however many groups come and go
                atexit.register(_stop_threads_at_exit)
            _threaded.add(self)
        self._queue.put((job, result, fut))
        return PyWork(fut)

    def _serve(self) -> None:
        q = self._queue
        assert q is not None
        while True:
            item = q.get()
            if item is None:
                return
            job, result, fut = item
            error: Optional[BaseException] = None
            with self._exec, torch.no_grad():  # grad mode is per thread: off here too
                try:
                    self._execute(job)
                except BaseException as e:
                    error = e
            with self._lock:
                self._pending -= 1
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            # let go of the job's tensors now: bound until the next q.get() returned, a 128 MB
            # result lived on after its caller dropped it, and its free (~30 ms) landed in the
            # next collective the thread ran (a 16 MB all_to_all after onedist's all_gather:
            # 2.5-3x as long, 8 ranks on 2 cores)
            del item, job, result, fut, error

    def _stop_thread(self, timeout: float = 10.0) -> None:
        """Stop the group's thread once its queued jobs are done, and wait for it (up to
        ``timeout`` s). Called by ``shutdown()`` and, for a program that never destroys its
        groups, at exit: Python kills a daemon thread that is in torch's C++ code when the
        interpreter finalizes (completing a future, or destroying the group it holds), which
        aborts the process ("terminate called without an active exception")."""
        _threaded.discard(self)
        if self._queue is not None:
            self._queue.put(None)
            self._queue = None
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def for_each(fn: Callable[..., None], *columns: list[Any]) -> None:
    """``fn`` on each row of the columns (the tensors of a multi-tensor collective)."""
    for args in zip(*columns):
        fn(*args)


def opts_or(cls: Any, opts: Any) -> Any:
    """``opts``, or the default options of type ``cls`` when torch passed none."""
    return opts if opts is not None else cls()


def all_cpu(tensors: list[torch.Tensor]) -> bool:
    """True when every tensor is a dense CPU tensor."""
    return all(t.device.type == "cpu" and not t.is_sparse for t in tensors)


def flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A flat view of ``t`` with stride 1, or a flat copy (then True: copy the result back)."""
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        view = t.view(-1)
        if view.numel() <= 1 and view.stride(0) != 1:  # "contiguous" x[i::2][:1]: stride 2
            view = view.as_strided((view.numel(),), (1,))
        return view, False
    return t.contiguous().resolve_conj().resolve_neg().view(-1), True


def averages(op: Any) -> bool:
    """True for ``ReduceOp.AVG`` (its RedOpType, or options holding it): neither shm's kernels nor
    MPI average, so both reduce it as SUM and divide by the group size."""
    return bool(getattr(op, "op", op) == dist.ReduceOp.AVG)


def op_name(op: Any) -> str:
    """``"SUM"`` for ``ReduceOp.SUM``, its RedOpType or the options' ``reduceOp``."""
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1]


class ArgCheck:
    """Argument checks of a collective ``call`` on a group of ``size`` ranks, made on every rank
    before anything moves: each raises ``ValueError("onedist <backend>: <call>: ...")`` naming
    the argument, its value and what it needs. Without them a wrong size reads or writes past a
    tensor's part (or hangs a peer) instead of failing.

    >>> ArgCheck("shm", "broadcast", 2).root(1)
    >>> ArgCheck("shm", "broadcast", 2).root(5)
    Traceback (most recent call last):
    ValueError: onedist shm: broadcast: root rank 5 is not in the group (its ranks are 0 to 1)
    """

    def __init__(self, backend: str, call: str, size: int) -> None:
        self.backend, self.call, self.size = backend, call, size

    def fail(self, what: str) -> ValueError:
        return ValueError(f"onedist {self.backend}: {self.call}: {what}")

    def at_root(
        self,
        root: int,
        rank: int,
        lists: Sequence[Sequence[torch.Tensor]],
        tensors: Sequence[torch.Tensor],
        kind: str,
    ) -> Optional[ValueError]:
        """Check ``root`` (raises on every rank); then, on the root, return what is wrong with its
        ``kind`` lists (a gather's outputs, a scatter's inputs), else None. Only the root can
        check them, and raising at once would leave the others waiting for it: the caller takes
        its part first, or tells the others (see :meth:`refused`)."""
        self.root(root)
        if rank != root:
            return None
        try:
            self.per_rank(lists, tensors, kind)
        except ValueError as e:
            return e
        return None

    def refused(self, root: int) -> ValueError:
        """What the other ranks raise when the root of a scatter refused its arguments."""
        return self.fail(f"the root, rank {root}, refused its arguments (its own error says why)")

    def root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise self.fail(f"root rank {root} is not in the group (its ranks are 0 to {self.size - 1})")

    def lists(self, lists: Sequence[Any], tensors: Sequence[torch.Tensor], kind: str) -> None:
        """One ``kind`` list per tensor of the other side."""
        if len(lists) != len(tensors):
            raise self.fail(f"{len(lists)} {kind} lists for {len(tensors)} tensors; one per tensor is needed")

    def per_rank(
        self, lists: Sequence[Sequence[torch.Tensor]], tensors: Sequence[torch.Tensor], kind: str
    ) -> None:
        """For each of ``tensors``, a ``kind`` list of one tensor per rank like it (all_gather's
        outputs, reduce_scatter's and scatter's inputs, gather's outputs)."""
        self.lists(lists, tensors, kind)
        for parts, like in zip(lists, tensors):
            self.parts(parts, like, kind)

    def parts(self, parts: Sequence[torch.Tensor], like: torch.Tensor, kind: str) -> None:
        """``parts`` (the ``kind`` list): one tensor per rank, each with ``like``'s dtype and
        number of elements."""
        self.count(parts, kind)
        other = "input" if kind == "output" else "output"
        for i, t in enumerate(parts):
            if t.dtype != like.dtype or t.numel() != like.numel():
                raise self.fail(
                    f"{kind} tensor {i} is {t.dtype} with {t.numel()} elements; it needs {like.dtype} with "
                    f"{like.numel()}, like the {other}"
                )

    def count(self, tensors: Sequence[torch.Tensor], kind: str) -> None:
        """One ``kind`` tensor per rank."""
        if len(tensors) != self.size:
            raise self.fail(
                f"the {kind} list has {len(tensors)} tensors; it needs one per rank ({self.size})"
            )

    def splits(self, t: torch.Tensor, splits: Sequence[int], kind: str) -> None:
        """``splits`` of ``t``'s first dimension, one per rank (empty: equal parts)."""
        rows = t.shape[0] if t.dim() else t.numel()
        if not splits:
            if rows % self.size:
                raise self.fail(
                    f"the {kind} tensor's first dimension ({rows}) does not split into world size "
                    f"({self.size}) equal parts; pass {kind}_split_sizes"
                )
            return
        if len(splits) != self.size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise self.fail(
                f"{kind}_split_sizes={list(splits)} is not allowed; it needs {self.size} sizes (one per "
                f"rank), none negative, that add up to the {kind} tensor's first dimension ({rows})"
            )

    def whole(self, whole: torch.Tensor, part: torch.Tensor, kind: str) -> None:
        """``whole`` (the ``kind`` tensor) holds one ``part`` per rank: ``size`` times its elements."""
        need = self.size * part.numel()
        if whole.dtype != part.dtype or whole.numel() != need:
            raise self.fail(
                f"the {kind} tensor is {whole.dtype} with {whole.numel()} elements; it needs {part.dtype} "
                f"with world size ({self.size}) x {part.numel()} = {need}"
            )
