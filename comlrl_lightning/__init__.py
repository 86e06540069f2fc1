"""comlrl_lightning: cooperative multi-LLM reinforcement learning on PyTorch Lightning.

    python -m comlrl_lightning fit --config configs/magrpo.yaml
"""

__version__ = "0.1.0"

from comlrl_lightning.algorithms import IAC, MAAC, MAGRPO, MAREINFORCE, MARLOO, MAReMax, MultiAgentModule  # noqa: E402
from comlrl_lightning.data import TaskDataModule  # noqa: E402

__all__ = ["IAC", "MAAC", "MAGRPO", "MAREINFORCE", "MARLOO", "MAReMax", "MultiAgentModule", "TaskDataModule", "__version__"]
