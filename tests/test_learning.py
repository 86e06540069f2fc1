"""Seeded learning tests: the team reward rises by a margin over a fixed number of updates."""

import pytest

from comlrl_lightning.envs import toy
from test_magrpo import ITEMS, column, fit, make_module, read_metrics


@pytest.mark.parametrize("agents,lr", [("tiny", 1e-2), ("tiny-5m", 2e-3)])
def test_magrpo_team_learns_the_letter_task(agents, lr, tmp_path):
    """Two agents from random init; reward = share of the letter 'e' in both completions (chance ~0.12)."""
    module = make_module(agents=agents, reward_func=toy.letter_reward, num_generations=8, max_new_tokens=8,
                         agent_learning_rate=lr, rollout_buffer_size=4)
    trainer = fit(module, tmp_path, max_steps=20, prompts_per_step=4, items=ITEMS * 4)
    rewards = column(read_metrics(trainer), "rollout/turn_1/reward_mean")
    assert len(rewards) == 20
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, (first, last, rewards)
