"""The command line as a user meets it: where a run's files go, the progress bar, and what it prints."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from comlrl_lightning.callbacks.progress import progress_bar, train_completed, train_description, train_total
from comlrl_lightning.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICK = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.max_steps=1",
         "--trainer.enable_progress_bar=false", "--model.init_args.max_new_tokens=4"]


def run_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_every_file_of_a_run_goes_under_default_root_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", *QUICK, "--trainer.default_root_dir", str(tmp_path / "run")])
    files = run_files(tmp_path / "run")
    for name in ("metrics.csv", "hparams.yaml", "config.yaml", "completions.jsonl"):
        assert f"quickstart/version_0/{name}" in files, files
    assert any(f.startswith("quickstart/version_0/checkpoints/") and f.endswith(".ckpt") for f in files), files
    assert not (tmp_path / "outputs").exists()


def test_without_default_root_dir_the_run_goes_to_outputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", *QUICK])
    assert (tmp_path / "outputs" / "quickstart" / "version_0" / "metrics.csv").is_file()


def test_a_logger_without_save_dir_follows_default_root_dir_and_an_explicit_one_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", *QUICK, "--trainer.default_root_dir", str(tmp_path / "run"),
          "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger", "--trainer.logger.init_args.name", "tb"])
    assert any((tmp_path / "run" / "tb").rglob("events.out.tfevents.*"))
    main(["fit", *QUICK, "--trainer.default_root_dir", str(tmp_path / "run"),
          "--trainer.logger.init_args.save_dir", str(tmp_path / "elsewhere")])
    assert (tmp_path / "elsewhere" / "quickstart" / "version_0" / "metrics.csv").is_file()


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
        cli = main(["--config", str(REPO / "configs" / "madpo_iter.yaml"), "--model.init_args.agents=tiny",
                    "--model.init_args.use_chat_template=false", "--model.init_args.num_iterations=3"], run=False)
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
def test_the_bar_runs_through_a_fit(bar, tmp_path, monkeypatch):
    import lightning.pytorch as pl

    from comlrl_lightning.callbacks import progress
    from test_magrpo import ITEMS, make_module

    from comlrl_lightning import TaskDataModule

    if bar == "rich" and not hasattr(progress, "UpdateRichProgressBar"):
        pytest.skip("rich is not installed")
    callback = progress.UpdateRichProgressBar() if bar == "rich" else progress.UpdateTQDMProgressBar()
    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
                         callbacks=[callback], accelerator="cpu", devices=1, default_root_dir=tmp_path)
    trainer.fit(make_module(), datamodule=TaskDataModule(dataset=ITEMS, prompts_per_step=2))
    assert trainer.global_step == 2
