"""StrBuild: two agents spell a word in blocks with ``/setblock`` commands (OpenMLRL/LLM_Collab_Minecraft).

Task. An item is a word from the data (``str_build/data.csv``: ``string,difficulty``; "I", "MC", "ICML", ...). Each
letter is a 5 × 5 glyph (the environment repository's font, so the targets are the same), letters ``spacing``
columns apart. The word stands in the x–y plane at ``z = local_z``: the bounding box runs from
``(0, 0, local_z)`` to ``(width − 1, 4, local_z)``, x left to right, y bottom to top (the glyph's top row is
``y = 4``). The cells of the letters are the *target*, the other cells of the box the *background*.

Agents. Agent 0 may use ``block_agent1`` (default ``oak_planks, stone, air``), agent 1 ``block_agent2``
(``white_concrete, obsidian, air``). Both answer at once with ``/setblock x y z block`` lines; the commands are
applied agent 0 first, then agent 1 (agent 1 overwrites). One agent alone (``num_agents = 1``) uses
``block_agent1`` and the whole budget.

Parser (:func:`parse_setblocks`, never raises). Lines are read by :func:`~.common.command_lines` (fenced block,
list markers). A line is *accepted* when it is ``setblock`` (``/`` optional, any case) with at least four more
words, integer absolute coordinates inside the box, and a block from the agent's palette (``minecraft:`` prefix
allowed; ``air`` always allowed); every other line is *rejected* with a reason. Each agent has a budget of
accepted commands (``max_commands`` split as :func:`~.common.command_budget`: 150 + 150 of the default 300);
lines after the budget is spent are rejected.

Reward (:func:`strbuild_breakdown`; range [−3, 2] for two agents), from the world the accepted commands build::

    R = 2.0·coverage − 1.5·extra_ratio − 1.0·adjacent_same_ratio − 0.25·missing_palettes

    coverage             target cells holding a block (any block) / target cells
    extra_ratio          background cells holding a block / background cells      (0 without background)
    adjacent_same_ratio  among pairs of side-by-side placed blocks (x and x+1, or y and y+1), the share whose
                         textures are the same; textures: *_planks / *_wood = wood; stone, cobblestone,
                         smooth_stone, *_stone, *_stone_bricks = stone; *_concrete = concrete; others by name
    missing_palettes     agents whose palette (air excluded) is not entirely present somewhere in the build

A perfect build (every target cell, no background cell, no two same textures side by side, all four blocks
used) scores 2.0. Building nothing scores −0.5 (both palettes missing), not the floor: −3.0 needs every
background cell filled with one texture and no target cell.

Multi-turn feedback (:class:`StrBuildFeedback`, ``mode``), given to each agent after a turn:

``perfect_feedback``
    The target cells whose block differs from a reference colouring, listed to the agent that owns them, and the
    background cells holding a block (listed to the last agent). The reference colouring (:func:`expected_blocks`)
    gives cell (x, y) to agent ``(x + y) mod n`` and, going up the rows, the first block of that agent's palette
    (starting at index ``(x + y) mod |palette|``) that no already coloured neighbour has. With the default
    palettes it uses oak_planks and obsidian only, so a build that follows it to the letter still pays the
    missing-palette penalty (as in the repository).
``position_feedback``
    Every target position (top row first), a suggested share (about half) and the agent's palette and budget; it
    does not depend on what was built.
``score_feedback``
    The reward of the last turn's joint build (before any reward processor).

Each next-turn prompt starts with the system text, then the feedback, then (``original_prompt``) the agent's
first prompt and (``previous_response``) its last answer. The trainer passes a transition only the item's
``prompt``, a key ``str_build:<task_id>:<word>``: :class:`StrBuildFeedback` finds the item among the items the
loaders built in this process (or ``tasks=`` given to it).

``prompt.provide_graph``: with ``provide_graph=False`` (the repository's training configs) the first prompt has no
target grid and no mention of ``#``/``.`` cells: the agents learn the word's shape from the feedback.

Data: :func:`strbuild_tasks` reads ``str_build/data.csv`` under :func:`~.common.data_root`; the repository trains
on rows ``[:8]`` and evaluates on ``[8:]`` (:func:`strbuild_train_tasks`, :func:`strbuild_eval_tasks`).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from comlrl_lightning.envs.minecraft.common import (
    SYSTEM_PROMPT,
    TASKS,
    Position,
    box_of,
    check_choice,
    command_budget,
    command_lines,
    command_words,
    data_file,
    format_positions,
    inside,
    is_air,
    mean_by_turn,
    normalize_block,
    parse_coordinate,
    require,
    slice_split,
    top_down,
    unique_blocks,
)

StrBuildMode = Literal["perfect_feedback", "position_feedback", "score_feedback"]
DEFAULT_BLOCKS_AGENT1 = ("oak_planks", "stone", "air")
DEFAULT_BLOCKS_AGENT2 = ("white_concrete", "obsidian", "air")
DEFAULT_MAX_COMMANDS = 300
TRAIN_HEAD = 8  # the repository's configs: rows [:8] train, [8:] evaluate
SPLITS = {"train": slice(None, TRAIN_HEAD), "eval": slice(TRAIN_HEAD, None), "all": slice(None)}
WEIGHTS = {"coverage": 2.0, "extra": 1.5, "adjacent": 1.0, "palette": 0.25}
REWARD_MIN, REWARD_MAX = -3.0, 2.0  # two agents; one agent: -2.75

# 5 x 5 glyphs, top row first ('#' = block). The shapes are the environment repository's font (MIT, OpenMLRL),
# so that a word has the same target here as there.
GLYPHS = {
    "A": ".###. #...# ##### #...# #...#",
    "B": "####. #...# ####. #...# ####.",
    "C": ".#### #.... #.... #.... .####",
    "D": "####. #...# #...# #...# ####.",
    "E": "##### #.... ####. #.... #####",
    "F": "##### #.... ####. #.... #....",
    "G": ".#### #.... #.### #...# .###.",
    "H": "#...# #...# ##### #...# #...#",
    "I": "##### ..#.. ..#.. ..#.. #####",
    "J": "..### ...#. ...#. #..#. .##..",
    "K": "#...# #..#. ###.. #..#. #...#",
    "L": "#.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #...# #...#",
    "N": "#...# ##..# #.#.# #..## #...#",
    "O": ".###. #...# #...# #...# .###.",
    "P": "####. #...# ####. #.... #....",
    "Q": ".###. #...# #...# #..## .####",
    "R": "####. #...# ####. #..#. #...#",
    "S": ".#### #.... .###. ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #.#.# ##.## #...#",
    "X": "#...# .#.#. ..#.. .#.#. #...#",
    "Y": "#...# .#.#. ..#.. ..#.. ..#..",
    "Z": "##### ...#. ..#.. .#... #####",
}
BLANK_GLYPH = "..... ..... ..... ..... ....."  # characters without a glyph (digits, spaces, ...)
GLYPH_SIZE = 5


def render_word(word: str, spacing: int) -> tuple[str, ...]:
    """The target rows of ``word`` (upper-cased), top row first: glyphs ``spacing`` empty columns apart."""
    word = str(word or "").strip().upper()
    rows = [""] * GLYPH_SIZE
    for k, char in enumerate(word):
        glyph = GLYPHS.get(char, BLANK_GLYPH).split()
        for r in range(GLYPH_SIZE):
            rows[r] += glyph[r] + ("." * spacing if k < len(word) - 1 else "")
    return tuple(rows)


# ------------------------------------------------------------------------------------------------ tasks
@dataclass(frozen=True)
class StrBuildTask:
    """One StrBuild task with its rules (what an item carries; see :meth:`to_item`)."""

    task_id: str
    word: str
    difficulty: int
    rows: tuple[str, ...]  # top row first, '#' = target cell
    bbox_from: Position
    bbox_to: Position
    blocks: tuple[tuple[str, ...], ...]  # palette of agent 0, agent 1 (air allowed)
    max_commands: int = DEFAULT_MAX_COMMANDS
    provide_graph: bool = True

    @property
    def prompt_key(self) -> str:
        return f"str_build:{self.task_id}:{self.word}"

    def targets(self) -> list[Position]:
        """The target cells: row r of the rows is ``y = bbox_from.y + (height − 1 − r)``."""
        height = len(self.rows)
        x0, y0, z0 = self.bbox_from
        return [
            (x0 + x, y0 + height - 1 - r, z0)
            for r, row in enumerate(self.rows)
            for x, char in enumerate(row)
            if char == "#"
        ]

    def palettes(self, num_agents: int) -> list[list[str]]:
        """Each agent's palette without air (what the missing-palette penalty and the colouring use)."""
        require(
            1 <= num_agents <= len(self.blocks),
            f"StrBuild has palettes for {len(self.blocks)} agents (block_agent1, block_agent2); got "
            f"{num_agents} agents' completions.",
        )
        return [[normalize_block(b) for b in self.blocks[i] if not is_air(b)] for i in range(num_agents)]

    def to_item(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt_key,
            "task_id": self.task_id,
            "string": self.word,
            "difficulty": self.difficulty,
            "target_rows": list(self.rows),
            "bbox_from": list(self.bbox_from),
            "bbox_to": list(self.bbox_to),
            "blocks": [list(b) for b in self.blocks],
            "max_commands": self.max_commands,
            "provide_graph": self.provide_graph,
        }

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> "StrBuildTask":
        missing = [k for k in ("task_id", "string", "target_rows", "bbox_from", "bbox_to", "blocks") if k not in item]
        if missing:
            raise KeyError(
                f"StrBuild item without {missing} (keys: {sorted(item)}): build the items with "
                "comlrl_lightning.envs.minecraft.strbuild.strbuild_tasks."
            )
        return cls(
            task_id=str(item["task_id"]),
            word=str(item["string"]),
            difficulty=int(item.get("difficulty") or 0),
            rows=tuple(str(r) for r in item["target_rows"]),
            bbox_from=tuple(int(v) for v in item["bbox_from"]),
            bbox_to=tuple(int(v) for v in item["bbox_to"]),
            blocks=tuple(tuple(str(b) for b in p) for p in item["blocks"]),
            max_commands=int(item.get("max_commands") or DEFAULT_MAX_COMMANDS),
            provide_graph=bool(item.get("provide_graph", True)),
        )


def strbuild_tasks(
    path: str | Path | None = None,
    split: str = "all",
    *,
    spacing: int = 2,
    local_z: int = 0,
    block_agent1: Sequence[str] = DEFAULT_BLOCKS_AGENT1,
    block_agent2: Sequence[str] = DEFAULT_BLOCKS_AGENT2,
    max_commands: int = DEFAULT_MAX_COMMANDS,
    provide_graph: bool = True,
) -> list[dict[str, Any]]:
    """StrBuild items from a ``string,difficulty`` CSV (default ``str_build/data.csv`` under the data root).

    ``split``: ``train`` (rows [:8]), ``eval`` ([8:]), ``all`` or a slice such as ``"[2:5]"``. The rules
    (palettes, ``max_commands``, ``provide_graph``) are stored in each item, so the reward, the formatters and the
    feedback all read the same ones. Task ids are ``str_build_<row number>`` (1-based data rows, as the repository).
    """
    require(spacing >= 0, f"spacing must be >= 0; got {spacing}.")
    require(max_commands >= 1, f"max_commands must be >= 1; got {max_commands}.")
    blocks = []
    for field, palette in (("block_agent1", block_agent1), ("block_agent2", block_agent2)):
        palette = unique_blocks([palette] if isinstance(palette, str) else palette)
        require(
            any(not is_air(b) for b in palette),
            f"{field} must list at least one block other than air; got {list(palette)!r}.",
        )
        blocks.append(tuple(palette))
    path = Path(path) if path is not None else data_file("str_build", "data.csv")
    if not path.exists():
        raise FileNotFoundError(f"StrBuild data file {str(path)!r} does not exist.")
    tasks = []
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        require(
            reader.fieldnames is not None and "string" in reader.fieldnames,
            f"StrBuild data {str(path)!r} needs a 'string' column (got {reader.fieldnames}).",
        )
        for number, row in enumerate(reader, start=1):
            word = str(row.get("string") or "").strip()
            if not word:
                continue
            try:
                difficulty = int(str(row.get("difficulty") or "0").strip() or 0)
            except ValueError:
                difficulty = 0
            rows = render_word(word, spacing)
            width = len(rows[0])
            tasks.append(
                StrBuildTask(
                    task_id=f"str_build_{number:04d}",
                    word=word,
                    difficulty=difficulty,
                    rows=rows,
                    bbox_from=(0, 0, int(local_z)),
                    bbox_to=(max(0, width - 1), GLYPH_SIZE - 1, int(local_z)),
                    blocks=tuple(blocks),
                    max_commands=int(max_commands),
                    provide_graph=bool(provide_graph),
                ).to_item()
            )
    items = slice_split(tasks, split, SPLITS)
    TASKS.add(items)
    return items


class StrBuildTasks:
    """:func:`strbuild_tasks` as a configurable loader for YAML (``dataset: {class_path: ..., init_args: ...}``)."""

    def __init__(
        self,
        path: str | None = None,
        split: str = "train",
        spacing: int = 2,
        local_z: int = 0,
        block_agent1: list[str] | None = None,
        block_agent2: list[str] | None = None,
        max_commands: int = DEFAULT_MAX_COMMANDS,
        provide_graph: bool = True,
    ):
        self.kwargs = dict(
            path=path,
            split=split,
            spacing=spacing,
            local_z=local_z,
            block_agent1=block_agent1 or DEFAULT_BLOCKS_AGENT1,
            block_agent2=block_agent2 or DEFAULT_BLOCKS_AGENT2,
            max_commands=max_commands,
            provide_graph=provide_graph,
        )
        slice_split([], split, SPLITS)  # an unknown split fails here, before any model loads

    def __call__(self) -> list[dict[str, Any]]:
        return strbuild_tasks(**self.kwargs)


def strbuild_train_tasks() -> list[dict[str, Any]]:
    """The repository's training words (data rows [:8]) with its default rules."""
    return strbuild_tasks(split="train")


def strbuild_eval_tasks() -> list[dict[str, Any]]:
    """The repository's evaluation words (data rows [8:]) with its default rules."""
    return strbuild_tasks(split="eval")


# ------------------------------------------------------------------------------------------------ parsing
@dataclass
class ParsedSetblocks:
    """One agent's commands: ``accepted`` ((x, y, z), block) in order, ``rejected`` (line, reason)."""

    accepted: list[tuple[Position, str]]
    rejected: list[tuple[str, str]]


def parse_setblocks(
    text: Any, palette: Sequence[str], bbox_from: Sequence[int], bbox_to: Sequence[int], budget: int
) -> ParsedSetblocks:
    """Accepted and rejected ``/setblock`` lines of one completion (see the module docstring); never raises."""
    allowed = {normalize_block(b) for b in palette} | {"air"}
    lo, hi = box_of(bbox_from, bbox_to)
    out = ParsedSetblocks([], [])
    for line in command_lines(text):
        if len(out.accepted) >= budget:
            out.rejected.append((line, f"over the budget of {budget} commands"))
            continue
        words = command_words(line)
        if not words:
            continue
        if words[0].lower() != "setblock":
            out.rejected.append((line, f"unsupported command {words[0]!r}"))
            continue
        if len(words) < 5:
            out.rejected.append((line, "setblock needs x y z block"))
            continue
        position = tuple(parse_coordinate(w) for w in words[1:4])
        if None in position:
            out.rejected.append((line, "coordinates must be absolute integers"))
            continue
        block = normalize_block(words[4])
        if block not in allowed:
            out.rejected.append((line, f"block {block!r} is not in the palette"))
            continue
        if not inside(position, lo, hi):
            out.rejected.append((line, "outside the bounding box"))
            continue
        out.accepted.append((position, block))
    return out


def parse_team(task: StrBuildTask, completions: Sequence[Any]) -> list[ParsedSetblocks]:
    n = len(completions)
    task.palettes(n)  # checks the number of agents
    budgets = command_budget(task.max_commands, n)
    return [
        parse_setblocks(c, task.blocks[i], task.bbox_from, task.bbox_to, budgets[i]) for i, c in enumerate(completions)
    ]


def build_world(parsed: Sequence[ParsedSetblocks]) -> dict[Position, str]:
    """The blocks after agent 0's accepted commands, then agent 1's (a later command overwrites)."""
    world: dict[Position, str] = {}
    for agent in parsed:
        for position, block in agent.accepted:
            world[position] = block
    return world


# ------------------------------------------------------------------------------------------------ reward
_TEXTURES = {
    "oak_planks": "wood",
    "oak_wood": "wood",
    "stone": "stone",
    "cobblestone": "stone",
    "smooth_stone": "stone",
    "stone_bricks": "stone",
    "white_concrete": "concrete",
    "obsidian": "obsidian",
}


def texture(block: str) -> str:
    """The texture a block counts as for the adjacency rule (see the module docstring)."""
    name = normalize_block(block).lower()
    if name in _TEXTURES:
        return _TEXTURES[name]
    if name.endswith(("_planks", "_wood")):
        return "wood"
    if name == "stone" or name.endswith(("_stone", "_stone_bricks")):
        return "stone"
    if name.endswith("_concrete"):
        return "concrete"
    return name


def score_world(task: StrBuildTask, world: Mapping[Position, str], num_agents: int) -> dict[str, float]:
    """Every term of the StrBuild reward for a built world (see the module docstring)."""
    targets = set(task.targets())
    solid = {p: b for p, b in world.items() if not is_air(b)}
    covered = sum(p in solid for p in targets)
    extra = sum(p not in targets for p in solid)
    cells = len(task.rows) * (len(task.rows[0]) if task.rows else 0)
    background = max(0, cells - len(targets))
    coverage = covered / len(targets) if targets else 0.0
    extra_ratio = extra / background if background else 0.0
    textures = {p: texture(b) for p, b in solid.items()}
    pairs = same = 0
    for (x, y, z), tex in textures.items():
        for neighbour in ((x + 1, y, z), (x, y + 1, z)):
            if neighbour in textures:
                pairs += 1
                same += textures[neighbour] == tex
    adjacent_same_ratio = same / pairs if pairs else 0.0
    placed = {normalize_block(b) for b in solid.values()}
    missing = sum(not set(p) <= placed for p in task.palettes(num_agents))
    total = (
        WEIGHTS["coverage"] * coverage
        - WEIGHTS["extra"] * extra_ratio
        - WEIGHTS["adjacent"] * adjacent_same_ratio
        - WEIGHTS["palette"] * missing
    )
    union = len(targets) + extra
    return {
        "total": total,
        "coverage": coverage,
        "extra_ratio": extra_ratio,
        "adjacent_same_ratio": adjacent_same_ratio,
        "missing_palettes": float(missing),
        "iou": covered / union if union else 0.0,
        "covered": float(covered),
        "target_cells": float(len(targets)),
        "extra_blocks": float(extra),
        "adjacent_pairs": float(pairs),
        "adjacent_same_pairs": float(same),
    }


def strbuild_breakdown(completions: Sequence[Any], item: Mapping[str, Any]) -> dict[str, float]:
    """The reward terms of one joint action (one completion per agent) plus parse counts; never raises on the
    completions' content."""
    task = StrBuildTask.from_item(item)
    parsed = parse_team(task, completions)
    out = score_world(task, build_world(parsed), len(completions))
    out["accepted_commands"] = float(sum(len(p.accepted) for p in parsed))
    out["rejected_commands"] = float(sum(len(p.rejected) for p in parsed))
    return out


def strbuild_reward(
    *agent_completions: Sequence[Any], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[float]:
    """StrBuild team reward in [−3, 2] per joint action (``batch_items`` aligned with the completions; one item
    serves them all)."""
    return [b["total"] for b in _joint_breakdowns(agent_completions, batch_items)]


def _joint_breakdowns(agent_completions: Sequence[Sequence[Any]], batch_items: Sequence[Mapping[str, Any]] | None):
    if not batch_items:
        raise ValueError("strbuild_reward needs batch_items (the StrBuild items with their targets).")
    count = len(agent_completions[0]) if agent_completions else 0
    items = list(batch_items) * count if len(batch_items) == 1 else list(batch_items)
    return [strbuild_breakdown(joint, item) for joint, item in zip(zip(*agent_completions), items)]


def reward_components(breakdown: Mapping[str, float]) -> dict[str, float]:
    """The weighted terms of one :func:`strbuild_breakdown` as the reward's named components: ``coverage``
    (2.0·coverage), ``extra`` (−1.5·extra_ratio), ``adjacent`` (−1.0·adjacent_same_ratio) and ``palette``
    (−0.25·missing_palettes); added in this order they give ``breakdown["total"]`` exactly."""
    return {
        "coverage": WEIGHTS["coverage"] * breakdown["coverage"],
        "extra": -(WEIGHTS["extra"] * breakdown["extra_ratio"]),
        "adjacent": -(WEIGHTS["adjacent"] * breakdown["adjacent_same_ratio"]),
        "palette": -(WEIGHTS["palette"] * breakdown["missing_palettes"]),
    }


def strbuild_reward_components(
    *agent_completions: Sequence[Any], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, float]]:
    """:func:`strbuild_reward` with each joint action's terms as named components (:func:`reward_components`; their sum
    is its reward), for ``reward_aggregation: normalize_components``."""
    return [reward_components(b) for b in _joint_breakdowns(agent_completions, batch_items)]


strbuild_reward.reward_range = (REWARD_MIN, REWARD_MAX)
strbuild_reward_components.reward_range = (REWARD_MIN, REWARD_MAX)


def expected_blocks(task: StrBuildTask, num_agents: int) -> tuple[dict[Position, str], dict[Position, int]]:
    """The reference colouring that ``perfect_feedback`` checks against: block and owning agent of every target
    cell (see the module docstring)."""
    palettes = task.palettes(num_agents)
    x0, y0, _ = task.bbox_from
    expected: dict[Position, str] = {}
    owners: dict[Position, int] = {}
    for position in sorted(task.targets(), key=lambda p: (p[1], p[0], p[2])):
        x, y, z = position
        phase = (x - x0) + (y - y0)
        owner = phase % num_agents
        palette = palettes[owner]
        taken = {expected[q] for q in ((x - 1, y, z), (x + 1, y, z), (x, y - 1, z), (x, y + 1, z)) if q in expected}
        order = [palette[(phase + k) % len(palette)] for k in range(len(palette))]
        expected[position] = next((b for b in order if b not in taken), order[0])
        owners[position] = owner
    return expected, owners


# ------------------------------------------------------------------------------------------------ prompts
def _user_prompt(task: StrBuildTask, agent_index: int, num_agents: int) -> str:
    graph = task.provide_graph
    palette = "\n".join(f"- {b}" for b in task.blocks[agent_index])
    lines = []
    if num_agents > 1:
        lines.append(
            f"You are agent {agent_index + 1} of a {num_agents}-agent Minecraft building team; together "
            "you build one structure and you place only part of its blocks."
        )
        if agent_index > 0:
            lines.append(
                "Your commands run after agent 1's, so a block you set replaces whatever agent 1 put at "
                "that position. Pick a sensible part of the cells."
            )
        lines.append("")
    if graph:
        lines += [
            "The target is a grid of '#' (a block) and '.' (air), top row first; it fills the bounding box.",
            "Answer with /setblock commands for " + ("the '#' cells." if num_agents == 1 else "some of the '#' cells."),
            "",
            "Target grid (top row first):",
            *task.rows,
            "",
        ]
    lines += [
        "Bounding box (inclusive, absolute coordinates):",
        f"- from: [{','.join(map(str, task.bbox_from))}]",
        f"- to:   [{','.join(map(str, task.bbox_to))}]",
        "",
        "Coordinates:",
        "- x grows from the box's minimum x to its maximum x (left to right).",
        "- y grows from the box's minimum y to its maximum y (bottom to top).",
        "- z is fixed (minimum z = maximum z).",
        "",
        "Blocks you may use (only these):",
        palette,
        "",
        "Rules:",
        "- Answer with Minecraft commands only, one per line; the only command is /setblock.",
        "- Absolute integer coordinates only (no ~).",
    ]
    if graph:
        lines.append("- Put blocks only on '#' cells; leave '.' cells as air.")
    if num_agents > 1:
        lines.append("- Two blocks that share a side must not have the same texture.")
    lines += ["- Every coordinate must lie inside the bounding box.", "Format: /setblock <x> <y> <z> <block>"]
    return "\n".join(lines)


def strbuild_prompt(item: Mapping[str, Any], agent_index: int = 0, num_agents: int = 2) -> str:
    """The first-turn prompt of agent ``agent_index`` (system text, role, target, box, palette, rules)."""
    task = StrBuildTask.from_item(item)
    return f"{SYSTEM_PROMPT}\n\n{_user_prompt(task, agent_index, num_agents)}"


def strbuild_agent0_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of agent 0 of 2 (palette ``block_agent1``); a later turn's external prompt is used as it is."""
    return external_prompts if external_prompts is not None else strbuild_prompt(item, 0, 2)


def strbuild_agent1_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of agent 1 of 2 (palette ``block_agent2``, writes after agent 0)."""
    return external_prompts if external_prompts is not None else strbuild_prompt(item, 1, 2)


def strbuild_single_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of a single agent building the whole word (palette ``block_agent1``)."""
    return external_prompts if external_prompts is not None else strbuild_prompt(item, 0, 1)


# ------------------------------------------------------------------------------------------------ feedback
def _turn(prompt_history_per_agent: Sequence[Sequence[str]] | None) -> int:
    """The coming turn's number: prompts so far + 1 (1 without a history)."""
    if prompt_history_per_agent and prompt_history_per_agent[0] is not None:
        return len(prompt_history_per_agent[0]) + 1
    return 1


def _closing(parts: list[str], original: str | None, previous: Any, label: str = "Your previous commands:") -> str:
    if original:
        parts += ["", original]
    if isinstance(previous, str) and previous.strip():
        parts += ["", label, previous.strip()]
    return "\n".join(parts).strip()


class StrBuildFeedback:
    """StrBuild's external transition: the next turn's prompt of every agent from this turn's answers.

    Args:
        mode: ``perfect_feedback``, ``position_feedback`` or ``score_feedback`` (see the module docstring).
        original_prompt: repeat the agent's first-turn prompt (without the system text) after the feedback.
        previous_response: append the agent's last answer.
        tasks: the items to look prompts up in (default: every item the StrBuild loaders built in this process).
    """

    def __init__(
        self,
        mode: StrBuildMode = "position_feedback",
        original_prompt: bool = True,
        previous_response: bool = False,
        tasks: Sequence[Mapping[str, Any]] | None = None,
    ):
        check_choice("mode", mode, StrBuildMode)
        self.mode, self.original_prompt, self.previous_response = mode, bool(original_prompt), bool(previous_response)
        self.tasks = {str(t["prompt"]): t for t in tasks} if tasks is not None else None

    def __call__(
        self,
        prompt: str,
        agent_completions: Sequence[Any],
        num_agents: int | None = None,
        prompt_history_per_agent: Sequence[Sequence[str]] | None = None,
        response_history_per_agent: Sequence[Sequence[str]] | None = None,
        **_: Any,
    ) -> list[str]:
        n = len(agent_completions) if num_agents is None else int(num_agents)
        require(len(agent_completions) == n, f"expected {n} agent completions, got {len(agent_completions)}.")
        task = StrBuildTask.from_item(TASKS.find(str(prompt), self.tasks, "StrBuild"))
        task.palettes(n)  # one palette per agent, else a clear error
        bodies = getattr(self, f"_{self.mode}")(task, list(agent_completions), _turn(prompt_history_per_agent))
        return [
            _closing(
                [SYSTEM_PROMPT, "", *bodies[i]],
                _user_prompt(task, i, n) if self.original_prompt else None,
                agent_completions[i] if self.previous_response else None,
            )
            for i in range(n)
        ]

    def _perfect_feedback(self, task: StrBuildTask, completions: list[Any], turn: int) -> list[list[str]]:
        n = len(completions)
        world = build_world(parse_team(task, completions))
        expected, owners = expected_blocks(task, n)
        wrong: list[list[Position]] = [[] for _ in range(n)]
        for position, block in expected.items():
            if normalize_block(world.get(position, "air")) != block:
                wrong[owners[position]].append(position)
        extra = sorted((p for p, b in world.items() if p not in expected and not is_air(b)), key=top_down)
        bodies = []
        for i in range(n):
            body = [
                "Feedback on the last build (coordinate fixes):",
                f"- Turn: {turn}",
                "- Coordinates are absolute (x, y, z).",
                "- Answer with /setblock commands only, no markdown.",
                "- Change only the positions listed below.",
                "",
                "Set the right block of your palette at:",
                format_positions(sorted(wrong[i], key=top_down)),
            ]
            if i == n - 1:
                body += ["", "Clear these extra blocks (set them to air):", format_positions(extra)]
            bodies.append(body)
        return bodies

    def _position_feedback(self, task: StrBuildTask, completions: list[Any], turn: int) -> list[list[str]]:
        n = len(completions)
        positions = sorted(task.targets(), key=top_down)
        share = max(1, len(positions) // 2) if positions else 0
        budgets = command_budget(task.max_commands, n)
        return [
            [
                "Position feedback (choose your cells):",
                f"- Turn: {turn}",
                "- Coordinates are absolute (x, y, z).",
                "- Answer with /setblock commands only, no markdown.",
                f"- Take about half of the positions (about {share}).",
                "- Avoid taking two positions that share a side.",
                f"- At most {budgets[i]} commands.",
                "",
                "Positions of the letters:",
                format_positions(positions),
                "",
                "Blocks you may use (only these):",
                "\n".join(f"- {b}" for b in task.blocks[i]),
                "",
                "Format: /setblock <x> <y> <z> <block>",
            ]
            for i in range(n)
        ]

    def _score_feedback(self, task: StrBuildTask, completions: list[Any], turn: int) -> list[list[str]]:
        total = score_world(task, build_world(parse_team(task, completions)), len(completions))["total"]
        return [["Score feedback:", f"- Turn: {turn}", f"- Reward of the last build: {total:.4f}"] for _ in completions]


# ------------------------------------------------------------------------------------------------ evaluation
EVAL_METRICS = (
    "total_reward",
    "coverage",
    "extra_ratio",
    "adjacent_same_ratio",
    "missing_palettes",
    "iou",
    "accepted_commands",
    "rejected_commands",
)


def strbuild_eval_logger(
    agent_completions_turns: Sequence[Sequence[Sequence[Any]]], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, float]]:
    """Per-sample ``turn_k/<name>`` for the names in :data:`EVAL_METRICS` (``agent_completions_turns[i][s]`` is
    agent i's list of completions over the turns of sample s)."""
    if not batch_items:
        raise ValueError("strbuild_eval_logger needs batch_items (the StrBuild items).")
    rows = []
    for s, per_agent in enumerate(zip(*agent_completions_turns)):
        item = batch_items[s] if s < len(batch_items) else batch_items[-1]
        metrics: dict[str, float] = {}
        for t, joint in enumerate(zip(*per_agent)):
            b = strbuild_breakdown(joint, item)
            b["total_reward"] = b["total"]
            metrics.update({f"turn_{t + 1}/{name}": float(b[name]) for name in EVAL_METRICS})
        rows.append(metrics)
    return rows


def strbuild_eval_aggregator(metrics: Sequence[Mapping[str, float]], num_turns: int = 1) -> dict[str, float]:
    """Means over samples: ``turn_k/avg_<name>`` (e.g. ``turn_1/avg_total_reward``, ``turn_2/avg_coverage``)."""
    return mean_by_turn(metrics, num_turns, EVAL_METRICS)
