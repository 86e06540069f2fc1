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
(``eval/turn_t/reward_mean`` ...); ``save_model(dir)`` writes ``dir/agent_i/`` (HF format). Attributes CoMLRL's
trainers expose (``agents``, ``tokenizers``, ``num_agents``, ``env_step``, ``critics``, ``reward_func`` ...) are the
module's. A CoMLRL argument without an equivalent raises an error that says what to use instead.
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from comlrl_lightning.algorithms import (
    IAC,
    MAAC,
    MADPO,
    MADPOIter,
    MAGRPO,
    MARLHF,
    MARLHFIter,
    MAREINFORCE,
    MARLOO,
    CentralizedMAGRPO,
    MAReMax,
)
from comlrl_lightning.callbacks import RunCheckpoints
from comlrl_lightning.callbacks.progress import progress_bar
from comlrl_lightning.compat import configs
from comlrl_lightning.compat.configs import module_parameters
from comlrl_lightning.data import PreferenceDataModule, TaskDataModule
from comlrl_lightning.data.tasks import load_items

log = logging.getLogger(__name__)

# CoMLRL trainer argument -> the module fields it sets (the first the module accepts; the adapter of a preference
# trainer is also its centralized team's adapter).
ARGUMENT_FIELDS = {
    "tokenizer": ("tokenizers",), "model_config": ("model_config",), "reward_func": ("reward_func",),
    "reward_processor": ("reward_processor",), "formatters": ("formatters",),
    "external_transition": ("external_transition",), "eval_logger": ("eval_logger",),
    "eval_aggregator": ("eval_aggregator",), "metrics_callback": ("metrics_callback",),
    "critic_model": ("critic_model",), "critics": ("critics",), "centralized_adapter": ("centralized_adapter",),
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
    return reward


def team_sources(agent_model: Any, agents: Any, num_agents: int | None) -> Any:
    """The ``agents`` field from CoMLRL's ``agent_model`` (a name: a homogeneous team) / ``agents`` (a list)."""
    if agent_model is None and agents is None:
        raise ValueError("Either agent_model or agents must be provided.")
    if agents is None:
        if not isinstance(agent_model, (str, os.PathLike)):
            raise ValueError("agent_model should be a string to create homogeneous agents (a hub id, a local path or "
                             "a factory name); pass loaded models as agents=[model, ...], one per agent.")
        return str(agent_model)
    if agent_model is not None:
        names = list(agents) if isinstance(agents, (list, tuple)) else [agents]
        if not all(isinstance(a, str) and a == agent_model for a in names):
            raise ValueError(f"Cannot provide both agent_model and agents unless agents repeats agent_model's name "
                             f"(conflict: agent_model={agent_model!r}, agents={names!r}); give one of them.")
        if num_agents is not None and len(names) != num_agents:
            raise ValueError(f"Cannot provide both agent_model and agents with {len(names)} entries for "
                             f"num_agents={num_agents}; give one of them.")
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

    def __init__(self, *, agent_model: Any = None, model: Any = None, agents: Any = None, num_agents: int | None = None,
                 tokenizer: Any = None, model_config: Mapping[str, Any] | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, dataset_type: str | None = None, reward_func: Callable | None = None,
                 reward_processor: Callable | None = None, formatters: Any = None,
                 external_transition: Callable | None = None, wandb_config: Mapping[str, Any] | None = None,
                 eval_logger: Callable | None = None, eval_aggregator: Callable | None = None,
                 metrics_callback: Callable | None = None, critic_model: Any = None, critics: Any = None,
                 centralized_adapter: Any = None, centralized_comparator_adapter: Any = None, args: Any = None,
                 trainer_options: Mapping[str, Any] | None = None):
        name = type(self).__name__
        self.args = args if args is not None else self.default_config()
        if not isinstance(self.args, self.config_family):
            raise TypeError(f"{name} takes args={self.config_family.__name__}(...) or a subclass; got "
                            f"{type(self.args).__name__}.")
        if model is not None and agent_model is not None:
            raise ValueError("Give agent_model or its older name model, not both.")
        self.wandb_config = dict(wandb_config) if wandb_config is not None else None
        sections = (self.wandb_config or {}).get("config_sections") or {}
        self.dataset_type = dataset_type or (sections.get("dataset") or {}).get("type")
        self.trainer_options = dict(trainer_options or {})
        self.verbose = bool((sections.get("output") or {}).get("verbose", True)) and \
            self.trainer_options.get("enable_progress_bar", True) is not False
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        model_config, critic_head_dim = self.split_model_config(model_config)
        objects = dict(tokenizer=tokenizer, model_config=model_config, reward_func=reward_func,
                       reward_processor=reward_processor, formatters=formatters,
                       external_transition=external_transition, eval_logger=eval_logger,
                       eval_aggregator=eval_aggregator, metrics_callback=metrics_callback, critic_model=critic_model,
                       critics=critics, centralized_adapter=centralized_adapter,
                       centralized_comparator_adapter=centralized_comparator_adapter)
        self.module = self.build_module(team_sources(agent_model or model, agents, num_agents), num_agents, objects,
                                        critic_head_dim)
        self.datamodule = self.build_data() if train_dataset is not None else None
        self._lightning: Trainer | None = None
        self._eval_items = None
        self._fitted = False

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

    def build_module(self, sources: Any, num_agents: int | None, objects: dict[str, Any],
                     critic_head_dim: int | None = None):
        """The module from the config's fields and the trainer's objects (it checks them all, loads nothing)."""
        accepted = module_parameters(self.module_class)
        values = self.args.module_values(self.module_class)
        for field, value in self.args.unused_values(self.module_class).items():
            log.warning("%s.%s=%r has no effect on %s (CoMLRL's config declares it, the algorithm does not read it).",
                        type(self.args).__name__, field, value, self.module_class.__name__)
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
                takers = [t.__name__ for t in TRAINERS if ARGUMENT_FIELDS[argument][0] in module_parameters(t.module_class)]
                raise TypeError(f"{type(self).__name__} does not take {argument}= ({self.module_class.__name__} has "
                                f"no such field); the trainers that take it: {', '.join(takers) or 'none'}.")
            for field in fields:
                values.setdefault(field, value)
        return self.module_class(agents=sources, **values)

    def build_data(self):
        """The data module of the datasets (and the config's data settings)."""
        options = {"show_progress": self.verbose} if self.data_class is PreferenceDataModule else {}
        return self.data_class(dataset=self.train_dataset, eval_dataset=self.eval_dataset,
                               eval_batch_size=self.args.eval_batch_size, prompts_per_step=self.args.prompts_per_step,
                               **options)

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
        sections = dict(config.get("config_sections") or {})
        return WandbLogger(project=config.get("project", "comlrl"), entity=config.get("entity"),
                           name=config.get("name") or config.get("run_name") or f"test-{algorithm.lower()}",
                           save_dir=str(save_dir), tags=config.get("tags"),
                           offline=os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun"),
                           config={**sections, "dataset_type": self.dataset_type, "algorithm": algorithm})

    @property
    def lightning_trainer(self) -> Trainer:
        """The Lightning ``Trainer`` of ``train()`` and ``evaluate()``, built from the run settings once."""
        if self._lightning is None:
            args = self.args
            callbacks = [progress_bar()] if self.verbose else []
            if args.save_steps is not None:
                callbacks.append(RunCheckpoints(args.save_steps))
            options = dict(max_epochs=self.module.fit_epochs() or args.num_train_epochs + self.extra_epochs,
                           max_steps=args.max_steps, log_every_n_steps=args.logging_steps, logger=self.build_logger(),
                           default_root_dir=self.output_dir, enable_checkpointing=args.save_steps is not None,
                           enable_progress_bar=self.verbose, enable_model_summary=False, num_sanity_val_steps=0,
                           accelerator="auto", devices=1)
            extra = dict(self.trainer_options)
            options["callbacks"] = callbacks + list(extra.pop("callbacks", []))
            self._lightning = Trainer(**{**options, **extra})
        return self._lightning

    # ------------------------------------------------------------------ CoMLRL's methods
    def train(self, ckpt_path: str | None = None, **generation_kwargs: Any) -> None:
        """Fit the module on ``train_dataset`` (``ckpt_path``: resume a checkpoint ``save_steps`` wrote)."""
        if generation_kwargs:
            raise TypeError(f"train() got {sorted(generation_kwargs)}: CoMLRL forwards these to generate(); here "
                            f"they are a config field: {type(self.args).__name__}(generation_kwargs={{...}}).")
        if self.datamodule is None:
            raise ValueError(f"train() needs train_dataset: pass train_dataset=... to {type(self).__name__}.")
        if self._fitted:  # train() again trains again, as CoMLRL's does: a fresh Lightning Trainer (a new run folder)
            self._lightning = None
        self.lightning_trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=ckpt_path)
        self._fitted = True

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
    doc = (f"CoMLRL's ``{name}`` on :class:`comlrl_lightning.{module_class.__name__}`; ``args`` is a "
           f"``{family.__name__}`` (docs/compat.md).")
    return type(name, (base,), {"module_class": module_class, "config_family": family, "__doc__": doc,
                                "__module__": __name__, **attrs})


MAGRPOTrainer = _trainer("MAGRPOTrainer", MAGRPO, configs.MAGRPOConfig)
MAREINFORCETrainer = _trainer("MAREINFORCETrainer", MAREINFORCE, configs.MAGRPOConfig, MAGRPOTrainer)
MARLOOTrainer = _trainer("MARLOOTrainer", MARLOO, configs.MAGRPOConfig, MAGRPOTrainer)
MAReMaxTrainer = _trainer("MAReMaxTrainer", MAReMax, configs.MAGRPOConfig, MAGRPOTrainer)
CentralizedMAGRPOTrainer = _trainer("CentralizedMAGRPOTrainer", CentralizedMAGRPO, configs.CentralizedMAGRPOConfig,
                                    MAGRPOTrainer)
IACTrainer = _trainer("IACTrainer", IAC, configs.IACConfig)
MAACTrainer = _trainer("MAACTrainer", MAAC, configs.MAACConfig)
MADPOTrainer = _trainer("MADPOTrainer", MADPO, configs.MADPOConfig, data_class=PreferenceDataModule)
MARLHFTrainer = _trainer("MARLHFTrainer", MARLHF, configs.MADPOConfig, MADPOTrainer, extra_epochs=1)
MADPOIterTrainer = _trainer("MADPOIterTrainer", MADPOIter, configs.MADPOConfig, MADPOTrainer)
MARLHFIterTrainer = _trainer("MARLHFIterTrainer", MARLHFIter, configs.MADPOConfig, MADPOTrainer)

TRAINERS = (MAGRPOTrainer, MAREINFORCETrainer, MARLOOTrainer, MAReMaxTrainer, CentralizedMAGRPOTrainer, IACTrainer,
            MAACTrainer, MADPOTrainer, MARLHFTrainer, MADPOIterTrainer, MARLHFIterTrainer)
