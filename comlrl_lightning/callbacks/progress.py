"""Progress of a run, in a terminal and in a log file.

Lightning's bars count training batches per epoch and print ``Epoch 0/-2`` when only ``max_steps`` is set. Here
one training batch may give zero or several updates (the rollout buffer), so a ``max_steps`` run shows
``Update 3/24`` (``global_step`` of ``max_steps``) and an epoch-bound run shows ``Epoch 2/20`` over the epoch's
batches. The bar shows the team reward and the loss (not Lightning's ``v_num``), the seconds per update when an
update takes longer than a second, ``Evaluating …`` while an evaluation runs, and prints each evaluation's results.

When standard output is not a terminal (a log file under SLURM or ``nohup``, a pipe, a notebook), a bar would only
show at the end: :class:`UpdateLineProgressBar` prints one plain line per step that made an update instead —
``update 3/24 | reward 2.131 | loss 0.412 | 12.3 s/update | ETA 4m06s`` — a line at least every ``min_interval``
seconds while the rollout buffer fills, and the evaluations.

:func:`progress_bar` picks the right one. The CLI adds it unless you configure a progress bar yourself, and so does
a module fitted by a plain ``lightning.Trainer`` whose bar is Lightning's default (``callbacks/conventions.py``).
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from typing import Any, Mapping

from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE


def counts_updates(trainer) -> bool:
    """A run bounded by ``max_steps`` (updates) rather than by ``max_epochs``."""
    return trainer.max_steps is not None and trainer.max_steps > 0


def train_description(trainer) -> str:
    epoch = trainer.current_epoch + 1
    if counts_updates(trainer):
        return f"Update (epoch {epoch})"
    return f"Epoch {epoch}/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else f"Epoch {epoch}"


def train_total(trainer, batches: float) -> float:
    return trainer.max_steps if counts_updates(trainer) else batches


def train_completed(trainer, batch_idx: int) -> int:
    return trainer.global_step if counts_updates(trainer) else batch_idx + 1


def duration(seconds: float) -> str:
    """``42s``, ``4m06s``, ``2h05m``."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def rate(seconds_per_update: float | None) -> str:
    """``12.3 s/update`` for slow updates, ``2.50 updates/s`` for fast ones."""
    if not seconds_per_update:
        return ""
    return (
        f"{seconds_per_update:.1f} s/update" if seconds_per_update >= 1 else f"{1 / seconds_per_update:.2f} updates/s"
    )


def value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def evaluation_label(trainer, num_items: int) -> str:
    """What a bar counting updates shows while an evaluation runs: ``Update 3: evaluating 4 items`` (the count
    beside it stays the updates')."""
    return f"Update {trainer.global_step}: evaluating {num_items} items"


def training_done(trainer, first_step: int, seconds: float) -> str:
    """``training done: 5 updates in 4m06s``, or for a resumed run ``training done: 2 updates this run (5 in all)
    in 1m40s``."""
    done = trainer.global_step - first_step
    count = f"{done} updates this run ({trainer.global_step} in all)" if first_step else f"{done} updates"
    return f"training done: {count} in {duration(seconds)}"


def evaluation_line(trainer, metrics: Mapping[str, float], final: bool) -> str:
    """``evaluation at update 8 (env_step 64): eval/turn_1/reward_mean 2.13, ...``."""
    shown = ", ".join(f"{k} {value(float(v))}" for k, v in metrics.items() if k != "env_step")
    where = f"update {trainer.global_step}" + (
        f" (env_step {int(metrics['env_step'])})" if "env_step" in metrics else ""
    )
    return f"{'final evaluation' if final else 'evaluation'} at {where}: {shown}"


class _Pace:
    """Seconds per update and the time left, measured from the start of this fit (a resumed run counts from its
    resume point)."""

    def start(self, trainer) -> None:
        self.started, self.first_step, self.first_batches = time.monotonic(), trainer.global_step, None

    def seconds_per_update(self, trainer) -> float | None:
        done = trainer.global_step - self.first_step
        return (time.monotonic() - self.started) / done if done > 0 else None

    def eta(self, trainer, batches_done: int | None = None, batches_total: float | None = None) -> float | None:
        if counts_updates(trainer):
            per_update = self.seconds_per_update(trainer)
            return None if per_update is None else per_update * max(trainer.max_steps - trainer.global_step, 0)
        if batches_done and batches_total and batches_total != float("inf"):
            return (time.monotonic() - self.started) / batches_done * max(batches_total - batches_done, 0)
        return None


class _Counting:
    """What every bar of this package shares: no ``v_num``, the pace, and evaluations announced and printed."""

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.pace = _Pace()
        self.pace.start(trainer)

    def on_evaluation_start(self, trainer, num_items: int, final: bool) -> None:
        """An evaluation during (or at the end of) a fit starts: the bar says so."""

    def on_evaluation_end(self, trainer, metrics: Mapping[str, float], final: bool) -> None:
        """Its results, printed above the bar (below it once the bar is closed: the final evaluation)."""
        if trainer.is_global_zero:
            line = evaluation_line(trainer, metrics, final)
            self.print(line) if self._bar_is_open() else print(line, flush=True)

    def _bar_is_open(self) -> bool:
        return True


class UpdateTQDMProgressBar(_Counting, TQDMProgressBar):
    """The tqdm variant (used when ``rich`` is not installed). tqdm itself shows ``s/it`` for slow steps."""

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        bar = self.train_progress_bar
        bar.reset(total=train_total(trainer, bar.total))
        bar.n = trainer.global_step if counts_updates(trainer) else 0
        bar.unit = "update" if counts_updates(trainer) else "it"
        bar.set_description(train_description(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is not None and not bar.disable:
            bar.n = train_completed(trainer, batch_idx)
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()

    def _bar_is_open(self) -> bool:
        return self._train_progress_bar is not None and not self._train_progress_bar.disable  # closed: disabled

    def on_evaluation_start(self, trainer, num_items: int, final: bool) -> None:
        bar = self._train_progress_bar
        if bar is not None and not bar.disable:
            bar.set_description(evaluation_label(trainer, num_items))
            bar.refresh()

    def on_evaluation_end(self, trainer, metrics: Mapping[str, float], final: bool) -> None:
        bar = self._train_progress_bar
        if bar is not None and not bar.disable:
            bar.set_description(train_description(trainer))
            bar.refresh()
        super().on_evaluation_end(trainer, metrics, final)


if _RICH_AVAILABLE:
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import CustomTimeColumn, ProcessingSpeedColumn
    from rich.text import Text

    class UpdateSpeedColumn(ProcessingSpeedColumn):
        """``12.3 s/update`` (or ``s/it``) for slow steps, where Lightning's column shows ``0.00it/s``."""

        def render(self, task) -> Text:
            per_update = task.fields.get("seconds_per_update")
            if per_update:
                return Text(rate(per_update), style=self.style)
            speed = task.speed
            text = "" if not speed else f"{speed:.2f}it/s" if speed >= 1 else f"{1 / speed:.1f}s/it"
            return Text(text, style=self.style)

    class UpdateTimeColumn(CustomTimeColumn):
        """``0:04:10 • 0:12:30``: elapsed, and the time left from the measured seconds per update (rich's own
        estimate looks at the last 30 s only, so an update slower than that left it at ``-:--:--``)."""

        def render(self, task) -> Text:
            eta = task.fields.get("eta")
            if eta is None:
                return super().render(task)
            elapsed = task.finished_time if task.finished else task.elapsed
            shown = "-:--:--" if elapsed is None else str(timedelta(seconds=int(elapsed)))
            return Text(f"{shown} • {timedelta(seconds=int(eta))}", style=self.style)

    class UpdateRichProgressBar(_Counting, RichProgressBar):
        """The rich variant (Lightning's default bar when ``rich`` is installed)."""

        @property
        def total_train_batches(self) -> float:
            return train_total(self.trainer, super().total_train_batches)

        def _get_train_description(self, current_epoch: int) -> str:
            return train_description(self.trainer)

        def configure_columns(self, trainer) -> list:
            replace = {ProcessingSpeedColumn: UpdateSpeedColumn, CustomTimeColumn: UpdateTimeColumn}
            return [
                replace[type(c)](style=c.style) if type(c) in replace else c for c in super().configure_columns(trainer)
            ]

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            super().on_train_epoch_start(trainer, pl_module)
            if counts_updates(trainer):  # a new epoch does not restart the count of updates
                self._update(self.train_progress_bar_id, trainer.global_step)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
            if not self.is_disabled and self.train_progress_bar_id is None:
                self._initialize_train_progress_bar_id()
            if self.progress is not None and self.train_progress_bar_id is not None and counts_updates(trainer):
                self.progress.update(
                    self.train_progress_bar_id,
                    seconds_per_update=self.pace.seconds_per_update(trainer),
                    eta=self.pace.eta(trainer),
                )
            self._update(self.train_progress_bar_id, train_completed(trainer, batch_idx))
            self._update_metrics(trainer, pl_module)
            self.refresh()

        def _describe(self, text: str) -> None:
            if self.progress is not None and self.is_enabled and self.train_progress_bar_id is not None:
                styled = f"[{self.theme.description}]{text}" if self.theme.description else text
                self.progress.update(self.train_progress_bar_id, description=styled)
                self.refresh()

        def on_evaluation_start(self, trainer, num_items: int, final: bool) -> None:
            self._describe(evaluation_label(trainer, num_items))

        def on_evaluation_end(self, trainer, metrics: Mapping[str, float], final: bool) -> None:
            self._describe(train_description(trainer))
            super().on_evaluation_end(trainer, metrics, final)


class UpdateLineProgressBar(_Counting, ProgressBar):
    """Plain lines for a log file: one per training step that made an update (``update 3/24 | reward 2.131 |
    loss 0.412 | 12.3 s/update | ETA 4m06s``), one at least every ``min_interval`` seconds while a buffer fills or
    a ``validate``/``test``/``predict`` run goes through its batches, and each evaluation's start and results.
    Every line is flushed at once."""

    def __init__(self, min_interval: float = 30.0):
        super().__init__()
        self.min_interval = min_interval
        self._enabled = True
        self._last_line = 0.0
        self._last_step = 0
        self._doing = ""  # what the run is in: "update 4/24", "evaluation of 4 items at update 3"
        self._since = 0.0
        self._heartbeat: threading.Thread | None = None
        self._stopped = threading.Event()

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self._enabled:
            self._last_line = time.monotonic()
            print(*args, **kwargs, flush=True)

    def _in(self, doing: str) -> None:
        self._doing, self._since = doing, time.monotonic()

    def _beat(self) -> None:
        """A line at least every ``min_interval`` seconds whatever the run is in (a first rollout, an evaluation or
        a pair collection can take minutes): ``... update 4/24 in progress for 2m30s (last update: 12.3 s)``."""
        while not self._stopped.wait(min(self.min_interval, 5.0)):
            if self._doing and time.monotonic() - self._last_line >= self.min_interval:
                trainer = self._trainer
                last = rate(self.pace.seconds_per_update(trainer)) if trainer is not None else ""
                self.print(
                    f"... {self._doing} in progress for {duration(time.monotonic() - self._since)}"
                    + (f" ({last})" if last else "")
                )

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_step, self._last_line = trainer.global_step, time.monotonic()
        limit = f"{trainer.max_steps} updates" if counts_updates(trainer) else f"{trainer.max_epochs} epochs"
        self.print(f"training: {limit}" + (f", from update {trainer.global_step}" if trainer.global_step else ""))
        self._in(self._next_update(trainer))
        if trainer.is_global_zero and self._heartbeat is None:
            self._stopped.clear()
            self._heartbeat = threading.Thread(target=self._beat, name="progress-heartbeat", daemon=True)
            self._heartbeat.start()

    def _stop_heartbeat(self) -> None:
        self._stopped.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        self._heartbeat = None

    @staticmethod
    def _next_update(trainer) -> str:
        total = f"/{trainer.max_steps}" if counts_updates(trainer) else ""
        return f"update {trainer.global_step + 1}{total}"

    def _metrics(self, trainer, pl_module) -> str:
        return " | ".join(f"{k} {value(v)}" for k, v in self.get_metrics(trainer, pl_module).items())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step, now = trainer.global_step, time.monotonic()
        updated = step > self._last_step
        if not updated and now - self._last_line < self.min_interval:
            return
        if counts_updates(trainer):
            done = (
                f"update {step}/{trainer.max_steps}"
                if step - self._last_step <= 1
                else f"updates {self._last_step + 1}-{step}/{trainer.max_steps}"
            )
        else:
            epochs = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
            done = (
                f"epoch {trainer.current_epoch + 1}{epochs} batch {batch_idx + 1}/{trainer.num_training_batches} "
                f"| update {step}"
            )
        if not updated:
            done += " (sampling; no update yet)"
        batches = trainer.num_training_batches
        total = batches * trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        eta = self.pace.eta(trainer, trainer.current_epoch * batches + batch_idx + 1, total)
        parts = [
            done,
            self._metrics(trainer, pl_module),
            rate(self.pace.seconds_per_update(trainer)),
            f"ETA {duration(eta)}" if eta is not None else "",
        ]
        self.print(" | ".join(p for p in parts if p))
        self._last_step = step
        if updated:
            self._in(self._next_update(trainer))

    def on_train_end(self, trainer, pl_module) -> None:
        self._in("")  # the heartbeat goes on through a final evaluation; teardown stops it
        self.print(training_done(trainer, self.pace.first_step, time.monotonic() - self.pace.started))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._stop_heartbeat()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._stop_heartbeat()
        super().teardown(trainer, pl_module, stage)

    def on_evaluation_start(self, trainer, num_items: int, final: bool) -> None:
        what = f"{'final evaluation' if final else 'evaluation'} of {num_items} items at update {trainer.global_step}"
        self.print(what + " ...")
        self._resume = self._doing
        self._in(what)

    def on_evaluation_end(self, trainer, metrics: Mapping[str, float], final: bool) -> None:
        super().on_evaluation_end(trainer, metrics, final)
        self._in(getattr(self, "_resume", "") if not final else "")

    def _stage_start(self, what: str, batches: Any) -> None:
        self._last_line = time.monotonic()
        self.print(f"{what}: {batches} batches")

    def _stage_batch(self, what: str, batch_idx: int, batches: Any) -> None:
        if time.monotonic() - self._last_line >= self.min_interval:
            self._last_line = time.monotonic()
            self.print(f"{what}: batch {batch_idx + 1}/{batches}")

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._stage_start("validate", sum(trainer.num_val_batches))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        self._stage_batch("validate", batch_idx, sum(trainer.num_val_batches))

    def on_test_start(self, trainer, pl_module) -> None:
        self._stage_start("test", sum(trainer.num_test_batches))

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        self._stage_batch("test", batch_idx, sum(trainer.num_test_batches))

    def on_predict_start(self, trainer, pl_module) -> None:
        self._stage_start("predict", sum(trainer.num_predict_batches))

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        self._stage_batch("predict", batch_idx, sum(trainer.num_predict_batches))


def stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def progress_bar():
    """Lines when standard output is not a terminal (:class:`UpdateLineProgressBar`); else the bar Lightning would
    pick (rich if installed, else tqdm), counting updates or epochs."""
    if not stdout_is_terminal():
        return UpdateLineProgressBar()
    return UpdateRichProgressBar() if _RICH_AVAILABLE else UpdateTQDMProgressBar()
