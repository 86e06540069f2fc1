"""LoRA teams: ONE frozen base in memory, one peft adapter per agent (agents/lora.py, docs/scaling.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_madpo import fit_madpo, make_madpo
from test_magrpo import ITEMS, fit, make_module

from comlrl_lightning.envs import toy

IDS = torch.tensor([[5, 17, 42, 9, 3, 11]])


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_base_is_held_once_and_each_agent_trains_only_its_adapter(tmp_path):
    full = make_module(num_agents=4)
    lora = make_module(num_agents=4, lora_rank=4)
    base = sum(p.numel() for p in full.agents[0].parameters())
    adapters = [sum(p.numel() for p in lora.agents[i].trainable_parameters()) for i in range(4)]
    total = sum(p.numel() for p in lora.parameters())  # shared modules counted once
    assert total == base + sum(adapters) and max(adapters) < base / 4
    assert sum(p.numel() for p in full.parameters()) == 4 * base
    before = {n: p.detach().clone() for n, p in lora.agents[0].team.base.named_parameters() if "lora_" not in n}
    adapters_before = [[p.detach().clone() for p in lora.agents[i].trainable_parameters()] for i in range(4)]
    fit(lora, tmp_path, max_steps=2)
    groups = lora.optimizers().optimizer.param_groups
    assert [len(g["params"]) for g in groups] == [len(lora.agents[i].trainable_parameters()) for i in range(4)]
    assert len({id(p) for g in groups for p in g["params"]}) == sum(len(g["params"]) for g in groups)
    for name, p in lora.agents[0].team.base.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, before[name]), f"the frozen base changed: {name}"
            assert not p.requires_grad
    for i in range(4):  # every adapter trained, each by its own agent's updates
        assert any(not torch.equal(a, b) for a, b in zip(adapters_before[i], lora.agents[i].trainable_parameters()))
        assert all(p.requires_grad for p in lora.agents[i].trainable_parameters())


def test_agents_switch_adapters_and_the_reference_is_the_base_with_adapters_off(tmp_path):
    module = make_module(lora_rank=4, reference_kl_enabled=True, reference_kl_coef=0.1)
    fit(module, tmp_path, max_steps=2)
    team = module.agents[0].team
    a0, a1 = logits(module.agents[0]), logits(module.agents[1])
    assert not torch.allclose(a0, a1), "both agents answered with the same adapter"
    assert torch.equal(logits(module.agents[0]), a0), "switching adapters changed an agent"
    reference = module.reference.models[0]
    with team.peft.disable_adapter():
        plain = logits(team.peft)
    assert torch.equal(logits(reference), plain) and not torch.allclose(plain, a0)
    assert all(p.requires_grad for i in range(2) for p in module.agents[i].trainable_parameters()), (
        "scoring with the reference left an adapter frozen"
    )
    assert (
        module.reference.models[0] is module.reference.models[1]
        or module.reference.models[0].team is module.reference.models[1].team
    )  # no copy of the base per agent


def test_save_pretrained_writes_one_adapter_folder_per_agent_and_they_load_back(tmp_path):
    module = make_module(lora_rank=4)
    fit(module, tmp_path, max_steps=1)
    module.save_pretrained(tmp_path / "out")
    for i in range(2):
        files = {p.name for p in (tmp_path / "out" / f"agent_{i}").iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= files, files
        assert not any(name.startswith("model") for name in files), "a LoRA agent wrote full weights"
    loaded = make_module(agents=[str(tmp_path / "out" / f"agent_{i}") for i in range(2)])
    assert loaded.lora is not None and loaded.lora["base"] == "tiny"
    for i in range(2):
        assert torch.allclose(logits(loaded.agents[i]), logits(module.agents[i]), atol=1e-6)
    loaded_params = sum(p.numel() for p in loaded.parameters())
    assert loaded_params == sum(p.numel() for p in module.parameters())


def test_madpo_trains_a_lora_team(tmp_path):
    module = make_madpo(lora_rank=4, reward_func=toy.brevity_reward, train_batch_size=4, agent_learning_rate=1e-2)
    before = [[p.detach().clone() for p in module.agents[i].trainable_parameters()] for i in range(2)]
    trainer, _ = fit_madpo(module, tmp_path, items=ITEMS, max_epochs=1)
    assert trainer.global_step > 0
    for i in range(2):
        assert any(not torch.equal(a, b) for a, b in zip(before[i], module.agents[i].trainable_parameters()))


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"agents": ["tiny", "tiny-5m"]}, "lora_rank=4: a LoRA team puts one adapter per agent on ONE base model"),
        ({"parallel_training": "mp", "agent_devices": ["cpu", "cpu"]}, "a LoRA team .* shares one base model"),
        ({"lora_rank": 0}, "lora_rank must be an integer >= 1 or null"),
    ],
)
def test_what_a_lora_team_cannot_be_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_module(**{"lora_rank": 4, **overrides})


@pytest.mark.parametrize("variant", ["iac-head", "iac-critics", "maac"])
def test_actor_critic_critics_are_adapters_and_value_heads_on_the_one_base(variant, tmp_path):
    """IAC with value heads on the actors, IAC with a critic per agent and MAAC's joint critic: every critic is a
    value head on the team's one base (a separate critic: its own adapter ``critic_j`` too). Nothing else is
    loaded; each update trains the agents' adapters, the critics' adapters and the heads, never the base."""
    from test_actor_critic import make_ac

    from comlrl_lightning import IAC, MAAC

    cls, overrides = {"iac-head": (IAC, {"use_separate_critic": False}), "iac-critics": (IAC, {}), "maac": (MAAC, {})}[
        variant
    ]
    module = make_ac(cls, lora_rank=4, critic_model=None, **overrides)
    team = module.policy_model(0).team
    full = make_ac(cls, **overrides)
    full.critics  # noqa: B018  (loads the full-copy team and its critics)
    critics = list(module.critics) or list(module.agents)
    base_size = sum(p.numel() for n, p in team.base.named_parameters() if "lora_" not in n)
    trainable = {id(p): p.numel() for m in [*module.agents, *module.critics] for p in m.trainable_parameters()}
    assert sum(p.numel() for p in module.parameters()) == base_size + sum(trainable.values()), "the base is not once"
    assert sum(p.numel() for p in full.parameters()) > (2 + len(full.critics)) * base_size  # a full copy per model
    assert all(critic.model.team is team for critic in critics), "a critic is not on the team's base"
    assert set(team.peft.peft_config) == {
        "agent_0",
        "agent_1",
        *(f"critic_{j}" for j in range(len(module.critics))),
    }
    before = [[p.detach().clone() for p in critic.trainable_parameters()] for critic in critics]
    base = {n: p.detach().clone() for n, p in team.base.named_parameters() if "lora_" not in n}
    fit(module, tmp_path, max_steps=2)
    groups = module.optimizers().optimizer.param_groups
    assert len({id(p) for g in groups for p in g["params"]}) == sum(len(g["params"]) for g in groups), (
        "a parameter is in two optimizer groups"
    )
    for critic, old in zip(critics, before):
        new = critic.trainable_parameters()
        assert not torch.equal(new[-1], old[-1]), "a value head did not train"
        if critic.model.name.startswith("critic_"):
            assert any(not torch.equal(a, b) for a, b in zip(old[:-1], new[:-1])), "a critic adapter did not train"
    assert all(torch.equal(p, base[n]) for n, p in team.base.named_parameters() if "lora_" not in n)
    module.save_pretrained(tmp_path / "out")
    saved = (
        tmp_path
        / "out"
        / ("critic" if variant == "maac" else "agent_0" / Path("critic") if variant == "iac-critics" else "agent_0")
    )
    files = {p.name for p in saved.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "value_head.safetensors"} <= files, files
    assert not any(name.startswith("model") for name in files), "a LoRA critic wrote full weights"


def test_an_adapter_folder_loads_anywhere_as_its_base_with_the_adapter_merged(tmp_path):
    """A comparator (``history``, ``model``) or a reward model given one agent's adapter folder gets a plain model
    that answers as that agent did."""
    from comlrl_lightning.agents import load_agents

    module = make_module(lora_rank=4)
    fit(module, tmp_path, max_steps=1)
    module.save_pretrained(tmp_path / "out")
    (merged,), _ = load_agents([str(tmp_path / "out" / "agent_1")], num_agents=1)
    assert not hasattr(merged, "peft_config")
    assert torch.allclose(logits(merged), logits(module.agents[1]), atol=1e-5)


def test_iterative_madpo_with_a_history_comparator_trains_a_lora_team(tmp_path):
    from comlrl_lightning import MADPOIter

    module = make_madpo(
        cls=MADPOIter,
        lora_rank=4,
        preference_num_candidates=2,
        num_iterations=2,
        comparator_policy="history",
        comparator_history_k=1,
        policy_checkpoint_dir=str(tmp_path / "pc"),
    )
    trainer, _ = fit_madpo(module, tmp_path, items=ITEMS[:4], max_epochs=2)
    assert trainer.global_step > 0
    assert (tmp_path / "pc" / "iteration_0000" / "agent_0" / "adapter_config.json").is_file()


def test_a_lora_team_samples_in_one_generate_call_each_row_through_its_own_adapter():
    """The agents of a LoRA team answer in ONE ``generate`` (peft's mixed-adapter batch); the first token of every
    row is drawn from its own agent's distribution (the logits its adapter view gives the prompt)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from comlrl_lightning.rollout.backends.hf import HFGenerate
    from comlrl_lightning.rollout.sampling import SamplingConfig

    module = make_module(num_agents=3, lora_rank=4)
    torch.manual_seed(0)
    for i in range(3):  # fresh adapters are the base (B = 0): make each agent its own
        for p in module.agents[i].trainable_parameters():
            p.data.normal_(0, 0.5)

    class FirstScores(LogitsProcessor):
        def __init__(self):
            self.first = None

        def __call__(self, input_ids, scores):
            self.first = scores.clone() if self.first is None else self.first
            return scores

    first = FirstScores()
    calls = []
    team = module.agents[0].team
    hook = team.base.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape), with_kwargs=True)
    prompts = [["Write a story", "The fox"], ["Two"], ["Tell me about cats and"]]
    try:
        out = HFGenerate(generation_kwargs={"logits_processor": LogitsProcessorList([first])}).sample(
            module.agents, module.tokenizers, prompts, 2, SamplingConfig(max_new_tokens=3, top_k=None, top_p=1.0)
        )
    finally:
        hook.remove()
    assert calls[0][0] == 4, "the team's prompts were not encoded together once"
    assert len(calls) == 4 and all(shape == (8, 1) for shape in calls[1:]), calls  # then 3 tokens, one batch each
    assert [c.completion_ids.shape[0] for c in out] == [4, 2, 2]
    row = 0
    tok = module.tokenizers[0]
    for i, agent_prompts in enumerate(prompts):
        for prompt in agent_prompts:
            ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            expected = logits(module.agents[i], ids)[0, -1]
            for _ in range(2):
                torch.testing.assert_close(first.first[row], expected, atol=1e-4, rtol=1e-4)
                row += 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_lora_team_trains_with_a_generation_copy_of_its_one_peft_model(dtype, tmp_path):
    """``generation_dtype: bfloat16`` / ``float16`` with a LoRA team: ONE copy of the team's peft model (base and
    every adapter) samples for all agents, and after each update it holds the trained adapters. On a CPU without
    fp16 matrix instructions the float16 copy shares the team's tensors and multiplies by fp16 packs of them, which
    must follow the trained adapters too."""
    from comlrl_lightning.rollout.backends import hf_copies as generation_mod
    from comlrl_lightning.rollout.backends.hf_copies import sampling_copies

    module = make_module(num_agents=2, lora_rank=4, generation_dtype=dtype)
    fit(module, tmp_path, max_steps=2)
    generator = module.agents[0].shared_generator()[0]
    held = [(m, c) for m, c in sampling_copies(dtype).held.items() if m is generator or m in module.agents]
    team = module.agents[0].team
    assert len(held) == 1 and held[0][0] is module.agents[0].shared_generator()[0]
    clone = held[0][1][0]
    adapters = {n: p for n, p in clone.named_parameters() if "lora_" in n}
    trained = dict(held[0][0].named_parameters())
    module.engine.rollout(module.agents, module.tokenizers, ITEMS[:1])  # the last update reaches the copy
    assert adapters and sum(p.numel() for p in clone.parameters()) == sum(p.numel() for p in team.base.parameters())
    shared = next(clone.parameters()) is next(generator.parameters())
    assert shared == (
        dtype == "float16"
        and not generation_mod.cpu_multiplies_in(torch.float16)
        and generation_mod.packing_works(generation_mod.FP16_WEIGHTS)
    )
    if not shared:
        assert all(p.dtype == getattr(torch, dtype) for p in clone.parameters())
        for name, p in adapters.items():
            assert torch.equal(p, trained[name].to(p.dtype)), name
        return
    assert all(p is trained[name] for name, p in adapters.items())
    packed = {n: m for n, m in clone.named_modules() if "lora_B" in n and isinstance(m, generation_mod.PackedLinear)}
    assert packed and any(bool(m.weight.abs().sum() > 0) for m in packed.values())  # trained away from zero
    for name, layer in packed.items():  # each pack is of the trained weight, not of the zeros it started from
        x = torch.randn(3, layer.in_features)
        torch.testing.assert_close(
            layer(x),
            torch.nn.functional.linear(x, layer.weight.detach().half().float()),
            atol=1e-5,
            rtol=1e-5,
            msg=name,
        )
