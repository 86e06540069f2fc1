from comlrl_lightning.algorithms.actor_critic import IAC, MAAC
from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.madpo import MADPO, MADPOIter
from comlrl_lightning.algorithms.marlhf import MARLHF, MARLHFIter
from comlrl_lightning.algorithms.reinforce import MAGRPO, MAREINFORCE, MARLOO, CentralizedMAGRPO, MAReMax

__all__ = [
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
