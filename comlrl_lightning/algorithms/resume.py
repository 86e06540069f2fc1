"""What a checkpoint holds of a run beyond the weights, the optimizer and Lightning's loop counters, so that a
``ckpt_path`` resume samples what an uninterrupted run would: ``env_step``, every rank's RNG, the rollout metrics
waiting for the next update's row, the user's stateful objects (``user_state.py``) and the W&B run's identity.

It is saved under ``checkpoint["comlrl_lightning"]``; a family adds its own entries there (the rollout buffer, an
iterative run's folders, MARLHF's reward-model round) in its ``on_save_checkpoint`` after the module's.
"""

from __future__ import annotations

from typing import Any, Mapping

from comlrl_lightning.algorithms.user_state import load_user_states, save_user_states
from comlrl_lightning.callbacks.checkpoints import wandb_identity
from comlrl_lightning.rollout.seeding import rng_state, set_rng_state
from comlrl_lightning.runs import ranks


class RunState:
    """``module.run_state``: the module's resume state, with ``state_dict``/``load_state_dict``."""

    def __init__(self, module: Any):
        self.module = module
        self.checkpoint_step = 0  # the updates behind a loaded checkpoint's weights (what validate/test report)
        self.rng_to_restore: Any = None

    @property
    def updates_done(self) -> int:
        """The updates that made the module's current weights: ``global_step`` during a fit, the checkpoint's when a
        ``validate``/``test``/``predict`` run loaded one."""
        return max(self.module.global_step, self.checkpoint_step)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's RNG is gathered: Lightning writes rank 0's checkpoint, and each rank samples its own share."""
        module = self.module
        return {
            "env_step": module.env_step,
            "rng": rng_state(),
            "rank_rng": ranks.gather(rng_state()),
            "sampled_since_update": list(module.record.pending),
            "user_state": save_user_states(module.field_values),
            "wandb": wandb_identity(module.loggers),
        }

    def load_state_dict(self, state: Mapping[str, Any], global_step: int) -> None:
        module = self.module
        module.env_step = int(state.get("env_step", 0))
        self.checkpoint_step = int(global_step)
        module.record.pending = [dict(m) for m in state.get("sampled_since_update", [])]
        load_user_states(module.field_values, state.get("user_state"))  # the user's stateful reward, logger, ...
        per_rank = state.get("rank_rng") or [state.get("rng")]
        # A run with more processes than the checkpointed one: the extra ranks keep their own seeded streams.
        self.rng_to_restore = per_rank[ranks.rank()] if ranks.rank() < len(per_rank) else None

    def restore_rng(self) -> None:
        """At the start of training, after Lightning's own start-up (which may draw random numbers)."""
        if self.rng_to_restore:
            set_rng_state(self.rng_to_restore)
            self.rng_to_restore = None
