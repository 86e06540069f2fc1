"""MultiAgentModule: N agents in one LightningModule, one optimizer step per team update.

Lightning decisions (README, docs/differences.md):

* Fields are declared once, in the groups of ``algorithms/fields.py``; a module is the groups it uses. Building a
  module only checks its configuration; the models are loaded in ``configure_model`` (Lightning calls it before
  restoring a checkpoint; ``module.agents`` also loads them on first use), so every configuration error is
  reported before any model loads.
* Manual optimization. Every update steps all agents at once through ONE ``torch.optim.AdamW`` holding one
  parameter group per distinct model (lr per agent; critics and reward models add theirs), so
  ``trainer.global_step`` counts team updates and ``max_steps`` means "updates" (Lightning would otherwise count
  N steps per update, issue 17958). An optional warm-up/decay schedule (``lr_*``) is stepped once per update.
* One update skeleton (:meth:`update`): zero_grad, then one backward per loss the family yields from
  :meth:`losses` (a micro-batch of one agent at a time, so one graph is alive at a time), finite checks, gradient
  norms and clipping, one optimizer and schedule step, timing. A family supplies the losses.
* The same model object given twice is one set of weights: one parameter group, one optimizer state, trained
  on the sum of the sharing agents' losses (CoMLRL steps it once per agent — an m-fold step).
* ``env_step`` (joint actions evaluated, CoMLRL's x-axis) is logged with every metric and checkpointed, with the
  RNG states, so ``ckpt_path`` resume samples what an uninterrupted run would.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Mapping, Sequence

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from comlrl_lightning.agents import CausalLMWithValueHead, load_agents, resolve_devices, save_agents
from comlrl_lightning.agents.loading import validate_agent_sources
from comlrl_lightning.agents.lora import LoRATeam
from comlrl_lightning.agents.memory import (
    check_update_memory,
    enable_checkpointing,
    keep_freed_memory,
)
from comlrl_lightning.agents.sharding import (
    full_state_dicts,
    gathered,
    is_sharded,
    reduce_gradients,
    refresh,
    shard,
)
from comlrl_lightning.algorithms import evaluation
from comlrl_lightning.algorithms.fields import (
    AgentFields,
    EvaluationFields,
    FieldGroup,
    OptimizationFields,
    SamplingFields,
    TaskFields,
    args_docstring,
    build_groups,
    require,
    signature_of,
)
from comlrl_lightning.algorithms.optimization import LearningRateSchedule, UpdateScheduler, adamw_kernel
from comlrl_lightning.algorithms.team import check_strategy, lora_plan, team_for, team_placement, trainable_parameters
from comlrl_lightning.algorithms.user_state import load_user_states, save_user_states
from comlrl_lightning.callbacks.checkpoints import wandb_identity
from comlrl_lightning.config_errors import SECRET_FIELDS, ConfigurationError
from comlrl_lightning.rollout import generation, weights
from comlrl_lightning.rollout.generation import backend_problem, make_backend
from comlrl_lightning.rollout.rewards import RewardCaller, build_formatters, check_reward_signature
from comlrl_lightning.rollout.sampling import ScoringInputs, forward_tokens, select_rows, token_logprobs
from comlrl_lightning.rollout.seeding import rng_state, set_rng_state
from comlrl_lightning.rollout.tree import RolloutEngine
from comlrl_lightning.runs import ranks
from comlrl_lightning.runs.files import RESUMED_FROM, run_root

MODEL_CONFIG_KEYS = (
    "dtype",
    "torch_dtype",
    "attn_implementation",
    "special_tokens",
    "model_kwargs",
    "gradient_checkpointing",
)


class MultiAgentModule(LightningModule, metaclass=abc.ABCMeta):
    """Base of every algorithm family: the team, the task, sampling, the optimizer, evaluation, checkpoints.

    A family lists its field groups (:attr:`field_groups`, ``algorithms/fields.py``), may change their defaults
    (:attr:`field_defaults`), and overrides the small hooks it needs: :meth:`check_config` (rules across fields),
    :meth:`init_state` (its own run state), :meth:`build_models` (critics, reward models), :meth:`losses` (what
    one update backpropagates) and :meth:`batch_metrics`. Its keyword-only ``__init__`` is generated from the
    groups (``fields.signature_of``); a family never writes one.
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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        require(
            "__init__" not in vars(cls),
            f"{cls.__name__} writes __init__: declare its fields in a group (a FieldGroup dataclass added to "
            "field_groups) and its run state in init_state(); its __init__ is generated (docs/new_algorithm.md).",
        )
        install_init(cls)

    def initialize(self, values: dict[str, Any]) -> None:
        """What the generated ``__init__`` runs: build and check the field groups, store every field as an
        attribute (the objects themselves), the cross-field checks, the saved hyper-parameters, the run state."""
        LightningModule.__init__(self)
        self.automatic_optimization = False
        self.groups = build_groups(type(self), self.prepare_fields(dict(values)))
        self.field_values: dict[str, Any] = {}
        for group in self.groups:
            for name, value in group.values().items():
                if name in SECRET_FIELDS:  # a credential stays in its group: never an attribute or hyper-parameter
                    continue
                object.__setattr__(self, group.attribute_names.get(name, name), value)
                self.field_values[name] = value
        self.check_config()
        self.save_hyperparameters(plain_hparams(self.effective_values()))
        self.sampling = self.group(SamplingFields).sampling
        self.task_reward = RewardCaller(
            self.team.reward_func, self.reward_processor, self.reward_timeout, where=self.describe_step
        )
        self.prompt_formatters = build_formatters(self.team.formatters, self.num_agents)
        self.engine = self.build_engine()
        self.env_step = 0
        self.phase_seconds: dict[str, float] = defaultdict(float)  # logged by the PhaseTimer callback
        self._sampled_since_update: list[dict[str, float]] = []  # rollout metrics waiting for the next update row
        self._eval_records: list[dict[str, Any]] = []
        self.init_state()

    def group(self, kind: type[FieldGroup]) -> FieldGroup:
        """This module's field group of type ``kind``."""
        return next(g for g in self.groups if isinstance(g, kind))

    def prepare_fields(self, values: dict[str, Any]) -> dict[str, Any]:
        """The keyword values before the groups are built from them (MARLHF fills its backend's defaults)."""
        return values

    def init_state(self) -> None:
        """A family's run state, set once every field is stored and checked. Families extend it."""

    # ------------------------------------------------------------------ configuration
    def check_config(self) -> None:
        """The rules that involve several fields; run before any model loads. Families extend it."""
        config = dict(self.model_config or {})
        unknown = sorted(set(config) - set(MODEL_CONFIG_KEYS))
        require(
            not unknown,
            f"model_config has unknown keys {unknown}; allowed: dtype, attn_implementation, "
            "special_tokens, model_kwargs, gradient_checkpointing.",
        )
        require(
            isinstance(config.get("gradient_checkpointing", False), bool),
            f"model_config.gradient_checkpointing must be true or false (got {config.get('gradient_checkpointing')!r}).",
        )
        self.gradient_checkpointing = config.get("gradient_checkpointing", False)
        self.team = team_for(
            self.collaboration_mode,
            self.agent_sources,
            self.field_values["num_agents"],
            self.tokenizer_sources,
            self.formatters,
            self.reward_func,
            self.centralized_adapter,
        )
        self.lora = lora_plan(self.team.agents, self.team.num_agents, self.field_values)
        if self.lora is not None:  # the team's sources: the base once per agent
            self.team.agents = [self.lora["base"]] * self.lora["num_agents"]
            require(
                self.parallel_training == "none",
                "parallel_training='mp' places whole agents on devices; a LoRA team (lora_rank, or adapter folders "
                "as agents) shares one base model, so it runs where the trainer places it: remove "
                "parallel_training/agent_devices.",
            )
        self.collaboration = self.team.collaboration
        problem = backend_problem(
            self.generation_backend, self.generation_kwargs, self.generation_dtype, lora=self.lora is not None
        )
        require(problem is None, problem or "")
        self.sources = validate_agent_sources(
            self.team.agents,
            self.team.num_agents,
            self.team.tokenizers,
            dtype=config.get("dtype", config.get("torch_dtype")),
            model_kwargs=config.get("model_kwargs"),
            special_tokens=config.get("special_tokens"),
        )
        self.num_agents = len(self.sources)
        self.place_team()
        roles = self.collaboration.num_roles if self.collaboration is not None else self.num_agents
        check_reward_signature(self.reward_func, roles)
        build_formatters(self.formatters, roles)  # one per role (or one for all), each callable

    def place_team(self) -> None:
        """Each agent's device and learning rate."""
        devices = self.field_values["agent_devices"]
        require(
            self.parallel_training != "mp" or devices is not None,
            "parallel_training='mp' requires explicit agent_devices.",
        )
        # mp: each agent on its own device. Otherwise the whole team on ONE device, the first named
        # (none named, or auto: where the trainer puts the module). None: the trainer places the team.
        self.agent_devices = (
            resolve_devices(devices, self.num_agents, kind="agent_devices")
            if self.parallel_training == "mp"
            else team_placement(devices, self.num_agents, "agent_devices")
        )
        rates = self.agent_learning_rate
        rates = list(rates) if isinstance(rates, (list, tuple)) else [rates] * self.num_agents
        require(
            len(rates) == self.num_agents,
            f"agent_learning_rate must be one value or one per agent ({self.num_agents}), got {len(rates)}.",
        )
        self.agent_learning_rates = [float(r) for r in rates]

    def effective_values(self) -> dict[str, Any]:
        """The fields as the run uses them, which the hyper-parameters are saved from: a field's value, or the
        module's attribute of that name where a rule derived it (``num_agents`` from the team, ``train_batch_size``
        from ``rollout_buffer_size``, an algorithm's own ``advantage_mode``); a checkpoint rebuilds the same run."""
        values = dict(self.field_values)
        for key, value in self.field_values.items():
            derived = self.__dict__.get(key, value)
            if derived != value and plain_hparams({key: derived}):
                values[key] = derived
        return values

    def build_engine(self, **options: Any) -> RolloutEngine:
        """The module's rollout engine: the team's formatters, task reward, sampling settings, chat template and
        generation backend, plus a family's ``options`` (samples per prompt, turns, joint mode, ...). The base
        engine samples one single-turn trajectory per item: what evaluation needs."""
        return RolloutEngine(
            num_agents=self.num_agents,
            formatters=self.prompt_formatters,
            reward=self.task_reward,
            sampling=self.sampling,
            use_chat_template=self.use_chat_template,
            generation_kwargs=self.generation_kwargs,
            backend=self.generation_engine,
            **{"num_generations": 1, **options},
        )

    @property
    def generation_engine(self) -> generation.GenerationBackend:
        """The module's one generation backend (``generation_backend``): every engine of the module samples
        through it."""
        if getattr(self, "_generation_engine", None) is None:
            self._generation_engine = make_backend(
                self.generation_backend,
                batch_size=self.generation_batch_size,
                generation_kwargs=self.generation_kwargs,
                concurrent=self.samples_concurrently,
                gpu_memory_utilization=self.vllm_gpu_memory_utilization,
                enable_sleep_mode=self.vllm_enable_sleep_mode,
                max_model_len=self.vllm_max_model_len,
            )
        return self._generation_engine

    # ------------------------------------------------------------------ models
    def configure_model(self) -> None:
        """Load the team (and the family's other models, :meth:`build_models`) once; idempotent. Under FSDP
        (``ModelParallelStrategy``) each agent is then sharded over the ranks (``agents/sharding.py``)."""
        if "agents" not in self._modules:
            self.load_models()
        self.shard_models()

    def shard_models(self) -> None:
        """Under FSDP2 (``ModelParallelStrategy``): shard each model of :meth:`sharded_models` not sharded yet."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if type(strategy).__name__ == "ModelParallelStrategy":
            for model in self.sharded_models():
                if not is_sharded(model):
                    shard(model, strategy.device_mesh["data_parallel"])

    def sharded_models(self) -> list[nn.Module]:
        """The distinct models FSDP shards (every trained model): the agents; families add critics or a reward
        model."""
        return list({id(m): m for m in self.agents}.values())

    def updated_models(self) -> list[nn.Module]:
        """The sharded models the current update trains (their gradients are reduce-scattered): all of them, unless a
        family's stage trains some only."""
        return [m for m in self.sharded_models() if is_sharded(m)]

    def load_models(self) -> None:
        """The team (and the family's other models, :meth:`build_models`)."""
        config = dict(self.model_config or {})
        lora = self.lora
        models, tokenizers = load_agents(
            self.sources[:1] if lora else self.sources,
            num_agents=1 if lora else self.num_agents,
            tokenizers=self.team.tokenizers,
            dtype=config.get("dtype", config.get("torch_dtype")),
            attn_implementation=config.get("attn_implementation", "sdpa"),
            model_kwargs=config.get("model_kwargs"),
            special_tokens=config.get("special_tokens"),
        )
        for model in {id(m): m for m in models}.values():
            self.apply_gradient_checkpointing(model)
        if lora:  # ONE base, one adapter per agent (agents/lora.py)
            team = LoRATeam(
                models[0], self.num_agents, adapters=lora["adapters"], base_name=lora["base"], **lora["settings"]
            )
            models, tokenizers = team.views, tokenizers * self.num_agents
        self._modules["agents"] = nn.ModuleList(models).train()  # from_pretrained gives eval mode
        self._tokenizers = tokenizers
        self.build_models()

    def build_models(self) -> None:
        """Load or build the family's other models (critics, value heads, a reward model) after the agents."""

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
        return self.parallel_training == "mp" and len(set(map(str, self.agent_devices))) > 1

    def apply_gradient_checkpointing(self, model: nn.Module) -> None:
        """Turn on ``model_config.gradient_checkpointing`` for a trained model (agent or critic)."""
        if self.gradient_checkpointing:
            enable_checkpointing(model)

    def save_pretrained(self, output_dir: str | Path) -> None:
        """``output_dir/agent_{i}/`` with each agent's weights and tokenizer (HF format). With sharded agents, call
        it on every rank: the agents are gathered and rank 0 writes."""
        states = full_state_dicts(list(self.agents))
        with ranks.rank_zero_first() as writer:
            if writer:
                save_agents(list(self.agents), self.tokenizers, output_dir, state_dicts=states)

    def describe_step(self) -> str:
        """Where a run is, for error messages: the update and env_step counters."""
        return f"update {self.global_step} (env_step {self.env_step})"

    def fit_epochs(self) -> int | None:
        """Epochs a fit must run when the algorithm fixes them (iterative rounds), else None (``trainer.max_epochs``
        decides). The CLI uses it as the default of ``trainer.max_epochs``."""
        return None

    # ------------------------------------------------------------------ optimizer and schedule
    def optimizer_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups: one per distinct agent model; families add critics/reward models."""
        return [
            {
                "params": trainable_parameters(self.agents[ids[0]]),
                "lr": self.agent_learning_rates[ids[0]],
                "name": f"agent_{ids[0]}",
                "agents": ids,
            }
            for ids in self.agent_groups()
        ]

    def configure_optimizers(self):
        groups = self.optimizer_groups()
        kernel = adamw_kernel(self.adamw_implementation, [p for g in groups for p in g["params"]])
        optimizer = torch.optim.AdamW(groups, weight_decay=self.weight_decay, betas=(0.9, 0.999), eps=1e-8, **kernel)
        if self.lr_warmup_steps == 0 and self.lr_decay == "constant":
            return optimizer
        total = self.lr_decay_steps or (self.trainer.max_steps if self.trainer.max_steps > 0 else None)
        if total is None and self.lr_decay != "constant":
            raise ConfigurationError(
                f"lr_decay={self.lr_decay!r} needs the number of updates it spans: set model lr_decay_steps, or "
                "trainer.max_steps (updates; a fit's update count is not known in advance: rollouts, pairs and "
                "rounds vary)."
            )
        schedule = LearningRateSchedule(self.lr_warmup_steps, self.lr_decay, int(total or 1), self.lr_min_ratio)
        return {"optimizer": optimizer, "lr_scheduler": UpdateScheduler(optimizer, schedule)}

    # ------------------------------------------------------------------ the update skeleton
    def update(self, batch: Any) -> dict[str, float]:
        """One team update on a mini-batch: one optimizer step, one ``global_step``. In a data-parallel run every
        rank updates together, each on its own mini-batch (possibly empty), with gradients averaged over the ranks
        by rows before clipping, so every rank holds the same weights after it."""
        with self.timed("update"):
            self.generation_engine.release_memory()  # vLLM's sleep mode: the engines' memory is the update's now
            optimizer = self.optimizers()
            optimizer.zero_grad()
            sums: dict[str, Any] = defaultdict(float)
            # DDP's reducer expects one backward per forward; ours are one per agent, so it stays off and the
            # gradients are averaged once below.
            no_sync = getattr(self.trainer.strategy, "block_backward_sync", contextlib.nullcontext)
            sharded = self.updated_models()
            # Sharded agents: FSDP averages over ranks; scaling by rows x D / all rows makes it row-weighted.
            scale = len(batch) * ranks.world_size() / max(ranks.reduce_sum(len(batch)), 1) if sharded else 1.0
            with no_sync():
                for loss, diagnostics in self.losses(batch) if len(batch) else ():  # one graph at a time
                    self.manual_backward(loss * scale if sharded else loss)
                    for key, value in diagnostics.items():
                        sums[key] = _add(sums[key], value)  # summed on the device; read once per update below
            with self.timed("gradient_sync"):  # data-parallel runs: one all-reduce per update (else nothing)
                if sharded:
                    reduce_gradients(sharded)
                else:
                    ranks.average_gradients((p for g in optimizer.param_groups for p in g["params"]), len(batch))
            metrics = {
                **self.clip_and_measure_gradients(),
                **(self.batch_metrics(batch) if len(batch) else {}),
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
        return {**metrics, **self.take_phase_timings()}

    def count_env_steps(self, joint_actions: int) -> None:
        """Add the joint actions of a step — over every rank — to ``env_step``."""
        self.env_step += int(ranks.reduce_sum(joint_actions))

    def completion_records(self, max_nodes: int) -> list[dict[str, Any]]:
        """What the agents wrote in the last training step, for ``CompletionsLogger`` (a family with samples to
        show overrides it; the base has none)."""
        return []

    @abc.abstractmethod
    def losses(self, batch: Any) -> Iterator[tuple[Tensor, dict[str, Tensor | float]]]:
        """Yield ``(loss, diagnostics)`` per forward of the update (checked finite); the losses sum to the
        update's objective."""

    def batch_metrics(self, batch: Any) -> dict[str, float]:
        """Metrics of the mini-batch itself, taken before the optimizer step (e.g. the policy lag)."""
        return {}

    def clip_and_measure_gradients(self) -> dict[str, float]:
        """Gradient norm per model (agents, critics, a reward model), clipped to ``max_grad_norm`` when set."""
        norms = {}
        for names, model in self.trained_models():
            params = [p for p in self.optimized_parameters(model, names[0]) if p.grad is not None]
            if not params:
                continue
            if is_sharded(model):  # DTensor shards: the norm over every rank's part, clipped the same way
                norm = ranks.sharded_norm(p.grad.to_local() for p in params)
                if self.max_grad_norm is not None and norm > self.max_grad_norm:
                    torch._foreach_mul_([p.grad for p in params], self.max_grad_norm / (norm + 1e-6))
            elif self.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            else:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
            for name in names:
                norms[f"{name}/grad_norm"] = float(norm)
        return norms

    def optimized_parameters(self, model: nn.Module, group: str) -> list[nn.Parameter]:
        """The parameters the optimizer steps for ``model`` (a sharded model's shards, which its module does not
        show while it is gathered: those of its parameter group, named ``group``), else its trainable parameters."""
        if is_sharded(model):
            return [p for g in self.optimizers().param_groups if g.get("name") == group for p in g["params"]]
        return trainable_parameters(model)

    def trained_models(self) -> list[tuple[list[str], nn.Module]]:
        """(metric names, model) of every trained model; families add theirs. The first name is the model's
        parameter group's."""
        return [([f"agent_{i}" for i in ids], self.agents[ids[0]]) for ids in self.agent_groups()]

    def check_update_fits(self, forwards: Sequence[tuple[nn.Module, ScoringInputs]]) -> None:
        """Raise a clear ``MemoryError`` before the backward when the update's largest forward plus the optimizer
        state not allocated yet clearly exceeds the memory left on the device (``agents/memory.py``)."""
        check_update_memory(
            [
                (
                    model,
                    forward_tokens(model, x),
                    x.input_ids.shape[0] * (x.completion_ids.shape[1] + 1),
                    x.input_ids.shape,
                )
                for model, x in forwards
            ],
            self.agent_device(0),
            [p for p in self.parameters() if p.requires_grad],
            self.optimizers() if self._trainer is not None else None,
            f"micro_batch_tokens (tokens per forward, now {self.micro_batch_tokens}), micro_batch_size (rows per "
            f"forward, now {self.micro_batch_size}), model_config.gradient_checkpointing (now "
            f"{self.gradient_checkpointing}; ~2.5x less), or shorter sequences (max_new_tokens, now "
            f"{self.max_new_tokens})",
        )

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Add the block's wall time to ``timing_s/<phase>`` of the current step (``PhaseTimer`` logs it)."""
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] += time.perf_counter() - tic

    def take_phase_timings(self) -> dict[str, float]:
        """``timing_s/<phase>`` of everything timed since the previous update (its share of sampling, rewards and
        scoring included), and start timing afresh; nothing when the run has no ``PhaseTimer``."""
        from comlrl_lightning.callbacks.timing import PhaseTimer

        seconds = dict(self.phase_seconds)
        self.phase_seconds.clear()
        timed = self._trainer is not None and any(isinstance(c, PhaseTimer) for c in self.trainer.callbacks)
        return {f"timing_s/{phase}": value for phase, value in seconds.items()} if timed else {}

    # ------------------------------------------------------------------ the run's record: one row per update
    # Lightning's own logging writes a row per training batch at a per-batch counter, and repeats on every row
    # the values of earlier batches; here a batch makes zero updates (it only fills the rollout buffer) or several
    # (mini-batches). So each update's metrics go to the loggers as ONE row at the update's step, beside
    # ``self.log`` for the progress bar only (docs/algorithms.md#metrics-and-steps).
    @property
    def updates_done(self) -> int:
        """The updates that made the current weights: ``global_step`` during a fit, the checkpoint's when a
        ``validate``/``test``/``predict`` run loaded one."""
        return max(self.global_step, getattr(self, "_checkpoint_step", 0))

    def write_row(self, metrics: Mapping[str, float], step: int | None = None) -> dict[str, float]:
        """Write one row to every logger at ``step`` (default :attr:`updates_done`): each metric the mean over the
        ranks that have it, with ``env_step``; the values also become ``trainer.callback_metrics`` (what
        ``ModelCheckpoint(monitor=...)`` and early stopping read). Every rank calls it (the mean is a
        collective); the loggers write on rank 0. Returns the row."""
        row = {**ranks.mean_of_ranks(dict(metrics)), "env_step": float(self.env_step)}
        step = self.updates_done if step is None else int(step)
        if self._trainer is None:
            return row
        row["epoch"] = self.current_epoch
        values = {k: torch.tensor(v) for k, v in row.items()}  # as Lightning keeps them
        # Lightning's own row writer (every logger, then save; trainer.logged_metrics kept up to date), given the step.
        self.trainer._logger_connector.log_metrics(values, step=step)
        self.trainer.callback_metrics.update(values)
        return row

    def log_metrics(
        self, metrics: Mapping[str, float], batch_size: int | None = None, progress: tuple[str, str] | None = None
    ) -> None:
        """A step that made one update: its row (``log_step([metrics])``), and ``progress`` (label, metric) on the
        bar."""
        self.log_step([metrics], progress=dict([progress]) if progress else None)

    def log_step(
        self,
        updates: Sequence[Mapping[str, float]],
        sampled: Mapping[str, float] | None = None,
        progress: Mapping[str, str] | None = None,
    ) -> None:
        """Record one training step: a row per update it made, at that update's step (the updates done before it:
        the row at step s holds update s+1, made from the samples of the weights after s updates; an evaluation
        at step s evaluates those weights). ``sampled`` (rollout metrics of the step's fresh samples) waits for
        the next update and joins its row, averaged with those of the other steps since the previous update: a
        step that only fills the buffer writes nothing. ``progress``: ``{label: metric}`` shown on the bar."""
        if sampled:
            self._sampled_since_update.append(dict(sampled))
        first = self.global_step - len(updates)
        shown: dict[str, float] = dict(sampled or {})
        for n, metrics in enumerate(updates):
            row = dict(metrics)
            if self._sampled_since_update:
                row = {**mean_over(self._sampled_since_update), **row}
                self._sampled_since_update = []
            shown.update(self.write_row(row, step=first + n))
        for label, key in (progress or {}).items():
            if key in shown:
                self.log(label, float(shown[key]), prog_bar=True, logger=False, batch_size=1)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        check_strategy(self.trainer, self)
        if self.trainer.datamodule is not None:
            self.check_items(self.trainer.datamodule, stage)  # before any model loads (configure_model is next)
        run_root(self.trainer)  # read on every rank now; later only rank 0 writes there
        if stage == "fit":
            # During fit, evaluation runs in EvaluationCallback, not in Lightning's validation
            # loop: switch the loop off for this fit (restored in teardown, so a later trainer.validate works).
            self._limit_val_batches = self.trainer.limit_val_batches
            self.trainer.limit_val_batches = 0

    def teardown(self, stage: str) -> None:
        if stage == "fit" and hasattr(self, "_limit_val_batches"):
            self.trainer.limit_val_batches = self._limit_val_batches

    def check_items(self, datamodule: Any, stage: str | None = None) -> None:
        """Try every formatter on the first item of each split the run reads (training and evaluation items for a
        fit, the stage's items otherwise), so that a formatter that cannot read a dataset's items fails before any
        model loads, naming the formatter, the split and the item's keys (a ``ConfigurationError``)."""
        first_items = getattr(datamodule, "first_items", None)
        if not callable(first_items):
            return
        for split, item in first_items(stage).items():
            for i, formatter in enumerate(self.prompt_formatters):
                try:
                    formatter(item)
                except Exception as err:  # noqa: BLE001 - user code: any error is reported the same way
                    text = err.args[0] if isinstance(err, KeyError) and err.args else err
                    name = f"formatters[{i}]" if len(self.prompt_formatters) > 1 else "formatters"
                    raise ConfigurationError(
                        f"{name} failed on the first item of the {split} ({type(err).__name__}: {text})"
                    ) from err

    def on_fit_start(self) -> None:
        # A resumed run's folder names its checkpoint: load_run joins the run to its start (no logger: no run folder).
        if self.trainer.ckpt_path and self.trainer.loggers and self.trainer.is_global_zero:
            folder = run_root(self.trainer)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / RESUMED_FROM).write_text(str(Path(self.trainer.ckpt_path).resolve()) + "\n", encoding="utf-8")
        if self.keep_freed_cpu_memory and self.device.type == "cpu":
            keep_freed_memory()  # no page fault per fresh page, step after step (agents/memory.py)
        for logger in self.loggers:  # W&B charts against env_step instead of global_step
            if type(logger).__name__ == "WandbLogger":
                logger.experiment.define_metric("env_step")
                logger.experiment.define_metric("*", step_metric="env_step")
        if self.agent_devices is not None:
            # Model placement: each whole agent on its device (Lightning moved everything to one).
            for model, device in zip(self.agents, self.agent_devices):
                model.to(device)

    def configure_callbacks(self):
        """The optional parts of a run this module's config turns on."""
        from comlrl_lightning.callbacks import CompletionsLogger, EvaluationCallback, PhaseTimer, PredictionWriter
        from comlrl_lightning.callbacks.conventions import run_conventions

        callbacks = [PhaseTimer()]
        if self.eval_interval > 0 and self.eval_num_samples > 0:
            callbacks.append(EvaluationCallback(self.eval_interval, self.eval_num_samples, at_end=self.eval_at_end))
        if self.log_completions:
            callbacks.append(CompletionsLogger())
        callbacks.append(PredictionWriter())
        return callbacks + run_conventions(self._trainer)

    @torch.no_grad()
    def score_no_grad(self, agent: int, inputs: ScoringInputs) -> Tensor:
        """Agent ``agent``'s token log-probs [B, T] (CPU) in eval mode, micro-batched."""
        model = self.policy_model(agent)
        was_training = model.training
        model.eval()
        rows = inputs.input_ids.shape[0]
        step = self.micro_batch_size or rows
        try:
            return torch.cat(
                [token_logprobs(model, select_rows(inputs, slice(s, s + step))).cpu() for s in range(0, rows, step)]
            )
        finally:
            model.train(was_training)

    # ------------------------------------------------------------------ evaluation (algorithms/evaluation.py)
    # ``evaluation_record(items)`` plays the evaluation episodes of a batch, ``evaluation_metrics(records)``
    # reduces them; the schedule (EvaluationCallback) and the `validate` loop call ``evaluate`` / these.
    @torch.no_grad()
    def evaluation_rollout(self, items: Sequence[Mapping[str, Any]]) -> Any:
        """One sampled trajectory per item over all turns (no early termination), scored with the task reward:
        what evaluation, ``test`` and ``predict`` play."""
        return self.engine.rollout(
            self.policy_models(),
            self.tokenizers,
            items,
            num_generations=1,
            early_termination=False,
            policy_version=self.global_step,
            reward=self.task_reward,
        )

    def evaluation_record(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return self.record_of(self.evaluation_rollout(items), items)

    def record_of(self, rollout, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Rewards [items, turns], each agent's completions per item and turn, the items and their prompts."""
        return evaluation.record_of(rollout, items, self.num_agents, self.turns)

    def evaluation_metrics(self, records: list[dict[str, Any]]) -> dict[str, float]:
        """Metrics of the evaluation ``records`` of every rank (a data-parallel run evaluates a share per rank)."""
        rewards = self.joined_table(records, "rewards")
        metrics = {
            "env_step": float(self.env_step),
            **evaluation.reward_metrics(rewards, getattr(self, "discount", 1.0)),
        }
        if self.eval_logger is not None and self.eval_aggregator is not None:
            metrics.update(
                evaluation.user_metrics(
                    records,
                    self.eval_logger,
                    self.eval_aggregator,
                    self.num_agents,
                    self.collaboration,
                    rewards.shape[1],
                )
            )
        return metrics

    @property
    def turns(self) -> int:
        return getattr(self, "num_turns", 1)

    def joined_table(self, records: list[dict[str, Any]], key: str) -> Tensor:
        return evaluation.joined_table(records, key, self.turns, self.device)

    def evaluate(self, items: Sequence[Any], batch_size: int = 1) -> dict[str, float]:
        """Evaluation metrics over ``items`` (in batches of ``batch_size``) with the task reward."""
        mine = ranks.shard(items)  # each rank plays its share of the items
        with gathered(self.sharded_models()):
            records = [self.evaluation_record(mine[s : s + batch_size]) for s in range(0, len(mine), batch_size)]
        return self.evaluation_metrics(records)

    def validation_step(self, batch: list[Any], batch_idx: int):
        self._eval_records.append(self.evaluation_record(batch))

    def on_validation_epoch_start(self) -> None:
        self._eval_records = []
        self._gather_agents()

    def on_validation_epoch_end(self) -> None:
        self._release_agents()
        if self._eval_records:
            # One row at the step of the weights evaluated (a checkpoint's, for `validate`): Lightning writes a
            # logged "step" as the row's step.
            self.log_dict({**self.evaluation_metrics(self._eval_records), "step": float(self.updates_done)})
        self._eval_records = []

    # The ``test`` subcommand: the evaluation on the test items, its metrics named ``test/...``.
    def test_step(self, batch: list[Any], batch_idx: int):
        self.validation_step(batch, batch_idx)

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def on_test_epoch_end(self) -> None:
        self._release_agents()
        if self._eval_records:
            metrics = self.evaluation_metrics(self._eval_records)
            metrics = {k.replace("eval/", "test/", 1): v for k, v in metrics.items()}
            self.log_dict({**metrics, "step": float(self.updates_done)})  # one row, at the step evaluated
        self._eval_records = []

    # The ``predict`` subcommand: what the team answers, item by item (``PredictionWriter`` writes it to JSONL).
    def on_predict_epoch_start(self) -> None:
        self._gather_agents()

    def on_predict_epoch_end(self) -> None:
        self._release_agents()

    def predict_step(self, batch: list[Any], batch_idx: int) -> list[dict[str, Any]]:
        """Per item: each agent's prompt and completion per turn (one sampled trajectory, as in evaluation) and the
        team reward per turn."""
        return evaluation.answers(batch, self.evaluation_rollout(batch))

    # Sharded agents (FSDP) are gathered once per step and kept whole for it (agents/sharding.py).
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._gather_agents()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._release_agents()

    def _gather_agents(self) -> None:
        self._release_agents()
        self._whole = contextlib.ExitStack()
        self._whole.enter_context(gathered(self.sharded_models()))

    def _release_agents(self) -> None:
        whole, self._whole = getattr(self, "_whole", None), None
        if whole is not None:
            whole.close()

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Every rank's RNG (Lightning writes rank 0's checkpoint; each rank samples its own share).
        checkpoint["comlrl_lightning"] = {
            "env_step": self.env_step,
            "rng": rng_state(),
            "rank_rng": ranks.gather(rng_state()),
            "sampled_since_update": list(self._sampled_since_update),
            "user_state": save_user_states(self.field_values),
            "wandb": wandb_identity(self.loggers),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("comlrl_lightning", {})
        self.env_step = int(state.get("env_step", 0))
        self._checkpoint_step = int(checkpoint.get("global_step", 0))  # the step validate/test/predict report
        self._sampled_since_update = [dict(m) for m in state.get("sampled_since_update", [])]
        load_user_states(self.field_values, state.get("user_state"))  # the user's stateful reward, logger, ...
        per_rank = state.get("rank_rng") or [state.get("rng")]
        # A run with more processes than the checkpointed one: the extra ranks keep their own seeded streams.
        self._rng_to_restore = per_rank[ranks.rank()] if ranks.rank() < len(per_rank) else None

    def on_train_start(self) -> None:
        # Restore RNG after Lightning's own start-up (which may draw random numbers) for exact resume.
        rng = getattr(self, "_rng_to_restore", None)
        if rng:
            set_rng_state(rng)
            self._rng_to_restore = None


def install_init(cls: type[MultiAgentModule]) -> None:
    """Give ``cls`` the keyword-only ``__init__`` of its fields: the signature and ``Args:`` the CLI reads."""

    def __init__(self, **values: Any) -> None:
        MultiAgentModule.initialize(self, values)

    __init__.__signature__ = signature_of(cls)
    __init__.__doc__ = args_docstring(cls)
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    cls.__init__ = __init__


install_init(MultiAgentModule)


def _add(total: Any, value: Any) -> Any:
    """``total + value`` for floats and tensors; a tensor joins the device of the running total (agents placed on
    different devices add to one ``loss``)."""
    if isinstance(total, Tensor) and isinstance(value, Tensor):
        return total + value.detach().to(total.device)
    return total + (value.detach() if isinstance(value, Tensor) else value)


def plain_hparams(values: Mapping[str, Any]) -> dict[str, Any]:
    """Hyper-parameters worth saving: plain values, and import paths of callables (not model objects)."""
    out = {}
    for key, value in values.items():
        if key.startswith("_"):
            continue
        if callable(value) and hasattr(value, "__module__") and hasattr(value, "__qualname__"):
            out[key] = f"{value.__module__}.{value.__qualname__}"
        elif value is None or isinstance(value, (str, int, float, bool)):
            out[key] = value
        elif isinstance(value, (list, tuple, dict)) and all(
            isinstance(v, (str, int, float, bool)) for v in (value.values() if isinstance(value, dict) else value)
        ):
            out[key] = value
    return out


def mean_over(updates: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Several updates in one step: the mean of each metric over the updates that logged it."""
    updates = list(updates)
    return {
        key: sum(u[key] for u in updates if key in u) / sum(key in u for u in updates)
        for key in {k for u in updates for k in u}
    }
