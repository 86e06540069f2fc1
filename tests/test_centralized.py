"""Centralized adapters and the one-actor collaboration wrapper (docs/iterative.md#centralized-collaboration)."""

from __future__ import annotations

import pytest

from comlrl_lightning.rollout.centralized import (
    CentralizedCollaboration,
    CentralizedComparatorParseError,
    CentralizedParseError,
    TaggedCentralizedAdapter,
    check_adapter,
    joint_prompt,
    split_joint,
)
from comlrl_lightning.rollout.rewards import build_formatters

ITEM = {"prompt": "task"}


class FixedAdapter:
    """Returns whatever parse result it was built with."""

    def __init__(self, result, prompt="joint"):
        self.result, self.prompt = result, prompt

    def build_prompt(self, item, prompts):
        return self.prompt

    def parse_completion(self, text, item, num_agents):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


# --------------------------------------------------------------------------- tagged adapter


def test_tagged_prompt_lists_roles_and_sections():
    p = TaggedCentralizedAdapter().build_prompt(ITEM, ["write A", "write B", "write C"])
    assert "centralized coordinator" in p
    assert "Agent 0 original prompt:\nwrite A" in p
    assert "Agent 2 original prompt:\nwrite C" in p
    assert "<agent_2>" in p and "</agent_2>" in p
    assert "<agent_3>" not in p
    assert "auxiliary" not in p.lower()
    assert p.index("write A") < p.index("write B") < p.index("write C") < p.index("<agent_0>")


def test_tagged_parse_basic():
    text = "<agent_0>a</agent_0><agent_1>b</agent_1><agent_2>c</agent_2>"
    assert TaggedCentralizedAdapter().parse_completion(text, ITEM, 3) == ["a", "b", "c"]


def test_tagged_parse_tolerates_whitespace_case_newlines():
    text = "intro\n< AGENT_0 >\n  first\nline two \n</ agent_0>\n<agent_1 >second</Agent_1 > trailing"
    assert TaggedCentralizedAdapter().parse_completion(text, ITEM, 2) == ["first\nline two", "second"]


def test_tagged_parse_missing_middle_and_first_duplicate_wins():
    text = "<agent_0>x</agent_0><agent_2>z</agent_2><agent_0>again</agent_0>"
    assert TaggedCentralizedAdapter().parse_completion(text, ITEM, 3) == ["x", "", "z"]


def test_tagged_parse_does_not_confuse_agent_1_with_agent_10():
    text = "<agent_10>ten</agent_10><agent_1>one</agent_1>"
    assert TaggedCentralizedAdapter().parse_completion(text, ITEM, 2) == ["", "one"]


def test_tagged_parse_plain_text_raises():
    with pytest.raises(CentralizedParseError):
        TaggedCentralizedAdapter().parse_completion("just some prose", ITEM, 2)
    assert CentralizedComparatorParseError is CentralizedParseError
    assert issubclass(CentralizedParseError, ValueError)


# --------------------------------------------------------------------------- validation helpers


def test_split_joint_wrong_count():
    with pytest.raises(ValueError, match="exactly 2 outputs; got 3"):
        split_joint(FixedAdapter(["a", "b", "c"]), "t", ITEM, 2)


def test_split_joint_single_string():
    with pytest.raises(TypeError, match="not a single string"):
        split_joint(FixedAdapter("ab"), "t", ITEM, 2)


def test_split_joint_non_string_entries():
    with pytest.raises(TypeError, match="must all be strings"):
        split_joint(FixedAdapter(["a", 3]), "t", ITEM, 2)


def test_split_joint_parse_error_modes():
    adapter = FixedAdapter(CentralizedParseError("no tags"))
    with pytest.raises(CentralizedParseError, match="no tags"):
        split_joint(adapter, "t", ITEM, 3)
    assert split_joint(adapter, "t", ITEM, 3, on_parse_error="empty") == ["", "", ""]
    with pytest.raises(ValueError, match="on_parse_error"):
        split_joint(adapter, "t", ITEM, 3, on_parse_error="ignore")


def test_split_joint_passes_through_valid_tuple():
    assert split_joint(FixedAdapter(("a", "b")), "t", ITEM, 2) == ["a", "b"]


def test_check_adapter_errors():
    class NoBuild:
        def parse_completion(self, text, item, n):
            return []

    class NoParse:
        build_prompt = staticmethod(lambda item, prompts: "x")
        parse_completion = "not callable"

    with pytest.raises(TypeError, match=r"^my_adapter\.build_prompt must be callable\.$"):
        check_adapter(NoBuild(), name="my_adapter")
    with pytest.raises(TypeError, match=r"^centralized_adapter\.parse_completion must be callable\.$"):
        check_adapter(NoParse())
    adapter = TaggedCentralizedAdapter()
    assert check_adapter(adapter) is adapter


def test_joint_prompt_rejects_empty():
    with pytest.raises(ValueError, match="non-empty prompt"):
        joint_prompt(FixedAdapter([], prompt=""), ITEM, ["a"])
    with pytest.raises(ValueError, match="non-empty prompt"):
        joint_prompt(FixedAdapter([], prompt=None), ITEM, ["a"])
    assert joint_prompt(FixedAdapter([], prompt="ok"), ITEM, ["a"]) == "ok"


# --------------------------------------------------------------------------- collaboration wrapper


def make_reward(calls):
    def reward(a0, a1, prompts=None, batch_items=None):
        calls.append((list(a0), list(a1), prompts, batch_items))
        return [float(x == "good") + float(y == "good") for x, y in zip(a0, a1)]

    reward.reward_range = (0, 2)
    return reward


def make_collab(calls, n=2):
    formatters = build_formatters([lambda item: "A:" + item["prompt"], lambda item: "B:" + item["prompt"]], n)
    return CentralizedCollaboration(TaggedCentralizedAdapter(), formatters, make_reward(calls), n)


def test_collaboration_formatter_builds_joint_prompt():
    collab = make_collab([])
    p = collab.formatter({"prompt": "sort"})
    assert "Agent 0 original prompt:\nA:sort" in p
    assert "Agent 1 original prompt:\nB:sort" in p
    assert "<agent_1>" in p
    assert collab.formatter({"prompt": "sort"}, external_prompts="ignored") == p


def test_collaboration_reward_single():
    calls = []
    collab = make_collab(calls)
    out = collab(["<agent_0>good</agent_0><agent_1>bad</agent_1>"], batch_items=[{"prompt": "p"}])
    assert out == [1.0]
    assert calls == [(["good"], ["bad"], ["A:p"], [{"prompt": "p"}])]
    assert collab.parse_failures == 0


def test_collaboration_reward_batched_once_with_parse_failure():
    calls = []
    collab = make_collab(calls)
    items = [{"prompt": "p"}, {"prompt": "q"}, {"prompt": "r"}]
    texts = [
        "<agent_0>good</agent_0><agent_1>good</agent_1>",
        "no tags at all",
        "<agent_1>good</agent_1>",
    ]
    assert collab(texts, batch_items=items) == [2.0, 0.0, 1.0]
    assert len(calls) == 1
    a0, a1, prompts, batch_items = calls[0]
    assert a0 == ["good", "", ""] and a1 == ["good", "", "good"]
    assert prompts == ["A:p", "A:q", "A:r"] and batch_items == items
    assert collab.parse_failures == 1
    collab(["plain"], batch_items=[{"prompt": "p"}])
    assert collab.parse_failures == 2 and len(calls) == 2


def test_collaboration_broadcasts_one_item():
    calls = []
    collab = make_collab(calls)
    texts = ["<agent_0>good</agent_0>", "<agent_1>good</agent_1><agent_0>good</agent_0>"]
    assert collab(texts, batch_items=[{"prompt": "x"}]) == [1.0, 2.0]
    assert calls[0][3] == [{"prompt": "x"}, {"prompt": "x"}]
    assert calls[0][2] == ["A:x", "A:x"]


def test_collaboration_requires_aligned_batch_items():
    collab = make_collab([])
    with pytest.raises(ValueError, match="require batch_items"):
        collab(["<agent_0>good</agent_0>"])
    with pytest.raises(ValueError, match="must align with batch_items"):
        collab(["a", "b", "c"], batch_items=[{"prompt": "p"}, {"prompt": "q"}])


def test_collaboration_reward_range_and_repr():
    collab = make_collab([])
    assert collab.reward_range == (0, 2)
    assert "num_roles=2" in repr(collab) and "reward" in repr(collab)

    formatters = build_formatters(None, 2)
    plain = CentralizedCollaboration(TaggedCentralizedAdapter(), formatters, lambda a, b: [0.0] * len(a), 2)
    assert not hasattr(plain, "reward_range")


def test_collaboration_rejects_bad_setup():
    formatters = build_formatters(None, 2)
    with pytest.raises(ValueError, match="1 formatters for 2 roles"):
        CentralizedCollaboration(TaggedCentralizedAdapter(), formatters[:1], make_reward([]), 2)
    with pytest.raises(TypeError, match="build_prompt must be callable"):
        CentralizedCollaboration(object(), formatters, make_reward([]), 2)


def test_split_roles_shape():
    collab = make_collab([])
    texts = ["<agent_0>a</agent_0><agent_1>b</agent_1>", "garbage", "<agent_1>d</agent_1>"]
    roles = collab.split_roles(texts, [{"prompt": "p"}])
    assert roles == [["a", "", ""], ["b", "", "d"]]
    assert collab.parse_failures == 0
