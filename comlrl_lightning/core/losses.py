"""Per-token KL estimators, loss aggregation weights and the REINFORCE surrogate (docs/algorithms.md).

Pure tensor math: no models, no Lightning. Shapes: B sequences (completions) x T completion tokens.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

# The choices of ``reference_kl_estimator`` and ``loss_aggregation`` (the fields' types: ``algorithms/fields.py``).
KlEstimator = Literal["k1", "k2", "k3"]
LossAggregation = Literal["seq_sum", "token_mean", "seq_mean_token_mean", "dr_grpo"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)


def kl_estimate(logp_policy: Tensor, logp_ref: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs (Schulman's k1/k2/k3).

    With d = logp_ref - logp_policy (log of the ratio ref/policy at the sampled token):
        k1 = -d                     unbiased, can be negative
        k2 = d**2 / 2               biased, >= 0
        k3 = exp(d) - d - 1         unbiased, >= 0 (CoMLRL's choice)
    Returns a tensor of the inputs' (broadcast) shape; identical inputs give 0.
    """
    d = logp_ref - logp_policy
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.expm1(d) - d  # expm1 keeps small |d| accurate
    raise ValueError(f"estimator must be one of: {', '.join(KL_ESTIMATORS)} (got {estimator!r}).")


def token_loss_weights(
    completion_mask: Tensor, aggregation: str = "seq_sum", max_new_tokens: int | None = None
) -> Tensor:
    """Weights w [B, T] such that the mini-batch loss is sum_{b,t} w[b,t] * loss_token[b,t].

    The weights are computed over the WHOLE mini-batch, so splitting its rows into micro-batches and summing
    each micro-batch's weighted loss gives exactly the full loss and gradient (gradient accumulation).

        seq_sum              w = mask / B                  mean over sequences of the token SUM (CoMLRL parity)
        token_mean           w = mask / sum(mask)          mean over all tokens of the mini-batch
        seq_mean_token_mean  w = mask / (B * len_b)        mean over sequences of the per-sequence token mean
        dr_grpo              w = mask / (B * max_new_tokens)   constant normaliser (Dr. GRPO)

    Empty rows (len_b = 0) get weight 0, never NaN.
    """
    mask = completion_mask.to(torch.promote_types(completion_mask.dtype, torch.float32))  # [B, T]; bool -> float32
    batch_size = max(mask.shape[0], 1)
    if aggregation == "seq_sum":
        return mask / batch_size
    if aggregation == "token_mean":
        return mask / mask.sum().clamp_min(1.0)
    if aggregation == "seq_mean_token_mean":
        seq_lengths = mask.sum(dim=-1, keepdim=True).clamp_min(1.0)  # [B, 1]; empty rows are 0/1 = 0
        return mask / (batch_size * seq_lengths)
    if aggregation == "dr_grpo":
        if max_new_tokens is None or max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be a positive int when loss_aggregation='dr_grpo' (got {max_new_tokens!r})."
            )
        return mask / (batch_size * max_new_tokens)
    raise ValueError(f"loss_aggregation must be one of: {', '.join(LOSS_AGGREGATIONS)} (got {aggregation!r}).")


def policy_gradient_loss(
    token_logprobs: Tensor,
    advantages: Tensor,
    weights: Tensor,
    token_kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE surrogate (CoMLRL's objective), optionally with a per-token KL penalty in the loss.

        loss = sum_{b,t} w[b,t] * ( -A_b * log pi(y_{b,t}) + kl_coef * KL_{b,t} )

    No importance ratio, no clipping, no entropy bonus: log-probs are recomputed with the current weights and
    the samples are treated as on-policy. With ``seq_sum`` weights this is mean_b(-A_b * sum_t log pi(y_{b,t})).

    Args:
        token_logprobs: [B, T] log pi of the sampled tokens (with grad).
        advantages: [B] one advantage per sequence (no grad expected).
        weights: [B, T] from ``token_loss_weights`` (0 on padding).
        token_kl: [B, T] per-token KL estimate (from ``kl_estimate``), or None.
    Returns:
        (scalar loss, detached diagnostics: policy_loss, kl_loss, kl_mean (if token_kl given), logprob_mean,
        advantage_mean, weight_sum).
    """
    if token_logprobs.shape != weights.shape or token_logprobs.dim() != 2:
        raise ValueError(
            f"token_logprobs and weights must both be [B, T] (got {tuple(token_logprobs.shape)} and "
            f"{tuple(weights.shape)})."
        )
    if advantages.shape != token_logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{token_logprobs.shape[0]}] (got {tuple(advantages.shape)}).")
    dtype = torch.promote_types(token_logprobs.dtype, torch.float32)  # never reduce in bf16/fp16
    token_logprobs, weights, advantages = token_logprobs.to(dtype), weights.to(dtype), advantages.to(dtype)
    policy_loss = (weights * (-advantages[:, None] * token_logprobs)).sum()  # scalar
    loss = policy_loss

    weight_sum = weights.sum()
    denom = weight_sum.clamp_min(torch.finfo(weights.dtype).tiny)  # weighted means; 0 when nothing is weighted
    metrics = {
        "policy_loss": policy_loss.detach(),
        "logprob_mean": ((weights * token_logprobs).sum() / denom).detach(),
        "advantage_mean": advantages.mean().detach() if advantages.numel() else advantages.new_zeros(()),
        "weight_sum": weight_sum.detach(),
    }
    if token_kl is not None:
        if token_kl.shape != weights.shape:
            raise ValueError(f"token_kl must be [B, T] = {tuple(weights.shape)} (got {tuple(token_kl.shape)}).")
        weighted_kl = (weights * token_kl).sum()
        kl_loss = kl_coef * weighted_kl
        loss = loss + kl_loss
        metrics["kl_loss"] = kl_loss.detach()
        metrics["kl_mean"] = (weighted_kl / denom).detach()
    return loss, metrics


ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
IMPORTANCE_SAMPLING_MODES: tuple[str, ...] = get_args(ImportanceSamplingMode)


def importance_sampling_weights(
    train_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str = "token_truncate", cap: float = 2.0
) -> Tensor:
    """Truncated / masked importance weights for samples drawn by an inference engine whose probabilities differ a
    little from the training model's (trl's ``vllm_importance_sampling_*``): ρ = π_train(y) / π_engine(y), per token
    (``token_*``) or per completion (``sequence_*``: the product over its tokens), then ``min(ρ, cap)``
    (``*_truncate``) or ρ·[ρ ≤ cap] (``*_mask``). Multiplies each token's policy-gradient term; detached.

    Args:
        train_logp / engine_logp: [B, T] the two log-probs of the sampled tokens (0 where masked).
        mask: [B, T] the completion tokens.
    Returns: [B, T] weights, 0 where masked.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(
            f"vllm_importance_sampling_mode must be one of: {', '.join(IMPORTANCE_SAMPLING_MODES)} (got {mode!r})."
        )
    mask = mask.to(train_logp.dtype)
    diff = (train_logp.detach().float() - engine_logp.float()) * mask  # [B, T]
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True).expand_as(mask)
    ratio = torch.exp(diff)
    ratio = ratio.clamp(max=cap) if mode.endswith("truncate") else ratio * (ratio <= cap)
    return ratio * mask


def assert_finite(name: str, tensor: Tensor, **context) -> None:
    """Raise FloatingPointError if ``tensor`` has any NaN/inf (instead of CoMLRL's silent 0.1 loss).

    The message names the quantity and the context, e.g. ``assert_finite("loss", loss, step=3, agent=1)``.
    """
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    num_nan = int(torch.isnan(tensor).sum())
    num_inf = int((~finite).sum()) - num_nan
    where = ", ".join(f"{key}={value}" for key, value in context.items())
    raise FloatingPointError(
        f"Non-finite {name}: {num_nan} NaN and {num_inf} inf of {tensor.numel()} values"
        + (f" ({where})." if where else ".")
    )


def value_loss(
    values: Tensor,
    targets: Tensor,
    old_values: Tensor | None = None,
    clip_range: float | None = None,
) -> Tensor:
    """Critic regression loss of IAC / MAAC (docs/algorithms.md#actor-critic), a mean over the B samples.

    Plain (separate critics, MAAC, or ``clip_range=None``):
        loss = mean_b (target_b - V_b)**2
    PPO-style clipped (IAC with the value head on the actor, ``clip_range`` = eps):
        V_clip = V_old + clamp(V - V_old, -eps, eps)
        loss   = mean_b max( (target_b - V_b)**2, (target_b - V_clip_b)**2 )
    The max is pessimistic: once V has moved more than eps away from V_old and the clipped error is the larger
    one, the sample contributes no gradient (V_clip is constant there).

    Args:
        values: [B] current critic values V (with grad).
        targets: [B] value targets (no grad expected): r' in single turn, TD(0) targets in multi-turn.
        old_values: [B] rollout-time values V_old; required when ``clip_range`` is set.
        clip_range: eps > 0, or None for the plain loss.
    Returns:
        scalar loss (float32 or wider); 0 (still attached to ``values``) for an empty batch.
    """
    if values.shape != targets.shape or values.dim() != 1:
        raise ValueError(f"values and targets must both be [B] (got {tuple(values.shape)} and {tuple(targets.shape)}).")
    dtype = torch.promote_types(values.dtype, torch.float32)  # never reduce in bf16/fp16
    v, target = values.to(dtype), targets.to(dtype)  # [B]
    if v.numel() == 0:
        return v.sum()
    error = (target - v).square()  # [B]
    if clip_range is None:
        return error.mean()
    if clip_range <= 0:
        raise ValueError(f"value_clip_range must be > 0 or null (got {clip_range!r}).")
    if old_values is None:
        raise ValueError("old_values must be given when clip_range is set (clipping is relative to V_old).")
    if old_values.shape != values.shape:
        raise ValueError(f"old_values must be [B] = {tuple(values.shape)} (got {tuple(old_values.shape)}).")
    v_old = old_values.to(dtype)
    v_clipped = v_old + (v - v_old).clamp(-clip_range, clip_range)  # [B]
    clipped_error = (target - v_clipped).square()  # [B]
    return torch.maximum(error, clipped_error).mean()


def madpo_loss(margins: Tensor, beta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Reference-free multi-agent DPO loss on the team margin (docs/algorithms.md example 6).

    For pair p and agent i, Delta_{p,i} = log pi_i(a^w_i | h_i) - log pi_i(a^l_i | h_i) (agent i's own sequence
    log-likelihood margin); the joint margin is Delta_p = sum_i Delta_{p,i} and

        loss = mean_p -log sigma(beta * Delta_p) = mean_p softplus(-beta * Delta_p)      (numerically stable)

    Per-agent gradient: d loss / d Delta_{p,i} = -(beta / P) * sigma(-beta * Delta_p), the same for every i, so
        grad_{theta_i} loss = mean_p -beta * sigma(-beta * Delta_p) * grad_{theta_i} Delta_{p,i}:
    the weight depends on the TEAM margin, the gradient flows only through agent i's own margin.

    CoMLRL's "detach trick" (per agent i: loss_i = mean_p -log sigma(beta * (Delta_{p,i} + sum_{j!=i}
    stopgrad(Delta_{p,j})))) gives agent i exactly this gradient; it is needed there only because CoMLRL steps
    the agents one after another. Here all agents take one simultaneous step from margins computed with the
    same weights, and plain autograd of this single joint loss already yields each agent's detach-trick
    gradient (agents have disjoint parameters, and d loss / d Delta_{p,i} does not depend on i). With shared
    weights the gradients of all agents' margins are summed into one step (CoMLRL applies them as N steps).

    Args:
        margins: [P, N] per-pair, per-agent log-likelihood margins (with grad).
        beta: DPO inverse temperature eta (``dpo_beta``), > 0.
    Returns:
        (scalar loss, detached diagnostics: loss, accuracy (fraction of pairs with Delta_p > 0),
        joint_margin_mean, margin_mean_agent_{i} for i = 0..N-1). An empty batch gives loss 0 (attached).
    """
    if not beta > 0:
        raise ValueError(f"dpo_beta must be > 0. (got {beta!r})")
    if margins.dim() != 2:
        raise ValueError(f"margins must be [P, N] (pairs x agents) (got {tuple(margins.shape)}).")
    dtype = torch.promote_types(margins.dtype, torch.float32)  # never reduce in bf16/fp16
    margins = margins.to(dtype)  # [P, N]
    joint_margin = margins.sum(dim=-1)  # [P]
    num_pairs = joint_margin.numel()
    if num_pairs == 0:
        loss = margins.sum()  # 0, still attached
        zero = loss.detach()
        metrics = {"loss": zero, "accuracy": zero, "joint_margin_mean": zero}
        metrics.update({f"margin_mean_agent_{i}": zero for i in range(margins.shape[1])})
        return loss, metrics
    loss = torch.nn.functional.softplus(-beta * joint_margin).mean()  # scalar
    detached = margins.detach()
    metrics = {
        "loss": loss.detach(),
        "accuracy": (joint_margin.detach() > 0).to(dtype).mean(),
        "joint_margin_mean": joint_margin.detach().mean(),
    }
    agent_means = detached.mean(dim=0)  # [N]
    metrics.update({f"margin_mean_agent_{i}": agent_means[i] for i in range(agent_means.numel())})
    return loss, metrics


def bradley_terry_loss(winner_scores: Tensor, loser_scores: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley–Terry reward-model loss (MARLHF's joint reward model, docs/algorithms.md#marlhf).

        loss = mean_b -log sigma(s_w - s_l) = mean_b softplus(-(s_w - s_l))

    Args:
        winner_scores: [B] reward-model scores of the preferred joint responses (with grad).
        loser_scores: [B] scores of the rejected ones.
    Returns:
        (scalar loss, detached diagnostics: loss, accuracy (fraction with s_w > s_l), margin_mean).
        An empty batch gives loss 0 (attached).
    """
    if winner_scores.shape != loser_scores.shape or winner_scores.dim() != 1:
        raise ValueError(
            f"winner_scores and loser_scores must both be [B] (got {tuple(winner_scores.shape)} and "
            f"{tuple(loser_scores.shape)})."
        )
    dtype = torch.promote_types(torch.promote_types(winner_scores.dtype, loser_scores.dtype), torch.float32)
    margin = winner_scores.to(dtype) - loser_scores.to(dtype)  # [B]
    if margin.numel() == 0:
        loss = margin.sum()
        zero = loss.detach()
        return loss, {"loss": zero, "accuracy": zero, "margin_mean": zero}
    loss = torch.nn.functional.softplus(-margin).mean()  # scalar
    return loss, {
        "loss": loss.detach(),
        "accuracy": (margin.detach() > 0).to(dtype).mean(),
        "margin_mean": margin.detach().mean(),
    }


def token_ratios(token_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token importance ratios r_{b,t} = π(y_{b,t}) / π_old(y_{b,t}) = exp(log π − log π_old), 0 where masked
    (PPO, Schulman et al. 2017). Gradient through ``token_logprobs`` only."""
    mask = mask.to(token_logprobs.dtype)
    return torch.exp((token_logprobs - old_logprobs.detach()) * mask) * mask


def sequence_ratios(token_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence ratio (Zheng et al. 2025, arXiv:2507.18071) in its token form: s_b = exp(mean_t (log π −
    log π_old)) over the completion's tokens, the same value at every token, r_{b,t} = sg(s_b)·π(y_{b,t})/sg(π(y_{b,t})):
    equal to s_b, with the gradient s_b·∇log π(y_{b,t}). Clipping r clips s_b, the whole sequence at once. 0 where
    masked; an empty completion has s = 1."""
    mask = mask.to(token_logprobs.dtype)
    lengths = mask.sum(-1, keepdim=True).clamp_min(1.0)
    s = torch.exp(((token_logprobs - old_logprobs) * mask).sum(-1, keepdim=True) / lengths).detach()  # [B, 1]
    return s * torch.exp(token_logprobs - token_logprobs.detach()) * mask


def clipped_surrogate_loss(
    ratios: Tensor, advantages: Tensor, weights: Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped surrogate with asymmetric bounds (PPO; DAPO's clip-higher):

        loss = −Σ_{b,t} w[b,t] · min(r_{b,t}·A_b, clip(r_{b,t}, 1 − ε_low, 1 + ε_high)·A_b)

    With r = 1 (the first pass over fresh samples) its gradient is REINFORCE's, −Σ w·A·∇log π.

    Args:
        ratios: [B, T] from :func:`token_ratios` or :func:`sequence_ratios` (with grad).
        advantages: [B]; weights: [B, T] from :func:`token_loss_weights` (0 on padding).
    Returns:
        (scalar loss, detached diagnostics: ``policy_loss``, ``clipped_tokens`` (tokens whose ratio was clipped
        and whose clipped term was the minimum: no gradient), ``ratio_sum`` (Σ r over weighted tokens) and
        ``ratio_tokens``).
    """
    dtype = torch.promote_types(ratios.dtype, torch.float32)
    ratios, weights = ratios.to(dtype), weights.to(dtype)
    advantages = advantages.to(dtype)[:, None]
    clipped = ratios.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    unclipped_term, clipped_term = ratios * advantages, clipped * advantages
    loss = -(weights * torch.minimum(unclipped_term, clipped_term)).sum()
    counted = weights != 0
    return loss, {
        "policy_loss": loss.detach(),
        "clipped_tokens": (counted & (clipped_term < unclipped_term)).sum().detach(),
        "ratio_sum": (ratios.detach() * counted).sum(),
        "ratio_tokens": counted.sum().detach(),
    }
