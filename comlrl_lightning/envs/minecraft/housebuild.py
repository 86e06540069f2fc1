"""HouseBuild: two agents build a house from layered blueprints with ``/fill`` commands, under per-agent resource
limits and a spider threat (OpenMLRL/LLM_Collab_Minecraft).

Task. An item is a blueprint from ``house_build/data.json``: an ``inventory`` (letter → block, e.g.
``C = white_concrete``, ``A = air``) and one slice of rows per y (``target_spec.layers``): row r of a slice is
``z = z0 + r``, column c is ``x = x0 + c``. The bounding box is the task's ``bbox`` (or, without one, x and z from 0
and y over the slices). Every cell of the box has a target block, air included (a 6 × 7 × 7 house: 294 cells).

Agents. Both may use ``block_agent1`` / ``block_agent2`` (default: the inventory's blocks, air included) and answer
at once with ``/fill x1 y1 z1 x2 y2 z2 block`` lines (a box of one block) and, against the spiders, ``/kill``.
The fills are applied agent 0 first, then agent 1. Each turn starts from an empty (all-air) world.

Parser (:func:`parse_fills`, never raises). Lines as in :func:`~.common.command_lines`. Accepted: ``kill`` (any
arguments), or ``fill`` with exactly seven more words: six integer absolute coordinates with both corners inside
the box, and a palette block (``air`` always allowed); fill modes (``replace``, ``keep``, ...) are rejected. With
``limited_resource`` each agent may place at most ``ceil(c / n) + floor(c / 2n)`` cells of a block whose target has
c cells (n agents; 0 for an inventory block the target does not use; air unlimited): a fill that would go over is
rejected. Each agent has a budget of accepted commands (``max_commands`` split as
:func:`~.common.command_budget`: 300 + 300 of the default 600).

Reward (:func:`housebuild_breakdown`; range [−0.1, 1])::

    R = match − spider_penalty

    match           cells of the box whose block equals the target's (air included) / cells of the box
    spider_penalty  0.1 · min(1, total spider damage / player HP) when no agent's accepted commands contain /kill
                    (0 when the HP or the damage is 0)

The spiders: ``spider_num`` spiders with attacks drawn uniformly from ``[spider_atk_low, spider_atk_high]`` by
``random.Random(spider_seed)``, once per loader call (the repository draws them once per run, from the run's seed).
A perfect build with a ``/kill`` scores 1.0; building nothing scores the target's share of air cells minus the
spider penalty. The repository applies the spider penalty only to two-agent teams (its score feedback to any team);
here every team pays it.

Multi-turn feedback (:class:`HouseBuildFeedback`, ``mode``):

``perfect_feedback``
    Every cell whose block is wrong, with the block it should have (top layer first), split between the agents:
    a block only one agent's palette has goes to that agent, others alternate (the i-th wrong cell to agent
    i mod n).
``position_feedback``
    Every non-air target cell with its block, a suggested share (about half), the agent's palette and budget.
``position_modification``
    The first ``lim`` wrong cells (bottom layer first) as ``(x y z block)``, the same list for every agent.
``rect_modification``
    The blueprint rectangles (the slices' runs of one block merged across rows, air included) that contain a wrong
    cell; agent 0 gets those with ``y ≤ 2``, agent 1 those with ``y ≥ 2`` (the repository's split), at most ``lim``
    each, with the agent's accepted commands of the last turn.
``resource_schedule``
    Needs ``limited_resource``. The agent's accepted commands, the resources it has left after the last turn, and
    a plan for the next one: the non-air blueprint rectangles its palette can build, largest first, taken while
    the resources last, plus the largest partial rectangle the rest allows. (The repository prints the resources
    left after that plan under the same heading; here they are the ones left after the last turn, as it says.)
``score_feedback``
    The last turn's team reward (spider penalty included, before any reward processor).

Each next-turn prompt has the system text, the feedback and, as set, the agent's first prompt (``original_prompt``;
without it the modes that check resources show the resource limits) and its last answer (``previous_response``).

Data: :func:`housebuild_tasks` reads ``house_build/data.json`` under :func:`~.common.data_root` (also
``one.json`` / ``one2.json``, single tasks); the repository trains on tasks ``[:8]`` and evaluates on ``[8:]``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
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

HouseBuildMode = Literal[
    "perfect_feedback",
    "position_feedback",
    "position_modification",
    "rect_modification",
    "resource_schedule",
    "score_feedback",
]
DEFAULT_MAX_COMMANDS = 600
TRAIN_HEAD = 8
SPLITS = {"train": slice(None, TRAIN_HEAD), "eval": slice(TRAIN_HEAD, None), "all": slice(None)}
SPIDER_WEIGHT = 0.1
REWARD_MIN, REWARD_MAX = -SPIDER_WEIGHT, 1.0
Rect = tuple[int, int, int, int, str]  # x1, z1, x2, z2, block of one slice


# ------------------------------------------------------------------------------------------------ tasks
@dataclass(frozen=True)
class HouseBuildTask:
    """One HouseBuild task with its rules (what an item carries; see :meth:`to_item`)."""

    task_id: str
    inventory: tuple[tuple[str, str], ...]  # (letter, block) in the data's order
    layers: tuple[tuple[str, ...], ...]  # layer k is y = bbox_from.y + k; its row r is z = z0 + r, column c x = x0 + c
    bbox_from: Position
    bbox_to: Position
    blocks: tuple[tuple[str, ...], ...]  # palettes of agent 0 and agent 1
    max_commands: int = DEFAULT_MAX_COMMANDS
    limited_resource: bool = True
    player_hp: int = 5
    spider_attacks: tuple[int, ...] = ()
    include_air_rects: bool = False

    @property
    def prompt_key(self) -> str:
        return f"house_build:{self.task_id}"

    @property
    def letters(self) -> dict[str, str]:
        return {k: normalize_block(v) for k, v in self.inventory}

    def expected(self) -> dict[Position, str]:
        """The target block of every cell of the box (air included), in y, z, x order."""
        x0, y0, z0 = self.bbox_from
        letters = self.letters
        return {
            (x0 + c, y0 + k, z0 + r): letters[ch]
            for k, rows in enumerate(self.layers)
            for r, row in enumerate(rows)
            for c, ch in enumerate(row)
        }

    def resource_limits(self, num_agents: int) -> dict[str, int]:
        """Cells of each non-air block one agent may place: ``ceil(c / n) + floor(c / 2n)`` (see the docstring)."""
        n = max(1, int(num_agents))
        counts: dict[str, int] = {}
        for block in self.expected().values():
            counts[block] = counts.get(block, 0) + 1
        blocks = sorted(set(counts) | {normalize_block(b) for _, b in self.inventory})
        return {b: -(-counts.get(b, 0) // n) + counts.get(b, 0) // (2 * n) for b in blocks if not is_air(b)}

    def palettes(self, num_agents: int) -> list[list[str]]:
        require(
            1 <= num_agents <= len(self.blocks),
            f"HouseBuild has palettes for {len(self.blocks)} agents (block_agent1, block_agent2); got "
            f"{num_agents} agents' completions.",
        )
        return [list(self.blocks[i]) for i in range(num_agents)]

    def rectangles(self, include_air: bool = True) -> dict[int, list[Rect]]:
        """The blueprint's rectangles per y (:func:`layer_rectangles`)."""
        x0, y0, z0 = self.bbox_from
        out = {}
        for k, rows in enumerate(self.layers):
            rects = layer_rectangles(rows, self.letters, x0, z0)
            out[y0 + k] = rects if include_air else [r for r in rects if not is_air(r[4])]
        return out

    def to_item(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt_key,
            "task_id": self.task_id,
            "inventory": dict(self.inventory),
            "layers": [list(rows) for rows in self.layers],
            "bbox_from": list(self.bbox_from),
            "bbox_to": list(self.bbox_to),
            "blocks": [list(b) for b in self.blocks],
            "max_commands": self.max_commands,
            "limited_resource": self.limited_resource,
            "player_hp": self.player_hp,
            "spider_attacks": list(self.spider_attacks),
            "include_air_rects": self.include_air_rects,
        }

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> "HouseBuildTask":
        missing = [k for k in ("task_id", "inventory", "layers", "bbox_from", "bbox_to", "blocks") if k not in item]
        if missing:
            raise KeyError(
                f"HouseBuild item without {missing} (keys: {sorted(item)}): build the items with "
                "comlrl_lightning.envs.minecraft.housebuild.housebuild_tasks."
            )
        return cls(
            task_id=str(item["task_id"]),
            inventory=tuple((str(k), str(v)) for k, v in item["inventory"].items()),
            layers=tuple(tuple(str(r) for r in rows) for rows in item["layers"]),
            bbox_from=tuple(int(v) for v in item["bbox_from"]),
            bbox_to=tuple(int(v) for v in item["bbox_to"]),
            blocks=tuple(tuple(str(b) for b in p) for p in item["blocks"]),
            max_commands=int(item.get("max_commands") or DEFAULT_MAX_COMMANDS),
            limited_resource=bool(item.get("limited_resource", True)),
            player_hp=int(item.get("player_hp") or 0),
            spider_attacks=tuple(int(a) for a in item.get("spider_attacks") or ()),
            include_air_rects=bool(item.get("include_air_rects", False)),
        )


def layer_rectangles(rows: Sequence[str], letters: Mapping[str, str], x0: int, z0: int) -> list[Rect]:
    """A slice as rectangles: each row's runs of one letter, a run merged with the run of the row before when both
    span the same x range with the same block. Rectangles are listed as they close (row order, then x)."""
    rects: list[Rect] = []
    open_runs: dict[tuple[int, int, str], list] = {}
    for r, row in enumerate(rows):
        runs, start = [], 0
        for c in range(1, len(row) + 1):
            if c == len(row) or row[c] != row[start]:
                runs.append((start, c - 1, letters[row[start]]))
                start = c
        still_open: dict[tuple[int, int, str], list] = {}
        for a, b, block in runs:
            rect = open_runs.pop((a, b, block), None) or [x0 + a, z0 + r, x0 + b, z0 + r, block]
            rect[3] = z0 + r
            still_open[(a, b, block)] = rect
        rects.extend(tuple(rect) for rect in open_runs.values())
        open_runs = still_open
    rects.extend(tuple(rect) for rect in open_runs.values())
    return rects


def _layers_of(task_id: str, spec: Mapping[str, Any]) -> dict[int, list[str]]:
    raw = spec.get("layers")
    if isinstance(raw, Mapping):
        entries = [(y, rows) for y, rows in raw.items()]
    elif isinstance(raw, list):
        require(
            all(isinstance(e, Mapping) and "y" in e for e in raw),
            f"{task_id}: target_spec.layers entries must be objects with 'y' and 'rows'.",
        )
        entries = [(e["y"], e.get("rows")) for e in raw]
    else:
        raise ValueError(f"{task_id}: target_spec.layers must be a list or a mapping; got {type(raw).__name__}.")
    layers: dict[int, list[str]] = {}
    for y, rows in entries:
        y = int(str(y).strip())
        require(y not in layers, f"{task_id}: layer y={y} appears twice.")
        require(isinstance(rows, list) and bool(rows), f"{task_id}: layer y={y} needs a non-empty list of rows.")
        layers[y] = [str(r) for r in rows]
    require(bool(layers), f"{task_id}: target_spec.layers is empty.")
    return layers


def _task_from_json(index: int, obj: Any, rules: dict[str, Any]) -> HouseBuildTask:
    require(isinstance(obj, Mapping), f"HouseBuild task {index} must be an object.")
    task_id = str(obj.get("task_id") or f"house_build_{index:04d}")
    inventory = obj.get("inventory")
    require(isinstance(inventory, Mapping) and bool(inventory), f"{task_id}: inventory must be a non-empty mapping.")
    for key, value in inventory.items():
        require(len(str(key)) == 1, f"{task_id}: inventory keys are single letters; got {key!r}.")
        require(bool(str(value).strip()), f"{task_id}: inventory entry {key!r} has no block.")
    spec = obj.get("target_spec") or {}
    require(isinstance(spec, Mapping), f"{task_id}: target_spec must be an object.")
    layers = _layers_of(task_id, spec)
    width, depth = len(next(iter(layers.values()))[0]), len(next(iter(layers.values())))
    for y, rows in layers.items():
        require(
            len(rows) == depth and all(len(r) == width for r in rows),
            f"{task_id}: layer y={y} is not {depth} rows of {width} letters like the others.",
        )
        unknown = sorted({ch for r in rows for ch in r} - {str(k) for k in inventory})
        require(not unknown, f"{task_id}: layer y={y} uses letters {unknown} that the inventory does not define.")
    ys = sorted(layers)
    if obj.get("bbox") is not None:
        bbox = obj["bbox"]
        require(
            isinstance(bbox, Mapping)
            and all(isinstance(bbox.get(k), list) and len(bbox[k]) == 3 for k in ("from", "to")),
            f"{task_id}: bbox needs 'from' and 'to' lists of 3 integers.",
        )
        lo, hi = box_of([int(v) for v in bbox["from"]], [int(v) for v in bbox["to"]])
    else:
        lo, hi = (0, ys[0], 0), (max(0, width - 1), ys[-1], max(0, depth - 1))
    size = (hi[0] - lo[0] + 1, hi[1] - lo[1] + 1, hi[2] - lo[2] + 1)
    require(
        size[0] == width and size[2] == depth,
        f"{task_id}: the box is {size[0]} x {size[2]} (x, z) but the layers are {width} x {depth}.",
    )
    require(
        ys == list(range(lo[1], hi[1] + 1)),
        f"{task_id}: the layers' y values {ys} must be every y of the box, {lo[1]}..{hi[1]}.",
    )
    hint = spec.get("size")
    if isinstance(hint, list) and len(hint) == 3:
        require(
            [int(v) for v in hint] == list(size), f"{task_id}: target_spec.size {hint} is not the box's {list(size)}."
        )
    inventory_pairs = tuple((str(k), str(v).strip()) for k, v in inventory.items())
    default_palette = tuple(unique_blocks(v for _, v in inventory_pairs))
    blocks = tuple(
        tuple(unique_blocks(p)) if p else default_palette for p in (rules["block_agent1"], rules["block_agent2"])
    )
    return HouseBuildTask(
        task_id=task_id,
        inventory=inventory_pairs,
        layers=tuple(tuple(layers[y]) for y in ys),
        bbox_from=lo,
        bbox_to=hi,
        blocks=blocks,
        max_commands=rules["max_commands"],
        limited_resource=rules["limited_resource"],
        player_hp=rules["player_hp"],
        spider_attacks=rules["spider_attacks"],
        include_air_rects=rules["include_air_rects"],
    )


def spider_attacks(num: int, low: int, high: int, seed: int) -> tuple[int, ...]:
    """``num`` attacks drawn uniformly from ``[low, high]`` by ``random.Random(seed)``."""
    rng = random.Random(int(seed))
    return tuple(rng.randint(int(low), int(high)) for _ in range(int(num)))


def housebuild_tasks(
    path: str | Path | None = None,
    split: str = "all",
    *,
    block_agent1: Sequence[str] | None = None,
    block_agent2: Sequence[str] | None = None,
    max_commands: int = DEFAULT_MAX_COMMANDS,
    limited_resource: bool = True,
    player_hp: int = 5,
    spider_num: int = 3,
    spider_atk_low: int = 1,
    spider_atk_high: int = 3,
    spider_seed: int = 0,
    include_air_rects: bool = False,
) -> list[dict[str, Any]]:
    """HouseBuild items from a JSON task list (default ``house_build/data.json`` under the data root).

    ``split``: ``train`` (tasks [:8]), ``eval`` ([8:]), ``all`` or a slice such as ``"[0:2]"``. Palettes default to
    each task's inventory blocks. The rules (palettes, budget, resource limits, HP and the drawn spider attacks,
    whether the prompt lists air rectangles) are stored in each item, so the reward, the formatters and the feedback
    read the same ones. Defaults: the repository's HouseBuild configs (600 commands, limited resources, 5 HP, 3
    spiders attacking 1–3).
    """
    require(max_commands >= 1, f"max_commands must be >= 1; got {max_commands}.")
    require(player_hp >= 0, f"player_hp must be >= 0; got {player_hp}.")
    require(spider_num >= 0, f"spider_num must be >= 0; got {spider_num}.")
    require(
        spider_atk_low <= spider_atk_high,
        f"spider_atk_low ({spider_atk_low}) must be <= spider_atk_high ({spider_atk_high}).",
    )
    for name, palette in (("block_agent1", block_agent1), ("block_agent2", block_agent2)):
        require(
            palette is None or any(not is_air(b) for b in ([palette] if isinstance(palette, str) else palette)),
            f"{name} must list at least one block other than air (or be null for the inventory's); got {palette!r}.",
        )
    rules = {
        "block_agent1": [block_agent1] if isinstance(block_agent1, str) else block_agent1,
        "block_agent2": [block_agent2] if isinstance(block_agent2, str) else block_agent2,
        "max_commands": int(max_commands),
        "limited_resource": bool(limited_resource),
        "player_hp": int(player_hp),
        "include_air_rects": bool(include_air_rects),
        "spider_attacks": spider_attacks(spider_num, spider_atk_low, spider_atk_high, spider_seed),
    }
    path = Path(path) if path is not None else data_file("house_build", "data.json")
    if not path.exists():
        raise FileNotFoundError(f"HouseBuild data file {str(path)!r} does not exist.")
    raw = json.loads(path.read_text(encoding="utf-8"))
    objs = raw if isinstance(raw, list) else [raw]
    items = [_task_from_json(i, obj, rules).to_item() for i, obj in enumerate(objs, start=1)]
    items = slice_split(items, split, SPLITS)
    TASKS.add(items)
    return items


class HouseBuildTasks:
    """:func:`housebuild_tasks` as a configurable loader for YAML (``dataset: {class_path: ..., init_args: ...}``)."""

    def __init__(
        self,
        path: str | None = None,
        split: str = "train",
        block_agent1: list[str] | None = None,
        block_agent2: list[str] | None = None,
        max_commands: int = DEFAULT_MAX_COMMANDS,
        limited_resource: bool = True,
        player_hp: int = 5,
        spider_num: int = 3,
        spider_atk_low: int = 1,
        spider_atk_high: int = 3,
        spider_seed: int = 0,
        include_air_rects: bool = False,
    ):
        self.kwargs = dict(
            path=path,
            split=split,
            block_agent1=block_agent1,
            block_agent2=block_agent2,
            max_commands=max_commands,
            limited_resource=limited_resource,
            player_hp=player_hp,
            spider_num=spider_num,
            spider_atk_low=spider_atk_low,
            spider_atk_high=spider_atk_high,
            spider_seed=spider_seed,
            include_air_rects=include_air_rects,
        )
        slice_split([], split, SPLITS)  # an unknown split fails here, before any model loads

    def __call__(self) -> list[dict[str, Any]]:
        return housebuild_tasks(**self.kwargs)


def housebuild_train_tasks() -> list[dict[str, Any]]:
    """The repository's training blueprints (``data.json`` [:8]) with its default rules."""
    return housebuild_tasks(split="train")


def housebuild_eval_tasks() -> list[dict[str, Any]]:
    """The repository's evaluation blueprints (``data.json`` [8:]) with its default rules."""
    return housebuild_tasks(split="eval")


# ------------------------------------------------------------------------------------------------ parsing
@dataclass
class ParsedFills:
    """One agent's commands: ``fills`` ((x1, y1, z1), (x2, y2, z2), block) and ``commands`` (accepted, as text, in
    order, ``/kill`` included), ``rejected`` (line, reason), ``used`` (cells placed per block) and ``killed``."""

    fills: list[tuple[Position, Position, str]] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    used: dict[str, int] = field(default_factory=dict)
    killed: bool = False


def parse_fills(
    text: Any,
    palette: Sequence[str],
    bbox_from: Sequence[int],
    bbox_to: Sequence[int],
    budget: int,
    limits: Mapping[str, int] | None = None,
) -> ParsedFills:
    """Accepted and rejected ``/fill`` and ``/kill`` lines of one completion (see the module docstring); never
    raises. ``limits``: cells per block this agent may place (``None``: unlimited)."""
    allowed = {normalize_block(b) for b in palette} | {"air"}
    lo, hi = box_of(bbox_from, bbox_to)
    out = ParsedFills()
    for line in command_lines(text):
        if len(out.commands) >= budget:
            out.rejected.append((line, f"over the budget of {budget} commands"))
            continue
        words = command_words(line)
        if not words:
            continue
        name = words[0].lower()
        if name == "kill":
            out.commands.append(" ".join(["/kill", *words[1:]]))
            out.killed = True
            continue
        if name != "fill":
            out.rejected.append((line, f"unsupported command {words[0]!r}"))
            continue
        if len(words) < 8:
            out.rejected.append((line, "fill needs x1 y1 z1 x2 y2 z2 block"))
            continue
        coords = [parse_coordinate(w) for w in words[1:7]]
        if None in coords:
            out.rejected.append((line, "coordinates must be absolute integers"))
            continue
        block = normalize_block(words[7])
        a, b = tuple(coords[:3]), tuple(coords[3:])
        if block not in allowed:
            out.rejected.append((line, f"block {block!r} is not in the palette"))
        elif not (inside(a, lo, hi) and inside(b, lo, hi)):
            out.rejected.append((line, "outside the bounding box"))
        elif len(words) > 8:
            out.rejected.append((line, "fill modes (replace, keep, ...) are not allowed"))
        else:
            volume = (abs(b[0] - a[0]) + 1) * (abs(b[1] - a[1]) + 1) * (abs(b[2] - a[2]) + 1)
            if limits and not is_air(block) and block in limits and out.used.get(block, 0) + volume > limits[block]:
                out.rejected.append(
                    (line, f"over the {block} limit ({out.used.get(block, 0) + volume} > {limits[block]})")
                )
                continue
            out.used[block] = out.used.get(block, 0) + volume
            out.fills.append((a, b, block))
            out.commands.append(f"/fill {a[0]} {a[1]} {a[2]} {b[0]} {b[1]} {b[2]} {block}")
    return out


def parse_team(task: HouseBuildTask, completions: Sequence[Any]) -> list[ParsedFills]:
    n = len(completions)
    palettes = task.palettes(n)
    budgets = command_budget(task.max_commands, n)
    limits = task.resource_limits(n) if task.limited_resource else None
    return [
        parse_fills(c, palettes[i], task.bbox_from, task.bbox_to, budgets[i], limits) for i, c in enumerate(completions)
    ]


def build_world(parsed: Sequence[ParsedFills]) -> dict[Position, str]:
    """The blocks after agent 0's fills, then agent 1's; every fill lies inside the box, so this is bounded."""
    world: dict[Position, str] = {}
    for agent in parsed:
        for a, b, block in agent.fills:
            for y in range(min(a[1], b[1]), max(a[1], b[1]) + 1):
                for x in range(min(a[0], b[0]), max(a[0], b[0]) + 1):
                    for z in range(min(a[2], b[2]), max(a[2], b[2]) + 1):
                        world[(x, y, z)] = block
    return world


# ------------------------------------------------------------------------------------------------ reward
def spider_penalty(task: HouseBuildTask, killed: bool) -> float:
    damage = sum(task.spider_attacks)
    if killed or task.player_hp <= 0 or damage <= 0:
        return 0.0
    return SPIDER_WEIGHT * min(1.0, damage / task.player_hp)


def score_world(task: HouseBuildTask, world: Mapping[Position, str], killed: bool) -> dict[str, float]:
    """Every term of the HouseBuild reward for a built world (see the module docstring)."""
    expected = task.expected()
    correct = sum(world.get(p, "air") == b for p, b in expected.items())
    target_solid = {p for p, b in expected.items() if not is_air(b)}
    built_solid = {p for p, b in world.items() if not is_air(b)}
    both = len(target_solid & built_solid)
    union = len(target_solid) + len(built_solid) - both
    match = correct / len(expected) if expected else 0.0
    penalty = spider_penalty(task, killed)
    return {
        "total": match - penalty,
        "match": match,
        "iou": both / union if union else 0.0,
        "spider_penalty": penalty,
        "killed": float(killed),
        "correct_cells": float(correct),
        "cells": float(len(expected)),
    }


def housebuild_breakdown(completions: Sequence[Any], item: Mapping[str, Any]) -> dict[str, float]:
    """The reward terms of one joint action (one completion per agent) plus parse counts; never raises on the
    completions' content."""
    task = HouseBuildTask.from_item(item)
    parsed = parse_team(task, completions)
    out = score_world(task, build_world(parsed), any(p.killed for p in parsed))
    out["accepted_commands"] = float(sum(len(p.commands) for p in parsed))
    out["rejected_commands"] = float(sum(len(p.rejected) for p in parsed))
    return out


def housebuild_reward(
    *agent_completions: Sequence[Any], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[float]:
    """HouseBuild team reward in [−0.1, 1] per joint action (``batch_items`` aligned with the completions; one item
    serves them all)."""
    return [b["total"] for b in _joint_breakdowns(agent_completions, batch_items)]


def _joint_breakdowns(agent_completions: Sequence[Sequence[Any]], batch_items: Sequence[Mapping[str, Any]] | None):
    if not batch_items:
        raise ValueError("housebuild_reward needs batch_items (the HouseBuild items with their blueprints).")
    count = len(agent_completions[0]) if agent_completions else 0
    items = list(batch_items) * count if len(batch_items) == 1 else list(batch_items)
    return [housebuild_breakdown(joint, item) for joint, item in zip(zip(*agent_completions), items)]


def reward_components(breakdown: Mapping[str, float]) -> dict[str, float]:
    """The terms of one :func:`housebuild_breakdown` as the reward's named components: ``match`` and
    ``spider_penalty`` (−spider_penalty); added in this order they give ``breakdown["total"]`` exactly."""
    return {"match": breakdown["match"], "spider_penalty": -breakdown["spider_penalty"]}


def housebuild_reward_components(
    *agent_completions: Sequence[Any], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, float]]:
    """:func:`housebuild_reward` with each joint action's terms as named components (:func:`reward_components`; their sum
    is its reward), for ``reward_aggregation: normalize_components``."""
    return [reward_components(b) for b in _joint_breakdowns(agent_completions, batch_items)]


housebuild_reward.reward_range = (REWARD_MIN, REWARD_MAX)
housebuild_reward_components.reward_range = (REWARD_MIN, REWARD_MAX)


# ------------------------------------------------------------------------------------------------ prompts
def layers_text(task: HouseBuildTask) -> str:
    """``y=Y: {(x1, Y, z1, x2, Y, z2 block), ...}`` per slice, lowest first (air rectangles only when the task's
    ``include_air_rects`` is set)."""
    lines = []
    for y, rects in task.rectangles(include_air=task.include_air_rects).items():
        body = ", ".join(f"({x1}, {y}, {z1}, {x2}, {y}, {z2} {b})" for x1, z1, x2, z2, b in rects)
        lines.append(f"y={y}: {{{body}}}")
    return "\n".join(lines)


def resource_text(task: HouseBuildTask, num_agents: int) -> str:
    """The per-agent resource limits in the inventory's order ("" without ``limited_resource``)."""
    if not task.limited_resource:
        return ""
    limits = task.resource_limits(num_agents)
    lines = [f"- {b}: {limits[b]}" for b in unique_blocks(normalize_block(v) for _, v in task.inventory) if b in limits]
    return "Resource limits per agent (air is unlimited):\n" + "\n".join(lines) if lines else ""


def _user_prompt(task: HouseBuildTask, agent_index: int, num_agents: int) -> str:
    attacks = list(task.spider_attacks)
    lines = []
    if num_agents > 1:
        lines += [
            f"You are agent {agent_index + 1} of a {num_agents}-agent Minecraft building team. You place only "
            "part of the blocks of the final build.",
            "",
        ]
    lines += [
        "Task: build the 3D structure given as horizontal slices, one per y.",
        "",
        "Blocks you may use (only these):",
        "\n".join(f"- {b}" for b in task.blocks[agent_index]),
        "",
        "Slices, lowest y first. Each slice is a set of rectangles in absolute (x, z) coordinates:",
        "- Format: y=Y: {(x1, Y, z1, x2, Y, z2 block_id), (x1, Y, z1, x2, Y, z2 block_id)}",
        layers_text(task),
        "",
        "Bounding box (inclusive, absolute coordinates):",
        f"- from: [{','.join(map(str, task.bbox_from))}]",
        f"- to:   [{','.join(map(str, task.bbox_to))}]",
        "",
        f"Threat: {len(attacks)} spiders are nearby and you have {task.player_hp} HP. Their attacks: "
        f"[{', '.join(map(str, attacks))}], total damage {sum(attacks)}. To kill them, answer one line: /kill. "
        "Every other line must be a building command.",
        "",
        "Rules:",
        "- Answer with Minecraft commands only, one per line.",
        "- Commands: /fill and /kill.",
        "- Fill format: /fill x1 y1 z1 x2 y2 z2 block",
        "- Absolute integer coordinates only (no ~).",
        "- Only blocks from the list above.",
        "- Every coordinate must lie inside the bounding box.",
    ]
    limits = resource_text(task, num_agents)
    return "\n".join(lines) + (f"\n\n{limits}" if limits else "")


def housebuild_prompt(item: Mapping[str, Any], agent_index: int = 0, num_agents: int = 2) -> str:
    """The first-turn prompt of agent ``agent_index`` (system text, role, palette, slices, box, spiders, rules,
    resource limits)."""
    task = HouseBuildTask.from_item(item)
    return f"{SYSTEM_PROMPT}\n\n{_user_prompt(task, agent_index, num_agents)}"


def housebuild_agent0_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of agent 0 of 2; a later turn's external prompt is used as it is."""
    return external_prompts if external_prompts is not None else housebuild_prompt(item, 0, 2)


def housebuild_agent1_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of agent 1 of 2 (its fills are applied after agent 0's)."""
    return external_prompts if external_prompts is not None else housebuild_prompt(item, 1, 2)


def housebuild_single_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of a single agent building the whole house (palette ``block_agent1``, the whole budget)."""
    return external_prompts if external_prompts is not None else housebuild_prompt(item, 0, 1)


# ------------------------------------------------------------------------------------------------ feedback
def _bullets(lines: Sequence[str], empty: str = "- (none)") -> str:
    return "\n".join(f"- {line}" for line in lines) if lines else empty


def _rect_lines(rects: Sequence[tuple[int, int, int, int, int, str]]) -> str:
    return "\n".join(f"y={y}: ({x1}, {z1}, {x2}, {z2} {b})" for y, x1, z1, x2, z2, b in rects) if rects else "(none)"


def best_subrect(x1: int, z1: int, x2: int, z2: int, max_area: int) -> tuple[int, int, int, int, int]:
    """The largest rectangle anchored at (x1, z1) inside the given one with at most ``max_area`` cells (widest
    first on ties): (x1, z1, x2', z2', area); area 0 when nothing fits."""
    width, depth = x2 - x1 + 1, z2 - z1 + 1
    best = (0, 0, 0)
    for w in range(width, 0, -1):
        d = min(depth, max_area // w)
        if w * d > best[0]:
            best = (w * d, w, d)
        if best[0] == max_area:
            break
    area, w, d = best
    return (x1, z1, x1 + w - 1, z1 + d - 1, area) if area > 0 else (x1, z1, x1, z1, 0)


class HouseBuildFeedback:
    """HouseBuild's external transition: the next turn's prompt of every agent from this turn's answers.

    Args:
        mode: one of ``perfect_feedback``, ``position_feedback``, ``position_modification``, ``rect_modification``,
            ``resource_schedule``, ``score_feedback`` (see the module docstring).
        original_prompt: repeat the agent's first-turn prompt (without the system text).
        previous_response: append the agent's last answer.
        lim: at most this many suggestions per agent in ``position_modification`` / ``rect_modification`` (null or
            0: all; the repository's configs use 20).
        tasks: the items to look prompts up in (default: every item the HouseBuild loaders built in this process).
    """

    def __init__(
        self,
        mode: HouseBuildMode = "score_feedback",
        original_prompt: bool = True,
        previous_response: bool = False,
        lim: int | None = None,
        tasks: Sequence[Mapping[str, Any]] | None = None,
    ):
        check_choice("mode", mode, HouseBuildMode)
        require(lim is None or lim >= 0, f"lim must be >= 0 or null; got {lim!r}.")
        self.mode, self.original_prompt, self.previous_response = mode, bool(original_prompt), bool(previous_response)
        self.lim = lim or None
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
        task = HouseBuildTask.from_item(TASKS.find(str(prompt), self.tasks, "HouseBuild"))
        completions = list(agent_completions)
        turn = len(prompt_history_per_agent[0]) + 1 if prompt_history_per_agent else 1
        bodies = getattr(self, f"_{self.mode}")(task, completions, parse_team(task, completions), turn)
        prompts = []
        for i in range(n):
            parts = [SYSTEM_PROMPT, ""]
            limits = resource_text(task, n)
            if limits and not self.original_prompt and self.mode not in ("position_feedback", "score_feedback"):
                parts += [limits, ""]
            original = _user_prompt(task, i, n) if self.original_prompt else None
            before, after = bodies[i]
            parts += before
            if original:
                parts += ["", original] if before else [original]
            parts += after
            previous = completions[i] if self.previous_response else None
            if isinstance(previous, str) and previous.strip():
                label = (
                    "Your previous raw output:"
                    if self.mode in ("rect_modification", "resource_schedule")
                    else "Your previous commands:"
                )
                parts += ["", label, previous.strip()]
            prompts.append("\n".join(parts).strip())
        return prompts

    # Each mode returns, per agent, (lines before the original prompt, lines after it).
    def _wrong_cells(self, task: HouseBuildTask, parsed: list[ParsedFills]) -> list[tuple[Position, str]]:
        world = build_world(parsed)
        return [(p, b) for p, b in task.expected().items() if world.get(p, "air") != b]

    def _perfect_feedback(self, task, completions, parsed, turn):
        n = len(completions)
        wrong = sorted(self._wrong_cells(task, parsed), key=lambda pb: top_down(pb[0]))
        allowed = [{normalize_block(b) for b in p} for p in task.palettes(n)]
        mine: list[list[tuple[Position, str]]] = [[] for _ in range(n)]
        for k, (position, block) in enumerate(wrong):
            owner = k % n
            if n == 2 and (block in allowed[0]) != (block in allowed[1]):
                owner = 0 if block in allowed[0] else 1
            mine[owner].append((position, block))
        out = []
        for i in range(n):
            body = [
                "Feedback on the last build (coordinate fixes):",
                f"- Turn: {turn}",
                "- Coordinates are absolute (x, y, z).",
                "- Answer with /fill commands only, no markdown.",
                "- No text other than commands.",
                "- Change only the positions listed below.",
                "- Use: /fill x y z x y z block",
                "",
                "Set these blocks:",
                _bullets([f"({x}, {y}, {z}) = {b}" for (x, y, z), b in mine[i]]),
            ]
            if i == n - 1:  # every command lies inside the box, so this list is empty (kept as in the repository)
                body += ["", "Clear these extra blocks (set them to air):", "- (none)"]
            out.append((body, []))
        return out

    def _position_feedback(self, task, completions, parsed, turn):
        n = len(completions)
        cells = sorted(((p, b) for p, b in task.expected().items() if not is_air(b)), key=lambda pb: top_down(pb[0]))
        share = max(1, len(cells) // 2) if cells else 0
        budgets = command_budget(task.max_commands, n)
        return [
            (
                [
                    "Position feedback (choose your cells):",
                    f"- Turn: {turn}",
                    "- Coordinates are absolute (x, y, z).",
                    "- Answer with /fill commands only, no markdown.",
                    "- No text other than commands.",
                    f"- Take about half of the positions (about {share}).",
                    "- Use: /fill x y z x y z block",
                    f"- At most {budgets[i]} commands.",
                    "",
                    "Target positions:",
                    _bullets([f"({x}, {y}, {z}) = {b}" for (x, y, z), b in cells]),
                    "",
                    "Blocks you may use (only these):",
                    "\n".join(f"- {b}" for b in task.blocks[i]),
                    "",
                    "Format: /fill <x> <y> <z> <x> <y> <z> <block>",
                ],
                [],
            )
            for i in range(n)
        ]

    def _position_modification(self, task, completions, parsed, turn):
        wrong = sorted(self._wrong_cells(task, parsed), key=lambda pb: (pb[0][1], pb[0][0], pb[0][2]))
        wrong = wrong[: self.lim] if self.lim else wrong
        fixes = "\n".join(f"({x} {y} {z} {b})" for (x, y, z), b in wrong) if wrong else "(none)"
        lines = ["", "No text other than commands.", "", "Suggested fixes (use them to correct the build):", fixes]
        return [([], lines) for _ in completions]

    def _rect_modification(self, task, completions, parsed, turn):
        n = len(completions)
        rects_by_y = task.rectangles(include_air=True)
        chosen: dict[tuple[int, int, int, int, int, str], None] = {}
        for (x, y, z), block in self._wrong_cells(task, parsed):
            for x1, z1, x2, z2, b in rects_by_y.get(y, []):
                if b == block and x1 <= x <= x2 and z1 <= z <= z2:
                    chosen[(y, x1, z1, x2, z2, b)] = None
                    break
        rects = sorted(chosen)
        out = []
        for i in range(n):
            mine = rects if n == 1 else [r for r in rects if (r[0] <= 2 if i == 0 else r[0] >= 2)]
            mine = mine[: self.lim] if self.lim else mine
            out.append(
                (
                    [],
                    [
                        "",
                        "No text other than commands.",
                        "",
                        "Reminder: every turn starts from an empty world (all air).",
                        "Accepted commands from your last turn:",
                        _bullets(parsed[i].commands),
                        "",
                        "Suggested rectangles to fix the mismatches:",
                        _rect_lines(mine),
                    ],
                )
            )
        return out

    def _resource_schedule(self, task, completions, parsed, turn):
        require(
            task.limited_resource,
            "HouseBuild feedback mode resource_schedule needs items loaded with limited_resource=True.",
        )
        n = len(completions)
        limits = task.resource_limits(n)
        rects = [
            (y, x1, z1, x2, z2, b, (x2 - x1 + 1) * (z2 - z1 + 1))
            for y, layer in task.rectangles(include_air=False).items()
            for x1, z1, x2, z2, b in layer
        ]
        out = []
        for i in range(n):
            allowed = {normalize_block(b) for b in task.blocks[i]}
            left = {b: limit - parsed[i].used.get(b, 0) for b, limit in limits.items()}
            budget = dict(left)
            candidates = sorted(
                (r for r in rects if r[5] in allowed and budget.get(r[5], 0) > 0), key=lambda r: (-r[6], *r[:6])
            )
            plan, taken = [], set()
            for r in candidates:
                if budget.get(r[5], 0) >= r[6]:
                    plan.append(r[:6])
                    taken.add(r[:6])
                    budget[r[5]] -= r[6]
            partial, partial_area = None, 0
            for y, x1, z1, x2, z2, b, _area in candidates:
                if (y, x1, z1, x2, z2, b) in taken or budget.get(b, 0) <= 0:
                    continue
                px1, pz1, px2, pz2, parea = best_subrect(x1, z1, x2, z2, budget[b])
                if parea > partial_area:
                    partial, partial_area = (y, px1, pz1, px2, pz2, b), parea
            if partial is not None:
                plan.append(partial)
            remaining = [
                f"- {b}: {max(0, left[b])}"
                for b in unique_blocks(normalize_block(v) for _, v in task.inventory)
                if b in left
            ]
            out.append(
                (
                    [],
                    [
                        "",
                        "No text other than commands.",
                        "",
                        "Accepted commands from your last turn:",
                        _bullets(parsed[i].commands),
                        "",
                        "Resources left after the last turn (air is unlimited):",
                        "\n".join(remaining) or "(none)",
                        "",
                        "Suggested rectangles to build next (largest first):",
                        _rect_lines(plan),
                    ],
                )
            )
        return out

    def _score_feedback(self, task, completions, parsed, turn):
        total = score_world(task, build_world(parsed), any(p.killed for p in parsed))["total"]
        return [
            (
                [
                    "Score feedback:",
                    f"- Turn: {turn}",
                    f"- Reward of the last build: {total:.4f}",
                    "- No text other than commands.",
                ],
                [],
            )
            for _ in completions
        ]


# ------------------------------------------------------------------------------------------------ evaluation
EVAL_METRICS = ("total_reward", "match", "iou", "spider_penalty", "killed", "accepted_commands", "rejected_commands")


def housebuild_eval_logger(
    agent_completions_turns: Sequence[Sequence[Sequence[Any]]], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, float]]:
    """Per-sample ``turn_k/<name>`` for the names in :data:`EVAL_METRICS` (``agent_completions_turns[i][s]`` is
    agent i's list of completions over the turns of sample s)."""
    if not batch_items:
        raise ValueError("housebuild_eval_logger needs batch_items (the HouseBuild items).")
    rows = []
    for s, per_agent in enumerate(zip(*agent_completions_turns)):
        item = batch_items[s] if s < len(batch_items) else batch_items[-1]
        metrics: dict[str, float] = {}
        for t, joint in enumerate(zip(*per_agent)):
            b = housebuild_breakdown(joint, item)
            b["total_reward"] = b["total"]
            metrics.update({f"turn_{t + 1}/{name}": float(b[name]) for name in EVAL_METRICS})
        rows.append(metrics)
    return rows


def housebuild_eval_aggregator(metrics: Sequence[Mapping[str, float]], num_turns: int = 1) -> dict[str, float]:
    """Means over samples: ``turn_k/avg_<name>`` (e.g. ``turn_1/avg_total_reward``, ``turn_2/avg_match``)."""
    return mean_by_turn(metrics, num_turns, EVAL_METRICS)
