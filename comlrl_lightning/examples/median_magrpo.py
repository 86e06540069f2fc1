"""MAGRPO with the group median as its baseline: register the baseline, make it the class's default."""

from torch import Tensor

from comlrl_lightning.algorithms import MAGRPO
from comlrl_lightning.core.advantages import register_baseline


@register_baseline("median")  # from now on `advantage_mode: median` is valid in any config
def median_baseline(returns: Tensor) -> Tensor:
    """A_k = G_k − median_j G_j over the K samples of a group (returns [..., K])."""
    return returns - returns.median(dim=-1, keepdim=True).values


class MedianMAGRPO(MAGRPO):  # a shift baseline shows only with advantage_normalization: false
    field_defaults = {"advantage_mode": "median"}
