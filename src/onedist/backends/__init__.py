"""Backends: how processes communicate (one class per library, see ``registry.py``), and detection.

Order matters for detection of a context created outside onedist: the first class whose
:meth:`~onedist.backends.interface.Backend.context_active` is true wins, torch.distributed's last.
"""

from __future__ import annotations

from ._rendezvous import announce_init_failure
from .interface import Backend, Layout, Work
from .registry import (
    available_backends,
    backend_classes,
    class_for_backend,
    detection_order,
    external_context_active,
)
from .serial import SerialBackend

__all__ = [
    "Backend",
    "Layout",
    "SerialBackend",
    "Work",
    "announce_init_failure",
    "available_backends",
    "backend_classes",
    "class_for_backend",
    "detect_backend",
    "external_context_active",
]


def detect_backend() -> Backend:
    """Wrap the context created outside onedist, or return the serial backend."""
    for cls in detection_order():
        if cls.context_active():
            backend = cls.create_from_context()
            if backend is not None:
                return backend
    return SerialBackend()
