"""What StrBuild and HouseBuild share: reading command text, block names, the command budget, choices, data files
and the table that maps a prompt key back to its task item.

Nothing here raises on model output: :func:`command_lines` and :func:`parse_coordinate` accept any object and
return empty / ``None`` for what they cannot read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TypeVar, get_args

AIR_BLOCKS = frozenset({"air", "cave_air", "void_air"})
SYSTEM_PROMPT = (
    "You are a Minecraft building agent. Answer with Minecraft commands only: no markdown, no code "
    "fences and no other text. Any line that is not a command is invalid."
)
Position = tuple[int, int, int]
T = TypeVar("T")


# ------------------------------------------------------------------------------------------------ blocks
def normalize_block(name: Any) -> str:
    """``"minecraft:stone "`` → ``"stone"`` (surrounding spaces and the namespace removed; case kept)."""
    text = str(name or "").strip()
    return text[len("minecraft:") :] if text.startswith("minecraft:") else text


def is_air(name: Any) -> bool:
    return normalize_block(name) in AIR_BLOCKS


def unique_blocks(names: Iterable[Any]) -> list[str]:
    """Non-empty names, stripped, first occurrence kept, in order."""
    seen: dict[str, None] = {}
    for name in names:
        text = str(name).strip()
        if text:
            seen.setdefault(text, None)
    return list(seen)


# ------------------------------------------------------------------------------------------------ command text
_FENCE = "```"
_LIST_MARKER = re.compile(r"^\s*(?:[-*]+|\d+[.)])\s*")


def _strip_fences(text: str) -> str:
    """The inside of the first fenced block (its language tag dropped) when the text has one, else the text."""
    if _FENCE not in text:
        return text
    parts = text.split(_FENCE)
    if len(parts) < 3:  # an opening fence without its closing one: read the text as it is
        return text
    inner = parts[1].strip()
    return re.sub(r"^\s*[A-Za-z0-9_-]+\s*\n", "", inner).strip()


def command_lines(text: Any) -> list[str]:
    """The non-empty lines of a completion, list markers (``-``, ``*``, ``1.``, ``2)``) removed; a completion with a
    fenced block is read from inside its first block. Anything that is not a string reads as no lines."""
    if not isinstance(text, str):
        return []
    lines = []
    for line in _strip_fences(text.strip()).splitlines():
        line = _LIST_MARKER.sub("", line.strip()).strip()
        if line:
            lines.append(line)
    return lines


def command_words(line: str) -> list[str]:
    """A command line's words, the leading ``/`` removed (``"/setblock 1 2 3 stone"`` → 4 words + the name)."""
    line = line.strip()
    if line.startswith("/"):
        line = line[1:].lstrip()
    return line.split()


def parse_coordinate(token: Any) -> int | None:
    """An absolute integer coordinate, or ``None`` (relative ``~``/``^`` coordinates, non-integers, numbers longer
    than Python's integer-string limit)."""
    if not isinstance(token, str):
        return None
    token = token.strip()
    if not token or token.startswith(("~", "^")):
        return None
    try:
        return int(token)
    except ValueError:  # not an integer, or over sys.get_int_max_str_digits() digits
        return None


def command_budget(total: int, num_agents: int) -> list[int]:
    """Commands each agent may have accepted: ``total // n`` each (at least 1), agent 0 also gets the remainder."""
    n = max(1, int(num_agents))
    limits = [max(1, int(total) // n)] * n
    limits[0] += int(total) % n
    return limits


def top_down(position: Position) -> tuple[int, int, int]:
    """Sort key listing positions from the highest layer down, then by x, then by z (the feedback order)."""
    x, y, z = position
    return (-y, x, z)


def format_positions(positions: Sequence[Position], empty: str = "- (none)") -> str:
    return "\n".join(f"- ({x}, {y}, {z})" for x, y, z in positions) if positions else empty


def box_of(frm: Sequence[int], to: Sequence[int]) -> tuple[Position, Position]:
    """The inclusive bounding box spanned by two corners, as (minimum corner, maximum corner)."""
    lo = (min(frm[0], to[0]), min(frm[1], to[1]), min(frm[2], to[2]))
    hi = (max(frm[0], to[0]), max(frm[1], to[1]), max(frm[2], to[2]))
    return lo, hi


def inside(position: Position, lo: Position, hi: Position) -> bool:
    return all(a <= p <= b for p, a, b in zip(position, lo, hi))


# ------------------------------------------------------------------------------------------------ choices
def check_choice(field: str, value: Any, choices: Any) -> None:
    """``value`` must be one of the ``Literal`` ``choices``; the error names the field, the value and the choices."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def slice_split(items: list[T], split: str, named: Mapping[str, slice], field: str = "split") -> list[T]:
    """``items`` selected by a named split (``train``, ``eval``, ``all``) or a Python slice such as ``"[:8]"``."""
    if split in named:
        return items[named[split]]
    m = re.fullmatch(r"\s*\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\]\s*", split)
    if not m:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, named))} or a slice like '[:8]'; got {split!r}.")
    start, stop = (int(g) if g else None for g in m.groups())
    return items[start:stop]


def mean_by_turn(metrics: Sequence[Mapping[str, float]], num_turns: int, names: Sequence[str]) -> dict[str, float]:
    """``turn_k/avg_<name>``: the mean over the samples that reached turn k (an eval aggregator's output)."""
    out: dict[str, float] = {}
    for t in range(1, num_turns + 1):
        rows = [m for m in metrics if f"turn_{t}/{names[0]}" in m]
        for name in names if rows else ():
            out[f"turn_{t}/avg_{name}"] = sum(float(m[f"turn_{t}/{name}"]) for m in rows) / len(rows)
    return out


# ------------------------------------------------------------------------------------------------ data files
def data_root() -> Path:
    """``$COMLRL_MINECRAFT_DATA`` if set (a folder with ``str_build/`` and ``house_build/``, such as a clone of
    OpenMLRL/LLM_Collab_Minecraft), else ``<repo>/../shared/data/minecraft``."""
    env = os.environ.get("COMLRL_MINECRAFT_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[4] / "shared" / "data" / "minecraft"


def data_file(environment: str, name: str) -> Path:
    """``<root>/<environment>/<name>``, or ``<root>/<environment>/dataset/<name>`` (the repository's layout)."""
    root = data_root()
    candidates = [root / environment / name, root / environment / "dataset" / name]
    for path in candidates:
        if path.exists():
            return path
    raise FileNotFoundError(
        f"Minecraft data file {name!r} not found (looked for {', '.join(str(p) for p in candidates)}). The tasks "
        "come from github.com/OpenMLRL/LLM_Collab_Minecraft (MIT): clone it and set COMLRL_MINECRAFT_DATA=<clone>, "
        "or pass the file's path to the loader."
    )


# ------------------------------------------------------------------------------------------------ prompt keys
class TaskTable:
    """Task items by prompt key. The trainer hands an external transition only the item's ``prompt`` (a key such as
    ``str_build:str_build_0001:I``); the loaders of this package record every item they build here, so a transition
    finds the task of a prompt without being told where the data came from. A later item with the same key replaces
    the earlier one."""

    def __init__(self) -> None:
        self._items: dict[str, Mapping[str, Any]] = {}

    def add(self, items: Iterable[Mapping[str, Any]]) -> None:
        for item in items:
            self._items[str(item["prompt"])] = item

    def find(self, prompt: str, given: Mapping[str, Mapping[str, Any]] | None, kind: str) -> Mapping[str, Any]:
        item = (given or {}).get(prompt) or self._items.get(prompt)
        if item is None:
            raise KeyError(
                f"no {kind} task has the prompt key {prompt[:120]!r}. The {kind} feedback looks a prompt up among the "
                f"items built by comlrl_lightning.envs.minecraft's {kind} loaders in this process, or among the items "
                "given to the transition as tasks=[...]; load the dataset with those loaders or pass the items."
            )
        return item


TASKS = TaskTable()
