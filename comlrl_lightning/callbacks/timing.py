"""Per-phase wall time of every training step: ``timing_s/{generate,reward,transition,score,update}``.

The module adds each phase's seconds to ``pl_module.phase_seconds`` (``with self.timed(phase):``); this callback
logs them at the end of the step and starts the next step from zero. Remove it to log no timings.
"""

from __future__ import annotations

from lightning.pytorch import Callback


class PhaseTimer(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        pl_module.phase_seconds.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if pl_module.phase_seconds:
            pl_module.log_dict({f"timing_s/{phase}": seconds for phase, seconds in pl_module.phase_seconds.items()},
                               batch_size=1)
        pl_module.phase_seconds.clear()
