"""BridgeBuild: two agents with partial views join two anchors across open water with blocks and pillars
(OpenMLRL/LLM_Collab_Minecraft, ``bridge_build``; rules of its newest simulator, commit 25a7971).

Map. A task is a grid of characters, one string per row (``z`` = row, top row ``z = 0``; ``x`` = column):
``#`` land, ``S`` / ``T`` the start and target anchors (land too), ``Y`` a true pillar, ``N`` a false pillar and
``.`` open cells. Land, anchors and pillars are fixed: a ``/fill`` never changes them. The goal is to make some
``S`` and some ``T`` 4-connected through *bridge cells*: anchors, pillars (true or false) and placed blocks; plain
land ``#`` does not count.

State (:class:`BridgeState`). The placed blocks; each agent's position (agent 0 starts on the first ``S``, agent 1
on the first ``T``, listed row by row), the points it has stood on (its *vision origins*), the pillar kinds it has
probed, and its inbox of teammate messages; whether S and T are connected and whether the episode is over. A cell
is visible to an agent when it lies within ``view`` (Chebyshev distance) of one of its vision origins: its prompt
lists only the visible anchors, land, placed blocks and pillar cells (kind unknown), plus its own probe results and
the messages it received.

Action. Each agent answers one JSON object (Python-literal dicts are accepted too) with four fields:

``comm``   an object sent to every teammate; it appears in their prompts from the next turn on (a non-object,
           ``{}`` or ``[]`` sends nothing). Its size in tokens (words, CJK characters, other non-space characters
           of its compact JSON) is counted.
``probe``  cells ``[x, z]`` (or ``{"x":, "z":}``, or ``"x,z"``) whose pillar kind the agent learns: ``Y``, ``N``
           or ``none``. The first ``max_probe`` cells inside the map count.
``cmds``   ``/fill x1 z1 x2 z2 block`` lines: a rectangle of one block (``air`` clears) with both corners inside
           the map and a block from the agent's list; the first ``max_commands // n`` accepted (agent 0 also gets
           the remainder), later ones rejected.
``path``   the agent's moves: a list of cells starting at its position, each step to one of the 8 neighbouring
           cells (or staying); any fault leaves the agent where it is. Every cell of a valid path becomes a vision
           origin.

The object is found as the repository finds it (:func:`extract_action`): the text inside a fenced block if any,
then candidates (the whole text, the text from the first ``{``, the span from the first ``{`` to the last ``}``,
every balanced ``{...}`` block, and each of these with unclosed brackets closed and stray closers dropped), parsed
as JSON and as Python literals; the dict with the most of the four fields wins, the later one on ties. Parsing
never raises: anything else is an empty action. Bounds that keep it linear on long input (none binds a normal
answer): a completion is read up to 50,000 characters, at most 64 balanced blocks are tried, and a candidate whose
text names none of the four fields is not parsed (so a field name spelt with JSON escapes is not seen).

Turn (:func:`apply_turn`). Fills run agent 0 first, then agent 1; then probes resolve, messages are delivered and
agents move. Once S and T are connected, or after ``max_turns`` turns, the episode is over: later turns change
nothing and score 0.

Reward of a turn (:func:`bridgebuild_breakdown`), from the state before and after it::

    R = bonus_gap_st + bonus_cc_merge + bonus_y_connected − penalty_n_adjacent − penalty_block_cost
        + bonus_terminal_connect

    bonus_gap_st            5 · (gap_before − gap_after) / max_gap: gap = fewest further blocks that would connect S
                            and T (a cell of land ``#`` cannot take one), max_gap the gap of the empty map (an
                            impossible gap counts as max_gap; max_gap 0 counts as 1)
    bonus_cc_merge          3 · (groups_before − groups_after) / max(1, groups_empty − 1), only when groups shrink:
                            the groups are the 4-connected components that the anchors and true pillars form through
                            placed blocks
    bonus_y_connected       5 · (rise in the true pillars joined to an anchor through blocks and true pillars) / |Y|
    penalty_n_adjacent      8 · (rise in the false pillars with a placed block on one of their sides) / |N|
    penalty_block_cost      5 · (cells holding a block now that did not before) / (open cells of the map)
    bonus_terminal_connect  2 when S and T become connected this turn

(A rise is the count after minus the count before, 0 when it falls; |Y|, |N| and the open-cell count are at least
1.) Every term lies in a bounded range, so R ∈ [−18, 15]
(:attr:`bridgebuild_reward.reward_range`; bounds, not all reachable at once). An empty action scores 0.

Multi-turn. The environment is a pure function of the trajectory: the reward replays the earlier turns of a joint
action from its task item (``response_history_per_agent``) and scores the current one; the external transition
(:class:`BridgeBuildFeedback`) replays the whole trajectory and writes each agent's next prompt: its own view of the
new state, the messages it has received (each cut to ``max_message_chars`` when that rule is set; the repository has
no limit) and the feedback of the mode:

``empty_feedback``     no feedback, only the new view (the repository's training configs).
``perfect_feedback``   the turn's reward, every term and count (gap, groups, joined/touched pillars, probes, comm
                       tokens) and the order of the subgoals.
``position_feedback``  the agent's position, how many land and pillar cells it sees, how many probe results it
                       holds, and whether S and T are connected.
``score_feedback``     the turn's reward, its terms and counts.

With ``original_prompt: false`` an agent gets only the feedback (``empty_feedback``: the new view without the system
text); with ``previous_response: true`` its last answer is appended.

Differences from the repository (which keeps one state per task between calls): its reward scores every turn from
the task's initial state and its transition shares one state among all the branches of a task; here each branch
has its own history. Its prompt text is not copied: the prompts state the same rules and data in other words.

Data: :func:`bridgebuild_tasks` reads the repository's ``bridge_build/dataset/data.json`` format (a list of
``{"task_id", "map": [rows]}``; ``rows`` or one newline-separated string also work; optional ``max_turns``) under
:func:`~.common.data_root`, with its splits ``[:8]`` train and ``[8:]`` evaluate; :func:`generate_bridge_maps` makes
seeded maps in the same format (13 × 11 like the repository's), so a run needs no data (:class:`BridgeBuildTasks`,
``source: generated``).
"""

from __future__ import annotations

import ast
import copy
import json
import random
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

from comlrl_lightning.envs.minecraft.common import (
    TASKS,
    _strip_fences,
    check_choice,
    command_budget,
    data_file,
    mean_by_turn,
    normalize_block,
    parse_coordinate,
    require,
    slice_split,
)

Cell = tuple[int, int]  # (x, z)
BridgeBuildMode = Literal["empty_feedback", "perfect_feedback", "position_feedback", "score_feedback"]
TaskSource = Literal["generated", "file"]
MAP_CHARS = frozenset("#.STYN")
AIR = frozenset({"air", "cave_air", "void_air"})
ACTION_KEYS = ("comm", "probe", "cmds", "path")
DEFAULT_BLOCKS = ("oak_planks",)
DEFAULT_VIEW, DEFAULT_MAX_PROBE, DEFAULT_MAX_COMMANDS, DEFAULT_MAX_TURNS = 3, 2, 40, 4
MAX_PROBE_LIMIT = 3  # the repository's reward clamps max_probe to [0, 3]
TRAIN_HEAD = 8  # the repository's configs: tasks [:8] train, [8:] evaluate
SPLITS = {"train": slice(None, TRAIN_HEAD), "eval": slice(TRAIN_HEAD, None), "all": slice(None)}
WEIGHTS = {"gap": 5.0, "cc_merge": 3.0, "y_connected": 5.0, "n_adjacent": 8.0, "block_cost": 5.0, "terminal": 2.0}
REWARD_MIN = -(WEIGHTS["gap"] + WEIGHTS["n_adjacent"] + WEIGHTS["block_cost"])  # -18
REWARD_MAX = WEIGHTS["gap"] + WEIGHTS["cc_merge"] + WEIGHTS["y_connected"] + WEIGHTS["terminal"]  # 15
TERMS = (
    "bonus_gap_st",
    "bonus_cc_merge",
    "bonus_y_connected",
    "penalty_n_adjacent",
    "penalty_block_cost",
    "bonus_terminal_connect",
)
MAX_TEXT_CHARS = 50_000  # a completion is read up to here (a 512-token answer is a few thousand characters)
MAX_BLOCKS = 64  # balanced {...} blocks tried as candidates, in order of their opening brace
MAX_IN_STRING_SCANS = 32  # of those, blocks opening inside a quoted string (each needs its own scan)
SYSTEM_PROMPT = (
    "You are one worker of a Minecraft bridge-building team. Answer with a single JSON object and stop: no "
    "markdown, no code fences, no explanation before or after it. Text outside the object is wasted."
)
_TOKEN = re.compile(r"[A-Za-z0-9_]+|[\u4e00-\u9fff]|[^\s]")
_FILL = re.compile(r"^/?fill\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", re.IGNORECASE)
_CELL_TEXT = re.compile(r"^\s*\(?\s*(-?\d+)\s*,\s*(-?\d+)\s*\)?\s*$")


def _by_row(cells: Iterable[Cell]) -> list[Cell]:
    """Distinct cells, row by row (z, then x): the order of every list in the state and the prompts."""
    return sorted(set(cells), key=lambda c: (c[1], c[0]))


def _sides(cell: Cell) -> tuple[Cell, Cell, Cell, Cell]:
    x, z = cell
    return ((x - 1, z), (x + 1, z), (x, z - 1), (x, z + 1))


def _compact(value: Any) -> str:
    """Compact JSON (non-ASCII kept); ``str`` for what JSON cannot write; never raises."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):  # sets, tuple keys, bytes; huge ints; deep nesting
        return _safe_str(value) or "<unprintable>"


# ------------------------------------------------------------------------------------------------ tasks
@dataclass(frozen=True)
class BridgeTask:
    """One map with its rules (what an item carries; see :meth:`to_item`)."""

    task_id: str
    rows: tuple[str, ...]
    max_turns: int = DEFAULT_MAX_TURNS
    view: int = DEFAULT_VIEW
    max_probe: int = DEFAULT_MAX_PROBE
    max_commands: int = DEFAULT_MAX_COMMANDS
    blocks: tuple[tuple[str, ...], ...] = (DEFAULT_BLOCKS, DEFAULT_BLOCKS)
    max_message_chars: int | None = None

    def __post_init__(self) -> None:
        cells: dict[str, list[Cell]] = {ch: [] for ch in MAP_CHARS}
        for z, row in enumerate(self.rows):
            for x, ch in enumerate(row):
                cells[ch].append((x, z))
        sets = {
            "anchors_s": _by_row(cells["S"]),
            "anchors_t": _by_row(cells["T"]),
            "land": _by_row(cells["#"] + cells["S"] + cells["T"]),
            "true_pillars": _by_row(cells["Y"]),
            "false_pillars": _by_row(cells["N"]),
        }
        for name, value in sets.items():
            object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "pillars", tuple(_by_row(sets["true_pillars"] + sets["false_pillars"])))
        object.__setattr__(self, "fixed", frozenset(sets["land"]) | frozenset(self.pillars))

    @property
    def width(self) -> int:
        return len(self.rows[0])

    @property
    def height(self) -> int:
        return len(self.rows)

    @property
    def prompt_key(self) -> str:
        return f"bridge_build:{self.task_id}"

    @property
    def open_cells(self) -> int:
        """Cells a block may take (not land, anchor or pillar), at least 1: the block-cost denominator."""
        return max(1, self.width * self.height - len(self.fixed))

    def inside(self, cell: Cell) -> bool:
        return 0 <= cell[0] < self.width and 0 <= cell[1] < self.height

    def palette(self, agent: int) -> tuple[str, ...]:
        """Agent ``agent``'s blocks (agents past the second use the first agent's, as the repository)."""
        return self.blocks[agent] if agent < len(self.blocks) else self.blocks[0]

    def to_item(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt_key,
            "task_id": self.task_id,
            "rows_topdown": list(self.rows),
            "width": self.width,
            "height": self.height,
            "anchors_s": [list(c) for c in self.anchors_s],
            "anchors_t": [list(c) for c in self.anchors_t],
            "true_pillars": [list(c) for c in self.true_pillars],
            "false_pillars": [list(c) for c in self.false_pillars],
            "max_turns": self.max_turns,
            "view": self.view,
            "max_probe": self.max_probe,
            "max_commands": self.max_commands,
            "block_agent1": list(self.blocks[0]),
            "block_agent2": list(self.blocks[1]),
            "max_message_chars": self.max_message_chars,
        }

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> "BridgeTask":
        missing = [k for k in ("task_id", "rows_topdown") if k not in item]
        if missing:
            raise KeyError(
                f"BridgeBuild item without {missing} (keys: {sorted(item)}): build the items with "
                "comlrl_lightning.envs.minecraft.bridgebuild.bridgebuild_tasks or BridgeBuildTasks."
            )
        limit = item.get("max_message_chars")
        return cls(
            task_id=str(item["task_id"]),
            rows=tuple(str(r) for r in item["rows_topdown"]),
            max_turns=int(item.get("max_turns") or DEFAULT_MAX_TURNS),
            view=int(item.get("view", DEFAULT_VIEW)),
            max_probe=int(item.get("max_probe", DEFAULT_MAX_PROBE)),
            max_commands=int(item.get("max_commands") or DEFAULT_MAX_COMMANDS),
            blocks=(
                tuple(str(b) for b in item.get("block_agent1") or DEFAULT_BLOCKS),
                tuple(str(b) for b in item.get("block_agent2") or item.get("block_agent1") or DEFAULT_BLOCKS),
            ),
            max_message_chars=int(limit) if limit is not None else None,
        )


def check_rows(task_id: str, rows: Any) -> tuple[str, ...]:
    """A map's rows (a list of strings or one newline-separated string; blank rows dropped), checked: equal
    widths, only ``# . S T Y N``, at least one S and one T. The error names the task."""
    if isinstance(rows, str):
        rows = [line.strip() for line in rows.splitlines()]
    require(isinstance(rows, (list, tuple)), f"{task_id}: the map must be a list of row strings; got {rows!r:.80}.")
    rows = tuple(str(r) for r in rows if str(r).strip())
    require(bool(rows), f"{task_id}: the map has no rows.")
    require(all(len(r) == len(rows[0]) for r in rows), f"{task_id}: the map's rows differ in width.")
    bad = sorted({ch for r in rows for ch in r} - MAP_CHARS)
    require(not bad, f"{task_id}: the map has characters {bad}; allowed: # . S T Y N.")
    joined = "".join(rows)
    require("S" in joined and "T" in joined, f"{task_id}: the map needs at least one S and one T.")
    return rows


def _rules(
    max_turns: int | None,
    view: int,
    max_probe: int,
    max_commands: int,
    block_agent1: Sequence[str] | str,
    block_agent2: Sequence[str] | str | None,
    max_message_chars: int | None,
) -> dict[str, Any]:
    require(max_turns is None or max_turns >= 1, f"max_turns must be >= 1 or null; got {max_turns!r}.")
    require(view >= 0, f"view must be >= 0; got {view!r}.")
    require(0 <= max_probe <= MAX_PROBE_LIMIT, f"max_probe must be between 0 and {MAX_PROBE_LIMIT}; got {max_probe!r}.")
    require(max_commands >= 1, f"max_commands must be >= 1; got {max_commands!r}.")
    require(
        max_message_chars is None or max_message_chars >= 1,
        f"max_message_chars must be >= 1 or null; got {max_message_chars!r}.",
    )
    palettes = []
    for name, blocks in (("block_agent1", block_agent1), ("block_agent2", block_agent2 or block_agent1)):
        blocks = [blocks] if isinstance(blocks, str) else list(blocks)
        blocks = [str(b).strip() for b in blocks if str(b).strip()]
        require(bool(blocks), f"{name} must list at least one block; got {blocks!r}.")
        palettes.append(tuple(blocks))
    return dict(
        max_turns=max_turns,
        view=int(view),
        max_probe=int(max_probe),
        max_commands=int(max_commands),
        blocks=tuple(palettes),
        max_message_chars=max_message_chars,
    )


def _items(maps: Sequence[Mapping[str, Any]], rules: Mapping[str, Any], split: str) -> list[dict[str, Any]]:
    tasks = []
    for number, obj in enumerate(maps, start=1):
        require(isinstance(obj, Mapping), f"BridgeBuild task #{number} must be an object; got {type(obj).__name__}.")
        task_id = str(obj.get("task_id") or f"bridge_build_{number:04d}")
        rows = check_rows(task_id, obj["map"] if "map" in obj else obj.get("rows"))
        max_turns = rules["max_turns"]
        if max_turns is None:  # the file's own limit, else the repository's 5 x the longer side
            max_turns = int(obj["max_turns"]) if obj.get("max_turns") is not None else 5 * max(len(rows), len(rows[0]))
        tasks.append(BridgeTask(task_id=task_id, rows=rows, **{**rules, "max_turns": max(1, int(max_turns))}).to_item())
    items = slice_split(tasks, split, SPLITS)
    TASKS.add(items)
    return items


def bridgebuild_tasks(
    path: str | Path | None = None,
    split: str = "all",
    *,
    file: str = "data.json",
    max_turns: int | None = DEFAULT_MAX_TURNS,
    view: int = DEFAULT_VIEW,
    max_probe: int = DEFAULT_MAX_PROBE,
    max_commands: int = DEFAULT_MAX_COMMANDS,
    block_agent1: Sequence[str] | str = DEFAULT_BLOCKS,
    block_agent2: Sequence[str] | str | None = DEFAULT_BLOCKS,
    max_message_chars: int | None = None,
) -> list[dict[str, Any]]:
    """BridgeBuild items from a file in the repository's ``data.json`` format (default ``bridge_build/<file>``
    under the data root: clone github.com/OpenMLRL/LLM_Collab_Minecraft and set ``COMLRL_MINECRAFT_DATA``).

    ``split``: ``train`` ([:8]), ``eval`` ([8:]), ``all`` or a slice such as ``"[2:5]"``. ``max_turns``: the turn
    limit stored in every item (the repository's training sets it to the run's ``num_turns``, 4); ``None`` keeps
    the file's ``max_turns`` or 5 × the map's longer side. The rules (``view``, ``max_probe``, ``max_commands``,
    palettes, ``max_message_chars``) are stored in each item, so the reward, formatters and feedback read the same.
    """
    rules = _rules(max_turns, view, max_probe, max_commands, block_agent1, block_agent2, max_message_chars)
    path = Path(path) if path is not None else data_file("bridge_build", file)
    if not path.exists():
        raise FileNotFoundError(f"BridgeBuild data file {str(path)!r} does not exist.")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"BridgeBuild data file {str(path)!r} is not JSON ({err}).") from None
    require(
        isinstance(raw, (list, dict)),
        f"BridgeBuild data {str(path)!r} must hold a task object or a list of them; got {type(raw).__name__}.",
    )
    return _items([raw] if isinstance(raw, dict) else raw, rules, split)


def generate_bridge_maps(count: int, seed: int = 0, width: int = 13, height: int = 11) -> list[dict[str, Any]]:
    """``count`` maps in the repository's format (``{"task_id", "map"}``), deterministic in ``(seed, width,
    height)``: land rows at the top (with one ``S``) and the bottom (with one ``T``), and between them a hidden
    winding route from below S to above T with true pillars on about a third of its cells (never two in a row, so
    blocks are needed), a few true pillars off the route, and false pillars off it, some right beside it. A bridge
    along the route always exists. Sizes: the repository's maps are 13 × 11 with 9-15 pillars of each kind."""
    require(count >= 0, f"count must be >= 0; got {count!r}.")
    require(width >= 2 and height >= 3, f"width must be >= 2 and height >= 3; got {width!r} x {height!r}.")
    rng = random.Random(f"bridge_build:{seed}:{width}x{height}")
    maps = []
    for k in range(count):
        grid = [["."] * width for _ in range(height)]
        grid[0] = ["#"] * width
        grid[-1] = ["#"] * width
        sx, tx = rng.randrange(width), rng.randrange(width)
        grid[0][sx], grid[-1][tx] = "S", "T"
        route: list[Cell] = []
        x = sx
        for z in range(1, height - 1):  # down one row at a time, sideways towards a moving goal
            goal = tx if z == height - 2 else rng.randrange(width)
            route.append((x, z))
            while x != goal and (z == height - 2 or rng.random() < 0.75):
                x += 1 if goal > x else -1
                route.append((x, z))
        on_route = set(route)
        previous_y = False
        for cx, cz in route:
            previous_y = not previous_y and rng.random() < 0.45
            if previous_y:
                grid[cz][cx] = "Y"
        middle = [(cx, cz) for cz in range(1, height - 1) for cx in range(width) if (cx, cz) not in on_route]
        rng.shuffle(middle)
        area = width * (height - 2)
        n_false, n_decoy = max(1, area // 9), max(0, area // 40)
        beside = [c for c in middle if any(s in on_route for s in _sides(c))]
        for cx, cz in beside[: n_false // 3]:
            grid[cz][cx] = "N"
        free = [c for c in middle if grid[c[1]][c[0]] == "."]
        for cx, cz in free[: n_false - n_false // 3]:
            grid[cz][cx] = "N"
        free = [c for c in free if grid[c[1]][c[0]] == "."]
        for cx, cz in free[:n_decoy]:
            grid[cz][cx] = "Y"
        maps.append({"task_id": f"bridge_build_gen{seed}_{k + 1:04d}", "map": ["".join(r) for r in grid]})
    return maps


def bridgebuild_generated_tasks(
    count: int = 10,
    seed: int = 0,
    split: str = "all",
    *,
    width: int = 13,
    height: int = 11,
    max_turns: int | None = DEFAULT_MAX_TURNS,
    view: int = DEFAULT_VIEW,
    max_probe: int = DEFAULT_MAX_PROBE,
    max_commands: int = DEFAULT_MAX_COMMANDS,
    block_agent1: Sequence[str] | str = DEFAULT_BLOCKS,
    block_agent2: Sequence[str] | str | None = DEFAULT_BLOCKS,
    max_message_chars: int | None = None,
) -> list[dict[str, Any]]:
    """Items from :func:`generate_bridge_maps` (no data needed), with the rules of :func:`bridgebuild_tasks` and its
    splits (``train`` = the first 8 maps)."""
    rules = _rules(max_turns, view, max_probe, max_commands, block_agent1, block_agent2, max_message_chars)
    if rules["max_turns"] is None:
        rules["max_turns"] = 5 * max(width, height)
    return _items(generate_bridge_maps(count, seed, width, height), rules, split)


class BridgeBuildTasks:
    """BridgeBuild tasks for YAML (``dataset: {class_path: ..., init_args: ...}``).

    Args:
        source: ``generated`` (:func:`generate_bridge_maps` from ``count``, ``seed``, ``width``, ``height``) or
            ``file`` (the repository's ``data.json`` format: ``path``, or ``file`` under the data root).
        split: ``train`` ([:8]), ``eval`` ([8:]), ``all`` or a slice such as ``"[:4]"``.
        max_turns, view, max_probe, max_commands, block_agent1, block_agent2, max_message_chars: the rules
            (:func:`bridgebuild_tasks`).
    """

    def __init__(
        self,
        source: TaskSource = "generated",
        split: str = "train",
        count: int = 10,
        seed: int = 0,
        width: int = 13,
        height: int = 11,
        path: str | None = None,
        file: str = "data.json",
        max_turns: int | None = DEFAULT_MAX_TURNS,
        view: int = DEFAULT_VIEW,
        max_probe: int = DEFAULT_MAX_PROBE,
        max_commands: int = DEFAULT_MAX_COMMANDS,
        block_agent1: list[str] | None = None,
        block_agent2: list[str] | None = None,
        max_message_chars: int | None = None,
    ):
        check_choice("source", source, TaskSource)
        slice_split([], split, SPLITS)  # an unknown split fails here, before any model loads
        rules = dict(
            max_turns=max_turns,
            view=view,
            max_probe=max_probe,
            max_commands=max_commands,
            block_agent1=block_agent1 or DEFAULT_BLOCKS,
            block_agent2=block_agent2 or block_agent1 or DEFAULT_BLOCKS,
            max_message_chars=max_message_chars,
        )
        _rules(**rules)  # bad rules fail here too
        if source == "generated":
            require(count >= 1, f"count must be >= 1 for source 'generated'; got {count!r}.")
            generate_bridge_maps(0, seed, width, height)  # checks the size
            self.load, self.kwargs = (
                bridgebuild_generated_tasks,
                dict(count=count, seed=seed, split=split, width=width, height=height, **rules),
            )
        else:
            self.load, self.kwargs = bridgebuild_tasks, dict(path=path, split=split, file=file, **rules)

    def __call__(self) -> list[dict[str, Any]]:
        return self.load(**self.kwargs)


def bridgebuild_train_tasks() -> list[dict[str, Any]]:
    """The repository's training maps (``data.json`` tasks [:8]) with its default rules."""
    return bridgebuild_tasks(split="train")


def bridgebuild_eval_tasks() -> list[dict[str, Any]]:
    """The repository's evaluation maps (``data.json`` tasks [8:]) with its default rules."""
    return bridgebuild_tasks(split="eval")


# ------------------------------------------------------------------------------------------------ parsing
def parse_cell(value: Any) -> Cell | None:
    """``[x, z]`` (a list or tuple of at least two integer-like items), ``{"x": .., "z": ..}`` or ``"x,z"`` /
    ``"(x, z)"`` as a cell; ``None`` for anything else (never raises)."""
    try:
        if isinstance(value, (list, tuple)) and len(value) >= 2:
            pair = (parse_coordinate(str(value[0])), parse_coordinate(str(value[1])))
        elif isinstance(value, Mapping):
            pair = (parse_coordinate(str(value.get("x"))), parse_coordinate(str(value.get("z"))))
        elif isinstance(value, str) and (m := _CELL_TEXT.match(value)):
            pair = (parse_coordinate(m.group(1)), parse_coordinate(m.group(2)))
        else:
            return None
    except (ValueError, RecursionError):  # str() of an int over the digit limit, or of a structure nested too deep
        return None
    return None if None in pair else (pair[0], pair[1])


def _close_brackets(text: str) -> str:
    """``text`` with stray ``}``/``]`` dropped and unclosed ``{``/``[`` closed (quoted strings left alone)."""
    out: list[str] = []
    closers: list[str] = []
    quote, escaped = "", False
    for ch in text:
        if quote:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not closers or closers[-1] != ch:
                continue
            closers.pop()
        out.append(ch)
    return "".join(out) + "".join(reversed(closers))


def _scan_block(text: str, start: int) -> int | None:
    """End of the brace-balanced block opening at ``start``, reading quotes from there (``None``: unclosed)."""
    depth, quote, escaped = 0, "", False
    for end in range(start, len(text)):
        ch = text[end]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return end
    return None


def _balanced_blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) of the brace-balanced block opening at each ``{``, in order of ``start``. One pass pairs the
    braces outside quoted strings; a ``{`` inside a string gets a scan of its own (at most
    :data:`MAX_IN_STRING_SCANS`), as if the string ended there."""
    spans: dict[int, int | None] = {}
    stack: list[int] = []
    quote, escaped, scans = "", False, 0
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
            elif ch == "{" and scans < MAX_IN_STRING_SCANS:
                scans += 1
                spans[i] = _scan_block(text, i)
            continue
        if ch in "\"'":
            quote = ch
        elif ch == "{":
            stack.append(i)
            spans[i] = None
        elif ch == "}" and stack:
            spans[stack.pop()] = i
    return sorted((s, e) for s, e in spans.items() if e is not None)


def _action_candidates(raw: str) -> list[str]:
    """The texts tried as the action object, in the repository's order, stripped, without repeats."""
    out: dict[str, None] = {}

    def add(text: str) -> None:
        for cand in (text, _close_brackets(text)):
            cand = cand.strip()
            if cand:
                out.setdefault(cand, None)

    add(raw)
    first, last = raw.find("{"), raw.rfind("}")
    if first >= 0:
        add(raw[first:])
    if 0 <= first < last:
        add(raw[first : last + 1])
    for start, end in _balanced_blocks(raw)[:MAX_BLOCKS]:
        add(raw[start : end + 1])
    return list(out)


def extract_action(text: Any) -> dict[str, Any]:
    """The action object of a completion (see the module docstring), ``{}`` when there is none; never raises."""
    if not isinstance(text, str):
        return {}
    raw = _strip_fences(text[:MAX_TEXT_CHARS].strip())
    if not raw:
        return {}
    best: tuple[int, int] | None = None
    found: dict[str, Any] = {}
    for index, cand in enumerate(_action_candidates(raw)):
        if not any(key in cand for key in ACTION_KEYS):  # no field name: cannot be an action
            continue
        for parse in (json.loads, ast.literal_eval):
            try:
                obj = parse(cand)
            except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):  # bad syntax, too deep, huge ints
                continue
            if isinstance(obj, dict):
                rank = (sum(key in obj for key in ACTION_KEYS), index)
                if rank[0] and (best is None or rank > best):
                    best, found = rank, obj
    return found


@dataclass
class Action:
    """One agent's parsed action."""

    comm: Any = None  # the object sent (None: nothing)
    comm_text: str = ""
    comm_tokens: int = 0
    probes: list[Cell] = field(default_factory=list)
    fills: list[tuple[int, int, int, int, str]] = field(default_factory=list)  # x1, z1, x2, z2 (ordered), block
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (line, reason)
    path: list[Cell] = field(default_factory=list)
    path_valid: bool = False


def _parse_comm(value: Any) -> tuple[Any, str, int]:
    if not isinstance(value, dict) or not value:
        return None, "", 0
    text = _compact(value).strip()
    if not text or text in ("{}", "[]"):
        return None, "", 0
    return value, text, len(_TOKEN.findall(text))


def parse_action(text: Any, task: BridgeTask, agent: int, position: Cell, max_commands: int) -> Action:
    """Agent ``agent``'s action from its completion ``text`` (standing at ``position``, with ``max_commands``
    accepted fills at most); never raises."""
    obj = extract_action(text)
    action = Action()
    action.comm, action.comm_text, action.comm_tokens = _parse_comm(obj.get("comm"))
    probes = obj.get("probe")
    if isinstance(probes, list):
        for value in probes:
            if len(action.probes) >= task.max_probe:
                break
            cell = parse_cell(value)
            if cell is not None and task.inside(cell):
                action.probes.append(cell)
    allowed = {normalize_block(b) for b in task.palette(agent)}
    cmds = obj.get("cmds")
    for value in cmds if isinstance(cmds, list) else ():
        line = _safe_str(value).strip()
        if not line:
            continue
        if len(action.fills) >= max_commands:
            action.rejected.append((line, f"over the budget of {max_commands} commands"))
            continue
        m = _FILL.match(line)
        if not m:
            action.rejected.append((line, "not '/fill x1 z1 x2 z2 block'"))
            continue
        corners = [parse_coordinate(m.group(k)) for k in (1, 2, 3, 4)]
        block = normalize_block(m.group(5))
        if None in corners:
            action.rejected.append((line, "coordinates must be absolute integers"))
        elif block not in allowed:
            action.rejected.append((line, f"block {block!r} is not yours"))
        elif not (task.inside((corners[0], corners[1])) and task.inside((corners[2], corners[3]))):
            action.rejected.append((line, "a corner is outside the map"))
        else:
            x1, z1, x2, z2 = corners
            action.fills.append((min(x1, x2), min(z1, z2), max(x1, x2), max(z1, z2), block))
    path = obj.get("path")
    action.path = [position]
    if isinstance(path, list) and path:
        cells = [parse_cell(v) for v in path]
        if (
            all(c is not None and task.inside(c) for c in cells)
            and cells[0] == position
            and all(abs(a[0] - b[0]) <= 1 and abs(a[1] - b[1]) <= 1 for a, b in zip(cells, cells[1:]))
        ):
            action.path, action.path_valid = cells, True
    return action


def _safe_str(value: Any) -> str:
    """``str(value)`` of a parsed value, or "" where Python cannot write it (an int over the digit limit, a structure
    nested too deep)."""
    try:
        return str(value)
    except (ValueError, RecursionError):
        return ""


# ------------------------------------------------------------------------------------------------ simulator
@dataclass
class BridgeState:
    """The world after some turns (see the module docstring)."""

    turn_index: int
    max_turns: int
    filled: dict[Cell, str]
    positions: list[Cell]
    origins: list[set[Cell]]
    known: list[dict[Cell, str]]
    inbox: list[list[Any]]
    connected: bool = False
    terminated: bool = False

    def clone(self) -> "BridgeState":
        return BridgeState(
            self.turn_index,
            self.max_turns,
            dict(self.filled),
            list(self.positions),
            [set(o) for o in self.origins],
            [dict(k) for k in self.known],
            [list(m) for m in self.inbox],
            self.connected,
            self.terminated,
        )


def initial_state(task: BridgeTask, num_agents: int) -> BridgeState:
    """Agent 0 on the first S, agent 1 on the first T, any further agent on the first S (row by row)."""
    n = max(1, int(num_agents))
    s0, t0 = task.anchors_s[0], task.anchors_t[0]
    positions = [t0 if i == 1 else s0 for i in range(n)]
    state = BridgeState(
        1, task.max_turns, {}, positions, [{p} for p in positions], [{} for _ in range(n)], [[] for _ in range(n)]
    )
    state.connected = state.terminated = connected_st(task, set())
    return state


def connected_st(task: BridgeTask, blocks: set[Cell]) -> bool:
    """Whether an S reaches a T through anchors, pillars (true or false) and placed blocks (4-neighbours)."""
    bridge = set(task.anchors_s) | set(task.anchors_t) | set(task.pillars) | blocks
    targets = set(task.anchors_t)
    return bool(_reach(task.anchors_s, bridge) & targets)


def _reach(seeds: Iterable[Cell], cells: set[Cell]) -> set[Cell]:
    seen = set(seeds)
    queue = deque(seen)
    while queue:
        for nb in _sides(queue.popleft()):
            if nb in cells and nb not in seen:
                seen.add(nb)
                queue.append(nb)
    return seen


def gap_st(task: BridgeTask, blocks: set[Cell]) -> int | None:
    """Fewest further blocks that would connect S and T (0-1 breadth-first search: a bridge cell costs 0, an open
    cell 1, land ``#`` cannot be crossed); ``None`` when no placement can."""
    free = set(task.anchors_s) | set(task.anchors_t) | set(task.pillars) | blocks
    targets = set(task.anchors_t)
    dist = {c: 0 for c in task.anchors_s}
    queue = deque(task.anchors_s)
    while queue:
        cur = queue.popleft()
        d = dist[cur]
        if cur in targets:
            return d
        for nb in _sides(cur):
            if not task.inside(nb):
                continue
            if nb in free:
                step = 0
            elif nb in task.fixed:
                continue
            else:
                step = 1
            if dist.get(nb, d + step + 1) <= d + step:
                continue
            dist[nb] = d + step
            queue.appendleft(nb) if step == 0 else queue.append(nb)
    return None


def joined_true_pillars(task: BridgeTask, blocks: set[Cell]) -> int:
    """True pillars that reach an anchor through blocks and true pillars."""
    if not task.true_pillars:
        return 0
    cells = set(task.anchors_s) | set(task.anchors_t) | set(task.true_pillars) | blocks
    seen = _reach([*task.anchors_s, *task.anchors_t], cells)
    return sum(p in seen for p in task.true_pillars)


def touched_false_pillars(task: BridgeTask, blocks: set[Cell]) -> int:
    """False pillars with a placed block on one of their four sides."""
    return sum(any(nb in blocks for nb in _sides(p)) for p in task.false_pillars)


def groups(task: BridgeTask, blocks: set[Cell]) -> int:
    """Connected components that the anchors and true pillars form through placed blocks."""
    focus = set(task.anchors_s) | set(task.anchors_t) | set(task.true_pillars)
    cells = focus | blocks
    seen: set[Cell] = set()
    count = 0
    for seed in focus:
        if seed not in seen:
            count += 1
            seen |= _reach([seed], cells)
    return count


def visible_cells(task: BridgeTask, origins: Iterable[Cell]) -> set[Cell]:
    """Cells within ``view`` (Chebyshev) of an origin, inside the map."""
    v = max(0, task.view)
    out: set[Cell] = set()
    for ox, oz in origins:
        xs = range(max(0, ox - v), min(task.width - 1, ox + v) + 1)
        for z in range(max(0, oz - v), min(task.height - 1, oz + v) + 1):
            out.update((x, z) for x in xs)
    return out


@dataclass
class Turn:
    """One applied turn: the state after it, the reward terms and counts, and the parsed actions."""

    state: BridgeState
    metrics: dict[str, Any]
    actions: list[Action]


def _terms(metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {"reward": 0.0, **dict.fromkeys(TERMS, 0.0), **metrics}


def apply_turn(task: BridgeTask, state: BridgeState, completions: Sequence[Any]) -> Turn:
    """One joint action (one completion per agent of the state; missing ones read as empty) applied to ``state``
    (not changed): the next state, the reward (``metrics["reward"]``), its terms (penalties positive, as the
    repository) and counts."""
    n = len(state.positions)
    texts = [completions[i] if i < len(completions) else "" for i in range(n)]
    budgets = command_budget(task.max_commands, n)
    actions = [parse_action(texts[i], task, i, state.positions[i], budgets[i]) for i in range(n)]
    before = {p for p, b in state.filled.items() if b not in AIR}
    max_gap = gap_st(task, set()) or 1
    counts = {
        "total_true_pillars": len(task.true_pillars),
        "total_false_pillars": len(task.false_pillars),
        "total_placeable_cells": task.open_cells,
        "max_gap_st": max_gap,
        "initial_cc_component_count": groups(task, set()),
    }
    if state.terminated:  # the episode is over: nothing changes, nothing scores
        joined = joined_true_pillars(task, before)
        gap = gap_st(task, before)
        metrics = _terms(
            {
                **counts,
                "gap_st": gap,
                "cc_component_count": groups(task, before),
                "connected_y_count": joined,
                "n_adjacent_count": touched_false_pillars(task, before),
                "y_uncovered_count": max(0, len(task.true_pillars) - joined),
                "new_cc_merge_count": 0,
                "new_connected_y_count": 0,
                "new_adjacent_n_count": 0,
                "newly_placed_block_count": 0,
                "num_valid_probes": 0,
                "comm_tokens": 0,
                "connected": state.connected,
                "terminated": True,
            }
        )
        return Turn(state.clone(), metrics, actions)
    nxt = state.clone()
    for action in actions:  # fills: agent 0 first
        for x1, z1, x2, z2, block in action.fills:
            for x in range(x1, x2 + 1):
                for z in range(z1, z2 + 1):
                    if (x, z) in task.fixed:
                        continue
                    if block in AIR:
                        nxt.filled.pop((x, z), None)
                    else:
                        nxt.filled[(x, z)] = block
    truth = {**{p: "N" for p in task.false_pillars}, **{p: "Y" for p in task.true_pillars}}
    for i, action in enumerate(actions):
        for cell in action.probes:
            nxt.known[i][cell] = truth.get(cell, "none")
    for src, action in enumerate(actions):
        if action.comm_text:
            for dst in range(n):
                if dst != src:
                    nxt.inbox[dst].append(copy.deepcopy(action.comm))
    for i, action in enumerate(actions):
        nxt.origins[i].add(nxt.positions[i])
        if action.path_valid:
            nxt.origins[i].update(action.path)
            nxt.positions[i] = action.path[-1]
    after = {p for p, b in nxt.filled.items() if b not in AIR}
    gap_before, gap_after = gap_st(task, before), gap_st(task, after)
    groups_before, groups_after = groups(task, before), groups(task, after)
    joined_before, joined_after = joined_true_pillars(task, before), joined_true_pillars(task, after)
    touched_before, touched_after = touched_false_pillars(task, before), touched_false_pillars(task, after)
    connected = connected_st(task, after)
    merges = max(0, groups_before - groups_after)
    new_joined = max(0, joined_after - joined_before)
    new_touched = max(0, touched_after - touched_before)
    new_blocks = len(after - before)
    bonus_gap = WEIGHTS["gap"] * (
        float((max_gap if gap_before is None else gap_before) - (max_gap if gap_after is None else gap_after))
        / float(max_gap)
    )
    bonus_cc = WEIGHTS["cc_merge"] * (float(merges) / float(max(1, counts["initial_cc_component_count"] - 1)))
    bonus_y = (float(new_joined) / float(max(1, len(task.true_pillars)))) * WEIGHTS["y_connected"]
    penalty_n = (float(new_touched) / float(max(1, len(task.false_pillars)))) * WEIGHTS["n_adjacent"]
    penalty_block = (float(new_blocks) / float(task.open_cells)) * WEIGHTS["block_cost"]
    terminal = WEIGHTS["terminal"] if connected and not state.connected else 0.0
    reward = bonus_gap + bonus_cc + bonus_y - penalty_n - penalty_block + terminal
    nxt.turn_index = state.turn_index + 1
    nxt.connected = connected
    nxt.terminated = connected or nxt.turn_index > nxt.max_turns
    metrics = {
        "reward": reward,
        "bonus_gap_st": bonus_gap,
        "bonus_cc_merge": bonus_cc,
        "bonus_y_connected": bonus_y,
        "penalty_n_adjacent": penalty_n,
        "penalty_block_cost": penalty_block,
        "bonus_terminal_connect": terminal,
        **counts,
        "gap_st": gap_after,
        "cc_component_count": groups_after,
        "connected_y_count": joined_after,
        "n_adjacent_count": touched_after,
        "y_uncovered_count": max(0, len(task.true_pillars) - joined_after),
        "new_cc_merge_count": merges,
        "new_connected_y_count": new_joined,
        "new_adjacent_n_count": new_touched,
        "newly_placed_block_count": new_blocks,
        "num_valid_probes": sum(len(a.probes) for a in actions),
        "comm_tokens": sum(a.comm_tokens for a in actions),
        "connected": connected,
        "terminated": nxt.terminated,
        "turn_index": state.turn_index,
    }
    return Turn(nxt, metrics, actions)


def replay(task: BridgeTask, turns: Sequence[Sequence[Any]], num_agents: int) -> list[Turn]:
    """Every turn of a trajectory (``turns[t]``: the agents' completions at turn t) from the initial state."""
    state = initial_state(task, num_agents)
    out = []
    for joint in turns:
        out.append(apply_turn(task, state, joint))
        state = out[-1].state
    return out


def _history_turns(history: Sequence[Sequence[Any]] | None, n: int) -> list[list[Any]]:
    """Per-agent response lists → per-turn joint actions (a shorter agent list reads as empty answers)."""
    if not history:
        return []
    lists = [list(history[i]) if i < len(history) and history[i] is not None else [] for i in range(n)]
    length = max((len(h) for h in lists), default=0)
    return [[h[t] if t < len(h) else "" for h in lists] for t in range(length)]


# ------------------------------------------------------------------------------------------------ reward
def bridgebuild_breakdown(
    completions: Sequence[Any], item: Mapping[str, Any], history: Sequence[Sequence[Any]] | None = None
) -> dict[str, float]:
    """The reward of one joint action after the earlier turns ``history`` (per agent, its earlier responses), its
    terms (penalties positive) and counts, as floats (``gap_st``: an impossible gap reads as ``max_gap_st``)."""
    task = BridgeTask.from_item(item)
    n = len(completions)
    state = initial_state(task, n)
    for joint in _history_turns(history, n):
        state = apply_turn(task, state, joint).state
    turn = apply_turn(task, state, completions)
    out = {k: float(v) for k, v in turn.metrics.items() if isinstance(v, (int, float)) and v is not None}
    out["total"] = out["reward"]
    out["gap_st"] = float(turn.metrics["gap_st"] if turn.metrics["gap_st"] is not None else turn.metrics["max_gap_st"])
    out["accepted_commands"] = float(sum(len(a.fills) for a in turn.actions))
    out["rejected_commands"] = float(sum(len(a.rejected) for a in turn.actions))
    out["valid_paths"] = float(sum(a.path_valid for a in turn.actions))
    return out


def _joint_breakdowns(agent_completions, batch_items, response_history_per_agent) -> list[dict[str, float]]:
    if not batch_items:
        raise ValueError("bridgebuild_reward needs batch_items (the BridgeBuild items with their maps).")
    count = len(agent_completions[0]) if agent_completions else 0
    items = list(batch_items) * count if len(batch_items) == 1 else list(batch_items)
    histories = list(response_history_per_agent) if response_history_per_agent is not None else [None] * count
    require(
        len(items) == count and len(histories) == count,
        f"bridgebuild_reward got {count} joint actions, {len(items)} items and {len(histories)} histories.",
    )
    return [
        bridgebuild_breakdown(joint, item, history)
        for joint, item, history in zip(zip(*agent_completions), items, histories)
    ]


def bridgebuild_reward(
    *agent_completions: Sequence[Any],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
    response_history_per_agent: Sequence[Sequence[Sequence[Any]]] | None = None,
) -> list[float]:
    """BridgeBuild team reward of each joint action in [−18, 15], after replaying its trajectory's earlier turns
    (``response_history_per_agent``; none: a first turn). ``batch_items``: one item per joint action, or one for
    all."""
    return [b["total"] for b in _joint_breakdowns(agent_completions, batch_items, response_history_per_agent)]


def reward_components(breakdown: Mapping[str, float]) -> dict[str, float]:
    """The terms of one :func:`bridgebuild_breakdown` as named components, penalties negative; added in this order
    from 0.0 they give ``breakdown["total"]`` exactly."""
    sign = {"penalty_n_adjacent": -1.0, "penalty_block_cost": -1.0}
    return {name: sign.get(name, 1.0) * breakdown[name] for name in TERMS}


def bridgebuild_reward_components(
    *agent_completions: Sequence[Any],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
    response_history_per_agent: Sequence[Sequence[Sequence[Any]]] | None = None,
) -> list[dict[str, float]]:
    """:func:`bridgebuild_reward` with each joint action's six terms as named components (their sum is its reward),
    for ``reward_aggregation: normalize_components``."""
    breakdowns = _joint_breakdowns(agent_completions, batch_items, response_history_per_agent)
    return [reward_components(b) for b in breakdowns]


bridgebuild_reward.reward_range = (REWARD_MIN, REWARD_MAX)
bridgebuild_reward_components.reward_range = (REWARD_MIN, REWARD_MAX)


# ------------------------------------------------------------------------------------------------ observation
def observation(task: BridgeTask, state: BridgeState, agent: int) -> dict[str, Any]:
    """What agent ``agent`` knows: its position, the visible anchors, land, placed blocks and pillar cells, its
    probe results and the messages it received (lists row by row, cells as ``[x, z]``)."""
    seen = visible_cells(task, state.origins[agent])
    blocks = {p for p, b in state.filled.items() if b not in AIR}
    anchors = [{"coord": list(c), "kind": "S"} for c in task.anchors_s if c in seen]
    anchors += [{"coord": list(c), "kind": "T"} for c in task.anchors_t if c in seen]
    known = state.known[agent]
    return {
        "turn_index": state.turn_index,
        "max_turns": state.max_turns,
        "current_pos": list(state.positions[agent]),
        "visible_anchors": anchors,
        "visible_land_coords": [list(c) for c in task.land if c in seen],
        "visible_filled_coords": [list(c) for c in _by_row(blocks & seen)],
        "visible_p_candidates": [list(c) for c in task.pillars if c in seen],
        "known_probe_results": [{"coord": list(c), "type": known[c]} for c in _by_row(known)],
        "received_messages": copy.deepcopy(state.inbox[agent]),
        "connected": state.connected,
        "terminated": state.terminated,
    }


def _messages_text(messages: Sequence[Any], limit: int | None) -> str:
    if not messages:
        return "(none)"
    lines = []
    for k, message in enumerate(messages, start=1):
        text = _compact(message)
        if limit is not None and len(text) > limit:
            text = text[:limit] + f" ... [cut at {limit} characters]"
        lines.append(f"  {k}. {text}")
    return "\n".join(lines)


def user_prompt(task: BridgeTask, state: BridgeState, agent: int, num_agents: int, feedback: str = "") -> str:
    """Agent ``agent``'s prompt without the system text: role, rules, its view of ``state`` and ``feedback``."""
    obs = observation(task, state, agent)
    budget = command_budget(task.max_commands, num_agents)[agent]
    pos = _compact(obs["current_pos"])
    name = "A" if agent == 0 else "B" if agent == 1 else str(agent + 1)
    team = (
        "You work alone."
        if num_agents == 1
        else f"You are worker {name} of {num_agents}; your teammates act at the same time, and all /fill commands run "
        "in worker order (A's first)."
    )
    lines = [
        f"Bridge task {task.task_id}. {team}",
        f"Map: {task.width} x {task.height} cells on one level, cells written [x,z]: x = column from 0 (left), "
        f"z = row from 0 (top). Turn {obs['turn_index']} of {obs['max_turns']}.",
        "Cells: '#' land, 'S' start anchor, 'T' target anchor, 'Y' real pillar, 'N' fake pillar, '*' a block placed "
        "with /fill, '.' open. Land, anchors and pillars never change; a /fill over them leaves them as they are.",
        "Goal: join an S to a T by a chain of side-by-side cells made of anchors, pillars (Y or N) and placed "
        "blocks, with as few blocks as you can. Land '#' is not part of any chain. A pillar's kind is hidden "
        "until someone probes it.",
        *(
            [
                "The game is over (" + ("S and T are joined" if obs["connected"] else "no turns are left") + "): "
                "nothing you do changes the map now."
            ]
            if obs["terminated"]
            else []
        ),
        "",
        f"What you see (cells within {task.view} steps, diagonals included, of any point you have stood on):",
        f"- your position: {pos}",
        f"- anchors: {_compact(obs['visible_anchors'])}",
        f"- land: {_compact(obs['visible_land_coords'])}",
        f"- placed blocks '*': {_compact(obs['visible_filled_coords'])}",
        f"- pillars of unknown kind: {_compact(obs['visible_p_candidates'])}",
        f"- your probe results: {_compact(obs['known_probe_results'])}",
        "- messages from teammates:",
        _messages_text(obs["received_messages"], task.max_message_chars),
        "",
        f"Your blocks: {_compact([normalize_block(b) for b in task.palette(agent)])}",
        "",
        "Reply with one JSON object with these four fields:",
        '  {"comm": {...}, "probe": [[x,z], ...], "cmds": ["/fill x1 z1 x2 z2 block", ...], "path": [[x,z], ...]}',
        "- comm: an object your teammates read next turn (for example the pillars you found); {} sends nothing. "
        "Keep it short.",
        f"- probe: at most {task.max_probe} cells whose pillar kind you want to learn.",
        f"- cmds: at most {budget} /fill commands; each fills the rectangle between two corners [x1,z1] and "
        "[x2,z2] (no y) with one of your blocks.",
        f"- path: your moves, starting with your position {pos}; each next cell is one of the 8 around the last "
        "(or the same). A wrong path keeps you in place.",
        f'Doing nothing: {{"comm":{{}},"probe":[],"cmds":[],"path":[{pos}]}}',
        "",
        "Score after every turn: up to +5 for shrinking the number of blocks still missing between S and T; up to +3 "
        "for joining anchors and real pillars into fewer groups; up to +5 for linking real pillars to an anchor; "
        "up to -8 for putting blocks beside fake pillars; up to -5 for the blocks you add; +2 when S and T become "
        "joined. The game ends when S and T are joined or after the last turn.",
        "",
        "Feedback:",
        feedback.strip() or "(none)",
    ]
    return "\n".join(lines)


def bridgebuild_prompt(item: Mapping[str, Any], agent_index: int = 0, num_agents: int = 2) -> str:
    """The first-turn prompt of agent ``agent_index`` of ``num_agents`` (system text, rules, its view)."""
    task = BridgeTask.from_item(item)
    require(0 <= agent_index < num_agents, f"agent_index must be in [0, {num_agents}); got {agent_index}.")
    return f"{SYSTEM_PROMPT}\n\n{user_prompt(task, initial_state(task, num_agents), agent_index, num_agents)}"


def bridgebuild_agent0_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of agent 0 (worker A, starts on S) of 2; a later turn's external prompt is used as it is."""
    return external_prompts if external_prompts is not None else bridgebuild_prompt(item, 0, 2)


def bridgebuild_agent1_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of agent 1 (worker B, starts on T) of 2."""
    return external_prompts if external_prompts is not None else bridgebuild_prompt(item, 1, 2)


def bridgebuild_single_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of a single agent (starts on S, the whole command budget)."""
    return external_prompts if external_prompts is not None else bridgebuild_prompt(item, 0, 1)


# ------------------------------------------------------------------------------------------------ feedback
def _number(value: Any) -> str:
    return f"{float(value):.4f}"


def score_text(metrics: Mapping[str, Any], turn: int) -> str:
    lines = ["Score of the last turn:", f"- turn: {turn}", f"- reward: {_number(metrics['reward'])}"]
    lines += [f"- {name}: {_number(metrics[name])}" for name in TERMS]
    lines += [
        f"- real pillars newly linked: {metrics['new_connected_y_count']}",
        f"- fake pillars newly touched: {metrics['new_adjacent_n_count']}",
        f"- blocks added: {metrics['newly_placed_block_count']}",
        f"- S and T joined: {bool(metrics['connected'])}",
    ]
    return "\n".join(lines)


def perfect_text(metrics: Mapping[str, Any], turn: int, agent: int) -> str:
    lines = [
        "Full report on the last turn:",
        f"- turn: {turn}",
        f"- you are worker {'A' if agent == 0 else 'B' if agent == 1 else agent + 1}",
        f"- reward: {_number(metrics['reward'])}",
        f"- S and T joined: {bool(metrics['connected'])}",
        f"- blocks still missing between S and T: {metrics['gap_st']} (at the start: {metrics['max_gap_st']})",
        f"- groups of anchors and real pillars: {metrics['cc_component_count']} "
        f"(at the start: {metrics['initial_cc_component_count']})",
        f"- real pillars linked to an anchor: {metrics['connected_y_count']}",
        f"- fake pillars touched by blocks: {metrics['n_adjacent_count']}",
        f"- real pillars not linked: {metrics['y_uncovered_count']}",
    ]
    lines += [f"- {name}: {_number(metrics[name])}" for name in TERMS]
    lines += [
        f"- probes that counted: {metrics['num_valid_probes']}",
        f"- message tokens sent: {metrics['comm_tokens']}",
        "- Next: learn where the real pillars are, keep blocks away from fake ones, link real pillars, then join "
        "S and T.",
    ]
    return "\n".join(lines)


def position_text(obs: Mapping[str, Any], connected: bool, turn: int, agent: int) -> str:
    return "\n".join(
        [
            "Where you stand:",
            f"- turn: {turn}",
            f"- you are worker {'A' if agent == 0 else 'B' if agent == 1 else agent + 1}",
            f"- position: {_compact(obs['current_pos'])}",
            f"- land cells in view: {len(obs['visible_land_coords'])}",
            f"- pillar cells in view: {len(obs['visible_p_candidates'])}",
            f"- probe results you hold: {len(obs['known_probe_results'])}",
            f"- S and T joined: {bool(connected)}",
        ]
    )


def _turn(prompt_history_per_agent: Sequence[Sequence[str]] | None) -> int:
    """The number the feedback shows: prompts so far + 1 (1 without a history), as the repository counts."""
    if prompt_history_per_agent and prompt_history_per_agent[0] is not None:
        return len(prompt_history_per_agent[0]) + 1
    return 1


class BridgeBuildFeedback:
    """BridgeBuild's external transition: each agent's next prompt from the trajectory so far.

    Args:
        mode: ``empty_feedback``, ``perfect_feedback``, ``position_feedback`` or ``score_feedback`` (module
            docstring).
        original_prompt: write the whole prompt (system text, rules, the agent's new view) around the feedback;
            without it an agent gets only the feedback (``empty_feedback``: its view without the system text).
        previous_response: append the agent's last answer.
        tasks: the items to look prompts up in (default: every item the BridgeBuild loaders built in this process).
    """

    def __init__(
        self,
        mode: BridgeBuildMode = "empty_feedback",
        original_prompt: bool = True,
        previous_response: bool = False,
        tasks: Sequence[Mapping[str, Any]] | None = None,
    ):
        check_choice("mode", mode, BridgeBuildMode)
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
        require(
            n >= 1 and len(agent_completions) == n, f"expected {n} agent completions, got {len(agent_completions)}."
        )
        task = BridgeTask.from_item(TASKS.find(str(prompt), self.tasks, "BridgeBuild"))
        turns = _history_turns(response_history_per_agent, n) or [list(agent_completions)]
        turns[-1] = list(agent_completions)  # the history includes this turn; its answers are these
        played = replay(task, turns, n)
        last, state = played[-1], played[-1].state
        turn = _turn(prompt_history_per_agent)
        prompts = []
        for i in range(n):
            if self.mode == "score_feedback":
                feedback = score_text(last.metrics, turn)
            elif self.mode == "perfect_feedback":
                feedback = perfect_text(last.metrics, turn, i)
            elif self.mode == "position_feedback":
                feedback = position_text(observation(task, state, i), state.connected, turn, i)
            else:
                feedback = ""
            if self.original_prompt:
                text = f"{SYSTEM_PROMPT}\n\n{user_prompt(task, state, i, n, feedback)}"
            elif self.mode == "empty_feedback":
                text = user_prompt(task, state, i, n)
            else:
                text = feedback
            previous = agent_completions[i]
            if self.previous_response and isinstance(previous, str) and previous.strip():
                text = f"{text.rstrip()}\n\nYour previous answer:\n{previous.strip()}"
            prompts.append(text)
        return prompts


# ------------------------------------------------------------------------------------------------ evaluation
EVAL_METRICS = (
    "total_reward",
    *TERMS,
    "connected",
    "gap_st",
    "cc_component_count",
    "connected_y_count",
    "n_adjacent_count",
    "newly_placed_block_count",
    "num_valid_probes",
    "comm_tokens",
    "accepted_commands",
    "rejected_commands",
    "valid_paths",
)


def bridgebuild_eval_logger(
    agent_completions_turns: Sequence[Sequence[Sequence[Any]]], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, float]]:
    """Per-sample ``turn_k/<name>`` for the names in :data:`EVAL_METRICS` (``agent_completions_turns[i][s]`` is
    agent i's list of completions over the turns of sample s), each turn scored after the earlier ones."""
    if not batch_items:
        raise ValueError("bridgebuild_eval_logger needs batch_items (the BridgeBuild items).")
    rows = []
    for s, per_agent in enumerate(zip(*agent_completions_turns)):
        item = batch_items[s] if s < len(batch_items) else batch_items[-1]
        metrics: dict[str, float] = {}
        for t, joint in enumerate(zip(*per_agent)):
            history = [list(turns[:t]) for turns in per_agent]
            b = bridgebuild_breakdown(joint, item, history)
            b["total_reward"] = b["total"]
            metrics.update({f"turn_{t + 1}/{name}": float(b[name]) for name in EVAL_METRICS})
        rows.append(metrics)
    return rows


def bridgebuild_eval_aggregator(metrics: Sequence[Mapping[str, float]], num_turns: int = 1) -> dict[str, float]:
    """Means over samples: ``turn_k/avg_<name>`` (e.g. ``turn_1/avg_total_reward``, ``turn_2/avg_connected``)."""
    return mean_by_turn(metrics, num_turns, EVAL_METRICS)
