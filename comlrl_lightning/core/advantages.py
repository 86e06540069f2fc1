"""Returns, credit assignment and advantages: pure tensor math (docs/algorithms.md).

Conventions: the *group* is always the last dimension. For one rollout-tree node and one agent it holds the
K returns of that agent's K completions; any leading dimensions are independent batches of groups.
"""

from __future__ import annotations

from typing import Callable, Literal, Sequence

import torch
from torch import Tensor

ADVANTAGE_MODES = ("mean", "raw", "max", "rloo")  # the built-in baselines; BASELINES holds every registered one


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
}  # the registry: the single source of truth for what ``advantage_mode`` accepts


def register_baseline(name: str, baseline: Callable[[Tensor], Tensor] | None = None):
    """Register ``baseline`` (returns [..., K] -> advantages [..., K], before normalization) as ``advantage_mode:
    name``; once registered the name is valid everywhere, YAML included. Usable as a decorator::

        @register_baseline("median")
        def median_baseline(returns):
            return returns - returns.median(dim=-1, keepdim=True).values
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a baseline's name must be a non-empty string (got {name!r}).")

    def register(function: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        if not callable(function):
            raise TypeError(f"baseline {name!r} must be callable (got {type(function).__name__}).")
        BASELINES[name] = function
        return function

    return register if baseline is None else register(baseline)


def compute_advantages(returns: Tensor, mode: str = "mean", normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages over the last dimension (docs/algorithms.md#baselines-and-advantages).

    A = baseline_mode(G); then, if ``normalize`` and K > 1:
        A <- (A - mean(A)) / max(std_pop(A), eps)        (population std, unbiased=False)

    With normalization every mode gives the same result (the baselines are shifts/scalings within the group);
    turn it off to see the difference between modes.

    Args:
        returns: [..., K] per-completion returns (already KL-shaped if that is enabled).
        mode: a name in ``BASELINES`` (the built-ins, or one added with :func:`register_baseline`).
    Returns:
        [..., K] advantages, at least float32.
    """
    if mode not in BASELINES:
        raise ValueError(f"advantage_mode must be one of: {', '.join(BASELINES)} (got {mode!r}).")
    g = _as_float(returns)  # [..., K]
    adv = BASELINES[mode](g)  # [..., K]
    if normalize:
        adv = _standardize(adv, eps)
    return adv


def _standardize(adv: Tensor, eps: float) -> Tensor:
    """(A - mean(A)) / max(std_pop(A), eps) over the last dim; groups of size <= 1 are returned unchanged."""
    if adv.shape[-1] <= 1:
        return adv
    centred = adv - adv.mean(dim=-1, keepdim=True)
    # The floor keeps all-equal groups at exactly 0 instead of 0/0 = NaN.
    std = adv.std(dim=-1, unbiased=False, keepdim=True).clamp_min(eps)
    return centred / std


RewardAggregation = Literal["sum", "normalize_components"]  # how a reward's named components become advantages


def component_advantages(
    credit: Tensor, weights: Tensor, mode: str = "mean", normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-component group advantages, then their weighted sum (GDPO).

    For a reward that returns named components (``{"syntax": 0.5, "tests": 1.0, ...}``) the credit of each
    completion is kept per component. ``reward_aggregation: sum`` normalises the (weighted) SUM of the components as
    one reward; this is ``normalize_components``:

        A_c = compute_advantages(credit[..., c], mode, normalize)      each component within its group of K
        A   = sum_c weights[c] * A_c

    With summed rewards two completions that trade one level for another tie, and a group whose sums all tie gets
    zero advantage everywhere; normalised apart, each component still ranks the group. With one component and
    weight 1 this is :func:`compute_advantages`.

    Args:
        credit: [..., K, C] per-completion credit of each component (``AgentSamples.credit_components``, stacked
            over nodes: [M, K, C]); the group is dim -2.
        weights: [C] the components' weights (``reward_component_weights``, 1.0 where a name is not given).
        mode, normalize, eps: as in :func:`compute_advantages`, applied to every component.
    Returns:
        [..., K] advantages, at least float32.
    """
    if credit.dim() < 2:
        raise ValueError(f"credit must be [..., K, C] (got shape {tuple(credit.shape)}).")
    if weights.dim() != 1 or weights.shape[0] != credit.shape[-1]:
        raise ValueError(
            f"weights must be [C] with C = {credit.shape[-1]} components, the last dim of credit (got shape "
            f"{tuple(weights.shape)})."
        )
    per_component = compute_advantages(credit.movedim(-1, -2), mode, normalize, eps)  # [..., C, K]
    w = weights.to(device=per_component.device, dtype=torch.promote_types(per_component.dtype, weights.dtype))
    return (per_component.to(w.dtype) * w.unsqueeze(-1)).sum(dim=-2)  # [..., K]


def bootstrap_returns(rewards: Tensor, child_mean_returns: Tensor, has_child: Tensor, discount: float = 1.0) -> Tensor:
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
    """Per-completion credit in cross mode (docs/algorithms.md#returns-and-credit, example 3).

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
            f"joint_returns must have K**N = {k}**{n} = {k**n} entries in its last dim (got {joint_returns.shape[-1]})."
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


# --- Actor-critic (IAC / MAAC, docs/algorithms.md#actor-critic) ---------------------------------------------
# Trajectory tensors are [..., T]: one agent trajectory (or one joint trajectory) per row, turns along the last
# dim. Early-terminated episodes have fewer turns; ``valid`` marks the executed ones, always a prefix of the row.


def _turn_mask(valid: Tensor | None, like: Tensor) -> Tensor:
    """``valid`` as a bool mask of ``like``'s shape (all True when None), checked to be a prefix per row."""
    if valid is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    if valid.shape != like.shape:
        raise ValueError(f"valid must have the rewards' shape {tuple(like.shape)} (got {tuple(valid.shape)}).")
    mask = valid.to(device=like.device, dtype=torch.bool)
    if bool((mask[..., 1:] & ~mask[..., :-1]).any()):
        raise ValueError("valid must mark a prefix of the turns of each row (no executed turn after a skipped one).")
    return mask


def td_targets(rewards: Tensor, next_values: Tensor, discount: float, valid: Tensor | None = None) -> Tensor:
    """One-step TD(0) targets along the turn dimension (multi-turn IAC/MAAC, docs/algorithms.md#actor-critic).

        target_t = r_t + discount * V_old(h_{t+1})     for every executed turn t but the last
        target_t = r_t                                  at the last executed turn (terminal: no bootstrap)
        target_t = 0                                    after it (turns not executed)

    A single-turn episode therefore gets target = r (the Monte-Carlo return).

    Args:
        rewards: [..., T] (KL-shaped) rewards r_t.
        next_values: [..., T]; ``next_values[..., t]`` is the rollout-time value of the NEXT turn's history,
            V_old(h_{t+1}) (e.g. ``old_values.roll(-1, -1)``). Ignored (may be anything, even NaN) at the last
            executed turn and after it.
        valid: [..., T] bool, True for executed turns (a prefix of each row); None = all turns executed.
    Returns:
        [..., T] targets, at least float32.
    """
    if next_values.shape != rewards.shape:
        raise ValueError(
            f"next_values must have the rewards' shape {tuple(rewards.shape)} (got {tuple(next_values.shape)})."
        )
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, next_values.dtype), torch.float32)
    r, v_next = rewards.to(dtype), next_values.to(dtype)  # [..., T]
    mask = _turn_mask(valid, r)  # [..., T]
    has_next = torch.zeros_like(mask)
    has_next[..., :-1] = mask[..., 1:]  # turn t+1 was executed, so turn t bootstraps from it
    targets = torch.where(has_next, r + discount * v_next, r)  # where, not arithmetic: a NaN V_T never leaks
    return targets.masked_fill(~mask, 0.0)


def discounted_returns(rewards: Tensor, discount: float, valid: Tensor | None = None) -> Tensor:
    """Monte-Carlo returns over the executed turns (logged as ``expected_return``, docs/algorithms.md#actor-critic).

        G_t = r_t + discount * G_{t+1}   for executed turns (G = 0 past the last one);   0 for turns not executed.

    Args:
        rewards: [..., T]; entries of turns not executed are ignored.
        valid: [..., T] bool prefix mask of executed turns, or None (all executed).
    Returns:
        [..., T], at least float32.
    """
    r = _as_float(rewards)
    mask = _turn_mask(valid, r)
    returns = suffix_returns(torch.where(mask, r, torch.zeros_like(r)), discount)  # [..., T]
    return returns.masked_fill(~mask, 0.0)


def critic_advantages(targets: Tensor, old_values: Tensor, normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """Actor-critic advantages of one update group (one agent, one turn; docs/algorithms.md#actor-critic).

        A = target - V_old
        if normalize and the group has more than one sample:  A <- (A - mean(A)) / max(std_pop(A), eps)

    Single turn: target = r', so A = r' - V(h) (a learned baseline). Multi-turn: target = ``td_targets``, so
    A = r_t + discount * V(h_{t+1}) - V(h_t), the TD error. ``old_values`` are rollout-time values: advantages are
    computed once per update, not refreshed between mini-batches.

    Args:
        targets, old_values: [..., B]; the group is the last dim (a 1-D tensor is one group).
    Returns:
        [..., B] advantages, at least float32.
    """
    if targets.shape != old_values.shape:
        raise ValueError(
            f"targets and old_values must have the same shape (got {tuple(targets.shape)} and "
            f"{tuple(old_values.shape)})."
        )
    dtype = torch.promote_types(torch.promote_types(targets.dtype, old_values.dtype), torch.float32)
    adv = targets.to(dtype) - old_values.to(dtype)  # [..., B]
    if normalize:
        adv = _standardize(adv, eps)
    return adv


def expand_rewards(
    rewards: Sequence[float] | Tensor, num_agents: int, num_generations: int, per_agent: bool = True
) -> Tensor:
    """Spread one reward call's output over the N x K samples of a joint rollout (docs/algorithms.md#actor-critic).

    The reward function returns one list per prompt; its length decides who gets what:

        length 1                 every sample of every agent gets the single (team) reward
        length K                 sample k of every agent gets reward k (the K aligned joint actions)
        length N                 every sample of agent i gets reward i
        anything else            ValueError

    Checked in this order, as CoMLRL does, so when N == K a list of that length is read as per-sample (length K),
    not per-agent. ``per_agent=False`` rejects the length-N form (MAAC's team critic with K > 1, where N values for
    K joint actions may be a list one short of K rather than per-agent rewards). With one agent a list of length 1 or K gives its single row. Here K = ``num_generations``
    (1 in multi-turn rollouts, where one call covers one turn).

    Returns:
        [N, K] float tensor (float32, or float64 for float64 input).
    """
    if num_agents < 1:
        raise ValueError(f"num_agents must be >= 1 (got {num_agents}).")
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1 (got {num_generations}).")
    if isinstance(rewards, Tensor):
        r = _as_float(rewards.detach()).reshape(-1)
    else:
        r = torch.as_tensor([float(x) for x in rewards], dtype=torch.float32)
    n, k = num_agents, num_generations
    if r.numel() == 1:
        return r.reshape(1, 1).expand(n, k).clone()
    if r.numel() == k:
        return r.reshape(1, k).expand(n, k).clone()
    if r.numel() == n and per_agent:
        return r.reshape(n, 1).expand(n, k).clone()
    if not per_agent:
        raise ValueError(
            f"The team reward must return one value per joint action (num_generations={k}) or one for "
            f"all; got {r.numel()}."
        )
    raise ValueError(
        "Reward function must return 1 value, num_generations values, or num_agents values; "
        f"got {r.numel()} (num_agents={n}, num_generations={k})."
    )
