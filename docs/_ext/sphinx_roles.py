"""Griffe extension for the docs build: onedist's docstrings are written for ``help()`` and Sphinx
habits; this turns them into what mkdocstrings renders well.

* ``:func:`onedist.device``` and the other Sphinx roles become links to the API reference for
  public names (``[`device()`][onedist.context.device]``) and code spans for the rest;
* an ``Example:`` section title becomes ``Examples:``, the Google-style section whose ``>>>``
  lines griffe renders as code.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(func|class|meth|attr|exc|mod|data):`~?([^`]+)`")
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


def _public_targets() -> dict[str, str]:
    """Public name -> the path its reference entry is rendered under (module where it is defined)."""
    import onedist

    targets = {}
    for name in onedist.__all__:
        obj = getattr(onedist, name, None)
        module = getattr(obj, "__module__", None)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and module and module.startswith("onedist"):
            targets[name] = f"{module}.{obj.__name__}"
    return targets


class SphinxRoles(griffe.Extension):
    def __init__(self) -> None:
        super().__init__()
        self._targets = _public_targets()

    def _link(self, match: re.Match[str]) -> str:
        role, name = match.group(1), match.group(2)
        short = name.rsplit(".", 1)[-1]
        text = f"`{short}()`" if role in ("func", "meth") else f"`{short}`"
        if role in ("func", "class", "exc") and short in self._targets:
            return f"[{text}][{self._targets[short]}]"
        return text

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        doc = getattr(obj, "docstring", None)
        if doc is not None and doc.value:
            doc.value = _EXAMPLE.sub(r"\1Examples:", _ROLE.sub(self._link, doc.value))
