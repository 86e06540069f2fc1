"""The preference updates split their pairs into micro-batches by ``micro_batch_size`` and ``micro_batch_tokens``
(MADPO's margins, MARLHF's reward model), and a split batch has the gradient of one forward over all its pairs."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from test_madpo import FirstGrads, fit_madpo, make_madpo, varied_lengths
from test_magrpo import ITEMS
from test_marlhf import make_marlhf

from comlrl_lightning import PreferenceDataModule
from comlrl_lightning.agents import JointRewardModel
from comlrl_lightning.algorithms import madpo
from comlrl_lightning.algorithms.pairs import pair_micro_batches
from comlrl_lightning.rollout.sampling import forward_tokens


def flat(grads):
    return torch.cat([g.flatten() for g in grads])


# ----------------------------------------------------------------------------------------------- the plan
def test_pair_plans_count_both_rows_of_a_pair_and_a_shared_prompt_once():
    # no token budget: consecutive pairs, micro_batch_size at a time
    assert pair_micro_batches(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert pair_micro_batches(3, None) == [slice(0, 3)]
    assert pair_micro_batches(0, None, 10) == []
    # not shared: a pair costs 2 × (prompt + width); prompts 3, 3, 5, width 2 → 10, 10, 14 tokens a pair; a
    # micro-batch costs 2 × pairs × its longest (prompt + width)
    plan = pair_micro_batches(3, None, 20, prompt_lengths=[3, 3, 5], width=2)
    assert [p.tolist() for p in plan] == [[0, 1], [2]]  # pairs 0, 1: 4 rows × 5 = 20; with pair 2: 6 × 7 = 42
    assert [p.tolist() for p in pair_micro_batches(3, None, 19, prompt_lengths=[3, 3, 5], width=2)] == [[0], [1], [2]]
    # shared (pairs 0 and 1 of one task): each distinct prompt once, minus its last token, plus 2·width per pair:
    # pairs 0, 1 = (3 - 1) + 2 × 2 × 2 = 10 tokens; all three = 2 prompts × (5 - 1) + 3 × 4 = 20 tokens
    plan = pair_micro_batches(
        3, None, 10, prompt_lengths=[3, 3, 5], width=2, groups=["a", "a", "b"], share_prompts=True
    )
    assert [p.tolist() for p in plan] == [[0, 1], [2]]
    plan = pair_micro_batches(
        3, None, 20, prompt_lengths=[3, 3, 5], width=2, groups=["a", "a", "b"], share_prompts=True
    )
    assert [p.tolist() for p in plan] == [[0, 1, 2]]
    # micro_batch_size still bounds the pairs of a forward under a budget
    plan = pair_micro_batches(3, 1, 1000, prompt_lengths=[3, 3, 5], width=2, groups=["a", "a", "b"], share_prompts=True)
    assert [p.tolist() for p in plan] == [[0], [1], [2]]


# ----------------------------------------------------------------------------------------------- MADPO
def madpo_update(tmp_path, monkeypatch, **overrides):
    """The first update of a MADPO fit on 4 pairs: its parameter gradients and every margin forward's (rows, tokens)."""
    forwards = []
    score = madpo.token_logprobs

    def spy(model, inputs, *args, **kwargs):
        forwards.append((inputs.input_ids.shape[0], forward_tokens(model, inputs)))
        return score(model, inputs, *args, **kwargs)

    monkeypatch.setattr(madpo, "token_logprobs", spy)
    grads = FirstGrads()
    module = make_madpo(train_batch_size=4, generation_kwargs=varied_lengths(), **overrides)
    fit_madpo(module, tmp_path, max_steps=1, callbacks=[grads])
    return flat(g for agent in grads.grads for g in agent), forwards


def test_madpo_forwards_keep_to_micro_batch_tokens_with_the_same_gradient(tmp_path, monkeypatch):
    whole, forwards = madpo_update(tmp_path, monkeypatch)
    assert [rows for rows, _ in forwards] == [8, 8]  # one forward per agent: 4 winners and 4 losers
    assert whole.abs().max() > 0
    budget = max(tokens for _, tokens in forwards) // 2
    split, forwards = madpo_update(tmp_path, monkeypatch, micro_batch_tokens=budget)
    assert len(forwards) > 2 and sum(rows for rows, _ in forwards) == 2 * 8  # every pair once per agent
    assert all(rows % 2 == 0 for rows, _ in forwards)  # a pair's winner and loser share a forward
    assert all(tokens <= budget or rows == 2 for rows, tokens in forwards), (budget, forwards)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-4)
    # with micro_batch_size too: at most one pair (two rows) a forward
    both, forwards = madpo_update(tmp_path, monkeypatch, micro_batch_tokens=budget, micro_batch_size=1)
    assert [rows for rows, _ in forwards] == [2] * 8
    torch.testing.assert_close(both, whole, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------- MARLHF
class RewardModelGrads(Callback):
    """The reward model's gradients at the first optimizer step (the agents have none in its stage)."""

    def __init__(self):
        self.grads = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads is None:
            assert all(p.grad is None for p in pl_module.agents.parameters())
            self.grads = [p.grad.detach().clone() for p in pl_module.reward_model.parameters()]


def reward_model_update(tmp_path, monkeypatch, **overrides):
    """The first reward-model update of a MARLHF fit on 4 pairs: the reward model's gradients and the [rows, tokens]
    shape of every reward-model forward with gradients (the training forwards)."""
    forwards = []
    forward = JointRewardModel.forward

    def spy(self, input_ids, attention_mask=None):
        if torch.is_grad_enabled():
            forwards.append(tuple(input_ids.shape))
        return forward(self, input_ids, attention_mask)

    monkeypatch.setattr(JointRewardModel, "forward", spy)
    module = make_marlhf(reward_train_batch_size=4, reward_num_train_epochs=1, **overrides)
    grads = RewardModelGrads()
    seed_everything(0)
    trainer = Trainer(
        max_epochs=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[grads],
        accelerator="cpu",
        devices=1,
    )
    data = PreferenceDataModule(dataset=ITEMS[:4], prompts_per_step=4, show_progress=False)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1 and len(data.pairs) >= 4
    return flat(grads.grads), forwards


def test_reward_model_forwards_keep_to_micro_batch_size_and_tokens_with_the_same_gradient(tmp_path, monkeypatch):
    whole, forwards = reward_model_update(tmp_path, monkeypatch)
    assert [rows for rows, _ in forwards] == [8]  # 4 winners and 4 losers in one forward
    assert whole.abs().max() > 0
    # micro_batch_size: pairs per forward (a pair is its winner's and its loser's joint text)
    split, forwards = reward_model_update(tmp_path, monkeypatch, micro_batch_size=1)
    assert [rows for rows, _ in forwards] == [2] * 4
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-4)
    # micro_batch_tokens: rows × the longest row of a forward (its texts are padded to it)
    rows, length = 8, max(length for _, length in reward_model_update(tmp_path, monkeypatch)[1])
    budget = rows * length // 2
    split, forwards = reward_model_update(tmp_path, monkeypatch, micro_batch_tokens=budget)
    assert len(forwards) > 1 and sum(r for r, _ in forwards) == 8
    assert all(r * length <= budget or r == 2 for r, length in forwards), (budget, forwards)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("freeze", [False, True])
def test_the_reward_model_is_a_model_part(freeze):
    """The reward model is the module's ``reward_model`` part: its checkpoint keys, its one parameter group and
    learning rate, its gradient-norm name; nothing of it in an RL objective."""
    module = make_marlhf(reward_freeze_backbone=freeze, reward_learning_rate=3e-4)
    part = module.reward_part
    assert module.model_parts()[-1] is part and part.name == "reward_model" and part.module is None
    model = module.reward_model  # loads the team and the parts
    assert part.module is model and module._modules["reward_model"] is module.reward_model
    assert any(k.startswith("reward_model.") for k in module.state_dict())
    (group,) = part.parameter_groups()
    assert group["name"] == "reward_model" and group["lr"] == 3e-4 and group["agents"] == []
    assert len(group["params"]) == len(list(module.reward_model.parameters()))  # frozen ones too, as before
    assert part.trained_models() == [(["reward_model"], module.reward_model)]
    assert module.reward_model.freeze_backbone is freeze
