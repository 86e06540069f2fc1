"""What a run leaves behind (issue 33): one metrics row per update with evaluation on the same axis, the CLI's
conventions for a plain ``lightning.Trainer``, one folder per run (W&B and several loggers too), progress that a log
file shows, a checkpoint on Ctrl-C / SIGTERM, and ``--ckpt_path last|best|PATH`` that really loads what it names in
``validate`` / ``test`` / ``predict``, logging into the run it evaluates."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from comlrl_lightning import MAGRPO, TaskDataModule
from comlrl_lightning.cli import main
from comlrl_lightning.envs import toy

REPO = Path(__file__).resolve().parents[1]
QUICK = [
    "--config",
    str(REPO / "configs" / "quickstart.yaml"),
    "--trainer.enable_progress_bar=false",
    "--model.init_args.max_new_tokens=4",
    "--trainer.enable_model_summary=false",
]
ITEMS = [{"topic": f"topic {i}"} for i in range(8)]


def rows_of(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def tiny_module(**overrides):
    kwargs = dict(
        agents="tiny",
        num_agents=2,
        reward_func=toy.story_reward,
        formatters=[toy.opening_prompt, toy.closing_prompt],
        num_generations=2,
        max_new_tokens=4,
        rollout_buffer_size=2,
        eval_interval=2,
        eval_num_samples=2,
        log_completions=False,
    )
    return MAGRPO(**{**kwargs, **overrides})


# ----------------------------------------------------------------------------------------------- one row per update
def test_one_row_per_update_at_its_step_with_evaluation_on_the_same_axis(tmp_path):
    """prompts_per_step 1 with a buffer of 2 nodes: a step in two only fills the buffer. Each of the 3 updates is
    one row at steps 0, 1, 2 (the updates done before it), holding the rollout reward of the 2 batches it trained
    on; evaluations are rows at the step of the weights they evaluate, the last one (``eval_at_end``) at 3."""
    seed_everything(0)
    trainer = Trainer(
        max_steps=3,
        logger=CSVLogger(tmp_path, name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(tiny_module(), datamodule=TaskDataModule(dataset=ITEMS, eval_dataset=ITEMS[:2], prompts_per_step=1))
    rows = rows_of(tmp_path / "run" / "version_0" / "metrics.csv")
    training = [r for r in rows if r["loss"]]
    evaluation = [r for r in rows if r["eval/turn_1/reward_mean"]]
    assert [int(r["step"]) for r in training] == [0, 1, 2]
    assert [float(r["env_step"]) for r in training] == [4.0, 8.0, 12.0]  # 2 batches x 1 item x K=2 per update
    assert all(r["rollout/turn_1/reward_mean"] and r["timing_s/generate"] for r in training)
    assert len(rows) == len(training) + len(evaluation)  # no row without an update or an evaluation
    # eval_interval 2 counts training batches (0, 2, 4: at updates 0, 1, 2), then the final evaluation at 3
    assert [int(r["step"]) for r in evaluation] == [0, 1, 2, 3]
    assert not any(r["loss"] for r in evaluation) and not any(r["eval/turn_1/reward_mean"] for r in training)
    # each metric under one name: the sampled reward is rollout/..., not also turn_1/reward_mean
    assert "turn_1/reward_mean" not in rows[0]
    assert float(trainer.callback_metrics["loss"]) == pytest.approx(float(training[-1]["loss"]))


def test_validate_and_test_rows_sit_at_the_checkpoints_step(tmp_path):
    seed_everything(0)
    module = tiny_module(eval_interval=0, eval_at_end=False)
    data = TaskDataModule(dataset=ITEMS, eval_dataset=ITEMS[:2], prompts_per_step=2)
    trainer = Trainer(
        max_steps=2,
        logger=CSVLogger(tmp_path, name="run"),
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, datamodule=data)
    checkpoint = tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt"
    assert checkpoint.exists()  # RunCheckpoints replaced Lightning's default ModelCheckpoint
    fresh = tiny_module(eval_interval=0)
    evaluator = Trainer(
        logger=CSVLogger(tmp_path, name="eval"),
        enable_progress_bar=False,
        accelerator="cpu",
        devices=1,
        enable_model_summary=False,
    )
    (metrics,) = evaluator.validate(fresh, datamodule=data, ckpt_path=str(checkpoint), verbose=False)
    (row,) = rows_of(tmp_path / "eval" / "version_0" / "metrics.csv")
    assert int(row["step"]) == 2 and float(row["env_step"]) == module.env_step
    assert float(row["eval/turn_1/reward_mean"]) == pytest.approx(metrics["eval/turn_1/reward_mean"])


# ----------------------------------------------------------------------------------------------- a plain Trainer
def test_a_plain_trainer_gets_the_clis_conventions(tmp_path, monkeypatch, capsys):
    """``Trainer(max_steps=2).fit(module)``: our bar (lines here, stdout being captured), one row per update in the
    default logger (TensorBoard), last.ckpt; a bar or checkpoint the user configured is kept."""
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

    from comlrl_lightning.analysis import load_run
    from comlrl_lightning.callbacks.checkpoints import RunCheckpoints
    from comlrl_lightning.callbacks.progress import UpdateLineProgressBar

    monkeypatch.chdir(tmp_path)
    seed_everything(0)
    trainer = Trainer(max_steps=2, accelerator="cpu", devices=1, enable_model_summary=False)
    trainer.fit(tiny_module(), datamodule=TaskDataModule(dataset=ITEMS, eval_dataset=ITEMS[:2], prompts_per_step=2))
    assert isinstance(trainer.progress_bar_callback, UpdateLineProgressBar)
    assert [type(c) for c in trainer.checkpoint_callbacks] == [RunCheckpoints]
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").exists()
    out = capsys.readouterr().out
    assert re.search(r"^update 1/2 \| reward [-\d.]+ \| loss [-\de.]+ \|", out, re.M), out
    assert re.search(r"^update 2/2 ", out, re.M) and "evaluation at update 0" in out
    run = load_run(tmp_path / "lightning_logs", verbose=False)  # TensorBoard event files
    assert run["loss"].dropna().size == 2 and run["eval/turn_1/reward_mean"].dropna().size >= 1

    mine = TQDMProgressBar(refresh_rate=5)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "mine", save_top_k=0)
    trainer = Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        callbacks=[mine, checkpoint],
        logger=False,
        enable_model_summary=False,
    )
    trainer.fit(tiny_module(eval_interval=0, eval_at_end=False), datamodule=TaskDataModule(dataset=ITEMS))
    assert trainer.progress_bar_callback is mine and trainer.checkpoint_callbacks == [checkpoint]


# ----------------------------------------------------------------------------------------------- one folder per run
def test_every_logger_gets_its_own_run_folder_wandb_and_several_loggers(tmp_path, monkeypatch):
    """Two W&B runs (offline) in one save_dir each get <save_dir>/<project>/<run id>/ with their own config,
    completions and checkpoints; with a CSV and a TensorBoard logger, everything is in the first one's folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with_wandb = [
        "--trainer.logger",
        "lightning.pytorch.loggers.WandbLogger",
        "--trainer.logger.init_args.offline",
        "true",
        "--trainer.logger.init_args.project",
        "proj",
        "--trainer.max_steps=1",
        "--trainer.default_root_dir",
        str(tmp_path / "w"),
    ]
    folders = []
    for _ in range(2):
        cli = main(["fit", *QUICK, *with_wandb])
        folder = Path(cli.trainer.checkpoint_callback.dirpath).parent
        folders.append(folder)
        assert folder.parent == tmp_path / "w" / "proj"
        assert {"config.yaml", "completions.jsonl"} <= {p.name for p in folder.iterdir()}
        assert (folder / "checkpoints" / "last.ckpt").exists()
        import wandb

        wandb.finish()  # a run per process, as from the command line (in one process W&B would go on with it)
    assert folders[0] != folders[1] and not (tmp_path / "w" / "config.yaml").exists()
    assert len((folders[0] / "completions.jsonl").read_text().splitlines()) == len(
        (folders[1] / "completions.jsonl").read_text().splitlines()
    )  # nobody appended to the first run's

    both = (
        '[{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"name": "both"}}, '
        '{"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"name": "both"}}]'
    )
    cli = main(
        [
            "fit",
            *QUICK,
            "--trainer.max_steps=1",
            "--trainer.default_root_dir",
            str(tmp_path / "two"),
            f"--trainer.logger={both}",
        ]
    )
    assert len(cli.trainer.loggers) == 2
    folder = tmp_path / "two" / "both" / "version_0"
    names = {p.name for p in folder.iterdir()}
    assert {"metrics.csv", "config.yaml", "completions.jsonl", "checkpoints"} <= names
    assert any(n.startswith("events.out.tfevents") for n in names)  # both loggers in one folder, not version_1


# ----------------------------------------------------------------------------------------------- progress in a log file
def test_a_fit_logged_to_a_file_prints_a_line_per_update_and_sigterm_saves_and_exits_143(tmp_path):
    """``fit > fit.log`` (as under SLURM or nohup): a plain line per update and the evaluations, as they happen. A
    SIGTERM (a cluster pre-empting the job) after update 3: a checkpoint of the last completed update, exit 143."""
    import time

    log = tmp_path / "fit.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "comlrl_lightning",
                "fit",
                *QUICK[:2],
                "--model.init_args.max_new_tokens=4",
                "--data.init_args.prompts_per_step=1",
                "--trainer.max_steps=200",
                "--trainer.default_root_dir",
                str(tmp_path / "runs"),
            ],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 240
        while not re.search(r"^update 3/200 ", log.read_text(), re.M):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)  # the line is there as soon as the update is: each line is flushed
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    text = log.read_text()
    for n in (1, 2, 3):
        assert re.search(
            rf"^update {n}/200 \| reward [-\d.]+ \| loss [-\de.]+ \| .*(s/update|updates/s) \| ETA \S+$", text, re.M
        ), text
    assert re.search(r"^evaluation at update \d+ \(env_step \d+\): eval/turn_1/reward_mean ", text, re.M), text
    assert "\r" not in text and "final evaluation" not in text  # no evaluation delays a pre-empted job
    assert proc.returncode == 143, err[-2000:]
    assert "SIGTERM: stopping at the next safe point, then writing the checkpoint of the last completed update" in err
    step = torch.load(tmp_path / "runs" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)[
        "global_step"
    ]
    assert 3 <= step < 200


def test_the_bars_show_slow_steps_in_seconds_and_print_evaluations():
    from types import SimpleNamespace

    from comlrl_lightning.callbacks import progress
    from comlrl_lightning.callbacks.progress import duration, evaluation_line, rate

    assert [duration(s) for s in (4.4, 246, 7500)] == ["4s", "4m06s", "2h05m"]
    assert (rate(12.34), rate(0.4), rate(None)) == ("12.3 s/update", "2.50 updates/s", "")
    line = evaluation_line(SimpleNamespace(global_step=8), {"eval/turn_1/reward_mean": 2.125, "env_step": 64.0}, True)
    assert line == "final evaluation at update 8 (env_step 64): eval/turn_1/reward_mean 2.125"
    if hasattr(progress, "UpdateSpeedColumn"):  # rich: Lightning's column shows 0.00it/s for a 12 s step
        column = progress.UpdateSpeedColumn(style="")
        assert column.render(SimpleNamespace(fields={"seconds_per_update": 12.34}, speed=None)).plain == "12.3 s/update"
        assert column.render(SimpleNamespace(fields={}, speed=0.05)).plain == "20.0s/it"
        assert column.render(SimpleNamespace(fields={}, speed=3.0)).plain == "3.00it/s"


# ----------------------------------------------------------------------------------------------- Ctrl-C / SIGTERM
def test_ctrl_c_writes_a_checkpoint_that_resumes_exactly(tmp_path, monkeypatch):
    """SIGINT during update 3's step: that step finishes, a checkpoint is written and the fit stops; resuming it with
    --ckpt_path last ends with the weights of an uninterrupted run (in this process: the handler is ours)."""
    from comlrl_lightning.envs import toy as toy_module

    calls = {"n": 0}

    def reward_interrupted_on_its_third_call(*completions, batch_items=None):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return toy.story_reward(*completions, batch_items=batch_items)

    monkeypatch.setattr(toy_module, "interrupted_story_reward", reward_interrupted_on_its_third_call, raising=False)
    monkeypatch.chdir(tmp_path)
    run = [*QUICK, "--trainer.max_steps=4", "--model.init_args.eval_interval=0", "--checkpoint_every_n_updates=50"]
    full = main(["fit", *run, "--trainer.default_root_dir", str(tmp_path / "full")])
    handler = signal.getsignal(signal.SIGINT)
    stopped = main(
        [
            "fit",
            *run,
            "--trainer.default_root_dir",
            str(tmp_path / "cut"),
            "--model.init_args.reward_func",
            "comlrl_lightning.envs.toy.interrupted_story_reward",
        ]
    )
    assert stopped.trainer.comlrl_interrupted_by == signal.SIGINT and 0 < stopped.trainer.global_step < 4
    assert signal.getsignal(signal.SIGINT) is handler  # the handlers are put back
    last = tmp_path / "cut" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == stopped.trainer.global_step
    resumed = main(["fit", *run, "--trainer.default_root_dir", str(tmp_path / "cut"), "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 4
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    # the record: the two runs joined into one row per update, equal to the uninterrupted run's
    from comlrl_lightning.analysis import load_run

    joined = load_run(tmp_path / "cut", verbose=False)
    assert [Path(d).name for d in joined.attrs["run_dirs"]] == ["version_0", "version_1"]
    uninterrupted = load_run(tmp_path / "full", verbose=False)
    assert joined["step"].tolist() == uninterrupted["step"].tolist() == [0, 1, 2, 3]
    assert joined["loss"].tolist() == pytest.approx(uninterrupted["loss"].tolist(), abs=0, rel=0)


# ----------------------------------------------------------------------------------------------- --ckpt_path everywhere
def test_validate_test_predict_load_the_checkpoint_they_name_and_log_into_its_run(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    root = ["--trainer.default_root_dir", str(tmp_path)]
    fit = main(
        [
            "fit",
            *QUICK,
            *root,
            "--trainer.max_steps=2",
            "--model.init_args.eval_interval=0",
            "--checkpoint_every_n_updates=1",
            "--checkpoint_total_limit=null",
        ]
    )
    run = tmp_path / "quickstart" / "version_0"
    fit_config = (run / "config.yaml").read_text()
    trained = {k: v.clone() for k, v in fit.model.state_dict().items()}
    step1 = torch.load(run / "checkpoints" / "epoch=0-step=1.ckpt", weights_only=False)["state_dict"]

    def weights_of(cli):
        return cli.model.state_dict()

    for subcommand in ("validate", "test", "predict"):
        cli = main([subcommand, *QUICK, *root, "--ckpt_path", "last"])
        for key, value in trained.items():  # the trained team, not the random initialisation
            torch.testing.assert_close(weights_of(cli)[key], value, atol=0, rtol=0)
        assert Path(cli.trainer.log_dir) == run / subcommand / "version_0"
    explicit = main(["validate", *QUICK, *root, "--ckpt_path", str(run / "checkpoints" / "epoch=0-step=1.ckpt")])
    for key, value in step1.items():
        torch.testing.assert_close(weights_of(explicit)[key], value, atol=0, rtol=0)
    assert sorted(p.name for p in (tmp_path / "quickstart").iterdir()) == ["version_0"]  # no new version_<n>
    rows = rows_of(run / "validate" / "version_0" / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [2] and rows[0]["eval/turn_1/reward_mean"]
    assert [int(r["step"]) for r in rows_of(run / "validate" / "version_1" / "metrics.csv")] == [1]
    assert rows_of(run / "test" / "version_0" / "metrics.csv")[0]["test/turn_1/reward_mean"]
    assert json.loads((run / "predict" / "version_0" / "predictions.jsonl").read_text().splitlines()[0])["agents"]
    assert (run / "config.yaml").read_text() == fit_config  # the training run's own files are left alone

    best = main(["validate", *QUICK, *root, "--ckpt_path", "best"])  # no monitor: Lightning's best is the newest
    for key, value in trained.items():
        torch.testing.assert_close(weights_of(best)[key], value, atol=0, rtol=0)
