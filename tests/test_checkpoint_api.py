"""CoMLRL 1.4.3's checkpoint API through ``comlrl_lightning.compat`` (docs/compat.md#checkpoints), and the same
guarantees through the CLI: a run killed after a checkpoint resumes to the weights of an uninterrupted run, the
user's stateful objects (a reward that counts its calls) come back with it, folders are pruned to the newest N, and
a resumed run continues its W&B run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, seed_everything

from comlrl_lightning import compat
from comlrl_lightning.algorithms.user_state import load_user_states, save_user_states
from comlrl_lightning.compat.checkpoints import METADATA_KEY, OWNER_FILENAME, STATE_FILENAME

REPO = Path(__file__).resolve().parents[1]
ITEMS = [{"prompt": f"Tell a story about {topic}:"} for topic in ("a cat", "a kite", "rain", "snow")]
QUIET = {"enable_progress_bar": False}
SMALL = dict(max_new_tokens=3, logging_steps=1, eval_interval=0, temperature=1.0, top_p=1.0, log_completions=False)


class CountingReward:
    """A reward function object with state, as a CoMLRL 1.4.3 user may write one: it counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, first, second):
        self.calls += 1
        return [float(len(b) > len(a)) + 0.1 * len(a) for a, b in zip(first, second)]

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


class KillInSecondEpoch(Callback):
    """Stands in for a killed process: the run dies in the middle of its second epoch, before batch ``batch``."""

    def __init__(self, batch: int = 1):
        self.batch = batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 1 and batch_idx == self.batch:
            raise RuntimeError("killed")


CONFIGS = {
    "MAGRPO": (compat.MAGRPOTrainer, lambda **kw: compat.MAGRPOConfig(num_turns=1, num_generations=2, **kw), {}),
    "IAC": (
        compat.IACTrainer,
        lambda **kw: compat.IACConfig(num_turns=1, num_generations=2, rollout_buffer_size=2, **kw),
        {"critic_model": "tiny"},
    ),
    # beyond the acceptance's two: a round per epoch, and MARLHF's reward-model epoch before its RL epochs
    "MADPOIter": (
        compat.MADPOIterTrainer,
        lambda num_train_epochs, **kw: compat.MADPOIterConfig(
            preference_num_candidates=3, preference_pairs_per_sample=1, num_iterations=num_train_epochs, **kw
        ),
        {},
    ),
    "MARLHF": (
        compat.MARLHFTrainer,
        lambda **kw: compat.MARLHFConfig(
            preference_num_candidates=3, preference_pairs_per_sample=1, num_generations=2, **kw
        ),
        {},
    ),
}


def make(algorithm, tmp_path, name, epochs=2, callbacks=(), **kwargs):
    """A CoMLRL 1.4.3-style trainer on tiny models (a fresh process would build the same one)."""
    trainer_class, config, objects = CONFIGS[algorithm]
    seed_everything(0)
    reward = CountingReward()
    trainer = trainer_class(
        agent_model="tiny",
        reward_func=reward,
        train_dataset=ITEMS,
        args=config(num_train_epochs=epochs, output_dir=str(tmp_path / name), **SMALL),
        trainer_options={**QUIET, "callbacks": list(callbacks)},
        **objects,
        **kwargs,
    )
    return trainer, reward


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def trainer_name(algorithm: str) -> str:
    return CONFIGS[algorithm][0].__name__


def folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ----------------------------------------------------------------------------------------------- kill and resume
@pytest.mark.parametrize("algorithm", list(CONFIGS))
def test_a_killed_run_resumes_from_its_checkpoint_to_the_uninterrupted_weights(algorithm, tmp_path):
    full, full_reward = make(algorithm, tmp_path, "full")
    full.train(checkpoint_dir=tmp_path / "full_ckpt")
    epochs = 3 if algorithm == "MARLHF" else 2  # MARLHF: its reward-model epoch, then 2 RL epochs
    assert folders(tmp_path / "full_ckpt") == [f"checkpoint-{n}" for n in range(1, epochs + 1)]
    assert not list((tmp_path / "full").rglob("*.ckpt"))  # no Lightning default checkpoints beside them

    killed, killed_reward = make(algorithm, tmp_path, "killed", callbacks=[KillInSecondEpoch()])
    with pytest.raises(RuntimeError, match="killed"):
        killed.train(checkpoint_dir=tmp_path / "ckpt")
    assert folders(tmp_path / "ckpt") == ["checkpoint-1"]  # nothing half-written beside it
    with pytest.raises(RuntimeError, match="Training did not reach a completed checkpoint boundary"):
        killed.save_checkpoint(tmp_path / "manual")
    metadata = compat.read_checkpoint_metadata(tmp_path / "ckpt" / "checkpoint-1")
    assert metadata["version"] == 1 and metadata["sequence"] == 1 and metadata["wandb"] is None
    assert metadata["trainer_class"] == f"comlrl_lightning.compat.trainers.{trainer_name(algorithm)}"
    assert re.fullmatch(r"[0-9a-f]{32}", metadata["run_id"])
    owner = json.loads((tmp_path / "ckpt" / "checkpoint-1" / OWNER_FILENAME).read_text())
    assert owner == {"run_id": metadata["run_id"], "sequence": 1}

    resumed, resumed_reward = make(algorithm, tmp_path, "resumed")  # a new process: fresh objects
    kwargs = dict(resume_from_checkpoint=tmp_path / "ckpt" / "checkpoint-1", checkpoint_dir=tmp_path / "ckpt")
    if algorithm == "IAC":  # keyword-only, as CoMLRL's actor-critic trainers
        with pytest.raises(TypeError):
            resumed.train(kwargs["resume_from_checkpoint"])
        resumed.train(**kwargs)
    else:  # CoMLRL's other trainers take them by position too
        resumed.train(kwargs["resume_from_checkpoint"], kwargs["checkpoint_dir"])
    assert folders(tmp_path / "ckpt") == [f"checkpoint-{n}" for n in range(1, epochs + 1)]
    final = compat.read_checkpoint_metadata(tmp_path / "ckpt" / f"checkpoint-{epochs}")
    assert final["run_id"] == metadata["run_id"] and final["sequence"] == epochs  # the same run, continued
    assert resumed.env_step == full.env_step
    for (name, a), b in zip(full.module.named_parameters(), resumed.module.parameters()):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)
    # the reward's state came back: the resumed run counts on from the checkpoint, as the uninterrupted run did
    assert resumed_reward.calls == full_reward.calls and killed_reward.calls > full_reward.calls / 2


def test_a_mid_epoch_save_steps_checkpoint_resumes_the_same_run(tmp_path):
    """Ours beyond CoMLRL: ``save_steps`` checkpoints (mid-epoch) carry the metadata; resuming one continues the
    run's sequence and run id and reaches the uninterrupted weights."""
    full, _ = make("MAGRPO", tmp_path, "full")
    full.train()
    killed, _ = make("MAGRPO", tmp_path, "killed", callbacks=[KillInSecondEpoch(batch=3)])
    killed.args.save_steps = 1
    with pytest.raises(RuntimeError, match="killed"):
        killed.train(checkpoint_dir=tmp_path / "ckpt")
    last = next((tmp_path / "killed").rglob("last.ckpt")).resolve()
    assert last.name.endswith("step=3.ckpt")  # an update every 2 items: one into the second epoch (+1 buffered)
    metadata = compat.read_checkpoint_metadata(last)
    assert metadata["sequence"] == 1
    resumed, _ = make("MAGRPO", tmp_path, "resumed")
    resumed.train(resume_from_checkpoint=last, checkpoint_dir=tmp_path / "ckpt")
    assert compat.read_checkpoint_metadata(tmp_path / "ckpt" / "checkpoint-2")["run_id"] == metadata["run_id"]
    for a, b in zip(full.module.parameters(), resumed.module.parameters()):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


def test_interval_and_total_limit_keep_the_newest_of_this_run_only(tmp_path):
    trainer, _ = make("MAGRPO", tmp_path, "run", epochs=3)
    root = tmp_path / "ckpt"
    (root / "notes").mkdir(parents=True)  # not a checkpoint: left alone
    trainer.train(checkpoint_dir=root, checkpoint_interval=2, checkpoint_total_limit=1)
    # epoch 2 (the interval) and epoch 3 (the last, always written); the limit keeps the newest
    assert folders(root) == ["checkpoint-3", "notes"]
    assert compat.read_checkpoint_metadata(root / "checkpoint-3")["sequence"] == 3
    with pytest.raises(FileExistsError, match="already contains another run's checkpoint"):
        make("MAGRPO", tmp_path, "other")[0].train(checkpoint_dir=root)  # a new run, a used folder


def test_a_resumed_run_never_overwrites_another_runs_checkpoint(tmp_path):
    first, _ = make("MAGRPO", tmp_path, "first", epochs=1)
    first.train(checkpoint_dir=tmp_path / "ckpt")
    foreign = tmp_path / "ckpt" / "checkpoint-2"
    foreign.mkdir()
    (foreign / STATE_FILENAME).write_bytes(b"")
    (foreign / OWNER_FILENAME).write_text(json.dumps({"run_id": "f" * 32, "sequence": 2}))
    second, _ = make("MAGRPO", tmp_path, "second")
    with pytest.raises(FileExistsError, match="Refusing to overwrite another run's checkpoint"):
        second.train(resume_from_checkpoint=tmp_path / "ckpt" / "checkpoint-1", checkpoint_dir=tmp_path / "ckpt")


def test_resume_checks_the_trainer_class_and_the_config(tmp_path):
    trainer, _ = make("MAGRPO", tmp_path, "run", epochs=1)
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    checkpoint = tmp_path / "ckpt" / "checkpoint-1"
    other = compat.MAREINFORCETrainer(
        agent_model="tiny",
        reward_func=CountingReward(),
        train_dataset=ITEMS,
        args=compat.MAGRPOConfig(num_turns=1, num_generations=2, **SMALL),
        trainer_options=QUIET,
    )
    with pytest.raises(ValueError, match="Checkpoint trainer class does not match this trainer"):
        other.train(resume_from_checkpoint=checkpoint)
    changed = compat.MAGRPOTrainer(
        agent_model="tiny",
        reward_func=CountingReward(),
        train_dataset=ITEMS,
        args=compat.MAGRPOConfig(num_turns=1, num_generations=3, num_train_epochs=4, **SMALL),
        trainer_options=QUIET,
    )
    with pytest.raises(ValueError, match=r"Checkpoint configuration does not match: num_generations \(2 -> 3\)"):
        changed.train(resume_from_checkpoint=checkpoint)  # num_train_epochs may change, num_generations not


# ----------------------------------------------------------------------------------------------- save / load
def test_save_checkpoint_and_load_checkpoint(tmp_path):
    trainer, reward = make("MAGRPO", tmp_path, "run", epochs=1)
    with pytest.raises(RuntimeError, match="call it after train"):
        trainer.save_checkpoint(tmp_path / "manual")
    trainer.train()
    (tmp_path / "occupied").mkdir()
    with pytest.raises(FileExistsError, match="Refusing to replace a non-checkpoint directory"):
        trainer.save_checkpoint(tmp_path / "occupied")
    assert trainer.save_checkpoint(tmp_path / "manual") == str(tmp_path / "manual")
    assert trainer.save_checkpoint(tmp_path / "manual") == str(tmp_path / "manual")  # replaces its own
    saved = torch.load(tmp_path / "manual" / STATE_FILENAME, weights_only=True)
    assert saved[METADATA_KEY]["sequence"] == 1
    assert saved["comlrl_lightning"]["user_state"]["reward_func"]["state"] == {"calls": reward.calls}

    fresh, fresh_reward = make("MAGRPO", tmp_path, "fresh", epochs=1)
    assert fresh.load_checkpoint(tmp_path / "manual") == {"sequence": 1, "global_step": 2, "env_step": 8}
    assert fresh.env_step == 8 and fresh_reward.calls == reward.calls
    for a, b in zip(trainer.module.parameters(), fresh.module.parameters()):
        assert torch.equal(a, b)
    seen = {}

    class OptimizerAtStart(Callback):  # runs after the restoring callback
        def on_train_start(self, lightning_trainer, pl_module):
            state = lightning_trainer.optimizers[0].state_dict()["state"]
            seen["state"] = {k: v["exp_avg"].clone() for k, v in state.items()}

    fresh.trainer_options["callbacks"] = [OptimizerAtStart()]
    fresh._lightning = None
    fresh.train()  # a new run from the loaded state: the optimizer starts with the saved moments
    expected = saved["optimizer_states"][0]["state"]
    assert seen["state"] and all(torch.equal(seen["state"][k], expected[k]["exp_avg"]) for k in seen["state"])


# ----------------------------------------------------------------------------------------------- arguments
def test_train_arguments_are_checked_and_an_unknown_one_says_what_to_use(tmp_path):
    trainer, _ = make("MAGRPO", tmp_path, "run")
    with pytest.raises(
        TypeError, match="unexpected keyword argument 'resume_from_checkpont'. Did you mean resume_from_checkpoint"
    ):
        trainer.train(resume_from_checkpont="x")
    with pytest.raises(TypeError, match=r"'repetition_penalty'.*generation_kwargs=\{'repetition_penalty': \.\.\.\}"):
        trainer.train(repetition_penalty=1.1)
    for value in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"checkpoint_interval must be a positive integer \\(got {value!r}\\)"):
            trainer.train(checkpoint_interval=value)
    with pytest.raises(ValueError, match="checkpoint_total_limit must be a positive integer or None"):
        trainer.train(checkpoint_total_limit=0)
    with pytest.raises(FileNotFoundError, match="No training checkpoint at"):
        trainer.train(resume_from_checkpoint=tmp_path / "nowhere")
    iac, _ = make("IAC", tmp_path, "iac")
    with pytest.raises(
        TypeError,
        match=r"IACTrainer.train\(\) got an unexpected keyword argument "
        r"'checkpoint_directory'. Did you mean checkpoint_dir",
    ):
        iac.train(checkpoint_directory="x")


# ----------------------------------------------------------------------------------------------- W&B
def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb_config = {"project": "comlrl-test", "dir": str(tmp_path / "wandb")}
    first, _ = make("MAGRPO", tmp_path, "first", epochs=1, wandb_config=wandb_config)
    first.train(checkpoint_dir=tmp_path / "ckpt")
    run_id = first.lightning_trainer.logger.experiment.id
    first.lightning_trainer.logger.experiment.finish()
    identity = compat.read_checkpoint_metadata(tmp_path / "ckpt" / "checkpoint-1")["wandb"]
    assert identity["id"] == run_id and identity["project"] == "comlrl-test"

    resumed, _ = make("MAGRPO", tmp_path, "resumed", epochs=2, wandb_config=dict(wandb_config))
    resumed.train(resume_from_checkpoint=tmp_path / "ckpt" / "checkpoint-1")
    logger = resumed.lightning_trainer.logger
    assert logger._wandb_init["id"] == run_id and logger._wandb_init["resume"] == "allow"
    assert logger.experiment.id == run_id
    logger.experiment.finish()
    # a wandb_config that names its run keeps it, as CoMLRL's
    chosen, _ = make("MAGRPO", tmp_path, "chosen", wandb_config={**wandb_config, "id": "mine", "resume": "never"})
    chosen.adopt_wandb_run({"wandb": identity})
    assert chosen.build_logger()._wandb_init["id"] == "mine" and chosen.build_logger()._wandb_init["resume"] == "never"


# ----------------------------------------------------------------------------------------------- user objects
class Stateful:
    def __init__(self, value=0):
        self.value = value

    def __call__(self, *args, **kwargs):
        return "prompt"

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_every_stateful_user_object_is_saved_and_checked_on_restore():
    fields = {
        "reward_func": Stateful(1),
        "formatters": [print, Stateful(2)],
        "external_transition": Stateful(3),
        "eval_logger": Stateful(4),
        "eval_aggregator": Stateful(5),
        "reward_processor": None,
    }
    saved = save_user_states(fields)
    assert {k: v["state"]["value"] for k, v in saved.items()} == {
        "reward_func": 1,
        "formatters.1": 2,
        "external_transition": 3,
        "eval_logger": 4,
        "eval_aggregator": 5,
    }
    fresh = {**fields, "reward_func": Stateful(), "formatters": [print, Stateful()], "eval_logger": Stateful()}
    load_user_states(fresh, saved)
    assert (fresh["reward_func"].value, fresh["formatters"][1].value, fresh["eval_logger"].value) == (1, 2, 4)
    with pytest.raises(ValueError, match="eval_logger .* defines state_dict, but the checkpoint holds no state"):
        load_user_states(fresh, {k: v for k, v in saved.items() if k != "eval_logger"})
    with pytest.raises(ValueError, match="holds the state of eval_aggregator .* has no state_dict"):
        load_user_states({**fresh, "eval_aggregator": print}, saved)

    class SaveOnly:
        def state_dict(self):
            return {}

    with pytest.raises(ValueError, match="reward_func .* defines state_dict but no load_state_dict"):
        save_user_states({"reward_func": SaveOnly()})


# ----------------------------------------------------------------------------------------------- the CLI
QUICK = [
    "--config",
    str(REPO / "configs" / "quickstart.yaml"),
    "--trainer.enable_progress_bar=false",
    "--model.init_args.max_new_tokens=4",
]


def test_cli_keeps_the_newest_n_checkpoints(tmp_path):
    from comlrl_lightning.cli import main

    main(
        [
            "fit",
            *QUICK,
            "--trainer.max_steps=4",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--checkpoint_every_n_updates=1",
            "--checkpoint_total_limit=2",
        ]
    )
    checkpoints = next(tmp_path.rglob("checkpoints"))
    assert folders(checkpoints) == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]


def test_cli_restores_a_stateful_reward_on_resume(tmp_path, monkeypatch):
    """A reward object given by import path: its state is in the checkpoint, and a resumed run (a fresh object, as in
    a new process) gets it back; the resumed run ends with the uninterrupted run's weights and count."""
    from comlrl_lightning.cli import main
    from comlrl_lightning.envs import toy

    class StoryCounter(CountingReward):
        def __call__(self, *completions, batch_items=None):
            self.calls += 1
            return toy.story_reward(*completions, batch_items=batch_items)

    def run(root, *args, reward=None):
        reward = reward or StoryCounter()
        monkeypatch.setattr(toy, "counting_story_reward", reward, raising=False)
        main(
            [
                "fit",
                *QUICK,
                "--trainer.default_root_dir",
                str(root),
                "--checkpoint_every_n_updates=2",
                "--model.init_args.reward_func",
                "comlrl_lightning.envs.toy.counting_story_reward",
                *args,
            ]
        )
        return reward

    full = run(tmp_path / "full", "--trainer.max_steps=4")
    run(tmp_path / "part", "--trainer.max_steps=2")
    checkpoint = next((tmp_path / "part").rglob("*step=2.ckpt"))
    state = torch.load(checkpoint, weights_only=True)["comlrl_lightning"]["user_state"]
    assert state["reward_func"]["state"]["calls"] > 0
    resumed = run(tmp_path / "part", "--trainer.max_steps=4", "--ckpt_path", str(checkpoint))
    assert resumed.calls == full.calls
    weights = [
        torch.load(next(root.rglob("*step=4.ckpt")), weights_only=True)["state_dict"]
        for root in (tmp_path / "full", tmp_path / "part")
    ]
    for key, value in weights[0].items():
        torch.testing.assert_close(weights[1][key], value, atol=0, rtol=0)


def test_cli_resume_continues_the_checkpoints_wandb_run(tmp_path, monkeypatch):
    from comlrl_lightning.cli import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb = [
        "--trainer.logger=lightning.pytorch.loggers.WandbLogger",
        "--trainer.logger.init_args.offline=true",
        "--trainer.logger.init_args.project=comlrl-test",
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    first = main(["fit", *QUICK, *wandb, "--trainer.max_steps=2"])
    run_id = first.trainer.logger.experiment.id
    first.trainer.logger.experiment.finish()
    checkpoint = next(tmp_path.rglob("*step=2.ckpt"))
    assert torch.load(checkpoint, weights_only=True)["comlrl_lightning"]["wandb"]["id"] == run_id
    resumed = main(["fit", *QUICK, *wandb, "--trainer.max_steps=3", "--ckpt_path", str(checkpoint)])
    assert resumed.trainer.global_step == 3 and resumed.trainer.logger.experiment.id == run_id
    resumed.trainer.logger.experiment.finish()
