from comlrl_lightning.algorithms.actor_critic import IAC, MAAC, ActorCritic, JointCritic
from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.madpo import MADPO, JointDPO, MADPOIter
from comlrl_lightning.algorithms.marlhf import MARLHF, BradleyTerry, MARLHFIter
from comlrl_lightning.algorithms.objective import Objective
from comlrl_lightning.algorithms.reinforce import MAGRPO, MAREINFORCE, MARLOO, CentralizedMAGRPO, GroupRelative, MAReMax

__all__ = [
    "ActorCritic",
    "BradleyTerry",
    "GroupRelative",
    "JointCritic",
    "JointDPO",
    "Objective",
    "CentralizedMAGRPO",
    "IAC",
    "MAAC",
    "MADPO",
    "MADPOIter",
    "MARLHF",
    "MARLHFIter",
    "MultiAgentModule",
    "MAGRPO",
    "MAREINFORCE",
    "MARLOO",
    "MAReMax",
]
