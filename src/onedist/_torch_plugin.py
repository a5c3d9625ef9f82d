"""onedist's process groups by name in any torch program: ``dist.init_process_group("shm")``.

:func:`register_torch_backends` is the one place that registers onedist's Python process groups
with ``torch.distributed``: ``"shm"`` (:mod:`onedist.backends.shm`) and ``"mpi4py"``
(:mod:`onedist.backends.mpi`; ``"mpi"`` is torch's built-in name, which torch serves only in
builds compiled against MPI, whatever is registered under it, so onedist never takes it).
``onedist.initialize`` calls it, and torch calls :func:`autoload` on every ``import torch``
through the ``torch.backends`` entry point in ``pyproject.toml`` (torch's plugin loading for
out-of-tree backends, ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off), so a plain torch script,
Lightning's ``DDPStrategy(process_group_backend="shm")`` or Accelerate's
``InitProcessGroupKwargs(backend="shm")`` find the names with onedist merely installed.

Because it runs inside every ``import torch`` on the machine, registering must cost next to
nothing: this module imports nothing of onedist's but the package root (which imports no torch)
and names the modules that build the groups as strings, as :mod:`onedist.backends.registry`
does, so they are imported when a group is created, never before (about 1 ms at ``import
torch`` against 20 ms for ``onedist.backends``, see docs/backends.md).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

#: torch name -> (module that builds the group, its constructor, whether torch passes the extended
#: options: the mpi4py group needs the group's global ranks to build its communicator)
_GROUPS: dict[str, tuple[str, str, bool]] = {
    "shm": ("onedist.backends.shm.group", "create", False),
    "mpi4py": ("onedist.backends.mpi", "create", True),
}


class _OnFirstGroup:
    """A group constructor that imports its module when torch first calls it (creating a group)."""

    def __init__(self, module: str, function: str) -> None:
        self.module, self.function = module, function

    def __call__(self, *args: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.function)(*args)

    def __repr__(self) -> str:
        return f"{self.module}.{self.function}"


def register_torch_backends() -> tuple[str, ...]:
    """Make onedist's process groups known to ``torch.distributed`` by name; idempotent.

    Returns the names now usable in ``dist.init_process_group`` (none when this torch build has
    no ``torch.distributed``). A name torch already knows is left as it is: a second call, or a
    backend of the same name registered by someone else, changes nothing. Nothing is imported
    until a group is created, and torch's default backend per device stays what it was (gloo
    for CPU). Called at ``import torch`` (see the module doc); call it yourself only where that
    is switched off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).

    Example:
        >>> import torch.distributed as dist
        >>> from onedist import register_torch_backends
        >>> register_torch_backends()
        ('shm', 'mpi4py')
        >>> "shm" in dist.Backend.backend_list, dist.Backend.default_device_backend_map["cpu"]
        (True, 'gloo')
    """
    import torch.distributed as dist

    if not dist.is_available():
        return ()
    for name, (module, function, extended_api) in _GROUPS.items():
        if name not in dist.Backend.backend_list:
            # CPU only: shm and MPI move host memory; CUDA tensors stay on nccl's side
            dist.Backend.register_backend(
                name, _OnFirstGroup(module, function), extended_api=extended_api, devices=["cpu"]
            )
    return tuple(_GROUPS)


def autoload() -> None:
    """torch's ``torch.backends`` entry point: :func:`register_torch_backends` at ``import torch``.

    torch turns an exception here into a failed ``import torch`` for every program on the
    machine; a failure to register (an unusual torch) is therefore only a warning, and
    ``onedist.initialize`` tries again where it matters.

    Example:
        >>> import torch.distributed as dist
        >>> from onedist._torch_plugin import autoload
        >>> autoload()
        >>> "mpi4py" in dist.Backend.backend_list
        True
    """
    try:
        register_torch_backends()
    except Exception as e:  # see the docstring: never break `import torch`
        warnings.warn(f"onedist could not register its torch.distributed backends: {e!r}", stacklevel=2)
