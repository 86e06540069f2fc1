"""ValueHead and CausalLMWithValueHead on the tiny Qwen2 model (docs/algorithms.md#actor-critic)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from comlrl_lightning.agents import MODEL_FACTORIES, CausalLMWithValueHead, ValueHead
from comlrl_lightning.agents.value_head import VALUE_HEAD_CONFIG_NAME, VALUE_HEAD_PT_NAME, VALUE_HEAD_WEIGHTS_NAME
from comlrl_lightning.rollout.backends.hf import sample_completions
from comlrl_lightning.rollout.sampling import SamplingConfig, build_scoring_inputs, token_logprobs


@pytest.fixture(scope="module")
def tiny():
    return MODEL_FACTORIES["tiny"]()


@pytest.fixture()
def wrapped(tiny):
    torch.manual_seed(0)
    return CausalLMWithValueHead(tiny[0])


@pytest.fixture(scope="module")
def batch(tiny):
    """Two left-padded rows, as generation/scoring lay them out."""
    _, tok = tiny
    enc = tok(
        ["The quick brown fox jumps", "Two agents"],
        return_tensors="pt",
        padding=True,
        padding_side="left",
        add_special_tokens=False,
    )
    mask = enc["attention_mask"]
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    return enc["input_ids"], mask, position_ids


# --- ValueHead -------------------------------------------------------------------------------------------


def test_value_head_linear_shapes_and_init():
    torch.manual_seed(0)
    head = ValueHead(4096)
    assert len(head) == 1 and isinstance(head[0], nn.Linear) and head.hidden_dim is None
    assert head(torch.randn(2, 3, 4096)).shape == (2, 3)
    assert head(torch.randn(5, 4096)).shape == (5,)
    assert torch.all(head[0].bias == 0)
    assert abs(head[0].weight.std().item() - 0.02) < 0.002 and abs(head[0].weight.mean().item()) < 0.002
    assert ValueHead(8, 0).hidden_dim is None and len(ValueHead(8, 0)) == 1


def test_value_head_hidden_dim_shapes_and_init():
    torch.manual_seed(0)
    head = ValueHead(64, hidden_dim=512)
    assert [type(m) for m in head] == [nn.Linear, nn.Tanh, nn.Linear]
    assert head[0].weight.shape == (512, 64) and head[2].weight.shape == (1, 512)
    assert sorted(head.state_dict()) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert torch.all(head[0].bias == 0) and torch.all(head[2].bias == 0)
    assert abs(head[0].weight.std().item() - 0.02) < 0.002
    assert head(torch.randn(2, 3, 64)).shape == (2, 3)


def test_value_head_bad_sizes():
    with pytest.raises(ValueError, match="hidden_size must be >= 1"):
        ValueHead(0)
    with pytest.raises(ValueError, match="value_head_hidden_dim must be > 0 or null"):
        ValueHead(8, -1)


# --- CausalLMWithValueHead: forward ----------------------------------------------------------------------


def test_logits_equal_bare_model_and_values_shape(tiny, wrapped, batch):
    model, _ = tiny
    ids, mask, pos = batch
    with torch.no_grad():
        bare = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        out = wrapped(input_ids=ids, attention_mask=mask, position_ids=pos)
    torch.testing.assert_close(out.logits, bare)
    assert out.values.shape == ids.shape and out.values.dtype == torch.float32
    assert out.hidden_states is None  # only returned when asked for
    assert torch.isfinite(out.values).all() and out.values.abs().max() > 0


def test_logits_to_keep(tiny, wrapped, batch):
    model, _ = tiny
    ids, mask, pos = batch
    with torch.no_grad():
        bare = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        out = wrapped(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=3)
        full = wrapped(input_ids=ids, attention_mask=mask, position_ids=pos)
    assert out.logits.shape == (2, 3, bare.shape[-1])
    torch.testing.assert_close(out.logits, bare[:, -3:])
    torch.testing.assert_close(out.values, full.values)  # values still cover every position


def test_output_values_false_and_hidden_states(wrapped, batch):
    ids, mask, pos = batch
    with torch.no_grad():
        out = wrapped(input_ids=ids, attention_mask=mask, position_ids=pos, output_values=False)
        with_hidden = wrapped(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert out.values is None and out.hidden_states is None
    assert len(with_hidden.hidden_states) == wrapped.config.num_hidden_layers + 1


def test_values_at_matches_forward_and_skips_lm_head(tiny, wrapped, batch):
    model, _ = tiny
    ids, mask, pos = batch
    calls = []
    hook = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            positions = torch.tensor([ids.shape[1] - 1, 2])
            at = wrapped.values_at(ids, mask, pos, positions)
            last = wrapped.values_at(ids, mask, pos)  # None -> last position
    finally:
        hook.remove()
    assert calls == []  # no vocabulary projection
    with torch.no_grad():
        full = wrapped(input_ids=ids, attention_mask=mask, position_ids=pos).values
    assert at.shape == (2,) and at.dtype == torch.float32
    torch.testing.assert_close(at, torch.stack([full[0, -1], full[1, 2]]))
    torch.testing.assert_close(last, full[:, -1])
    torch.testing.assert_close(wrapped.values_at(ids, mask, pos, torch.tensor([-1, -1])).detach(), full[:, -1])


def test_values_at_fallback_without_decoder(wrapped, batch, monkeypatch):
    ids, mask, pos = batch
    positions = torch.tensor([3, 4])
    with torch.no_grad():
        expected = wrapped.values_at(ids, mask, pos, positions)
        monkeypatch.setattr(wrapped, "_decoder", lambda: None)
        torch.testing.assert_close(wrapped.values_at(ids, mask, pos, positions), expected)


def test_values_at_gradient_reaches_head_and_backbone(wrapped, batch):
    ids, mask, pos = batch
    wrapped.zero_grad()
    wrapped.values_at(ids, mask, pos, torch.tensor([-1, -1])).sum().backward()
    assert wrapped.value_head[0].weight.grad.abs().sum() > 0
    assert wrapped.model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    wrapped.zero_grad()


def test_token_logprobs_on_wrapper(tiny, wrapped):
    model, tok = tiny
    prompts = [
        torch.tensor(tok("The quick brown", add_special_tokens=False)["input_ids"]),
        torch.tensor(tok("Two", add_special_tokens=False)["input_ids"]),
    ]
    completions = torch.tensor([[11, 12, 13], [14, 15, tok.pad_token_id]])
    cmask = torch.tensor([[True, True, True], [True, True, False]])
    inputs = build_scoring_inputs(prompts, completions, cmask, tok.pad_token_id)
    with torch.no_grad():
        expected = token_logprobs(model, inputs)
        got = token_logprobs(wrapped, inputs)
    torch.testing.assert_close(got, expected)
    assert got.shape == (2, 3) and got[1, 2] == 0
    # Two rows of one prompt: the wrapper passes the shared prompt's cache through to its backbone.
    shared = build_scoring_inputs([prompts[0], prompts[0]], completions, cmask, tok.pad_token_id)
    with torch.no_grad():
        whole = token_logprobs(model, shared, share_prompts=False)
        torch.testing.assert_close(token_logprobs(wrapped, shared), whole, atol=2e-5, rtol=0)


def test_generate_and_sampling_on_wrapper(tiny, wrapped, batch):
    model, tok = tiny
    ids, mask, _ = batch
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    torch.testing.assert_close(
        wrapped.generate(input_ids=ids, attention_mask=mask, **kw),
        model.generate(input_ids=ids, attention_mask=mask, **kw),
    )
    assert wrapped.can_generate() and wrapped.config is model.config
    assert wrapped.generation_config is model.generation_config
    assert next(wrapped.parameters()).device == wrapped.device
    torch.manual_seed(0)
    comps = sample_completions(wrapped, tok, ["Two agents"], 2, SamplingConfig(max_new_tokens=3, top_k=None))
    assert comps.completion_ids.shape[0] == 2 and len(comps.texts) == 2


def test_no_value_head(tiny, batch):
    ids, mask, pos = batch
    wrapper = CausalLMWithValueHead(tiny[0], attach_value_head=False)
    assert wrapper.value_head is None and not wrapper.has_value_head
    assert not any(name.startswith("value_head") for name, _ in wrapper.named_parameters())
    with torch.no_grad():
        assert wrapper(input_ids=ids, attention_mask=mask, position_ids=pos).values is None
        with pytest.raises(ValueError, match="Value head is missing"):
            wrapper.values_at(ids, mask, pos)


def test_head_follows_backbone_dtype(tiny, batch):
    ids, mask, pos = batch
    model = MODEL_FACTORIES["tiny"](dtype=torch.bfloat16)[0]
    wrapper = CausalLMWithValueHead(model, value_head_hidden_dim=8)
    assert all(p.dtype == torch.bfloat16 for p in wrapper.value_head.parameters())
    with torch.no_grad():
        assert wrapper(input_ids=ids, attention_mask=mask, position_ids=pos).values.dtype == torch.float32
        assert wrapper.values_at(ids, mask, pos).dtype == torch.float32


def test_hidden_size_from_n_embd_and_bad_config():
    gpt2_like = nn.Linear(2, 2)
    gpt2_like.config = SimpleNamespace(n_embd=16)
    assert CausalLMWithValueHead(gpt2_like).value_head.hidden_size == 16
    bad = nn.Linear(2, 2)
    bad.config = SimpleNamespace(vocab_size=10)
    with pytest.raises(ValueError, match="Could not infer hidden size"):
        CausalLMWithValueHead(bad)
    with pytest.raises(ValueError, match="Could not infer hidden size"):
        CausalLMWithValueHead(nn.Linear(2, 2))


# --- save / load -----------------------------------------------------------------------------------------


def _outputs(wrapper, batch):
    ids, mask, pos = batch
    with torch.no_grad():
        out = wrapper(input_ids=ids, attention_mask=mask, position_ids=pos)
    return out.logits, out.values


@pytest.mark.parametrize("hidden_dim", [None, 16])
def test_save_load_round_trip(tiny, batch, tmp_path, hidden_dim):
    torch.manual_seed(1)
    wrapper = CausalLMWithValueHead(tiny[0], value_head_hidden_dim=hidden_dim)
    with torch.no_grad():
        wrapper.value_head[-1].bias.fill_(0.25)  # not the init values, so a fresh head would differ
    wrapper.save_pretrained(tmp_path)
    assert (tmp_path / VALUE_HEAD_WEIGHTS_NAME).is_file() and (tmp_path / "config.json").is_file()
    assert (tmp_path / VALUE_HEAD_CONFIG_NAME).read_text().count(f'"hidden_dim": {hidden_dim or "null"}') == 1

    loaded = CausalLMWithValueHead.from_pretrained(tmp_path)
    assert loaded.value_head.hidden_dim == hidden_dim
    for got, expected in zip(_outputs(loaded, batch), _outputs(wrapper, batch)):
        torch.testing.assert_close(got, expected)

    from transformers import AutoModelForCausalLM  # the directory is still a plain HF model directory

    backbone = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(_outputs(CausalLMWithValueHead(backbone), batch)[0], _outputs(wrapper, batch)[0])


def test_load_hidden_dim_mismatch_and_no_head(tiny, tmp_path):
    CausalLMWithValueHead(tiny[0], value_head_hidden_dim=16).save_pretrained(tmp_path / "head16")
    with pytest.raises(ValueError, match="does not match the saved value head"):
        CausalLMWithValueHead.from_pretrained(tmp_path / "head16", value_head_hidden_dim=8)
    assert CausalLMWithValueHead.from_pretrained(tmp_path / "head16", attach_value_head=False).value_head is None

    CausalLMWithValueHead(tiny[0], attach_value_head=False).save_pretrained(tmp_path / "nohead")
    assert not (tmp_path / "nohead" / VALUE_HEAD_WEIGHTS_NAME).exists()
    fresh = CausalLMWithValueHead.from_pretrained(tmp_path / "nohead", value_head_hidden_dim=4)
    assert fresh.value_head.hidden_dim == 4  # no saved head: a fresh one


def test_load_comlrl_value_head_pt(tiny, batch, tmp_path):
    torch.manual_seed(2)
    source = CausalLMWithValueHead(tiny[0], value_head_hidden_dim=32)
    tiny[0].save_pretrained(tmp_path)
    torch.save({f"value_head.{k}": v for k, v in source.value_head.state_dict().items()}, tmp_path / VALUE_HEAD_PT_NAME)
    loaded = CausalLMWithValueHead.from_pretrained(tmp_path)
    assert loaded.value_head.hidden_dim == 32
    torch.testing.assert_close(_outputs(loaded, batch)[1], _outputs(source, batch)[1])


def test_from_pretrained_model_objects(tiny, wrapped):
    model, _ = tiny
    fresh = CausalLMWithValueHead.from_pretrained(model, value_head_hidden_dim=8)
    assert fresh.model is model and fresh.value_head.hidden_dim == 8
    rewrapped = CausalLMWithValueHead.from_pretrained(wrapped)
    assert rewrapped.model is model and rewrapped.value_head is wrapped.value_head
    with pytest.raises(TypeError, match="already a CausalLMWithValueHead"):
        CausalLMWithValueHead(wrapped)


def test_wrapper_mirrors_backbone_mode(tiny):
    model, _ = tiny
    assert not model.training
    wrapper = CausalLMWithValueHead(model)
    assert not wrapper.training and not wrapper.value_head.training
    wrapper.train()
    assert model.training
    wrapper.eval()
    assert not model.training
