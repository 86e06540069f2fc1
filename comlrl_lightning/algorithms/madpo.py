"""MADPO: multi-agent direct preference optimization (arXiv:2508.04652; docs/algorithms.md).

Users give tasks, not preferences. For each task the agents sample ``preference_num_candidates`` (K_c)
completions each; joint candidate k pairs every agent's k-th sample (aligned); the oracle — the task reward after
``reward_processor`` — scores each joint candidate, and score differences become preference pairs (ties dropped,
``pair_selection`` and ``preference_pairs_per_sample`` choose which). Pairs keep the sampled token ids.

Per pair (w, l) and agent i, Δ_i = log π_i(a_i^w | h_i) − log π_i(a_i^l | h_i) over every generated token up to
and including EOS; the team margin Δ = Σ_i Δ_i and the loss is −log σ(η·Δ), η = ``dpo_beta``. Each agent's
gradient is −η·σ(−ηΔ)·∇Δ_i: the team margin sets the weight, the agent's own margin the direction. CoMLRL gets
this by stepping agents one after another with the others' margins detached; we take one simultaneous step on
the joint loss, whose gradient with respect to each agent's weights is the same. No reference model.

Collection happens in ``PreferenceDataModule.train_dataloader`` from the current agents (once per fit), with what
the module hands the data module when the fit starts (``module.pairs``, ``pairs.py``: the team policy and the
selection rules);
each Lightning epoch is one pass over the pairs in batches of ``train_batch_size`` pairs, one update each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Sequence

import torch
from torch import Tensor

from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.fields import FieldGroup, JointActionFields, PreferenceFields, require
from comlrl_lightning.algorithms.iterative import Rounds, iterative_groups
from comlrl_lightning.algorithms.objective import Objective
from comlrl_lightning.algorithms.pairs import Pairs
from comlrl_lightning.core.losses import assert_finite, madpo_loss
from comlrl_lightning.core.pairs import PAIR_SELECTIONS, PreferencePair
from comlrl_lightning.core.replay import ITERATIVE_PAIR_SELECTIONS
from comlrl_lightning.rollout.sampling import collate_rows, token_logprobs


@dataclass
class DPOFields(FieldGroup):
    """MADPO's update.

    Args:
        dpo_beta: eta, the inverse temperature of the joint-margin loss.
        use_environment_step: count ``environment_steps_per_pair`` env steps per trained pair.
        environment_steps_per_pair: env steps one pair stands for (two joint actions).
        train_batch_size: pairs per update.
    """

    dpo_beta: float = 0.1
    use_environment_step: bool = True
    environment_steps_per_pair: int = 2
    train_batch_size: int = 2

    def check(self) -> None:
        require(self.dpo_beta > 0, "dpo_beta must be > 0.")
        require(self.environment_steps_per_pair >= 1, "environment_steps_per_pair must be >= 1.")
        require(self.train_batch_size >= 1, "train_batch_size must be >= 1.")


class JointDPO(Objective):
    """MADPO's objective (module docstring): the team margin Δ = Σ_i Δ_i of each pair in −log σ(η·Δ)."""

    def __init__(self, host: Any):
        super().__init__(host)
        self.margins: list[Tensor] = []  # [P, N] per micro-batch of the current update

    def losses(self, pairs: list[PreferencePair]) -> Iterator[tuple[Tensor, dict[str, Tensor]]]:
        """Per micro-batch of pairs: every agent's margins (gathered on this module's device) in one joint loss
        (the agents are coupled through the team margin, so a micro-batch's graphs are alive together)."""
        m = self.host
        step = m.micro_batch_size or len(pairs)
        self.margins = []
        for start in range(0, len(pairs), step):
            chunk = pairs[start : start + step]
            # with parallel_training="mp" each agent's margins live on its own device: gather them on ours
            margins = torch.stack([self.agent_margins(i, chunk).to(m.device) for i in range(m.num_agents)], dim=1)
            loss, _ = madpo_loss(margins, m.dpo_beta)
            loss = loss * (len(chunk) / len(pairs))  # the batch loss is a mean over its pairs
            assert_finite("MADPO loss", loss, step=m.global_step)
            self.margins.append(margins.detach())
            yield loss, {"loss": loss.detach()}

    def batch_metrics(self, pairs: list[PreferencePair]) -> dict[str, float]:
        margins = torch.cat(self.margins).float().cpu()  # [P, N], from this update's forwards
        _, diagnostics = madpo_loss(margins, self.host.dpo_beta)
        candidate_mean = sum(p.candidate_reward_mean for p in pairs) / len(pairs)
        metrics = {
            "dpo/accuracy": float(diagnostics["accuracy"]),
            "dpo/joint_margin_mean": float(diagnostics["joint_margin_mean"]),
            "dpo/reward_gap_mean": sum(p.winner_reward - p.loser_reward for p in pairs) / len(pairs),
            "dpo/num_pairs": float(len(pairs)),
            "turn_1/reward_mean": candidate_mean,
        }
        for i in range(self.host.num_agents):
            metrics[f"agent_{i}/margin_mean"] = float(margins[:, i].mean())
        return metrics

    def agent_margins(self, agent: int, pairs: Sequence[PreferencePair]) -> Tensor:
        """Δ_i per pair: Σ_t log π_i over the winner's generated tokens minus the loser's, one batched forward."""
        prompts = [p.prompt_ids[agent] for p in pairs] * 2
        completions = [p.winner_ids[agent] for p in pairs] + [p.loser_ids[agent] for p in pairs]
        inputs = collate_rows(
            prompts,
            [c[None] for c in completions],
            [torch.ones(1, len(c), dtype=torch.bool) for c in completions],
            self.host.tokenizers[agent].pad_token_id,
        )
        sequence_logp = token_logprobs(self.host.policy_model(agent), inputs).sum(-1)  # [2P]
        return sequence_logp[: len(pairs)] - sequence_logp[len(pairs) :]


class MADPO(MultiAgentModule):
    """Multi-agent DPO on preference pairs collected from the agents and scored by the task reward.

    Training metrics: ``loss``, ``dpo/accuracy`` (share of pairs with Δ > 0), ``dpo/joint_margin_mean``,
    ``dpo/reward_gap_mean``, ``dpo/num_pairs``, ``turn_1/reward_mean`` (mean candidate reward at collection,
    CoMLRL's metric) — and the task reward of the current agents under ``eval/``.
    """

    algorithm_name = "MADPO"
    field_groups = (*MultiAgentModule.field_groups, JointActionFields, PreferenceFields, DPOFields)
    objective_class = JointDPO
    pair_selections = PAIR_SELECTIONS
    rounds_class: ClassVar[type[Rounds] | None] = None  # the iterative variant: Rounds (module.rounds)
    keep_comparator_loaded = True  # an iterative variant's 'model' comparator stays loaded between rounds
    pair_passes = 1  # DPO passes over the pairs in one epoch

    def check_config(self) -> None:
        super().check_config()
        self.pairs = Pairs(self, self.train_batch_size, self.pair_passes)  # what the data module collects
        self.rounds = self.pairs.rounds
        self.pairs.check()
        self.pairs.check_rounds()

    def training_step(self, batch: list[PreferencePair], batch_idx: int):
        if self.pairs.is_empty_round(batch):
            return
        metrics = self.update(batch)
        if self.use_environment_step:
            self.count_env_steps(self.environment_steps_per_pair * len(batch))
        self.pairs.last_batch = batch
        self.record.log_step([metrics], progress={"dpo_acc": "dpo/accuracy", "loss": "loss"})

    def completion_records(self, max_nodes: int) -> list[dict[str, Any]]:
        return self.pairs.records(max_nodes)

    def parts(self) -> list[Any]:
        return [self.pairs]  # its setup, callbacks, data attachment and checkpoint entry run with the module's


@dataclass
class MADPOIterFields(FieldGroup):
    """MADPOIter's rounds.

    Args:
        dpo_epochs_per_round: DPO passes over each round's pairs (CoMLRL's MADPOIterConfig calls it
            ``num_train_epochs``).
    """

    dpo_epochs_per_round: int = 1

    def check(self) -> None:
        require(self.dpo_epochs_per_round >= 1, "dpo_epochs_per_round must be >= 1.")


class MADPOIter(MADPO):
    """Iterative MADPO: ``num_iterations`` rounds of collect (current agents vs a comparator) → replay shard →
    ``dpo_epochs_per_round`` DPO passes over the round's replayed pairs. One round is one Lightning epoch
    (``trainer.max_epochs`` is set to ``num_iterations``). The round machinery, comparators and replay are in
    ``algorithms/iterative.py`` (docs/iterative.md); the DPO update is MADPO's.
    """

    algorithm_name = "MADPOIter"
    field_groups = (*iterative_groups(MADPO.field_groups), MADPOIterFields)
    pair_selections = ITERATIVE_PAIR_SELECTIONS
    rounds_class = Rounds
    epochs_per_iteration = 1

    @property
    def pair_passes(self) -> int:
        """DPO passes over the round's pairs, served in one epoch."""
        return self.dpo_epochs_per_round
