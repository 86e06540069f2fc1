"""comlrl_lightning: cooperative multi-LLM reinforcement learning on PyTorch Lightning."""

__version__ = "0.1.0"
