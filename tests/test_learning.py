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
    trainer = fit(module, tmp_path, max_steps=20, prompts_per_step=4, items=ITEMS * 4)
    rewards = column(read_metrics(trainer), "rollout/turn_1/reward_mean")
    assert len(rewards) == 20
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, (first, last, rewards)


def test_maac_team_learns_the_letter_task(tmp_path):
    """MAAC from random init: two actors and one centralized critic over the joint text; the letter task (the share
    of 'e' in both completions, chance ~0.12) rises within 20 updates."""
    from test_actor_critic import make_ac

    from comlrl_lightning import MAAC

    module = make_ac(MAAC, reward_func=toy.letter_reward, num_generations=8, max_new_tokens=8, critic_type="v",
                     agent_learning_rate=1e-2, critic_learning_rate=1e-2, rollout_buffer_size=32)
    trainer = fit(module, tmp_path, max_steps=20, prompts_per_step=4, items=ITEMS * 4)
    rewards = column(read_metrics(trainer), "rollout/turn_1/reward_mean")
    assert len(rewards) == 20
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, (first, last, rewards)
