"""Seeded learning tests: the team reward rises by a margin over a fixed number of updates."""

import pytest

from comlrl_lightning.envs import toy
from test_magrpo import ITEMS, column, fit, make_module, read_metrics


# A LoRA team (agents/lora.py) trains only its adapters on one frozen base. A random base has tiny logits, which
# adapters inside the layers barely move, so the output layer gets one too (on a trained model ``all-linear`` —
# every layer but the output — is the usual choice).
LORA = dict(lora_rank=8, lora_alpha=16.0, lora_target_modules=["q_proj", "v_proj", "up_proj", "down_proj", "lm_head"])


@pytest.mark.parametrize("agents,lr,team", [("tiny", 1e-2, {}), ("tiny-5m", 2e-3, {}), ("tiny", 2e-2, LORA)],
                         ids=["tiny", "tiny-5m", "tiny-lora"])
def test_magrpo_team_learns_the_letter_task(agents, lr, team, tmp_path):
    """Two agents from random init; reward = share of the letter 'e' in both completions (chance ~0.12)."""
    module = make_module(agents=agents, reward_func=toy.letter_reward, num_generations=8, max_new_tokens=8,
                         agent_learning_rate=lr, rollout_buffer_size=4, **team)
    assert_reward_rises(fit(module, tmp_path, max_steps=20, prompts_per_step=4, items=ITEMS * 4))


@pytest.mark.parametrize("variant", ["iac-head", "maac"])
def test_actor_critic_team_learns_the_letter_task(variant, tmp_path):
    """From random init, the letter task (the share of 'e' in both completions, chance ~0.12) rises within 20
    updates: IAC with a value head on each actor, MAAC with one centralized critic over the joint text."""
    from test_actor_critic import make_ac

    from comlrl_lightning import IAC, MAAC

    cls, critic = {"iac-head": (IAC, {"use_separate_critic": False}),
                   "maac": (MAAC, {"critic_type": "v", "critic_learning_rate": 1e-2})}[variant]
    module = make_ac(cls, reward_func=toy.letter_reward, num_generations=8, max_new_tokens=8,
                     agent_learning_rate=1e-2, rollout_buffer_size=32, **critic)
    assert_reward_rises(fit(module, tmp_path, max_steps=20, prompts_per_step=4, items=ITEMS * 4))


def assert_reward_rises(trainer, steps: int = 20, margin: float = 0.1) -> None:
    """The mean rollout reward of the last 5 updates beats the first 5 by ``margin``."""
    rewards = column(read_metrics(trainer), "rollout/turn_1/reward_mean")
    assert len(rewards) == steps
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + margin, (first, last, rewards)
