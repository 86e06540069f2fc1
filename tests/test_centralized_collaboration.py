"""Centralized collaboration end to end on tiny models (docs/iterative.md#centralized-collaboration): ONE actor
writes a joint answer for ``num_agents`` roles; the module holds one agent whose prompt is the adapter's joint
prompt and whose reward splits the joint completion and calls the user's N-role reward.

Random tiny models never write ``<agent_i>`` tags, so most tests use :class:`HalfAdapter`, which splits a joint
completion into N contiguous pieces: the user's per-role reward then varies across samples. The adapter's own unit
tests live in ``test_centralized.py``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from comlrl_lightning import (
    MADPO,
    MAGRPO,
    MARLHF,
    CentralizedMAGRPO,
    MADPOIter,
    MARLHFIter,
    PreferenceDataModule,
    TaskDataModule,
)
from comlrl_lightning.agents import RewardModelReward
from comlrl_lightning.agents.factories import TOKENIZER_FACTORIES
from comlrl_lightning.envs import toy
from comlrl_lightning.rollout.centralized import CentralizedCollaboration, TaggedCentralizedAdapter

ITEMS = [{"prompt": "cats"}, {"prompt": "rain"}]
ROLE_FORMATTERS = [lambda item: "left " + item["prompt"], lambda item: "right " + item["prompt"]]


class HalfAdapter:
    """Joint prompt ``joint <role prompts joined by ' | '>``; a joint completion is cut into N contiguous pieces
    whose concatenation is the completion (so the split never fails and always carries text)."""

    def build_prompt(self, item, prompts):
        return "joint " + " | ".join(prompts)

    def parse_completion(self, text, item, num_agents):
        size = -(-len(text) // num_agents)  # ceil
        return [text[i * size : (i + 1) * size] for i in range(num_agents)]


def joint(item):
    return HalfAdapter().build_prompt(item, [f(item) for f in ROLE_FORMATTERS])


def halves(text):
    return HalfAdapter().parse_completion(text, ITEMS[0], 2)


def record_sampling(engine):
    """Record the prompts of every ``engine.sample`` call ([model][prompt])."""
    prompts_seen = []
    original = engine.sample

    def sample(models, tokenizers, prompts, K):
        prompts_seen.append([list(p) for p in prompts])
        return original(models, tokenizers, prompts, K)

    engine.sample = sample
    return prompts_seen


def recording_reward(calls):
    """``toy.letter_reward`` (per-role text scores) that records the role lists it was called with."""

    def reward(*agent_completions, batch_items=None):
        calls.append([list(c) for c in agent_completions])
        return toy.letter_reward(*agent_completions)

    reward.reward_range = toy.letter_reward.reward_range
    return reward


COMMON = dict(
    agents="tiny",
    num_agents=2,
    reward_func=toy.letter_reward,
    max_new_tokens=8,
    temperature=1.0,
    top_p=1.0,
    top_k=None,
    agent_learning_rate=1e-3,
    weight_decay=0.0,
    eval_interval=0,
    log_completions=False,
)
CENTRAL = dict(collaboration_mode="centralized", centralized_adapter=HalfAdapter(), formatters=ROLE_FORMATTERS)
PREFERENCE = dict(preference_num_candidates=2, preference_pairs_per_sample=2)
MARLHF_FIELDS = dict(
    reward_model_name="tiny",
    reward_learning_rate=1e-3,
    reward_train_batch_size=2,
    num_generations=2,
    rollout_buffer_size=1,
)


def build(cls, **overrides):
    kwargs = dict(COMMON)
    if cls in (MADPO, MADPOIter):
        kwargs.update(PREFERENCE, train_batch_size=2)
    if cls in (MARLHF, MARLHFIter):
        kwargs.update(PREFERENCE, **MARLHF_FIELDS)
    if cls in (MAGRPO, CentralizedMAGRPO):
        kwargs.update(num_generations=2, rollout_buffer_size=1)
    kwargs.update(overrides)
    seed_everything(0)
    return cls(**kwargs)


def trainer_for(tmp_path, max_epochs=1, callbacks=()):
    return Trainer(
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
    )


def params_of(module):
    return [p.detach().clone() for p in module.agents.parameters()]


def changed(before, module):
    return any(not torch.equal(a, b) for a, b in zip(before, module.agents.parameters()))


# ----------------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("cls", [MAGRPO, MADPO, MARLHF, MADPOIter, MARLHFIter])
def test_decentralized_by_default_and_centralized_on_request(cls):
    plain = build(cls)
    assert plain.collaboration is None
    assert plain.num_agents == 2 and len(plain.agents) == 2

    central = build(cls, collaboration_mode="centralized")
    assert central.num_agents == 1 and len(central.agents) == 1 and len(central.tokenizers) == 1
    assert isinstance(central.collaboration, CentralizedCollaboration)
    assert central.collaboration.num_roles == 2
    assert isinstance(central.collaboration.adapter, TaggedCentralizedAdapter)  # the default adapter
    if cls in (MADPOIter, MARLHFIter):
        assert plain.comparator_generation_mode == "decentralized"
        assert central.comparator_generation_mode == "centralized"  # forced: the comparator keeps joint text


@pytest.mark.parametrize("cls", [MAGRPO, MADPO, MARLHF, MADPOIter, MARLHFIter])
def test_misspelled_collaboration_mode_is_rejected(cls):
    with pytest.raises(ValueError, match="collaboration_mode"):
        build(cls, collaboration_mode="centralised_typo")


def test_centralized_requires_one_actor_and_one_tokenizer():
    tokenizer = TOKENIZER_FACTORIES["tiny"]()
    for cls in (MAGRPO, MADPO, MARLHF):
        with pytest.raises(ValueError, match="exactly one actor"):
            build(cls, collaboration_mode="centralized", agents=["tiny", "tiny"])
        with pytest.raises(ValueError, match="one actor tokenizer"):
            build(cls, collaboration_mode="centralized", tokenizers=[tokenizer, tokenizer])
    one = build(MAGRPO, collaboration_mode="centralized", agents=["tiny"], tokenizers=[tokenizer])
    assert one.num_agents == 1 and one.collaboration.num_roles == 2


@pytest.mark.parametrize("cls", [MADPOIter, MARLHFIter])
def test_iterative_centralized_comparator_uses_actor_index_zero(cls):
    with pytest.raises(ValueError, match="actor index 0"):
        build(cls, collaboration_mode="centralized", comparator_centralized_agent_index=1)
    module = build(
        cls,
        collaboration_mode="centralized",
        comparator_centralized_agent_index=0,
        comparator_generation_mode="decentralized",
    )
    assert module.comparator_generation_mode == "centralized"
    assert module.comparator_centralized_agent_index == 0


def test_centralized_magrpo_rules():
    module = build(CentralizedMAGRPO)
    assert module.num_agents == 1 and module.collaboration.num_roles == 2
    assert module.algorithm_name == "CentralizedMAGRPO"
    with pytest.raises(ValueError, match="num_turns=1"):
        build(CentralizedMAGRPO, num_turns=2, external_transition=toy.revise_transition)
    with pytest.raises(ValueError, match="num_turns=1"):
        build(MAGRPO, collaboration_mode="centralized", num_turns=2, external_transition=toy.revise_transition)
    with pytest.raises(ValueError, match="centralized"):
        build(CentralizedMAGRPO, collaboration_mode="decentralized")
    for backend in ("iac", "maac"):  # a documented limit (docs/differences.md), said in the error
        with pytest.raises(
            ValueError,
            match=f"rl_algorithm='{backend}' with collaboration_mode='centralized' is "
            "not supported.*docs/differences.md",
        ):
            build(MARLHF, collaboration_mode="centralized", rl_algorithm=backend)


# ----------------------------------------------------------------------------------------------- joint prompt
def test_the_actor_reads_the_adapters_joint_prompt():
    item = ITEMS[0]
    for cls in (MAGRPO, MADPO, MARLHF):
        module = build(cls, **CENTRAL)
        engines = [module.engine, module.pairs.policy.engine] if cls in (MADPO, MARLHF) else [module.engine]
        for engine in engines:
            assert len(engine.formatters) == 1
            assert engine.formatters[0](item) == "joint left cats | right cats" == joint(item)
            assert engine.first_prompts([item]) == [[joint(item)]]

    tagged = build(MAGRPO, collaboration_mode="centralized", formatters=ROLE_FORMATTERS)
    prompt = tagged.engine.formatters[0](item)
    assert prompt == TaggedCentralizedAdapter().build_prompt(item, ["left cats", "right cats"])
    assert "Agent 0 original prompt:\nleft cats" in prompt and "Agent 1 original prompt:\nright cats" in prompt
    assert "<agent_1>" in prompt


# ----------------------------------------------------------------------------------------------- CentralizedMAGRPO
def test_centralized_magrpo_fit_trains_one_actor_with_one_reference(tmp_path):
    calls = []
    reward = recording_reward(calls)
    module = build(
        CentralizedMAGRPO,
        reward_func=reward,
        centralized_adapter=HalfAdapter(),
        formatters=ROLE_FORMATTERS,
        reference_kl_enabled=True,
        reference_kl_coef=0.1,
    )
    assert module.engine.reward.reward_func.reward_range == toy.letter_reward.reward_range
    generated = record_sampling(module.engine)
    before = params_of(module)
    trainer = trainer_for(tmp_path)
    seed_everything(0)
    trainer.fit(module, datamodule=TaskDataModule(dataset=ITEMS[:1], prompts_per_step=1))

    assert trainer.global_step == 1
    assert module.env_step == 2  # 1 item x 2 joint generations x 1 epoch
    assert generated == [[[joint(ITEMS[0])]]]  # one actor, the joint prompt only
    assert module.reference is not None and len(module.reference.models) == 1
    assert len(module.configure_optimizers().param_groups) == 1

    # the user's 2-role reward got the two halves of each joint completion
    joint_texts = module.last_rollout.nodes[0].agents[0].texts
    assert len(joint_texts) == 2 and len(calls) == 1 and len(calls[0]) == 2
    assert [a + b for a, b in zip(*calls[0])] == joint_texts
    rewards = module.last_rollout.nodes[0].rewards.tolist()
    assert rewards == pytest.approx(toy.letter_reward(*calls[0]))
    assert rewards[0] != rewards[1]  # the group has a signal, so the update must move the actor
    assert changed(before, module)


# ----------------------------------------------------------------------------------------------- evaluation
def test_evaluation_hands_the_user_logger_the_split_roles(tmp_path):
    logged = {}

    def eval_logger(agent_completions_turns, batch_items, prompts):
        logged["roles"], logged["items"], logged["prompts"] = agent_completions_turns, batch_items, prompts
        return [{"len0": len(turns[0])} for turns in agent_completions_turns[0]]

    def eval_aggregator(metrics, num_turns):
        return {"turn_1/role0_len": sum(m["len0"] for m in metrics) / len(metrics)}

    module = build(
        CentralizedMAGRPO,
        eval_logger=eval_logger,
        eval_aggregator=eval_aggregator,
        **{k: v for k, v in CENTRAL.items() if k != "collaboration_mode"},
    )
    records = []
    original = module.evaluation.record

    def evaluation_record(items):
        records.append(original(items))
        return records[-1]

    module.evaluation.record = evaluation_record
    seed_everything(0)
    metrics = module.evaluation.evaluate(ITEMS, batch_size=1)

    roles = logged["roles"]
    assert len(roles) == 2  # one list per role, not the one actor's list
    for role in roles:
        assert len(role) == len(ITEMS) and all(len(turns) == 1 and isinstance(turns[0], str) for turns in role)
    joint_texts = [text for r in records for turns in r["completions"][0] for text in turns]
    assert len(records) == 2 and len(joint_texts) == 2
    assert [roles[0][b][0] + roles[1][b][0] for b in range(len(ITEMS))] == joint_texts
    assert logged["items"] == ITEMS
    # each item's own `prompt` field (CoMLRL's eval_logger contract), not a formatted or joint prompt
    assert logged["prompts"] == [it.get("prompt") for it in ITEMS]

    expected = toy.letter_reward([r[0] for r in roles[0]], [r[0] for r in roles[1]])
    assert metrics["eval/turn_1/reward_mean"] == pytest.approx(sum(expected) / len(expected))
    assert metrics["eval/turn_1/role0_len"] == pytest.approx(sum(len(r[0]) for r in roles[0]) / len(ITEMS))

    # the Lightning validation loop reduces its batches the same way
    records.clear()
    trainer = Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
    )
    seed_everything(1)
    (result,) = trainer.validate(
        module, datamodule=TaskDataModule(dataset=ITEMS, eval_dataset=ITEMS, eval_batch_size=2)
    )
    roles = logged["roles"]
    joint_texts = [text for r in records for turns in r["completions"][0] for text in turns]
    assert len(roles) == 2 and len(joint_texts) == 2
    assert [roles[0][b][0] + roles[1][b][0] for b in range(len(ITEMS))] == joint_texts
    expected = toy.letter_reward([r[0] for r in roles[0]], [r[0] for r in roles[1]])
    assert result["eval/turn_1/reward_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)
    assert result["eval/turn_1/role0_len"] == pytest.approx(sum(len(r[0]) for r in roles[0]) / len(ITEMS))
    from comlrl_lightning.callbacks.evaluation import EvaluationRows

    (rows,) = [c for c in trainer.callbacks if isinstance(c, EvaluationRows)]
    assert rows.records == []  # the epoch's records are not kept


# ----------------------------------------------------------------------------------------------- MADPO
def test_madpo_centralized_trains_one_actor_on_joint_pairs(tmp_path):
    module = build(MADPO, **CENTRAL)
    sampled = record_sampling(module.pairs.policy.engine)
    before = params_of(module)
    trainer = trainer_for(tmp_path)
    seed_everything(0)
    data = PreferenceDataModule(dataset=ITEMS[:1], prompts_per_step=1, show_progress=False)
    trainer.fit(module, datamodule=data)

    assert sampled == [[[joint(ITEMS[0])]]]
    assert len(module.configure_optimizers().param_groups) == 1
    assert data.pairs and all(p.prompts == [joint(ITEMS[0])] and len(p.winner_ids) == 1 for p in data.pairs)
    assert module.env_step == 2 * len(data.pairs) == 2  # K_c=2 candidates: one non-tied pair
    assert changed(before, module)


# ----------------------------------------------------------------------------------------------- MADPOIter
def read_shards(directory):
    return [json.loads(path.read_text()) for path in sorted(directory.glob("iteration_*.json"))]


@pytest.mark.parametrize("comparator", ["current", "history"])
def test_madpo_iter_centralized_trains_one_actor_on_joint_pairs(comparator, tmp_path):
    module = build(
        MADPOIter,
        num_iterations=2,
        comparator_policy=comparator,
        preference_replay_dir=str(tmp_path / "replay"),
        policy_checkpoint_dir=str(tmp_path / "policies"),
        **CENTRAL,
    )
    assert module.num_agents == 1 and module.comparator_generation_mode == "centralized"
    sampled = record_sampling(module.pairs.policy.engine)  # the current side and the comparator sample here
    before = params_of(module)
    trainer = trainer_for(tmp_path)
    seed_everything(0)
    data = PreferenceDataModule(dataset=ITEMS[:1], prompts_per_step=1, show_progress=False)
    trainer.fit(module, datamodule=data)

    assert len(sampled) == 4  # 2 rounds x (current + comparator), each one actor answering the joint prompt
    assert all(prompts == [[joint(ITEMS[0])]] for prompts in sampled)
    shards = read_shards(tmp_path / "replay")
    assert [s["iteration"] for s in shards] == [1, 2]
    pairs = [p for s in shards for p in s["pairs"]]
    assert pairs, "no non-tied pair in two rounds: the test needs a different seed"
    for pair in pairs:  # one actor: one-element lists holding the joint prompt and the joint texts
        assert pair["prompts"] == [joint(ITEMS[0])]
        assert len(pair["winner_completions"]) == 1 and len(pair["loser_completions"]) == 1
        # raw joint text is stored; the oracle scored its split roles with the user's reward
        for text, raw in zip([pair["winner_completions"][0], pair["loser_completions"][0]], pair["raw_rewards"]):
            assert raw == pytest.approx(toy.letter_reward(*[[r] for r in halves(text)])[0])
    assert module.env_step == 2 * len(pairs)  # environment_steps_per_pair x pairs trained (replay: current)
    assert changed(before, module)

    policies = tmp_path / "policies"
    for label in ("initial", "iteration_0000", "iteration_0001"):
        assert (policies / label / "agent_0").is_dir(), label
        assert not (policies / label / "agent_1").exists(), label
    if comparator == "history":
        assert data.rounds.comparator.checkpoint.resolve() == (policies / "initial").resolve()
        assert data.rounds.comparator.roles == [0]


# ----------------------------------------------------------------------------------------------- MARLHFIter
def test_marlhf_iter_centralized_reward_model_reads_joint_text(tmp_path):
    logged = {}

    def eval_logger(agent_completions_turns):
        logged["roles"] = agent_completions_turns
        return [{} for _ in agent_completions_turns[0]]

    def eval_aggregator(metrics):
        return {}

    module = build(
        MARLHFIter,
        num_iterations=2,
        rl_epochs_per_round=1,
        reward_num_train_epochs=1,
        preference_replay_dir=str(tmp_path / "replay"),
        eval_logger=eval_logger,
        eval_aggregator=eval_aggregator,
        **CENTRAL,
    )
    assert module.num_agents == 1
    learned = module.learned_reward.reward_func
    assert isinstance(learned, RewardModelReward)
    assert [f(ITEMS[0]) for f in learned.formatters] == [joint(ITEMS[0])]  # the reward model's prompt is joint

    scored = []
    original = module.reward_model.score_joint

    def score_joint(prompts_per_agent, responses_per_agent, *args, **kwargs):
        if module.in_reward_model_stage:
            scored.append(([list(p) for p in prompts_per_agent], [list(r) for r in responses_per_agent]))
        return original(prompts_per_agent, responses_per_agent, *args, **kwargs)

    module.reward_model.score_joint = score_joint
    resets = []
    original_reset = module.reset_reward_model

    def reset_reward_model():
        resets.append(module.current_epoch)
        original_reset()

    module.reset_reward_model = reset_reward_model
    head = {k: v.clone() for k, v in module.reward_model.reward_head.state_dict().items()}
    before = params_of(module)
    trainer = trainer_for(tmp_path)
    seed_everything(0)
    trainer.fit(module, datamodule=PreferenceDataModule(dataset=ITEMS[:1], prompts_per_step=1, show_progress=False))

    assert trainer.current_epoch == 4  # 2 rounds x (reward-model epoch + 1 RL epoch)
    assert resets == [0, 2]  # a fresh reward model per round
    assert len(trainer.optimizers) == 1 and len(trainer.optimizers[0].param_groups) == 2  # one actor + the RM
    assert any(not torch.equal(v, module.reward_model.reward_head.state_dict()[k]) for k, v in head.items())
    assert scored, "the reward model never trained: no non-tied pair in two rounds"
    for prompts, responses in scored:
        assert len(prompts) == 1 and len(responses) == 1  # one joint "agent"
        assert all(p == joint(ITEMS[0]) for p in prompts[0])
    assert module.env_step == 2 * 2  # RL epochs: 1 item x 2 generations, two rounds
    assert changed(before, module)
    assert module.rollout_reward() is module.learned_reward  # the RL stage rewards with the reward model

    seed_everything(0)
    metrics = module.evaluation.evaluate(ITEMS[:1])
    roles = logged["roles"]
    assert len(roles) == 2
    task = toy.letter_reward([roles[0][0][0]], [roles[1][0][0]])[0]
    assert metrics["eval/turn_1/reward_mean"] == pytest.approx(task)  # the task reward, not the reward model
    assert module.rollout_reward() is module.learned_reward  # unchanged by evaluation


# ----------------------------------------------------------------------------------------------- parse failures
def test_untagged_joint_completions_score_as_empty_roles():
    calls = []
    module = build(MAGRPO, collaboration_mode="centralized", reward_func=recording_reward(calls))
    collaboration = module.collaboration
    assert collaboration.parse_failures == 0

    out = module.engine.reward([["plain prose, no sections"]], batch_items=ITEMS[:1])
    assert out == toy.letter_reward([""], [""]) == [0.0]
    assert calls[-1] == [[""], [""]]
    assert collaboration.parse_failures == 1

    tagged = "<agent_0>eee</agent_0><agent_1>xyz</agent_1>"
    assert module.engine.reward([[tagged, "garbage"]], batch_items=ITEMS[:1]) == pytest.approx([0.5, 0.0])
    assert calls[-1] == [["eee", ""], ["xyz", ""]]
    assert collaboration.parse_failures == 2

    # a random tiny model never writes the tags: every sampled joint answer is a parse failure
    seed_everything(0)
    rollout = module.collect_rollout(ITEMS[:1])
    assert collaboration.parse_failures == 2 + 2
    assert rollout.nodes[0].rewards.tolist() == [0.0, 0.0]
    assert calls[-1] == [["", ""], ["", ""]]


def test_parse_failure_rate_is_logged(tmp_path):
    """Tiny models never write the tags: every joint answer of the step fails to parse (rate 1.0); with an
    adapter that always parses, the rate is 0."""

    def rates(module, name):
        trainer = Trainer(
            max_epochs=1,
            logger=CSVLogger(tmp_path, name=name),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=1,
            accelerator="cpu",
            devices=1,
        )
        trainer.fit(module, datamodule=TaskDataModule(dataset=ITEMS[:2], prompts_per_step=1))
        with open(Path(trainer.log_dir) / "metrics.csv") as handle:
            return [
                float(r["collaboration/parse_failure_rate"])
                for r in csv.DictReader(handle)
                if r.get("collaboration/parse_failure_rate")
            ]

    assert rates(build(CentralizedMAGRPO, eval_interval=0), "tagged") == [1.0, 1.0]
    assert rates(build(CentralizedMAGRPO, eval_interval=0, centralized_adapter=HalfAdapter()), "half") == [0.0, 0.0]


@pytest.mark.parametrize("name", ["CentralizedMAGRPO", "MADPO", "MARLHF", "MADPOIter", "MARLHFIter"])
def test_a_centralized_teams_saved_hyper_parameters_rebuild_its_roles(name):
    """As CoMLRL: a centralized team saves its number of roles as num_agents (one actor model), so a module rebuilt
    from its saved hyper-parameters has the same roles."""
    import comlrl_lightning as cl
    from comlrl_lightning.envs.toy import story_reward

    module_class = getattr(cl, name)
    module = module_class(agents="tiny", reward_func=story_reward, num_agents=2, collaboration_mode="centralized")
    assert module.num_agents == 1 and module.hparams["num_agents"] == 2
    saved = {key: value for key, value in module.hparams.items() if key != "reward_func"}  # an import path
    rebuilt = module_class(**saved, reward_func=story_reward)
    assert rebuilt.collaboration.num_roles == 2 and rebuilt.num_agents == 1
