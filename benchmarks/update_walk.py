"""Count what one entry point reaches in a package, statically: functions, call edges (hops) and files.

    .venv/bin/python benchmarks/update_walk.py comlrl_lightning algorithms/base.py:MultiAgentModule.update \\
        --class-context MAGRPO --bind objective=GroupRelative [--stop step_groups] [--edges] [--json PATH]

Every ``.py`` file under the package directory is parsed with ``ast`` (nothing is imported or run). From the entry,
the walk goes breadth-first over *states* (a function and what is known about its ``self`` and parameters) and
counts, per distinct function definition reached:

- **functions**: the distinct definitions reached, the entry included (a ``--stop`` function is reached and counted,
  its body is not walked);
- **edges (hops)**: the distinct (caller definition, callee definition) pairs (also counted: those whose caller
  and callee are in different files);
- **files**: the distinct files holding a reached definition, the entry's included.

What a function's body is: every node under its ``def``, nested ``def``/``lambda``/class bodies included (a nested
function belongs to its enclosing one and is never a node of its own; calling it adds no edge). Decorators,
default values and class-level statements are not walked. What is indexed: module-level functions, and the methods
of module-level classes and of classes nested in them. A method decorated with ``property`` (or any decorator whose
name ends in ``property``, e.g. ``cached_property``) is a property; its ``.setter``/``.deleter`` are not indexed.

What a call (``f(...)``) or a property read (an attribute in load context that is not itself called) resolves to:

1. ``name(...)``: the function's own imports, then its module's namespace (top-level ``def``/``class``, and
   ``import``/``from ... import`` of package modules, followed through re-exports). A package function is one
   edge; a package class is its constructor: ``__init__`` and ``__post_init__``, each the first definer in the
   class's MRO (the self of those is that class exactly). Anything else (a builtin, a local variable, a parameter,
   a name imported from outside the package) ends the walk there.
2. ``recv.name(...)`` / ``recv.name`` (property): the receiver's *type* decides.
   - a package module (``ranks.x``, ``pkg.sub.x``): that module's symbol, as in 1;
   - a package class object (``Cls.method(...)``): the first definer in ``Cls``'s MRO;
   - an **exact** type ``T`` (``self`` under ``--class-context``, a ``--bind``, an object built by ``T(...)``): the
     first definer of ``name`` in ``T``'s MRO — one edge, as Python dispatches;
   - a **static** type ``T`` (``self`` in a method of ``T`` without a context, a parameter annotated with a package
     class, an attribute annotated so): the instance may be of any subclass, so the candidates are the first
     definer in ``T``'s MRO plus every override of ``name`` in ``T``'s subclasses;
   - ``super().name``: the first definer after the current method's class in the MRO of ``self``'s type;
   - **unknown** (anything else, e.g. a local holding what a call returned): every package method named ``name``
     (for a property read: every package property named ``name``), matched by name alone; the self of a method
     reached so is static (its own class). ``--unknown unique`` follows such a site only when the name has one
     definition in the package; ``--unknown none`` never (typed edges only: what the walk can tell, a floor rather
     than a bound, since calls on untyped receivers that do run are left out).
   Property reads count only when the resolved definition is a property.
3. A site with more than one candidate counts one edge to each, and then the totals are an **upper bound** (the
   report says so and counts such sites). A site with exactly one by-name candidate on an unknown receiver is
   counted and reported separately ("by name": it may be a false match, e.g. a ``dict.get`` against a package
   ``get``). With the default ``--unknown all`` a common name (``add``, ``get``, ``device``, ``sample``) pulls in
   every class defining it, and the walk then spreads over most of the package: read that count as the loose
   bound it is, and the typed walk (``none``) next to it.

What gives a receiver its type:

- ``self`` (a method's first parameter, ``cls`` too): the type the method was reached with. The entry's self is
  exact ``C`` with ``--class-context C`` (the entry's class must be in ``C``'s MRO), else static (its own class); a
  method reached through an exact/static receiver inherits that receiver's type;
- ``--bind NAME=Class`` (repeatable): a bare name ``NAME`` (a parameter or local) or an attribute ``.NAME`` on any
  receiver (``self.NAME``, ``m.NAME``) is exactly ``Class`` (e.g. ``--bind objective=GroupRelative``);
- call arguments: a call passes the type of each argument it can tell (``self``, a bound name, a constructed
  object) to the callee's matching parameter (by position or keyword; a method's self parameter skipped; not at a
  by-name site with several candidates), so ``run_update(self, ...)`` walks ``run_update`` with ``module`` typed
  (the same function reached with other argument types is walked again; it counts once);
- a parameter annotation naming a package class (``C``, ``"C"``, ``C | None``, ``Optional[C]``): static.
  Precedence: self, then a passed argument, then a bind, then the annotation;
- in a function, ``a = <expr>`` with a single-name target: ``a`` takes the type of ``<expr>`` (the last assignment
  wins, order not considered); ``a = Cls(...)`` makes ``a`` exactly ``Cls``;
- a call's result: static ``C`` when the callee's return annotation names a package class ``C`` (``-> C``,
  ``-> "C"``, ``-> C | None``), the call resolved through a typed route (a package function, an exact/static
  receiver; not by name) and every candidate agrees (``step = self.begin_update(...)``: ``step.finish()`` is typed);
- instance attributes: ``self.a = Cls(...)`` (exact) or ``self.a: Cls`` (static) anywhere in a class's methods,
  looked up along the receiver's MRO, when every such assignment agrees.

Not modelled (they end the walk): calls through containers, callbacks passed as values, ``__call__``, context
managers' ``__enter__``/``__exit__``, iteration protocols, operator overloads, attribute stores (property setters)
and anything dynamic (``getattr``, ``objective_class(...)``).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UNKNOWN_MODES = ("all", "unique", "none")
USAGE = (
    "update_walk.py PACKAGE_DIR FILE.py:[Class.]function [--class-context CLASS] [--bind NAME=CLASS ...] "
    "[--stop NAME ...] [--unknown all|unique|none] [--edges] [--json PATH]"
)


# ---------------------------------------------------------------------------------------------------- index
@dataclass
class Func:
    """One indexed definition: a module function or a method (``cls`` set)."""

    key: str  # "rel/path.py:Class.name" or "rel/path.py:name"
    name: str
    module: str
    file: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    cls: str | None = None  # class key
    is_property: bool = False
    is_static: bool = False

    @property
    def self_param(self) -> str | None:
        if self.cls is None or self.is_static:
            return None
        args = self.node.args.posonlyargs + self.node.args.args
        return args[0].arg if args else None

    def params(self) -> list[str]:
        """Positional parameters after self (for methods)."""
        names = [a.arg for a in self.node.args.posonlyargs + self.node.args.args]
        return names[1:] if self.self_param is not None else names


@dataclass
class Cls:
    key: str  # "rel/path.py:Outer.Name"
    name: str
    module: str
    node: ast.ClassDef
    methods: dict[str, Func] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)  # class keys of package bases
    attrs: dict[str, Any] = field(default_factory=dict)  # instance attribute -> type (or CONFLICT)


CONFLICT = ("conflict",)


@dataclass
class Module:
    name: str  # dotted
    file: str  # path relative to the package's parent
    tree: ast.Module
    defs: dict[str, tuple] = field(default_factory=dict)  # top-level name -> ("func", key) | ("class", key)
    imports: dict[str, tuple] = field(default_factory=dict)  # name -> ("module", dotted) | ("from", dotted, name)


class Index:
    """Every module, class and function of one package directory."""

    def __init__(self, package_dir: Path):
        self.root = package_dir.resolve()
        self.package = self.root.name
        self.modules: dict[str, Module] = {}
        self.classes: dict[str, Cls] = {}
        self.funcs: dict[str, Func] = {}
        self.methods_by_name: dict[str, list[Func]] = {}
        for path in sorted(self.root.rglob("*.py")):
            rel = path.relative_to(self.root.parent)
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            except SyntaxError:
                continue
            module = Module(".".join(parts), rel.as_posix(), tree)
            self.modules[module.name] = module
            self._index_module(module)
        for cls in self.classes.values():
            cls.bases = [b for b in (self._base_key(cls, base) for base in cls.node.bases) if b]
        self.subclasses: dict[str, set[str]] = {k: set() for k in self.classes}
        for cls in self.classes.values():
            for base in self.mro(cls.key)[1:]:
                self.subclasses[base].add(cls.key)
        for cls in self.classes.values():
            self._index_attrs(cls)

    # -------------------------------------------------------------------------------------------- building
    def _index_module(self, module: Module) -> None:
        for stmt in module.tree.body:
            for node in _flat(stmt):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"{module.file}:{node.name}"
                    self.funcs[key] = Func(key, node.name, module.name, module.file, node)
                    module.defs[node.name] = ("func", key)
                elif isinstance(node, ast.ClassDef):
                    module.defs[node.name] = ("class", self._index_class(module, node, node.name))
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    module.imports.update(self._imports(module, node))

    def _index_class(self, module: Module, node: ast.ClassDef, qualname: str) -> str:
        key = f"{module.file}:{qualname}"
        cls = Cls(key, node.name, module.name, node)
        self.classes[key] = cls
        for stmt in node.body:
            for item in _flat(stmt):
                if isinstance(item, ast.ClassDef):
                    self._index_class(module, item, f"{qualname}.{item.name}")
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                decorators = [_dotted(d) or "" for d in item.decorator_list]
                if any(d.endswith((".setter", ".deleter")) for d in decorators):
                    continue
                func = Func(
                    f"{key}.{item.name}",
                    item.name,
                    module.name,
                    module.file,
                    item,
                    cls=key,
                    is_property=any(d.split(".")[-1].endswith("property") for d in decorators),
                    is_static=any(d.split(".")[-1] == "staticmethod" for d in decorators),
                )
                self.funcs[func.key] = func
                cls.methods[item.name] = func
                self.methods_by_name.setdefault(item.name, []).append(func)
        return key

    def _imports(self, module: Module, node: ast.Import | ast.ImportFrom) -> dict[str, tuple]:
        out: dict[str, tuple] = {}
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = ("module", alias.name)
                else:
                    top = alias.name.split(".")[0]
                    out[top] = ("module", top)
            return out
        base = node.module or ""
        if node.level:
            parts = module.name.split(".")
            is_package = module.file.endswith("__init__.py")
            parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            if alias.name != "*":
                out[alias.asname or alias.name] = ("from", base, alias.name)
        return out

    def _base_key(self, cls: Cls, base: ast.expr) -> str | None:
        sym = self.resolve_expr_symbol(self.modules[cls.module], base, {})
        return sym[1] if sym and sym[0] == "class" else None

    def _index_attrs(self, cls: Cls) -> None:
        """Instance attributes set as ``self.a = Cls(...)`` (exact) or annotated ``self.a: Cls`` (static)."""
        module = self.modules[cls.module]
        for func in cls.methods.values():
            me = func.self_param
            if me is None:
                continue
            local = self.local_imports(module, func.node)
            for node in ast.walk(func.node):
                pairs = []
                if isinstance(node, ast.Assign):
                    for target, value in _assignments(node):
                        sym = (
                            self.resolve_expr_symbol(module, value.func, local) if isinstance(value, ast.Call) else None
                        )
                        pairs.append((target, ("exact", sym[1]) if sym and sym[0] == "class" else None))
                elif isinstance(node, ast.AnnAssign):
                    sym = self.resolve_expr_symbol(module, _annotation_expr(node.annotation), local)
                    pairs.append((node.target, ("static", sym[1]) if sym and sym[0] == "class" else None))
                for target, typ in pairs:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == me
                        and typ is not None
                    ):
                        old = cls.attrs.get(target.attr)
                        cls.attrs[target.attr] = typ if old in (None, typ) else CONFLICT

    # -------------------------------------------------------------------------------------------- lookups
    def mro(self, key: str) -> list[str]:
        """C3 linearisation over package classes (bases outside the package are left out)."""
        cache = self.__dict__.setdefault("_mro", {})
        if key in cache:
            return cache[key]
        cache[key] = [key]  # cycle guard
        seqs = [list(self.mro(b)) for b in self.classes[key].bases] + [list(self.classes[key].bases)]
        out = [key]
        while any(seqs):
            for seq in seqs:
                if not seq:
                    continue
                head = seq[0]
                if not any(head in s[1:] for s in seqs):
                    break
            else:  # inconsistent: fall back to depth-first order
                for seq in seqs:
                    out += [c for c in seq if c not in out]
                break
            out.append(head)
            seqs = [s[1:] if s and s[0] == head else s for s in seqs]
        cache[key] = out
        return out

    def lookup(self, cls_key: str, name: str, after: str | None = None) -> Func | None:
        """The first definer of ``name`` in ``cls_key``'s MRO (after class ``after`` when given: ``super()``)."""
        chain = self.mro(cls_key)
        if after is not None:
            chain = chain[chain.index(after) + 1 :] if after in chain else self.mro(after)[1:]
        for key in chain:
            func = self.classes[key].methods.get(name)
            if func is not None:
                return func
        return None

    def attr_type(self, cls_key: str, name: str) -> tuple | None:
        for key in self.mro(cls_key):
            typ = self.classes[key].attrs.get(name)
            if typ is not None:
                return None if typ is CONFLICT else typ
        return None

    def module_symbol(self, dotted: str, name: str, seen: frozenset = frozenset()) -> tuple | None:
        """What ``name`` is in package module ``dotted``: ("func"|"class", key), ("module", dotted) or None."""
        if (dotted, name) in seen:
            return None
        module = self.modules.get(dotted)
        if module is not None:
            if name in module.defs:
                return module.defs[name]
            if name in module.imports:
                return self.import_symbol(module.imports[name], seen | {(dotted, name)})
        if f"{dotted}.{name}" in self.modules:
            return ("module", f"{dotted}.{name}")
        return None

    def import_symbol(self, imp: tuple, seen: frozenset = frozenset()) -> tuple | None:
        if imp[0] == "module":
            return ("module", imp[1]) if self.in_package(imp[1]) else ("external",)
        _, base, name = imp
        if not self.in_package(base):
            return ("external",)
        return self.module_symbol(base, name, seen)

    def in_package(self, dotted: str) -> bool:
        return dotted == self.package or dotted.startswith(self.package + ".")

    def local_imports(self, module: Module, node: ast.AST) -> dict[str, tuple]:
        out: dict[str, tuple] = {}
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                out.update(self._imports(module, sub))
        return out

    def resolve_name(self, module: Module, name: str, local: dict[str, tuple]) -> tuple | None:
        if name in local:
            return self.import_symbol(local[name])
        if name in module.defs:
            return module.defs[name]
        if name in module.imports:
            return self.import_symbol(module.imports[name])
        return None

    def resolve_expr_symbol(self, module: Module, expr: ast.expr | None, local: dict[str, tuple]) -> tuple | None:
        """A Name or dotted Attribute chain as a package symbol (module, class, function), or None."""
        if isinstance(expr, ast.Name):
            return self.resolve_name(module, expr.id, local)
        if isinstance(expr, ast.Attribute):
            inner = self.resolve_expr_symbol(module, expr.value, local)
            if inner and inner[0] == "module":
                return self.module_symbol(inner[1], expr.attr)
            if inner and inner[0] == "class":
                nested = f"{inner[1]}.{expr.attr}"
                return ("class", nested) if nested in self.classes else None
        return None

    def find_class(self, spec: str) -> str:
        """A class key from ``Name`` or ``file.py:Name`` (error when ambiguous or absent)."""
        if ":" in spec:
            key = self.entry_key(spec)
            if key not in self.classes:
                raise SystemExit(f"no class {spec}")
            return key
        found = [k for k, c in self.classes.items() if c.name == spec or k.split(":", 1)[1] == spec]
        if len(found) != 1:
            raise SystemExit(f"class {spec!r}: {'ambiguous: ' + ', '.join(found) if found else 'not found'}")
        return found[0]

    def entry_key(self, spec: str) -> str:
        """``path/to/file.py:Qual.name`` (relative to the package dir or its parent; dotted modules too)."""
        where, _, qual = spec.partition(":")
        if not where.endswith(".py"):
            where = where.replace(".", "/") + ".py"
        if not where.startswith(self.package + "/"):
            where = f"{self.package}/{where}"
        if where not in {m.file for m in self.modules.values()}:
            package_init = where[: -len(".py")] + "/__init__.py"
            where = package_init if package_init in {m.file for m in self.modules.values()} else where
        return f"{where}:{qual}"


# ---------------------------------------------------------------------------------------------------- walk
@dataclass
class Report:
    entry: str
    functions: list[str]
    edges: list[tuple[str, str, str]]  # (caller, callee, how)
    files: dict[str, int]
    ambiguous_sites: int
    by_name_edges: int
    stopped: list[str]
    depth: int

    @property
    def cross_file_edges(self) -> int:
        return sum(1 for a, b, _ in self.edges if a.split(":", 1)[0] != b.split(":", 1)[0])

    @property
    def upper_bound(self) -> bool:
        return self.ambiguous_sites > 0


class Walker:
    def __init__(
        self, index: Index, binds: dict[str, str] | None = None, stop: set[str] | None = None, unknown: str = "all"
    ):
        self.index = index
        self.unknown = unknown
        self.binds = {name: ("exact", index.find_class(cls)) for name, cls in (binds or {}).items()}
        self.stop = stop or set()

    def walk(self, entry: str, class_context: str | None = None) -> Report:
        ix = self.index
        key = ix.entry_key(entry)
        if key not in ix.funcs:
            raise SystemExit(f"entry {entry!r} ({key}) is not an indexed function")
        func = ix.funcs[key]
        if func.cls is None:
            self_type = None
        elif class_context:
            context = ix.find_class(class_context)
            if func.cls not in ix.mro(context):
                raise SystemExit(f"--class-context {class_context}: {func.cls} is not in its MRO")
            self_type = ("exact", context)
        else:
            self_type = ("static", func.cls)
        start = (key, self_type, ())
        seen_states, depth_of = {start}, {key: 0}
        queue = deque([(start, 0)])
        edges: dict[tuple[str, str], str] = {}
        ambiguous: set[tuple[str, int, int, str]] = set()
        stopped: set[str] = set()
        max_depth = 0
        while queue:
            (fkey, self_type, params), depth = queue.popleft()
            max_depth = max(max_depth, depth)
            f = ix.funcs[fkey]
            if self._stops(f):
                stopped.add(fkey)
                continue
            for site, targets in self._calls(f, self_type, dict(params)):
                if len(targets) > 1:
                    ambiguous.add((fkey, *site))
                for callee, how, callee_self, callee_params in targets:
                    how = "ambiguous" if len(targets) > 1 else how
                    edges.setdefault((fkey, callee.key), how)
                    depth_of.setdefault(callee.key, depth + 1)
                    state = (callee.key, callee_self, tuple(sorted(callee_params.items())))
                    if state not in seen_states:
                        seen_states.add(state)
                        queue.append((state, depth + 1))
        functions = sorted(depth_of, key=lambda k: (depth_of[k], k))
        files: dict[str, int] = {}
        for k in functions:
            files[ix.funcs[k].file] = files.get(ix.funcs[k].file, 0) + 1
        return Report(
            entry=key,
            functions=functions,
            edges=sorted((a, b, how) for (a, b), how in edges.items()),
            files=dict(sorted(files.items())),
            ambiguous_sites=len(ambiguous),
            by_name_edges=sum(1 for how in edges.values() if how == "by name"),
            stopped=sorted(stopped),
            depth=max_depth,
        )

    def _stops(self, f: Func) -> bool:
        qual = f.key.split(":", 1)[1]
        return f.name in self.stop or qual in self.stop

    # ------------------------------------------------------------------------------------------ one body
    def _calls(self, f: Func, self_type: tuple | None, params: dict[str, tuple]):
        """Yield ((line, col, name), [(callee Func, how, callee self type, callee param types)]) per site."""
        ix = self.index
        module = ix.modules[f.module]
        local = ix.local_imports(module, f.node)
        env = self._env(f, self_type, params, module, local)
        called = set()
        for node in ast.walk(f.node):
            if isinstance(node, ast.Call):
                called.add(id(node.func))
        for node in ast.walk(f.node):
            if node is f.node:
                continue
            if isinstance(node, ast.Call):
                targets = self._resolve_call(node, f, env, module, local)
                if targets:
                    yield (node.lineno, node.col_offset, "call"), targets
            elif (
                isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in called
            ):  # a property read
                targets = [t for t in self._resolve_attr(node, f, env, module, local, prop=True) if t[0].is_property]
                if targets:
                    yield (node.lineno, node.col_offset, "read"), targets

    def _env(self, f: Func, self_type, params, module, local) -> dict[str, tuple]:
        """Types of the names in ``f``: self, parameters (passed or annotated), binds, single-name assignments."""
        env: dict[str, tuple] = {}
        args = f.node.args
        for a in args.posonlyargs + args.args + args.kwonlyargs:
            sym = self.index.resolve_expr_symbol(module, _annotation_expr(a.annotation), local)
            if sym and sym[0] == "class":
                env[a.arg] = ("static", sym[1])
        for name, typ in self.binds.items():
            env[name] = typ
        env.update(params)
        if f.self_param is not None and self_type is not None:
            env[f.self_param] = self_type
        assignments = [
            (target.id, value)
            for node in ast.walk(f.node)
            if isinstance(node, ast.Assign)
            for target, value in _assignments(node)
            if isinstance(target, ast.Name)
        ]
        fixed = set(env) - set(self.binds)  # self and the parameters keep their types
        for _ in range(2):  # twice: an alias of an alias (b = a; a = self.x) resolves whatever the order
            assigned: dict[str, tuple | None] = {}
            for name, value in assignments:
                if name in fixed or name == f.self_param:
                    continue
                typ = self._type_of(value, f, env, module, local)
                assigned[name] = typ if assigned.get(name, typ) == typ else None
            env.update({k: v for k, v in assigned.items() if v is not None})
        return env

    def _type_of(self, expr: ast.expr, f: Func, env, module, local) -> tuple | None:
        ix = self.index
        if isinstance(expr, ast.Name):
            if expr.id in env:
                return env[expr.id]
            sym = ix.resolve_name(module, expr.id, local)
            if sym and sym[0] in ("module", "class"):
                return (sym[0] if sym[0] == "module" else "classobj", sym[1])
            return None
        if isinstance(expr, ast.Attribute):
            if expr.attr in self.binds:
                return self.binds[expr.attr]
            inner = self._type_of(expr.value, f, env, module, local)
            if inner is None:
                return None
            if inner[0] == "module":
                sym = ix.module_symbol(inner[1], expr.attr)
                if sym and sym[0] in ("module", "class"):
                    return (sym[0] if sym[0] == "module" else "classobj", sym[1])
                return None
            if inner[0] in ("exact", "static"):
                return ix.attr_type(inner[1], expr.attr)
            return None
        if isinstance(expr, ast.Call):
            kind = self._type_of(expr.func, f, env, module, local)
            if kind and kind[0] == "classobj":
                return ("exact", kind[1])
            return self._return_type(expr, f, env, module, local)
        if isinstance(expr, ast.BoolOp):
            types = {self._type_of(v, f, env, module, local) for v in expr.values}
            return types.pop() if len(types) == 1 else None
        return None

    def _return_type(self, call: ast.Call, f: Func, env, module, local) -> tuple | None:
        """A call's type from its callees' return annotation (a package class: static), when the call resolves
        through a typed route (not by name) and every candidate's annotation names the same class."""
        ix = self.index
        if isinstance(call.func, ast.Name):
            if call.func.id in env:
                return None
            sym = ix.resolve_name(module, call.func.id, local)
            callees = [ix.funcs[sym[1]]] if sym and sym[0] == "func" else []
        elif isinstance(call.func, ast.Attribute):
            callees = [t[0] for t in self._resolve_attr(call.func, f, env, module, local) if t[1] != "by name"]
        else:
            return None
        types = set()
        for callee in callees:
            returns = _annotation_expr(callee.node.returns)
            sym = ix.resolve_expr_symbol(ix.modules[callee.module], returns, {}) if returns is not None else None
            types.add(sym[1] if sym and sym[0] == "class" else None)
        return ("static", types.pop()) if len(types) == 1 and None not in types else None

    def _resolve_call(self, call: ast.Call, f: Func, env, module, local) -> list:
        ix = self.index
        func = call.func
        if isinstance(func, ast.Name):
            if func.id in env:  # a typed local/parameter being called: __call__ is not modelled
                return []
            return self._symbol_targets(ix.resolve_name(module, func.id, local), call, f, env, module, local)
        if isinstance(func, ast.Attribute):
            return self._resolve_attr(func, f, env, module, local, call=call)
        return []

    def _symbol_targets(self, sym, call, f, env, module, local) -> list:
        ix = self.index
        if not sym:
            return []
        if sym[0] == "func":
            callee = ix.funcs[sym[1]]
            return [(callee, "exact", None, self._arg_types(callee, call, f, env, module, local))]
        if sym[0] == "class":
            out = []
            for ctor in ("__init__", "__post_init__"):
                callee = ix.lookup(sym[1], ctor)
                if callee is not None:
                    out.append(
                        (callee, "exact", ("exact", sym[1]), self._arg_types(callee, call, f, env, module, local))
                    )
            return out
        return []

    def _resolve_attr(self, attr: ast.Attribute, f: Func, env, module, local, call=None, prop=False) -> list:
        ix = self.index
        name, recv = attr.attr, attr.value
        # super().name
        if isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name) and recv.func.id == "super" and f.cls:
            self_type = env.get(f.self_param) if f.self_param else None
            base = self_type[1] if self_type and self_type[0] == "exact" else f.cls
            callee = ix.lookup(base, name, after=f.cls)
            if callee is None:
                return []
            return [(callee, "exact", self_type, self._arg_types(callee, call, f, env, module, local))]
        typ = self._type_of(recv, f, env, module, local)
        if typ is not None and typ[0] == "module":
            return self._symbol_targets(ix.module_symbol(typ[1], name), call, f, env, module, local)
        if typ is not None and typ[0] == "classobj":
            callee = ix.lookup(typ[1], name)
            if callee is None:
                return []
            return [(callee, "exact", ("static", typ[1]), self._arg_types(callee, call, f, env, module, local))]
        if typ is not None and typ[0] == "exact":
            callee = ix.lookup(typ[1], name)
            if callee is None:
                return []
            return [(callee, "exact", typ, self._arg_types(callee, call, f, env, module, local))]
        if typ is not None and typ[0] == "static":
            found = {}
            first = ix.lookup(typ[1], name)
            if first is not None:
                found[first.key] = (first, typ)
            for sub in sorted(ix.subclasses[typ[1]]):
                override = ix.classes[sub].methods.get(name)
                if override is not None:
                    found.setdefault(override.key, (override, ("static", sub)))
            return [
                (callee, "static", self_type, self._arg_types(callee, call, f, env, module, local))
                for callee, self_type in found.values()
            ]
        if self.unknown == "none":
            return []
        candidates = [c for c in ix.methods_by_name.get(name, []) if c.is_property or not prop]
        if self.unknown == "unique" and len(candidates) > 1:
            return []
        return [
            (
                c,
                "by name",
                ("static", c.cls),
                self._arg_types(c, call, f, env, module, local) if len(candidates) == 1 else {},
            )
            for c in candidates
        ]

    def _arg_types(self, callee: Func, call: ast.Call | None, f: Func, env, module, local) -> dict[str, tuple]:
        """The types the call passes to ``callee``'s parameters (those it can tell)."""
        if call is None:
            return {}
        names = callee.params()
        out = {}
        for i, arg in enumerate(call.args):
            if isinstance(arg, ast.Starred) or i >= len(names):
                break
            typ = self._type_of(arg, f, env, module, local)
            if typ is not None and typ[0] in ("exact", "static"):
                out[names[i]] = typ
        kwonly = {a.arg for a in callee.node.args.kwonlyargs}
        for kw in call.keywords:
            if kw.arg is not None and (kw.arg in names or kw.arg in kwonly):
                typ = self._type_of(kw.value, f, env, module, local)
                if typ is not None and typ[0] in ("exact", "static"):
                    out[kw.arg] = typ
        return out


# ---------------------------------------------------------------------------------------------------- helpers
def _flat(stmt: ast.stmt):
    """A top-level statement, and the statements inside its ``if``/``try`` blocks (conditional definitions)."""
    yield stmt
    if isinstance(stmt, (ast.If, ast.Try)) or type(stmt).__name__ == "TryStar":
        for block in ("body", "orelse", "finalbody"):
            for sub in getattr(stmt, block, []):
                yield from _flat(sub)
        for handler in getattr(stmt, "handlers", []):
            for sub in handler.body:
                yield from _flat(sub)


def _assignments(node: ast.Assign) -> list[tuple[ast.expr, ast.expr]]:
    """``a = v`` as [(a, v)]; ``a, b = v, w`` as [(a, v), (b, w)]; other forms (chained, unpacking a call) as []."""
    if len(node.targets) != 1:
        return []
    target, value = node.targets[0], node.value
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return list(zip(target.elts, value.elts))
    return [] if isinstance(target, ast.Tuple) else [(target, value)]


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Call):
        return _dotted(expr.func)
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = _dotted(expr.value)
        return f"{inner}.{expr.attr}" if inner else None
    return None


def _annotation_expr(annotation: ast.expr | None) -> ast.expr | None:
    """``Cls``, ``"Cls"``, ``Cls | None`` and ``Optional[Cls]`` as the expression naming ``Cls``."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        for side in (annotation.left, annotation.right):
            if not (isinstance(side, ast.Constant) and side.value is None):
                return _annotation_expr(side)
    if isinstance(annotation, ast.Subscript) and (_dotted(annotation.value) or "").endswith("Optional"):
        return _annotation_expr(annotation.slice)
    return annotation if isinstance(annotation, (ast.Name, ast.Attribute)) else None


def walk(
    package_dir: str | Path,
    entry: str,
    class_context: str | None = None,
    binds: dict[str, str] | None = None,
    stop: set[str] | None = None,
    unknown: str = "all",
) -> Report:
    return Walker(Index(Path(package_dir)), binds, stop, unknown).walk(entry, class_context)


def format_report(report: Report, show_edges: bool = False) -> str:
    bound = " (UPPER BOUND: a site had several candidates)" if report.upper_bound else ""
    lines = [
        f"entry: {report.entry}",
        f"functions reached: {len(report.functions)}{bound}",
        f"edges (hops): {len(report.edges)}{bound}",
        f"  of which by name only (one candidate, receiver unknown): {report.by_name_edges}",
        f"  of which cross a file (caller and callee in different files): {report.cross_file_edges}",
        f"  ambiguous call sites (several candidates, one edge each): {report.ambiguous_sites}",
        f"files: {len(report.files)}",
        f"max BFS depth: {report.depth}",
    ]
    if report.stopped:
        lines.append(f"stopped at (reached, not walked): {', '.join(report.stopped)}")
    lines += [f"  {path} ({n} function{'s' if n != 1 else ''})" for path, n in report.files.items()]
    if show_edges:
        lines.append("edges:")
        lines += [f"  {a} -> {b} [{how}]" for a, b, how in report.edges]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(usage=USAGE, description=__doc__.split("\n\n")[0])
    parser.add_argument("package_dir", help="the package directory (its name is the top-level package)")
    parser.add_argument("entry", help="FILE.py:Class.method or FILE.py:function, relative to the package dir")
    parser.add_argument("--class-context", default=None, help="the entry's self is exactly this class")
    parser.add_argument(
        "--bind", action="append", default=[], metavar="NAME=CLASS", help="NAME / .NAME receivers are CLASS"
    )
    parser.add_argument("--stop", action="append", default=[], help="reach but do not walk functions of this name")
    parser.add_argument(
        "--unknown",
        choices=UNKNOWN_MODES,
        default="all",
        help="calls on receivers of unknown type: all = every package method of that name (an upper bound); "
        "unique = only a name defined once in the package; none = not followed (typed edges only)",
    )
    parser.add_argument("--edges", action="store_true", help="list every edge")
    parser.add_argument("--json", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    binds = {}
    for item in args.bind:
        name, sep, cls = item.partition("=")
        if not sep:
            parser.error(f"--bind {item!r}: expected NAME=CLASS")
        binds[name.strip()] = cls.strip()
    stop = {s.strip() for item in args.stop for s in item.split(",") if s.strip()}
    report = walk(args.package_dir, args.entry, args.class_context, binds, stop, args.unknown)
    print(format_report(report, args.edges))
    if args.json:
        data = {
            "entry": report.entry,
            "class_context": args.class_context,
            "binds": binds,
            "stop": sorted(stop),
            "unknown": args.unknown,
            "stopped": report.stopped,
            "functions": report.functions,
            "edges": report.edges,
            "files": report.files,
            "cross_file_edges": report.cross_file_edges,
            "ambiguous_sites": report.ambiguous_sites,
            "by_name_edges": report.by_name_edges,
            "upper_bound": report.upper_bound,
        }
        Path(args.json).write_text(json.dumps(data, indent=1), encoding="utf-8")
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
