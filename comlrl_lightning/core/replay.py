"""Preference replay buffer and iterative pair selection (docs/algorithms.md#iterative-rounds, examples 5, 7).

Pure torch + stdlib. Records and files are those of ``comlrl_lightning.core.pairs`` (``save_pairs`` /
``load_pairs``); this module adds the per-round shard index, the replay weights and the sampling rule.

Shards. Each training round ν (1-based ``iteration``) writes ``<dir>/iteration_{ν:04d}.json`` =
``{"iteration": ν, "num_pairs": n, "pairs": [records]}`` atomically, also when n = 0; only non-empty rounds are
registered as shards (oldest first, newest last).

Weights over the K eligible shards, listed oldest -> newest (index j = 0..K-1, age a = K-1-j, a = 0 newest):
    current       newest only: w = [0, ..., 0, 1]           (training uses the in-memory pairs, no sampling)
    nearest_k     eligible = last k shards: w_j = 1/min(k, K) for the last min(k, K), 0 for older ones
    all_history   w_j = 1/K
    lambda_decay  w_a = (1-λ) λ^a / Σ_b (1-λ) λ^b = λ^a / Σ_b λ^b   (λ ∈ [0, 1]; 0^0 = 1)
                  λ = 1 -> 1/K each; λ = 0 -> newest only; K = 3, λ = 0.8 -> [0.262, 0.328, 0.410]  (example 5)

Sampling (historical modes), S draws:
    S = sample_size  if set  else |current pairs|  if > 0  else |newest shard|  if any  else 0
    shard of each draw ~ Categorical(w)              (``rng.choices``), giving counts c_j, Σ_j c_j = S
    c_j <= n_j: c_j records without replacement      (``rng.sample``)
    c_j >  n_j: ⌊c_j/n_j⌋ whole shuffled copies, then c_j mod n_j without replacement ("nested copies"),
                so every record of shard j appears ⌊c_j/n_j⌋ or ⌈c_j/n_j⌉ times
    concatenate (shards oldest -> newest) and shuffle once more.

Iterative selection (``select_comparison_pairs``): comparison k pairs current[k] with comparator[k] for
k < min(K_c, K_cmp); gap_k = r^cur_k - r^cmp_k; gap > 0 current wins, gap < 0 comparator wins, gap = 0 dropped.
"""

from __future__ import annotations

from typing import Literal, Sequence, get_args

import torch
from torch import Tensor

from comlrl_lightning.choices import Choice
from comlrl_lightning.core.pairs import PairSelection

# The modes and their aliases (any case; docs/iterative.md).
REPLAY_MODE = Choice(
    "preference_replay_mode",
    {
        "current": ("latest", "new"),
        "nearest_k": ("recent_k", "last_k", "k"),
        "all_history": (),
        "lambda_decay": ("lambda", "td_lambda", "td-lambda"),
    },
)
REPLAY_MODES = REPLAY_MODE.values
REPLAY_MODE_ALIASES = REPLAY_MODE.aliases
normalize_replay_mode = REPLAY_MODE
# The iterative variants' ``pair_selection``: the pairs' selections, and current vs comparator by comparator reward.
IterativePairSelection = Literal[PairSelection, "comparator_reward"]
ITERATIVE_PAIR_SELECTIONS: tuple[str, ...] = get_args(IterativePairSelection)
_SHARD_NAME = "iteration_{:04d}.json"


def replay_weights(num_shards: int, mode: str, k: int | None = None, lam: float | None = None) -> list[float]:
    """Normalised dataset weights of ``num_shards`` shards, oldest -> newest (see the module docstring).

    Args:
        num_shards: K, number of non-empty shards (>= 0; K = 0 gives []).
        mode: replay mode or alias (``normalize_replay_mode``).
        k: ``preference_replay_k``; required (>= 1) for ``nearest_k``; k > K keeps all K shards.
        lam: ``preference_replay_lambda``; required, in [0, 1], for ``lambda_decay``.
    Returns:
        [K] python floats summing to 1 (empty list for K = 0).
    """
    mode = normalize_replay_mode(mode)
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 0:
        raise ValueError(f"num_shards must be an int >= 0. (got {num_shards!r})")
    if mode == "nearest_k" and (k is None or isinstance(k, bool) or int(k) != k or k < 1):
        raise ValueError(
            f"preference_replay_k must be an int >= 1 when preference_replay_mode='nearest_k'. (got {k!r})"
        )
    if mode == "lambda_decay" and (lam is None or not 0.0 <= float(lam) <= 1.0):
        raise ValueError(
            f"preference_replay_lambda must be in [0, 1] when preference_replay_mode='lambda_decay'. (got {lam!r})"
        )
    K = num_shards
    if K == 0:
        return []
    if mode == "current":
        return [0.0] * (K - 1) + [1.0]
    if mode == "nearest_k":
        m = min(int(k), K)
        return [0.0] * (K - m) + [1.0 / m] * m
    if mode == "all_history":
        return [1.0 / K] * K
    # lambda_decay: the common factor (1 - λ) cancels; λ^a keeps λ = 1 (uniform) and λ = 0 (0^0 = 1) exact.
    lam = float(lam)
    raw = [lam ** (K - 1 - j) for j in range(K)]  # oldest (a = K-1) ... newest (a = 0)
    total = sum(raw)
    return [r / total for r in raw]


def select_comparison_pairs(
    current_scores: Sequence[float] | Tensor,
    comparator_scores: Sequence[float] | Tensor,
    selection: str = "comparator_reward",
    limit: int | None = 4,
    generator: torch.Generator | None = None,
) -> list[tuple[int, bool]]:
    """Iterative pair selection: compare current[k] with comparator[k], k < min(K_c, K_cmp)
    (docs/algorithms.md#iterative-rounds).

    gap_k = r^cur_k - r^cmp_k (processed scores); gap_k = 0 dropped; current_wins = gap_k > 0. Order:
        reward_gap         |gap_k| descending (stable: ties keep k order)
        random             uniform shuffle (``torch.randperm`` with ``generator``)
        all                k ascending (``limit`` must be None)
        comparator_reward  (r^cmp_k, |gap_k|) descending (stable)
    then the first ``limit`` (None = all). Example 7: current [3, 1, 2], comparator [1, 2, 2], comparator_reward,
    limit 2 -> [(1, False), (0, True)].

    Returns:
        list of (k, current_wins) with python int / bool.
    """
    selection = str(selection).lower()
    if selection not in ITERATIVE_PAIR_SELECTIONS:
        raise ValueError(f"pair_selection must be one of: {', '.join(ITERATIVE_PAIR_SELECTIONS)}. (got {selection!r})")
    if limit is not None and limit < 1:
        raise ValueError(f"preference_pairs_per_sample must be >= 1 or null. (got {limit!r})")
    if selection == "all" and limit is not None:
        raise ValueError(f"preference_pairs_per_sample must be null when pair_selection='all'. (got {limit!r})")

    def as_scores(values: Sequence[float] | Tensor, name: str) -> Tensor:
        s = torch.as_tensor(values).detach().to("cpu", torch.float64)  # [K]
        if s.dim() != 1:
            raise ValueError(f"{name} must be 1-D [K] (got shape {tuple(s.shape)}).")
        if not bool(torch.isfinite(s).all()):
            raise ValueError(f"{name} must be finite (got {s.tolist()}).")
        return s

    cur = as_scores(current_scores, "current_scores")
    cmp = as_scores(comparator_scores, "comparator_scores")
    n = min(cur.numel(), cmp.numel())
    cur_list, cmp_list = cur[:n].tolist(), cmp[:n].tolist()
    # (k, gap, comparator score) for every non-tied comparison, k ascending
    cands = [(i, c - m, m) for i, (c, m) in enumerate(zip(cur_list, cmp_list)) if c != m]
    if not cands:
        return []
    if selection == "reward_gap":
        cands = sorted(cands, key=lambda t: -abs(t[1]))
    elif selection == "comparator_reward":
        cands = sorted(cands, key=lambda t: (-t[2], -abs(t[1])))
    elif selection == "random":
        cands = [cands[j] for j in torch.randperm(len(cands), generator=generator).tolist()]
    if limit is not None:
        cands = cands[:limit]
    return [(int(i), bool(gap > 0)) for i, gap, _ in cands]


__all__ = [
    "ITERATIVE_PAIR_SELECTIONS",
    "IterativePairSelection",
    "REPLAY_MODES",
    "REPLAY_MODE_ALIASES",
    "normalize_replay_mode",
    "replay_weights",
    "select_comparison_pairs",
]
