"""Frozen reference models for the reference-KL penalty, managed by a callback.

They live here, not on the LightningModule, so they are never trained, never in the checkpoint and never
loaded when the penalty is off. They are copies of the agents taken at ``setup`` — before Lightning restores a
checkpoint — so a resumed run keeps the initial policy as its reference.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from lightning.pytorch import Callback
from torch import Tensor

from comlrl_lightning.agents import resolve_devices
from comlrl_lightning.rollout.sampling import ScoringInputs, select_rows, token_logprobs


class ReferenceModels(Callback):
    """Holds one frozen copy per distinct agent model; ``token_logprobs(i, inputs)`` scores with agent i's. The module
    reads them as ``module.reference``."""

    def __init__(self, devices: str | Sequence[str] | None = None, micro_batch_size: int | None = None):
        self.devices = devices
        self.micro_batch_size = micro_batch_size
        self.models: list[torch.nn.Module] | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.models is not None:
            pl_module.reference = self
            return
        n = pl_module.num_agents
        devices = resolve_devices(self.devices, n, kind="reference_devices") if self.devices is not None else None
        copies: dict[int, torch.nn.Module] = {}
        self.models = []
        for agent in pl_module.agents:
            if id(agent) not in copies:  # shared weights share one reference
                team = getattr(agent, "team", None)  # a LoRA team: the base with its adapters off, not a copy
                copies[id(agent)] = (
                    team.reference() if team is not None else copy.deepcopy(agent).eval().requires_grad_(False)
                )
            self.models.append(copies[id(agent)])
        self._devices = devices
        pl_module.reference = self

    @torch.no_grad()
    def token_logprobs(self, agent: int, inputs: ScoringInputs, default_device: torch.device) -> Tensor:
        """Reference log-probs [B, T] on CPU; the model sits on ``reference_devices[agent]`` or the agent's."""
        model = self.models[agent].to(self._devices[agent] if self._devices else default_device)
        rows = inputs.input_ids.shape[0]
        step = self.micro_batch_size or rows
        parts = [token_logprobs(model, select_rows(inputs, slice(s, s + step))).cpu() for s in range(0, rows, step)]
        return torch.cat(parts)
