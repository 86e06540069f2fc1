"""An algorithm's learning rule as a loss of tensors, and the models a module trains besides its agents.

An **objective** is built with its settings (constructor parameters named as the fields they come from,
:meth:`Objective.from_fields`) and its ``loss`` takes tensors only: a batch of log-probs, stored log-probs,
advantages, loss weights, values. It never sees the module: the loop that owns the update (``OnPolicyModule.update``,
``MADPO.update``, ...) prepares the tensors, calls the loss, and steps the optimizer. So an objective is unit-tested
with tensors alone (tests/test_objectives.py) and a new algorithm is a small subclass that overrides ``loss``
(docs/new_algorithm.md).

A **model part** owns the models an algorithm trains besides the agents (IAC/MAAC's critics, MARLHF's reward
model): it creates, places, saves and exports them and says how the optimizer sees them. The module registers what
:meth:`ModelPart.build` returns under ``part.name`` (so checkpoints hold it) and asks every part for its parameter
groups, its gradient norms' names and its export.
"""

from __future__ import annotations

import abc
import inspect
from pathlib import Path
from typing import Any, Mapping

from torch import Tensor, nn


class Objective:
    """What one update optimises, as a function of tensors. Subclasses define ``loss`` with the tensors they need,
    and return ``(loss, metrics)``: the scalar to back-propagate and detached, additive metrics (summed over an
    update's forwards and logged)."""

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> "Objective":
        """The objective with its settings taken from a module's field values, by constructor parameter name."""
        names = inspect.signature(cls).parameters
        return cls(**{name: values[name] for name in names if name in values})

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        """An update's logged metrics from the sums of its forwards' (a ratio objective turns sums into means)."""
        return metrics

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({settings})"


class ModelPart(abc.ABC):
    """Models a module trains besides its agents. ``build`` returns the ``nn.Module`` the module registers under
    :attr:`name` (checkpoint keys ``<name>.*``); the other methods read the built module."""

    name: str = "part"

    def __init__(self) -> None:
        self.module: nn.Module | None = None

    @abc.abstractmethod
    def build(self, tokenizers: list[Any], agents: nn.ModuleList) -> nn.Module:
        """Create (load) the part's models; the caller registers the result under ``name``."""

    def models(self) -> list[nn.Module]:
        """Its trained models, one per parameter group (sharded under FSDP, exported one by one)."""
        return list(self.module) if isinstance(self.module, nn.ModuleList) else [self.module]

    @abc.abstractmethod
    def learning_rate(self) -> float:
        """The learning rate of its parameter groups."""

    def metric_name(self, index: int) -> str:
        """The parameter-group and metric name of model ``index`` (``critic_0``, ``reward_model``)."""
        return f"{self.name}_{index}"

    def parameter_groups(self) -> list[dict[str, Any]]:
        """One AdamW parameter group per model (``params``, ``lr``, ``name``, ``agents: []``)."""
        return [
            {
                "params": [p for p in model.parameters() if p.requires_grad],
                "lr": self.learning_rate(),
                "name": self.metric_name(j),
                "agents": [],
            }
            for j, model in enumerate(self.models())
        ]

    def trained_models(self) -> list[tuple[list[str], nn.Module]]:
        """(metric names, model) per model, for the gradient norms."""
        return [([self.metric_name(j)], model) for j, model in enumerate(self.models())]

    def place(self) -> None:
        """Move the models to their devices when the fit starts (default: where Lightning put them)."""

    def save_pretrained(self, root: Path, tokenizers: list[Any]) -> None:
        """Write the models beside the agents' export (rank 0 writes; gather sharded models on every rank)."""


def detach_metrics(metrics: Mapping[str, Tensor | float]) -> dict[str, Tensor | float]:
    """``metrics`` with every tensor detached (what an objective returns beside its loss)."""
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in metrics.items()}
