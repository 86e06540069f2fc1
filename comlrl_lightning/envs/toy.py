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

Self-play with ONE agent (docs/algorithms.md#self-play-and-self-improvement), each turn a prompt the external
transition writes:

* ``word chain``: a two-player word game the agent plays against itself. Turn 1 says a word starting with the
  item's letter; every later turn, as the other player, a word starting with the last letter of the previous
  word (:func:`word_chain_transition`). :func:`word_rule_reward` scores each turn against the rule its prompt states
  (1: one word of 3+ letters starting with the letter; 0.5: it starts with the letter but is not one clean word).
  :func:`revise_word_transition` turns the same task into a revise-your-answer loop (MAFT): the rule stays, the
  agent sees its previous answer and whether it kept the rule.
* ``role game``: the agent is the ``proposer`` at odd turns and the ``solver`` at even ones
  (:func:`switch_roles`); each role has its own objective, stated last in its prompt and scored by
  :func:`role_reward` from the turn: the proposer writes with the letter ``e``, the solver with vowels only —
  signals a random tiny model learns (the learning benchmark's self-play row). The two objectives are compatible:
  a random 138K-parameter model does not learn to condition on its prompt within the benchmark's 40 updates
  (measured: a one-agent "write with the letter in the prompt" task stays at 0.50).
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


# ------------------------------------------------------------------------------------------------ self-play
ROLES = ("proposer", "solver")
ROLE_TASKS = {"proposer": "write with the letter e", "solver": "write with vowels only"}
VOWELS = "aeiou"
_RULE = re.compile(r"starts with '([a-z])'")
WORD_CHAIN_LETTERS = "abcdefghilmnoprstw"


def word_chain_tasks(num_items: int | None = None) -> list[dict[str, Any]]:
    """Word-chain items ``{"letter", "prompt"}``: one per starting letter (cycled to ``num_items``)."""
    letters = (
        WORD_CHAIN_LETTERS
        if num_items is None
        else [WORD_CHAIN_LETTERS[i % len(WORD_CHAIN_LETTERS)] for i in range(num_items)]
    )
    return [{"letter": c, "prompt": f"word chain from {c}"} for c in letters]


def word_chain_eval_tasks() -> list[dict[str, Any]]:
    return word_chain_tasks()[::3]


def word_rule(letter: str) -> str:
    return f"Answer with one English word that starts with '{letter}'. Answer with the word only."


def word_chain_prompt(item: Mapping[str, Any]) -> str:
    return f"We are playing a word chain game. {word_rule(item['letter'])}"


def _first_word(text: str) -> str:
    words = _WORD.findall(text)
    return words[0].lower() if words else ""


def word_chain_transition(
    prompt: str,
    agent_completions: Sequence[str],
    num_agents: int,
    prompt_history_per_agent: Sequence[Sequence[str]],
    response_history_per_agent: Sequence[Sequence[str]],
) -> list[str]:
    """The next player's prompt (the same agent, the other side of the game): the word just said and the rule for
    the reply, its first letter the last letter of that word (``a`` when there is no word)."""
    prompts = []
    for completion in agent_completions:
        word = _first_word(completion)
        letter = word[-1] if word else "a"
        said = f"The other player said '{word}'." if word else "The other player said nothing."
        prompts.append(f"We are playing a word chain game. {said} {word_rule(letter)}")
    return prompts


def revise_word_transition(
    prompt: str,
    agent_completions: Sequence[str],
    num_agents: int,
    prompt_history_per_agent: Sequence[Sequence[str]],
    response_history_per_agent: Sequence[Sequence[str]],
) -> list[str]:
    """Revise-your-answer (MAFT-style self-improvement): the same rule as the last prompt, the agent's previous
    answer and whether it kept the rule."""
    prompts = []
    for completion, history in zip(agent_completions, prompt_history_per_agent):
        match = _RULE.search(history[-1])
        letter = match.group(1) if match else "a"
        verdict = "It keeps the rule." if word_rule_score(completion, letter) == 1.0 else "It breaks the rule."
        prompts.append(
            f"Your previous answer was: {completion.strip()[:80]!r}. {verdict} Answer again, better. {word_rule(letter)}"
        )
    return prompts


def word_rule_score(completion: str, letter: str) -> float:
    """1 for one word of 3+ letters starting with ``letter`` (and nothing else); 0.5 when the first word starts with
    it but the answer is not one clean word; else 0."""
    words = _WORD.findall(completion)
    if not words or not words[0].lower().startswith(letter):
        return 0.0
    return 1.0 if len(words) == 1 and len(words[0]) >= 3 and words[0].isalpha() else 0.5


def word_rule_reward(*agent_completions: Sequence[str], prompts: Sequence[str]) -> list[float]:
    """Each joint action's mean over agents of :func:`word_rule_score` against the letter its turn's prompt states
    (``starts with 'x'``: the first turn's item letter, a chain's last letter, a revision's same letter)."""
    rewards = []
    for joint, prompt in zip(zip(*agent_completions), prompts):
        match = _RULE.search(prompt)
        letter = match.group(1) if match else "a"
        rewards.append(sum(word_rule_score(c, letter) for c in joint) / len(joint))
    return rewards


word_rule_reward.reward_range = (0.0, 1.0)


def role_instruction(role: str) -> str:
    """What a role is asked to do, last in its prompt."""
    return f"Answer as the {role}: {ROLE_TASKS[role]}"


def proposer_prompt(item: Mapping[str, Any]) -> str:
    return f"You are the {ROLES[0]}. Topic: {item['topic']}. {role_instruction(ROLES[0])}"


def switch_roles(
    prompt: str,
    agent_completions: Sequence[str],
    num_agents: int,
    prompt_history_per_agent: Sequence[Sequence[str]],
    response_history_per_agent: Sequence[Sequence[str]],
) -> list[str]:
    """Self-play's role switch: after turn t the agent plays the other role, reading the last move."""
    turn = len(response_history_per_agent[0])  # turns played, the current one included
    role, last = ROLES[turn % 2], ROLES[(turn - 1) % 2]
    return [
        f"You are the {role}. Topic: {prompt}. The {last} wrote: {c.strip()[:80]}. {role_instruction(role)}"
        for c in agent_completions
    ]


def role_reward(
    *agent_completions: Sequence[str], response_history_per_agent: Sequence[Sequence[Sequence[str]]]
) -> list[float]:
    """The role of the turn (proposer at turns 1, 3, ...; solver at 2, 4, ...: read from the turns played before
    it) decides the objective: the proposer's share of ``e`` among its letters, the solver's share of vowels (0 for
    no letters); the mean over agents."""
    rewards = []
    for joint, history in zip(zip(*agent_completions), response_history_per_agent):
        letters = "e" if ROLES[len(history[0]) % 2] == "proposer" else VOWELS
        shares = [sum(letter_shares([text], c)[0] for c in letters) for text in joint]
        rewards.append(sum(shares) / len(shares))
    return rewards


role_reward.reward_range = (0.0, 1.0)
