"""Run files written atomically: JSON records (preference pairs, replay shards, reward distributions) that a reader
or a crash never sees half-written, and the clean-up of what a killed run's write left behind."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from comlrl_lightning.core.pairs import PreferencePair

log = logging.getLogger(__name__)


def write_json_atomic(payload: Any, path: str | os.PathLike) -> Path:
    """Write ``payload`` as UTF-8 JSON (``ensure_ascii=False``) to ``path`` atomically: a temporary sibling is
    written, flushed and moved into place with ``os.replace``, so a reader (or a crash) never sees a half-written
    file. Parent directories are created. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, ensure_ascii=False, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return path


def remove_orphaned_writes(directory: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Delete the temporary siblings ``write_json_atomic`` leaves when its process is killed mid-write
    (``.<name>.<random>.tmp``; only those of ``name`` when given). Call it when a run starts using ``directory``,
    before anything writes there. Returns what was removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    pattern = f".{name}.*.tmp" if name else ".*.tmp"
    removed = []
    for path in directory.glob(pattern):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def save_pairs(
    pairs: Sequence[PreferencePair], path: str | os.PathLike, metadata: Mapping[str, Any] | None = None
) -> Path:
    """Write ``{**metadata, "num_pairs": n, "pairs": [records]}`` with ``write_json_atomic``.

    ``metadata`` adds leading keys, e.g. ``{"iteration": 3}`` for the replay shards (docs/algorithms.md#iterative-rounds).
    """
    payload: dict[str, Any] = dict(metadata or {})
    payload["num_pairs"] = len(pairs)
    payload["pairs"] = [pair.to_record() for pair in pairs]
    return write_json_atomic(payload, path)


def load_pairs(path: str | os.PathLike) -> list[PreferencePair]:
    """Read a file written by ``save_pairs``; token tensors are empty (re-tokenise from text if needed)."""
    path = Path(path)
    with path.open("r", encoding="utf-8") as handle:
        payload = json.load(handle)
    if not isinstance(payload, Mapping) or not isinstance(payload.get("pairs"), list):
        raise ValueError(f"{path} is not a preference pair file (expected an object with a 'pairs' list).")
    pairs = [PreferencePair.from_record(record) for record in payload["pairs"]]
    expected = payload.get("num_pairs", len(pairs))
    if expected != len(pairs):
        raise ValueError(f"{path}: num_pairs is {expected} but the file holds {len(pairs)} pairs.")
    return pairs


RESUMED_FROM = "resumed_from.txt"  # in a run folder: the checkpoint the run resumed from (analysis.load_run)


def mark_resumed(trainer: Any) -> None:
    """A resumed fit's run folder names the checkpoint it resumed from (``RESUMED_FROM``), so that
    ``analysis.load_run`` joins the run to its start; rank 0 writes it, and only when the run has a logger."""
    if trainer.ckpt_path and trainer.loggers and trainer.is_global_zero:
        folder = run_root(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RESUMED_FROM).write_text(str(Path(trainer.ckpt_path).resolve()) + "\n", encoding="utf-8")


def run_folder(trainer: Any) -> str:
    """The run's own folder: ``<save_dir>/<name>/<version>`` of the first logger — where Lightning's
    ``ModelCheckpoint`` puts ``checkpoints/``, and for CSV and TensorBoard loggers their ``log_dir`` — else
    ``default_root_dir``. A W&B run's is ``<save_dir>/<project>/<run id>`` (Lightning's ``trainer.log_dir`` would be
    the shared ``save_dir`` itself, where every run would write over the others' files)."""
    if not trainer.loggers:
        return str(trainer.default_root_dir)
    logger = trainer.loggers[0]
    version = logger.version
    version = version if isinstance(version, str) else f"version_{version}"
    return os.path.join(str(logger.save_dir or trainer.default_root_dir), str(logger.name or ""), version)


def run_root(trainer: Any) -> Path:
    """The run's folder (:func:`run_folder`): ``completions.jsonl``, ``config.yaml``, ``predictions.jsonl`` and the
    iterative variants' files go there, beside ``checkpoints/`` and the logger's own files; the same on every rank.

    Reading it is a collective in a data-parallel run (rank 0's folder, broadcast), so it cannot be read where only
    rank 0 runs (a file write): the module reads it once in ``setup``, on every rank, and it is remembered on the
    trainer for the fit."""
    root = getattr(trainer, "_comlrl_run_root", None)
    if root is None:
        root = str(trainer.strategy.broadcast(run_folder(trainer)))
        trainer._comlrl_run_root = root
    return Path(root)


class RunDirectories:
    """Directories a run writes beside its logs (replay shards, reward distributions, policy checkpoints): the
    explicit path a field gives, else ``<trainer.log_dir or default_root_dir>/<name>``. Resolved once and
    remembered (``state_dict``), so a resumed run — which logs to a new version directory — keeps writing where it
    started; what an interrupted write left there is removed when a process first uses the directory."""

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}
        self._checked: set[str] = set()

    def get(self, trainer: Any, name: str, explicit: str | os.PathLike | None = None) -> Path:
        """The directory ``name`` (absolute, created)."""
        if name not in self.paths:
            base = explicit or run_root(trainer) / name
            self.paths[name] = str(Path(base).expanduser().resolve())
        path = Path(self.paths[name])
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(f"{name}: {path} is a file, not a directory.")
        path.mkdir(parents=True, exist_ok=True)
        if name not in self._checked:  # a run killed mid-write (also the one being resumed) may have left files
            self._checked.add(name)
            for orphan in remove_orphaned_writes(path):
                log.info("removed %s, left by an interrupted write", orphan)
        return path

    def state_dict(self) -> dict[str, str]:
        return dict(self.paths)

    def load_state_dict(self, state: Mapping[str, str]) -> None:
        self.paths.update(state)
