"""Which agents learn, and when: the team's update schedule (``ScheduleFields``; docs/algorithms.md#who-trains-when).

``trained_agents`` names the agents that learn; the others sample with frozen weights (no gradients, no optimizer
state: ``MultiAgentModule.configure_model`` freezes them). ``agent_update_schedule`` says which trained agents step at
each agent update: all of them (``simultaneous``), one block's in turn (``alternating``), or all of them one after
another (``sequential``, HAPPO/HAGRPO: the on-policy update weighs each later agent's advantages by the earlier
agents' ratios, ``core/schedules.py``). The schedule's position — agent updates done — and the seed of a shuffled
order are checkpointed, so a resumed run continues at the block and with the orders an uninterrupted one would.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from comlrl_lightning.algorithms.fields import require
from comlrl_lightning.core.schedules import agent_order, block_agents


def shared_models(sources: Any, num_agents: int) -> list[list[int]]:
    """Groups of agents given the same model object (one set of weights), from the ``agents`` field's sources."""
    if not isinstance(sources, (list, tuple)):
        return []
    groups: dict[int, list[int]] = {}
    for i, source in enumerate(list(sources)[:num_agents]):
        if not isinstance(source, str):
            groups.setdefault(id(source), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


class AgentSchedule:
    """The agents each agent update steps, stage by stage, and the schedule's position.

    Args:
        num_agents: the team size (agents are numbered 0 … num_agents − 1).
        trained_agents: the agents that learn (None: all).
        schedule: ``simultaneous``, ``alternating`` or ``sequential``.
        every: updates per block of an alternating schedule.
        groups: an alternating schedule's blocks (None: each trained agent alone, agents sharing a model together).
        order: a sequential update's order: ``fixed``, ``reversed`` or ``shuffled``.
        shared: groups of agents that share one model (they learn together or not at all).
    """

    def __init__(
        self,
        num_agents: int,
        trained_agents: Sequence[int] | None = None,
        schedule: str = "simultaneous",
        every: int = 1,
        groups: Sequence[Sequence[int]] | None = None,
        order: str = "fixed",
        shared: Sequence[Sequence[int]] = (),
    ):
        agents = list(range(num_agents))
        trained = agents if trained_agents is None else list(trained_agents)
        require(
            bool(trained)
            and all(isinstance(i, int) and i in agents for i in trained)
            and len(set(trained)) == len(trained),
            f"trained_agents must be distinct agent indices in 0..{num_agents - 1} (got {trained_agents!r}); null "
            "trains every agent.",
        )
        self.num_agents, self.trained = num_agents, sorted(trained)
        self.schedule, self.every, self.order = schedule, int(every), order
        for group in shared:
            learning = [i for i in group if i in self.trained]
            require(
                not learning or len(learning) == len(group),
                f"agents {list(group)} share one model, so they learn together or not at all: trained_agents "
                f"{self.trained} names only {learning}.",
            )
            require(
                schedule != "sequential" or not learning,
                f"agent_update_schedule=sequential steps one agent's model at a time, but agents {list(group)} "
                "share one model: give them separate copies, or use simultaneous.",
            )
        together = {i: next((list(g) for g in shared if i in g), [i]) for i in self.trained}  # one model, one block
        default = [together[i] for i in self.trained if together[i][0] == i]
        self.groups = [list(g) for g in groups] if groups is not None else default
        require(
            schedule == "alternating" or groups is None,
            f"alternate_groups is set but agent_update_schedule is {schedule!r}: alternate_groups names the blocks of "
            "an alternating schedule.",
        )
        require(
            all(g and set(g) <= set(self.trained) for g in self.groups),
            f"alternate_groups must be non-empty lists of trained agents {self.trained} (got {self.groups}).",
        )
        for group in shared:
            require(
                all(set(g) >= set(group) or not set(g) & set(group) for g in self.groups),
                f"agents {list(group)} share one model, so an alternating block trains all of them or none "
                f"(alternate_groups: {self.groups}).",
            )
        self.position = 0  # agent updates done
        self.seed: int | None = None  # a shuffled order's seed (the run's, taken at the first update)

    @property
    def frozen(self) -> list[int]:
        """The agents that never learn in this run."""
        return [i for i in range(self.num_agents) if i not in self.trained]

    def stages(self) -> list[list[int]]:
        """The agents the next agent update steps, stage by stage: one stage (``simultaneous``: every trained agent;
        ``alternating``: the current block's), or one stage per agent in the update's order (``sequential``)."""
        if self.schedule == "alternating":
            return [block_agents(self.position, self.groups, self.every)]
        if self.schedule == "sequential":
            if self.seed is None:
                self.seed = int(torch.initial_seed())
            return [[i] for i in agent_order(self.trained, self.order, self.position, self.seed)]
        return [list(self.trained)]

    def advance(self) -> None:
        """One agent update done."""
        self.position += 1

    def metrics(self, stepped: Sequence[int]) -> dict[str, float]:
        """``agent_<i>/stepped``: 1 for the agents this update stepped, 0 for the others (frozen or waiting)."""
        return {f"agent_{i}/stepped": float(i in stepped) for i in range(self.num_agents)}

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = int(state.get("position", 0))
        self.seed = state.get("seed")
