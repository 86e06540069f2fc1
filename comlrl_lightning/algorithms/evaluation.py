"""Evaluation of a team: what one sampled trajectory per item (over all turns, no early termination, the task
reward) gives -- per-turn reward tables joined over the ranks, the user's ``eval_logger``/``eval_aggregator``
metrics, and the answers ``predict`` writes.

A module's evaluation is one :class:`Evaluation` (``module.evaluation``; a family with more to report subclasses it:
IAC's values and targets). The periodic ``EvaluationCallback``, the ``validate``/``test`` loops (``EvaluationRows``)
and ``predict`` call it."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor
from torchmetrics.aggregation import CatMetric

from comlrl_lightning.agents.sharding import gathered
from comlrl_lightning.core.advantages import suffix_returns
from comlrl_lightning.rollout.rewards import call_filtered
from comlrl_lightning.rollout.tree import episode
from comlrl_lightning.runs import ranks, stop


class Evaluation:
    """``module.evaluation``: the evaluation episodes of the module's current team and their metrics."""

    def __init__(self, module: Any):
        self.module = module

    @property
    def turns(self) -> int:
        return getattr(self.module, "num_turns", 1)

    def evaluate(self, items: Sequence[Any], batch_size: int = 1) -> dict[str, float]:
        """Evaluation metrics over ``items`` (in batches of ``batch_size``) with the task reward; each rank of a
        data-parallel run plays its share of the items."""
        mine = ranks.shard(items)
        starts = range(0, len(mine), batch_size)
        records = []
        # An evaluation changes nothing a checkpoint holds: Ctrl-C / SIGTERM may throw it away (runs/stop.py).
        with stop.discardable(f"the evaluation at update {self.module.global_step}", len(starts), "batches") as phase:
            with gathered(self.module.sharded_models()):
                if ranks.world_size() > 1:  # every rank, even one with no items to play
                    self.module.engine.take_weights(self.module.policy_models(), self.module.tokenizers)
                for start in starts:
                    records.append(self.record(mine[start : start + batch_size]))
                    phase.done += 1
        return self.metrics(records)

    @torch.no_grad()
    def rollout(self, items: Sequence[Mapping[str, Any]]) -> Any:
        """One sampled trajectory per item over all turns (no early termination), scored with the task reward:
        what evaluation, ``test`` and ``predict`` play."""
        m = self.module
        return m.engine.rollout(
            m.policy_models(),
            m.tokenizers,
            items,
            num_generations=1,
            early_termination=False,
            policy_version=m.global_step,
            reward=m.task_reward,
        )

    def record(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The episodes of a batch of ``items``, as :meth:`record_of` keeps them."""
        return self.record_of(self.rollout(items), items)

    def record_of(self, rollout: Any, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Rewards [items, turns], each agent's completions per item and turn, the items and their prompts."""
        return record_of(rollout, items, self.module.num_agents, self.turns)

    def metrics(self, records: list[dict[str, Any]]) -> dict[str, float]:
        """Metrics of the evaluation ``records`` of every rank (a data-parallel run evaluates a share per rank)."""
        m = self.module
        rewards = self.table(records, "rewards")
        metrics = {"env_step": float(m.env_step), **reward_metrics(rewards, getattr(m, "discount", 1.0))}
        if m.eval_logger is not None and m.eval_aggregator is not None:
            metrics.update(
                user_metrics(records, m.eval_logger, m.eval_aggregator, m.num_agents, m.collaboration, self.turns)
            )
        return metrics

    def table(self, records: list[dict[str, Any]], key: str) -> Tensor:
        """The [items, turns] tables ``key`` of every rank's records (:func:`joined_table`)."""
        return joined_table(records, key, self.turns, self.module.device)


def turn_table(rollout: Any, num_items: int, num_turns: int, value: Callable[[Any], Any]) -> Tensor:
    """[items, turns] of ``value(node)`` along each item's single-trajectory episode."""
    table = torch.zeros(num_items, num_turns)
    for b, root in enumerate(rollout.roots):
        for t, node in enumerate(episode(root)):
            table[b, t] = value(node)
    return table


def record_of(rollout: Any, items: Sequence[Mapping[str, Any]], num_agents: int, num_turns: int) -> dict[str, Any]:
    """Rewards [items, turns], each agent's completions per item and turn, the items and their prompts."""
    completions = [[[] for _ in items] for _ in range(num_agents)]  # [agent][item][turn]
    for b, root in enumerate(rollout.roots):
        for node in episode(root):
            for i, agent in enumerate(node.agents):
                completions[i][b].append(agent.texts[0])
    # What the eval logger gets as ``prompts``: each item's own ``prompt`` field.
    return {
        "rewards": turn_table(rollout, len(items), num_turns, lambda node: node.rewards[0]),
        "completions": completions,
        "items": list(items),
        "prompts": [item.get("prompt") for item in items],
    }


def joined_table(records: list[dict[str, Any]], key: str, num_turns: int, device: Any) -> Tensor:
    """The [items, turns] tables ``key`` of the records of every rank, in item order (torchmetrics ``CatMetric``,
    which joins the ranks' rows; one process: the records' own). Each row carries a flag column, and a rank with no
    items adds one flagged-out row: torchmetrics leaves a rank with nothing out of the gather the others wait in."""
    local = torch.cat([r[key] for r in records]).float() if records else torch.zeros(0, num_turns)
    flagged = torch.cat([local, torch.ones(len(local), 1)], dim=1) if len(local) else torch.zeros(1, num_turns + 1)
    table = CatMetric(nan_strategy="disable").to(device)
    table.update(flagged.to(device))
    joined = table.compute().reshape(-1, num_turns + 1).cpu()
    return joined[joined[:, -1] == 1, :num_turns]


def reward_metrics(rewards: Tensor, discount: float) -> dict[str, float]:
    """``eval/turn_t/reward_mean`` and ``eval/turn_t/expected_return`` of an [items, turns] reward table."""
    returns = suffix_returns(rewards, discount)
    metrics = {}
    for t in range(rewards.shape[1]):
        metrics[f"eval/turn_{t + 1}/reward_mean"] = float(rewards[:, t].mean())
        metrics[f"eval/turn_{t + 1}/expected_return"] = float(returns[:, t].mean())
    return metrics


def user_metrics(
    records: list[dict[str, Any]],
    eval_logger: Callable,
    eval_aggregator: Callable,
    num_agents: int,
    collaboration: Any,
    num_turns: int,
) -> dict[str, float]:
    """The user's ``eval_logger`` over every rank's records (gathered), reduced by ``eval_aggregator``, named
    ``eval/<key>``."""
    records = [r for share in ranks.gather(records) for r in share]
    items = [it for r in records for it in r["items"]]
    completions = [[c for r in records for c in r["completions"][i]] for i in range(num_agents)]
    if collaboration is not None:  # the user's logger sees each role's part of the joint answer
        completions = collaboration.split_turns(completions[0], items)
    per_sample = call_filtered(
        eval_logger,
        agent_completions_turns=completions,
        batch_items=items,
        prompts=[p for r in records for p in r["prompts"]],
        test_cases=[it.get("test", "") for it in items],
        entry_points=[it.get("entry_point", "") for it in items],
    )
    aggregated = call_filtered(eval_aggregator, metrics=per_sample, num_turns=num_turns)
    return {
        key if key.startswith("eval/") else f"eval/{key}": float(value) for key, value in (aggregated or {}).items()
    }


def answers(items: Sequence[Mapping[str, Any]], rollout: Any) -> list[dict[str, Any]]:
    """What ``predict`` writes per item: each agent's prompt and completion per turn, and the team reward per turn."""
    out = []
    for item, root in zip(items, rollout.roots):
        turns = list(episode(root))
        out.append(
            {
                "item": dict(item),
                "agents": [
                    {
                        "prompts": [n.agents[i].prompt for n in turns],
                        "completions": [n.agents[i].texts[0] for n in turns],
                    }
                    for i in range(len(turns[0].agents))
                ],
                "rewards": [float(n.rewards[0]) for n in turns],
            }
        )
    return out
