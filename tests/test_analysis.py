"""comlrl_lightning.analysis: reading a run back (CSV and TensorBoard) and plotting it; tables of what a team wrote."""

from __future__ import annotations

import json
import os
import runpy
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from test_magrpo import ITEMS, make_module

from comlrl_lightning import TaskDataModule
from comlrl_lightning.analysis import (
    PLOT_KINDS,
    find_run_file,
    load_reward_distributions,
    load_run,
    plot_reward_distributions,
    plot_run,
    predictions_table,
)
from comlrl_lightning.core.distributions import distribution_record

# A CSVLogger file as a MAGRPO run writes it: an evaluation row before the first update, one row per update, and
# an evaluation row that shares its env_step with the update before it.
CSV = """\
env_step,epoch,eval/turn_1/reward_mean,loss,rollout/turn_1/reward_mean,rollout/turn_1/reward_std,step,timing_s/generate,timing_s/update
0.0,,1.5,,,,0,,
4.0,0,,0.5,1.0,0.25,0,2.0,1.0
8.0,0,,0.25,2.0,0.5,1,3.0,1.5
8.0,,2.5,,,,2,,
"""


def write_run(root, version=0, text=CSV):
    run = root / "run" / f"version_{version}"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text(text)
    return run


def axis_by_title(figure, title):
    return next(ax for ax in figure.axes if ax.get_title() == title)


def test_load_run_indexes_csv_rows_by_env_step(tmp_path):
    run = write_run(tmp_path)
    for path in (tmp_path, run, run / "metrics.csv"):  # the root above a run, the run, or the file itself
        frame = load_run(path)
        assert frame.index.name == "env_step"
        assert frame.index.tolist() == [0.0, 4.0, 8.0, 8.0]
        assert frame["step"].tolist() == [0, 0, 1, 2]
        assert frame["loss"].dropna().tolist() == [0.5, 0.25]
        assert frame["eval/turn_1/reward_mean"].dropna().to_dict() == {0.0: 1.5, 8.0: 2.5}
        assert frame.attrs["source"] == str(run / "metrics.csv") and frame.attrs["run_dir"] == str(run)


def test_load_run_without_env_step_uses_lightning_step(tmp_path):
    write_run(tmp_path, text="loss,step\n0.5,0\n0.25,1\n")
    frame = load_run(tmp_path)
    assert frame.index.name == "step" and frame.index.tolist() == [0, 1] and frame["loss"].tolist() == [0.5, 0.25]


def test_load_run_takes_the_newest_run_under_a_folder(tmp_path):
    old, new = write_run(tmp_path, 0), write_run(tmp_path, 1, text="env_step,loss,step\n2.0,9.0,0\n")
    os.utime(old / "metrics.csv", (time.time() - 60, time.time() - 60))
    assert find_run_file(tmp_path) == new / "metrics.csv"
    assert load_run(tmp_path)["loss"].tolist() == [9.0]


def test_load_run_takes_the_newest_training_run_not_an_evaluation_of_it(tmp_path, capsys):
    """``validate`` logs a 1-row evaluation into ``<run>/validate/version_0/`` after the training run: a folder
    above both still gives the training run."""
    run = write_run(tmp_path)
    evaluation = run / "validate" / "version_0"
    evaluation.mkdir(parents=True)
    (evaluation / "metrics.csv").write_text("env_step,eval/turn_1/reward_mean,step\n8.0,2.0,2\n")
    os.utime(run / "metrics.csv", (time.time() - 60, time.time() - 60))
    frame = load_run(tmp_path)
    assert frame.attrs["run_dir"] == str(run) and frame["loss"].dropna().tolist() == [0.5, 0.25]
    assert f"load_run: read {run} (steps 0-2)" in capsys.readouterr().out
    assert load_run(evaluation, verbose=False)["eval/turn_1/reward_mean"].tolist() == [2.0]  # asked for: given


def test_load_run_joins_a_resumed_run_to_its_start(tmp_path, capsys):
    """version_1 resumed from version_0's step-2 checkpoint (resumed_from.txt): the frame is version_0's rows before
    step 2 then version_1's; version_0's rows from step 2 on (redone after the resume) are dropped."""
    first = write_run(tmp_path, 0, text="env_step,loss,step\n4.0,1.0,0\n8.0,2.0,1\n12.0,3.0,2\n")
    second = write_run(tmp_path, 1, text="env_step,loss,step\n12.0,30.0,2\n16.0,40.0,3\n")
    (second / "resumed_from.txt").write_text(str(first / "checkpoints" / "epoch=0-step=2.ckpt") + "\n")
    os.utime(first / "metrics.csv", (time.time() - 60, time.time() - 60))
    frame = load_run(tmp_path)
    assert frame["step"].tolist() == [0, 1, 2, 3] and frame["loss"].tolist() == [1.0, 2.0, 30.0, 40.0]
    assert frame.attrs["run_dirs"] == [str(first), str(second)] and frame.attrs["run_dir"] == str(second)
    out = capsys.readouterr().out
    assert f"{first} (steps 0-1) + {second} (steps 2-3) (a resumed run, joined)" in out


def test_missing_or_empty_runs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as error:
        load_run(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(error.value)
    with pytest.raises(FileNotFoundError, match="No metrics.csv .* or TensorBoard event file") as error:
        load_run(tmp_path)
    assert str(tmp_path) in str(error.value)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="neither a metrics.csv nor a TensorBoard event file"):
        load_run(tmp_path / "notes.txt")
    write_run(tmp_path, text="step,loss\n")
    with pytest.raises(ValueError, match="holds no metrics yet"):
        load_run(tmp_path)


def test_reward_curve_plots_the_logged_values_with_a_std_band(tmp_path):
    write_run(tmp_path)
    figure = plot_run(tmp_path, "rewards")
    ax = axis_by_title(figure, "team reward")
    (line,) = ax.get_lines()
    assert line.get_label() == "rollout/turn_1/reward_mean"
    assert line.get_xdata().tolist() == [4.0, 8.0] and line.get_ydata().tolist() == [1.0, 2.0]
    (band,) = ax.collections
    lows_and_highs = band.get_paths()[0].vertices[:, 1]
    assert {0.75, 1.25, 1.5, 2.5} <= {round(float(v), 6) for v in lows_and_highs}  # mean ± std
    assert ax.get_xlabel() == "env_step"


def test_one_legend_entry_per_metric_beside_the_chart(tmp_path):
    """Metrics whose values happen to be equal keep their own entries (notebook 04's advantages figure merged
    ``agent_0/zero_advantage_ratio = agent_1/advantage_mean``); the legend sits right of the axes, off the data;
    advantage statistics and the zero-advantage share get their own charts, apart from the returns."""
    write_run(
        tmp_path,
        text="env_step,agent_0/advantage_mean,agent_1/advantage_mean,agent_0/zero_advantage_ratio,"
        "turn_1/expected_return,step\n4.0,0.0,0.0,0.0,1.0,0\n8.0,0.0,0.0,0.0,2.5,1\n",
    )
    figure = plot_run(tmp_path, "advantages")
    assert [ax.get_title() for ax in figure.axes if ax.get_visible()] == [
        "returns and critic values",
        "advantages",
        "samples with advantage 0",
    ]
    advantages = axis_by_title(figure, "advantages")
    assert [t.get_text() for t in advantages.get_legend().get_texts()] == [
        "agent_0/advantage_mean",
        "agent_1/advantage_mean",
    ]
    figure.canvas.draw()
    for ax in figure.axes:
        if ax.get_visible():
            assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1  # right of the plot area


def test_several_kinds_and_stacked_timing(tmp_path):
    write_run(tmp_path)
    figure = plot_run(load_run(tmp_path), ["timing", "eval"], title="demo")
    assert [ax.get_title() for ax in figure.axes] == ["time per phase", "evaluation"]
    timing = axis_by_title(figure, "time per phase")
    assert timing.get_ylim()[1] >= 4.5  # stacked: generate + update at env_step 8 = 3.0 + 1.5
    (line,) = axis_by_title(figure, "evaluation").get_lines()
    assert line.get_xdata().tolist() == [0.0, 8.0] and line.get_ydata().tolist() == [1.5, 2.5]


def test_absent_metrics_are_skipped_with_a_message_and_bad_kinds_named(tmp_path):
    write_run(tmp_path)
    with pytest.warns(UserWarning, match="no metric for 'KL to the reference', 'KL penalty'"):
        figure = plot_run(tmp_path, "kl")
    assert not figure.axes and "Nothing to plot for kl" in figure.texts[0].get_text()
    with pytest.warns(UserWarning, match="completion length"):
        figure = plot_run(tmp_path, ["rewards", "lengths"])
    assert [ax.get_title() for ax in figure.axes if ax.get_visible()] == ["team reward"]
    with pytest.raises(ValueError, match=r"kind must be one of \[.*'rewards'.*\], got 'reward'"):
        plot_run(tmp_path, "reward")
    assert set(PLOT_KINDS) >= {"rewards", "lengths", "advantages", "kl", "timing", "policy_lag", "eval"}


def test_updates_without_new_joint_actions_go_against_step_and_rounds_against_round(tmp_path):
    # MARLHF's reward-model updates evaluate no joint action (env_step stays 0); iterative runs log once per round.
    write_run(
        tmp_path,
        text="env_step,iter/current_iteration,iter/current_win_rate,reward_model/accuracy,step\n"
        "0.0,1,0.25,,0\n0.0,,,0.5,0\n0.0,,,1.0,1\n6.0,2,0.75,,2\n",
    )
    with pytest.warns(UserWarning, match="'reward-model loss', 'reward-model margin'"):
        accuracy = axis_by_title(plot_run(tmp_path, "reward_model"), "reward-model accuracy")
    assert accuracy.get_xlabel() == "step" and accuracy.get_lines()[0].get_xdata().tolist() == [0, 1]
    with pytest.warns(UserWarning, match="reward per round"):
        rounds = axis_by_title(plot_run(tmp_path, "iterations"), "current vs comparator")
    assert rounds.get_xlabel() == "round"
    assert rounds.get_lines()[0].get_xdata().tolist() == [1, 2] and rounds.get_lines()[0].get_ydata().tolist() == [
        0.25,
        0.75,
    ]


def test_the_readme_picture_script(tmp_path):
    write_run(tmp_path)
    script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "docs" / "images" / "make_reward_curve.py"))
    output = script["main"]([str(tmp_path), "--output", str(tmp_path / "curve.png")])
    assert output.read_bytes().startswith(b"\x89PNG")


def test_a_real_fit_reads_back_the_same_from_csv_and_tensorboard(tmp_path):
    """One tiny MAGRPO fit logs to both loggers; both files load to the same rows and values."""
    seed_everything(0)
    module = make_module(eval_interval=2, eval_num_samples=1, reference_kl_enabled=True, reference_kl_coef=0.1)
    trainer = Trainer(
        max_steps=3,
        logger=[CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, datamodule=TaskDataModule(dataset=ITEMS, eval_dataset=ITEMS[:2], prompts_per_step=2))
    csv, events = load_run(tmp_path / "csv"), load_run(tmp_path / "tb")
    assert events.attrs["source"].endswith("version_0") and csv.attrs["source"].endswith("metrics.csv")
    # eval rows at env_step 0 and 8 (every 2 batches) and the final one at 12, beside the update rows 4, 8, 12
    assert csv.index.tolist() == [0.0, 4.0, 8.0, 8.0, 12.0, 12.0]
    assert csv["step"].tolist() == [0, 0, 1, 2, 2, 3]
    assert events.index.tolist() == csv.index.tolist()
    shared = sorted(set(csv.columns) & set(events.columns))
    assert {
        "loss",
        "rollout/turn_1/reward_mean",
        "turn_1/reference_kl_mean",
        "timing_s/generate",
        "eval/turn_1/reward_mean",
        "completions/mean_length",
        "rollout/policy_lag",
        "step",
    } <= set(shared)
    np.testing.assert_allclose(events[shared].to_numpy(float), csv[shared].to_numpy(float), rtol=1e-6)
    (event_file,) = (tmp_path / "tb" / "version_0").glob("events.out.tfevents.*")
    pd.testing.assert_frame_equal(load_run(event_file), events, check_like=True)
    figure = plot_run(events, ["rewards", "lengths", "advantages", "kl", "timing", "policy_lag", "eval", "loss"])
    titles = [ax.get_title() for ax in figure.axes if ax.get_visible()]
    assert titles == [
        "team reward",
        "completion length",
        "completions cut at max_new_tokens",
        "returns and critic values",
        "advantages",
        "samples with advantage 0",
        "KL to the reference",
        "KL penalty",
        "time per phase",
        "policy lag (0 = on-policy)",
        "evaluation",
        "loss",
        "gradient norm",
    ]

    answers = Trainer(
        logger=False, default_root_dir=tmp_path, enable_progress_bar=False, accelerator="cpu", devices=1
    ).predict(module, datamodule=TaskDataModule(dataset=ITEMS, predict_dataset=ITEMS[:2], eval_batch_size=2))
    table = predictions_table(answers)
    assert table.columns.tolist() == ["prompt", "turn", "agent_0", "agent_1", "reward"]
    assert table["prompt"].tolist() == [item["prompt"] for item in ITEMS[:2]] and set(table["turn"]) == {1}
    assert all(isinstance(text, str) for text in table["agent_0"]) and table["reward"].between(0, 1).all()
    # the module's PredictionWriter wrote the same answers to <default_root_dir>/predictions.jsonl
    pd.testing.assert_frame_equal(predictions_table(tmp_path / "predictions.jsonl"), table)


def test_predictions_table_rejects_other_objects():
    with pytest.raises(ValueError, match="dicts with 'item', 'agents' and 'rewards'"):
        predictions_table([[{"prompt": "x"}]])


def test_reward_distributions_per_round(tmp_path):
    folder = tmp_path / "run" / "version_0" / "reward_distributions"
    folder.mkdir(parents=True)
    rounds = {1: ([0.0, 0.1, 2.9], [1.5]), 2: ([3.0, 3.0], [0.0, 1.4])}
    for number, (target, comparator) in rounds.items():
        record = distribution_record(
            number,
            0.0,
            3.0,
            target=target,
            comparator=comparator,
            selected_target=target,
            selected_comparator=comparator,
        )
        (folder / f"iteration_{number:04d}.json").write_text(json.dumps(record))
    records = load_reward_distributions(tmp_path)
    assert [r["iteration"] for r in records] == [1, 2]
    figure = plot_reward_distributions(tmp_path)
    assert [ax.get_title() for ax in figure.axes] == ["round 1", "round 2"]
    for ax, record, (target, comparator) in zip(figure.axes, records, rounds.values()):
        target_bars, comparator_bars = ax.containers
        assert [bar.get_height() for bar in target_bars] == record["candidate"]["target"]["counts"]
        assert [bar.get_height() for bar in comparator_bars] == record["candidate"]["comparator"]["counts"]
        assert sum(bar.get_height() for bar in target_bars) == len(target)
        assert sum(bar.get_height() for bar in comparator_bars) == len(comparator)
    assert [bar.get_height() for bar in figure.axes[1].containers[0]][-1] == 2  # 3.0 (the maximum) in the last bin
    with pytest.raises(FileNotFoundError, match="No reward_distributions/iteration_XXXX.json"):
        load_reward_distributions(write_run(tmp_path / "other"))
    with pytest.raises(ValueError, match="part must be one of"):
        plot_reward_distributions(records, part="pairs")
