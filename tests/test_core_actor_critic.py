"""Hand-derived checks of the actor-critic math: TD(0) targets, Monte-Carlo returns, critic advantages, reward
expansion and the (clipped) value loss (docs/algorithms.md#actor-critic, example 10)."""

import math

import pytest
import torch

from comlrl_lightning.core import (
    compute_advantages,
    critic_advantages,
    discounted_returns,
    expand_rewards,
    td_targets,
    value_loss,
)

NAN = float("nan")


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- TD(0) targets ---------------------------------------------------------------------------------------


def test_td_single_turn_is_the_reward():
    # One turn: nothing to bootstrap from, target = r whatever next_values holds.
    close(td_targets(torch.tensor([0.7]), torch.tensor([5.0]), discount=0.9), [0.7])


def test_td_two_turns():
    # r = [1, 2], V_old(h_1) = 3  ->  target_0 = 1 + 0.9 * 3 = 3.7, target_1 = r_1 = 2 (next value ignored).
    close(td_targets(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 99.0]), 0.9), [3.7, 2.0])


def test_td_three_turns_and_a_nan_last_next_value_never_leaks():
    # r = [1, 0, 2], V_old(h_1) = 2, V_old(h_2) = 4:
    #   target_0 = 1 + 0.9 * 2 = 2.8, target_1 = 0 + 0.9 * 4 = 3.6, target_2 = 2.
    got = td_targets(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([2.0, 4.0, NAN]), 0.9)
    close(got, [2.8, 3.6, 2.0])


def test_td_from_old_values_rolled():
    old_values = torch.tensor([0.5, 2.0, 4.0])  # V_old(h_0), V_old(h_1), V_old(h_2)
    rewards = torch.tensor([1.0, 0.0, 2.0])
    targets = td_targets(rewards, old_values.roll(-1, dims=-1), 0.9)
    close(targets, [2.8, 3.6, 2.0])
    # A_t = target_t - V_old(h_t) = the TD error: [2.3, 1.6, -2.0]
    close(critic_advantages(targets, old_values, normalize=False), [2.3, 1.6, -2.0])


def test_td_early_terminated_rows():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 2.0, 9.0], [0.5, 9.0, 9.0]])
    next_values = torch.tensor([[2.0, 4.0, 7.0], [3.0, 7.0, 8.0], [100.0, 7.0, NAN]])
    valid = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    # row 0: full episode as above; row 1 stopped after turn 1: [1 + 0.9*3, 2 (last, no bootstrap), 0];
    # row 2 stopped after turn 0: [0.5, 0, 0].
    got = td_targets(rewards, next_values, 0.9, valid)
    close(got, [[2.8, 3.6, 2.0], [3.7, 2.0, 0.0], [0.5, 0.0, 0.0]])


def test_td_discount_zero_and_one():
    r, v = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0])
    close(td_targets(r, v, 0.0), [1.0, 2.0])
    close(td_targets(r, v, 1.0), [4.0, 2.0])


def test_td_leading_dims_and_dtype():
    r = torch.tensor([[[1, 2]], [[0, 1]]])  # int rewards [2, 1, 2] -> float32
    v = torch.tensor([[[3.0, 0.0]], [[1.0, 0.0]]])
    got = td_targets(r, v, 0.5)
    assert got.dtype == torch.float32 and got.shape == (2, 1, 2)
    close(got, [[[2.5, 2.0]], [[0.5, 1.0]]])
    assert td_targets(r.double(), v, 0.5).dtype == torch.float64


def test_td_validation():
    with pytest.raises(ValueError, match="next_values must have the rewards' shape"):
        td_targets(torch.zeros(3), torch.zeros(2), 0.9)
    with pytest.raises(ValueError, match="valid must have the rewards' shape"):
        td_targets(torch.zeros(3), torch.zeros(3), 0.9, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="valid must mark a prefix"):
        td_targets(torch.zeros(3), torch.zeros(3), 0.9, torch.tensor([True, False, True]))


# --- Monte-Carlo returns ---------------------------------------------------------------------------------


def test_discounted_returns_hand_values():
    # r = [1, 0, 2], γ = 0.9: G_2 = 2, G_1 = 0 + 0.9*2 = 1.8, G_0 = 1 + 0.9*1.8 = 2.62
    close(discounted_returns(torch.tensor([1.0, 0.0, 2.0]), 0.9), [2.62, 1.8, 2.0])
    close(discounted_returns(torch.tensor([3.0]), 0.9), [3.0])


def test_discounted_returns_ignore_turns_not_executed():
    rewards = torch.tensor([[1.0, 2.0, 100.0], [1.0, 0.0, 2.0]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    # row 0: G_1 = 2, G_0 = 1 + 0.9*2 = 2.8, turn 2 -> 0 (its 100 never counts)
    close(discounted_returns(rewards, 0.9, valid), [[2.8, 2.0, 0.0], [2.62, 1.8, 2.0]])


def test_td_targets_equal_returns_when_values_are_the_true_returns():
    # Bootstrapping from V(h_{t+1}) = G_{t+1} reproduces the Monte-Carlo return exactly.
    r = torch.tensor([[0.3, -1.0, 2.0, 0.5]])
    g = discounted_returns(r, 0.8)
    close(td_targets(r, g.roll(-1, dims=-1), 0.8), g, atol=1e-6)


# --- Critic advantages -----------------------------------------------------------------------------------


def test_critic_advantages_unnormalized():
    targets = torch.tensor([1.0, 2.0, 3.0, 6.0])
    close(critic_advantages(targets, torch.zeros(4), normalize=False), [1.0, 2.0, 3.0, 6.0])
    close(critic_advantages(targets, torch.tensor([1.0, 1.0, 0.5, 7.0]), normalize=False), [0.0, 1.0, 2.5, -1.0])


def test_critic_advantages_normalized():
    # A = [1, 2, 3, 6] - [1, 1, 1, 1] = [0, 1, 2, 5]: mean 2, population var (4+1+0+9)/4 = 3.5
    got = critic_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.ones(4))
    close(got, [(a - 2.0) / math.sqrt(3.5) for a in [0.0, 1.0, 2.0, 5.0]], atol=1e-5)
    close(got, compute_advantages(torch.tensor([0.0, 1.0, 2.0, 5.0]), "raw"), atol=1e-6)  # same normalization


def test_critic_advantages_single_sample_is_not_normalized():
    close(critic_advantages(torch.tensor([2.0]), torch.tensor([0.5])), [1.5])


def test_critic_advantages_std_floor():
    # All-equal advantages: 0, not 0/0 = NaN.
    close(critic_advantages(torch.tensor([3.0, 3.0, 3.0]), torch.tensor([1.0, 1.0, 1.0])), [0.0, 0.0, 0.0])
    # A = [1e-8, 0]: mean 5e-9, std 5e-9 < eps = 1e-6 -> divided by 1e-6: [5e-3, -5e-3]
    got = critic_advantages(torch.tensor([1e-8, 0.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    close(got, [5e-3, -5e-3], atol=1e-12)
    close(
        critic_advantages(torch.tensor([1e-8, 0.0], dtype=torch.float64), torch.zeros(2), eps=1e-9),
        [1.0, -1.0],
        atol=1e-9,
    )


def test_critic_advantages_groups_are_the_last_dim():
    targets = torch.tensor([[1.0, 3.0], [5.0, 5.0]])
    close(critic_advantages(targets, torch.zeros(2, 2)), [[-1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="targets and old_values must have the same shape"):
        critic_advantages(targets, torch.zeros(2))


# --- Reward expansion ------------------------------------------------------------------------------------


def test_expand_one_reward_to_everyone():
    got = expand_rewards([0.5], num_agents=2, num_generations=3)
    assert got.shape == (2, 3) and got.dtype == torch.float32
    close(got, [[0.5] * 3] * 2)


def test_expand_k_rewards_per_joint_sample():
    close(expand_rewards([1.0, 2.0, 3.0], 2, 3), [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])


def test_expand_n_rewards_per_agent():
    close(expand_rewards([1.0, 2.0], 2, 3), [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    close(expand_rewards([1.0, 2.0, 3.0], 3, 1), [[1.0], [2.0], [3.0]])  # multi-turn: K = 1


def test_expand_n_equals_k_is_read_per_sample():
    # N == K == 2: CoMLRL checks length K before length N, so [1, 2] is sample k's reward for both agents.
    close(expand_rewards([1.0, 2.0], 2, 2), [[1.0, 2.0], [1.0, 2.0]])


def test_expand_single_agent():
    close(expand_rewards([1.0, 2.0, 3.0], 1, 3), [[1.0, 2.0, 3.0]])
    close(expand_rewards([4.0], 1, 3), [[4.0, 4.0, 4.0]])
    close(expand_rewards([4.0], 1, 1), [[4.0]])


def test_expand_tensor_input():
    got = expand_rewards(torch.tensor([1.0, 2.0], dtype=torch.float64), 2, 3)
    assert got.dtype == torch.float64
    close(got, [[1.0] * 3, [2.0] * 3])
    close(expand_rewards(torch.tensor(7), 2, 2), [[7.0, 7.0], [7.0, 7.0]])


def test_expand_error_message():
    msg = (
        r"Reward function must return 1 value, num_generations values, or num_agents values; "
        r"got 4 \(num_agents=2, num_generations=3\)\."
    )
    with pytest.raises(ValueError, match=msg):
        expand_rewards([1.0, 2.0, 3.0, 4.0], 2, 3)
    with pytest.raises(ValueError, match=r"got 2 \(num_agents=1, num_generations=3\)"):
        expand_rewards([1.0, 2.0], 1, 3)
    with pytest.raises(ValueError, match=r"got 0"):
        expand_rewards([], 2, 3)
    with pytest.raises(ValueError, match="num_agents must be >= 1"):
        expand_rewards([1.0], 0, 3)
    with pytest.raises(ValueError, match="num_generations must be >= 1"):
        expand_rewards([1.0], 2, 0)


# --- Value loss ------------------------------------------------------------------------------------------


def test_value_loss_plain():
    # mean((0 - 1)^2, (4 - 2)^2) = (1 + 4) / 2
    close(value_loss(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0])), 2.5)
    # old_values without clip_range: still plain
    close(value_loss(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0]), old_values=torch.zeros(2)), 2.5)


def test_value_loss_plain_gradient():
    v = torch.tensor([1.0, 2.0], requires_grad=True)
    value_loss(v, torch.tensor([0.0, 4.0])).backward()
    close(v.grad, [1.0, -2.0])  # d/dV mean (t - V)^2 = 2 (V - t) / B


def test_value_loss_clipped_not_binding():
    # V - V_old = 0.1 inside ±0.2: V_clip = V, loss = (2 - 1.1)^2 = 0.81, same as plain
    v, old, target = torch.tensor([1.1]), torch.tensor([1.0]), torch.tensor([2.0])
    close(value_loss(v, target, old, clip_range=0.2), 0.81, atol=1e-6)
    close(value_loss(v, target, old, clip_range=0.2), value_loss(v, target))


def test_value_loss_clipped_binding_clipped_term_dominates_and_has_no_gradient():
    # V_old = 1, V = 1.5 (moved +0.5 > 0.2): V_clip = 1.2. target 2: (2-1.5)^2 = 0.25 < (2-1.2)^2 = 0.64
    v = torch.tensor([1.5], requires_grad=True)
    loss = value_loss(v, torch.tensor([2.0]), torch.tensor([1.0]), clip_range=0.2)
    close(loss, 0.64, atol=1e-6)
    loss.backward()
    close(v.grad, [0.0])


def test_value_loss_clipped_binding_unclipped_term_dominates():
    # Same V, target 0: (0-1.5)^2 = 2.25 > (0-1.2)^2 = 1.44 -> 2.25, gradient 2 (1.5 - 0) = 3
    v = torch.tensor([1.5], requires_grad=True)
    loss = value_loss(v, torch.tensor([0.0]), torch.tensor([1.0]), clip_range=0.2)
    close(loss, 2.25, atol=1e-6)
    loss.backward()
    close(v.grad, [3.0], atol=1e-6)


def test_value_loss_clipped_batch_both_sides():
    # sample 0: V_old 1, V 1.5, target 2 -> 0.64 (clipped, no grad)
    # sample 1: V_old 1, V 1.5, target 0 -> 2.25 (unclipped, grad 3 / B)
    # sample 2: V_old 0, V -1 (moved -1): V_clip = -0.2; target -2: (−2+1)^2 = 1 < (−2+0.2)^2 = 3.24 -> 3.24, no grad
    # sample 3: V_old 0, V -1, target 1: (1+1)^2 = 4 > (1+0.2)^2 = 1.44 -> 4, grad 2 (-1 - 1) / B = -4 / 4
    v = torch.tensor([1.5, 1.5, -1.0, -1.0], requires_grad=True)
    old = torch.tensor([1.0, 1.0, 0.0, 0.0])
    target = torch.tensor([2.0, 0.0, -2.0, 1.0])
    loss = value_loss(v, target, old, clip_range=0.2)
    close(loss, (0.64 + 2.25 + 3.24 + 4.0) / 4, atol=1e-6)
    loss.backward()
    close(v.grad, [0.0, 0.75, 0.0, -1.0], atol=1e-6)


def test_value_loss_dtypes_and_empty_batch():
    loss = value_loss(torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([0.0, 4.0]))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    v = torch.zeros(0, requires_grad=True)
    empty = value_loss(v, torch.zeros(0), torch.zeros(0), clip_range=0.2)
    assert float(empty.detach()) == 0.0 and empty.requires_grad


def test_value_loss_validation():
    with pytest.raises(ValueError, match=r"values and targets must both be \[B\]"):
        value_loss(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match=r"values and targets must both be \[B\]"):
        value_loss(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="old_values must be given when clip_range is set"):
        value_loss(torch.zeros(2), torch.zeros(2), clip_range=0.2)
    with pytest.raises(ValueError, match=r"value_clip_range must be > 0 or null \(got 0.0\)"):
        value_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.0)
    with pytest.raises(ValueError, match=r"old_values must be \[B\]"):
        value_loss(torch.zeros(2), torch.zeros(2), torch.zeros(3), clip_range=0.2)


def test_a_team_reward_one_short_is_rejected_not_read_per_agent():
    # MAAC (per_agent=False): N=2, K=3 and two values are a list one short of K, not per-agent rewards
    with pytest.raises(ValueError, match=r"one value per joint action \(num_generations=3\) or one for all; got 2"):
        expand_rewards([1.0, 2.0], 2, 3, per_agent=False)
    close(expand_rewards([1.0, 2.0, 3.0], 2, 3, per_agent=False), [[1.0, 2.0, 3.0]] * 2)
    close(expand_rewards([5.0], 2, 3, per_agent=False), [[5.0] * 3] * 2)
