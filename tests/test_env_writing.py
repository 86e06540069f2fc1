"""Writing env (TL;DR, arXiv): leveled gated rewards on hand-built texts, real shared items, eval metrics, a fit."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from comlrl_lightning import MAGRPO, TaskDataModule
from comlrl_lightning.envs import writing as w

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TLDR_FILE = SHARED / "tldr" / "tldr_sample.jsonl.gz"
ARXIV_FILE = SHARED / "arxiv_abstract" / "scitldr_abstracts.jsonl.gz"
needs_data = pytest.mark.skipif(
    not (TLDR_FILE.exists() and ARXIV_FILE.exists()),
    reason=f"shared writing data not found under {SHARED} (../shared/data)",
)


def distinct(lengths, prefix):
    """Distinct words ``prefix`` + zero-padded index, word k having ``lengths[k]`` characters (no transitions)."""
    return [f"{prefix}{k:0{n - 1}d}" for k, n in enumerate(lengths)]


def join(*parts):
    return " ".join(x for p in parts for x in p)


# ------------------------------------------------------------------------------------------------ pieces
def test_trapezoid_ramps_and_gates():
    win = (1.1, 1.6, 3.2, 5.0)
    assert w.trapezoid(2.0, win) == 1.0 and w.trapezoid(1.6, win) == 1.0 and w.trapezoid(3.2, win) == 1.0
    assert w.trapezoid(1.35, win) == pytest.approx(0.5)  # (1.35 - 1.1) / 0.5
    assert w.trapezoid(4.1, win) == pytest.approx(0.5)  # (5.0 - 4.1) / 1.8
    assert w.trapezoid(1.1, win) == 0.0 and w.trapezoid(5.0, win) == 0.0  # edges: 0 but the gate passes
    assert w.trapezoid(1.09, win) is None and w.trapezoid(5.01, win) is None and w.trapezoid(None, win) is None
    assert w.trapezoid(50.0, w.TLDR_SPEC.unique_window) == 1.0  # no upper ramp for the TL;DR vocabulary


def test_transition_categories_word_boundaries_and_score():
    assert w.transition_categories("Ifrit ate butter; thesis whenever") == []  # no partial-word matches
    assert w.transition_categories("ALSO, as a\nresult") == ["addition", "effect"]
    assert w.transition_score("plain words") == 0.0
    assert w.transition_score("however") == pytest.approx(0.4)
    assert w.transition_score("however, therefore, for example") == pytest.approx(0.5)  # 0.4 + 2 * 0.05
    every = " ".join(phrases[0] for phrases in w.TRANSITION_CATEGORIES.values())
    assert len(w.TRANSITION_CATEGORIES) == 12 and w.transition_score(every) == pytest.approx(0.95)


def test_jaccard_ignores_stopwords_and_case():
    assert w.content_jaccard("The cat and THE dog", "a cat with a bird") == pytest.approx(1 / 3)  # {cat}/{cat,dog,bird}
    assert w.content_jaccard("the and", "of a") == 0.0  # no content words at all
    assert w.unique_word_ratio("a a b", "C c d e") == pytest.approx(1.5) and w.unique_word_ratio("...", "x") is None


# ------------------------------------------------------------------------------------------------ TL;DR
C1_49 = join(distinct([4] * 10, "k"))  # 10 words of 4 chars: 49 characters, 10 tokens, 10 distinct words
C1_40 = join(distinct([4] * 7 + [5], "k"))  # 8 tokens, 7*4 + 5 + 7 spaces = 40 characters, 8 distinct words


def test_tldr_full_pass():
    c2 = join(["k000"], distinct([4] * 19, "m"), ["however", "therefore", "for", "example"])
    # c2: 24 tokens, 20*4 + 7 + 9 + 3 + 7 + 23 spaces = 129 chars -> ratio 129/49 = 2.63 in [1.6, 3.2]: +1.0
    # distinct words 24 / 10 = 2.4 >= 2.0: +0.5
    # transitions contrast, effect, example: 0.4 + 2 * 0.05 = 0.5 -> 0.4 * 0.5 = 0.2
    # content words: c1 10, c2 23 (minus "for"), shared {k000}: J = 1/32 = 0.03125 >= 0.03 -> 0.6
    # total 0.5 + 1.0 + 0.5 + 0.2 + 0.6 = 2.8
    assert len(c2) == 129
    b = w.tldr_reward_breakdown(C1_49, c2)
    assert b["levels_passed"] == 4 and b["jaccard"] == pytest.approx(1 / 32)
    assert w.tldr_reward([C1_49], [c2]) == [pytest.approx(2.8)]
    assert b["total"] == pytest.approx(2.8) and b["ungated_total"] == pytest.approx(2.8)


def test_tldr_lower_ramps():
    c2 = join(distinct([4] * 11, "m"))  # 11 tokens, 54 chars, 11 distinct words
    # ratio 54/40 = 1.35 -> (1.35 - 1.1)/0.5 = 0.5; distinct 11/8 = 1.375 -> 0.5 * (1.375 - 1.3)/0.7 = 0.0535714
    # style: no transition, J = 0 -> 0;  total 0.5 + 0.5 + 0.0535714 = 1.0535714
    assert len(C1_40) == 40 and len(c2) == 54
    assert w.tldr_reward([C1_40], [c2]) == [pytest.approx(0.5 + 0.5 + 0.5 * 0.075 / 0.7)]


def test_tldr_upper_ramp_then_vocabulary_gate_stops_style():
    c2 = "however" + " m000" * 31  # 32 tokens, 7 + 5*31 = 162 chars, 2 distinct words
    # ratio 162/40 = 4.05 -> 1 - (4.05 - 3.2)/1.8 = 0.527778; distinct 2/8 = 0.25 < 1.3: gate fails, stop
    # total 0.5 + 0.527778 = 1.027778; ungated adds style 0.4 * 0.4 (one category) = 0.16
    b = w.tldr_reward_breakdown(C1_40, c2)
    assert b["total"] == pytest.approx(0.5 + (1 - 0.85 / 1.8))
    assert (b["level_3"], b["level_4"], b["passed_level_3"], b["levels_passed"]) == (0.0, 0.0, False, 2)
    assert b["ungated_level_4"] == pytest.approx(0.16)
    assert b["ungated_total"] == pytest.approx(0.5 + (1 - 0.85 / 1.8) + 0.16)


def test_tldr_edge_of_a_ramp_adds_zero_but_continues():
    c2 = join(["however"], distinct([7] * 12, "m"))  # 13 distinct words of 7 chars: 91 + 12 = 103 chars
    # ratio 103/49 = 2.10: +1.0; distinct 13/10 = 1.3 exactly: ramp edge, +0 but level 4 is reached
    # style: contrast only -> 0.4 * 0.4 = 0.16, J = 0;  total 0.5 + 1.0 + 0 + 0.16 = 1.66
    assert len(c2) == 103
    b = w.tldr_reward_breakdown(C1_49, c2)
    assert b["passed_level_3"] and b["level_3"] == 0.0 and b["total"] == pytest.approx(1.66)


@pytest.mark.parametrize(
    "c1, c2, expected",
    [
        (join(distinct([4] * 7, "k")), join(distinct([4] * 20, "m")), 0.0),  # c1 has 7 tokens < 8: stop at L1
        (C1_40, "m000 " * 257, 0.0),  # c2 has 257 tokens > 256: stop at L1
        (C1_40, join(distinct([4] * 8, "m")), 0.5),  # ratio 39/40 < 1.1: L2 gate fails
        (C1_40, "m000 " * 45, 0.5),  # ratio 225/40 = 5.6 > 5.0: L2 gate fails
    ],
)
def test_tldr_gates(c1, c2, expected):
    assert w.tldr_reward([c1], [c2]) == [pytest.approx(expected)]


def test_tldr_reward_batches_and_range():
    # empty pair: 0 tokens, stop at L1 -> 0; identical pair: ratio 1.0 < 1.1, stop at L2 -> 0.5
    assert w.tldr_reward(["", C1_40], ["", C1_40], batch_items=[{}, {}]) == [0.0, 0.5]
    assert w.tldr_reward.reward_range == (0.0, 3.0) and w.arxiv_reward.reward_range == (0.0, 3.0)


# ------------------------------------------------------------------------------------------------ arXiv
A1 = join(distinct([4] * 127 + [5], "a"))  # 128 tokens, 127*4 + 5 + 127 spaces = 640 chars, 128 distinct words


def test_arxiv_full_pass_without_transitions():
    c2 = join(distinct([4] * 10, "a"), distinct([4] * 117 + [5], "b"))  # 128 tokens, 640 chars
    # ratio 1.0 -> +1.0; distinct 128/128 = 1.0 in [0.7, 1.3] -> +0.5
    # no transition -> 0; J = 10 shared / 246 = 0.0407 >= 0.03 -> 0.6;  total 0.5 + 1 + 0.5 + 0.6 = 2.6
    assert len(c2) == 640
    assert w.arxiv_reward([A1], [c2]) == [pytest.approx(2.6)]


def test_arxiv_lower_ramps():
    # c2: 128 tokens; 80 distinct words (65 of 4 chars, 15 of 3) then 48 repeats of the 3-char "b65"
    # chars: 65*4 + 63*3 + 127 spaces = 576 -> ratio 0.9 -> (0.9 - 0.8)/0.2 = 0.5
    # distinct 80/128 = 0.625 -> 0.5 * (0.625 - 0.5)/0.2 = 0.3125;  style 0;  total 0.5 + 0.5 + 0.3125 = 1.3125
    c2 = join(distinct([4] * 65 + [3] * 15, "b"), ["b65"] * 48)
    assert len(c2) == 576 and w.count_tokens(c2) == 128
    assert w.arxiv_reward([A1], [c2]) == [pytest.approx(1.3125)]


def test_arxiv_upper_ramps_with_style():
    # c2: 192 distinct words (129 of 4 chars, 63 of 3), 705 + 191 spaces = 896 chars -> ratio 1.4
    #   -> 1 - (1.4 - 1.3)/0.2 = 0.5;  distinct 192/128 = 1.5 -> 0.5 * (1 - (1.5 - 1.3)/0.4) = 0.25
    # style: "c00".."c61" contain no transition; last 3-char word replaced by "yet" (contrast) -> 0.4 * 0.4 = 0.16
    # J = 0;  total 0.5 + 0.5 + 0.25 + 0.16 = 1.41
    c2 = join(distinct([4] * 129, "d"), distinct([3] * 62, "c"), ["yet"])
    assert len(c2) == 896
    b = w.arxiv_reward_breakdown(A1, c2)
    assert b["transition_categories"] == ["contrast"] and b["total"] == pytest.approx(1.41)


@pytest.mark.parametrize(
    "c1, c2, expected",
    [
        (join(distinct([4] * 127, "a")), A1, 0.0),  # c1 127 tokens < 128: stop at L1
        (A1, join(distinct([4] * 100, "b")), 0.0),  # c2 has 100 tokens < 128: stop at L1
        (A1, join(distinct([6] * 150, "b")), 0.5),  # 150*6 + 149 = 1049 chars: ratio 1.64 > 1.5, L2 fails
        (A1, "b000 " * 127 + "b0000", 1.5),  # 640 chars (ratio 1 -> +1) but 2 distinct words: 2/128 < 0.5, L3 fails
    ],
)
def test_arxiv_gates(c1, c2, expected):
    assert w.arxiv_reward([c1], [c2]) == [pytest.approx(expected)]


# ------------------------------------------------------------------------------------------------ evaluation
def test_eval_logger_and_aggregator_metric_names():
    c2 = join(["k000"], distinct([4] * 19, "m"), ["however", "therefore", "for", "example"])  # 2.8 (see above)
    completions = [[[C1_49], [C1_40]], [[c2], ["x"]]]  # [agent][sample][turn]
    per_sample = w.writing_eval_logger(completions, batch_items=[{"prompt": "p"}, {"prompt": "q"}])
    assert set(per_sample[0]) == {f"turn_1/{name}" for name in w.EVAL_METRICS}
    assert per_sample[0]["turn_1/total_reward"] == pytest.approx(2.8)
    assert per_sample[1]["turn_1/total_reward"] == 0.0  # "x" is 1 token
    assert per_sample[0]["turn_1/transition_coverage"] == pytest.approx(3 / 12)
    agg = w.writing_eval_aggregator(per_sample, num_turns=1)
    assert agg["turn_1/avg_total_reward"] == pytest.approx(1.4)
    assert agg["turn_1/avg_length_ratio"] == pytest.approx((129 / 49 + 1 / 40) / 2)
    assert agg["turn_1/level_1_pass_rate"] == 0.5 and agg["turn_1/level_4_pass_rate"] == 0.5
    assert {f"turn_1/avg_{n}" for n in w.EVAL_METRICS} <= set(agg)
    # the arXiv thresholds are picked from the items (abstract_text) or by name
    arxiv = w.writing_eval_logger(completions, batch_items=[{"abstract_text": "a"}] * 2)
    assert arxiv[0]["turn_1/total_reward"] == 0.0 and w.arxiv_eval_logger(completions) == arxiv


# ------------------------------------------------------------------------------------------------ data
@needs_data
def test_real_items_load_and_format():
    tldr = w.tldr_tasks(str(TLDR_FILE), limit=3)
    assert len(tldr) == 3 and tldr[0]["prompt"].startswith("SUBREDDIT: r/") and "completion" in tldr[0]
    concise, detailed = w.tldr_concise_prompt(tldr[0]), w.tldr_detailed_prompt(tldr[0])
    assert "concise summary" in concise and "detailed summary" in detailed and "TITLE:" in concise
    assert "TL;DR:\n\nConcise summary:" not in concise  # the dataset's trailing "TL;DR:" cue is dropped
    arxiv = w.arxiv_tasks(str(ARXIV_FILE), limit=2)
    assert arxiv[0]["prompt"] == arxiv[0]["abstract_text"] and "title" in arxiv[0]
    back, meth = w.arxiv_background_prompt(arxiv[0]), w.arxiv_method_prompt(arxiv[0])
    assert arxiv[0]["abstract_text"][:80] in back and "methodology" in back and "background" in meth
    # raw rows (no `prompt`) format the same
    raw = {k: v for k, v in arxiv[0].items() if k != "prompt"}
    assert w.arxiv_background_prompt(raw) == back
    # default train/eval functions use the shared copies, disjoint
    train, evaluation = w.tldr_train_tasks(), w.tldr_eval_tasks()
    assert len(evaluation) == w.EVAL_HEAD and train[0]["id"] == evaluation[-1]["id"] + 1
    assert len(w.arxiv_train_tasks()) + len(w.arxiv_eval_tasks()) == len(w.arxiv_tasks(str(ARXIV_FILE)))
    # a human TL;DR paired with its post scores through the reward without error
    assert 0.0 <= w.tldr_reward([tldr[0]["completion"]], [tldr[0]["prompt"]])[0] <= 3.0


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"(?s)'trl-lib/tldr'.*local \.jsonl"):
        w.tldr_tasks("trl-lib/tldr")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        w.arxiv_tasks("missing/abstracts.jsonl.gz")


# ------------------------------------------------------------------------------------------------ fit / configs
@needs_data
def test_magrpo_fit_on_real_tldr_items(tmp_path):
    seed_everything(0)
    items = w.tldr_tasks(str(TLDR_FILE), limit=6)
    for item in items:  # keep the posts short so the tiny model runs fast
        item["prompt"] = item["prompt"][:300]
    seen = []

    def reward(summaries, details, batch_items=None):
        assert len(summaries) == len(details) == len(batch_items)
        seen.extend(item["id"] for item in batch_items)
        return w.tldr_reward(summaries, details, batch_items)

    module = MAGRPO(
        agents="tiny",
        num_agents=2,
        reward_func=reward,
        formatters=[w.tldr_concise_prompt, w.tldr_detailed_prompt],
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
        eval_logger=w.tldr_eval_logger,
        eval_aggregator=w.writing_eval_aggregator,
        log_completions=False,
    )
    trainer = Trainer(
        max_steps=2,
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
        module,
        datamodule=TaskDataModule(dataset=items[:4], eval_dataset=items[4:], prompts_per_step=2, eval_batch_size=2),
    )
    # 2 steps x 2 items x 2 generations scored in training (+ the evaluation at step 0), on the real items
    assert len(seen) >= 2 * 2 * 2 and set(seen) <= {it["id"] for it in items}
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    assert "eval/turn_1/avg_total_reward" in columns and "eval/turn_1/avg_transition_coverage" in columns
    assert any(r.get("eval/turn_1/avg_total_reward") for r in rows)


@needs_data
def test_magrpo_fit_on_real_arxiv_items(tmp_path):
    seed_everything(0)
    items = w.arxiv_tasks(str(ARXIV_FILE), limit=2)
    for item in items:  # keep the abstracts short so the tiny model runs fast
        item["prompt"] = item["prompt"][:300]
    module = MAGRPO(
        agents="tiny",
        num_agents=2,
        reward_func=w.arxiv_reward,
        formatters=[w.arxiv_background_prompt, w.arxiv_method_prompt],
        use_chat_template=False,
        num_generations=2,
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        eval_interval=1,
        eval_num_samples=1,
        eval_logger=w.arxiv_eval_logger,
        eval_aggregator=w.writing_eval_aggregator,
        log_completions=False,
    )
    trainer = Trainer(
        max_steps=1,
        logger=CSVLogger(tmp_path, name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, datamodule=TaskDataModule(dataset=items, eval_dataset=items[:1], prompts_per_step=2))
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        columns = set(next(csv.DictReader(f)))
    assert "rollout/turn_1/reward_mean" in columns and "eval/turn_1/avg_total_reward" in columns


@pytest.mark.parametrize("name", ["writing_tldr_magrpo.yaml", "writing_arxiv_magrpo.yaml"])
def test_writing_configs_parse(name, capsys):
    from comlrl_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / name), "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "comlrl_lightning.envs.writing." in out and "num_turns: 1" in out
