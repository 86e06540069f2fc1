"""Dynamic sampling (DAPO's ``filter_groups``, verl's ``filter_groups``, OpenRLHF's ``dynamic_filtering``):
drop the rollout-tree nodes that teach nothing and refill the step with the nodes of extra dataset items.

A node whose every agent's group of K credited returns ties (``core.filtering``) gives every agent zero advantage
under the group-relative objectives: it costs a forward and a backward and moves nothing. The training step resolves
its ``RolloutBatch`` through :meth:`DynamicSampling.resolve`:

1. the step's own items are rolled out (the rollout the step would have had); its node count is the *target*;
2. its tied nodes are dropped (each node separately: in a multi-turn tree every node is a record of its own);
3. while fewer nodes are kept than the target and the step's extra-item budget is not spent, the next extra items
   (:class:`ExtraItems`, at most ``chunk`` — the step's batch size — at a time, never past the budget) are rolled out
   by the same policy with the same stamps (``env_step`` moved on by the joint actions before them), and their
   untied nodes kept;
4. the kept nodes are cut to the target (in the order they were sampled) and returned as one ``Rollout``.

Every joint action rolled out, kept or not, counts in ``num_joint_actions`` (env steps), and the timings add up.
When the budget runs out first the step keeps only untied nodes — fewer than the target (DAPO drops tied groups
whatever happens); when no untied node at all was found the step gets its own rollout back whole, all tied, so that it
still has records and metrics (``rollout/zero_advantage_ratio`` 1.0 says so). The rollout's ``metrics``:

* ``rollout/zero_advantage_ratio_before``: the share of the step's own nodes that tied;
* ``rollout/zero_advantage_ratio``: the share of the returned nodes that tie (0.0, or 1.0 in the fallback above);
* ``rollout/dynamic_sampling_extra_prompts``: extra items rolled out this step (this rank);
* ``rollout/dynamic_sampling_fill_ratio``: untied nodes returned / target (1.0 when refilled completely).

Data-parallel: each rank refills its own share from its own stream (ranks may end with different node counts; the
module pads its updates across ranks).

Tied means tied on the task returns the tree computed (``AgentSamples.credit``; per reward component too when the
reward has components and ``by_components`` is on, so a node that a component could still rank is kept). A reference KL placed on the reward is
attached after the rollout and is not looked at: as in DAPO, a group that only the KL term would rank is dropped.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import torch

from comlrl_lightning.core.filtering import all_groups_tie, tied_share
from comlrl_lightning.rollout.tree import Node, Rollout
from comlrl_lightning.runs import ranks


def node_ties(node: Node, by_components: bool = True) -> bool:
    """Whether ``node`` gives every agent zero advantage (``core.filtering.all_groups_tie`` of its agents' credit;
    the node's returns stand in for an agent without credit). ``by_components``: when the reward has named
    components, they must tie too (what ``reward_aggregation: normalize_components`` needs; with ``sum`` only the
    summed credit ranks a group, and False drops a node whose sums tie whatever its components)."""
    credit = torch.stack([a.credit if a.credit is not None else node.returns for a in node.agents])
    parts = [getattr(a, "credit_components", None) for a in node.agents]  # [K, C] each, with named components
    components = torch.stack(parts) if by_components and all(p is not None for p in parts) else None
    return all_groups_tie(credit, components)


class ExtraItems:
    """Dynamic sampling's own stream of training items, one per rank: pass p over the items in a permutation seeded
    by (``seed``, rank, p), walked from ``position`` (the items this rank has drawn). Shuffled even when the training
    order is fixed, so that a refill is not the items the loader serves next.

    Resume: the data module saves every rank's position (:meth:`saved_position`) and gives each rank its own back
    (:meth:`load`). A checkpoint written while a training step is under way (a stop that discards the step) holds the
    position from before that step's draws, so the redone step draws the same items.
    """

    def __init__(self, items: Any, seed: int = 0):
        self.items, self.seed = items, seed
        self.position = 0
        self._step: tuple[Any, int] = (None, 0)  # (the step that began drawing, the position before its draws)
        self._order: tuple[int, list[int]] | None = None  # (pass, its permutation), the one being walked

    def order(self, index: int) -> list[int]:
        """Pass ``index``'s permutation of the item indices on this rank (string-seeded: the same in every process
        and Python version)."""
        size = len(self.items)
        return random.Random(f"comlrl_lightning.dynamic_sampling:{self.seed}:{ranks.rank()}:{index}").sample(
            range(size), size
        )

    def take(self, n: int) -> list[Mapping[str, Any]]:
        """The next ``n`` items of the stream (passes follow each other without a gap)."""
        size, out = len(self.items), []
        while len(out) < n:
            index, offset = divmod(self.position, size)
            if self._order is None or self._order[0] != index:
                self._order = (index, self.order(index))
            count = min(n - len(out), size - offset)
            out += [self.items[i] for i in self._order[1][offset : offset + count]]
            self.position += count
        return out

    def begin_step(self, step: Any) -> None:
        """A step (``step``: its key; None outside a training loop) is about to draw: remember where it started."""
        if step is None or self._step[0] != step:
            self._step = (step, self.position)

    def saved_position(self, step_under_way: Any = None) -> int:
        """What a checkpoint holds: the position, or where the step under way (``step_under_way``) began drawing."""
        if step_under_way is not None and self._step[0] == step_under_way:
            return self._step[1]
        return self.position

    def load(self, positions: Sequence[int]) -> None:
        """Every rank's saved position (rank order); a rank the checkpoint did not have starts its stream afresh."""
        rank = ranks.rank()
        self.position = int(positions[rank]) if rank < len(positions) else 0
        self._step = (None, self.position)


class DynamicSampling:
    """The refill of one data module (module docstring): its extra-item stream, the budget and the chunk size.

    Args:
        extra: the stream extra items come from.
        max_extra_prompts: extra items one step may roll out on one rank (None: as many as the step's own items).
        chunk: most extra items rolled out at once (the data module's ``prompts_per_step``).
        step_key: the key of the training step under way (None outside one): :meth:`ExtraItems.begin_step`.
        by_components: a node ties only when its reward components tie too (:func:`node_ties`).
    """

    def __init__(
        self,
        extra: ExtraItems,
        max_extra_prompts: int | None = None,
        chunk: int = 1,
        step_key: Callable[[], Any] = lambda: None,
        by_components: bool = True,
    ):
        if max_extra_prompts is not None and max_extra_prompts < 0:
            raise ValueError(f"dynamic_sampling_max_extra_prompts must be >= 0 or null (got {max_extra_prompts}).")
        if chunk < 1:
            raise ValueError(f"the refill chunk must be >= 1 (got {chunk}).")
        self.extra, self.max_extra_prompts, self.chunk, self.step_key = extra, max_extra_prompts, chunk, step_key
        self.by_components = by_components

    def ties(self, node: Node) -> bool:
        return node_ties(node, self.by_components)

    def budget(self, items: Sequence[Any]) -> int:
        return len(items) if self.max_extra_prompts is None else self.max_extra_prompts

    def resolve(self, policy: Any, items: Sequence[Mapping[str, Any]], **stamps: Any) -> Rollout:
        """``items``' rollout with its tied nodes dropped and refilled (module docstring); ``stamps`` as
        ``RolloutBatch.resolve``'s."""
        own = policy.rollout(items, **stamps)
        nodes = own.nodes
        ties = [self.ties(n) for n in nodes]
        target, kept = len(nodes), [n for n, tied in zip(nodes, ties) if not tied]
        joint_actions, timings = own.num_joint_actions, defaultdict(float, own.timings)
        budget, extra = self.budget(items), 0
        start = int(stamps.get("env_step", 0))
        if len(kept) < target and budget > 0:
            self.extra.begin_step(self.step_key())
        while len(kept) < target and extra < budget:
            more_items = self.extra.take(min(self.chunk, budget - extra))
            more = policy.rollout(more_items, **{**stamps, "env_step": start + joint_actions})
            for node in more.nodes:  # its item's position in the step's batch: the own items, then the extras
                node.item_index += len(items) + extra
            extra += len(more_items)
            joint_actions += more.num_joint_actions
            for phase, seconds in more.timings.items():
                timings[phase] += seconds
            kept += [n for n in more.nodes if not self.ties(n)]
        kept = kept[:target]
        metrics = {
            "rollout/zero_advantage_ratio_before": tied_share(ties),
            "rollout/zero_advantage_ratio": 0.0 if kept or not nodes else 1.0,
            "rollout/dynamic_sampling_extra_prompts": float(extra),
            "rollout/dynamic_sampling_fill_ratio": len(kept) / target if target else 1.0,
        }
        if not kept:  # nothing could teach: the step's own rollout, so that it still has records
            return Rollout(own.roots, own.levels, joint_actions, dict(timings), metrics)
        if not any(ties):  # nothing dropped: the rollout as the engine built it
            return Rollout(own.roots, own.levels, joint_actions, dict(timings), metrics)
        return Rollout.of_nodes(kept, joint_actions, timings, metrics)
