"""The optimizer side of an update: the team's one AdamW and its kernel, the learning-rate schedule (warm-up then
constant, linear or cosine decay), the scheduler that steps each parameter group over the updates that trained it,
the gradient norms and clipping, and the optimizer side of one update (:class:`UpdateStep`). Plain helpers: none takes
the module."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Any, Sequence

import torch
from torch import Tensor

from comlrl_lightning.agents.sharding import is_sharded, reduce_gradients, refresh
from comlrl_lightning.algorithms.team import agent_groups, trainable_parameters
from comlrl_lightning.config_errors import ConfigurationError
from comlrl_lightning.rollout import weights
from comlrl_lightning.runs import ranks


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


def build_optimizer(
    groups: list[dict[str, Any]],
    implementation: str,
    weight_decay: float,
    warmup_steps: int,
    decay: str,
    decay_steps: int | None,
    min_ratio: float,
    max_steps: int,
) -> Any:
    """``configure_optimizers``'s answer: ONE AdamW over every parameter group (one per distinct model), with the
    update scheduler when the rate warms up or decays (``decay_steps``, else ``max_steps``: the updates it spans)."""
    kernel = adamw_kernel(implementation, [p for g in groups for p in g["params"]])
    optimizer = torch.optim.AdamW(groups, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8, **kernel)
    if warmup_steps == 0 and decay == "constant":
        return optimizer
    total = decay_steps or (max_steps if max_steps > 0 else None)
    if total is None and decay != "constant":
        raise ConfigurationError(
            f"lr_decay={decay!r} needs the number of updates it spans: set model lr_decay_steps, or "
            "trainer.max_steps (updates; a fit's update count is not known in advance: rollouts, pairs and "
            "rounds vary)."
        )
    schedule = LearningRateSchedule(warmup_steps, decay, int(total or 1), min_ratio)
    return {"optimizer": optimizer, "lr_scheduler": UpdateScheduler(optimizer, schedule)}


def clip_and_measure(
    trained: Sequence[tuple[list[str], list[Tensor], bool]], max_grad_norm: float | None
) -> dict[str, float]:
    """``<name>/grad_norm`` of each trained model, given as (metric names, its optimized parameters, whether they are
    FSDP shards), its gradients clipped to ``max_grad_norm`` when set (a sharded model's norm is over every rank's
    shards, and clipped the same way on each)."""
    norms = {}
    for names, params, sharded in trained:
        params = [p for p in params if p.grad is not None]
        if not params:
            continue
        if sharded:
            norm = ranks.sharded_norm(p.grad.to_local() for p in params)
            if max_grad_norm is not None and norm > max_grad_norm:
                torch._foreach_mul_([p.grad for p in params], max_grad_norm / (norm + 1e-6))
        elif max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        for name in names:
            norms[f"{name}/grad_norm"] = float(norm)
    return norms


def trained_parameters(
    trained_models: Sequence[tuple[list[str], Any]], optimizer: torch.optim.Optimizer
) -> list[tuple[list[str], list[Tensor], bool]]:
    """Per trained model (its metric names, the first its parameter group's; the model): the names, the parameters
    the optimizer steps (a sharded model's shards, which its module does not show while gathered: its parameter
    group's; else its trainable parameters) and whether they are FSDP shards (what :func:`clip_and_measure` reads)."""
    by_name = {g.get("name"): g["params"] for g in optimizer.param_groups}
    return [
        (names, by_name[names[0]] if is_sharded(m) else trainable_parameters(m), is_sharded(m))
        for names, m in trained_models
    ]


class UpdateStep:
    """The optimizer side of one team update, from explicit parts (a loop's ``update`` makes one with
    ``MultiAgentModule.begin_update``): the gradients zeroed at the start; :meth:`backward` per forward (one graph at
    a time, DDP's per-backward sync off, a sharded model's loss scaled so FSDP's average is row-weighted), metrics
    summed on the device; :meth:`finish` averages the gradients over the ranks, clips and measures every trained
    model's gradient norm, takes one optimizer step and one scheduler step (one ``global_step``). In a data-parallel
    run every rank updates together, each on its own mini-batch of ``rows`` (possibly empty), so every rank holds
    the same weights after it."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        trained: list[tuple[list[str], Any]],
        sharded: list[Any],
        rows: int,
        backward: Any,
        no_sync: Any = contextlib.nullcontext,
        max_grad_norm: float | None = None,
    ):
        self.optimizer, self.scheduler, self.trained, self.sharded = optimizer, scheduler, trained, sharded
        self.rows, self._backward, self.no_sync, self.max_grad_norm = rows, backward, no_sync, max_grad_norm
        # Sharded models: FSDP averages over ranks; scaling by rows x D / all rows makes it row-weighted.
        self.scale = rows * ranks.world_size() / max(ranks.reduce_sum(rows), 1) if sharded else 1.0
        self.sums: dict[str, Any] = defaultdict(float)
        self.measured: dict[str, float] = {}  # what the models stepped by step_now measured
        optimizer.zero_grad()

    def backward(self, loss: Tensor, metrics: dict[str, Any] | None = None) -> None:
        """Back-propagate one forward's loss and add its metrics (summed on the device, read once at the end; a
        tensor joins the running total's device: agents placed on different devices add to one loss)."""
        with self.no_sync():  # DDP expects one backward per forward; ours are one per agent: synced once in finish
            self._backward(loss * self.scale if self.scale != 1.0 else loss)
        self.add(metrics or {})

    def add(self, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            value = value.detach() if isinstance(value, Tensor) else value
            total = self.sums[key]
            self.sums[key] = total + (value.to(total.device) if isinstance(total, Tensor) else value)

    def step_now(self, models: Sequence[Any]) -> None:
        """Step ``models`` now, before the update's later forwards (a sequential schedule's earlier agents): their
        gradients averaged, clipped, measured and applied, then cleared. The update's one ``global_step`` is still
        :meth:`finish`'s."""
        now = [m for m in self.sharded if any(m is x for x in models)]
        self.sharded = [m for m in self.sharded if not any(m is x for x in models)]
        self.measured.update(self._apply(now, getattr(self.optimizer, "optimizer", self.optimizer)))
        self.optimizer.zero_grad()

    def finish(self) -> dict[str, float]:
        """Average, clip, step: the gradient norms, the learning rates this update used and the summed metrics."""
        metrics = {**self.measured, **self._apply(self.sharded, self.optimizer)}
        return {**metrics, **{key: float(value) for key, value in self.sums.items()}}

    def _apply(self, sharded: list[Any], optimizer: Any) -> dict[str, float]:
        """One optimizer step on the gradients there are (of ``sharded`` models, and the unsharded ones'), through
        ``optimizer`` (Lightning's, which counts ``global_step``, or the torch optimizer it wraps)."""
        if sharded:  # data-parallel runs: one all-reduce per step (else nothing)
            reduce_gradients(sharded)
        else:
            ranks.average_gradients((p for g in self.optimizer.param_groups for p in g["params"]), self.rows)
        metrics = clip_and_measure(trained_parameters(self.trained, self.optimizer), self.max_grad_norm)
        for group in self.optimizer.param_groups:  # the rate this update used
            metrics[f"{group.get('name', 'group')}/learning_rate"] = group["lr"]
        stepped = [any(p.grad is not None for p in group["params"]) for group in self.optimizer.param_groups]
        optimizer.step()
        refresh(sharded)  # sharded models: gather the updated weights
        # what sampled with the stepped weights (a generation copy, an engine, a server) takes them again
        weights.weights_changed(p for group in self.optimizer.param_groups for p in group["params"])
        if self.scheduler is not None:
            self.scheduler.step_groups(stepped)
        return metrics


def agent_parameter_groups(
    agents: Any, learning_rates: Sequence[float], trained: Sequence[int]
) -> list[dict[str, Any]]:
    """One AdamW parameter group per distinct model of the ``trained`` agents: its learning rate, named
    ``agent_<i>`` (a frozen agent has none: no optimizer state)."""
    return [
        {
            "params": trainable_parameters(agents[ids[0]]),
            "lr": learning_rates[ids[0]],
            "name": f"agent_{ids[0]}",
            "agents": ids,
        }
        for ids in agent_groups(agents, trained)
    ]


def agent_trained_models(agents: Any, trained: Sequence[int]) -> list[tuple[list[str], Any]]:
    """(metric names, model) of each distinct model of the ``trained`` agents (``agent_<i>`` for every agent sharing
    it)."""
    return [([f"agent_{i}" for i in ids], agents[ids[0]]) for ids in agent_groups(agents, trained)]
