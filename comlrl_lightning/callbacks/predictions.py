"""Writes what a trained team answers (the ``predict`` subcommand): ``predictions.jsonl`` in the run's log directory."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch.callbacks import BasePredictionWriter

from comlrl_lightning.runs.files import run_root


class PredictionWriter(BasePredictionWriter):
    """One JSON line per item, after every predict batch: the item, each agent's prompts and completions per turn
    and the team reward per turn (``MultiAgentModule.predict_step``). A data-parallel run writes one file per rank
    (``predictions.rank<r>.jsonl``), each with that rank's share of the items."""

    def __init__(self, filename: str = "predictions.jsonl"):
        super().__init__(write_interval="batch")
        self.filename = filename
        self.path: Path | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "predict":
            return
        name = (
            self.filename
            if trainer.world_size == 1
            else self.filename.replace(".jsonl", f".rank{trainer.global_rank}.jsonl")
        )
        self.path = run_root(trainer) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")  # a new predict run replaces the file

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx: int, dataloader_idx: int
    ) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            for row in prediction:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
