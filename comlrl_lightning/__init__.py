"""comlrl_lightning: cooperative multi-LLM reinforcement learning on PyTorch Lightning.

python -m comlrl_lightning fit --config configs/magrpo.yaml
"""

__version__ = "0.1.0"

from comlrl_lightning.installs import check_torch_extensions  # noqa: E402
from comlrl_lightning.quiet import quiet_known_noise  # noqa: E402

quiet_known_noise()
check_torch_extensions()  # before torchmetrics, transformers or vLLM import torchvision (installs.py)

from comlrl_lightning.algorithms import (  # noqa: E402
    IAC,
    MAAC,
    MADPO,
    MAGRPO,
    MAREINFORCE,
    MARLHF,
    MARLOO,
    CentralizedMAGRPO,
    MADPOIter,
    MAReMax,
    MARLHFIter,
    MultiAgentModule,
)
from comlrl_lightning.data import PreferenceDataModule, TaskDataModule  # noqa: E402

__all__ = [
    "CentralizedMAGRPO",
    "IAC",
    "MAAC",
    "MADPO",
    "MADPOIter",
    "MAGRPO",
    "MARLHF",
    "MARLHFIter",
    "MAREINFORCE",
    "MARLOO",
    "MAReMax",
    "MultiAgentModule",
    "PreferenceDataModule",
    "TaskDataModule",
    "__version__",
]
