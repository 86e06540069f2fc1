"""MARLHF end to end on tiny models: the two stages (reward model, then RL on it) for every backend, which reward
scores what, env_step accounting, validation, export, resume and the CLI config (docs/algorithms.md#marlhf)."""

from __future__ import annotations

import copy
import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_magrpo import ITEMS, column, params_of, read_metrics

from comlrl_lightning import IAC, MAAC, MAGRPO, MAREINFORCE, MARLHF, MARLOO, MAReMax, PreferenceDataModule
from comlrl_lightning.agents import JointRewardModel
from comlrl_lightning.agents.factories import MODEL_FACTORIES
from comlrl_lightning.agents.reward_model import joint_texts
from comlrl_lightning.algorithms import ActorCritic, BradleyTerry, JointCritic
from comlrl_lightning.algorithms.marlhf import RewardModelPart
from comlrl_lightning.envs import toy

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "marlhf.yaml"

# rl_algorithm -> (backend class, MAGRPO-family advantage_mode or None for actor-critic)
BACKENDS = {
    "magrpo": (MAGRPO, "mean"),
    "mareinforce": (MAREINFORCE, "raw"),
    "mareforce": (MAREINFORCE, "raw"),  # CoMLRL's alias
    "marloo": (MARLOO, "rloo"),
    "maremax": (MAReMax, "max"),
    "iac": (IAC, None),
    "maac": (MAAC, None),
}


def make_marlhf(rl_algorithm="magrpo", **overrides):
    kwargs = dict(
        agents="tiny",
        num_agents=2,
        reward_func=toy.letter_reward,
        rl_algorithm=rl_algorithm,
        preference_num_candidates=4,
        preference_pairs_per_sample=2,
        reward_model_name="tiny",
        reward_train_batch_size=2,
        reward_num_train_epochs=2,
        num_generations=2,
        max_new_tokens=6,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        agent_learning_rate=1e-3,
        reward_learning_rate=1e-3,
        rollout_buffer_size=2,
        eval_interval=2,
        eval_num_samples=2,
        log_completions=False,
    )
    kwargs.update(overrides)
    seed_everything(0)  # the reward model's (and critics') fresh heads draw from the global RNG
    return MARLHF(**kwargs)


def fit_marlhf(
    module, tmp_path, max_epochs=2, callbacks=(), ckpt_path=None, name="run", items=ITEMS[:4], collects=None
):
    """``collects``: a list that gets the epoch of every collection call of the data module."""
    seed_everything(0)
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer = Trainer(
        max_epochs=max_epochs,
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
    data = PreferenceDataModule(
        dataset=items, eval_dataset=ITEMS[:2], prompts_per_step=2, eval_batch_size=2, show_progress=False
    )
    if collects is not None:
        collect = data.collect_pairs
        data.collect_pairs = lambda items: collects.append(module.current_epoch) or collect(items)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, data


def count_updates(module):
    """Wrap the module's two updates to record the epoch of each call: the reward-model stage's
    (``module.update_reward_model``) in the first list, the RL objective's (``module.update``) in the second."""
    stages = ([], [])

    def counted(update, calls):
        def wrapper(*args, **kwargs):
            calls.append(module.current_epoch)
            return update(*args, **kwargs)

        return wrapper

    for calls, name in zip(stages, ("update_reward_model", "update")):
        setattr(module, name, counted(getattr(module, name), calls))
    return stages


def current_reward(module):
    """The reward caller the RL stage's training rollouts use now."""
    return module.rollout_reward()


class StageProbe(Callback):
    """Snapshots of the reward model and the agents at epoch boundaries, the reward caller in use at every training
    batch, and env_step at the end of each epoch."""

    def __init__(self):
        self.rm, self.agents, self.env_step = {}, {}, {}
        self.rewards: list[tuple[int, object]] = []

    def _snap(self, when, trainer, module):
        self.rm[(when, trainer.current_epoch)] = params_of(module.reward_model)
        self.agents[(when, trainer.current_epoch)] = [p.detach().clone() for p in module.agents.parameters()]

    def on_train_epoch_start(self, trainer, module):
        self._snap("start", trainer, module)

    def on_train_epoch_end(self, trainer, module):
        self._snap("end", trainer, module)
        self.env_step[trainer.current_epoch] = module.env_step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.rewards.append((trainer.current_epoch, current_reward(module)))


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------- stages
@pytest.mark.parametrize("algo", list(BACKENDS))
def test_two_stages_for_every_backend(algo, tmp_path):
    backend, mode = BACKENDS[algo]
    module = make_marlhf(algo)
    # one module, one team: the backend's objective on it (chosen case-insensitively), the reward model's stage beside
    # the RL stage runs the backend's loop: the module is a MARLHF whose second base is the backend
    assert (
        isinstance(module, MARLHF) and type(module).__name__ == "MARLHF" and type(module).__bases__ == (MARLHF, backend)
    )
    assert module.rl_backend is backend and type(module.objective) is backend.objective_class
    assert type(make_marlhf(algo.upper()).objective) is backend.objective_class
    assert type(module.reward_objective) is BradleyTerry and type(module.reward_part) is RewardModelPart
    assert module.model_parts()[-1] is module.reward_part  # after the RL objective's parts (critics)
    if mode is not None:
        assert module.advantage_mode == mode

    collects = []
    rm_steps, rl_updates = count_updates(module)  # the reward-model stage's updates, the RL objective's
    probe = StageProbe()
    trainer, data = fit_marlhf(module, tmp_path, callbacks=[probe], collects=collects)

    assert collects == [0, 0]  # 4 tasks, 2 per collection call, all in epoch 0
    pairs = data.pairs
    assert pairs and all(p.winner_reward > p.loser_reward for p in pairs)
    expected_rm = math.ceil(len(pairs) * 2 / 2)  # pairs x reward_num_train_epochs / reward_train_batch_size
    assert rm_steps == [0] * expected_rm
    assert rl_updates and set(rl_updates) == {1}
    assert trainer.global_step == len(rm_steps) + len(rl_updates)

    # reward model: learns in epoch 0, frozen in the RL epoch; agents: the other way round
    assert not same(probe.rm[("start", 0)], probe.rm[("end", 0)])
    assert same(probe.rm[("end", 0)], params_of(module.reward_model))
    assert same(probe.agents[("start", 0)], probe.agents[("end", 0)])
    assert not same(probe.agents[("start", 1)], [p.detach() for p in module.agents.parameters()])
    assert not any(p.requires_grad for p in module.reward_model.parameters())
    # the task reward ranks pairs in epoch 0; the learned reward scores the rollouts of epoch 1
    assert {e for e, r in probe.rewards if r is module.task_reward} == {0}
    assert {e for e, r in probe.rewards if r is module.learned_reward} == {1}

    rows = read_metrics(trainer)
    rm_rows = [r for r in rows if r.get("reward_model/loss")]
    assert len(rm_rows) == expected_rm and {r["epoch"] for r in rm_rows} == {"0"}
    for key in ("reward_model/accuracy", "reward_model/margin_mean", "reward_model/num_pairs"):
        assert len(column(rows, key)) == expected_rm, key
    assert sum(column(rows, "reward_model/num_pairs")) == 2 * len(pairs)  # every pair once per RM epoch
    assert all(0.0 <= a <= 1.0 for a in column(rows, "reward_model/accuracy"))
    rl_rows = [r for r in rows if r.get("loss")]
    assert rl_rows and {r["epoch"] for r in rl_rows} == {"1"}
    for key in ("rollout/turn_1/reward_mean", "turn_1/expected_return", "agent_0/grad_norm", "agent_1/grad_norm"):
        assert column(rows, key), key
    evals = column(rows, "eval/turn_1/reward_mean")
    assert evals and all(0.0 <= v <= 1.0 for v in evals)  # the letter reward's range


def test_env_step_does_not_advance_during_the_reward_model_stage(tmp_path):
    module = make_marlhf("magrpo")
    probe = StageProbe()
    trainer, _ = fit_marlhf(module, tmp_path, callbacks=[probe])
    assert probe.env_step[0] == 0
    assert module.env_step == probe.env_step[1] == 4 * 2  # RL epoch: 4 tasks x K=2 aligned joint actions
    rows = read_metrics(trainer)
    assert {float(r["env_step"]) for r in rows if r.get("reward_model/loss")} == {0.0}
    rl_env_steps = [float(r["env_step"]) for r in rows if r.get("loss")]
    assert rl_env_steps == [4.0, 8.0]


# ----------------------------------------------------------------------------------------------- rewards
@pytest.mark.parametrize("algo", ["magrpo", "iac", "maac"])
def test_rl_stage_uses_raw_reward_model_scores_and_evaluation_the_task_reward(algo, tmp_path):
    state = {"eval": False, "batch": None}
    task_calls, rm_calls = [], []
    module = None

    def task_reward(*agent_completions):
        task_calls.append((module.current_epoch, state["eval"]))
        return toy.letter_reward(*agent_completions)

    module = make_marlhf(algo, reward_func=task_reward, reward_processor=lambda r: r + 100.0, log_completions=True)

    evaluation_record = module.evaluation.record

    def spy_evaluation(items):
        state["eval"] = True
        try:
            return evaluation_record(items)
        finally:
            state["eval"] = False

    module.evaluation.record = spy_evaluation
    score_joint = module.reward_model.score_joint

    def spy_score(*args, **kwargs):
        scores = score_joint(*args, **kwargs)
        rm_calls.append(
            {
                "epoch": module.current_epoch,
                "eval": state["eval"],
                "batch": state["batch"],
                "grad": torch.is_grad_enabled(),
                "training": module.reward_model.training,
                "scores": scores.detach().float().tolist(),
            }
        )
        return scores

    module.reward_model.score_joint = spy_score

    class Batches(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            state["batch"] = (trainer.current_epoch, batch_idx)

    trainer, data = fit_marlhf(module, tmp_path, callbacks=[Batches()])

    # the task reward: the oracle of pair collection (epoch 0) and every evaluation, never an RL-stage rollout
    assert (0, False) in task_calls
    assert (1, True) in task_calls
    assert (1, False) not in task_calls
    # pairs are ranked by the processed task reward
    for p in data.pairs:
        assert 100.0 <= p.loser_reward < p.winner_reward <= 101.0
        assert all(0.0 <= r <= 1.0 for r in p.raw_rewards)
    evals = column(read_metrics(trainer), "eval/turn_1/reward_mean")
    assert evals and all(100.0 <= v <= 101.0 for v in evals)  # task reward (with its processor)

    # the reward model: trained in epoch 0 (with grad), scoring the RL rollouts in epoch 1 (no grad, eval mode)
    assert all(c["grad"] and c["training"] and not c["eval"] for c in rm_calls if c["epoch"] == 0)
    rl_calls = [c for c in rm_calls if c["epoch"] == 1]
    assert rl_calls and all(not c["grad"] and not c["training"] and not c["eval"] for c in rl_calls)
    assert not any(c["eval"] for c in rm_calls)  # evaluation never asks the reward model

    # the rollout rewards of the RL stage are the raw scores: no reward_processor (+100) on them
    rows = read_metrics(trainer)
    logged = [float(r["rollout/turn_1/reward_mean"]) for r in rows if r.get("rollout/turn_1/reward_mean")]
    batches = sorted({c["batch"] for c in rl_calls})
    assert len(logged) == len(batches) == 2
    for value, batch in zip(logged, batches):
        scores = [s for c in rl_calls if c["batch"] == batch for s in c["scores"]]
        assert len(scores) == 2 * 2  # 2 tasks x K=2 joint actions
        assert all(abs(s) < 50 for s in scores)
        assert value == pytest.approx(sum(scores) / len(scores), abs=1e-5)

    # completions log: pair records (oracle rewards) in epoch 0, rollouts with raw RM scores afterwards
    lines = (Path(trainer.logger.log_dir) / "completions.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    rm_records = [r for r in records if r["step"] < len(data.pairs)]  # one RM update per pair (2 epochs / 2)
    rl_records = [r for r in records if r["step"] >= len(data.pairs)]  # a record's step: updates done at sampling
    assert rm_records and all(100.0 <= x <= 101.0 for r in rm_records for x in _flat(r["rewards"]))
    assert rl_records and all(abs(x) < 50 for r in rl_records for x in _flat(r["rewards"]))


def _flat(values):
    for v in values:
        if isinstance(v, list):
            yield from _flat(v)
        else:
            yield v


# ----------------------------------------------------------------------------------------------- validation
@pytest.fixture(scope="module")
def tiny_model():
    return MODEL_FACTORIES["tiny"]()


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"rl_algorithm": "ppo"}, "rl_algorithm must be one of: magrpo, mareinforce, maremax, marloo, maac, iac"),
        ({"num_generations": 1}, "num_generations must be >= 2 for MAGRPO-family MARLHF backends."),
        ({"num_generations": 0, "rl_algorithm": "iac"}, "num_generations must be >= 1."),
        ({"reward_learning_rate": 0}, "reward_learning_rate must be > 0."),
        ({"reward_num_train_epochs": 0}, "reward_num_train_epochs must be >= 1."),
        ({"reward_train_batch_size": 0}, "reward_train_batch_size must be >= 1."),
        ({"reward_max_length": 0}, "reward_max_length must be >= 1 or null."),
        ({"critic_learning_rate": 0}, "critic_learning_rate must be > 0 or null."),
        ({"critic_type": "w", "rl_algorithm": "maac"}, "critic_type must be one of: v, q (got 'w')."),
        ({"value_loss_coef": 0}, "value_loss_coef must be > 0."),
        ({"value_clip_range": 0}, "value_clip_range must be > 0 or null."),
        ({"num_turns": 2}, "MARLHF currently supports num_turns=1 only."),
        ({"joint_mode": "cross"}, "MARLHF reward model currently supports aligned joint_mode only."),
        ({"preference_num_candidates": 1}, "preference_num_candidates must be >= 2."),
        ({"reward_func": None}, "reward_func must be a callable"),
        (
            {"agents": "objects", "reward_model_name": None},
            "reward_model_name must be provided: the agents are model objects without a name",
        ),
        (
            {"agents": "objects", "rl_algorithm": "maac"},
            "critic_model_name must be provided for MARLHF with MAAC/IAC: the agents are model objects without a name",
        ),
        (
            {"agents": "objects", "rl_algorithm": "iac"},
            "critic_model_name must be provided for MARLHF with MAAC/IAC: the agents are model objects without a name",
        ),
    ],
)
def test_invalid_config_fails_before_loading_models(overrides, message, monkeypatch, tiny_model):
    model, tok = tiny_model
    if overrides.get("agents") == "objects":  # built in memory: no name to load a reward model or critic from
        model = copy.deepcopy(model)
        model.config._name_or_path = ""
        overrides = {**overrides, "agents": [model, model], "tokenizers": tok}

    def no_loading(**kwargs):
        raise AssertionError("a model was loaded before validation")

    monkeypatch.setitem(MODEL_FACTORIES, "tiny", no_loading)
    with pytest.raises(AssertionError, match="a model was loaded"):  # control: the patch is effective
        make_marlhf().configure_model()
    with pytest.raises(ValueError, match=re.escape(message)):
        make_marlhf(**overrides)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"reward_model_name": "./no/such/reward_model"}, "reward_model_name"),
        ({"rl_algorithm": "maac", "critic_model_name": "./no/such/critic"}, "critic_model_name"),
    ],
)
def test_a_reward_model_or_critic_that_cannot_be_loaded_is_named_by_its_field(overrides, field, monkeypatch):
    monkeypatch.setitem(MODEL_FACTORIES, "tiny", lambda **_: pytest.fail("a model was loaded before validation"))
    with pytest.raises(FileNotFoundError, match=f"^{field} = '"):
        make_marlhf(**overrides)


def test_an_unreachable_reward_model_hub_id_is_named_by_its_field():
    with pytest.raises(OSError, match="Could not load the reward_model_name model 'no-org/no-such-reward-model'"):
        make_marlhf(reward_model_name="no-org/no-such-reward-model").configure_model()  # models load here


def test_reward_model_defaults_to_the_agents_name_for_lists_and_named_objects(monkeypatch):
    """CoMLRL needs reward_model_name only for model objects without a name: a list of names (factory names or
    hub ids) and objects whose config carries _name_or_path give the reward model's (and critics') backbone."""
    loaded = []
    factory = MODEL_FACTORIES["tiny"]
    monkeypatch.setitem(MODEL_FACTORIES, "tiny", lambda **kw: loaded.append("tiny") or factory(**kw))
    module = make_marlhf(agents=["tiny", "tiny"])
    assert module.reward_model is not None and loaded.count("tiny") == 2  # the agents once, the reward model once
    model, tok = factory()
    model.config._name_or_path = "tiny"  # as from_pretrained("tiny-org/tiny") would record it
    module = make_marlhf("maac", agents=[model, copy.deepcopy(model)], tokenizers=tok)
    assert module.reward_model.backbone is not model and len(module.critics) == 1


def test_model_objects_with_named_reward_and_critic_models(tiny_model):
    model, tok = tiny_model
    module = make_marlhf(
        "iac", agents=[model, model], tokenizers=tok, reward_model_name="tiny", use_separate_critic=False
    )  # the value head sits on the actor: no critic source needed
    assert isinstance(module.objective, ActorCritic) and module.reward_model.backbone is not model
    module = make_marlhf(
        "maac", agents=[model, model], tokenizers=tok, reward_model_name="tiny", critic_model_name="tiny"
    )
    assert isinstance(module.objective, JointCritic) and module.reward_model.backbone is not model


# ----------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("algo", ["magrpo", "maac"])
def test_save_pretrained_writes_agents_and_a_reloadable_reward_model(algo, tmp_path):
    module = make_marlhf(algo)
    fit_marlhf(module, tmp_path)
    out = tmp_path / "export"
    module.save_pretrained(out)
    for name in ("agent_0", "agent_1", "reward_model"):
        assert (out / name / "config.json").is_file(), name
    if algo == "maac":
        assert (out / "critic").is_dir()

    # The exported tokenizer is checked by test_reloaded_tiny_tokenizer_splits_digits_like_the_original (joint
    # texts always hold digits: "Agent 1 prompt:"); here the weights: same ids in, same scores out.
    reloaded = JointRewardModel.from_pretrained(out / "reward_model", tokenizer=module.reward_model.tokenizer).eval()
    assert reloaded.max_length == module.reward_model.max_length
    prompts = [["Write about topic 0.", "Write about topic 1."], ["Close topic 0.", "Close topic 1."]]
    responses = [["the sea", "eerie eel"], ["a cat", "deep green"]]
    module.reward_model.eval()
    with torch.no_grad():
        expected = module.reward_model.score_joint(prompts, responses)
        torch.testing.assert_close(reloaded.score_joint(prompts, responses), expected, atol=1e-5, rtol=0)
        inputs = module.reward_model.tokenize(["Joint multi-agent response", "the sea and the eel"])
        torch.testing.assert_close(reloaded(**inputs), module.reward_model(**inputs), atol=1e-5, rtol=0)
    torch.testing.assert_close(reloaded.reward_head.weight, module.reward_model.reward_head.weight)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "transformers 5 reloads an exported tiny tokenizer as Qwen2Tokenizer (config.json says qwen2), whose "
        "pre-tokenizer splits every digit, unlike the in-memory tiny BPE: 'Agent 1' is 'Ġ1' before export and "
        "'Ġ','1' after, so a reloaded reward model (or agent) scores texts with digits differently"
    ),
)
def test_reloaded_tiny_tokenizer_splits_digits_like_the_original(tmp_path):
    rm = JointRewardModel.from_pretrained("tiny")
    rm.save_pretrained(tmp_path / "rm")
    reloaded = JointRewardModel.from_pretrained(tmp_path / "rm")
    text = joint_texts([["Write about topic 10."], ["Close topic 10."]], [["the sea"], ["a cat"]])[0]
    assert reloaded.tokenizer(text).input_ids == rm.tokenizer(text).input_ids


# ----------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("algo", ["magrpo", "iac"])
def test_resume_in_the_rl_stage_neither_recollects_nor_retrains(algo, tmp_path):
    def run(ckpt_path=None, callbacks=(), name="run"):
        module = make_marlhf(algo)
        counts = {
            "collect_pairs": [],
            **dict(zip(("reward_model_step", "update"), count_updates(module))),
        }
        trainer, data = fit_marlhf(
            module, tmp_path, ckpt_path=ckpt_path, callbacks=callbacks, name=name, collects=counts["collect_pairs"]
        )
        return module, trainer, data, counts

    ckpt_dir = tmp_path / "ckpt"
    full, full_trainer, full_data, counts = run(
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)]
    )
    rm_updates = len(counts["reward_model_step"])
    assert counts["collect_pairs"] and rm_updates and counts["update"]

    def step_of(path):
        return int(re.search(r"step=(\d+)", path.name).group(1))

    rl_ckpts = sorted(ckpt_dir.glob("epoch=1-step=*.ckpt"), key=step_of)
    assert rl_ckpts and step_of(rl_ckpts[0]) > rm_updates  # written after an RL update
    boundary = ckpt_dir / f"epoch=0-step={rm_updates}.ckpt"  # written by the last reward-model update
    assert boundary.is_file()
    for ckpt in (rl_ckpts[0], boundary):
        probe = StageProbe()
        resumed, trainer, data, calls = run(ckpt_path=str(ckpt), callbacks=[probe], name=ckpt.stem)
        assert calls["collect_pairs"] == [] and calls["reward_model_step"] == []
        # a resumed run gets no on_train_epoch_start for its first epoch: the RL stage must be entered anyway
        assert probe.rewards and all(e == 1 and r is resumed.learned_reward for e, r in probe.rewards)
        assert not any(p.requires_grad for p in resumed.reward_model.parameters())
        assert set(calls["update"]) == {1}
        assert trainer.global_step == full_trainer.global_step
        assert resumed.env_step == full.env_step
        assert len(data.pairs) == len(full_data.pairs)  # the pairs travel with the checkpoint
        assert same(params_of(resumed.reward_model), params_of(full.reward_model))
        for a, b in zip(resumed.agents.parameters(), full.agents.parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------- CLI
needs_config = pytest.mark.skipif(not CONFIG.is_file(), reason="configs/marlhf.yaml has not been written yet")


@needs_config
def test_cli_prints_the_marlhf_config(tmp_path, monkeypatch, capsys):
    from comlrl_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIG), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "comlrl_lightning.MARLHF" in printed and "rl_algorithm: magrpo" in printed
    assert "PreferenceDataModule" in printed


@needs_config
def test_cli_fits_the_marlhf_config_with_tiny_models(tmp_path, monkeypatch):
    from comlrl_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            "--config",
            str(CONFIG),
            "--trainer.enable_progress_bar=false",
            "--model.init_args.agents=tiny",
            "--model.init_args.reward_model_name=tiny",
            "--model.init_args.use_chat_template=false",
            "--model.init_args.max_new_tokens=4",
            "--model.init_args.preference_num_candidates=3",
            "--model.init_args.num_generations=2",
            "--model.init_args.eval_interval=2",
            "--model.init_args.eval_num_samples=2",
            "--data.init_args.max_train_items=2",
            "--data.init_args.show_progress=false",
        ]
    )
    metrics = next(tmp_path.glob("outputs/marlhf/*/metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    assert column(rows, "reward_model/loss") and column(rows, "loss") and column(rows, "eval/turn_1/reward_mean")


@pytest.mark.parametrize("algo", ["iac", "maac"])
def test_reference_kl_with_an_actor_critic_backend_fits(algo, tmp_path):
    """MARLHF with reference_kl_enabled and an actor-critic backend: the RL stage scores the samples against the
    frozen reference (it used to crash on the backend's first rollout)."""
    module = make_marlhf(
        algo, reference_kl_enabled=True, reference_kl_coef=0.5, critic_model_name="tiny", eval_interval=0
    )
    trainer, _ = fit_marlhf(module, tmp_path)
    assert trainer.global_step >= 2 and module.last_rollout is not None
    assert module.last_rollout.nodes[0].agents[0].sequence_kl is not None


def test_a_checkpoint_of_the_nested_backend_loads_into_the_one_team():
    """Checkpoints written when MARLHF nested its RL backend as a module (weights under ``rl.agents.*`` and
    ``rl.critics.*``) restore the same team: the weights land on ``agents.*`` and ``critics.*``."""
    saved = make_marlhf("iac", critic_model="tiny")
    saved.configure_model()
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p))
    state = {k: v.clone() for k, v in saved.state_dict().items()}
    nested = {(k if k.startswith("reward_model.") else f"rl.{k}"): v for k, v in state.items()}
    assert any(k.startswith("rl.critics.") for k in nested) and any(k.startswith("rl.agents.") for k in nested)
    checkpoint = {"state_dict": nested, "comlrl_lightning": {}, "global_step": 0}
    restored = make_marlhf("iac", critic_model="tiny")
    restored.configure_model()
    restored.on_load_checkpoint(checkpoint)
    restored.load_state_dict(checkpoint["state_dict"])
    for key, value in restored.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("algo", ["magrpo", "iac"])
def test_a_marlhf_pickles_with_its_backend(algo):
    """A spawned process (``ddp_spawn``) gets the module pickled: the class composed with the backend is not
    importable by name, so it is rebuilt from (MARLHF, backend) on load."""
    import pickle

    module = make_marlhf(algo)
    module.configure_model()  # the team, the critics' part and the reward model, loaded before pickling
    back = pickle.loads(pickle.dumps(module))
    assert type(back) is type(module) and back.rl_backend is module.rl_backend
    assert same(module.agents.parameters(), back.agents.parameters())
    assert same(module.reward_model.parameters(), back.reward_model.parameters())
