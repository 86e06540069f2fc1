"""Coding configs (CoopHumanEval 1/2 turns, MBPP) parse; default dataset functions load the shared copies."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not SHARED.exists(), reason=f"shared data not found under {SHARED}")


@pytest.mark.parametrize("name", ["coding_che_magrpo.yaml", "coding_che_magrpo_2turn.yaml", "coding_mbpp_magrpo.yaml"])
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


def _fit(tmp_path, module, items, max_steps=1):
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger

    from comlrl_lightning import TaskDataModule

    seed_everything(0)
    trainer = Trainer(
        max_steps=max_steps,
        logger=CSVLogger(tmp_path, name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        log_every_n_steps=1,
    )
    trainer.fit(module, datamodule=TaskDataModule(dataset=items, eval_dataset=items[:1], prompts_per_step=len(items)))
    return (Path(trainer.logger.log_dir) / "metrics.csv").read_text()


def _counting(reward):
    calls = []

    def counted(*completions, batch_items=None):
        calls.append(len(completions[0]))
        return reward(*completions, batch_items=batch_items)

    counted.reward_range = reward.reward_range
    return counted, calls


@needs_data
@pytest.mark.parametrize("dataset", ["che", "mbpp"])
def test_one_turn_coding_fit_on_real_items(dataset, tmp_path):
    """MAGRPO on two real CoopHumanEval / MBPP items: aux + main agents, the sandboxed coding reward."""
    from comlrl_lightning import MAGRPO
    from comlrl_lightning.envs import coding
    from comlrl_lightning.envs import datasets as d

    items = (d.che_train_tasks() if dataset == "che" else d.mbpp_eval_tasks())[:2]
    reward, calls = _counting(coding.CodingReward(timeout_per_test=2.0, workers=2))
    module = MAGRPO(
        agents="tiny",
        reward_func=reward,
        formatters=[coding.aux_formatter, coding.main_formatter],
        num_generations=2,
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        eval_interval=1,
        eval_num_samples=1,
        eval_logger=coding.coding_eval_logger,
        eval_aggregator=coding.coding_eval_aggregator,
        log_completions=False,
    )
    metrics = _fit(tmp_path, module, items)
    assert 4 in calls  # training: 2 items x K=2 aligned joint actions in one reward call (eval calls have 1)
    assert "turn_1/reward_mean" in metrics and "eval/turn_1/pass_rate" in metrics


@needs_data
def test_two_turn_coding_fit_with_level_feedback(tmp_path):
    """Two turns: the level-feedback transition builds turn-2 prompts from static and sandbox diagnostics."""
    from comlrl_lightning import MAGRPO
    from comlrl_lightning.envs import coding
    from comlrl_lightning.envs import datasets as d

    items = d.che_train_tasks()[:1]
    transition = coding.LevelFeedbackTransition(tasks=items, timeout_per_test=2.0)
    seen = []

    def spy(**kwargs):
        prompts = transition(**kwargs)
        seen.append(prompts)
        return prompts

    module = MAGRPO(
        agents="tiny",
        reward_func=coding.CodingReward(timeout_per_test=2.0),
        formatters=[coding.aux_formatter, coding.main_formatter],
        num_turns=2,
        external_transition=spy,
        external_prompt_passthrough=True,
        num_generations=2,
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        eval_interval=0,
        log_completions=False,
        rollout_buffer_size=3,
    )
    metrics = _fit(tmp_path, module, items)
    assert len(seen) == 2 and all(len(p) == 2 for p in seen)  # one transition per turn-1 joint action
    assert "Output ONLY the function code" in seen[0][1]
    assert "turn_2/reward_mean" in metrics


@needs_data
def test_classeval_fit_on_a_real_item(tmp_path):
    from comlrl_lightning import MAGRPO
    from comlrl_lightning.envs import classeval

    items = classeval.classeval_default_tasks()[:1]
    module = MAGRPO(
        agents="tiny",
        reward_func=classeval.ClassEvalReward(timeout_per_test=2.0),
        formatters=[classeval.classeval_agent0_prompt, classeval.classeval_agent1_prompt],
        num_generations=2,
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        eval_interval=0,
        log_completions=False,
    )
    metrics = _fit(tmp_path, module, items)
    assert "turn_1/reward_mean" in metrics
