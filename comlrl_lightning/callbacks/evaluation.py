"""Periodic evaluation during training with the task reward (docs/algorithms.md#evaluation-and-step-accounting).

Every ``eval_interval`` training batches (batch 0 of each epoch included, before training on that batch), the
first ``eval_num_samples`` items of the data module's eval set are played once each (one sampled trajectory per
item over all turns) and ``eval/turn_t/reward_mean``, ``eval/turn_t/expected_return`` and the user's
``eval_logger``/``eval_aggregator`` metrics are logged as one row at the step of the weights evaluated (the
updates done so far: the same axis as the training rows). With ``at_end`` (``eval_at_end``) the trained team is
evaluated once more when the fit ends, unless its last update was just evaluated or the run was interrupted.

The progress bar says when an evaluation runs and prints its results (``callbacks/progress.py``).

``EvaluationRows`` writes what the ``validate`` and ``test`` subcommands evaluate: the records the module's
``validation_step``/``test_step`` return, reduced over the ranks into one row (``test/...`` for test) at the step of
the weights evaluated (a checkpoint's).
"""

from __future__ import annotations

import logging

from lightning.pytorch import Callback

log = logging.getLogger(__name__)


class EvaluationCallback(Callback):
    """Added by the module (``configure_callbacks``) with its ``eval_interval``, ``eval_num_samples`` and
    ``eval_at_end`` fields, which checked them."""

    def __init__(self, eval_interval: int, eval_num_samples: int, at_end: bool):
        self.eval_interval = eval_interval
        self.eval_num_samples = eval_num_samples
        self.at_end = at_end
        self._warned = False
        self._evaluated_step: int | None = None  # the step of the last evaluation of this fit

    def on_fit_start(self, trainer, pl_module) -> None:
        self._evaluated_step = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.eval_interval == 0 or batch_idx % self.eval_interval != 0:
            return
        self.run(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        interrupted = getattr(trainer, "comlrl_interrupted_by", None) is not None  # Ctrl-C / SIGTERM: stop quickly
        if self.at_end and not interrupted and self._evaluated_step != trainer.global_step:
            # The random streams are put back afterwards: a run extended from its final checkpoint samples what a
            # longer run would have (the checkpoint is written after this hook).
            from comlrl_lightning.rollout.seeding import rng_state, set_rng_state

            state = rng_state()
            try:
                self.run(trainer, pl_module, final=True)
            finally:
                set_rng_state(state)

    def run(self, trainer, pl_module, final: bool = False) -> dict[str, float] | None:
        """Evaluate now and log one row; returns the metrics (None when there is nothing to evaluate)."""
        if getattr(pl_module, "in_reward_model_stage", False):  # MARLHF evaluates in its RL stage (docs/algorithms.md)
            return None
        datamodule = trainer.datamodule
        items = datamodule.eval_items(self.eval_num_samples) if hasattr(datamodule, "eval_items") else []
        if not items:
            if not self._warned:
                log.warning(
                    "Evaluation is on (eval_interval=%d) but the data module has no eval set; skipping.",
                    self.eval_interval,
                )
                self._warned = True
            return None
        bar = trainer.progress_bar_callback
        if hasattr(bar, "on_evaluation_start"):
            bar.on_evaluation_start(trainer, len(items), final)
        metrics = pl_module.evaluation.evaluate(items, batch_size=datamodule.eval_batch_size)
        # Straight to the loggers, at the step of the weights evaluated; also trainer.callback_metrics, for
        # ModelCheckpoint(monitor="eval/turn_1/reward_mean") and early stopping.
        row = pl_module.record.write_row(metrics)
        self._evaluated_step = trainer.global_step
        if hasattr(bar, "on_evaluation_end"):
            bar.on_evaluation_end(trainer, row, final)
        return row


class EvaluationRows(Callback):
    def __init__(self) -> None:
        self.records: list = []
        self._limit_val_batches = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            # During fit, evaluation runs in EvaluationCallback, not in Lightning's validation loop: the loop is off
            # for this fit (restored in teardown, so a later trainer.validate works).
            self._limit_val_batches, trainer.limit_val_batches = trainer.limit_val_batches, 0

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self._limit_val_batches is not None:
            trainer.limit_val_batches, self._limit_val_batches = self._limit_val_batches, None

    def start(self, trainer, pl_module) -> None:
        self.records = []

    def keep(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.records.append(outputs)

    def on_validation_epoch_end(self, trainer, pl_module, prefix: str = "eval/") -> None:
        if self.records:
            metrics = pl_module.evaluation.metrics(self.records)
            metrics = {key.replace("eval/", prefix, 1): value for key, value in metrics.items()}
            pl_module.log_dict({**metrics, "step": float(pl_module.run_state.updates_done)})  # Lightning's row step
        self.records = []

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self.on_validation_epoch_end(trainer, pl_module, prefix="test/")

    on_validation_epoch_start = on_test_epoch_start = start
    on_validation_batch_end = on_test_batch_end = keep
