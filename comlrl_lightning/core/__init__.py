"""Pure tensor math (torch only): returns, credit assignment, advantages, KL estimators and losses
(REINFORCE family, actor-critic and preference learning), and preference pair selection/records."""

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
    register_baseline,
    suffix_returns,
    td_targets,
)
from comlrl_lightning.core.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    assert_finite,
    bradley_terry_loss,
    kl_estimate,
    madpo_loss,
    policy_gradient_loss,
    token_loss_weights,
    value_loss,
)
from comlrl_lightning.core.pairs import PAIR_SELECTIONS, RECORD_KEYS, PreferencePair, select_pairs

__all__ = [
    "ADVANTAGE_MODES",
    "BASELINES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "PAIR_SELECTIONS",
    "RECORD_KEYS",
    "PreferencePair",
    "assert_finite",
    "bradley_terry_loss",
    "bootstrap_returns",
    "compute_advantages",
    "critic_advantages",
    "cross_credit",
    "cross_joint_indices",
    "discounted_returns",
    "expand_rewards",
    "kl_estimate",
    "madpo_loss",
    "policy_gradient_loss",
    "register_baseline",
    "select_pairs",
    "suffix_returns",
    "td_targets",
    "token_loss_weights",
    "value_loss",
]
