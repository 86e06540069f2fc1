"""Minecraft environments (StrBuild, HouseBuild): hand-checked rewards, parsing that never raises, every feedback mode
on a small case, choices and loaders, and two-update fits of the CPU configs with tiny models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from comlrl_lightning.envs.minecraft import housebuild as H
from comlrl_lightning.envs.minecraft import strbuild as S
from comlrl_lightning.envs.minecraft.common import TASKS, command_lines, parse_coordinate

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "minecraft"
needs_data = pytest.mark.skipif(
    not DATA.exists(),
    reason=f"shared Minecraft data not found under {DATA} "
    "(../shared/data; the tasks come from github.com/OpenMLRL/LLM_Collab_Minecraft)",
)


# ------------------------------------------------------------------------------------------------ StrBuild
@pytest.fixture
def letter_i():
    """The word "I" as an item (no data file needed: the glyph is the font's). Its 13 target cells, by (x, y):
    top row y=4 x=0..4, the stem x=2 at y=3, 2, 1, bottom row y=0 x=0..4; 12 background cells. Owner of a cell:
    (x + y) mod 2 — agent 0 has 7 cells, agent 1 has 6, and side-by-side cells always have different owners."""
    rows = S.render_word("I", 2)
    assert rows == ("#####", "..#..", "..#..", "..#..", "#####")
    task = S.StrBuildTask(
        task_id="str_build_t001",
        word="I",
        difficulty=1,
        rows=rows,
        bbox_from=(0, 0, 0),
        bbox_to=(4, 4, 0),
        blocks=(S.DEFAULT_BLOCKS_AGENT1, S.DEFAULT_BLOCKS_AGENT2),
    )
    item = task.to_item()
    TASKS.add([item])
    return item


AGENT0_CELLS = [(0, 4), (2, 4), (4, 4), (2, 2), (0, 0), (2, 0), (4, 0)]
AGENT1_CELLS = [(1, 4), (3, 4), (2, 3), (2, 1), (1, 0), (3, 0)]


def setblocks(cells, blocks):
    return "\n".join(f"/setblock {x} {y} 0 {blocks[k % len(blocks)]}" for k, (x, y) in enumerate(cells))


def test_strbuild_perfect_build_scores_the_maximum(letter_i):
    # Every letter cell covered, no background block, no same-texture neighbours (owners alternate and the two
    # palettes share no texture), all four blocks used: 2·1 − 0 − 0 − 0 = 2.
    a = setblocks(AGENT0_CELLS, ["oak_planks", "stone"])
    b = setblocks(AGENT1_CELLS, ["white_concrete", "obsidian"])
    br = S.strbuild_breakdown([a, b], letter_i)
    assert br["total"] == pytest.approx(2.0) == S.REWARD_MAX
    assert br["coverage"] == 1.0 and br["extra_ratio"] == 0.0 and br["missing_palettes"] == 0.0
    assert br["adjacent_pairs"] == 12 and br["adjacent_same_pairs"] == 0  # 4 + 4 in the bars, 4 up the stem
    assert S.strbuild_reward([a], [b], batch_items=[letter_i]) == [pytest.approx(2.0)]
    assert S.strbuild_reward.reward_range == (-3.0, 2.0)


def test_strbuild_empty_and_worst_builds(letter_i):
    # Nothing built: coverage 0, no extra, no pairs, both palettes unused: −0.25·2 = −0.5.
    assert S.strbuild_reward([""], [""], batch_items=[letter_i]) == [pytest.approx(-0.5)]
    # The floor: the 12 background cells (x = 0, 1, 3, 4 at y = 1, 2, 3) all stone, no letter cell: coverage 0,
    # extra 12/12, pairs 2 per row x 3 rows + 2 per column x 4 columns = 14, all the same texture, both palettes
    # incomplete: −1.5 − 1 − 0.5 = −3.
    background = [(x, y) for y in (1, 2, 3) for x in (0, 1, 3, 4)]
    br = S.strbuild_breakdown([setblocks(background, ["stone"]), ""], letter_i)
    assert (br["extra_ratio"], br["adjacent_pairs"], br["adjacent_same_ratio"]) == (1.0, 14, 1.0)
    assert br["total"] == pytest.approx(-3.0) == S.REWARD_MIN


def test_strbuild_half_builds_score_in_between(letter_i):
    # Agent 0 builds its 7 cells in oak_planks only, agent 1 nothing: coverage 7/13, no pairs (agent 0's cells never
    # touch), both palettes incomplete (no stone; nothing of agent 1): 2·7/13 − 0.5 = 15/26.
    half = S.strbuild_reward([setblocks(AGENT0_CELLS, ["oak_planks"])], [""], batch_items=[letter_i])[0]
    assert half == pytest.approx(15 / 26)
    # Every term at once. Agent 0: oak (0,4), stone (2,4), oak (4,4) and an extra oak at (0,3); agent 1:
    # white_concrete (1,4), obsidian (3,4). Covered 5/13; extra 1/12; pairs along the top row 4 (all different
    # textures) + (0,3)-(0,4) oak over oak = 5 pairs, 1 the same; every palette used: 10/13 − 1.5/12 − 1/5.
    a = "/setblock 0 4 0 oak_planks\n/setblock 2 4 0 stone\n/setblock 4 4 0 oak_planks\n/setblock 0 3 0 oak_planks"
    b = "/setblock 1 4 0 white_concrete\n/setblock 3 4 0 obsidian"
    br = S.strbuild_breakdown([a, b], letter_i)
    assert (br["covered"], br["extra_blocks"], br["adjacent_pairs"], br["adjacent_same_pairs"]) == (5, 1, 5, 1)
    assert br["total"] == pytest.approx(10 / 13 - 1.5 / 12 - 1 / 5)
    assert -0.5 < br["total"] < 2.0 and -0.5 < half < 2.0


def test_strbuild_overwrites_budget_and_single_agent(letter_i):
    # Agent 1 runs second: its obsidian replaces agent 0's oak at (0,4) (the cell is covered once).
    br = S.strbuild_breakdown(["/setblock 0 4 0 oak_planks", "/setblock 0 4 0 obsidian"], letter_i)
    assert br["covered"] == 1 and br["accepted_commands"] == 2
    # Budget: 300 commands → 150 each; the 151st accepted line of an agent is rejected.
    task = S.StrBuildTask.from_item(letter_i)
    many = "\n".join(["/setblock 0 4 0 oak_planks"] * 151)
    parsed = S.parse_team(task, [many, ""])
    assert len(parsed[0].accepted) == 150 and parsed[0].rejected[0][1] == "over the budget of 150 commands"
    # One agent alone (palette block_agent1, the whole budget) builds all 13 cells in oak_planks: coverage 1, every
    # one of the 12 pairs the same texture, stone unused: 2 − 1 − 0.25.
    one = S.strbuild_breakdown([setblocks(AGENT0_CELLS + AGENT1_CELLS, ["oak_planks"])], letter_i)
    assert one["coverage"] == 1.0 and one["missing_palettes"] == 1.0 and one["adjacent_same_ratio"] == 1.0
    assert one["total"] == pytest.approx(2.0 - 1.0 - 0.25)
    with pytest.raises(ValueError, match="palettes for 2 agents"):
        S.strbuild_breakdown(["", "", ""], letter_i)


JUNK = [
    "",
    "hello world",
    "/setblock",
    "/setblock 0 4 0",
    "/setblock ~ ~ ~ stone",
    "/setblock ^1 4 0 stone",
    "/setblock 1.5 4 0 stone",
    "/setblock 99999999999999999999999999999 4 0 stone",
    "/setblock " + "9" * 5000 + " 4 0 stone",
    "/setblock -0 4 0 stone\x00",
    "/setblock 0 4 0 diamond_block",
    "/SETBLOCK 0 4 0 minecraft:stone",
    "```",
    "```\n",
    "```mcfunction\n/setblock 0 4 0 stone",
    "\u202e/setblock 0 4 0 stone",
    "/fill 0 0 0 4 4 0 stone",
    "/kill @e",
    "{'a': [1, {'b': None}]}",
    "[[[[[[]]]]]]",
    "\n" * 1000,
    "/setblock 0 4 0 stone " * 300,
    "💥" * 2000,
    None,
    42,
    3.5,
    b"/setblock 0 4 0 stone",
    ["/setblock 0 4 0 stone"],
    {"nested": [{"junk": ()}]},
    object(),
    float("nan"),
    True,
]


@pytest.mark.parametrize("junk", JUNK, ids=range(len(JUNK)))
def test_strbuild_malformed_completions_score_without_raising(letter_i, junk):
    for pair in ([junk, ""], ["", junk], [junk, junk]):
        value = S.strbuild_reward([pair[0]], [pair[1]], batch_items=[letter_i])[0]
        assert math.isfinite(value) and S.REWARD_MIN <= value <= S.REWARD_MAX
        for mode in ("perfect_feedback", "position_feedback", "score_feedback"):
            prompts = S.StrBuildFeedback(mode, previous_response=True)(letter_i["prompt"], pair, 2)
            assert len(prompts) == 2 and all(isinstance(p, str) for p in prompts)


def test_parsing_helpers():
    assert command_lines("```mcfunction\n- /setblock 1 2 3 stone\n\n2) /setblock 4 5 6 air\n```\ntext") == [
        "/setblock 1 2 3 stone",
        "/setblock 4 5 6 air",
    ]
    assert command_lines("```\nunclosed") == ["```", "unclosed"] and command_lines(None) == []
    assert [parse_coordinate(t) for t in ("12", "-3", "~1", "^0", "1.0", "1e3", "9" * 5000, None)] == [
        12,
        -3,
        None,
        None,
        None,
        None,
        None,
        None,
    ]
    task = S.StrBuildTask(
        task_id="t",
        word="I",
        difficulty=1,
        rows=S.render_word("I", 2),
        bbox_from=(0, 0, 0),
        bbox_to=(4, 4, 0),
        blocks=(S.DEFAULT_BLOCKS_AGENT1, S.DEFAULT_BLOCKS_AGENT2),
    )
    parsed = S.parse_setblocks(
        "```\n/setblock 0 4 0 minecraft:stone\nsetblock 9 9 0 stone\n/give x\n```",
        ["stone"],
        task.bbox_from,
        task.bbox_to,
        10,
    )
    assert parsed.accepted == [((0, 4, 0), "stone")]
    assert [r for _, r in parsed.rejected] == ["outside the bounding box", "unsupported command 'give'"]


# ------------------------------------------------------------------------------------------------ StrBuild feedback
def test_strbuild_feedback_modes(letter_i):
    # Agent 0 sets oak at (0,4); agent 1 sets obsidian at (0,3), a background cell.
    answers = ["/setblock 0 4 0 oak_planks", "/setblock 0 3 0 obsidian"]
    history = [["first prompt 0"], ["first prompt 1"]]  # one turn so far: the feedback is for turn 2
    # The reference colouring gives every agent-0 cell oak_planks and every agent-1 cell obsidian.
    expected, owners = S.expected_blocks(S.StrBuildTask.from_item(letter_i), 2)
    assert {expected[(x, y, 0)] for x, y in AGENT0_CELLS} == {"oak_planks"}
    assert {expected[(x, y, 0)] for x, y in AGENT1_CELLS} == {"obsidian"}

    p0, p1 = S.StrBuildFeedback("perfect_feedback", original_prompt=False)(letter_i["prompt"], answers, 2, history)
    assert p0.startswith(S.SYSTEM_PROMPT) and "- Turn: 2" in p0
    # Agent 0: its 6 unfixed cells, top layer first then by x; (0,4) is right.
    fix0 = "- (2, 4, 0)\n- (4, 4, 0)\n- (2, 2, 0)\n- (0, 0, 0)\n- (2, 0, 0)\n- (4, 0, 0)"
    assert fix0 in p0 and "(0, 4, 0)" not in p0 and "Clear these extra blocks" not in p0
    fix1 = "- (1, 4, 0)\n- (3, 4, 0)\n- (2, 3, 0)\n- (2, 1, 0)\n- (1, 0, 0)\n- (3, 0, 0)"
    assert fix1 in p1 and "Clear these extra blocks (set them to air):\n- (0, 3, 0)" in p1
    assert "Target grid" not in p0  # no original prompt asked for

    p0, p1 = S.StrBuildFeedback("position_feedback", previous_response=True)(letter_i["prompt"], answers, 2, history)
    assert "about 6" in p0 and "At most 150 commands" in p0 and p0.count("\n- (") == 13
    assert "- oak_planks\n- stone\n- air" in p0 and "- white_concrete\n- obsidian\n- air" in p1
    assert p0.endswith("Your previous commands:\n/setblock 0 4 0 oak_planks")
    assert "Target grid (top row first):\n#####" in p0  # the original prompt (provide_graph) follows the feedback
    assert "You are agent 2 of a 2-agent" in p1

    # Score: coverage 1/13, extra 1/12, one pair (oak over obsidian, different), both palettes incomplete:
    # 2/13 − 1.5/12 − 0.5 = −0.47115...
    p0, p1 = S.StrBuildFeedback("score_feedback")(letter_i["prompt"], answers, 2, history)
    assert f"- Reward of the last build: {2 / 13 - 1.5 / 12 - 0.5:.4f}" in p0 and "-0.4712" in p1


def test_strbuild_choices_and_lookup_errors(letter_i):
    with pytest.raises(
        ValueError,
        match=r"mode must be one of 'perfect_feedback', 'position_feedback', "
        r"'score_feedback'; got 'rect_modification'",
    ):
        S.StrBuildFeedback("rect_modification")
    with pytest.raises(KeyError, match="no StrBuild task has the prompt key 'str_build:nope'"):
        S.StrBuildFeedback()("str_build:nope", ["", ""], 2)
    # Explicit tasks are looked up first.
    fed = S.StrBuildFeedback("score_feedback", tasks=[letter_i])(letter_i["prompt"], ["", ""], 2)
    assert "-0.5000" in fed[0]
    with pytest.raises(ValueError, match="expected 2 agent completions, got 1"):
        S.StrBuildFeedback()(letter_i["prompt"], [""], 2)


# ------------------------------------------------------------------------------------------------ HouseBuild
HOUSE = {
    "task_id": "house_t001",
    "inventory": {"S": "stone", "P": "oak_planks", "A": "air"},
    "target_spec": {
        "type": "y_layers",
        "size": [2, 2, 2],
        "layers": [{"y": 0, "rows": ["SS", "SS"]}, {"y": 1, "rows": ["PA", "AP"]}],
    },
    "bbox": {"from": [0, 0, 0], "to": [1, 1, 1]},
}


@pytest.fixture
def house(tmp_path):
    """A 2 x 2 x 2 house: y=0 all stone; y=1 oak_planks at (0,1,0) and (1,1,1), air at (1,1,0) and (0,1,1).
    8 cells: stone 4, oak_planks 2, air 2. Per-agent limits (2 agents): stone ceil(4/2) + floor(4/4) = 3,
    oak_planks 1 + 0 = 1. Two spiders attacking 3 each: damage 6 > 5 HP, penalty 0.1·min(1, 6/5) = 0.1."""
    path = tmp_path / "house.json"
    path.write_text(json.dumps([HOUSE]))
    (item,) = H.housebuild_tasks(path, spider_num=2, spider_atk_low=3, spider_atk_high=3)
    return item


def test_housebuild_loader_rules(house):
    task = H.HouseBuildTask.from_item(house)
    assert house["prompt"] == "house_build:house_t001" and house["spider_attacks"] == [3, 3]
    assert task.resource_limits(2) == {"stone": 3, "oak_planks": 1}
    assert task.resource_limits(1) == {"stone": 4 + 2, "oak_planks": 2 + 1}
    assert house["blocks"] == [["stone", "oak_planks", "air"]] * 2  # the inventory's blocks
    assert task.rectangles() == {
        0: [(0, 0, 1, 1, "stone")],
        1: [(0, 0, 0, 0, "oak_planks"), (1, 0, 1, 0, "air"), (0, 1, 0, 1, "air"), (1, 1, 1, 1, "oak_planks")],
    }
    prompt = H.housebuild_agent0_prompt(house)
    assert "y=0: {(0, 0, 0, 1, 0, 1 stone)}" in prompt and "(1, 1, 0, 1" not in prompt  # air rectangles left out
    assert "Their attacks: [3, 3], total damage 6" in prompt and "- stone: 3\n- oak_planks: 1" in prompt


PERFECT_A = "/fill 0 0 0 1 0 0 stone\n/fill 0 1 0 0 1 0 oak_planks\n/kill"
PERFECT_B = "/fill 0 0 1 1 0 1 stone\n/fill 1 1 1 1 1 1 oak_planks"


def test_housebuild_perfect_empty_and_half(house):
    # Perfect, with /kill: all 8 cells right, no penalty: 1 (the maximum). Without /kill: 1 − 0.1.
    assert H.housebuild_reward([PERFECT_A], [PERFECT_B], batch_items=[house]) == [pytest.approx(1.0)]
    assert H.housebuild_reward.reward_range == (-0.1, 1.0)
    no_kill = PERFECT_A.replace("\n/kill", "")
    assert H.housebuild_reward([no_kill], [PERFECT_B], batch_items=[house]) == [pytest.approx(0.9)]
    # Empty: only the 2 air cells match: 2/8 − 0.1 = 0.15 (the lowest a build without /kill and without wrong
    # blocks can score).
    assert H.housebuild_reward([""], [""], batch_items=[house]) == [pytest.approx(0.15)]
    # Half: agent 0 builds the z=0 stone row and kills: 2 stones + 2 air cells = 4/8 = 0.5.
    half = H.housebuild_breakdown(["/fill 0 0 0 1 0 0 stone\n/kill", ""], house)
    assert half["total"] == pytest.approx(0.5) and half["killed"] == 1.0
    # IoU: 2 of the 6 non-air target cells built, nothing else: 2/6.
    assert half["iou"] == pytest.approx(2 / 6)


def test_housebuild_resource_limits_wrong_blocks_and_budget(house):
    # 4 stones in one fill is over agent 0's stone limit of 3: rejected; the build stays empty (0.15).
    br = H.housebuild_breakdown(["/fill 0 0 0 1 0 1 stone", ""], house)
    assert br["rejected_commands"] == 1 and br["total"] == pytest.approx(0.15)
    parsed = H.parse_team(H.HouseBuildTask.from_item(house), ["/fill 0 0 0 1 0 1 stone", ""])
    assert parsed[0].rejected[0][1] == "over the stone limit (4 > 3)"
    # Split across the agents the same 4 stones fit (2 + 2); air is unlimited. A stone where air belongs is wrong:
    # 4 stones + (1,1,0) air right = 5/8, minus 0.1.
    br = H.housebuild_breakdown(
        ["/fill 0 0 0 1 0 0 stone\n/fill 0 1 0 1 1 1 air", "/fill 0 0 1 1 0 1 stone\n/fill 0 1 1 0 1 1 stone"], house
    )
    assert br["accepted_commands"] == 4 and br["total"] == pytest.approx(5 / 8 - 0.1)
    # Fill modes, relative coordinates and corners outside the box are rejected.
    bad = "/fill 0 0 0 1 0 0 stone replace\n/fill ~ 0 0 1 0 0 stone\n/fill 0 0 0 2 0 0 stone\n/fill 0 0 0 stone"
    assert [r for _, r in H.parse_team(H.HouseBuildTask.from_item(house), [bad, ""])[0].rejected] == [
        "fill modes (replace, keep, ...) are not allowed",
        "coordinates must be absolute integers",
        "outside the bounding box",
        "fill needs x1 y1 z1 x2 y2 z2 block",
    ]


HOUSE_JUNK = JUNK + [
    "/fill 0 0 0 999999999999999999999 1 1 stone",
    "/fill -5 -5 -5 5 5 5 stone",
    "/kill\n" * 400,
    "/fill 0 0 0 1 1 1 stone\n" * 400,
    "/fill " + "1 " * 6 + "oak_planks extra",
]


@pytest.mark.parametrize("junk", HOUSE_JUNK, ids=range(len(HOUSE_JUNK)))
def test_housebuild_malformed_completions_score_without_raising(house, junk):
    for pair in ([junk, ""], ["", junk], [junk, junk]):
        value = H.housebuild_reward([pair[0]], [pair[1]], batch_items=[house])[0]
        assert math.isfinite(value) and H.REWARD_MIN <= value <= H.REWARD_MAX
        for mode in (
            "perfect_feedback",
            "position_feedback",
            "position_modification",
            "rect_modification",
            "resource_schedule",
            "score_feedback",
        ):
            prompts = H.HouseBuildFeedback(mode, previous_response=True, lim=5)(house["prompt"], pair, 2)
            assert len(prompts) == 2 and all(isinstance(p, str) for p in prompts)


# ------------------------------------------------------------------------------------------------ HouseBuild feedback
# The build of every feedback test: agent 0 the z=0 stone row; agent 1 a stone at (0,1,1), where air belongs.
# Right: (0,0,0), (1,0,0) stone, (1,1,0) air. Wrong, in the box's y, z, x order: (0,0,1) stone, (1,0,1) stone,
# (0,1,0) oak_planks, (0,1,1) air, (1,1,1) oak_planks. Reward 3/8 − 0.1 = 0.275.
BUILD = ["/fill 0 0 0 1 0 0 stone", "/fill 0 1 1 0 1 1 stone"]


def feedback(house, mode, **kwargs):
    return H.HouseBuildFeedback(mode, original_prompt=kwargs.pop("original_prompt", False), **kwargs)(
        house["prompt"], BUILD, 2, [["p0"], ["p1"]]
    )


def test_housebuild_perfect_feedback(house):
    p0, p1 = feedback(house, "perfect_feedback")
    # Wrong cells top layer first, then x, then z; both palettes hold every block, so they alternate:
    # (0,1,0) → agent 0, (0,1,1) → agent 1, (1,1,1) → agent 0, (0,0,1) → agent 1, (1,0,1) → agent 0.
    assert "Set these blocks:\n- (0, 1, 0) = oak_planks\n- (1, 1, 1) = oak_planks\n- (1, 0, 1) = stone" in p0
    assert "Set these blocks:\n- (0, 1, 1) = air\n- (0, 0, 1) = stone" in p1
    assert "- Turn: 2" in p0 and "Clear these extra blocks" in p1 and "Clear these extra blocks" not in p0
    # Without the original prompt the resource limits are repeated.
    assert "Resource limits per agent (air is unlimited):\n- stone: 3\n- oak_planks: 1" in p0


def test_housebuild_position_feedback_and_modification(house):
    p0, _ = feedback(house, "position_feedback")
    assert "about 3" in p0 and "At most 300 commands" in p0
    assert "Target positions:\n- (0, 1, 0) = oak_planks\n- (1, 1, 1) = oak_planks\n- (0, 0, 0) = stone" in p0
    assert "Resource limits" not in p0
    p0, p1 = feedback(house, "position_modification", lim=2)  # bottom layer first, the first 2, same for both
    fixes = "Suggested fixes (use them to correct the build):\n(0 0 1 stone)\n(1 0 1 stone)"
    assert p0.endswith(fixes) and p1.endswith(fixes)
    p0, _ = feedback(house, "position_modification", lim=None, original_prompt=True)
    assert p0.index("Task: build the 3D structure") < p0.index("Suggested fixes") and "(1 1 1 oak_planks)" in p0


def test_housebuild_rect_modification(house):
    p0, p1 = feedback(house, "rect_modification", previous_response=True)
    # The rectangles holding a wrong cell: y=0's stone slab, and at y=1 the planks at (0,0), the air at (0,1) and
    # the planks at (1,1). Agent 0 gets those with y <= 2 (all), agent 1 those with y >= 2 (none).
    assert (
        "Suggested rectangles to fix the mismatches:\ny=0: (0, 0, 1, 1 stone)\ny=1: (0, 0, 0, 0 oak_planks)\n"
        "y=1: (0, 1, 0, 1 air)\ny=1: (1, 1, 1, 1 oak_planks)"
    ) in p0
    assert "Suggested rectangles to fix the mismatches:\n(none)" in p1
    assert "Accepted commands from your last turn:\n- /fill 0 0 0 1 0 0 stone" in p0
    assert p1.endswith("Your previous raw output:\n/fill 0 1 1 0 1 1 stone")
    p0, _ = feedback(house, "rect_modification", lim=1)
    assert "y=0: (0, 0, 1, 1 stone)\n" not in p0 and "y=0: (0, 0, 1, 1 stone)" in p0 and "y=1:" not in p0


def test_housebuild_resource_schedule_and_score(house, tmp_path):
    p0, p1 = feedback(house, "resource_schedule")
    # Agent 0 used 2 stones: 1 stone and 1 plank left. Largest first: the 4-cell slab does not fit, the first
    # plank does (planks now 0), the second does not; then the largest part of the slab 1 stone allows: 1 cell.
    assert "Resources left after the last turn (air is unlimited):\n- stone: 1\n- oak_planks: 1" in p0
    assert (
        "Suggested rectangles to build next (largest first):\ny=1: (0, 0, 0, 0 oak_planks)\ny=0: (0, 0, 0, 0 stone)"
    ) in p0
    # Agent 1 used 1 stone: 2 left; the plank, then a 2 x 1 part of the slab.
    assert "- stone: 2\n- oak_planks: 1" in p1
    assert "y=1: (0, 0, 0, 0 oak_planks)\ny=0: (0, 0, 1, 0 stone)" in p1
    assert H.best_subrect(0, 0, 3, 2, 5) == (0, 0, 3, 0, 4) and H.best_subrect(0, 0, 1, 1, 0)[-1] == 0
    p0, _ = feedback(house, "score_feedback")
    assert "- Reward of the last build: 0.2750" in p0
    unlimited = tmp_path / "u.json"
    unlimited.write_text(json.dumps(dict(HOUSE, task_id="house_t002")))
    (item,) = H.housebuild_tasks(unlimited, limited_resource=False)
    with pytest.raises(ValueError, match="resource_schedule needs items loaded with limited_resource=True"):
        H.HouseBuildFeedback("resource_schedule")(item["prompt"], BUILD, 2)


def test_housebuild_choices_and_loader_errors(tmp_path):
    with pytest.raises(ValueError, match=r"mode must be one of 'perfect_feedback', .*'score_feedback'; got 'nope'"):
        H.HouseBuildFeedback("nope")
    with pytest.raises(ValueError, match="lim must be >= 0 or null; got -1"):
        H.HouseBuildFeedback(lim=-1)
    path = tmp_path / "h.json"
    path.write_text(json.dumps(HOUSE))
    with pytest.raises(ValueError, match=r"split must be one of 'train', 'eval', 'all' or a slice"):
        H.HouseBuildTasks(path=str(path), split="validation")
    with pytest.raises(ValueError, match=r"spider_atk_low \(4\) must be <= spider_atk_high \(3\)"):
        H.housebuild_tasks(path, spider_atk_low=4)
    with pytest.raises(ValueError, match="block_agent2 must list at least one block other than air"):
        H.housebuild_tasks(path, block_agent2=["air"])
    bad = dict(HOUSE, target_spec={"layers": [{"y": 0, "rows": ["SX", "SS"]}, {"y": 1, "rows": ["PA", "AP"]}]})
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"house_t001: layer y=0 uses letters \['X'\]"):
        H.housebuild_tasks(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        H.housebuild_tasks(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="block_agent1 must list at least one block other than air"):
        S.strbuild_tasks(path, block_agent1=["air"])
    with pytest.raises(KeyError, match="no HouseBuild task has the prompt key"):
        H.HouseBuildFeedback()("house_build:nope", ["", ""], 2)


# ------------------------------------------------------------------------------------------------ real data
@needs_data
def test_strbuild_data():
    items = S.strbuild_tasks()
    assert [i["string"] for i in items] == ["I", "C", "M", "L", "MC", "CM", "LI", "LLM", "ICML", "CLIM"]
    assert [i["task_id"] for i in items[:2]] == ["str_build_0001", "str_build_0002"]
    assert len(S.strbuild_train_tasks()) == 8 and len(S.strbuild_eval_tasks()) == 2
    icml = items[8]
    # 4 letters of 5 columns, 2 apart: 26 columns.
    assert icml["bbox_to"] == [25, 4, 0] and icml["prompt"] == "str_build:str_build_0009:ICML"
    assert icml["target_rows"][0] == "#####...####..#...#..#...."
    blind = S.StrBuildTasks(split="[8:9]", provide_graph=False)()
    prompt = S.strbuild_agent0_prompt(blind[0])
    assert "Target grid" not in prompt and "'#'" not in prompt and "[25,4,0]" in prompt


@needs_data
def test_housebuild_data_perfect_build_scores_one():
    items = H.housebuild_tasks()
    assert len(items) == 10 and len(H.housebuild_train_tasks()) == 8 and len(H.housebuild_eval_tasks()) == 2
    first = items[0]
    task = H.HouseBuildTask.from_item(first)
    assert first["task_id"] == "house_build_0002" and first["bbox_to"] == [5, 6, 6]
    # The data's block counts: C 68, O 12, S 36, B 54, D 2 → limits per agent ceil(c/2) + floor(c/4).
    assert task.resource_limits(2) == {
        "white_concrete": 51,
        "obsidian": 9,
        "stone_stairs": 27,
        "stone_bricks": 40,
        "planks": 1,
    }
    # Cell by cell, each to the agent with resources left: within both limits and budgets (172 non-air cells).
    limits = task.resource_limits(2)
    used = [dict.fromkeys(limits, 0), dict.fromkeys(limits, 0)]
    lines = [["/kill"], []]
    for (x, y, z), block in task.expected().items():
        if block == "air":
            continue
        agent = 0 if used[0][block] < limits[block] else 1
        used[agent][block] += 1
        lines[agent].append(f"/fill {x} {y} {z} {x} {y} {z} {block}")
    assert H.housebuild_reward(["\n".join(lines[0])], ["\n".join(lines[1])], batch_items=[first]) == [1.0]
    # Empty: 122 air cells of 294, spiders [2, 2, 1] (spider_seed 0): 5 damage on 5 HP, penalty 0.1.
    assert first["spider_attacks"] == [2, 2, 1]
    assert H.housebuild_reward([""], [""], batch_items=[first]) == [pytest.approx(122 / 294 - 0.1)]
    assert "- white_concrete: 51" in H.housebuild_agent1_prompt(first)


def test_data_root_from_environment(tmp_path, monkeypatch):
    # $COMLRL_MINECRAFT_DATA in the repository's layout (<env>/dataset/<file>).
    (tmp_path / "str_build" / "dataset").mkdir(parents=True)
    (tmp_path / "str_build" / "dataset" / "data.csv").write_text("string,difficulty\nHI,1\n")
    monkeypatch.setenv("COMLRL_MINECRAFT_DATA", str(tmp_path))
    (item,) = S.strbuild_tasks()
    assert item["string"] == "HI" and item["bbox_to"] == [11, 4, 0]
    monkeypatch.setenv("COMLRL_MINECRAFT_DATA", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="OpenMLRL/LLM_Collab_Minecraft"):
        H.housebuild_tasks()


# ------------------------------------------------------------------------------------------------ eval and fits
def test_eval_logger_and_aggregator(letter_i, house):
    turns = [[["/setblock 0 4 0 oak_planks", ""]], [["", "/setblock 1 4 0 obsidian"]]]  # 1 sample, 2 turns
    rows = S.strbuild_eval_logger(turns, batch_items=[letter_i])
    assert rows[0]["turn_1/coverage"] == pytest.approx(1 / 13) and rows[0]["turn_2/coverage"] == pytest.approx(1 / 13)
    agg = S.strbuild_eval_aggregator(rows, num_turns=2)
    assert set(agg) == {f"turn_{t}/avg_{m}" for t in (1, 2) for m in S.EVAL_METRICS}
    rows = H.housebuild_eval_logger([[[PERFECT_A]], [[PERFECT_B]]], batch_items=[house])
    assert H.housebuild_eval_aggregator(rows)["turn_1/avg_total_reward"] == pytest.approx(1.0)


@needs_data
@pytest.mark.parametrize("name", ["strbuild_magrpo", "housebuild_magrpo"])
def test_cpu_config_fits_two_updates(name, tmp_path, monkeypatch):
    from test_configs import fit_two_updates, small_config

    monkeypatch.chdir(tmp_path)
    rows = fit_two_updates(small_config(REPO / "configs" / f"{name}.yaml", tmp_path), tmp_path)
    trained = {k for row in rows for k, v in row.items() if v and not k.startswith("eval/")}
    assert any(k.endswith("turn_2/reward_mean") for k in trained)  # the feedback turn was sampled and trained on
    assert any(row.get("eval/turn_1/avg_total_reward") for row in rows)
    assert any(row.get("eval/turn_2/avg_rejected_commands") for row in rows)
