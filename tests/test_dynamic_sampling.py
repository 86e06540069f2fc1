"""Dynamic sampling (issue 43): the tie predicate (core/filtering.py), the refill of a RolloutBatch through a stub
policy (data/dynamic_sampling.py), the extra-item stream's resume, the fields, and a tiny fit that resumes exactly."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from comlrl_lightning.algorithms.fields import DynamicSamplingFields, described
from comlrl_lightning.algorithms.on_policy import OnPolicyModule
from comlrl_lightning.core.advantages import compute_advantages, cross_credit
from comlrl_lightning.core.filtering import all_groups_tie, group_ties, tied_share
from comlrl_lightning.data.dynamic_sampling import DynamicSampling, ExtraItems, node_ties
from comlrl_lightning.data.tasks import RolloutBatch, TaskDataModule
from comlrl_lightning.rollout.tree import AgentSamples, Node, Rollout


# ----------------------------------------------------------------------------------------------- the tie predicate
@pytest.mark.parametrize(
    "values, ties",
    [
        ([1.0, 1.0, 1.0], True),
        ([1.0, 1.0, 2.0], False),
        ([0.0, 1e-7], True),  # spread 1e-7 <= 1e-6 * max(1, 1e-7) = 1e-6
        ([0.0, 2e-6], False),  # 2e-6 > 1e-6
        ([-3.0, -3.0], True),
        ([1000.0, 1000.0005], True),  # spread 5e-4 <= 1e-6 * 1000.0005 ~ 1.0e-3: relative above 1
        ([1000.0, 1000.002], False),  # 2e-3 > 1.000002e-3
        ([5.0], True),  # one value: the mean baseline gives it 0
        ([], True),
        ([float("nan"), float("nan")], False),  # never tie: the update reports non-finite values
        ([float("inf"), float("inf")], False),
    ],
)
def test_group_ties_hand_derived(values, ties):
    assert bool(group_ties(torch.tensor(values, dtype=torch.float64))) is ties


def test_group_ties_batches_groups_over_the_last_dimension():
    values = torch.tensor([[[0.5, 0.5], [0.0, 1.0]], [[2.0, 2.0], [3.0, 3.0]]])  # [2, 2, K=2]
    assert group_ties(values).tolist() == [[True, False], [True, True]]
    with pytest.raises(ValueError, match="tolerance"):
        group_ties(values, tolerance=-1.0)


def test_float32_rounding_of_equal_returns_ties():
    # The same three rewards summed in three orders: equal in exact arithmetic, float32 values ~1e-7 apart.
    r = torch.tensor([0.3, 0.7, 0.9], dtype=torch.float32)
    g = torch.stack([r[list(order)].sum() for order in ((0, 1, 2), (2, 1, 0), (1, 2, 0))])
    assert len(set(g.tolist())) > 1
    assert group_ties(g)
    assert compute_advantages(g).abs().max() > 0.05  # normalised, rounding noise would be a random push


def test_a_node_ties_when_every_agents_group_ties():
    # Agents' groups tie separately (1,1 and 0,0): every advantage is 0 although the agents' credits differ.
    assert all_groups_tie(torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert not all_groups_tie(torch.tensor([[1.0, 1.0], [0.0, 1.0]]))  # agent 1 still learns
    # Reward components: the sums tie, the components do not (normalised apart they rank the group).
    credit = torch.tensor([[1.0, 1.0]])
    trade = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # [N=1, K=2, C=2]
    assert not all_groups_tie(credit, trade)
    assert all_groups_tie(credit, torch.tensor([[[0.5, 0.5], [0.5, 0.5]]]))
    assert tied_share([True, False, True, True]) == 0.75 and tied_share([]) == 0.0


def test_cross_mode_credits_can_tie_when_returns_do_not():
    # N=2, K=2, joint actions (0,0),(0,1),(1,0),(1,1) with returns 1,0,0,1. Agent 0's sample 0 is in (0,0),(0,1):
    # credit 1+0 = 1; sample 1 in (1,0),(1,1): 0+1 = 1. Agent 1's sample 0 in (0,0),(1,0): 1; sample 1: 0+1 = 1.
    returns = torch.tensor([1.0, 0.0, 0.0, 1.0])
    credit = cross_credit(returns, 2, 2)
    assert credit.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert not group_ties(returns) and all_groups_tie(credit)


# ----------------------------------------------------------------------------------------------- a stub policy
def make_node(item, turn=0, returns=None, item_index=0, N=2, K=2):
    returns = torch.tensor(item["returns"] if returns is None else returns, dtype=torch.float32)
    agents = [
        AgentSamples(
            prompt=item["prompt"],
            prompt_ids=torch.tensor([1, 2]),
            completion_ids=torch.ones(K, 3, dtype=torch.long),
            completion_mask=torch.ones(K, 3, dtype=torch.bool),
            texts=["x"] * K,
            credit=returns.clone(),
        )
        for _ in range(N)
    ]
    joint = torch.arange(K).unsqueeze(1).expand(K, N)
    return Node(item, turn, agents, joint, returns, returns, 0, 0, item_index, returns=returns)


class StubPolicy:
    """``TeamPolicy.rollout``'s signature; one node per item (J = K = 2, ``item["returns"]``), or for a multi-turn item
    (``item["children"]``: their returns) a root and one child per entry."""

    def __init__(self):
        self.calls: list[tuple[list[str], dict]] = []

    def rollout(self, items, *, policy_version=0, env_step=0, **kwargs):
        self.calls.append(
            ([i["prompt"] for i in items], dict(policy_version=policy_version, env_step=env_step, **kwargs))
        )
        roots = [make_node(item, item_index=b) for b, item in enumerate(items)]
        children = []
        for b, (root, item) in enumerate(zip(roots, items)):
            for j, r in enumerate(item.get("children", [])):
                root.children[j] = make_node(item, turn=1, returns=r, item_index=b)
                children.append(root.children[j])
        levels = [roots] + ([children] if children else [])
        joint_actions = sum(n.rewards.shape[0] for level in levels for n in level)
        return Rollout(roots, levels, joint_actions, {"generate": 1.0, "reward": 0.5})

    @property
    def extra_prompts(self) -> list[str]:
        return [p for prompts, _ in self.calls[1:] for p in prompts]


def item(name, tied):
    return {"prompt": name, "returns": [1.0, 1.0] if tied else [0.0, 1.0]}


TRAIN = [item(f"t{i}", tied=False) for i in range(6)]  # the extra-item stream: none ties
STAMPS = dict(policy_version=3, env_step=100, reward="R")


def refill(train=TRAIN, max_extra=None, chunk=2, seed=0):
    return DynamicSampling(ExtraItems(train, seed), max_extra, chunk)


def test_without_dynamic_sampling_resolve_is_one_rollout():
    policy = StubPolicy()
    batch = RolloutBatch([item("a", True), item("b", False)], policy)
    rollout = batch.resolve(**STAMPS)
    assert len(policy.calls) == 1 and len(rollout.nodes) == 2 and rollout.metrics == {}


def test_tied_nodes_are_dropped_and_refilled_in_chunks_up_to_the_target():
    policy = StubPolicy()
    own = [item("a", True), item("b", False), item("c", True), item("d", True)]
    dynamic = refill(chunk=2)
    rollout = RolloutBatch(own, policy, dynamic).resolve(**STAMPS)
    expected = [i["prompt"] for i in ExtraItems(TRAIN, 0).take(4)]  # the stream's first four items
    # Target 4 nodes; b kept; 3 missing: a chunk of 2 (kept 3), another of 2 (kept 5, cut to 4). Budget 4 = own items.
    assert [p for p, _ in policy.calls] == [["a", "b", "c", "d"], expected[:2], expected[2:]]
    assert [n.item["prompt"] for n in rollout.nodes] == ["b"] + expected[:3]
    assert rollout.levels == [rollout.nodes] and rollout.roots == rollout.nodes
    assert [n.item_index for n in rollout.nodes] == [1, 4, 5, 6]  # the own items, then the extras, in sampling order
    # Env steps: 4 own nodes x 2 joint actions + 2 chunks x 2 items x 2; the extras are stamped after what came before.
    assert rollout.num_joint_actions == 16
    assert [c[1]["env_step"] for c in policy.calls] == [100, 108, 112]
    assert all(c[1]["policy_version"] == 3 and c[1]["reward"] == "R" for c in policy.calls)
    assert rollout.timings == {"generate": 3.0, "reward": 1.5}
    assert rollout.metrics == {
        "rollout/zero_advantage_ratio_before": 0.75,
        "rollout/zero_advantage_ratio": 0.0,
        "rollout/dynamic_sampling_extra_prompts": 4.0,
        "rollout/dynamic_sampling_fill_ratio": 1.0,
    }
    assert not any(node_ties(n) for n in rollout.nodes)


def test_the_budget_is_never_exceeded_and_a_short_step_keeps_only_untied_nodes():
    policy = StubPolicy()
    own = [item("a", True), item("b", False), item("c", True), item("d", True)]
    rollout = RolloutBatch(own, policy, refill(max_extra=1, chunk=2)).resolve(**STAMPS)
    assert len(policy.extra_prompts) == 1  # a chunk of 2 capped by the budget left
    assert len(rollout.nodes) == 2 and rollout.num_joint_actions == 10
    assert rollout.metrics["rollout/dynamic_sampling_fill_ratio"] == 0.5
    assert rollout.metrics["rollout/zero_advantage_ratio"] == 0.0
    assert rollout.metrics["rollout/dynamic_sampling_extra_prompts"] == 1.0
    # Budget 0: drop without refilling.
    policy = StubPolicy()
    rollout = RolloutBatch(own, policy, refill(max_extra=0)).resolve(**STAMPS)
    assert len(policy.calls) == 1 and [n.item["prompt"] for n in rollout.nodes] == ["b"]
    assert rollout.metrics["rollout/dynamic_sampling_extra_prompts"] == 0.0


def test_extras_that_tie_are_dropped_too():
    train = [item("u0", False), item("t0", True), item("u1", False), item("t1", True)]
    policy = StubPolicy()
    own = [item("a", True), item("b", True)]
    rollout = RolloutBatch(own, policy, refill(train, max_extra=4, chunk=4)).resolve(**STAMPS)
    # One chunk of min(4, budget 4) = the whole (permuted) train set; its two untied items refill the two nodes.
    assert sorted(policy.extra_prompts) == ["t0", "t1", "u0", "u1"]
    assert sorted(n.item["prompt"] for n in rollout.nodes) == ["u0", "u1"]
    assert rollout.metrics["rollout/zero_advantage_ratio_before"] == 1.0
    assert rollout.metrics["rollout/dynamic_sampling_fill_ratio"] == 1.0


def test_nothing_untied_at_all_gives_the_steps_own_rollout_back():
    train = [item(f"t{i}", True) for i in range(3)]
    policy = StubPolicy()
    own = [item("a", True), item("b", True)]
    rollout = RolloutBatch(own, policy, refill(train)).resolve(**STAMPS)
    assert [n.item["prompt"] for n in rollout.nodes] == ["a", "b"]  # still records, all tied
    assert len(policy.extra_prompts) == 2  # the default budget: the step's own item count
    assert rollout.num_joint_actions == 8
    assert rollout.metrics["rollout/zero_advantage_ratio"] == 1.0
    assert rollout.metrics["rollout/zero_advantage_ratio_before"] == 1.0
    assert rollout.metrics["rollout/dynamic_sampling_fill_ratio"] == 0.0


def test_no_tie_no_extra_rollout():
    policy = StubPolicy()
    own = [item("a", False), item("b", False)]
    rollout = RolloutBatch(own, policy, refill()).resolve(**STAMPS)
    assert len(policy.calls) == 1 and [n.item["prompt"] for n in rollout.nodes] == ["a", "b"]
    assert rollout.metrics["rollout/zero_advantage_ratio_before"] == 0.0
    assert rollout.metrics["rollout/dynamic_sampling_extra_prompts"] == 0.0


def test_multi_turn_nodes_are_dropped_one_by_one_and_levels_stay_by_turn():
    # Item a: a tied root, children [untied, tied]; item b: an untied root, children [tied, tied].
    own = [
        {"prompt": "a", "returns": [2.0, 2.0], "children": [[0.0, 1.0], [3.0, 3.0]]},
        {"prompt": "b", "returns": [0.0, 2.0], "children": [[1.0, 1.0], [1.0, 1.0]]},
    ]
    train = [{"prompt": "x", "returns": [5.0, 5.0], "children": [[1.0, 1.0], [1.0, 1.0]]}]  # every node ties
    policy = StubPolicy()
    rollout = RolloutBatch(own, policy, refill(train, max_extra=1)).resolve(**STAMPS)
    assert rollout.metrics["rollout/zero_advantage_ratio_before"] == 4 / 6
    assert [[(n.item["prompt"], n.turn) for n in level] for level in rollout.levels] == [[("b", 0)], [("a", 1)]]
    assert rollout.roots == rollout.levels[0] and rollout.nodes == rollout.levels[0] + rollout.levels[1]
    assert rollout.num_joint_actions == 12 + 6
    assert rollout.metrics["rollout/dynamic_sampling_fill_ratio"] == 2 / 6

    # Only a deeper turn kept: level 0 is empty, level 1 holds the node; the module's rollout metrics skip turn 1.
    own = [{"prompt": "c", "returns": [2.0, 2.0], "children": [[0.0, 1.0], [3.0, 3.0]]}]
    rollout = RolloutBatch(own, StubPolicy(), refill(train, max_extra=0)).resolve(**STAMPS)
    assert rollout.roots == [] and [len(level) for level in rollout.levels] == [0, 1]
    host = SimpleNamespace(reference=None, max_new_tokens=3, collaboration=None)
    metrics = OnPolicyModule.rollout_metrics(host, rollout)
    assert "rollout/turn_1/reward_mean" not in metrics and metrics["rollout/turn_2/reward_mean"] == 0.5
    assert metrics["rollout/zero_advantage_ratio_before"] == 2 / 3  # rollout.metrics are merged


def test_of_nodes_groups_by_turn_in_the_given_order():
    a, b, c = make_node(item("a", False)), make_node(item("b", False), turn=1), make_node(item("c", False))
    rollout = Rollout.of_nodes([a, b, c], 7, {"generate": 1.0}, {"m": 1.0})
    assert rollout.levels == [[a, c], [b]] and rollout.roots == [a, c] and rollout.nodes == [a, c, b]
    assert rollout.num_joint_actions == 7 and rollout.metrics == {"m": 1.0}
    assert Rollout.of_nodes([], 0, {}).levels == []


# ----------------------------------------------------------------------------------------------- the extra-item stream
def test_the_stream_walks_one_seeded_permutation_per_pass():
    items = [{"prompt": str(i)} for i in range(5)]
    stream = ExtraItems(items, seed=3)
    drawn = [i["prompt"] for i in stream.take(7)] + [i["prompt"] for i in stream.take(8)]
    passes = [drawn[0:5], drawn[5:10], drawn[10:15]]
    assert all(sorted(p) == ["0", "1", "2", "3", "4"] for p in passes)  # every item once per pass
    assert len({tuple(p) for p in passes}) > 1  # each pass in its own order
    assert [i["prompt"] for i in ExtraItems(items, seed=3).take(15)] == drawn  # seeded: the same stream again
    assert [i["prompt"] for i in ExtraItems(items, seed=4).take(15)] != drawn
    assert stream.position == 15


def test_each_rank_has_its_own_stream(monkeypatch):
    from comlrl_lightning.runs import ranks

    items = [{"prompt": str(i)} for i in range(20)]
    rank0 = [i["prompt"] for i in ExtraItems(items).take(20)]
    monkeypatch.setattr(ranks, "rank", lambda: 1)
    assert [i["prompt"] for i in ExtraItems(items).take(20)] != rank0
    stream = ExtraItems(items)
    stream.load([4, 9])
    assert stream.position == 9  # rank 1's saved position
    stream.load([4])
    assert stream.position == 0  # a rank the checkpoint did not have: afresh


ITEMS = [item(f"i{i}", tied=i % 2 == 0) for i in range(8)]  # half of the training items tie


def resolve_steps(data: TaskDataModule, policy: StubPolicy, skip: int, steps: int) -> list[list[str]]:
    """The extra items each of ``steps`` training batches drew, after ``skip`` batches (not resolved)."""
    drawn = []
    for b, batch in enumerate(data.train_dataloader()):
        if b < skip:
            continue
        if b >= skip + steps:
            break
        before = len(policy.calls)
        batch.resolve(**STAMPS)
        drawn.append([p for prompts, _ in policy.calls[before + 1 :] for p in prompts])
    return drawn


def test_the_data_module_refills_and_its_stream_resumes_exactly():
    policy = StubPolicy()
    data = TaskDataModule(dataset=ITEMS, prompts_per_step=2, shuffle=True, seed=1)
    data.attach_rollouts(policy, dynamic_sampling=True, max_extra_prompts=3)
    assert data.state_dict() == {"world_size": 1, "extra_items": [0]}
    first = resolve_steps(data, policy, 0, 2)
    state = data.state_dict()
    later = resolve_steps(data, policy, 2, 2)
    assert all(len(d) <= 3 for d in first + later) and any(first + later)

    resumed_policy = StubPolicy()
    resumed = TaskDataModule(dataset=ITEMS, prompts_per_step=2, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    resumed.attach_rollouts(resumed_policy, dynamic_sampling=True, max_extra_prompts=3)
    assert resolve_steps(resumed, resumed_policy, 2, 2) == later


def test_a_checkpoint_written_mid_step_keeps_the_position_before_the_steps_draws():
    policy = StubPolicy()
    data = TaskDataModule(dataset=ITEMS, prompts_per_step=2, seed=1)
    data.attach_rollouts(policy, dynamic_sampling=True)
    total = SimpleNamespace(started=1, processed=0)
    data.trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(total=total)))
    )
    batch = RolloutBatch([item("a", True), item("b", True)], policy, data.dynamic_sampling)
    batch.resolve(**STAMPS)
    assert data.extra_items.position == 2
    assert data.state_dict()["extra_items"] == [0]  # a stop discarding step 1: its draws are done again
    total.processed = 1
    assert data.state_dict()["extra_items"] == [2]  # the step finished (on_train_batch_end's checkpoint)
    total.started = 2  # the next step began but has drawn nothing yet
    assert data.state_dict()["extra_items"] == [2]
    data.trainer = None


def test_attach_rollouts_keeps_todays_behaviour_by_default():
    data = TaskDataModule(dataset=ITEMS, prompts_per_step=2)
    data.attach_rollouts(StubPolicy())
    batch = next(iter(data.train_dataloader()))
    assert isinstance(batch, RolloutBatch) and batch.dynamic is None
    assert data.state_dict() == {"world_size": 1}
    data.attach_rollouts(None, dynamic_sampling=True)  # no policy: plain items, nothing to refill
    assert data.dynamic_sampling is None


# ----------------------------------------------------------------------------------------------- fields
def test_fields_defaults_checks_and_descriptions():
    group = DynamicSamplingFields()
    assert group.dynamic_sampling is False and group.dynamic_sampling_max_extra_prompts is None
    assert DynamicSamplingFields(dynamic_sampling=True, dynamic_sampling_max_extra_prompts=0)
    with pytest.raises(ValueError, match="dynamic_sampling_max_extra_prompts must be >= 0"):
        DynamicSamplingFields(dynamic_sampling_max_extra_prompts=-1)
    assert set(described(DynamicSamplingFields)) == {"dynamic_sampling", "dynamic_sampling_max_extra_prompts"}
    with pytest.raises(ValueError, match=">= 0"):
        DynamicSampling(ExtraItems(ITEMS), max_extra_prompts=-1)


def test_ratio_values_are_plain_floats():
    rollout = RolloutBatch([item("a", True), item("b", False)], StubPolicy(), refill(max_extra=0)).resolve(**STAMPS)
    assert all(isinstance(v, float) and math.isfinite(v) for v in rollout.metrics.values())


# ----------------------------------------------------------------------------------------------- a tiny fit
def half_tied_reward(*agent_completions, batch_items=None):
    """``brevity_reward``, but 0.0 for every joint action of a ``hard`` item: its nodes always tie."""
    from comlrl_lightning.envs import toy

    brief = toy.brevity_reward(*agent_completions)
    return [0.0 if item.get("hard") else r for r, item in zip(brief, batch_items)]


def test_a_fit_with_dynamic_sampling_resumes_exactly(tmp_path):
    """A MAGRPO fit with ``dynamic_sampling`` on (its data module refills): 4 updates == 2, checkpoint, resume for 2
    more (weights, env_step with the extras' joint actions, the extras drawn)."""
    import csv
    from pathlib import Path

    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from comlrl_lightning import MAGRPO

    items = [{"prompt": f"topic {i}", "topic": f"topic {i}", "hard": i % 2 == 0} for i in range(8)]

    def run(root, ckpt_path=None, every=None):
        seed_everything(0)
        module = MAGRPO(
            dynamic_sampling=True,
            dynamic_sampling_max_extra_prompts=2,
            agents="tiny",
            num_agents=2,
            reward_func=half_tied_reward,
            num_generations=2,
            max_new_tokens=6,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            rollout_buffer_size=2,
            agent_learning_rate=1e-3,
            eval_interval=0,
            log_completions=False,
        )
        trainer = Trainer(
            max_steps=4,
            logger=CSVLogger(root, name="run"),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=1,
            callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1)]
            if every
            else [],
            enable_checkpointing=bool(every),
            accelerator="cpu",
            devices=1,
        )
        data = TaskDataModule(dataset=items, prompts_per_step=2, shuffle=True)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        return module, data, rows

    full, full_data, rows = run(tmp_path / "full", every=2)
    before = [
        float(r["rollout/zero_advantage_ratio_before"]) for r in rows if r.get("rollout/zero_advantage_ratio_before")
    ]
    extras = [
        float(r["rollout/dynamic_sampling_extra_prompts"])
        for r in rows
        if r.get("rollout/dynamic_sampling_extra_prompts")
    ]
    assert len(before) == 4 and set(before) <= {0.0, 0.5, 1.0} and max(before) > 0  # hard items always tie
    assert len(extras) == 4 and all(0 <= e <= 2 for e in extras) and sum(extras) > 0  # the budget: 2 per step
    assert full.env_step == 4 * 2 * 2 + 2 * full_data.extra_items.position  # 2 joint actions per item
    ckpt = next((tmp_path / "full" / "ckpt").glob("*step=2.ckpt"))
    resumed, resumed_data, _ = run(tmp_path / "resumed", ckpt_path=str(ckpt))
    assert resumed.env_step == full.env_step
    assert resumed_data.extra_items.position == full_data.extra_items.position
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
