"""Hand-derived checks of returns, cross credit and advantages (docs/algorithms.md examples 1-3)."""

import itertools
import math

import pytest
import torch

from comlrl_lightning.core import (
    ADVANTAGE_MODES,
    BASELINES,
    bootstrap_returns,
    component_advantages,
    compute_advantages,
    cross_credit,
    cross_joint_indices,
    suffix_returns,
)

G = torch.tensor([1.0, 2.0, 3.0, 6.0])  # docs/algorithms.md example 1
E1_UNNORMALIZED = {
    "mean": [-2.0, -1.0, 0.0, 3.0],
    "rloo": [-8 / 3, -4 / 3, 0.0, 4.0],
    "max": [-5.0, -4.0, -3.0, 0.0],
    "raw": [1.0, 2.0, 3.0, 6.0],
}
E1_NORMALIZED = [(g - 3.0) / math.sqrt(3.5) for g in [1.0, 2.0, 3.0, 6.0]]  # [-1.069, -0.535, 0, 1.604]


def close(actual, expected, atol=1e-3):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_e1_each_mode_unnormalized(mode):
    close(compute_advantages(G, mode, normalize=False), E1_UNNORMALIZED[mode])


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_e1_every_mode_normalizes_to_the_same(mode):
    adv = compute_advantages(G, mode, normalize=True)
    close(adv, E1_NORMALIZED)
    close(adv, [-1.069, -0.535, 0.0, 1.604])


def test_registry_matches_modes():
    # the built-ins first; baselines registered by users (e.g. the median example, imported by its tests) follow
    assert tuple(BASELINES)[: len(ADVANTAGE_MODES)] == ADVANTAGE_MODES


def test_e1_kl_shaped_returns():
    beta, kl = 0.5, torch.tensor([0.2, 0.4, 0.0, 0.0])
    shaped = G - beta * kl
    close(shaped, [0.9, 1.8, 3.0, 6.0])
    # mean of shaped = 11.7 / 4 = 2.925
    close(compute_advantages(shaped, "mean", normalize=False), [0.9 - 2.925, 1.8 - 2.925, 3 - 2.925, 6 - 2.925])


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_leading_batch_dims_are_independent_groups(mode):
    returns = torch.randn(2, 3, 4)
    adv = compute_advantages(returns, mode, normalize=True)
    assert adv.shape == (2, 3, 4) and adv.dtype == torch.float32
    for i, j in itertools.product(range(2), range(3)):
        close(adv[i, j], compute_advantages(returns[i, j], mode), atol=1e-6)
    close(adv.mean(-1), torch.zeros(2, 3), atol=1e-5)


def test_integer_returns_are_promoted_to_float32():
    adv = compute_advantages(torch.tensor([1, 2, 3, 6]), "rloo", normalize=False)
    assert adv.dtype == torch.float32
    close(adv, E1_UNNORMALIZED["rloo"])


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_k_equals_one(mode):
    returns = torch.tensor([[5.0], [-2.0]])
    expected = {"mean": [[0.0], [0.0]], "rloo": [[0.0], [0.0]], "max": [[0.0], [0.0]], "raw": [[5.0], [-2.0]]}
    # K = 1: rloo falls back to mean; normalization is skipped (no group to normalize over).
    close(compute_advantages(returns, mode, normalize=False), expected[mode])
    close(compute_advantages(returns, mode, normalize=True), expected[mode])


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_std_floor_all_equal_returns_give_zeros(mode):
    adv = compute_advantages(torch.full((3, 4), 7.0), mode, normalize=True)
    assert torch.isfinite(adv).all()
    close(adv, torch.zeros(3, 4), atol=0)


def test_std_floor_small_spread_divides_by_eps():
    adv = compute_advantages(torch.tensor([0.0, 2e-7]), "mean", normalize=True, eps=1e-6)
    close(adv, [-0.1, 0.1], atol=1e-6)  # std_pop = 1e-7 < eps, so (±1e-7) / 1e-6


def test_bad_mode_names_the_field():
    with pytest.raises(
        ValueError, match=r"advantage_mode must be one of: mean, raw, max, rloo(, \w+)* \(got 'greedy'\)"
    ):
        compute_advantages(G, "greedy")


# --- Tree returns (example 2) ----------------------------------------------------------------------------


def test_e2_tree_returns():
    root_rewards = torch.tensor([1.0, 0.0])
    children = torch.tensor([[0.5, 1.5], [2.0, 0.0]])  # leaves: returns = rewards
    child_means = children.mean(-1)  # [1, 1]
    has_child = torch.tensor([True, True])
    close(bootstrap_returns(root_rewards, child_means, has_child), [2.0, 1.0])
    close(bootstrap_returns(root_rewards, child_means, has_child, discount=0.5), [1.5, 0.5])


def test_tree_returns_leaf_keeps_reward():
    # joint action 1 terminated early: its child value is ignored (even if garbage).
    got = bootstrap_returns(
        torch.tensor([1.0, 3.0]), torch.tensor([1.0, float("nan")]), torch.tensor([True, False]), discount=0.5
    )
    close(got, [1.5, 3.0])


# --- Cross credit (example 3) ----------------------------------------------------------------------------


def brute_force_cross_credit(joint_returns, n, k):
    combos = list(itertools.product(range(k), repeat=n))
    credit = torch.zeros(n, k)
    for j, combo in enumerate(combos):
        for agent, sample in enumerate(combo):
            credit[agent, sample] += joint_returns[j]
    return credit


def test_e3_cross_credit_two_agents():
    g00, g01, g10, g11 = 1.0, 2.0, 4.0, 8.0
    credit = cross_credit(torch.tensor([g00, g01, g10, g11]), num_agents=2, num_samples=2)
    close(credit, [[g00 + g01, g10 + g11], [g00 + g10, g01 + g11]])  # [[3, 12], [5, 10]]


def test_cross_credit_three_agents_matches_brute_force_with_batch_dims():
    n, k = 3, 2
    joint = torch.randn(5, k**n)
    credit = cross_credit(joint, n, k)
    assert credit.shape == (5, n, k)
    for b in range(5):
        close(credit[b], brute_force_cross_credit(joint[b], n, k), atol=1e-5)


def test_cross_credit_uneven_sizes_matches_brute_force():
    n, k = 2, 3
    joint = torch.randn(k**n)
    close(cross_credit(joint, n, k), brute_force_cross_credit(joint, n, k), atol=1e-5)


def test_cross_credit_single_agent_is_identity():
    joint = torch.tensor([1.0, 2.0, 3.0])
    close(cross_credit(joint, num_agents=1, num_samples=3), [[1.0, 2.0, 3.0]])


def test_cross_credit_wrong_size():
    with pytest.raises(ValueError, match="joint_returns"):
        cross_credit(torch.zeros(5), num_agents=2, num_samples=2)


@pytest.mark.parametrize(("n", "k"), [(1, 3), (2, 2), (3, 2), (2, 3), (3, 1)])
def test_cross_joint_indices_follow_itertools_order(n, k):
    idx = cross_joint_indices(n, k)
    assert idx.dtype == torch.long and idx.shape == (k**n, n)
    assert idx.tolist() == [list(c) for c in itertools.product(range(k), repeat=n)]


def test_cross_joint_indices_bad_sizes():
    with pytest.raises(ValueError, match="num_agents"):
        cross_joint_indices(0, 2)
    with pytest.raises(ValueError, match="num_samples"):
        cross_joint_indices(2, 0)


# --- Suffix returns ----------------------------------------------------------------------------------------


def test_suffix_returns_undiscounted_and_discounted():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    close(suffix_returns(rewards), [[6.0, 5.0, 3.0], [4.0, 4.0, 4.0]])
    # G_2 = 3; G_1 = 2 + 0.5*3 = 3.5; G_0 = 1 + 0.5*3.5 = 2.75
    close(suffix_returns(rewards, discount=0.5), [[2.75, 3.5, 3.0], [1.0, 2.0, 4.0]])


def test_suffix_returns_single_turn():
    close(suffix_returns(torch.tensor([[2.0], [3.0]]), discount=0.9), [[2.0], [3.0]])


# --- Per-component advantages (issue 43, GDPO's normalize_components) -------------------------------------------


def test_component_advantages_break_a_tie_of_the_summed_reward():
    """K = 4 completions, two components (syntax, tests) whose sums all tie at 1: the summed reward gives zero
    advantage everywhere; normalised apart, each component still ranks the group.

        syntax = [1, 1, 0, 0]   mean 0.5, std_pop 0.5   ->  A_syntax = [ 1,  1, -1, -1]
        tests  = [0, 0, 1, 1]   mean 0.5, std_pop 0.5   ->  A_tests  = [-1, -1,  1,  1]
    With weights (1, 1) the two cancel (the components trade off exactly); with weights (2, 1):
        A = 2·A_syntax + A_tests = [1, 1, -1, -1].
    """
    credit = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]])  # [M=1, K=4, C=2]
    summed = compute_advantages(credit.sum(-1))
    close(summed, [[0.0, 0.0, 0.0, 0.0]], atol=1e-6)
    close(component_advantages(credit, torch.tensor([1.0, 1.0])), [[0.0, 0.0, 0.0, 0.0]], atol=1e-6)
    close(component_advantages(credit, torch.tensor([2.0, 1.0])), [[1.0, 1.0, -1.0, -1.0]], atol=1e-6)


def test_component_advantages_nonzero_where_the_sum_ties_and_the_components_do_not_cancel():
    """K = 3, three components whose sums all tie at 2 (summed advantage 0); s = 1 / sqrt(2/3) = sqrt(1.5):

        a = [2, 1,   0]    mean 1,   std_pop sqrt(2/3)     ->  A_a = [ s, 0, -s]
        b = [0, 0.5, 1]    mean 0.5, std_pop sqrt(1/6)     ->  A_b = [-s, 0,  s]
        c = [0, 0.5, 1]                                      ->  A_c = [-s, 0,  s]
        A = A_a + A_b + A_c = [-s, 0, s]   (the two components that rise outweigh the one that falls)
    A constant component is 0 after normalisation (std floored at eps, never NaN).
    """
    s = math.sqrt(1.5)  # 1 / sqrt(2/3)
    credit = torch.tensor([[[2.0, 0.0, 0.0], [1.0, 0.5, 0.5], [0.0, 1.0, 1.0]]])  # [1, 3, 3]
    close(compute_advantages(credit.sum(-1)), [[0.0, 0.0, 0.0]], atol=1e-6)
    close(component_advantages(credit, torch.ones(3)), [[-s, 0.0, s]], atol=1e-5)
    # Unnormalised with the mean baseline: A_c = c - mean(c); a: [1, 0, -1], b and c: [-0.5, 0, 0.5] -> [0, 0, 0].
    close(component_advantages(credit, torch.ones(3), normalize=False), [[0.0, 0.0, 0.0]], atol=1e-6)
    # Weights (1, 0, 0): only a counts -> [s, 0, -s]; a constant component adds nothing.
    close(component_advantages(credit, torch.tensor([1.0, 0.0, 0.0])), [[s, 0.0, -s]], atol=1e-5)
    flat = torch.tensor([[[2.0, 3.0], [1.0, 3.0], [0.0, 3.0]]])
    close(component_advantages(flat, torch.ones(2)), [[s, 0.0, -s]], atol=1e-5)


@pytest.mark.parametrize("mode", ["mean", "raw", "max", "rloo"])
@pytest.mark.parametrize("normalize", [True, False])
def test_component_advantages_with_one_component_is_compute_advantages(mode, normalize):
    credit = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.5, -1.0, 4.0, 4.0]])  # [M=2, K=4]
    expected = compute_advantages(credit, mode, normalize)
    close(component_advantages(credit.unsqueeze(-1), torch.ones(1), mode, normalize), expected, atol=1e-6)
    # A weight w scales it (the weight multiplies the normalised component).
    close(component_advantages(credit.unsqueeze(-1), torch.tensor([0.5]), mode, normalize), 0.5 * expected, atol=1e-6)


def test_component_advantages_baseline_mode_per_component_unnormalised():
    """mode max, no normalisation, components x = [1, 3], y = [2, 0] (K = 2):
    A_x = [-2, 0], A_y = [0, -2]; weights (1, 3) -> [-2, -6]. rloo: A_x = [-2, 2], A_y = [2, -2] -> [4, -4]."""
    credit = torch.tensor([[[1.0, 2.0], [3.0, 0.0]]])
    w = torch.tensor([1.0, 3.0])
    close(component_advantages(credit, w, "max", normalize=False), [[-2.0, -6.0]])
    close(component_advantages(credit, w, "rloo", normalize=False), [[4.0, -4.0]])


def test_component_advantages_shapes_are_checked():
    with pytest.raises(ValueError, match="weights"):
        component_advantages(torch.zeros(1, 3, 2), torch.ones(3))
    with pytest.raises(ValueError, match="credit"):
        component_advantages(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="advantage_mode"):
        component_advantages(torch.zeros(1, 3, 2), torch.ones(2), mode="median?")
