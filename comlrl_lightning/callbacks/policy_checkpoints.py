"""Policy checkpoints of iterative preference training (docs/iterative.md, step 6 of a round), read by the
``history`` comparator.

``<policy_checkpoint_dir>/initial/`` before the first round and ``iteration_{ν:04d}/`` (0-based, CoMLRL's names)
after round ν, also after an empty round; each holds ``agent_i/`` (``save_pretrained`` weights and tokenizer).
They are policies only — no optimizer or RNG state: resume training from Lightning checkpoints.
"""

from __future__ import annotations

import logging

from lightning.pytorch import Callback

from comlrl_lightning.agents import save_agents
from comlrl_lightning.agents.sharding import full_state_dicts
from comlrl_lightning.runs import ranks

log = logging.getLogger(__name__)


class PolicyCheckpoints(Callback):
    """Added by the iterative modules when ``policy_checkpoint_dir`` is set or the comparator is ``history``."""

    def on_fit_start(self, trainer, pl_module) -> None:
        # Before the fit loop: round 0's collection (which may need ``initial``) runs before on_train_start.
        target = pl_module.rounds.run_dir("policy_checkpoints", pl_module.policy_checkpoint_dir) / "initial"
        if not ranks.broadcast(target.exists()):  # a resumed run keeps the initial policy of its first start
            self.save(pl_module, target.name)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if (trainer.current_epoch + 1) % pl_module.epochs_per_iteration == 0:
            self.save(pl_module, f"iteration_{pl_module.rounds.iteration:04d}")

    @staticmethod
    def save(pl_module, label: str) -> None:
        """Written once, by rank 0, with sharded agents gathered on every rank; every rank waits for the files."""
        target = pl_module.rounds.run_dir("policy_checkpoints", pl_module.policy_checkpoint_dir) / label
        models = [pl_module.policy_model(i) for i in range(pl_module.num_agents)]
        states = full_state_dicts(models)
        with ranks.rank_zero_first() as writer:
            if writer:
                save_agents(models, pl_module.tokenizers, target, state_dicts=states)
                log.info("policy checkpoint %s", target)
