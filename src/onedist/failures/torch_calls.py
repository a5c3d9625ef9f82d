"""Plain ``torch.distributed`` collectives seen from the failure watcher, for the stall check.

A script may call ``dist.all_reduce`` itself on the group onedist initialised; onedist's guard
never sees such a call. The watcher looks instead: once a second it takes the main thread's Python
stack (``sys._current_frames``, no cost to the main thread) and finds the outermost frame of a
public collective in ``torch/distributed/distributed_c10d.py``. The process group numbers its own
collectives (``_get_sequence_number_for_group``, counted by gloo and NCCL alike; onedist's Python
groups, mpi4py's and shm's, count theirs in ``collectives``), and that number orders the ranks'
calls as onedist's count orders its own. Point-to-point calls are left out
(a send and its receive carry different numbers on their two ranks), as are asynchronous calls
waited on later (``work.wait()`` has no Python frame to find).
"""

from __future__ import annotations

import json
import os
import sys
from types import FrameType
from typing import Any, Optional

from ..errors import user_frame

__all__ = ["TorchCall", "torch_call"]

_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "gather",
        "gather_object",
        "broadcast",
        "broadcast_object_list",
        "scatter",
        "scatter_object_list",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
    }
)
# the arguments that make two ranks' calls the same call (the values: by type, dtype and shape)
_SCALARS = ("op", "src", "dst", "group_src", "group_dst")
_VALUES = (
    "tensor",
    "tensor_list",
    "output_tensor_list",
    "input_tensor_list",
    "output_tensor",
    "input_tensor",
    "output",
    "input",
    "scatter_list",
    "gather_list",
    "object_list",
)


class TorchCall:
    """The plain collective the main thread is in, as one sample saw it: which frame (its identity,
    not the frame), group and number, and what the ranks compare, taken at once. The frame is not
    kept: a frame holds its callers' frames and every local of theirs (a checkpoint's mapped
    tensors, a batch), which would then live until the next sample, a second after the call."""

    __slots__ = ("args", "frame_id", "group", "name", "seq", "site")

    def __init__(self, frame: FrameType, group: Any, seq: int) -> None:
        self.frame_id, self.group, self.seq = id(frame), group, seq
        local = frame.f_locals
        self.name = frame.f_code.co_name
        self.args = {k: _text(local[k]) for k in _SCALARS if local.get(k) is not None}
        self.args.update({k: _text(local[k]) for k in _VALUES if k in local})
        self.site = _site(frame)

    def same(self, other: Any) -> bool:
        """The same call: the same frame (alive while the call runs) of the same group's call."""
        return (
            isinstance(other, TorchCall)
            and other.frame_id == self.frame_id
            and other.group is self.group
            and other.seq == self.seq
        )

    def describe(self) -> dict[str, Any]:
        """What the ranks compare, as :func:`onedist.collectives.debug.describe_call` gives it."""
        import torch.distributed as dist

        shown = ", ".join(f"{k}={v}" for k, v in self.args.items())[:300]
        sig = json.dumps({"call": self.name, **self.args}, sort_keys=True)
        ranks = dist.get_process_group_ranks(self.group)
        default = self.group is dist.distributed_c10d._get_default_group()
        where = {"group": ranks, "default": default}
        return {"call": f"torch.distributed.{self.name}({shown})", "site": self.site, "sig": sig, **where}


def torch_call(main_ident: int) -> Optional[TorchCall]:
    """The plain ``torch.distributed`` collective the main thread waits in, or None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return None
    frame = sys._current_frames().get(main_ident)
    outer = None
    while frame is not None:  # the outermost: all_gather_object runs all_gather inside
        code = frame.f_code
        if code.co_name in _COLLECTIVES and code.co_filename.endswith(_C10D):
            outer = frame
        frame = frame.f_back
    if outer is None:
        return None
    try:
        group = outer.f_locals.get("group") or dist.distributed_c10d._get_default_group()
        # torch numbers its C++ groups' calls; onedist's Python groups (mpi4py, shm) count their own
        counted = getattr(group, "collectives", None)
        seq = int(group._get_sequence_number_for_group() if counted is None else counted)
        return TorchCall(outer, group, seq)
    except Exception:  # a backend that does not number its calls (another Python process group)
        return None


def _text(value: Any) -> str:
    """A value as the ranks compare it: a tensor by dtype and shape, a list item by item."""
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        items = [_text(v) for v in value[:8]]
        return "[" + ", ".join(items) + (", ..." if len(value) > 8 else "") + "]"
    if hasattr(value, "name") and not isinstance(value, str):  # ReduceOp's RedOpType
        return str(value.name)
    if isinstance(value, (int, float, str, bool)):
        return repr(value)
    return type(value).__name__


def _site(frame: Optional[FrameType]) -> str:
    """``file:line`` of the first frame outside torch and onedist that led to the call."""
    torch_dir = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__ or "")) + os.sep
    user = user_frame(frame, torch_dir)
    return "<unknown>" if user is None else f"{os.path.basename(user.f_code.co_filename)}:{user.f_lineno}"
