"""User-code adapters of ``comlrl_lightning.rollout.rewards``
(docs/algorithms.md#formatters-rewards-and-transitions)."""

from __future__ import annotations

import functools
import math
import pickle

import numpy as np
import pytest
import torch

from comlrl_lightning.rollout.rewards import (
    RewardCaller,
    RewardProcessors,
    ScaleShift,
    build_formatters,
    call_external_transition,
    default_formatter,
    format_prompt,
)

C0 = ["a0", "a1", "a2"]
C1 = ["b0", "b1", "b2"]
PROMPTS = ["p", "p", "q"]
ITEMS = [{"prompt": "p"}, {"prompt": "p"}, {"prompt": "q"}]


# --------------------------------------------------------------------------- RewardCaller


class TestRewardCallerKwargs:
    def test_plain_signature_gets_only_positional_lists(self):
        seen = {}

        def reward(c0, c1):
            seen["args"] = (c0, c1)
            return [1.0, 2.0, 3.0]

        out = RewardCaller(reward).raw([C0, C1], prompts=PROMPTS, batch_items=ITEMS)
        assert out == [1.0, 2.0, 3.0]
        assert seen["args"] == (C0, C1)
        assert all(isinstance(a, list) for a in seen["args"])

    def test_named_prompts_only(self):
        seen = {}

        def reward(c0, c1, prompts=None):
            seen["prompts"] = prompts
            return [0.0] * len(c0)

        RewardCaller(reward).raw([C0, C1], prompts=PROMPTS, batch_items=ITEMS)
        assert seen["prompts"] == PROMPTS

    def test_named_batch_items_only(self):
        seen = {}

        def reward(c0, c1, batch_items=None):
            seen["items"] = batch_items
            return [0.0] * len(c0)

        RewardCaller(reward).raw([C0, C1], prompts=PROMPTS, batch_items=ITEMS)
        assert seen["items"] == ITEMS

    def test_var_kwargs_gets_both(self):
        seen = {}

        def reward(*completions, **kwargs):
            seen["completions"] = completions
            seen["kwargs"] = kwargs
            return [0.0] * len(completions[0])

        RewardCaller(reward).raw([C0, C1], prompts=PROMPTS, batch_items=ITEMS)
        assert seen["completions"] == (C0, C1)
        assert seen["kwargs"] == {"prompts": PROMPTS, "batch_items": ITEMS}

    def test_none_values_are_not_passed(self):
        seen = {}

        def reward(c0, c1, **kwargs):
            seen["kwargs"] = kwargs
            return [0.0] * len(c0)

        RewardCaller(reward).raw([C0, C1])
        assert seen["kwargs"] == {}

    def test_keyword_only_parameters_detected(self):
        seen = {}

        def reward(*completions, batch_items, prompts):
            seen["both"] = (prompts, batch_items)
            return [0.0] * len(completions[0])

        RewardCaller(reward).raw([C0, C1], prompts=PROMPTS, batch_items=ITEMS)
        assert seen["both"] == (PROMPTS, ITEMS)

    def test_partial_and_callable_object(self):
        def reward(c0, c1, bonus, prompts=None):
            assert prompts == PROMPTS
            return [bonus] * len(c0)

        assert RewardCaller(functools.partial(reward, bonus=2.5)).raw([C0, C1], prompts=PROMPTS) == [2.5] * 3

        class Reward:
            def __call__(self, c0, batch_items=None):
                return [float(len(batch_items))] * len(c0)

        assert RewardCaller(Reward()).raw([C0], batch_items=ITEMS) == [3.0] * 3

    def test_single_agent_and_three_agents(self):
        assert RewardCaller(lambda c: [len(x) for x in c]).raw([["x", "yy"]]) == [1.0, 2.0]
        r = RewardCaller(lambda a, b, c: [float(x + y + z == "abc") for x, y, z in zip(a, b, c)])
        assert r.raw([["a", "x"], ["b", "b"], ["c", "c"]]) == [1.0, 0.0]


class TestRewardCallerValues:
    def test_wrong_count_names_both_counts(self):
        with pytest.raises(ValueError, match=r"returned 2 values for 3 joint actions"):
            RewardCaller(lambda a, b: [1.0, 2.0]).raw([C0, C1])
        with pytest.raises(ValueError, match=r"returned 4 values for 3 joint actions"):
            RewardCaller(lambda a, b: [1.0] * 4).raw([C0, C1])

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
    def test_non_finite_rejected(self, bad):
        with pytest.raises(ValueError, match="non-finite"):
            RewardCaller(lambda a, b: [0.0, bad, 1.0]).raw([C0, C1])

    @pytest.mark.parametrize(
        "value",
        [
            torch.tensor([1.0, 2.0, 3.0]),
            torch.tensor([1, 2, 3]),
            np.array([1.0, 2.0, 3.0]),
            np.array([1, 2, 3], dtype=np.int64),
            (1, 2, 3),
            [np.float32(1), torch.tensor(2.0), 3],
        ],
        ids=["torch-float", "torch-int", "numpy-float", "numpy-int", "tuple", "mixed-scalars"],
    )
    def test_sequence_coercion(self, value):
        out = RewardCaller(lambda a, b: value).raw([C0, C1])
        assert out == [1.0, 2.0, 3.0]
        assert all(type(v) is float for v in out)

    @pytest.mark.parametrize("value", [2, 2.0, torch.tensor(2.0), np.float64(2.0), np.array(2.0)])
    def test_scalar_coercion_for_one_joint_action(self, value):
        out = RewardCaller(lambda a: value).raw([["only"]])
        assert out == [2.0] and type(out[0]) is float

    @pytest.mark.parametrize("value", [1.0, {"r": 1.0}])  # a mapping is ONE joint action's named components
    def test_scalar_for_many_joint_actions_is_count_error(self, value):
        with pytest.raises(ValueError, match="returned 1 values for 3 joint actions"):
            RewardCaller(lambda a: value).raw([C0])

    @pytest.mark.parametrize(
        "value",
        ["1.0", None, ["x", "y", "z"], ["1.0", "0.5", "2"], [True, False, True], True, [1.0, None, 2.0]],
    )
    def test_non_numeric_return_is_type_error(self, value):
        """Strings and booleans are rejected, not converted ("1.0" -> 1.0, True -> 1.0 would hide a bug)."""
        with pytest.raises(TypeError, match="reward_func must return a list of (floats|numbers)"):
            RewardCaller(lambda a: value).raw([C0])

    def test_numpy_and_torch_numbers_are_numbers(self):
        import numpy as np

        assert RewardCaller(lambda a: [np.float32(1.5), np.int64(2), torch.tensor(0.25)]).raw([C0]) == [1.5, 2.0, 0.25]

    def test_a_hung_reward_fails_with_the_field_and_the_step(self):
        import threading

        release = threading.Event()
        caller = RewardCaller(lambda a: release.wait(30) and [1.0] * 3, timeout=0.2, where=lambda: "update 7")
        with pytest.raises(TimeoutError, match=r"reward_timeout = 0.2 s at update 7"):
            caller.raw([C0])
        release.set()
        assert RewardCaller(lambda a: [1.0] * 3, timeout=5).raw([C0]) == [1.0] * 3
        with pytest.raises(ZeroDivisionError):  # the reward's own error still surfaces as itself
            RewardCaller(lambda a: 1 / 0, timeout=5).raw([C0])

    @pytest.mark.parametrize(
        "reward,agents", [(lambda a: [1.0], 2), (lambda a, b, c: [1.0], 2), (lambda *, prompts: [1.0], 1)]
    )
    def test_a_reward_with_the_wrong_signature_shows_the_expected_one(self, reward, agents):
        from comlrl_lightning.rollout.rewards import check_reward_signature

        with pytest.raises(
            TypeError,
            match=r"cannot take the completions of \d agents.*expected signature is "
            r"reward_func\(\*agent_completions, prompts=None, batch_items=None, response_history_per_agent=None\)",
        ):
            check_reward_signature(reward, agents)

    def test_reward_processor_applied_by_process_and_call_not_raw(self):
        caller = RewardCaller(lambda a, b: [1.0, 2.0, 3.0], reward_processor=lambda x: 10 * x - 1)
        assert caller.raw([C0, C1]) == [1.0, 2.0, 3.0]
        assert caller.process([1.0, 2.0, 3.0]) == [9.0, 19.0, 29.0]
        assert caller([C0, C1]) == [9.0, 19.0, 29.0]
        assert RewardCaller(lambda a, b: [1.0, 2.0, 3.0])([C0, C1]) == [1.0, 2.0, 3.0]

    def test_reward_processor_non_finite_rejected(self):
        caller = RewardCaller(lambda a: [1.0, 0.0, 2.0], reward_processor=lambda x: math.log(x) if x else -math.inf)
        with pytest.raises(ValueError, match="reward_processor returned a non-finite"):
            caller([C0])

    @pytest.mark.parametrize("func", [None, "reward", 3, [lambda a: a]])
    def test_non_callable_reward_func(self, func):
        with pytest.raises(ValueError, match="reward_func must be a callable"):
            RewardCaller(func)

    def test_non_callable_processor(self):
        with pytest.raises(ValueError, match="reward_processor must be a callable"):
            RewardCaller(lambda a: [0.0], reward_processor=2.0)


# --------------------------------------------------------------------------- formatters


class TestBuildFormatters:
    def test_none_gives_default(self):
        fs = build_formatters(None, 3)
        assert len(fs) == 3
        for f in fs:
            assert f({"prompt": "hello"}) == "hello"
            assert f({"prompt": "hello"}, external_prompts="ext") == "ext"
            assert f({}) == ""
        assert default_formatter({"prompt": 7}) == "7"

    def test_single_callable_broadcast(self):
        calls = []

        def fmt(item):
            calls.append(item)
            return "Q: " + item["prompt"]

        fs = build_formatters(fmt, 3)
        assert len(fs) == 3
        assert [f({"prompt": "x"}) for f in fs] == ["Q: x"] * 3
        assert len(calls) == 3

    def test_one_element_list_broadcast(self):
        fs = build_formatters([lambda item: item["prompt"].upper()], 2)
        assert [f({"prompt": "ab"}) for f in fs] == ["AB", "AB"]

    def test_per_agent_list_keeps_order(self):
        fs = build_formatters([lambda it: "A" + it["prompt"], lambda it: "B" + it["prompt"]], 2)
        assert [f({"prompt": "x"}) for f in fs] == ["Ax", "Bx"]

    @pytest.mark.parametrize("count", [2, 4])
    def test_wrong_count(self, count):
        with pytest.raises(ValueError, match="formatters"):
            build_formatters([lambda it: "x"] * count, 3)

    @pytest.mark.parametrize("bad", ["not callable", 5, [lambda it: "x", "nope"]])
    def test_invalid_types(self, bad):
        with pytest.raises(ValueError, match="formatters"):
            build_formatters(bad, 2)

    @pytest.mark.parametrize("ret", [None, 3, ["x"], b"bytes"])
    def test_non_str_return_is_type_error(self, ret):
        (f,) = build_formatters(lambda item: ret, 1)
        with pytest.raises(TypeError, match="Formatter must return a string prompt. formatter .* returned"):
            f({"prompt": "x"})

    def test_a_missing_key_names_the_formatter_the_item_and_the_key(self):
        def topic_prompt(item):
            return f"Write about {item['topic']}."

        (f,) = build_formatters(topic_prompt, 1)
        with pytest.raises(
            KeyError,
            match=r"formatter .*topic_prompt needs the key 'topic', which the dataset item "
            r"\{'prompt': 'cats'\} does not have \(its keys: \['prompt'\]\)",
        ):
            f({"prompt": "cats"})

    def test_external_prompts_param_only_when_not_none(self):
        calls = []

        def fmt(item, external_prompts=None):
            calls.append(("kw" if external_prompts is not None else "plain", external_prompts))
            return external_prompts or item["prompt"]

        (f,) = build_formatters(fmt, 1)
        assert f({"prompt": "x"}) == "x"
        assert f({"prompt": "x"}, external_prompts=None) == "x"
        assert f({"prompt": "x"}, external_prompts="ext") == "ext"
        assert calls == [("plain", None), ("plain", None), ("kw", "ext")]

    def test_external_prompts_required_keyword_never_called_with_none(self):
        # A formatter that cannot be called without it proves the None case calls f(item).
        def fmt(item, *, external_prompts):
            return f"{item['prompt']}|{external_prompts}"

        (f,) = build_formatters(fmt, 1)
        assert f({"prompt": "x"}, external_prompts="e") == "x|e"
        with pytest.raises(TypeError):
            f({"prompt": "x"})

    def test_formatter_without_param_ignores_external(self):
        (f,) = build_formatters(lambda item: "F" + item["prompt"], 1)
        assert f({"prompt": "x"}, external_prompts="ext") == "Fx"


class TestFormatPrompt:
    def test_first_turn_formats_item(self):
        (f,) = build_formatters(lambda item: "F[" + item["prompt"] + "]", 1)
        assert format_prompt(f, {"prompt": "x"}, None, passthrough=True) == "F[x]"
        assert format_prompt(f, {"prompt": "x"}, None, passthrough=False) == "F[x]"

    def test_passthrough_returns_external_verbatim(self):
        def fmt(item):
            raise AssertionError("formatter must be bypassed")

        (f,) = build_formatters(fmt, 1)
        assert format_prompt(f, {"prompt": "x"}, "  raw\nnext prompt ", passthrough=True) == "  raw\nnext prompt "

    def test_non_passthrough_formats_copy_with_prompt_replaced(self):
        seen = []

        def fmt(item):
            seen.append(dict(item))
            return "F[" + item["prompt"] + "]"

        (f,) = build_formatters(fmt, 1)
        item = {"prompt": "orig", "tests": [1]}
        assert format_prompt(f, item, "ext", passthrough=False) == "F[ext]"
        assert seen == [{"prompt": "ext", "tests": [1], "_original_prompt": "orig"}]
        assert item == {"prompt": "orig", "tests": [1]}  # untouched

    def test_non_passthrough_passes_external_prompts_when_accepted(self):
        def fmt(item, external_prompts=None):
            return f"{item['prompt']}/{item['_original_prompt']}/{external_prompts}"

        (f,) = build_formatters(fmt, 1)
        assert format_prompt(f, {"prompt": "orig"}, "ext", passthrough=False) == "ext/orig/ext"

    def test_original_prompt_kept_from_first_turn(self):
        (f,) = build_formatters(lambda item: item["_original_prompt"] + ">" + item["prompt"], 1)
        item = {"prompt": "turn2", "_original_prompt": "turn1"}
        assert format_prompt(f, item, "turn3", passthrough=False) == "turn1>turn3"

    def test_default_formatter_non_passthrough_yields_external(self):
        (f,) = build_formatters(None, 1)
        assert format_prompt(f, {"prompt": "orig"}, "ext", passthrough=False) == "ext"

    @pytest.mark.parametrize("passthrough", [True, False])
    def test_non_str_external_prompt(self, passthrough):
        (f,) = build_formatters(None, 1)
        with pytest.raises(TypeError, match="External prompt must be a string"):
            format_prompt(f, {"prompt": "x"}, ["ext"], passthrough=passthrough)


# --------------------------------------------------------------------------- external transition

TRANSITION_KW = dict(
    prompt="raw prompt",
    agent_completions=("c0", "c1"),
    num_agents=2,
    prompt_history_per_agent=[["p0"], ["p1"]],
    response_history_per_agent=[("c0",), ("c1",)],
)


class TestExternalTransition:
    def test_called_with_exactly_the_documented_keywords(self):
        seen = {}

        def transition(*args, **kwargs):
            seen["args"], seen["kwargs"] = args, kwargs
            return ("n0", "n1")

        out = call_external_transition(transition, **TRANSITION_KW)
        assert out == ["n0", "n1"] and isinstance(out, list)
        assert seen["args"] == ()
        assert seen["kwargs"] == {
            "prompt": "raw prompt",
            "agent_completions": ["c0", "c1"],
            "num_agents": 2,
            "prompt_history_per_agent": [["p0"], ["p1"]],
            "response_history_per_agent": [["c0"], ["c1"]],
        }

    def test_reference_signature_works(self):
        def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
            return [f"{prompt}|{c}|{len(h)}" for c, h in zip(agent_completions, prompt_history_per_agent)]

        assert call_external_transition(transition, **TRANSITION_KW) == ["raw prompt|c0|1", "raw prompt|c1|1"]

    def test_histories_are_copies(self):
        hist = [["p0"], ["p1"]]

        def transition(**kw):
            kw["prompt_history_per_agent"][0].append("mutated")
            return ["a", "b"]

        call_external_transition(transition, **{**TRANSITION_KW, "prompt_history_per_agent": hist})
        assert hist == [["p0"], ["p1"]]

    @pytest.mark.parametrize("ret", ["one string", None, {"a": 1}, 3])
    def test_non_list_return(self, ret):
        with pytest.raises(ValueError, match="External transition must return per-agent prompts"):
            call_external_transition(lambda **kw: ret, **TRANSITION_KW)

    @pytest.mark.parametrize("ret", [["only"], ["a", "b", "c"], []])
    def test_wrong_count(self, ret):
        with pytest.raises(ValueError, match=rf"returned {len(ret)} values but expected 2"):
            call_external_transition(lambda **kw: ret, **TRANSITION_KW)


# --------------------------------------------------------------------------- processors


class TestRewardProcessors:
    def test_identity(self):
        f = RewardProcessors.identity()
        assert [f(x) for x in (-3.5, 0.0, 7)] == [-3.5, 0.0, 7]

    def test_clamp(self):
        f = RewardProcessors.clamp(-1.0, 2.0)
        assert [f(x) for x in (-5, -1, 0.5, 2, 9)] == [-1.0, -1, 0.5, 2, 2.0]
        g = RewardProcessors.clamp()
        assert [g(x) for x in (-100, 3, 100)] == [-10.0, 3, 10.0]

    def test_scale_and_shift(self):
        assert RewardProcessors.scale(3.0)(2.0) == 6.0
        assert RewardProcessors.scale()(2.5) == 2.5
        assert RewardProcessors.shift(-4.0)(1.0) == -3.0
        assert RewardProcessors.shift()(1.5) == 1.5

    def test_sigmoid_scale(self):
        f = RewardProcessors.sigmoid_scale()
        assert f(0.0) == 0.5
        assert f(2.0) == pytest.approx(1 / (1 + math.exp(-2.0)))
        assert f(-2.0) == pytest.approx(1 - f(2.0))

    def test_exponential_scale_sign_symmetric(self):
        f = RewardProcessors.exponential_scale(2.0)
        assert f(0.0) == 0.0
        assert f(1.0) == pytest.approx(math.exp(2.0) - 1)
        assert f(-1.0) == pytest.approx(-(math.exp(2.0) - 1))
        assert RewardProcessors.exponential_scale()(0.5) == pytest.approx(math.exp(0.5) - 1)

    def test_scale_shift_numbers_and_pickle(self):
        f = ScaleShift(scale=2.0, shift=-1.0)
        assert [f(x) for x in (0.0, 1.0, 3.0, -2.0)] == [-1.0, 1.0, 5.0, -5.0]
        assert ScaleShift()(4.25) == 4.25
        g = pickle.loads(pickle.dumps(f))
        assert g(3.0) == 5.0

    def test_processor_through_caller(self):
        caller = RewardCaller(lambda a: [0.0, 1.0, 3.0], reward_processor=ScaleShift(0.5, -4.0))
        assert caller([C0]) == [-4.0, -3.5, -2.5]
