"""The run's record: one row of metrics per team update, and the wall time of each phase of a step.

Lightning's own logging writes a row per training batch at a per-batch counter, and repeats on every row the values
of earlier batches; here a batch makes zero updates (it only fills the rollout buffer) or several (mini-batches). So
each update's metrics go to the loggers as ONE row at the update's step, beside ``module.log`` for the progress bar
only (docs/algorithms.md#metrics-and-steps). Every rank writes (a row's metrics are means over the ranks); the
loggers write on rank 0.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

import torch

from comlrl_lightning.runs import ranks


class RunRecord:
    """What a module writes to its loggers (``module.record``): update rows, and ``timing_s/<phase>``."""

    def __init__(self, module: Any):
        self.module = module
        self.phase_seconds: dict[str, float] = defaultdict(float)  # logged when the run has a PhaseTimer
        self.pending: list[dict[str, float]] = []  # rollout metrics waiting for the next update's row

    @staticmethod
    def chart_against_env_step(loggers: Sequence[Any]) -> None:
        """W&B charts every metric against ``env_step`` (CoMLRL's x-axis) instead of the logger's step."""
        for logger in loggers:
            if type(logger).__name__ == "WandbLogger":
                logger.experiment.define_metric("env_step")
                logger.experiment.define_metric("*", step_metric="env_step")

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Add the block's wall time to ``timing_s/<phase>`` of the current step."""
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] += time.perf_counter() - tic

    def take_timings(self) -> dict[str, float]:
        """``timing_s/<phase>`` of everything timed since the previous update (its share of sampling, rewards and
        scoring included), and start timing afresh; nothing when the run has no ``PhaseTimer`` callback."""
        seconds = dict(self.phase_seconds)
        self.phase_seconds.clear()
        trainer = self.module._trainer
        timed = trainer is not None and any(getattr(c, "logs_phase_timings", False) for c in trainer.callbacks)
        return {f"timing_s/{phase}": value for phase, value in seconds.items()} if timed else {}

    def write_row(self, metrics: Mapping[str, float], step: int | None = None) -> dict[str, float]:
        """Write one row to every logger at ``step`` (default: the updates behind the current weights): each metric
        the mean over the ranks that have it, with ``env_step``; the values also become ``trainer.callback_metrics``
        (what ``ModelCheckpoint(monitor=...)`` and early stopping read). Every rank calls it. Returns the row."""
        module = self.module
        row = {**ranks.mean_of_ranks(dict(metrics)), "env_step": float(module.env_step)}
        step = module.run_state.updates_done if step is None else int(step)
        if module._trainer is None:
            return row
        row["epoch"] = module.current_epoch
        values = {k: torch.tensor(v) for k, v in row.items()}  # as Lightning keeps them
        # Lightning's own row writer (every logger, then save; trainer.logged_metrics kept up to date), given the step.
        module.trainer._logger_connector.log_metrics(values, step=step)
        module.trainer.callback_metrics.update(values)
        return row

    def log_step(
        self,
        updates: Sequence[Mapping[str, float]],
        sampled: Mapping[str, float] | None = None,
        progress: Mapping[str, str] | None = None,
    ) -> None:
        """Record one training step: a row per update it made, at that update's step (the updates done before it:
        the row at step s holds update s+1, made from the samples of the weights after s updates; an evaluation
        at step s evaluates those weights). ``sampled`` (rollout metrics of the step's fresh samples) waits for
        the next update and joins its row, averaged with those of the other steps since the previous update: a
        step that only fills the buffer writes nothing. ``progress``: ``{label: metric}`` shown on the bar."""
        if sampled:
            self.pending.append(dict(sampled))
        first = self.module.global_step - len(updates)
        shown: dict[str, float] = dict(sampled or {})
        for n, metrics in enumerate(updates):
            row = dict(metrics)
            if self.pending:
                row = {**mean_over(self.pending), **row}
                self.pending = []
            shown.update(self.write_row(row, step=first + n))
        for label, key in (progress or {}).items():
            if key in shown:
                self.module.log(label, float(shown[key]), prog_bar=True, logger=False, batch_size=1)


def mean_over(updates: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Several updates in one step: the mean of each metric over the updates that logged it."""
    updates = list(updates)
    return {
        key: sum(u[key] for u in updates if key in u) / sum(key in u for u in updates)
        for key in {k for u in updates for k in u}
    }
