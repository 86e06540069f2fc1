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
each Lightning epoch is one pass over the pairs in batches of ``train_batch_size`` pairs, one update each
(``MADPO.update``). An update scores its pairs in micro-batches of at most ``micro_batch_size`` pairs and
``micro_batch_tokens`` tokens per forward (a pair is its winner and loser rows); each micro-batch's loss is its share
of the batch mean, so the gradient is the one forward's over every pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
from torch import Tensor

from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.fields import FieldGroup, JointActionFields, PreferenceFields, require
from comlrl_lightning.algorithms.iterative import Rounds, iterative_groups
from comlrl_lightning.algorithms.objective import Objective
from comlrl_lightning.algorithms.pairs import Pairs, pair_micro_batches
from comlrl_lightning.core.losses import assert_finite, madpo_loss
from comlrl_lightning.core.pairs import PreferencePair
from comlrl_lightning.rollout.sampling import collate_rows, shares_prompts, take, token_logprobs


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
    """MADPO's objective (module docstring): the team margin Δ = Σ_i Δ_i of each pair in −log σ(η·Δ), η =
    ``dpo_beta``."""

    def __init__(self, dpo_beta: float = 0.1):
        self.dpo_beta = dpo_beta

    def loss(self, margins: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``margins`` [P, N]: Δ_{p,i}, agent i's sequence log-likelihood margin (winner − loser) on pair p. Returns
        mean_p −log σ(η·Σ_i Δ_{p,i}) and the pairs' detached means: ``loss``, ``dpo/accuracy`` (share of pairs with
        Δ > 0), ``dpo/joint_margin_mean`` and ``agent_<i>/margin_mean`` (a loop that splits a batch weights each
        part's by its share of the pairs, so they add up to the batch's)."""
        loss, diagnostics = madpo_loss(margins, self.dpo_beta)
        metrics = {
            "loss": diagnostics["loss"],
            "dpo/accuracy": diagnostics["accuracy"],
            "dpo/joint_margin_mean": diagnostics["joint_margin_mean"],
        }
        for i in range(margins.shape[1]):
            metrics[f"agent_{i}/margin_mean"] = diagnostics[f"margin_mean_agent_{i}"]
        return loss, metrics


class MADPO(MultiAgentModule):
    """Multi-agent DPO on preference pairs collected from the agents and scored by the task reward.

    Training metrics: ``loss``, ``dpo/accuracy`` (share of pairs with Δ > 0), ``dpo/joint_margin_mean``,
    ``agent_<i>/margin_mean``, ``dpo/reward_gap_mean``, ``dpo/num_pairs``, ``turn_1/reward_mean`` (mean candidate
    reward at collection, CoMLRL's metric) — and the task reward of the current agents under ``eval/``.
    """

    algorithm_name = "MADPO"
    field_groups = (*MultiAgentModule.field_groups, JointActionFields, PreferenceFields, DPOFields)
    objective_class = JointDPO
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

    def update(self, pairs: list[PreferencePair]) -> dict[str, float]:
        """One MADPO update (one optimizer step, one ``global_step``) on a batch of pairs; the batch's loss is the
        mean over its pairs whichever micro-batches score them."""
        with self.record.timed("update"):
            (stepping,) = self.agent_schedule.stages()  # every trained agent, or an alternating block's
            step = self.begin_update(len(pairs), agents=stepping)
            # 1. The pairs were collected and scored by the data side (module docstring): each holds every agent's
            #    prompt, winner and loser token ids.
            for rows in self.pair_micro_batches(pairs):
                chunk = take(pairs, rows)
                # 2. Every agent's margins Δ_i on the micro-batch's pairs (one forward per agent over its winner and
                #    loser rows; an agent that does not step now adds its margin without gradients), gathered on
                #    this module's device (parallel_training: mp puts agents elsewhere).
                margins = torch.stack([self.margins_of(i, chunk, i in stepping) for i in range(self.num_agents)], dim=1)
                # 3. The joint loss −log σ(η·Σ_i Δ_i), the micro-batch's share of the batch mean, backward (the
                #    agents are coupled through the team margin: their graphs are alive together until here).
                loss, metrics = self.objective.loss(margins)
                share = len(chunk) / len(pairs)
                assert_finite("MADPO loss", loss, step=self.global_step)
                step.backward(loss * share, {key: value * share for key, value in metrics.items()})
            # 4. Clip and step.
            metrics = step.finish()
            self.agent_schedule.advance()
            # 5. What the batch itself says: the oracle's reward gap and the candidates' mean reward at collection.
            batch_metrics = {**self.pair_metrics(pairs), **self.agent_schedule.metrics(stepping)}
        return {**metrics, **batch_metrics, **self.record.take_timings()}

    def pair_micro_batches(self, pairs: Sequence[PreferencePair]) -> list[slice | Tensor]:
        """The pairs of each forward of an update: ``micro_batch_size`` pairs at most (a pair is two rows, its
        winner and loser) and, with ``micro_batch_tokens``, at most that many tokens in every agent's forward (a
        prompt shared by several rows counted once; each pair priced at its longest agent's prompt and the batch's
        longest completion, so the budget holds for every agent). ``pairs.pair_micro_batches`` plans them."""
        if self.micro_batch_tokens is None or not pairs:
            return pair_micro_batches(len(pairs), self.micro_batch_size)
        n = self.num_agents
        return pair_micro_batches(
            len(pairs),
            self.micro_batch_size,
            self.micro_batch_tokens,
            prompt_lengths=[max(len(p.prompt_ids[i]) for i in range(n)) for p in pairs],
            width=max(len(ids) for p in pairs for ids in (*p.winner_ids, *p.loser_ids)),
            groups=[tuple(p.prompts) for p in pairs],
            share_prompts=all(shares_prompts(self.policy_model(i)) for i in range(n)),
        )

    def margins_of(self, agent: int, pairs: Sequence[PreferencePair], learns: bool) -> Tensor:
        """:meth:`agent_margins` on this module's device, with gradients when the agent ``learns`` in this update."""
        with torch.set_grad_enabled(learns):
            return self.agent_margins(agent, pairs).to(self.device)

    def agent_margins(self, agent: int, pairs: Sequence[PreferencePair]) -> Tensor:
        """Δ_i per pair: Σ_t log π_i over the winner's generated tokens minus the loser's, one batched forward."""
        prompts = [p.prompt_ids[agent] for p in pairs] * 2
        completions = [p.winner_ids[agent] for p in pairs] + [p.loser_ids[agent] for p in pairs]
        inputs = collate_rows(
            prompts,
            [c[None] for c in completions],
            [torch.ones(1, len(c), dtype=torch.bool) for c in completions],
            self.tokenizers[agent].pad_token_id,
        )
        sequence_logp = token_logprobs(self.policy_model(agent), inputs).sum(-1)  # [2P]
        return sequence_logp[: len(pairs)] - sequence_logp[len(pairs) :]

    def pair_metrics(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        """``dpo/reward_gap_mean`` (the oracle's winner − loser reward), ``dpo/num_pairs`` and ``turn_1/reward_mean``
        (the mean candidate reward at collection) of a batch of pairs (none for an empty one)."""
        if not pairs:
            return {}
        return {
            "dpo/reward_gap_mean": sum(p.winner_reward - p.loser_reward for p in pairs) / len(pairs),
            "dpo/num_pairs": float(len(pairs)),
            "turn_1/reward_mean": sum(p.candidate_reward_mean for p in pairs) / len(pairs),
        }

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
    rounds_class = Rounds
    epochs_per_iteration = 1

    @property
    def pair_passes(self) -> int:
        """DPO passes over the round's pairs, served in one epoch."""
        return self.dpo_epochs_per_round
