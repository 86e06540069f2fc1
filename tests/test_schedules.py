"""Which agents learn, and when (``trained_agents``, ``agent_update_schedule``; ``algorithms/schedule.py``).

Hand-derived checks of the pure functions (``core/schedules.py``), then fits of tiny teams: only the scheduled agents'
weights change (bitwise), a frozen agent has no optimizer state and no gradients, an alternating schedule switches at
the right update and resumes mid-block exactly, and a sequential update weighs the later agent by M as computed by
hand from the earlier agent's new weights.
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_magrpo import ITEMS, column, fit, make_module, read_metrics

from comlrl_lightning import IAC, MAAC, MADPO, MAGRPO, TaskDataModule
from comlrl_lightning.core.schedules import agent_order, block_agents, ratio_product_weights, sequence_log_ratios
from comlrl_lightning.envs import toy


# ----------------------------------------------------------------------------------------------- core (by hand)
def test_blocks_of_updates_train_the_groups_in_turn():
    groups = [[0], [1, 2]]
    assert [block_agents(u, groups, 2) for u in range(6)] == [[0], [0], [1, 2], [1, 2], [0], [0]]
    assert [block_agents(u, [[1], [0]], 1) for u in range(3)] == [[1], [0], [1]]


def test_agent_orders_fixed_reversed_and_shuffled_from_the_seed_and_update_only():
    assert agent_order([0, 2, 3], "fixed", 5, 0) == [0, 2, 3]
    assert agent_order([0, 2, 3], "reversed", 5, 0) == [3, 2, 0]
    orders = [agent_order(list(range(4)), "shuffled", u, 7) for u in range(20)]
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # a fresh order per update
    assert orders == [agent_order(list(range(4)), "shuffled", u, 7) for u in range(20)]  # the same after a resume
    assert orders != [agent_order(list(range(4)), "shuffled", u, 8) for u in range(20)]  # another seed, other orders


def test_sequence_log_ratios_sum_or_mean_over_the_completion():
    new = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    old = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -1.5, -0.5]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    # row 0: (−1 + 1.5) + (−2 + 1) = −0.5 over 2 tokens (the third is padding); row 1: 0 + 1 + 0 = 1 over 3
    torch.testing.assert_close(sequence_log_ratios(new, old, mask), torch.tensor([-0.5, 1.0]))
    torch.testing.assert_close(sequence_log_ratios(new, old, mask, "mean"), torch.tensor([-0.25, 1.0 / 3]))
    assert sequence_log_ratios(new, old, torch.zeros_like(mask), "mean").tolist() == [0.0, 0.0]  # no tokens: ratio 1


def test_the_weight_is_the_clipped_product_of_the_earlier_agents_ratios():
    """docs/algorithms.md, example 11."""
    first = torch.log(torch.tensor([1.5, 3.0, 0.05]))
    second = torch.log(torch.tensor([1.2, 1.0, 0.25]))
    M = ratio_product_weights([first], 0.1, 2.0)
    torch.testing.assert_close(M, torch.tensor([1.5, 2.0, 0.1]))
    torch.testing.assert_close(M * torch.tensor([1.0, 0.0, -1.0]), torch.tensor([1.5, 0.0, -0.1]))
    torch.testing.assert_close(ratio_product_weights([first, second], 0.1, 2.0), torch.tensor([1.8, 2.0, 0.1]))


# ----------------------------------------------------------------------------------------------- fits
class Snapshots(Callback):
    """Each agent's weights after every update (read at the end of the training step that made it)."""

    def __init__(self):
        self.after: list[list[list[torch.Tensor]]] = []

    @staticmethod
    def weights(module):
        return [[p.detach().clone() for p in module.agents[i].parameters()] for i in range(module.num_agents)]

    def on_train_start(self, trainer, module):
        self.after.append(self.weights(module))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == len(self.after):  # one update in this step (a step without one adds nothing)
            self.after.append(self.weights(module))

    def changed(self, step: int) -> list[bool]:
        """Per agent: whether update ``step`` (1-based) changed its weights."""
        before, after = self.after[step - 1], self.after[step]
        return [any(not torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(before, after)]


def test_a_frozen_agent_samples_with_unchanged_weights_and_has_no_gradients_or_optimizer_state(tmp_path):
    module = make_module(trained_agents=[1])
    snaps = Snapshots()
    trainer = fit(module, tmp_path, max_steps=2, callbacks=[snaps])
    assert [snaps.changed(u) for u in (1, 2)] == [[False, True], [False, True]]
    frozen = list(module.agents[0].parameters())
    assert all(not p.requires_grad and p.grad is None for p in frozen)
    optimizer = trainer.optimizers[0]
    assert [g["name"] for g in optimizer.param_groups] == ["agent_1"]
    assert not any(id(p) in {id(q) for q in frozen} for p in optimizer.state)  # state only for agent 1's parameters
    assert len(optimizer.state) == len(list(module.agents[1].parameters()))
    rows = read_metrics(trainer)
    assert column(rows, "agent_0/stepped") == [0.0, 0.0] and column(rows, "agent_1/stepped") == [1.0, 1.0]
    assert not column(rows, "agent_0/grad_norm") and len(column(rows, "agent_1/grad_norm")) == 2
    assert len(column(rows, "rollout/turn_1/reward_mean")) == 2  # both agents still sampled every step


def test_alternation_switches_agents_every_block(tmp_path):
    module = make_module(agent_update_schedule="alternating", alternate_every=2)
    snaps = Snapshots()
    trainer = fit(module, tmp_path, max_steps=5, callbacks=[snaps])
    assert [snaps.changed(u) for u in range(1, 6)] == [[True, False]] * 2 + [[False, True]] * 2 + [[True, False]]
    rows = read_metrics(trainer)
    assert column(rows, "agent_0/stepped") == [1.0, 1.0, 0.0, 0.0, 1.0]
    optimizer = trainer.optimizers[0]
    assert [g["name"] for g in optimizer.param_groups] == ["agent_0", "agent_1"]  # both learn, in turn
    assert module.agent_schedule.position == 5


def test_madpo_trains_only_the_scheduled_agent_and_keeps_the_partners_margin(tmp_path):
    from test_madpo import fit_madpo, make_madpo

    module = make_madpo(agent_update_schedule="alternating", alternate_groups=[[1], [0]])
    snaps = Snapshots()
    trainer, _ = fit_madpo(module, tmp_path, max_steps=2, callbacks=[snaps])
    assert [snaps.changed(u) for u in (1, 2)] == [[False, True], [True, False]]
    assert column(read_metrics(trainer), "agent_1/stepped") == [1.0, 0.0]


@pytest.mark.parametrize("cls", [IAC, MAAC])
def test_actor_critic_trains_only_the_scheduled_agent(cls, tmp_path):
    module = make_module(cls, num_generations=1, rollout_buffer_size=2, trained_agents=[0], critic_model="tiny")
    snaps = Snapshots()
    fit(module, tmp_path, max_steps=2, callbacks=[snaps])
    assert [snaps.changed(u) for u in (1, 2)] == [[True, False], [True, False]]


def test_resume_mid_alternation_is_exact(tmp_path):
    """fit 5 updates (blocks of 2: 0 0 1 1 0) == fit 3, stop, resume from the step-3 checkpoint (mid-block of agent 1)."""

    def run(root, max_steps, ckpt_path=None, every=None):
        seed_everything(0)
        module = make_module(agent_update_schedule="alternating", alternate_every=2)
        callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1)] if every else []
        trainer = Trainer(
            max_steps=max_steps,
            logger=CSVLogger(root, name="run"),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=1,
            callbacks=callbacks,
            enable_checkpointing=bool(every),
            accelerator="cpu",
            devices=1,
        )
        data = TaskDataModule(dataset=ITEMS, prompts_per_step=2, shuffle=True)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return module, read_metrics(trainer)

    full, full_rows = run(tmp_path / "full", 5, every=3)
    ckpt = next((tmp_path / "full" / "ckpt").glob("*step=3.ckpt"))
    resumed, rows = run(tmp_path / "resumed", 5, ckpt_path=str(ckpt))
    assert column(full_rows, "agent_1/stepped") == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert column(rows, "agent_1/stepped") == [1.0, 0.0]  # update 4 finishes agent 1's block, update 5 is agent 0's
    assert resumed.agent_schedule.position == full.agent_schedule.position == 5
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("order, first", [("fixed", 0), ("reversed", 1)])
def test_sequential_update_weighs_the_later_agent_by_the_earlier_agents_ratio(order, first, tmp_path):
    """Two agents, one update: the first in order steps; its new log-probs against the sampling policy's give
    M = clip(exp(Σ_t log π_new − log π_old), 0.1, 2.0) per joint action; the second's advantages are its group
    advantages times M. Computed here by hand from the module's own tensors and compared with what its loss got."""
    module = make_module(agent_update_schedule="sequential", sequential_order=order, policy_loss="clipped")
    later = 1 - first
    calls = []  # (agent, its group advantages, its batch) as agent_batch built them
    original = module.agent_batch

    def batch(records, agent):
        out = original(records, agent)
        calls.append((agent, out.advantages.clone(), out))
        return out

    module.agent_batch = batch
    log_ratio = {}

    def log_ratios(agent, b):  # by hand, after the agent's step: Σ_t (log π_new − log π_old) over its completion
        new = module.score_no_grad(agent, b.inputs)
        mask = b.inputs.completion_mask
        by_hand = ((new - b.old_logprobs) * mask).sum(-1)
        log_ratio[agent] = by_hand
        return by_hand

    module.log_ratios_after_step = log_ratios
    order_seen = []
    micro = module.agent_micro_batches

    def micro_batches(inputs):
        order_seen.extend(inputs)
        return micro(inputs)

    module.agent_micro_batches = micro_batches
    trainer = fit(module, tmp_path, max_steps=1)
    assert order_seen == [first, later]
    base = {agent: adv for agent, adv, _ in calls}
    (b_first,) = [b for a, _, b in calls if a == first]
    M = torch.exp(log_ratio[first]).clamp(0.1, 2.0)
    assert not torch.allclose(M, torch.ones_like(M))  # the first agent's step moved its probabilities
    torch.testing.assert_close(b_first.advantages, base[first])  # the first agent's advantages are its own
    later_batch = next(b for a, _, b in calls if a == later)
    torch.testing.assert_close(later_batch.advantages, base[later] * M.to(base[later].dtype))
    rows = read_metrics(trainer)
    assert column(rows, f"agent_{later}/sequential_weight_mean") == pytest.approx([float(M.mean())])
    assert column(rows, "agent_0/stepped") == [1.0] and column(rows, "agent_1/stepped") == [1.0]
    assert math.isfinite(column(rows, f"agent_{first}/grad_norm")[0])  # measured at its own step


def test_schedule_configuration_errors_name_the_field():
    with pytest.raises(ValueError, match=r"trained_agents must be distinct agent indices in 0\.\.1 \(got \[2\]\)"):
        make_module(trained_agents=[2])
    with pytest.raises(ValueError, match="agent_update_schedule must be one of: simultaneous, alternating, sequential"):
        make_module(agent_update_schedule="round_robin")
    with pytest.raises(ValueError, match="alternate_groups is set but agent_update_schedule is 'simultaneous'"):
        make_module(alternate_groups=[[0], [1]])
    with pytest.raises(ValueError, match=r"alternate_groups must be non-empty lists of trained agents \[0\]"):
        make_module(agent_update_schedule="alternating", trained_agents=[0], alternate_groups=[[1]])
    with pytest.raises(ValueError, match="joint_mode=cross"):
        make_module(agent_update_schedule="sequential", joint_mode="cross")
    with pytest.raises(ValueError, match="MADPO's update has no advantages"):
        MADPO(agents="tiny", num_agents=2, reward_func=toy.brevity_reward, agent_update_schedule="sequential")
    with pytest.raises(ValueError, match="alternate_every must be >= 1"):
        make_module(agent_update_schedule="alternating", alternate_every=0)
    one = MAGRPO(agents="tiny", num_agents=1, reward_func=lambda a: [0.0] * len(a))
    model, tokenizer = one.agents[0], one.tokenizers[0]
    with pytest.raises(ValueError, match=r"agents \[0, 1\] share one model, so they learn together or not at all"):
        make_module(agents=[model, model], tokenizers=tokenizer, trained_agents=[0])
    with pytest.raises(ValueError, match="share one model: give them separate copies"):
        make_module(agents=[model, model], tokenizers=tokenizer, agent_update_schedule="sequential")


def test_a_frozen_agent_of_a_lora_team_keeps_its_adapter(tmp_path):
    module = make_module(num_agents=3, lora_rank=4, trained_agents=[0, 2])
    adapters = [[p.detach().clone() for p in module.agents[i].trainable_parameters()] for i in range(3)]
    trainer = fit(module, tmp_path, max_steps=2)
    changed = [
        any(not torch.equal(a, b) for a, b in zip(adapters[i], module.agents[i].trainable_parameters()))
        for i in range(3)
    ]
    assert changed == [True, False, True]
    assert not any(p.requires_grad for p in module.agents[1].trainable_parameters())  # whichever adapter is active
    assert [g["name"] for g in trainer.optimizers[0].param_groups] == ["agent_0", "agent_2"]


def test_a_sequential_actor_critic_update_steps_each_agent_with_its_critic(tmp_path):
    module = make_module(
        IAC, num_generations=1, rollout_buffer_size=2, critic_model="tiny", agent_update_schedule="sequential"
    )
    critics = [[p.detach().clone() for p in c.parameters()] for c in module.critics]
    snaps = Snapshots()
    trainer = fit(module, tmp_path, max_steps=2, callbacks=[snaps])
    assert [snaps.changed(u) for u in (1, 2)] == [[True, True], [True, True]]
    for before, critic in zip(critics, module.critics):  # each critic stepped in its agent's stage
        assert any(not torch.equal(a, b) for a, b in zip(before, critic.parameters()))
    rows = read_metrics(trainer)
    assert len(column(rows, "agent_1/sequential_weight_mean")) == 2 and not column(
        rows, "agent_0/sequential_weight_mean"
    )
    assert trainer.global_step == 2  # one team update each, whatever the stages
