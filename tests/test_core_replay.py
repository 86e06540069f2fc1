"""Replay buffer weights/shards/sampling and iterative pair selection (docs/algorithms.md#iterative-rounds,
examples 5 and 7)."""

import json
import os
import random
from collections import Counter

import pytest
import torch

from comlrl_lightning.core.pairs import RECORD_KEYS, PreferencePair
from comlrl_lightning.core.replay import (
    ITERATIVE_PAIR_SELECTIONS,
    REPLAY_MODES,
    normalize_replay_mode,
    replay_weights,
    select_comparison_pairs,
)
from comlrl_lightning.data.replay import ReplayIndex, ReplayShard
from comlrl_lightning.runs.files import load_pairs


def make_pairs(tag: str, n: int) -> list[PreferencePair]:
    return [
        PreferencePair(
            prompts=[f"{tag}-p{i}", f"{tag}-q{i}"],
            winner_completions=[f"{tag}-w{i}", "ω"],
            loser_completions=[f"{tag}-l{i}", ""],
            winner_reward=1.0 + i,
            loser_reward=0.0,
            candidate_reward_mean=0.5,
            raw_rewards=[2.0 + i, 1.0],
            target_raw_reward=2.0 + i,
            comparator_raw_reward=1.0,
        )
        for i in range(n)
    ]


def key(pair: PreferencePair) -> str:
    return pair.prompts[0]


# ---------------------------------------------------------------- weights and modes


def test_e5_lambda_decay_weights():
    w = replay_weights(3, "lambda_decay", lam=0.8)
    assert [round(x, 3) for x in w] == [0.262, 0.328, 0.410]  # oldest -> newest
    assert sum(w) == pytest.approx(1.0)
    raw = [0.128, 0.16, 0.2]  # (1-λ)λ^a for a = 2, 1, 0
    assert w == pytest.approx([r / sum(raw) for r in raw])


def test_lambda_edges():
    assert replay_weights(3, "lambda_decay", lam=1.0) == pytest.approx([1 / 3] * 3)
    assert replay_weights(3, "lambda_decay", lam=0.0) == [0.0, 0.0, 1.0]
    assert replay_weights(1, "lambda_decay", lam=0.3) == [1.0]
    assert replay_weights(0, "lambda_decay", lam=0.5) == []


def test_nearest_k_all_history_current():
    assert replay_weights(5, "nearest_k", k=2) == [0.0, 0.0, 0.0, 0.5, 0.5]
    assert replay_weights(2, "nearest_k", k=4) == [0.5, 0.5]  # k > K keeps every shard
    assert replay_weights(4, "all_history") == [0.25] * 4
    assert replay_weights(3, "current") == [0.0, 0.0, 1.0]


def test_weight_validation():
    with pytest.raises(ValueError, match="preference_replay_k must be"):
        replay_weights(3, "nearest_k")
    with pytest.raises(ValueError, match="preference_replay_k must be"):
        replay_weights(3, "last_k", k=0)
    with pytest.raises(ValueError, match=r"preference_replay_lambda must be in \[0, 1\]"):
        replay_weights(3, "lambda_decay")
    with pytest.raises(ValueError, match=r"preference_replay_lambda must be in \[0, 1\]"):
        replay_weights(3, "td-lambda", lam=1.5)
    with pytest.raises(ValueError, match="num_shards"):
        replay_weights(-1, "all_history")


@pytest.mark.parametrize(
    ("alias", "mode"),
    [
        ("current", "current"),
        ("latest", "current"),
        ("NEW", "current"),
        ("nearest_k", "nearest_k"),
        ("recent_k", "nearest_k"),
        ("last_k", "nearest_k"),
        ("k", "nearest_k"),
        ("all_history", "all_history"),
        ("lambda_decay", "lambda_decay"),
        ("lambda", "lambda_decay"),
        ("td_lambda", "lambda_decay"),
        (" TD-Lambda ", "lambda_decay"),
    ],
)
def test_mode_aliases(alias, mode):
    assert normalize_replay_mode(alias) == mode


def test_unknown_mode():
    assert REPLAY_MODES == ("current", "nearest_k", "all_history", "lambda_decay")
    with pytest.raises(ValueError, match="preference_replay_mode must be one of: current, nearest_k, all_history"):
        normalize_replay_mode("ring")
    with pytest.raises(ValueError, match="preference_replay_mode"):
        replay_weights(2, "fifo")


# ---------------------------------------------------------------- shard files and index


def test_shard_files_and_registration(tmp_path):
    index = ReplayIndex()
    p1 = index.add(1, make_pairs("a", 3), tmp_path / "replay")
    p2 = index.add(2, [], tmp_path / "replay")
    p3 = index.add(12, make_pairs("c", 2), tmp_path / "replay")
    assert [p.name for p in (p1, p2, p3)] == ["iteration_0001.json", "iteration_0002.json", "iteration_0012.json"]
    assert all(p.exists() for p in (p1, p2, p3))
    # no temporary leftovers from the atomic write
    assert sorted(os.listdir(tmp_path / "replay")) == [p.name for p in (p1, p2, p3)]

    payload = json.loads(p1.read_text(encoding="utf-8"))
    assert list(payload) == ["iteration", "num_pairs", "pairs"]
    assert payload["iteration"] == 1 and payload["num_pairs"] == 3
    assert list(payload["pairs"][0]) == list(RECORD_KEYS)
    assert "ω" in p1.read_text(encoding="utf-8")  # ensure_ascii=False
    empty = json.loads(p2.read_text(encoding="utf-8"))
    assert empty == {"iteration": 2, "num_pairs": 0, "pairs": []}

    # the empty round is written but not registered
    assert index.shards == [ReplayShard(1, str(p1), 3), ReplayShard(12, str(p3), 2)]
    assert [key(p) for p in load_pairs(p1)] == ["a-p0", "a-p1", "a-p2"]

    # re-adding an iteration replaces its shard (and an empty re-add unregisters it)
    index.add(12, make_pairs("d", 4), tmp_path / "replay")
    assert [(s.iteration, s.num_pairs) for s in index.shards] == [(1, 3), (12, 4)]
    index.add(12, [], tmp_path / "replay")
    assert [s.iteration for s in index.shards] == [1]


def test_state_dict_round_trip(tmp_path):
    index = ReplayIndex()
    index.add(1, make_pairs("a", 2), tmp_path)
    index.add(2, make_pairs("b", 1), tmp_path)
    state = index.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain types only
    assert state == {
        "shards": [
            {"iteration": 1, "path": str(tmp_path / "iteration_0001.json"), "num_pairs": 2},
            {"iteration": 2, "path": str(tmp_path / "iteration_0002.json"), "num_pairs": 1},
        ]
    }
    restored = ReplayIndex()
    restored.load_state_dict(state)
    assert restored.shards == index.shards and len(restored) == 2
    rng_a, rng_b = random.Random(3), random.Random(3)
    a = index.sample("all_history", [], sample_size=5, rng=rng_a)
    b = restored.sample("all_history", [], sample_size=5, rng=rng_b)
    assert [key(p) for p in a] == [key(p) for p in b]
    with pytest.raises(ValueError, match="shards"):
        restored.load_state_dict({"nope": []})


# ---------------------------------------------------------------- sampling


def test_current_returns_current_pairs(tmp_path):
    index = ReplayIndex()
    index.add(1, make_pairs("old", 4), tmp_path)
    current = make_pairs("cur", 3)
    out = index.sample("latest", current, rng=random.Random(0))
    assert out == current and all(a is b for a, b in zip(out, current))
    assert index.sample("current", [], rng=random.Random(0)) == []


def test_sample_size_defaults(tmp_path):
    index = ReplayIndex()
    assert index.sample("all_history", [], rng=random.Random(0)) == []  # nothing anywhere -> S = 0
    index.add(1, make_pairs("a", 5), tmp_path)
    index.add(2, make_pairs("b", 3), tmp_path)
    index.add(3, [], tmp_path)
    rng = random.Random(0)
    assert len(index.sample("all_history", make_pairs("x", 7), rng=rng)) == 7  # |current|
    assert len(index.sample("all_history", [], rng=rng)) == 3  # newest non-empty shard
    assert len(index.sample("all_history", [], sample_size=11, rng=rng)) == 11
    loaded = index.sample("all_history", [], sample_size=2, rng=rng)
    assert all(isinstance(p, PreferencePair) and p.prompt_ids == [] for p in loaded)  # tensors rebuilt by caller
    with pytest.raises(ValueError, match="preference_replay_sample_size"):
        index.sample("all_history", [], sample_size=0, rng=rng)


def test_without_replacement_within_a_shard(tmp_path):
    index = ReplayIndex()
    index.add(1, make_pairs("a", 10), tmp_path)
    for seed in range(20):
        out = index.sample("all_history", [], sample_size=7, rng=random.Random(seed))
        names = [key(p) for p in out]
        assert len(names) == 7 and len(set(names)) == 7
    full = index.sample("all_history", [], sample_size=10, rng=random.Random(0))
    assert sorted(key(p) for p in full) == sorted(f"a-p{i}" for i in range(10))


@pytest.mark.parametrize("count", [8, 9, 11, 12, 13])
def test_nested_copies(tmp_path, count):
    index = ReplayIndex()
    index.add(1, make_pairs("a", 4), tmp_path)
    out = index.sample("nearest_k", [], sample_size=count, k=1, rng=random.Random(count))
    counts = Counter(key(p) for p in out)
    assert sum(counts.values()) == count and len(counts) == 4
    lo, hi = count // 4, -(-count // 4)
    assert all(lo <= c <= hi for c in counts.values())
    assert sum(c == hi for c in counts.values()) == (count % 4 if count % 4 else 4)


def test_nearest_k_draws_only_recent_shards(tmp_path):
    index = ReplayIndex()
    for it, tag in enumerate("abcd", start=1):
        index.add(it, make_pairs(tag, 3), tmp_path)
    out = index.sample("recent_k", [], sample_size=60, k=2, rng=random.Random(1))
    assert {key(p)[0] for p in out} == {"c", "d"}
    only_newest = index.sample("lambda_decay", [], sample_size=30, lam=0.0, rng=random.Random(1))
    assert {key(p)[0] for p in only_newest} == {"d"}


def test_lambda_weights_respected_statistically(tmp_path):
    index = ReplayIndex()
    for it, tag in enumerate("abc", start=1):
        index.add(it, make_pairs(tag, 5), tmp_path)
    S = 3000
    out = index.sample("lambda_decay", [], sample_size=S, lam=0.8, rng=random.Random(1234))
    freq = Counter(key(p)[0] for p in out)
    assert sum(freq.values()) == S
    for tag, w in zip("abc", (0.262, 0.328, 0.410)):
        assert abs(freq[tag] / S - w) < 0.04
    uniform = index.sample("all_history", [], sample_size=S, rng=random.Random(99))
    freq = Counter(key(p)[0] for p in uniform)
    assert all(abs(freq[t] / S - 1 / 3) < 0.04 for t in "abc")


def test_sampling_is_reproducible_and_shuffled(tmp_path):
    index = ReplayIndex()
    index.add(1, make_pairs("a", 6), tmp_path)
    index.add(2, make_pairs("b", 6), tmp_path)
    a = [key(p) for p in index.sample("all_history", [], sample_size=12, rng=random.Random(5))]
    b = [key(p) for p in index.sample("all_history", [], sample_size=12, rng=random.Random(5))]
    assert a == b
    # the final shuffle interleaves shards (not oldest block then newest block) for some seed
    blocky = lambda names: names == sorted(names, key=lambda n: n[0])  # noqa: E731
    assert any(
        not blocky([key(p) for p in index.sample("all_history", [], sample_size=12, rng=random.Random(s))])
        for s in range(5)
    )


# ---------------------------------------------------------------- iterative selection


def test_e7_comparator_reward():
    assert "comparator_reward" in ITERATIVE_PAIR_SELECTIONS
    assert select_comparison_pairs([3, 1, 2], [1, 2, 2], "comparator_reward", 2) == [(1, False), (0, True)]
    cur, cmp = torch.tensor([3.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 2.0])
    out = select_comparison_pairs(cur, cmp, "Comparator_Reward", 1)
    assert out == [(1, False)]
    typed = select_comparison_pairs([3, 1], [1, 2], "all", None)
    assert typed == [(0, True), (1, False)]
    assert all(isinstance(k, int) and isinstance(w, bool) for k, w in typed)


CUR = [5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 7.0]
CMP = [1.0, 2.0, 4.0, 5.0, 1.0]  # shorter: only k < 5 compared; k = 2 ties
# gaps: k0 +4 (cmp 1), k1 -1 (cmp 2), k3 -3 (cmp 5), k4 +2 (cmp 1)


def test_selection_orders():
    assert select_comparison_pairs(CUR, CMP, "all", None) == [(0, True), (1, False), (3, False), (4, True)]
    assert select_comparison_pairs(CUR, CMP, "reward_gap", None) == [(0, True), (3, False), (4, True), (1, False)]
    assert select_comparison_pairs(CUR, CMP, "reward_gap", 2) == [(0, True), (3, False)]
    # comparator score desc, then |gap| desc: k3 (5), k1 (2), k0 (1, gap 4), k4 (1, gap 2)
    expected = [(3, False), (1, False), (0, True), (4, True)]
    assert select_comparison_pairs(CUR, CMP, "comparator_reward", None) == expected
    # reverse roles: comparator longer
    assert select_comparison_pairs([1.0, 2.0], [0.0, 3.0, 9.0], "all", None) == [(0, True), (1, False)]
    assert select_comparison_pairs([1.0, 2.0], [1.0, 2.0], "reward_gap", 4) == []  # all ties


def test_random_selection():
    def draw(seed, limit):
        return select_comparison_pairs(CUR, CMP, "random", limit, generator=torch.Generator().manual_seed(seed))

    full = draw(0, None)
    assert sorted(full) == [(0, True), (1, False), (3, False), (4, True)]
    assert draw(0, 2) == full[:2] and draw(0, None) == full
    assert any(draw(s, None) != full for s in range(1, 8))


def test_selection_validation():
    with pytest.raises(ValueError, match="pair_selection must be one of: reward_gap, random, all, comparator_reward"):
        select_comparison_pairs([1.0], [0.0], "best", 1)
    with pytest.raises(ValueError, match="preference_pairs_per_sample must be >= 1 or null"):
        select_comparison_pairs([1.0], [0.0], "reward_gap", 0)
    with pytest.raises(ValueError, match="preference_pairs_per_sample must be null when pair_selection='all'"):
        select_comparison_pairs([1.0], [0.0], "all", 2)
    with pytest.raises(ValueError, match="current_scores must be finite"):
        select_comparison_pairs([float("nan")], [0.0], "reward_gap", 1)
    with pytest.raises(ValueError, match="comparator_scores must be 1-D"):
        select_comparison_pairs([1.0], [[0.0]], "reward_gap", 1)
