"""MAGRPO and the critic-free multi-agent REINFORCE family (arXiv:2508.04652; docs/algorithms.md).

For every dataset item the N agents build a rollout tree (``rollout/tree.py``): at each node every agent samples
K completions, joint actions get one team reward, and the return of a joint action is its reward plus the
discounted mean return of its child node. Agent i's K completions at a node form one group:

    G'_k = G_k − β·KL_k                       (reference KL on the returns, ``reference_kl_placement="reward"``)
    A_k  = normalize(G'_k − b(G'))            b = the baseline registered as ``advantage_mode``: mean (MAGRPO),
                                              leave-one-out mean (MARLOO), group max (MAReMax), 0 (MAREINFORCE)
    L_i  = Σ_{k,t} w_{k,t} · (−A_k · log π_i(y_{k,t} | x, y_{k,<t}))      w: ``loss_aggregation``

No importance ratio, no clipping, no entropy bonus (the paper's objective). Log-probs cover exactly the
generated tokens up to and including EOS (CoMLRL skips the last token and scores padding; we do not).

One update (``OnPolicyModule`` schedules them; :class:`GroupRelative` is the objective, ``module.objective``): for
each agent, for each micro-batch of its rows, log-probs -> ``policy_loss`` -> backward. To change the baseline,
register one (``core.advantages.register_baseline``); the advantage computation is ``GroupRelative.advantages``,
the per-agent loss ``GroupRelative.policy_loss`` (docs/new_algorithm.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from comlrl_lightning.algorithms.fields import FieldGroup, require
from comlrl_lightning.algorithms.objective import Objective
from comlrl_lightning.algorithms.on_policy import OnPolicyModule
from comlrl_lightning.core.advantages import BASELINES, compute_advantages
from comlrl_lightning.core.losses import (
    assert_finite,
    importance_sampling_weights,
    kl_estimate,
    policy_gradient_loss,
    token_loss_weights,
)
from comlrl_lightning.rollout.sampling import (
    ScoringInputs,
    select_rows,
    token_logprobs,
    trim_prompt_padding,
)
from comlrl_lightning.rollout.tree import Node


@dataclass
class PolicyBatch:
    """One agent's rows of a mini-batch: inputs, per-row advantages, loss weights, stored log-probs."""

    inputs: ScoringInputs
    advantages: Tensor  # [B]
    weights: Tensor  # [B, T]
    ref_logprobs: Tensor | None  # [B, T] the reference policy's (reference KL in the loss)
    old_logprobs: Tensor | None = None  # [B, T] the sampling policy's (a PPO-style subclass stores them)
    engine_logprobs: Tensor | None = None  # [B, T] the inference engine's, where one sampled (vLLM)
    fresh: Tensor | None = None  # [B] bool: sampled by the weights this update starts from (policy lag 0)
    entropy: Tensor | None = None  # [B, T] the policy's entropy per position (``needs_token_entropy``), with grad
    extras: dict[str, Tensor] = field(default_factory=dict)  # [B, ...] the samples' ``AgentSamples.extras``

    def rows(self, sl: slice) -> "PolicyBatch":
        def part(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[sl]

        return PolicyBatch(
            trim_prompt_padding(select_rows(self.inputs, sl)),
            self.advantages[sl],
            self.weights[sl],
            part(self.ref_logprobs),
            part(self.old_logprobs),
            part(self.engine_logprobs),
            part(self.fresh),
            extras={name: value[sl] for name, value in self.extras.items()},
        )


@dataclass
class AdvantageFields(FieldGroup):
    """The group baseline of the MAGRPO family.

    Args:
        advantage_mode: the group baseline, a name registered in ``core.advantages.BASELINES`` (``mean``,
            ``rloo``, ``max``, ``raw``, or one you register).
    """

    advantage_mode: str = "mean"

    def check(self) -> None:
        require(
            self.advantage_mode in BASELINES,
            f"advantage_mode must be one of: {', '.join(BASELINES)} (got {self.advantage_mode!r}).",
        )


class GroupRelative(Objective):
    """MAGRPO's objective (module docstring): per agent, group advantages of the credited returns and the
    REINFORCE loss, micro-batch by micro-batch."""

    needs_token_entropy = False  # True: scoring also gives the policy's per-token entropy (PolicyBatch.entropy)

    def check(self) -> None:
        m = self.host
        require(m.num_generations >= 2, "num_generations must be >= 2 (group baseline requires multiple samples).")
        require(
            m.collaboration is None or m.num_turns == 1,
            f"Centralized {m.algorithm_name.removeprefix('Centralized')} currently supports num_turns=1 only.",
        )

    def losses(self, nodes: list[Node]) -> Iterator[tuple[Tensor, dict[str, Tensor]]]:
        """Agent by agent, micro-batch by micro-batch: the policy loss of each forward."""
        m = self.host
        batches, gap = [self.policy_batch(nodes, i) for i in range(m.num_agents)], EngineGap()
        for i, c, count, rows in m.agent_micro_batches([batch.inputs for batch in batches]):
            chunk, gap = batches[i].rows(rows), EngineGap() if c == 0 else gap  # the gap: one agent's forwards
            if self.needs_token_entropy:
                logp, chunk.entropy = token_logprobs(m.policy_model(i), chunk.inputs, entropy=True)
            else:
                logp = token_logprobs(m.policy_model(i), chunk.inputs)
            loss, diagnostics = self.policy_loss(i, logp, chunk)
            assert_finite("policy loss", loss, step=m.global_step, agent=i)
            if c == 0:  # once per agent and update: what its advantages were
                diagnostics = {**advantage_metrics(batches[i].advantages), **diagnostics}
            shared = {"loss": loss.detach()}
            gap.add(logp, chunk)
            if c == count - 1 and gap.tokens:  # the mean over the agents, once per agent and update
                shared["rollout/engine_logprob_gap"] = gap.mean() / m.num_agents
            diagnostics = {f"agent_{i}/{name}": value for name, value in diagnostics.items()}
            yield loss, {f"agent_{i}/loss": loss.detach(), **shared, **diagnostics}

    def policy_loss(self, agent: int, logp: Tensor, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Agent ``agent``'s loss on one micro-batch from its token log-probs ``logp`` [B, T] (with grad) and the
        batch's advantages, loss weights and stored log-probs (the hook a PPO-style variant overrides). Returns
        the loss and additive diagnostics (summed over the update's micro-batches, logged as ``agent_i/<name>``)."""
        m, device = self.host, logp.device
        token_kl, kl_coef = None, 0.0
        if batch.ref_logprobs is not None:  # reference KL in the loss
            token_kl = kl_estimate(logp, batch.ref_logprobs.to(device), m.reference_kl_estimator)
            token_kl, kl_coef = token_kl * batch.inputs.completion_mask.to(device), m.reference_kl_coef
        weights = batch.weights.to(device)
        if m.corrects_engine_sampling:  # π_train / π_engine of each sampled token, truncated or masked
            weights = weights * importance_sampling_weights(
                batch.old_logprobs.to(device),
                batch.engine_logprobs.to(device),
                batch.inputs.completion_mask.to(device),
                m.vllm_importance_sampling_mode,
                m.vllm_importance_sampling_cap,
            )
        loss, terms = policy_gradient_loss(logp, batch.advantages.to(device), weights, token_kl, kl_coef)
        # The reference KL's share of the loss (placement loss): the update's sum is logged as agent_i/reference_kl_loss.
        return loss, {"reference_kl_loss": terms["kl_loss"]} if token_kl is not None else {}

    def advantages(self, credit: Tensor) -> Tensor:
        """[M, K] group advantages from the [M, K] credited returns of M nodes (one agent's groups)."""
        return compute_advantages(credit, self.host.advantage_mode, self.host.advantage_normalization)

    def policy_batch(self, nodes: list[Node], agent: int) -> PolicyBatch:
        """Agent ``agent``'s rows of a mini-batch with group advantages computed per node (over its K)."""
        m = self.host
        samples, inputs = m.agent_inputs(nodes, agent)
        credit = torch.stack([s.credit for s in samples])  # [M, K]
        if m.reference_kl_placement == "reward" and samples[0].sequence_kl is not None:
            credit = credit - m.reference_kl_coef * torch.stack([s.sequence_kl for s in samples])
        weights = token_loss_weights(inputs.completion_mask, m.loss_aggregation, m.max_new_tokens)
        rows = torch.tensor([s.completion_ids.shape[0] for s in samples])
        fresh = torch.tensor([n.policy_version == m.global_step for n in nodes]).repeat_interleave(rows)
        # The importance weights' π_train is the training model's at sampling (attach_training_logprobs).
        old = "sampling_logprobs" if m.corrects_engine_sampling else "old_logprobs"
        return PolicyBatch(
            inputs,
            self.advantages(credit).reshape(-1),
            weights,
            stored_rows(samples, "ref_logprobs", inputs),
            stored_rows(samples, old, inputs),
            stored_rows(samples, "engine_logprobs", inputs),
            fresh,
            extras={name: torch.cat([s.extras[name] for s in samples]) for name in samples[0].extras},
        )

    def batch_metrics(self, nodes: list[Node]) -> dict[str, float]:
        # The reward of the samples is ``rollout/turn_t/reward_mean`` (on_policy.py), once; an update adds the
        # returns its advantages are built from.
        return {f"turn_{nodes[0].turn + 1}/expected_return": sum(n.mean_return for n in nodes) / len(nodes)}


class MAGRPO(OnPolicyModule):
    """Multi-Agent Group Relative Policy Optimization; the baseline is ``advantage_mode`` (default ``mean``)."""

    field_groups = (*OnPolicyModule.field_groups, AdvantageFields)
    objective_class = GroupRelative
    algorithm_name = "MAGRPO"


class EngineGap:
    """Mean |log π_engine − log π_train| per token over an agent's rows of one update that the weights being
    updated sampled (policy lag 0): how far the inference engine's probabilities are from the training model's
    (``rollout/engine_logprob_gap``; vLLM only)."""

    def __init__(self):
        self.total, self.tokens = 0.0, 0

    def add(self, logp: Tensor, batch: PolicyBatch) -> None:
        if batch.engine_logprobs is None:
            return
        mask = batch.inputs.completion_mask.to(logp.device) & batch.fresh.to(logp.device).unsqueeze(-1)
        self.total += float(((logp.detach() - batch.engine_logprobs.to(logp.device)).abs() * mask).sum())
        self.tokens += int(mask.sum())

    def mean(self) -> float:
        return self.total / self.tokens


def stored_rows(samples: list, name: str, inputs: ScoringInputs) -> Tensor | None:
    """The per-token values ``name`` stored with each sample (log-probs of some policy, [K_s, T_s] each), one row per
    completion, right-padded to the width of ``inputs``; None when the samples store none."""
    if getattr(samples[0], name) is None:
        return None
    width = inputs.completion_ids.shape[1]
    return torch.cat(
        [torch.nn.functional.pad(getattr(s, name), (0, width - getattr(s, name).shape[1])) for s in samples]
    )


def advantage_metrics(advantages: Tensor) -> dict[str, Tensor]:
    """Mean and spread of one agent's advantages in an update, and the share of its samples with advantage 0 (a
    group whose returns were all equal: no learning signal, trl's ``frac_reward_zero_std``)."""
    return {
        "advantage_mean": advantages.mean(),
        "advantage_std": advantages.std(unbiased=False),
        "zero_advantage_ratio": (advantages == 0).float().mean(),
    }


class MAREINFORCE(MAGRPO):
    """Multi-agent REINFORCE: ``advantage_mode="raw"`` (no baseline). Set ``advantage_normalization: false`` to
    see the difference — with normalization all four baselines give the same advantages."""

    algorithm_name = "MAREINFORCE"
    field_defaults = {"advantage_mode": "raw"}


class MARLOO(MAGRPO):
    """Multi-agent REINFORCE leave-one-out: ``advantage_mode="rloo"``, A_k = K/(K−1)·(G_k − mean G)."""

    algorithm_name = "MARLOO"
    field_defaults = {"advantage_mode": "rloo"}


class MAReMax(MAGRPO):
    """``advantage_mode="max"``: the baseline is the group MAXIMUM of the K sampled returns (all advantages ≤ 0).
    This is CoMLRL's MAReMax, not ReMax's greedy-decoding baseline: no extra greedy rollout is sampled."""

    algorithm_name = "MAReMax"
    field_defaults = {"advantage_mode": "max"}


class CentralizedMAGRPO(MAGRPO):
    """MAGRPO with ONE joint actor (the paper's single-model baseline): it reads the adapter's joint prompt (every
    role's prompt), writes all roles' outputs in one completion, and is trained on the team reward of the split
    roles. ``num_agents`` is the number of roles; ``agents`` one model; ``centralized_adapter`` defaults to the
    tagged ``<agent_i>…</agent_i>`` adapter; ``max_new_tokens`` is the joint budget; single turn.

    Args:
        collaboration_mode: always ``centralized`` for this class.
    """

    algorithm_name = "CentralizedMAGRPO"
    field_defaults = {"collaboration_mode": "centralized"}

    def check_config(self) -> None:
        require(
            self.collaboration_mode == "centralized",
            "CentralizedMAGRPO requires centralized collaboration (collaboration_mode='centralized').",
        )
        super().check_config()
