"""The registry: backend name -> the class that implements it, imported on first use.

Each backend module may import its library (horovod, torch_xla) only inside its methods, so
importing the registry never imports them.
"""

from __future__ import annotations

import importlib
from functools import cache

from .interface import Backend

# name -> (module, class), in the order available_backends() lists their names
_REGISTRY: dict[str, tuple[str, str]] = {
    "native": ("onedist.backends.native", "NativeBackend"),
    "horovod": ("onedist.backends.horovod", "HorovodBackend"),
    "xla-tpu": ("onedist.backends.xla", "XlaBackend"),
}
# detection asks torch.distributed last: Horovod and XLA programs may create a torch process
# group of their own beside the context that defines them
_DETECT_LAST = "native"


@cache
def backend_classes() -> tuple[type[Backend], ...]:
    """The registered backend classes (not the serial one), imported on first use."""
    classes = []
    for module_name, class_name in _REGISTRY.values():
        module = importlib.import_module(module_name)
        classes.append(getattr(module, class_name))
    return tuple(classes)


def available_backends() -> tuple[str, ...]:
    """Every backend name that can be initialised on this machine."""
    names: list[str] = []
    for cls in backend_classes():
        names.extend(cls.available_backends())
    return tuple(names)


def class_for_backend(name: str) -> type[Backend] | None:
    """The class that initialises backend ``name``, or None when no installed class can."""
    for cls in backend_classes():
        if name in cls.available_backends():
            return cls
    return None


def external_context_active() -> bool:
    """True when some backend reports a context created outside onedist (cheap, no collective)."""
    return any(cls.context_active() for cls in detection_order())


def detection_order() -> list[type[Backend]]:
    last = importlib.import_module(_REGISTRY[_DETECT_LAST][0])
    return sorted(backend_classes(), key=lambda cls: cls.__module__ == last.__name__)
