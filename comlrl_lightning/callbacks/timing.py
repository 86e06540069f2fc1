"""Per-phase wall time of every update: ``timing_s/{generate,reward,transition,score,update}``.

The module adds each phase's seconds to ``pl_module.record.phase_seconds`` (``with self.record.timed(phase):``); with this
callback in the run, each update's row carries the seconds of every phase since the previous update (the sampling,
rewards and scoring of the batches that filled its buffer, then the update itself), so the rows' timings add up to
the run's training time. Remove it to log no timings.
"""

from __future__ import annotations

from lightning.pytorch import Callback


class PhaseTimer(Callback):
    logs_phase_timings = True  # what the run's record looks for (runs/record.py)

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.record.phase_seconds.clear()  # time spent before training (loading, restoring) is not a phase
