"""Writes what the agents said: ``completions.jsonl`` in the run's log directory (and a W&B table)."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from comlrl_lightning.runs.files import run_root


class CompletionsLogger(Callback):
    """After every training batch, one line per record of ``pl_module.completion_records(max_nodes)``: step (the
    updates done when the samples were drawn — the step of the metrics row that holds them; by default the updates
    done when the batch started), env_step, turn, each agent's prompt and completions, and the team rewards."""

    def __init__(self, max_nodes: int = 2, filename: str = "completions.jsonl"):
        self.max_nodes = max_nodes
        self.filename = filename
        self.path: Path | None = None
        self._step = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._step = trainer.global_step

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        rows = [{"step": self._step, **r} for r in pl_module.completion_records(self.max_nodes)]
        if not rows:
            return
        if self.path is None:
            self.path = run_root(trainer) / self.filename
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and rows:
                data = [
                    [r["step"], r["turn"], i, p, c, r["rewards"][0]]
                    for r in rows
                    for i, (p, cs) in enumerate(zip(r["prompts"], r["completions"]))
                    for c in cs[:1]
                ]
                logger.log_text(
                    "completions",
                    columns=["step", "turn", "agent", "prompt", "completion", "reward"],
                    data=data,
                    step=trainer.global_step,
                )
