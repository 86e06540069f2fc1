"""Hand-derived checks of KL estimators, loss weights and the REINFORCE surrogate (docs/algorithms.md examples 8, 9)."""

import math

import pytest
import torch

from comlrl_lightning.core import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    assert_finite,
    kl_estimate,
    policy_gradient_loss,
    token_loss_weights,
)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- KL estimators ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        # d = log 0.25 - log 0.5 = -log 2
        ("k1", math.log(2)),  # -d
        ("k2", 0.5 * math.log(2) ** 2),  # d^2 / 2 ≈ 0.2402
        ("k3", 0.5 - 1 + math.log(2)),  # exp(d) - d - 1 = 0.5 + log 2 - 1 ≈ 0.1931
    ],
)
def test_kl_estimators_hand_values(estimator, expected):
    got = kl_estimate(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]), estimator)
    close(got, [expected])


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_identical_inputs_are_zero(estimator):
    logp = torch.log_softmax(torch.randn(3, 7), dim=-1)
    close(kl_estimate(logp, logp.clone(), estimator), torch.zeros(3, 7), atol=1e-6)


def test_k3_nonnegative_and_sequence_sum_e8():
    gen = torch.Generator().manual_seed(0)
    logp_pol = -torch.rand(4, 9, generator=gen) * 5
    logp_ref = -torch.rand(4, 9, generator=gen) * 5
    per_token = kl_estimate(logp_pol, logp_ref)  # default k3
    assert per_token.shape == (4, 9) and (per_token >= 0).all()
    d = logp_ref - logp_pol
    close(per_token.sum(-1), (torch.exp(d) - d - 1).sum(-1), atol=1e-5)  # sequence KL (example 8)


def test_kl_bad_estimator_names_the_field():
    with pytest.raises(ValueError, match=r"estimator must be one of: k1, k2, k3 \(got 'k4'\)"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


# --- Loss weights ----------------------------------------------------------------------------------------

MASK = torch.tensor(
    [
        [1, 1, 1, 0],  # 3 tokens
        [1, 0, 0, 0],  # 1 token
        [0, 0, 0, 0],  # empty
    ],
    dtype=torch.bool,
)
M = MASK.float()


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("seq_sum", M / 3),  # B = 3
        ("token_mean", M / 4),  # 4 tokens
        ("seq_mean_token_mean", torch.stack([M[0] / (3 * 3), M[1] / (3 * 1), M[2] * 0])),
        ("dr_grpo", M / (3 * 8)),  # max_new_tokens = 8
    ],
)
def test_token_loss_weights_hand_values(aggregation, expected):
    w = token_loss_weights(MASK, aggregation, max_new_tokens=8)
    assert w.shape == MASK.shape and torch.isfinite(w).all()
    close(w, expected)


def test_weights_of_all_empty_batch_are_zero_not_nan():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for aggregation in LOSS_AGGREGATIONS:
        close(token_loss_weights(empty, aggregation, max_new_tokens=4), torch.zeros(2, 3), atol=0)


def test_dr_grpo_requires_max_new_tokens():
    with pytest.raises(ValueError, match="max_new_tokens"):
        token_loss_weights(MASK, "dr_grpo")


def test_bad_aggregation_names_the_field():
    with pytest.raises(ValueError, match=r"loss_aggregation must be one of: seq_sum, token_mean.*\(got 'sum'\)"):
        token_loss_weights(MASK, "sum")


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_micro_batches_sum_to_the_full_mini_batch_loss(aggregation):
    torch.manual_seed(0)
    b, t = 6, 5
    mask = torch.rand(b, t) > 0.3
    logp = torch.randn(b, t, requires_grad=True)
    adv = torch.randn(b)
    kl = torch.rand(b, t)
    w = token_loss_weights(mask, aggregation, max_new_tokens=t)

    full, _ = policy_gradient_loss(logp, adv, w, token_kl=kl, kl_coef=0.1)
    (full_grad,) = torch.autograd.grad(full, logp)

    chunks = [slice(0, 2), slice(2, b)]  # uneven split, weights from the whole mini-batch
    parts = [policy_gradient_loss(logp[c], adv[c], w[c], token_kl=kl[c], kl_coef=0.1)[0] for c in chunks]
    accumulated = sum(parts)
    (acc_grad,) = torch.autograd.grad(accumulated, logp)
    close(accumulated, full.detach(), atol=1e-6)
    close(acc_grad, full_grad, atol=1e-6)


# --- Policy-gradient loss --------------------------------------------------------------------------------


def test_policy_gradient_loss_hand_values():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0])
    kl = torch.tensor([[0.1, 0.3, 9.0], [0.2, 9.0, 9.0]])  # masked entries must not count
    w = token_loss_weights(mask, "seq_sum")  # 1/2 on real tokens

    loss, metrics = policy_gradient_loss(logp, adv, w, token_kl=kl, kl_coef=0.5)
    # policy: mean_b(-A_b * sum_t logp) = (-2 * -3 + 1 * -0.5) / 2 = 2.75
    # kl: 0.5 * (0.1 + 0.3 + 0.2) / 2 = 0.15
    close(loss, 2.9)
    close(metrics["policy_loss"], 2.75)
    close(metrics["kl_loss"], 0.15)
    close(metrics["kl_mean"], 0.2)  # (0.1 + 0.3 + 0.2) / 3 tokens
    close(metrics["logprob_mean"], -3.5 / 3)
    close(metrics["advantage_mean"], 0.5)
    assert all(not v.requires_grad for v in metrics.values())

    loss_no_kl, metrics_no_kl = policy_gradient_loss(logp, adv, w)
    close(loss_no_kl, 2.75)
    assert "kl_loss" not in metrics_no_kl


@pytest.mark.parametrize("aggregation", ["seq_sum", "seq_mean_token_mean"])
def test_gradient_equals_autograd_of_documented_objective(aggregation):
    torch.manual_seed(1)
    b, t, vocab = 4, 6, 11
    logits = torch.randn(b, t, vocab, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(vocab, (b, t))
    mask = torch.arange(t)[None, :] < torch.tensor([6, 3, 1, 0])[:, None]  # includes an empty row
    adv = torch.randn(b, dtype=torch.float64)

    def token_logprobs():
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)  # [B, T]

    loss, _ = policy_gradient_loss(token_logprobs(), adv, token_loss_weights(mask, aggregation))
    (grad,) = torch.autograd.grad(loss, logits)

    # Objective written independently of the weight helper.
    seq_logp = (mask * token_logprobs()).sum(-1)  # [B]
    if aggregation == "seq_sum":
        objective = (-adv * seq_logp).mean()  # CoMLRL: mean_b(-A_b * sum_t log pi)
    else:
        lengths = mask.sum(-1)
        per_seq = torch.where(lengths > 0, seq_logp / lengths.clamp_min(1), torch.zeros_like(seq_logp))
        objective = (-adv * per_seq).mean()
    (expected,) = torch.autograd.grad(objective, logits)
    # float32 weights (e.g. 1/9) against a float64 objective: agree to float32 precision.
    close(loss.detach(), objective.detach(), atol=1e-6)
    close(grad, expected, atol=1e-6)
    assert grad[3].abs().sum() == 0  # empty completion contributes nothing


def test_policy_gradient_loss_shape_errors():
    with pytest.raises(ValueError, match="advantages"):
        policy_gradient_loss(torch.zeros(2, 3), torch.zeros(3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="weights"):
        policy_gradient_loss(torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="token_kl"):
        policy_gradient_loss(torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 3), token_kl=torch.zeros(3))


# --- assert_finite ---------------------------------------------------------------------------------------


def test_assert_finite_passes_and_raises_with_context():
    assert_finite("loss", torch.tensor([1.0, -2.0]), step=0)
    with pytest.raises(FloatingPointError) as err:
        assert_finite("policy_loss", torch.tensor([1.0, float("nan"), float("inf")]), step=3, agent=1)
    message = str(err.value)
    assert "policy_loss" in message and "step=3" in message and "agent=1" in message
    assert "1 NaN" in message and "1 inf" in message


# --- importance weights of an inference engine's samples ------------------------------------------------------


def test_importance_sampling_weights_by_hand():
    """ρ = exp(log π_train − log π_engine). Row 0: token diffs [ln 3, ln 0.5, masked] → ρ = [3, 0.5]; row 1: [0, ln 1.5]
    → [1, 1.5]. token_truncate, cap 2: [2, 0.5], [1, 1.5]. token_mask: [0, 0.5], [1, 1.5]. sequence: row 0's ρ is
    3·0.5 = 1.5 on each of its tokens, row 1's 1·1.5 = 1.5; both ≤ 2, so truncate and mask agree; with cap 1.2 both
    rows are capped to 1.2 (truncate) or zeroed (mask). Masked positions are 0 in every mode."""
    from comlrl_lightning.core import importance_sampling_weights as weights

    engine = torch.tensor([[-2.0, -1.0, -5.0], [-1.0, -2.0, 0.0]])
    train = engine + torch.tensor([[math.log(3), math.log(0.5), 7.0], [0.0, math.log(1.5), 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    close(weights(train, engine, mask, "token_truncate", 2.0), torch.tensor([[2.0, 0.5, 0.0], [1.0, 1.5, 0.0]]))
    close(weights(train, engine, mask, "token_mask", 2.0), torch.tensor([[0.0, 0.5, 0.0], [1.0, 1.5, 0.0]]))
    for mode in ("sequence_truncate", "sequence_mask"):
        close(weights(train, engine, mask, mode, 2.0), torch.tensor([[1.5, 1.5, 0.0], [1.5, 1.5, 0.0]]))
    close(weights(train, engine, mask, "sequence_truncate", 1.2), torch.tensor([[1.2, 1.2, 0.0], [1.2, 1.2, 0.0]]))
    close(weights(train, engine, mask, "sequence_mask", 1.2), torch.zeros(2, 3))
    assert not weights(train.requires_grad_(), engine, mask).requires_grad  # a weight, not a term to differentiate
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of: token_truncate"):
        weights(train, engine, mask, "clip")
