"""Returns, credit assignment and advantages: pure tensor math (REFERENCE §3.6, §3.8, appendix E).

Conventions: the *group* is always the last dimension. For one rollout-tree node and one agent it holds the
K returns of that agent's K completions; any leading dimensions are independent batches of groups.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

ADVANTAGE_MODES = ("mean", "raw", "max", "rloo")


def _as_float(x: Tensor) -> Tensor:
    """Promote to at least float32 (ints/halves -> float32; float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# --- Pluggable baselines (rl4co style): returns [..., K] -> advantages [..., K] ------------------------


def mean_baseline(returns: Tensor) -> Tensor:
    """MAGRPO: A_k = G_k - mean_j G_j."""
    return returns - returns.mean(dim=-1, keepdim=True)


def raw_baseline(returns: Tensor) -> Tensor:
    """MAREINFORCE: A_k = G_k (no baseline)."""
    return returns.clone()


def max_baseline(returns: Tensor) -> Tensor:
    """MAReMax: A_k = G_k - max_j G_j (all advantages <= 0).

    The baseline is the group maximum, NOT ReMax's reward of a separate greedy rollout (CoMLRL's choice).
    """
    return returns - returns.amax(dim=-1, keepdim=True)


def rloo_baseline(returns: Tensor) -> Tensor:
    """MARLOO: A_k = G_k - mean_{j != k} G_j = (K * G_k - sum_j G_j) / (K - 1).

    With K <= 1 there is no "other" sample, so it falls back to the mean baseline (as CoMLRL does).
    """
    k = returns.shape[-1]
    if k <= 1:
        return mean_baseline(returns)
    return (k * returns - returns.sum(dim=-1, keepdim=True)) / (k - 1)


BASELINES: dict[str, Callable[[Tensor], Tensor]] = {
    "mean": mean_baseline,
    "raw": raw_baseline,
    "max": max_baseline,
    "rloo": rloo_baseline,
}


def compute_advantages(returns: Tensor, mode: str = "mean", normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages over the last dimension (REFERENCE §3.8).

    A = baseline_mode(G); then, if ``normalize`` and K > 1:
        A <- (A - mean(A)) / max(std_pop(A), eps)        (population std, unbiased=False)

    With normalization every mode gives the same result (the baselines are shifts/scalings within the group);
    turn it off to see the difference between modes.

    Args:
        returns: [..., K] per-completion returns (already KL-shaped if that is enabled).
        mode: one of ``ADVANTAGE_MODES``.
    Returns:
        [..., K] advantages, at least float32.
    """
    if mode not in BASELINES:
        raise ValueError(f"advantage_mode must be one of: {', '.join(ADVANTAGE_MODES)} (got {mode!r}).")
    g = _as_float(returns)  # [..., K]
    adv = BASELINES[mode](g)  # [..., K]
    if normalize and adv.shape[-1] > 1:
        centred = adv - adv.mean(dim=-1, keepdim=True)
        # The floor keeps all-equal groups at exactly 0 instead of 0/0 = NaN.
        std = adv.std(dim=-1, unbiased=False, keepdim=True).clamp_min(eps)
        adv = centred / std
    return adv


def bootstrap_returns(
    rewards: Tensor, child_mean_returns: Tensor, has_child: Tensor, discount: float = 1.0
) -> Tensor:
    """Tree return of each joint action: immediate reward + discounted MEAN return of its child node.

    G_j = r_j + discount * mean(child_j.returns)   if joint action j has a child node
    G_j = r_j                                        otherwise (leaf: last turn or early termination)

    Args (all broadcastable, typically [..., J] for J joint actions):
        rewards: immediate joint rewards r_j.
        child_mean_returns: mean return of child_j's joint actions (any value where there is no child).
        has_child: bool mask.
    """
    r = _as_float(rewards)
    bootstrapped = r + discount * _as_float(child_mean_returns)
    return torch.where(has_child.bool(), bootstrapped, r)


def cross_joint_indices(num_agents: int, num_samples: int) -> Tensor:
    """Per-agent sample index of every joint action of the cross product, in itertools.product order.

    Row j is ``list(itertools.product(range(K), repeat=N))[j]`` (last agent varies fastest).
    Returns: LongTensor [K**N, N].
    """
    _check_cross_sizes(num_agents, num_samples)
    n, k = num_agents, num_samples
    joint = torch.arange(k**n).unsqueeze(1)  # [K**N, 1]
    place_values = k ** torch.arange(n - 1, -1, -1)  # [N]: K**(N-1), ..., K, 1 (agent 0 is the slowest digit)
    return (joint // place_values) % k  # [K**N, N]


def cross_credit(joint_returns: Tensor, num_agents: int, num_samples: int) -> Tensor:
    """Per-completion credit in cross mode (REFERENCE §3.6, E.3).

    credit[i, k] = SUM over all K**(N-1) joint actions in which agent i used its sample k of their return.
    (A sum, not a mean, as in CoMLRL.) Joint actions must be in itertools.product order.

    Args:
        joint_returns: [..., K**N].
    Returns:
        [..., N, K].
    """
    _check_cross_sizes(num_agents, num_samples)
    n, k = num_agents, num_samples
    if joint_returns.shape[-1] != k**n:
        raise ValueError(
            f"joint_returns must have K**N = {k}**{n} = {k**n} entries in its last dim "
            f"(got {joint_returns.shape[-1]})."
        )
    lead = joint_returns.shape[:-1]
    grid = _as_float(joint_returns).reshape(*lead, *([k] * n))  # [..., K, ..., K]: axis i = agent i's sample
    per_agent = [  # agent i: bring its axis last, flatten the other agents' axes and sum them out
        grid.movedim(len(lead) + i, -1).reshape(*lead, k ** (n - 1), k).sum(dim=-2)  # [..., K]
        for i in range(n)
    ]
    return torch.stack(per_agent, dim=-2)  # [..., N, K]


def _check_cross_sizes(num_agents: int, num_samples: int) -> None:
    if num_agents < 1:
        raise ValueError(f"num_agents must be >= 1 (got {num_agents}).")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 (got {num_samples}).")


def suffix_returns(rewards: Tensor, discount: float = 1.0) -> Tensor:
    """Discounted reward-to-go along the last (turn) dimension.

    G_t = sum_{u >= t} discount**(u - t) * r_u, computed backwards as G_t = r_t + discount * G_{t+1}.

    Args:
        rewards: [..., T].
    Returns:
        [..., T].
    """
    r = _as_float(rewards)
    out = torch.empty_like(r)
    running = r.new_zeros(r.shape[:-1])  # G_T = 0 past the last turn
    for t in range(r.shape[-1] - 1, -1, -1):  # T is the number of turns: tiny
        running = r[..., t] + discount * running
        out[..., t] = running
    return out
