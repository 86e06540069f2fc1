"""The CoMLRL-compatible front door (comlrl_lightning.compat, docs/compat.md): CoMLRL's configs and trainers on our
modules, the three example scripts of examples/compat/ on tiny models, and what has no equivalent."""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from comlrl_lightning import compat
from comlrl_lightning.compat import configs
from comlrl_lightning.compat.configs import ALIASES, OBJECT_FIELDS, RUN_FIELDS, module_parameters
from comlrl_lightning.compat.trainers import NOT_PROVIDED, REFUSED_MODEL_CONFIG, TRAINERS, comlrl_reward
from comlrl_lightning.rollout.rewards import RewardCaller, RewardProcessors

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "compat"
SHARED = REPO.parent / "shared" / "data"
ITEMS = [{"prompt": f"Tell a story about {topic}:"} for topic in ("a cat", "a kite", "rain")]
QUIET = {"enable_progress_bar": False}
SMALL = dict(
    num_train_epochs=1,
    max_new_tokens=3,
    logging_steps=1,
    eval_interval=0,
    temperature=1.0,
    top_p=1.0,
    log_completions=False,
)


def length_reward(first, second):
    """Longer second answers score higher, and the first answer's length breaks ties (pairs are never all tied)."""
    return [float(len(b) > len(a)) + 0.1 * len(a) for a, b in zip(first, second)]


def metric_rows(root: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(next(root.rglob("metrics.csv")).open()))


def run_script(name: str, *argv: str) -> None:
    saved = sys.argv
    sys.argv = [str(EXAMPLES / name), *argv]
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        sys.argv = saved


# ----------------------------------------------------------------------------------------------- the scripts
def test_story_script_trains_and_saves_on_tiny_models(tmp_path, capsys):
    run_script(
        "story_length_ratio.py",
        "--model",
        "tiny",
        "--epochs",
        "1",
        "--num-prompts",
        "2",
        "--num-generations",
        "2",
        "--max-new-tokens",
        "4",
        "--output-dir",
        "run",
    )
    assert "Training complete: 4 joint actions" in capsys.readouterr().out  # 2 prompts x K = 2
    for agent in ("agent_0", "agent_1"):
        assert (tmp_path / "run" / "models" / agent / "model.safetensors").is_file()


def test_story_reward_by_hand():
    script = runpy.run_path(str(EXAMPLES / "story_length_ratio.py"))
    # ratios 2.5 (in range), 1 (distance 1), 4 (distance 1), empty first answer
    assert script["length_ratio_reward"](["ab", "ab", "ab", ""], ["abcde", "ab", "abcdefgh", "x"]) == pytest.approx(
        [1.0, math.exp(-1), math.exp(-1), 0.0]
    )


@pytest.mark.skipif(not (SHARED / "tldr" / "tldr_sample.jsonl.gz").exists(), reason=f"TL;DR sample under {SHARED}")
def test_tldr_script_trains_evaluates_and_saves(tmp_path, capsys):
    run_script(
        "tldr_length_ratio.py",
        "--model",
        "tiny",
        "--data",
        str(SHARED / "tldr" / "tldr_sample.jsonl.gz"),
        "--train-items",
        "2",
        "--eval-items",
        "1",
        "--epochs",
        "1",
        "--max-new-tokens",
        "4",
        "--output-dir",
        "run",
    )
    assert "eval/turn_1/reward_mean" in capsys.readouterr().out
    for agent in ("agent_0", "agent_1"):
        assert (tmp_path / "run" / agent / "model.safetensors").is_file()
    rows = [r for r in metric_rows(tmp_path / "run" / "iac") if r.get("turn_1/completion_char_length_mean")]
    assert rows  # the script's metrics_callback is logged with the updates


@pytest.mark.skipif(not (SHARED / "coophumaneval" / "che_raw.json").exists(), reason=f"CoopHumanEval under {SHARED}")
def test_two_turn_coding_script_runs_with_level_feedback(tmp_path, capsys):
    run_script(
        "coding_two_turn.py",
        "--model",
        "tiny",
        "--data",
        str(SHARED / "coophumaneval" / "che_raw.json"),
        "--train-items",
        "1",
        "--eval-items",
        "1",
        "--epochs",
        "1",
        "--num-generations",
        "2",
        "--max-new-tokens",
        "4",
        "--output-dir",
        "run",
    )
    out = capsys.readouterr().out
    assert "eval/turn_2/reward_mean" in out and "eval/turn_2/pass_rate" in out  # two turns, the coding aggregator
    rows = metric_rows(tmp_path / "run" / "magrpo")
    # two turns, K = 2, no early stop (a random team scores -4 < -0.2): 2 + 2 x 2 joint actions
    assert float(rows[-1]["env_step"]) == 6 and any(r.get("rollout/turn_2/reward_mean") for r in rows)
    assert (tmp_path / "run" / "models" / "agent_1" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------- every trainer
CASES = {
    "MAGRPOTrainer": ({"num_turns": 1, "num_generations": 2}, {}),
    "MAREINFORCETrainer": ({"num_turns": 1, "num_generations": 2}, {}),
    "MARLOOTrainer": ({"num_turns": 1, "num_generations": 2}, {}),
    "MAReMaxTrainer": ({"num_turns": 1, "num_generations": 2}, {}),
    "CentralizedMAGRPOTrainer": ({"num_generations": 2}, {}),
    "IACTrainer": ({"num_turns": 1, "rollout_buffer_size": 1}, {"critic_model": "tiny"}),
    "MAACTrainer": ({"num_turns": 1, "rollout_buffer_size": 1}, {"critic_model": "tiny"}),
    "MADPOTrainer": ({"preference_num_candidates": 3, "preference_pairs_per_sample": 1}, {}),
    "MARLHFTrainer": ({"preference_num_candidates": 3, "preference_pairs_per_sample": 1, "num_generations": 2}, {}),
    "MADPOIterTrainer": ({"preference_num_candidates": 3, "preference_pairs_per_sample": 1, "num_iterations": 1}, {}),
    "MARLHFIterTrainer": (
        {
            "preference_num_candidates": 3,
            "preference_pairs_per_sample": 1,
            "num_iterations": 1,
            "num_generations": 2,
            "reward_num_train_epochs": 1,
        },
        {},
    ),
}


@pytest.mark.parametrize("trainer_class", TRAINERS, ids=lambda t: t.__name__)
def test_every_trainer_builds_and_trains_one_step_with_its_config(trainer_class, tmp_path):
    from lightning.pytorch import seed_everything

    fields, objects = CASES[trainer_class.__name__]
    config_class = type(trainer_class.default_config())
    assert config_class.__name__ == trainer_class.__name__.replace("Trainer", "Config")
    seed_everything(0)  # what is sampled (and so whether a preference pair is found) must not depend on test order
    trainer = trainer_class(
        agent_model="tiny",
        reward_func=length_reward,
        train_dataset=ITEMS[:1],
        args=config_class(output_dir=str(tmp_path), **SMALL, **fields),
        trainer_options=QUIET,
        **objects,
    )
    assert isinstance(trainer.module, trainer_class.module_class)
    before = [p.detach().clone() for p in trainer.agents[0].parameters()]
    trainer.train()
    # MARLHF: the reward-model update, then one RL update; the others: one update
    assert trainer.lightning_trainer.global_step == (2 if "RLHF" in trainer_class.__name__ else 1)
    assert trainer.env_step == (1 if trainer_class in (compat.IACTrainer, compat.MAACTrainer) else 2)  # K joint actions
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.agents[0].parameters()))
    assert [r for r in metric_rows(tmp_path) if r.get("loss") or r.get("reward_model/loss")]


def test_evaluate_returns_the_metrics_and_save_model_writes_hf_folders(tmp_path):
    from transformers import AutoModelForCausalLM

    calls = []

    def eval_logger(agent_completions_turns, batch_items, prompts):  # how CoMLRL 1.4.3 calls it
        calls.append(len(batch_items))
        assert prompts == [item["prompt"] for item in batch_items]
        return [{"turns": len(c)} for c in agent_completions_turns[0]]

    def eval_aggregator(metrics, num_turns):
        return {"turn_1/samples": float(len(metrics)), "turn_1/turns": sum(m["turns"] for m in metrics) / len(metrics)}

    trainer = compat.MAGRPOTrainer(
        agent_model="tiny",
        reward_func=lambda a, b: [0.25] * len(a),
        train_dataset=ITEMS[:1],
        eval_dataset=ITEMS,
        eval_logger=eval_logger,
        eval_aggregator=eval_aggregator,
        trainer_options=QUIET,
        args=compat.MAGRPOConfig(num_turns=1, num_generations=2, output_dir=str(tmp_path), save_steps=1, **SMALL),
    )
    trainer.train()
    assert next(tmp_path.rglob("checkpoints/last.ckpt")).exists()  # save_steps: a checkpoint every update
    trainer.train()  # again, as CoMLRL's train(): one more epoch
    assert trainer.env_step == 4 and trainer.lightning_trainer.global_step == 1
    metrics = trainer.evaluate(num_eval_samples=2)
    assert metrics["eval/turn_1/reward_mean"] == pytest.approx(0.25)  # a constant team reward, one turn
    assert metrics["eval/turn_1/expected_return"] == pytest.approx(0.25)
    assert metrics["eval/turn_1/samples"] == 2 and metrics["eval/turn_1/turns"] == 1 and calls == [2]
    trainer.save_model(tmp_path / "team")
    for i in range(2):
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "team" / f"agent_{i}")
        for (name, p), q in zip(trainer.agents[i].named_parameters(), saved.parameters()):
            assert torch.equal(p.detach().cpu(), q.detach()), name
        assert (tmp_path / "team" / f"agent_{i}" / "tokenizer.json").is_file()


# ----------------------------------------------------------------------------------------------- configs
def test_configs_are_dataclasses_with_comlrl_defaults():
    magrpo = compat.MAGRPOConfig()
    assert (
        magrpo.num_train_epochs,
        magrpo.logging_steps,
        magrpo.num_turns,
        magrpo.early_termination_threshold,
        magrpo.num_generations,
        magrpo.rollout_buffer_size,
        magrpo.top_k,
        magrpo.advantage_mode,
        magrpo.agent_learning_rate,
    ) == (20, 50, 2, -0.2, 4, 2, 50, "mean", 5e-6)
    variants = {compat.MAREINFORCEConfig: "raw", compat.MARLOOConfig: "rloo", compat.MAReMaxConfig: "max"}
    for config, mode in variants.items():
        assert issubclass(config, compat.MAGRPOConfig) and config().advantage_mode == mode
    assert compat.CentralizedMAGRPOConfig().num_turns == 1
    iac = compat.IACConfig()
    assert (
        iac.num_train_epochs,
        iac.logging_steps,
        iac.num_generations,
        iac.discount,
        iac.rollout_buffer_size,
        iac.top_k,
        iac.use_separate_critic,
        iac.value_loss_coef,
    ) == (40, 1, 1, 0.9, 8, None, True, 0.6)
    assert "use_separate_critic" not in {f.name for f in dataclasses.fields(compat.MAACConfig)}
    madpo = compat.MADPOConfig()
    assert (
        madpo.preference_num_candidates,
        madpo.preference_pairs_per_sample,
        madpo.dpo_beta,
        madpo.train_batch_size,
        madpo.discount,
        madpo.advantage_mode,
    ) == (80, 16, 0.1, 2, 1.0, "mean")
    assert issubclass(compat.MARLHFConfig, compat.MADPOConfig) and compat.MARLHFConfig().reward_learning_rate == 1e-5
    it = compat.MADPOIterConfig()
    assert (it.num_train_epochs, it.num_iterations, it.preference_num_candidates, it.pair_selection) == (
        1,
        6,
        20,
        "comparator_reward",
    )
    assert (compat.MARLHFIterConfig().num_train_epochs, compat.MARLHFIterConfig().reward_num_train_epochs) == (2, 2)
    # CoMLRL's one name for two things becomes the module field of each: DPO passes or RL epochs per round.
    assert compat.MADPOIterConfig(num_train_epochs=3).module_values()["dpo_epochs_per_round"] == 3
    assert compat.MARLHFIterConfig(num_train_epochs=4).module_values()["rl_epochs_per_round"] == 4
    assert "num_train_epochs" not in compat.MARLHFIterConfig().module_values()
    assert "rl_epochs_per_round" not in {f.name for f in dataclasses.fields(compat.MARLHFIterConfig)}


@pytest.mark.parametrize("config", configs.CONFIGS, ids=lambda c: c.__name__)
def test_config_fields_are_the_modules_fields_plus_the_run_settings(config):
    fields = {f.name for f in dataclasses.fields(config)}
    names = {config.comlrl_names.get(name, name) for name in fields}  # under the module's names
    module = set(module_parameters(config.module_class)) - set(OBJECT_FIELDS)
    excluded = (
        {"use_separate_critic", "value_clip_range", "value_head_hidden_dim"} if config is compat.MAACConfig else set()
    )
    assert module - excluded <= names and set(RUN_FIELDS) <= fields


@pytest.mark.parametrize(
    "config,values,message",
    [
        (compat.MAGRPOConfig, {"num_generations": 1}, "num_generations must be >= 2 (group baseline"),
        (compat.MAGRPOConfig, {"num_train_epochs": 0}, "num_train_epochs must be >= 1"),
        (compat.MAGRPOConfig, {"logging_steps": 0}, "logging_steps must be >= 1"),
        (compat.MAGRPOConfig, {"eval_batch_size": 0}, "eval_batch_size must be >= 1"),
        (compat.MAGRPOConfig, {"rollout_buffer_size": 0}, "rollout_buffer_size must be >= 1"),
        (
            compat.MAGRPOConfig,
            {"advantage_mode": "no-such-baseline"},
            "advantage_mode must be one of",
        ),  # not "median": an example registers it
        (compat.MAGRPOConfig, {"parallel_training": "ddp"}, "parallel_training only supports: none, mp"),
        (compat.MAGRPOConfig, {"parallel_training": "mp"}, "parallel_training='mp' requires explicit agent_devices"),
        (compat.MAGRPOConfig, {"reference_kl_coef": -1.0}, "reference_kl_coef must be >= 0"),
        (compat.CentralizedMAGRPOConfig, {"num_turns": 2}, "supports num_turns=1 only"),
        (compat.CentralizedMAGRPOConfig, {"collaboration_mode": "decentralized"}, "requires centralized collaboration"),
        (compat.IACConfig, {"critic_type": "w"}, "critic_type must be one of"),
        (compat.IACConfig, {"num_generations": 2}, "Multi-turn IAC currently supports num_generations == 1"),
        (compat.MADPOConfig, {"dpo_beta": 0.0}, "dpo_beta must be > 0"),
        (compat.MADPOConfig, {"num_turns": 2}, "MADPO currently supports num_turns=1 only"),
        (
            compat.MADPOConfig,
            {"pair_selection": "all"},
            "preference_pairs_per_sample must be null when pair_selection='all'",
        ),
        (compat.MARLHFConfig, {"rl_algorithm": "ppo"}, "rl_algorithm must be one of"),
        (compat.MARLHFConfig, {"reward_learning_rate": 0.0}, "reward_learning_rate must be > 0"),
        (compat.MADPOIterConfig, {"preference_replay_mode": "lambda_decay"}, "preference_replay_lambda is required"),
        (
            compat.MADPOIterConfig,
            {"comparator_policy": "model"},
            "comparator_model_name or comparator_agents is required",
        ),
    ],
)
def test_configs_check_their_fields_when_built(config, values, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        config(**values)
    if values.get("parallel_training") == "ddp":
        assert "trainer_options={'strategy': 'ddp'" in str(err.value)


def test_the_migration_guide_names_every_run_setting_alias_and_refusal():
    text = (REPO / "docs" / "compat.md").read_text()
    for name in [*RUN_FIELDS, *ALIASES, *REFUSED_MODEL_CONFIG, *NOT_PROVIDED]:
        assert name in text, name


def test_older_field_names_and_unknown_fields():
    config = compat.MAGRPOConfig(learning_rate=1e-4, termination_threshold=None, per_device_train_batch_size=3)
    assert (config.agent_learning_rate, config.early_termination_threshold, config.prompts_per_step) == (1e-4, None, 3)
    with pytest.raises(ValueError, match="give agent_learning_rate or its older name learning_rate, not both"):
        compat.MAGRPOConfig(learning_rate=1e-4, agent_learning_rate=1e-4)
    with pytest.raises(TypeError, match="MAGRPOConfig has no field 'num_generation'. Did you mean num_generations"):
        compat.MAGRPOConfig(num_generation=4)


# ----------------------------------------------------------------------------------------------- trainers
def make_trainer(trainer_class=None, **kwargs):
    kwargs.setdefault("args", compat.MAGRPOConfig(num_turns=1, **SMALL))
    kwargs.setdefault("reward_func", length_reward)
    return (trainer_class or compat.MAGRPOTrainer)(trainer_options=QUIET, **kwargs)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({}, ValueError, "Either agent_model or agents must be provided."),
        ({"agent_model": torch.nn.Linear(1, 1)}, ValueError, "agent_model should be a string"),
        ({"agent_model": "tiny", "agents": ["tiny", "tiny-5m"]}, ValueError, "conflict"),
        ({"agent_model": "tiny", "model": "tiny"}, ValueError, "not both"),
        (
            {"agent_model": "tiny", "critics": ["tiny", "tiny"]},
            TypeError,
            "MAGRPOTrainer does not take critics= .*IACTrainer, MAACTrainer, MARLHFTrainer, MARLHFIterTrainer",
        ),
        ({"agent_model": "tiny", "args": compat.IACConfig()}, TypeError, "takes args=MAGRPOConfig"),
        (
            {"agent_model": "tiny", "model_config": {"critic_model_kwargs": {}}},
            ValueError,
            "model_config\\['critic_model_kwargs'\\] has no equivalent here: .*critics=\\[...\\]",
        ),
        (
            {"agent_model": "tiny", "args": compat.MAGRPOConfig()},
            ValueError,
            "Multi-turn MAGRPO requires an external_transition",
        ),
        (
            {"trainer_class": compat.IACTrainer, "agent_model": "tiny", "args": compat.IACConfig(num_turns=1)},
            ValueError,
            "Either critic_model or critics must be provided when use_separate_critic=True",
        ),
    ],
)
def test_trainer_arguments_without_an_equivalent_say_what_to_use(kwargs, error, message):
    with pytest.raises(error, match=message):
        make_trainer(**kwargs)


def test_trainer_methods_and_attributes_without_an_equivalent(tmp_path):
    trainer = make_trainer(agent_model="tiny", num_agents=3, reward_func=lambda *texts: [0.0] * len(texts[0]))
    assert trainer.num_agents == 3 and trainer.module.num_agents == 3
    with pytest.raises(TypeError, match="generation_kwargs"):
        trainer.train(repetition_penalty=1.1)
    with pytest.raises(ValueError, match="train\\(\\) needs train_dataset"):
        trainer.train()
    with pytest.raises(ValueError, match="evaluate\\(\\) needs eval_dataset"):
        trainer.evaluate()
    with pytest.raises(AttributeError, match="optimizers has no equivalent here: one AdamW"):
        trainer.optimizers  # noqa: B018


def test_trainer_maps_comlrl_arguments_onto_the_module(caplog):
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    maac = make_trainer(
        compat.MAACTrainer,
        agents=["tiny", "tiny"],
        critic_model="tiny",
        model_config={"critic_value_head_hidden_dim": 8},
        args=compat.MAACConfig(num_turns=1, output_dir="somewhere"),
    )
    assert maac.module.critic_value_head_hidden_dim == 8 and maac.module.num_agents == 2
    assert isinstance(maac.build_logger(), CSVLogger) and maac.output_dir == "somewhere"
    with caplog.at_level(logging.WARNING):
        madpo = make_trainer(
            compat.MADPOTrainer,
            agent_model="tiny",
            args=compat.MADPOConfig(discount=0.5),
            wandb_config={
                "project": "p",
                "run_name": "r",
                "dir": "wandb_dir",
                "config_sections": {"dataset": {"type": "toy"}},
            },
        )
    assert "MADPOConfig.discount=0.5 has no effect on MADPO" in caplog.text
    assert madpo.dataset_type == "toy" and madpo.datamodule is None
    logger = madpo.build_logger()
    assert (
        isinstance(logger, WandbLogger)
        and logger._wandb_init["project"] == "p"
        and logger._wandb_init["name"] == "r"
        and logger._wandb_init["config"]["dataset_type"] == "toy"
    )
    from comlrl_lightning.agents import load_agents

    models, tokenizers = load_agents("tiny", num_agents=2)  # CoMLRL's quick start passes loaded models
    team = make_trainer(agents=list(models), tokenizer=tokenizers[0])
    assert team.module.num_agents == 2 and team.agents[1] is models[1] and team.tokenizer is tokenizers[0]
    with pytest.raises(ValueError, match="num_agents must match args.num_agents"):
        make_trainer(
            compat.CentralizedMAGRPOTrainer,
            agent_model="tiny",
            num_agents=3,
            args=compat.CentralizedMAGRPOConfig(num_generations=2),
        )


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # loggers that default to ./outputs and W&B directories stay in the test's folder


# ----------------------------------------------------------------------------------------------- rewards
def test_comlrl_reward_forms_are_called_as_comlrl_calls_them():
    seen = {}

    def prompts_first(prompts, a, b):
        seen["prompts"] = prompts
        return [len(x) + len(y) for x, y in zip(a, b)]

    def one_list(completions, batch_items=None):
        seen["items"] = batch_items
        return [len(x) - len(y) for x, y in zip(*completions)]

    def plain(a, b, scale=2.0):
        return [scale * len(x) for x in a]

    assert comlrl_reward(plain, 2) is plain  # one list per agent already: unchanged
    caller = RewardCaller(comlrl_reward(prompts_first, 2))
    assert caller([["ab", "c"], ["d", ""]], prompts=["p0", "p1"]) == [3.0, 1.0] and seen["prompts"] == ["p0", "p1"]
    caller = RewardCaller(comlrl_reward(one_list, 2))
    assert caller([["abc"], ["a"]], batch_items=[{"k": 1}]) == [2.0] and seen["items"] == [{"k": 1}]


def test_reward_processors_by_hand():
    rp = compat.RewardProcessors
    assert rp is RewardProcessors  # CoMLRL's name, our one implementation
    assert rp.identity()(-3.5) == -3.5
    assert (rp.clamp(-1, 2)(5.0), rp.clamp(-1, 2)(-5.0), rp.clamp()(11.0)) == (2, -1, 10.0)
    assert rp.scale(100.0)(0.37) == pytest.approx(37.0) and rp.shift(-4.0)(4.5) == 0.5
    assert rp.sigmoid_scale()(0.0) == 0.5 and rp.sigmoid_scale()(math.log(3.0)) == pytest.approx(0.75)
    assert rp.exponential_scale(2.0)(0.5) == pytest.approx(math.e - 1)
    assert rp.exponential_scale(2.0)(-0.5) == pytest.approx(1 - math.e)  # sign-symmetric
    normalize = rp.normalize_by_length(max_len=200)
    assert normalize(3.0) == 3.0  # trainers call a processor with the reward only
    assert (normalize(3.0, text_length=50), normalize(3.0, text_length=400)) == (0.75, 3.0)
    with pytest.raises(ValueError, match="max_len must be > 0"):
        rp.normalize_by_length(0)


# ----------------------------------------------------------------------------------------------- the outside run's
# findings against CoMLRL 1.4.3 (each of these failed before its fix)
@pytest.mark.parametrize("value", ["null", "NULL", None, "none"])
def test_parallel_training_null_and_none_mean_none(value):
    from comlrl_lightning import MAGRPO

    assert compat.MAGRPOConfig(num_turns=1, parallel_training=value).parallel_training == "none"
    assert compat.IACConfig(num_turns=1, parallel_training=value).parallel_training == "none"
    assert MAGRPO(agents="tiny", reward_func=length_reward, parallel_training=value).parallel_training == "none"


@pytest.mark.parametrize(
    "config,values",
    [
        (compat.MAGRPOConfig, {"num_turns": 1, "agent_devices": "cpu"}),
        (compat.MAGRPOConfig, {"num_turns": 1, "agent_devices": ["cpu", "cuda:1"]}),
        (compat.IACConfig, {"num_turns": 1, "agent_devices": ["cpu"], "critic_devices": ["cpu"]}),
        (compat.IACConfig, {"num_turns": 1, "critic_devices": "cpu"}),
        (compat.MAACConfig, {"num_turns": 1, "agent_devices": "cpu", "critic_devices": "cpu"}),
        (compat.MADPOConfig, {"agent_devices": "cpu"}),
    ],
)
def test_devices_without_mp_are_accepted_as_comlrl_does(config, values):
    config(**values)  # CoMLRL places the whole team on the first device; so does the module (test_actor_critic.py)


def test_empty_agent_devices_with_mp_is_a_message():
    with pytest.raises(ValueError, match=re.escape("agent_devices must be a non-empty list or 'auto'.")):
        compat.MAGRPOConfig(num_turns=1, parallel_training="mp", agent_devices=[])


def test_iterative_configs_log_reward_distributions():
    assert compat.MADPOIterConfig(log_reward_distribution=True).log_reward_distribution
    assert compat.MARLHFIterConfig(log_reward_distribution=True).log_reward_distribution
    compat.MARLHFIterConfig(preference_num_candidates=3, num_iterations=1)
    args = compat.MADPOIterConfig(log_reward_distribution=True, num_iterations=1)
    with pytest.raises(ValueError, match="requires reward_func.reward_range"):  # the trainer checks the real reward
        make_trainer(compat.MADPOIterTrainer, agent_model="tiny", args=args)

    def ranged(first, second):
        return length_reward(first, second)

    ranged.reward_range = (0.0, 2.0)
    make_trainer(compat.MADPOIterTrainer, agent_model="tiny", reward_func=ranged, args=args)


@pytest.mark.parametrize(
    "build,message",
    [
        (
            lambda: compat.MADPOConfig(collaboration_mode="hybrid"),
            "collaboration_mode must be decentralized or centralized (got 'hybrid').",
        ),
        (
            lambda: compat.MAGRPOConfig(num_turns=1, joint_mode="diagonal"),
            "Unsupported joint_mode: diagonal (joint_mode must be one of: aligned, cross, align, crossed).",
        ),
        (
            lambda: compat.CentralizedMAGRPOConfig(num_turns=2),
            "Centralized MAGRPO currently supports num_turns=1 only.",
        ),
        (
            lambda: compat.MADPOConfig(pair_selection="best"),
            "pair_selection must be one of: reward_gap, random, all (got 'best').",
        ),
        (
            lambda: compat.MADPOConfig(pair_selection="comparator_reward"),
            "pair_selection must be one of: reward_gap, random, all (got 'comparator_reward').",
        ),
        (
            lambda: compat.MADPOIterConfig(pair_selection="best"),
            "pair_selection must be one of: reward_gap, random, all, comparator_reward (got 'best').",
        ),
    ],
)
def test_messages_keep_comlrl_wording(build, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_parallel_training_ddp_says_only_none_and_mp_and_where_data_parallel_goes():
    from comlrl_lightning import MAGRPO

    with pytest.raises(ValueError, match=r"parallel_training only supports: none, mp\..*trainer\.strategy: ddp"):
        MAGRPO(agents="tiny", reward_func=length_reward, parallel_training="ddp")


@pytest.mark.parametrize("trainer_class", TRAINERS, ids=lambda t: t.__name__)
def test_a_trainer_without_models_or_reward_says_what_comlrl_says(trainer_class):
    """CoMLRL's MAGRPO and preference trainers check the models first, its IAC/MAAC the reward function first."""
    config = type(trainer_class.default_config())
    args = config(num_turns=1) if "num_turns" in {f.name for f in dataclasses.fields(config)} else config()
    with pytest.raises(ValueError, match="Either agent_model or agents must be provided."):
        trainer_class(reward_func=length_reward, args=args)
    first = (
        "reward_func must be a callable."
        if trainer_class in (compat.IACTrainer, compat.MAACTrainer)
        else "Either agent_model or agents must be provided."
    )
    with pytest.raises(ValueError, match=re.escape(first)):
        trainer_class(args=args)


def test_centralized_wandb_run_config_names_magrpo_and_its_roles(caplog):
    trainer = make_trainer(
        compat.CentralizedMAGRPOTrainer,
        agent_model="tiny",
        args=compat.CentralizedMAGRPOConfig(num_generations=2),
        wandb_config={"project": "p", "config_sections": {"dataset": {"name": "d", "type": "t"}}},
    )
    config = trainer.build_logger()._wandb_init["config"]
    assert (config["algorithm"], config["num_roles"], config["num_actor_models"], config["collaboration_mode"]) == (
        "MAGRPO",
        2,
        1,
        "centralized",
    )
    assert (config["dataset_name"], config["dataset_type"], config["num_agents"]) == ("d", "t", 2)
    assert make_trainer(agent_model="tiny", wandb_config={}).wandb_run_config()["algorithm"] == "MAGRPO"
    with caplog.at_level(logging.WARNING):
        old = make_trainer(agent_model="tiny", dataset_type="mbpp", wandb_config={})  # removed in CoMLRL 1.4.3
    assert "dataset_type= was removed in CoMLRL 1.4.3" in caplog.text
    assert old.wandb_run_config()["dataset_type"] == "mbpp" and "num_roles" not in old.wandb_run_config()


def test_wandb_config_id_and_resume_reach_the_logger():
    wandb_config = {"project": "p", "id": "abc", "resume": "must"}
    logger = make_trainer(agent_model="tiny", wandb_config=wandb_config).build_logger()
    assert (logger._wandb_init["id"], logger._wandb_init["resume"]) == ("abc", "must")


def test_parallel_training_null_from_yaml(tmp_path):
    from comlrl_lightning.cli import main

    extra = tmp_path / "null.yaml"
    extra.write_text('model:\n  init_args:\n    parallel_training: "null"\n')
    cli = main(["--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(extra)], run=False)
    assert cli.model.parallel_training == "none"
    extra.write_text("model:\n  init_args:\n    parallel_training: null\n")
    assert (
        main(
            ["--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(extra)], run=False
        ).model.parallel_training
        == "none"
    )


# ----------------------------------------------------------------------------------------------- CoMLRL's own expectations
def test_actor_critic_trainers_have_their_critics_right_after_construction():
    """CoMLRL's IAC/MAAC trainers hold their critics once built (docs/compat.md lists ``critics``)."""
    iac = make_trainer(compat.IACTrainer, agent_model="tiny", critic_model="tiny", args=compat.IACConfig(num_turns=1))
    assert len(iac.critics) == 2 and iac.critics[0] is not iac.critics[1]
    shared = make_trainer(
        compat.IACTrainer, agent_model="tiny", args=compat.IACConfig(num_turns=1, use_separate_critic=False)
    )
    assert len(shared.critics) == 0  # the value heads sit on the actors
    maac = make_trainer(
        compat.MAACTrainer, agent_model="tiny", critic_model="tiny", args=compat.MAACConfig(num_turns=1)
    )
    assert len(maac.critics) == 1


@pytest.mark.parametrize("config", [compat.MADPOIterConfig, compat.MARLHFIterConfig], ids=lambda c: c.__name__)
def test_a_centralized_iterative_config_generates_its_comparators_centralized(config):
    assert config().comparator_generation_mode == "decentralized"
    args = config(collaboration_mode="centralized")
    assert args.comparator_generation_mode == "centralized"
    trainer = make_trainer(
        compat.MADPOIterTrainer if config is compat.MADPOIterConfig else compat.MARLHFIterTrainer,
        agent_model="tiny",
        args=args,
    )
    assert trainer.module.comparator_generation_mode == "centralized"


def test_messages_carry_comlrl_sentences():
    """Where our message says more, CoMLRL's sentence is still in it (a migrating user searches for it)."""
    from comlrl_lightning.agents import load_agents

    models, tokenizers = load_agents("tiny", num_agents=2)
    iac = dict(args=compat.IACConfig(num_turns=1, use_separate_critic=False))
    cases = [
        (lambda: make_trainer(agents=[]), "Either agent_model or agents must be provided."),
        (lambda: make_trainer(compat.IACTrainer, agents=[], **iac), "Either agent_model or agents must be provided."),
        (
            lambda: make_trainer(compat.IACTrainer, agent_model=models[0], **iac),
            "Multi-agent IAC requires `agent_model` to be a pretrained identifier string.",
        ),
        (
            lambda: make_trainer(
                compat.MAACTrainer, agent_model=models[0], critic_model="tiny", args=compat.MAACConfig(num_turns=1)
            ),
            "Multi-agent MAAC requires `agent_model` to be a pretrained identifier string.",
        ),
        (
            lambda: make_trainer(agents=list(models)),
            "Tokenizer(s) must be provided when agents are model objects.",
        ),
        (
            lambda: make_trainer(compat.IACTrainer, agents=list(models), **iac),
            "Tokenizer must be provided when using agents.",
        ),
        (
            lambda: compat.MARLHFConfig(joint_mode="cross"),
            "MARLHF reward model currently supports aligned joint_mode only.",
        ),
        (
            lambda: compat.CentralizedMAGRPOConfig(collaboration_mode="decentralized"),
            "CentralizedMAGRPOConfig requires centralized collaboration.",
        ),
        (
            lambda: make_trainer(agent_model="tiny", formatters=lambda item: 3).module.prompt_formatters[0](ITEMS[0]),
            "Formatter must return a string prompt.",
        ),
        (
            lambda: (
                make_trainer(
                    compat.IACTrainer,
                    agent_model="tiny",
                    critic_model="no-org/no-such-critic",
                    args=compat.IACConfig(num_turns=1),
                ).critics
            ),
            "Failed to load critic model from identifier 'no-org/no-such-critic'.",
        ),
    ]
    for build, sentence in cases:
        with pytest.raises((ValueError, TypeError, OSError), match=re.escape(sentence)):
            build()


def test_a_hand_made_alternation_of_two_trainers_is_one_config(tmp_path):
    """CoMLRL's recursive self-improvement: a trainer per agent, trained in turn by a hand-written loop. Here one
    trainer takes agent_update_schedule: alternating (docs/compat.md); frozen partners are trained_agents."""
    trainer = compat.MAGRPOTrainer(
        agent_model="tiny",
        reward_func=length_reward,
        train_dataset=ITEMS,
        args=compat.MAGRPOConfig(
            output_dir=str(tmp_path),
            agent_update_schedule="alternating",
            alternate_every=1,
            num_turns=1,
            num_generations=2,
            rollout_buffer_size=1,
            **SMALL,
        ),
        trainer_options=QUIET,
    )
    trainer.train()
    rows = [r for r in metric_rows(tmp_path) if r.get("agent_0/stepped")]
    assert [(float(r["agent_0/stepped"]), float(r["agent_1/stepped"])) for r in rows] == [(1, 0), (0, 1), (1, 0)]
    with pytest.raises(ValueError, match="trained_agents must be distinct agent indices"):
        compat.MAGRPOConfig(trained_agents=[5], **SMALL)
