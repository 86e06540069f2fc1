"""Loading environment data: a local JSON / JSON-lines file (optionally gzipped) or a Hugging Face dataset id.

One loader for every environment, so they all fail the same clear way offline: a missing file names the path, a
hub id that cannot be loaded names the id and split and says how to pass a local copy instead.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

_SPLIT_SLICE = re.compile(r"^\s*(\w+)?\s*\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\]\s*$")
_LOCAL_SUFFIXES = (".json", ".jsonl", ".gz")


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a JSON array, a JSON object holding one list (``{"test": [...]}``) or of ``{id: row}``, or JSON
    lines — whatever the extension says, ``.gz`` included."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        text = fh.read()
    lines = lambda: [json.loads(line) for line in text.splitlines() if line.strip()]  # noqa: E731
    if path.name.removesuffix(".gz").endswith(".jsonl"):
        return lines()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # JSON lines saved as .json (BFCL's files)
        return lines()
    if isinstance(data, Mapping):
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else list(data.values())
    return list(data) if isinstance(data, list) else [data]


def looks_local(path_or_id: str) -> bool:
    return (
        path_or_id.startswith((".", "/", "~"))
        or path_or_id.endswith(_LOCAL_SUFFIXES)
        or Path(path_or_id).expanduser().exists()
    )


def split_parts(split: str | None) -> tuple[str | None, slice | None]:
    """``"train[16:]"`` → ("train", slice(16, None)); ``"test"`` → ("test", None)."""
    if split is None:
        return None, None
    m = _SPLIT_SLICE.match(split)
    if not m:
        return split, None
    to_int = lambda s: int(s) if s not in ("", None) else None  # noqa: E731
    return m.group(1), slice(to_int(m.group(2)), to_int(m.group(3)))


def load_rows(
    path_or_id: str,
    split: str | None = None,
    *,
    config: str | None = None,
    local_split: Callable[[list[dict[str, Any]], str], list[dict[str, Any]]] | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Rows from a local file (``split`` selects through ``local_split`` and/or a ``[a:b]`` slice) or a hub id
    (``datasets.load_dataset(path_or_id, config, split=split)``; an unknown ``config`` falls back to none)."""
    if looks_local(path_or_id):
        path = Path(path_or_id).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"dataset file {path_or_id!r} does not exist.")
        rows = read_records(path)
        name, sl = split_parts(split)
        if name and local_split is not None:
            rows = local_split(rows, name)
        rows = rows[sl] if sl is not None else rows
        return rows if limit is None else rows[:limit]
    try:
        import datasets

        try:
            data = datasets.load_dataset(*((path_or_id, config) if config else (path_or_id,)), split=split or "test")
        except ValueError:
            if not config:
                raise
            data = datasets.load_dataset(path_or_id, split=split or "test")
    except Exception as err:  # offline / unknown id / missing library: the versions raise different types
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        hint = " The machine is offline (HF_HUB_OFFLINE=1)." if offline else ""
        raise FileNotFoundError(
            f"dataset {path_or_id!r} (split {split!r}) could not be loaded: {type(err).__name__}: {err}.{hint} "
            "Pass a local copy instead: a local .jsonl or .json file (optionally .gz), e.g. "
            "path_or_id='/path/to/file.jsonl' or --data.init_args.dataset <that path>."
        ) from err
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    return [dict(row) for row in data]
