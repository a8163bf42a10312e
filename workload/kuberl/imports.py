"""User code a manifest names by import path, ``package.module:Name`` (``spec.reward.function``,
``spec.rollout.workflow``): looked up without running it (``kuberl validate``: a manifest under review
runs none of its code on the reviewer's machine), and imported (the trainer). Errors name the field."""

from __future__ import annotations

import ast
import importlib
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any


def module_source(module_name: str) -> Path | bool | None:
    """Where ``module_name``'s source is on ``sys.path``, found without running any of its code (nor its
    parent packages' ``__init__``: ``importlib.util.find_spec`` would import those): its file; True when
    the module exists but has no Python source here (a compiled extension, a namespace package); False
    when it is not on the path."""
    locations: list[str] | None = None
    origin: str | None = None
    for part in module_name.split("."):
        spec = PathFinder.find_spec(part, locations)
        if spec is None:
            return False
        locations, origin = list(spec.submodule_search_locations or []), spec.origin
    return Path(origin) if origin and origin.endswith(".py") else True


def module_found(module_name: str) -> bool:
    """Whether ``module_name`` lies on ``sys.path`` (:func:`module_source`)."""
    return module_source(module_name) is not False


def defines(source: str, name: str) -> bool | None:
    """Whether Python ``source`` defines ``name`` at its top level (a def, class, assignment or import,
    also inside a top-level if/try); None when that cannot be told without running it (a ``*`` import,
    a module ``__getattr__``, source that does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    names: set[str] = set()
    statements = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            statements += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                           *(s for handler in getattr(node, "handlers", []) for s in handler.body)]
    return None if "__getattr__" in names else name in names


def lookup_issue(path: str, field: str, import_it: bool = False) -> tuple[str | None, str | None]:
    """(error, warning) about ``path`` ('module:Name') on this machine. A module that is not here is a
    warning (it may live only in the run's image; the trainer imports it at start-up); a module here that
    does not define ``Name`` is an error — read from its source, or with ``import_it`` imported (its
    code runs)."""
    module_name, _, name = path.partition(":")
    if import_it:
        try:
            imported(path, field)
        except ValueError as err:
            return (None, str(err)) if not module_found(module_name) else (str(err), None)
        return None, None
    source = module_source(module_name)
    if source is False:
        return None, f"{field} {path!r}: no module {module_name!r} on this machine's Python path"
    if isinstance(source, Path) and defines(source.read_text(errors="replace"), name) is False:
        return f"{field} {path!r}: {module_name} ({source}) defines no {name!r}", None
    return None, None


def imported(path: str, field: str) -> Any:
    """The object ``path`` ('package.module:Name') names, imported; ValueError naming ``field`` when the
    module does not import or lacks the name."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{field} {path!r}: cannot import {module_name!r} ({err})") from err
    if not hasattr(module, name):
        raise ValueError(f"{field} {path!r}: {module_name} defines no {name!r}")
    return getattr(module, name)
