"""Make ``import ignite.distributed`` give onedist, for code that cannot be edited.

A user switching from ignite changes one import. Code nobody here can edit (ignite's own test
suite, ignite's ``Engine`` and metrics, which ``import ignite.distributed as idist``) gets the
same switch from :func:`install`: ignite's public modules ``ignite.distributed``, ``.utils``,
``.auto`` and ``.launcher`` become modules whose names are onedist's, while every other module of
ignite (``comp_models``, ``engine``, ``metrics``) still loads from ignite's own files.

To give every worker and subprocess the switch, have each interpreter call
:func:`install_if_asked` at start-up, e.g. from a ``.pth`` file in site-packages (a line that
starts with ``import`` runs at every start), and set ``ONEDIST_AS_IGNITE=1``; the runner of
ignite's suite, ``tests/foreign/ignite_suite.py``, does so for its run. onedist never installs
it by itself.

Example:
    >>> import sys
    >>> from onedist import ignite_alias
    >>> ignite_alias.ALIASED[0]
    'ignite.distributed'
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Optional

__all__ = ["ALIASED", "ENV_VAR", "install", "install_if_asked", "installed"]

ALIASED = (
    "ignite.distributed",
    "ignite.distributed.auto",
    "ignite.distributed.launcher",
    "ignite.distributed.utils",
)
ENV_VAR = "ONEDIST_AS_IGNITE"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ignite's aliased modules where ignite has them and fills them with onedist's names."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in ALIASED:
            return None
        # ignite's own spec gives the package its real __path__, so that comp_models & co. load
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=real.origin)
        spec.submodule_search_locations = real.submodule_search_locations
        return spec

    def exec_module(self, module: ModuleType) -> None:
        import onedist

        for name in onedist.__all__:
            setattr(module, name, getattr(onedist, name))
        module.__dict__["__all__"] = list(onedist.__all__)
        module.__dict__.update(_fixture_names())
        if module.__name__ == "ignite.distributed":
            # what ignite's package namespace also holds: its submodules and computation models
            from ignite.distributed import auto, launcher, utils  # noqa: F401  (sets attributes)
            from ignite.distributed.comp_models import native, registered_computation_models, xla

            extra = {
                "native": native,
                "xla": xla,
                "registered_computation_models": registered_computation_models,
            }
            module.__dict__.update(extra)


def _rank_not_in_group(group: Any) -> bool:
    """ignite's private helper, which ignite's tests import: whether this rank is outside ``group``
    (None: the whole world; a list of ranks; a torch group)."""
    import onedist

    if group is None:
        return False
    if isinstance(group, (list, tuple)):
        return onedist.get_rank() not in group
    from onedist.context import current

    # the backend's own answer: a torch group, a Horovod process set, an XLA replica list
    return current().group_rank(group) < 0


class _ModelView:
    """What ``ignite.distributed.utils._model`` answers in ignite's tests, read from onedist's
    active backend each time (ignite's tests import it inside the function they check)."""

    def __init__(self) -> None:
        from onedist.context import current

        self._backend = current()
        self.name = self._backend.model_name
        #: the init_method the backend was initialised with (None: made outside onedist)
        self._init_method = getattr(self._backend, "init_method", None)

    def __getattr__(self, name: str) -> Any:
        import onedist

        if name in _QUERIES:
            return getattr(onedist, name)
        raise AttributeError(f"onedist has no equivalent of ignite's private _model.{name}")

    def _get_max_length(self, x: str, device: Any = None) -> int:
        """The longest ``len(x)`` over the ranks (ignite's tests call this helper of ``_model``)."""
        import torch

        import onedist

        size = torch.tensor([len(x)], device=device)
        return int(onedist.all_reduce(size, op="MAX").item())

    def __repr__(self) -> str:
        return f"<onedist backend {self.name!r} seen as ignite's _model>"


_QUERIES = frozenset(
    {"get_rank", "get_local_rank", "get_world_size", "get_nproc_per_node", "get_nnodes", "get_node_rank"}
    | {"device", "backend"}
)


def _module_getattr(name: str) -> Any:
    if name == "_model":
        return _ModelView()
    raise AttributeError(name)


def _fixture_names() -> dict[str, Any]:
    """ignite's private names that ignite's test fixtures call around their own
    ``dist.init_process_group``/``destroy_process_group``. onedist notices a context made or
    destroyed outside it by itself, so resetting to ignite's serial model is a re-detection."""
    from ignite.distributed.comp_models.base import _SerialModel

    import onedist

    def _set_model(model: Any, temporary: bool = False) -> None:
        onedist.sync()

    return {
        "_SerialModel": _SerialModel,
        "_set_model": _set_model,
        "_rank_not_in_group": _rank_not_in_group,
        "__getattr__": _module_getattr,
    }


_FINDER = _Finder()


def install() -> None:
    """Resolve ignite's public distributed modules to onedist in this process (idempotent).

    Call it before anything imports ``ignite``; modules already imported are left as they are.

    Example (in a fresh process: the alias stays for the process's life)::

        from onedist import ignite_alias
        ignite_alias.install()
        import ignite.distributed as idist
        idist.all_reduce is __import__("onedist").all_reduce    # True
    """
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def installed() -> bool:
    """Whether :func:`install` ran in this process.

    Example:
        >>> from onedist import ignite_alias
        >>> isinstance(ignite_alias.installed(), bool)
        True
    """
    return _FINDER in sys.meta_path


def install_if_asked(environ: Any = os.environ) -> None:
    """:func:`install` when ``ONEDIST_AS_IGNITE=1`` in ``environ`` (what a ``sitecustomize`` calls).

    Example:
        >>> from onedist import ignite_alias
        >>> ignite_alias.install_if_asked({"ONEDIST_AS_IGNITE": "0"})   # not asked: nothing changes
    """
    if environ.get(ENV_VAR) == "1":
        install()
