"""A progress bar that counts what a run is limited by: team updates for a ``max_steps`` run, epochs otherwise.

Lightning's bars count training batches per epoch and print ``Epoch 0/-2`` when only ``max_steps`` is set. Here
one training batch may give zero or several updates (the rollout buffer), so a ``max_steps`` run shows
``Update 3/24`` (``global_step`` of ``max_steps``) and an epoch-bound run shows ``Epoch 2/20`` over the epoch's
batches. The bar shows the team reward and the logged ``loss``, not Lightning's ``v_num``.

The CLI adds it unless you configure a progress bar yourself; in Python pass ``callbacks=[progress_bar()]``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar
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


class _Counting:
    """What both bars share: drop ``v_num`` from the shown metrics."""

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


class UpdateTQDMProgressBar(_Counting, TQDMProgressBar):
    """The tqdm variant (used when ``rich`` is not installed)."""

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        bar = self.train_progress_bar
        bar.reset(total=train_total(trainer, bar.total))
        bar.n = trainer.global_step if counts_updates(trainer) else 0
        bar.set_description(train_description(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is not None and not bar.disable:
            bar.n = train_completed(trainer, batch_idx)
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()


if _RICH_AVAILABLE:
    from lightning.pytorch.callbacks import RichProgressBar

    class UpdateRichProgressBar(_Counting, RichProgressBar):
        """The rich variant (Lightning's default bar when ``rich`` is installed)."""

        @property
        def total_train_batches(self) -> float:
            return train_total(self.trainer, super().total_train_batches)

        def _get_train_description(self, current_epoch: int) -> str:
            return train_description(self.trainer)

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            super().on_train_epoch_start(trainer, pl_module)
            if counts_updates(trainer):  # a new epoch does not restart the count of updates
                self._update(self.train_progress_bar_id, trainer.global_step)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
            if not self.is_disabled and self.train_progress_bar_id is None:
                self._initialize_train_progress_bar_id()
            self._update(self.train_progress_bar_id, train_completed(trainer, batch_idx))
            self._update_metrics(trainer, pl_module)
            self.refresh()


def progress_bar():
    """The bar Lightning would pick (rich if installed, else tqdm), counting updates or epochs."""
    return UpdateRichProgressBar() if _RICH_AVAILABLE else UpdateTQDMProgressBar()
