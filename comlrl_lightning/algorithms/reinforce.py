"""MAGRPO and the critic-free multi-agent REINFORCE family (arXiv:2508.04652; docs/algorithms.md).

For every dataset item the N agents build a rollout tree (``rollout/tree.py``): at each node every agent samples
K completions, joint actions get one team reward, and the return of a joint action is its reward plus the
discounted mean return of its child node. Agent i's K completions at a node form one group:

    G'_k = G_k − β·KL_k                       (reference KL on the returns, ``reference_kl_placement="reward"``)
    A_k  = normalize(G'_k − b(G'))            b = the baseline registered as ``advantage_mode``: mean (MAGRPO),
                                              leave-one-out mean (MARLOO), group max (MAReMax), 0 (MAREINFORCE)
    L_i  = Σ_{k,t} w_{k,t} · (−A_k · log π_i(y_{k,t} | x, y_{k,<t}))      w: ``loss_aggregation``

No importance ratio, no clipping, no entropy bonus (the paper's objective, ``policy_loss: reinforce``). Log-probs
cover exactly the generated tokens up to and including EOS (CoMLRL skips the last token and scores padding; we do
not). ``policy_loss`` picks another registered objective: ``clipped`` (the clipped ratio against the sampling
policy, ``num_iterations`` passes over each batch, ``epsilon_low``/``epsilon_high``) or ``gspo`` (GSPO's sequence
ratio); ``reward_aggregation: normalize_components`` normalises each named reward component within its group
before they are summed (GDPO); ``dynamic_sampling`` drops the groups whose returns tie and refills them.

One update is ``OnPolicyModule.update`` (on_policy.py): step 2, this module's :meth:`MAGRPO.agent_batch` (each
agent's rows and their group advantages); step 3, ``module.objective.loss`` on each micro-batch's log-probs.
To change the baseline, register one (``core.advantages.register_baseline``); to change the loss, register an
objective (:func:`register_policy_loss`, docs/new_algorithm.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from comlrl_lightning.algorithms.fields import DynamicSamplingFields, FieldGroup, require
from comlrl_lightning.algorithms.objective import Objective
from comlrl_lightning.algorithms.on_policy import OnPolicyModule, PolicyBatch, stored_rows
from comlrl_lightning.core.advantages import BASELINES, component_advantages, compute_advantages
from comlrl_lightning.core.filtering import tied_share
from comlrl_lightning.core.losses import (
    clipped_surrogate_loss,
    importance_sampling_weights,
    kl_estimate,
    policy_gradient_loss,
    sequence_ratios,
    token_loss_weights,
    token_ratios,
)
from comlrl_lightning.data.dynamic_sampling import node_ties
from comlrl_lightning.rollout.rewards import callable_name
from comlrl_lightning.rollout.tree import AgentSamples, Node, Rollout

POLICY_LOSSES: dict[str, type[GroupRelative]] = {}  # policy_loss -> objective (register_policy_loss)


def register_policy_loss(name: str) -> Callable[[type[GroupRelative]], type[GroupRelative]]:
    """Register an objective under ``name`` for the MAGRPO family's ``policy_loss`` field (a class decorator)."""

    def register(objective: type[GroupRelative]) -> type[GroupRelative]:
        POLICY_LOSSES[name] = objective
        return objective

    return register


@dataclass(frozen=True)
class KLTerm:
    """The reference-KL term in the loss (``reference_kl_placement: loss``): coefficient β and estimator."""

    coef: float
    estimator: str

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> "KLTerm | None":
        on = values.get("reference_kl_enabled") and values.get("reference_kl_coef", 0) > 0
        if not on or values.get("reference_kl_placement") != "loss":
            return None
        return cls(values["reference_kl_coef"], values["reference_kl_estimator"])


@dataclass(frozen=True)
class EngineCorrection:
    """Importance weights π_train / π_engine of samples drawn by an inference engine (``vllm_importance_sampling_*``)."""

    mode: str
    cap: float

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> "EngineCorrection | None":
        if not values.get("vllm_importance_sampling_correction"):
            return None
        return cls(values["vllm_importance_sampling_mode"], values["vllm_importance_sampling_cap"])


@register_policy_loss("reinforce")
class GroupRelative(Objective):
    """MAGRPO's loss of one agent's micro-batch: REINFORCE with the batch's advantages (module docstring), the
    reference KL when it is in the loss, importance weights when an engine sampled."""

    uses_old_logprobs = False  # True: the batch carries the sampling policy's log-probs (a ratio objective)
    uses_entropy = False  # True: scoring also gives the policy's per-token entropy (``PolicyBatch.entropy``)

    def __init__(self, kl: KLTerm | None = None, correction: EngineCorrection | None = None):
        self.kl, self.correction = kl, correction

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> "GroupRelative":
        """Its settings from a module's fields: by constructor parameter name, the KL term and the correction."""
        settings = {n: values[n] for n in inspect.signature(cls).parameters if n in values}
        return cls(**{**settings, "kl": KLTerm.from_fields(values), "correction": EngineCorrection.from_fields(values)})

    def loss(self, logp: Tensor, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of log-probs ``logp`` [B, T] (with grad) on ``batch``; metrics are additive (logged summed over
        the update's micro-batches as ``agent_i/<name>``)."""
        weights = self.weights(logp, batch)
        loss, terms = policy_gradient_loss(logp, batch.advantages.to(logp.device), weights)
        return self.with_kl(loss, {}, logp, batch, weights)

    def weights(self, logp: Tensor, batch: PolicyBatch) -> Tensor:
        """The batch's loss weights, times the engine correction's importance weights when an engine sampled."""
        weights = batch.weights.to(logp.device)
        if self.correction is None:
            return weights
        mask = batch.inputs.completion_mask.to(logp.device)
        return weights * importance_sampling_weights(
            batch.old_logprobs.to(logp.device),
            batch.engine_logprobs.to(logp.device),
            mask,
            self.correction.mode,
            self.correction.cap,
        )

    def with_kl(self, loss: Tensor, metrics: dict, logp: Tensor, batch: PolicyBatch, weights: Tensor) -> tuple:
        """``loss`` plus β·Σ w·KL(π‖π_ref) when the reference KL is in the loss (logged as ``reference_kl_loss``)."""
        if self.kl is None or batch.ref_logprobs is None:
            return loss, metrics
        mask = batch.inputs.completion_mask.to(logp.device)
        token_kl = kl_estimate(logp, batch.ref_logprobs.to(logp.device), self.kl.estimator) * mask
        kl_loss = self.kl.coef * (weights * token_kl).sum()
        return loss + kl_loss, {**metrics, "reference_kl_loss": kl_loss.detach()}


@register_policy_loss("clipped")
class ClippedRatio(GroupRelative):
    """The clipped multi-pass policy gradient (PPO's surrogate on MAGRPO's group advantages, with DAPO's asymmetric
    bounds; trl's ``num_iterations``/``epsilon``/``epsilon_high``): the ratio π/π_old against the sampling
    policy's log-probs, clipped to [1 − ``epsilon_low``, 1 + ``epsilon_high``]; the loop makes ``num_iterations``
    passes over each drained buffer. The reference KL and the engine correction apply as in :class:`GroupRelative`."""

    uses_old_logprobs = True

    def __init__(
        self,
        epsilon_low: float,
        epsilon_high: float,
        kl: KLTerm | None = None,
        correction: EngineCorrection | None = None,
    ):
        super().__init__(kl, correction)
        self.epsilon_low, self.epsilon_high = epsilon_low, epsilon_high

    def ratios(self, logp: Tensor, batch: PolicyBatch) -> Tensor:
        """Per-token π/π_old (:func:`core.losses.token_ratios`); GSPO overrides it."""
        return token_ratios(logp, batch.old_logprobs.to(logp.device), batch.inputs.completion_mask.to(logp.device))

    def loss(self, logp: Tensor, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        weights = self.weights(logp, batch)
        ratios = self.ratios(logp, batch)
        loss, terms = clipped_surrogate_loss(
            ratios, batch.advantages.to(logp.device), weights, self.epsilon_low, self.epsilon_high
        )
        metrics = {k: terms[k] for k in ("clipped_tokens", "ratio_sum", "ratio_tokens")}
        return self.with_kl(loss, metrics, logp, batch, weights)

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        """Per agent, the summed ratio terms become ``ratio_mean`` (mean π/π_old over the weighted tokens) and
        ``clip_ratio`` (the share of tokens whose clipped term won: no gradient from them)."""
        out = dict(metrics)
        for key in [k for k in metrics if k.endswith("ratio_sum")]:
            prefix = key.removesuffix("ratio_sum")
            tokens = max(out.pop(f"{prefix}ratio_tokens"), 1.0)
            out[f"{prefix}ratio_mean"] = out.pop(key) / tokens
            out[f"{prefix}clip_ratio"] = out.pop(f"{prefix}clipped_tokens") / tokens
        return out


@register_policy_loss("gspo")
class SequenceRatio(ClippedRatio):
    """GSPO (Zheng et al. 2025): one ratio per completion, exp of the mean token log-ratio, clipped as a whole."""

    def ratios(self, logp: Tensor, batch: PolicyBatch) -> Tensor:
        return sequence_ratios(logp, batch.old_logprobs.to(logp.device), batch.inputs.completion_mask.to(logp.device))


@dataclass
class AdvantageFields(FieldGroup):
    """The MAGRPO family's baseline and loss.

    Args:
        advantage_mode: the group baseline, a name registered in ``core.advantages.BASELINES`` (``mean``,
            ``rloo``, ``max``, ``raw``, or one you register).
        policy_loss: the objective, a name registered with ``register_policy_loss``: ``reinforce`` (the paper's),
            ``clipped`` (clipped ratio against the sampling policy) or ``gspo`` (sequence ratio), or one you register.
        num_iterations: passes over each drained buffer (> 1 needs a ratio objective: ``clipped`` or ``gspo``).
        epsilon_low: the ratio's lower clip, 1 − epsilon_low (``clipped``, ``gspo``).
        epsilon_high: the ratio's upper clip, 1 + epsilon_high (``clipped``, ``gspo``; DAPO's clip-higher).
    """

    advantage_mode: str = "mean"
    policy_loss: str = "reinforce"
    num_iterations: int = 1
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2

    def check(self) -> None:
        require(
            self.advantage_mode in BASELINES,
            f"advantage_mode must be one of: {', '.join(BASELINES)} (got {self.advantage_mode!r}).",
        )
        require(
            self.policy_loss in POLICY_LOSSES,
            f"policy_loss must be one of: {', '.join(POLICY_LOSSES)} (got {self.policy_loss!r}).",
        )
        require(self.num_iterations >= 1, f"num_iterations must be >= 1 (got {self.num_iterations}).")
        require(
            self.num_iterations == 1 or POLICY_LOSSES[self.policy_loss].uses_old_logprobs,
            f"num_iterations={self.num_iterations} needs a ratio objective (policy_loss clipped or gspo): "
            f"policy_loss {self.policy_loss!r} would reuse samples without correcting for the changed policy.",
        )
        for name in ("epsilon_low", "epsilon_high"):
            require(getattr(self, name) > 0, f"{name} must be > 0 (got {getattr(self, name)}).")
        require(self.epsilon_low < 1, f"epsilon_low must be < 1 (got {self.epsilon_low}).")


class MAGRPO(OnPolicyModule):
    """Multi-Agent Group Relative Policy Optimization; the baseline is ``advantage_mode`` (default ``mean``), the
    objective ``policy_loss`` (default ``reinforce``, the paper's)."""

    field_groups = (*OnPolicyModule.field_groups, AdvantageFields, DynamicSamplingFields)
    objective_class = GroupRelative  # the default; ``policy_loss`` names the one a module uses
    normalizes_components = True
    algorithm_name = "MAGRPO"

    def make_objective(self) -> GroupRelative:
        return POLICY_LOSSES[self.policy_loss].from_fields(self.__dict__)

    @property
    def passes(self) -> int:
        return self.num_iterations

    def check_config(self) -> None:
        super().check_config()
        require(self.num_generations >= 2, "num_generations must be >= 2 (group baseline requires multiple samples).")
        require(
            self.collaboration is None or self.num_turns == 1,
            f"Centralized {self.algorithm_name.removeprefix('Centralized')} currently supports num_turns=1 only.",
        )

    def agent_batch(self, nodes: list[Node], agent: int) -> PolicyBatch:
        """Step 2 of an update: agent ``agent``'s rows of a mini-batch (node by node, K rows each) and their group
        advantages, computed per node over its K credited returns (minus the reference KL on the returns)."""
        samples, inputs = self.agent_inputs(nodes, agent)
        advantages = self.group_advantages(nodes, samples)
        rows = torch.tensor([s.completion_ids.shape[0] for s in samples])
        return PolicyBatch(
            inputs,
            advantages.reshape(-1),
            token_loss_weights(inputs.completion_mask, self.loss_aggregation, self.max_new_tokens),
            stored_rows(samples, "ref_logprobs", inputs),
            stored_rows(samples, "sampling_logprobs", inputs) if self.keeps_old_logprobs else None,
            stored_rows(samples, "engine_logprobs", inputs),
            fresh=torch.tensor([n.policy_version == self.global_step for n in nodes]).repeat_interleave(rows),
            extras={name: torch.cat([s.extras[name] for s in samples]) for name in samples[0].extras},
        )

    def group_advantages(self, nodes: list[Node], samples: list[AgentSamples]) -> Tensor:
        """A_k of each node's group of K (``samples``: one agent's, node by node), [M, K]:
        ``normalize(G' − b(G'))`` of the credited returns G' = G − β·KL; with ``reward_aggregation:
        normalize_components``, Σ_c w_c·normalize(G_c − b(G_c)) over the reward's components, −β·KL one more
        component of weight 1 (``core.advantages.component_advantages``)."""
        kl = None
        if self.reference_kl_placement == "reward" and samples[0].sequence_kl is not None:
            kl = -self.reference_kl_coef * torch.stack([s.sequence_kl for s in samples])  # [M, K]
        mode, normalize = self.advantage_mode, self.advantage_normalization
        if self.reward_aggregation == "sum":
            credit = torch.stack([s.credit for s in samples])  # [M, K]
            return compute_advantages(credit if kl is None else credit + kl, mode, normalize)
        names = nodes[0].component_names
        require(
            names is not None,
            "reward_aggregation=normalize_components needs a reward that returns named components "
            f"({{name: value}} per joint action); reward_func {callable_name(self.team.reward_func)} returned floats.",
        )
        components = torch.stack([s.credit_components for s in samples])  # [M, K, C]
        weights = [(self.reward_component_weights or {}).get(name, 1.0) for name in names]
        if kl is not None:
            components, weights = torch.cat([components, kl.unsqueeze(-1)], -1), [*weights, 1.0]
        return component_advantages(components, torch.tensor(weights, dtype=torch.float64), mode, normalize)

    def rollout_options(self) -> dict[str, Any]:
        return {
            "dynamic_sampling": self.dynamic_sampling,
            "max_extra_prompts": self.dynamic_sampling_max_extra_prompts,
            "tie_by_components": self.reward_aggregation == "normalize_components",
        }

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        """The on-policy loop's, and the share of nodes that give every agent zero advantage
        (``rollout/zero_advantage_ratio``; dynamic sampling reports it, before and after, itself)."""
        metrics = super().rollout_metrics(rollout)
        if "rollout/zero_advantage_ratio" not in metrics:
            by_components = self.reward_aggregation == "normalize_components"
            metrics["rollout/zero_advantage_ratio"] = tied_share([node_ties(n, by_components) for n in rollout.nodes])
        return metrics

    def batch_metrics(self, nodes: list[Node]) -> dict[str, float]:
        # The reward of the samples is ``rollout/turn_t/reward_mean`` (on_policy.py), once; an update adds the
        # returns its advantages are built from.
        turn = nodes[0].turn + 1
        metrics = {f"turn_{turn}/expected_return": sum(n.mean_return for n in nodes) / len(nodes)}
        return {**super().batch_metrics(nodes), **metrics}


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
