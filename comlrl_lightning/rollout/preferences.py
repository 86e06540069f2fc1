"""Preference pairs from sampled joint candidates (REFERENCE §5.3), shared by MADPO and MARLHF."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from comlrl_lightning.core.pairs import PreferencePair, select_pairs
from comlrl_lightning.rollout.tree import RolloutEngine


@torch.no_grad()
def collect_preference_pairs(
    engine: RolloutEngine,
    models: Sequence[torch.nn.Module],
    tokenizers: Sequence[Any],
    items: Sequence[Mapping[str, Any]],
    *,
    selection: str,
    limit: int | None,
    policy_version: int = 0,
) -> list[PreferencePair]:
    """Sample the engine's K candidates per agent per item (aligned joint candidates, one turn), score them with
    the engine's reward (the oracle) and turn score differences into pairs that keep the sampled token ids."""
    rollout = engine.rollout(models, tokenizers, items, policy_version=policy_version)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))  # seeded via the global RNG
    pairs = []
    for node in rollout.roots:
        scores = node.rewards
        mean = float(scores.mean())
        for w, l in select_pairs(scores, selection, limit, generator):
            pairs.append(PreferencePair(
                prompts=[a.prompt for a in node.agents],
                winner_completions=[a.texts[w] for a in node.agents],
                loser_completions=[a.texts[l] for a in node.agents],
                winner_reward=float(scores[w]), loser_reward=float(scores[l]), candidate_reward_mean=mean,
                raw_rewards=[float(node.raw_rewards[w]), float(node.raw_rewards[l])],
                prompt_ids=[a.prompt_ids for a in node.agents],
                winner_ids=[a.completion_ids[w][a.completion_mask[w]] for a in node.agents],
                loser_ids=[a.completion_ids[l][a.completion_mask[l]] for a in node.agents],
            ))
    return pairs
