"""The worked examples of docs/new_algorithm.md: each stays within its line budget, its maths is checked by hand, and
it fits through the CLI with ``class_path``."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from comlrl_lightning import MultiAgentModule, TaskDataModule
from comlrl_lightning.algorithms import Objective
from comlrl_lightning.algorithms.on_policy import PolicyBatch
from comlrl_lightning.core.advantages import BASELINES, compute_advantages
from comlrl_lightning.envs import toy
from comlrl_lightning.examples.entropy_bonus import EntropyMAGRPO
from comlrl_lightning.examples.median_magrpo import MedianMAGRPO
from comlrl_lightning.rollout.sampling import ScoringInputs
from comlrl_lightning.rollout.tree import Node

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "comlrl_lightning" / "examples"
ITEMS = [{"prompt": f"topic {i}", "topic": f"topic {i}"} for i in range(8)]


def lines_of(text: str) -> int:
    """Lines with something on them (the formatter's blank lines are not the example's size)."""
    return sum(bool(line.strip()) for line in text.splitlines())


@pytest.mark.parametrize("name,budget", [("median_magrpo.py", 10), ("entropy_bonus.py", 25)])
def test_the_examples_stay_within_their_line_budget(name, budget):
    """What docs/new_algorithm.md promises: a new algorithm of this kind is this small, docstring included."""
    assert lines_of((EXAMPLES / name).read_text()) <= budget


def test_the_gspo_worked_example_is_the_shipped_code_within_40_lines():
    """docs/new_algorithm.md's GSPO section shows the package's own objective, registration, ratio and config (no copy
    that drifts), in at most 40 non-blank lines."""
    import inspect
    import re

    from comlrl_lightning.algorithms.reinforce import SequenceRatio
    from comlrl_lightning.core.losses import sequence_ratios

    doc = (REPO / "docs" / "new_algorithm.md").read_text()
    section = doc[doc.index("## A worked example: GSPO") : doc.index("and its test builds it")]
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", section, re.S)
    assert len(blocks) == 2 and sum(lines_of(b) for b in blocks) <= 40
    code, config = blocks
    shipped = inspect.getsource(SequenceRatio).strip()
    assert shipped.splitlines()[1:] == code.strip().split("\n\n\ndef ")[0].splitlines()[1:]  # after its decorator
    ratio = inspect.getsource(sequence_ratios)
    for line in code.split("def sequence_ratios")[1].splitlines()[1:]:
        assert line.split("  #")[0].strip() in ratio  # each statement, its comment aside
    for line in config.splitlines()[3:]:
        assert line.split("#")[0].strip() in (REPO / "configs" / "magrpo_gspo.yaml").read_text()


def fit_cli(tmp_path, class_path, *overrides):
    from comlrl_lightning.cli import main

    cli = main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            "--model",
            class_path,
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
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    return cli, rows


# ----------------------------------------------------------------------------------------------- median baseline
def test_registering_the_median_makes_it_an_advantage_mode():
    assert "median" in BASELINES  # registered by importing the example
    returns = torch.tensor([[1.0, 2.0, 10.0], [4.0, 0.0, 1.0]])
    # by hand: medians 2 and 1 -> [-1, 0, 8] and [3, -1, 0]
    assert compute_advantages(returns, "median", normalize=False).tolist() == [[-1.0, 0.0, 8.0], [3.0, -1.0, 0.0]]
    # with normalization any shift baseline gives MAGRPO's advantages (the example's comment says so)
    torch.testing.assert_close(compute_advantages(returns, "median"), compute_advantages(returns, "mean"))


def test_median_magrpo_fits_through_the_cli(tmp_path):
    cli, rows = fit_cli(
        tmp_path,
        "comlrl_lightning.examples.median_magrpo.MedianMAGRPO",
        "--model.init_args.advantage_normalization",
        "false",
        "--trainer.max_steps",
        "2",
    )
    assert isinstance(cli.model, MedianMAGRPO) and cli.model.advantage_mode == "median"
    assert cli.trainer.global_step == 2 and [r for r in rows if r.get("loss")]


def test_an_unregistered_baseline_is_rejected_with_the_registered_names(tmp_path, capsys):
    from comlrl_lightning.cli import main

    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "--config",
                str(REPO / "configs" / "quickstart.yaml"),
                "--model.init_args.advantage_mode",
                "mode",
                "--trainer.default_root_dir",
                str(tmp_path),
            ]
        )
    assert "advantage_mode must be one of: mean, raw, max, rloo, median (got 'mode')" in capsys.readouterr().err


def batch_of(ratio, advantages):
    """A PolicyBatch whose stored log-probs give ``ratio`` against log-probs 0, with weights 1/2 per token."""
    ratio, mask = torch.tensor(ratio), torch.ones(len(ratio), len(ratio[0]), dtype=torch.bool)
    inputs = ScoringInputs(
        input_ids=torch.zeros(1),
        attention_mask=torch.zeros(1),
        position_ids=torch.zeros(1),
        completion_ids=torch.zeros(1),
        completion_mask=mask,
    )
    return PolicyBatch(inputs, torch.tensor(advantages), mask.float() / 2, None, old_logprobs=-ratio.log())


# ----------------------------------------------------------------------------------------------- a new family
class WeightDecay(Objective):
    """The smallest objective: a loss of tensors (an agent's parameters), nothing else."""

    def loss(self, parameters):
        return 1e-3 * sum(p.pow(2).sum() for p in parameters), {}


class WeightDecayOnly(MultiAgentModule):
    """The smallest algorithm on the base class: its objective and its update, nothing else declared."""

    algorithm_name = "WeightDecayOnly"
    objective_class = WeightDecay

    def training_step(self, batch, batch_idx):
        step = self.begin_update(len(batch))  # 1. zero the gradients
        for i, agent in enumerate(self.agents):  # 2. each agent's loss, backward
            loss, metrics = self.objective.loss(agent.parameters())
            step.backward(loss, {**metrics, f"agent_{i}/items": len(batch)})
        self.record.log_step([step.finish()])  # 3. clip, step, log


def test_a_new_family_needs_only_its_own_hooks(tmp_path):
    """Fit, an update's optimizer side (gradient norms, learning rates, one global_step per update) and evaluation (the
    base engine samples one trajectory per item with the task reward) work without setting anything by hand."""
    from lightning.pytorch.loggers import CSVLogger

    seed_everything(0)
    module = WeightDecayOnly(agents="tiny", num_agents=2, reward_func=toy.brevity_reward, max_new_tokens=4)
    trainer = Trainer(
        max_steps=2,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        log_every_n_steps=1,
    )
    data = TaskDataModule(dataset=ITEMS, eval_dataset=ITEMS[:2], prompts_per_step=2, eval_batch_size=2)
    before = [p.detach().clone() for p in module.agents.parameters()]
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, module.agents.parameters()))
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    assert {"agent_0/grad_norm", "agent_0/learning_rate", "agent_1/items"} <= set(rows[0])
    (metrics,) = trainer.validate(module, datamodule=data, verbose=False)
    assert 0.0 <= metrics["eval/turn_1/reward_mean"] <= 1.0


# ----------------------------------------------------------------------------------------------- entropy bonus
def test_the_entropy_bonus_is_twenty_lines():
    text = (EXAMPLES / "entropy_bonus.py").read_text()
    assert lines_of(text[text.index("@dataclass") :]) <= 20  # its field group, its objective and the class


def test_scoring_gives_the_policys_entropy_by_hand():
    """H_t = −Σ_v π(v) log π(v) of the completion positions, from the same forward as the log-probs."""
    from comlrl_lightning.agents import load_agents
    from comlrl_lightning.rollout.sampling import token_logprobs

    seed_everything(0)
    (model,), _ = load_agents("tiny", num_agents=1)
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 10, 11]])
    mask = torch.tensor([[True, True], [True, False]])
    inputs = ScoringInputs(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(5).expand(2, 5),
        completion_ids=ids[:, 3:],
        completion_mask=mask,
    )
    logp, entropy = token_logprobs(model, inputs, entropy=True)
    torch.testing.assert_close(logp, token_logprobs(model, inputs))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, 2:4].float()  # positions 2, 3 predict completion tokens 3, 4
    probs = logits.softmax(-1)
    expected = -(probs * probs.log()).sum(-1) * mask
    torch.testing.assert_close(entropy, expected, atol=1e-5, rtol=1e-5)


def test_the_entropy_bonus_loss_by_hand():
    from comlrl_lightning.examples.entropy_bonus import EntropyBonus

    module = EntropyMAGRPO(agents="tiny", num_agents=2, reward_func=toy.brevity_reward, entropy_coef=0.5)
    assert isinstance(module.objective, EntropyBonus) and module.objective.entropy_coef == 0.5
    objective = EntropyBonus(entropy_coef=0.5)  # no module needed
    batch = batch_of([[1.0, 1.0]], [2.0])  # weights 1/2 per token, advantage 2, old log-probs unused
    batch.entropy = torch.tensor([[1.0, 3.0]])
    logp = torch.tensor([[-1.0, -2.0]])
    # MAGRPO: -(0.5 * 2 * -1 + 0.5 * 2 * -2) = 3; bonus Σ w H = 0.5 * 1 + 0.5 * 3 = 2; loss = 3 - 0.5 * 2 = 2
    loss, diagnostics = objective.loss(logp, batch)
    assert loss.item() == pytest.approx(2.0) and diagnostics["entropy_bonus"].item() == pytest.approx(2.0)


def test_entropy_magrpo_fits_through_the_cli(tmp_path):
    cli, rows = fit_cli(
        tmp_path,
        "comlrl_lightning.examples.entropy_bonus.EntropyMAGRPO",
        "--model.init_args.entropy_coef",
        "0.1",
        "--trainer.max_steps",
        "2",
    )
    assert isinstance(cli.model, EntropyMAGRPO) and cli.trainer.global_step == 2
    assert all(float(r["agent_0/entropy_bonus"]) > 0 for r in rows if r.get("loss"))


def test_a_samples_extras_reach_the_update_and_survive_a_checkpoint():
    """``AgentSamples.extras``: per-sample state of a new algorithm, stored after a rollout, checkpointed with the
    buffer, handed to the objective's ``loss`` as ``PolicyBatch.extras`` (rows in the batch's order)."""
    from comlrl_lightning.algorithms import MAGRPO

    seed_everything(0)
    module = MAGRPO(
        agents="tiny",
        num_agents=2,
        reward_func=toy.brevity_reward,
        num_generations=2,
        max_new_tokens=4,
        eval_interval=0,
        log_completions=False,
    )
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
    for n, node in enumerate(rollout.nodes):
        for sample in node.agents:
            sample.extras["tag"] = torch.tensor([10.0 * n, 10.0 * n + 1])
    buffer = io.BytesIO()
    torch.save([n.state_dict() for n in rollout.nodes], buffer)
    buffer.seek(0)
    restored = [Node.from_state_dict(s) for s in torch.load(buffer, weights_only=True)]
    batch = module.agent_batch(restored, 0)
    assert batch.extras["tag"].tolist() == [0.0, 1.0, 10.0, 11.0]
    assert batch.rows(slice(1, 3)).extras["tag"].tolist() == [1.0, 10.0]
