"""CoMLRL's trainer classes on our Lightning modules (docs/compat.md).

``MAGRPOTrainer(agent_model=..., reward_func=..., args=MAGRPOConfig(...), train_dataset=...).train()`` builds

* the module (``comlrl_lightning.MAGRPO``) from the config's module fields and the trainer's objects (models,
  tokenizer, reward, formatters, transition, evaluation callbacks, critics);
* the data module (``TaskDataModule``, or ``PreferenceDataModule`` for the preference family) from the datasets —
  a Hugging Face ``datasets.Dataset`` or a list of dicts;
* on ``train()``/``evaluate()``, a Lightning ``Trainer`` from the run settings: ``num_train_epochs`` ->
  ``max_epochs``, ``logging_steps`` -> ``log_every_n_steps``, ``output_dir`` -> ``default_root_dir``,
  ``save_steps`` -> a checkpoint every N updates, W&B from ``wandb_config`` (``WandbLogger``, offline when
  ``WANDB_MODE=offline``), else a CSV logger under ``output_dir``.

``evaluate()`` runs Lightning's ``validate`` on the first ``eval_num_samples`` eval items and returns the metrics
(``eval/turn_t/reward_mean`` ...); ``save_model(dir)`` writes ``dir/agent_i/`` (HF format). CoMLRL 1.4.3's
checkpoints — ``train(resume_from_checkpoint=, checkpoint_dir=, checkpoint_interval=, checkpoint_total_limit=)``,
``save_checkpoint(dir)``, ``load_checkpoint(ckpt)`` — are Lightning checkpoints in ``checkpoint-<n>/`` folders
(``compat/checkpoints.py``). Attributes CoMLRL's trainers expose (``agents``, ``tokenizers``, ``num_agents``,
``env_step``, ``critics``, ``reward_func`` ...) are the module's. A CoMLRL argument without an equivalent raises an error that says what to use instead.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from comlrl_lightning.agents.loading import is_model_object
from comlrl_lightning.algorithms import (
    IAC,
    MAAC,
    MADPO,
    MAGRPO,
    MAREINFORCE,
    MARLHF,
    MARLOO,
    CentralizedMAGRPO,
    MADPOIter,
    MAReMax,
    MARLHFIter,
)
from comlrl_lightning.callbacks import RunCheckpoints
from comlrl_lightning.callbacks.progress import progress_bar
from comlrl_lightning.compat import configs
from comlrl_lightning.compat.checkpoints import (
    STATE_FILENAME,
    RestoredOptimizers,
    TrainingCheckpoints,
    check_interval,
    check_resumable,
    class_path,
    config_values,
    preflight,
    state_file,
    stored_metadata,
)
from comlrl_lightning.compat.configs import module_parameters
from comlrl_lightning.data import PreferenceDataModule, TaskDataModule
from comlrl_lightning.data.tasks import load_items

log = logging.getLogger(__name__)

# CoMLRL trainer argument -> the module fields it sets (the first the module accepts; the adapter of a preference
# trainer is also its centralized team's adapter).
ARGUMENT_FIELDS = {
    "tokenizer": ("tokenizers",),
    "model_config": ("model_config",),
    "reward_func": ("reward_func",),
    "reward_processor": ("reward_processor",),
    "formatters": ("formatters",),
    "external_transition": ("external_transition",),
    "eval_logger": ("eval_logger",),
    "eval_aggregator": ("eval_aggregator",),
    "metrics_callback": ("metrics_callback",),
    "critic_model": ("critic_model",),
    "critics": ("critics",),
    "centralized_adapter": ("centralized_adapter",),
    "centralized_comparator_adapter": ("centralized_comparator_adapter", "centralized_adapter"),
}
# model_config keys CoMLRL reads that have no equivalent here, and what to use instead.
REFUSED_MODEL_CONFIG = {
    "critic_model_kwargs": "critics load with the agents' model_config; pass loaded critic models as critics=[...] "
    "to choose their dtype or options",
    "tokenizer_kwargs": "pass a loaded tokenizer as tokenizer=... (AutoTokenizer.from_pretrained(name, **kwargs))",
}
# CoMLRL trainer attributes that have no equivalent here, and what to use instead.
NOT_PROVIDED = {
    "optimizers": "one AdamW with a parameter group per agent, created by Lightning in train(): "
    "trainer.module.optimizers() during a fit",
    "get_train_dataloader": "trainer.datamodule.train_dataloader() (the data module serves rollout batches)",
    "get_eval_dataloader": "trainer.evaluate(), which plays the first eval_num_samples items of eval_dataset",
    "reference_models": "the frozen reference copies live in the ReferenceModels callback during train()",
}


def comlrl_reward(reward_func: Callable[..., Any], num_agents: int) -> Callable[..., Any]:
    """``reward_func`` in our signature, ``f(*agent_completions, prompts=None, batch_items=None)``, for the two
    other calling conventions CoMLRL infers from the number of required positional parameters when it is
    unambiguous: N + 1 (``f(prompts, c_1, ..., c_N)``) and, for several agents, 1 (``f([c_1, ..., c_N])``).
    Any other function is returned as it is (CoMLRL also counts parameters with defaults and retries on
    ``TypeError``; we do neither: docs/differences.md)."""
    try:
        params = list(inspect.signature(reward_func).parameters.values())
    except (TypeError, ValueError):
        return reward_func
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return reward_func
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    prompts_first = len(required) == num_agents + 1
    if not prompts_first and not (len(required) == 1 and num_agents > 1):
        return reward_func
    takes_items = any(p.name == "batch_items" or p.kind is p.VAR_KEYWORD for p in params)

    def reward(*agent_completions, prompts=None, batch_items=None):
        extra = {"batch_items": batch_items} if takes_items else {}
        if prompts_first:
            return reward_func(list(prompts or [""] * len(agent_completions[0])), *agent_completions, **extra)
        return reward_func(list(agent_completions), **extra)

    for name in ("__module__", "__name__", "__qualname__", "reward_range"):  # not __wrapped__: our signature counts
        if hasattr(reward_func, name):
            setattr(reward, name, getattr(reward_func, name))
    reward._checkpoint_source = reward_func  # a stateful reward object is checkpointed itself
    return reward


def team_sources(agent_model: Any, agents: Any, num_agents: int | None, actor_critic: str | None = None) -> Any:
    """The ``agents`` field from CoMLRL's ``agent_model`` (a name: a homogeneous team) / ``agents`` (a list);
    ``actor_critic``: the IAC/MAAC algorithm whose message CoMLRL words its own way."""
    if isinstance(agents, (list, tuple)) and not agents:  # an empty team is no team
        agents = None
    if agent_model is None and agents is None:
        raise ValueError("Either agent_model or agents must be provided.")
    if agents is None:
        if not isinstance(agent_model, (str, os.PathLike)) and actor_critic:
            raise ValueError(
                f"Multi-agent {actor_critic} requires `agent_model` to be a pretrained identifier string. Pass "
                "loaded models as agents=[model, ...], one per agent (with tokenizer=...)."
            )
        if not isinstance(agent_model, (str, os.PathLike)):
            raise ValueError(
                "agent_model should be a string to create homogeneous agents (a hub id, a local path or "
                "a factory name); pass loaded models as agents=[model, ...], one per agent."
            )
        return str(agent_model)
    if agent_model is not None:
        names = list(agents) if isinstance(agents, (list, tuple)) else [agents]
        if not all(isinstance(a, str) and a == agent_model for a in names):
            raise ValueError(
                f"Cannot provide both agent_model and agents unless agents repeats agent_model's name "
                f"(conflict: agent_model={agent_model!r}, agents={names!r}); give one of them."
            )
        if num_agents is not None and len(names) != num_agents:
            raise ValueError(
                f"Cannot provide both agent_model and agents with {len(names)} entries for "
                f"num_agents={num_agents}; give one of them."
            )
    return agents


class CoMLRLTrainer:
    """Base of the compat trainers: a module, a data module and a Lightning ``Trainer`` (module docstring).

    Arguments are CoMLRL's (keyword-only); ``model`` is CoMLRL's older name of ``agent_model``. Ours beyond them:
    ``trainer_options`` (more ``lightning.Trainer`` arguments: ``accelerator``, ``devices``, ``strategy``,
    ``precision``, ``callbacks`` ...).
    """

    module_class: ClassVar[type]
    config_family: ClassVar[type]  # the configs this trainer takes: this class and its subclasses
    data_class: ClassVar[type] = TaskDataModule
    extra_epochs: ClassVar[int] = 0  # Lightning epochs besides num_train_epochs (MARLHF's reward-model epoch)
    reward_checked_first: ClassVar[bool] = False  # CoMLRL's IAC/MAAC check reward_func before the models
    comlrl_algorithm: ClassVar[str | None] = None  # the ``algorithm`` CoMLRL's W&B run config names, if not ours

    def __init__(
        self,
        *,
        agent_model: Any = None,
        model: Any = None,
        agents: Any = None,
        num_agents: int | None = None,
        tokenizer: Any = None,
        model_config: Mapping[str, Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        dataset_type: str | None = None,
        reward_func: Callable | None = None,
        reward_processor: Callable | None = None,
        formatters: Any = None,
        external_transition: Callable | None = None,
        wandb_config: Mapping[str, Any] | None = None,
        eval_logger: Callable | None = None,
        eval_aggregator: Callable | None = None,
        metrics_callback: Callable | None = None,
        critic_model: Any = None,
        critics: Any = None,
        centralized_adapter: Any = None,
        centralized_comparator_adapter: Any = None,
        args: Any = None,
        trainer_options: Mapping[str, Any] | None = None,
    ):
        name = type(self).__name__
        self.args = args if args is not None else self.default_config()
        if not isinstance(self.args, self.config_family):
            raise TypeError(
                f"{name} takes args={self.config_family.__name__}(...) or a subclass; got {type(self.args).__name__}."
            )
        if model is not None and agent_model is not None:
            raise ValueError("Give agent_model or its older name model, not both.")
        self.wandb_config = dict(wandb_config) if wandb_config is not None else None
        sections = (self.wandb_config or {}).get("config_sections") or {}
        if dataset_type is not None:
            log.warning(
                "dataset_type= was removed in CoMLRL 1.4.3 (it reads wandb_config['config_sections']['dataset']"
                "['type']); accepted here for older scripts and recorded in the W&B run config."
            )
        self.dataset_type = dataset_type or (sections.get("dataset") or {}).get("type")
        self.trainer_options = dict(trainer_options or {})
        self.verbose = (
            bool((sections.get("output") or {}).get("verbose", True))
            and self.trainer_options.get("enable_progress_bar", True) is not False
        )
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        model_config, critic_head_dim = self.split_model_config(model_config)
        if self.reward_checked_first and (reward_func is None or not callable(reward_func)):
            raise ValueError("reward_func must be a callable.")  # before the models, as CoMLRL's IAC/MAAC
        objects = dict(
            tokenizer=tokenizer,
            model_config=model_config,
            reward_func=reward_func,
            reward_processor=reward_processor,
            formatters=formatters,
            external_transition=external_transition,
            eval_logger=eval_logger,
            eval_aggregator=eval_aggregator,
            metrics_callback=metrics_callback,
            critic_model=critic_model,
            critics=critics,
            centralized_adapter=centralized_adapter,
            centralized_comparator_adapter=centralized_comparator_adapter,
        )
        actor_critic = self.module_class.algorithm_name if issubclass(self.module_class, IAC) else None  # or MAAC
        sources = team_sources(agent_model or model, agents, num_agents, actor_critic)
        if actor_critic and tokenizer is None and isinstance(sources, (list, tuple)):
            if any(is_model_object(source) for source in sources):
                raise ValueError(
                    "Tokenizer must be provided when using agents. The agents are model objects: pass "
                    "tokenizer=... (one for all agents, or a list with one per agent)."
                )
        self.module = self.build_module(sources, num_agents, objects, critic_head_dim)
        self.datamodule = self.build_data() if train_dataset is not None else None
        self._lightning: Trainer | None = None
        self._eval_items = None
        self._fitted = False
        self._fit_failed = False
        self._checkpoints = TrainingCheckpoints(class_path(self), config_values(self.args))
        self._restored_optimizers: RestoredOptimizers | None = None

    @classmethod
    def default_config(cls):
        """CoMLRL's default: the config of this trainer's own algorithm."""
        return next(c for c in configs.CONFIGS if c.module_class is cls.module_class)()

    # ------------------------------------------------------------------ construction
    @staticmethod
    def split_model_config(model_config: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, int | None]:
        """CoMLRL's ``model_config`` as ours, and MAAC's ``critic_value_head_hidden_dim`` (a field here); refused
        keys say what to use instead."""
        config = dict(model_config or {})
        for key, instead in REFUSED_MODEL_CONFIG.items():
            if key in config:
                raise ValueError(f"model_config[{key!r}] has no equivalent here: {instead}.")
        head_dim = config.pop("critic_value_head_hidden_dim", None)
        return config or None, head_dim

    def build_module(
        self, sources: Any, num_agents: int | None, objects: dict[str, Any], critic_head_dim: int | None = None
    ):
        """The module from the config's fields and the trainer's objects (it checks them all, loads nothing)."""
        accepted = module_parameters(self.module_class)
        values = self.args.module_values(self.module_class)
        for field, value in self.args.unused_values(self.module_class).items():
            log.warning(
                "%s.%s=%r has no effect on %s (CoMLRL's config declares it, the algorithm does not read it).",
                type(self.args).__name__,
                field,
                value,
                self.module_class.__name__,
            )
        centralized = values.get("collaboration_mode") == "centralized"
        if centralized and num_agents is not None and num_agents != self.args.num_agents:
            raise ValueError("num_agents must match args.num_agents (the role count).")
        if num_agents is None and not centralized and isinstance(sources, (list, tuple)):
            num_agents = len(sources)
        values["num_agents"] = num_agents if num_agents is not None else self.args.num_agents
        if critic_head_dim is not None and "critic_value_head_hidden_dim" in accepted:
            values["critic_value_head_hidden_dim"] = critic_head_dim
        if objects["reward_func"] is not None:  # called with one completion list per role
            objects["reward_func"] = comlrl_reward(objects["reward_func"], values["num_agents"])
        for argument, value in objects.items():
            if value is None:
                continue
            fields = [f for f in ARGUMENT_FIELDS[argument] if f in accepted]
            if not fields:
                takers = [
                    t.__name__ for t in TRAINERS if ARGUMENT_FIELDS[argument][0] in module_parameters(t.module_class)
                ]
                raise TypeError(
                    f"{type(self).__name__} does not take {argument}= ({self.module_class.__name__} has "
                    f"no such field); the trainers that take it: {', '.join(takers) or 'none'}."
                )
            for field in fields:
                values.setdefault(field, value)
        return self.module_class(agents=sources, **values)

    def build_data(self):
        """The data module of the datasets (and the config's data settings)."""
        options = {"show_progress": self.verbose} if self.data_class is PreferenceDataModule else {}
        return self.data_class(
            dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
            eval_batch_size=self.args.eval_batch_size,
            prompts_per_step=self.args.prompts_per_step,
            **options,
        )

    @property
    def output_dir(self) -> str:
        """Where the run's files go: ``args.output_dir``, else ``wandb_config["output_dir"]``, else ``outputs``."""
        return self.args.output_dir or (self.wandb_config or {}).get("output_dir") or "outputs"

    def build_logger(self):
        """W&B from ``wandb_config`` (CoMLRL's keys), else CSV under ``output_dir``."""
        algorithm = self.module.algorithm_name
        if self.wandb_config is None:
            from lightning.pytorch.loggers import CSVLogger

            return CSVLogger(self.output_dir, name=algorithm.lower())
        from lightning.pytorch.loggers import WandbLogger

        config = self.wandb_config
        save_dir = Path(config.get("dir") or self.output_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        resume = {key: config[key] for key in ("id", "resume") if key in config}  # CoMLRL 1.4.3: resume a W&B run
        return WandbLogger(
            project=config.get("project", "comlrl"),
            entity=config.get("entity"),
            name=config.get("name") or config.get("run_name") or f"test-{algorithm.lower()}",
            save_dir=str(save_dir),
            tags=config.get("tags"),
            offline=os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun"),
            config=self.wandb_run_config(),
            **resume,
        )

    def wandb_run_config(self) -> dict[str, Any]:
        """The W&B run config, as CoMLRL's: the algorithm, team size, turns, ``config_sections`` (``dataset_name``
        and ``dataset_type`` from its ``dataset`` section) and, for a centralized team, the roles and actor models."""
        module, sections = self.module, dict((self.wandb_config or {}).get("config_sections") or {})
        dataset = sections.get("dataset") if isinstance(sections.get("dataset"), Mapping) else {}
        roles = module.collaboration.num_roles if module.collaboration is not None else module.num_agents
        run = {
            "algorithm": self.comlrl_algorithm or module.algorithm_name,
            "num_agents": roles,
            "num_turns": getattr(self.args, "num_turns", 1),
            **sections,
        }
        if dataset.get("name"):
            run["dataset_name"] = dataset["name"]
        run["dataset_type"] = self.dataset_type
        if module.collaboration is not None:
            run.update(
                collaboration_mode="centralized",
                num_roles=module.collaboration.num_roles,
                num_actor_models=len(module.team.agents),
            )
        return run

    @property
    def lightning_trainer(self) -> Trainer:
        """The Lightning ``Trainer`` of ``train()`` and ``evaluate()``, built from the run settings once."""
        if self._lightning is None:
            args = self.args
            callbacks = [progress_bar()] if self.verbose else []
            if args.save_steps is not None:
                callbacks.append(RunCheckpoints(args.save_steps))
            if self.checkpointing:  # CoMLRL's checkpoint-<n>/ folders and every checkpoint's metadata
                callbacks.append(self._checkpoints)
            if self._restored_optimizers is not None:
                callbacks.append(self._restored_optimizers)
            options = dict(
                max_epochs=self.module.fit_epochs() or args.num_train_epochs + self.extra_epochs,
                max_steps=args.max_steps,
                log_every_n_steps=args.logging_steps,
                logger=self.build_logger(),
                default_root_dir=self.output_dir,
                enable_checkpointing=True,
                enable_progress_bar=self.verbose,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                accelerator="auto",
                devices=1,
            )
            extra = dict(self.trainer_options)
            options["callbacks"] = callbacks + list(extra.pop("callbacks", []))
            self._lightning = Trainer(**{**options, **extra})
        return self._lightning

    @property
    def checkpointing(self) -> bool:
        """Whether checkpoints may be written (``trainer_options={"enable_checkpointing": False}`` says no)."""
        return self.trainer_options.get("enable_checkpointing", True) is not False

    # ------------------------------------------------------------------ CoMLRL's methods
    def train(
        self,
        resume_from_checkpoint: str | os.PathLike | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_interval: int = 1,
        checkpoint_total_limit: int | None = None,
        *,
        ckpt_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Fit the module on ``train_dataset`` for ``num_train_epochs`` in all (a resumed run counts the epochs it
        had done). ``checkpoint_dir``: write ``checkpoint-<n>/`` after every ``checkpoint_interval``-th epoch and
        the last, keeping the newest ``checkpoint_total_limit``; ``resume_from_checkpoint``: continue the run of
        such a folder exactly (CoMLRL 1.4.3, docs/compat.md#checkpoints). ``ckpt_path`` (ours): resume any Lightning
        checkpoint of this run (``save_steps``' ``last.ckpt``)."""
        self._train(
            resume_from_checkpoint, checkpoint_dir, checkpoint_interval, checkpoint_total_limit, ckpt_path, kwargs
        )

    # train()'s keywords, for the message about one it does not take
    TRAIN_KEYWORDS = (
        "resume_from_checkpoint",
        "checkpoint_dir",
        "checkpoint_interval",
        "checkpoint_total_limit",
        "ckpt_path",
    )

    def _train(
        self,
        resume_from_checkpoint,
        checkpoint_dir,
        checkpoint_interval,
        checkpoint_total_limit,
        ckpt_path,
        unknown: dict[str, Any],
    ) -> None:
        if unknown:
            raise TypeError(self.unknown_train_keyword(sorted(unknown)[0]))
        check_interval(checkpoint_interval, checkpoint_total_limit)
        if self.datamodule is None:
            raise ValueError(f"train() needs train_dataset: pass train_dataset=... to {type(self).__name__}.")
        if resume_from_checkpoint is not None and ckpt_path is not None:
            raise ValueError(
                "Give resume_from_checkpoint or ckpt_path, not both (the same resume, CoMLRL's name and Lightning's)."
            )
        metadata = None
        if resume_from_checkpoint is not None:
            ckpt_path = str(state_file(resume_from_checkpoint))
            metadata = stored_metadata(Path(ckpt_path))
        elif ckpt_path is not None and Path(ckpt_path).is_file():  # a compat run's own checkpoint continues its run
            metadata = stored_metadata(Path(ckpt_path), required=False)
        if metadata is not None:
            check_resumable(metadata, self)
        if checkpoint_dir is not None and not self.checkpointing:
            raise ValueError(
                "train(checkpoint_dir=...) writes checkpoints, but trainer_options has "
                "enable_checkpointing=False: remove one of them."
            )
        preflight(checkpoint_dir, metadata)
        if self._fitted or metadata is not None:  # train() again trains again (a fresh Lightning Trainer, a new run
            self._lightning = None  # folder), as CoMLRL's does; a resume also picks up its W&B run
        self.adopt_wandb_run(metadata)
        callback = self._checkpoints
        callback.directory = None if checkpoint_dir is None else Path(checkpoint_dir).expanduser().absolute()
        callback.interval, callback.total_limit = checkpoint_interval, checkpoint_total_limit
        callback.config = config_values(self.args)
        callback.sequence = metadata["sequence"] if metadata else 0
        callback.run_id = metadata["run_id"] if metadata else uuid.uuid4().hex  # a new run, as CoMLRL's
        self._fit_failed = True  # until fit returns: a failed run has no boundary to save
        self.lightning_trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=ckpt_path)
        self._fit_failed, self._fitted = False, True

    def unknown_train_keyword(self, key: str) -> str:
        """What a ``train()`` keyword we do not take should be instead."""
        name = f"{type(self).__name__}.train()"
        close = difflib.get_close_matches(key, self.TRAIN_KEYWORDS, n=1)
        if close:
            return f"{name} got an unexpected keyword argument {key!r}. Did you mean {close[0]}?"
        return (
            f"{name} got an unexpected keyword argument {key!r}: CoMLRL forwards extra train() arguments to "
            f"generate(); here sampling settings are config fields: {type(self.args).__name__}(generation_kwargs="
            f"{{{key!r}: ...}}) (temperature, top_p, top_k, max_new_tokens have fields of their own). train() "
            f"takes {', '.join(self.TRAIN_KEYWORDS)}."
        )

    def adopt_wandb_run(self, metadata: dict[str, Any] | None) -> None:
        """A resumed run logs into the checkpoint's W&B run, unless ``wandb_config`` names its own (``id`` or
        ``resume``), as CoMLRL 1.4.3 does."""
        identity = (metadata or {}).get("wandb")
        if not identity or self.wandb_config is None or {"id", "resume"} & set(self.wandb_config):
            return
        self.wandb_config = {**self.wandb_config, "id": identity["id"], "resume": "allow"}
        for key in ("project", "entity"):
            if identity.get(key) and not self.wandb_config.get(key):
                self.wandb_config[key] = identity[key]

    def save_checkpoint(self, output_dir: str | os.PathLike) -> str:
        """Write the state ``train()`` reached to ``output_dir/`` (``training_state.pt`` and the owner record),
        resumable with ``train(resume_from_checkpoint=output_dir)``; returns the folder. An existing folder is
        replaced only if it is a checkpoint."""
        if self._fit_failed:
            raise RuntimeError(
                "Training did not reach a completed checkpoint boundary; resume the last saved "
                "checkpoint (train(resume_from_checkpoint=...))."
            )
        if not self._fitted:
            raise RuntimeError(
                f"{type(self).__name__}.save_checkpoint() saves the state train() reached: call it "
                "after train() (train(checkpoint_dir=...) writes checkpoints during the run)."
            )
        target = Path(output_dir).expanduser().absolute()
        if target.is_symlink() or (target.exists() and not (target / STATE_FILENAME).is_file()):
            raise FileExistsError(f"Refusing to replace a non-checkpoint directory: {target}")
        return str(self._checkpoints.save(self.lightning_trainer, target))

    def load_checkpoint(self, checkpoint: str | os.PathLike) -> dict[str, Any]:
        """Load a checkpoint's weights, counters, RNG states, buffered samples and user object states into this
        trainer now, and its optimizer and schedule states into the next ``train()``'s optimizer; that ``train()``
        starts a new run (epoch 0) from them. ``train(resume_from_checkpoint=...)`` continues the saved run instead.
        Returns ``{"sequence", "global_step", "env_step"}`` of the checkpoint."""
        path = state_file(checkpoint)
        metadata = stored_metadata(path)
        check_resumable(metadata, self)
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.module.configure_model()
        self.module.load_state_dict(state["state_dict"])
        self.module.on_load_checkpoint(state)
        self._restored_optimizers = RestoredOptimizers(
            state.get("optimizer_states", []), state.get("lr_schedulers", []), done=self._optimizers_restored
        )
        self._lightning = None  # the next train() builds its Trainer with them (and the checkpoint's W&B run)
        self.adopt_wandb_run(metadata)
        return {
            "sequence": metadata["sequence"],
            "global_step": int(state.get("global_step", 0)),
            "env_step": int(self.module.env_step),
        }

    def _optimizers_restored(self) -> None:
        self._restored_optimizers = None

    def evaluate(self, num_eval_samples: int | None = None) -> dict[str, float]:
        """The evaluation metrics (``eval/turn_t/reward_mean``, ``eval/turn_t/expected_return`` and the
        ``eval_logger``/``eval_aggregator`` ones) of the first ``num_eval_samples`` (default: the config's
        ``eval_num_samples``) eval items, played once each with the task reward (Lightning ``validate``)."""
        count = self.args.eval_num_samples if num_eval_samples is None else num_eval_samples
        if self.eval_dataset is None:
            raise ValueError(f"evaluate() needs eval_dataset: pass eval_dataset=... to {type(self).__name__}.")
        if self.datamodule is not None:
            items = self.datamodule.eval_items(count)
        else:  # evaluation without a training set
            self._eval_items = self._eval_items or load_items(self.eval_dataset, field="eval_dataset")
            items = [self._eval_items[i] for i in range(min(count, len(self._eval_items)))]
        if not items:
            return {}
        loader = DataLoader(items, batch_size=self.args.eval_batch_size, collate_fn=list)
        results = self.lightning_trainer.validate(self.module, dataloaders=loader, verbose=self.verbose)
        return dict(results[0]) if results else {}

    def save_model(self, output_dir: str | os.PathLike) -> None:
        """``output_dir/agent_i/`` per agent (weights and tokenizer, HF format; critics and a reward model beside
        them); with W&B, logs ``final_model_saved`` and finishes the run, as CoMLRL does."""
        self.module.save_pretrained(output_dir)
        logger = self._lightning.logger if self._lightning is not None else None
        if type(logger).__name__ == "WandbLogger" and getattr(logger, "_experiment", None) is not None:
            logger.experiment.log({"final_model_saved": str(output_dir)})
            logger.experiment.finish()

    @property
    def tokenizer(self):
        """Agent 0's tokenizer (CoMLRL's ``tokenizer``; ``tokenizers`` has every agent's)."""
        return self.module.tokenizers[0]

    def __getattr__(self, name: str) -> Any:
        """CoMLRL's attributes (``agents``, ``tokenizers``, ``num_agents``, ``env_step``, ``critics`` ...) are the
        module's."""
        if name in NOT_PROVIDED:
            raise AttributeError(f"{type(self).__name__}.{name} has no equivalent here: {NOT_PROVIDED[name]}.")
        module = self.__dict__.get("module")
        if module is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(module, name)


def _trainer(name: str, module_class: type, family: type, base: type = CoMLRLTrainer, **attrs: Any) -> type:
    doc = (
        f"CoMLRL's ``{name}`` on :class:`comlrl_lightning.{module_class.__name__}`; ``args`` is a "
        f"``{family.__name__}`` (docs/compat.md)."
    )
    return type(
        name,
        (base,),
        {"module_class": module_class, "config_family": family, "__doc__": doc, "__module__": __name__, **attrs},
    )


class ActorCriticTrainer(CoMLRLTrainer):
    """Base of ``IACTrainer``/``MAACTrainer``: their ``train()`` arguments are keyword-only, as CoMLRL's."""

    reward_checked_first = True

    def train(
        self,
        *,
        resume_from_checkpoint: str | os.PathLike | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_interval: int = 1,
        checkpoint_total_limit: int | None = None,
        ckpt_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        """As :meth:`CoMLRLTrainer.train`, keyword-only."""
        self._train(
            resume_from_checkpoint, checkpoint_dir, checkpoint_interval, checkpoint_total_limit, ckpt_path, kwargs
        )


MAGRPOTrainer = _trainer("MAGRPOTrainer", MAGRPO, configs.MAGRPOConfig)
MAREINFORCETrainer = _trainer("MAREINFORCETrainer", MAREINFORCE, configs.MAGRPOConfig, MAGRPOTrainer)
MARLOOTrainer = _trainer("MARLOOTrainer", MARLOO, configs.MAGRPOConfig, MAGRPOTrainer)
MAReMaxTrainer = _trainer("MAReMaxTrainer", MAReMax, configs.MAGRPOConfig, MAGRPOTrainer)
CentralizedMAGRPOTrainer = _trainer(
    "CentralizedMAGRPOTrainer",
    CentralizedMAGRPO,
    configs.CentralizedMAGRPOConfig,
    MAGRPOTrainer,
    comlrl_algorithm="MAGRPO",
)
IACTrainer = _trainer("IACTrainer", IAC, configs.IACConfig, ActorCriticTrainer)
MAACTrainer = _trainer("MAACTrainer", MAAC, configs.MAACConfig, ActorCriticTrainer)
MADPOTrainer = _trainer("MADPOTrainer", MADPO, configs.MADPOConfig, data_class=PreferenceDataModule)
MARLHFTrainer = _trainer("MARLHFTrainer", MARLHF, configs.MADPOConfig, MADPOTrainer, extra_epochs=1)
MADPOIterTrainer = _trainer("MADPOIterTrainer", MADPOIter, configs.MADPOConfig, MADPOTrainer)
MARLHFIterTrainer = _trainer("MARLHFIterTrainer", MARLHFIter, configs.MADPOConfig, MADPOTrainer)

TRAINERS = (
    MAGRPOTrainer,
    MAREINFORCETrainer,
    MARLOOTrainer,
    MAReMaxTrainer,
    CentralizedMAGRPOTrainer,
    IACTrainer,
    MAACTrainer,
    MADPOTrainer,
    MARLHFTrainer,
    MADPOIterTrainer,
    MARLHFIterTrainer,
)
