"""Which agents learn at an update, and HAPPO's weighting of a sequential update — pure functions.

* :func:`block_agents`: alternating training (CoMLRL's recursive self-improvement, MARFT's
  ``agent_iteration_interval``): the updates are cut into blocks of ``every`` updates and block b trains
  ``groups[b mod len(groups)]``.
* :func:`agent_order`: a sequential update's order of the agents — as given, reversed, or a permutation drawn
  from ``(seed, update)`` alone, so that a resumed run draws the same orders.
* :func:`sequence_log_ratios` and :func:`ratio_product_weights`: HAPPO (Kuba et al., 2022, "Trust Region Policy
  Optimisation in Multi-Agent Reinforcement Learning") and HAGRPO update the agents one after another in one
  update; agent m's advantage is multiplied by M = Π_{j before m} π_j^new(a_j | s) / π_j^old(a_j | s), the ratio of
  the joint action's own sample of every agent updated before it, here clipped to [m_clip_min, m_clip_max] (HAGRPO's
  0.1 and 2.0): a joint action the earlier agents now make likelier weighs more for the later ones.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor

AgentOrder = Literal["fixed", "reversed", "shuffled"]
LogRatio = Literal["sum", "mean"]


def block_agents(update: int, groups: Sequence[Sequence[int]], every: int) -> list[int]:
    """The agents trained at ``update`` (0-based) when blocks of ``every`` updates train ``groups`` in turn."""
    return list(groups[(update // every) % len(groups)])


def agent_order(agents: Sequence[int], order: AgentOrder, update: int, seed: int) -> list[int]:
    """The order a sequential update visits ``agents``: ``fixed`` (as given), ``reversed``, or ``shuffled``: a
    permutation drawn from a generator seeded with ``seed`` and ``update`` only (the same at every rank and after a
    resume)."""
    agents = list(agents)
    if order == "fixed":
        return agents
    if order == "reversed":
        return agents[::-1]
    generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(update))
    return [agents[j] for j in torch.randperm(len(agents), generator=generator).tolist()]


def sequence_log_ratios(new: Tensor, old: Tensor, mask: Tensor, reduce: LogRatio = "sum") -> Tensor:
    """log π_new(y) − log π_old(y) per row [B] from token log-probs [B, T] over the completion ``mask``: the sum
    (the sequence's ratio) or, ``mean``, the mean over its tokens (HAGRPO's ``normalize_log_prob_by_length``: a
    ratio that does not grow with the length). A row without tokens has ratio 1."""
    mask = mask.to(new.dtype)
    total = ((new - old) * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if reduce == "mean" else total


def ratio_product_weights(log_ratios: Sequence[Tensor], low: float, high: float) -> Tensor:
    """M [B] = clip(Π_j exp(log_ratios[j]), low, high): the weight of a later agent's advantage, from the per-row
    log-ratios of the agents updated before it (none: 1)."""
    if not log_ratios:
        raise ValueError("ratio_product_weights needs the log-ratios of at least one agent")
    return torch.stack(list(log_ratios)).sum(0).exp().clamp(low, high)
