"""Small inline SVG charts of a round's reward histograms (line or bar), for loggers with HTML panels (W&B) and as
files beside the distribution records. Rendering only: the histograms are ``comlrl_lightning.core.distributions``'s."""

from __future__ import annotations

from xml.sax.saxutils import escape

from comlrl_lightning.core.distributions import SIDES as _SIDES

CHART_KINDS = ("line", "bar")
TARGET_COLOR = "#f28e2b"  # orange
COMPARATOR_COLOR = "#8c8c8c"  # grey
_COLORS = {"target": TARGET_COLOR, "comparator": COMPARATOR_COLOR}

# Chart geometry (pixels): fixed 240 x 80 canvas, plot area inside the margins.
_WIDTH, _HEIGHT = 240, 80
_LEFT, _RIGHT, _TOP, _BOTTOM = 24, 6, 12, 16


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
