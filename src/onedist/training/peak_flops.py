"""``od.peak_flops``: the dense peak FLOP/s of common GPUs, for :class:`onedist.Throughput`'s utilisation.

The numbers are the vendors' datasheet figures without sparsity (the datasheets print the
structured-sparsity figure, twice the dense one, for tensor cores). float32 matmuls count at the
TF32 tensor-core peak when torch allows TF32 for them (``torch.backends.cuda.matmul.allow_tf32``),
else at the plain float32 peak. A device that is not in the table (a CPU, another GPU) has no
known peak: None, and the utilisation is then None too; pass ``peak_flops=`` to
:class:`onedist.Throughput` for it.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..errors import bad_type

__all__ = ["peak_flops"]

# name fragment of torch.cuda.get_device_name() -> (float32, tf32, bfloat16, float16), dense, FLOP/s.
# The first fragment found in the name wins: the more specific ones come first.
_GPUS: tuple[tuple[str, tuple[float, Optional[float], Optional[float], float]], ...] = (
    ("H200", (67e12, 494.7e12, 989.4e12, 989.4e12)),
    ("H100 PCIe", (51e12, 378e12, 756e12, 756e12)),
    ("H100", (67e12, 494.7e12, 989.4e12, 989.4e12)),  # SXM5 ("H100 80GB HBM3")
    ("A100", (19.5e12, 156e12, 312e12, 312e12)),
    ("L40S", (91.6e12, 183e12, 362e12, 362e12)),
    ("L4", (30.3e12, 60e12, 121e12, 121e12)),
    ("V100", (15.7e12, None, None, 125e12)),
    ("T4", (8.1e12, None, None, 65e12)),
)


def peak_flops(
    device: Union[torch.device, str, None] = None, dtype: torch.dtype = torch.float32
) -> Optional[float]:
    """The dense peak FLOP/s of one ``device`` computing in ``dtype``; None when not known.

    Args:
        device: a CUDA device (None: :func:`onedist.device`). A CPU gives None.
        dtype: ``torch.float32`` (TF32's peak when torch allows TF32 matmuls), ``torch.bfloat16``
            or ``torch.float16``; another dtype gives None.

    Example:
        >>> import torch, onedist as od
        >>> od.peak_flops("cpu") is None
        True
    """
    from ..context import device as current_device

    if not isinstance(device, (torch.device, str, type(None))):
        raise bad_type("peak_flops", "device", device, "None, a torch.device or a device string")
    if not isinstance(dtype, torch.dtype):
        raise bad_type("peak_flops", "dtype", dtype, "a torch.dtype (torch.float32, torch.bfloat16, ...)")
    where = torch.device(device) if device is not None else current_device()
    if where.type != "cuda" or not torch.cuda.is_available():
        return None
    return table_peak(torch.cuda.get_device_name(where), dtype, torch.backends.cuda.matmul.allow_tf32)


def table_peak(name: str, dtype: torch.dtype, tf32: bool) -> Optional[float]:
    """The table's peak for a GPU named ``name`` (as ``torch.cuda.get_device_name`` gives it)."""
    for fragment, (fp32, tf32_peak, bf16, fp16) in _GPUS:
        if fragment in name:
            if dtype == torch.float32:
                return tf32_peak if tf32 and tf32_peak is not None else fp32
            return {torch.bfloat16: bf16, torch.float16: fp16}.get(dtype)
    return None
