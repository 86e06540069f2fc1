"""Pure tensor math (torch only): returns, credit assignment, advantages, KL estimators and losses."""

from comlrl_lightning.core.advantages import (
    ADVANTAGE_MODES,
    BASELINES,
    bootstrap_returns,
    compute_advantages,
    cross_credit,
    cross_joint_indices,
    suffix_returns,
)
from comlrl_lightning.core.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    assert_finite,
    kl_estimate,
    policy_gradient_loss,
    token_loss_weights,
)

__all__ = [
    "ADVANTAGE_MODES",
    "BASELINES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "assert_finite",
    "bootstrap_returns",
    "compute_advantages",
    "cross_credit",
    "cross_joint_indices",
    "kl_estimate",
    "policy_gradient_loss",
    "suffix_returns",
    "token_loss_weights",
]
