"""The MAGRPO family's objectives as losses of tensors: each is built without a LightningModule and its loss is
checked against numbers worked out by hand (in the comments); then the ratio objectives (``policy_loss: clipped``,
``gspo``, ``num_iterations``) through a fit: passes, stored log-probs, reference KL, exact resume."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from comlrl_lightning import TaskDataModule
from comlrl_lightning.algorithms import MAGRPO
from comlrl_lightning.algorithms.on_policy import PolicyBatch
from comlrl_lightning.algorithms.reinforce import (
    POLICY_LOSSES,
    ClippedRatio,
    EngineCorrection,
    GroupRelative,
    KLTerm,
    SequenceRatio,
)
from comlrl_lightning.envs import toy
from comlrl_lightning.rollout.sampling import ScoringInputs
from comlrl_lightning.rollout.tree import Node

REPO = Path(__file__).resolve().parents[1]
ITEMS = [{"prompt": f"topic {i}", "topic": f"topic {i}"} for i in range(8)]


def batch(advantages, old=None, ref=None, engine=None, weights=0.5, mask=None):
    """One row per advantage, two tokens each, loss weight ``weights`` per token."""
    rows = len(advantages)
    mask = torch.ones(rows, 2, dtype=torch.bool) if mask is None else torch.tensor(mask)
    inputs = ScoringInputs(
        input_ids=torch.zeros(1),
        attention_mask=torch.zeros(1),
        position_ids=torch.zeros(1),
        completion_ids=torch.zeros(rows, 2, dtype=torch.long),
        completion_mask=mask,
    )

    def t(x):
        return None if x is None else torch.tensor(x, dtype=torch.float32)

    return PolicyBatch(
        inputs, torch.tensor(advantages), mask.float() * weights, t(ref), old_logprobs=t(old), engine_logprobs=t(engine)
    )


def test_reinforce_by_hand():
    # loss = −Σ w·A·log π = −(0.5·2·(−1) + 0.5·2·(−2)) = 3; the gradient of each token is −w·A = −1.
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, metrics = GroupRelative().loss(logp, batch([2.0]))
    assert loss.item() == pytest.approx(3.0) and metrics == {}
    loss.backward()
    assert logp.grad.tolist() == [[-1.0, -1.0]]


def test_reinforce_with_the_reference_kl_in_the_loss_by_hand():
    # k1 estimator: KL_t = log π − log π_ref = (−1 − (−1.5), −2 − (−1)) = (0.5, −1); Σ w·KL = 0.5·0.5 + 0.5·(−1)
    # = −0.25; β = 0.4: kl loss = −0.1; total 3 − 0.1 = 2.9.
    objective = GroupRelative(kl=KLTerm(0.4, "k1"))
    loss, metrics = objective.loss(torch.tensor([[-1.0, -2.0]]), batch([2.0], ref=[[-1.5, -1.0]]))
    assert loss.item() == pytest.approx(2.9) and metrics["reference_kl_loss"].item() == pytest.approx(-0.1)


def test_reinforce_with_the_engine_correction_by_hand():
    # π_train/π_engine per token: exp(−1 − (−1.5)) = e^0.5 ≈ 1.6487 and exp(−2 − (−2)) = 1; token_truncate, cap 1.5:
    # weights 0.5·1.5 and 0.5·1. loss = −(0.75·2·(−1) + 0.5·2·(−2)) = 1.5 + 2 = 3.5.
    objective = GroupRelative(correction=EngineCorrection("token_truncate", 1.5))
    loss, _ = objective.loss(torch.tensor([[-1.0, -2.0]]), batch([2.0], old=[[-1.0, -2.0]], engine=[[-1.5, -2.0]]))
    assert loss.item() == pytest.approx(3.5)


def test_the_clipped_ratio_by_hand():
    objective = ClippedRatio(epsilon_low=0.2, epsilon_high=0.2)
    logp = torch.zeros(1, 2)
    # ratios 1.5 and 0.5 (old log-probs −log r), clipped to 1.2 and 0.8. A = +1: min(1.5, 1.2) = 1.2,
    # min(0.5, 0.8) = 0.5; loss = −(0.5·1.2 + 0.5·0.5) = −0.85; one token's clipped term won (1.2 < 1.5).
    old = [[-math.log(1.5), -math.log(0.5)]]
    loss, metrics = objective.loss(logp, batch([1.0], old=old))
    assert loss.item() == pytest.approx(-0.85) and metrics["clipped_tokens"].item() == 1
    # A = −1: min(−1.5, −1.2) = −1.5, min(−0.5, −0.8) = −0.8; loss = 1.15; the 0.5 token's clipped term won.
    loss, metrics = objective.loss(logp, batch([-1.0], old=old))
    assert loss.item() == pytest.approx(1.15) and metrics["clipped_tokens"].item() == 1
    # inside the clip range (1.1, 0.9), A = 2: −(0.5·2.2 + 0.5·1.8) = −2
    loss, metrics = objective.loss(logp, batch([2.0], old=[[-math.log(1.1), -math.log(0.9)]]))
    assert loss.item() == pytest.approx(-2.0) and metrics["clipped_tokens"].item() == 0
    # DAPO's clip-higher: ε_high 0.6 lets 1.5 through: −(0.5·1.5 + 0.5·0.5) = −1
    loss, _ = ClippedRatio(epsilon_low=0.2, epsilon_high=0.6).loss(logp, batch([1.0], old=old))
    assert loss.item() == pytest.approx(-1.0)


def test_the_first_pass_of_the_clipped_ratio_is_reinforce():
    """π_old = π (a fresh batch's first pass): the ratio is 1 and the gradient is REINFORCE's."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.25]], requires_grad=True)
    fresh = batch([2.0, -1.0], old=logp.detach().tolist())
    ClippedRatio(epsilon_low=0.2, epsilon_high=0.2).loss(logp, fresh)[0].backward()
    clipped_grad, logp.grad = logp.grad.clone(), None
    GroupRelative().loss(logp, fresh)[0].backward()
    torch.testing.assert_close(clipped_grad, logp.grad)


def test_gspo_by_hand():
    """One ratio per completion: s = exp(mean_t(log π − log π_old)), clipped as a whole."""
    objective = SequenceRatio(epsilon_low=0.2, epsilon_high=0.2)
    logp = torch.zeros(1, 2, requires_grad=True)
    old = [[-math.log(2.0), 0.0]]  # token ratios 2 and 1; s = exp((ln 2 + 0) / 2) = √2 ≈ 1.41421
    # A = +1: min(√2, 1.2) = 1.2 at both tokens: loss = −(0.5·1.2 + 0.5·1.2) = −1.2 (the token ratio would give
    # −(0.5·1.2 + 0.5·1) = −1.1); the clipped term won: no gradient.
    loss, metrics = objective.loss(logp, batch([1.0], old=old))
    assert loss.item() == pytest.approx(-1.2) and metrics["clipped_tokens"].item() == 2
    assert ClippedRatio(epsilon_low=0.2, epsilon_high=0.2).loss(logp, batch([1.0], old=old))[0].item() == (
        pytest.approx(-1.1)
    )
    loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0]]
    # A = −1: min(−√2, −1.2) = −√2: loss = √2; each token's gradient is −w·A·s = 0.5·√2 ≈ 0.70711.
    logp.grad = None
    loss, _ = objective.loss(logp, batch([-1.0], old=old))
    assert loss.item() == pytest.approx(math.sqrt(2))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), 0.5 * math.sqrt(2)))


def test_gspo_ratio_is_over_the_completion_tokens_only():
    # mask (1, 0): s = exp(ln 1.1 / 1) = 1.1 inside the clip; A = 1, w = 0.5 on the one token: loss = −0.55
    loss, _ = SequenceRatio(epsilon_low=0.2, epsilon_high=0.2).loss(
        torch.zeros(1, 2), batch([1.0], old=[[-math.log(1.1), -5.0]], mask=[[True, False]])
    )
    assert loss.item() == pytest.approx(-0.55)


def test_the_ratio_metrics_become_means():
    objective = ClippedRatio(epsilon_low=0.2, epsilon_high=0.2)
    summed = {"agent_0/ratio_sum": 6.0, "agent_0/ratio_tokens": 4.0, "agent_0/clipped_tokens": 1.0, "loss": 1.0}
    assert objective.summarize(summed) == {"agent_0/ratio_mean": 1.5, "agent_0/clip_ratio": 0.25, "loss": 1.0}


def test_every_registered_objective_is_built_from_fields_without_a_module():
    fields = {
        "epsilon_low": 0.1,
        "epsilon_high": 0.3,
        "reference_kl_enabled": True,
        "reference_kl_coef": 0.05,
        "reference_kl_placement": "loss",
        "reference_kl_estimator": "k3",
        "vllm_importance_sampling_correction": False,
        "entropy_coef": 0.01,
    }
    for name, cls in POLICY_LOSSES.items():
        objective = cls.from_fields(fields)
        assert objective.kl == KLTerm(0.05, "k3") and objective.correction is None, name
    clipped = POLICY_LOSSES["clipped"].from_fields(fields)
    assert (clipped.epsilon_low, clipped.epsilon_high) == (0.1, 0.3)
    assert GroupRelative.from_fields({**fields, "reference_kl_placement": "reward"}).kl is None


# ------------------------------------------------------------------------------------------ through a fit
def make(**overrides):
    fields = dict(
        agents="tiny",
        num_agents=2,
        reward_func=toy.brevity_reward,
        num_generations=2,
        max_new_tokens=4,
        eval_interval=0,
        log_completions=False,
        policy_loss="clipped",
    )
    return MAGRPO(**{**fields, **overrides})


def test_num_iterations_needs_a_ratio_objective():
    with pytest.raises(ValueError, match="num_iterations=2 needs a ratio objective"):
        make(policy_loss="reinforce", num_iterations=2)
    with pytest.raises(ValueError, match="policy_loss must be one of: reinforce, clipped, gspo"):
        make(policy_loss="ppo")


def fit_cli(tmp_path, *overrides):
    from comlrl_lightning.cli import main

    cli = main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
            "--model.init_args.max_new_tokens",
            "4",
            "--model.init_args.eval_interval",
            "0",
            *overrides,
        ]
    )
    import csv

    rows = list(csv.DictReader(next(Path(tmp_path).rglob("metrics.csv")).open()))
    return cli, rows


@pytest.mark.parametrize("policy_loss", ["clipped", "gspo"])
def test_ratio_objectives_fit_through_the_cli_with_several_passes(tmp_path, policy_loss):
    steps = 4
    cli, rows = fit_cli(
        tmp_path,
        "--model.init_args.policy_loss",
        policy_loss,
        "--model.init_args.num_iterations",
        "2",
        "--trainer.max_steps",
        str(steps),
    )
    assert type(cli.model.objective) is POLICY_LOSSES[policy_loss] and cli.trainer.global_step == steps
    updates = [r for r in rows if r.get("loss")]
    # quickstart: 2 prompts per step, buffer 2 nodes, train_batch_size 2 -> one mini-batch per pass, 2 passes per
    # rollout, so every step makes 2 updates, one row each: policy lag 0 on the first pass, 1 on the second (the same
    # samples again); the samples' reward is on the first row of the two.
    assert [int(r["step"]) for r in updates] == list(range(steps))
    assert [float(r["rollout/policy_lag"]) for r in updates] == [0.0, 1.0] * (steps // 2)
    assert [bool(r["rollout/turn_1/reward_mean"]) for r in updates] == [True, False] * (steps // 2)
    # the first pass: π = π_old, every ratio 1 and nothing clipped
    first = updates[0]
    assert float(first["agent_0/ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
    assert float(first["agent_0/clip_ratio"]) == 0.0
    assert all(0.0 <= float(r["agent_1/clip_ratio"]) <= 1.0 for r in updates)


def test_the_clipped_objective_keeps_the_reference_kl(tmp_path):
    cli, rows = fit_cli(
        tmp_path,
        "--model.init_args.policy_loss",
        "clipped",
        "--model.init_args.reference_kl_enabled",
        "true",
        "--model.init_args.reference_kl_coef",
        "0.1",
        "--model.init_args.reference_kl_placement",
        "loss",
        "--trainer.max_steps",
        "2",
    )
    assert cli.model.objective.kl == KLTerm(0.1, "k3")
    assert all(r["agent_0/reference_kl_loss"] != "" for r in rows if r.get("loss"))


def test_the_sampling_logprobs_are_stored_and_survive_a_checkpoint():
    seed_everything(0)
    module = make()
    module.configure_model()
    module.trainer = Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    rollout = module.collect_rollout(ITEMS[:2])
    for node in rollout.nodes:
        for sample in node.agents:
            assert sample.sampling_logprobs.shape == sample.completion_ids.shape
    # what the sampling weights give, recomputed: the stored values are the current policy's
    samples, inputs = module.agent_inputs(rollout.nodes, 0)
    width = inputs.completion_ids.shape[1]
    stored = torch.cat(
        [torch.nn.functional.pad(s.sampling_logprobs, (0, width - s.sampling_logprobs.shape[1])) for s in samples]
    )
    torch.testing.assert_close(
        stored * inputs.completion_mask, module.score_no_grad(0, inputs) * inputs.completion_mask, atol=1e-5, rtol=1e-5
    )
    buffer = io.BytesIO()  # a checkpoint holding the buffered samples, loaded the way Lightning loads it
    torch.save([n.state_dict() for n in rollout.nodes], buffer)
    buffer.seek(0)
    restored = [Node.from_state_dict(s) for s in torch.load(buffer, weights_only=True)]
    for before, after in zip(rollout.nodes, restored):
        for a, b in zip(before.agents, after.agents):
            assert torch.equal(a.sampling_logprobs, b.sampling_logprobs)
    assert torch.equal(module.agent_batch(restored, 0).old_logprobs, module.agent_batch(rollout.nodes, 0).old_logprobs)


def test_several_passes_resume_exactly(tmp_path):
    def run(root, ckpt_path=None, every=None):
        seed_everything(0)
        module = make(rollout_buffer_size=2, agent_learning_rate=1e-3, num_iterations=2)
        callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1)] if every else []
        trainer = Trainer(
            max_steps=8,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            enable_checkpointing=bool(every),
            accelerator="cpu",
            devices=1,
        )
        trainer.fit(
            module, datamodule=TaskDataModule(dataset=ITEMS, prompts_per_step=2, shuffle=True), ckpt_path=ckpt_path
        )
        return module

    full = run(tmp_path / "full", every=4)
    resumed = run(tmp_path / "resumed", ckpt_path=str(next((tmp_path / "full" / "ckpt").glob("*step=4.ckpt"))))
    assert resumed.env_step == full.env_step
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_buffered_node_of_the_release_with_old_logprobs_loads_and_an_unknown_field_is_loud():
    """``AgentSamples.old_logprobs`` (never set by a shipped objective) is gone: a checkpoint that still holds it
    loads; any other unknown field is an error, not silently dropped."""
    seed_everything(0)
    module = make()
    module.configure_model()
    node = module.policy.rollout(ITEMS[:1]).nodes[0]
    state = node.state_dict()
    state["agents"] = [{**a, "old_logprobs": None} for a in state["agents"]]
    assert torch.equal(Node.from_state_dict(state).agents[0].completion_ids, node.agents[0].completion_ids)
    state["agents"] = [{**a, "typo_logprobs": None} for a in state["agents"]]
    with pytest.raises(TypeError, match="typo_logprobs"):
        Node.from_state_dict(state)
