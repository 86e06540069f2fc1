"""CoMLRL 1.4.3's training-state checkpoints, mapped onto Lightning checkpoints (docs/compat.md#checkpoints).

``trainer.train(checkpoint_dir=D, checkpoint_interval=k, checkpoint_total_limit=n)`` writes ``D/checkpoint-<s>/``
after every k-th completed epoch (and after the run's last): ``s`` is the run's count of completed (Lightning)
epochs, CoMLRL's ``sequence``. An epoch is a pass over the training set; a round of ``MADPOIter``; MARLHF's
reward-model stage and each of its RL epochs (a ``MARLHFIter`` round is ``1 + num_train_epochs`` of them). A folder
holds

* ``training_state.pt``: a Lightning checkpoint — weights, optimizer and schedule, ``global_step``/``env_step``, the
  RNG states, the data position, buffered samples, the user's stateful objects (``algorithms/user_state.py``) — with
  CoMLRL's metadata under ``"comlrl_checkpoint"``: ``version``, ``trainer_class``, ``sequence``, ``run_id``, ``wandb``
  and the config the run was started with;
* ``checkpoint_owner.json``: ``{"run_id", "sequence"}``, so that a run never overwrites or prunes another's.

A folder is written under a hidden staging name and renamed when complete; only the run's own folders count
towards ``checkpoint_total_limit`` (the newest is always kept). ``train(resume_from_checkpoint=...)`` continues the
run exactly (Lightning's ``ckpt_path`` resume), with the same run id, sequence and W&B run. Any checkpoint a compat
trainer writes (also ``save_steps``'s, mid-epoch) carries the metadata; the files are ordinary Lightning checkpoints,
so ``Trainer.fit(ckpt_path=...)`` and the CLI's ``--ckpt_path`` take them too.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, Checkpoint

from comlrl_lightning.callbacks.checkpoints import FileCheckpointIO, wandb_identity

CHECKPOINT_VERSION = 1
STATE_FILENAME = "training_state.pt"
OWNER_FILENAME = "checkpoint_owner.json"
METADATA_KEY = "comlrl_checkpoint"
FOLDER = re.compile(r"checkpoint-(\d+)")
# Config fields a resumed run may change (CoMLRL's, plus our run settings of the same kind): epochs, rounds,
# placement, logging, output folders.
PORTABLE_FIELDS = {
    "num_train_epochs",
    "num_iterations",
    "agent_devices",
    "critic_devices",
    "reference_devices",
    "comparator_devices",
    "parallel_training",
    "reward_model_device",
    "logging_steps",
    "verbose",
    "max_steps",
    "save_steps",
}


def state_file(checkpoint: str | os.PathLike) -> Path:
    """The state file of ``checkpoint``: a checkpoint folder (its ``training_state.pt``) or a checkpoint file."""
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        path = path / STATE_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"No training checkpoint at {checkpoint!s}: give a checkpoint-<n>/ folder written by "
            f"train(checkpoint_dir=...) or save_checkpoint(), or its {STATE_FILENAME}."
        )
    return path


def read_checkpoint_metadata(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """CoMLRL's ``read_checkpoint_metadata``: ``{"version", "trainer_class", "sequence", "run_id", "wandb"}`` of a
    checkpoint folder or file, read without building a trainer (the tensors are memory-mapped, not read).
    ``wandb`` is None or the saved run's ``{"id", "project", "entity"}``; pass ``wandb_config={..., "id": ...,
    "resume": "allow"}`` to choose the W&B run yourself (``train(resume_from_checkpoint=...)`` resumes the saved one
    when ``wandb_config`` names none)."""
    metadata = stored_metadata(state_file(checkpoint))
    return {key: metadata[key] for key in ("version", "trainer_class", "sequence", "run_id", "wandb")}


def stored_metadata(path: Path, required: bool = True) -> dict[str, Any] | None:
    """The metadata of the checkpoint file ``path`` (None when it has none and it is not ``required``)."""
    options = {"map_location": "cpu", "weights_only": True}
    if "mmap" in inspect.signature(torch.load).parameters:
        options["mmap"] = True
    metadata = torch.load(path, **options).get(METADATA_KEY)
    if metadata is None and not required:
        return None
    if not isinstance(metadata, dict):
        raise ValueError(
            f"{path} has no CoMLRL checkpoint metadata: it was not written by a "
            "comlrl_lightning.compat trainer (resume it with Trainer.fit(ckpt_path=...) or the CLI's "
            "--ckpt_path)."
        )
    if metadata.get("version") != CHECKPOINT_VERSION:
        raise ValueError(
            f"Unsupported checkpoint version: {metadata.get('version')!r} (this version reads {CHECKPOINT_VERSION})."
        )
    for key, ok in (
        ("trainer_class", isinstance(metadata.get("trainer_class"), str)),
        ("sequence", type(metadata.get("sequence")) is int and metadata["sequence"] >= 0),
        ("run_id", re.fullmatch(r"[0-9a-f]{32}", str(metadata.get("run_id"))) is not None),
    ):
        if not ok:
            raise ValueError(f"Invalid checkpoint {key}: {metadata.get(key)!r} in {path}.")
    metadata.setdefault("wandb", None)
    return metadata


def class_path(obj: Any) -> str:
    klass = obj if isinstance(obj, type) else type(obj)
    return f"{klass.__module__}.{klass.__qualname__}"


def config_values(args: Any) -> dict[str, Any]:
    """The config fields a resumed run must keep (plain values; not the portable ones, not ``*_dir``)."""
    values = {}
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if field.name in PORTABLE_FIELDS or field.name.endswith("_dir"):
            continue
        if value is None or isinstance(value, (str, int, float, bool, list, tuple, dict)):
            values[field.name] = list(value) if isinstance(value, tuple) else value
    return values


def check_resumable(metadata: dict[str, Any], trainer: Any) -> None:
    """The checkpoint was written by this trainer class with the same non-portable config."""
    if metadata["trainer_class"] != class_path(trainer):
        raise ValueError(
            f"Checkpoint trainer class does not match this trainer: the checkpoint was written by "
            f"{metadata['trainer_class']}, this is {class_path(trainer)}."
        )
    if "config" not in metadata:
        return
    saved, now = metadata["config"], config_values(trainer.args)
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k, "<absent>") != now.get(k, "<absent>"))
    if changed:
        details = ", ".join(f"{k} ({saved.get(k, '<absent>')!r} -> {now.get(k, '<absent>')!r})" for k in changed)
        raise ValueError(
            f"Checkpoint configuration does not match: {details}. A resumed run keeps its config; only "
            f"{', '.join(sorted(PORTABLE_FIELDS))} and *_dir fields may change."
        )


def check_interval(checkpoint_interval: Any, checkpoint_total_limit: Any) -> None:
    if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int) or checkpoint_interval < 1:
        raise ValueError(f"checkpoint_interval must be a positive integer (got {checkpoint_interval!r}).")
    if checkpoint_total_limit is not None and (
        isinstance(checkpoint_total_limit, bool)
        or not isinstance(checkpoint_total_limit, int)
        or checkpoint_total_limit < 1
    ):
        raise ValueError(f"checkpoint_total_limit must be a positive integer or None (got {checkpoint_total_limit!r}).")


def _owner(folder: Path) -> dict[str, Any] | None:
    try:
        owner = json.loads((folder / OWNER_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(owner, dict) and isinstance(owner.get("run_id"), str) and type(owner.get("sequence")) is int
    return owner if ok and (folder / STATE_FILENAME).is_file() else None


def check_destination(target: Path, run_id: str) -> None:
    """An existing ``checkpoint-<n>`` may be replaced only by the run that wrote it."""
    if target.is_symlink() or not target.is_dir():
        raise FileExistsError(f"Checkpoint destination is not a checkpoint directory: {target}")
    owner = _owner(target)
    if owner is None:
        raise FileExistsError(
            f"Checkpoint destination {target} has no valid {OWNER_FILENAME}: use an empty checkpoint_dir to continue."
        )
    if owner["run_id"] != run_id:
        raise FileExistsError(f"Refusing to overwrite another run's checkpoint: {target} (run {owner['run_id']}).")


def preflight(checkpoint_dir: str | os.PathLike | None, metadata: dict[str, Any] | None) -> None:
    """Before training: a new run needs a checkpoint_dir without checkpoints; a resumed run may meet later
    checkpoints only of its own run (it overwrites them as it goes)."""
    if checkpoint_dir is None:
        return
    root = Path(checkpoint_dir).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"checkpoint_dir is not a directory: {root}")
    for target in sorted(root.iterdir()) if root.is_dir() else ():
        match = FOLDER.fullmatch(target.name)
        if match is None:
            continue
        if metadata is None:
            raise FileExistsError(
                f"Checkpoint directory already contains another run's checkpoint: {target}. "
                "Resume a checkpoint or use an empty checkpoint_dir."
            )
        if int(match.group(1)) > metadata["sequence"]:
            check_destination(target, metadata["run_id"])


def write_checkpoint(trainer: Any, target: Path, run_id: str, sequence: int) -> Path:
    """Write ``target/`` (the state file and the owner record) from ``trainer`` (a Lightning ``Trainer``):
    staged under a hidden name, then renamed over any previous folder of the same run. Every rank calls it."""
    target = Path(target).expanduser().absolute()
    staging = target.parent / f".{target.name}.staging"
    if trainer.is_global_zero:
        if target.exists() or target.is_symlink():
            check_destination(target, run_id)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    trainer.strategy.barrier("comlrl_checkpoint_staging")
    trainer.save_checkpoint(staging / STATE_FILENAME)
    if trainer.is_global_zero:
        (staging / OWNER_FILENAME).write_text(json.dumps({"run_id": run_id, "sequence": sequence}), encoding="utf-8")
        backup = target.parent / f".{target.name}.old"
        if target.exists():
            shutil.rmtree(backup, ignore_errors=True)
            os.replace(target, backup)
        os.replace(staging, target)
        shutil.rmtree(backup, ignore_errors=True)
    trainer.strategy.barrier("comlrl_checkpoint_written")
    return target


def prune(root: Path, run_id: str, keep: int, latest: Path) -> None:
    """Keep the newest ``keep`` folders of run ``run_id`` under ``root`` (``latest`` always)."""
    mine = [
        (owner["sequence"], path)
        for path in root.iterdir()
        if FOLDER.fullmatch(path.name)
        and not path.is_symlink()
        and path.is_dir()
        and (owner := _owner(path)) is not None
        and owner["run_id"] == run_id
        and path != latest
    ]
    for _, path in sorted(mine, reverse=True)[max(keep - 1, 0) :]:
        shutil.rmtree(path)


class TrainingCheckpoints(Checkpoint):
    """Stamps every checkpoint of a compat run with CoMLRL's metadata and, with a ``directory``, writes
    ``checkpoint-<sequence>/`` at every ``interval``-th epoch end (and the last), keeping ``total_limit`` of them.

    A ``Checkpoint`` callback: Lightning runs it after the module's own epoch-end hook (the state it saves is the
    epoch's final one) and adds no default ``ModelCheckpoint`` beside it.
    """

    def __init__(
        self,
        trainer_class: str,
        config: dict[str, Any],
        directory: str | os.PathLike | None = None,
        interval: int = 1,
        total_limit: int | None = None,
        sequence: int = 0,
        run_id: str | None = None,
    ):
        self.trainer_class, self.config = trainer_class, config
        self.directory = None if directory is None else Path(directory).expanduser().absolute()
        self.interval, self.total_limit = interval, total_limit
        self.sequence, self.run_id = sequence, run_id or uuid.uuid4().hex
        self.written: list[Path] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # as RunCheckpoints: files written straight
            trainer.strategy.checkpoint_io = FileCheckpointIO()

    def metadata(self, trainer) -> dict[str, Any]:
        return {
            "version": CHECKPOINT_VERSION,
            "trainer_class": self.trainer_class,
            "sequence": self.sequence,
            "run_id": self.run_id,
            "wandb": wandb_identity(trainer.loggers),
            "config": self.config,
        }

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[METADATA_KEY] = self.metadata(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.sequence += 1
        epochs, steps = trainer.max_epochs or -1, trainer.max_steps
        last = (0 < epochs <= trainer.current_epoch + 1) or (0 < steps <= trainer.global_step) or trainer.should_stop
        if self.directory is not None and (self.sequence % self.interval == 0 or last):
            self.save(trainer, self.directory / f"checkpoint-{self.sequence}")

    def save(self, trainer, target: Path) -> Path:
        """Write ``target/`` now (``train``'s epoch ends, ``save_checkpoint``), then prune this run's folders."""
        target = write_checkpoint(trainer, target, self.run_id, self.sequence)
        self.written.append(target)
        if trainer.is_global_zero and self.total_limit is not None and target.parent == self.directory:
            prune(self.directory, self.run_id, self.total_limit, target)
        return target


class RestoredOptimizers(Callback):
    """``load_checkpoint()``'s optimizer and schedule states, loaded into the next ``train()``'s optimizer when it
    starts (Lightning creates the optimizer in ``fit``)."""

    def __init__(self, optimizer_states: list[dict], scheduler_states: list[dict], done: Callable[[], None]):
        self.optimizer_states, self.scheduler_states, self.done = optimizer_states, scheduler_states, done

    def on_train_start(self, trainer, pl_module) -> None:
        for optimizer, state in zip(trainer.optimizers, self.optimizer_states):
            optimizer.load_state_dict(state)
        for config, state in zip(trainer.lr_scheduler_configs, self.scheduler_states):
            config.scheduler.load_state_dict(state)
        self.optimizer_states, self.scheduler_states = [], []  # once
        self.done()
