from comlrl_lightning.algorithms.actor_critic import IAC, MAAC
from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.madpo import MADPO
from comlrl_lightning.algorithms.marlhf import MARLHF
from comlrl_lightning.algorithms.reinforce import MAGRPO, MAREINFORCE, MARLOO, MAReMax

__all__ = ["IAC", "MAAC", "MADPO", "MARLHF", "MultiAgentModule", "MAGRPO", "MAREINFORCE", "MARLOO", "MAReMax"]
