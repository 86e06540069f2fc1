"""Coding configs (CoopHumanEval 1/2 turns, MBPP) parse; default dataset functions load the shared copies."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not SHARED.exists(), reason=f"shared data not found under {SHARED}")


@pytest.mark.parametrize("name", ["coding_che_magrpo.yaml", "coding_che_magrpo_2turn.yaml",
                                  "coding_mbpp_magrpo.yaml"])
def test_coding_configs_parse(name, capsys):
    from comlrl_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / name), "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "comlrl_lightning.envs.coding.coding_reward" in out and "shift: -4.0" in out


@needs_data
def test_default_coding_datasets():
    from comlrl_lightning.envs import datasets as d

    assert (len(d.che_train_tasks()), len(d.che_eval_tasks())) == (66, 16)
    assert len(d.mbpp_eval_tasks()) == 257 and d.mbpp_train_tasks()[0]["entry_point"]
