"""The command line as a user meets it: where a run's files go, the progress bar, and what it prints."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from comlrl_lightning.callbacks.progress import progress_bar, train_completed, train_description, train_total
from comlrl_lightning.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICK = [
    "--config",
    str(REPO / "configs" / "quickstart.yaml"),
    "--trainer.max_steps=1",
    "--trainer.enable_progress_bar=false",
    "--model.init_args.max_new_tokens=4",
]


def run_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_every_file_of_a_run_goes_under_default_root_dir(tmp_path, monkeypatch):
    from comlrl_lightning.callbacks.checkpoints import FileCheckpointIO

    monkeypatch.chdir(tmp_path)
    cli = main(["fit", *QUICK, "--trainer.default_root_dir", str(tmp_path / "run")])
    files = run_files(tmp_path / "run")
    for name in ("metrics.csv", "hparams.yaml", "config.yaml", "completions.jsonl"):
        assert f"quickstart/version_0/{name}" in files, files
    checkpoints = [f for f in files if f.startswith("quickstart/version_0/checkpoints/")]
    assert checkpoints and all(f.endswith(".ckpt") for f in checkpoints), files  # nothing partial left beside them
    assert type(cli.trainer.strategy.checkpoint_io) is FileCheckpointIO
    assert not (tmp_path / "outputs").exists()


def test_without_default_root_dir_the_run_goes_to_outputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", *QUICK])
    assert (tmp_path / "outputs" / "quickstart" / "version_0" / "metrics.csv").is_file()


def test_a_logger_without_save_dir_follows_default_root_dir_and_an_explicit_one_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            *QUICK,
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.logger",
            "lightning.pytorch.loggers.TensorBoardLogger",
            "--trainer.logger.init_args.name",
            "tb",
        ]
    )
    assert any((tmp_path / "run" / "tb").rglob("events.out.tfevents.*"))
    main(
        [
            "fit",
            *QUICK,
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "elsewhere"),
        ]
    )
    assert (tmp_path / "elsewhere" / "quickstart" / "version_0" / "metrics.csv").is_file()


def test_the_command_exits_0_after_a_run_and_freezes_its_objects_however_it_ends(tmp_path, monkeypatch, capsys):
    """``comlrl-lightning`` (the installed script: ``sys.exit(command())``) and ``python -m comlrl_lightning``: a
    finished run exits with status 0, and the objects are left out of the interpreter's last garbage collections
    (seconds at every exit), after a run and after an exit such as ``--help``."""
    import gc
    import runpy
    from importlib.metadata import entry_points

    from comlrl_lightning.cli import command

    (script,) = entry_points(group="console_scripts", name="comlrl-lightning")
    assert script.load() is command
    monkeypatch.chdir(tmp_path)
    try:
        monkeypatch.setattr(
            "sys.argv",
            [
                "comlrl-lightning",
                "fit",
                *QUICK,
                "--model.init_args.agents=tiny",
                "--model.init_args.use_chat_template=false",
            ],
        )
        gc.unfreeze()
        with pytest.raises(SystemExit) as exit_info:
            sys.exit(command())
        assert exit_info.value.code is None and gc.get_freeze_count() > 0  # status 0
        assert (tmp_path / "outputs" / "quickstart" / "version_0" / "metrics.csv").is_file()
        monkeypatch.setattr("sys.argv", ["comlrl_lightning", "--help"])
        gc.unfreeze()
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_module("comlrl_lightning", run_name="__main__")
        assert exit_info.value.code == 0 and "fit" in capsys.readouterr().out
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_shipped_configs_name_the_run_not_the_directory():
    for config in sorted((REPO / "configs").glob("*.yaml")):
        assert "save_dir" not in config.read_text(), f"{config.name} hard-codes a log directory"


def test_a_fit_prints_no_warning_the_project_causes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["fit", *QUICK])
    messages = [str(w.message) for w in caught]
    for fragment in ("Total length of", "max_epochs", "LeafSpec", "litlogger", "litmodels"):
        assert not any(fragment in m for m in messages), (fragment, messages)


def test_iterative_configs_get_their_epochs_from_the_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main(
            [
                "--config",
                str(REPO / "configs" / "madpo_iter.yaml"),
                "--model.init_args.agents=tiny",
                "--model.init_args.use_chat_template=false",
                "--model.init_args.num_iterations=3",
            ],
            run=False,
        )
    assert cli.trainer.max_epochs == 3
    assert not any("max_epochs" in str(w.message) for w in caught)


# ----------------------------------------------------------------------------------------------- progress bar
def trainer(max_steps=-1, max_epochs=None, epoch=0, global_step=0):
    return SimpleNamespace(max_steps=max_steps, max_epochs=max_epochs, current_epoch=epoch, global_step=global_step)


def test_a_max_steps_run_counts_updates():
    t = trainer(max_steps=24, max_epochs=-1, epoch=1, global_step=7)
    assert train_description(t) == "Update (epoch 2)"
    assert (train_total(t, batches=5), train_completed(t, batch_idx=2)) == (24, 7)


def test_an_epoch_run_counts_batches_of_the_epoch():
    t = trainer(max_epochs=20, epoch=0, global_step=7)
    assert train_description(t) == "Epoch 1/20"
    assert (train_total(t, batches=5), train_completed(t, batch_idx=2)) == (5, 3)
    assert "-" not in train_description(trainer(max_epochs=-1))


def test_the_cli_uses_the_counting_bar_unless_one_is_configured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main([*QUICK[:-2], "--model.init_args.max_new_tokens=4"], run=False)
    assert type(cli.trainer.progress_bar_callback) is type(progress_bar())
    cli = main([*QUICK[:-2], "--trainer.callbacks", "lightning.pytorch.callbacks.TQDMProgressBar"], run=False)
    assert type(cli.trainer.progress_bar_callback).__name__ == "TQDMProgressBar"


@pytest.mark.parametrize("bar", ["rich", "tqdm"])
def test_the_bar_runs_through_a_fit(bar, tmp_path, monkeypatch, capsys):
    import lightning.pytorch as pl
    from test_magrpo import ITEMS, make_module

    from comlrl_lightning import TaskDataModule
    from comlrl_lightning.callbacks import progress

    if bar == "rich" and not hasattr(progress, "UpdateRichProgressBar"):
        pytest.skip("rich is not installed")
    callback = progress.UpdateRichProgressBar() if bar == "rich" else progress.UpdateTQDMProgressBar()
    trainer = pl.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[callback],
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
    )
    trainer.fit(
        make_module(eval_interval=1, eval_num_samples=1),
        datamodule=TaskDataModule(dataset=ITEMS, eval_dataset=ITEMS[:1], prompts_per_step=2),
    )
    assert trainer.global_step == 2
    out = capsys.readouterr().out  # the evaluations' results, printed above the bar
    assert "evaluation at update 0 (env_step 0): eval/turn_1/reward_mean" in out, out
    assert "final evaluation at update 2" in out
    assert {"reward", "loss"} <= set(trainer.progress_bar_metrics)


# ----------------------------------------------------------------------------------------------- fail and resume
RESUMABLE = [
    *QUICK[:2],
    "--trainer.max_steps=6",
    "--checkpoint_every_n_updates=2",
    "--trainer.enable_progress_bar=false",
    "--model.init_args.max_new_tokens=4",
    "--model.init_args.eval_interval=0",
]


def cli_process(tmp_path, *args, **env):
    """``python -m comlrl_lightning fit`` in its own process (as a user runs it; `tests/` importable)."""
    import os
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-m", "comlrl_lightning", "fit", *RESUMABLE, *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO / "tests"), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def checkpoint_weights(path):
    import torch

    return torch.load(path, weights_only=False)["state_dict"]


def test_kill_and_resume_from_the_cli_with_last_and_with_an_explicit_path(tmp_path, monkeypatch):
    """A run killed (SIGKILL) after its step-4 checkpoint resumes from the CLI — with `--ckpt_path last` and with
    the checkpoint's path — to exactly the weights of an uninterrupted run (the killed and resumed runs each in
    their own process; the uninterrupted one in this process, while the first runs)."""
    import signal
    import time

    import torch

    root = tmp_path / "runs"
    step4 = root / "quickstart" / "version_0" / "checkpoints"
    proc = cli_process(
        tmp_path,
        "--trainer.default_root_dir",
        str(root),
        "--model.init_args.reward_func",
        "cli_fixtures.story_reward_that_hangs_after_a_checkpoint",
        HANG_AFTER=str(step4 / "*step=4.ckpt"),
    )
    monkeypatch.chdir(tmp_path)
    main(["fit", *RESUMABLE, "--trainer.default_root_dir", str(tmp_path / "full")])
    deadline = time.monotonic() + 600  # a hang's bound, not a speed: a loaded machine takes minutes
    last = step4 / "last.ckpt"
    while not (last.exists() and last.resolve().name.endswith("step=4.ckpt")):  # the file, then the link to it
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no step-4 checkpoint"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    checkpoint = (step4 / "last.ckpt").resolve()
    assert checkpoint.name.endswith("step=4.ckpt")
    expected = checkpoint_weights(next((tmp_path / "full").rglob("*step=6.ckpt")))

    for version, ckpt_path in ((1, "last"), (2, str(checkpoint))):
        resumed = cli_process(tmp_path, "--trainer.default_root_dir", str(root), "--ckpt_path", ckpt_path)
        assert resumed.wait() == 0, resumed.stderr.read().decode()[-2000:]
        got = checkpoint_weights(next(root.glob(f"quickstart/version_{version}/checkpoints/*step=6.ckpt")))
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=0, rtol=0)


def test_a_crash_mid_run_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    import torch

    from comlrl_lightning.envs import toy

    calls = {"n": 0}

    def reward_that_fails_on_its_fifth_call(*completions, batch_items=None):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("the reward server went away")
        return toy.story_reward(*completions, batch_items=batch_items)

    monkeypatch.setattr(toy, "flaky_story_reward", reward_that_fails_on_its_fifth_call, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="the reward server went away"):
        main(
            [
                "fit",
                *RESUMABLE,
                "--trainer.default_root_dir",
                str(tmp_path),
                "--model.init_args.reward_func",
                "comlrl_lightning.envs.toy.flaky_story_reward",
            ]
        )
    checkpoints = tmp_path / "quickstart" / "version_0" / "checkpoints"
    last = (checkpoints / "last.ckpt").resolve()  # one update per step: the 5th reward call is in step 5
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert last.name == "epoch=0-step=4.ckpt" and torch.load(last, weights_only=False)["global_step"] == 4


def test_a_checkpoint_is_written_straight_to_a_partial_file_that_replaces_the_old_one_whole(tmp_path, monkeypatch):
    """FileCheckpointIO hands torch.save the file itself (Lightning's default, a memory buffer it then copies out);
    a save that fails half-way leaves the previous checkpoint as it was and nothing beside it."""
    import io

    import fsspec
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from comlrl_lightning.callbacks.checkpoints import FileCheckpointIO

    save, destinations = torch.save, []

    def spy(obj, f, *args, **kwargs):
        destinations.append(type(f))
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", spy)
    path = tmp_path / "checkpoints" / "epoch=0-step=1.ckpt"
    FileCheckpointIO().save_checkpoint({"step": 1, "w": torch.arange(6.0)}, path)
    assert destinations == [io.BufferedWriter] and [p.name for p in path.parent.iterdir()] == [path.name]
    assert torch.load(path)["step"] == 1 and torch.equal(torch.load(path)["w"], torch.arange(6.0))
    TorchCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "lightning.ckpt")
    assert destinations[-1] is io.BytesIO  # what is avoided

    def fails_half_way(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", fails_half_way)
    with pytest.raises(OSError, match="No space left"):
        FileCheckpointIO().save_checkpoint({"step": 2, "w": torch.zeros(6)}, path)
    assert [p.name for p in path.parent.iterdir()] == [path.name] and torch.load(path)["step"] == 1

    monkeypatch.setattr(torch, "save", spy)
    FileCheckpointIO().save_checkpoint({"step": 3}, "memory://run/last.ckpt")  # a remote path: Lightning's way
    memory = fsspec.filesystem("memory")
    assert destinations[-1] is io.BytesIO and memory.exists("/run/last.ckpt")
    memory.rm("/run", recursive=True)
    with pytest.raises(TypeError):
        FileCheckpointIO().save_checkpoint({"step": 3}, path, storage_options={"x": 1})  # as Lightning's


def test_run_checkpoints_write_with_file_checkpoint_io_unless_the_run_chose_its_own(tmp_path):
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch import Trainer

    from comlrl_lightning.callbacks.checkpoints import FileCheckpointIO, RunCheckpoints

    class Mine(TorchCheckpointIO):
        pass

    for plugins, expected in (([], FileCheckpointIO), ([Mine()], Mine)):
        trainer = Trainer(logger=False, default_root_dir=tmp_path, plugins=plugins, enable_progress_bar=False)
        RunCheckpoints(1).setup(trainer, None, "fit")
        assert type(trainer.strategy.checkpoint_io) is expected


def test_ckpt_path_last_without_a_checkpoint_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *RESUMABLE, "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", "last"])
    assert exit_info.value.code == 2
    assert "ckpt_path last: no checkpoint under" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- test and predict
def counting_logger(agent_completions_turns, batch_items):
    return [{"items": 1, "agents": len(agent_completions_turns)} for _ in batch_items]


def summing_aggregator(metrics):
    return {"items": sum(m["items"] for m in metrics), "agents": metrics[0]["agents"]}


def test_the_test_subcommand_evaluates_the_test_items_with_the_eval_logger(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main(
        [
            "test",
            *QUICK,
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--data.init_args.test_dataset",
            "comlrl_lightning.envs.toy.story_tasks",
            "--data.init_args.max_eval_items",
            "3",
            "--data.init_args.eval_batch_size",
            "2",
            "--model.init_args.eval_logger",
            "test_cli.counting_logger",
            "--model.init_args.eval_aggregator",
            "test_cli.summing_aggregator",
        ]
    )
    metrics = cli.trainer.callback_metrics
    assert float(metrics["test/items"]) == 3 and float(metrics["test/agents"]) == 2  # every test item, once
    assert "test/turn_1/reward_mean" in metrics and not any(k.startswith("eval/") for k in metrics)


def test_predict_writes_each_items_joint_answer_from_a_checkpoint_or_saved_agents(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    fit = main(["fit", *QUICK, "--trainer.default_root_dir", str(tmp_path / "fit")])
    checkpoint = next((tmp_path / "fit").rglob("*.ckpt"))
    fit.model.save_pretrained(tmp_path / "team")

    def predict(*args):
        main(
            [
                "predict",
                *QUICK,
                "--trainer.default_root_dir",
                str(tmp_path / "predict"),
                "--data.init_args.predict_dataset",
                "comlrl_lightning.envs.toy.story_eval_tasks",
                *args,
            ]
        )
        path = max(tmp_path.rglob("predictions.jsonl"), key=lambda p: p.stat().st_mtime)
        return path, [json.loads(line) for line in path.read_text().splitlines()]

    from comlrl_lightning.envs.toy import story_eval_tasks

    # A checkpoint's predictions go into its run's folder; the saved agents' into <root>/<name>/predict/.
    (path, from_checkpoint), (path_agents, from_agents) = (
        predict("--ckpt_path", str(checkpoint)),
        predict("--model.init_args.agents", f"[{tmp_path / 'team' / 'agent_0'}, {tmp_path / 'team' / 'agent_1'}]"),
    )
    assert path.parent == tmp_path / "fit" / "quickstart" / "version_0" / "predict" / "version_0"
    assert path_agents.parent == tmp_path / "predict" / "quickstart" / "predict" / "version_0"
    for rows in (from_checkpoint, from_agents):
        assert [r["item"] for r in rows] == story_eval_tasks()
        for row in rows:
            assert len(row["agents"]) == 2 and len(row["rewards"]) == 1
            assert all(len(a["prompts"]) == len(a["completions"]) == 1 for a in row["agents"])
            assert row["item"]["topic"] in row["agents"][0]["prompts"][0]
