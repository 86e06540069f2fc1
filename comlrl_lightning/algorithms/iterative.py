"""Iterative preference learning: rounds of collect → replay → train (docs/iterative.md).

A preference module's rounds are one :class:`Rounds` object (``module.rounds``) that MADPOIter and MARLHFIter
compose (``rounds_class = Rounds``); MADPO and MARLHF have none. One round ν:

1. **Collect** — the data side (``PreferenceDataModule`` with ``data/rounds.py``), from the plan this module
   hands it (``module.pairs.plan()``: the team policy, the comparator, the replay rules): per task the current
   agents sample K_c candidates, the comparator K_cmp; both sides are scored by the oracle (the task reward after
   ``reward_processor``, or MARLHFIter's previous reward model); candidate k of one side meets candidate k of the
   other, either side can win, ties are dropped, ``pair_selection`` and ``preference_pairs_per_sample`` choose.
2. **Shard**: ``<preference_replay_dir>/iteration_{ν+1:04d}.json``, written atomically, also for empty rounds.
3. **Replay**: the round's training pairs by ``preference_replay_mode``.
4. **Train** (this module): MADPO: ``dpo_epochs_per_round`` passes over them; MARLHF: a fresh reward model on
   them, then ``rl_epochs_per_round`` RL epochs on the task set with it.
5. **Checkpoint** the policy (``PolicyCheckpoints``) when ``policy_checkpoint_dir`` is set or the comparator is
   ``history``; ``RoundMetrics`` logs ``iter/*`` (and reward distributions) when a round's pairs are ready.

Lightning mapping: a round is ``epochs_per_iteration`` Lightning epochs (MADPOIter 1, MARLHFIter 1 + RL
epochs), so ``trainer.max_epochs`` is set to ``num_iterations × epochs_per_iteration``; loggers, callbacks and
checkpoints see every round. The replay index and the comparator's random stream live in the data module's state,
the policy checkpoints' directory in the module's, so ``ckpt_path`` resume continues exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comlrl_lightning.agents import check_model_sources
from comlrl_lightning.algorithms.fields import (
    ComparatorFields,
    FieldGroup,
    PreferenceFields,
    ReplayFields,
    default_of,
    require,
)
from comlrl_lightning.core.distributions import reward_range_of
from comlrl_lightning.core.replay import IterativePairSelection, select_comparison_pairs
from comlrl_lightning.data.preferences import PairPlan
from comlrl_lightning.data.rounds import ComparatorSpec, RoundPlan
from comlrl_lightning.rollout.centralized import TaggedCentralizedAdapter, check_adapter
from comlrl_lightning.runs.files import RunDirectories

log = logging.getLogger(__name__)


@dataclass
class IterativePreferenceFields(PreferenceFields):
    """The iterative variants' candidates and pairs: fewer candidates, and pairs against the comparator.

    Args:
        preference_num_candidates: completions each agent samples per task (the iterative variants' default: 20).
        preference_pairs_per_sample: pairs kept per task (the iterative variants' default: 4).
        pair_selection: how comparisons become pairs: ``comparator_reward`` (current vs comparator, either side
            can win; the iterative variants' default), ``reward_gap``, ``random`` or ``all``.
    """

    preference_num_candidates: int = 20
    preference_pairs_per_sample: int | None = default_of(select_comparison_pairs, "limit")
    pair_selection: IterativePairSelection = default_of(select_comparison_pairs, "selection")


def iterative_groups(groups: tuple[type[FieldGroup], ...]) -> tuple[type[FieldGroup], ...]:
    """A preference module's field groups for its iterative variant: the iterative pairs, rounds and comparator."""
    swapped = tuple(IterativePreferenceFields if g is PreferenceFields else g for g in groups)
    return (*swapped, ReplayFields, ComparatorFields)


class Rounds:
    """``module.rounds`` of an iterative variant: collect → shard → replay → train, round after round (module
    docstring). The module (MADPOIter or MARLHFIter, whose ``module.pairs`` creates it) keeps its fields (the
    ``ReplayFields`` and ``ComparatorFields`` groups, ``iterative_groups``) and ``epochs_per_iteration``; this object
    checks the comparator, fixes the fit's epochs, adds the round callbacks, extends the module's pair plan with the
    rounds and keeps the policy checkpoints' directory (in the module's checkpoint)."""

    def __init__(self, module: Any):
        self.module = module
        self.run_dirs = RunDirectories()  # the policy checkpoints' directory, kept in checkpoints

    @property
    def api_config(self):
        """The ``api`` comparator's client settings (``ComparatorFields``), None for the other comparators."""
        return self.module.group(ComparatorFields).api_config

    def check(self) -> None:
        """The comparator's rules against the team, and the reward-distribution range, before any model loads."""
        m = self.module
        roles = m.collaboration.num_roles if m.collaboration is not None else m.num_agents
        self.check_comparator(roles, centralized_team=m.collaboration is not None)
        if m.log_reward_distribution:
            reward_range_of(m.reward_func)  # the histograms' range: fails now, not at the end of round 1

    def check_comparator(self, roles: int, centralized_team: bool) -> None:
        """The rules that involve the team: ``roles`` comparator roles; a centralized team (one joint actor)."""
        m = self.module
        index = m.comparator_centralized_agent_index
        if m.comparator_generation_mode == "centralized":
            require(index >= 0, "comparator_centralized_agent_index must be >= 0.")
            require(index < roles, "comparator_centralized_agent_index must be smaller than num_agents.")
        if centralized_team:  # one joint actor: its comparator answers the same joint prompt, keeping joint text
            require(index == 0, "Centralized collaboration has only actor index 0.")
            m.comparator_generation_mode = "centralized"
        named_model = m.comparator_model_name is not None or m.comparator_agents is not None
        if m.comparator_policy == "model":
            require(
                named_model, "comparator_model_name or comparator_agents is required when comparator_policy='model'."
            )
            agents = m.comparator_agents
            require(
                agents is None or (isinstance(agents, (list, tuple)) and len(agents) in (1, roles)),
                f"comparator_agents must list 1 or num_agents ({roles}) models.",
            )
            check_model_sources(agents, "comparator_agents")
            check_model_sources(m.comparator_model_name, "comparator_model_name")
            tokenizers = m.comparator_tokenizers
            require(
                not isinstance(tokenizers, (list, tuple)) or len(tokenizers) in (1, roles),
                f"comparator_tokenizers must list 1 or num_agents ({roles}) tokenizers "
                f"(got {len(tokenizers) if isinstance(tokenizers, (list, tuple)) else 0}).",
            )
        else:
            require(
                not named_model,
                "comparator_model_name and comparator_agents are only valid when comparator_policy='model'.",
            )
            require(
                m.comparator_tokenizers is None,
                "comparator_tokenizers is only valid when comparator_policy='model'.",
            )
        if m.comparator_policy == "history":
            m.comparator_history_k = 1 if m.comparator_history_k is None else m.comparator_history_k
            require(m.comparator_history_k >= 1, "comparator_history_k must be >= 1.")
        else:
            require(
                m.comparator_history_k is None,
                "comparator_history_k is only valid when comparator_policy='history'.",
            )
        m.centralized_comparator_adapter = check_adapter(
            m.centralized_comparator_adapter or TaggedCentralizedAdapter(), "centralized_comparator_adapter"
        )

    # ------------------------------------------------------------------ rounds and directories
    @property
    def iteration(self) -> int:
        """0-based round of the current Lightning epoch."""
        return self.module.current_epoch // self.module.epochs_per_iteration

    @property
    def checkpoints_policy(self) -> bool:
        return self.module.policy_checkpoint_dir is not None or self.module.comparator_policy == "history"

    def run_dir(self, name: str, explicit: str | None = None) -> Path:
        """``explicit`` if given, else ``<trainer.log_dir or default_root_dir>/<name>``; absolute, created."""
        return self.run_dirs.get(self.module.trainer, name, explicit)

    def fit_epochs(self) -> int:
        """A fit is ``num_iterations`` rounds of ``epochs_per_iteration`` epochs (the CLI sets max_epochs to it)."""
        return self.module.num_iterations * self.module.epochs_per_iteration

    def fix_epochs(self, trainer: Any) -> None:
        """A fit runs :meth:`fit_epochs` epochs, whatever ``trainer.max_epochs`` says (a warning says so)."""
        m, epochs = self.module, self.fit_epochs()
        if trainer.max_epochs not in (None, -1, 1000, epochs):
            log.warning(
                "%s runs num_iterations=%d rounds of %d epoch(s): trainer.max_epochs=%s is replaced by %d.",
                m.algorithm_name,
                m.num_iterations,
                m.epochs_per_iteration,
                trainer.max_epochs,
                epochs,
            )
        trainer.fit_loop.max_epochs = epochs

    def callbacks(self) -> list[Any]:
        """``PolicyCheckpoints`` (when the policy is checkpointed) and ``RoundMetrics``."""
        from comlrl_lightning.callbacks import PolicyCheckpoints, RoundMetrics

        m = self.module
        reward_range = reward_range_of(m.reward_func) if m.log_reward_distribution else None
        return ([PolicyCheckpoints()] if self.checkpoints_policy else []) + [RoundMetrics(reward_range)]

    def state_dict(self) -> dict[str, Any]:
        return {"run_dirs": self.run_dirs.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_dirs.load_state_dict(state["run_dirs"])

    # ------------------------------------------------------------------ what the data side collects
    def extend(self, plan: PairPlan) -> PairPlan:
        """The module's pair plan plus the rounds: comparator, replay and where the history comparator reads."""
        m = self.module
        plan.rounds = RoundPlan(
            num_rounds=m.num_iterations,
            epochs_per_round=m.epochs_per_iteration,
            comparator=self.comparator_spec(),
            num_candidates=plan.num_candidates,
            selection=plan.selection,
            limit=plan.limit,
            replay_mode=m.preference_replay_mode,
            replay_k=m.preference_replay_k,
            replay_lambda=m.preference_replay_lambda,
            replay_sample_size=m.preference_replay_sample_size,
            replay_dir=m.preference_replay_dir,
            history_dir=self.run_dir("policy_checkpoints", m.policy_checkpoint_dir)
            if self.checkpoints_policy
            else None,
        )
        return plan

    def comparator_spec(self) -> ComparatorSpec:
        """The ``comparator_*`` fields as the data side needs them."""
        m = self.module
        return ComparatorSpec(
            kind=m.comparator_policy,
            model_sources=m.comparator_agents or [m.comparator_model_name],
            model_tokenizers=m.comparator_tokenizers,
            model_field="comparator_agents" if m.comparator_agents else "comparator_model_name",
            devices=m.comparator_devices or m.team.devices,
            num_candidates=m.comparator_num_candidates,
            history_k=m.comparator_history_k or 1,
            keep_loaded=m.keep_comparator_loaded,
            api_config=self.api_config,
            centralized=m.comparator_generation_mode == "centralized",
            centralized_index=m.comparator_centralized_agent_index,
            adapter=m.centralized_comparator_adapter,
        )
