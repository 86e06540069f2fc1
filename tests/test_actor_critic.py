"""IAC and MAAC end to end on tiny models (docs/algorithms.md#actor-critic): fit of every critic layout, TD(0)
targets and returns of multi-turn rollouts, advantages, reward-length expansion, the MAAC critic text, the
gradient of the documented objective, value clipping, export, validation, learning, metrics callback, resume."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from test_magrpo import ITEMS, column, fit, read_metrics

from comlrl_lightning import IAC, MAAC, TaskDataModule
from comlrl_lightning.agents import CausalLMWithValueHead
from comlrl_lightning.agents.factories import MODEL_FACTORIES
from comlrl_lightning.algorithms import actor_critic
from comlrl_lightning.algorithms.actor_critic import AgentStep, JointSample
from comlrl_lightning.algorithms.team import agent_groups
from comlrl_lightning.envs import toy


def make_ac(cls=IAC, **overrides):
    """A tiny two-agent module; separate critics (IAC default, MAAC always) are tiny models too."""
    kwargs = dict(
        agents="tiny",
        num_agents=2,
        reward_func=toy.brevity_reward,
        num_generations=2,
        max_new_tokens=5,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        rollout_buffer_size=4,
        agent_learning_rate=1e-3,
        critic_learning_rate=1e-3,
        eval_interval=0,
        log_completions=False,
    )
    kwargs.update(overrides)
    if cls is MAAC or kwargs.get("use_separate_critic", True):
        kwargs.setdefault("critic_model", "tiny")
    seed_everything(0)  # value heads are initialised from the global RNG
    return cls(**kwargs)


def actor_params(module):
    """Actor weights only (the value head on a shared-backbone actor is the critic)."""
    return [p for agent in module.agents for name, p in agent.named_parameters() if not name.startswith("value_head")]


def critic_params(module):
    if module.use_separate_critic:
        return list(module.critics.parameters())
    return [p for agent in module.agents for p in agent.value_head.parameters()]


def collect(module, items):
    """The joint samples of one rollout of ``items`` (what the buffer receives)."""
    return module.records(module.collect_rollout(items))


def params_of_list(params):
    return [p.detach().clone() for p in params]


def changed(before, after):
    return any(not torch.equal(a, b) for a, b in zip(before, after))


def grads_of(model):
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------------------------- fit
VARIANTS = {
    "iac-head": (IAC, {"use_separate_critic": False}),
    "iac-v": (IAC, {"critic_type": "v"}),
    "iac-q": (IAC, {"critic_type": "q"}),
    "maac-v": (MAAC, {"critic_type": "v"}),
    "maac-q": (MAAC, {"critic_type": "q"}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_critic_layout_fits(variant, tmp_path, monkeypatch):
    cls, overrides = VARIANTS[variant]
    clip_ranges = []
    original_value_loss = actor_critic.value_loss

    def spy_value_loss(values, targets, old_values=None, clip_range=None):
        clip_ranges.append(clip_range)
        return original_value_loss(values, targets, old_values, clip_range)

    monkeypatch.setattr(actor_critic, "value_loss", spy_value_loss)
    module = make_ac(cls, eval_interval=1, eval_num_samples=2, **overrides)
    expected_critics = {"iac-head": 0, "iac-v": 2, "iac-q": 2, "maac-v": 1, "maac-q": 1}[variant]
    assert len(module.critics) == expected_critics
    if variant == "iac-head":
        assert all(isinstance(a, CausalLMWithValueHead) and a.has_value_head for a in module.agents)
    actors, critics = params_of_list(actor_params(module)), params_of_list(critic_params(module))
    assert actors and critics
    trainer = fit(module, tmp_path, max_steps=2, eval_items=ITEMS[:2])
    assert trainer.global_step == 2  # 2 prompts x K=2 = 4 joint samples = rollout_buffer_size: one update per step
    assert changed(actors, actor_params(module)), "actor weights did not change"
    assert changed(critics, critic_params(module)), "critic weights did not change"
    # Value clipping only for the value head on the actor; every update computes a value loss.
    assert clip_ranges and set(clip_ranges) == ({0.2} if variant == "iac-head" else {None})
    rows = read_metrics(trainer)
    assert column(rows, "env_step")[-1] == 8.0
    for key in (
        "turn_1/value_pred_mean",
        "turn_1/value_target_mean",
        "turn_1/policy_loss",
        "turn_1/value_loss",
        "turn_1/reward_mean",
        "turn_1/expected_return",
        "loss",
        "eval/turn_1/value_pred_mean",
        "eval/turn_1/value_target_mean",
        "eval/turn_1/reward_mean",
    ):
        values = column(rows, key)
        assert values and all(v == v for v in values), key  # logged and not NaN
    assert len(column(rows, "turn_1/policy_loss")) == 2
    assert all(v >= 0 for v in column(rows, "turn_1/value_loss"))
    # single turn: the value target is the (brevity) reward, in [0, 1]
    assert all(0.0 <= v <= 1.0 for v in column(rows, "turn_1/value_target_mean"))


# ----------------------------------------------------------------------------------------------- multi-turn
def parity_reward(a, b, batch_items):
    """Brevity plus +1 for even items, -2 for odd ones: with threshold 0.5 even items stop after turn 1."""
    bonus = 1.0 if int(batch_items[0]["prompt"].split()[-1]) % 2 == 0 else -2.0
    return [r + bonus for r in toy.brevity_reward(a, b)]


def test_multi_turn_td_targets_returns_and_env_steps():
    module = make_ac(IAC, num_turns=2, num_generations=1, external_transition=toy.revise_transition, discount=0.5)
    items = ITEMS[:3]
    steps = collect(module, items)
    assert len(steps) == 6 and module.env_step == 6  # executed turns (joint actions) per item
    assert [s.env_step for s in steps] == [1, 2, 3, 4, 5, 6]
    by = {(s.metadata["item_index"], s.turn): s for s in steps}
    for b, item in enumerate(items):
        first, second = by[(b, 0)], by[(b, 1)]
        expected_prompts = toy.revise_transition(
            prompt=item["prompt"],
            agent_completions=[a.completion for a in first.agents],
            num_agents=2,
            prompt_history_per_agent=[[a.prompt] for a in first.agents],
            response_history_per_agent=[[a.completion] for a in first.agents],
        )
        assert [a.prompt for a in second.agents] == expected_prompts
        for i in range(2):
            a1, a2 = first.agents[i], second.agents[i]
            assert a1.reward == a1.environment_reward and a2.reward == a2.environment_reward  # no KL
            assert a1.value_target == pytest.approx(a1.reward + 0.5 * a2.old_value, abs=1e-6)
            assert a2.value_target == pytest.approx(a2.reward, abs=1e-6)
            assert a1.returns == pytest.approx(a1.reward + 0.5 * a2.reward, abs=1e-6)
            assert a2.returns == pytest.approx(a2.reward, abs=1e-6)
            # V_old(h_2) is agent i's critic at the last token of its turn-2 prompt
            critic = module.critics[i].eval()
            with torch.no_grad():
                expected_v = float(critic.values_at(a2.prompt_ids[None])[0])
            assert a2.old_value == pytest.approx(expected_v, abs=1e-5)
            assert a1.old_value != a2.old_value


def test_multi_turn_early_termination_per_item():
    module = make_ac(
        IAC,
        num_turns=2,
        num_generations=1,
        external_transition=toy.revise_transition,
        discount=0.5,
        reward_func=parity_reward,
        early_termination_threshold=0.5,
    )
    items = ITEMS[:4]  # topics 0 and 2 stop after turn 1 (reward >= 1 > 0.5); 1 and 3 play both turns
    steps = collect(module, items)
    assert sorted((s.metadata["item_index"], s.turn) for s in steps) == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0), (3, 1)]
    assert module.env_step == 6
    by = {(s.metadata["item_index"], s.turn): s for s in steps}
    for b in (0, 2):  # terminated: no bootstrap
        for a in by[(b, 0)].agents:
            assert a.value_target == pytest.approx(a.reward) and a.returns == pytest.approx(a.reward)
            assert a.reward >= 1.0
    for b in (1, 3):
        for a1, a2 in zip(by[(b, 0)].agents, by[(b, 1)].agents):
            assert a1.value_target == pytest.approx(a1.reward + 0.5 * a2.old_value, abs=1e-6)
            assert a2.value_target == pytest.approx(a2.reward, abs=1e-6)


def test_multi_turn_threshold_below_every_reward_gives_only_first_turn():
    module = make_ac(
        MAAC,
        num_turns=2,
        num_generations=1,
        external_transition=toy.revise_transition,
        early_termination_threshold=-1.0,
    )
    steps = collect(module, ITEMS[:3])
    assert len(steps) == 3 and {s.turn for s in steps} == {0} and module.env_step == 3
    for s in steps:
        assert all(a.value_target == pytest.approx(a.reward) for a in s.agents)
        assert s.joint_target == pytest.approx(sum(a.value_target for a in s.agents) / 2)
        assert all(a.old_value == s.joint_old_value for a in s.agents)  # one joint value shared by the agents


def test_maac_multi_turn_joint_values_and_targets():
    module = make_ac(
        MAAC,
        num_turns=2,
        num_generations=1,
        external_transition=toy.revise_transition,
        discount=0.8,
        reward_func=lambda a, b: [0.3, 0.9],
    )  # one reward per agent
    steps = collect(module, ITEMS[:2])
    by = {(s.metadata["item_index"], s.turn): s for s in steps}
    for b in range(2):
        first, second = by[(b, 0)], by[(b, 1)]
        assert [a.environment_reward for a in first.agents] == pytest.approx([0.3, 0.9])
        for a1, a2 in zip(first.agents, second.agents):
            assert a1.value_target == pytest.approx(a1.reward + 0.8 * second.joint_old_value, abs=1e-6)
            assert a2.value_target == pytest.approx(a2.reward, abs=1e-6)
        assert first.joint_target == pytest.approx((0.3 + 0.9) / 2 + 0.8 * second.joint_old_value, abs=1e-6)
        assert second.joint_target == pytest.approx(0.6, abs=1e-6)


# ----------------------------------------------------------------------------------------------- advantages
def test_single_turn_advantages_are_normalised_per_agent():
    module = make_ac(IAC, critic_type="q")  # Q(h, a): values differ between the K samples of one prompt
    steps = collect(module, ITEMS[:2])
    assert len(steps) == 4 and module.env_step == 4
    module.prepare_group(steps)
    for i in range(2):
        rows = [s.agents[i] for s in steps]
        targets = torch.tensor([a.value_target for a in rows], dtype=torch.float64)
        old = torch.tensor([a.old_value for a in rows], dtype=torch.float64)
        rewards = [toy.brevity_reward([s.agents[0].completion], [s.agents[1].completion])[0] for s in steps]
        assert targets.tolist() == pytest.approx(rewards, abs=1e-6)  # single turn: target = r
        # Q values: agent i's critic at the last completion token (EOS included) of prompt + completion
        critic = module.critics[i].eval()
        for a in rows:
            length = int(a.completion_mask.sum())
            ids = torch.cat([a.prompt_ids, a.completion_ids[:length]])[None]
            assert a.old_value == pytest.approx(float(critic.values_at(ids)[0].detach()), abs=1e-5)
        raw = targets - old
        normalized = (raw - raw.mean()) / raw.std(unbiased=False).clamp_min(1e-6)
        assert [a.advantage for a in rows] == pytest.approx(raw.tolist(), abs=1e-5)
        assert [a.normalized_advantage for a in rows] == pytest.approx(normalized.tolist(), abs=1e-4)
    module.advantage_normalization = False
    module.prepare_group(steps)
    for s in steps:
        for a in s.agents:
            assert a.normalized_advantage == pytest.approx(a.value_target - a.old_value, abs=1e-6)


# ----------------------------------------------------------------------------------------------- reward lengths
@pytest.mark.parametrize(
    "returned,expected",
    [
        ([0.5], [[0.5] * 3, [0.5] * 3]),  # one team reward
        ([0.1, 0.2, 0.3], [[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]]),  # one per joint sample (K = 3)
        ([0.7, -0.4], [[0.7] * 3, [-0.4] * 3]),  # one per agent (N = 2)
    ],
    ids=["one", "per-sample", "per-agent"],
)
def test_reward_lengths_expand_per_agent(returned, expected):
    calls = []

    def reward(a, b):
        calls.append((len(a), len(b)))
        return list(returned)

    module = make_ac(
        IAC, use_separate_critic=False, num_generations=3, reward_func=reward, reward_processor=lambda x: 2 * x
    )
    steps = collect(module, ITEMS[:1])
    assert calls == [(3, 3)]  # one call per item with all K completions of every agent
    got = [[s.agents[i].environment_reward for s in sorted(steps, key=lambda s: s.generation_idx)] for i in range(2)]
    torch.testing.assert_close(torch.tensor(got), 2 * torch.tensor(expected))


def test_reward_of_another_length_is_an_error():
    module = make_ac(IAC, use_separate_critic=False, num_generations=3, reward_func=lambda a, b: [0.1] * 4)
    with pytest.raises(
        ValueError, match=re.escape("Reward function must return 1 value, num_generations values, or num_agents values")
    ):
        collect(module, ITEMS[:1])


# ----------------------------------------------------------------------------------------------- MAAC critic text
@pytest.mark.parametrize("critic_type", ["v", "q"])
def test_maac_critic_text(critic_type):
    module = make_ac(MAAC, critic_type=critic_type)
    assert module.joint_critic_text(["p0", "p1"], None) == "[Agent 0] p0\n\n[Agent 1] p1"
    assert module.joint_critic_text(["p0", "p1"], ["c0", "c1"]) == (
        "[Agent 0] p0\n\n[Agent 1] p1\n\n[Joint Action]\n\n[Agent 0 action]\nc0\n\n[Agent 1 action]\nc1"
    )
    steps = collect(module, ITEMS[:2])
    tok = module.tokenizers[0]
    critic = module.critics[0].eval()
    for s in steps:
        prompts = [a.prompt for a in s.agents]
        completions = [a.completion for a in s.agents] if critic_type == "q" else None
        text = module.joint_critic_text(prompts, completions)
        assert tok.decode(s.critic_ids) == text
        assert s.critic_ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
        value = float(critic.values_at(s.critic_ids[None])[0].detach())  # value at the last token of the joint text
        assert s.joint_old_value == pytest.approx(value, abs=1e-5)
        assert all(a.old_value == s.joint_old_value for a in s.agents)
    if critic_type == "v":  # V(h) ignores the completions: both samples of one item share the value
        by_item = {}
        for s in steps:
            by_item.setdefault(s.metadata["item_index"], set()).add(round(s.joint_old_value, 6))
        assert all(len(v) == 1 for v in by_item.values())


# ----------------------------------------------------------------------------------------------- gradients
def test_iac_gradient_matches_documented_objective(tmp_path):
    """Actor i: mean_rows(-Â · Σ_t log π(y_t)) (seq_sum, tokens up to and including EOS); critic i:
    value_loss_coef · mean((target − V(prompt))²), V at the last prompt token — each computed one sequence at a
    time without padding, from independently recomputed rewards, old values and advantages."""
    module = make_ac(IAC, critic_type="v", rollout_buffer_size=4, max_new_tokens=5, value_loss_coef=0.6)
    assert len(agent_groups(module.agents)) == 2
    captured = {}
    update = module.update

    def spy_update(steps):
        if "steps" not in captured:
            captured["steps"] = list(steps)
            captured["agents"] = copy.deepcopy(module.agents)
            captured["critics"] = copy.deepcopy(module.critics)
        return update(steps)

    class Grab(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if "actor_grads" not in captured:
                captured["actor_grads"] = [grads_of(a) for a in pl_module.agents]
                captured["critic_grads"] = [grads_of(c) for c in pl_module.critics]

    module.update = spy_update
    fit(module, tmp_path, max_steps=1, callbacks=[Grab()])
    steps = captured["steps"]
    assert len(steps) == 4
    for i in range(2):
        agent, critic = captured["agents"][i], captured["critics"][i]
        rows = [s.agents[i] for s in steps]
        # the critic's rollout-time values, targets (= brevity reward) and normalised advantages, by hand
        with torch.no_grad():
            old = torch.stack([critic.values_at(a.prompt_ids[None])[0] for a in rows]).double()
        assert old.tolist() == pytest.approx([a.old_value for a in rows], abs=1e-5)
        targets = torch.tensor(
            [toy.brevity_reward([s.agents[0].completion], [s.agents[1].completion])[0] for s in steps],
            dtype=torch.float64,
        )
        raw = targets - old
        advantages = ((raw - raw.mean()) / raw.std(unbiased=False).clamp_min(1e-6)).float()
        assert advantages.tolist() == pytest.approx([a.normalized_advantage for a in rows], abs=1e-4)
        # actor
        agent.zero_grad()
        logps = []
        for a in rows:
            length = int(a.completion_mask.sum())
            assert length >= 1
            ids = torch.cat([a.prompt_ids, a.completion_ids[:length]])[None]
            logits = agent(input_ids=ids).logits[0, len(a.prompt_ids) - 1 : -1].float()
            logps.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(a.prompt_ids) :, None]).sum())
        (-(advantages * torch.stack(logps))).mean().backward()
        for expected, got in zip(grads_of(agent), captured["actor_grads"][i]):
            scale = float(expected.abs().max()) + 1e-12
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)
        # critic
        critic.zero_grad()
        values = torch.stack([critic.values_at(a.prompt_ids[None])[0] for a in rows])
        (0.6 * (targets.float() - values).square().mean()).backward()
        assert any(g.abs().sum() > 0 for g in captured["critic_grads"][i])
        for expected, got in zip(grads_of(critic), captured["critic_grads"][i]):
            scale = float(expected.abs().max()) + 1e-12
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)


# ----------------------------------------------------------------------------------------------- value clipping
def test_value_clipping_only_for_the_value_head_on_the_actor():
    assert make_ac(IAC, use_separate_critic=False, value_clip_range=0.2).value_clip_range == 0.2
    assert make_ac(IAC, use_separate_critic=False, value_clip_range=None).value_clip_range is None
    assert make_ac(IAC, value_clip_range=0.2).value_clip_range is None
    assert make_ac(MAAC, value_clip_range=0.2).value_clip_range is None


# ----------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("variant", ["iac-head", "iac-v", "maac-q"])
def test_save_pretrained_round_trip_of_critics(variant, tmp_path):
    cls, overrides = VARIANTS[variant]
    module = make_ac(cls, value_head_hidden_dim=4, critic_value_head_hidden_dim=8, **overrides)
    if variant == "iac-head":
        in_memory, where = module.agents[0], tmp_path / "agent_0"
    elif variant == "iac-v":
        in_memory, where = module.critics[1], tmp_path / "agent_1" / "critic"
    else:
        in_memory, where = module.critics[0], tmp_path / "critic"
    with torch.no_grad():  # make the head distinct from any fresh initialisation
        in_memory.value_head[-1].bias.fill_(0.37)
    module.save_pretrained(tmp_path)
    loaded = CausalLMWithValueHead.from_pretrained(where).eval()
    assert loaded.value_head.hidden_dim == (4 if variant == "iac-head" else 8)
    ids = torch.tensor([[5, 17, 33, 2, 9], [7, 7, 40, 41, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.values_at(ids), in_memory.eval().values_at(ids))
        torch.testing.assert_close(loaded(input_ids=ids).values, in_memory(input_ids=ids).values)
    for i in range(2):
        assert (tmp_path / f"agent_{i}" / "config.json").is_file()


# ----------------------------------------------------------------------------------------------- validation
BASE = dict(agents="tiny", num_agents=2, reward_func=toy.brevity_reward, critic_model="tiny")


@pytest.mark.parametrize(
    "cls,overrides,message",
    [
        (IAC, {"num_generations": 0}, "num_generations must be >= 1."),
        (
            IAC,
            {"num_turns": 2, "num_generations": 2, "external_transition": toy.revise_transition},
            "Multi-turn IAC currently supports num_generations == 1.",
        ),
        (
            MAAC,
            {"num_turns": 2, "num_generations": 2, "external_transition": toy.revise_transition},
            "Multi-turn MAAC currently supports num_generations == 1.",
        ),
        (IAC, {"num_turns": 2}, "Multi-turn IAC requires an external_transition."),
        (MAAC, {"num_turns": 2}, "Multi-turn MAAC requires an external_transition."),
        (IAC, {"critic_type": "w"}, "critic_type must be one of: v, q (got 'w')."),
        (MAAC, {"critic_type": "w"}, "critic_type must be one of: v, q (got 'w')."),
        (
            IAC,
            {"use_separate_critic": False, "critic_model": None, "critics": ["tiny", "tiny"]},
            "critics can only be provided when use_separate_critic=True.",
        ),
        (IAC, {"critic_model": None}, "Either critic_model or critics must be provided when use_separate_critic=True."),
        (MAAC, {"critic_model": None}, "Either critic_model or critics must be provided for MAAC."),
        (MAAC, {"critic_model": None, "critics": ["tiny", "tiny"]}, "critics length (2) must match 1 critic for MAAC."),
        (IAC, {"critic_model": None, "critics": ["tiny"]}, "critics length (1) must match the number of agents (2)."),
        (
            IAC,
            {"num_agents": None, "critic_model": None, "critics": ["tiny"] * 3},
            "critics length (3) must match the number of agents (2).",
        ),
        (IAC, {"parallel_training": "mp"}, "parallel_training='mp' requires explicit agent_devices."),
        (MAAC, {"parallel_training": "mp"}, "parallel_training='mp' requires explicit agent_devices."),
        (IAC, {"value_loss_coef": 0.0}, "value_loss_coef must be > 0."),
        (IAC, {"value_clip_range": 0.0}, "value_clip_range must be > 0 or null."),
        (IAC, {"critic_learning_rate": 0.0}, "critic_learning_rate must be > 0 or null."),
        (
            IAC,
            {"parallel_training": "mp", "agent_devices": ["cpu", "cpu"]},
            "parallel_training='mp' requires explicit critic_devices.",
        ),
        (
            MAAC,
            {"parallel_training": "mp", "agent_devices": ["cpu", "cpu"]},
            "parallel_training='mp' requires explicit critic_devices.",
        ),
        (IAC, {"reward_func": None}, "reward_func must be a callable"),
        (MAAC, {"reward_func": None}, "reward_func must be a callable"),
    ],
)
def test_bad_config_fails_before_any_model_loads(cls, overrides, message, monkeypatch):
    def must_not_load(**_):
        raise AssertionError("a model was loaded before validation finished")

    monkeypatch.setitem(MODEL_FACTORIES, "tiny", must_not_load)
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**{**BASE, **overrides})


@pytest.mark.parametrize(
    "cls,overrides,message",
    [
        (IAC, {"critic_model": "./no/such/critic"}, "critic_model = './no/such/critic' looks like a local path"),
        (
            IAC,
            {"critic_model": None, "critics": ["tiny", "./no/such/critic"]},
            "critics[1] = './no/such/critic' looks like a local path",
        ),
        (MAAC, {"critic_model": "./no/such/critic"}, "critic_model = './no/such/critic' looks like a local path"),
    ],
)
def test_a_critic_that_cannot_be_loaded_is_named_by_its_field(cls, overrides, message, monkeypatch):
    def must_not_load(**_):
        raise AssertionError("a model was loaded before validation finished")

    monkeypatch.setitem(MODEL_FACTORIES, "tiny", must_not_load)
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        cls(**{**BASE, **overrides})


# ----------------------------------------------------------------------------------------------- metrics callback
def test_metrics_callback_gets_agent_steps_and_is_logged(tmp_path):
    received = []

    def metrics_callback(rollouts):
        received.append(list(rollouts))
        return {"my_metric": sum(r.reward for r in rollouts) / len(rollouts) + 100.0}

    module = make_ac(IAC, use_separate_critic=False, metrics_callback=metrics_callback)
    trainer = fit(module, tmp_path, max_steps=2)
    rows = read_metrics(trainer)
    logged, rewards = column(rows, "turn_1/my_metric"), column(rows, "turn_1/reward_mean")
    assert len(logged) == 2 and logged == pytest.approx([r + 100.0 for r in rewards], abs=1e-5)
    assert len(received) == 2
    for rollouts in received:
        assert len(rollouts) == 8  # 4 joint samples x 2 agents
        assert {r.agent_idx for r in rollouts} == {0, 1}
        for r in rollouts:
            assert isinstance(r, AgentStep)
            assert isinstance(r.prompt, str) and r.prompt.startswith("topic ") and isinstance(r.completion, str)
            for name in ("reward", "old_value", "value_target", "returns"):
                assert isinstance(getattr(r, name), float), name
            assert r.value_target == r.returns == r.reward  # single turn


# ----------------------------------------------------------------------------------------------- resume
def assert_same_steps(a: list[JointSample], b: list[JointSample]):
    def same(x, y, where):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x, y), where
        elif isinstance(x, dict):
            assert isinstance(y, dict) and x.keys() == y.keys(), where
            for k in x:
                same(x[k], y[k], f"{where}.{k}")
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), where
            for n, (u, v) in enumerate(zip(x, y)):
                same(u, v, f"{where}[{n}]")
        else:
            assert x == y, where

    assert len(a) == len(b) and a
    for n, (x, y) in enumerate(zip(a, b)):
        assert isinstance(y, JointSample) and all(isinstance(s, AgentStep) for s in y.agents)
        same(x.state_dict(), y.state_dict(), f"step{n}")


def test_resume_restores_samples_waiting_in_the_buffer(tmp_path):
    """rollout_buffer_size 8 > 2 prompts x K=2: after batch 0 four joint samples wait; a checkpoint taken there
    carries them, they round-trip through weights_only loading, and the resumed run trains exactly as the
    uninterrupted one."""
    saved = {}
    ckpt = tmp_path / "mid.ckpt"

    class SaveWhileWaiting(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if pl_module.buffer and "buffer" not in saved:
                saved["buffer"] = copy.deepcopy(pl_module.buffer)
                saved["env_step"] = pl_module.env_step
                trainer.save_checkpoint(ckpt)

    class SeeStart(Callback):
        def on_train_start(self, trainer, pl_module):
            saved["restored"] = copy.deepcopy(pl_module.buffer)
            saved["restored_env_step"] = pl_module.env_step

    def run(root, callbacks, ckpt_path=None):
        module = make_ac(IAC, use_separate_critic=False, rollout_buffer_size=8)
        updates = []
        update = module.update
        module.update = lambda steps: (updates.append(sorted(s.env_step for s in steps)), update(steps))[1]
        seed_everything(0)
        trainer = Trainer(
            max_steps=1,
            logger=CSVLogger(root, name="run"),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            enable_checkpointing=False,
            callbacks=callbacks,
            accelerator="cpu",
            devices=1,
        )
        trainer.fit(
            module, datamodule=TaskDataModule(dataset=ITEMS, prompts_per_step=2, shuffle=True), ckpt_path=ckpt_path
        )
        return module, updates

    full, full_updates = run(tmp_path / "full", [SaveWhileWaiting()])
    assert saved["env_step"] == 4 and len(saved["buffer"]) == 4
    assert full_updates == [[1, 2, 3, 4, 5, 6, 7, 8]]
    # the checkpoint's buffer loads with weights_only and rebuilds equal JointSamples
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert_same_steps(saved["buffer"], [JointSample.from_state_dict(s) for s in state["comlrl_lightning"]["buffer"]])
    assert_same_steps(saved["buffer"], [JointSample.from_state_dict(s.state_dict()) for s in saved["buffer"]])
    resumed, resumed_updates = run(tmp_path / "resumed", [SeeStart()], ckpt_path=str(ckpt))
    assert_same_steps(saved["buffer"], saved["restored"])
    assert saved["restored_env_step"] == 4
    assert resumed_updates == full_updates  # the waiting samples are trained on after the resume
    assert resumed.env_step == full.env_step == 8
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("cls", [IAC, MAAC])
def test_agents_on_distinct_devices_sample_concurrently(cls, tmp_path, monkeypatch):
    """parallel_training: mp with agents on two devices: their generate calls overlap in time, one thread each
    (as the MAGRPO engine does). "cpu" and "cpu:0" stand in for two devices."""
    import threading
    import time

    import comlrl_lightning.rollout.backends.hf as generation

    calls, original = [], generation.sample_completions

    def slow_sample(*args, **kwargs):
        start = time.monotonic()
        time.sleep(0.2)  # long enough that sequential calls could not overlap
        out = original(*args, **kwargs)
        calls.append((threading.get_ident(), start, time.monotonic()))
        return out

    monkeypatch.setattr(generation, "sample_completions", slow_sample)
    module = make_ac(
        cls,
        parallel_training="mp",
        agent_devices=["cpu", "cpu:0"],
        critic_devices=["cpu"] * 2 if cls is IAC else ["cpu"],
    )
    fit(module, tmp_path, max_steps=1)
    (t0, s0, e0), (t1, s1, e1) = calls[:2]
    assert t0 != t1 and s0 < e1 and s1 < e0  # two threads, overlapping intervals


def test_maac_rejects_a_reward_list_one_short(tmp_path):
    """MAAC with K (=3) joint actions: a reward returning N (=2) values is one short of K, an error; IAC reads it as
    one reward per agent (CoMLRL's per-agent form), and so does MAAC with K = 1 (multi-turn)."""
    short = lambda a, b: [1.0, 0.0]  # noqa: E731
    with pytest.raises(ValueError, match="one value per joint action"):
        collect(make_ac(MAAC, reward_func=short, num_generations=3), ITEMS[:1])
    steps = collect(make_ac(IAC, reward_func=short, num_generations=3, use_separate_critic=False), ITEMS[:1])
    assert [a.environment_reward for a in steps[0].agents] == [1.0, 0.0]


@pytest.mark.parametrize(
    "cls,overrides",
    [
        (IAC, {"agent_devices": ["cpu", "cuda:1"]}),
        (IAC, {"critic_devices": ["cpu", "cuda:1"]}),
        (MAAC, {"agent_devices": "cpu", "critic_devices": ["cuda:1"]}),
    ],
)
def test_devices_without_mp_place_the_whole_team_on_the_first_one_as_comlrl(cls, overrides, tmp_path):
    """Without ``parallel_training: mp``, CoMLRL puts actors and critics on ONE device: the first of agent_devices,
    else of critic_devices (these used to be refused). The team is moved there when the fit starts (the second
    entries name a device this machine lacks: they are never used)."""
    from lightning.pytorch import Trainer

    from comlrl_lightning.algorithms.team import check_strategy
    from comlrl_lightning.config_errors import ConfigurationError

    module = make_ac(cls, **overrides)
    cpu = torch.device("cpu")
    assert module.team.devices == [cpu, cpu] and module.critic_placement == [cpu] * len(module.critics)
    moved = []
    for model in [*module.agents, *module.critics]:
        model.to = lambda device, original=model.to: (moved.append(str(device)), original(device))[1]
    assert fit(module, tmp_path, max_steps=1).global_step == 1
    assert moved == ["cpu"] * (2 + len(module.critics))
    ddp = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    with pytest.raises(ConfigurationError, match="place the whole team on ONE device .* runs 2 processes"):
        check_strategy(ddp, module)


def test_agent_devices_empty_with_mp_is_a_message_not_a_crash(monkeypatch):
    monkeypatch.setitem(MODEL_FACTORIES, "tiny", lambda **_: pytest.fail("a model was loaded before validation"))
    with pytest.raises(ValueError, match=re.escape("agent_devices must be a non-empty list or 'auto'.")):
        IAC(**{**BASE, "parallel_training": "mp", "agent_devices": [], "critic_devices": ["cpu"]})


# ----------------------------------------------------------------------------------------------- reference KL
@pytest.mark.parametrize("variant", ["iac-head", "iac-v", "maac-q"])
def test_reference_kl_fits_and_shapes_the_reward(variant, tmp_path):
    """reference_kl_enabled: the frozen copies score every sampled completion; r' = r − β·KL is what the critics
    learn (IAC/MAAC used to crash on the first rollout: ``agent_inputs`` was overridden with its arguments
    swapped)."""
    cls, overrides = VARIANTS[variant]
    module = make_ac(cls, reference_kl_enabled=True, reference_kl_coef=0.5, **overrides)
    actors = params_of_list(actor_params(module))
    trainer = fit(module, tmp_path, max_steps=1)
    assert trainer.global_step == 1 and changed(actors, actor_params(module))
    rows = read_metrics(trainer)
    kl = column(rows, "turn_1/reference_kl_mean")
    assert kl and all(v == v and v >= -1e-6 for v in kl)  # logged, finite (k3 >= 0)
    node = module.last_rollout.nodes[0]
    assert node.agents[0].sequence_kl is not None
    expected = node.agent_rewards - 0.5 * torch.stack([a.sequence_kl for a in node.agents])
    torch.testing.assert_close(node.shaped_rewards, expected)
