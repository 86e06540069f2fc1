"""Checkpoints during a run, so that a crash loses at most ``every_n_updates`` updates.

``RunCheckpoints`` is Lightning's ``ModelCheckpoint`` saving every N updates (``global_step``), keeping the newest
checkpoint and ``last.ckpt`` (a link to it), and one more when training ends on a step that is not a multiple of N.
Nothing is written when a run fails: ``last.ckpt`` keeps pointing at the last good checkpoint (a reward that raises
or a non-finite loss stops the run before it changes anything). The CLI adds it by default
(``--checkpoint_every_n_updates``); resume with ``--ckpt_path last`` or ``--ckpt_path <file>``.

Checkpoints hold the state after the update they follow (weights, optimizer, counters, RNG, data position): that
is what an exact resume needs.

``FileCheckpointIO`` writes a local checkpoint straight to its file; ``RunCheckpoints`` has the run's strategy use it
in place of Lightning's default (``TorchCheckpointIO``), which serialises the whole checkpoint in memory and then
copies it out.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint


class FileCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with local checkpoints written straight to their file.

    Lightning's default ``torch.save``-s the checkpoint into memory, copies the buffer out and writes the copy (the
    buffer serves remote filesystems' transactions): for two SmolLM2-135M agents with AdamW's moments (3.2 GB) that
    took ~17 s and ~2.9 GB of memory beyond the checkpoint's, against ~8.5 s and none with ``torch.save`` writing the
    file (benchmarks/README.md#checkpoints). The file is written under a hidden temporary name beside its path and
    renamed onto it when complete, so a killed or failing run (a full disk) never leaves a half-written checkpoint
    under the real name (the file is not fsync-ed: after a power loss the filesystem decides). A remote path
    (``s3://``, ``gs://``, …) is saved Lightning's way; loading is Lightning's.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):  # a URL (s3://, file://, simplecache::gs://, ...)
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = os.fspath(path)
        folder, name = os.path.split(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        partial = os.path.join(folder, f".{name}.partial-{os.getpid()}")  # not *.ckpt: never taken for a checkpoint
        try:
            with open(partial, "wb") as file:
                torch.save(checkpoint, file)
            os.replace(partial, path)
        except BaseException:
            if os.path.exists(partial):
                os.remove(partial)
            raise


class RunCheckpoints(ModelCheckpoint):
    def __init__(self, every_n_updates: int | None = 50, **kwargs):
        kwargs.setdefault("save_top_k", 1)
        kwargs.setdefault("save_last", "link")
        super().__init__(every_n_train_steps=every_n_updates or None, **kwargs)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, not one the user chose
            trainer.strategy.checkpoint_io = FileCheckpointIO()

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)
