"""Point to point: :func:`send`, :func:`recv`, :func:`isend`, :func:`irecv`, of tensors or any object."""

from __future__ import annotations

import pickle
from typing import Any, Optional

import torch

from ..context import current
from ..errors import bad_type, bad_value
from .base import CPU, U8, AsyncResult, GroupLike, check_peer, resolve_group


# ============================================================================ point to point
def send(tensor: Any, dst: int, group: GroupLike = None, tag: int = 0) -> None:
    """Send a tensor or any picklable object to global rank ``dst`` (blocking).

    The receiver calls :func:`recv` with a tensor of the same shape and dtype for a tensor, or
    without one for an object.

    Example:
        >>> import onedist as od
        >>> def handover(local_rank):
        ...     if od.get_rank() == 0:
        ...         od.send({"step": 10}, dst=1)
        ...     else:
        ...         return od.recv(src=0)
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", handover, nproc_per_node=2, start_method="fork"))
        [None, {'step': 10}]
    """
    b = current()
    g, _, ranks = resolve_group("send", b, group)
    check_peer("send", "dst", dst, b, ranks)
    if dst == b.rank:
        raise bad_value("send", "dst", dst, "a rank other than this process's own")
    if isinstance(tensor, torch.Tensor):
        dev = b.comm_device(tensor.device, "send")
        buf = tensor if (tensor.device == dev and tensor.is_contiguous()) else tensor.to(dev).contiguous()
        b.send_(buf, dst, g, tag, False)
        return
    try:
        data = pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise bad_type(
            "send", "tensor", tensor, "a tensor or a picklable object", hint=f"pickling failed: {e}"
        ) from e
    dev = b.comm_device(CPU, "send")
    og = b.object_group(g)
    b.send_(torch.tensor([len(data)], dtype=torch.int64, device=dev), dst, og, tag, False)
    b.send_(torch.frombuffer(bytearray(data), dtype=U8).to(dev), dst, og, tag, False)


def recv(
    tensor: Optional[torch.Tensor] = None, src: Optional[int] = None, group: GroupLike = None, tag: int = 0
) -> Any:
    """Receive what :func:`send` sent.

    Args:
        tensor: for a tensor, the buffer to receive into (filled in place and returned); None to
            receive an object.
        src: global rank to receive from; None for any rank.
        group: None, a list of global ranks, or a group handle.
        tag: matches the sender's tag.

    Returns:
        The filled ``tensor``, or the received object.

    Example:
        >>> import torch
        >>> import onedist as od
        >>> def handover(local_rank):
        ...     if od.get_rank() == 0:
        ...         od.send(torch.arange(3.0), dst=1)
        ...     else:
        ...         return od.recv(torch.empty(3), src=0).tolist()
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", handover, nproc_per_node=2, start_method="fork"))
        [None, [0.0, 1.0, 2.0]]
    """
    b = current()
    g, _, ranks = resolve_group("recv", b, group)
    if src is not None:
        check_peer("recv", "src", src, b, ranks)
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise bad_type("recv", "tensor", tensor, "a tensor to receive into, or None to receive an object")
    if tensor is not None:
        dev = b.comm_device(tensor.device, "recv")
        direct = tensor.device == dev and tensor.is_contiguous()
        buf = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype, device=dev)
        b.recv_(buf, src, g, tag, False)
        if not direct:
            tensor.copy_(buf)
        return tensor
    dev = b.comm_device(CPU, "recv")
    og = b.object_group(g)
    n = torch.empty(1, dtype=torch.int64, device=dev)
    sender = b.recv_(n, src, og, tag, False)
    data = torch.empty(int(n.item()), dtype=U8, device=dev)
    b.recv_(data, src if src is not None else int(sender), og, tag, False)
    return pickle.loads(bytes(data.cpu().numpy()))


def isend(tensor: torch.Tensor, dst: int, group: GroupLike = None, tag: int = 0) -> AsyncResult:
    """Start sending a tensor to global rank ``dst``; ``.wait()`` on the result.

    Example:
        >>> import torch
        >>> import onedist as od
        >>> def exchange(local_rank):
        ...     peer = 1 - od.get_rank()
        ...     sending = od.isend(torch.full((2,), float(od.get_rank())), dst=peer)
        ...     received = od.irecv(torch.empty(2), src=peer)       # both in flight at once
        ...     sending.wait()
        ...     return received.wait().tolist()
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", exchange, nproc_per_node=2, start_method="fork"))
        [[1.0, 1.0], [0.0, 0.0]]
    """
    b = current()
    g, _, ranks = resolve_group("isend", b, group)
    check_peer("isend", "dst", dst, b, ranks)
    if not isinstance(tensor, torch.Tensor):
        raise bad_type("isend", "tensor", tensor, "a tensor (use send for objects)")
    dev = b.comm_device(tensor.device, "send")
    buf = tensor if (tensor.device == dev and tensor.is_contiguous()) else tensor.to(dev).contiguous()
    work = b.send_(buf, dst, g, tag, True)
    return AsyncResult([work], lambda: None)


def irecv(
    tensor: torch.Tensor, src: Optional[int] = None, group: GroupLike = None, tag: int = 0
) -> AsyncResult:
    """Start receiving into ``tensor``; ``.wait()`` returns the filled tensor.

    Example:
        >>> import torch
        >>> import onedist as od
        >>> def receive(local_rank):
        ...     if od.get_rank() == 0:
        ...         od.isend(torch.ones(2), dst=1).wait()
        ...     else:
        ...         return od.irecv(torch.empty(2), src=0).wait().tolist()
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", receive, nproc_per_node=2, start_method="fork"))
        [None, [1.0, 1.0]]
    """
    b = current()
    g, _, ranks = resolve_group("irecv", b, group)
    if src is not None:
        check_peer("irecv", "src", src, b, ranks)
    if not isinstance(tensor, torch.Tensor):
        raise bad_type("irecv", "tensor", tensor, "a tensor to receive into")
    dev = b.comm_device(tensor.device, "recv")
    direct = tensor.device == dev and tensor.is_contiguous()
    buf = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype, device=dev)
    work = b.recv_(buf, src, g, tag, True)

    def finish() -> torch.Tensor:
        if not direct:
            tensor.copy_(buf)
        return tensor

    return AsyncResult([work], finish)
