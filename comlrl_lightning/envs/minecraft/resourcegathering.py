"""ResourceGathering: two workers with different tools gather wood, stone and iron on a grid they only partly see,
telling each other where the resources are (OpenMLRL/LLM_Collab_Minecraft, ``resource_gathering/``).

Task. A map of ``width × height`` cells (8 × 8 to 10 × 10 in the repository), x left to right and z top to bottom
(the first row is ``z = 0``). A cell holds a pile ``(wood, stone, iron)`` or nothing; the two workers start at the
cells marked ``A`` (agent 0) and ``B`` (agent 1). The team must collect ``goal`` of each resource (the
repository: wood 3, stone 3, iron 1). The maps put A next to the minerals and B next to the trees, so each worker
has to walk, or learn from the other where its own resource lies.

Tools (asymmetric). Worker A's tool takes only wood; worker B's only stone and iron. Extracting a cell takes every
unit of the resources the worker's tool allows and leaves the others in the cell.

One turn. Both workers answer at once with one JSON object ``{"comm": ..., "probe": [], "cmds": [...],
"path": [...]}`` (:func:`parse_action`; any text is read, a fenced block from inside, the first balanced ``{...}``
decoded; nothing raises: what cannot be read counts as absent):

1. ``path``: cells ``[x, z]`` starting at the worker's position, each one step (8-neighbourhood, staying allowed)
   from the last and inside the map; at most ``max_path_len`` steps are read (longer paths are cut). A path that
   breaks a rule is void (the worker stays); a missing, empty or non-list path means staying.
2. Moves are applied, agent 0 first. Every cell a worker has stood on (its start, every path cell) becomes a
   *vision origin*: a worker sees the square of radius ``view`` around each of them, for the rest of the episode
   (partial observability: resources outside are unknown to it until seen or told).
3. ``cmds``: up to ``extraction_limit`` cells ``[x, z]`` to extract, after moving. An extraction counts as *wasted*
   when the cell is unreadable or off the map, farther than ``extraction_range`` (Manhattan) from the worker's new
   position, empty, or holds nothing the worker's tool takes. Agent 0's extractions come before agent 1's.
4. ``comm``: ``{"resource_facts": [{"x": .., "z": .., "type": "wood" | "stone" | "iron"}, ...]}``. A fact is kept
   when its cell is visible to the sender (before the move) and holds that resource; its ``count`` is the true
   amount (a claimed count is ignored); duplicates are dropped, then the first ``comm_limit`` facts are sent
   (``comm_limit: null``: all). The message reaches the other worker, who sees every message received so far in its
   next prompts.

Reward (:class:`ResourceGatheringReward`, the repository's shaping; per turn)::

    R = progress + terminal + move_to_zone + useful_comm + first_enter_zone + move_cost + comm_cost + wasted_extraction

    progress           progress_reward_scale · (P_after − P_before), P = mean over wood, stone, iron of
                       min(1, collected / goal)
    terminal           terminal_bonus the turn every goal is first met
    move_to_zone       move_to_zone_bonus_scale · the Manhattan distance each worker closed towards its work zone
                       (the cells within extraction_range of a cell holding a resource its tool takes and the team
                       still needs, from the state before the turn; no zone: 0)
    useful_comm        per sender, useful_comm_bonus_scale · min(1, Σ min(1, count / remaining goal)) over its kept
                       facts that the receiver needs, did not see and was not told before
    first_enter_zone   first_enter_zone_bonus_scale per worker entering its work zone for the first time
                       (starting inside counts as entered)
    move_cost          −move_cost_scale · path steps of both workers
    comm_cost          −comm_cost_scale · facts sent by both workers
    wasted_extraction  −wasted_extraction_penalty · wasted extractions of both workers

With the repository's final numbers (progress 8, terminal 7, move to zone 0.05, useful comm 0.1, first entry 0.15,
wasted 0.1, no move / comm cost) a whole episode that meets every goal earns at least 8 + 7 = 15 from the first two
terms. The reward is a pure function of the task and the answers so far: a turn's reward replays the earlier turns
(``response_history_per_agent``) from the task item, then scores this turn.

Multi-turn feedback (:class:`ResourceGatheringFeedback`): ``empty_feedback``, the repository's only mode: the next
prompt of each worker is its full prompt rendered from the state after the turn (position, what it sees, the
messages it has received, team inventory), with no further feedback; ``previous_response`` appends its last
answer. The trainer passes a transition only the item's ``prompt`` key ``resource_gathering:<task_id>``; the
transition finds the task among the items the loaders of this process built (or ``tasks=``).

Data. :func:`resourcegathering_tasks` reads the repository's ``resource_gathering/dataset/data.json`` (a list of
``{"task_id", "family", "goal": {...}, "rows": ["(0,2,1) A . ...", ...]}``; tokens ``.`` / ``_`` / ``0`` empty,
``(w,s,i)`` a pile, ``A`` / ``B`` / ``AB`` the starts) under :func:`~.common.data_root`;
:func:`generate_resourcegathering_tasks` draws maps of the same schema from a seed (no data needed).
:class:`ResourceGatheringTasks` picks one for YAML. Splits ``train`` / ``eval`` are the first / second half (the
repository's 14 tasks: its ``[:7]`` / ``[7:]``) or a slice such as ``"[:4]"``.

Differences from the repository, all deliberate: it never applies ``comm_limit`` to an LLM's message (only its
neural-policy decoder does; ``comm_limit: null`` reproduces it), computes the starting work-zone flags with an
extraction range of 2 whatever the configured one (here the configured one), and crashes on a non-iterable
``resource_facts`` (here: no facts).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from comlrl_lightning.envs.minecraft.common import TASKS, check_choice, data_file, mean_by_turn, require, slice_split

ResourceGatheringMode = Literal["empty_feedback"]
Coord = tuple[int, int]
RESOURCES = ("wood", "stone", "iron")
AGENT_NAMES = ("A", "B")
TOOLS = (frozenset({"wood"}), frozenset({"stone", "iron"}))  # what agent 0's / agent 1's tool extracts
RULE_DEFAULTS = {
    "view": 2,
    "extraction_range": 2,
    "extraction_limit": 2,
    "max_path_len": 4,
    "comm_limit": 1,
    "max_turns": 4,
}
SHAPING_DEFAULTS = {  # the repository's final values (configs/comlrl/resource_gathering_maac_config.yaml)
    "progress_reward_scale": 8.0,
    "terminal_bonus": 7.0,
    "move_cost_scale": 0.0,
    "comm_cost_scale": 0.0,
    "move_to_zone_bonus_scale": 0.05,
    "useful_comm_bonus_scale": 0.1,
    "first_enter_zone_bonus_scale": 0.15,
    "wasted_extraction_penalty": 0.1,
}
COMPONENTS = (
    "progress",
    "terminal",
    "move_to_zone",
    "useful_comm",
    "first_enter_zone",
    "move_cost",
    "comm_cost",
    "wasted_extraction",
)
SYSTEM_PROMPT = (
    "You are one of two workers in a Minecraft resource-gathering team. Answer with exactly one JSON object and stop: "
    "no markdown, no code fences, no reasoning, no other text."
)
_PILE = re.compile(r"^\(?\s*(\d+)\s*[,:|]\s*(\d+)\s*[,:|]\s*(\d+)\s*\)?$")
_EMPTY_TOKENS = frozenset({".", "_", "0"})
_START_TOKENS = frozenset({"A", "B", "AB", "BA"})


def _splits(count: int) -> dict[str, slice]:
    half = count - count // 2
    return {"train": slice(None, half), "eval": slice(half, None), "all": slice(None)}


# ------------------------------------------------------------------------------------------------ tasks
@dataclass(frozen=True)
class ResourceTask:
    """One map with its goal and rules (what an item carries; see :meth:`to_item`)."""

    task_id: str
    family: str
    piles: tuple[tuple[tuple[int, int, int], ...], ...]  # piles[z][x] = (wood, stone, iron)
    starts: tuple[Coord, Coord]
    goal: tuple[int, int, int]
    view: int = RULE_DEFAULTS["view"]
    extraction_range: int = RULE_DEFAULTS["extraction_range"]
    extraction_limit: int = RULE_DEFAULTS["extraction_limit"]
    max_path_len: int = RULE_DEFAULTS["max_path_len"]
    comm_limit: int | None = RULE_DEFAULTS["comm_limit"]
    max_turns: int = RULE_DEFAULTS["max_turns"]

    @property
    def width(self) -> int:
        return len(self.piles[0])

    @property
    def height(self) -> int:
        return len(self.piles)

    @property
    def prompt_key(self) -> str:
        return f"resource_gathering:{self.task_id}"

    def inside(self, cell: Coord) -> bool:
        return 0 <= cell[0] < self.width and 0 <= cell[1] < self.height

    def rows(self) -> list[str]:
        """The map in the repository's token format (``A`` / ``B`` / ``AB`` on the start cells)."""
        out = []
        for z, row in enumerate(self.piles):
            tokens = []
            for x, pile in enumerate(row):
                mark = "".join(n for n, s in zip(AGENT_NAMES, self.starts) if s == (x, z))
                if any(pile):  # a start on a pile (agent_starts) keeps the pile; the item's agent_starts has the start
                    tokens.append(f"({pile[0]},{pile[1]},{pile[2]})")
                else:
                    tokens.append(mark or ".")
            out.append(" ".join(tokens))
        return out

    def to_item(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt_key,
            "task_id": self.task_id,
            "family": self.family,
            "goal": dict(zip(RESOURCES, self.goal)),
            "rows": self.rows(),
            "agent_starts": [list(s) for s in self.starts],
            "view": self.view,
            "extraction_range": self.extraction_range,
            "extraction_limit": self.extraction_limit,
            "max_path_len": self.max_path_len,
            "comm_limit": self.comm_limit,
            "max_turns": self.max_turns,
        }

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> "ResourceTask":
        missing = [k for k in ("task_id", "rows") if k not in item]
        if missing:
            raise KeyError(
                f"ResourceGathering item without {missing} (keys: {sorted(item)}): build the items with "
                "comlrl_lightning.envs.minecraft.resourcegathering.resourcegathering_tasks or ResourceGatheringTasks."
            )
        rules = {k: item.get(k, v) for k, v in RULE_DEFAULTS.items()}
        return parse_map(item, rules, str(item["task_id"]))


def parse_map(obj: Mapping[str, Any], rules: Mapping[str, Any], task_id: str) -> ResourceTask:
    """A task from the repository's JSON schema (``rows`` or ``map``, ``goal``, optional ``agent_starts``)."""
    raw = obj.get("map") if "map" in obj else obj.get("rows")
    if isinstance(raw, str):
        raw = [line for line in raw.splitlines() if line.strip()]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError(f"{task_id}: 'rows' must be a non-empty list of rows (or one string); got {raw!r:.80}.")
    grid = [row.split() if isinstance(row, str) else [str(t).strip() for t in row] for row in raw]
    width = len(grid[0])
    require(width > 0, f"{task_id}: the first row is empty.")
    piles: list[tuple[tuple[int, int, int], ...]] = []
    starts: dict[str, Coord] = {}
    for z, tokens in enumerate(grid):
        require(len(tokens) == width, f"{task_id}: row {z} has {len(tokens)} cells, row 0 has {width}.")
        row = []
        for x, token in enumerate(tokens):
            if token in _START_TOKENS:
                for name in token:
                    starts[name] = (x, z)
                row.append((0, 0, 0))
            elif token in _EMPTY_TOKENS:
                row.append((0, 0, 0))
            else:
                m = _PILE.match(token)
                if not m:
                    raise ValueError(
                        f"{task_id}: cell ({x}, {z}) has the token {token!r}; a cell is '.', '_', '0', "
                        "'(wood,stone,iron)' or a start marker A, B, AB."
                    )
                row.append((int(m[1]), int(m[2]), int(m[3])))
        piles.append(tuple(row))
    given = obj.get("agent_starts")
    if isinstance(given, (list, tuple)) and given:
        cells = [_coord(c) for c in given[:2]]
        require(len(cells) == 2 and None not in cells, f"{task_id}: agent_starts must be two [x, z]; got {given!r}.")
        starts = {"A": cells[0], "B": cells[1]}
    require("A" in starts and "B" in starts, f"{task_id}: the rows must mark both starts, A and B.")
    goal_obj = obj.get("goal") if isinstance(obj.get("goal"), Mapping) else {}
    goal = tuple(max(1, int(goal_obj.get(name, 1))) for name in RESOURCES)
    comm_limit = rules.get("comm_limit")
    task = ResourceTask(
        task_id=task_id,
        family=str(obj.get("family") or ""),
        piles=tuple(piles),
        starts=(starts["A"], starts["B"]),
        goal=goal,  # type: ignore[arg-type]
        view=int(rules["view"]),
        extraction_range=int(rules["extraction_range"]),
        extraction_limit=int(rules["extraction_limit"]),
        max_path_len=int(rules["max_path_len"]),
        comm_limit=None if comm_limit is None else int(comm_limit),
        max_turns=int(rules["max_turns"]),
    )
    for start in task.starts:
        require(task.inside(start), f"{task_id}: start {list(start)} is outside the {width} x {len(grid)} map.")
    return task


def _check_rules(rules: Mapping[str, Any]) -> dict[str, Any]:
    for name in ("view", "extraction_range", "extraction_limit"):
        require(
            isinstance(rules[name], int) and rules[name] >= 0, f"{name} must be an integer >= 0; got {rules[name]!r}."
        )
    for name in ("max_path_len", "max_turns"):
        require(
            isinstance(rules[name], int) and rules[name] >= 1, f"{name} must be an integer >= 1; got {rules[name]!r}."
        )
    limit = rules["comm_limit"]
    require(
        limit is None or (isinstance(limit, int) and limit >= 0),
        f"comm_limit must be an integer >= 0 or null (no limit); got {limit!r}.",
    )
    return dict(rules)


def _items(objs: Sequence[Any], rules: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    items = []
    for index, obj in enumerate(objs, start=1):
        if not isinstance(obj, Mapping):
            raise ValueError(f"{where}: task #{index} must be an object; got {type(obj).__name__}.")
        task_id = str(obj.get("task_id") or f"resource_gathering_{index:04d}")
        items.append(parse_map(obj, rules, task_id).to_item())
    return items


def resourcegathering_tasks(
    path: str | Path | None = None,
    split: str = "all",
    *,
    view: int = RULE_DEFAULTS["view"],
    extraction_range: int = RULE_DEFAULTS["extraction_range"],
    extraction_limit: int = RULE_DEFAULTS["extraction_limit"],
    max_path_len: int = RULE_DEFAULTS["max_path_len"],
    comm_limit: int | None = RULE_DEFAULTS["comm_limit"],
    max_turns: int = RULE_DEFAULTS["max_turns"],
) -> list[dict[str, Any]]:
    """Items from a file of the repository's schema (default ``resource_gathering/dataset/data.json`` under the data
    root; a list of tasks or one task). ``split``: ``train`` (first half), ``eval`` (second half), ``all`` or a slice
    such as ``"[:7]"``. The rules are stored in every item, so the reward, the formatters and the feedback read the
    same ones."""
    rules = _check_rules(
        dict(
            view=view,
            extraction_range=extraction_range,
            extraction_limit=extraction_limit,
            max_path_len=max_path_len,
            comm_limit=comm_limit,
            max_turns=max_turns,
        )
    )
    path = Path(path) if path is not None else data_file("resource_gathering", "data.json")
    if not path.exists():
        raise FileNotFoundError(f"ResourceGathering data file {str(path)!r} does not exist.")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"ResourceGathering data file {str(path)!r} is not valid JSON: {err}.") from None
    objs = raw if isinstance(raw, list) else [raw] if isinstance(raw, dict) else None
    if objs is None:
        raise ValueError(f"ResourceGathering data file {str(path)!r} must hold a task object or a list of them.")
    items = _items(objs, rules, str(path))
    items = slice_split(items, split, _splits(len(items)))
    TASKS.add(items)
    return items


# ------------------------------------------------------------------------------------------------ generator
FAMILIES = (
    "west_mineral_east_forest",
    "east_mineral_west_forest",
    "north_mineral_south_forest",
    "south_mineral_north_forest",
    "diagonal_exchange",
    "mixed_hub",
)


def _cluster(rng: random.Random, centre: Coord, size: int, count: int, taken: set[Coord]) -> list[Coord]:
    """``count`` distinct cells near ``centre`` (Chebyshev radius 2, widened if needed) not in ``taken``."""
    for radius in (2, 3, 4):
        cells = [
            (centre[0] + dx, centre[1] + dz)
            for dx in range(-radius, radius + 1)
            for dz in range(-radius, radius + 1)
            if 0 <= centre[0] + dx < size
            and 0 <= centre[1] + dz < size
            and (centre[0] + dx, centre[1] + dz) not in taken
        ]
        if len(cells) >= count:
            return rng.sample(sorted(cells), count)
    return []


def generate_resourcegathering_tasks(count: int = 14, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` maps in the repository's JSON schema, drawn by ``random.Random(seed)`` (the same seed, the same
    maps). Like the repository's: square maps of 8 to 10 cells, goal wood 3 / stone 3 / iron 1, a mineral cluster
    (piles ``(0, s, i)``, s in 1..3, i in 0..1, at least 4 stone and 2 iron in all) around worker A's start and a
    forest (``(w, 0, 0)``, w in 1..4, at least 5 wood) around worker B's, on opposite sides (by family), sometimes
    one mixed pile ``(1, 1, 0)`` between them: each worker starts far from what its tool takes."""
    require(isinstance(count, int) and count >= 1, f"count must be an integer >= 1; got {count!r}.")
    rng = random.Random(seed)
    out = []
    for k in range(1, count + 1):
        family = FAMILIES[(k - 1) % len(FAMILIES)]
        size = rng.choice((8, 9, 10))
        lo, hi, mid = 1, size - 2, size // 2
        a, b = {
            "west_mineral_east_forest": ((lo, mid - 2), (hi, mid - 2)),
            "east_mineral_west_forest": ((hi, lo), (lo, lo)),
            "north_mineral_south_forest": ((lo + 1, lo), (hi - 1, hi)),
            "south_mineral_north_forest": ((hi - 1, hi), (lo, lo)),
            "diagonal_exchange": ((lo + 1, lo), (hi - 1, hi - 1)),
            "mixed_hub": ((lo + 1, lo + 1), (hi - 2, hi - 2)),
        }[family]
        grid = [["." for _ in range(size)] for _ in range(size)]
        taken = {a, b}
        while True:
            minerals = [(0, rng.randint(1, 3), rng.randint(0, 1)) for _ in range(rng.randint(6, 8))]
            if sum(p[1] for p in minerals) >= 4 and sum(p[2] for p in minerals) >= 2:
                break
        while True:
            forest = [(rng.randint(1, 4), 0, 0) for _ in range(rng.randint(5, 7))]
            if sum(p[0] for p in forest) >= 5:
                break
        for centre, piles in ((a, minerals), (b, forest)):
            for cell, pile in zip(_cluster(rng, centre, size, len(piles), taken), piles):
                taken.add(cell)
                grid[cell[1]][cell[0]] = f"({pile[0]},{pile[1]},{pile[2]})"
        if rng.random() < 0.4:
            between = ((a[0] + b[0]) // 2, (a[1] + b[1]) // 2)
            if between not in taken:
                grid[between[1]][between[0]] = "(1,1,0)"
        grid[a[1]][a[0]], grid[b[1]][b[0]] = "A", "B"
        out.append(
            {
                "task_id": f"resource_gathering_gen_{family}_{size}x{size}_{seed}_{k:04d}",
                "family": family,
                "goal": {"wood": 3, "stone": 3, "iron": 1},
                "rows": [" ".join(row) for row in grid],
            }
        )
    return out


class ResourceGatheringTasks:
    """The tasks for YAML (``dataset: {class_path: ..., init_args: ...}``).

    Args:
        source: ``generated`` (:func:`generate_resourcegathering_tasks` with ``count`` and ``seed``; no data needed)
            or ``file`` (the repository's ``data.json``, or ``path``).
        split: ``train`` (first half), ``eval`` (second half), ``all`` or a slice such as ``"[:7]"``.
        view, extraction_range, extraction_limit, max_path_len, comm_limit, max_turns: the rules (module docstring).
    """

    def __init__(
        self,
        source: Literal["generated", "file"] = "generated",
        split: str = "train",
        path: str | None = None,
        count: int = 14,
        seed: int = 0,
        view: int = RULE_DEFAULTS["view"],
        extraction_range: int = RULE_DEFAULTS["extraction_range"],
        extraction_limit: int = RULE_DEFAULTS["extraction_limit"],
        max_path_len: int = RULE_DEFAULTS["max_path_len"],
        comm_limit: int | None = RULE_DEFAULTS["comm_limit"],
        max_turns: int = RULE_DEFAULTS["max_turns"],
    ):
        check_choice("source", source, Literal["generated", "file"])
        require(
            source == "file" or path is None,
            f"path is only read with source: file; got path={path!r} with source: {source!r}.",
        )
        require(isinstance(count, int) and count >= 1, f"count must be an integer >= 1; got {count!r}.")
        self.source, self.split, self.path, self.count, self.seed = source, split, path, count, seed
        self.rules = _check_rules(
            dict(
                view=view,
                extraction_range=extraction_range,
                extraction_limit=extraction_limit,
                max_path_len=max_path_len,
                comm_limit=comm_limit,
                max_turns=max_turns,
            )
        )
        slice_split([], split, _splits(0))  # an unknown split fails here, before any model loads

    def __call__(self) -> list[dict[str, Any]]:
        if self.source == "file":
            return resourcegathering_tasks(self.path, self.split, **self.rules)
        objs = generate_resourcegathering_tasks(self.count, self.seed)
        items = slice_split(_items(objs, self.rules, "generated"), self.split, _splits(self.count))
        TASKS.add(items)
        return items


def resourcegathering_train_tasks() -> list[dict[str, Any]]:
    """The repository's training maps (first half of its ``data.json``: ``[:7]``) with its rules."""
    return resourcegathering_tasks(split="train")


def resourcegathering_eval_tasks() -> list[dict[str, Any]]:
    """The repository's evaluation maps (second half: ``[7:]``) with its rules."""
    return resourcegathering_tasks(split="eval")


# ------------------------------------------------------------------------------------------------ state
@dataclass
class WorldState:
    """The world before a turn. ``origins[i]``: the cells agent i has stood on (its vision origins); ``inbox[i]``:
    the messages it received (each a list of facts); ``entered[i]``: it has been in its work zone."""

    turn: int
    positions: list[Coord]
    origins: list[set[Coord]]
    inbox: list[list[list[dict[str, Any]]]]
    piles: dict[Coord, tuple[int, int, int]]
    collected: dict[str, int]
    entered: list[bool]
    completed: bool = False

    def copy(self) -> "WorldState":
        return WorldState(
            self.turn,
            list(self.positions),
            [set(o) for o in self.origins],
            [[list(m) for m in box] for box in self.inbox],
            dict(self.piles),
            dict(self.collected),
            list(self.entered),
            self.completed,
        )


def _manhattan(a: Coord, b: Coord) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def needs(task: ResourceTask, collected: Mapping[str, int], agent: int) -> list[str]:
    """The resources agent ``agent``'s tool takes that the team still lacks."""
    return [r for r, g in zip(RESOURCES, task.goal) if r in TOOLS[agent] and collected[r] < g]


def work_zone(task: ResourceTask, state: WorldState, agent: int) -> set[Coord]:
    """Cells within ``extraction_range`` of a pile holding something the agent needs (empty: nothing needed)."""
    wanted = [RESOURCES.index(r) for r in needs(task, state.collected, agent)]
    zone: set[Coord] = set()
    reach = task.extraction_range
    for (cx, cz), pile in state.piles.items():
        if any(pile[i] > 0 for i in wanted):
            for x in range(max(0, cx - reach), min(task.width, cx + reach + 1)):
                for z in range(max(0, cz - reach), min(task.height, cz + reach + 1)):
                    if abs(x - cx) + abs(z - cz) <= reach:
                        zone.add((x, z))
    return zone


def _distance(cell: Coord, zone: set[Coord]) -> int | None:
    return min(_manhattan(cell, c) for c in zone) if zone else None


def initial_state(task: ResourceTask) -> WorldState:
    state = WorldState(
        turn=1,
        positions=list(task.starts),
        origins=[{s} for s in task.starts],
        inbox=[[], []],
        piles={(x, z): p for z, row in enumerate(task.piles) for x, p in enumerate(row) if any(p)},
        collected=dict.fromkeys(RESOURCES, 0),
        entered=[False, False],
    )
    state.entered = [state.positions[i] in work_zone(task, state, i) for i in range(2)]
    return state


def visible_cells(task: ResourceTask, origins: set[Coord]) -> set[Coord]:
    """The cells of the map within Chebyshev distance ``view`` of a vision origin."""
    v = max(0, task.view)
    return {
        (ox + dx, oz + dz)
        for ox, oz in origins
        for dx in range(-v, v + 1)
        for dz in range(-v, v + 1)
        if task.inside((ox + dx, oz + dz))
    }


def extraction_zone(task: ResourceTask, cell: Coord) -> list[Coord]:
    """The cells within ``extraction_range`` (Manhattan) of ``cell``, by x then z."""
    return [
        (x, z)
        for x in range(task.width)
        for z in range(task.height)
        if _manhattan(cell, (x, z)) <= task.extraction_range
    ]


def _known(task: ResourceTask, state: WorldState, agent: int) -> dict[str, dict[Coord, int]]:
    """What ``agent`` knows of the piles: the facts it was told and the piles it sees now (largest count)."""
    known: dict[str, dict[Coord, int]] = {r: {} for r in RESOURCES}
    for message in state.inbox[agent]:
        for fact in message:
            cell = (fact["x"], fact["z"])
            known[fact["type"]][cell] = max(known[fact["type"]].get(cell, 0), fact["count"])
    for cell in visible_cells(task, state.origins[agent]):
        for i, name in enumerate(RESOURCES):
            count = state.piles.get(cell, (0, 0, 0))[i]
            if count > 0:
                known[name][cell] = max(known[name].get(cell, 0), count)
    return known


# ------------------------------------------------------------------------------------------------ parsing
def _as_int(value: Any) -> int | None:
    """``int(value)`` for a number or a numeric string (a float is truncated, as Python's ``int``); else None."""
    if not isinstance(value, (int, float, str)):
        return None
    try:
        return int(value)
    except (ValueError, OverflowError):  # 'abc', '1.5', nan, inf, over the integer-string limit
        return None


def _coord(value: Any) -> Coord | None:
    """``[x, z]`` (a list of two or more) or ``{"x": .., "z": ..}`` as integers, else None."""
    if isinstance(value, (list, tuple)) and len(value) >= 2:
        x, z = _as_int(value[0]), _as_int(value[1])
    elif isinstance(value, Mapping):
        x, z = _as_int(value.get("x")), _as_int(value.get("z"))
    else:
        return None
    return None if x is None or z is None else (x, z)


def json_object(text: Any) -> dict[str, Any]:
    """The first balanced ``{...}`` of a completion decoded as a JSON object, read from inside the first fenced block
    when there is one; ``{}`` for anything else (no object, broken JSON, not a string). Never raises."""
    if not isinstance(text, str):
        return {}
    raw = text.strip()
    if "```" in raw:
        parts = raw.split("```")
        if len(parts) >= 3:  # an opening and a closing fence: the inside of the first block, its language tag dropped
            raw = re.sub(r"^\s*[A-Za-z0-9_-]+\s*\n", "", parts[1].strip()).strip()
    start = raw.find("{")
    if start < 0:
        return {}
    depth, quote, escaped = 0, "", False
    for end in range(start, len(raw)):
        char = raw[end]
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                try:
                    obj = json.loads(raw[start : end + 1])
                except (ValueError, RecursionError):
                    return {}
                return obj if isinstance(obj, dict) else {}
    return {}


@dataclass
class ParsedAction:
    """One worker's answer as the simulator reads it (see the module docstring)."""

    facts: list[dict[str, Any]] = field(default_factory=list)  # kept facts, at most comm_limit
    cmds: list[Coord | None] = field(default_factory=list)  # extraction cells (None: unreadable or off the map)
    path: list[Coord] = field(default_factory=list)  # the accepted path, start included
    path_valid: bool = True
    is_json: bool = False  # a non-empty JSON object was found


def parse_action(text: Any, task: ResourceTask, state: WorldState, agent: int) -> ParsedAction:
    """Read one worker's completion against the state before the turn; never raises."""
    obj = json_object(text)
    start = state.positions[agent]
    out = ParsedAction(path=[start], is_json=bool(obj))
    seen = visible_cells(task, state.origins[agent])
    comm = obj.get("comm")
    facts = comm.get("resource_facts") if isinstance(comm, Mapping) else None
    keys: set[tuple[Coord, str]] = set()
    for fact in facts if isinstance(facts, (list, tuple)) else ():
        if not isinstance(fact, Mapping):
            continue
        cell = _coord(fact)
        kind = str(fact.get("type") or "").strip().lower()
        if cell is None or cell not in seen or kind not in RESOURCES:
            continue
        count = state.piles.get(cell, (0, 0, 0))[RESOURCES.index(kind)]
        if count > 0 and (cell, kind) not in keys:
            keys.add((cell, kind))
            out.facts.append({"x": cell[0], "z": cell[1], "type": kind, "count": count})
    if task.comm_limit is not None:
        del out.facts[task.comm_limit :]
    cmds = obj.get("cmds")
    if task.extraction_limit > 0 and isinstance(cmds, list):
        for value in cmds[: task.extraction_limit]:
            cell = _coord(value)
            out.cmds.append(cell if cell is not None and task.inside(cell) else None)
    path = obj.get("path")
    if isinstance(path, list) and path:
        cells = [_coord(v) for v in path[: task.max_path_len + 1]]
        ok = None not in cells and cells[0] == start
        ok = ok and all(
            max(abs(a[0] - b[0]), abs(a[1] - b[1])) <= 1 and task.inside(b) for a, b in zip(cells, cells[1:])
        )
        if ok:
            out.path = cells  # type: ignore[assignment]
        else:
            out.path_valid = False
    return out


# ------------------------------------------------------------------------------------------------ one turn
@dataclass(frozen=True)
class Shaping:
    """The reward's numbers (see :class:`ResourceGatheringReward`)."""

    progress_reward_scale: float = SHAPING_DEFAULTS["progress_reward_scale"]
    terminal_bonus: float = SHAPING_DEFAULTS["terminal_bonus"]
    move_cost_scale: float = SHAPING_DEFAULTS["move_cost_scale"]
    comm_cost_scale: float = SHAPING_DEFAULTS["comm_cost_scale"]
    move_to_zone_bonus_scale: float = SHAPING_DEFAULTS["move_to_zone_bonus_scale"]
    useful_comm_bonus_scale: float = SHAPING_DEFAULTS["useful_comm_bonus_scale"]
    first_enter_zone_bonus_scale: float = SHAPING_DEFAULTS["first_enter_zone_bonus_scale"]
    wasted_extraction_penalty: float = SHAPING_DEFAULTS["wasted_extraction_penalty"]


def progress_score(task: ResourceTask, collected: Mapping[str, int]) -> float:
    """Mean over the three resources of min(1, collected / goal)."""
    return sum(min(1.0, collected[r] / g) for r, g in zip(RESOURCES, task.goal)) / len(RESOURCES)


def step(
    task: ResourceTask, state: WorldState, completions: Sequence[Any], shaping: Shaping = Shaping()
) -> tuple[WorldState, dict[str, float]]:
    """Apply one joint action (one completion per agent) to ``state``: the next state and the turn's breakdown (every
    reward term under its component name, ``total``, and counts). Never raises on the completions' content."""
    require(len(completions) == 2, f"ResourceGathering has two workers; got {len(completions)} agents' completions.")
    actions = [parse_action(c, task, state, i) for i, c in enumerate(completions)]
    nxt = state.copy()
    zones = [work_zone(task, state, i) for i in range(2)]
    before = [_distance(state.positions[i], zones[i]) for i in range(2)]
    moves = 0
    for i, act in enumerate(actions):
        nxt.origins[i].update(act.path)
        nxt.positions[i] = act.path[-1]
        moves += len(act.path) - 1
    closed = entries = 0
    for i in range(2):
        after = _distance(nxt.positions[i], zones[i])
        if before[i] is not None and after is not None and after < before[i]:
            closed += before[i] - after
        inside_now = nxt.positions[i] in zones[i]
        if not state.entered[i] and state.positions[i] not in zones[i] and inside_now:
            entries += 1
        nxt.entered[i] = state.entered[i] or inside_now
    gained = dict.fromkeys(RESOURCES, 0)
    valid = wasted = 0
    for i, act in enumerate(actions):
        for cell in act.cmds:
            pile = nxt.piles.get(cell) if cell is not None else None
            if pile is None or _manhattan(nxt.positions[i], cell) > task.extraction_range:
                wasted += 1
                continue
            take = [n if RESOURCES[k] in TOOLS[i] else 0 for k, n in enumerate(pile)]
            if not any(take):
                wasted += 1
                continue
            valid += 1
            for k, n in enumerate(take):
                gained[RESOURCES[k]] += n
            rest = tuple(n - t for n, t in zip(pile, take))
            if any(rest):
                nxt.piles[cell] = rest
            else:
                del nxt.piles[cell]
    for name in RESOURCES:
        nxt.collected[name] += gained[name]
    for i, act in enumerate(actions):
        if act.facts:
            nxt.inbox[1 - i].append([dict(f) for f in act.facts])
    useful_items, useful = 0, 0.0
    for i, act in enumerate(actions):
        receiver = 1 - i
        wanted = needs(task, state.collected, receiver)
        if not act.facts or not wanted:
            continue
        known = _known(task, state, receiver)
        score = 0.0
        for fact in act.facts:
            cell, kind = (fact["x"], fact["z"]), fact["type"]
            if kind not in wanted or known[kind].get(cell, 0) > 0:
                continue
            remaining = task.goal[RESOURCES.index(kind)] - state.collected[kind]
            score += min(1.0, fact["count"] / max(1, remaining))
            useful_items += 1
        useful += shaping.useful_comm_bonus_scale * min(1.0, score)
    p_before, p_after = progress_score(task, state.collected), progress_score(task, nxt.collected)
    nxt.completed = all(nxt.collected[r] >= g for r, g in zip(RESOURCES, task.goal))
    nxt.turn = state.turn + 1
    facts = sum(len(a.facts) for a in actions)
    terms = {
        "progress": shaping.progress_reward_scale * max(0.0, p_after - p_before),
        "terminal": shaping.terminal_bonus if nxt.completed and not state.completed else 0.0,
        "move_to_zone": shaping.move_to_zone_bonus_scale * float(closed),
        "useful_comm": float(useful),
        "first_enter_zone": shaping.first_enter_zone_bonus_scale * float(entries),
        "move_cost": 0.0 - shaping.move_cost_scale * float(moves),
        "comm_cost": 0.0 - shaping.comm_cost_scale * float(facts),
        "wasted_extraction": 0.0 - shaping.wasted_extraction_penalty * float(wasted),
    }
    total = 0.0
    for name in COMPONENTS:
        total += terms[name]
    out = dict(terms)
    out.update(
        total=total,
        progress_score=p_after,
        completed=float(nxt.completed),
        valid_extractions=float(valid),
        wasted_extractions=float(wasted),
        move_steps=float(moves),
        zone_steps=float(closed),
        first_entries=float(entries),
        comm_facts=float(facts),
        useful_comm_facts=float(useful_items),
        invalid_paths=float(sum(not a.path_valid for a in actions)),
        json_answers=float(sum(a.is_json for a in actions)),
        **{f"collected_{r}": float(nxt.collected[r]) for r in RESOURCES},
        **{f"delta_{r}": float(gained[r]) for r in RESOURCES},
    )
    return nxt, out


def replay(
    task: ResourceTask, history: Sequence[Sequence[Any]], shaping: Shaping = Shaping()
) -> tuple[WorldState, list[dict[str, float]]]:
    """The state after the turns of ``history`` (``history[i]``: agent i's answers, one per turn) and each turn's
    breakdown."""
    require(len(history) == 2, f"ResourceGathering has two workers; got {len(history)} agents' histories.")
    turns = len(history[0])
    require(len(history[1]) == turns, f"the two workers' histories differ in length ({turns} and {len(history[1])}).")
    state, rows = initial_state(task), []
    for t in range(turns):
        state, row = step(task, state, [history[0][t], history[1][t]], shaping)
        rows.append(row)
    return state, rows


# ------------------------------------------------------------------------------------------------ reward
def _per_joint(agent_completions: Sequence[Sequence[Any]], batch_items, response_history_per_agent, name: str):
    """(item, earlier answers per agent, this turn's answers) per joint action."""
    if not batch_items:
        raise ValueError(f"{name} needs batch_items (the ResourceGathering items with their maps).")
    require(len(agent_completions) == 2, f"ResourceGathering has two workers; got {len(agent_completions)} agents.")
    count = len(agent_completions[0])
    items = list(batch_items) * count if len(batch_items) == 1 else list(batch_items)
    histories = list(response_history_per_agent) if response_history_per_agent is not None else [[[], []]] * count
    require(
        len(items) == count and len(histories) == count,
        f"{name}: {count} joint actions, {len(items)} batch_items and {len(histories)} histories.",
    )
    return [(items[j], histories[j], [agent_completions[0][j], agent_completions[1][j]]) for j in range(count)]


class ResourceGatheringReward:
    """The team reward of one turn (module docstring), with the repository's shaping numbers as fields; usable in
    YAML as ``reward_func: {class_path: ...ResourceGatheringReward, init_args: {...}}``.

    ``components: true`` returns each joint action's terms as named components (:data:`COMPONENTS`; their sum is the
    reward) for ``reward_aggregation: normalize_components``. ``reward_range`` bounds one turn for the default rules
    (``max_path_len`` 4, ``extraction_limit`` 2, ``comm_limit`` 1): with the default numbers [−0.4, 16.3].
    """

    def __init__(
        self,
        progress_reward_scale: float = SHAPING_DEFAULTS["progress_reward_scale"],
        terminal_bonus: float = SHAPING_DEFAULTS["terminal_bonus"],
        move_cost_scale: float = SHAPING_DEFAULTS["move_cost_scale"],
        comm_cost_scale: float = SHAPING_DEFAULTS["comm_cost_scale"],
        move_to_zone_bonus_scale: float = SHAPING_DEFAULTS["move_to_zone_bonus_scale"],
        useful_comm_bonus_scale: float = SHAPING_DEFAULTS["useful_comm_bonus_scale"],
        first_enter_zone_bonus_scale: float = SHAPING_DEFAULTS["first_enter_zone_bonus_scale"],
        wasted_extraction_penalty: float = SHAPING_DEFAULTS["wasted_extraction_penalty"],
        components: bool = False,
    ):
        self.shaping = Shaping(
            float(progress_reward_scale),
            float(terminal_bonus),
            float(move_cost_scale),
            float(comm_cost_scale),
            float(move_to_zone_bonus_scale),
            float(useful_comm_bonus_scale),
            float(first_enter_zone_bonus_scale),
            float(wasted_extraction_penalty),
        )
        for name, value in vars(self.shaping).items():
            require(value == value and abs(value) != float("inf"), f"{name} must be a finite number; got {value!r}.")
        self.components = bool(components)
        self.reward_range = self.bounds(self.shaping)
        self.__name__ = "resourcegathering_reward_components" if self.components else "resourcegathering_reward"

    @staticmethod
    def bounds(
        s: Shaping, max_path_len: int = 4, extraction_limit: int = 2, comm_limit: int = 1
    ) -> tuple[float, float]:
        """(lowest, highest) reward of one turn: each worker closes at most 2 cells of distance per step."""
        pos, neg = (lambda v: max(0.0, v)), (lambda v: min(0.0, v))

        def total(bonus, cost):  # the bonuses' extreme parts, minus the costs' opposite ones, at their most
            return (
                bonus(s.progress_reward_scale)
                + bonus(s.terminal_bonus)
                + bonus(s.move_to_zone_bonus_scale) * 2 * 2 * max_path_len
                + bonus(s.useful_comm_bonus_scale) * 2
                + bonus(s.first_enter_zone_bonus_scale) * 2
                - cost(s.move_cost_scale) * 2 * max_path_len
                - cost(s.comm_cost_scale) * 2 * comm_limit
                - cost(s.wasted_extraction_penalty) * 2 * extraction_limit
            )

        return (total(neg, pos), total(pos, neg))

    def breakdowns(
        self, agent_completions: Sequence[Sequence[Any]], batch_items=None, response_history_per_agent=None
    ) -> list[dict[str, float]]:
        """Each joint action's breakdown (:func:`step` after replaying its earlier turns)."""
        out = []
        for item, history, joint in _per_joint(
            agent_completions, batch_items, response_history_per_agent, self.__name__
        ):
            task = ResourceTask.from_item(item)
            state, _ = replay(task, history, self.shaping)
            out.append(step(task, state, joint, self.shaping)[1])
        return out

    def __call__(
        self,
        *agent_completions: Sequence[Any],
        batch_items: Sequence[Mapping[str, Any]] | None = None,
        response_history_per_agent: Sequence[Sequence[Sequence[Any]]] | None = None,
    ) -> list[float] | list[dict[str, float]]:
        rows = self.breakdowns(agent_completions, batch_items, response_history_per_agent)
        if self.components:
            return [{name: row[name] for name in COMPONENTS} for row in rows]
        return [row["total"] for row in rows]


_DEFAULT = ResourceGatheringReward()
_DEFAULT_COMPONENTS = ResourceGatheringReward(components=True)


def resourcegathering_reward(
    *agent_completions: Sequence[Any],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
    response_history_per_agent: Sequence[Sequence[Sequence[Any]]] | None = None,
) -> list[float]:
    """The team reward of one turn with the repository's final shaping (progress 8, terminal 7, ...)."""
    return _DEFAULT(*agent_completions, batch_items=batch_items, response_history_per_agent=response_history_per_agent)


def resourcegathering_reward_components(
    *agent_completions: Sequence[Any],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
    response_history_per_agent: Sequence[Sequence[Sequence[Any]]] | None = None,
) -> list[dict[str, float]]:
    """:func:`resourcegathering_reward` with each joint action's terms as named components (their sum is the
    reward), for ``reward_aggregation: normalize_components``."""
    return _DEFAULT_COMPONENTS(
        *agent_completions, batch_items=batch_items, response_history_per_agent=response_history_per_agent
    )


resourcegathering_reward.reward_range = _DEFAULT.reward_range
resourcegathering_reward_components.reward_range = _DEFAULT.reward_range


# ------------------------------------------------------------------------------------------------ prompts
def observe(task: ResourceTask, state: WorldState, agent: int) -> dict[str, Any]:
    """What agent ``agent`` knows before a turn: its position, the piles it sees (by z then x), those within its
    extraction range, the other worker's position when visible, the messages received, its extraction zone."""
    seen = visible_cells(task, state.origins[agent])
    here = state.positions[agent]
    piles = [
        {"coord": [x, z], "wood": p[0], "stone": p[1], "iron": p[2]}
        for (x, z), p in sorted(state.piles.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        if (x, z) in seen and any(p)
    ]
    other = state.positions[1 - agent]
    return {
        "position": list(here),
        "visible_resources": piles,
        "reachable_resources": [p for p in piles if _manhattan(here, tuple(p["coord"])) <= task.extraction_range],
        "teammate_position": list(other) if other in seen else None,
        "received_messages": [[dict(f) for f in m] for m in state.inbox[agent]],
        "extraction_zone": [list(c) for c in extraction_zone(task, here)],
    }


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def user_prompt(task: ResourceTask, state: WorldState, agent: int) -> str:
    """The prompt of agent ``agent`` before a turn (without the system text)."""
    obs = observe(task, state, agent)
    here = _compact(obs["position"])
    goal = dict(zip(RESOURCES, task.goal))
    have = state.collected
    left = {r: max(0, goal[r] - have[r]) for r in RESOURCES}
    limit = "all the facts you list" if task.comm_limit is None else f"at most {task.comm_limit} fact(s)"
    tool = "wood only" if agent == 0 else "stone and iron only"
    return "\n".join(
        [
            "Answer format:",
            '- Exactly one JSON object with the keys "comm", "probe", "cmds" and "path", nothing else.',
            f'- To stay where you are: {{"comm":{{}},"probe":[],"cmds":[],"path":[{here}]}}',
            "",
            "Your role:",
            f"- You are worker {AGENT_NAMES[agent]} of two. Worker A's tool extracts wood only; worker B's extracts "
            f"stone and iron only. Yours: {tool}.",
            f"- The map is {task.width} x {task.height} cells; x grows to the right from 0, z grows downwards from 0.",
            f"- Turn {state.turn} of {task.max_turns}.",
            f"- Team goal: wood {goal['wood']}, stone {goal['stone']}, iron {goal['iron']}.",
            f"- Collected by the team: wood {have['wood']}, stone {have['stone']}, iron {have['iron']}.",
            f"- Still needed: wood {left['wood']}, stone {left['stone']}, iron {left['iron']}.",
            "",
            "Rules:",
            f"- You see every cell within {task.view} steps (in x and in z) of any cell you have stood on.",
            f'- "path": the cells you walk, [[x,z], ...]; the first is your position, each next one a neighbour '
            f"(diagonals allowed) inside the map; at most {task.max_path_len} moves are read. A broken path means you "
            "do not move.",
            f'- "cmds": after moving, up to {task.extraction_limit} cells [x,z] to extract; a cell counts only within '
            f"Manhattan distance {task.extraction_range} of where you end, and gives you only what your tool takes. "
            "A useless extraction is penalised.",
            f'- "comm": {{"resource_facts": [{{"x": 1, "z": 2, "type": "wood"}}]}} tells your teammate '
            f"about piles you see now ({limit} per turn); {{}} sends nothing. Tell it about what its tool takes.",
            '- "probe": always [].',
            "",
            "What you know:",
            f"- Your position: {here}",
            f"- Resources you see: {_compact(obs['visible_resources'])}",
            f"- Resources you can extract without moving: {_compact(obs['reachable_resources'])}",
            f"- Your teammate's position (null: not in sight): {_compact(obs['teammate_position'])}",
            f"- Messages from your teammate: {_compact(obs['received_messages'])}",
            f"- Cells you can extract from without moving: {_compact(obs['extraction_zone'])}",
        ]
    )


def resourcegathering_prompt(item: Mapping[str, Any], agent_index: int = 0) -> str:
    """The first-turn prompt of worker ``agent_index`` (system text, answer format, role, rules, observation)."""
    task = ResourceTask.from_item(item)
    return f"{SYSTEM_PROMPT}\n\n{user_prompt(task, initial_state(task), agent_index)}"


def resourcegathering_agent0_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of worker A (agent 0, wood); a later turn's external prompt is used as it is."""
    return external_prompts if external_prompts is not None else resourcegathering_prompt(item, 0)


def resourcegathering_agent1_prompt(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """Formatter of worker B (agent 1, stone and iron)."""
    return external_prompts if external_prompts is not None else resourcegathering_prompt(item, 1)


# ------------------------------------------------------------------------------------------------ feedback
class ResourceGatheringFeedback:
    """ResourceGathering's external transition: each worker's next prompt, from the state after this turn (the whole
    trajectory, ``response_history_per_agent``, replayed from the task).

    Args:
        mode: ``empty_feedback`` (the repository's only mode): the full prompt of the new state, no further text.
        original_prompt: start the prompt with the system text, as the first prompt (the repository's flag of this
            name does this).
        previous_response: append the worker's last answer.
        tasks: the items to look prompts up in (default: every item the loaders built in this process).
    """

    def __init__(
        self,
        mode: ResourceGatheringMode = "empty_feedback",
        original_prompt: bool = True,
        previous_response: bool = False,
        tasks: Sequence[Mapping[str, Any]] | None = None,
    ):
        check_choice("mode", mode, ResourceGatheringMode)
        self.mode, self.original_prompt, self.previous_response = mode, bool(original_prompt), bool(previous_response)
        self.tasks = {str(t["prompt"]): t for t in tasks} if tasks is not None else None

    def __call__(
        self,
        prompt: str,
        agent_completions: Sequence[Any],
        num_agents: int | None = None,
        prompt_history_per_agent: Sequence[Sequence[str]] | None = None,
        response_history_per_agent: Sequence[Sequence[Any]] | None = None,
        **_: Any,
    ) -> list[str]:
        n = len(agent_completions) if num_agents is None else int(num_agents)
        require(
            n == 2 and len(agent_completions) == 2,
            f"ResourceGathering has two workers; got {n} agents and {len(agent_completions)} completions.",
        )
        task = ResourceTask.from_item(TASKS.find(str(prompt), self.tasks, "ResourceGathering"))
        history = response_history_per_agent
        if not history or not history[0]:  # no history given: this turn is the first
            history = [[c] for c in agent_completions]
        state, _ = replay(task, history)
        prompts = []
        for i in range(2):
            text = user_prompt(task, state, i)
            if self.original_prompt:
                text = f"{SYSTEM_PROMPT}\n\n{text}"
            last = agent_completions[i]
            if self.previous_response and isinstance(last, str) and last.strip():
                text += f"\n\nYour previous answer:\n{last.strip()}"
            prompts.append(text)
        return prompts


# ------------------------------------------------------------------------------------------------ evaluation
EVAL_METRICS = (
    "total_reward",
    *COMPONENTS,
    "progress_score",
    "completed",
    "collected_wood",
    "collected_stone",
    "collected_iron",
    "valid_extractions",
    "wasted_extractions",
    "comm_facts",
    "useful_comm_facts",
    "invalid_paths",
    "json_answers",
)


def resourcegathering_eval_logger(
    agent_completions_turns: Sequence[Sequence[Sequence[Any]]], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, float]]:
    """Per-sample ``turn_k/<name>`` for the names in :data:`EVAL_METRICS` (``agent_completions_turns[i][s]`` is agent
    i's list of completions over the turns of sample s), the turns replayed in order with the default shaping."""
    if not batch_items:
        raise ValueError("resourcegathering_eval_logger needs batch_items (the ResourceGathering items).")
    rows = []
    for s, per_agent in enumerate(zip(*agent_completions_turns)):
        task = ResourceTask.from_item(batch_items[s] if s < len(batch_items) else batch_items[-1])
        _, turns = replay(task, [list(per_agent[0]), list(per_agent[1])])
        metrics: dict[str, float] = {}
        for t, b in enumerate(turns):
            b["total_reward"] = b["total"]
            metrics.update({f"turn_{t + 1}/{name}": float(b[name]) for name in EVAL_METRICS})
        rows.append(metrics)
    return rows


def resourcegathering_eval_aggregator(metrics: Sequence[Mapping[str, float]], num_turns: int = 1) -> dict[str, float]:
    """Means over samples: ``turn_k/avg_<name>`` (e.g. ``turn_1/avg_total_reward``, ``turn_4/avg_completed``)."""
    return mean_by_turn(metrics, num_turns, EVAL_METRICS)
