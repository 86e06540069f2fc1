"""The preference objectives as losses of tensors, built without any module: MADPO's JointDPO and MARLHF's
BradleyTerry against numbers worked out by hand (docs/algorithms.md: MADPO, MARLHF)."""

from __future__ import annotations

import pytest
import torch

from comlrl_lightning.algorithms import BradleyTerry, JointDPO


def test_joint_dpo_loss_of_equal_team_margins():
    # margins [[1.0, -0.5], [0.2, 0.3]], eta = 0.1: team margins Δ = 0.5 and 0.5, so η·Δ = 0.05 for both pairs;
    # −log σ(0.05) = log(1 + e^-0.05) = log(1.951229) = 0.668460 per pair, and the mean is 0.668460.
    objective = JointDPO(dpo_beta=0.1)
    margins = torch.tensor([[1.0, -0.5], [0.2, 0.3]], requires_grad=True)
    loss, metrics = objective.loss(margins)
    assert loss.item() == pytest.approx(0.668460, abs=1e-6)
    assert float(metrics["loss"]) == pytest.approx(0.668460, abs=1e-6)
    assert float(metrics["dpo/accuracy"]) == 1.0  # both team margins > 0
    assert float(metrics["dpo/joint_margin_mean"]) == pytest.approx(0.5)
    assert float(metrics["agent_0/margin_mean"]) == pytest.approx(0.6)  # (1.0 + 0.2) / 2
    assert float(metrics["agent_1/margin_mean"]) == pytest.approx(-0.1)  # (-0.5 + 0.3) / 2
    assert all(not v.requires_grad for v in metrics.values())
    # d loss / d Δ_{p,i} = −(η / P)·σ(−η·Δ_p) = −(0.1 / 2)·σ(−0.05) = −0.05 × 0.487503 = −0.024375, every entry
    loss.backward()
    torch.testing.assert_close(margins.grad, torch.full((2, 2), -0.024375), atol=1e-6, rtol=0)


def test_joint_dpo_loss_of_a_won_and_a_lost_pair():
    # margins [[2.0, 1.0], [-3.0, 0.5]], eta = 0.5: Δ = 3.0 and -2.5, η·Δ = 1.5 and -1.25;
    # −log σ(1.5) = log(1 + e^-1.5) = 0.201413, −log σ(-1.25) = log(1 + e^1.25) = 1.501929; mean 0.851671.
    objective = JointDPO.from_fields({"dpo_beta": 0.5, "train_batch_size": 2})  # picks its setting by name
    assert objective.dpo_beta == 0.5 and "dpo_beta=0.5" in repr(objective)
    margins = torch.tensor([[2.0, 1.0], [-3.0, 0.5]], requires_grad=True)
    loss, metrics = objective.loss(margins)
    assert loss.item() == pytest.approx(0.851671, abs=1e-6)
    assert float(metrics["dpo/accuracy"]) == 0.5  # pair 0 won (Δ > 0), pair 1 lost
    assert float(metrics["dpo/joint_margin_mean"]) == pytest.approx(0.25)  # (3.0 - 2.5) / 2
    assert float(metrics["agent_0/margin_mean"]) == pytest.approx(-0.5)  # (2.0 - 3.0) / 2
    assert float(metrics["agent_1/margin_mean"]) == pytest.approx(0.75)  # (1.0 + 0.5) / 2
    # the gradient's weight is the team margin's, the same for both agents of a pair:
    # pair 0: −(0.5 / 2)·σ(−1.5) = −0.25 × 0.182426 = −0.045606; pair 1: −0.25·σ(1.25) = −0.25 × 0.777300 = −0.194325
    loss.backward()
    expected = torch.tensor([[-0.045606, -0.045606], [-0.194325, -0.194325]])
    torch.testing.assert_close(margins.grad, expected, atol=1e-6, rtol=0)


def test_joint_dpo_rejects_a_non_positive_beta_and_flat_margins():
    with pytest.raises(ValueError, match="dpo_beta must be > 0"):
        JointDPO(dpo_beta=0.0).loss(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"margins must be \[P, N\]"):
        JointDPO().loss(torch.zeros(4))


def test_bradley_terry_loss():
    # winner scores [2.0, 0.5, -1.0], loser scores [1.0, 1.5, -1.0]: margins s_w − s_l = 1.0, -1.0, 0.0;
    # −log σ(1) = 0.313262, −log σ(-1) = 1.313262, −log σ(0) = log 2 = 0.693147; mean 2.319671 / 3 = 0.773224.
    objective = BradleyTerry.from_fields({"reward_learning_rate": 1e-3})  # no settings: nothing is picked
    winners = torch.tensor([2.0, 0.5, -1.0], requires_grad=True)
    losers = torch.tensor([1.0, 1.5, -1.0], requires_grad=True)
    loss, metrics = objective.loss(winners, losers)
    assert loss.item() == pytest.approx(0.773224, abs=1e-6)
    assert float(metrics["reward_model/loss"]) == pytest.approx(0.773224, abs=1e-6)
    assert float(metrics["reward_model/accuracy"]) == pytest.approx(1 / 3)  # only the first: a tie is no win
    assert float(metrics["reward_model/margin_mean"]) == pytest.approx(0.0)  # (1 - 1 + 0) / 3
    assert all(not v.requires_grad for v in metrics.values())
    # d loss / d s_w = −σ(−margin) / P: −0.268941 / 3 = −0.089647, −0.731059 / 3 = −0.243686, −0.5 / 3 = −0.166667
    loss.backward()
    torch.testing.assert_close(winners.grad, torch.tensor([-0.089647, -0.243686, -0.166667]), atol=1e-6, rtol=0)
    torch.testing.assert_close(losers.grad, -winners.grad)


def test_bradley_terry_needs_one_score_per_pair_on_each_side():
    with pytest.raises(ValueError, match="must both be"):
        BradleyTerry().loss(torch.zeros(3), torch.zeros(2))
