"""Periodic evaluation during training with the task reward (docs/algorithms.md#evaluation-and-step-accounting).

Every ``eval_interval`` training batches (batch 0 of each epoch included, before training on that batch), the
first ``eval_num_samples`` items of the data module's eval set are played once each (one sampled trajectory per
item over all turns) and ``eval/turn_t/reward_mean``, ``eval/turn_t/expected_return`` and the user's
``eval_logger``/``eval_aggregator`` metrics are logged.
"""

from __future__ import annotations

import logging

import torch

from lightning.pytorch import Callback

log = logging.getLogger(__name__)


class EvaluationCallback(Callback):
    def __init__(self, eval_interval: int = 16, eval_num_samples: int = 4):
        if eval_interval < 0:
            raise ValueError(f"eval_interval must be >= 0 (got {eval_interval}).")
        if eval_num_samples < 0:
            raise ValueError(f"eval_num_samples must be >= 0 (got {eval_num_samples}).")
        self.eval_interval = eval_interval
        self.eval_num_samples = eval_num_samples
        self._warned = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.eval_interval == 0 or batch_idx % self.eval_interval != 0:
            return
        if getattr(pl_module, "in_reward_model_stage", False):  # MARLHF evaluates in its RL stage (docs/algorithms.md)
            return
        datamodule = trainer.datamodule
        items = datamodule.eval_items(self.eval_num_samples) if hasattr(datamodule, "eval_items") else []
        if not items:
            if not self._warned:
                log.warning("Evaluation is on (eval_interval=%d) but the data module has no eval set; skipping.",
                            self.eval_interval)
                self._warned = True
            return
        metrics = pl_module.evaluate(items, batch_size=datamodule.eval_batch_size)
        # Straight to the loggers: values self.log'ed in on_train_batch_start would be repeated on later steps.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        # ...and visible to ModelCheckpoint(monitor="eval/turn_1/reward_mean") and early stopping.
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
