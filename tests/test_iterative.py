"""Iterative preference training (MADPOIter, MARLHFIter) on tiny models: config validation, pair construction
against a comparator, comparator sources, round files and metrics, the fresh reward model per round, resume and
empty rounds (docs/iterative.md; docs/algorithms.md example 7)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_magrpo import ITEMS, column, read_metrics

import comlrl_lightning.comparators.sources as sources
from comlrl_lightning import MADPOIter, MARLHFIter, PreferenceDataModule
from comlrl_lightning.agents import load_agents
from comlrl_lightning.agents.factories import MODEL_FACTORIES
from comlrl_lightning.comparators.sources import HistoryComparator, IndependentRNG
from comlrl_lightning.core.pairs import RECORD_KEYS
from comlrl_lightning.envs import toy

BASE = dict(
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
    num_iterations=2,
)
MARLHF_EXTRA = dict(
    rl_epochs_per_round=1,
    num_generations=2,
    reward_train_batch_size=2,
    reward_num_train_epochs=1,
    reward_learning_rate=1e-2,
)


def make_iter(cls=MADPOIter, **overrides):
    kwargs = dict(BASE)
    if cls is MARLHFIter:
        kwargs.pop("train_batch_size")
        kwargs.update(MARLHF_EXTRA)
    kwargs.update(overrides)
    seed_everything(0)
    return cls(**kwargs)


def fit_iter(module, root, items=ITEMS[:3], callbacks=(), ckpt_path=None, name="run", seed=0, spy=None):
    seed_everything(seed)
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer = Trainer(
        logger=CSVLogger(root, name=name),
        enable_checkpointing=checkpointing,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=list(callbacks),
        accelerator="cpu",
        devices=1,
    )
    data = PreferenceDataModule(dataset=items, show_progress=False, prompts_per_step=4)
    if spy is not None:
        spy(data)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, data


def read_json(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def iter_rows(trainer):
    return [r for r in read_metrics(trainer) if r.get("iter/current_iteration")]


# ----------------------------------------------------------------------------------------------- validation
VALIDATION_CASES = [
    ({"num_iterations": 0}, "num_iterations must be >= 1."),
    ({"preference_replay_k": 2}, "preference_replay_k is only valid when preference_replay_mode='nearest_k'."),
    (
        {"preference_replay_lambda": 0.5},
        "preference_replay_lambda is only valid when preference_replay_mode='lambda_decay'.",
    ),
    (
        {"preference_replay_sample_size": 4},
        "preference_replay_sample_size is only valid when preference_replay_mode is 'nearest_k', 'all_history', "
        "or 'lambda_decay'.",
    ),
    (
        {"preference_replay_mode": "nearest_k"},
        "preference_replay_k is required when preference_replay_mode='nearest_k'.",
    ),
    ({"preference_replay_mode": "nearest_k", "preference_replay_k": 0}, "preference_replay_k must be >= 1."),
    (
        {"preference_replay_mode": "all_history", "preference_replay_k": 2},
        "preference_replay_k is only valid when preference_replay_mode='nearest_k'.",
    ),
    (
        {"preference_replay_mode": "lambda_decay"},
        "preference_replay_lambda is required when preference_replay_mode='lambda_decay'.",
    ),
    (
        {"preference_replay_mode": "lambda_decay", "preference_replay_lambda": 1.5},
        "preference_replay_lambda must be in [0, 1].",
    ),
    ({"preference_replay_mode": "newest_first"}, "preference_replay_mode must be one of"),
    ({"comparator_policy": "teacher"}, "comparator_policy must be one of: current, current_copy, model, history, api."),
    ({"comparator_generation_mode": "sequential"}, "comparator_generation_mode must be one of"),
    (
        {"comparator_generation_mode": "centralized", "comparator_centralized_agent_index": -1},
        "comparator_centralized_agent_index must be >= 0.",
    ),
    (
        {"comparator_generation_mode": "centralized", "comparator_centralized_agent_index": 2},
        "comparator_centralized_agent_index must be smaller than num_agents.",
    ),
    ({"comparator_num_candidates": 0}, "comparator_num_candidates must be >= 1 or null."),
    (
        {
            "comparator_policy": "api",
            "comparator_api_url": "http://127.0.0.1:1/v1",
            "comparator_api_max_n_per_request": 0,
        },
        "comparator_api_max_n_per_request must be >= 1 or null.",
    ),
    (
        {"comparator_policy": "model"},
        "comparator_model_name or comparator_agents is required when comparator_policy='model'.",
    ),
    ({"comparator_history_k": 2}, "comparator_history_k is only valid when comparator_policy='history'."),
    (
        {"comparator_policy": "api", "comparator_api_url": "http://127.0.0.1:1/v1", "comparator_history_k": 1},
        "comparator_history_k is only valid when comparator_policy='history'.",
    ),
    ({"comparator_policy": "history", "comparator_history_k": 0}, "comparator_history_k must be >= 1."),
    (
        {"comparator_policy": "history", "comparator_model_name": "tiny"},
        "comparator_model_name and comparator_agents are only valid when comparator_policy='model'.",
    ),
    (
        {"comparator_model_name": "tiny"},
        "comparator_model_name and comparator_agents are only valid when comparator_policy='model'.",
    ),
    ({"comparator_policy": "api"}, "comparator_api_url is required when comparator_policy='api'."),
    ({"comparator_tokenizers": "tiny"}, "comparator_tokenizers is only valid when comparator_policy='model'."),
    (
        {"comparator_policy": "model", "comparator_model_name": "tiny", "comparator_tokenizers": ["tiny"] * 3},
        "comparator_tokenizers must list 1 or num_agents (2) tokenizers (got 3).",
    ),
    ({"pair_selection": "best_of"}, "pair_selection must be one of: .*comparator_reward"),
    (
        {"log_reward_distribution": True, "reward_func": lambda *completions: [0.0] * len(completions[0])},
        "reward_func.reward_range",
    ),
]


@pytest.fixture
def no_model_loads(monkeypatch):
    def must_not_load(**_):
        raise AssertionError("a model was loaded before validation finished")

    monkeypatch.setitem(MODEL_FACTORIES, "tiny", must_not_load)


@pytest.mark.parametrize("cls", [MADPOIter, MARLHFIter], ids=lambda c: c.__name__)
@pytest.mark.parametrize("overrides,message", VALIDATION_CASES, ids=[f"case{i}" for i in range(len(VALIDATION_CASES))])
def test_invalid_iterative_config_fails_before_models_load(cls, overrides, message, no_model_loads):
    pattern = (
        message
        if message.endswith("comparator_reward")
        else message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    )
    with pytest.raises(ValueError, match=pattern):
        make_iter(cls, **overrides)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"comparator_agents": ["tiny", "./no/such/comparator"]},
            "comparator_agents[1] = './no/such/comparator' looks like a local path",
        ),
        (
            {"comparator_model_name": "./no/such/comparator"},
            "comparator_model_name = './no/such/comparator' looks like a local path",
        ),
    ],
)
def test_a_comparator_model_that_cannot_be_loaded_is_named_by_its_field(overrides, message, no_model_loads):
    import re

    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        make_iter(comparator_policy="model", **overrides)


def test_marlhfiter_unknown_scoring_reward(no_model_loads):
    with pytest.raises(ValueError, match=r"preference_scoring_reward must be one of: task, reward_model\."):
        make_iter(MARLHFIter, preference_scoring_reward="critic")


def test_aliases_are_normalised():
    module = make_iter(comparator_policy="self", preference_replay_mode="td-lambda", preference_replay_lambda=0.5)
    assert module.comparator_policy == "current"
    assert module.preference_replay_mode == "lambda_decay"
    assert module.hparams["comparator_policy"] == "current"
    assert module.hparams["preference_replay_mode"] == "lambda_decay"

    module = make_iter(comparator_policy="checkpoint", comparator_generation_mode="single-agent")
    assert module.comparator_policy == "history"
    assert module.comparator_history_k == 1
    assert module.comparator_generation_mode == "centralized"

    module = make_iter(
        MARLHFIter,
        comparator_policy="external",
        comparator_model_name="tiny",
        preference_scoring_reward="learned",
        preference_replay_mode="recent_k",
        preference_replay_k=2,
    )
    assert module.comparator_policy == "model"
    assert module.preference_scoring_reward == "reward_model"
    assert module.preference_replay_mode == "nearest_k"
    assert make_iter(MARLHFIter, preference_scoring_reward="ENV").preference_scoring_reward == "task"


# ----------------------------------------------------------------------------------------------- pair construction
def digit_reward(first, second):
    """Raw team reward: the sum of the last digit of both agents' texts ('a3' + 'p1' -> 4)."""
    return [float(a[-1]) + float(b[-1]) for a, b in zip(first, second)]


def reversed_scale(raw):
    """A processor that reverses the order: the *processed* score must decide (raw 1 beats raw 3)."""
    return 100.0 - 10.0 * raw


def first_formatter(item):
    return "first " + item["prompt"]


def second_formatter(item):
    return "second " + item["prompt"]


class FakeComparator:
    def __init__(self, texts):
        self.texts, self.calls, self.events = texts, [], []

    def start_round(self, iteration):
        self.events.append(("start", iteration))

    def end_round(self):
        self.events.append(("end",))

    def sample(self, roles, prompts, K, items):
        self.calls.append((list(roles), [list(p) for p in prompts], K, list(items)))
        return self.texts


def rounds_of(module, comparator=None):
    """The data module a fit would attach, outside a fit: its round collector is built from the module's plan;
    ``comparator`` stands in for the one it would build."""
    module.configure_model()
    data = PreferenceDataModule(dataset=list(ITEMS), show_progress=False)
    data.attach(module.pairs.plan())
    if comparator is not None:
        data.rounds.comparator = comparator
    return data


def stub_sampling(monkeypatch, module, current_texts):
    calls = []

    def fake_sample(models, tokenizers, prompts, K):
        calls.append(([id(m) for m in models], [list(p) for p in prompts], K))
        return [SimpleNamespace(texts=list(t)) for t in current_texts]

    monkeypatch.setattr(module.pairs.policy.engine, "sample", fake_sample)
    return calls


def test_pairs_from_current_vs_comparator_use_processed_scores_and_keep_raw(monkeypatch):
    module = make_iter(
        reward_func=digit_reward,
        reward_processor=reversed_scale,
        formatters=[first_formatter, second_formatter],
        preference_num_candidates=3,
        comparator_num_candidates=2,
        pair_selection="all",
        preference_pairs_per_sample=None,
    )
    items = ITEMS[:2]
    # [agent][item * K + k]
    current = [["a3", "a1", "a5", "a2", "a4", "a0"], ["p0", "p0", "p0", "p1", "p0", "p0"]]
    comparator = [["a1", "a2", "a1", "a4"], ["q0", "q0", "q1", "q0"]]
    sample_calls = stub_sampling(monkeypatch, module, current)
    data = rounds_of(module, FakeComparator(comparator))
    data.rounds.start_round(0)
    pairs = data.collect_pairs(items)
    data.rounds.end_round()

    assert data.rounds.comparator.events == [("start", 0), ("end",)]
    prompts = [["first topic 0", "first topic 1"], ["second topic 0", "second topic 1"]]
    assert sample_calls == [([id(module.policy_model(0)), id(module.policy_model(1))], prompts, 3)]
    assert data.rounds.comparator.calls == [([0, 1], prompts, 2, items)]

    # raw: current item0 [3, 1, 5], item1 [3, 4, 0]; comparator item0 [1, 2], item1 [2, 4]
    # processed 100 - 10 r: current [70, 90, 50] / [70, 60, 100]; comparator [90, 80] / [80, 60]
    # item0 k0: 70 < 90 comparator wins; k1: 90 > 80 current wins; item1 k0: 70 < 80 comparator wins; k1 tie.
    expected = [
        dict(
            prompts=["first topic 0", "second topic 0"],
            winner_completions=["a1", "q0"],
            loser_completions=["a3", "p0"],
            winner_reward=90.0,
            loser_reward=70.0,
            candidate_reward_mean=76.0,
            raw_rewards=[1.0, 3.0],
            target_raw_reward=3.0,
            comparator_raw_reward=1.0,
        ),
        dict(
            prompts=["first topic 0", "second topic 0"],
            winner_completions=["a1", "p0"],
            loser_completions=["a2", "q0"],
            winner_reward=90.0,
            loser_reward=80.0,
            candidate_reward_mean=76.0,
            raw_rewards=[1.0, 2.0],
            target_raw_reward=1.0,
            comparator_raw_reward=2.0,
        ),
        dict(
            prompts=["first topic 1", "second topic 1"],
            winner_completions=["a1", "q1"],
            loser_completions=["a2", "p1"],
            winner_reward=80.0,
            loser_reward=70.0,
            candidate_reward_mean=74.0,
            raw_rewards=[2.0, 3.0],
            target_raw_reward=3.0,
            comparator_raw_reward=2.0,
        ),
    ]
    assert [p.to_record() for p in pairs] == [{k: e[k] for k in RECORD_KEYS} for e in expected]

    for pair in pairs:
        for i, tokenizer in enumerate(module.tokenizers):
            eos = tokenizer.eos_token_id
            assert pair.prompt_ids[i].tolist() == tokenizer(pair.prompts[i], add_special_tokens=False)["input_ids"]
            for ids, text in (
                (pair.winner_ids[i], pair.winner_completions[i]),
                (pair.loser_ids[i], pair.loser_completions[i]),
            ):
                assert ids.dtype == torch.long and ids[-1].item() == eos
                assert ids[:-1].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "selection,order", [("comparator_reward", [(1, False), (0, True)]), ("reward_gap", [(0, True), (1, False)])]
)
def test_iterative_pair_selection_order(selection, order, monkeypatch):
    """docs/algorithms.md example 7: current [3, 1, 2] vs comparator [1, 2, 2], limit 2."""
    module = make_iter(
        reward_func=digit_reward, preference_num_candidates=3, pair_selection=selection, preference_pairs_per_sample=2
    )
    current = [["a3", "a1", "a2"], ["p0", "p0", "p0"]]
    comparator = [["a1", "a2", "a2"], ["q0", "q0", "q0"]]
    stub_sampling(monkeypatch, module, current)
    data = rounds_of(module, FakeComparator(comparator))
    data.rounds.start_round(0)
    pairs = data.collect_pairs(ITEMS[:1])
    assert data.rounds.comparator.calls[0][2] == 3  # comparator_num_candidates defaults to preference_num_candidates
    got = []
    for pair in pairs:
        current_wins = pair.winner_completions[1] == "p0"
        k = [current[0][j] for j in range(3)].index(
            pair.winner_completions[0] if current_wins else pair.loser_completions[0]
        )
        got.append((k, current_wins))
        assert pair.candidate_reward_mean == pytest.approx(11 / 6)
    assert got == order


# ----------------------------------------------------------------------------------------------- comparator sources
def test_current_comparator_uses_its_own_random_stream():
    module = make_iter(preference_num_candidates=2)
    torch.manual_seed(1234)
    data = rounds_of(module)
    data.rounds.start_round(0)
    comparator, engine = data.rounds.comparator, module.engine
    assert type(comparator).__name__ == "CurrentComparator"
    items = ITEMS[:2]
    prompts = engine.first_prompts(items)
    policies = [module.policy_model(i) for i in range(2)]

    def policy_sample():
        return [c.texts for c in engine.sample(policies, module.tokenizers, prompts, 2)]

    def comparator_sample():
        return comparator.sample([0, 1], prompts, 2, items)

    state = torch.get_rng_state()
    first = comparator_sample()
    assert torch.equal(torch.get_rng_state(), state)  # the global stream is untouched
    policy_a, policy_b = policy_sample(), policy_sample()
    torch.set_rng_state(state)
    assert policy_sample() == policy_a and policy_sample() == policy_b  # sampling is a function of the RNG state
    assert first != policy_a  # not the policy's own samples

    torch.set_rng_state(state)
    assert policy_sample() == policy_a
    comparator_sample()  # in between: the policy's sequence does not notice
    assert policy_sample() == policy_b

    saved = copy.deepcopy(data.comparator_rng.state_dict())
    second, third = comparator_sample(), comparator_sample()
    assert second != first and third != second  # the stream advances
    restored = IndependentRNG(seed=0)
    restored.load_state_dict(saved)
    comparator.rng = restored
    assert comparator_sample() == second and comparator_sample() == third


def test_history_checkpoint_for(tmp_path):
    def comparator(k):
        return HistoryComparator(None, None, tmp_path, k=k, devices=None, roles=[0, 1])

    (tmp_path / "initial").mkdir()
    assert [comparator(1).checkpoint_for(v).name for v in (0, 1, 2)] == ["initial", "initial", "initial"]
    for label in (0, 1, 3):
        (tmp_path / f"iteration_{label:04d}").mkdir()
    one, two = comparator(1), comparator(2)
    assert [one.checkpoint_for(v).name for v in range(7)] == [
        "initial",
        "initial",
        "iteration_0000",
        "iteration_0001",
        "iteration_0001",  # iteration_0002 is missing: the newest earlier one
        "iteration_0003",
        "iteration_0003",
    ]
    assert [two.checkpoint_for(v).name for v in range(6)] == [
        "initial",
        "initial",
        "initial",
        "iteration_0000",
        "iteration_0001",
        "iteration_0001",
    ]


def test_history_missing_agent_dir_is_a_clear_error(tmp_path):
    (tmp_path / "initial" / "agent_0").mkdir(parents=True)
    history = HistoryComparator(None, None, tmp_path, k=1, devices=None, roles=[0, 1])
    with pytest.raises(FileNotFoundError, match="Missing comparator history checkpoint") as info:
        history.start_round(0)
    assert "agent_1" in str(info.value)


def count_loads(monkeypatch):
    calls = []
    original = sources.load_agents

    def counting(agents, *args, **kwargs):
        calls.append(list(agents))
        return original(agents, *args, **kwargs)

    monkeypatch.setattr(sources, "load_agents", counting)
    return calls


def same_weights(model_a, model_b):
    a, b = model_a.state_dict(), model_b.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_history_fit_writes_policy_checkpoints_and_reads_k_rounds_back(tmp_path, monkeypatch):
    module = make_iter(comparator_policy="history", num_iterations=3, preference_num_candidates=2)
    initial = [copy.deepcopy(module.policy_model(i)) for i in range(2)]
    loads = count_loads(monkeypatch)
    trainer, _ = fit_iter(module, tmp_path, items=ITEMS[:2])
    root = Path(trainer.log_dir) / "policy_checkpoints"
    labels = ["initial", "iteration_0000", "iteration_0001", "iteration_0002"]
    assert sorted(p.name for p in root.iterdir()) == labels
    for label in labels:
        assert sorted(p.name for p in (root / label).iterdir() if p.is_dir()) == ["agent_0", "agent_1"]
    # k = 1: rounds 0 and 1 compare against 'initial', round 2 against the policy saved after round 0
    assert loads == [
        [str(root.resolve() / label / f"agent_{i}") for i in range(2)]
        for label in ("initial", "initial", "iteration_0000")
    ]
    saved_initial, _ = load_agents([str(root / "initial" / f"agent_{i}") for i in range(2)])
    saved_last, _ = load_agents([str(root / "iteration_0002" / f"agent_{i}") for i in range(2)])
    for i in range(2):
        assert same_weights(saved_initial[i], initial[i])
        assert same_weights(saved_last[i], module.policy_model(i))
        assert not same_weights(saved_last[i], initial[i])


@pytest.mark.parametrize("cls,expected_loads", [(MADPOIter, 1), (MARLHFIter, 2)], ids=["MADPOIter", "MARLHFIter"])
def test_model_comparator_load_schedule(cls, expected_loads, tmp_path, monkeypatch):
    module = make_iter(cls, comparator_policy="model", comparator_model_name="tiny", preference_num_candidates=2)
    loads = count_loads(monkeypatch)
    trainer, _ = fit_iter(module, tmp_path, items=ITEMS[:2])
    assert loads == [["tiny", "tiny"]] * expected_loads
    assert [r["iter/current_iteration"] for r in iter_rows(trainer)] == ["1.0", "2.0"]


def test_model_comparator_objects_use_the_agents_tokenizers_or_comparator_tokenizers(tmp_path):
    """comparator_agents given as loaded models: their tokenizers are the agents' (CoMLRL) unless
    comparator_tokenizers names others; a round collects and trains with them."""
    model, tok = MODEL_FACTORIES["tiny"](seed=3)
    module = make_iter(
        comparator_policy="model", comparator_agents=[model], preference_num_candidates=2, num_iterations=1
    )
    trainer, data = fit_iter(module, tmp_path / "agents_tokenizers", items=ITEMS[:2])
    assert trainer.global_step >= 1
    assert [data.rounds.comparator.model_for(r)[1] for r in range(2)] == list(module.tokenizers)
    other_tok = MODEL_FACTORIES["tiny"]()[1]
    module = make_iter(
        comparator_policy="model",
        comparator_agents=[model, copy.deepcopy(model)],
        comparator_tokenizers=other_tok,
        preference_num_candidates=2,
        num_iterations=1,
    )
    _, data = fit_iter(module, tmp_path / "own_tokenizers", items=ITEMS[:2])
    assert all(data.rounds.comparator.model_for(r)[1] is other_tok for r in range(2))


# ----------------------------------------------------------------------------------------------- fits
class RewardHeadProbe(Callback):
    """The reward head's weights at the end of every epoch and at the first batch of every epoch."""

    def __init__(self):
        self.epoch_end, self.first_batch = {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.first_batch[trainer.current_epoch] = copy.deepcopy(pl_module.reward_model.reward_head.state_dict())

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_end[trainer.current_epoch] = copy.deepcopy(pl_module.reward_model.reward_head.state_dict())


def heads_equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("cls", [MADPOIter, MARLHFIter], ids=lambda c: c.__name__)
def test_two_rounds_write_shards_distributions_and_metrics(cls, tmp_path):
    extra = dict(preference_scoring_reward="reward_model") if cls is MARLHFIter else {}
    module = make_iter(
        cls, preference_replay_mode="lambda_decay", preference_replay_lambda=0.5, log_reward_distribution=True, **extra
    )
    callbacks = []
    oracle_calls = []
    if cls is MARLHFIter:
        initial_head = copy.deepcopy(module.reward_model.reward_head.state_dict())
        probe = RewardHeadProbe()
        callbacks.append(probe)

    def spy(data):  # which reward scores each collection call (the oracle the policy carries then)
        collect = data.collect_pairs

        def collect_pairs(items):
            oracle_calls.append((module.current_epoch, data.plan.policy.reward is module.learned_reward))
            return collect(items)

        data.collect_pairs = collect_pairs

    trainer, data = fit_iter(module, tmp_path, callbacks=callbacks, spy=spy if cls is MARLHFIter else None)
    log_dir = Path(trainer.log_dir)

    shards = [read_json(log_dir / "preference_replay" / f"iteration_{v:04d}.json") for v in (1, 2)]
    for number, shard in zip((1, 2), shards):
        assert set(shard) == {"iteration", "num_pairs", "pairs"}
        assert shard["iteration"] == number
        assert shard["num_pairs"] == len(shard["pairs"]) > 0
        for record in shard["pairs"]:
            assert list(record) == list(RECORD_KEYS)
            assert len(record["raw_rewards"]) == 2
            assert record["target_raw_reward"] is not None and record["comparator_raw_reward"] is not None
            assert record["winner_reward"] > record["loser_reward"]
            assert sorted(record["raw_rewards"]) == sorted(
                [record["target_raw_reward"], record["comparator_raw_reward"]]
            )
    assert [(s.iteration, s.num_pairs) for s in data.replay.shards] == [
        (1, shards[0]["num_pairs"]),
        (2, shards[1]["num_pairs"]),
    ]

    for number in (1, 2):
        dist = read_json(log_dir / "reward_distributions" / f"iteration_{number:04d}.json")
        assert dist["iteration"] == number and dist["num_bins"] == 16 and len(dist["bin_edges"]) == 17
        assert (dist["reward_min"], dist["reward_max"]) == (0.0, 1.0)
        for part in ("candidate", "selected"):
            for side in ("target", "comparator"):
                assert len(dist[part][side]["counts"]) == 16
        # every current and comparator candidate of the round: 3 items x 4 candidates
        assert dist["candidate"]["target"]["sample_count"] == dist["candidate"]["comparator"]["sample_count"] == 12

    rows = iter_rows(trainer)
    assert [float(r["iter/current_iteration"]) for r in rows] == [1.0, 2.0]
    sizes = [s["num_pairs"] for s in shards]
    assert [float(r["iter/current_preference_pairs"]) for r in rows] == sizes
    assert [float(r["iter/total_preference_pairs"]) for r in rows] == [sizes[0], sizes[0] + sizes[1]]
    # lambda_decay without a sample size draws as many pairs as the round collected
    train_pairs = [float(r["iter/train_preference_pairs"]) for r in rows]
    assert train_pairs == sizes

    if cls is MADPOIter:
        assert trainer.current_epoch == 2
        assert module.env_step == 2 * sum(train_pairs)  # environment_steps_per_pair = 2, one pass per round
        assert column(read_metrics(trainer), "dpo/num_pairs") and sum(
            column(read_metrics(trainer), "dpo/num_pairs")
        ) == sum(train_pairs)
    else:
        assert trainer.current_epoch == 4
        # a fresh reward model each round: trained in round 1, back to the initial weights when round 2 starts
        assert not heads_equal(probe.epoch_end[0], initial_head)
        assert heads_equal(probe.first_batch[0], initial_head)
        assert heads_equal(probe.first_batch[2], initial_head)
        assert not heads_equal(probe.epoch_end[2], initial_head)
        # round 1 is scored by the task reward, round 2 by round 1's reward model
        assert sorted(set(oracle_calls)) == [(0, False), (2, True)]
        assert module.collection_reward() is module.learned_reward


def test_marlhfiter_reward_model_scoring_keeps_raw_scores_unprocessed(tmp_path):
    """With preference_scoring_reward=reward_model, round 2's scores are raw reward-model scores (no processor);
    round 1's are task rewards after reward_processor."""
    module = make_iter(MARLHFIter, reward_processor=offset_processor, preference_scoring_reward="model")
    trainer, _ = fit_iter(module, tmp_path)
    first, second = (read_json(Path(trainer.log_dir) / "preference_replay" / f"iteration_{v:04d}.json") for v in (1, 2))
    for record in first["pairs"]:
        assert record["winner_reward"] == pytest.approx(record["raw_rewards"][0] + 10.0)
        assert record["loser_reward"] == pytest.approx(record["raw_rewards"][1] + 10.0)
        assert 0.0 <= record["raw_rewards"][0] <= 1.0
    assert second["pairs"]
    for record in second["pairs"]:
        assert [record["winner_reward"], record["loser_reward"]] == pytest.approx(record["raw_rewards"])


def offset_processor(raw):
    return raw + 10.0


# ----------------------------------------------------------------------------------------------- resume
def test_resume_after_round_one_continues_exactly(tmp_path):
    def run(root, ckpt_path=None):
        module = make_iter(preference_replay_mode="lambda_decay", preference_replay_lambda=0.5)
        callbacks = [
            ModelCheckpoint(dirpath=root / "ckpt", save_on_train_epoch_end=True, every_n_epochs=1, save_top_k=-1)
        ]
        trainer, data = fit_iter(module, root, callbacks=callbacks, ckpt_path=ckpt_path)
        return trainer, module, data

    full_trainer, full, full_data = run(tmp_path / "full")
    full_shards = copy.deepcopy(full_data.replay.shards)
    full_round_two = read_json(full_shards[1].path)
    ckpt = next((tmp_path / "full" / "ckpt").glob("epoch=0-*.ckpt"))

    trainer, resumed, data = run(tmp_path / "resumed", ckpt_path=str(ckpt))
    assert trainer.current_epoch == full_trainer.current_epoch == 2
    assert trainer.global_step == full_trainer.global_step
    assert resumed.env_step == full.env_step
    assert data.replay.shards == full_shards
    assert read_json(data.replay.shards[1].path) == full_round_two
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------- empty rounds
def constant_reward(first, second):
    return [0.5] * len(first)


@pytest.mark.parametrize(
    "cls,mode,extra",
    [
        (MADPOIter, "current", {}),
        (MADPOIter, "lambda_decay", {"preference_replay_lambda": 0.5}),
        (MARLHFIter, "current", {}),
    ],
    ids=["MADPOIter-current", "MADPOIter-lambda_decay", "MARLHFIter-current"],
)
def test_rounds_without_pairs_still_write_shards_and_finish(cls, mode, extra, tmp_path):
    module = make_iter(cls, reward_func=constant_reward, preference_replay_mode=mode, **extra)
    before = [p.detach().clone() for p in module.agents.parameters()]
    trainer, data = fit_iter(module, tmp_path, items=ITEMS[:2])
    for number in (1, 2):
        shard = read_json(Path(trainer.log_dir) / "preference_replay" / f"iteration_{number:04d}.json")
        assert shard == {"iteration": number, "num_pairs": 0, "pairs": []}
    assert data.replay.shards == []
    # nothing to train on: no update in any epoch of the round (MARLHFIter: no reward model, no RL either)
    assert trainer.current_epoch == 2 * module.epochs_per_iteration
    assert trainer.global_step == 0 and module.env_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.agents.parameters()))
    rows = iter_rows(trainer)
    assert [float(r["iter/current_preference_pairs"]) for r in rows] == [0.0, 0.0]
    assert [float(r["iter/train_preference_pairs"]) for r in rows] == [0.0, 0.0]
    assert [float(r["iter/tie_rate"]) for r in rows] == [1.0, 1.0]


# ----------------------------------------------------------------------------------------------- MARLHFIter resume
@pytest.mark.parametrize("scoring", ["task", "reward_model"])
def test_marlhfiter_resume_at_a_round_boundary_is_exact(scoring, tmp_path):
    """Resume from the checkpoint written when round 1's RL epoch closed (epoch 1) == the uninterrupted run."""

    def run(root, ckpt_path=None):
        module = make_iter(MARLHFIter, preference_scoring_reward=scoring)
        callbacks = [
            ModelCheckpoint(dirpath=root / "ckpt", save_on_train_epoch_end=True, every_n_epochs=1, save_top_k=-1)
        ]
        trainer, data = fit_iter(module, root, callbacks=callbacks, ckpt_path=ckpt_path)
        return trainer, module, data

    full_trainer, full, full_data = run(tmp_path / "full")
    full_round_two = read_json(full_data.replay.shards[-1].path)
    ckpt = next((tmp_path / "full" / "ckpt").glob("epoch=1-*.ckpt"))
    trainer, resumed, data = run(tmp_path / "resumed", ckpt_path=str(ckpt))
    assert trainer.global_step == full_trainer.global_step
    assert read_json(data.replay.shards[-1].path) == full_round_two  # round 2 collected as before
    for a, b in zip(full.parameters(), resumed.parameters()):  # agents and reward model
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------- replay repeats
def test_replay_draws_that_repeat_a_pair_keep_one_token_set_per_agent(tmp_path):
    module = make_iter(
        num_iterations=1,
        preference_replay_mode="all_history",
        preference_replay_sample_size=8,
        formatters=[first_formatter, second_formatter],
    )
    _, data = fit_iter(module, tmp_path, items=ITEMS[:2])
    assert data.replay.shards[0].num_pairs <= 4  # 2 items x 2 pairs: 8 draws must repeat pairs
    assert len(data.pairs) == 8
    for pair in data.pairs:
        assert len(pair.prompt_ids) == len(pair.winner_ids) == len(pair.loser_ids) == 2
        for i, tokenizer in enumerate(module.tokenizers):
            eos = [tokenizer.eos_token_id]
            assert pair.prompt_ids[i].tolist() == tokenizer(pair.prompts[i], add_special_tokens=False)["input_ids"]
            assert (
                pair.winner_ids[i].tolist()
                == tokenizer(pair.winner_completions[i], add_special_tokens=False)["input_ids"] + eos
            )
            assert (
                pair.loser_ids[i].tolist()
                == tokenizer(pair.loser_completions[i], add_special_tokens=False)["input_ids"] + eos
            )


# ----------------------------------------------------------------------------------------------- extras
def test_current_copy_on_other_devices_samples_a_frozen_copy_for_one_round():
    """Devices that differ from the agents' get a frozen copy of the current weights, released after the round."""
    from comlrl_lightning.comparators.sources import CurrentCopyComparator, IndependentRNG

    module = make_iter()
    # torch.device("cpu", 0) != torch.device("cpu"): a stand-in for "another device" on a CPU-only machine.
    module.configure_model()
    comparator = CurrentCopyComparator(module.pairs.policy, IndependentRNG(1), [torch.device("cpu", 0)] * 2)
    comparator.start_round(0)
    copies = [comparator.model_for(i)[0] for i in range(2)]
    for i, copy_ in enumerate(copies):
        assert copy_ is not module.policy_model(i)
        assert not copy_.training and not any(p.requires_grad for p in copy_.parameters())
        assert same_weights(copy_, module.policy_model(i))
    comparator.end_round()
    assert comparator.model_for(0)[0] is module.policy_model(0)  # released: the live agent again
    same_device = CurrentCopyComparator(module.pairs.policy, IndependentRNG(1), [torch.device("cpu")] * 2)
    same_device.start_round(0)
    assert same_device.model_for(1)[0] is module.policy_model(1)


def test_current_copy_shares_one_copy_for_shared_weights():
    from comlrl_lightning.agents.factories import MODEL_FACTORIES
    from comlrl_lightning.comparators.sources import CurrentCopyComparator, IndependentRNG

    model, tokenizer = MODEL_FACTORIES["tiny"]()
    module = make_iter(agents=[model, model], tokenizers=tokenizer)
    comparator = CurrentCopyComparator(module.pairs.policy, IndependentRNG(1), [torch.device("cpu", 0)] * 2)
    comparator.start_round(0)
    assert comparator.model_for(0)[0] is comparator.model_for(1)[0]


def test_reward_distribution_charts_are_files_and_tensorboard_histograms(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    module = make_iter(num_iterations=1, log_reward_distribution=True)
    seed_everything(0)
    trainer = Trainer(
        logger=TensorBoardLogger(tmp_path, name="tb"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, datamodule=PreferenceDataModule(dataset=ITEMS[:2], show_progress=False))
    directory = Path(trainer.log_dir) / "reward_distributions"
    charts = sorted(p.name for p in directory.glob("*.svg"))
    assert charts == [
        f"iteration_0001_{part}_{kind}.svg" for part in ("candidate", "selected") for kind in ("bar", "line")
    ]
    assert 'width="240"' in (directory / "iteration_0001_candidate_line.svg").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trainer.log_dir), size_guidance={"histograms": 0})
    events.Reload()
    assert {"iter/reward_distribution/target", "iter/reward_distribution/comparator"} <= set(
        events.Tags()["histograms"]
    )
    target = events.Histograms("iter/reward_distribution/target")[0]
    assert target.step == 1 and target.histogram_value.num == 2 * 4  # 2 items x K_c = 4 current candidates


def test_centralized_comparator_generation_splits_joint_answers(monkeypatch):
    """One comparator answer per candidate, written for every role, split by the adapter; unparsable answers
    become empty roles and are counted."""
    module = make_iter(
        comparator_generation_mode="centralized", comparator_centralized_agent_index=1, preference_num_candidates=2
    )
    data = rounds_of(module, FakeComparator([["<agent_0>a0</agent_0><agent_1>b0</agent_1>", "no tags at all"]]))
    stub_sampling(monkeypatch, module, [["x", "y"], ["x", "y"]])
    data.rounds.start_round(0)
    texts = data.rounds.comparator_candidates(ITEMS[:1], module.engine.first_prompts(ITEMS[:1]), 2)
    roles, prompts, K, _ = data.rounds.comparator.calls[0]
    assert roles == [1] and K == 2  # the centralized agent's model answers the joint prompt
    assert "Agent 0 original prompt" in prompts[0][0] and "<agent_1>" in prompts[0][0]
    assert texts == [["a0", ""], ["b0", ""]]
    assert data.rounds.parse_failures == 1


def test_each_pair_pass_is_a_permutation_of_its_own():
    """dpo_epochs_per_round / reward_num_train_epochs passes in one epoch: every pass visits each pair once, in a
    fresh order (not the passes' copies shuffled together, where a pair could sit twice in one batch)."""
    from comlrl_lightning.data.tasks import EpochSampler

    sampler = EpochSampler(6, shuffle=True, seed=3, passes=3)
    order = list(sampler)
    assert len(sampler) == len(order) == 18
    passes = [order[i : i + 6] for i in range(0, 18, 6)]
    assert all(sorted(p) == list(range(6)) for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # each pass has its own order
    sampler.set_epoch(1)
    assert list(sampler) != order  # and the next epoch another one
    assert list(EpochSampler(4, shuffle=False, seed=0, passes=2)) == [0, 1, 2, 3, 0, 1, 2, 3]
    resumed = EpochSampler(6, shuffle=True, seed=3, skip=8, passes=3)
    assert list(resumed) == order[8:]  # mid-epoch resume skips across pass boundaries


def test_mp_margins_are_gathered_on_the_module_device(tmp_path, monkeypatch):
    """MADPOIter's update with parallel_training: mp, agent 1's margins on a simulated second device."""
    from standin_device import on_second_device

    margins = MADPOIter.agent_margins  # MADPO's
    monkeypatch.setattr(
        MADPOIter,
        "agent_margins",
        lambda self, i, pairs: on_second_device(margins(self, i, pairs)) if i else margins(self, i, pairs),
    )
    module = make_iter(num_iterations=1, parallel_training="mp", agent_devices=["cpu", "cpu"])
    trainer, _ = fit_iter(module, tmp_path)
    assert trainer.global_step >= 1


@pytest.mark.parametrize("cls", [MADPOIter, MARLHFIter])
def test_the_rounds_folders_travel_in_the_checkpoint(cls, tmp_path):
    """An iterative module's checkpoint holds its rounds' folders (where a resumed run keeps writing policy
    checkpoints), beside the run state — MARLHFIter's also the RL stage's buffer and its reward model's round."""
    module = make_iter(cls)
    module.rounds.run_dirs.load_state_dict({"policy_checkpoints": str(tmp_path / "policy")})
    checkpoint: dict = {"global_step": 3}
    module.on_save_checkpoint(checkpoint)
    state = checkpoint["comlrl_lightning"]
    assert state["iterative"] == {"run_dirs": {"policy_checkpoints": str(tmp_path / "policy")}}
    assert {"env_step", "rng", "user_state"} <= set(state)
    if cls is MARLHFIter:
        assert "buffer" in state and state["reward_model_round"] == -1
    restored = make_iter(cls)
    restored.on_load_checkpoint(checkpoint)
    assert restored.rounds.run_dirs.state_dict() == {"policy_checkpoints": str(tmp_path / "policy")}
    assert restored.run_state.updates_done == 3
