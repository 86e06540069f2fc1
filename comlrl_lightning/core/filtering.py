"""Which groups carry no learning signal: the filter of dynamic sampling (DAPO's ``filter_groups``, verl's
``filter_groups``, OpenRLHF's ``dynamic_filtering``). Pure tensor math.

At a rollout-tree node agent i's K completions form one group, and the group-relative objectives (the MAGRPO
family) give completion k the advantage A_k = normalize(G_k − b(G)) of its credited return G_k. When the K values of a
group are all equal, every registered baseline with normalization on (and mean / leave-one-out / max without it)
gives A = 0 to every completion: the group produces no gradient. A *node* ties when every agent's group ties; then it
teaches no agent anything, and dynamic sampling drops it.

"All equal" is decided with a tolerance, because returns are float32 sums and means (a multi-turn return
r + γ·mean(child G), a cross-mode credit summed over Kᴺ⁻¹ joint actions) that can differ in the last bits where
they are equal in exact arithmetic — and normalization divides such a spread by max(std, 1e-6), turning rounding
noise into advantages. A group of values v ties when

    max(v) − min(v) ≤ tolerance · max(1, max |v|)            tolerance = 1e-6

(an absolute 1e-6 for rewards of order one, relative above: 1e-3 for returns of order 1000; float32 resolves about
6e-8 relatively, so a handful of roundings stays well inside). A group of one value ties (its advantage is 0 with
the mean baseline); NaN or inf values never tie (the update reports them).

Conventions as in ``core/advantages.py``: the group is the last dimension; leading dimensions are independent groups.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

TIE_TOLERANCE = 1e-6


def group_ties(values: Tensor, tolerance: float = TIE_TOLERANCE) -> Tensor:
    """Whether each group (the last dimension) of ``values`` [..., K] has all its values equal:
    ``max − min ≤ tolerance · max(1, max |v|)`` (module docstring). Returns a bool tensor [...]; an empty or
    one-value group ties."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0 (got {tolerance}).")
    v = values.detach().to(torch.float64)  # exact for float32 inputs: the spread is not rounded again
    if v.shape[-1] == 0:
        return torch.ones(v.shape[:-1], dtype=torch.bool, device=v.device)
    spread = v.amax(dim=-1) - v.amin(dim=-1)  # NaN / inf -> NaN: the comparison is False
    scale = v.abs().amax(dim=-1).clamp_min(1.0)
    return spread <= tolerance * scale


def all_groups_tie(credit: Tensor, components: Tensor | None = None, tolerance: float = TIE_TOLERANCE) -> bool:
    """Whether a node gives every agent zero advantage: each agent's K credited returns tie (``credit`` [N, K]) and,
    when the reward has named components, each agent's K credits of each component tie too (``components``
    [N, K, C]; normalised apart, a component can rank a group whose summed credit ties)."""
    if not bool(group_ties(credit, tolerance).all()):
        return False
    return components is None or bool(group_ties(components.movedim(-1, -2), tolerance).all())


def tied_share(ties: Sequence[bool]) -> float:
    """The share of groups (nodes) that tie; 0.0 for none."""
    return sum(bool(t) for t in ties) / len(ties) if len(ties) else 0.0
