"""BridgeBuild (Minecraft): hand-checked rewards, parsing that never raises, messages and partial views in the next
prompts, replay of multi-turn trajectories, the map generator and loaders, and two-update fits (MAGRPO, IAC, MAAC)
of the CPU config with tiny models."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from comlrl_lightning.envs.minecraft import bridgebuild as B
from comlrl_lightning.envs.minecraft.common import TASKS

REPO = Path(__file__).resolve().parents[1]

# 5 x 5 map, cells [x, z] (z = row):      The shortest bridge: S(1,0) - (1,1) - Y(1,2) - (1,3) - (2,3) - (3,3) - T(3,4),
#   z0  # S # # #                         4 blocks (max_gap 4: from row 1 to row 3 and from x 1 to x 3 takes 5 cells,
#   z1  . . . . N                         one of them the pillar Y). Open cells: 25 - 10 land - 2 pillars = 13.
#   z2  . Y . . .                         Groups of anchors and true pillars at the start: S, Y, T apart = 3, so a
#   z3  . . . . .                         merge is worth 3 / (3 - 1) = 1.5. One true pillar, one false one (N at (4,1):
#   z4  # # # T #                         its sides are (3,1) and (4,2); (4,0) is land).
ROWS = ("#S###", "....N", ".Y...", ".....", "###T#")


@pytest.fixture
def item():
    task = B.BridgeTask(task_id="bridge_t001", rows=ROWS, blocks=(("oak_planks", "air"), ("oak_planks",)))
    item = task.to_item()
    TASKS.add([item])
    return item


def act(cmds=(), probe=(), path=None, comm=None) -> str:
    return json.dumps({"comm": comm or {}, "probe": list(probe), "cmds": list(cmds), "path": path or []})


BRIDGE_A = act(["/fill 1 1 1 1 oak_planks", "/fill 1 3 1 3 oak_planks"])
BRIDGE_B = act(["/fill 2 3 3 3 oak_planks"])


def test_perfect_bridge(item):
    # Gap 4 -> 0: 5·4/4 = 5; groups 3 -> 1: 3·2/2 = 3; the true pillar joins S: 5·1/1 = 5; no false pillar touched;
    # 4 new blocks of 13 open cells: 5·4/13 = 20/13; S and T joined: +2. R = 5 + 3 + 5 − 0 − 20/13 + 2 = 15 − 20/13.
    br = B.bridgebuild_breakdown([BRIDGE_A, BRIDGE_B], item)
    assert br["total"] == pytest.approx(15 - 20 / 13)
    assert (br["bonus_gap_st"], br["bonus_cc_merge"], br["bonus_y_connected"]) == (5.0, 3.0, 5.0)
    assert (br["penalty_n_adjacent"], br["penalty_block_cost"], br["bonus_terminal_connect"]) == (0.0, 20 / 13, 2.0)
    assert (br["max_gap_st"], br["gap_st"], br["connected"], br["accepted_commands"]) == (4, 0, 1.0, 3)
    assert B.bridgebuild_reward([BRIDGE_A], [BRIDGE_B], batch_items=[item]) == [pytest.approx(15 - 20 / 13)]
    components = B.bridgebuild_reward_components([BRIDGE_A], [BRIDGE_B], batch_items=[item])[0]
    assert list(components) == list(B.TERMS) and components["penalty_block_cost"] == -20 / 13
    assert sum(components.values()) == B.bridgebuild_reward([BRIDGE_A], [BRIDGE_B], batch_items=[item])[0]
    assert B.bridgebuild_reward.reward_range == (-18.0, 15.0)


@pytest.mark.parametrize("empty", ["", '{"comm":{},"probe":[],"cmds":[],"path":[[1,0]]}', "no idea"])
def test_empty_action_scores_zero(item, empty):
    # Nothing placed: every term is 0 (probes and messages cost nothing in this simulator).
    assert B.bridgebuild_reward([empty], [empty], batch_items=[item]) == [0.0]


def test_worst_turn_after_a_partial_bridge(item):
    # Turn 1 (agent 0): (1,1), (1,3), (2,3): gap 4 -> 1: 3.75; groups 3 -> 2: 1.5; Y joins: 5; 3 blocks: 15/13.
    turn1 = act(["/fill 1 1 1 1 oak_planks", "/fill 1 3 2 3 oak_planks"])
    assert B.bridgebuild_reward([turn1], [""], batch_items=[item]) == [pytest.approx(3.75 + 1.5 + 5 - 15 / 13)]
    # Turn 2 (agent 0 clears everything with air, then blocks both sides of N): gap 1 -> 4: 5·(1 − 4)/4 = −3.75;
    # groups 2 -> 3 and Y unjoined score 0 (only gains count); N touched: −8·1/1; 2 new blocks: −10/13.
    turn2 = act(["/fill 0 1 3 3 air", "/fill 3 1 3 1 oak_planks", "/fill 4 2 4 2 oak_planks"])
    history = [[[turn1], [""]]]  # agent 0's and agent 1's earlier answers
    got = B.bridgebuild_reward([turn2], [""], batch_items=[item], response_history_per_agent=history)
    assert got == [pytest.approx(-3.75 - 8 - 10 / 13)]
    # Without the history the same answer scores from the empty map: gap 4 -> 4, N touched, 2 blocks.
    assert B.bridgebuild_reward([turn2], [""], batch_items=[item]) == [pytest.approx(-8 - 10 / 13)]


def test_half_bridges_add_up_to_the_whole(item):
    # Turn 1: (1,1) only: gap 4 -> 3: 1.25; groups 3 -> 2: 1.5; Y joins: 5; 1 block: 5/13.
    half = act(["/fill 1 1 1 1 oak_planks"])
    rest = act(["/fill 1 3 3 3 oak_planks"])
    assert B.bridgebuild_reward([half], [""], batch_items=[item]) == [pytest.approx(1.25 + 1.5 + 5 - 5 / 13)]
    # Turn 2: the other three: gap 3 -> 0: 3.75; groups 2 -> 1: 1.5; Y already joined: 0; 3 blocks: 15/13; +2.
    second = B.bridgebuild_reward([""], [rest], batch_items=[item], response_history_per_agent=[[[half], [""]]])
    assert second == [pytest.approx(3.75 + 1.5 - 15 / 13 + 2)]
    assert 1.25 + 1.5 + 5 - 5 / 13 + second[0] == pytest.approx(15 - 20 / 13)  # the two halves make the whole
    # Once S and T are joined the episode is over: a third turn changes nothing and scores 0.
    history = [[[half, ""], ["", rest]]]
    assert B.bridgebuild_reward([BRIDGE_A], [""], batch_items=[item], response_history_per_agent=history) == [0.0]


def test_the_reward_caller_passes_the_trajectory(item):
    from comlrl_lightning.rollout.rewards import RewardCaller

    half, rest = act(["/fill 1 1 1 1 oak_planks"]), act(["/fill 1 3 3 3 oak_planks"])
    caller = RewardCaller(B.bridgebuild_reward)
    # after (1,1): the second half of test_half_bridges_add_up_to_the_whole
    assert caller.raw([[""], [rest]], batch_items=[item], histories=[[[half], [""]]]) == [
        pytest.approx(3.75 + 1.5 - 15 / 13 + 2)
    ]
    # no history: a first turn on the empty map: gap 4 -> 1: 3.75; Y joins T's group: 1.5; Y linked: 5; 3 blocks
    assert caller.raw([[""], [rest]], batch_items=[item]) == [pytest.approx(3.75 + 1.5 + 5 - 15 / 13)]


def test_multi_turn_replay_equals_step_by_step(item):
    task = B.BridgeTask.from_item(item)
    turns = [
        [act(["/fill 1 1 1 1 oak_planks"], probe=[[1, 2]], comm={"y": [1, 2]}), act(path=[[3, 4], [3, 3]])],
        ["```json\n" + act(["/fill 3 1 3 2 oak_planks"], path=[[1, 0], [1, 1], [0, 2]]) + "\n```", "junk"],
        [act(["/fill 0 1 0 1 air"]), act(["/fill 1 3 3 3 oak_planks"], path=[[3, 3], [2, 3]])],
    ]
    state = B.initial_state(task, 2)
    for t, joint in enumerate(turns):
        step = B.apply_turn(task, state, joint)
        history = [[[turns[s][i] for s in range(t)] for i in range(2)]]
        replayed = B.bridgebuild_reward(*[[c] for c in joint], batch_items=[item], response_history_per_agent=history)
        assert replayed == [step.metrics["reward"]]
        state = step.state
    assert state.positions == [(0, 2), (2, 3)] and state.turn_index == 4 and state.connected
    rows = B.bridgebuild_eval_logger([[[j[0] for j in turns]], [[j[1] for j in turns]]], batch_items=[item])
    assert rows[0]["turn_3/total_reward"] == pytest.approx(step.metrics["reward"])
    agg = B.bridgebuild_eval_aggregator(rows, num_turns=3)
    assert set(agg) == {f"turn_{t}/avg_{m}" for t in (1, 2, 3) for m in B.EVAL_METRICS}


JUNK = [
    None,
    "",
    "   ",
    "{",
    "}",
    "{{{{",
    "[" * 10000,
    "{" * 60_000,
    '{"comm":' * 20_000,
    '```json\n{"cmds": ["/fill 1 1 1 1 oak_planks"]}\n```',
    "```",
    '{"cmds": "/fill 1 1 1 1 oak_planks"}',
    '{"cmds": [null, 7, {"a": 1}, ["x"], "/fill ~1 1 1 1 oak_planks", "/fill 1 1 99 1 oak_planks"]}',
    '{"probe": [[1e999, 2], ["(' + "9" * 5000 + ', 1)"], "(' + "9" * 5000 + ', 1)", {"x": null}, true]}',
    '{"cmds": ["/fill ' + "1" * 5000 + ' 1 1 1 oak_planks"]}',
    '{"path": [[1, 0], [1, 1], [' + "9" * 4000 + ", 1]]}",
    '{"comm": {(1, 2): {3}}, "probe": []}',
    "{'comm': {'a': b'\\x00'}, 'path': [(1, 0), (2, 1)]}",
    '{"comm": ' + "[" * 3000 + "]" * 3000 + "}",
    "'" + "{" * 500 + '"path": [[1, 0]]',
    "\x00\ud800{\u202e}",
    json.dumps({"comm": {"t": "桥" * 5000}, "probe": [[1, 2]] * 100, "cmds": ["/fill 0 1 4 3 oak_planks"] * 500}),
]


@pytest.mark.parametrize("junk", JUNK, ids=range(len(JUNK)))
def test_parsing_never_raises(item, junk):
    start = time.perf_counter()
    assert len(B.bridgebuild_reward([junk], [junk], batch_items=[item])) == 1
    prompts = B.BridgeBuildFeedback(mode="perfect_feedback")(item["prompt"], [junk, junk], 2, [[""], [""]])
    assert len(prompts) == 2 and all(isinstance(p, str) for p in prompts)
    assert time.perf_counter() - start < 2.0  # no quadratic blow-up on long inputs
    assert isinstance(B.extract_action(junk), dict)


def test_action_extraction():
    assert B.extract_action('Sure! {"path": [[1, 0]]} and {"cmds": [], "probe": []}') == {"cmds": [], "probe": []}
    assert B.extract_action('{"cmds": ["/fill 1 1 1 1 oak_planks"]')["cmds"] == ["/fill 1 1 1 1 oak_planks"]  # closed
    assert B.extract_action("{'probe': [(1, 2)]}") == {"probe": [(1, 2)]}  # a Python literal
    assert B.extract_action('{"note": "no fields"}') == {}
    assert B.parse_cell("(3, 4)") == (3, 4) and B.parse_cell({"x": "2", "z": 1}) == (2, 1)
    assert B.parse_cell([1.5, 2]) is None and B.parse_cell([True, 1]) is None and B.parse_cell("~1,2") is None


def test_budgets_and_palettes(item):
    task = B.BridgeTask.from_item(item)
    many = act([f"/fill {x} 1 {x} 1 oak_planks" for x in range(4)] * 6 + ["/fill 0 3 0 3 stone"])
    a = B.parse_action(many, task, 0, (1, 0), max_commands=20)
    assert len(a.fills) == 20 and len(a.rejected) == 5  # 20 accepted, 4 over the budget, 1 not in the palette
    b = B.parse_action(act(["/fill 0 1 0 1 air"]), task, 1, (3, 4), max_commands=20)
    assert b.fills == [] and "not yours" in b.rejected[0][1]  # agent 1 has no air
    c = B.parse_action(act(probe=[[1, 2], [9, 9], [4, 1], [0, 0]]), task, 0, (1, 0), max_commands=20)
    assert c.probes == [(1, 2), (4, 1)]  # max_probe 2, the out-of-map cell skipped


def test_messages_reach_the_other_agent_and_are_cut_at_the_limit(item):
    feedback = B.BridgeBuildFeedback()
    note = {"pillars": [{"x": 1, "z": 2, "type": "Y"}], "plan": "meet at row 3"}
    a, b = feedback(item["prompt"], [act(comm=note), act(comm={})], 2, [[""], [""]], [[act(comm=note)], [""]])
    text = json.dumps(note, separators=(",", ":"))
    assert text in b and text not in a  # delivered to agent 1 only
    assert "messages from teammates:\n(none)" in a
    limited = dict(item, max_message_chars=20)
    _, b = B.BridgeBuildFeedback(tasks=[limited])(item["prompt"], [act(comm=note), ""], 2)
    assert f"1. {text[:20]} ... [cut at 20 characters]" in b and text not in b
    # a later turn keeps the earlier messages (the inbox grows), in order
    later = {"second": True}
    history = [[act(comm=note), act(comm=later)], ["", ""]]
    _, b = feedback(item["prompt"], [act(comm=later), ""], 2, [["", ""], ["", ""]], history)
    assert b.index(text) < b.index('{"second":true}')


def test_partial_observability_and_probes(item):
    narrow = dict(item, view=1)
    a0, b0 = B.bridgebuild_prompt(narrow, 0), B.bridgebuild_prompt(narrow, 1)
    # agent 0 on S(1,0) sees x 0..2, z 0..1: no pillar, no T; agent 1 on T(3,4) sees x 2..4, z 3..4.
    assert '- anchors: [{"coord":[1,0],"kind":"S"}]' in a0 and "- land: [[0,0],[1,0],[2,0]]" in a0
    assert "- pillars of unknown kind: []" in a0 and '"kind":"T"' not in a0
    assert '- anchors: [{"coord":[3,4],"kind":"T"}]' in b0 and '"kind":"S"' not in b0
    # agent 0 walks to (1,1) and probes three cells (max_probe 2: the first two count; one is no pillar)
    move = act(probe=[[1, 2], [0, 0], [4, 1]], path=[[1, 0], [1, 1]], cmds=["/fill 0 1 0 1 oak_planks"])
    a1, b1 = B.BridgeBuildFeedback(tasks=[narrow])(narrow["prompt"], [move, ""], 2, [[""], [""]], [[move], [""]])
    assert "- your position: [1,1]" in a1 and "- pillars of unknown kind: [[1,2]]" in a1
    assert '- your probe results: [{"coord":[0,0],"type":"none"},{"coord":[1,2],"type":"Y"}]' in a1
    assert "- placed blocks '*': [[0,1]]" in a1 and "- placed blocks '*': []" in b1  # B cannot see the block
    assert "- your probe results: []" in b1


@pytest.mark.parametrize("mode", ["empty_feedback", "perfect_feedback", "position_feedback", "score_feedback"])
def test_feedback_modes(item, mode):
    prompts = B.BridgeBuildFeedback(mode=mode, previous_response=True)(
        item["prompt"], [BRIDGE_A, BRIDGE_B], 2, [["p"], ["p"]], [[BRIDGE_A], [BRIDGE_B]]
    )
    assert all(p.startswith(B.SYSTEM_PROMPT) and "Turn 2 of 4" in p for p in prompts)
    assert prompts[0].endswith(BRIDGE_A) and prompts[1].endswith(BRIDGE_B)
    assert all("The game is over (S and T are joined)" in p for p in prompts)
    if mode == "score_feedback":
        assert f"- reward: {15 - 20 / 13:.4f}" in prompts[0] and "- S and T joined: True" in prompts[0]
    if mode == "perfect_feedback":
        assert "blocks still missing between S and T: 0 (at the start: 4)" in prompts[1]
    if mode == "position_feedback":
        assert "- position: [3,4]" in prompts[1]
    bare = B.BridgeBuildFeedback(mode=mode, original_prompt=False)(item["prompt"], [BRIDGE_A, BRIDGE_B], 2)
    assert not bare[0].startswith(B.SYSTEM_PROMPT)
    with pytest.raises(ValueError, match="mode must be one of 'empty_feedback'"):
        B.BridgeBuildFeedback(mode="hint_feedback")


def test_one_agent(item):
    prompt = B.bridgebuild_single_prompt(item)
    assert prompt.count("You work alone.") == 1 and "at most 40 /fill commands" in prompt  # the whole budget
    assert "at most 20 /fill commands" in B.bridgebuild_agent1_prompt(item)  # 40 split between two
    # two of the four bridge cells, (1,1) and (1,3): gap 4 -> 2, groups 3 -> 2, Y joined, 2 blocks.
    assert B.bridgebuild_reward([BRIDGE_A], batch_items=[item])[0] == pytest.approx(2.5 + 1.5 + 5 - 10 / 13)


def test_generator_is_deterministic_and_bridgeable():
    first, again = B.generate_bridge_maps(12, seed=3), B.generate_bridge_maps(12, seed=3)
    assert first == again and first != B.generate_bridge_maps(12, seed=4)
    for m in first:
        task = B.BridgeTask(task_id=m["task_id"], rows=B.check_rows(m["task_id"], m["map"]))
        assert (task.width, task.height) == (13, 11) and len(task.anchors_s) == len(task.anchors_t) == 1
        assert 8 <= len(task.false_pillars) <= 15 and len(task.true_pillars) >= 2
        assert B.gap_st(task, set()) is not None and not B.connected_st(task, set())
    items = B.BridgeBuildTasks(count=10, seed=3, split="eval")()
    assert [i["task_id"] for i in items] == ["bridge_build_gen3_0009", "bridge_build_gen3_0010"]
    assert items[0]["rows_topdown"] == first[8]["map"] and items[0]["max_turns"] == 4


def test_file_loader_and_errors(tmp_path, monkeypatch):
    tasks = [{"task_id": f"m{k}", "map": list(ROWS)} for k in range(9)] + [{"map": "\n".join(ROWS), "max_turns": 9}]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(tasks))
    assert len(B.bridgebuild_tasks(path, split="train")) == 8
    last = B.bridgebuild_tasks(path, split="[9:]", max_turns=None)[0]
    assert last["task_id"] == "bridge_build_0010" and last["max_turns"] == 9
    assert B.bridgebuild_tasks(path, split="[:1]", max_turns=None)[0]["max_turns"] == 25  # 5 x the longer side
    (tmp_path / "bridge_build").mkdir()
    (tmp_path / "bridge_build" / "data.json").write_text(json.dumps(tasks[:1]))
    monkeypatch.setenv("COMLRL_MINECRAFT_DATA", str(tmp_path))
    assert B.BridgeBuildTasks(source="file", split="all")()[0]["task_id"] == "m0"
    monkeypatch.setenv("COMLRL_MINECRAFT_DATA", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="OpenMLRL/LLM_Collab_Minecraft.*COMLRL_MINECRAFT_DATA"):
        B.bridgebuild_train_tasks()
    with pytest.raises(ValueError, match="source must be one of 'generated', 'file'; got 'web'"):
        B.BridgeBuildTasks(source="web")
    with pytest.raises(ValueError, match="split must be one of 'train', 'eval', 'all'"):
        B.BridgeBuildTasks(split="test")
    with pytest.raises(ValueError, match="max_probe must be between 0 and 3; got 5"):
        B.BridgeBuildTasks(max_probe=5)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"task_id": "x1", "map": ["S.Q", "..T"]}]))
    with pytest.raises(ValueError, match=r"x1: the map has characters \['Q'\]"):
        B.bridgebuild_tasks(bad)
    bad.write_text(json.dumps([{"task_id": "x2", "map": ["S..", "..."]}]))
    with pytest.raises(ValueError, match="x2: the map needs at least one S and one T"):
        B.bridgebuild_tasks(bad)
    with pytest.raises(KeyError, match="no BridgeBuild task has the prompt key"):
        B.BridgeBuildFeedback()("bridge_build:nope", ["", ""], 2)


# ------------------------------------------------------------------------------------------------ fits
def _actor_critic(config: Path, root: Path, class_path: str, extra: dict) -> Path:
    """The CPU config with another trainer: one sample per prompt (multi-turn actor-critic) and a buffer of one
    two-turn path, drained as one update per turn."""
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["class_path"] = class_path
    cfg["model"]["init_args"].update(num_generations=1, rollout_buffer_size=2, discount=0.9, **extra)
    out = root / "src" / config.name
    out.parent.mkdir()
    out.write_text(yaml.safe_dump(cfg))
    return out


@pytest.mark.parametrize(
    "trainer, extra",
    [
        ("comlrl_lightning.MAGRPO", None),
        ("comlrl_lightning.IAC", {"use_separate_critic": False}),
        ("comlrl_lightning.MAAC", {"critic_model": "smollm2-135m-instruct", "critic_type": "v"}),
    ],
    ids=["magrpo", "iac", "maac"],
)
def test_cpu_config_fits_two_updates(trainer, extra, tmp_path, monkeypatch):
    from test_configs import fit_two_updates, small_config

    monkeypatch.chdir(tmp_path)
    config = REPO / "configs" / "bridgebuild_magrpo.yaml"
    if extra is not None:
        config = _actor_critic(config, tmp_path, trainer, extra)
    rows = fit_two_updates(small_config(config, tmp_path), tmp_path)
    assert any(row.get("eval/turn_1/avg_total_reward") for row in rows)
    if extra is None:
        trained = {k for row in rows for k, v in row.items() if v and not k.startswith("eval/")}
        assert any(k.endswith("turn_2/reward_mean") for k in trained)  # the second turn was sampled and trained on
