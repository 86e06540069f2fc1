"""Pure tensor math (torch only): returns, credit assignment, advantages, KL estimators and losses
(REINFORCE family and actor-critic)."""

from comlrl_lightning.core.advantages import (
    ADVANTAGE_MODES,
    BASELINES,
    bootstrap_returns,
    compute_advantages,
    critic_advantages,
    cross_credit,
    cross_joint_indices,
    discounted_returns,
    expand_rewards,
    suffix_returns,
    td_targets,
)
from comlrl_lightning.core.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    assert_finite,
    kl_estimate,
    policy_gradient_loss,
    token_loss_weights,
    value_loss,
)

__all__ = [
    "ADVANTAGE_MODES",
    "BASELINES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "assert_finite",
    "bootstrap_returns",
    "compute_advantages",
    "critic_advantages",
    "cross_credit",
    "cross_joint_indices",
    "discounted_returns",
    "expand_rewards",
    "kl_estimate",
    "policy_gradient_loss",
    "suffix_returns",
    "td_targets",
    "token_loss_weights",
    "value_loss",
]
