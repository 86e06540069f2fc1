"""``generation_backend``: the one field that chooses the sampling engine; what each backend refuses before any model
loads; transformers' continuous batching (``transformers_cb``) end to end; the ``hf`` backend's CPU speed code as
its own concern. vLLM's real-engine tests are in tests/test_vllm.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_magrpo import column, fit, make_module, read_metrics

from comlrl_lightning import IAC, MADPO, MAGRPO
from comlrl_lightning.algorithms import team
from comlrl_lightning.envs import toy
from comlrl_lightning.rollout import generation
from comlrl_lightning.rollout.backends.continuous import ContinuousBatching
from comlrl_lightning.rollout.backends.hf import HFGenerate
from comlrl_lightning.rollout.sampling import SamplingConfig

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tiny():
    from comlrl_lightning.agents.factories import MODEL_FACTORIES

    model, tok = MODEL_FACTORIES["tiny"]()
    return model.eval(), tok


def loads_no_model(monkeypatch):
    """Fail the test if any model would load."""
    monkeypatch.setattr(team, "load_agents", lambda *a, **k: pytest.fail("a model was loaded"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"generation_backend": "sglang"},
            "generation_backend must be one of: hf, vllm, transformers_cb (got 'sglang')",
        ),
        (
            {"generation_backend": "vllm", "generation_dtype": "bfloat16"},
            "generation_dtype: bfloat16 is a sampling copy of the hf backend",
        ),
        (
            {"generation_backend": "vllm", "generation_kwargs": {"cache_implementation": "static"}},
            "generation_kwargs ['cache_implementation'] have no vLLM equivalent",
        ),
        (
            {"generation_backend": "transformers_cb", "generation_kwargs": {"stop_strings": ["\n"]}},
            "generation_kwargs ['stop_strings'] have no continuous-batching equivalent",
        ),
        ({"generation_backend": "transformers_cb", "lora_rank": 4}, "generation_backend: transformers_cb samples one"),
        (
            {"vllm_importance_sampling_correction": True},
            "vllm_importance_sampling_correction: true corrects for sampling by a vLLM engine",
        ),
        ({"vllm_importance_sampling_mode": "clip"}, "vllm_importance_sampling_mode must be one of: token_truncate"),
        ({"vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization must be in (0, 1] (got 1.5)"),
        ({"vllm_max_model_len": 4}, "vllm_max_model_len must be null or more than max_new_tokens (6)"),
    ],
)
def test_a_bad_backend_setting_is_refused_before_any_model_loads(overrides, message, monkeypatch):
    if overrides.get("generation_backend") == "vllm" and importlib.util.find_spec("vllm") is None:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # the message after the install
    loads_no_model(monkeypatch)
    with pytest.raises(ValueError) as error:
        make_module(**overrides)
    assert message in str(error.value)


def test_a_missing_vllm_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    loads_no_model(monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"generation_backend: vllm needs vLLM, which is not installed: pip install "
        r"\"comlrl_lightning\[vllm\]\"",
    ):
        make_module(generation_backend="vllm")


def test_the_cli_refuses_a_bad_backend_in_one_line(tmp_path):
    """From YAML the same check is one line naming the field and its choices, no traceback."""
    import subprocess
    import sys

    config = tmp_path / "bad.yaml"
    config.write_text(
        "model:\n  class_path: comlrl_lightning.MAGRPO\n  init_args:\n    agents: tiny\n"
        "    reward_func: comlrl_lightning.envs.toy.brevity_reward\n    generation_backend: sglang\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "comlrl_lightning",
            "fit",
            "--config",
            str(config),
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and "generation_backend" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "hf" in out.stderr and "transformers_cb" in out.stderr


@pytest.mark.parametrize("cls", [MAGRPO, IAC, MADPO])
def test_every_family_samples_through_the_backend_it_names(cls, monkeypatch):
    """The module's engine (training rollouts, evaluation, pairs, comparators) holds the named backend."""
    kwargs = dict(generation_backend="transformers_cb")
    if cls is IAC:
        kwargs.update(critic_model="tiny")
    if cls is MADPO:
        module = MADPO(agents="tiny", reward_func=toy.letter_reward, **kwargs)
    else:
        module = make_module(cls, **kwargs)
    assert isinstance(module.engine.backend, ContinuousBatching) and module.engine.backend is module.generation_engine
    assert isinstance(make_module().engine.backend, HFGenerate)


def test_continuous_batching_fits_magrpo(tmp_path):
    module = make_module(generation_backend="transformers_cb")
    trainer = fit(module, tmp_path, max_steps=2)
    rows = read_metrics(trainer)
    assert trainer.global_step == 2 and column(rows, "rollout/policy_lag") == [0.0, 0.0] and column(rows, "loss")


def test_continuous_batching_samples_follow_hfs_distribution(tiny):
    """First tokens of a fixed prompt: continuous batching's and hf's draws pass a two-sample chi-square test, and
    its records have hf's layout (K rows per prompt, the mask up to and including EOS)."""
    import copy

    model, tok = tiny
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    cfg = SamplingConfig(max_new_tokens=1, temperature=0.8, top_p=0.9, top_k=30)
    torch.manual_seed(0)
    ours = ContinuousBatching().sample([model], [tok], [[PROMPT]], 2000, cfg)[0].completion_ids[:, 0]
    theirs = HFGenerate().sample([model], [tok], [[PROMPT]], 2000, cfg)[0].completion_ids[:, 0]
    a, b = (torch.bincount(ids, minlength=len(tok)).double() for ids in (ours, theirs))
    seen = (a + b) > 0
    expected = (a + b)[seen] / 2
    chi2 = (((a[seen] - expected) ** 2 + (b[seen] - expected) ** 2) / expected).sum().item()
    dof = int(seen.sum()) - 1
    assert dof > 5 and chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)
    out = ContinuousBatching().sample([model], [tok], [["a", "b c"]], 3, SamplingConfig(max_new_tokens=4))[0]
    assert out.completion_ids.shape[0] == 6 and len(out.prompt_ids) == 2
    assert out.texts == tok.batch_decode(out.completion_ids, skip_special_tokens=True)


def test_continuous_batching_leaves_the_random_stream_one_draw_on(tiny):
    """The engine reseeds torch's generator while it runs; the process's stream continues as after one draw, so a
    run (and its resume) samples and shuffles deterministically."""
    model, tok = tiny
    torch.manual_seed(7)
    torch.randint(0, 2**31 - 1, (1,))
    expected = torch.rand(3)
    torch.manual_seed(7)
    ContinuousBatching().sample([model], [tok], [["a"]], 2, SamplingConfig(max_new_tokens=2))
    assert torch.equal(torch.rand(3), expected)


def test_keeping_freed_cpu_memory_is_opt_in():
    """The process-wide allocator setting (glibc mallopt) is not on unless asked for."""
    assert make_module().keep_freed_cpu_memory is False


def test_the_hf_backends_speed_code_lives_in_the_backend():
    """rollout/sampling.py holds the records and scoring; the CPU product timing, packing and shared-prefix
    attention are the hf backend's modules, and a packed layer is a module of its own put in its parent."""
    import inspect

    from comlrl_lightning.rollout import sampling

    source = inspect.getsource(sampling)
    for name in ("fast_decoding_products", "SharedPrefixCache", "pack_linears", "def sample_completions"):
        assert name not in source, name
    from comlrl_lightning.rollout.backends import hf_copies

    assert "__class__ =" not in inspect.getsource(hf_copies)
    assert generation.GENERATION_BACKENDS == ("hf", "vllm", "transformers_cb")
