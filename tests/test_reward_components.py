"""Rewards with named components (issue 43): the reward caller, the rollout tree's per-component returns and
credit, their checkpointed state, the field group, and the environments' levels as components.

The tree tests replace ``sample_completions`` with a deterministic fake (as tests/test_rollout.py does) so every
reward, return and credit is known in advance; one test rolls out the offline ``tiny`` model for real.
"""

from __future__ import annotations

import ast
import io
import itertools
import math
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from comlrl_lightning.algorithms.fields import RewardComponentFields
from comlrl_lightning.core.advantages import component_advantages, compute_advantages
from comlrl_lightning.rollout.backends import hf as hf_backend
from comlrl_lightning.rollout.generation import make_backend
from comlrl_lightning.rollout.rewards import RewardCaller, ScaleShift, build_formatters
from comlrl_lightning.rollout.sampling import Completions, SamplingConfig
from comlrl_lightning.rollout.tree import Node, RolloutEngine

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

# ================================================================================ the reward caller


def components_reward(*completions, prompts=None, batch_items=None):
    """Two components per joint action: ``syntax`` = 1 per agent text that contains 'ok', ``tests`` = its length/10."""
    return [
        {"syntax": float(sum("ok" in t for t in texts)), "tests": len(texts[0]) / 10} for texts in zip(*completions)
    ]


def test_mappings_are_summed_and_kept():
    caller = RewardCaller(components_reward)
    out = caller.raw_rewards([["ok", "no!"], ["ok", "ok"]])
    assert out.names == ["syntax", "tests"]
    assert out.components == [[2.0, 0.2], [1.0, 0.3]]
    assert out.values == [2.0 + 0.2, 1.0 + 0.3]
    assert caller.raw([["ok", "no!"], ["ok", "ok"]]) == out.values  # raw: the sums, as a float reward gives
    assert caller([["ok", "no!"], ["ok", "ok"]]) == out.values


def test_the_sum_is_the_mappings_own_sum_exactly_and_the_processor_applies_to_it():
    parts = [{"a": 0.1, "b": 0.2, "c": 0.3}, {"a": 1 / 3, "b": 1 / 7, "c": -0.7}]
    caller = RewardCaller(lambda x: parts, ScaleShift(2.0, -1.0))
    out = caller.raw_rewards([["x", "y"]])
    assert out.values == [sum(p.values()) for p in parts]  # bit for bit: added left to right from 0.0
    assert caller([["x", "y"]]) == [2.0 * sum(p.values()) - 1.0 for p in parts]


def test_a_single_mapping_is_one_joint_action_and_numpy_torch_values_are_numbers():
    caller = RewardCaller(lambda a: {"x": np.float32(0.5), "y": torch.tensor(2.0)})
    out = caller.raw_rewards([["only"]])
    assert out.values == [2.5] and out.names == ["x", "y"] and out.components == [[0.5, 2.0]]


def test_names_in_first_seen_order_any_order_per_joint_action():
    caller = RewardCaller(lambda a: [{"b": 1.0, "a": 2.0}, {"a": 3.0, "b": 4.0}])
    out = caller.raw_rewards([["p", "q"]])
    assert out.names == ["b", "a"] and out.components == [[1.0, 2.0], [4.0, 3.0]] and out.values == [3.0, 7.0]


def test_weights_weigh_the_sum_and_a_missing_name_weighs_one():
    caller = RewardCaller(components_reward, component_weights={"tests": 10.0})
    out = caller.raw_rewards([["ok", "no!"], ["ok", "ok"]])
    assert out.values == [2.0 + 10.0 * 0.2, 1.0 + 10.0 * 0.3]
    assert out.components == [[2.0, 0.2], [1.0, 0.3]]  # the components stay raw
    with pytest.raises(ValueError, match=r"reward_component_weights names \['test'\].*\['syntax', 'tests'\]"):
        RewardCaller(components_reward, component_weights={"test": 1.0}).raw([["ok"], ["ok"]])
    with pytest.raises(ValueError, match="returned plain numbers"):
        RewardCaller(lambda a: [1.0], component_weights={"x": 1.0}).raw([["ok"]])
    for bad in ({"x": "1"}, {"x": math.inf}, {"x": True}, {1: 1.0}, [("x", 1.0)]):
        with pytest.raises(ValueError, match="reward_component_weights"):
            RewardCaller(components_reward, component_weights=bad)


def named_reward(*completions):
    return [{"syntax": 1.0, "tests": 0.5}, {"syntax": 1.0, "test": 0.5}]


def test_mismatched_names_name_the_reward_the_joint_action_and_the_names():
    with pytest.raises(ValueError) as err:
        RewardCaller(named_reward).raw([["a", "b"]])
    message = str(err.value)
    assert "named_reward" in message and "joint action 1" in message
    assert "['syntax', 'test']" in message and "['syntax', 'tests']" in message


@pytest.mark.parametrize(
    "output, error, match",
    [
        ([{"x": 1.0}, 2.0], TypeError, "named components for some joint actions and float 2.0 for joint action 1"),
        ([{"x": "1"}], TypeError, "component 'x' of joint action 0 must be a number"),
        ([{"x": True}], TypeError, "must be a number"),
        ([{"x": math.nan}], ValueError, "non-finite value nan for component 'x' at joint action 0"),
        ([{}], ValueError, "empty mapping"),
        ([{1: 1.0}], TypeError, "component names must be strings"),
    ],
)
def test_bad_components_are_clear_errors(output, error, match):
    with pytest.raises(error, match=match):
        RewardCaller(lambda a: output).raw([["x"] * len(output)])


def test_the_count_is_checked_as_for_floats():
    with pytest.raises(ValueError, match="returned 1 values for 2 joint actions"):
        RewardCaller(lambda a: [{"x": 1.0}]).raw([["x", "y"]])


def test_float_rewards_are_unchanged():
    out = RewardCaller(lambda a: [1.0, 2]).raw_rewards([["x", "y"]])
    assert out.values == [1.0, 2.0] and out.names is None and out.components is None


# ================================================================================ rollout trees (fake sampler)


class Agent:
    def __init__(self, name):
        self.name = name


class FakeSampler:
    """Agent X's k-th sample for prompt p is the text ``"X:p#k"``."""

    def __call__(self, model, tokenizer, prompts, num_samples, sampling, batch_size=None, generation_kwargs=None):
        K, M = num_samples, len(prompts)
        texts = [f"{model.name}:{p}#{k}" for p in prompts for k in range(K)]
        ids = torch.arange(M * K * 3).view(M * K, 3) + 1
        mask = torch.ones(M * K, 3, dtype=torch.bool)
        return Completions([torch.tensor(list(p.encode())) for p in prompts], ids, mask, texts, K)


def parse(text):
    agent, rest = text.split(":", 1)
    prompt, k = rest.rsplit("#", 1)
    return agent, prompt, int(k)


class LevelReward:
    """Components of joint action (k_0, ..., k_{N-1}) at prompt p: ``a`` = 1 + Σ k_i·2^i, ``b`` = depth(p) - k_0,
    ``c`` = 0.25 · len(p); records every call."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *completions):
        self.calls += 1
        out = []
        for texts in zip(*completions):
            parsed = [parse(t) for t in texts]
            ks, prompt = [p[2] for p in parsed], parsed[0][1]
            out.append(
                {
                    "a": 1.0 + sum(k * 2**i for i, k in enumerate(ks)),
                    "b": float(prompt.count(">")) - ks[0],
                    "c": 0.25 * len(prompt),
                }
            )
        return out


def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    ks = "".join(str(parse(c)[2]) for c in agent_completions)
    return [f"{h[-1]}>{ks}" for h in prompt_history_per_agent]


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(hf_backend, "sample_completions", FakeSampler())


def engine(reward, *, N=2, K=2, H=1, joint_mode="aligned", processor=None, weights=None, step=transition, **kw):
    return RolloutEngine(
        num_agents=N,
        formatters=build_formatters(None, N),
        reward=RewardCaller(reward, processor, component_weights=weights),
        sampling=SamplingConfig(max_new_tokens=3),
        backend=make_backend("hf"),
        use_chat_template=False,
        num_generations=K,
        num_turns=H,
        joint_mode=joint_mode,
        external_transition=step if H > 1 else None,
        external_prompt_passthrough=True,
        **kw,
    )


MODELS = [Agent("A"), Agent("B"), Agent("C")]


def check_consistent(node: Node, weights=(1.0, 1.0, 1.0)):
    """The scalar rewards, returns and credit are the weighted sums of their components (no reward_processor)."""
    w = torch.tensor(weights)
    torch.testing.assert_close(node.raw_rewards, node.reward_components @ w)
    torch.testing.assert_close(node.returns, node.component_returns @ w)
    for agent in node.agents:
        torch.testing.assert_close(agent.credit, agent.credit_components @ w)


def test_aligned_single_turn_components_and_credit(fake):
    roll = engine(LevelReward(), K=3).rollout(MODELS[:2], ["t", "t"], [{"prompt": "p"}, {"prompt": "qq"}])
    for root, prompt in zip(roll.roots, ["p", "qq"]):
        assert root.component_names == ["a", "b", "c"]
        # joint action k = (k, k): a = 1 + k + 2k, b = 0 - k, c = 0.25 len(p)
        expected = torch.tensor([[1.0 + 3 * k, -float(k), 0.25 * len(prompt)] for k in range(3)])
        torch.testing.assert_close(root.reward_components, expected)
        torch.testing.assert_close(root.component_returns, expected)  # one turn: the return is the reward
        for agent in root.agents:
            torch.testing.assert_close(agent.credit_components, expected)  # [K, C]: aligned, k-th action's
        check_consistent(root)


def test_multi_turn_recursion_per_component_with_discount(fake):
    reward = LevelReward()
    roll = engine(reward, H=3, discount=0.5).rollout(MODELS[:2], ["t", "t"], [{"prompt": "p"}])
    assert [len(level) for level in roll.levels] == [1, 2, 4] and reward.calls == 3
    for node in roll.nodes:
        check_consistent(node)
        for j in range(node.rewards.shape[0]):
            child = node.children.get(j)
            expected = node.reward_components[j].clone()
            if child is not None:  # G_c = r_c + γ · mean over the child's joint actions of G_c
                expected += 0.5 * child.component_returns.mean(dim=0)
            torch.testing.assert_close(node.component_returns[j], expected)
    # By hand, joint action 0 of the root: r = (1, 0, 0.25); its child "p>00" has r_a = (1, 4), r_b = (1, 0),
    # r_c = 1; that child's children "p>00>00" and "p>00>11" are leaves with a = (1, 4), b = (2, 1), c = 1.75.
    leaf = torch.tensor([2.5, 1.5, 1.75])  # mean over both leaves' joint actions (the same for both leaves)
    child0 = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 1.0]]) + 0.5 * leaf
    torch.testing.assert_close(roll.roots[0].children[0].component_returns, child0)
    torch.testing.assert_close(
        roll.roots[0].component_returns[0], torch.tensor([1.0, 0.0, 0.25]) + 0.5 * child0.mean(dim=0)
    )


@pytest.mark.parametrize("N", [2, 3])
def test_cross_mode_credits_each_component_by_cross_credit(fake, N):
    roll = engine(LevelReward(), N=N, joint_mode="cross", H=2).rollout(MODELS[:N], ["t"] * N, [{"prompt": "p"}])
    root = roll.roots[0]
    combos = list(itertools.product(range(2), repeat=N))
    assert root.joint_index.tolist() == [list(c) for c in combos]
    for node in roll.nodes:
        check_consistent(node)
    # credit_components[i][s, c] = Σ over the joint actions where agent i used sample s of their return of c
    for i, agent in enumerate(root.agents):
        for s in range(2):
            rows = [j for j, combo in enumerate(combos) if combo[i] == s]
            torch.testing.assert_close(agent.credit_components[s], root.component_returns[rows].sum(dim=0))


def test_weights_and_reward_processor(fake):
    weights = {"a": 2.0, "c": -1.0}  # b: 1.0
    roll = engine(LevelReward(), H=2, weights=weights).rollout(MODELS[:2], ["t", "t"], [{"prompt": "p"}])
    for node in roll.nodes:
        check_consistent(node, (2.0, 1.0, -1.0))
    # A reward_processor applies to the (weighted) sum; the components and their returns stay raw.
    roll = engine(LevelReward(), H=2, processor=ScaleShift(3.0, 1.0)).rollout(MODELS[:2], ["t", "t"], [{"prompt": "p"}])
    for node in roll.nodes:
        torch.testing.assert_close(node.raw_rewards, node.reward_components.sum(-1))
        torch.testing.assert_close(node.rewards, 3.0 * node.raw_rewards + 1.0)
        torch.testing.assert_close(node.agents[0].credit_components.sum(-1), node.component_returns.sum(-1))


def test_float_rewards_leave_the_component_fields_empty(fake):
    roll = engine(lambda *c: [1.0] * len(c[0]), H=2).rollout(MODELS[:2], ["t", "t"], [{"prompt": "p"}])
    for node in roll.nodes:
        assert node.reward_components is None and node.component_names is None and node.component_returns is None
        assert all(a.credit_components is None for a in node.agents)


def test_names_changing_between_turns_is_an_error(fake):
    def reward(*completions):
        deep = ">" in parse(completions[0][0])[1]
        return [{"late" if deep else "early": 1.0} for _ in completions[0]]

    with pytest.raises(ValueError, match=r"components \['late'\] at turn 2 but \['early'\] at turn 1"):
        engine(reward, H=2).rollout(MODELS[:2], ["t", "t"], [{"prompt": "p"}])


def test_actor_critic_reward_per_node_keeps_the_team_view(fake):
    def per_agent(*completions):  # one value per agent (N = 2 values for J = 3 joint actions)
        return [{"x": 1.0, "y": 10.0}, {"x": 3.0, "y": 20.0}]

    roll = engine(per_agent, K=3, reward_per_node=True).rollout(MODELS[:2], ["t", "t"], [{"prompt": "p"}])
    root = roll.roots[0]
    torch.testing.assert_close(root.reward_components, torch.tensor([[2.0, 15.0]] * 3))  # mean over agents
    torch.testing.assert_close(root.raw_rewards, torch.tensor([17.0] * 3))
    check_consistent(root, (1.0, 1.0))


def test_state_dict_round_trip_keeps_components(fake):
    roll = engine(LevelReward(), H=2, joint_mode="cross").rollout(MODELS[:2], ["t", "t"], [{"prompt": "p"}])
    for node in roll.nodes:
        buffer = io.BytesIO()
        torch.save(node.state_dict(), buffer)
        buffer.seek(0)
        back = Node.from_state_dict(torch.load(buffer, weights_only=True))  # plain tensors and lists only
        assert back.component_names == node.component_names
        torch.testing.assert_close(back.reward_components, node.reward_components)
        torch.testing.assert_close(back.component_returns, node.component_returns)
        for a, b in zip(back.agents, node.agents):
            torch.testing.assert_close(a.credit_components, b.credit_components)
    # A state saved before components existed still loads (the new fields default to None).
    old = roll.roots[0].state_dict()
    for key in ("reward_components", "component_names", "component_returns"):
        old.pop(key)
    for agent in old["agents"]:
        agent.pop("credit_components")
    back = Node.from_state_dict(old)
    assert back.reward_components is None and back.agents[0].credit_components is None


def test_credit_components_feed_component_advantages(fake):
    """Two components that trade off exactly tie the summed reward of the whole group (zero advantage), while
    normalize_components still ranks the completions."""

    def tradeoff(*completions):
        ks = [parse(t)[2] for t in completions[0]]
        return [{"syntax": float(k), "tests": 3.0 - 2 * k} for k in ks]

    roll = engine(tradeoff, K=3).rollout(MODELS[:2], ["t", "t"], [{"prompt": "p"}])
    agent = roll.roots[0].agents[0]
    torch.testing.assert_close(agent.credit, torch.tensor([3.0, 2.0, 1.0]))
    weights = torch.tensor([2.0, 1.0])  # syntax counts double: the sums tie, 2·syntax + tests = 3
    tied = agent.credit_components @ weights
    torch.testing.assert_close(compute_advantages(tied.unsqueeze(0)), torch.zeros(1, 3))
    s = math.sqrt(1.5)  # syntax [0, 1, 2] -> [-s, 0, s]; tests [3, 1, -1] -> [s, 0, -s]; 2·A_syntax + A_tests
    torch.testing.assert_close(
        component_advantages(agent.credit_components.unsqueeze(0), weights), torch.tensor([[-s, 0.0, s]])
    )


# ================================================================================ a real rollout (tiny model)


def test_tiny_model_rollout_with_components():
    from comlrl_lightning.agents.factories import MODEL_FACTORIES

    model, tok = MODEL_FACTORIES["tiny"]()
    model.eval()

    def reward(a, b):
        return [{"length_a": len(x) / 10, "length_b": len(y) / 10, "same": float(x == y)} for x, y in zip(a, b)]

    torch.manual_seed(0)

    def again(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        return [f"{prompt} {c[:8]}" for c in agent_completions]

    roll = engine(reward, K=3, H=2, joint_mode="cross", step=again).rollout(
        [model, model], [tok, tok], [{"prompt": "hi"}]
    )
    assert [len(level) for level in roll.levels] == [1, 9]
    for node in roll.nodes:
        assert node.component_names == ["length_a", "length_b", "same"]
        assert node.reward_components.shape == (9, 3) and node.component_returns.shape == (9, 3)
        assert all(a.credit_components.shape == (3, 3) for a in node.agents)
        for j, (i0, i1) in enumerate(node.joint_index.tolist()):
            x, y = node.agents[0].texts[i0], node.agents[1].texts[i1]
            torch.testing.assert_close(
                node.reward_components[j], torch.tensor([len(x) / 10, len(y) / 10, x == y]).float()
            )
        check_consistent(node, (1.0, 1.0, 1.0))


# ================================================================================ the field group


def test_reward_component_fields():
    fields = RewardComponentFields()
    assert fields.reward_aggregation == "sum" and fields.reward_component_weights is None
    fields = RewardComponentFields("Normalize_Components", {"tests": 2, "syntax": 0.5})
    assert fields.reward_aggregation == "normalize_components"
    assert fields.reward_component_weights == {"tests": 2.0, "syntax": 0.5}
    with pytest.raises(ValueError, match="reward_aggregation must be one of: sum, normalize_components"):
        RewardComponentFields("gdpo")
    with pytest.raises(ValueError, match=r"reward_component_weights\['x'\] must be a finite number"):
        RewardComponentFields(reward_component_weights={"x": "heavy"})


# ================================================================================ environments: levels as components


def added(components):
    """How the reward caller adds unit-weighted components: left to right from 0.0."""
    total = 0.0
    for value in components.values():
        total += value
    return total


# ---- coding


CHE_FILE = SHARED / "coophumaneval" / "che_raw.json"
MBPP_FILE = SHARED / "mbpp" / "sanitized-mbpp.json"
AUX_PRIME = (
    "def aux(n):\n    if n < 2:\n        return False\n    return all(n % i for i in range(2, int(n ** 0.5) + 1))"
)
MAIN_OK = "def x_or_y(n, x, y):\n    is_prime = aux(n)\n    return x if is_prime else y"


def test_coding_components_sum_to_the_total_over_every_sandbox_outcome():
    """The real breakdown with a stand-in sandbox: every pass ratio p/q (q ≤ 24), with and without a timeout, for
    completions that call aux, wrap it, ignore its result, never call it, or have no aux: the components add up to
    the total exactly, and only level_3 moves (by less than 1e-10)."""
    from comlrl_lightning.envs import coding as C

    item = {"prompt": "def f(x):\n    '''f'''\n", "entry_point": "f", "test": ["assert f(1) == 1"]}
    mains = [
        "def f(x):\n    y = aux(x)\n    return y + 0",
        "def f(x):\n    return aux(x)",
        "def f(x):\n    aux(x)\n    return x",
        "def f(x):\n    return x",
    ]
    pairs = list(itertools.product(["def aux(x):\n    return x", "def helper(x):\n    return x"], mains))

    class Stand(C.CodingReward):
        def run(self, jobs):
            return [self.result] * len(jobs)

    reward = Stand()
    rows = 0
    for total in range(1, 25):
        for passed in range(total + 1):
            for timeouts in (0, 1):
                reward.result = SimpleNamespace(
                    passed=passed, total=total, timeouts=timeouts, errors=[], pass_ratio=passed / total
                )
                for b in reward.breakdown([a for a, _ in pairs], [m for _, m in pairs], [item]):
                    parts = C.reward_components(b)
                    assert list(parts) == list(C.COMPONENTS) and added(parts) == b["total"], b
                    assert all(parts[k] == b[k] for k in C.COMPONENTS if k != "level_3")
                    assert abs(parts["level_3"] - b["level_3"]) < 1e-10
                    rows += 1
    assert rows == sum(q + 1 for q in range(1, 25)) * 2 * len(pairs)


@pytest.mark.skipif(not CHE_FILE.exists(), reason=f"CoopHumanEval data not found at {CHE_FILE}")
def test_coding_reward_components_on_real_items():
    from comlrl_lightning.envs import coding as C

    item = C.coophumaneval_tasks(str(CHE_FILE))[0]
    aux = [AUX_PRIME, "def aux(n):\n    return n % 2 == 1", AUX_PRIME, "garbage", AUX_PRIME]
    main = [
        MAIN_OK,  # 4.5
        MAIN_OK,  # 2 of 5 tests
        "def x_or_y(n, x, y):\n    return y if aux(n) else x",  # no test passes
        MAIN_OK,  # format gate
        "def x_or_y(n, x, y):\n    aux(n)\n    p = n > 1 and all(n % i for i in range(2, n))\n    return x if p else y",
    ]
    reward = C.CodingReward(timeout_per_test=2.0, workers=4, components=True)
    rows = reward.breakdown(aux, main, [item])
    parts = reward(aux, main, batch_items=[item])
    assert [C.reward_components(b) for b in rows] == parts
    assert [added(p) for p in parts] == [b["total"] for b in rows]
    assert [round(added(p), 6) for p in parts] == [4.5, 3.9, 1.5, 0.0, 4.0]
    assert C.coding_reward_components.components and C.coding_reward_components.reward_range == (-0.7, 4.5)
    # Through the reward caller: the team reward is the float coding_reward gives.
    caller = RewardCaller(C.CodingReward(timeout_per_test=2.0, workers=4, components=True))
    assert caller.raw([aux, main], batch_items=[item]) == C.CodingReward(timeout_per_test=2.0, workers=4)(
        aux, main, batch_items=[item]
    )


# ---- ClassEval


CE_FILE = SHARED / "classeval" / "ClassEval_data.json.gz"


def test_classeval_components_sum_to_the_total_over_every_level_combination():
    from comlrl_lightning.envs import classeval as ce

    for q in range(1, 60):
        for p in range(q + 1):
            for syntax, contributed, penalty in itertools.product((0.0, 0.5), (True, False), (0.0, -0.2)):
                tests = 5.0 * (p / q)
                bonus = 0.5 if contributed and p > 0 else 0.0
                row = dict(level_syntax=syntax, level_tests=tests, bonus=bonus, penalty=penalty)
                row["total"] = round(syntax + tests + bonus + penalty, 10)  # as ClassEvalReward.breakdown adds them
                parts = ce.reward_components(row)
                assert list(parts) == list(ce.COMPONENTS) and added(parts) == row["total"], row
                assert all(abs(parts[k] - row[k]) < 1e-10 for k in ce.COMPONENTS)


@pytest.mark.skipif(not CE_FILE.exists(), reason=f"ClassEval data not found at {CE_FILE}")
def test_classeval_reward_components_on_a_real_item():
    from comlrl_lightning.envs import classeval as ce

    item = ce.classeval_tasks(str(CE_FILE))[0]
    cls = next(n for n in ast.parse(item["solution_code"]).body if isinstance(n, ast.ClassDef))
    defs = {f.name: ast.unparse(f) for f in cls.body if isinstance(f, ast.FunctionDef)}
    a0, a1 = ["\n\n".join(defs[m] for m in own) for own in item["agent_methods"]]
    reward = ce.ClassEvalReward(timeout_per_test=5.0, components=True)
    rows = reward.breakdown([a0, "", a0], [a1, a1, ""], batch_items=[item])
    parts = [ce.reward_components(b) for b in rows]
    assert [added(p) for p in parts] == [b["total"] for b in rows]
    assert parts[0] == {"level_syntax": 0.5, "level_tests": 5.0, "penalty": 0.0, "bonus": 0.5}
    assert 0 < rows[1]["pass_ratio"] < 1 and 0 < rows[2]["pass_ratio"] < 1
    assert ce.classeval_reward_components.reward_range == ce.classeval_reward.reward_range


# ---- writing


TLDR_FILE = SHARED / "tldr" / "tldr_sample.jsonl.gz"
ARXIV_FILE = SHARED / "arxiv_abstract" / "scitldr_abstracts.jsonl.gz"


@pytest.mark.skipif(not (TLDR_FILE.exists() and ARXIV_FILE.exists()), reason=f"writing data not found under {SHARED}")
def test_writing_components_sum_to_the_reward_on_real_texts():
    from comlrl_lightning.envs import writing as w

    tldr = w.tldr_tasks(str(TLDR_FILE), limit=40)
    arxiv = w.arxiv_tasks(str(ARXIV_FILE), limit=40)
    rng = random.Random(0)
    post_words = [t["prompt"].split() for t in tldr]
    c1 = [t["completion"] for t in tldr] * 3
    c2 = [" ".join(words[: rng.randint(10, len(words))]) for words in post_words * 3]
    abstracts = [a["abstract_text"] for a in arxiv]
    a1 = [" ".join((abstracts[i] + " " + abstracts[i - 1]).split()[: rng.randint(120, 240)]) for i in range(40)]
    a2 = [" ".join((abstracts[i - 2] + " " + abstracts[i - 3]).split()[: rng.randint(120, 260)]) for i in range(40)]
    full = 0
    for fn, components, x, y in [
        (w.tldr_reward, w.tldr_reward_components, c1, c2),
        (w.arxiv_reward, w.arxiv_reward_components, a1, a2),
    ]:
        totals, parts = fn(x, y), components(x, y)
        assert [added(p) for p in parts] == totals
        assert all(list(p) == ["level_1", "level_2", "level_3", "level_4"] for p in parts)
        assert RewardCaller(components).raw([x, y]) == totals
        full += sum(all(v > 0 for v in p.values()) for p in parts)
        assert components.reward_range == fn.reward_range
    assert full > 0  # some pairs reach every level


# ---- Minecraft


MINECRAFT = SHARED / "minecraft"


@pytest.mark.skipif(not MINECRAFT.exists(), reason=f"Minecraft data not found under {MINECRAFT}")
def test_minecraft_components_sum_to_the_reward_on_real_tasks():
    from comlrl_lightning.envs.minecraft import housebuild as H
    from comlrl_lightning.envs.minecraft import strbuild as S

    rng = random.Random(0)
    for item in S.strbuild_tasks():
        task = S.StrBuildTask.from_item(item)
        palettes = task.palettes(2)
        (x0, y0, z0), (x1, y1, z1) = item["bbox_from"], item["bbox_to"]
        builds = [
            [
                "\n".join(
                    f"/setblock {rng.randint(x0, x1)} {rng.randint(y0, y1)} {rng.randint(z0, z1)} {rng.choice(pal)}"
                    for _ in range(rng.randint(0, 60))
                )
                for pal in palettes
            ]
            for _ in range(12)
        ]
        agents = [[b[0] for b in builds], [b[1] for b in builds]]
        totals = S.strbuild_reward(*agents, batch_items=[item])
        parts = S.strbuild_reward_components(*agents, batch_items=[item])
        assert [added(p) for p in parts] == totals and len(set(totals)) > 3
        assert all(list(p) == ["coverage", "extra", "adjacent", "palette"] for p in parts)
    for item in H.housebuild_tasks():
        task = H.HouseBuildTask.from_item(item)
        (x0, y0, z0), (x1, y1, z1) = item["bbox_from"], item["bbox_to"]
        blocks = sorted(set(task.expected().values()))
        builds = []
        for _ in range(12):
            lines = [["/kill"] if rng.random() < 0.5 else [], []]
            for agent in range(2):
                for _ in range(rng.randint(0, 30)):
                    x, y, z = rng.randint(x0, x1), rng.randint(y0, y1), rng.randint(z0, z1)
                    lines[agent].append(f"/fill {x} {y} {z} {x} {y} {z} {rng.choice(blocks)}")
            builds.append(["\n".join(lines[0]), "\n".join(lines[1])])
        agents = [[b[0] for b in builds], [b[1] for b in builds]]
        totals = H.housebuild_reward(*agents, batch_items=[item])
        parts = H.housebuild_reward_components(*agents, batch_items=[item])
        assert [added(p) for p in parts] == totals and len(set(totals)) > 3
        assert all(list(p) == ["match", "spider_penalty"] for p in parts)
    assert S.strbuild_reward_components.reward_range == S.strbuild_reward.reward_range
    assert H.housebuild_reward_components.reward_range == H.housebuild_reward.reward_range


# ---- centralized collaboration passes the components on


def test_centralized_reward_passes_components_on():
    from comlrl_lightning.rollout.centralized import CentralizedCollaboration, TaggedCentralizedAdapter

    collab = CentralizedCollaboration(TaggedCentralizedAdapter(), build_formatters(None, 2), components_reward, 2)
    joint = ["<agent_0>ok</agent_0><agent_1>no</agent_1>", "<agent_0>nope</agent_0><agent_1>ok</agent_1>"]
    out = collab(joint, batch_items=[{"prompt": "p"}])
    assert out == [{"syntax": 1.0, "tests": 0.2}, {"syntax": 1.0, "tests": 0.4}]
    assert RewardCaller(collab).raw([joint], batch_items=[{"prompt": "p"}]) == [1.2, 1.4]


# ================================================================================ MAGRPO with normalize_components


def tradeoff_reward(*completions, prompts=None, batch_items=None):
    """Three components that trade off, one-hot of the first agent's text length mod 3: their sum is 1.0 for every
    joint action, so the summed reward of any group ties."""
    return [{f"c{r}": float(len(a) % 3 == r) for r in range(3)} for a in completions[0]]


def magrpo(**fields):
    from comlrl_lightning import MAGRPO

    base = dict(
        agents="tiny",
        num_agents=2,
        reward_func=tradeoff_reward,
        num_generations=4,
        max_new_tokens=8,
        rollout_buffer_size=1,
        eval_interval=0,
        log_completions=False,
    )
    return MAGRPO(**{**base, **fields})


def test_magrpo_normalizes_each_component_within_its_group():
    """normalize_components: each component normalised within its group, then weighted; sum: the weighted sum
    normalised as one reward."""
    module = magrpo(reward_aggregation="normalize_components", reward_component_weights={"c0": 3.0})
    torch.manual_seed(0)
    rollout = module.policy.rollout([{"prompt": "a"}, {"prompt": "b"}], policy_version=0, env_step=0)
    nodes = rollout.nodes
    samples = [n.agents[0] for n in nodes]
    assert all(n.component_names == ["c0", "c1", "c2"] for n in nodes)
    expected = component_advantages(torch.stack([s.credit_components for s in samples]), torch.tensor([3.0, 1.0, 1.0]))
    torch.testing.assert_close(module.group_advantages(nodes, samples), expected.float(), check_dtype=False)
    summed = magrpo(reward_component_weights={"c0": 3.0})  # sum: the weighted sums 3·c0 + c1 + c2 rank the group
    credit = torch.stack([s.credit for s in samples])
    torch.testing.assert_close(summed.group_advantages(nodes, samples), compute_advantages(credit))


def test_normalize_components_needs_components_and_a_group():
    from comlrl_lightning import IAC
    from comlrl_lightning.envs import toy

    module = magrpo(reward_aggregation="normalize_components", reward_func=toy.brevity_reward)
    rollout = module.policy.rollout([{"prompt": "a", "topic": "a"}], policy_version=0, env_step=0)
    with pytest.raises(ValueError, match="normalize_components needs a reward that returns named components"):
        module.group_advantages(rollout.nodes, [n.agents[0] for n in rollout.nodes])
    with pytest.raises(ValueError, match="IAC does not have: use the MAGRPO family"):
        IAC(agents="tiny", num_agents=2, reward_func=tradeoff_reward, reward_aggregation="normalize_components")


def test_magrpo_with_normalize_components_fits_and_logs_the_zero_advantage_share(tmp_path):
    import csv

    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from comlrl_lightning.data import TaskDataModule

    rows = {}
    for mode in ("sum", "normalize_components"):
        module = magrpo(reward_aggregation=mode, weight_decay=0.0)  # no decay: only a gradient moves a weight
        before = [p.detach().clone() for p in module.agents.parameters()]
        trainer = Trainer(
            max_steps=2,
            logger=CSVLogger(tmp_path, name=mode),
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=1,
            accelerator="cpu",
        )
        trainer.fit(
            module, datamodule=TaskDataModule(dataset=[{"prompt": f"p{i}"} for i in range(4)], prompts_per_step=2)
        )
        with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
            rows[mode] = [r for r in csv.DictReader(f) if r.get("rollout/zero_advantage_ratio")]
        moved = any(not torch.equal(a, b) for a, b in zip(before, module.agents.parameters()))
        assert moved == (mode == "normalize_components")  # summed: every group ties (1.0 each), nothing moves
    # normalised apart, the components' different spreads rank a group: 1.0 only where a component never varies
    assert rows["sum"] and all(float(r["rollout/zero_advantage_ratio"]) == 1.0 for r in rows["sum"])
    assert rows["normalize_components"]
    assert all(0.0 <= float(r["rollout/zero_advantage_ratio"]) <= 1.0 for r in rows["normalize_components"])
