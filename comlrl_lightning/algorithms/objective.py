"""An algorithm's learning rule as one object composed into its host module (``module.objective``).

The host (``MultiAgentModule`` and its on-policy or preference loop) owns the team, sampling, the buffer, the
schedule, the optimizer, the update skeleton, evaluation and checkpoints. The objective says, in a handful of
methods, what makes the algorithm itself: what it keeps from a fresh rollout, how it prepares a turn group, the
losses of one update, the metrics of a mini-batch and the extra models it trains (critics). It reads its settings
from the host's fields (``self.host.<field>``, declared in ``algorithms/fields.py``). docs/new_algorithm.md shows
three worked examples.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, ClassVar, Iterator

from torch import Tensor, nn

from comlrl_lightning.algorithms.evaluation import Evaluation
from comlrl_lightning.rollout.tree import Node, Rollout


class Objective(metaclass=abc.ABCMeta):
    """What one update optimises, and what it needs from experience. Every method but :meth:`losses` has a
    default that does nothing extra."""

    evaluation_class: ClassVar[type[Evaluation]] = Evaluation  # what the host's ``module.evaluation`` is
    reward_per_node: ClassVar[bool] = False  # on-policy: one reward call per node, 1/J/N values (actor-critic)
    per_agent_rewards: ClassVar[bool] = True  # on-policy: an N-value reward is one reward per agent
    needs_sampling_logprobs: ClassVar[bool] = False  # on-policy: keep the sampling policy's token log-probs
    passes: ClassVar[int] = 1  # on-policy: shuffled passes over every drained buffer
    trains_agents: ClassVar[bool] = True  # False: its updates train its own models only (a reward model)

    def __init__(self, host: Any):
        self.host = host

    def check(self) -> None:
        """Rules across the host's fields this objective needs (raise ``ValueError`` naming the field); runs before
        any model loads and before the hyper-parameters are saved, so a derived value is stored as used."""

    # ------------------------------------------------------------------ experience (on-policy hosts)
    def after_rollout(self, rollout: Rollout) -> None:
        """What is computed on fresh nodes before they are buffered (actor-critic: values and targets)."""

    def records(self, rollout: Rollout) -> list[Any]:
        """What the buffer holds and ``rollout_buffer_size`` counts: nodes."""
        return rollout.nodes

    def record_from_state(self, state: dict[str, Any]) -> Any:
        """A buffered record back from a checkpoint (``record.state_dict()``)."""
        return Node.from_state_dict(state)

    def prepare_group(self, group: list[Any]) -> None:
        """Per drained turn group, before its mini-batches (actor-critic: advantages over the group)."""

    def node_record(self, node: Node) -> dict[str, Any]:
        """What the completions log adds for a node (actor-critic: per-agent rewards and values)."""
        return {}

    # ------------------------------------------------------------------ the update
    @abc.abstractmethod
    def losses(self, batch: Any) -> Iterator[tuple[Tensor, dict[str, Tensor | float]]]:
        """Yield ``(loss, diagnostics)`` per forward of one update (checked finite); the losses sum to the
        update's objective, the diagnostics are summed over the forwards and logged."""

    def batch_metrics(self, batch: Any) -> dict[str, float]:
        """Metrics of the mini-batch itself, taken before the optimizer step."""
        return {}

    # ------------------------------------------------------------------ the extra models it trains
    def build_models(self) -> None:
        """Load or build the models it trains besides the agents (registered on the host), after the agents."""

    def models(self) -> list[nn.Module]:
        """Its extra models (sharded under FSDP, kept whole for evaluation)."""
        return []

    def parameter_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups of its extra models (``params``, ``lr``, ``name``, ``agents: []``)."""
        return []

    def trained_models(self) -> list[tuple[list[str], nn.Module]]:
        """(metric names, model) of its extra models, for the gradient norms."""
        return []

    def place_models(self) -> None:
        """Move its extra models to their devices when the fit starts."""

    def save_pretrained(self, root: Path) -> None:
        """Write its extra models beside the agents' export (rank 0 writes; gather sharded models on every rank)."""
