"""IAC's and MAAC's objectives as losses of tensors, built without a LightningModule, against numbers worked out by
hand (docs/algorithms.md: actor-critic); then the engine correction reaching IAC's loss (it was accepted, paid a
scoring forward every step, and never applied)."""

from __future__ import annotations

import pytest
import torch

from comlrl_lightning.algorithms.actor_critic import IAC, MAAC, ActorCritic, JointCritic
from comlrl_lightning.algorithms.fields import declared_fields
from comlrl_lightning.algorithms.on_policy import PolicyBatch
from comlrl_lightning.algorithms.reinforce import EngineCorrection
from comlrl_lightning.rollout.sampling import ScoringInputs


def batch(advantages, values, targets, old_values=None, old=None, engine=None, weights=0.5):
    """One row per advantage, two completion tokens each (loss weight ``weights`` per token); the critic's
    ``values`` (with grad), ``targets``, the rollout-time ``old_values``, each row's share 1/rows."""
    rows = len(advantages)
    mask = torch.ones(rows, 2, dtype=torch.bool)
    inputs = ScoringInputs(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(rows, 2).long(), mask)

    def t(x):
        return None if x is None else torch.tensor(x, dtype=torch.float32)

    extras = {"targets": t(targets), "value_shares": torch.full((rows,), 1.0 / rows, dtype=torch.float64)}
    if old_values is not None:
        extras["old_values"] = t(old_values)
    return PolicyBatch(
        inputs,
        t(advantages),
        mask.float() * weights,
        None,
        old_logprobs=t(old),
        engine_logprobs=t(engine),
        values=values,
        extras=extras,
    )


def test_actor_critic_loss_by_hand():
    # policy: −Σ w·Â·log π = −(0.5·1·(−1 − 2) + 0.5·(−2)·(−0.5 − 0.5)) = 1.5 − 1 = 0.5
    # value: mean((t − V)²) = ((1 − 0.5)² + (0 − 1)²)/2 = 0.625, times the rows' share 1: L_V = 0.625
    # total = 0.5 + 0.5·0.625 = 0.8125; dL/dV = 0.5·2·(V − t)/2 = (V − t)/2 = (−0.25, 0.5)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    values = torch.tensor([0.5, 1.0], requires_grad=True)
    loss, metrics = ActorCritic(value_loss_coef=0.5).loss(logp, batch([1.0, -2.0], values, [1.0, 0.0]))
    assert loss.item() == pytest.approx(0.8125)
    assert metrics["policy_loss"].item() == pytest.approx(0.5) and metrics["value_loss"].item() == pytest.approx(0.625)
    loss.backward()
    assert values.grad.tolist() == pytest.approx([-0.25, 0.5])
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.5], [1.0, 1.0]]))  # −w·Â


def test_value_clipping_by_hand():
    # V_old = 0, ε = 0.2: V = 0.5 clips to 0.2; target 1: max((1 − 0.5)², (1 − 0.2)²) = 0.64 (no gradient to V)
    values = torch.tensor([0.5], requires_grad=True)
    objective = ActorCritic(value_loss_coef=1.0, value_clip_range=0.2)
    loss, metrics = objective.loss(torch.zeros(1, 2), batch([0.0], values, [1.0], old_values=[0.0]))
    assert metrics["value_loss"].item() == pytest.approx(0.64) and loss.item() == pytest.approx(0.64)
    loss.backward()
    assert values.grad.item() == 0.0


def test_micro_batches_of_a_mini_batch_add_up_to_its_value_loss():
    # value_shares = each row's share of the mini-batch (1/4 here): two micro-batches of 2 rows sum to the mean of 4
    values, targets = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0, 1.0, 1.0])
    objective = ActorCritic(value_loss_coef=1.0)
    whole = objective.value_term(values, targets, None, torch.full((4,), 0.25))
    halves = sum(
        objective.value_term(values[s], targets[s], None, torch.full((2,), 0.25)) for s in (slice(0, 2), slice(2, 4))
    )
    assert whole.item() == pytest.approx((1 + 0 + 1 + 4) / 4) and halves.item() == pytest.approx(whole.item())


def test_joint_critic_by_hand():
    # MAAC: an agent's loss is the policy part only; the joint critic's: coef·mean((t − V)²)·Σ shares
    logp = torch.tensor([[-1.0, -2.0]])
    objective = JointCritic(value_loss_coef=0.5)
    loss, metrics = objective.loss(logp, batch([1.0], None, [0.0]))
    assert loss.item() == pytest.approx(1.5) and set(metrics) == {"policy_loss"}
    loss, metrics = objective.critic_loss(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0]), torch.full((2,), 0.5))
    assert metrics["value_loss"].item() == pytest.approx((1 + 4) / 2) and loss.item() == pytest.approx(1.25)


def test_the_engine_correction_weights_the_actor_critic_policy_term():
    # ρ_t = min(exp(log π_train − log π_engine), cap): (e^0.5 → 1.5, 1); policy = −(0.75·1·(−1) + 0.5·1·(−2)) = 1.75
    logp = torch.tensor([[-1.0, -2.0]])
    corrected = ActorCritic(value_loss_coef=0.0, correction=EngineCorrection("token_truncate", 1.5))
    b = batch([1.0], torch.zeros(1), [0.0], old=[[-1.0, -2.0]], engine=[[-1.5, -2.0]])
    assert corrected.loss(logp, b)[1]["policy_loss"].item() == pytest.approx(1.75)
    assert ActorCritic(value_loss_coef=0.0).loss(logp, b)[1]["policy_loss"].item() == pytest.approx(1.5)


@pytest.mark.parametrize("cls", [IAC, MAAC])
def test_iac_and_maac_build_the_correction_they_accept(cls):
    """Before: IAC/MAAC accepted vllm_importance_sampling_correction, scored the engine's log-probs every step, and
    left them unused. Now their objective, built from the module's fields, carries the correction."""
    fields = {name: declared.default for name, declared in declared_fields(cls).items()}
    on = cls.objective_class.from_fields(
        {**fields, "vllm_importance_sampling_correction": True, "vllm_importance_sampling_cap": 3.0}
    )
    assert on.correction == EngineCorrection("token_truncate", 3.0)
    assert cls.objective_class.from_fields(fields).correction is None
