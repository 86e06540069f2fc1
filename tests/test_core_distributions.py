"""Reward-distribution logging: bins, histograms, payload, metrics, validation and SVG charts
(docs/iterative.md#metrics)."""

import functools
import json
import math
import xml.etree.ElementTree as ET

import pytest

from comlrl_lightning.callbacks.charts import COMPARATOR_COLOR, TARGET_COLOR, svg_chart
from comlrl_lightning.core.distributions import (
    NUM_BINS,
    bin_edges,
    distribution_metrics,
    distribution_record,
    histogram,
    reward_range_of,
)

# Range (0, 3) in 16 bins: width 3 / 16 = 0.1875.
# 0 -> bin 0, 0.1 -> bin 0 (0.1 / 0.1875 = 0.53), 1.5 -> bin 8 (1.5 / 0.1875 = 8.0 exactly),
# 3.0 == max -> last bin 15, 3.5 clips to 3.0 -> bin 15, -1 clips to 0 -> bin 0.
VALUES = [0.0, 0.1, 1.5, 3.0, 3.5, -1.0]
COUNTS = [3, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 2]
MEAN = 7.1 / 6  # raw (unclipped) values: 0 + 0.1 + 1.5 + 3 + 3.5 - 1 = 7.1

S_KEYS = {"sample_count", "mean", "counts", "raw_rewards"}
RECORD_KEYS = {
    "iteration",
    "reward_min",
    "reward_max",
    "num_bins",
    "bin_edges",
    "bin_centers",
    "candidate",
    "selected",
}


def _record(**overrides):
    sides = dict(target=VALUES, comparator=[1.0, 2.0], selected_target=[3.0], selected_comparator=[0.5])
    sides.update(overrides)
    return distribution_record(2, 0.0, 3.0, **sides)


def _all_keys(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _all_keys(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _all_keys(v)


def test_bin_edges_0_to_3():
    edges = bin_edges(0.0, 3.0)
    assert NUM_BINS == 16
    assert len(edges) == 17
    assert edges == pytest.approx([0.1875 * i for i in range(17)])
    assert edges[0] == 0.0 and edges[-1] == 3.0 and edges[1] == 0.1875


def test_histogram_hand_computed():
    h = histogram(VALUES, 0.0, 3.0)
    assert set(h) == S_KEYS
    assert h["counts"] == COUNTS
    assert h["sample_count"] == 6
    assert sum(h["counts"]) == h["sample_count"]
    assert h["mean"] == pytest.approx(MEAN)
    assert h["raw_rewards"] == VALUES  # unclipped: 3.5 and -1 kept as given


def test_histogram_edge_value_goes_to_upper_bin():
    # 0.1875 is the edge between bins 0 and 1; it belongs to bin 1.
    assert histogram([0.1875], 0.0, 3.0)["counts"][1] == 1


def test_histogram_empty():
    h = histogram([], 0.0, 3.0)
    assert h == {"sample_count": 0, "mean": None, "counts": [0] * 16, "raw_rewards": []}


def test_histogram_rejects_nan():
    with pytest.raises(ValueError, match="finite"):
        histogram([math.nan], 0.0, 3.0)


def test_record_keys_and_no_density():
    rec = _record()
    assert set(rec) == RECORD_KEYS
    assert rec["iteration"] == 2 and rec["reward_min"] == 0.0 and rec["reward_max"] == 3.0
    assert rec["num_bins"] == 16
    assert len(rec["bin_edges"]) == 17 and len(rec["bin_centers"]) == 16
    assert rec["bin_centers"][0] == pytest.approx(0.09375) and rec["bin_centers"][-1] == pytest.approx(2.90625)
    for part in ("candidate", "selected"):
        assert set(rec[part]) == {"target", "comparator"}
        for side in ("target", "comparator"):
            assert set(rec[part][side]) == S_KEYS
            assert sum(rec[part][side]["counts"]) == rec[part][side]["sample_count"]
    assert rec["candidate"]["target"]["counts"] == COUNTS
    assert rec["selected"]["target"]["counts"][15] == 1  # 3.0 == max
    assert rec["selected"]["comparator"]["counts"][2] == 1  # 0.5 / 0.1875 = 2.67
    assert "density" not in set(_all_keys(rec))


def test_record_json_round_trip():
    rec = _record(selected_comparator=[])
    assert json.loads(json.dumps(rec)) == rec


def test_metrics_names_and_values():
    metrics = distribution_metrics(_record(), pair_count=1)
    assert metrics == pytest.approx(
        {
            "iter/reward_distribution/current_iteration": 2.0,
            "iter/reward_distribution/target_sample_count": 6.0,
            "iter/reward_distribution/comparator_sample_count": 2.0,
            "iter/reward_distribution/target_mean": MEAN,
            "iter/reward_distribution/comparator_mean": 1.5,
            "iter/selected_reward_distribution/current_iteration": 2.0,
            "iter/selected_reward_distribution/target_sample_count": 1.0,
            "iter/selected_reward_distribution/comparator_sample_count": 1.0,
            "iter/selected_reward_distribution/target_mean": 3.0,
            "iter/selected_reward_distribution/comparator_mean": 0.5,
            "iter/selected_reward_distribution/pair_count": 1.0,
        }
    )


def test_metrics_omit_empty_mean():
    rec = _record(comparator=[], selected_target=[], selected_comparator=[])
    metrics = distribution_metrics(rec, pair_count=0)
    assert "iter/reward_distribution/comparator_mean" not in metrics
    assert "iter/reward_distribution/target_mean" in metrics
    assert "iter/selected_reward_distribution/target_mean" not in metrics
    assert "iter/selected_reward_distribution/comparator_mean" not in metrics
    assert metrics["iter/reward_distribution/comparator_sample_count"] == 0.0
    assert metrics["iter/selected_reward_distribution/pair_count"] == 0.0


def _reward(*_args, **_kwargs):
    return [0.0]


def _with_range(value):
    def fn(*_args, **_kwargs):
        return [0.0]

    fn.reward_range = value
    return fn


def test_reward_range_of_function_and_callable_object():
    assert reward_range_of(_with_range((0, 3))) == (0.0, 3.0)

    class Scorer:
        reward_range = [-1.0, 4.0]

        def __call__(self, *args):
            return [0.0]

    assert reward_range_of(Scorer()) == (-1.0, 4.0)


def test_reward_range_through_partial():
    part = functools.partial(_with_range((0.0, 2.5)), level=1)
    assert reward_range_of(part) == (0.0, 2.5)
    # Set on the partial itself also counts.
    own = functools.partial(_reward, level=1)
    own.reward_range = (1.0, 2.0)
    assert reward_range_of(own) == (1.0, 2.0)


def test_reward_range_missing():
    with pytest.raises(
        ValueError, match=r"log_reward_distribution=True requires reward_func\.reward_range \(minimum, maximum\)"
    ):
        reward_range_of(_reward)
    with pytest.raises(ValueError, match="requires reward_func.reward_range"):
        reward_range_of(functools.partial(_reward))


@pytest.mark.parametrize("bad", [(0.0,), (0.0, 1.0, 2.0), 3.0, "ab"])
def test_reward_range_not_two_items(bad):
    with pytest.raises(ValueError) as err:
        reward_range_of(_with_range(bad))
    assert "reward_func.reward_range must be a two-item sequence: (minimum, maximum)." in str(err.value)


@pytest.mark.parametrize("bad", [(0.0, math.inf), (-math.inf, 1.0), (math.nan, 1.0)])
def test_reward_range_not_finite(bad):
    with pytest.raises(ValueError) as err:
        reward_range_of(_with_range(bad))
    assert "reward_func.reward_range values must be finite." in str(err.value)


@pytest.mark.parametrize("bad", [(1.0, 1.0), (2.0, 1.0)])
def test_reward_range_min_not_below_max(bad):
    with pytest.raises(ValueError) as err:
        reward_range_of(_with_range(bad))
    assert "reward_func.reward_range minimum must be less than maximum." in str(err.value)


@pytest.mark.parametrize("kind", ["line", "bar"])
@pytest.mark.parametrize("part", ["candidate", "selected"])
def test_svg_chart(kind, part):
    rec = _record()
    svg = svg_chart(rec[part], rec["bin_edges"], kind=kind)
    assert 'width="240"' in svg and 'height="80"' in svg
    root = ET.fromstring(svg)  # valid XML
    assert root.tag.endswith("svg")
    assert root.get("width") == "240" and root.get("height") == "80"
    texts = [el.text for el in root.iter() if el.tag.endswith("text")]
    assert "reward" in texts and "count" in texts
    assert TARGET_COLOR.lower() == "#f28e2b"
    assert TARGET_COLOR in svg and COMPARATOR_COLOR in svg
    shape = "polyline" if kind == "line" else "rect"
    assert any(el.tag.endswith(shape) for el in root.iter())


def test_svg_line_points_follow_counts():
    rec = _record()
    root = ET.fromstring(svg_chart(rec["candidate"], rec["bin_edges"], kind="line"))
    lines = [el for el in root.iter() if el.tag.endswith("polyline")]
    target = next(el for el in lines if el.get("stroke") == TARGET_COLOR)
    ys = [float(p.split(",")[1]) for p in target.get("points").split()]
    assert len(ys) == 16
    # Bin 0 holds the most target samples (3), so it is drawn highest (smallest y); empty bins sit on the baseline.
    assert ys[0] == min(ys) and ys[1] == max(ys) and ys[8] < ys[1] and ys[15] < ys[8]


def test_svg_empty_sides_still_valid():
    rec = _record(selected_target=[], selected_comparator=[])
    for kind in ("line", "bar"):
        ET.fromstring(svg_chart(rec["selected"], rec["bin_edges"], kind=kind))


def test_svg_bad_kind():
    rec = _record()
    with pytest.raises(ValueError, match="line.*bar"):
        svg_chart(rec["candidate"], rec["bin_edges"], kind="pie")
