from comlrl_lightning.algorithms.actor_critic import IAC, MAAC
from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.reinforce import MAGRPO, MAREINFORCE, MARLOO, MAReMax

__all__ = ["IAC", "MAAC", "MultiAgentModule", "MAGRPO", "MAREINFORCE", "MARLOO", "MAReMax"]
