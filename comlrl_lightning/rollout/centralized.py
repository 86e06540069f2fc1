"""Centralized joint completions: one model writes the outputs of all N roles
(docs/iterative.md#centralized-collaboration).

A team task normally has N agents, each writing its own completion from its own prompt. In *centralized* mode a
single model receives one joint prompt holding every role's prompt and answers with one joint completion that
an *adapter* splits back into N role outputs. Any object with two callables is an adapter::

    build_prompt(item, prompts: list[str]) -> str                      # prompts: each role's own prompt
    parse_completion(text: str, item, num_agents: int) -> Sequence[str]

:class:`TaggedCentralizedAdapter` is the domain-neutral default: ``<agent_i> ... </agent_i>`` sections.

The adapter serves two different uses:

* **Centralized collaboration** (:class:`CentralizedCollaboration`): the centralized model *is* the team. The
  team task becomes a one-actor task whose formatter builds the joint prompt and whose reward splits each joint
  completion and scores the N role outputs with the user's unchanged N-agent reward function.
* **Centralized comparator generation** (docs/iterative.md, Comparators): the centralized model only produces a
  joint reference answer that a comparator contrasts with the decentralized agents' outputs; the decentralized
  agents stay the learners. That path reuses :func:`joint_prompt` and :func:`split_joint` (and CoMLRL's error name
  ``CentralizedComparatorParseError``) but not the collaboration wrapper.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence

from .rewards import Formatter, RewardCaller

__all__ = [
    "CentralizedCollaboration",
    "CentralizedComparatorParseError",
    "CentralizedParseError",
    "TaggedCentralizedAdapter",
    "check_adapter",
    "joint_prompt",
    "split_joint",
]


class CentralizedParseError(ValueError):
    """A joint completion holds no recognisable role section (the model ignored the output format)."""


CentralizedComparatorParseError = CentralizedParseError  # CoMLRL's name for the same failure


class TaggedCentralizedAdapter:
    """Default adapter: role i's output lives in ``<agent_i> ... </agent_i>`` (0-based, domain-neutral)."""

    def build_prompt(self, item: Mapping[str, Any], prompts: Sequence[str]) -> str:
        n = len(prompts)
        parts = [
            f"You are a centralized coordinator. Write {n} separate agent outputs in one response, one for each "
            "agent below. Each agent's output must answer that agent's original prompt."
        ]
        for i, prompt in enumerate(prompts):
            parts.append(f"Agent {i} original prompt:\n{prompt}")
        sections = "\n".join(f"<agent_{i}>\n...\n</agent_{i}>" for i in range(n))
        parts.append(
            "Required output format: put each agent's output in its own section, exactly as below, "
            f"and write nothing outside the sections.\n{sections}"
        )
        return "\n\n".join(parts)

    def parse_completion(self, text: str, item: Mapping[str, Any], num_agents: int) -> list[str]:
        outputs: list[str] = []
        found = False
        for i in range(num_agents):
            match = _section_pattern(i).search(text)
            found = found or match is not None
            outputs.append(match.group(1).strip() if match else "")
        if not found:
            raise CentralizedParseError(
                f"Joint completion has no <agent_i> section for any of the {num_agents} agents."
            )
        return outputs

    def __repr__(self) -> str:
        return "TaggedCentralizedAdapter()"


def _section_pattern(i: int) -> re.Pattern:
    # whitespace tolerated inside the tags; non-greedy so the first section wins when a tag repeats
    return re.compile(rf"<\s*agent_{i}\s*>(.*?)<\s*/\s*agent_{i}\s*>", re.IGNORECASE | re.DOTALL)


def check_adapter(adapter: Any, name: str = "centralized_adapter") -> Any:
    """Fail at construction, not at the first rollout, when an adapter lacks its two callables."""
    for attr in ("build_prompt", "parse_completion"):
        if not callable(getattr(adapter, attr, None)):
            raise TypeError(f"{name}.{attr} must be callable.")
    return adapter


def joint_prompt(adapter: Any, item: Mapping[str, Any], role_prompts: Sequence[str]) -> str:
    """The adapter's joint prompt, refused when empty (an empty prompt would silently train on nothing)."""
    prompt = adapter.build_prompt(item, list(role_prompts))
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("Centralized adapter must build a non-empty prompt.")
    return prompt


def split_joint(
    adapter: Any,
    text: str,
    item: Mapping[str, Any],
    num_roles: int,
    *,
    on_parse_error: str = "raise",
) -> list[str]:
    """Split one joint completion into ``num_roles`` strings; ``on_parse_error="empty"`` turns an unparseable
    completion into empty outputs so training can score it (low) instead of crashing."""
    if on_parse_error not in ("raise", "empty"):
        raise ValueError(f"on_parse_error must be 'raise' or 'empty', got {on_parse_error!r}.")
    try:
        outputs = adapter.parse_completion(text, item, num_roles)
    except CentralizedParseError:
        if on_parse_error == "raise":
            raise
        return [""] * num_roles
    if isinstance(outputs, str):
        raise TypeError("Centralized adapter must return a sequence of strings, not a single string.")
    try:
        outputs = list(outputs)
    except TypeError:
        raise TypeError(
            f"Centralized adapter must return a sequence of strings, got {type(outputs).__name__}."
        ) from None
    if len(outputs) != num_roles:
        raise ValueError(f"Centralized adapter must return exactly {num_roles} outputs; got {len(outputs)}.")
    if not all(isinstance(o, str) for o in outputs):
        raise TypeError("Centralized adapter outputs must all be strings.")
    return outputs


class CentralizedCollaboration:
    """Turns an N-role team task into a one-actor task: the actor's prompt is the joint prompt and its reward is
    the user's N-agent reward on the split joint completion, so user reward code needs no change."""

    def __init__(
        self,
        adapter: Any,
        role_formatters: Sequence[Formatter],
        reward_func: Callable[..., Any],
        num_roles: int,
    ):
        if not isinstance(num_roles, int) or isinstance(num_roles, bool) or num_roles < 1:
            raise ValueError(f"num_roles must be a positive integer, got {num_roles!r}.")
        role_formatters = list(role_formatters)
        if len(role_formatters) != num_roles:
            raise ValueError(f"role_formatters: got {len(role_formatters)} formatters for {num_roles} roles.")
        for i, f in enumerate(role_formatters):
            if not callable(f):
                raise TypeError(f"role_formatters[{i}] must be callable, got {type(f).__name__}.")
        self.adapter = check_adapter(adapter)
        self.role_formatters = role_formatters
        self.reward_func = reward_func
        self.num_roles = num_roles
        self._caller = RewardCaller(reward_func)
        self.parse_failures = 0
        if hasattr(reward_func, "reward_range"):
            self.reward_range = reward_func.reward_range

    def take_parse_failures(self) -> int:
        """Joint answers the adapter could not split since the last call (they were scored as empty roles)."""
        count, self._taken = self.parse_failures - getattr(self, "_taken", 0), self.parse_failures
        return count

    def formatter(self, item: Mapping[str, Any], external_prompts: str | None = None) -> str:
        """The joint prompt; external prompts are ignored because centralized mode is single-turn."""
        return joint_prompt(self.adapter, item, [f(item) for f in self.role_formatters])

    def _items(self, batch_items: Sequence[Mapping[str, Any]] | None, count: int) -> list[Mapping[str, Any]]:
        if batch_items is None:
            raise ValueError("Centralized task rewards require batch_items.")
        items = list(batch_items)
        if len(items) == 1:
            return items * count
        if len(items) != count:
            raise ValueError("Centralized completions must align with batch_items.")
        return items

    def split_roles(self, joint_texts: Sequence[str], items: Sequence[Mapping[str, Any]]) -> list[list[str]]:
        """Per-role texts ``[role][row]`` so evaluation can hand the user's logger ordinary agent completions."""
        rows = self._items(items, len(joint_texts))
        split = [
            split_joint(self.adapter, t, it, self.num_roles, on_parse_error="empty") for t, it in zip(joint_texts, rows)
        ]
        return [[row[i] for row in split] for i in range(self.num_roles)]

    def split_turns(
        self, joint_turns: Sequence[Sequence[str]], items: Sequence[Mapping[str, Any]]
    ) -> list[list[list[str]]]:
        """``[item][turn]`` joint texts → ``[role][item][turn]`` role texts (evaluation's agent_completions_turns)."""
        out: list[list[list[str]]] = [[] for _ in range(self.num_roles)]
        for turns, item in zip(joint_turns, items):
            roles = self.split_roles(list(turns), [item])
            for i in range(self.num_roles):
                out[i].append(roles[i])
        return out

    def __call__(
        self,
        joint_completions: Sequence[str],
        prompts: Sequence[str] | None = None,
        batch_items: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[float] | list[dict[str, float]]:
        """Raw team rewards, one per joint completion (the user's named components when it returns them); the user's
        reward is called once for the whole batch."""
        texts = list(joint_completions)
        items = self._items(batch_items, len(texts))
        if not texts:
            return []
        split = []
        for text, item in zip(texts, items):
            try:
                split.append(split_joint(self.adapter, text, item, self.num_roles))
            except CentralizedParseError:
                self.parse_failures += 1
                split.append([""] * self.num_roles)
        role_lists = [[row[i] for row in split] for i in range(self.num_roles)]
        role_prompts = [self.role_formatters[0](item) for item in items]
        out = self._caller.raw_rewards(role_lists, prompts=role_prompts, batch_items=items)
        if out.names is None:
            return out.values
        return [dict(zip(out.names, row)) for row in out.components]  # the user's named components, passed on

    def __repr__(self) -> str:
        name = getattr(self.reward_func, "__name__", type(self.reward_func).__name__)
        return f"CentralizedCollaboration(adapter={self.adapter!r}, num_roles={self.num_roles}, reward_func={name})"
