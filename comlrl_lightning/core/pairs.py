"""Preference pairs: selection from oracle scores and the replay record format
(docs/algorithms.md#preference-pairs-and-madpo).

Pure torch + stdlib. A *candidate* is one joint response (agent_1 sample k, ..., agent_N sample k) scored by
the oracle (processed task reward). A *pair* (w, l) says candidate w is preferred to candidate l.

Selection (``select_pairs``), for K scores s_0..s_{K-1}:
    candidates = { (w, l) : w != l, s_w - s_l > 0 }    ties dropped; each unordered pair once, winner first
    reward_gap  sort by gap s_w - s_l descending (stable: equal gaps keep (w, l) lexicographic order), first `limit`
    random      uniform shuffle (``torch.randperm`` with the given generator), first `limit`
    all         (winner, loser) lexicographic order, every candidate (`limit` must be None)
With K = 80 candidates and limit 16 (CoMLRL defaults) the default keeps the 16 largest-gap pairs.

Records (``PreferencePair.to_record``) carry text and rewards only; token tensors stay in memory and are rebuilt
by re-tokenising on load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence, get_args

import torch
from torch import Tensor

PairSelection = Literal["reward_gap", "random", "all"]  # ``pair_selection`` (the field's type)
PAIR_SELECTIONS: tuple[str, ...] = get_args(PairSelection)
# Keys of one serialised pair, in file order (docs/algorithms.md#preference-pairs-and-madpo).
RECORD_KEYS = (
    "prompts",
    "winner_completions",
    "loser_completions",
    "winner_reward",
    "loser_reward",
    "candidate_reward_mean",
    "raw_rewards",
    "target_raw_reward",
    "comparator_raw_reward",
)
_REQUIRED_RECORD_KEYS = RECORD_KEYS[:6]


def select_pairs(
    scores: Sequence[float] | Tensor,
    selection: str = "reward_gap",
    limit: int | None = 16,
    generator: torch.Generator | None = None,
) -> list[tuple[int, int]]:
    """Choose (winner, loser) index pairs among K scored candidates (docs/algorithms.md#preference-pairs-and-madpo).

    Args:
        scores: [K] oracle scores (processed rewards) of the K joint candidates; must be finite.
        selection: ``reward_gap`` | ``random`` | ``all`` (case-insensitive); config field ``pair_selection``.
        limit: max pairs kept (``preference_pairs_per_sample``); None = unlimited; must be None for ``all``.
        generator: RNG for ``random`` (None -> torch's global RNG).
    Returns:
        list of (winner, loser) python-int tuples with scores[winner] > scores[loser]; empty if all scores tie.
    """
    selection = str(selection).lower()
    if selection not in PAIR_SELECTIONS:
        raise ValueError(f"pair_selection must be one of: {', '.join(PAIR_SELECTIONS)}. (got {selection!r})")
    if limit is not None and limit < 1:
        raise ValueError(f"preference_pairs_per_sample must be >= 1 or null. (got {limit!r})")
    if selection == "all" and limit is not None:
        raise ValueError(f"preference_pairs_per_sample must be null when pair_selection='all'. (got {limit!r})")

    s = torch.as_tensor(scores).detach().to("cpu", torch.float64)  # [K]; float64 so tiny gaps are not lost
    if s.dim() != 1:
        raise ValueError(f"scores must be 1-D [K] (got shape {tuple(s.shape)}).")
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"scores must be finite (got {s.tolist()}).")

    # gap[w, l] = s_w - s_l; of each unordered pair only the positive direction survives (ties: neither), so
    # nonzero() lists every candidate once, winner first, already in (winner, loser) row-major order.
    gap = s[:, None] - s[None, :]  # [K, K]
    positive = gap > 0  # [K, K]
    winners, losers = positive.nonzero(as_tuple=True)  # [C], [C]
    # [C]; index_select, because advanced/boolean indexing launches a parallel CPU kernel that costs ms under load
    gaps = s.index_select(0, winners) - s.index_select(0, losers)
    if winners.numel() == 0:
        return []

    if selection == "reward_gap":
        order = torch.argsort(-gaps, stable=True)
    elif selection == "random":
        order = torch.randperm(winners.numel(), generator=generator)
    else:  # all
        order = torch.arange(winners.numel())
    if limit is not None:
        order = order[:limit]
    return list(zip(winners.index_select(0, order).tolist(), losers.index_select(0, order).tolist()))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass
class PreferencePair:
    """One preference between two joint responses; per-agent lists have one entry per agent.

    Text and rewards are serialised (``to_record``); the token tensors are in-memory only:
        prompt_ids[i]  [Lp_i] agent i's prompt tokens
        winner_ids[i]  [Lw_i] agent i's generated tokens of the winner, up to and including EOS, no padding
        loser_ids[i]   [Ll_i] same for the loser
    They are empty after ``from_record`` / ``load_pairs``: callers re-tokenise from the text.

    ``raw_rewards`` = [winner_raw, loser_raw] (task reward before ``reward_processor``) in iterative training;
    ``target_raw_reward`` / ``comparator_raw_reward`` = the current-policy / comparator candidate's raw reward.
    """

    prompts: list[str]
    winner_completions: list[str]
    loser_completions: list[str]
    winner_reward: float
    loser_reward: float
    candidate_reward_mean: float
    raw_rewards: list[float] = field(default_factory=list)
    target_raw_reward: float | None = None
    comparator_raw_reward: float | None = None
    prompt_ids: list[Tensor] = field(default_factory=list, repr=False)
    winner_ids: list[Tensor] = field(default_factory=list, repr=False)
    loser_ids: list[Tensor] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.prompts) == len(self.winner_completions) == len(self.loser_completions)):
            raise ValueError(
                "prompts, winner_completions and loser_completions must have one entry per agent "
                f"(got {len(self.prompts)}, {len(self.winner_completions)}, {len(self.loser_completions)})."
            )
        if self.raw_rewards is None:
            self.raw_rewards = []

    @property
    def num_agents(self) -> int:
        return len(self.prompts)

    def to_record(self) -> dict[str, Any]:
        """JSON-ready dict with exactly the keys of ``RECORD_KEYS`` (no token tensors)."""
        return {
            "prompts": [str(p) for p in self.prompts],
            "winner_completions": [str(c) for c in self.winner_completions],
            "loser_completions": [str(c) for c in self.loser_completions],
            "winner_reward": float(self.winner_reward),
            "loser_reward": float(self.loser_reward),
            "candidate_reward_mean": float(self.candidate_reward_mean),
            "raw_rewards": [float(r) for r in (self.raw_rewards or [])],
            "target_raw_reward": _optional_float(self.target_raw_reward),
            "comparator_raw_reward": _optional_float(self.comparator_raw_reward),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "PreferencePair":
        """Inverse of ``to_record``; optional keys may be missing or null. Token tensors are left empty."""
        missing = [key for key in _REQUIRED_RECORD_KEYS if key not in record]
        if missing:
            raise ValueError(f"preference pair record is missing keys: {', '.join(missing)}.")
        return cls(
            prompts=list(record["prompts"]),
            winner_completions=list(record["winner_completions"]),
            loser_completions=list(record["loser_completions"]),
            winner_reward=float(record["winner_reward"]),
            loser_reward=float(record["loser_reward"]),
            candidate_reward_mean=float(record["candidate_reward_mean"]),
            raw_rewards=[float(r) for r in (record.get("raw_rewards") or [])],
            target_raw_reward=_optional_float(record.get("target_raw_reward")),
            comparator_raw_reward=_optional_float(record.get("comparator_raw_reward")),
        )


__all__ = ["PAIR_SELECTIONS", "RECORD_KEYS", "PairSelection", "PreferencePair", "select_pairs"]
