"""Checkpoints during a run, so that a crash loses at most ``every_n_updates`` updates.

``RunCheckpoints`` is Lightning's ``ModelCheckpoint`` saving every N updates (``global_step``), keeping the newest
checkpoint and ``last.ckpt`` (a link to it), and one more when training ends on a step that is not a multiple of N.
Nothing is written when a run fails: ``last.ckpt`` keeps pointing at the last good checkpoint (a reward that raises
or a non-finite loss stops the run before it changes anything). The CLI adds it by default
(``--checkpoint_every_n_updates``); resume with ``--ckpt_path last`` or ``--ckpt_path <file>``.

Checkpoints hold the state after the update they follow (weights, optimizer, counters, RNG, data position): that
is what an exact resume needs.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint


class RunCheckpoints(ModelCheckpoint):
    def __init__(self, every_n_updates: int | None = 50, **kwargs):
        kwargs.setdefault("save_top_k", 1)
        kwargs.setdefault("save_last", "link")
        super().__init__(every_n_train_steps=every_n_updates or None, **kwargs)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)
