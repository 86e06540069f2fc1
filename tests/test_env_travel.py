"""Travel env (TravelPlanner): parser, merger, dense joint reward v3 on a real annotated train item, eval, fit."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from comlrl_lightning import MAGRPO, TaskDataModule
from comlrl_lightning.envs import travel as T

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TRAVEL_FILE = SHARED / "travelplanner" / "train_sole_planning.jsonl.gz"
pytestmark = pytest.mark.skipif(
    not TRAVEL_FILE.exists(), reason=f"shared TravelPlanner data not found under {SHARED} (../shared/data)"
)


@pytest.fixture(scope="module")
def items():
    return T.travel_tasks(str(TRAVEL_FILE))


@pytest.fixture(scope="module")
def item(items):
    # idx 0: St. Petersburg -> Rockford, 3 days, 21 slots. Agent 0 owns 10 (cc/tr/acc x3 + day-2 dinner), agent 1
    # owns 11. Gold-empty ("-"): day 1 breakfast/attraction/lunch, day 2 transportation, day 3 accommodation (E=5);
    # gold-filled F=16, 8 owned by each agent.
    return items[0]


def split(item):
    """The perfect split of the annotated plan: each agent's owned slots with the gold values ("-" included)."""
    out = [[], []]
    for d in item["plan"]:
        for f in T.FIELDS:
            out[T.slot_owner(d["days"], f)].append({"day": d["days"], "field": f, "value": d[f]})
    return out


def dump(agent_id, assignments, **extra):
    return json.dumps({"agent_id": agent_id, "assignments": assignments, **extra})


def gold(item, day, field):
    return item["plan"][day - 1][field]


def harmonic(*xs):
    return len(xs) / sum(1 / x for x in xs)


# ------------------------------------------------------------------------------------------------ data / prompts
def test_items_roles_and_formatters(items, item):
    assert len(items) == 45 and {it["days"] for it in items} == {3, 5, 7}
    assert all(len(it["plan"]) == it["days"] for it in items)
    assert item["prompt"].startswith("Please help me plan a trip from St. Petersburg to Rockford")
    assert item["reference_sections"][0]["Description"] == "Attractions in Rockford"
    assert len(T.owned_slots(0, 3)) == 10 and len(T.owned_slots(1, 3)) == 11
    assert T.slot_owner(2, "dinner") == 0 and T.slot_owner(3, "dinner") == 1 and T.slot_owner(1, "lunch") == 1
    p0, p1 = T.travel_agent0_prompt(item), T.travel_agent1_prompt(item)
    assert item["prompt"] in p0 and '"agent_id": 0' in p0 and '"agent_id": 1' in p1
    assert "day 2 dinner" in p0 and "day 2 dinner" not in p1 and "day 3 dinner" in p1
    assert "Coco Bambu" in p0 and "(truncated)" in p0 and len(p0) < 5000  # 12k chars of reference cut down
    assert len(T.travel_train_tasks()) == 40 and len(T.travel_eval_tasks()) == 5


def test_missing_sources_are_clear_errors(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"(?s)'osunlp/TravelPlanner'.*local \.jsonl"):
        T.travel_tasks("osunlp/TravelPlanner")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        T.travel_tasks("missing/travel.jsonl.gz")


# ------------------------------------------------------------------------------------------------ parser
def test_parser_edge_cases():
    good = [{"day": 1, "field": "lunch", "value": "A, X"}, {"day": 2, "field": "lunch", "value": ""}]
    p = T.parse_proposal(dump(1, good), 1, 2)
    assert p["decoded"] and p["slots"] == {(1, "lunch"): "A, X", (2, "lunch"): "-"}  # "" is an explicit "-"
    # components: shape 1, id 1, entries 1, role 1, unique 1, owned 2 of 7 (agent 1 owns 7 slots over 2 days)
    assert p["validity"] == pytest.approx((5 + 2 / 7) / 6)
    for bad in ['{"agent_id": 1, "assignments": [', "no json here", "", None, 42, "[1, 2]"]:
        q = T.parse_proposal(bad, 1, 2)
        assert not q["decoded"] and q["validity"] == 0.0 and q["slots"] == {}
    fenced = "Sure, here it is:\n```json\n" + dump(1, good) + "\n```\nHope it helps {not json}"
    assert T.parse_proposal(fenced, 1, 2)["slots"] == p["slots"]
    two = dump(1, good[:1]) + "\n" + dump(1, good)  # first complete top-level object wins; tail ignored
    assert T.parse_proposal(two, 1, 2)["slots"] == {(1, "lunch"): "A, X"}
    empty = T.parse_proposal(dump(1, []), 1, 2)
    assert empty["decoded"] and empty["slots"] == {} and empty["validity"] == pytest.approx(2 / 6)  # shape + id
    wrong_id = T.parse_proposal(dump(0, good), 1, 2)
    assert wrong_id["slots"] == p["slots"] and not wrong_id["agent_id_ok"]
    assert wrong_id["components"]["agent_id"] == 0.0 and wrong_id["validity"] == pytest.approx(p["validity"] - 1 / 6)
    junk = good + [
        {"day": 1, "field": "snack", "value": "x"},
        {"day": 3, "field": "lunch", "value": "x"},
        {"day": 0, "field": "lunch", "value": "x"},
        {"day": True, "field": "lunch", "value": "x"},
        {"day": 1, "field": "breakfast", "value": 5},
        {"field": "lunch"},
        "lunch",
    ]
    j = T.parse_proposal(dump(1, junk), 1, 2)
    assert j["slots"] == p["slots"] and j["num_entries"] == 9 and j["num_invalid"] == 7
    assert j["components"]["entries"] == pytest.approx(2 / 9)
    dup = good + [
        {"day": 1, "field": "lunch", "value": "B, X"},
        {"day": 1, "field": "dinner", "value": "C"},
        {"day": 2, "field": "dinner", "value": "D"},
    ]  # day-2 dinner belongs to agent 0
    d = T.parse_proposal(dump(1, dup), 1, 2)
    assert d["slots"][(1, "lunch")] == "A, X" and d["num_duplicates"] == 1 and d["num_off_role"] == 1
    assert d["components"]["unique"] == pytest.approx(4 / 5) and d["components"]["role"] == pytest.approx(4 / 5)
    assert T.parse_proposal('{"assignments": "x"}', 1, 2)["components"]["shape"] == 0.0


def test_merger():
    a = {(1, "lunch"): "Flying Mango, Rockford", (1, "dinner"): "X", (2, "lunch"): "-"}
    b = {(1, "lunch"): " flying mango,  ROCKFORD", (1, "dinner"): "Y", (1, "breakfast"): "Z"}
    m = T.merge_proposals([a, b])
    assert m["plan"] == {(1, "lunch"): "Flying Mango, Rockford", (2, "lunch"): "-", (1, "breakfast"): "Z"}
    assert m["overlap"] == {(1, "lunch")} and m["conflict"] == {(1, "dinner")}
    assert m["credit"][(1, "lunch")] == [0, 1] and m["credit"][(1, "breakfast")] == [1]
    assert T.merge_proposals([{}, {}])["plan"] == {}


def test_slot_match():
    assert T.slot_match("coco bambu, rockford.", "Coco Bambu, Rockford", "dinner") == 1.0
    assert T.slot_match("Coco Bambu", "Coco Bambu, Rockford", "dinner") == 0.5
    assert T.slot_match("A, R;B, R;", "A, R;C, R;", "attraction") == pytest.approx(1 / 3)
    assert T.slot_match("-", "Coco Bambu, Rockford", "dinner") == 0.0 and T.slot_match(None, "-", "lunch") == 0.0


# ------------------------------------------------------------------------------------------------ reward
def test_perfect_split_gets_the_maximum(item):
    a, b = split(item)
    # A = V = C = G = 1, P = 0.20 + 0.45 + 0.05 + 0.15 + 0.10 = 0.95, exact 1: R = 0.05 + 0.95 + 0.20 = 1.20
    br = T.travel_reward_breakdown(dump(0, a), dump(1, b), item)
    assert br["total"] == pytest.approx(1.2) and br["P"] == pytest.approx(0.95) and br["exact_bonus"] == 1.0
    assert all(br[k] == 0.0 for k in T.PENALTY_COEFFICIENTS)
    assert T.travel_reward([dump(0, a)], [dump(1, b)], batch_items=[item]) == [pytest.approx(1.2)]
    # fenced answers with prose around them score the same
    fenced = "```json\n" + dump(1, b) + "\n```"
    assert T.travel_reward([dump(0, a)], [fenced], batch_items=[item]) == [pytest.approx(1.2)]
    assert T.travel_reward.reward_range == (-0.5, 1.2)


def edited(item, agent, day, field, value):
    a, b = split(item)
    for e in (a, b)[agent]:
        if (e["day"], e["field"]) == (day, field):
            e["value"] = value
    return a, b


def test_explicit_empty_mismatch(item):
    a, b = edited(item, 1, 2, "breakfast", "-")  # gold "Dial A Cake, Rockford"
    br = T.travel_reward_breakdown(dump(0, a), dump(1, b), item)
    # coverage = quality = 15/16, owned quality min(1, 7/8); V = C = G = 1; exact 0; mismatch 1/16
    # P = 0.65 * 15/16 + 0.05 + 0.15 + 0.10 * 7/8 = 0.896875; R = 0.05 + 0.896875 - 0.25/16 = 0.93125
    assert br["explicit_empty_mismatch"] == pytest.approx(1 / 16) and br["P"] == pytest.approx(0.896875)
    assert br["total"] == pytest.approx(0.93125)


def test_spurious_fill(item):
    a, b = edited(item, 1, 1, "breakfast", "Dial A Cake, Rockford")  # gold "-"
    br = T.travel_reward_breakdown(dump(0, a), dump(1, b), item)
    # gated empty recall 4/5 -> P = 0.20 + 0.45 + 0.05 * 0.8 + 0.15 + 0.10 = 0.94; spurious 1/5
    # R = 0.05 + 0.94 - 0.15 * 0.2 = 0.96
    assert br["spurious_fill"] == pytest.approx(0.2) and br["total"] == pytest.approx(0.96)


def test_overlap(item):
    a, b = split(item)
    b = b + [{"day": 1, "field": "current_city", "value": gold(item, 1, "current_city")}]  # same as agent 0
    br = T.travel_reward_breakdown(dump(0, a), dump(1, b), item)
    # V_1 = (5 + role 11/12) / 6 = 71/72, V = harmonic(1, 71/72) = 142/143, C = 1 (12/11 clipped)
    # role balance: credits 10 vs 12 -> |10/22 - 10/21| / (11/21) = 10/242 -> 1 - 10/242
    # P = 0.95 - 0.15 * 10/242; exact 1; overlap 1/21; over capacity mean(0, 1/11) = 1/22
    g = 0.2 + 0.8 * math.sqrt(142 / 143)
    p = 0.95 - 0.15 * 10 / 242
    assert br["overlap"] == pytest.approx(1 / 21) and br["over_capacity"] == pytest.approx(1 / 22)
    assert br["total"] == pytest.approx(0.05 + g * p + 0.20 - 0.15 / 21 - 0.25 / 22)  # ~ 1.17265


def test_conflict(item):
    a, b = split(item)
    b = b + [{"day": 1, "field": "current_city", "value": "Rockford"}]  # differs from agent 0's value
    br = T.travel_reward_breakdown(dump(0, a), dump(1, b), item)
    # the slot stays empty: coverage = quality = 15/16, coverage deficit 1/21, conflict 1/21
    # C = harmonic(9/10, 1) = 18/19, V = 142/143; role balance: credits 9 vs 11 -> 1 - (10/21 - 9/20)/(11/21) = 0.95
    # P = 0.65 * 15/16 + 0.05 + 0.15 * 0.95 + 0.10 = 0.901875; exact 0; over capacity 1/22
    g = 0.2 + 0.8 * math.sqrt(142 / 143 * 18 / 19)
    assert br["conflict"] == pytest.approx(1 / 21) and br["coverage_deficit"] == pytest.approx(1 / 21)
    assert br["C"] == pytest.approx(18 / 19) and br["P"] == pytest.approx(0.901875)
    assert br["total"] == pytest.approx(0.05 + g * 0.901875 - 0.30 / 21 - 0.25 / 21 - 0.25 / 22)  # ~ 0.86186


def test_invalid_slot(item):
    a, b = split(item)
    b = b + [{"day": 1, "field": "snack", "value": "x"}, {"day": 9, "field": "lunch", "value": "x"}]
    br = T.travel_reward_breakdown(dump(0, a), dump(1, b), item)
    # invalid 2 of 23 entries; V_1 = (5 + 11/13)/6 = 38/39, V = 76/77; C = 1, P = 0.95, exact 1
    assert br["invalid_slot"] == pytest.approx(2 / 23) and br["V"] == pytest.approx(76 / 77)
    g = 0.2 + 0.8 * math.sqrt(76 / 77)
    assert br["total"] == pytest.approx(0.05 + g * 0.95 + 0.20 - 0.15 * 2 / 23)  # ~ 1.17663


def test_duplicate_and_over_capacity(item):
    a, b = split(item)
    a = a + [{"day": 2, "field": "accommodation", "value": "Somewhere else, Rockford"}]  # first one kept
    br = T.travel_reward_breakdown(dump(0, a), dump(1, b), item)
    # duplicate 1 of 22 well-formed; over capacity mean(1/10, 0) = 0.05; V_0 = (5 + 10/11)/6 = 65/66, V = 130/131
    assert br["duplicate"] == pytest.approx(1 / 22) and br["over_capacity"] == pytest.approx(0.05)
    g = 0.2 + 0.8 * math.sqrt(130 / 131)
    assert br["exact_bonus"] == 1.0
    assert br["total"] == pytest.approx(0.05 + g * 0.95 + 0.20 - 0.15 / 22 - 0.25 * 0.05)  # ~ 1.18161


def test_coverage_deficit(item):
    a, b = split(item)
    b = [e for e in b if (e["day"], e["field"]) != (2, "breakfast")]  # gold-filled slot left out
    br = T.travel_reward_breakdown(dump(0, a), dump(1, b), item)
    # V_1 = (5 + 10/11)/6 -> V = 130/131; C = harmonic(1, 10/11) = 20/21; role balance 1 - (1/42)/(11/21) = 21/22
    # P = 0.65 * 15/16 + 0.05 + 0.15 * 21/22 + 0.10 * 7/8; exact 0; deficit 1/21
    p = 0.65 * 15 / 16 + 0.05 + 0.15 * 21 / 22 + 0.10 * 7 / 8
    g = 0.2 + 0.8 * math.sqrt(130 / 131 * 20 / 21)
    assert br["coverage_deficit"] == pytest.approx(1 / 21) and br["explicit_empty_mismatch"] == 0.0
    assert br["total"] == pytest.approx(0.05 + g * p - 0.25 / 21)  # ~ 0.86466


def test_failures_and_clamping(item):
    # nothing decodes: A = V = 0, G = 0.2, P = 0, every slot missing -> R = -0.25 * 1
    assert T.travel_reward(["oops"], ["{"], batch_items=[item]) == [pytest.approx(-0.25)]

    # both agents write all 21 slots with wrong, different values: conflict 1, deficit 1, P = 0, over capacity
    # mean(min(1, 11/10), 10/11) = 21/22; raw = 0.05 + 0.2 * 0 - 0.30 - 0.25 - 0.25 * 21/22 = -0.7386 < -0.5
    def every(tag):
        return [{"day": d, "field": f, "value": f"{tag}{d}{f}"} for d in (1, 2, 3) for f in T.FIELDS]

    br = T.travel_reward_breakdown(dump(0, every("x")), dump(1, every("y")), item)
    assert br["conflict"] == 1.0 and br["coverage_deficit"] == 1.0 and br["P"] == 0.0
    assert br["unclamped_total"] == pytest.approx(0.05 - 0.30 - 0.25 - 0.25 * 21 / 22)
    assert br["total"] == -0.5
    with pytest.raises(ValueError, match="batch_items"):
        T.travel_reward(["x"], ["y"])


def test_eval_logger_and_aggregator_names(item):
    a, b = split(item)
    completions = [[[dump(0, a)], ["junk"]], [[dump(1, b)], ["junk"]]]  # [agent][sample][turn]
    per_sample = T.travel_eval_logger(completions, batch_items=[item, item])
    assert set(per_sample[0]) == {f"turn_1/{n}" for n in T.EVAL_METRICS}
    assert per_sample[0]["turn_1/total_reward"] == pytest.approx(1.2)
    assert per_sample[1]["turn_1/total_reward"] == pytest.approx(-0.25)
    agg = T.travel_eval_aggregator(per_sample, num_turns=1)
    assert set(agg) == {f"turn_1/avg_{n}" for n in T.EVAL_METRICS}
    assert agg["turn_1/avg_total_reward"] == pytest.approx(0.475) and agg["turn_1/avg_parse_rate"] == 0.5
    assert agg["turn_1/avg_coverage"] == 0.5 and agg["turn_1/avg_conflict_rate"] == 0.0
    assert agg["turn_1/avg_exact_match"] == 0.5


# ------------------------------------------------------------------------------------------------ fit / config
def test_magrpo_fit_on_real_items(items, tmp_path):
    seed_everything(0)
    chosen = items[:2]
    seen = []

    def reward(plans0, plans1, batch_items=None):
        seen.extend(it["idx"] for it in batch_items)
        return T.travel_reward(plans0, plans1, batch_items)

    module = MAGRPO(
        agents="tiny",
        num_agents=2,
        reward_func=reward,
        formatters=[lambda it: T.travel_agent0_prompt(it)[:200], lambda it: T.travel_agent1_prompt(it)[:200]],
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
        eval_logger=T.travel_eval_logger,
        eval_aggregator=T.travel_eval_aggregator,
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
    assert len(seen) >= 2 * 2 and set(seen) <= {0, 1}
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    assert "eval/turn_1/avg_total_reward" in columns and "eval/turn_1/avg_parse_rate" in columns
    assert any(r.get("eval/turn_1/avg_total_reward") for r in rows)


def test_travel_config_parses(capsys):
    from comlrl_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "travel_magrpo.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "comlrl_lightning.envs.travel.travel_reward" in out and "num_agents: 2" in out
