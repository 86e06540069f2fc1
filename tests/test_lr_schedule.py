"""The learning-rate schedule (``lr_warmup_steps``, ``lr_decay``, ``lr_min_ratio``): its multipliers by hand, one
scheduler step per team update (not per batch), every parameter group on its own base rate (agents, critics), and
a resumed run that continues the schedule exactly where the checkpoint left it."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from comlrl_lightning import IAC, MADPO, MAGRPO, PreferenceDataModule, TaskDataModule
from comlrl_lightning.algorithms.optimization import LearningRateSchedule
from comlrl_lightning.config_errors import ConfigurationError
from comlrl_lightning.envs import toy

ITEMS = [{"prompt": f"topic {i}", "topic": f"topic {i}"} for i in range(16)]
RATES = [1e-3, 4e-4]  # two agents, two base rates


# ----------------------------------------------------------------------------------------------- (a) by hand
# warm-up 2, horizon 6, min_ratio 0.1.  Warm-up: (step + 1) / 2 -> 0.5, 1.0.  After it,
# progress p = (step - 2) / (6 - 2) = (step - 2) / 4, capped at 1:
#   step:        2      3        4      5        6     7 (past the horizon)
#   p:           0      0.25     0.5    0.75     1     1
#   linear  0.1 + 0.9 (1 - p):
#                1.0    0.775    0.55   0.325    0.1   0.1
#   cosine  0.1 + 0.9 * (1 + cos(pi p)) / 2, cos(pi/4) = 0.70710678:
#                1.0    0.1 + 0.9 * 0.85355339 = 0.86819805
#                              0.1 + 0.9 * 0.5 = 0.55
#                                       0.1 + 0.9 * 0.14644661 = 0.23180195
#                                                        0.1   0.1
#   constant:    1.0 everywhere after the warm-up.
HAND = {
    "constant": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    "linear": [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1],
    "cosine": [0.5, 1.0, 1.0, 0.86819805, 0.55, 0.23180195, 0.1, 0.1],
}


@pytest.mark.parametrize("decay", list(HAND))
def test_multipliers_by_hand(decay):
    schedule = LearningRateSchedule(warmup=2, decay=decay, total=6, min_ratio=0.1)
    assert [schedule(step) for step in range(8)] == pytest.approx(HAND[decay], abs=1e-8)


def test_multipliers_without_warmup_and_degenerate_horizons():
    # no warm-up: decay starts at 1.0 on update 0; linear over 4 updates to 0 -> 1, 0.75, 0.5, 0.25, 0
    assert [LearningRateSchedule(0, "linear", 4, 0.0)(s) for s in range(5)] == pytest.approx([1, 0.75, 0.5, 0.25, 0])
    # warm-up as long as the horizon: the run's 3 updates are the warm-up ramp 1/3, 2/3, 1
    assert [LearningRateSchedule(3, "cosine", 3, 0.2)(s) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert LearningRateSchedule(0, "cosine", 0, 0.5)(0) == pytest.approx(1.0)  # total < 1 is clamped, no 0-division


def test_the_schedule_is_off_unless_asked_for():
    module = make_module()
    assert isinstance(module.configure_optimizers(), torch.optim.AdamW)  # no warm-up, constant: no scheduler


# ----------------------------------------------------------------------------------------------- helpers
def make_module(cls=MAGRPO, **overrides):
    kwargs = dict(
        agents="tiny",
        num_agents=2,
        reward_func=toy.brevity_reward,
        num_generations=2,
        max_new_tokens=4,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        rollout_buffer_size=2,
        agent_learning_rate=RATES,
        eval_interval=0,
        log_completions=False,
    )
    kwargs.update(overrides)
    seed_everything(0)
    return cls(**kwargs)


def fit(module, root: Path, max_steps: int, ckpt_path: str | None = None, callbacks=(), prompts_per_step=2):
    seed_everything(0)
    trainer = Trainer(
        max_steps=max_steps,
        logger=CSVLogger(root, name="run"),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=list(callbacks),
        accelerator="cpu",
        devices=1,
    )
    data = TaskDataModule(dataset=ITEMS, prompts_per_step=prompts_per_step, eval_batch_size=2)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def logged(trainer, key: str) -> dict[int, float]:
    """``{step: value}`` of a metric in the run's metrics.csv."""
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


def spy_updates(module, stage=None, method="update") -> list[dict[str, float]]:
    """The metrics of every update (each carries the rate per group that update used); with ``stage``, only the
    updates of that objective (``module.objective`` when ``stage`` is ``"objective"``); ``method``: the update to
    spy on (MARLHF's reward-model stage: ``update_reward_model``)."""
    seen, update = [], getattr(module, method)

    def spy(batch, *rest):
        metrics = update(batch, *rest)
        objective = rest[0] if rest else None
        chosen = module.objective if stage == "objective" else stage
        if stage is None or (objective or module.objective) is chosen:
            seen.append(metrics)
        return metrics

    setattr(module, method, spy)
    return seen


def expected(schedule: LearningRateSchedule, base: float, steps) -> list[float]:
    return [base * schedule(step) for step in steps]


# ----------------------------------------------------------------------------------------------- (b) in a fit
def test_each_agent_follows_its_own_rate_one_scheduler_step_per_update(tmp_path):
    """One update per batch: the row of step s logs the rates update s used, base_i x multiplier(s)."""
    module = make_module(lr_warmup_steps=2, lr_decay="cosine", lr_min_ratio=0.1)
    trainer = fit(module, tmp_path, max_steps=4)
    schedule = LearningRateSchedule(2, "cosine", 4, 0.1)  # horizon: trainer.max_steps
    assert trainer.global_step == 4
    for i, base in enumerate(RATES):
        rates = logged(trainer, f"agent_{i}/learning_rate")
        assert sorted(rates) == [0, 1, 2, 3]
        # 0.5, 1.0, 1.0, 0.55 (progress (3-2)/(4-2) = 0.5) x base
        assert [rates[s] for s in range(4)] == pytest.approx(expected(schedule, base, range(4)), rel=1e-6)
        assert [rates[s] / base for s in range(4)] == pytest.approx([0.5, 1.0, 1.0, 0.55], rel=1e-6)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 4  # stepped once per update
    optimizer = trainer.optimizers[0]
    # after the last update the groups hold the rate the next update would use: base x multiplier(4) = min
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([r * 0.1 for r in RATES], rel=1e-6)
    assert [g["name"] for g in optimizer.param_groups] == ["agent_0", "agent_1"]


def test_several_updates_in_one_batch_step_the_schedule_each_time(tmp_path):
    """Two updates per batch (train_batch_size 1 of a 2-node buffer): the schedule advances per update, so the
    k-th update uses multiplier(k), and each update's row (at its step) logs the rate it used."""
    module = make_module(lr_warmup_steps=2, lr_decay="linear", lr_min_ratio=0.1, train_batch_size=1)
    seen = spy_updates(module)
    trainer = fit(module, tmp_path, max_steps=6)
    schedule = LearningRateSchedule(2, "linear", 6, 0.1)  # the hand-derived table above: 0.5, 1, 1, .775, .55, .325
    assert trainer.global_step == 6 and len(seen) == 6
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 6
    for i, base in enumerate(RATES):
        per_update = [m[f"agent_{i}/learning_rate"] for m in seen]
        assert per_update == pytest.approx(expected(schedule, base, range(6)), rel=1e-6)
        assert [r / base for r in per_update] == pytest.approx(HAND["linear"][:6], rel=1e-6)
        rows = logged(trainer, f"agent_{i}/learning_rate")
        assert sorted(rows) == list(range(6))  # one row per update, not per batch
        assert [rows[s] for s in range(6)] == pytest.approx(per_update, rel=1e-6)


@pytest.mark.parametrize(
    "layout,updates",
    [
        ({"rollout_buffer_size": 4}, 2),  # a 4-node buffer fills every 2nd batch: 1 update per 2 batches
        (
            {"rollout_buffer_size": 2, "train_batch_size": 1},
            8,
        ),  # 2 one-node mini-batches per batch: 2 updates per batch
    ],
    ids=["update-every-2nd-batch", "two-updates-per-batch"],
)
def test_without_max_steps_the_decay_spans_lr_decay_steps(layout, updates, tmp_path):
    """A fit's update count is not known in advance (rollouts, buffers, pairs and rounds vary), so with only
    ``max_epochs`` the decay spans ``lr_decay_steps`` updates: here the fit's own count (8 items, 2 per batch: 4
    batches, 2 nodes each), linear to 0, so update k of U uses 1 - k/U and none runs at rate 0."""
    module = make_module(lr_decay="linear", lr_min_ratio=0.0, lr_decay_steps=updates, **layout)
    seen = spy_updates(module)
    seed_everything(0)
    trainer = Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, datamodule=TaskDataModule(dataset=ITEMS[:8], prompts_per_step=2))
    assert trainer.num_training_batches == 4 and len(seen) == trainer.global_step == updates
    used = [m["agent_0/learning_rate"] / RATES[0] for m in seen]
    assert min(used) > 0, f"updates ran at learning rate 0: multipliers {used}"
    assert used == pytest.approx([1 - k / updates for k in range(updates)])


def test_a_decay_without_a_horizon_is_a_configuration_error(tmp_path):
    module = make_module(lr_decay="cosine")
    trainer = Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    with pytest.raises(
        ConfigurationError,
        match="lr_decay='cosine' needs the number of updates it spans: set model lr_decay_steps, or trainer.max_steps",
    ):
        trainer.fit(module, datamodule=TaskDataModule(dataset=ITEMS[:2], prompts_per_step=2))


def test_the_cli_reports_a_decay_without_a_horizon_in_one_message(tmp_path, capsys):
    from comlrl_lightning.cli import main

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                str(config),
                "--trainer.max_steps",
                "-1",
                "--model.init_args.lr_decay",
                "linear",
                "--trainer.default_root_dir",
                str(tmp_path),
                "--trainer.enable_progress_bar",
                "false",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and err.count("error:") == 1
    assert "lr_decay='linear' needs the number of updates it spans" in err


# ----------------------------------------------------------------------------------------------- (c) resume
def test_resume_continues_the_schedule(tmp_path):
    """A run checkpointed after every update and resumed from the middle logs the rates of the uninterrupted run
    and ends with the same rates in the optimizer."""
    overrides = dict(lr_warmup_steps=2, lr_decay="cosine", lr_min_ratio=0.1)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    full = fit(make_module(**overrides), tmp_path / "full", max_steps=5, callbacks=[checkpoints])
    middle = tmp_path / "ckpt" / "step=2.ckpt"
    assert middle.is_file(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    saved = torch.load(middle, weights_only=False)
    assert saved["lr_schedulers"][0]["last_epoch"] == 2

    module = make_module(**overrides)
    seen = spy_updates(module)
    resumed = fit(module, tmp_path / "resumed", max_steps=5, ckpt_path=str(middle))
    assert resumed.global_step == 5 and len(seen) == 3  # updates 2, 3, 4 only
    schedule = LearningRateSchedule(2, "cosine", 5, 0.1)
    for i, base in enumerate(RATES):
        uninterrupted = logged(full, f"agent_{i}/learning_rate")
        after = logged(resumed, f"agent_{i}/learning_rate")
        assert sorted(after) == [2, 3, 4]
        assert [after[s] for s in (2, 3, 4)] == pytest.approx([uninterrupted[s] for s in (2, 3, 4)], rel=1e-9)
        assert [m[f"agent_{i}/learning_rate"] for m in seen] == pytest.approx(
            expected(schedule, base, (2, 3, 4)), rel=1e-6
        )
    assert resumed.lr_scheduler_configs[0].scheduler.last_epoch == full.lr_scheduler_configs[0].scheduler.last_epoch
    assert [g["lr"] for g in resumed.optimizers[0].param_groups] == pytest.approx(
        [g["lr"] for g in full.optimizers[0].param_groups], rel=1e-12
    )
    assert [g["initial_lr"] for g in resumed.optimizers[0].param_groups] == pytest.approx(RATES)


def test_resume_keeps_the_horizon_of_the_checkpoint(tmp_path):
    """The schedule's shape (warm-up, decay, horizon, floor) is restored with the scheduler state."""
    overrides = dict(lr_warmup_steps=1, lr_decay="linear", lr_min_ratio=0.0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    full = fit(make_module(**overrides), tmp_path / "full", max_steps=3, callbacks=[checkpoints])
    module = make_module(**overrides)
    resumed = fit(module, tmp_path / "resumed", max_steps=3, ckpt_path=str(tmp_path / "ckpt" / "step=1.ckpt"))
    restored = resumed.lr_scheduler_configs[0].scheduler.schedule
    assert (restored.warmup, restored.decay, restored.total, restored.min_ratio) == (1, "linear", 3, 0.0)
    assert logged(resumed, "agent_0/learning_rate") == pytest.approx(
        {s: v for s, v in logged(full, "agent_0/learning_rate").items() if s >= 1}
    )


# ----------------------------------------------------------------------------------------------- (d) critics
def test_separate_critics_are_scheduled_on_their_own_rate(tmp_path):
    critic_rate = 3e-4
    module = make_module(
        IAC,
        use_separate_critic=True,
        critic_model="tiny",
        critic_learning_rate=critic_rate,
        rollout_buffer_size=4,
        lr_warmup_steps=2,
        lr_decay="linear",
        lr_min_ratio=0.1,
    )
    trainer = fit(module, tmp_path, max_steps=4)
    schedule = LearningRateSchedule(2, "linear", 4, 0.1)  # 0.5, 1.0, 1.0, 0.55
    names = [g["name"] for g in trainer.optimizers[0].param_groups]
    assert names == ["agent_0", "agent_1", "critic_0", "critic_1"]
    bases = {"agent_0": RATES[0], "agent_1": RATES[1], "critic_0": critic_rate, "critic_1": critic_rate}
    for name, base in bases.items():
        rates = logged(trainer, f"{name}/learning_rate")
        assert [rates[s] for s in range(4)] == pytest.approx(expected(schedule, base, range(4)), rel=1e-6), name
        assert [rates[s] / base for s in range(4)] == pytest.approx([0.5, 1.0, 1.0, 0.55], rel=1e-6), name
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == pytest.approx(
        [b * schedule(4) for b in bases.values()], rel=1e-6
    )


# ----------------------------------------------------------------------------------------------- preference data
def test_a_preference_module_is_scheduled_over_lr_decay_steps(tmp_path):
    """MADPO (one update per batch of pairs) with a schedule, only ``max_epochs`` and ``lr_decay_steps``."""
    seed_everything(0)
    module = MADPO(
        agents="tiny",
        num_agents=2,
        reward_func=toy.letter_reward,
        preference_num_candidates=4,
        preference_pairs_per_sample=2,
        max_new_tokens=4,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        agent_learning_rate=RATES,
        eval_interval=0,
        log_completions=False,
        lr_warmup_steps=1,
        lr_decay="linear",
        lr_min_ratio=0.0,
        lr_decay_steps=4,
    )
    seen = spy_updates(module)
    trainer = Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, datamodule=PreferenceDataModule(dataset=ITEMS[:4], prompts_per_step=2, show_progress=False))
    updates = len(seen)
    assert updates == trainer.global_step >= 2
    schedule = LearningRateSchedule(1, "linear", 4, 0.0)
    assert [m["agent_1/learning_rate"] for m in seen] == pytest.approx(expected(schedule, RATES[1], range(updates)))


def test_marlhf_stages_do_not_use_up_each_others_schedule(tmp_path):
    """Each group counts the updates that trained it: the reward-model epoch does not advance the agents' warm-up,
    and the RL epoch does not advance the reward model's."""
    from comlrl_lightning import MARLHF

    seed_everything(0)
    module = MARLHF(
        agents="tiny",
        num_agents=2,
        reward_func=toy.letter_reward,
        preference_num_candidates=4,
        preference_pairs_per_sample=2,
        reward_model_name="tiny",
        reward_train_batch_size=2,
        num_generations=2,
        max_new_tokens=4,
        rollout_buffer_size=2,
        agent_learning_rate=RATES,
        reward_learning_rate=2e-3,
        eval_interval=0,
        log_completions=False,
        lr_warmup_steps=3,
        lr_decay="constant",
    )
    rm_updates, rl_updates = spy_updates(module, method="update_reward_model"), spy_updates(module, "objective")
    trainer = Trainer(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, datamodule=PreferenceDataModule(dataset=ITEMS[:4], prompts_per_step=2, show_progress=False))
    assert len(rm_updates) >= 2 and len(rl_updates) >= 2
    warmup = [min((k + 1) / 3, 1.0) for k in range(max(len(rm_updates), len(rl_updates)))]
    assert [m["reward_model/learning_rate"] / 2e-3 for m in rm_updates] == pytest.approx(warmup[: len(rm_updates)])
    assert [m["agent_0/learning_rate"] / RATES[0] for m in rl_updates] == pytest.approx(warmup[: len(rl_updates)])
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.group_updates == [len(rl_updates), len(rl_updates), len(rm_updates)]


def test_adamw_kernel_fused_by_default_foreach_for_sharded_tensors_and_the_same_step_every_way():
    """``adamw_implementation: auto`` picks the fused kernel for plain CPU/CUDA tensors and ``foreach`` for anything
    else (an FSDP shard is a DTensor); every kernel takes the same step."""
    from comlrl_lightning.algorithms.optimization import adamw_kernel

    plain = [torch.nn.Parameter(torch.randn(3, 4))]
    assert adamw_kernel("auto", plain) == {"fused": True}
    assert adamw_kernel("auto", [torch.nn.Parameter(torch.randn(2).to(torch.float64))]) == {"foreach": True}
    assert adamw_kernel("for-loop", plain) == {"foreach": False}
    steps = []
    for choice in ("fused", "foreach", "for-loop"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 32))
        optimizer = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.01, **adamw_kernel(choice, [p]))
        for _ in range(3):
            p.grad = torch.sin(p.detach() * 3)
            optimizer.step()
        steps.append(p.detach())
    torch.testing.assert_close(steps[0], steps[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(steps[1], steps[2], rtol=1e-5, atol=1e-6)
    module = MAGRPO(agents="tiny", num_agents=2, reward_func=toy.brevity_reward)
    assert module.configure_optimizers().defaults["fused"] is True
    with pytest.raises(ValueError, match="adamw_implementation"):
        MAGRPO(agents="tiny", num_agents=2, reward_func=toy.brevity_reward, adamw_implementation="turbo")
