"""The optimizer side of an update: the AdamW kernel, the learning-rate schedule (warm-up then constant, linear or
cosine decay), and the scheduler that steps each parameter group over the updates that trained it."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor


class LearningRateSchedule:
    """Multiplier of a group's learning rate at its update ``step`` (0-based): linear warm-up over ``warmup``
    updates ((step + 1) / warmup), then ``constant``, or ``linear``/``cosine`` decay from 1 at update ``warmup``
    towards ``min_ratio``, reached at update ``total`` — just after the last of ``total`` updates, as in the usual
    Hugging Face schedules (so no update runs at a zero rate) — and kept after it."""

    def __init__(self, warmup: int, decay: str, total: int, min_ratio: float):
        self.warmup, self.decay, self.total, self.min_ratio = warmup, decay, max(total, 1), min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay == "constant":
            return 1.0
        progress = min((step - self.warmup) / max(self.total - self.warmup, 1), 1.0)
        shape = 1.0 - progress if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * shape


class UpdateScheduler(torch.optim.lr_scheduler.LRScheduler):
    """Each parameter group's rate follows ``schedule`` over the updates that trained that group (MARLHF's agents
    do not warm up during its reward-model stage, nor its reward model during RL). Its state — each group's update
    count and the schedule's settings — is checkpointed, so a resumed run continues where it stopped."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LearningRateSchedule):
        self.schedule = schedule
        self.group_updates = [0] * len(optimizer.param_groups)
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [base * self.schedule(n) for base, n in zip(self.base_lrs, self.group_updates)]

    def step_groups(self, trained: Sequence[bool]) -> None:
        """After an optimizer step: advance the groups that had gradients in it."""
        self.group_updates = [n + int(t) for n, t in zip(self.group_updates, trained)]
        self.step()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "schedule": dict(vars(self.schedule))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self.schedule.__dict__.update(state.pop("schedule", {}))
        super().load_state_dict(state)


def adamw_kernel(choice: str, params: Sequence[Tensor]) -> dict[str, bool]:
    """``torch.optim.AdamW``'s kernel arguments for ``adamw_implementation``. ``auto``: the fused kernel (one pass over
    all tensors; ~2x the for-loop step on CPU, benchmarks/README.md) where every parameter is a plain floating-point
    tensor on a CPU or CUDA device; ``foreach`` otherwise (e.g. FSDP-sharded DTensors)."""
    if choice == "auto":
        fusable = all(
            type(p.data) is Tensor
            and p.device.type in ("cpu", "cuda")
            and p.dtype in (torch.float32, torch.float16, torch.bfloat16)
            for p in params
        )
        choice = "fused" if fusable else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[choice]
