"""MADPO joint loss and Bradley–Terry loss: hand values, gradients, detach-trick equivalence
(docs/algorithms.md example 6)."""

import math

import pytest
import torch
import torch.nn.functional as F

from comlrl_lightning.core import bradley_terry_loss, madpo_loss


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- MADPO ------------------------------------------------------------------------------------------------


def test_madpo_worked_example_e6():
    # N = 2, eta = 0.1: Delta_1 = 2, Delta_2 = -1 -> Delta = 1 -> loss = -log sigma(0.1) ≈ 0.644.
    margins = torch.tensor([[2.0, -1.0]], requires_grad=True)
    loss, metrics = madpo_loss(margins, beta=0.1)
    close(loss, -math.log(sigmoid(0.1)))
    assert loss.item() == pytest.approx(0.644, abs=5e-4)
    loss.backward()
    # d loss / d Delta_i = -eta * sigma(-eta * Delta) ≈ -0.0475 for BOTH agents.
    close(margins.grad, [[-0.1 * sigmoid(-0.1)] * 2])
    assert margins.grad[0, 0].item() == pytest.approx(-0.0475, abs=5e-5)
    close(metrics["loss"], loss.detach())
    close(metrics["accuracy"], 1.0)
    close(metrics["joint_margin_mean"], 1.0)
    close(metrics["margin_mean_agent_0"], 2.0)
    close(metrics["margin_mean_agent_1"], -1.0)
    assert all(not value.requires_grad for value in metrics.values())


def test_madpo_batch_diagnostics_and_mean():
    # 3 pairs x 3 agents; joint margins 1, -3, 0 (a zero margin is not "correct").
    margins = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -1.0, -1.0], [0.5, -0.5, 0.0]])
    beta = 0.5
    loss, metrics = madpo_loss(margins, beta)
    expected = sum(-math.log(sigmoid(beta * d)) for d in (1.0, -3.0, 0.0)) / 3
    close(loss, expected)
    close(metrics["accuracy"], 1 / 3)
    close(metrics["joint_margin_mean"], -2 / 3)
    close(metrics["margin_mean_agent_0"], 0.5 / 3)
    close(metrics["margin_mean_agent_1"], -0.5 / 3)
    close(metrics["margin_mean_agent_2"], -2 / 3)
    assert set(metrics) == {
        "loss",
        "accuracy",
        "joint_margin_mean",
        "margin_mean_agent_0",
        "margin_mean_agent_1",
        "margin_mean_agent_2",
    }


def test_madpo_is_stable_for_large_margins_and_low_precision():
    loss, _ = madpo_loss(torch.tensor([[-500.0, -500.0], [500.0, 500.0]]), beta=1.0)
    close(loss, 500.0)  # softplus(1000) / 2 + softplus(-1000) / 2, no inf / nan
    loss16, _ = madpo_loss(torch.tensor([[2.0, -1.0]], dtype=torch.bfloat16), beta=0.1)
    assert loss16.dtype == torch.float32


@pytest.mark.parametrize("num_agents", [2, 3])
def test_madpo_autograd_equals_comlrl_detach_trick(num_agents):
    """Each agent's gradient of the joint loss equals the gradient of CoMLRL's per-agent detached form."""
    torch.manual_seed(0)
    num_pairs, beta = 5, 0.7
    weights = [torch.randn(4, requires_grad=True) for _ in range(num_agents)]  # one tiny "policy" per agent
    features = [torch.randn(num_pairs, 4) for _ in range(num_agents)]  # [P, 4] per agent

    def agent_margins():
        return [x @ w for w, x in zip(weights, features)]  # N x [P], Delta_{p,i} = w_i . x_{p,i}

    loss, _ = madpo_loss(torch.stack(agent_margins(), dim=-1), beta)
    ours = torch.autograd.grad(loss, weights)

    for i in range(num_agents):
        deltas = agent_margins()
        others = sum(deltas[j].detach() for j in range(num_agents) if j != i)
        comlrl_loss = -F.logsigmoid(beta * (deltas[i] + others)).mean()
        (reference,) = torch.autograd.grad(comlrl_loss, weights[i])
        torch.testing.assert_close(ours[i], reference, atol=1e-6, rtol=1e-6)
        assert comlrl_loss.item() == pytest.approx(loss.item(), abs=1e-6)  # same value, too


def test_madpo_empty_batch_is_zero_and_attached():
    margins = torch.zeros(0, 2, requires_grad=True)
    loss, metrics = madpo_loss(margins, beta=0.1)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert metrics["accuracy"].item() == 0.0 and "margin_mean_agent_1" in metrics


@pytest.mark.parametrize("beta", [0.0, -0.1, float("nan")])
def test_madpo_beta_must_be_positive(beta):
    with pytest.raises(ValueError, match="dpo_beta must be > 0."):
        madpo_loss(torch.zeros(1, 2), beta)


def test_madpo_shape_check():
    with pytest.raises(ValueError, match=r"margins must be \[P, N\]"):
        madpo_loss(torch.zeros(3), 0.1)


# --- Bradley–Terry ---------------------------------------------------------------------------------------


def test_bradley_terry_hand_values_and_gradient():
    winner = torch.tensor([1.0], requires_grad=True)
    loser = torch.tensor([0.0], requires_grad=True)
    loss, metrics = bradley_terry_loss(winner, loser)
    close(loss, math.log(1 + math.exp(-1)))  # -log sigma(1) ≈ 0.3133
    loss.backward()
    close(winner.grad, [-sigmoid(-1.0)])  # d/ds_w = -sigma(-(s_w - s_l))
    close(loser.grad, [sigmoid(-1.0)])
    close(metrics["accuracy"], 1.0)
    close(metrics["margin_mean"], 1.0)
    close(metrics["loss"], loss.detach())


def test_bradley_terry_batch():
    winner = torch.tensor([1.0, 0.0, 2.0, 3.0])
    loser = torch.tensor([0.0, 0.0, 3.0, 1.0])  # margins 1, 0, -1, 2
    loss, metrics = bradley_terry_loss(winner, loser)
    expected = sum(math.log(1 + math.exp(-m)) for m in (1.0, 0.0, -1.0, 2.0)) / 4
    close(loss, expected)
    close(metrics["accuracy"], 0.5)  # a tie is not correct
    close(metrics["margin_mean"], 0.5)


def test_bradley_terry_shape_check_and_empty():
    with pytest.raises(ValueError, match=r"must both be \[B\]"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))
    loss, metrics = bradley_terry_loss(torch.zeros(0, requires_grad=True), torch.zeros(0))
    assert loss.item() == 0.0 and metrics["accuracy"].item() == 0.0
