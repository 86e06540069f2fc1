"""MultiAgentModule: N agents in one LightningModule, one optimizer step per team update.

Lightning decisions (README, docs/differences.md):

* Fields are declared once (``fields.py``); building a module only checks them. The models load in
  ``configure_model`` (before a checkpoint is restored; ``module.agents`` also loads them on first use), so every
  configuration error is reported before any model loads.
* Manual optimization: ONE AdamW, a parameter group per distinct model, steps the team at once, so ``global_step``
  counts team updates and ``max_steps`` means updates. Each loop writes its update as one function (``update``) with
  the optimizer side from :meth:`begin_update` (``optimization.UpdateStep``); the algorithm's objective
  (``module.objective``, ``objective.py``) is a loss of tensors. The same model object given twice
  is one set of weights, trained on the sum of the sharing agents' losses (CoMLRL steps it once per agent).
* ``env_step`` (joint actions evaluated, CoMLRL's x-axis) is logged with every row and checkpointed with the RNG
  states, so a ``ckpt_path`` resume samples what an uninterrupted run would.

Composed parts: the team (``module.team``, ``team.py``), the optimizer (``optimization.py``), the objective, the
models trained besides the agents (``model_parts``: critics, a reward model), evaluation (``module.evaluation``), the resume state (``module.run_state``) and the run's record
(``module.record``, ``runs/record.py``); sharded models are kept whole by a callback (``callbacks/sharding.py``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule
from torch import nn

from comlrl_lightning.agents import CausalLMWithValueHead
from comlrl_lightning.agents.memory import keep_freed_memory
from comlrl_lightning.agents.sharding import is_sharded
from comlrl_lightning.algorithms import evaluation
from comlrl_lightning.algorithms.fields import (
    AgentFields,
    EvaluationFields,
    FieldGroup,
    OptimizationFields,
    RewardComponentFields,
    SamplingFields,
    ScheduleFields,
    TaskFields,
    build_groups,
    effective_hparams,
    install_init,
    require,
    store_fields,
)
from comlrl_lightning.algorithms.objective import ModelPart, Objective
from comlrl_lightning.algorithms.optimization import (
    UpdateStep,
    agent_parameter_groups,
    agent_trained_models,
    build_optimizer,
)
from comlrl_lightning.algorithms.resume import RunState, report_changed_fields
from comlrl_lightning.algorithms.schedule import AgentSchedule, shared_models
from comlrl_lightning.algorithms.team import (
    agent_groups,
    assemble_team,
    check_first_items,
    check_strategy,
    export,
    load_models,
    place_models,
)
from comlrl_lightning.config_errors import SECRET_FIELDS
from comlrl_lightning.rollout.generation import GenerationBackend, backend_problem
from comlrl_lightning.rollout.rewards import RewardCaller, build_formatters
from comlrl_lightning.rollout.tree import RolloutEngine
from comlrl_lightning.runs import ranks
from comlrl_lightning.runs.files import mark_resumed, run_root
from comlrl_lightning.runs.record import RunRecord


class MultiAgentModule(LightningModule):
    """Base of every algorithm family: the team, the task, sampling, the optimizer, evaluation, checkpoints.

    An algorithm lists its field groups (:attr:`field_groups`, ``algorithms/fields.py``), may change their defaults
    (:attr:`field_defaults`) and names its learning rule (:attr:`objective_class`, ``algorithms/objective.py``: a
    loss of tensors built from the fields), held as ``module.objective``; its loop's ``update`` feeds it. Its
    keyword-only ``__init__`` is generated from the groups (``fields.install_init``); an algorithm never writes one.
    """

    algorithm_name = "MultiAgentModule"
    field_groups: ClassVar[tuple[type[FieldGroup], ...]] = (
        AgentFields,
        ScheduleFields,
        TaskFields,
        RewardComponentFields,
        SamplingFields,
        OptimizationFields,
        EvaluationFields,
    )
    field_defaults: ClassVar[dict[str, Any]] = {}  # a family's own defaults, by field name
    objective_class: ClassVar[type[Objective]]  # what module.objective is: the algorithm's learning rule
    evaluation_class: ClassVar[type[evaluation.Evaluation]] = evaluation.Evaluation  # what module.evaluation is
    normalizes_components: ClassVar[bool] = False  # reward_aggregation normalize_components (the MAGRPO family)
    steps_sequentially: ClassVar[bool] = False  # agent_update_schedule sequential (the on-policy families)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        install_init(cls, MultiAgentModule.initialize)  # refuses a class that writes its own

    def initialize(self, values: dict[str, Any]) -> None:
        """What the generated ``__init__`` runs: build and check the field groups, store every field as an
        attribute (the objects themselves), the cross-field checks, the saved hyper-parameters, the run state."""
        LightningModule.__init__(self)
        self.automatic_optimization = False
        self.groups = build_groups(type(self), self.prepare_fields(dict(values)))
        self.field_values = store_fields(self, self.groups, SECRET_FIELDS)
        self.check_config()
        self.objective = self.make_objective()
        hparams = effective_hparams(self.field_values, self.__dict__)
        if self.collaboration is not None:  # a centralized team: ONE actor model, num_agents roles (as CoMLRL saves)
            hparams["num_agents"] = self.collaboration.num_roles
        self.save_hyperparameters(hparams)
        self.sampling = self.group(SamplingFields).sampling
        self.task_reward = RewardCaller(
            self.team.reward_func,
            self.reward_processor,
            self.reward_timeout,
            where=self.describe_step,
            component_weights=self.reward_component_weights,
        )
        self.prompt_formatters = build_formatters(self.team.formatters, self.num_agents)
        self.engine = self.build_engine()
        self.record, self.run_state = RunRecord(self), RunState(self)
        self.evaluation = self.evaluation_class(self)
        self.init_state()
        self.env_step = 0  # joint actions evaluated so far (CoMLRL's x-axis), checkpointed

    def make_objective(self) -> Objective:
        """``module.objective``, the learning rule the module's loop trains with: ``objective_class`` built with
        the fields its constructor names (after every check, so a derived value is what it gets)."""
        return self.objective_class.from_fields(self.__dict__)

    def model_parts(self) -> list[ModelPart]:
        """The parts that own models trained besides the agents (IAC/MAAC's critics, MARLHF's reward model)."""
        return []

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
        self.agent_schedule = AgentSchedule(
            self.num_agents,
            self.trained_agents,
            self.agent_update_schedule,
            self.alternate_every,
            self.alternate_groups,
            self.sequential_order,
            shared=shared_models(self.agent_sources, self.num_agents),
        )
        require(
            self.agent_update_schedule != "sequential" or self.steps_sequentially,
            f"agent_update_schedule=sequential weighs each later agent's advantages by the ratios of the agents "
            f"updated before it; {self.algorithm_name}'s update has no advantages: use simultaneous or alternating.",
        )
        require(
            self.reward_aggregation == "sum" or self.normalizes_components,
            f"reward_aggregation=normalize_components normalises components within a group of samples, which "
            f"{self.algorithm_name} does not have: use the MAGRPO family, or reward_aggregation=sum.",
        )
        problem = backend_problem(
            self.generation_backend, self.generation_kwargs, self.generation_dtype, lora=self.lora is not None
        )
        require(problem is None, problem or "")
        if self.generation_backend == "vllm":  # the engine's limits, from each model's config (no weights loaded)
            from comlrl_lightning.agents.architecture import architecture
            from comlrl_lightning.rollout.backends.vllm import unsupported_architecture

            kwargs = (self.model_config or {}).get("model_kwargs")
            devices = self.team.devices or [torch.device("cuda" if torch.cuda.is_available() else "cpu")]
            problem = unsupported_architecture(
                [architecture(source, kwargs) for source in self.team.sources], devices[0].type
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
        """The module's one generation backend (``generation_backend``): every engine of the module samples through
        it. Agents on distinct devices (``parallel_training: mp``) generate at the same time, one thread each."""
        if getattr(self, "_generation_engine", None) is None:
            concurrent = self.parallel_training == "mp" and len(set(map(str, self.team.devices))) > 1
            self._generation_engine = self.group(SamplingFields).make_backend(concurrent=concurrent)
        return self._generation_engine

    # ------------------------------------------------------------------ models
    def configure_model(self) -> None:
        """Load the team and the objectives' models once, then shard them under FSDP2 (``team.load_models``)."""
        load_models(self)

    def sharded_models(self) -> list[nn.Module]:
        """The distinct models FSDP shards (every trained model): the agents and the model parts' (critics, a reward
        model)."""
        return list({id(m): m for m in self.agents}.values()) + [m for p in self.model_parts() for m in p.models()]

    @property
    def agents(self) -> nn.ModuleList:
        if "agents" not in self._modules:
            self.configure_model()
        return self._modules["agents"]

    @property
    def tokenizers(self) -> list[Any]:
        self.agents  # noqa: B018  (loads the team with its tokenizers)
        return self._tokenizers

    def policy_model(self, i: int) -> nn.Module:
        """Agent i's language model for sampling and scoring (the backbone when a value head wraps it)."""
        model = self.agents[i]
        return model.model if isinstance(model, CausalLMWithValueHead) else model

    def policy_models(self) -> list[nn.Module]:
        return [self.policy_model(i) for i in range(self.num_agents)]

    def agent_device(self, i: int) -> torch.device:
        return next(self.agents[i].parameters()).device

    def save_pretrained(self, output_dir: str | Path) -> None:
        """``output_dir/agent_{i}/`` with each agent's weights and tokenizer (HF format), and the model parts' models
        (critics, a reward model). With sharded models, call it on every rank: rank 0 writes (``team.export``)."""
        export(self, Path(output_dir))

    def describe_step(self) -> str:
        """Where a run is, for error messages: the update and env_step counters."""
        return f"update {self.global_step} (env_step {self.env_step})"

    def parts(self) -> list[Any]:
        """Composed parts that take part in the fit (``module.pairs``): ``setup(trainer, stage)``, ``callbacks()``,
        ``attach(datamodule)`` when the fit starts, ``save(state)``/``load(state)`` in checkpoints, ``fit_epochs()``."""
        return []

    def fit_epochs(self) -> int | None:
        """Epochs a fit must run when a part fixes them (iterative rounds), else None (``trainer.max_epochs``
        decides). The CLI uses it as the default of ``trainer.max_epochs``."""
        return next((e for e in (part.fit_epochs() for part in self.parts()) if e is not None), None)

    # ------------------------------------------------------------------ the optimizer and an update's optimizer side
    def configure_optimizers(self):
        trained = self.agent_schedule.trained  # a frozen agent has no parameter group: no optimizer state
        agents = agent_parameter_groups(self.agents, self.team.learning_rates, trained)  # loads the team and parts
        parts = [group for part in self.model_parts() for group in part.parameter_groups()]
        return build_optimizer(
            agents + parts,
            self.adamw_implementation,
            self.weight_decay,
            self.lr_warmup_steps,
            self.lr_decay,
            self.lr_decay_steps,
            self.lr_min_ratio,
            self._trainer.max_steps if self._trainer is not None else -1,
        )

    def trained_models(self) -> list[tuple[list[str], nn.Module]]:
        """(metric names, model) of every model the module trains: each distinct trained agent model, then the
        parts'."""
        trained = agent_trained_models(self.agents, self.agent_schedule.trained)
        return trained + [t for part in self.model_parts() for t in part.trained_models()]

    def begin_update(
        self, rows: int, parts: list[ModelPart] | None = None, agents: list[int] | None = None
    ) -> UpdateStep:
        """The optimizer side of one update on ``rows`` rows that trains ``agents`` (default: every trained agent;
        ``[]``: none) and the models of ``parts`` (default: every part): gradients zeroed now;
        ``step.backward(loss, metrics)`` per forward, ``step.finish()`` clips, steps and returns the metrics
        (``optimization.UpdateStep``)."""
        self.generation_engine.release_memory()  # vLLM's sleep mode: the engines' memory is the update's now
        parts = self.model_parts() if parts is None else parts
        agents = self.agent_schedule.trained if agents is None else agents
        models = [self.agents[ids[0]] for ids in agent_groups(self.agents, agents)]
        models += [m for part in parts for m in part.models()]
        strategy = self.trainer.strategy
        return UpdateStep(
            self.optimizers(),
            self.lr_schedulers(),
            self.trained_models(),
            [m for m in models if is_sharded(m) and any(p.requires_grad for p in m.parameters())],  # frozen: none
            rows,
            self.manual_backward,
            getattr(strategy, "block_backward_sync", contextlib.nullcontext),
            self.max_grad_norm,
        )

    def count_env_steps(self, joint_actions: int) -> None:
        """Add the joint actions of a step — over every rank — to ``env_step``."""
        self.env_step += int(ranks.reduce_sum(joint_actions))

    def completion_records(self, max_nodes: int) -> list[dict[str, Any]]:
        """What the agents wrote in the last training step, for ``CompletionsLogger`` (a family with samples to
        show overrides it; the base has none)."""
        return []

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        check_strategy(self.trainer, self)
        if self.trainer.datamodule is not None:  # before any model loads (configure_model is next)
            check_first_items(self.trainer.datamodule, stage, self.prompt_formatters)
        run_root(self.trainer)  # read on every rank now; later only rank 0 writes there
        for part in self.parts():
            part.setup(self.trainer, stage)

    def on_fit_start(self) -> None:
        mark_resumed(self.trainer)  # a resumed run's folder names its checkpoint (analysis.load_run)
        if self.keep_freed_cpu_memory and self.device.type == "cpu":
            keep_freed_memory()  # no page fault per fresh page, step after step (agents/memory.py)
        self.record.chart_against_env_step(self.loggers)
        self.run_state.mark_completed(at_fit_start=True)  # what a stop before the first step keeps (resume.py)
        place_models(self)  # each whole model on its device (Lightning moved everything to one)
        for part in self.parts():
            part.attach(self.trainer.datamodule)

    def configure_callbacks(self):
        """The parts of a run this module's config turns on (``callbacks/conventions.py``)."""
        from comlrl_lightning.callbacks.conventions import module_callbacks

        return module_callbacks(self) + [callback for part in self.parts() for callback in part.callbacks()]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["comlrl_lightning"] = self.run_state.state_dict()
        checkpoint["comlrl_lightning"]["agent_schedule"] = self.agent_schedule.state_dict()
        for part in self.parts():
            part.save(checkpoint["comlrl_lightning"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        report_changed_fields(self, checkpoint)  # a resumed fit whose fields differ from the checkpoint's
        state = checkpoint.get("comlrl_lightning", {})
        self.run_state.load_state_dict(state, checkpoint.get("global_step", 0))
        self.agent_schedule.load_state_dict(state.get("agent_schedule", {}))
        for part in self.parts():
            part.load(state)

    def on_train_start(self) -> None:
        self.run_state.restore_rng()
        self.run_state.mark_completed()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.run_state.mark_completed()  # after the step's checkpoint, if any: what a stop in the next step keeps

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
