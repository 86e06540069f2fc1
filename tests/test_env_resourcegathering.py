"""ResourceGathering (Minecraft): hand-checked shaped rewards over whole episodes, asymmetric tools, partial
observability, messages and comm_limit, parsing that never raises, replay equal to stepping, the seeded generator,
loader errors, and two-update fits of MAGRPO, IAC and MAAC on the CPU config with tiny models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from comlrl_lightning.envs.minecraft import resourcegathering as R
from comlrl_lightning.envs.minecraft.common import TASKS

REPO = Path(__file__).resolve().parents[1]

# A 7 x 3 map. Worker A (agent 0, wood) starts at (6, 1) by the minerals, worker B (agent 1, stone and iron) at
# (0, 1) by the trees: wood (2, 0, 0) at (0, 0), a mineral pile (0, 2, 1) at (6, 0). Goal wood 2, stone 2, iron 1.
#   A's work zone: the cells within Manhattan 2 of (0, 0): (0,0) (1,0) (2,0) (0,1) (1,1) (0,2); from (6, 1) the
#   nearest, (2, 0) or (1, 1), is 5 away. B's: within 2 of (6, 0): (6,0) (5,0) (4,0) (6,1) (5,1) (6,2); from
#   (0, 1) 5 away. Neither starts inside its zone.
MAP = {
    "task_id": "rg_t001",
    "family": "test_exchange",
    "goal": {"wood": 2, "stone": 2, "iron": 1},
    "rows": ["(2,0,0) . . . . . (0,2,1)", "B . . . . . A", ". . . . . . ."],
}


def item_of(obj=MAP, **rules):
    item = R.parse_map(obj, {**R.RULE_DEFAULTS, **rules}, obj["task_id"]).to_item()
    TASKS.add([item])
    return item


@pytest.fixture
def item():
    return item_of()


def act(path=None, cmds=None, facts=None):
    obj = {"comm": {"resource_facts": facts} if facts else {}, "probe": [], "cmds": cmds or []}
    if path is not None:
        obj["path"] = path
    return json.dumps(obj)


# The perfect episode. Turn 1: both walk 4 steps towards their zones and tell each other about the other's piles.
A1 = act([[6, 1], [5, 1], [4, 1], [3, 1], [2, 1]], facts=[{"x": 6, "z": 0, "type": "stone"}])
B1 = act([[0, 1], [1, 1], [2, 1], [3, 1], [4, 1]], facts=[{"x": 0, "z": 0, "type": "wood"}])
# Turn 2: one more step each, into the zone, and extract.
A2 = act([[2, 1], [1, 1]], cmds=[[0, 0]])
B2 = act([[4, 1], [5, 1]], cmds=[[6, 0]])


def reward(item, a, b, history=None, fn=R.resourcegathering_reward):
    return fn([a], [b], batch_items=[item], response_history_per_agent=[history or [[], []]])[0]


def test_perfect_episode(item):
    # Turn 1. Distance to the zone 5 -> 1 for each worker ((2,1) is 1 from (1,1); (4,1) 1 from (4,0)): 0.05 x 8 = 0.4.
    # B's fact (wood at (0,0), true count 2) is new to A, who sees x 4..6 only and needs 2 wood: min(1, 2/2) = 1 ->
    # 0.1; A's fact (stone at (6,0), 2) likewise for B: 0.1. Nothing extracted, nobody inside a zone yet: 0.6.
    b1 = R.ResourceGatheringReward().breakdowns([[A1], [B1]], [item])[0]
    assert b1["move_to_zone"] == pytest.approx(0.4) and b1["useful_comm"] == pytest.approx(0.2)
    assert (b1["zone_steps"], b1["comm_facts"], b1["useful_comm_facts"]) == (8, 2, 2)
    assert reward(item, A1, B1) == pytest.approx(0.6)
    # Turn 2 (turn 1 replayed). One more cell each (1 -> 0: 0.05 x 2 = 0.1), both enter their zones for the first
    # time (0.15 x 2 = 0.3); A extracts (0,0) from (1,1) (Manhattan 2): wood 2; B extracts (6,0) from (5,1): stone 2,
    # iron 1. Progress 0 -> 1 (8 x 1) and the goal met (7): 8 + 7 + 0.1 + 0.3 = 15.4.
    r2 = reward(item, A2, B2, [[A1], [B1]])
    assert r2 == pytest.approx(15.4)
    comps = R.resourcegathering_reward_components(
        [A2], [B2], batch_items=[item], response_history_per_agent=[[[A1], [B1]]]
    )
    assert comps[0] == pytest.approx(
        dict(
            progress=8.0,
            terminal=7.0,
            move_to_zone=0.1,
            useful_comm=0.0,
            first_enter_zone=0.3,
            move_cost=0.0,
            comm_cost=0.0,
            wasted_extraction=0.0,
        )
    )
    assert sum(comps[0].values()) == r2
    # Turn 3 after completion: staying pays nothing more (the terminal bonus is paid once).
    assert reward(item, act(), act(), [[A1, A2], [B1, B2]]) == 0.0
    low, high = R.resourcegathering_reward.reward_range
    assert (low, high) == pytest.approx((-0.4, 16.3)) and low <= 0.6 <= 15.4 <= high


def test_empty_worst_and_half(item):
    # Empty answers: nobody moves, extracts or says anything: every term 0, every turn.
    assert reward(item, "", "") == 0.0 and reward(item, act(), act(), [["", ""], ["", ""]]) == 0.0
    # The worst turn: 2 wasted extractions each, -0.1 x 4 = -0.4 (the floor). A: (9,9) is off the map, (0,0) is 6
    # away. B: "x" is no cell, and (0,0) is in reach (1 away) but holds wood, which B's tool does not take.
    worst = reward(item, act(cmds=[[9, 9], [0, 0]]), act(cmds=["x", [0, 0]]))
    assert worst == pytest.approx(-0.4) == R.resourcegathering_reward.reward_range[0]
    # Half-way: after turn 1, only A reaches the wood and extracts it: wood 2/2, stone 0/2, iron 0/1, progress 1/3 ->
    # 8/3; A closes 1 cell (0.05) and enters its zone (0.15); B stays: 8/3 + 0.2.
    half = reward(item, A2, act(), [[A1], [B1]])
    assert half == pytest.approx(8 / 3 + 0.2)
    assert worst < 0.0 < half < 15.4


def test_asymmetric_tools():
    # A at (0,0), a mixed pile (1, 1, 0) at (1,0), B at (2,0), goal 1 of each.
    obj = {"task_id": "rg_tools", "goal": {"wood": 1, "stone": 1, "iron": 1}, "rows": ["A (1,1,0) B (2,0,0)"]}
    task = R.ResourceTask.from_item(item_of(obj))
    s0 = R.initial_state(task)
    # A's tool takes the wood and leaves the stone; B, extracting the same cell after A, takes the stone.
    s1, b = R.step(task, s0, [act(cmds=[[1, 0]]), act(cmds=[[1, 0]])])
    assert s1.collected == {"wood": 1, "stone": 1, "iron": 0} and (1, 0) not in s1.piles
    assert (b["valid_extractions"], b["wasted_extractions"]) == (2, 0)
    # B cannot extract wood: the pile at (3,0) stays whole and the extraction is wasted (-0.1).
    s2, b = R.step(task, s0, [act(), act(cmds=[[3, 0]])])
    assert s2.piles[(3, 0)] == (2, 0, 0) and s2.collected["wood"] == 0 and b["total"] == pytest.approx(-0.1)
    # A alone takes only the wood of the mixed pile.
    s3, _ = R.step(task, s0, [act(cmds=[[1, 0]]), act()])
    assert s3.piles[(1, 0)] == (0, 1, 0) and s3.collected == {"wood": 1, "stone": 0, "iron": 0}


def test_partial_observability_and_messages(item):
    task = R.ResourceTask.from_item(item)
    s0 = R.initial_state(task)
    # A at (6,1) sees x 4..6 (view 2): the mineral pile, not the wood nor B.
    obs = R.observe(task, s0, 0)
    assert [p["coord"] for p in obs["visible_resources"]] == [[6, 0]] and obs["teammate_position"] is None
    # A cannot report what it does not see: its fact about the wood at (0,0) is dropped.
    assert R.parse_action(act(facts=[{"x": 0, "z": 0, "type": "wood"}]), task, s0, 0).facts == []
    # After turn 1 A has stood on (2..6, 1) and sees the whole map, the wood and B (at (4,1)).
    s1, _ = R.replay(task, [[A1], [B1]])
    obs = R.observe(task, s1, 0)
    assert [p["coord"] for p in obs["visible_resources"]] == [[0, 0], [6, 0]] and obs["teammate_position"] == [4, 1]
    assert obs["reachable_resources"] == [] and [0, 0] not in obs["extraction_zone"]
    # B's message reaches A's next prompt (with the true count), not B's own; A's reaches B.
    p0, p1 = R.ResourceGatheringFeedback()(item["prompt"], [A1, B1], 2, [["p"], ["p"]], [[A1], [B1]])
    assert 'Messages from your teammate: [[{"x":0,"z":0,"type":"wood","count":2}]]' in p0
    assert 'Messages from your teammate: [[{"x":6,"z":0,"type":"stone","count":2}]]' in p1
    assert p0.startswith(R.SYSTEM_PROMPT) and "Your position: [2,1]" in p0 and "Turn 2 of 4." in p0
    assert "Collected by the team: wood 0, stone 0, iron 0." in p1 and "Your position: [4,1]" in p1


def test_comm_limit_cuts_messages(item):
    task = R.ResourceTask.from_item(item)
    # A sees stone and iron at (6,0); with comm_limit 1 (the default) only the first fact is sent.
    two = act(
        facts=[{"x": 6, "z": 0, "type": "iron"}, {"x": 6, "z": 0, "type": "stone"}, {"x": 6, "z": 0, "type": "iron"}]
    )
    s1, b = R.step(task, R.initial_state(task), [two, act()])
    assert s1.inbox[1] == [[{"x": 6, "z": 0, "type": "iron", "count": 1}]] and b["comm_facts"] == 1
    # Useful for B (needs iron 1, never saw (6,0)): min(1, 1/1) -> 0.1.
    assert b["useful_comm"] == pytest.approx(0.1)
    # comm_limit null: both distinct facts (the duplicate is dropped); still 0.1 (the sender's score is capped at 1).
    free = R.ResourceTask.from_item(item_of(dict(MAP, task_id="rg_free"), comm_limit=None))
    s1, b = R.step(free, R.initial_state(free), [two, act()])
    assert [f["type"] for f in s1.inbox[1][0]] == ["iron", "stone"] and b["useful_comm"] == pytest.approx(0.1)
    zero = R.ResourceTask.from_item(item_of(dict(MAP, task_id="rg_mute"), comm_limit=0))
    assert R.step(zero, R.initial_state(zero), [two, act()])[0].inbox == [[], []]
    p0, p1 = R.ResourceGatheringFeedback(previous_response=True, tasks=[item])(
        item["prompt"], [two, ""], 2, None, [[two], [""]]
    )
    assert '"type":"iron","count":1}]]' in p1 and "at most 1 fact(s) per turn" in p1
    assert p0.endswith("Your previous answer:\n" + two) and "Your previous answer" not in p1


def test_paths():
    task = R.ResourceTask.from_item(item_of())
    s0 = R.initial_state(task)
    parse = lambda text: R.parse_action(text, task, s0, 0)  # noqa: E731
    assert parse(act([[6, 1], [5, 0], [4, 0]])).path == [(6, 1), (5, 0), (4, 0)]  # diagonal steps
    assert parse(act([{"x": 6, "z": 1}, {"x": "5", "z": 1.9}])).path == [(6, 1), (5, 1)]  # int(), as the repository
    long = parse(act([[6, 1], [5, 1], [4, 1], [3, 1], [2, 1], [1, 1]]))
    assert long.path[-1] == (2, 1) and long.path_valid  # cut at max_path_len = 4 moves
    for bad in ([[5, 1], [4, 1]], [[6, 1], [4, 1]], [[6, 1], [7, 1]], [[6, 1], "x"], [[6, 1], [6, 2], [6, 3]]):
        p = parse(act(bad))
        assert p.path == [(6, 1)] and not p.path_valid, bad
    for stay in ("{}", act([]), '{"path": "north"}', '{"path": null}'):
        assert parse(stay).path == [(6, 1)] and parse(stay).path_valid


JUNK = [
    "",
    "hello",
    "{",
    "}{",
    "{'path': [[6, 1], [5, 1]]}",
    '{"path": [[6, 1], [5, 1]]',
    "[1, 2, 3]",
    '"just a string"',
    '{"comm": {"resource_facts": 5}}',
    '{"comm": {"resource_facts": "wood"}}',
    '{"comm": {"resource_facts": [{"x": "a", "z": null, "type": ["wood"]}, 7, null]}}',
    '{"comm": [], "cmds": "[[0,0]]", "path": {"x": 1}}',
    '{"cmds": [[1e400, 0], [NaN, 1], [Infinity, 2], null, {"x": 1}]}',
    '{"path": [[6, 1], [99999999999999999999999999999, 1]]}',
    '{"path": [["' + "9" * 5000 + '", 1]]}',
    '{"cmds": [[' + "9" * 5000 + ", 0]]}",
    "[" * 5000 + "]" * 5000,
    "{" * 3000 + "}" * 3000,
    '{"a": ' + "[" * 3000 + "]" * 3000 + "}",
    "```json\n" + act([[6, 1], [5, 1]]) + "\n```",
    "```\n{\n```",
    "```json",
    "text before " + act() + " text after {",
    '{"path": "a}b", "x": "\\"}"}',
    "\u202e{}\x00",
    "💥" * 2000,
    None,
    42,
    3.5,
    float("nan"),
    True,
    b'{"path": []}',
    ["{}"],
    {"path": [[6, 1]]},
    object(),
]


@pytest.mark.parametrize("junk", JUNK, ids=range(len(JUNK)))
def test_malformed_completions_never_raise(item, junk):
    low, high = R.resourcegathering_reward.reward_range
    for pair in ([junk, ""], ["", junk], [junk, junk]):
        for history in ([[], []], [[junk], [A1]], [[A1, junk], [junk, B1]]):
            value = reward(item, pair[0], pair[1], history)
            assert math.isfinite(value) and low <= value <= high
            comps = R.resourcegathering_reward_components(
                [pair[0]], [pair[1]], batch_items=[item], response_history_per_agent=[history]
            )[0]
            assert sum(comps.values()) == pytest.approx(value)
        prompts = R.ResourceGatheringFeedback(previous_response=True)(
            item["prompt"], pair, 2, None, [[p] for p in pair]
        )
        assert len(prompts) == 2 and all(isinstance(p, str) for p in prompts)
        rows = R.resourcegathering_eval_logger([[[pair[0], junk]], [[pair[1], ""]]], batch_items=[item])
        assert math.isfinite(rows[0]["turn_2/total_reward"])


def test_replay_equals_step_by_step():
    objs = R.generate_resourcegathering_tasks(6, seed=3)
    answers = [A1, B1, A2, B2, act([[1, 1], [1, 0]], cmds=[[1, 0], [0, 0]]), "junk", act(cmds=[[2, 2]])]
    shaping = R.Shaping()
    for k, obj in enumerate(objs):
        item = item_of(obj)
        task = R.ResourceTask.from_item(item)
        x0, z0 = task.starts[0]
        x1, z1 = task.starts[1]
        turns = [
            [act([[x0, z0], [x0 + 1, z0], [x0 + 1, z0 + 1]], cmds=[[x0 + 1, z0 + 1]]), act([[x1, z1], [x1 - 1, z1]])],
            [answers[k % len(answers)], answers[(k + 2) % len(answers)]],
            [act(cmds=[[x0, z0 + 1], [x0 + 2, z0]]), act(cmds=[[x1 - 1, z1], [x1, z1 + 1]])],
            [answers[(k + 4) % len(answers)], act()],
        ]
        state, history = R.initial_state(task), [[], []]
        for a, b in turns:
            state, expected = R.step(task, state, [a, b], shaping)
            assert reward(item, a, b, [list(history[0]), list(history[1])]) == expected["total"]
            history[0].append(a)
            history[1].append(b)
        replayed, rows = R.replay(task, history, shaping)
        assert replayed == state and len(rows) == 4
        logged = R.resourcegathering_eval_logger([[history[0]], [history[1]]], batch_items=[item])[0]
        assert [logged[f"turn_{t + 1}/total_reward"] for t in range(4)] == [r["total"] for r in rows]


def test_generator_is_deterministic_and_like_the_repository():
    a, b = R.generate_resourcegathering_tasks(14, seed=5), R.generate_resourcegathering_tasks(14, seed=5)
    assert a == b and a != R.generate_resourcegathering_tasks(14, seed=6)
    assert R.generate_resourcegathering_tasks(3, seed=5) == a[:3]
    for obj in a:
        task = R.ResourceTask.from_item(item_of(obj))
        assert task.width == task.height and 8 <= task.width <= 10 and task.goal == (3, 3, 1)
        total = [sum(p[i] for row in task.piles for p in row) for i in range(3)]
        assert total[0] >= 5 and total[1] >= 4 and total[2] >= 2  # the goal can be met
        assert obj["family"] in R.FAMILIES and {"task_id", "family", "goal", "rows"} == set(obj)
    assert len({o["task_id"] for o in a}) == 14
    train = R.ResourceGatheringTasks(split="train", count=14, seed=5)()
    test = R.ResourceGatheringTasks(split="eval", count=14, seed=5)()
    assert [t["task_id"] for t in train + test] == [o["task_id"] for o in a] and len(train) == 7
    assert TASKS.find(train[0]["prompt"], None, "ResourceGathering") == train[0]
    assert train[0]["prompt"] == f"resource_gathering:{a[0]['task_id']}"


def test_file_loader_splits_and_errors(tmp_path, monkeypatch):
    data = tmp_path / "resource_gathering" / "dataset" / "data.json"
    data.parent.mkdir(parents=True)
    data.write_text(json.dumps([MAP, dict(MAP, task_id="rg_t002"), dict(MAP, task_id="rg_t003")]))
    monkeypatch.setenv("COMLRL_MINECRAFT_DATA", str(tmp_path))
    assert [t["task_id"] for t in R.resourcegathering_train_tasks()] == ["rg_t001", "rg_t002"]
    assert [t["task_id"] for t in R.resourcegathering_eval_tasks()] == ["rg_t003"]
    items = R.ResourceGatheringTasks(source="file", split="[1:]", comm_limit=None, view=1)()
    assert [t["task_id"] for t in items] == ["rg_t002", "rg_t003"] and items[0]["comm_limit"] is None
    assert R.ResourceTask.from_item(items[0]).view == 1
    one = tmp_path / "one.json"
    one.write_text(json.dumps(MAP))  # a single task object
    assert len(R.resourcegathering_tasks(one)) == 1
    monkeypatch.setenv("COMLRL_MINECRAFT_DATA", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="OpenMLRL/LLM_Collab_Minecraft.*COMLRL_MINECRAFT_DATA"):
        R.resourcegathering_train_tasks()
    with pytest.raises(ValueError, match=r"source must be one of 'generated', 'file'; got 'web'"):
        R.ResourceGatheringTasks(source="web")
    with pytest.raises(ValueError, match=r"split must be one of 'train', 'eval', 'all' or a slice"):
        R.ResourceGatheringTasks(split="dev")
    with pytest.raises(ValueError, match="path is only read with source: file"):
        R.ResourceGatheringTasks(path="x.json")
    with pytest.raises(ValueError, match="comm_limit must be an integer >= 0 or null"):
        R.ResourceGatheringTasks(comm_limit=-1)
    with pytest.raises(ValueError, match="max_path_len must be an integer >= 1; got 0"):
        R.resourcegathering_tasks(one, max_path_len=0)
    with pytest.raises(ValueError, match="count must be an integer >= 1"):
        R.ResourceGatheringTasks(count=0)
    bad = tmp_path / "bad.json"
    for rows, message in (
        (["A . B", ". ."], "row 1 has 2 cells, row 0 has 3"),
        (["A (1,x,0) B"], r"cell \(1, 0\) has the token '\(1,x,0\)'"),
        (["A . ."], "must mark both starts"),
    ):
        bad.write_text(json.dumps([{"task_id": "t", "rows": rows}]))
        with pytest.raises(ValueError, match=message):
            R.resourcegathering_tasks(bad)
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="is not valid JSON"):
        R.resourcegathering_tasks(bad)
    with pytest.raises(ValueError, match="mode must be one of 'empty_feedback'; got 'score_feedback'"):
        R.ResourceGatheringFeedback("score_feedback")
    with pytest.raises(KeyError, match="no ResourceGathering task has the prompt key 'resource_gathering:nope'"):
        R.ResourceGatheringFeedback()("resource_gathering:nope", ["", ""], 2)
    with pytest.raises(ValueError, match="two workers"):
        R.resourcegathering_reward([""], [""], [""], batch_items=[item_of()])
    with pytest.raises(ValueError, match="needs batch_items"):
        R.resourcegathering_reward([""], [""])


def test_reward_class_settings(item):
    # Other numbers: progress 10, terminal 4 (an older repository config), a move cost of 0.01 per step.
    r = R.ResourceGatheringReward(progress_reward_scale=10.0, terminal_bonus=4.0, move_cost_scale=0.01)
    # Turn 2 of the perfect episode: 10 + 4 + 0.1 + 0.3 - 0.01 x 2 steps.
    assert r([A2], [B2], batch_items=[item], response_history_per_agent=[[[A1], [B1]]]) == [pytest.approx(14.38)]
    assert r.reward_range == pytest.approx((-0.48, 10 + 4 + 0.8 + 0.2 + 0.3))
    comps = R.ResourceGatheringReward(components=True)([A1], [B1], batch_items=[item])
    assert set(comps[0]) == set(R.COMPONENTS)
    with pytest.raises(ValueError, match="terminal_bonus must be a finite number"):
        R.ResourceGatheringReward(terminal_bonus=float("inf"))


def test_first_prompts(item):
    p0, p1 = R.resourcegathering_agent0_prompt(item), R.resourcegathering_agent1_prompt(item)
    assert p0.startswith(R.SYSTEM_PROMPT) and "You are worker A of two" in p0 and "Yours: wood only." in p0
    assert "You are worker B" in p1 and "Yours: stone and iron only." in p1
    assert 'To stay where you are: {"comm":{},"probe":[],"cmds":[],"path":[[6,1]]}' in p0
    assert 'Resources you see: [{"coord":[6,0],"wood":0,"stone":2,"iron":1}]' in p0
    assert 'Resources you see: [{"coord":[0,0],"wood":2,"stone":0,"iron":0}]' in p1
    assert R.resourcegathering_agent0_prompt(item, external_prompts="next") == "next"


def test_eval_logger_and_aggregator(item):
    rows = R.resourcegathering_eval_logger([[[A1, A2]], [[B1, B2]]], batch_items=[item])
    assert rows[0]["turn_1/total_reward"] == pytest.approx(0.6) and rows[0]["turn_2/total_reward"] == pytest.approx(
        15.4
    )
    assert rows[0]["turn_2/completed"] == 1.0 and rows[0]["turn_2/collected_iron"] == 1.0
    agg = R.resourcegathering_eval_aggregator(rows, num_turns=2)
    assert set(agg) == {f"turn_{t}/avg_{m}" for t in (1, 2) for m in R.EVAL_METRICS}


def variant(tmp_path: Path, algorithm: str) -> Path:
    """configs/resourcegathering_maac.yaml with another algorithm (its required fields set)."""
    cfg = yaml.safe_load((REPO / "configs" / "resourcegathering_maac.yaml").read_text())
    args = cfg["model"]["init_args"]
    cfg["model"]["class_path"] = f"comlrl_lightning.{algorithm}"
    if algorithm == "IAC":
        args.pop("critic_model")
        args.update(use_separate_critic=False)
    if algorithm == "MAGRPO":
        for name in ("critic_model", "critic_type", "critic_learning_rate", "value_loss_coef"):
            args.pop(name)
        args.update(num_generations=2, discount=1.0, rollout_buffer_size=3)  # one tree of 1 + 2 nodes
    path = tmp_path / f"resourcegathering_{algorithm.lower()}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("algorithm", ["MAAC", "IAC", "MAGRPO"])
def test_cpu_config_fits_two_updates(algorithm, tmp_path, monkeypatch):
    from test_configs import fit_two_updates, small_config

    monkeypatch.chdir(tmp_path)
    config = REPO / "configs" / "resourcegathering_maac.yaml" if algorithm == "MAAC" else variant(tmp_path, algorithm)
    rows = fit_two_updates(small_config(config, tmp_path), tmp_path)
    trained = {k for row in rows for k, v in row.items() if v and not k.startswith("eval/")}
    assert any(k.endswith("turn_2/reward_mean") for k in trained)  # the second turn was sampled and trained on
    assert any(row.get("eval/turn_2/avg_total_reward") for row in rows)
    assert any(row.get("eval/turn_1/avg_json_answers") for row in rows)
