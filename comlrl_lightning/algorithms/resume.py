"""What a checkpoint holds of a run beyond the weights, the optimizer and Lightning's loop counters, so that a
``ckpt_path`` resume samples what an uninterrupted run would: ``env_step``, every rank's RNG, the rollout metrics
waiting for the next update's row, the user's stateful objects (``user_state.py``) and the W&B run's identity.

It is saved under ``checkpoint["comlrl_lightning"]``; a family adds its own entries there (the rollout buffer, an
iterative run's folders, MARLHF's reward-model round) in its ``on_save_checkpoint`` after the module's.

A stop in the middle of a step (Ctrl-C / SIGTERM, ``callbacks/checkpoints.py``) throws that step's partial work away:
the checkpoint it writes holds the RNG and the user's objects' states of the last completed step
(:meth:`RunState.mark_completed`, :meth:`RunState.as_last_completed`), not the ones the discarded work moved on.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Mapping

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
        # The RNG and user states after the last completed step (mark_completed); "rng" None: the fit's start, where a
        # resumed run keeps the RNG its seed gave it. What the checkpoint of a stop holds (as_last_completed).
        self.completed: dict[str, Any] = {"rng": None, "user_state": None}
        self._discarding = False

    @property
    def updates_done(self) -> int:
        """The updates that made the module's current weights: ``global_step`` during a fit, the checkpoint's when a
        ``validate``/``test``/``predict`` run loaded one."""
        return max(self.module.global_step, self.checkpoint_step)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's RNG is gathered: Lightning writes rank 0's checkpoint, and each rank samples its own share."""
        module = self.module
        rng = self.completed["rng"] if self._discarding else rng_state()
        return {
            "env_step": module.env_step,
            "rng": rng,
            "rank_rng": ranks.gather(rng) if rng is not None else None,
            "sampled_since_update": list(module.record.pending),
            "user_state": self.completed["user_state"] if self._discarding else save_user_states(module.field_values),
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

    def mark_completed(self, at_fit_start: bool = False) -> None:
        """Remember the RNG and the user's objects' states as they are now, after a completed step (or when
        training starts). ``at_fit_start``: before any phase of the fit, the RNG a loaded checkpoint will restore
        (None for a fresh fit: resuming it starts from the seeded RNG, as the fresh fit did)."""
        rng = self.rng_to_restore if at_fit_start else rng_state()
        self.completed = {"rng": rng, "user_state": save_user_states(self.module.field_values)}

    @contextlib.contextmanager
    def as_last_completed(self) -> Iterator[None]:
        """While a stop's checkpoint is written: :meth:`state_dict` gives the states :meth:`mark_completed` kept."""
        self._discarding = True
        try:
            yield
        finally:
            self._discarding = False

    def restore_rng(self) -> None:
        """At the start of training, after Lightning's own start-up (which may draw random numbers)."""
        if self.rng_to_restore:
            set_rng_state(self.rng_to_restore)
            self.rng_to_restore = None


def changed_fields(saved: Any, current: Mapping[str, Any]) -> list[str]:
    """``name saved -> current`` for every hyper-parameter a run resumed from a checkpoint changed (the checkpoint's
    ``hyper_parameters``: the fields it was trained with)."""
    if not isinstance(saved, Mapping):
        return []
    return [
        f"{key} {saved[key]!r} -> {value!r}" for key, value in current.items() if key in saved and saved[key] != value
    ]


def report_changed_fields(module: Any, checkpoint: Mapping[str, Any]) -> None:
    """A fit resumed with fields that differ from the checkpoint's config goes on with the new values, and says so
    (once, on rank 0): a changed ``num_generations`` or learning rate is not the run the checkpoint continued."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.state.fn != "fit" or ranks.rank() != 0:
        return
    changes = changed_fields(checkpoint.get("hyper_parameters"), dict(module.hparams))
    if changes:
        logging.getLogger(__name__).warning(
            "Resuming %s with fields changed from the checkpoint's config: %s (the run goes on with the new values).",
            trainer.ckpt_path or "a checkpoint",
            "; ".join(changes),
        )
