"""CoMLRL's public API on comlrl_lightning: a CoMLRL script runs with only its import lines changed (docs/compat.md).

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer          # CoMLRL
    from comlrl.utils.reward_processor import RewardProcessors
    from comlrl_lightning.compat import MAGRPOConfig, MAGRPOTrainer, RewardProcessors   # here

The configs (``configs.py``) are dataclasses with CoMLRL's field names and defaults, derived from our modules'
fields; the trainers (``trainers.py``) build the module, the data module and a Lightning ``Trainer`` and offer
CoMLRL's ``train()``, ``evaluate()``, ``save_model()``, ``save_checkpoint()`` and ``load_checkpoint()``
(``checkpoints.py``: CoMLRL 1.4.3's checkpoint folders on Lightning checkpoints, and ``read_checkpoint_metadata``). CoMLRL's algorithms are those of Liu et al., *LLM
Collaboration With Multi-Agent Reinforcement Learning*, arXiv:2508.04652.
"""

from comlrl_lightning.agents import CausalLMWithValueHead, JointRewardModel
from comlrl_lightning.compat.checkpoints import read_checkpoint_metadata
from comlrl_lightning.compat.configs import (
    CentralizedMAGRPOConfig,
    IACConfig,
    MAACConfig,
    MADPOConfig,
    MADPOIterConfig,
    MAGRPOConfig,
    MAREINFORCEConfig,
    MAReMaxConfig,
    MARLHFConfig,
    MARLHFIterConfig,
    MARLOOConfig,
)
from comlrl_lightning.compat.trainers import (
    CentralizedMAGRPOTrainer,
    IACTrainer,
    MAACTrainer,
    MADPOIterTrainer,
    MADPOTrainer,
    MAGRPOTrainer,
    MAREINFORCETrainer,
    MAReMaxTrainer,
    MARLHFIterTrainer,
    MARLHFTrainer,
    MARLOOTrainer,
)
from comlrl_lightning.rollout.centralized import CentralizedParseError as CentralizedComparatorParseError
from comlrl_lightning.rollout.centralized import TaggedCentralizedAdapter as TaggedCentralizedComparatorAdapter
from comlrl_lightning.rollout.rewards import RewardProcessors

__all__ = [
    "CausalLMWithValueHead",
    "CentralizedComparatorParseError",
    "CentralizedMAGRPOConfig",
    "CentralizedMAGRPOTrainer",
    "IACConfig",
    "IACTrainer",
    "JointRewardModel",
    "MAACConfig",
    "MAACTrainer",
    "MADPOConfig",
    "MADPOIterConfig",
    "MADPOIterTrainer",
    "MADPOTrainer",
    "MAGRPOConfig",
    "MAGRPOTrainer",
    "MARLHFConfig",
    "MARLHFIterConfig",
    "MARLHFIterTrainer",
    "MARLHFTrainer",
    "MAREINFORCEConfig",
    "MAREINFORCETrainer",
    "MARLOOConfig",
    "MARLOOTrainer",
    "MAReMaxConfig",
    "MAReMaxTrainer",
    "RewardProcessors",
    "TaggedCentralizedComparatorAdapter",
    "read_checkpoint_metadata",
]
