"""Which weights a sampler holds: the grouping of agents by weight set (agents that share a model, a LoRA team's one
base) and the record of which weights a holder (an engine, a sampling copy) last saw, so that it can take exactly the
ones that changed. Shared by the generation backends (``rollout/backends/``); the update counts itself here
(:func:`weights_changed`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from comlrl_lightning.rollout.sampling import Completions


def generator_of(model: Any) -> tuple[Any, str | None]:
    """What generates for ``model`` and under which adapter: an agent of a LoRA team (``agents/lora.py``) is its
    team's one peft model with the agent's adapter; any other model is itself."""
    shared = getattr(model, "shared_generator", None)
    return shared() if callable(shared) else (model, None)


def answer_groups(models: Sequence[Any], tokenizers: Sequence[Any]) -> list[list[int]]:
    """The agents each call answers for: agents with the same generator (shared weights, a LoRA team) and
    tokenizer answer together."""
    calls: dict[tuple[int, int], list[int]] = {}
    for i, model in enumerate(models):
        calls.setdefault((id(generator_of(model)[0]), id(tokenizers[i])), []).append(i)
    return list(calls.values())


def place_answers(
    groups: Sequence[Sequence[int]], answers: Sequence[Sequence[Completions]], num_agents: int
) -> list[Completions]:
    """One ``Completions`` per agent, in agent order, from each group's answers."""
    out: list[Completions | None] = [None] * num_agents
    for agents, completions in zip(groups, answers):
        for i, c in zip(agents, completions):
            out[i] = c
    return out


# ---------------------------------------------------------------------------------------------------- weight versions
_UPDATES = 0  # team updates this process has made (weights_changed counts them)
_STEPPED = "_comlrl_stepped_at"  # an optimizer's parameter carries the count of the update that last stepped it


def weights_changed(optimized: Iterable[torch.Tensor] = ()) -> None:
    """Called after every update (``MultiAgentModule.update``), with the optimizer's parameters: those with a
    gradient were stepped and count as changed for whatever saw the weights before (a sampling copy, an engine's
    weights); those without (an agent a schedule left out of this update) did not change. A trained parameter the
    optimizer does not hold (a sharded model's gathered copy) counts as changed by every update."""
    global _UPDATES
    _UPDATES += 1
    for p in optimized:
        if p.grad is not None:
            setattr(p, _STEPPED, _UPDATES)
        elif not hasattr(p, _STEPPED):
            setattr(p, _STEPPED, 0)


@dataclass(frozen=True)
class WeightsSeen:
    """What a holder of a model's weights (a sampling copy, an inference engine) saw when it last took them: each
    parameter's (storage, version counter), and the number of updates made by then."""

    stamps: tuple[tuple[int, int], ...]
    updates: int


def weights_seen(model: torch.nn.Module) -> WeightsSeen:
    return WeightsSeen(tuple((p.data_ptr(), p._version) for p in model.parameters()), _UPDATES)


def changed_parameters(model: torch.nn.Module, seen: WeightsSeen) -> list[bool]:
    """Which of ``model``'s parameters changed since ``seen``: its storage or version counter moved (a checkpoint
    load, a move, any counted in-place write), or an update since stepped it (the fused AdamW kernel writes in place
    without counting it; :func:`weights_changed`). A LoRA team's frozen base is neither after an update, nor is an
    agent a schedule left out."""
    updated = _UPDATES != seen.updates
    now = [(p.data_ptr(), p._version) for p in model.parameters()]
    if len(now) != len(seen.stamps):
        return [True] * len(now)
    return [
        stamp != then or (updated and p.requires_grad and getattr(p, _STEPPED, _UPDATES) > seen.updates)
        for p, stamp, then in zip(model.parameters(), now, seen.stamps)
    ]
