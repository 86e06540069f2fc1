"""Small cooperative tasks for demos, quick starts and tests (no downloads).

``story``: two agents write one tiny story together — agent 0 the opening sentence, agent 1 the closing sentence —
about a given topic. The team reward (0 to 3) asks each part to be one short, finished sentence on the topic,
and the two parts to complement rather than repeat each other::

    per agent (×2):  0.5 · brevity  (5–20 words: 1; fades to 0 at 30 words)
                     0.25 · on topic (mentions a word of the topic)
                     0.25 · finished (ends with . ! or ?)
    team:            1.0 · complementarity (1 − word-set Jaccard overlap / 0.6, clipped to [0, 1])

``brevity_reward`` and ``letter_reward`` are simpler signals that even a randomly initialised tiny model can
learn in a few updates (used by the learning tests and the quick start).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

STORY_TOPICS = [
    "a lighthouse keeper",
    "a lost umbrella",
    "a robot gardener",
    "the last train home",
    "a talking cat",
    "a snowy mountain village",
    "an old violin",
    "a secret garden",
    "a broken clock",
    "a friendly dragon",
    "the first day of school",
    "a message in a bottle",
    "a forgotten birthday",
    "a night at the museum",
    "a tiny spaceship",
    "a rainy market",
    "a stubborn goat",
    "a haunted bakery",
    "a kite festival",
    "a library at midnight",
    "an underwater city",
    "a lonely scarecrow",
    "a picnic with ants",
    "a magic paintbrush",
    "a desert oasis",
    "a runaway balloon",
    "a chess tournament",
    "a fox and a crow",
    "a river ferry",
    "a lost puppy",
    "a summer storm",
    "a clockmaker's apprentice",
    "a bicycle race",
    "a jar of fireflies",
    "a mountain rescue",
    "a pirate's map",
    "a quiet island",
    "a baker's first loaf",
    "a paper boat",
    "a new neighbor",
]

_WORD = re.compile(r"[A-Za-z']+")
_STOP = {"a", "an", "the", "of", "at", "in", "on", "and", "with", "to", "first", "last", "new", "old"}


def story_tasks(num_items: int | None = None) -> list[dict[str, Any]]:
    """Dataset items ``{"topic", "prompt"}`` (``prompt`` is the topic, used by transitions and defaults)."""
    topics = STORY_TOPICS if num_items is None else [STORY_TOPICS[i % len(STORY_TOPICS)] for i in range(num_items)]
    return [{"topic": t, "prompt": t} for t in topics]


def story_eval_tasks() -> list[dict[str, Any]]:
    """A held-out-order view of the topics for evaluation (every third topic)."""
    return [{"topic": t, "prompt": t} for t in STORY_TOPICS[::3]]


def opening_prompt(item: Mapping[str, Any]) -> str:
    return (
        f"Write the opening sentence of a very short story about {item['topic']}. Answer with that one sentence only."
    )


def closing_prompt(item: Mapping[str, Any]) -> str:
    return (
        f"Write the closing sentence of a very short story about {item['topic']}. Answer with that one sentence only."
    )


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _brevity(num_words: int, low: int = 5, high: int = 20, fade: int = 10) -> float:
    if low <= num_words <= high:
        return 1.0
    if num_words < low:
        return num_words / low
    return max(0.0, 1.0 - (num_words - high) / fade)


def story_reward(
    openings: Sequence[str], closings: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[float]:
    """Team reward in [0, 3] per (opening, closing) pair; see the module docstring."""
    rewards = []
    for k, (opening, closing) in enumerate(zip(openings, closings)):
        topic = batch_items[k]["topic"] if batch_items else ""
        topic_words = {w for w in _words(topic) if w not in _STOP}
        total = 0.0
        for part in (opening, closing):
            words = _words(part)
            total += 0.5 * _brevity(len(words))
            total += 0.25 * bool(topic_words & set(words))
            total += 0.25 * part.strip().endswith((".", "!", "?"))
        a, b = set(_words(opening)), set(_words(closing))
        if a and b:
            jaccard = len(a & b) / len(a | b)
            total += max(0.0, min(1.0, 1.0 - jaccard / 0.6))
        rewards.append(total)
    return rewards


story_reward.reward_range = (0.0, 3.0)


def brevity_reward(*agent_completions: Sequence[str], max_chars: int = 40) -> list[float]:
    """1 − mean length / max_chars over the agents, clipped at 0: the team is rewarded for being brief."""
    rewards = []
    for joint in zip(*agent_completions):
        mean_len = sum(len(c) for c in joint) / len(joint)
        rewards.append(max(0.0, 1.0 - mean_len / max_chars))
    return rewards


brevity_reward.reward_range = (0.0, 1.0)


def letter_shares(joint: Sequence[str], letter: str = "e") -> list[float]:
    """Each completion's share of ``letter`` among its letters (0 when it has none)."""
    shares = []
    for text in joint:
        letters = [c for c in text.lower() if c.isalpha()]
        shares.append(letters.count(letter) / len(letters) if letters else 0.0)
    return shares


def letter_reward(*agent_completions: Sequence[str], letter: str = "e") -> list[float]:
    """Mean over agents of the share of ``letter`` among the letters of each completion (0 when empty)."""
    return [sum(shares) / len(shares) for shares in (letter_shares(j, letter) for j in zip(*agent_completions))]


def letter_reward_components(*agent_completions: Sequence[str], letter: str = "e") -> list[dict[str, float]]:
    """:func:`letter_reward` as named components, one per agent: ``agent_i`` = its share / N (they sum to the
    reward), for ``reward_aggregation: normalize_components``."""
    rewards = []
    for joint in zip(*agent_completions):
        shares = letter_shares(joint, letter)
        rewards.append({f"agent_{i}": share / len(shares) for i, share in enumerate(shares)})
    return rewards


letter_reward.reward_range = letter_reward_components.reward_range = (0.0, 1.0)


def revise_transition(
    prompt: str,
    agent_completions: Sequence[str],
    num_agents: int,
    prompt_history_per_agent: Sequence[Sequence[str]],
    response_history_per_agent: Sequence[Sequence[str]],
) -> list[str]:
    """Second-turn prompts: each agent sees the team's previous sentences and is asked to improve its own."""
    team = "\n".join(f"Part {i + 1}: {c.strip()}" for i, c in enumerate(agent_completions))
    return [
        f"Story about {prompt}.\n{team}\nRewrite part {i + 1} as one short, finished sentence that does not repeat "
        "the other part."
        for i in range(num_agents)
    ]
