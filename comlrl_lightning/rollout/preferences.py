"""Preference pairs from sampled joint candidates, shared by MADPO and MARLHF
(docs/algorithms.md#preference-pairs-and-madpo)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from comlrl_lightning.core.pairs import PreferencePair, select_pairs
from comlrl_lightning.rollout.rewards import RewardCaller
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
    reward: RewardCaller | None = None,
) -> list[PreferencePair]:
    """Sample the engine's K candidates per agent per item (aligned joint candidates, one turn), score them with
    ``reward`` (the oracle; default the engine's) and turn score differences into pairs that keep the sampled
    token ids."""
    rollout = engine.rollout(models, tokenizers, items, policy_version=policy_version, reward=reward)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))  # seeded via the global RNG
    pairs = []
    for node in rollout.roots:
        scores = node.rewards
        mean = float(scores.mean())
        for w, l in select_pairs(scores, selection, limit, generator):
            pairs.append(
                PreferencePair(
                    prompts=[a.prompt for a in node.agents],
                    winner_completions=[a.texts[w] for a in node.agents],
                    loser_completions=[a.texts[l] for a in node.agents],
                    winner_reward=float(scores[w]),
                    loser_reward=float(scores[l]),
                    candidate_reward_mean=mean,
                    raw_rewards=[float(node.raw_rewards[w]), float(node.raw_rewards[l])],
                    prompt_ids=[a.prompt_ids for a in node.agents],
                    winner_ids=[a.completion_ids[w][a.completion_mask[w]] for a in node.agents],
                    loser_ids=[a.completion_ids[l][a.completion_mask[l]] for a in node.agents],
                )
            )
    return pairs


def tokenize_pairs(pairs: Sequence[PreferencePair], tokenizers: Sequence[Any], model_input) -> None:
    """Set each pair's token ids from its text (pairs that met a comparator, or were read from a replay file).

    Per agent, one tokenizer call for all prompts and one for all completions. The prompt is what the model
    reads (``model_input(tokenizer, prompt)``: the chat template when it is on); a completion known only as text
    is scored as its tokens followed by EOS, as if the model had written it and stopped.
    """
    pairs = list({id(p): p for p in pairs}.values())  # replay may draw one pair object several times
    if not pairs:
        return
    for pair in pairs:
        pair.prompt_ids, pair.winner_ids, pair.loser_ids = [], [], []
    for i, tokenizer in enumerate(tokenizers[: pairs[0].num_agents]):

        def encode(texts: list[str], tokenizer=tokenizer) -> list[list[int]]:
            return tokenizer(texts, add_special_tokens=False)["input_ids"]

        prompts = encode([model_input(tokenizer, p.prompts[i]) for p in pairs])
        winners = encode([p.winner_completions[i] for p in pairs])
        losers = encode([p.loser_completions[i] for p in pairs])
        eos = [tokenizer.eos_token_id]
        for pair, prompt, winner, loser in zip(pairs, prompts, winners, losers):
            pair.prompt_ids.append(torch.tensor(prompt, dtype=torch.long))
            pair.winner_ids.append(torch.tensor(winner + eos, dtype=torch.long))
            pair.loser_ids.append(torch.tensor(loser + eos, dtype=torch.long))
