"""ClassEval env: loader, method split, merger, reward levels, code_feedback transition, eval metrics, config."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from comlrl_lightning.envs import classeval as ce

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CE_FILE = SHARED / "classeval" / "ClassEval_data.json.gz"
needs_data = pytest.mark.skipif(not CE_FILE.exists(), reason=f"shared ClassEval data not found under {SHARED}")

TOY = {
    "skeleton": "class Acc:\n    def __init__(self):\n        self.v = 0\n\n    def add(self, x):\n        '''add'''\n\n"
    "    def get(self):\n        '''get'''\n\n    def spin(self):\n        '''loop'''\n",
    "class_constructor": "class Acc:\n    def __init__(self):\n        self.v = 0\n",
    "test": "import unittest\n\nclass AccTest(unittest.TestCase):\n    def test_add(self):\n        a = Acc()\n"
    "        a.add(2)\n        self.assertEqual(a.get(), 2)\n\n    def test_spin(self):\n"
    "        self.assertEqual(Acc().spin(), 1)\n\nif __name__ == '__main__':\n    unittest.main()\n",
}
FAST = ce.ClassEvalReward(timeout_per_test=0.5, workers=2, timeout_total=20)


def canonical_split(item):
    cls = next(n for n in ast.parse(item["solution_code"]).body if isinstance(n, ast.ClassDef))
    defs = {f.name: ast.unparse(f) for f in cls.body if isinstance(f, ast.FunctionDef)}
    return ["\n\n".join(defs[m] for m in own) for own in item["agent_methods"]]


def test_split_methods_rule():
    assert ce.split_methods(["a", "b", "c"]) == [["a", "b"], ["c"]]
    assert ce.split_methods(["a", "b", "c", "d"]) == [["a", "b"], ["c", "d"]]
    assert ce.split_methods(["a"]) == [["a"], []]
    assert ce.split_methods([]) == [[], []]
    assert ce.skeleton_methods(TOY["skeleton"]) == ["add", "get", "spin"]


def test_merger_edge_cases():
    item = ce._normalise(TOY)
    assert item["agent_methods"] == [["add", "get"], ["spin"]] and item["test_cases"] == [
        ("AccTest", "test_add"),
        ("AccTest", "test_spin"),
    ]
    a0 = (
        "```python\nimport math\nclass Acc:\n    def add(self, x):\n        self.v += x\n    def spin(self):\n"
        "        return 99\n```"
    )
    a1 = "def spin(self):\n    return 1\ndef broken(:\n"  # malformed: salvaged def by def
    m = ce.merge_class([a0, a1], item)
    assert m["implemented"] == [["add"], ["spin"]] and m["parsed"] == [True, False]
    assert "import math" in m["code"] and "return 1" in m["code"] and "return 99" not in m["code"]
    assert "def get(self, *args, **kwargs)" in m["code"]  # unimplemented -> stub
    compile(m["code"], "x", "exec")
    stubs = ce.merge_class(["def add(self, x):\n    '''doc'''\n    pass", ""], item)
    assert stubs["implemented"] == [[], []]


def test_reward_levels_on_toy_item_and_timeout():
    good = ["def add(self, x):\n    self.v += x\n\ndef get(self):\n    return self.v", "def spin(self):\n    return 1"]
    loop = [
        "def add(self, x):\n    self.v += x\n\ndef get(self):\n    return self.v",
        "def spin(self):\n    while True:\n        pass",
    ]
    rows = FAST.breakdown(
        [good[0], loop[0], "", "def add(self, x) self.v"], [good[1], loop[1], "nonsense", ""], batch_items=[TOY] * 4
    )
    assert [r["total"] for r in rows][0] == 6.0  # 0.5 + 1.0 * 5 + 0.5
    assert rows[1]["passed"] == 1 and rows[1]["timeouts"] == 1
    assert rows[1]["total"] == pytest.approx(0.5 + 2.5 + 0.5 - 0.2)
    assert rows[2]["total"] == 0.0 and not rows[2]["tests_run"]  # garbage: gate
    assert rows[3]["total"] == 0.0  # syntax error, nothing salvageable
    assert ce.classeval_reward.reward_range == (-0.2, 6.0)


def test_syntax_error_in_one_agent_loses_syntax_level():
    rows = FAST.breakdown(
        ["def add(self, x):\n    self.v += x\ndef get(self):\n    return self.v\nx = (\n"],
        ["def spin(self):\n    return 1"],
        batch_items=[TOY],
    )
    assert rows[0]["parsed"] == [False, True] and rows[0]["level_syntax"] == 0.0
    assert rows[0]["total"] == pytest.approx(5.0 + 0.5)


def test_transition_prompts_and_eval_metrics():
    tr = ce.CodeFeedbackTransition(tasks=[TOY], timeout_per_test=0.5)
    out = tr(TOY["skeleton"], ["def add(self, x):\n    self.v += x", "def spin(self):\n    return 2"], 2)
    assert len(out) == 2 and out[0].startswith(TOY["skeleton"].rstrip())
    assert "Your methods: add, get" in out[0] and "Missing or empty: get" in out[0]
    assert "Tests of the merged class passed: 0/2" in out[1] and "AccTest" in out[1]
    static = ce.code_feedback_transition(TOY["skeleton"], ["", "x"], 2)
    assert "Tests: not run" in static[0]
    per = ce.classeval_eval_logger(
        [
            [["", "def add(self, x):\n    self.v += x\ndef get(self):\n    return self.v"]],
            [["", "def spin(self):\n    return 1"]],
        ],
        batch_items=[TOY],
        reward=FAST,
    )
    agg = ce.classeval_eval_aggregator(per, num_turns=2)
    assert agg["turn_1/avg_total_reward"] == 0.0 and agg["turn_2/pass_rate"] == 1.0
    assert {"turn_1/pass_rate", "turn_1/syntax_rate", "turn_1/avg_total_reward"} <= set(agg)


@needs_data
def test_loader_and_canonical_solution_reward():
    items = ce.classeval_tasks(str(CE_FILE))
    assert len(items) == 100
    item = items[0]
    assert item["prompt"] == item["skeleton"] and item["class_name"] == "AccessGatewayFilter"
    assert item["agent_methods"] == [["filter", "is_start_with"], ["get_jwt_user", "set_current_user_info_and_log"]]
    assert "Your methods: filter, is_start_with" in ce.classeval_agent0_prompt(item)
    a0, a1 = canonical_split(item)
    rows = ce.ClassEvalReward(timeout_per_test=5.0).breakdown([a0, ""], [a1, a1], batch_items=[item])
    # canonical: 0.5 syntax + 1.0 * 5.0 + 0.5 cooperation = 6.0 (max); agent 0 empty: gate passes via agent 1
    assert rows[0]["passed"] == rows[0]["total_tests"] == len(item["test_cases"]) > 0
    assert rows[0]["total"] == 6.0
    assert rows[1]["bonus"] == 0.0 and rows[1]["pass_ratio"] < 1.0
    assert len(ce.classeval_eval_tasks()) == 16 and all(ce.is_stdlib_only(i) for i in ce.classeval_train_tasks())


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="local copy"):
        ce.classeval_tasks("no-such-org/no-such-dataset-xyz")
    with pytest.raises(FileNotFoundError):
        ce.classeval_tasks("/nonexistent/ClassEval_data.json.gz")


def test_classeval_config_parses(capsys):
    from comlrl_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "classeval_magrpo.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "comlrl_lightning.envs.classeval.classeval_reward" in out and "shift: -6.0" in out


# Reference solutions (``solution_code``) that do not pass every one of their tests in the sandbox, and why:
REFERENCE_FAILURES = {
    "ClassEval_17",  # its "upcoming events" test expects dates in 2024 to lie in the future
    "ClassEval_25",  # test_load_cookies* read cookies.json written by another test; each test starts in an empty dir
    "ClassEval_48",  # needs the network (gethostbyname/gethostname of real hosts)
    "ClassEval_84",  # replaces the object's methods with unittest.mock.MagicMock: a test's own objects stay outside
}
# 20: the test stamps datetime.now() to the second before the method stamps its own, and fails when a second ends
# between the two (seen under load); 35: an A* search near the time limit; 58: random mines may coincide.
FLAKY = {"ClassEval_20", "ClassEval_35", "ClassEval_58"}


@needs_data
def test_reference_solutions_pass_classeval():
    """The 88 stdlib-only reference solutions, run as programs against their own unittest methods: all but the
    listed ones pass every test (84 of 88; before the trusted evaluator it was 85: ClassEval_50 failed as root,
    whose writes ignore read-only modes, and now passes under the sandbox's own uid; 25 and 84 fail for the
    reasons above)."""
    items = [it for it in ce.classeval_tasks(str(CE_FILE)) if ce.is_stdlib_only(it)]
    assert len(items) == 88
    reward = ce.ClassEvalReward(timeout_per_test=20.0, workers=2, timeout_total=300.0)
    results = reward.run([ce.sandbox_job(it["solution_code"], it) for it in items])
    failing = {it["task_id"] for it, r in zip(items, results) if not (r.total > 0 and r.passed == r.total)}
    assert failing - FLAKY == REFERENCE_FAILURES, failing
    assert sum(r.passed for r in results) >= 1966 - 20
