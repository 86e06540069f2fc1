"""MADPO end to end on tiny models: pair collection, margins, the joint-margin gradient, resume, learning."""

from __future__ import annotations

import copy
import json
import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_magrpo import ITEMS, column, params_of, read_metrics
from transformers import LogitsProcessor, LogitsProcessorList

from comlrl_lightning import MADPO, PreferenceDataModule
from comlrl_lightning.agents.factories import MODEL_FACTORIES
from comlrl_lightning.core.pairs import RECORD_KEYS
from comlrl_lightning.envs import toy

EOS = 0  # tiny tokenizer: pad == eos == <|endoftext|>


class EndEvenRows(LogitsProcessor):
    """Pushes EOS up in every even row of a generate batch, so candidates end at varied lengths (random tiny
    models almost never sample EOS on their own) and completions of different lengths meet in one batch."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[0::2, EOS] += 7.0
        return scores


def varied_lengths():
    return {"logits_processor": LogitsProcessorList([EndEvenRows()])}


def make_madpo(cls=MADPO, **overrides):
    kwargs = dict(
        agents="tiny",
        num_agents=2,
        reward_func=toy.letter_reward,
        preference_num_candidates=4,
        preference_pairs_per_sample=2,
        train_batch_size=2,
        max_new_tokens=6,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        agent_learning_rate=1e-3,
        eval_interval=0,
        log_completions=False,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def count_collections(data, calls, value=lambda items: len(items)):
    """Record ``value(items)`` for every ``collect_pairs`` call of the data module."""
    collect = data.collect_pairs
    data.collect_pairs = lambda items: calls.append(value(items)) or collect(items)
    return data


def collected(module, items):
    """The pairs the data side collects for ``items`` with the module's plan (outside a fit)."""
    module.configure_model()
    data = PreferenceDataModule(dataset=list(items), show_progress=False)
    data.attach(module.pairs.plan())
    return data.collect_pairs(items)


def fit_madpo(
    module,
    tmp_path,
    items=ITEMS[:3],
    max_epochs=2,
    max_steps=-1,
    callbacks=(),
    ckpt_path=None,
    seed=0,
    name="run",
    calls=None,
    **data_kwargs,
):
    seed_everything(seed)
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer = Trainer(
        max_epochs=max_epochs,
        max_steps=max_steps,
        logger=CSVLogger(tmp_path, name=name),
        enable_checkpointing=checkpointing,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=list(callbacks),
        accelerator="cpu",
        devices=1,
    )
    data_kwargs.setdefault("prompts_per_step", 4)
    data = PreferenceDataModule(dataset=items, show_progress=False, **data_kwargs)
    if calls is not None:
        count_collections(data, calls)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, data


class FirstGrads(Callback):
    """Each agent's parameter gradients at the first optimizer step."""

    def __init__(self):
        self.grads = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads is None:
            self.grads = [[p.grad.detach().clone() for p in agent.parameters()] for agent in pl_module.agents]


def sequence_logp(model, prompt_ids, completion_ids):
    """Σ_t log π(y_t | x, y_<t) for one unpadded sequence."""
    ids = torch.cat([prompt_ids, completion_ids]).unsqueeze(0)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, completion_ids[:, None]).sum()


def reference_margins(models, pairs):
    """[P, N] Δ_{p,i} one sequence at a time (with grad)."""
    return torch.stack(
        [
            torch.stack(
                [
                    sequence_logp(m, p.prompt_ids[i], p.winner_ids[i])
                    - sequence_logp(m, p.prompt_ids[i], p.loser_ids[i])
                    for i, m in enumerate(models)
                ]
            )
            for p in pairs
        ]
    )


# ----------------------------------------------------------------------------------------------- fit
def test_fit_collects_pairs_updates_and_logs(tmp_path):
    module = make_madpo(train_batch_size=3)
    before = params_of(module)
    pairs_file = tmp_path / "pairs.json"
    trainer, data = fit_madpo(module, tmp_path, items=ITEMS[:5], pairs_file=str(pairs_file))
    pairs = data.pairs
    assert pairs and all(p.winner_reward > p.loser_reward for p in pairs)
    assert len(pairs) <= 5 * 2
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    updates_per_epoch = math.ceil(len(pairs) / 3)
    assert trainer.global_step == 2 * updates_per_epoch
    assert module.env_step == 2 * len(pairs) * 2  # environment_steps_per_pair=2 x pairs x epochs (example 4)

    rows = read_metrics(trainer)
    env_steps = column(rows, "env_step")
    num_pairs = column(rows, "dpo/num_pairs")
    assert len(num_pairs) == trainer.global_step
    assert sum(num_pairs) == 2 * len(pairs)  # every pair once per epoch, the last batch partial
    assert env_steps == [2.0 * sum(num_pairs[: k + 1]) for k in range(len(num_pairs))]
    for key in (
        "loss",
        "dpo/accuracy",
        "dpo/joint_margin_mean",
        "dpo/reward_gap_mean",
        "turn_1/reward_mean",
        "agent_0/grad_norm",
        "agent_1/grad_norm",
    ):
        assert len(column(rows, key)) == trainer.global_step, key
    assert all(0.0 <= a <= 1.0 for a in column(rows, "dpo/accuracy"))
    assert all(g > 0 for g in column(rows, "dpo/reward_gap_mean"))
    assert all(l > 0 for l in column(rows, "loss"))
    mean_candidate = sum(p.candidate_reward_mean for p in pairs) / len(pairs)
    assert sum(r * n for r, n in zip(column(rows, "turn_1/reward_mean"), num_pairs)) / sum(num_pairs) == pytest.approx(
        mean_candidate, abs=1e-6
    )

    payload = json.loads(pairs_file.read_text())
    assert payload["num_pairs"] == len(pairs) == len(payload["pairs"])
    for record, pair in zip(payload["pairs"], pairs):
        assert list(record) == list(RECORD_KEYS)
        assert record["winner_completions"] == pair.winner_completions
        assert record["winner_reward"] == pytest.approx(pair.winner_reward)
        assert record["raw_rewards"] == pytest.approx([pair.winner_reward, pair.loser_reward])  # no processor
        assert record["target_raw_reward"] is None and record["comparator_raw_reward"] is None


def test_environment_step_can_be_turned_off(tmp_path):
    module = make_madpo(use_environment_step=False)
    trainer, data = fit_madpo(module, tmp_path, items=ITEMS[:2], max_epochs=1)
    assert data.pairs and trainer.global_step > 0
    assert module.env_step == 0
    assert set(column(read_metrics(trainer), "env_step")) == {0.0}


# ----------------------------------------------------------------------------------------------- pairs
def test_pairs_keep_the_sampled_token_ids():
    seed_everything(0)
    formatters = [lambda item: "Agent A: " + item["prompt"], lambda item: "Agent B writes about " + item["prompt"]]
    module = make_madpo(
        formatters=formatters, reward_processor=lambda r: 2.0 * r + 1.0, generation_kwargs=varied_lengths()
    )
    items = ITEMS[:4]
    pairs = collected(module, items)
    assert len(pairs) == 4 * 2  # 2 per item: random text hardly ever ties
    ended, full = 0, 0
    for p in pairs:
        for i, tok in enumerate(module.tokenizers):
            assert p.prompts[i] in {formatters[i](item) for item in items}
            assert p.prompt_ids[i].tolist() == tok(p.prompts[i], add_special_tokens=False).input_ids
            for ids, text in ((p.winner_ids[i], p.winner_completions[i]), (p.loser_ids[i], p.loser_completions[i])):
                assert ids.dim() == 1 and ids.dtype == torch.long and 1 <= len(ids) <= 6
                assert EOS not in ids[:-1].tolist()  # ends at the first EOS; no padding (pad == EOS) after it
                if ids[-1] == EOS:
                    ended += 1
                else:
                    assert len(ids) == 6  # without EOS generation ran to max_new_tokens
                    full += 1
                assert tok.decode(ids, skip_special_tokens=True) == text
        raw_w = toy.letter_reward(*[[c] for c in p.winner_completions])[0]
        raw_l = toy.letter_reward(*[[c] for c in p.loser_completions])[0]
        assert p.winner_reward == pytest.approx(2.0 * raw_w + 1.0) and p.loser_reward == pytest.approx(
            2.0 * raw_l + 1.0
        )
        assert p.raw_rewards == pytest.approx([raw_w, raw_l])
        assert p.winner_reward > p.loser_reward
    assert ended and full  # both kinds were checked


def test_agent_margins_match_per_sequence_scoring():
    seed_everything(1)
    module = make_madpo(generation_kwargs=varied_lengths())
    pairs = collected(module, ITEMS[:3])
    lengths = {len(p.winner_ids[0]) for p in pairs} | {len(p.loser_ids[0]) for p in pairs}
    assert len(lengths) > 1  # padding is exercised
    module.eval()
    with torch.no_grad():
        expected = reference_margins([module.policy_model(i) for i in range(2)], pairs)
        for i in range(2):
            torch.testing.assert_close(module.agent_margins(i, pairs), expected[:, i], atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------- gradients
def test_gradient_matches_the_joint_objective_and_the_detach_form(tmp_path):
    """grad of one update == autograd of mean_p -log σ(η Σ_i Δ_i) scored one sequence at a time; per agent, also ==
    CoMLRL's form mean_p -log σ(η (Δ_i + Σ_{j≠i} stopgrad Δ_j)) (docs/algorithms.md example 6)."""
    beta = 0.05  # margins of the varied-length pairs are tens of nats: σ(-ηΔ) then differs clearly between pairs
    module = make_madpo(train_batch_size=4, dpo_beta=beta, generation_kwargs=varied_lengths())
    captured = {}
    step = module.training_step

    def spy(batch, batch_idx):
        if "batch" not in captured:
            captured["batch"], captured["agents"] = batch, copy.deepcopy(module.agents)
        return step(batch, batch_idx)

    module.training_step = spy
    grads = FirstGrads()
    fit_madpo(module, tmp_path, max_steps=1, callbacks=[grads])
    batch, agents = captured["batch"], captured["agents"]
    assert len(batch) == 4

    margins = reference_margins(agents, batch)  # [P, N]
    weights = torch.sigmoid(-beta * margins.detach().sum(-1))
    assert float(weights.max() - weights.min()) > 0.05, (weights, margins)
    F.softplus(-beta * margins.sum(-1)).mean().backward()
    for i, agent in enumerate(agents):
        for got, p in zip(grads.grads[i], agent.parameters()):
            torch.testing.assert_close(got, p.grad, atol=2e-5, rtol=1e-3)

    for i, agent in enumerate(agents):
        agent.zero_grad()
        margins = reference_margins(agents, batch)
        joint = margins[:, i] + (margins.sum(-1) - margins[:, i]).detach()
        (-F.logsigmoid(beta * joint)).mean().backward()
        for got, p in zip(grads.grads[i], agent.parameters()):
            torch.testing.assert_close(got, p.grad, atol=2e-5, rtol=1e-3)


def test_micro_batches_accumulate_to_the_same_gradient(tmp_path):
    captured = []
    for micro in (None, 1):
        grads = FirstGrads()
        fit_madpo(
            make_madpo(train_batch_size=4, micro_batch_size=micro, generation_kwargs=varied_lengths()),
            tmp_path,
            max_steps=1,
            callbacks=[grads],
        )
        captured.append(torch.cat([g.flatten() for agent in grads.grads for g in agent]))
    assert captured[0].abs().max() > 0
    torch.testing.assert_close(captured[0], captured[1], atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------- no pairs
def test_all_tied_rewards_train_nothing(tmp_path, caplog):
    module = make_madpo(reward_func=lambda *completions, **kwargs: [0.5] * len(completions[0]))
    before = params_of(module)
    with caplog.at_level(logging.WARNING, logger="comlrl_lightning"):
        trainer, data = fit_madpo(module, tmp_path, items=ITEMS[:2])
    assert data.pairs == []
    assert "no non-tied preference pairs" in caplog.text
    assert trainer.global_step == 0 and module.env_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


# ----------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"num_turns": 2}, "MADPO currently supports num_turns=1 only."),
        ({"joint_mode": "cross"}, "aligned joint_mode only"),
        ({"preference_num_candidates": 1}, "preference_num_candidates must be >= 2"),
        ({"preference_pairs_per_sample": 0}, "preference_pairs_per_sample must be >= 1 or null"),
        ({"pair_selection": "best"}, "pair_selection must be one of"),
        ({"pair_selection": "all", "preference_pairs_per_sample": 4}, "must be null when pair_selection='all'"),
        ({"dpo_beta": 0.0}, "dpo_beta must be > 0"),
        ({"environment_steps_per_pair": 0}, "environment_steps_per_pair must be >= 1"),
        ({"train_batch_size": 0}, "train_batch_size must be >= 1"),
        ({"reward_func": None}, "reward_func must be a callable"),
    ],
)
def test_invalid_config_fails_before_loading_models(overrides, message, monkeypatch):
    def no_loading(**kwargs):
        raise AssertionError("a model was loaded before validation")

    monkeypatch.setitem(MODEL_FACTORIES, "tiny", no_loading)
    with pytest.raises(AssertionError, match="a model was loaded"):  # control: the patch is effective
        make_madpo().configure_model()
    with pytest.raises(ValueError, match=re.escape(message)):
        make_madpo(**overrides)


def test_pair_selection_all_with_null_limit_is_valid():
    module = make_madpo(pair_selection="ALL", preference_pairs_per_sample=None)
    assert module.pair_selection == "all"


# ----------------------------------------------------------------------------------------------- resume
def test_resume_restores_the_pairs_and_matches_the_uninterrupted_run(tmp_path):
    def run(ckpt_path=None, callbacks=(), name="run"):
        module = make_madpo(generation_kwargs=varied_lengths())
        calls = []
        trainer, data = fit_madpo(module, tmp_path, ckpt_path=ckpt_path, callbacks=callbacks, name=name, calls=calls)
        return module, trainer, data, calls

    ckpt_dir = tmp_path / "ckpt"
    full, full_trainer, full_data, calls = run(
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)]
    )
    assert calls == [3]
    per_epoch = math.ceil(len(full_data.pairs) / 2)
    assert full_trainer.global_step == 2 * per_epoch and per_epoch >= 2
    # the first checkpoint (mid-epoch) and the one written by the last update of epoch 0
    for step in (1, per_epoch):
        (ckpt,) = ckpt_dir.glob(f"epoch=0-step={step}.ckpt")
        resumed, trainer, data, calls = run(ckpt_path=str(ckpt), name=f"resume{step}")
        assert calls == []  # no recollection: the pairs come from the checkpoint
        assert [(p.winner_completions, p.loser_completions, p.winner_reward) for p in data.pairs] == [
            (p.winner_completions, p.loser_completions, p.winner_reward) for p in full_data.pairs
        ]
        for a, b in zip(data.pairs, full_data.pairs):
            for field in ("prompt_ids", "winner_ids", "loser_ids"):
                assert all(torch.equal(x, y) for x, y in zip(getattr(a, field), getattr(b, field)))
        assert trainer.global_step == full_trainer.global_step
        assert resumed.env_step == full.env_step
        for a, b in zip(resumed.parameters(), full.parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_reloading_the_loader_recollects_pairs(tmp_path):
    module = make_madpo()
    calls = []
    seed_everything(0)
    trainer = Trainer(
        max_epochs=2,
        reload_dataloaders_every_n_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    data = PreferenceDataModule(dataset=ITEMS[:2], prompts_per_step=2, show_progress=False)
    count_collections(data, calls, lambda items: module.global_step)
    trainer.fit(module, datamodule=data)
    per_epoch = trainer.global_step // 2
    assert calls == [0, per_epoch]  # each epoch's pairs come from the agents as they are then


# ----------------------------------------------------------------------------------------------- learning
def test_madpo_team_learns_the_letter_task(tmp_path):
    """From random tiny models, DPO on pairs scored by the letter reward raises the task reward of the agents."""
    module = make_madpo(
        preference_num_candidates=8,
        preference_pairs_per_sample=4,
        train_batch_size=8,
        max_new_tokens=8,
        agent_learning_rate=1e-2,
        dpo_beta=0.1,
        eval_interval=4,
        eval_num_samples=8,
    )
    trainer, data = fit_madpo(
        module, tmp_path, items=ITEMS * 4, max_epochs=3, prompts_per_step=8, eval_dataset=ITEMS, eval_batch_size=8
    )
    assert trainer.global_step == 3 * math.ceil(len(data.pairs) / 8)
    rewards = column(read_metrics(trainer), "eval/turn_1/reward_mean")
    assert len(rewards) >= 6
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    assert last > first + 0.04, (first, last, rewards)


def test_mp_margins_are_gathered_on_the_module_device(tmp_path, monkeypatch):
    """With parallel_training: mp each agent's margins are computed on its own device; the joint loss combines
    them only after moving them to the module's device (agent 1 stands on a simulated second device)."""
    from standin_device import on_second_device

    margins = MADPO.agent_margins
    monkeypatch.setattr(
        MADPO,
        "agent_margins",
        lambda self, i, pairs: on_second_device(margins(self, i, pairs)) if i else margins(self, i, pairs),
    )
    module = make_madpo(parallel_training="mp", agent_devices=["cpu", "cpu"])
    before = params_of(module)
    trainer, _ = fit_madpo(module, tmp_path, max_epochs=1)
    assert trainer.global_step >= 1
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
