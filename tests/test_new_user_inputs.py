"""Inputs a new user gets wrong (or right in a way the first version did not expect), tried through the CLI and the
API: ``--ckpt_path last``/``best`` with every logger, a folder that cannot be written, an empty folder as a model, a
completion longer than the model's context, a malformed JSONL file, a resume whose fields changed."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace
from test_cli import QUICK

from comlrl_lightning.cli import main, resolve_ckpt_path

REPO = Path(__file__).resolve().parents[1]


def logger(kind: str, **init_args) -> Namespace:
    return Namespace(class_path=f"lightning.pytorch.loggers.{kind}", init_args=Namespace(**init_args))


def checkpoint(folder: Path, best: str | None = None) -> Path:
    """``folder/checkpoints/last.ckpt`` (recording ``best`` as its ModelCheckpoint's best) and ``step=1.ckpt``."""
    (folder / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {}, "global_step": 1}, folder / "checkpoints" / "step=1.ckpt")
    callbacks = {"ModelCheckpoint{}": {"best_model_path": best}} if best else {}
    torch.save({"state_dict": {}, "global_step": 1, "callbacks": callbacks}, folder / "checkpoints" / "last.ckpt")
    return folder / "checkpoints" / "last.ckpt"


def wandb_run(project: Path, run_id: str, name: str, age: float) -> Path:
    """A W&B run folder as the CLI leaves it (``config.yaml`` naming the run), its checkpoints ``age`` s old."""
    folder = project / run_id
    last = checkpoint(folder, best=str(folder / "checkpoints" / "step=1.ckpt"))
    (folder / "config.yaml").write_text(
        f"trainer:\n  logger:\n    class_path: lightning.pytorch.loggers.WandbLogger\n    init_args:\n"
        f"      name: {name}\n      project: {project.name}\n"
    )
    stamp = time.time() - age
    os.utime(last, (stamp, stamp))
    return last


# ----------------------------------------------------------------------------------------------- last and best
@pytest.mark.parametrize("kind", ["CSVLogger", "TensorBoardLogger"])
def test_last_and_best_find_the_newest_version_of_the_configs_name(kind, tmp_path):
    for n in (0, 2, 10):
        checkpoint(tmp_path / "story" / f"version_{n}", best=str(tmp_path / "story" / f"version_{n}" / "x.ckpt"))
    (tmp_path / "story" / "version_10" / "checkpoints" / "x.ckpt").write_bytes(
        (tmp_path / "story" / "version_10" / "checkpoints" / "step=1.ckpt").read_bytes()
    )
    checkpoint(tmp_path / "other" / "version_11")
    loggers = logger(kind, save_dir=str(tmp_path), name="story")
    assert resolve_ckpt_path("last", str(tmp_path), loggers) == str(tmp_path / "story/version_10/checkpoints/last.ckpt")
    assert resolve_ckpt_path("best", str(tmp_path), [loggers]) == str(tmp_path / "story/version_10/checkpoints/x.ckpt")
    named = logger(kind, save_dir=str(tmp_path), name="story", version=2)  # a config that names its version
    assert resolve_ckpt_path("last", str(tmp_path), named) == str(tmp_path / "story/version_2/checkpoints/last.ckpt")


def test_last_and_best_find_the_newest_wandb_run_of_the_configs_name(tmp_path, monkeypatch):
    """W&B runs live in <save_dir>/<project>/<run id>/: `last` is the newest run there named as the config's."""
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    project = tmp_path / "proj"
    wandb_run(project, "old1", "quick", age=300)
    newest = wandb_run(project, "new2", "quick", age=10)
    wandb_run(project, "else3", "other", age=1)  # newer, but another run's name
    wandb_run(tmp_path / "proj2", "else4", "quick", age=0)  # another project
    loggers = logger("WandbLogger", save_dir=str(tmp_path), project="proj", name="quick")
    assert resolve_ckpt_path("last", str(tmp_path), loggers) == str(newest)
    assert resolve_ckpt_path("best", str(tmp_path), loggers) == str(newest.parent / "step=1.ckpt")
    by_id = logger("WandbLogger", save_dir=str(tmp_path), project="proj", name="quick", id="old1")
    assert resolve_ckpt_path("last", str(tmp_path), by_id) == str(project / "old1/checkpoints/last.ckpt")
    nameless = logger("WandbLogger", save_dir=str(tmp_path), project="proj")
    assert resolve_ckpt_path("last", str(tmp_path), nameless) == str(project / "else3/checkpoints/last.ckpt")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint under .*proj/\*/checkpoints/ of a W&B run named 'x'"):
        resolve_ckpt_path(
            "last", str(tmp_path), logger("WandbLogger", save_dir=str(tmp_path), project="proj", name="x")
        )


def test_last_without_a_logger_is_the_default_root_dirs_checkpoint(tmp_path):
    last = checkpoint(tmp_path)
    assert resolve_ckpt_path("last", str(tmp_path), False) == str(last)


def test_a_wandb_fit_is_evaluated_with_ckpt_path_last(tmp_path, monkeypatch):
    """Every paper recipe logs to W&B: right after a W&B fit, `--ckpt_path last` finds its checkpoint."""
    import wandb

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    with_wandb = [
        "--trainer.logger=lightning.pytorch.loggers.WandbLogger",
        "--trainer.logger.init_args.project=proj",
        "--trainer.logger.init_args.name=quickstart",
        "--trainer.default_root_dir",
        str(tmp_path / "runs"),
    ]
    fit = main(["fit", *QUICK, *with_wandb])
    written = Path(fit.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    wandb.finish()
    validate = main(["validate", *QUICK, *with_wandb, "--ckpt_path", "last"])
    wandb.finish()
    assert validate.config["validate"]["ckpt_path"] == str(written)


# ----------------------------------------------------------------------------------------------- folders and files
def test_a_default_root_dir_that_cannot_be_written_is_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the folder reads as read-only to the check, as for a user
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", *QUICK, "--trainer.default_root_dir", str(locked / "runs")])
    finally:
        locked.chmod(0o755)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert f"trainer.default_root_dir '{locked / 'runs'}' cannot be written ({locked} is read-only" in err, err


def test_a_malformed_jsonl_dataset_names_the_field_and_the_line_not_pyarrow(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "items.jsonl").write_text('{"topic": "a kite"}\n{"topic": "a bo\n{"topic": "rain"}\n')
    with pytest.raises(SystemExit):
        main(["fit", *QUICK, "--data.init_args.dataset=items.jsonl", "--trainer.default_root_dir=runs"])
    err = capsys.readouterr().err
    assert "data.init_args.dataset file 'items.jsonl' could not be read as json: line 2, column 11" in err, err
    assert "pyarrow" not in err and "Arrow" not in err and err.count("\n") <= 3, err


def test_a_jsonl_line_that_is_not_an_object_is_named(tmp_path):
    from comlrl_lightning.data.tasks import load_items

    (tmp_path / "items.jsonl").write_text('{"topic": "a kite"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"eval_dataset file .* line 2 is a JSON list, not an object"):
        load_items(str(tmp_path / "items.jsonl"), field="eval_dataset")


# ----------------------------------------------------------------------------------------------- the model's context
def test_max_new_tokens_beyond_the_models_positions_is_refused_before_loading(tmp_path):
    """The context is read from the model's config (AutoConfig), a factory's size or a loaded model: no weights."""
    from transformers import GPT2Config

    from comlrl_lightning import MAGRPO
    from comlrl_lightning.agents import load_agents
    from comlrl_lightning.agents.loading import max_positions
    from comlrl_lightning.envs.toy import story_reward

    GPT2Config(n_positions=64, n_embd=8, n_layer=1, n_head=2).save_pretrained(tmp_path / "gpt2")  # config only
    assert max_positions(str(tmp_path / "gpt2")) == ("max_position_embeddings", 64)  # GPT-2: n_positions
    assert max_positions("tiny") == ("max_position_embeddings", 512)
    assert max_positions("tiny", {"max_position_embeddings": 2048}) == ("max_position_embeddings", 2048)
    assert max_positions("no-org/unreachable-model") is None  # offline: the load will say
    with pytest.raises(ValueError, match=r"max_new_tokens = 64 does not fit the context of the model '.*gpt2' "):
        MAGRPO(agents=str(tmp_path / "gpt2"), reward_func=story_reward, max_new_tokens=64)
    with pytest.raises(ValueError, match=r"max_new_tokens = 100000 .* \(max_position_embeddings = 512"):
        MAGRPO(agents="tiny", reward_func=story_reward, max_new_tokens=100000)
    models, tokenizers = load_agents("tiny", num_agents=2)
    with pytest.raises(ValueError, match=r"the model agents\[0\] \(max_position_embeddings = 512"):
        MAGRPO(agents=list(models), tokenizers=tokenizers, reward_func=story_reward, max_new_tokens=512)
    assert MAGRPO(agents="tiny", reward_func=story_reward, max_new_tokens=511).max_new_tokens == 511


# ----------------------------------------------------------------------------------------------- resume
def test_resuming_with_a_changed_num_generations_says_what_changed(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    root = ["--trainer.default_root_dir", str(tmp_path / "runs")]
    main(["fit", *QUICK, *root])
    with caplog.at_level(logging.WARNING):
        main(["fit", *QUICK, *root, "--trainer.max_steps=2", "--ckpt_path", "last"])
    assert "changed from the checkpoint's config" not in caplog.text  # the same fields: nothing to say
    with caplog.at_level(logging.WARNING):
        main(
            [
                "fit",
                *QUICK,
                *root,
                "--trainer.max_steps=3",
                "--ckpt_path",
                "last",
                "--model.init_args.num_generations=2",
            ]
        )
    assert "with fields changed from the checkpoint's config: num_generations 4 -> 2" in caplog.text, caplog.text
