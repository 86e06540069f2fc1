"""The MAGRPO family end to end on tiny models: fit, validation, freshness, gradients, KL, evaluation, export."""

from __future__ import annotations

import copy
import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from comlrl_lightning import MAGRPO, MAREINFORCE, MARLOO, MAReMax, TaskDataModule
from comlrl_lightning.agents.factories import MODEL_FACTORIES
from comlrl_lightning.core.advantages import compute_advantages
from comlrl_lightning.data.tasks import RolloutBatch
from comlrl_lightning.envs import toy

ITEMS = [{"prompt": f"topic {i}", "topic": f"topic {i}"} for i in range(8)]


def make_module(cls=MAGRPO, **overrides):
    kwargs = dict(
        agents="tiny",
        num_agents=2,
        reward_func=toy.brevity_reward,
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
    kwargs.update(overrides)
    return cls(**kwargs)


def fit(module, tmp_path, max_steps=2, items=ITEMS, eval_items=None, prompts_per_step=2, callbacks=()):
    seed_everything(0)
    trainer = Trainer(
        max_steps=max_steps,
        logger=CSVLogger(tmp_path, name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=list(callbacks),
        accelerator="cpu",
        devices=1,
    )
    data = TaskDataModule(dataset=items, eval_dataset=eval_items, prompts_per_step=prompts_per_step, eval_batch_size=2)
    trainer.fit(module, datamodule=data)
    return trainer


def read_metrics(trainer) -> list[dict[str, str]]:
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def column(rows, key):
    return [float(r[key]) for r in rows if r.get(key)]


def params_of(module):
    if hasattr(module, "configure_model"):
        module.configure_model()  # models load in configure_model (or on first use of module.agents), not in __init__
    return [p.detach().clone() for p in module.parameters()]


# ----------------------------------------------------------------------------------------------- fit
@pytest.mark.parametrize("cls,mode", [(MAGRPO, "mean"), (MARLOO, "rloo"), (MAReMax, "max"), (MAREINFORCE, "raw")])
def test_each_variant_fits_and_changes_weights(cls, mode, tmp_path):
    module = make_module(cls)
    assert module.advantage_mode == mode
    before = params_of(module)
    trainer = fit(module, tmp_path)
    assert trainer.global_step == 2  # one global step per team update, not per agent
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    rows = read_metrics(trainer)
    assert column(rows, "env_step") == [4.0, 8.0]  # 2 prompts x K=2 aligned joint actions per step
    for key in (
        "loss",
        "rollout/turn_1/reward_mean",
        "turn_1/expected_return",
        "agent_0/grad_norm",
        "agent_1/grad_norm",
        "completions/mean_length",
        "timing_s/generate",
        "timing_s/reward",
        "timing_s/update",
    ):
        assert column(rows, key), key


def test_advantage_statistics_are_logged_per_agent(tmp_path):
    """``agent_i/advantage_mean|advantage_std|zero_advantage_ratio``: normalised group advantages have mean 0 and
    spread 1 where the group's returns differ; a reward that never varies gives every sample advantage 0."""
    from comlrl_lightning.algorithms.on_policy import advantage_metrics

    stats = advantage_metrics(torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert [float(stats[k]) for k in ("advantage_mean", "advantage_std", "zero_advantage_ratio")] == pytest.approx(
        [0.0, 0.5**0.5, 0.5]
    )
    rows = read_metrics(fit(make_module(reward_func=lambda a, b: [1.0] * len(a)), tmp_path / "flat"))
    assert column(rows, "agent_1/zero_advantage_ratio") == [1.0, 1.0]
    assert column(rows, "agent_0/advantage_std") == [0.0, 0.0]
    rows = read_metrics(fit(make_module(num_generations=4), tmp_path / "varied"))
    assert all(abs(v) < 1e-5 for v in column(rows, "agent_0/advantage_mean"))
    assert all(0.5 < v <= 1.0 + 1e-5 for v in column(rows, "agent_0/advantage_std"))


def test_class_path_variant_defaults_can_be_overridden():
    assert make_module(MARLOO, advantage_mode="mean").advantage_mode == "mean"


def test_single_agent_grpo(tmp_path):
    module = make_module(num_agents=1)
    trainer = fit(module, tmp_path)
    assert module.num_agents == 1 and trainer.global_step == 2


def test_shared_weights_one_parameter_group(tmp_path):
    model, tok = MODEL_FACTORIES["tiny"]()
    module = make_module(agents=[model, model], tokenizers=tok)
    assert module.agents[0] is module.agents[1]
    optimizer = module.configure_optimizers()
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["agents"] == [0, 1]
    before = params_of(module)
    fit(module, tmp_path)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_multi_turn_and_cross_fit(tmp_path):
    module = make_module(
        num_turns=2,
        external_transition=toy.revise_transition,
        joint_mode="cross",
        rollout_buffer_size=1,
        train_batch_size=1,
    )
    trainer = fit(module, tmp_path, max_steps=3, prompts_per_step=1)
    rows = read_metrics(trainer)
    # cross, N=2, K=2: 4 joint actions at the root, 4 children x 4 = 16 below -> 20 per item
    assert column(rows, "env_step")[0] == 20.0
    assert column(rows, "rollout/turn_2/reward_mean") and column(rows, "turn_2/expected_return")


def test_cli_fit_with_config(tmp_path, monkeypatch):
    from comlrl_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    main(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false",
            "--model.init_args.eval_interval=1",
            "--model.init_args.max_new_tokens=4",
        ]
    )
    metrics = next(tmp_path.glob("outputs/quickstart/*/metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    assert column(rows, "eval/turn_1/reward_mean") and column(rows, "loss")
    assert (metrics.parent / "completions.jsonl").read_text().strip()


# ----------------------------------------------------------------------------------------------- freshness
def test_rollouts_come_from_the_weights_after_the_previous_update(tmp_path):
    """The batch consumed at update t was sampled by the weights produced by update t-1 (no stale prefetch)."""
    module = make_module(rollout_buffer_size=2)
    sampled_with, updated_to = [], []
    collect, update = module.collect_rollout, module.update

    def spy_collect(batch):
        # the data module serves the step's items with the team policy; the trees are sampled now, in the step
        assert isinstance(batch, RolloutBatch) and batch.policy is module.policy
        sampled_with.append((module.global_step, [p.detach().clone() for p in module.parameters()]))
        return collect(batch)

    def spy_update(nodes):
        assert all(n.policy_version == module.global_step for n in nodes)
        out = update(nodes)
        updated_to.append([p.detach().clone() for p in module.parameters()])
        return out

    module.collect_rollout, module.update = spy_collect, spy_update
    trainer = fit(module, tmp_path, max_steps=3)
    assert [v for v, _ in sampled_with] == [0, 1, 2]
    assert column(read_metrics(trainer), "rollout/policy_lag") == [0.0, 0.0, 0.0]
    for t in range(1, 3):
        assert all(torch.equal(a, b) for a, b in zip(sampled_with[t][1], updated_to[t - 1]))


# ----------------------------------------------------------------------------------------------- gradients
class GradCapture(torch.nn.Module):
    pass


def test_gradient_matches_documented_objective(tmp_path):
    """The update's parameter gradient equals autograd of mean_rows(-A * sum_t log pi) computed one sequence at a
    time without padding (seq_sum), for every agent."""
    module = make_module(rollout_buffer_size=2, max_new_tokens=5)
    captured = {}
    update = module.update

    def spy_update(nodes):
        captured["nodes"] = nodes
        captured["weights"] = copy.deepcopy(module.agents).eval()
        return update(nodes)

    class Grads(torch.nn.Module):
        pass

    from lightning.pytorch import Callback

    class OnBeforeStep(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if "grads" not in captured:
                captured["grads"] = [[p.grad.clone() for p in agent.parameters()] for agent in pl_module.agents]

    module.update = spy_update
    fit(module, tmp_path, max_steps=1, callbacks=[OnBeforeStep()])
    nodes, agents = captured["nodes"], captured["weights"]
    for i, agent in enumerate(agents):
        agent.zero_grad()
        credit = torch.stack([n.agents[i].credit for n in nodes])
        advantages = compute_advantages(credit, "mean", True).reshape(-1)
        logps = []
        for n in nodes:
            s = n.agents[i]
            for k in range(s.completion_ids.shape[0]):
                length = int(s.completion_mask[k].sum())
                ids = torch.cat([s.prompt_ids, s.completion_ids[k, :length]]).unsqueeze(0)
                logits = agent(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
                logps.append(torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(s.prompt_ids) :, None]).sum())
        loss = (-(advantages * torch.stack(logps))).mean()
        loss.backward()
        for expected, got in zip(agent.parameters(), captured["grads"][i]):
            torch.testing.assert_close(got, expected.grad, atol=2e-5, rtol=1e-3)


def test_micro_batches_accumulate_to_the_same_gradient(tmp_path):
    grads = []
    from lightning.pytorch import Callback

    class OnBeforeStep(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.append(torch.cat([p.grad.flatten() for p in pl_module.parameters()]))

    for micro in (None, 1):
        fit(
            make_module(micro_batch_size=micro, loss_aggregation="token_mean"),
            tmp_path,
            max_steps=1,
            callbacks=[OnBeforeStep()],
        )
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_a_token_budget_and_one_agent_at_a_time_give_the_same_gradient(tmp_path, monkeypatch):
    """Update memory is bounded: each agent's micro-batches are forwarded and backpropagated before the next
    agent's, within a token budget; the gradient is that of the whole mini-batch in one forward."""
    from lightning.pytorch import Callback

    import comlrl_lightning.algorithms.on_policy as on_policy

    grads, events = [], []

    class OnBeforeStep(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.append(torch.cat([p.grad.flatten() for p in pl_module.parameters()]))

    for budget in (None, 12):
        module = make_module(micro_batch_tokens=budget, loss_aggregation="token_mean", max_new_tokens=4)
        if budget:
            score, backward = on_policy.token_logprobs, module.manual_backward
            agent_of = {id(module.policy_model(i)): i for i in range(module.num_agents)}
            monkeypatch.setattr(
                on_policy,
                "token_logprobs",
                lambda model, inputs: (events.append(agent_of[id(model)]), score(model, inputs))[1],  # noqa: B023
            )  # used within the iteration that binds them
            module.manual_backward = lambda loss: (events.append("backward"), backward(loss))  # noqa: B023
        fit(module, tmp_path, max_steps=1, callbacks=[OnBeforeStep()])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    forwards = [e for e in events if e != "backward"]
    assert len(forwards) > 2  # the budget split each agent's rows
    # never two graphs alive: every forward is followed by its backward, agent 0's all before agent 1's
    assert events == [e for f in forwards for e in (f, "backward")]
    assert forwards == sorted(forwards)


def test_an_update_that_cannot_fit_says_which_fields_to_change(tmp_path, monkeypatch):
    import comlrl_lightning.agents.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1024)  # 1 KB left on the device
    module = make_module()
    backward = []
    module.manual_backward = backward.append
    with pytest.raises(MemoryError, match=r"micro_batch_tokens.*micro_batch_size.*gradient_checkpointing.*max_new_tok"):
        fit(module, tmp_path, max_steps=1)
    assert backward == []  # refused before the first backward


def test_gradient_checkpointing_from_model_config(tmp_path):
    from comlrl_lightning.agents.memory import is_checkpointing

    grads = []
    from lightning.pytorch import Callback

    class OnBeforeStep(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.append(torch.cat([p.grad.flatten() for p in pl_module.parameters()]))

    for checkpointing in (False, True):
        module = make_module(model_config={"gradient_checkpointing": checkpointing})
        assert all(is_checkpointing(a) == checkpointing for a in module.agents)
        fit(module, tmp_path, max_steps=1, callbacks=[OnBeforeStep()])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="model_config.gradient_checkpointing must be true or false"):
        make_module(model_config={"gradient_checkpointing": "yes"})


_FRESH_PAGES = """
import resource, sys, torch
from comlrl_lightning.agents.memory import keep_freed_memory
kept = sys.argv[1] == "keep" and keep_freed_memory()
faults = []
for _ in range(8):  # a step's activations: 64 MB allocated, written and freed, step after step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * 2**20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, max(faults[4:]), min(faults[4:]))  # once the heap has grown to the step's peak
"""


@pytest.mark.parametrize("keep", [True, False])
def test_fit_on_a_cpu_keeps_freed_memory_for_the_next_step(keep, tmp_path, monkeypatch):
    """keep_freed_cpu_memory: fit asks glibc to keep what a step frees (on_fit_start), so a later step's memory
    costs no page faults; checked in a fresh process, on 64 MB allocated again and again (16k pages)."""
    import subprocess
    import sys

    from comlrl_lightning.algorithms import base

    calls = []
    monkeypatch.setattr(base, "keep_freed_memory", lambda: calls.append(1))  # this test process stays as it is
    fit(make_module(keep_freed_cpu_memory=keep), tmp_path, max_steps=1)
    assert calls == ([1] if keep else [])
    out = subprocess.run(
        [sys.executable, "-c", _FRESH_PAGES, "keep" if keep else "return"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == str(keep)
    assert (int(out[1]) < 1000) if keep else (int(out[2]) > 8000), out  # 16384 pages without


# ----------------------------------------------------------------------------------------------- reference KL
@pytest.mark.parametrize("placement", ["reward", "loss"])
def test_reference_kl(placement, tmp_path):
    module = make_module(reference_kl_enabled=True, reference_kl_coef=0.5, reference_kl_placement=placement)
    if placement == "reward":  # the policy's log-probs are kept while sampling: no scoring forward of its own
        assert module.sampling.keep_logprobs
        module.score_no_grad = lambda *a: pytest.fail("the policy's log-probs were scored again")
    trainer = fit(module, tmp_path, max_steps=3)
    assert module.reference is not None and len(module.reference.models) == 2
    assert not any(p.requires_grad for m in module.reference.models for p in m.parameters())
    assert "reference" not in "".join(module.state_dict())  # never in the trained state / checkpoint
    if placement == "reward":
        kl = column(read_metrics(trainer), "turn_1/reference_kl_mean")
        assert abs(kl[0]) < 1e-5  # the first rollout is sampled by the reference weights (kept = scored log-probs)
        assert kl[-1] > 0
    else:  # the KL term's share of each agent's loss is logged too
        for i in range(2):
            kl = column(read_metrics(trainer), f"agent_{i}/reference_kl_loss")
            assert len(kl) == 3 and abs(kl[0]) < 1e-5 and kl[-1] > 0


def test_no_reference_model_when_disabled_or_zero_coef(tmp_path):
    for kwargs in ({}, {"reference_kl_enabled": True, "reference_kl_coef": 0.0}):
        module = make_module(**kwargs)
        fit(module, tmp_path, max_steps=1)
        assert module.reference is None


# ----------------------------------------------------------------------------------------------- evaluation
def test_evaluation_schedule_and_user_metrics(tmp_path):
    calls = {}

    def eval_logger(agent_completions_turns, batch_items, prompts, test_cases):
        calls["shape"] = (
            len(agent_completions_turns),
            len(agent_completions_turns[0]),
            len(agent_completions_turns[0][0]),
        )
        calls["n_items"] = len(batch_items)
        calls["prompts"] = prompts
        return [{"len": len(c[0])} for c in agent_completions_turns[0]]

    def eval_aggregator(metrics, num_turns):
        return {"turn_1/mean_len": sum(m["len"] for m in metrics) / len(metrics)}

    module = make_module(
        eval_interval=2,
        eval_num_samples=3,
        eval_logger=eval_logger,
        eval_aggregator=eval_aggregator,
        formatters=[lambda it: f"Begin {it['topic']}", lambda it: f"End {it['topic']}"],
    )
    trainer = fit(module, tmp_path, max_steps=3, eval_items=ITEMS[:5])
    rows = read_metrics(trainer)
    # batches 0 and 2 (at updates 0 and 2: one update per batch here), and the final evaluation after update 3
    assert [int(r["step"]) for r in rows if r.get("eval/turn_1/reward_mean")] == [0, 2, 3]
    assert column(rows, "eval/turn_1/mean_len")
    # prompts: each item's own `prompt` field (CoMLRL's contract), not agent 0's formatted prompt
    assert calls == {"shape": (2, 3, 1), "n_items": 3, "prompts": [it["prompt"] for it in ITEMS[:3]]}


def test_validate_runs_whole_eval_set(tmp_path):
    module = make_module()
    trainer = Trainer(logger=False, enable_progress_bar=False, accelerator="cpu", devices=1)
    data = TaskDataModule(dataset=ITEMS, eval_dataset=ITEMS[:3], eval_batch_size=2)
    (result,) = trainer.validate(module, datamodule=data)
    assert "eval/turn_1/reward_mean" in result and "eval/turn_1/expected_return" in result


# ----------------------------------------------------------------------------------------------- export
def test_save_pretrained_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = make_module()
    module.save_pretrained(tmp_path / "export")
    for i in range(2):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / f"agent_{i}")
        AutoTokenizer.from_pretrained(tmp_path / "export" / f"agent_{i}")
        ids = torch.tensor([[1, 2, 3]])
        torch.testing.assert_close(loaded(ids).logits, module.agents[i].eval()(ids).logits)


# ----------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "overrides,fragment",
    [
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"rollout_buffer_size": 0}, "rollout_buffer_size"),
        ({"train_batch_size": 0}, "train_batch_size"),
        ({"num_turns": 0}, "num_turns"),
        ({"num_turns": 2}, "Multi-turn MAGRPO requires an external_transition"),
        ({"advantage_mode": "midrange"}, "advantage_mode must be one of: mean, raw, max, rloo"),
        ({"loss_aggregation": "sum"}, "loss_aggregation"),
        ({"reference_kl_coef": -1.0}, "reference_kl_coef must be >= 0"),
        ({"reference_kl_estimator": "k4"}, "reference_kl_estimator"),
        ({"reference_kl_placement": "advantage"}, "reference_kl_placement"),
        ({"eval_interval": -1}, "eval_interval"),
        ({"eval_num_samples": -1}, "eval_num_samples"),
        ({"joint_mode": "diagonal"}, "joint_mode"),
        ({"discount": 1.5}, "discount"),
        ({"reward_func": None}, "reward_func must be a callable"),
        ({"parallel_training": "ddp"}, "parallel_training only supports: none, mp. Got 'ddp'."),
        ({"parallel_training": "mp"}, "parallel_training='mp' requires explicit agent_devices"),
        ({"agent_devices": "gpu0"}, "agent_devices"),
        ({"temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"generation_kwargs": {"do_sample": False}}, "generation_kwargs must not set"),
        ({"agent_learning_rate": [1e-3]}, "agent_learning_rate"),
        ({"eval_logger": print}, "eval_logger and eval_aggregator"),
    ],
)
def test_bad_config_fails_before_any_model_loads(overrides, fragment, monkeypatch):
    def must_not_load(**_):
        raise AssertionError("a model was loaded before validation finished")

    monkeypatch.setitem(MODEL_FACTORIES, "tiny", must_not_load)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make_module(**overrides)


def test_reward_returning_wrong_count_is_a_clear_error(tmp_path):
    module = make_module(reward_func=lambda a, b: [1.0])
    with pytest.raises(ValueError, match="returned 1 values for 4 joint actions"):
        fit(module, tmp_path, max_steps=1)


@pytest.mark.parametrize(
    "config", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_config_parses(config, capsys):
    """Types, import paths and field names of every shipped config are valid (no models are loaded)."""
    from comlrl_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "class_path: comlrl_lightning." in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------- resume
def test_resume_from_a_mid_epoch_checkpoint_is_exact(tmp_path):
    """fit 4 updates == fit 2, stop, resume from the step-2 checkpoint for 2 more (weights, env_step, data)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(root, max_steps, ckpt_path=None, every=None):
        seed_everything(0)
        module = make_module(rollout_buffer_size=2)
        callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1)] if every else []
        trainer = Trainer(
            max_steps=max_steps,
            logger=CSVLogger(root, name="run"),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=callbacks,
            enable_checkpointing=bool(every),
            accelerator="cpu",
            devices=1,
        )
        seen = []
        collect = module.collect_rollout
        module.collect_rollout = lambda items: (seen.extend(i["prompt"] for i in items), collect(items))[1]
        trainer.fit(
            module, datamodule=TaskDataModule(dataset=ITEMS, prompts_per_step=2, shuffle=True), ckpt_path=ckpt_path
        )
        return module, seen

    full, seen_full = run(tmp_path / "full", 4, every=2)
    ckpt = next((tmp_path / "full" / "ckpt").glob("*step=2.ckpt"))
    resumed, seen_resumed = run(tmp_path / "resumed", 4, ckpt_path=str(ckpt))
    assert seen_resumed == seen_full[4:]  # the resumed run continues the epoch, it does not replay it
    assert resumed.env_step == full.env_step == 16
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------- devices, loggers
def test_model_placement_mode_runs_on_cpu_devices(tmp_path):
    module = make_module(parallel_training="mp", agent_devices=["cpu", "cpu"])
    trainer = fit(module, tmp_path, max_steps=1)
    assert trainer.global_step == 1 and [str(module.agent_device(i)) for i in range(2)] == ["cpu", "cpu"]


@pytest.mark.parametrize("logger_name", ["TensorBoardLogger", "WandbLogger"])
def test_tensorboard_and_wandb_loggers(logger_name, tmp_path, monkeypatch):
    import lightning.pytorch.loggers as loggers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    kwargs = {"save_dir": str(tmp_path)}
    if logger_name == "WandbLogger":
        kwargs.update(project="comlrl-test", offline=True)
    logger = getattr(loggers, logger_name)(**kwargs)
    seed_everything(0)
    trainer = Trainer(
        max_steps=1,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(make_module(), datamodule=TaskDataModule(dataset=ITEMS, prompts_per_step=2))
    assert trainer.global_step == 1
    if logger_name == "WandbLogger":
        logger.experiment.finish()
        assert any(tmp_path.rglob("*.wandb"))
    else:
        assert any(tmp_path.rglob("events.out.tfevents.*"))


def test_resume_from_the_checkpoint_that_closed_an_epoch(tmp_path):
    """A checkpoint written by an epoch's last batch resumes at the start of the next epoch (nothing skipped)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(root, ckpt_path=None, save=False):
        seed_everything(0)
        module = make_module(rollout_buffer_size=2)
        callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1)] if save else []
        trainer = Trainer(
            max_epochs=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            enable_checkpointing=save,
            accelerator="cpu",
            devices=1,
        )
        trainer.fit(module, datamodule=TaskDataModule(dataset=ITEMS[:4], prompts_per_step=2), ckpt_path=ckpt_path)
        return trainer, module

    full_trainer, full = run(tmp_path / "full", save=True)
    ckpt = next((tmp_path / "full" / "ckpt").glob("epoch=0-step=2.ckpt"))
    trainer, resumed = run(tmp_path / "resumed", ckpt_path=str(ckpt))
    assert trainer.global_step == full_trainer.global_step == 4
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_choices_accept_any_case_from_python():
    """From Python a choice is accepted in any case and stored in its canonical spelling (CoMLRL lower-cases);
    the CLI takes the listed spellings."""
    module = make_module(
        joint_mode="CROSS",
        loss_aggregation="Token_Mean",
        reference_kl_placement="LOSS",
        parallel_training="None",
        advantage_mode="mean",
    )
    assert (module.joint_mode, module.loss_aggregation, module.reference_kl_placement, module.parallel_training) == (
        "cross",
        "token_mean",
        "loss",
        "none",
    )
    assert module.hparams["joint_mode"] == "cross"
    with pytest.raises(
        ValueError,
        match=r"Unsupported joint_mode: diagonal \(joint_mode must be one of: aligned, cross, "
        r"align, crossed\)",
    ):
        make_module(joint_mode="diagonal")


@pytest.mark.parametrize("generation_dtype", ["model", "bfloat16"])
def test_bf16_autocast_is_lightnings_precision_setting(generation_dtype, tmp_path):
    """``trainer.precision: bf16-mixed``: sampling and the update's forwards run under bf16 autocast, the weights and
    the optimizer stay float32, and token log-probs are computed in float32 (also when a bf16 copy samples:
    ``generation_dtype``, the usual pairing)."""
    module = make_module(generation_dtype=generation_dtype)
    seen = []
    objective_loss = module.objective.loss

    def spy(logp, batch):
        loss, metrics = objective_loss(logp, batch)
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), loss.dtype))
        return loss, metrics

    module.objective.loss = spy
    seed_everything(0)
    trainer = Trainer(
        max_steps=2,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, datamodule=TaskDataModule(dataset=ITEMS, prompts_per_step=2))
    assert trainer.global_step == 2 and seen
    assert all(on and dtype == torch.bfloat16 and loss == torch.float32 for on, dtype, loss in seen), seen
    assert all(p.dtype == torch.float32 for p in module.agents[0].parameters())
