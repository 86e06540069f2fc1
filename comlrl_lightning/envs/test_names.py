"""Which names a benchmark's test code takes from outside itself (docs/sandbox.md#names-a-test-uses).

A test runs in the trusted evaluator; the program under test is a set of handles there. Only the item's entry
points (the function or class the test exercises) may come from the program: every other name a test or its setup
uses must be defined by the trusted side — the test itself, the item's imports, the prompt's helpers. Otherwise the
program would choose what the test computes (a program's ``import math`` with a patched ``math.isclose`` would
decide the verdict). Some dataset items do use such names; :func:`check_item` finds them when the items load:

* a standard-library module the tests use without importing it (MBPP 596's ``sys.getsizeof``) is imported in the
  trusted setup instead (the item is *fixed*);
* a name nothing defines, or an attribute such a module does not have (the HumanEval-style MBPP rewrite's
  ``math.candidate(...)``), makes a test only a forgery can pass: the item is *broken* and dropped.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import logging
import symtable
import sys
from dataclasses import dataclass, field
from typing import Iterable, Sequence

log = logging.getLogger(__name__)

_BUILTINS = frozenset(vars(builtins))
_MODULE_NAMES = frozenset({"__file__", "__name__", "__builtins__"})  # what the evaluator gives every test


@dataclass
class NameCheck:
    """What :func:`check_item` found: ``imports`` to add to the trusted setup (standard-library modules the tests
    use unimported) and ``broken``, the names or attributes nothing trusted defines."""

    imports: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)


def defined_names(code: str) -> set[str]:
    """Names bound at the top level of ``code`` (assignments, imports, defs, classes, loop targets)."""
    table = _table(code)
    if table is None:
        return set()
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}


def free_names(code: str) -> set[str]:
    """Global names ``code`` reads (in any of its scopes) that it does not bind at its top level."""
    table = _table(code)
    if table is None:
        return set()
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    read: set[str] = set()
    stack = [table]
    while stack:
        scope = stack.pop()
        stack.extend(scope.get_children())
        for symbol in scope.get_symbols():
            top = scope is table
            if symbol.is_referenced() and (top or symbol.is_global()) and not (top and symbol.get_name() in bound):
                read.add(symbol.get_name())
    return read - bound


def module_attributes(code: str, module: str) -> set[str]:
    """The attributes ``code`` reads of the global name ``module`` (``math.isclose`` -> ``isclose``)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return set()
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == module
    }


def check_item(setup: str, tests: Sequence[str], entry_points: Iterable[str]) -> NameCheck:
    """The names the item's ``setup`` and ``tests`` take from outside them (module docstring)."""
    defined = defined_names(setup) | set(entry_points) | _BUILTINS | _MODULE_NAMES
    wanted: set[str] = set()
    for code in (setup, *tests):
        wanted |= free_names(code)
    wanted -= defined
    found = NameCheck()
    for name in sorted(wanted):
        module = _stdlib_module(name)
        if module is None:
            found.broken.append(name)
            continue
        missing = sorted(
            {a for code in (setup, *tests) for a in module_attributes(code, name) if not hasattr(module, a)}
        )
        if missing:
            found.broken.extend(f"{name}.{a}" for a in missing)
        else:
            found.imports.append(f"import {name}")
    return found


def keep_checked(items: list[dict], check, dataset: str) -> list[dict]:
    """``items`` with each one's :func:`check_item` applied by ``check(item) -> NameCheck``: the imports it needs
    are added to its ``trusted_imports`` and broken items are dropped, with one log line saying how many of each."""
    kept, dropped, fixed = [], [], 0
    for item in items:
        found = check(item)
        if found.broken:
            dropped.append((item.get("task_id", "?"), found.broken))
            continue
        if found.imports:
            item = {**item, "trusted_imports": [*item.get("trusted_imports", []), *found.imports]}
            fixed += 1
        kept.append(item)
    if dropped or fixed:
        shown = "; ".join(f"{task}: {', '.join(names)}" for task, names in dropped[:5])
        log.warning(
            "%s: %d of %d items' tests use names nothing trusted defines (only a program could supply "
            "them): %d fixed with a standard-library import in the trusted setup, %d dropped%s",
            dataset,
            fixed + len(dropped),
            len(items),
            fixed,
            len(dropped),
            f" ({shown}{', ...' if len(dropped) > 5 else ''})" if dropped else "",
        )
    return kept


def _stdlib_module(name: str):
    if name not in sys.stdlib_module_names:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _table(code: str):
    try:
        return symtable.symtable(code, "<test>", "exec")
    except (SyntaxError, ValueError):
        return None
