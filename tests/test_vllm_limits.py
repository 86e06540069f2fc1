"""A configuration vLLM cannot run is refused in one line before any model loads (the quick start with
``generation_backend: vllm`` used to crash after loading, in a ~100-line traceback: the tiny model's head size, 16, is
one vLLM's CPU attention does not take)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from comlrl_lightning.agents.architecture import architecture
from comlrl_lightning.agents.factories import build_tiny_model, build_tiny_tokenizer
from comlrl_lightning.rollout.backends.vllm import CPU_HEAD_SIZES, unsupported_architecture

REPO = Path(__file__).resolve().parents[1]


def test_an_agents_architecture_is_read_without_its_weights(tmp_path):
    assert architecture("tiny") == {"head_size": 16, "positions": 512}
    assert architecture("tiny", {"num_heads": 2, "num_kv_heads": 1}) == {"head_size": 32, "positions": 512}
    assert architecture("tiny-5m", {"max_position_embeddings": 1024}) == {"head_size": 64, "positions": 1024}
    model = build_tiny_model(build_tiny_tokenizer(), num_heads=2, num_kv_heads=1)
    assert architecture(model) == {"head_size": 32, "positions": 512}
    model.save_pretrained(tmp_path / "saved")
    assert architecture(str(tmp_path / "saved")) == {"head_size": 32, "positions": 512}
    assert architecture("some-org/not-in-the-cache") is None  # unknown: nothing is refused on a guess


def test_vllms_cpu_head_sizes_are_checked_per_agent():
    ok, bad = {"head_size": 64, "positions": 512}, {"head_size": 16, "positions": 512}
    assert unsupported_architecture([ok, None], "cpu") is None
    problem = unsupported_architecture([ok, bad], "cpu")
    assert "agent 1's model has 16" in problem and "model_config.model_kwargs" in problem
    assert all(str(h) in problem for h in CPU_HEAD_SIZES)
    assert unsupported_architecture([bad], "cuda") is None  # the GPU kernels take it


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_quick_start_with_vllm_stops_in_one_line_before_loading(tmp_path, capsys, monkeypatch):
    from comlrl_lightning.agents import loading
    from comlrl_lightning.cli import main

    monkeypatch.setattr(loading, "load_agents", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                str(REPO / "configs" / "quickstart.yaml"),
                "--model.init_args.generation_backend=vllm",
                "--trainer.default_root_dir",
                str(tmp_path / "run"),
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert "agent 0's model has 16" in err and "model_config.model_kwargs" in err, err
