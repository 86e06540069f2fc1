"""Reward-distribution logging for iterative preference training (docs/iterative.md#metrics).

Each round ("iteration", 1-based) may record the raw task rewards of every current-policy ("target") candidate
and every comparator candidate, plus the ``target_raw_reward`` / ``comparator_raw_reward`` of the selected
training pairs. The reward function must carry ``reward_range = (minimum, maximum)``; rewards are clipped into
that range and counted in ``NUM_BINS`` equal-width bins (a value equal to the maximum falls in the last bin).

Outputs: a JSON-ready payload (``distribution_record``) and scalar metrics (``distribution_metrics``); the
charts are drawn by ``comlrl_lightning.callbacks.charts``. Pure stdlib: anything ``float()`` accepts (python numbers, 0-d tensors) works.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

NUM_BINS = 16
SIDES = ("target", "comparator")  # the current policy's candidates, the comparator's


def _find_reward_range(reward_func: Any) -> Any:
    # functools.partial keeps the wrapped function in .func; the attribute may sit on either layer.
    seen = set()
    obj = reward_func
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        value = getattr(obj, "reward_range", None)
        if value is not None:
            return value
        obj = getattr(obj, "func", None)
    return None


def reward_range_of(reward_func: Any) -> tuple[float, float]:
    """Read and validate ``reward_func.reward_range``; returns ``(minimum, maximum)`` as floats."""
    value = _find_reward_range(reward_func)
    if value is None:
        raise ValueError(
            "log_reward_distribution=True requires reward_func.reward_range (minimum, maximum) "
            "to be set on the reward function."
        )
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError("reward_func.reward_range must be a two-item sequence: (minimum, maximum).")
    try:
        low, high = float(value[0]), float(value[1])
    except (TypeError, ValueError):
        raise ValueError("reward_func.reward_range values must be finite.") from None
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError("reward_func.reward_range values must be finite.")
    if low >= high:
        raise ValueError("reward_func.reward_range minimum must be less than maximum.")
    return low, high


def _check_range(low: float, high: float, num_bins: int) -> None:
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ValueError(f"reward range must be finite with minimum < maximum, got ({low}, {high}).")
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}.")


def bin_edges(low: float, high: float, num_bins: int = NUM_BINS) -> list[float]:
    """``num_bins + 1`` equally spaced edges from ``low`` to ``high`` (endpoints exact)."""
    _check_range(low, high, num_bins)
    width = (high - low) / num_bins
    edges = [low + i * width for i in range(num_bins)]
    edges.append(float(high))  # exact, not low + n * width, so the last edge never drifts
    return edges


def histogram(values: Sequence[float], low: float, high: float, num_bins: int = NUM_BINS) -> dict:
    """Summary of one side: ``{"sample_count", "mean", "counts", "raw_rewards"}``.

    ``raw_rewards`` and ``mean`` use the values as given; only ``counts`` sees them clipped into [low, high].
    ``mean`` is None when there are no values.
    """
    _check_range(low, high, num_bins)
    raw = [float(v) for v in values]
    # NaN/inf cannot be binned meaningfully and would make the payload invalid JSON.
    if not all(math.isfinite(v) for v in raw):
        raise ValueError("reward distribution values must be finite.")
    counts = [0] * num_bins
    width = (high - low) / num_bins
    for v in raw:
        clipped = min(max(v, low), high)
        counts[min(int((clipped - low) / width), num_bins - 1)] += 1  # value == high -> last bin
    return {
        "sample_count": len(raw),
        "mean": sum(raw) / len(raw) if raw else None,
        "counts": counts,
        "raw_rewards": raw,
    }


def distribution_record(
    iteration: int,
    low: float,
    high: float,
    *,
    target: Sequence[float],
    comparator: Sequence[float],
    selected_target: Sequence[float],
    selected_comparator: Sequence[float],
) -> dict:
    """The per-iteration JSON payload: range, bins, and candidate / selected histograms for both sides."""
    edges = bin_edges(low, high)
    return {
        "iteration": int(iteration),
        "reward_min": float(low),
        "reward_max": float(high),
        "num_bins": NUM_BINS,
        "bin_edges": edges,
        "bin_centers": [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])],
        "candidate": {
            "target": histogram(target, low, high),
            "comparator": histogram(comparator, low, high),
        },
        "selected": {
            "target": histogram(selected_target, low, high),
            "comparator": histogram(selected_comparator, low, high),
        },
    }


def distribution_metrics(record: dict, pair_count: int) -> dict[str, float]:
    """Scalar metrics of a record; a ``*_mean`` key is left out when that side has no samples."""
    metrics: dict[str, float] = {}
    for part, prefix in (("candidate", "iter/reward_distribution"), ("selected", "iter/selected_reward_distribution")):
        metrics[f"{prefix}/current_iteration"] = float(record["iteration"])
        for side in SIDES:
            stats = record[part][side]
            metrics[f"{prefix}/{side}_sample_count"] = float(stats["sample_count"])
            if stats["mean"] is not None:
                metrics[f"{prefix}/{side}_mean"] = float(stats["mean"])
    metrics["iter/selected_reward_distribution/pair_count"] = float(pair_count)
    return metrics
