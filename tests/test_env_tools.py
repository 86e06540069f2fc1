"""BFCL v4 native parallel function calling: loader, formatter, call parser, merge, reward, eval, fit, config."""

from __future__ import annotations

import csv
import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bfcl_eval") is None, reason="bfcl-eval is not installed (pip install --no-deps bfcl-eval)"
)

from comlrl_lightning.envs import tools as T  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# parallel_0: two spotify.play calls (artist/duration), the ground truth
A = 'spotify.play(artist="Taylor Swift", duration=20)'
B = 'spotify.play(artist="Maroon 5", duration=15)'


@pytest.fixture(scope="module")
def items():
    return T.bfcl_tasks()


@pytest.fixture(scope="module")
def item(items):
    it = items[0]
    assert it["id"] == "parallel_0"
    assert it["ground_truth"] == [
        {"spotify.play": {"artist": ["Taylor Swift"], "duration": [20]}},
        {"spotify.play": {"artist": ["Maroon 5"], "duration": [15]}},
    ]
    return it


# ------------------------------------------------------------------------------------------- loading


def test_loader_categories_and_fields(items):
    counts = {c: sum(it["official_category"] == c for it in items) for c in T.CATEGORIES}
    assert counts == {"parallel": 200, "parallel_multiple": 200, "live_parallel": 16, "live_parallel_multiple": 24}
    for it in items:
        assert it["prompt"] and it["function"] and it["ground_truth"]
    assert T.bfcl_tasks("live_parallel", limit=3)[2]["official_category"] == "live_parallel"
    assert len(T.bfcl_train_tasks()) + len(T.bfcl_eval_tasks()) == 440
    assert {it["id"] for it in T.bfcl_train_tasks()}.isdisjoint(it["id"] for it in T.bfcl_eval_tasks())


def test_loader_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="parallel"):
        T.bfcl_tasks(path=tmp_path)


def test_formatter_role_modes(item):
    texts = {m: [T.BFCLFormatter(i, 2, m)(item) for i in range(2)] for m in T.ROLE_MODES}
    for p0, p1 in texts.values():
        for p in (p0, p1):
            assert item["prompt"] in p and '"name": "spotify.play"' in p and "Category: parallel" in p
            assert "exactly []" in p and "one per line" in p and "decentralized" in p
    assert "agent 1 of 2" in texts["self_select"][0] and "agent 2 of 2" in texts["self_select"][1]
    assert "non-empty subset" in texts["self_select"][0]
    assert "positions 1, 3, 5" in texts["odd_even"][0] and "positions 2, 4, 6" in texts["odd_even"][1]
    assert "part 1 of 2" in texts["split_by_order"][0] and "part 2 of 2" in texts["split_by_order"][1]
    assert T.bfcl_agent_1_prompt(item) == texts["self_select"][1]
    with pytest.raises(ValueError, match="role_mode"):
        T.BFCLFormatter(0, 2, "chaos")


# --------------------------------------------------------------------------------------------- parser


def test_parser_edge_cases(item):
    fns = item["function"]
    p = T.parse_calls("```python\n[spotify.play(artist='X', duration=1), spotify.play(artist='Y', duration=2)]\n```")
    assert p.calls == [
        ("spotify.play", {"artist": "X", "duration": 1}),
        ("spotify.play", {"artist": "Y", "duration": 2}),
    ]
    assert p.ok and p.malformed == 0
    for empty in ("[]", "  []\n", "```\n[]\n```"):
        e = T.parse_calls(empty)
        assert e.empty and e.ok and e.calls == []
    assert not T.parse_calls("").ok and not T.parse_calls("I cannot help.").ok  # nothing parsed
    # one per line, prose ignored, trailing commas, a multi-line call, malformed lines skipped and counted
    text = "Here are the calls:\nf(a=1),\nf(a=1)\ng(b=[1,\n  2])\nh(x=foo(1))\nbroken(a=1\nk(**kw)\n"
    p = T.parse_calls(text)
    assert p.calls == [("f", {"a": 1}), ("f", {"a": 1}), ("g", {"b": [1, 2]})]
    assert p.malformed == 3 and not p.ok  # h (non-literal), broken (unclosed), k (**kwargs)
    # positional arguments take the schema's parameter names, else _arg<k>; bare names become strings
    assert T.parse_calls('spotify.play("Maroon 5", 15)', fns).calls == [
        ("spotify.play", {"artist": "Maroon 5", "duration": 15})
    ]
    assert T.parse_calls("f(1, unit=celsius)").calls == [("f", {"_arg0": 1, "unit": "celsius"})]
    # duplicates are kept by the parser and removed by dedupe
    uniq, dups = T.dedupe_calls(T.parse_calls(f"{A}\n{A}\n{B}").calls)
    assert dups == 1 and [c[1]["artist"] for c in uniq] == ["Taylor Swift", "Maroon 5"]


def test_parser_caps_and_hostile_shapes(item):
    """A completion over MAX_COMPLETION_CHARS characters or with over MAX_CALLS calls is one malformed answer,
    scored as score_joint scores what it cannot parse; the shapes that were quadratic (a long line of backticks,
    an unclosed call over many lines) parse as before, in one pass."""
    over = "f(a=1)\n" + " " * T.MAX_COMPLETION_CHARS
    p = T.parse_calls(over)
    assert (p.calls, p.malformed, p.ok) == ([], 1, False)
    calls = [f"f(a={i})" for i in range(T.MAX_CALLS + 1)]
    for text in ("\n".join(calls), "[" + ", ".join(calls) + "]", "```\n" + "\n".join(calls) + "\n```"):
        p = T.parse_calls(text)
        assert (p.calls, p.malformed) == ([], 1)
        assert len(T.parse_calls(text.replace(calls[-1], "")).calls) == T.MAX_CALLS
    b = T.score_joint([over, f"{A}\n{B}"], item)
    assert b["parse"] == 0.5 and b["malformed"] == 1 and b["exact"] == 1.0
    # fences are found as the regex they replace found them
    fence = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)
    for text in ["`" * 100, "`" * 100 + "\nf(a=1)", "```py\nf()\n```x\n```\ng()", "a```\n```", "````\nf()`", "```"]:
        assert T._fenced_blocks(text) == fence.findall(text), text
    assert T.parse_calls("`" * 65536 + "\nf(a=1)").calls == [("f", {"a": 1})]
    p = T.parse_calls("f(\n" + " a=1,\n" * 5000 + "g(b=2)")  # an unclosed call, then a new one
    assert (p.calls, p.malformed) == ([("g", {"b": 2})], 1)


def test_merge_overlap_and_conflict():
    a = T.parse_calls("f(a=1)\ng(x='u')\nf(a=1)").calls
    b = T.parse_calls("g(x='u')\ng(x='v')").calls
    m = T.merge_calls([a, b])
    assert m.calls == [("f", {"a": 1}), ("g", {"x": "u"}), ("g", {"x": "v"})]
    assert [len(c) for c in m.per_agent] == [2, 2]  # agent 0's duplicate f removed
    assert m.overlap == 1  # g(x='u') from both agents
    assert m.conflicts == ["g"]  # g called with different arguments by different agents
    assert T.merge_calls([[("f", {"a": 1})], []]).conflicts == []


def test_value_matching():
    assert T.value_matches("San Francisco, CA", "san francisco ca") and T.value_matches(20.0, 20)
    assert not T.value_matches(True, 1) and not T.value_matches("20", 20)
    assert T.value_matches([3, 5], [3, 5]) and not T.value_matches([3], [3, 5])
    truth = {"loc": ["Beijing, China"], "unit": ["", "fahrenheit"]}
    assert T.args_score({"loc": "Beijing, China"}, truth) == 1.0  # optional omitted
    assert T.args_score({"loc": "Beijing, China", "unit": "kelvin"}, truth) == 0.5
    assert T.args_score({"loc": "Beijing, China", "extra": 1}, truth) == pytest.approx(2 / 2.5)
    nested = {"prefs": [{"size": ["large"], "milk": ["", "almond"]}]}
    assert T.args_score({"prefs": {"size": "Large"}}, nested) == 1.0
    assert T.args_score({"prefs": {"size": "small"}}, nested) == 0.0


# --------------------------------------------------------------------------------------------- reward

# Weights: parse .05, name F1 .25, args .35, count .10, balance .15, exact .20,
#          overlap −.20, lazy −.15, extra −.05, duplicate −.05
CASES = {
    # ground truth split evenly: every positive term 1, no penalty = .05+.25+.35+.10+.15+.20 = 1.10 (the maximum)
    "even_split": (A, B, 1.10),
    # same, agent 2 with positional args mapped to the schema → 1.10
    "positional": (A, 'spotify.play("Maroon 5", 15)', 1.10),
    # agent 2 lazy ([]): balance 0 (counts 2/0), lazy 1/2 → 1.10 − .15 − .15·.5 = 0.875
    "lazy": (f"{A}\n{B}", "[]", 0.875),
    # both make both calls: overlap 2/4 → 1.10 − .20·.5 = 1.00
    "overlap": (f"{A}\n{B}", f"{B}\n{A}", 1.00),
    # an extra call: 3 merged vs 2: F1 = 2·(2/3·1)/(2/3+1) = .8 → .20; args 2/2 → .35; count 1 − 1/2 → .05;
    # balance 2/1 is the most even split of 3 → .15; exact 0; extra 1/3 → −.05/3; parse .05
    # → .05 + .20 + .35 + .05 + .15 − .016667 = 0.783333
    "extra_call": (f"{A}\nspotify.play(artist='Adele', duration=10)", B, 0.05 + 0.20 + 0.35 + 0.05 + 0.15 - 0.05 / 3),
    # agent 1 repeats its call: duplicate rate 1/3 → 1.10 − .05/3 = 1.083333
    "duplicate": (f"{A}\n{A}", B, 1.10 - 0.05 / 3),
    # wrong duration in the second call: its arg score 1/2 → args (1 + .5)/2 = .75 → .2625; exact 0
    # → .05 + .25 + .2625 + .10 + .15 = 0.8125
    "wrong_args": (A, 'spotify.play(artist="Maroon 5", duration=25)', 0.8125),
    # agent 2 malformed (unquoted string): parse 1/2 → .025; F1 (P 1, R 1/2) = 2/3 → .166667; args 1/2 → .175;
    # count 1/2 → .05; balance with T = 1 is 1 → .15; lazy 1/2 → −.075; exact 0 → 0.491667
    "malformed": (A, "spotify.play(artist=Maroon 5, duration=15)", 0.025 + 0.25 * 2 / 3 + 0.175 + 0.05 + 0.15 - 0.075),
}


def test_reward_hand_totals(item):
    names = list(CASES)
    c0 = [CASES[n][0] for n in names]
    c1 = [CASES[n][1] for n in names]
    rows = T.bfcl_reward_breakdown(c0, c1, batch_items=[item])
    for name, b in zip(names, rows):
        assert b["total"] == pytest.approx(CASES[name][2], abs=1e-9), (name, b)
    assert T.bfcl_reward(c0, c1, batch_items=[item] * len(names)) == pytest.approx([CASES[n][2] for n in names])
    by = dict(zip(names, rows))
    assert by["lazy"]["balance"] == 0.0 and by["lazy"]["lazy_rate"] == 0.5
    assert by["overlap"]["overlap_rate"] == 0.5 and by["overlap"]["exact"] == 1.0
    assert by["extra_call"]["name_f1"] == pytest.approx(0.8) and by["extra_call"]["extra_rate"] == pytest.approx(1 / 3)
    assert by["duplicate"]["duplicates"] == 1 and by["wrong_args"]["arg_match"] == 0.75
    assert by["malformed"]["malformed"] == 1 and by["malformed"]["parse"] == 0.5


def test_reward_range_and_errors(item, items):
    assert T.bfcl_reward.reward_range == (-0.4, 1.2)
    junk = ["", "[]", "nonsense(", "x(a=1)\nx(a=1)\ny(b=2)", A, f"{A}\n{A}\n{B}\nfoo()"]
    for a in junk:
        for b in junk:
            for it in (item, items[250]):
                r = T.bfcl_reward([a], [b], batch_items=[it])[0]
                assert -0.4 <= r <= 1.2
    # both empty: parse 1 → .05, balance 0, lazy (2 − 0)/2 → −.15 → −0.10
    assert T.bfcl_reward(["[]"], ["[]"], batch_items=[item]) == pytest.approx([-0.10])
    with pytest.raises(ValueError, match="batch_items"):
        T.bfcl_reward([A], [B])
    with pytest.raises(ValueError, match="differ in length"):
        T.bfcl_reward([A, A], [B], batch_items=[item])


def test_reward_parallel_multiple_item(items):
    it = next(i for i in items if i["id"] == "parallel_multiple_0")
    a = "math_toolkit.sum_of_multiples(lower_limit=1, upper_limit=1000, multiples=[3, 5])"
    b = "math_toolkit.product_of_primes(count=5)"
    assert T.bfcl_reward([a], [b], batch_items=[it]) == pytest.approx([1.10])
    # the right names with each other's arguments: F1 1 → .25; each call matched with score 0 → args 0, no extra;
    # count .10; balance .15; parse .05; exact 0 → 0.55
    swapped = (
        "math_toolkit.product_of_primes(lower_limit=1, upper_limit=1000, multiples=[3, 5])",
        "math_toolkit.sum_of_multiples(count=5)",
    )
    assert T.bfcl_reward([swapped[0]], [swapped[1]], batch_items=[it])[0] == pytest.approx(0.55)


# ----------------------------------------------------------------------------------------------- eval


def test_eval_logger_and_aggregator(item):
    metrics = T.bfcl_eval_logger([[[A], [f"{A}\n{B}"]], [[B], ["[]"]]], batch_items=[item, item])
    assert metrics[0]["turn_1/total"] == pytest.approx(1.10) and metrics[1]["turn_1/total"] == pytest.approx(0.875)
    agg = T.bfcl_eval_aggregator(metrics)
    for name in (
        "total",
        "parse",
        "name_f1",
        "arg_match",
        "count_match",
        "balance",
        "exact",
        "overlap_rate",
        "lazy_rate",
        "extra_rate",
        "duplicate_rate",
        "num_calls",
        "malformed",
    ):
        assert f"turn_1/avg_{name}" in agg
    assert agg["turn_1/avg_total"] == pytest.approx((1.10 + 0.875) / 2)
    assert agg["turn_1/avg_exact"] == 1.0 and agg["turn_1/avg_lazy_rate"] == 0.25


# ------------------------------------------------------------------------------------------ fit / config


def test_magrpo_fit_on_real_bfcl_items(tmp_path, items):
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger

    from comlrl_lightning import MAGRPO, TaskDataModule

    seed_everything(0)
    chosen = [items[0], items[200]]
    seen = []

    def reward(c0, c1, batch_items=None):
        seen.extend(it["id"] for it in batch_items)
        return T.bfcl_reward(c0, c1, batch_items=batch_items)

    reward.reward_range = T.bfcl_reward.reward_range
    module = MAGRPO(
        agents="tiny",
        num_agents=2,
        reward_func=reward,
        formatters=T.bfcl_formatters(2),
        use_chat_template=False,
        num_generations=2,
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        rollout_buffer_size=2,
        agent_learning_rate=1e-3,
        eval_interval=2,
        eval_num_samples=2,
        eval_logger=T.bfcl_eval_logger,
        eval_aggregator=T.bfcl_eval_aggregator,
        log_completions=False,
    )
    trainer = Trainer(
        max_steps=1,
        logger=CSVLogger(tmp_path, name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(
        module, datamodule=TaskDataModule(dataset=chosen, eval_dataset=chosen, prompts_per_step=2, eval_batch_size=2)
    )
    assert len(seen) >= 2 * 2 and set(seen) <= {"parallel_0", "parallel_multiple_0"}
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert "eval/turn_1/avg_total" in set(rows[0])


def test_bfcl_config_parses(capsys):
    from comlrl_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "bfcl_magrpo.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "comlrl_lightning.envs.tools.bfcl_reward" in out and "joint_mode: aligned" in out
