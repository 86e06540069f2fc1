"""Seeded learning tests: from random init the team's task reward rises by a margin within a fixed budget."""

import math

import pytest
import torch
from test_magrpo import ITEMS, column, fit, make_module, read_metrics

from comlrl_lightning.envs import toy

# Items the preference families never train on; their reward is measured by the module's own evaluation.
HELD_OUT = [{"prompt": f"held-out topic {i}", "topic": f"held-out topic {i}"} for i in range(32)]


# A LoRA team (agents/lora.py) trains only its adapters on one frozen base. A random base has tiny logits, which
# adapters inside the layers barely move, so the output layer gets one too (on a trained model ``all-linear`` —
# every layer but the output — is the usual choice).
LORA = dict(lora_rank=8, lora_alpha=16.0, lora_target_modules=["q_proj", "v_proj", "up_proj", "down_proj", "lm_head"])


@pytest.mark.parametrize(
    "agents,lr,team",
    [("tiny", 1e-2, {}), ("tiny-5m", 2e-3, {}), ("tiny", 2e-2, LORA)],
    ids=["tiny", "tiny-5m", "tiny-lora"],
)
def test_magrpo_team_learns_the_letter_task(agents, lr, team, tmp_path):
    """Two agents from random init; reward = share of the letter 'e' in both completions (chance ~0.12)."""
    module = make_module(
        agents=agents,
        reward_func=toy.letter_reward,
        num_generations=8,
        max_new_tokens=8,
        agent_learning_rate=lr,
        rollout_buffer_size=4,
        **team,
    )
    assert_reward_rises(fit(module, tmp_path, max_steps=20, prompts_per_step=4, items=ITEMS * 4))


@pytest.mark.parametrize("variant", ["iac-head", "maac"])
def test_actor_critic_team_learns_the_letter_task(variant, tmp_path):
    """From random init, the letter task (the share of 'e' in both completions, chance ~0.12) rises within 20
    updates: IAC with a value head on each actor, MAAC with one centralized critic over the joint text."""
    from test_actor_critic import make_ac

    from comlrl_lightning import IAC, MAAC

    cls, critic = {
        "iac-head": (IAC, {"use_separate_critic": False}),
        "maac": (MAAC, {"critic_type": "v", "critic_learning_rate": 1e-2}),
    }[variant]
    module = make_ac(
        cls,
        reward_func=toy.letter_reward,
        num_generations=8,
        max_new_tokens=8,
        agent_learning_rate=1e-2,
        rollout_buffer_size=32,
        **critic,
    )
    assert_reward_rises(fit(module, tmp_path, max_steps=20, prompts_per_step=4, items=ITEMS * 4))


MARLHF_STEPS = 96


def test_marlhf_team_learns_the_letter_task_from_its_reward_model(tmp_path):
    """MARLHF from random init: a reward model learns pairs scored by the letter task (epoch 0), then MAGRPO trains
    on the reward model's scores alone — the task reward is never called in the RL stage — and the team's task reward
    on held-out items rises. (The reward model needs many pairs with wide gaps to generalise past its pairs.)"""
    from test_madpo import fit_madpo
    from test_marlhf import make_marlhf

    in_reward_model_stage = []

    def task_reward(*completions, batch_items=None):
        in_reward_model_stage.append(module.in_reward_model_stage)
        return toy.letter_reward(*completions)

    module = make_marlhf(
        reward_func=task_reward,
        preference_num_candidates=32,
        preference_pairs_per_sample=16,
        reward_train_batch_size=16,
        reward_num_train_epochs=2,
        reward_learning_rate=2e-3,
        num_generations=8,
        rollout_buffer_size=4,
        max_new_tokens=8,
        agent_learning_rate=5e-3,
        eval_interval=0,
    )
    before = held_out_reward(module)
    calls_before_fit = len(in_reward_model_stage)
    trainer, data = fit_madpo(module, tmp_path, items=ITEMS * 4, max_epochs=-1, max_steps=112)
    during_fit = in_reward_model_stage[calls_before_fit:]
    assert during_fit and all(during_fit)  # the pairs were scored by the task; the RL stage never asked it
    reward_model_updates = len(column(read_metrics(trainer), "reward_model/loss"))
    assert reward_model_updates == 2 * math.ceil(len(data.pairs) / 16) < trainer.global_step == 112  # then RL
    after = held_out_reward(module)
    assert after > before + 0.1, (before, after)


def test_madpo_iter_team_learns_the_letter_task(tmp_path):
    """MADPOIter from random init: rounds of pairs (current team vs an independent sample of itself) and DPO on
    each round's pairs; the team's task reward on held-out items rises."""
    from test_iterative import fit_iter, make_iter

    module = make_iter(
        preference_num_candidates=16,
        preference_pairs_per_sample=16,
        train_batch_size=16,
        agent_learning_rate=1e-2,
        dpo_beta=0.1,
        max_new_tokens=8,
        num_iterations=4,
    )
    before = held_out_reward(module)
    trainer, _ = fit_iter(module, tmp_path, items=ITEMS * 2)
    assert trainer.current_epoch == 4  # four rounds
    after = held_out_reward(module)
    assert after > before + 0.2, (before, after)


def test_marlhf_iter_team_learns_the_letter_task(tmp_path):
    """MARLHFIter from random init: each round a fresh reward model learns the round's pairs (the widest gaps of
    32 comparisons per task), then four MAGRPO epochs train on it; the team's task reward on held-out items
    rises. Its gain depends on the seed more than any other family's (10 seeds of fit_iter: +0.02 to +0.46, median
    +0.2); with the agents' learning rate at 1e-12 it moves by +0.009, so a margin of 0.05 tells learning from
    none."""
    from test_iterative import fit_iter, make_iter

    from comlrl_lightning import MARLHFIter

    module = make_iter(
        MARLHFIter,
        preference_num_candidates=32,
        preference_pairs_per_sample=8,
        pair_selection="reward_gap",
        reward_model_name="tiny",
        reward_train_batch_size=16,
        reward_num_train_epochs=2,
        reward_learning_rate=2e-3,
        num_generations=8,
        rollout_buffer_size=4,
        max_new_tokens=8,
        agent_learning_rate=1e-2,
        rl_epochs_per_round=4,
        num_iterations=3,
    )
    before = held_out_reward(module)
    trainer, _ = fit_iter(module, tmp_path, items=ITEMS * 2)
    assert trainer.current_epoch == 3 * 5  # three rounds of a reward-model epoch + four RL epochs
    after = held_out_reward(module)
    assert after > before + 0.05, (before, after)


def held_out_reward(module) -> float:
    """The module's evaluation of ``HELD_OUT`` (task reward, one sampled completion per agent) with a fixed seed,
    in a forked RNG so that training's random stream is untouched."""
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        return module.evaluation.evaluate(HELD_OUT, batch_size=len(HELD_OUT))["eval/turn_1/reward_mean"]


def assert_reward_rises(trainer, steps: int = 20, margin: float = 0.1) -> None:
    """The mean rollout reward of the last 5 updates beats the first 5 by ``margin``."""
    rewards = column(read_metrics(trainer), "rollout/turn_1/reward_mean")
    assert len(rewards) == steps
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + margin, (first, last, rewards)
