"""A callback for the data-parallel tests (``tests/test_scale_out.py``): what each rank saw and held, written to
``$PROBE_DIR/rank_<r>.json`` when the fit ends."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback


def weights_digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if hasattr(tensor, "full_tensor"):  # a shard of an FSDP-sharded parameter: the whole parameter
            tensor = tensor.full_tensor()
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Probe(Callback):
    def __init__(self):
        self.steps, self.items = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.items.append([item_key(x) for x in batch])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollout = getattr(pl_module, "last_rollout", None)
        local = None
        if rollout is not None and len(batch) and hasattr(rollout, "levels"):
            local = float(torch.cat([n.rewards for n in rollout.levels[0]]).mean())
        self.steps.append(
            {
                "epoch": trainer.current_epoch,
                "batch_idx": batch_idx,
                "global_step": trainer.global_step,
                "env_step": pl_module.env_step,
                "digest": weights_digest(pl_module),
                "local_reward_mean": local,
                "batch_size": len(batch),
                "logged": {k: float(v) for k, v in trainer.logged_metrics.items() if v.numel() == 1},
            }
        )

    def on_train_end(self, trainer, pl_module):
        if os.environ.get("EXPORT_DIR"):  # every rank calls it (sharded models are gathered); rank 0 writes
            pl_module.save_pretrained(os.environ["EXPORT_DIR"])
        out = Path(os.environ["PROBE_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "steps": self.steps,
            "items": self.items,
            "final_digest": weights_digest(pl_module),
        }
        (out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))


def item_key(item) -> str:
    if hasattr(item, "prompts"):  # a preference pair
        return json.dumps([item.prompts, item.winner_completions, item.loser_completions])
    return json.dumps(item, sort_keys=True, default=str)
