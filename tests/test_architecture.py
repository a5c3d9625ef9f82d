"""The rules docs/architecture.md states that import-linter does not check (it checks the layers).

Each rule is read from the source tree itself, so a file or function that outgrows it, or a module
the page names that no longer exists, fails here with its name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "onedist"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_source_file_over_800_lines() -> None:
    too_long = {
        str(p.relative_to(PACKAGE)): n
        for p in _sources()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert too_long == {}


def test_no_function_over_80_lines() -> None:
    too_long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    assert too_long == {}


def test_module_names_are_unique_across_layers() -> None:
    """One role, one file name: two ``base.py`` in two layers make ``from .base import`` ambiguous
    to a reader (issue 39); package ``__init__.py`` files are the exception by nature."""
    by_name: dict[str, list[str]] = {}
    for path in _sources():
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}


def _named_paths() -> list[str]:
    """The source paths docs/architecture.md names: ``onedist/x/y.py`` and ``x/`` folders."""
    text = ARCHITECTURE.read_text()
    return sorted(
        set(re.findall(r"\bonedist/[\w/]*\w(?:\.py|/)(?!<)", text))
    )  # not store keys (onedist/x/<rank>)


def test_architecture_page_names_modules() -> None:
    assert len(_named_paths()) > 30  # the page lists the modules; a regex that finds none proves nothing


@pytest.mark.parametrize("named", _named_paths())
def test_every_module_the_architecture_page_names_exists(named: str) -> None:
    assert (PACKAGE.parent / named).exists(), f"docs/architecture.md names {named}, which does not exist"


def test_every_module_is_on_the_architecture_page() -> None:
    named = set(_named_paths())
    missing = [
        str(p.relative_to(PACKAGE.parent))
        for p in _sources()
        if p.name not in ("__init__.py", "__main__.py", "_version.py")
        and str(p.relative_to(PACKAGE.parent)) not in named
    ]
    assert missing == []


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a ``from ... import`` statement in ``package`` reads from."""
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return base


def _imports(path: Path) -> set[str]:
    """The onedist modules ``path`` imports, anywhere in it (function-level imports too)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("onedist")}
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(node, package)
            if base.startswith("onedist"):
                # ``from pkg import sub`` reads the submodule; ``from pkg import name`` the package
                subs = {f"{base}.{a.name}" for a in node.names}
                modules = {s for s in subs if _is_module(s)}
                found |= modules | ({base} if len(modules) < len(subs) else set())
    return found - {module}


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_no_import_circle() -> None:
    """No module reaches itself through the imports of the modules it imports (Tarjan's SCCs)."""
    modules = {}
    for p in _sources():
        name = ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = p
    graph = {m: {i for i in _imports(p) if i in modules} for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert len(graph) > 60 and sum(map(len, graph.values())) > 150  # the graph is really read
    assert circles == []


def _module_names() -> set[str]:
    """Every module and package of onedist, dotted (``onedist.backends._pygroup``)."""
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in _sources()
    }


def _private_names_imported() -> tuple[list[str], int]:
    """Every ``from X import _name`` in onedist where X is a onedist module (relative or absolute)
    and ``_name`` is not a module (``from . import _gloo_threads`` imports a private module, which
    is fine), as ``file:line: from X import _name``; and how many names from onedist modules were read."""
    modules = _module_names()
    found, read = [], 0
    for path in _sources():
        dotted = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = dotted.removesuffix(".__init__") if path.name == "__init__.py" else dotted.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _from_module(node, package)
            if base != "onedist" and not base.startswith("onedist."):
                continue
            for alias in node.names:
                read += 1
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and f"{base}.{name}" not in modules:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    found.append(f"{where}: from {base} import {name}")
    return found, read


def test_no_underscore_name_imported_across_modules() -> None:
    """A name another module imports is part of the package's inner API: it has a plain name (or
    the two modules are one). Private modules (``_pygroup``) and their public names are fine."""
    found, read = _private_names_imported()
    assert read > 300  # the imports are really read
    assert found == []


def _private_names_read_through_modules() -> list[str]:
    """Every ``module._name`` where ``module`` is a onedist module bound by ``from X import module``
    (``xla_backend._tls``): the same reach into another module's privates as importing the name."""
    modules = _module_names()
    found = []
    for path in _sources():
        dotted = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = dotted.removesuffix(".__init__") if path.name == "__init__.py" else dotted.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        aliases = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
            if f"{_from_module(node, package)}.{alias.name}" in modules
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_underscore_name_read_through_another_module() -> None:
    """launchers/xmp.py reaches backends/xla.py through its public functions (``launched_worker``,
    ``import_torch_xla``, ``device_count_env``), not its ``_tls``."""
    assert _private_names_read_through_modules() == []


def _ways_of_starting() -> list[str]:
    """The launcher modules, as pyproject's independence contract lists them (the one list)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index('name = "Each way of starting is a module of its own') :]
    block = block[block.index("modules = [") : block.index("]")]
    return re.findall(r'"(onedist\.launchers\.\w+)"', block)


@pytest.mark.parametrize("module", _ways_of_starting())
def test_every_way_of_starting_implements_the_launcher_interface(module: str) -> None:
    """Each launcher module defines one concrete ``Launcher`` subclass (Fabric's ``_Launcher`` is
    the model: docs/architecture.md), and no free ``launch`` function beside it."""
    import importlib
    import inspect

    from onedist.launchers.launcher import Launcher

    tree = ast.parse((PACKAGE.parent / (module.replace(".", "/") + ".py")).read_text())
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "launch" for n in tree.body), module
    loaded = importlib.import_module(module)
    classes = [
        c
        for c in vars(loaded).values()
        if inspect.isclass(c) and c.__module__ == module and issubclass(c, Launcher)
    ]
    assert len(classes) == 1, (module, classes)
    assert not inspect.isabstract(classes[0]), classes[0]
    assert isinstance(classes[0].__dict__.get("name"), str), f"{classes[0]} names itself (Launcher.name)"


def test_launchers_are_chosen_by_plain_imports() -> None:
    """No onedist module imported by a string in the launchers (``importlib.import_module``): a
    dispatch the layer contracts cannot see is refused."""
    found = []
    for path in sorted((PACKAGE / "launchers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            if getattr(node.func, "attr", getattr(node.func, "id", "")) not in (
                "import_module",
                "__import__",
            ):
                continue
            target = node.args[0]
            named = isinstance(target, ast.Constant) and not str(target.value).startswith(("onedist", "."))
            if not named:  # a computed name, or one of onedist's modules
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
    assert found == []


#: the launch arguments (LaunchSpec's fields that only a launch has)
LAUNCH_ARGUMENTS = frozenset(
    {
        "nproc_per_node",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
        "max_restarts",
        "start_method",
        "hosts",
    }
)
#: conditions that name a launch argument but check what happens at run time, not an argument
RUNTIME_CHECKS = {
    "backends/_rendezvous.py": "initialize: what the environment says about the rendezvous",
    "launchers/nodes.py": "the launchers of several nodes agreeing with each other at run time",
    "launchers/processes.py:_with_start_method": "a notebook's function once CUDA is initialised",
}


def _launch_argument_checks() -> list[str]:
    """Every ``if <condition on a launch argument>: ... raise`` outside launchers/spec.py and
    launchers/run_spec.py (the front ends' checks) and launchers/arguments.py (the declaration
    and its rules), as ``file:function:line``; the :data:`RUNTIME_CHECKS` left out."""
    found = []
    for path in _sources():
        where = str(path.relative_to(PACKAGE))
        if (
            where in ("launchers/spec.py", "launchers/run_spec.py", "launchers/arguments.py")
            or where in RUNTIME_CHECKS
        ):
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if (
                not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                or f"{where}:{fn.name}" in RUNTIME_CHECKS
            ):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.If) or not any(isinstance(n, ast.Raise) for n in ast.walk(node)):
                    continue
                named = {getattr(n, "id", None) or getattr(n, "attr", None) for n in ast.walk(node.test)}
                named |= {n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)}
                if named & LAUNCH_ARGUMENTS:
                    found.append(f"{where}:{fn.name}:{node.lineno}")
    return found


def test_launch_arguments_are_checked_only_in_launch_spec() -> None:
    """spawn, Parallel and `onedist run` check their launch arguments with the functions of
    launchers/spec.py and launchers/run_spec.py (LaunchSpec.build, RunSpec.build and the front
    ends' checks beside them): a condition on one that raises anywhere else is a second validator."""
    assert _launch_argument_checks() == []


# ---------------------------------------------------------------- one declaration of the launch arguments
DECLARATION = "launchers/arguments.py"
#: the modules that take launch arguments from users: each reads them from the declaration
FRONT_ENDS = ("launchers/", "parallel.py", "cli.py")
#: declared names that are everyday words elsewhere too (a dict of a call's "args" and "kwargs", a
#: "backend" key): a listing of them says nothing; their flags still count
EVERYDAY_WORDS = frozenset(
    {"backend", "fn", "args", "kwargs", "timeout", "init_method", "module", "role", "tee", "standalone"}
)


def _declared_words() -> set[str]:
    """The declared arguments' names (but :data:`EVERYDAY_WORDS`) and their long flags."""
    from onedist.launchers.arguments import ARGUMENTS

    names = set(ARGUMENTS) - EVERYDAY_WORDS
    return names | {f for a in ARGUMENTS.values() for f in a.flags if f.startswith("--")}


def _strings_of(node: ast.AST) -> list[str]:
    """The string constants of a literal collection (nested literal collections included; a
    dict's keys only)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings_of(e)]
    if isinstance(node, ast.Dict):
        return [s for k in node.keys if k is not None for s in _strings_of(k)]
    return []


def _listings(tree: ast.Module, words: set[str]) -> list[tuple[int, list[str]]]:
    """``(line, names)`` of each literal collection naming two or more of ``words``, and of each
    ``add_argument`` call with one of them (a flag declared a second time)."""
    found = []
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and id(node) not in inner:
            inner |= {id(n) for n in ast.walk(node) if n is not node}
            named = [s for s in _strings_of(node) if s in words]
            if len(named) >= 2:
                found.append((node.lineno, named))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            named = [s for a in node.args for s in _strings_of(a) if s in words]
            if named:
                found.append((node.lineno, named))
    return found


def _declarations_outside() -> list[str]:
    words = _declared_words()
    found = []
    for path in _sources():
        where = str(path.relative_to(PACKAGE))
        if where == DECLARATION or not where.startswith(FRONT_ENDS):
            continue
        found += [f"{where}:{line}: {named}" for line, named in _listings(ast.parse(path.read_text()), words)]
    return found


def test_launch_arguments_are_declared_only_in_the_declaration() -> None:
    """The launch arguments are listed once, in launchers/arguments.py: a front end that lists two
    of them (a tuple of names, a dict keyed by them, a loop over them) or adds a flag of its own
    for one declares them a second time; it derives them from the declaration instead."""
    assert len(_declared_words()) >= 15  # the declaration is really read
    assert _declarations_outside() == []


def test_the_front_ends_take_the_declared_arguments() -> None:
    """spawn's keywords and defaults, LaunchSpec's fields, RunSpec's, Parallel's keywords and
    ``onedist run``'s flags are the declaration's, in its order."""
    import dataclasses
    import inspect

    import onedist as od
    from onedist.launchers.arguments import ARGUMENTS, LAUNCH_ARGUMENTS
    from onedist.launchers.run import build_parser
    from onedist.launchers.run_spec import RunSpec
    from onedist.launchers.spec import LaunchSpec

    spawn = inspect.signature(od.spawn).parameters
    assert [(p.name, p.default) for p in spawn.values()] == [
        (a.spawn_keyword, inspect.Parameter.empty if a.name in ("backend", "fn") else a.default)
        for a in LAUNCH_ARGUMENTS
    ]
    fields = dataclasses.fields(LaunchSpec)
    assert [(f.name, f.type) for f in fields] == [(a.name, a.type) for a in LAUNCH_ARGUMENTS]
    run_fields = {f.name for f in dataclasses.fields(RunSpec)} - {"command", "run_id"}
    assert all(ARGUMENTS[name].flags for name in run_fields), run_fields
    parallel = list(inspect.signature(od.Parallel).parameters)
    named = [a.name for a in LAUNCH_ARGUMENTS if a.parallel in ("init", "spawn")]
    assert parallel == [*named, "spawn_kwargs"]
    options = {o for action in build_parser()._actions for o in action.option_strings}
    assert {f for a in ARGUMENTS.values() for f in a.flags} <= options


#: ordering comparisons: the bounds a rule puts on a value
_ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _names_in(node: ast.AST) -> set[str]:
    """The names an expression reads: variables, attributes and string subscripts (``v["nnodes"]``)."""
    named = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            named.add(n.id)
        elif isinstance(n, ast.Attribute):
            named.add(n.attr)
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
            named.add(str(n.slice.value))
    return named


def _bounds_checked(tree: ast.Module, names: set[str]) -> list[ast.Compare]:
    """The ordering comparisons on one of ``names`` in the condition of an ``if`` that raises."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(isinstance(n, ast.Raise) for n in ast.walk(node)):
            found += [
                c
                for c in ast.walk(node.test)
                if isinstance(c, ast.Compare)
                and any(isinstance(op, _ORDERINGS) for op in c.ops)
                and _names_in(c) & names
            ]
    return found


def _rule_text(compare: ast.Compare) -> str:
    """A comparison with its variables blanked: ``value >= 1`` and ``count >= 1`` are one rule."""

    class Blank(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            return ast.Name(id="_", ctx=node.ctx)

    return ast.unparse(Blank().visit(ast.parse(ast.unparse(compare), mode="eval")))


def _rules_written_twice() -> list[str]:
    """A bound on a launch argument compared outside the declaration's rules (a rule written a
    second time), and a rule of the declaration written twice."""
    names = {word for word in _declared_words() if not word.startswith("--")}
    found = []
    for path in _sources():
        where = str(path.relative_to(PACKAGE))
        if where != DECLARATION and where not in RUNTIME_CHECKS:
            tree = ast.parse(path.read_text())
            found += [f"{where}:{c.lineno}: {ast.unparse(c)}" for c in _bounds_checked(tree, names)]
    seen: dict[str, int] = {}
    for node in ast.walk(ast.parse((PACKAGE / DECLARATION).read_text())):
        if isinstance(node, ast.Compare) and any(isinstance(op, _ORDERINGS) for op in node.ops):
            text = _rule_text(node)
            if text in seen:
                found.append(f"{DECLARATION}:{node.lineno}: {text} (also line {seen[text]})")
            seen[text] = node.lineno
    return found


def test_each_rule_is_written_once() -> None:
    """Each bound on a launch argument (nproc_per_node >= 1, 0 <= node_rank < nnodes, a port in
    1..65535, a port needed with nnodes > 1, ...) is one function of launchers/arguments.py that
    every front end calls; comparing one anywhere else, or twice there, fails."""
    from onedist.launchers import arguments

    declared = [f for a in arguments.ARGUMENTS.values() for f in (a.rule, *a.ties) if f is not None]
    assert {f.__name__ for f in declared} >= {"at_least_one", "node_rank_below", "in_port_range"}
    assert _rules_written_twice() == []


def _restart_decisions() -> list[str]:
    """Comparisons that read ``max_restarts`` (or ``attempt < ...``-style counts against it)
    anywhere but launcher.py's :func:`restarts_left`."""
    found = []
    for path in _sources():
        where = str(path.relative_to(PACKAGE))
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if where == "launchers/launcher.py" and fn.name == "restarts_left":
                continue
            for c in ast.walk(fn):
                if isinstance(c, ast.Compare) and "max_restarts" in _names_in(c):
                    found.append(f"{where}:{fn.name}:{c.lineno}: {ast.unparse(c)}")
    return found


def test_one_place_decides_whether_to_restart() -> None:
    """Every launcher (one node's, several nodes' agreed, spawn's) restarts on
    launcher.py's :func:`restart_verdict`; a count of attempts compared with ``max_restarts``
    anywhere else is a second decision."""
    assert _restart_decisions() == []


# ---------------------------------------------------------------- who writes state.world
# calls that change a container held in a slot of world (world.routes.clear(), ...)
_MUTATORS = frozenset({"append", "add", "clear", "discard", "extend", "insert", "pop", "popitem", "remove",
                       "setdefault", "update"})  # fmt: skip


def _world_slot(node: ast.AST, aliases: set[str]) -> str | None:
    """The slot of ``world`` that ``node`` (a store target or a mutated value) is, or None."""
    if isinstance(node, ast.Subscript):  # world.routes[key] = ...
        node = node.value
    if not isinstance(node, ast.Attribute):
        return None
    owner = node.value
    if isinstance(owner, ast.Name) and owner.id in aliases:
        return node.attr
    if isinstance(owner, ast.Attribute) and owner.attr == "world":  # state.world.x
        return node.attr
    return None


def _world_writes(tree: ast.Module) -> set[str]:
    """The slots of ``state.world`` a module assigns, augments, deletes or mutates, through the
    name ``world`` or a local alias of it (``w = world``); the World class's own ``__init__``
    (the initial values) is not a write."""
    aliases = {"world"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == "world":
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    skip = {
        id(n) for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "World" for n in ast.walk(c)
    }
    slots: set[str | None] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                parts = target.elts if isinstance(target, ast.Tuple) else [target]
                slots |= {_world_slot(t, aliases) for t in parts}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _MUTATORS:
                slots.add(_world_slot(node.func.value, aliases))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            target = node.args[0] if node.args else None
            if isinstance(target, ast.Name) and target.id in aliases:
                slots.add("?setattr")  # a slot named at run time cannot be checked: refused
    return {s for s in slots if s}


def _documented_writers() -> dict[str, set[str]]:
    """module -> slots, from the writers' list in state.py's docstring."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "state.py").read_text())) or ""
    block = doc.split("(``tests/test_architecture.py`` compares this list with the code)::", 1)[1]
    writers = {}
    for line in block.strip("\n").split("\n\n", 1)[0].splitlines():
        module, slots = line.split(None, 1)
        writers[module] = {s.strip() for s in re.sub(r"\(.*\)", "", slots).split(",")}
    return writers


def test_state_world_is_written_only_where_state_py_says() -> None:
    found = {}
    for path in _sources():
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        slots = _world_writes(ast.parse(path.read_text()))
        if slots:
            found[module] = slots
    assert found == _documented_writers(), (
        "state.world is written elsewhere than state.py's docstring lists: correct the code or the "
        f"list.\nin the code: {found}\nin the list: {_documented_writers()}"
    )
