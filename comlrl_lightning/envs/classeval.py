"""ClassEval: two agents complete a Python class from its skeleton (signatures + docstrings).

Data (:func:`classeval_tasks`): ``FudanSELab/ClassEval`` (hub, split ``test``) or a local ``.json(.gz)`` copy
(e.g. ``../shared/data/classeval/ClassEval_data.json.gz``). Items keep the original fields and add ``prompt``
(= the class ``skeleton``), ``methods`` (method names, ``__init__`` excluded, in skeleton order),
``agent_methods`` (the split below), ``test_cases`` (``(TestClass, test_method)`` pairs of the unittest code) and
``class_constructor`` (the class line + ``__init__``).

Method split (:func:`split_methods`): the methods are cut into contiguous chunks in skeleton order; agent 0
implements the first ``ceil(n / 2)`` methods, agent 1 the rest (N agents: ``ceil`` sized chunks in order). Each
agent sees the full skeleton and is told which methods it owns and which its teammate owns.

Merger (:func:`merge_class`): the class is rebuilt as ``imports + class_constructor`` followed by, for every
method, the owner's implementation when the owner's completion defines it (top level or inside any class; markdown
fences stripped; completions that do not parse are salvaged ``def`` block by ``def`` block), else a placeholder
that raises ``RuntimeError`` (so the tests of a method nobody wrote fail). Methods a completion defines but does not own are ignored; top-level imports of the
completions are kept. A definition whose body is only a docstring / ``pass`` / ``...`` / ``raise
NotImplementedError`` does not count as implemented.

Team reward (:class:`ClassEvalReward`, default instance :data:`classeval_reward`), max 6.0, min −0.2::

    gate          no agent implemented any owned method                                   → 0 (stop)
    syntax        +0.5 every agent's completion parses and the merged program compiles
    tests         + pass_ratio × 5.0 over the item's unittest test methods (sandbox)
    cooperation   +0.5 every agent implemented ≥ 1 owned method and some test passed
    penalty       −0.2 any timeout or sandbox violation

Reward components (``reward_aggregation``, README): :func:`classeval_reward_components` (``ClassEvalReward(components=True)``) returns
these levels of each joint action as named components (:data:`COMPONENTS`, :func:`reward_components`) whose sum is the
total :func:`classeval_reward` returns, for ``reward_aggregation: normalize_components``.

The scale makes the paper's ``reward_processor`` shift −6 map a perfect team to 0. Tests run in
:mod:`comlrl_lightning.envs.sandbox` (:func:`sandbox_job`): the merged class is the sandboxed program; the test
module (its ``if __name__ == "__main__"`` block removed) + a ``_run_test(cls, method)`` helper running one
TestCase method with ``unittest`` is trusted setup, run by the sandbox's evaluator, where the class under test
is a handle; each test is ``assert _run_test('TestX', 'test_y')``, in a sandbox of its own.

Multi-turn (:class:`CodeFeedbackTransition`, ``code_feedback`` mode): per agent, the skeleton, its owned methods,
its previous code, the teammate's method names, parse problems, missing methods and the per-test-class results
(``passed x/y`` and error types) of the merged class, test classes mapped to the agent's methods first.
"""

from __future__ import annotations

import ast
import math
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from comlrl_lightning.envs.coding import all_passed, components_summing_to, per_turn_means, strip_markdown
from comlrl_lightning.envs.loading import load_rows
from comlrl_lightning.envs.sandbox import Isolation
from comlrl_lightning.envs.untrusted import compile_error, parse_python

CLASSEVAL_HUB_ID = "FudanSELab/ClassEval"
EVAL_HEAD = 16  # default eval set: the first EVAL_HEAD (stdlib-only) items, training: the rest
REWARD_MIN, REWARD_MAX = -0.2, 6.0
# The breakdown's levels as the reward's components (syntax, tests, penalty, cooperation bonus): in this order a row's
# components add up to its total rounded to 10 decimals (coding.components_summing_to; level_tests takes the rounding).
COMPONENTS = ("level_syntax", "level_tests", "penalty", "bonus")
_STUB = "raise RuntimeError('method not implemented by its agent')"

# ------------------------------------------------------------------------------------------------ loading


def _test_cases(test_code: str, test_classes: Sequence[str] | None = None) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(test_code or "")
    except SyntaxError:
        return []
    wanted = set(test_classes or [])
    out = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or (wanted and node.name not in wanted):
            continue
        if not wanted and not any("TestCase" in ast.unparse(b) for b in node.bases):
            continue
        out += [
            (node.name, f.name)
            for f in node.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test")
        ]
    return out


def skeleton_methods(skeleton: str) -> list[str]:
    """Method names (``__init__`` excluded) of the class in a skeleton, in order (text based: skeletons may not
    parse)."""
    names = [m for m in re.findall(r"^[ \t]+def\s+(\w+)\s*\(", skeleton or "", re.M) if m != "__init__"]
    return list(dict.fromkeys(names))


def split_methods(methods: Sequence[str], num_agents: int = 2) -> list[list[str]]:
    """Contiguous chunks in order: agent 0 gets the first ``ceil(n / num_agents)`` methods, and so on."""
    size = max(1, math.ceil(len(methods) / num_agents)) if methods else 1
    return [list(methods[i * size : (i + 1) * size]) for i in range(num_agents)]


def _normalise(row: Mapping[str, Any], num_agents: int = 2) -> dict[str, Any]:
    item = dict(row)
    skeleton = row.get("skeleton") or row.get("prompt") or ""
    item["prompt"] = skeleton
    methods = [m["method_name"] for m in row.get("methods_info") or []] or skeleton_methods(skeleton)
    item["methods"] = methods
    item["agent_methods"] = split_methods(methods, num_agents)
    name = row.get("class_name") or (re.findall(r"^class\s+(\w+)", skeleton, re.M) or ["Solution"])[0]
    item["class_name"] = name
    item["class_constructor"] = row.get("class_constructor") or f"class {name}:"
    item["import_statement"] = list(row.get("import_statement") or [])
    item["test_cases"] = _test_cases(row.get("test", ""), row.get("test_classes"))
    return item


def classeval_tasks(
    path_or_id: str = CLASSEVAL_HUB_ID, split: str | None = "test", limit: int | None = None
) -> list[dict[str, Any]]:
    """ClassEval items (see the module docstring). ``path_or_id``: a hub id or a local ``.json``/``.json.gz``
    file (one split: a split name is ignored, a slice such as ``"test[:20]"`` is applied). Offline, a hub id
    raises a ``FileNotFoundError`` that says to pass the local file."""
    from comlrl_lightning.envs.test_names import check_item, keep_checked

    items = [_normalise(r) for r in load_rows(path_or_id, split)]
    items = keep_checked(
        items,
        lambda item: check_item(unittest_setup(item), unittest_snippets(item["test_cases"]), [item["class_name"]]),
        f"ClassEval ({path_or_id})",
    )
    return items[:limit] if limit is not None else items


def _top_module(line: str) -> str | None:
    m = re.match(r"^\s*(?:from|import)\s+([\w.]+)", line)
    return m.group(1).split(".")[0] if m else None


def is_stdlib_only(item: Mapping[str, Any]) -> bool:
    """The class and its tests import only standard-library modules."""
    lines = list(item.get("import_statement") or []) + (item.get("test") or "").splitlines()
    mods = {_top_module(line) for line in lines} - {None}
    return all(m in sys.stdlib_module_names for m in mods)


def local_classeval_file() -> Path:
    from comlrl_lightning.envs.writing import shared_data_dir

    return shared_data_dir() / "classeval" / "ClassEval_data.json.gz"


def classeval_default_tasks() -> list[dict[str, Any]]:
    """All stdlib-only items: the shared local copy when present, else the hub (``FudanSELab/ClassEval``)."""
    local = local_classeval_file()
    items = classeval_tasks(str(local)) if local.exists() else classeval_tasks(CLASSEVAL_HUB_ID, "test")
    return [it for it in items if is_stdlib_only(it)]


def classeval_train_tasks() -> list[dict[str, Any]]:
    """Default training set: the stdlib-only items after the first EVAL_HEAD."""
    return classeval_default_tasks()[EVAL_HEAD:]


def classeval_eval_tasks() -> list[dict[str, Any]]:
    """Default eval set: the first EVAL_HEAD stdlib-only items."""
    return classeval_default_tasks()[:EVAL_HEAD]


# ------------------------------------------------------------------------------------------------ formatters


def _agent_methods(item: Mapping[str, Any], num_agents: int = 2) -> list[list[str]]:
    split = item.get("agent_methods")
    if split and len(split) == num_agents:
        return [list(s) for s in split]
    return split_methods(item.get("methods") or skeleton_methods(item.get("prompt", "")), num_agents)


def _agent_prompt(item: Mapping[str, Any], agent: int, num_agents: int = 2) -> str:
    split = _agent_methods(item, num_agents)
    own = split[agent]
    others = [m for i, s in enumerate(split) if i != agent for m in s]
    return (
        "Complete part of the Python class below together with a teammate.\n\n"
        f"Class skeleton:\n{item['prompt'].rstrip()}\n\n"
        f"Your methods: {', '.join(own) or '(none)'}\n"
        f"Your teammate implements: {', '.join(others) or '(none)'}\n\n"
        "Rules:\n"
        "- Answer with Python code only: no markdown, no explanations, no tests.\n"
        "- Write only the complete definitions of your methods (def name(self, ...): with a body), keeping the "
        "signatures of the skeleton; you may call the other methods of the class.\n"
        "- Put any import you need above the methods.\n"
    )


def classeval_agent0_prompt(item: Mapping[str, Any]) -> str:
    """Agent 0: the first half of the methods."""
    return _agent_prompt(item, 0)


def classeval_agent1_prompt(item: Mapping[str, Any]) -> str:
    """Agent 1: the second half of the methods."""
    return _agent_prompt(item, 1)


# ------------------------------------------------------------------------------------------------ merger


def _is_stub(fn: ast.AST) -> bool:
    body = list(fn.body)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    for node in body:
        if isinstance(node, ast.Pass) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None and "NotImplementedError" in ast.unparse(node.exc):
            continue
        return False
    return True


def _collect(tree: ast.Module, defs: dict[str, ast.AST], imports: list[str]) -> None:
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(ast.unparse(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.setdefault(node.name, node)
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defs.setdefault(sub.name, sub)


def parse_completion(completion: str) -> tuple[dict[str, ast.AST], list[str], bool]:
    """``(defs by name, import lines, parsed)`` of one completion: fences stripped; code that does not parse is
    salvaged block by block (each ``def`` with its decorators and deeper-indented lines, dedented)."""
    code = strip_markdown(completion or "")
    defs: dict[str, ast.AST] = {}
    imports: list[str] = []
    for candidate in (code, textwrap.dedent(code)):
        tree = parse_python(candidate)
        if tree is not None:
            _collect(tree, defs, imports)
            return defs, imports, True
    lines = code.splitlines()
    for k, line in enumerate(lines):
        if re.match(r"^\s*import\s+[\w.]|^\s*from\s+[\w.]+\s+import\s", line) and not line[:1].isspace():
            tree = parse_python(line.strip())
            if tree is not None:
                _collect(tree, defs, imports)
        m = re.match(r"^(\s*)(?:async\s+)?def\s+\w+\s*\(", line)
        if not m:
            continue
        indent = len(m.group(1))
        start = k
        while (
            start > 0
            and lines[start - 1].strip().startswith("@")
            and len(lines[start - 1]) - len(lines[start - 1].lstrip()) == indent
        ):
            start -= 1
        end = k + 1
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        tree = parse_python(textwrap.dedent("\n".join(lines[start:end])))
        if tree is not None:
            _collect(tree, defs, imports)
    return defs, imports, False


def merge_class(agent_completions: Sequence[str], item: Mapping[str, Any]) -> dict[str, Any]:
    """Merged program source and facts: ``code``, ``implemented`` (per agent: owned methods it implemented),
    ``parsed`` (per agent: the completion parsed as a whole)."""
    split = _agent_methods(item, len(agent_completions))
    header = list(item.get("import_statement") or [])
    implemented: list[list[str]] = []
    parsed: list[bool] = []
    chosen: dict[str, ast.AST] = {}
    for completion, own in zip(agent_completions, split):
        defs, imports, ok = parse_completion(completion)
        parsed.append(ok)
        header += [i for i in imports if i not in header]
        mine = [m for m in own if m in defs and not _is_stub(defs[m])]
        implemented.append(mine)
        chosen.update({m: defs[m] for m in mine})
    methods = [m for s in split for m in s]
    order = item.get("methods") or methods
    body = []
    for name in order:
        if name in chosen:
            body.append(textwrap.indent(ast.unparse(chosen[name]), "    "))
        else:
            body.append(f"    def {name}(self, *args, **kwargs):\n        {_STUB}")
    ctor = (item.get("class_constructor") or f"class {item.get('class_name') or 'Solution'}:").rstrip()
    code = "\n".join(header) + "\n\n" + ctor + "\n    pass\n\n" + "\n\n".join(body) + "\n"
    return {"code": code, "implemented": implemented, "parsed": parsed}


_RUNNER = """

def _run_test(_cls_name, _method):
    import unittest as _unittest

    _result = _unittest.TestResult()
    globals()[_cls_name](_method).run(_result)
    if _result.errors or _result.failures:
        _exc = (_result.errors or _result.failures)[0][1].strip().splitlines()[-1]
        raise AssertionError(_exc[:200])
    return _result.testsRun == 1
"""


def _strip_main(test_code: str) -> str:
    try:
        tree = ast.parse(test_code)
    except SyntaxError:
        return test_code
    keep = [n for n in tree.body if not (isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))]
    if len(keep) == len(tree.body):
        return test_code
    tree.body = keep
    return ast.unparse(tree)


def unittest_setup(item: Mapping[str, Any]) -> str:
    """Trusted setup of every test: the class's imports (``import_statement``, and the standard-library imports its
    tests need: ``trusted_imports``), the item's test module (without its ``__main__`` block) and the ``_run_test``
    helper; run by the sandbox's evaluator, never by the program. The tests take only the class under test from
    the program (docs/sandbox.md#names-a-test-uses)."""
    imports = [*(item.get("import_statement") or []), *(item.get("trusted_imports") or [])]
    return "\n".join([*imports, _strip_main(item.get("test") or ""), _RUNNER])


def unittest_snippets(cases: Sequence[tuple[str, str]]) -> list[str]:
    return [f"assert _run_test({c!r}, {m!r})" for c, m in cases]


def sandbox_job(merged_code: str, item: Mapping[str, Any], cases: Sequence[tuple[str, str]] | None = None) -> Any:
    """The sandbox job of a merged class: the class is the program; the item's test methods (``cases``, default
    all) run in the evaluator, where the class is a handle."""
    from comlrl_lightning.envs import sandbox

    tests = unittest_snippets(item["test_cases"] if cases is None else cases)
    return sandbox.Job(merged_code, tests, setup=unittest_setup(item), entry_points=(item.get("class_name") or "",))


# ------------------------------------------------------------------------------------------------ reward


def _items_for(n: int, batch_items: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    if not batch_items:
        raise ValueError("classeval reward needs batch_items (the dataset items with skeleton/test).")
    if len(batch_items) == 1:
        return [batch_items[0]] * n
    if len(batch_items) != n:
        raise ValueError(f"classeval reward got {n} joint completions but {len(batch_items)} batch_items.")
    return list(batch_items)


def _item(row: Mapping[str, Any]) -> Mapping[str, Any]:
    return row if "test_cases" in row and "methods" in row else _normalise(row)


def reward_components(row: Mapping[str, Any]) -> dict[str, float]:
    """One :meth:`ClassEvalReward.breakdown` row as the reward's named components (:data:`COMPONENTS`); they add up
    to ``row["total"]`` exactly (``level_tests`` takes the total's rounding to 10 decimals where it can, another level
    where it cannot: ``coding.components_summing_to``)."""
    return components_summing_to({name: float(row[name]) for name in COMPONENTS}, float(row["total"]), "level_tests")


class ClassEvalReward:
    """The leveled ClassEval reward (module docstring); ``timeout_per_test``, ``workers`` and other sandbox
    limits (``timeout_total``, ``memory_mb``, ``disk_mb``, ``max_timeouts``) go to ``sandbox.run_many``;
    ``sandbox_isolation="strict"`` refuses to run tests without the sandbox's kernel layers. ``components=True``
    returns each joint action's levels as named components (:func:`reward_components`) instead of the total."""

    reward_range = (REWARD_MIN, REWARD_MAX)

    def __init__(
        self,
        timeout_per_test: float = 5.0,
        workers: int = 2,
        timeout_total: float = 60.0,
        sandbox_isolation: Isolation = "best_effort",
        components: bool = False,
        **limits: Any,
    ):
        self.timeout_per_test = timeout_per_test
        self.workers = workers
        self.components = components
        self.limits = {"timeout_total": timeout_total, "isolation": sandbox_isolation, **limits}

    def run(self, jobs: Sequence[Any]) -> list[Any]:
        if not jobs:
            return []
        from comlrl_lightning.envs import sandbox

        return sandbox.run_many(jobs, workers=self.workers, timeout_per_test=self.timeout_per_test, **self.limits)

    def breakdown(
        self, *agent_completions: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        lists = [list(c) for c in agent_completions]
        if len(lists) < 2 or len({len(c) for c in lists}) != 1:
            raise ValueError("classeval reward needs ≥ 2 completion lists of equal length.")
        items = [_item(r) for r in _items_for(len(lists[0]), batch_items)]
        rows, jobs, job_rows = [], [], []
        for k, item in enumerate(items):
            merged = merge_class([c[k] for c in lists], item)
            contributed = all(merged["implemented"][i] for i in range(len(lists)))
            b = {
                "implemented": merged["implemented"],
                "parsed": merged["parsed"],
                "contributed": contributed,
                "syntax_ok": False,
                "syntax_error": None,
                "tests_run": False,
                "passed": 0,
                "total_tests": len(item["test_cases"]),
                "pass_ratio": 0.0,
                "timeouts": 0,
                "errors": [],
                "level_syntax": 0.0,
                "level_tests": 0.0,
                "bonus": 0.0,
                "penalty": 0.0,
                "total": 0.0,
                "program": "",
            }
            rows.append(b)
            if not any(merged["implemented"]):
                continue
            program = merged["code"]
            b["program"] = program
            error = compile_error(program, "<classeval>")
            if error is not None:
                b["syntax_error"] = str(error)[:200]
            b["syntax_ok"] = b["syntax_error"] is None
            b["level_syntax"] = 0.5 if b["syntax_ok"] and all(merged["parsed"]) else 0.0
            if b["syntax_ok"] and item["test_cases"]:
                jobs.append(sandbox_job(program, item))
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
            b["level_tests"] = 5.0 * b["pass_ratio"]
            b["bonus"] = 0.5 if b["contributed"] and res.passed > 0 else 0.0
            if res.timeouts > 0 or any(e in ("Timeout", "SandboxViolation") for e in res.errors):
                b["penalty"] = -0.2
        for b in rows:
            b["total"] = round(b["level_syntax"] + b["level_tests"] + b["bonus"] + b["penalty"], 10)
        return rows

    def __call__(
        self, *agent_completions: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
    ) -> list[float] | list[dict[str, float]]:
        rows = self.breakdown(*agent_completions, batch_items=batch_items)
        return [reward_components(b) for b in rows] if self.components else [b["total"] for b in rows]


_default_reward = ClassEvalReward()
_default_components = ClassEvalReward(components=True)


def classeval_reward(
    *agent_completions: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[float]:
    """Team reward of each joint action (see the module docstring)."""
    return _default_reward(*agent_completions, batch_items=batch_items)


classeval_reward.reward_range = (REWARD_MIN, REWARD_MAX)  # type: ignore[attr-defined]


def classeval_reward_components(
    *agent_completions: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, float]]:
    """:func:`classeval_reward` with each joint action's levels as named components (their sum is its reward)."""
    return _default_components(*agent_completions, batch_items=batch_items)


classeval_reward_components.reward_range = (REWARD_MIN, REWARD_MAX)  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------ transition


class CodeFeedbackTransition:
    """``code_feedback`` external transition (use with ``external_prompt_passthrough: true``).

    The trainer gives only the prompt (the skeleton); the item with its tests is looked up in ``tasks``
    (or, with ``load_default_tasks``, in :func:`classeval_default_tasks`). Unknown prompts get static feedback
    only (methods from the skeleton). ``max_failures`` test classes with failures are listed per agent, those
    testing its own methods first.
    """

    def __init__(
        self,
        tasks: Iterable[Mapping[str, Any]] | None = None,
        load_default_tasks: bool = False,
        timeout_per_test: float = 5.0,
        workers: int = 2,
        max_failures: int = 3,
        sandbox_isolation: Isolation = "best_effort",
    ):
        rows = list(tasks or []) + (classeval_default_tasks() if load_default_tasks else [])
        self.tasks = {r.get("prompt") or r.get("skeleton"): _item(r) for r in rows}
        self.reward = ClassEvalReward(
            timeout_per_test=timeout_per_test, workers=workers, sandbox_isolation=sandbox_isolation
        )
        self.max_failures = max_failures

    def _lookup(self, prompt: str) -> dict[str, Any]:
        item = self.tasks.get(prompt)
        return dict(item) if item is not None else _normalise({"skeleton": prompt})

    def __call__(
        self,
        prompt: str,
        agent_completions: Sequence[str],
        num_agents: int,
        prompt_history_per_agent: Sequence[Sequence[str]] | None = None,
        response_history_per_agent: Sequence[Sequence[str]] | None = None,
    ) -> list[str]:
        item = self._lookup(prompt)
        item["agent_methods"] = _agent_methods(item, num_agents)
        merged = merge_class(list(agent_completions), item)
        class_results: dict[str, tuple[int, int, list[str]]] = {}
        if any(merged["implemented"]) and item["test_cases"]:
            by_class: dict[str, list[tuple[str, str]]] = {}
            for c, m in item["test_cases"]:
                by_class.setdefault(c, []).append((c, m))
            names = list(by_class)
            jobs = [sandbox_job(merged["code"], item, by_class[n]) for n in names]
            for name, res in zip(names, self.reward.run(jobs)):
                class_results[name] = (res.passed, res.total, sorted(set(res.errors)))
        owner_of = {m.get("test_class"): m.get("method_name") for m in item.get("methods_info") or []}
        out = []
        for i in range(num_agents):
            own = item["agent_methods"][i]
            mate = [m for j, s in enumerate(item["agent_methods"]) if j != i for m in s]
            previous = strip_markdown(agent_completions[i]) if i < len(agent_completions) else ""
            lines = [f"- Your methods implemented: {', '.join(merged['implemented'][i]) or 'none'}"]
            missing = [m for m in own if m not in merged["implemented"][i]]
            if missing:
                lines.append(f"- Missing or empty: {', '.join(missing)}")
            if not merged["parsed"][i]:
                lines.append("- Your code does not parse as a whole (syntax error); only complete defs were used")
            if class_results:
                passed = sum(p for p, _, _ in class_results.values())
                total = sum(t for _, t, _ in class_results.values())
                lines.append(f"- Tests of the merged class passed: {passed}/{total}")
                failing = [(c, r) for c, r in class_results.items() if r[0] < r[1]]
                failing.sort(key=lambda cr: owner_of.get(cr[0]) not in own)
                for c, (p, t, errs) in failing[: self.max_failures]:
                    who = owner_of.get(c)
                    tag = f" (tests {who})" if who else ""
                    lines.append(f"  {c}{tag}: {p}/{t} passed; errors: {'; '.join(errs) or 'failed'}")
            else:
                lines.append("- Tests: not run (no implemented method or no tests available)")
            out.append(
                "\n".join(
                    [
                        prompt.rstrip(),
                        "",
                        f"Your methods: {', '.join(own) or '(none)'}; your teammate implements: {', '.join(mate) or '(none)'}",
                        "",
                        "Your previous code:",
                        previous or "(empty)",
                        "",
                        "Feedback:",
                        *lines,
                        "",
                        "Revise your methods accordingly. Output ONLY the Python code of your method definitions.",
                    ]
                )
            )
        return out


code_feedback_transition = CodeFeedbackTransition()


# ------------------------------------------------------------------------------------------------ eval


def classeval_eval_logger(
    agent_completions_turns: Sequence[Sequence[Sequence[str]]],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
    reward: ClassEvalReward | None = None,
    **_: Any,
) -> list[dict[str, Any]]:
    """Per eval sample ``{"sample": s, "turns": [breakdown per turn]}``; ``agent_completions_turns[i][s][t]``."""
    num_samples = len(agent_completions_turns[0]) if agent_completions_turns else 0
    out: list[dict[str, Any]] = [{"sample": s, "turns": []} for s in range(num_samples)]
    flat: list[list[str]] = [[] for _ in agent_completions_turns]
    items, index = [], []
    for s in range(num_samples):
        turns = min(len(a[s]) for a in agent_completions_turns)
        for t in range(turns):
            for i, a in enumerate(agent_completions_turns):
                flat[i].append(a[s][t])
            items.append(batch_items[s] if batch_items and len(batch_items) > 1 else (batch_items or [{}])[0])
            index.append(s)
    if index:
        for s, row in zip(index, (reward or _default_reward).breakdown(*flat, batch_items=items)):
            row.pop("program", None)
            out[s]["turns"].append(row)
    return out


def classeval_eval_aggregator(metrics: Sequence[Mapping[str, Any]], num_turns: int | None = None) -> dict[str, float]:
    """Per turn means: ``turn_t/pass_rate``, ``turn_t/all_passed_rate``, ``turn_t/syntax_rate``,
    ``turn_t/cooperation_rate`` and ``turn_t/avg_total_reward``."""
    return per_turn_means(
        metrics,
        num_turns,
        {
            "pass_rate": lambda r: r["pass_ratio"],
            "all_passed_rate": all_passed,
            "syntax_rate": lambda r: float(r["level_syntax"] > 0),
            "cooperation_rate": lambda r: float(r["contributed"]),
            "avg_total_reward": lambda r: r["total"],
        },
    )
