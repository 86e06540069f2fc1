from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.reinforce import MAGRPO, MAREINFORCE, MARLOO, MAReMax

__all__ = ["MultiAgentModule", "MAGRPO", "MAREINFORCE", "MARLOO", "MAReMax"]
