"""Reward-distribution logging for iterative preference training (REFERENCE §5.13).

Each round ("iteration", 1-based) may record the raw task rewards of every current-policy ("target") candidate
and every comparator candidate, plus the ``target_raw_reward`` / ``comparator_raw_reward`` of the selected
training pairs. The reward function must carry ``reward_range = (minimum, maximum)``; rewards are clipped into
that range and counted in ``NUM_BINS`` equal-width bins (a value equal to the maximum falls in the last bin).

Outputs: a JSON-ready payload (``distribution_record``), scalar metrics (``distribution_metrics``) and small
inline SVG charts (``svg_chart``). Pure stdlib: anything ``float()`` accepts (python numbers, 0-d tensors) works.
"""

from __future__ import annotations

import math
from typing import Any, Sequence
from xml.sax.saxutils import escape

NUM_BINS = 16
CHART_KINDS = ("line", "bar")
TARGET_COLOR = "#f28e2b"  # orange
COMPARATOR_COLOR = "#8c8c8c"  # grey

_SIDES = ("target", "comparator")
_COLORS = {"target": TARGET_COLOR, "comparator": COMPARATOR_COLOR}
# Chart geometry (pixels): fixed 240 x 80 canvas, plot area inside the margins.
_WIDTH, _HEIGHT = 240, 80
_LEFT, _RIGHT, _TOP, _BOTTOM = 24, 6, 12, 16


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
        for side in _SIDES:
            stats = record[part][side]
            metrics[f"{prefix}/{side}_sample_count"] = float(stats["sample_count"])
            if stats["mean"] is not None:
                metrics[f"{prefix}/{side}_mean"] = float(stats["mean"])
    metrics["iter/selected_reward_distribution/pair_count"] = float(pair_count)
    return metrics


def _fmt(x: float) -> str:
    return f"{x:.1f}"


def _text(x: float, y: float, label: str, anchor: str = "middle", extra: str = "") -> str:
    return (
        f'<text x="{_fmt(x)}" y="{_fmt(y)}" font-size="8" font-family="sans-serif" '
        f'text-anchor="{anchor}"{extra}>{escape(label)}</text>'
    )


def svg_chart(record_part: dict, edges: list[float], kind: str = "line") -> str:
    """A 240x80 inline SVG of target (orange) vs comparator (grey) bin counts.

    ``record_part`` is ``record["candidate"]`` or ``record["selected"]``; ``edges`` is ``record["bin_edges"]``.
    ``kind`` is ``line`` (count per bin center) or ``bar`` (side-by-side bars per bin).
    """
    if kind not in CHART_KINDS:
        raise ValueError(f"kind must be one of {CHART_KINDS}, got {kind!r}.")
    num_bins = len(edges) - 1
    if num_bins < 1:
        raise ValueError("edges must hold at least two values.")
    for side in _SIDES:
        if len(record_part[side]["counts"]) != num_bins:
            raise ValueError(f"{side} counts must have {num_bins} entries (len(edges) - 1).")

    x0, x1 = _LEFT, _WIDTH - _RIGHT
    y0, y1 = _TOP, _HEIGHT - _BOTTOM  # y0 = top, y1 = baseline
    bin_w = (x1 - x0) / num_bins
    peak = max([1, *(c for side in _SIDES for c in record_part[side]["counts"])])  # avoid /0 when all empty

    def y_of(count: int) -> float:
        return y1 - (y1 - y0) * count / peak

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
        f'viewBox="0 0 {_WIDTH} {_HEIGHT}">',
        f'<line x1="{x0}" y1="{y1}" x2="{x1}" y2="{y1}" stroke="#333" stroke-width="0.5"/>',
        f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="#333" stroke-width="0.5"/>',
    ]
    for s, side in enumerate(_SIDES):
        counts, color = record_part[side]["counts"], _COLORS[side]
        if kind == "line":
            points = " ".join(f"{_fmt(x0 + (i + 0.5) * bin_w)},{_fmt(y_of(c))}" for i, c in enumerate(counts))
            parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.2"/>')
        else:
            half = bin_w / 2
            for i, c in enumerate(counts):
                if c:
                    top = y_of(c)
                    parts.append(
                        f'<rect x="{_fmt(x0 + i * bin_w + s * half)}" y="{_fmt(top)}" width="{_fmt(half)}" '
                        f'height="{_fmt(y1 - top)}" fill="{color}"/>'
                    )
    # Axis labels, range ends, peak count and a two-entry legend.
    parts += [
        _text((x0 + x1) / 2, _HEIGHT - 3, "reward"),
        _text(x0, _HEIGHT - 6, f"{edges[0]:g}", anchor="start"),
        _text(x1, _HEIGHT - 6, f"{edges[-1]:g}", anchor="end"),
        _text(8, (y0 + y1) / 2, "count", extra=f' transform="rotate(-90 8 {_fmt((y0 + y1) / 2)})"'),
        _text(x0 - 2, y0 + 3, f"{peak}", anchor="end"),
    ]
    for s, side in enumerate(_SIDES):
        lx = x0 + 8 + s * 60
        parts.append(f'<rect x="{lx}" y="3" width="6" height="6" fill="{_COLORS[side]}"/>')
        parts.append(_text(lx + 8, 9, side, anchor="start"))
    parts.append("</svg>")
    return "".join(parts)
