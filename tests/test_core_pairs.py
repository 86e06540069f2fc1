"""Preference pair selection and the replay record format (docs/algorithms.md#preference-pairs-and-madpo)."""

import json
import math

import pytest
import torch

from comlrl_lightning.core import PAIR_SELECTIONS, RECORD_KEYS, PreferencePair, select_pairs
from comlrl_lightning.runs.files import load_pairs, save_pairs

# Scores of K = 5 joint candidates; candidates 1 and 3 tie (3.0), so {1, 3} is never a pair.
SCORES = [1.0, 3.0, 2.0, 3.0, 0.0]
# Every (w, l) with s_w > s_l, in (winner, loser) lexicographic order: 10 unordered pairs - 1 tie = 9.
ALL_PAIRS = [(0, 4), (1, 0), (1, 2), (1, 4), (2, 0), (2, 4), (3, 0), (3, 2), (3, 4)]
# Gap 3: (1,4),(3,4); gap 2: (1,0),(2,4),(3,0); gap 1: (0,4),(1,2),(2,0),(3,2) -- ties in gap keep lexicographic order.
BY_GAP = [(1, 4), (3, 4), (1, 0), (2, 4), (3, 0), (0, 4), (1, 2), (2, 0), (3, 2)]


def test_selection_names():
    assert set(PAIR_SELECTIONS) == {"reward_gap", "random", "all"}


def test_all_is_lexicographic_and_drops_ties():
    pairs = select_pairs(SCORES, "all", limit=None)
    assert pairs == ALL_PAIRS
    assert (1, 3) not in pairs and (3, 1) not in pairs
    assert all(isinstance(w, int) and isinstance(l, int) for w, l in pairs)


@pytest.mark.parametrize(("limit", "expected"), [(None, BY_GAP), (4, BY_GAP[:4]), (1, [(1, 4)]), (100, BY_GAP)])
def test_reward_gap_order_and_limit(limit, expected):
    assert select_pairs(SCORES, "reward_gap", limit=limit) == expected


def test_default_is_reward_gap_with_limit_16():
    scores = torch.arange(10, dtype=torch.float32)  # 45 candidate pairs
    pairs = select_pairs(scores)
    assert len(pairs) == 16
    assert pairs[0] == (9, 0)  # largest gap first
    assert pairs == select_pairs(scores.tolist(), "reward_gap", 16)


def test_selection_is_case_insensitive_and_accepts_tensors():
    assert select_pairs(torch.tensor(SCORES), "Reward_Gap", limit=3) == BY_GAP[:3]
    assert select_pairs(torch.tensor(SCORES, dtype=torch.float64), "ALL", limit=None) == ALL_PAIRS


def test_random_is_reproducible_subset():
    def draw(seed, limit):
        return select_pairs(SCORES, "random", limit=limit, generator=torch.Generator().manual_seed(seed))

    first = draw(0, 4)
    assert first == draw(0, 4)
    assert len(first) == 4 and len(set(first)) == 4
    assert set(first) <= set(ALL_PAIRS)
    everything = draw(0, None)
    assert sorted(everything) == ALL_PAIRS  # a permutation of all candidates
    assert everything[:4] == first  # the limit truncates the same shuffle
    assert any(draw(seed, None) != everything for seed in range(1, 6))  # actually shuffled


def test_all_ties_give_no_pairs():
    for selection, limit in [("reward_gap", 16), ("random", 16), ("all", None)]:
        assert select_pairs([0.5, 0.5, 0.5, 0.5], selection, limit) == []
    assert select_pairs([1.0], "reward_gap") == []
    assert select_pairs([], "all", None) == []


def test_validation_errors():
    with pytest.raises(ValueError, match="preference_pairs_per_sample must be null when pair_selection='all'."):
        select_pairs(SCORES, "all", limit=4)
    with pytest.raises(ValueError, match=r"pair_selection must be one of: reward_gap, random, all\."):
        select_pairs(SCORES, "comparator_reward", limit=4)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="preference_pairs_per_sample must be >= 1 or null."):
            select_pairs(SCORES, "reward_gap", limit=bad)
    with pytest.raises(ValueError, match="scores must be 1-D"):
        select_pairs(torch.zeros(2, 3), "reward_gap")
    with pytest.raises(ValueError, match="scores must be finite"):
        select_pairs([1.0, math.nan, 0.0], "reward_gap")


def test_k80_keeps_the_largest_gaps():
    generator = torch.Generator().manual_seed(1)
    scores = torch.rand(80, generator=generator, dtype=torch.float64)
    pairs = select_pairs(scores, "reward_gap", 16)
    assert len(pairs) == 16
    assert pairs[0] == (int(scores.argmax()), int(scores.argmin()))
    gaps = [float(scores[w] - scores[l]) for w, l in pairs]
    assert all(g > 0 for g in gaps) and gaps == sorted(gaps, reverse=True)
    all_gaps = sorted((float(scores[w] - scores[l]) for w, l in select_pairs(scores, "all", None)), reverse=True)
    assert len(all_gaps) == 80 * 79 // 2  # distinct scores: every unordered pair once
    assert gaps == pytest.approx(all_gaps[:16])
    assert len(select_pairs(scores, "random", 16, generator=generator)) == 16


# --- PreferencePair records ----------------------------------------------------------------------------------


def make_pair(**overrides):
    fields = dict(
        prompts=["p0", "p1 ü"],
        winner_completions=["w0", "w1"],
        loser_completions=["l0", "l1"],
        winner_reward=2.0,
        loser_reward=0.5,
        candidate_reward_mean=1.25,
    )
    fields.update(overrides)
    return PreferencePair(**fields)


def test_record_keys_and_defaults():
    pair = make_pair()
    assert pair.raw_rewards == [] and pair.target_raw_reward is None and pair.comparator_raw_reward is None
    assert pair.prompt_ids == [] and pair.winner_ids == [] and pair.loser_ids == []
    record = pair.to_record()
    assert tuple(record) == RECORD_KEYS
    assert list(record) == [
        "prompts",
        "winner_completions",
        "loser_completions",
        "winner_reward",
        "loser_reward",
        "candidate_reward_mean",
        "raw_rewards",
        "target_raw_reward",
        "comparator_raw_reward",
    ]
    assert record["raw_rewards"] == [] and record["target_raw_reward"] is None
    assert record["comparator_raw_reward"] is None
    json.dumps(record)  # JSON-ready


def test_record_round_trip_drops_tensors():
    pair = make_pair(
        raw_rewards=[3.0, 1.0],
        target_raw_reward=3.0,
        comparator_raw_reward=1.0,
        prompt_ids=[torch.tensor([1, 2]), torch.tensor([3])],
        winner_ids=[torch.tensor([4, 0]), torch.tensor([5, 0])],
        loser_ids=[torch.tensor([6, 0]), torch.tensor([7, 0])],
    )
    record = pair.to_record()
    assert set(record) == set(RECORD_KEYS)  # tensors are not serialised
    back = PreferencePair.from_record(record)
    assert back.to_record() == record
    assert back.raw_rewards == [3.0, 1.0] and back.target_raw_reward == 3.0 and back.comparator_raw_reward == 1.0
    assert back.prompt_ids == [] and back.winner_ids == [] and back.loser_ids == []


def test_from_record_tolerates_null_optionals_and_rejects_missing_keys():
    record = make_pair().to_record()
    record["raw_rewards"] = None
    del record["comparator_raw_reward"]
    back = PreferencePair.from_record(record)
    assert back.raw_rewards == [] and back.comparator_raw_reward is None
    with pytest.raises(ValueError, match="missing keys: winner_reward"):
        PreferencePair.from_record({k: v for k, v in record.items() if k != "winner_reward"})


def test_agent_lists_must_align():
    with pytest.raises(ValueError, match="one entry per agent"):
        make_pair(loser_completions=["only one"])


def test_save_and_load_pairs(tmp_path):
    pairs = [make_pair(), make_pair(raw_rewards=[1.0, 0.0], target_raw_reward=1.0, comparator_raw_reward=0.0)]
    path = tmp_path / "replay" / "iteration_0001.json"
    assert save_pairs(pairs, path) == path
    payload = json.loads(path.read_text(encoding="utf-8"))
    assert list(payload) == ["num_pairs", "pairs"]
    assert payload["num_pairs"] == 2
    assert [list(r) for r in payload["pairs"]] == [list(RECORD_KEYS)] * 2
    assert payload["pairs"][0]["raw_rewards"] == [] and payload["pairs"][0]["target_raw_reward"] is None
    assert payload["pairs"][1]["raw_rewards"] == [1.0, 0.0]
    assert "p1 ü" in path.read_text(encoding="utf-8")  # ensure_ascii=False, UTF-8
    loaded = load_pairs(path)
    assert [p.to_record() for p in loaded] == [p.to_record() for p in pairs]
    assert all(p.prompt_ids == [] for p in loaded)
    assert sorted(x.name for x in path.parent.iterdir()) == ["iteration_0001.json"]  # no temp files left


def test_save_pairs_metadata_and_empty(tmp_path):
    path = tmp_path / "empty.json"
    save_pairs([], path, metadata={"iteration": 3})
    assert json.loads(path.read_text()) == {"iteration": 3, "num_pairs": 0, "pairs": []}
    assert load_pairs(path) == []


def test_save_pairs_overwrites_atomically_and_cleans_up_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "pairs.json"
    save_pairs([make_pair()], path)
    original = path.read_text()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("comlrl_lightning.runs.files.os.replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_pairs([make_pair(), make_pair()], path)
    assert path.read_text() == original  # old file intact
    assert [x.name for x in tmp_path.iterdir()] == ["pairs.json"]  # temp file removed


def test_load_pairs_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not a preference pair file"):
        load_pairs(bad)
    wrong_count = tmp_path / "count.json"
    wrong_count.write_text(json.dumps({"num_pairs": 2, "pairs": [make_pair().to_record()]}))
    with pytest.raises(ValueError, match="num_pairs is 2"):
        load_pairs(wrong_count)


def test_orphaned_temporary_writes_are_removed_and_nothing_else(tmp_path):
    from comlrl_lightning.runs.files import remove_orphaned_writes, write_json_atomic

    write_json_atomic({"a": 1}, tmp_path / "iteration_0001.json")
    left = [tmp_path / ".iteration_0002.json.k3j2.tmp", tmp_path / ".pairs.json.x9.tmp"]  # a killed writer's files
    for path in left:
        path.write_text('{"half": ')
    (tmp_path / "notes.tmp").write_text("not ours")  # not the writer's pattern
    assert sorted(remove_orphaned_writes(tmp_path, "pairs.json")) == [left[1]]
    assert sorted(remove_orphaned_writes(tmp_path)) == [left[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iteration_0001.json", "notes.tmp"]
