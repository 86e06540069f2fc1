"""MultiAgentModule: N agents in one LightningModule, one optimizer step per team update.

Lightning decisions (README, docs/differences.md):

* Fields are declared once, in the groups of ``algorithms/fields.py``; building a module only checks them. The
  models load in ``configure_model`` (before a checkpoint is restored; ``module.agents`` also loads them on first
  use), so every configuration error is reported before any model loads.
* Manual optimization: every update steps all agents at once through ONE AdamW with a parameter group per distinct
  model, so ``global_step`` counts team updates and ``max_steps`` means updates. One update skeleton
  (:meth:`update`); the algorithm's objective (``module.objective``, ``objective.py``) supplies the losses. The
  same model object given twice is one set of weights, trained on the sum of the sharing agents' losses (CoMLRL
  steps it once per agent).
* ``env_step`` (joint actions evaluated, CoMLRL's x-axis) is logged with every row and checkpointed with the RNG
  states, so a ``ckpt_path`` resume samples what an uninterrupted run would.

The module's composed parts: the team (``module.team``, ``team.py``: assembly, loading, placement, strategies), the
optimizer (``optimization.py``), evaluation (``module.evaluation``, ``evaluation.py``), the resume state
(``module.run_state``, ``resume.py``) and the run's record of update rows and phase timings (``module.record``,
``runs/record.py``); sharded models are kept whole by a callback (``callbacks/sharding.py``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from comlrl_lightning.agents import CausalLMWithValueHead, save_agents
from comlrl_lightning.agents.memory import enable_checkpointing, keep_freed_memory
from comlrl_lightning.agents.sharding import full_state_dicts, is_sharded, reduce_gradients, refresh, shard
from comlrl_lightning.algorithms import evaluation
from comlrl_lightning.algorithms.fields import (
    AgentFields,
    EvaluationFields,
    FieldGroup,
    OptimizationFields,
    SamplingFields,
    TaskFields,
    build_groups,
    effective_hparams,
    install_init,
    require,
)
from comlrl_lightning.algorithms.objective import Objective
from comlrl_lightning.algorithms.optimization import build_optimizer, clip_and_measure, trained_parameters
from comlrl_lightning.algorithms.resume import RunState
from comlrl_lightning.algorithms.team import (
    assemble_team,
    check_first_items,
    check_strategy,
    load_team,
    trainable_parameters,
)
from comlrl_lightning.config_errors import SECRET_FIELDS
from comlrl_lightning.rollout import weights
from comlrl_lightning.rollout.generation import GenerationBackend, backend_problem
from comlrl_lightning.rollout.rewards import RewardCaller, build_formatters
from comlrl_lightning.rollout.tree import RolloutEngine
from comlrl_lightning.runs import ranks
from comlrl_lightning.runs.files import mark_resumed, run_root
from comlrl_lightning.runs.record import RunRecord


class MultiAgentModule(LightningModule):
    """Base of every algorithm family: the team, the task, sampling, the optimizer, evaluation, checkpoints.

    An algorithm lists its field groups (:attr:`field_groups`, ``algorithms/fields.py``), may change their defaults
    (:attr:`field_defaults`) and names its learning rule (:attr:`objective_class`, ``algorithms/objective.py``:
    the losses of an update, what it keeps from experience, its extra models), held as ``module.objective``. Its
    keyword-only ``__init__`` is generated from the groups (``fields.install_init``); an algorithm never writes one.
    """

    algorithm_name = "MultiAgentModule"
    field_groups: ClassVar[tuple[type[FieldGroup], ...]] = (
        AgentFields,
        TaskFields,
        SamplingFields,
        OptimizationFields,
        EvaluationFields,
    )
    field_defaults: ClassVar[dict[str, Any]] = {}  # a family's own defaults, by field name
    objective_class: ClassVar[type[Objective]]  # what module.objective is: the algorithm's learning rule

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        require(
            "__init__" not in vars(cls),
            f"{cls.__name__} writes __init__: declare its fields in a group (a FieldGroup dataclass added to "
            "field_groups) and its run state in init_state(); its __init__ is generated (docs/new_algorithm.md).",
        )
        install_init(cls, MultiAgentModule.initialize)

    def initialize(self, values: dict[str, Any]) -> None:
        """What the generated ``__init__`` runs: build and check the field groups, store every field as an
        attribute (the objects themselves), the cross-field checks, the saved hyper-parameters, the run state."""
        LightningModule.__init__(self)
        self.automatic_optimization = False
        self.groups = build_groups(type(self), self.prepare_fields(dict(values)))
        self.field_values: dict[str, Any] = {}
        for group in self.groups:
            for name, value in group.values().items():
                if name not in SECRET_FIELDS:  # a credential stays in its group: never an attribute or hyper-parameter
                    object.__setattr__(self, group.attribute_names.get(name, name), value)
                    self.field_values[name] = value
        self.objective = self.make_objective()
        self.check_config()
        for objective in self.objectives():
            objective.check()
        self.save_hyperparameters(effective_hparams(self.field_values, self.__dict__))
        self.sampling = self.group(SamplingFields).sampling
        self.task_reward = RewardCaller(
            self.team.reward_func, self.reward_processor, self.reward_timeout, where=self.describe_step
        )
        self.prompt_formatters = build_formatters(self.team.formatters, self.num_agents)
        self.engine = self.build_engine()
        self.record, self.run_state = RunRecord(self), RunState(self)
        self.evaluation = self.objective.evaluation_class(self)
        self.init_state()
        self.env_step = 0  # joint actions evaluated so far (CoMLRL's x-axis), checkpointed

    def make_objective(self) -> Objective:
        """``module.objective``, the learning rule the module's loop trains with: ``objective_class``'s."""
        return self.objective_class(self)

    def objectives(self) -> list[Objective]:
        """Every objective of the module (MARLHF: its RL objective and its reward-model stage's): their models are
        the module's."""
        return [self.objective]

    def group(self, kind: type[FieldGroup]) -> FieldGroup:
        """This module's field group of type ``kind``."""
        return next(g for g in self.groups if isinstance(g, kind))

    def prepare_fields(self, values: dict[str, Any]) -> dict[str, Any]:
        """The keyword values before the groups are built from them (MARLHF fills its backend's defaults)."""
        return values

    def init_state(self) -> None:
        """A family's run state, set once every field is stored and checked. Families extend it."""

    def check_config(self) -> None:
        """The rules that involve several fields; run before any model loads. Families extend it."""
        self.team = assemble_team(self.field_values)  # sources, devices, learning rates, LoRA plan (team.py)
        self.num_agents = self.team.num_agents
        problem = backend_problem(
            self.generation_backend, self.generation_kwargs, self.generation_dtype, lora=self.lora is not None
        )
        require(problem is None, problem or "")

    @property
    def collaboration(self) -> Any:
        """A centralized team's adapter and reward (``rollout/centralized.py``); None for N agents."""
        return self.team.collaboration

    @property
    def lora(self) -> dict[str, Any] | None:
        """A LoRA team's plan (``team.lora_plan``), else None."""
        return self.team.lora

    def build_engine(self) -> RolloutEngine:
        """``module.engine``, what the module's loop and evaluation sample with; the base's samples one single-turn
        trajectory per item (what evaluation needs). A loop overrides it with its options."""
        return self.make_engine()

    def make_engine(self, **options: Any) -> RolloutEngine:
        """A rollout engine of the team: its formatters, task reward, sampling settings, chat template and
        generation backend, plus ``options`` (samples per prompt, turns, joint mode, ...)."""
        return RolloutEngine(
            num_agents=self.num_agents,
            formatters=self.prompt_formatters,
            reward=self.task_reward,
            sampling=self.sampling,
            use_chat_template=self.use_chat_template,
            backend=self.generation_engine,
            **{"num_generations": 1, **options},
        )

    @property
    def generation_engine(self) -> GenerationBackend:
        """The module's one generation backend (``generation_backend``): every engine of the module samples
        through it."""
        if getattr(self, "_generation_engine", None) is None:
            self._generation_engine = self.group(SamplingFields).make_backend(concurrent=self.samples_concurrently)
        return self._generation_engine

    # ------------------------------------------------------------------ models
    def configure_model(self) -> None:
        """Load the team (and the objective's other models, ``objective.build_models``) once; idempotent. Under FSDP
        (``ModelParallelStrategy``) each model of :meth:`sharded_models` is then sharded over the ranks."""
        if "agents" not in self._modules:
            models, self._tokenizers = load_team(self.team)
            for model in {id(m): m for m in models}.values():
                self.apply_gradient_checkpointing(model)
            self._modules["agents"] = nn.ModuleList(models)
            for objective in self.objectives():
                objective.build_models()
        self.shard_models()

    def shard_models(self) -> None:
        """Under FSDP2 (``ModelParallelStrategy``): shard each model of :meth:`sharded_models` not sharded yet."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if type(strategy).__name__ == "ModelParallelStrategy":
            for model in self.sharded_models():
                if not is_sharded(model):
                    shard(model, strategy.device_mesh["data_parallel"])

    def sharded_models(self) -> list[nn.Module]:
        """The distinct models FSDP shards (every trained model): the agents and the objectives' (critics, a reward
        model)."""
        return list({id(m): m for m in self.agents}.values()) + [m for o in self.objectives() for m in o.models()]

    def updated_models(self, objective: Objective) -> list[nn.Module]:
        """The sharded models an update of ``objective`` trains (their gradients are reduce-scattered)."""
        agents = list({id(m): m for m in self.agents}.values()) if objective.trains_agents else []
        return [m for m in agents + objective.models() if is_sharded(m)]

    @property
    def agents(self) -> nn.ModuleList:
        if "agents" not in self._modules:
            self.configure_model()
        return self._modules["agents"]

    @property
    def tokenizers(self) -> list[Any]:
        self.agents  # noqa: B018  (loads the team with its tokenizers)
        return self._tokenizers

    def agent_groups(self) -> list[list[int]]:
        """Agent indices grouped by model identity (a group of several = shared weights)."""
        groups: dict[int, list[int]] = {}
        for i, model in enumerate(self.agents):
            groups.setdefault(id(model), []).append(i)
        return list(groups.values())

    def policy_model(self, i: int) -> nn.Module:
        """Agent i's language model for sampling and scoring (the backbone when a value head wraps it)."""
        model = self.agents[i]
        return model.model if isinstance(model, CausalLMWithValueHead) else model

    def policy_models(self) -> list[nn.Module]:
        return [self.policy_model(i) for i in range(self.num_agents)]

    def agent_device(self, i: int) -> torch.device:
        return next(self.agents[i].parameters()).device

    @property
    def samples_concurrently(self) -> bool:
        """Agents on distinct devices (``parallel_training: mp``) generate at the same time, one thread each."""
        return self.parallel_training == "mp" and len(set(map(str, self.team.devices))) > 1

    def apply_gradient_checkpointing(self, model: nn.Module) -> None:
        """Turn on ``model_config.gradient_checkpointing`` for a trained model (agent or critic)."""
        if self.team.gradient_checkpointing:
            enable_checkpointing(model)

    def save_pretrained(self, output_dir: str | Path) -> None:
        """``output_dir/agent_{i}/`` with each agent's weights and tokenizer (HF format). With sharded agents, call
        it on every rank: the agents are gathered and rank 0 writes."""
        states = full_state_dicts(list(self.agents))
        with ranks.rank_zero_first() as writer:
            if writer:
                save_agents(list(self.agents), self.tokenizers, output_dir, state_dicts=states)
        for objective in self.objectives():
            objective.save_pretrained(Path(output_dir))

    def describe_step(self) -> str:
        """Where a run is, for error messages: the update and env_step counters."""
        return f"update {self.global_step} (env_step {self.env_step})"

    def fit_epochs(self) -> int | None:
        """Epochs a fit must run when the algorithm fixes them (iterative rounds), else None (``trainer.max_epochs``
        decides). The CLI uses it as the default of ``trainer.max_epochs``."""
        return None

    # ------------------------------------------------------------------ the optimizer and the update skeleton
    def optimizer_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups: one per distinct agent model, then the objectives' (critics, a reward model)."""
        return [
            {
                "params": trainable_parameters(self.agents[ids[0]]),
                "lr": self.team.learning_rates[ids[0]],
                "name": f"agent_{ids[0]}",
                "agents": ids,
            }
            for ids in self.agent_groups()
        ] + [group for o in self.objectives() for group in o.parameter_groups()]

    def configure_optimizers(self):
        return build_optimizer(
            self.optimizer_groups(),
            self.adamw_implementation,
            self.weight_decay,
            self.lr_warmup_steps,
            self.lr_decay,
            self.lr_decay_steps,
            self.lr_min_ratio,
            self._trainer.max_steps if self._trainer is not None else -1,
        )

    def update(self, batch: Any, objective: Objective | None = None) -> dict[str, float]:
        """One team update of ``objective`` (default ``module.objective``) on a mini-batch: one optimizer step, one
        ``global_step``. In a data-parallel run every rank updates together, each on its own mini-batch (possibly
        empty), with gradients averaged over the ranks by rows before clipping, so every rank holds the same weights
        after it."""
        objective = objective or self.objective
        with self.record.timed("update"):
            self.generation_engine.release_memory()  # vLLM's sleep mode: the engines' memory is the update's now
            optimizer = self.optimizers()
            optimizer.zero_grad()
            sums: dict[str, Any] = defaultdict(float)
            # DDP's reducer expects one backward per forward; ours are one per agent, so it stays off and the
            # gradients are averaged once below.
            no_sync = getattr(self.trainer.strategy, "block_backward_sync", contextlib.nullcontext)
            sharded = self.updated_models(objective)
            # Sharded agents: FSDP averages over ranks; scaling by rows x D / all rows makes it row-weighted.
            scale = len(batch) * ranks.world_size() / max(ranks.reduce_sum(len(batch)), 1) if sharded else 1.0
            with no_sync():
                for loss, diagnostics in objective.losses(batch) if len(batch) else ():  # one graph at a time
                    self.manual_backward(loss * scale if sharded else loss)
                    for key, value in diagnostics.items():  # summed on the device, read once below (a tensor
                        # joins the running total's device: agents placed on different devices add to one loss)
                        value = value.detach() if isinstance(value, Tensor) else value
                        total = sums[key]
                        sums[key] = total + (value.to(total.device) if isinstance(total, Tensor) else value)
            with self.record.timed("gradient_sync"):  # data-parallel runs: one all-reduce per update (else nothing)
                if sharded:
                    reduce_gradients(sharded)
                else:
                    ranks.average_gradients((p for g in optimizer.param_groups for p in g["params"]), len(batch))
            metrics = {
                **clip_and_measure(trained_parameters(self.trained_models(), optimizer), self.max_grad_norm),
                **(self.batch_metrics(batch, objective) if len(batch) else {}),
                **{key: float(value) for key, value in sums.items()},
            }
            for group in optimizer.param_groups:  # the rate this update used
                metrics[f"{group.get('name', 'group')}/learning_rate"] = group["lr"]
            trained = [any(p.grad is not None for p in group["params"]) for group in optimizer.param_groups]
            optimizer.step()
            refresh(sharded)  # sharded models: gather the updated weights
            weights.weights_changed()  # a generation copy of the weights (generation_dtype) is now stale
            scheduler = self.lr_schedulers()
            if scheduler is not None:
                scheduler.step_groups(trained)
        return {**metrics, **self.record.take_timings()}

    def batch_metrics(self, batch: Any, objective: Objective) -> dict[str, float]:
        """Metrics of the mini-batch itself, taken before the optimizer step (the objective's; a loop adds its own)."""
        return objective.batch_metrics(batch)

    def trained_models(self) -> list[tuple[list[str], nn.Module]]:
        """(metric names, model) of every trained model: the agents, then the objectives'. The first name is the
        model's parameter group's."""
        agents = [([f"agent_{i}" for i in ids], self.agents[ids[0]]) for ids in self.agent_groups()]
        return agents + [trained for o in self.objectives() for trained in o.trained_models()]

    def count_env_steps(self, joint_actions: int) -> None:
        """Add the joint actions of a step — over every rank — to ``env_step``."""
        self.env_step += int(ranks.reduce_sum(joint_actions))

    def completion_records(self, max_nodes: int) -> list[dict[str, Any]]:
        """What the agents wrote in the last training step, for ``CompletionsLogger`` (a family with samples to
        show overrides it; the base has none)."""
        return []

    @property
    def updates_done(self) -> int:
        """The updates that made the current weights: ``global_step`` during a fit, the checkpoint's when a
        ``validate``/``test``/``predict`` run loaded one."""
        return max(self.global_step, self.run_state.checkpoint_step)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        check_strategy(self.trainer, self)
        if self.trainer.datamodule is not None:  # before any model loads (configure_model is next)
            check_first_items(self.trainer.datamodule, stage, self.prompt_formatters)
        run_root(self.trainer)  # read on every rank now; later only rank 0 writes there

    def on_fit_start(self) -> None:
        mark_resumed(self.trainer)  # a resumed run's folder names its checkpoint (analysis.load_run)
        if self.keep_freed_cpu_memory and self.device.type == "cpu":
            keep_freed_memory()  # no page fault per fresh page, step after step (agents/memory.py)
        self.record.chart_against_env_step(self.loggers)
        if self.team.devices is not None:
            # Model placement: each whole agent on its device (Lightning moved everything to one).
            for model, device in zip(self.agents, self.team.devices):
                model.to(device)
        for objective in self.objectives():
            objective.place_models()

    def configure_callbacks(self):
        """The optional parts of a run this module's config turns on."""
        from comlrl_lightning.callbacks import CompletionsLogger, EvaluationCallback, PhaseTimer, PredictionWriter
        from comlrl_lightning.callbacks.conventions import run_conventions
        from comlrl_lightning.callbacks.evaluation import EvaluationRows
        from comlrl_lightning.callbacks.sharding import WholeModels

        callbacks = [PhaseTimer()]
        if self.eval_interval > 0 and self.eval_num_samples > 0:
            callbacks.append(EvaluationCallback(self.eval_interval, self.eval_num_samples, at_end=self.eval_at_end))
        if self.log_completions:
            callbacks.append(CompletionsLogger())
        callbacks += [PredictionWriter(), EvaluationRows(), WholeModels()]  # WholeModels after those that evaluate
        return callbacks + run_conventions(self._trainer)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["comlrl_lightning"] = self.run_state.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.run_state.load_state_dict(checkpoint.get("comlrl_lightning", {}), checkpoint.get("global_step", 0))

    def on_train_start(self) -> None:
        self.run_state.restore_rng()

    # ------------------------------------------------------------------ evaluation (module.evaluation)
    # The ``validate`` and ``test`` subcommands: ``EvaluationRows`` writes the records these return as one row.
    def validation_step(self, batch: list[Any], batch_idx: int) -> dict[str, Any]:
        return self.evaluation.record(batch)

    def test_step(self, batch: list[Any], batch_idx: int) -> dict[str, Any]:
        return self.evaluation.record(batch)

    # The ``predict`` subcommand: what the team answers, item by item (``PredictionWriter`` writes it to JSONL).
    def predict_step(self, batch: list[Any], batch_idx: int) -> list[dict[str, Any]]:
        """Per item: each agent's prompt and completion per turn (one sampled trajectory, as in evaluation) and the
        team reward per turn."""
        return evaluation.answers(batch, self.evaluation.rollout(batch))


install_init(MultiAgentModule, MultiAgentModule.initialize)
