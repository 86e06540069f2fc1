"""Checkpoints during a run, so that a crash loses at most ``every_n_updates`` updates.

``RunCheckpoints`` is Lightning's ``ModelCheckpoint`` saving every N updates (``global_step``), keeping the newest
``keep_last`` checkpoints (default 1; None: all) and ``last.ckpt`` (a link to the newest), and one more when training
ends on a step that is not a multiple of N.
Nothing is written when a run fails: ``last.ckpt`` keeps pointing at the last good checkpoint (a reward that raises
or a non-finite loss stops the run before it changes anything). The CLI adds it by default
(``--checkpoint_every_n_updates``, ``--checkpoint_total_limit``); resume with ``--ckpt_path last`` or
``--ckpt_path <file>``.

Ctrl-C (SIGINT) or SIGTERM (what a cluster sends before pre-empting a job) during training does not lose the work
since the last checkpoint: the step under way finishes, a checkpoint is written (``last.ckpt`` points at it) and
the fit ends; ``--ckpt_path last`` resumes from it exactly. A second Ctrl-C stops at once, without a checkpoint.
The CLI then exits with status 130 (SIGINT) or 143 (SIGTERM); in Python, ``trainer.comlrl_interrupted_by`` holds
the signal's number.

Checkpoints hold the state after the update they follow (weights, optimizer, counters, RNG, data position): that
is what an exact resume needs. They also record the run's W&B identity (:func:`wandb_identity`), so a resumed run
can continue the same W&B run.

``FileCheckpointIO`` writes a local checkpoint straight to its file; ``RunCheckpoints`` has the run's strategy use it
in place of Lightning's default (``TorchCheckpointIO``), which serialises the whole checkpoint in memory and then
copies it out.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
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


CHECKPOINT_EVERY = 50  # updates between checkpoints, unless a run says otherwise
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunCheckpoints(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` every ``every_n_updates`` updates (None or 0: only at the end), with
    ``last.ckpt``, a checkpoint when training ends, and one when Ctrl-C or SIGTERM stops the fit (module docstring)."""

    def __init__(self, every_n_updates: int | None = CHECKPOINT_EVERY, keep_last: int | None = 1, **kwargs):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"checkpoint_total_limit must be a positive integer or None (got {keep_last!r}).")
        if keep_last is None or keep_last > 1:  # the newest N (all): ranked by update count, newest best
            kwargs.setdefault("monitor", "step")
            kwargs.setdefault("mode", "max")
        kwargs.setdefault("save_top_k", -1 if keep_last is None else keep_last)
        kwargs.setdefault("save_last", "link")
        super().__init__(every_n_train_steps=every_n_updates or None, **kwargs)
        self._stop_signal: int | None = None
        self._previous_handlers: dict[int, Any] = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, not one the user chose
            trainer.strategy.checkpoint_io = FileCheckpointIO()

    # ------------------------------------------------------------------ Ctrl-C / SIGTERM: finish the step, save, stop
    def on_train_start(self, trainer, pl_module) -> None:
        self._stop_signal = None
        trainer.comlrl_interrupted_by = None
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            return
        for signum in STOP_SIGNALS:
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._request_stop)

    def _request_stop(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None:  # the second one: stop now, as the signal would have
            self._restore_handlers()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
            return
        self._stop_signal = signum
        sys.stderr.write(
            f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint and stopping "
            "(resume with --ckpt_path last; Ctrl-C again stops at once, without a checkpoint)\n"
        )
        sys.stderr.flush()

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        saved = self._last_checkpoint_saved
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not trainer.strategy.reduce_boolean_decision(self._stop_signal is not None, all=False):
            return
        trainer.comlrl_interrupted_by = int(self._stop_signal or signal.SIGTERM)  # None here: another rank's
        if self._last_checkpoint_saved == saved:  # not just written by the every-N schedule
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_handlers()
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_handlers()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore_handlers()
        super().teardown(trainer, pl_module, stage)


def wandb_identity(loggers: Any) -> dict[str, str] | None:
    """``{"id", "project", "entity"}`` of the W&B run among ``loggers`` (the non-empty ones), or None: what a resumed
    run needs to continue logging into the same W&B run (``WandbLogger(id=...)``; CoMLRL: ``wandb_config["id"]``). A
    logger whose run has not started yet is not started for this."""
    for logger in loggers or ():
        run = getattr(logger, "_experiment", None) if type(logger).__name__ == "WandbLogger" else None
        if run is not None and isinstance(getattr(run, "id", None), str) and run.id:
            return {
                key: value
                for key in ("id", "project", "entity")
                if isinstance(value := getattr(run, key, None), str) and value
            }
    return None
