"""Checkpoints during a run, so that a crash loses at most ``every_n_updates`` updates.

``RunCheckpoints`` is Lightning's ``ModelCheckpoint`` saving every N updates (``global_step``), keeping the newest
``keep_last`` checkpoints (default 1; None: all) and ``last.ckpt`` (a link to the newest), and one more when training
ends on a step that is not a multiple of N.
Nothing is written when a run fails: ``last.ckpt`` keeps pointing at the last good checkpoint (a reward that raises
or a non-finite loss stops the run before it changes anything). The CLI adds it by default
(``--checkpoint_every_n_updates``, ``--checkpoint_total_limit``); resume with ``--ckpt_path last`` or
``--ckpt_path <file>``.

Ctrl-C (SIGINT) or SIGTERM (what a cluster sends 30-120 s before it kills a job) during a fit stops it within
seconds, whatever the fit is doing, and loses no completed update. The phases whose work changes nothing a checkpoint
holds -- sampling a step's rollout (every turn), collecting preference pairs, an evaluation, and what runs inside them
(rewards, sandbox jobs, comparator API requests) -- stop at their next safe point (a generated token, a call, a task,
a batch; ``runs/stop.py``) and their partial work is thrown away: the checkpoint written is the state after the last
completed update (weights, optimizer, counters, the RNG and data position of that moment), so ``--ckpt_path last``
resumes exactly, redoing the discarded work. One line says what was discarded and where the checkpoint is. A stop
during an update (or a reward-model update) lets that step finish, then writes the checkpoint. A fit stopped before
its first update writes its starting state (a resume of it starts the fit afresh, from the same seed); a resumed fit
stopped so, the state it resumed. A second Ctrl-C or SIGTERM stops at once, without a checkpoint. The CLI then exits
with status 130 (SIGINT) or 143 (SIGTERM); in Python, ``trainer.comlrl_interrupted_by`` holds the signal's number
(a ``trainer.fit`` of your own raises :class:`~comlrl_lightning.runs.stop.StopRequested` after writing the
checkpoint). The handlers are in place from the fit's start (models load before: a signal then ends the process as
it would any program). A data-parallel run finishes the step under way on every rank before it stops.

Checkpoints hold the state after the update they follow (weights, optimizer, counters, RNG, data position): that
is what an exact resume needs. They also record the run's W&B identity (:func:`wandb_identity`), so a resumed run
can continue the same W&B run.

``FileCheckpointIO`` writes a local checkpoint straight to its file; ``RunCheckpoints`` has the run's strategy use it
in place of Lightning's default (``TorchCheckpointIO``), which serialises the whole checkpoint in memory and then
copies it out.

A checkpoint that cannot be written (a full disk, a quota) ends the run with :class:`CheckpointNotWritten`, one line
naming the folder, its free space and the checkpoint's size, and where the weights still are: the previous checkpoint
stays in place until the new one is complete. The free space is checked against the checkpoint's size before any
byte is written; the CLI then offers, at a terminal, to ``save_pretrained`` the agents to another folder.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import sys
import threading
from typing import Any, Callable

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from comlrl_lightning.runs import stop


class CheckpointNotWritten(OSError):
    """A checkpoint that could not be written: the message names the folder, the space it needs and (from
    ``RunCheckpoints``) where the run's weights still are."""


def checkpoint_bytes(checkpoint: Any) -> int:
    """The bytes of the tensors in ``checkpoint`` (dicts, lists and tuples walked; a storage shared by several tensors
    counted once): what ``torch.save`` writes, less the pickle of the rest (kilobytes)."""
    storages: dict[tuple[str, int], int] = {}
    pending, seen = [checkpoint], set()
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (str(item.device), storage.data_ptr()) if storage.data_ptr() else ("", id(storage))
            storages[key] = max(storages.get(key, 0), storage.nbytes())
        elif isinstance(item, (dict, list, tuple, set)) and id(item) not in seen:
            seen.add(id(item))
            pending.extend(item.values() if isinstance(item, dict) else item)
    return sum(storages.values())


def size_text(n: float) -> str:
    """``1.23 GB`` / ``4.5 MB`` / ``812 kB`` (powers of 1000, as ``df -H``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{n / 1e3:.0f} kB"


SPACE_MARGIN = 1 << 20  # bytes beyond the tensors' that a checkpoint needs (its pickle, zip headers, alignment)


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
        needed = checkpoint_bytes(checkpoint) + SPACE_MARGIN
        free = shutil.disk_usage(folder).free
        if free < needed:  # before a byte is written: a full disk found at once, not by a failing write
            raise CheckpointNotWritten(
                f"checkpoint {path} not written: {folder} has {size_text(free)} free, the checkpoint needs "
                f"{size_text(needed)}"
            )
        try:
            with open(partial, "wb") as file:
                torch.save(checkpoint, file)
            os.replace(partial, path)
        except BaseException as err:
            if os.path.exists(partial):
                os.remove(partial)
            if isinstance(err, (OSError, RuntimeError)):  # torch reports a failed write as a RuntimeError
                first = (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]
                raise CheckpointNotWritten(
                    f"checkpoint {path} not written ({first}): {folder} has {size_text(shutil.disk_usage(folder).free)}"
                    f" free, the checkpoint needs {size_text(needed)}"
                ) from err
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
        self._previous_handlers: dict[int, Any] = {}  # before the fit, put back when it ends
        self._handling = False  # whether this fit's stops are ours to handle (else a signal goes to the previous)
        self._discards = False  # one process: a stop may discard the step under way (several ranks must agree first)
        self._completed_loops: dict[str, Any] | None = None  # Lightning's loop counters after the last completed step
        self._writing_stop = False  # the checkpoint of a discarded step is being written

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, not one the user chose
            trainer.strategy.checkpoint_io = FileCheckpointIO()

    # ------------------------------------------------------------------ Ctrl-C / SIGTERM: stop soon, keep every update
    def on_fit_start(self, trainer, pl_module) -> None:
        self._stop_signal = None
        trainer.comlrl_interrupted_by = None
        stop.clear()
        self._discards = trainer.world_size == 1
        loaded = trainer._checkpoint_connector._loaded_checkpoint  # restored into the loops after this hook
        loops = loaded.get("loops") if loaded else trainer._checkpoint_connector._get_loops_state_dict()
        self._completed_loops = copy.deepcopy(loops)
        self._install_handlers(fit_start=True)  # before pairs are collected (the training loader, built first)

    def on_train_start(self, trainer, pl_module) -> None:
        # Again: Lightning put its own SIGTERM handler in front of ours after on_fit_start. A stop asked for since
        # (and not taken by the pair collection) is taken by the first step: its first phase, or its end.
        self._install_handlers()

    def _install_handlers(self, fit_start: bool = False) -> None:
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            return
        self._handling = True
        for signum in STOP_SIGNALS:
            current = signal.getsignal(signum)
            if fit_start and current != self._request_stop:  # ours: left by a fit that raised (kept: what it found)
                self._previous_handlers[signum] = current
            signal.signal(signum, self._request_stop)

    def _request_stop(self, signum: int, frame: Any) -> None:
        if not self._handling or self._stop_signal is not None:  # after the fit, or the second one: stop now
            previous = self._previous_handlers.get(signum)
            self.restore_signal_handlers()
            if callable(previous):
                previous(signum, frame)
            elif signum == signal.SIGINT and previous != signal.SIG_IGN:
                raise KeyboardInterrupt
            elif previous != signal.SIG_IGN:
                signal.raise_signal(signum)
            return
        self._stop_signal = signum
        if self._discards:
            stop.request(signum)
        name = stop.signal_name(signum)
        sys.stderr.write(
            f"\n{name}: stopping at the next safe point, then writing the checkpoint of the last completed update "
            f"(resume with --ckpt_path last; {name} again stops at once, without a checkpoint)\n"
        )
        sys.stderr.flush()

    def restore_signal_handlers(self) -> None:
        """Put back the handlers the fit found (also after a fit that raised: Lightning's clean-up re-installs ours,
        so the CLI calls this once more)."""
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        saved = self._last_checkpoint_saved
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._completed_loops = copy.deepcopy(trainer._checkpoint_connector._get_loops_state_dict())
        if not trainer.strategy.reduce_boolean_decision(self._stop_signal is not None, all=False):
            return
        trainer.comlrl_interrupted_by = int(self._stop_signal or signal.SIGTERM)  # None here: another rank's
        if self._last_checkpoint_saved == saved:  # not just written by the every-N schedule
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        if trainer.is_global_zero:
            sys.stderr.write(
                f"{stop.signal_name(trainer.comlrl_interrupted_by)}: the step under way finished; the checkpoint of "
                f"update {trainer.global_step} is {self._last_checkpoint_saved} (resume with --ckpt_path last)\n"
            )
        trainer.should_stop = True

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._writing_stop:  # the loop counters of the last completed step: the discarded one is done again
            checkpoint["loops"] = copy.deepcopy(self._completed_loops)

    def save_last_completed(self, trainer, pl_module, stopped: stop.StopRequested) -> None:
        """After a stop that discarded work: the checkpoint of the last completed update (the module's RNG and user
        states of that moment, ``RunState.as_last_completed``; Lightning's loop counters, :meth:`on_save_checkpoint`)
        unless this fit has just written it, and one line saying what was discarded."""
        trainer.comlrl_interrupted_by = stopped.signum
        step = trainer.global_step
        if self._last_checkpoint_saved and self._last_global_step_saved == step:  # written when that step ended
            where = f"is {self._last_checkpoint_saved}"
        else:
            run_state = getattr(pl_module, "run_state", None)
            self._writing_stop = True
            try:
                with run_state.as_last_completed() if run_state is not None else contextlib.nullcontext():
                    candidates = self._monitor_candidates(trainer)
                    self._save_topk_checkpoint(trainer, candidates)
                    self._save_last_checkpoint(trainer, candidates)
            finally:
                self._writing_stop = False
            where = f"written to {self._last_checkpoint_saved}"
        sys.stderr.write(
            f"{stopped}: discarded it; the checkpoint of update {step} (the last completed) {where} "
            "(resume with --ckpt_path last)\n"
        )
        sys.stderr.flush()

    # ------------------------------------------------------------------ a checkpoint that cannot be written
    def _save_checkpoint(self, trainer, filepath: str) -> None:
        """Lightning's save; one that fails says where the run's weights still are (the previous checkpoint, which
        Lightning removes only after the new one is written, and the module in memory)."""
        try:
            super()._save_checkpoint(trainer, filepath)
        except CheckpointNotWritten as err:
            previous = self._last_checkpoint_saved
            if previous and previous != filepath and os.path.isfile(previous):
                kept = (
                    f"the previous checkpoint {previous} (update {self._last_global_step_saved}) is kept and "
                    f"{os.path.join(os.path.dirname(previous), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)} "
                    "points at it: free space and resume with --ckpt_path last (or --ckpt_path <that file> with "
                    "--trainer.default_root_dir on another disk)"
                )
            else:
                kept = (
                    "this run has no earlier checkpoint: free space or give --trainer.default_root_dir on another disk"
                )
            raise CheckpointNotWritten(
                f"{err}. The weights after update {trainer.global_step} are only in memory; {kept}. From Python, "
                "module.save_pretrained('<a folder on another disk>') writes the agents"
            ) from err

    def on_train_end(self, trainer, pl_module) -> None:
        self._handling = False
        stop.clear()
        self.restore_signal_handlers()
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._handling = False
        stop.clear()
        self.restore_signal_handlers()
        if isinstance(exception, stop.StopRequested):
            self.save_last_completed(trainer, pl_module, exception)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._handling = False
        self.restore_signal_handlers()
        self._previous_handlers = {}
        super().teardown(trainer, pl_module, stage)


def at_terminal() -> bool:
    """Whether someone can answer a question (stdin and stderr are a terminal, not a job's files)."""
    return sys.stdin.isatty() and sys.stderr.isatty()


def offer_save_pretrained(module: Any, ask: Callable[[str], str] | None = None) -> str | None:
    """After a checkpoint that could not be written, at a terminal: ask for another folder and ``save_pretrained``
    the agents there (one line in reply; Enter: nothing). Returns the folder written, else None."""
    if not at_terminal() or not hasattr(module, "save_pretrained"):
        return None
    try:
        folder = (ask or input)(
            "save the agents with save_pretrained to another folder (a path on another disk; Enter: no)? "
        )
    except EOFError:
        return None
    folder = folder.strip()
    if not folder:
        return None
    try:
        module.save_pretrained(folder)
    except (OSError, RuntimeError) as err:
        sys.stderr.write(f"save_pretrained({folder!r}) failed too: {str(err).strip()[:200]}\n")
        return None
    sys.stderr.write(f"the agents are in {folder}/agent_<i>/ (load them with agents: [{folder}/agent_0, ...])\n")
    return folder


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
