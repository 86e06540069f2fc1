"""CoMLRL's configuration dataclasses, derived from our modules' fields (docs/compat.md).

``MAGRPOConfig``, ``IACConfig``, ``MADPOConfig`` ... are dataclasses with CoMLRL's class names, field names and
defaults. No field is declared here a second time; each comes from one of three places:

* **the module's own fields** — every parameter of the module's ``__init__`` chain (``algorithms/fields.py`` and
  the family's class), with CoMLRL's default where it differs from ours (:data:`COMLRL_DEFAULTS`, e.g. CoMLRL's
  ``num_turns=2``). Ours beyond CoMLRL's (``loss_aggregation``, ``lr_decay``, ``lora_rank`` ...) are there too.
  Objects (models, callables) are trainer arguments, as in CoMLRL, not config fields (:data:`OBJECT_FIELDS`).
* **run settings** (:data:`RUN_FIELDS`): what CoMLRL keeps in its configs and Lightning in its ``Trainer`` or our
  data modules (``num_train_epochs`` -> ``Trainer(max_epochs)``, ``logging_steps`` -> ``log_every_n_steps`` ...).
* **fields CoMLRL declares but its algorithm does not use** (MADPO's ``discount``, ``advantage_mode`` ...): kept
  with CoMLRL's defaults so that a CoMLRL config still builds; the trainer reports a non-default value as having no
  effect.

A config checks its values when it is built, as CoMLRL's ``__post_init__`` does, with the module's own checks (the
module is built without models: it only validates, it loads nothing), so the messages are the module's.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from typing import Any, ClassVar

from comlrl_lightning.agents.devices import normalize_parallel_training
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
from comlrl_lightning.algorithms.fields import declared_fields, require
from comlrl_lightning.data import TaskDataModule

# What a run setting of CoMLRL's configs becomes here: (default, type, where it goes).
RUN_FIELDS: dict[str, tuple[Any, str, str]] = {
    "num_train_epochs": (
        20,
        "int",
        "Trainer(max_epochs=...) (MARLHF: + 1, the reward-model epoch; iterative "
        "variants: a module field, epochs per round)",
    ),
    "logging_steps": (50, "int", "Trainer(log_every_n_steps=...), counted in updates (CoMLRL: env steps)"),
    "eval_batch_size": (1, "int", "TaskDataModule(eval_batch_size=...)"),
    "prompts_per_step": (1, "int", "TaskDataModule(prompts_per_step=...): items sampled per training step"),
    "max_steps": (-1, "int", "Trainer(max_steps=...): stop after this many updates (-1: no limit)"),
    "output_dir": (
        None,
        "str | None",
        "Trainer(default_root_dir=...): logs, metrics.csv, checkpoints (default: outputs)",
    ),
    "save_steps": (
        None,
        "int | None",
        "a Lightning checkpoint every N updates, resumable with train(ckpt_path=...) (default: none, as CoMLRL)",
    ),
}
# Older CoMLRL names of a field.
ALIASES = {
    "learning_rate": "agent_learning_rate",
    "termination_threshold": "early_termination_threshold",
    "per_device_train_batch_size": "prompts_per_step",
}
# Module fields that are objects: trainer arguments in CoMLRL (tokenizer=, reward_func=, critics=, ...).
OBJECT_FIELDS = (
    "agents",
    "tokenizers",
    "model_config",
    "reward_func",
    "reward_processor",
    "formatters",
    "external_transition",
    "eval_logger",
    "eval_aggregator",
    "metrics_callback",
    "critic_model",
    "critics",
    "centralized_adapter",
    "centralized_comparator_adapter",
)
# CoMLRL's defaults where they differ from our modules' (docs/differences.md says why ours differ).
COMLRL_DEFAULTS = {
    "MAGRPOConfig": {"num_agents": 2, "num_turns": 2, "early_termination_threshold": -0.2},
    "IACConfig": {
        "num_agents": 2,
        "num_turns": 2,
        "early_termination_threshold": -0.2,
        "num_train_epochs": 40,
        "logging_steps": 1,
    },
    "MADPOConfig": {"num_agents": 2},
}
# CoMLRL's names of module fields that are ours under another name (its num_train_epochs means DPO passes per round
# in MADPOIterConfig and RL epochs per round in MARLHFIterConfig; each has a name of its own here).
COMLRL_NAMES = {
    "MADPOIterConfig": {"num_train_epochs": "dpo_epochs_per_round"},
    "MARLHFIterConfig": {"num_train_epochs": "rl_epochs_per_round"},
}
# CoMLRL's MADPOConfig keeps the MAGRPO fields it shares a base with; MADPO itself never reads them.
MADPO_UNUSED = (
    "discount",
    "early_termination_threshold",
    "external_prompt_passthrough",
    "rollout_buffer_size",
    "advantage_normalization",
    "advantage_mode",
    "reference_kl_enabled",
    "reference_kl_coef",
    "reference_devices",
)


def module_parameters(module_class: type) -> dict[str, inspect.Parameter]:
    """Every field of a module, as its generated ``__init__`` declares it (``fields.declared_fields``: the field
    groups with the module's own defaults)."""
    return {name: p for name, p in inspect.signature(module_class).parameters.items()}


def _dry_reward(*agent_completions, **_):
    return [0.0] * len(agent_completions[0])


# The stand-in declares a range, so that a config with log_reward_distribution=True builds; the trainer checks the
# user's reward function for it.
_dry_reward.reward_range = (0.0, 1.0)


def _dry_transition(prompt, agent_completions, num_agents, **_):
    return [prompt] * num_agents


class CoMLRLConfig:
    """Base of the generated configs: the module they configure and the checks run when one is built."""

    module_class: ClassVar[type]
    comlrl_defaults: ClassVar[dict[str, Any]] = {}
    comlrl_names: ClassVar[dict[str, str]] = {}  # CoMLRL's name of a field -> the module's (COMLRL_NAMES)

    def __post_init__(self) -> None:
        for name in ("num_train_epochs", "logging_steps"):  # eval_batch_size, prompts_per_step: the data module's
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, f"{name} must be >= 1.")
        require(self.save_steps is None or self.save_steps >= 1, "save_steps must be >= 1 or None.")
        require(self.max_steps == -1 or self.max_steps >= 1, "max_steps must be >= 1 or -1 (no limit).")
        if hasattr(self, "parallel_training"):
            try:
                self.parallel_training = normalize_parallel_training(self.parallel_training)
            except ValueError as err:
                raise ValueError(f"{err} Here: trainer_options={{'strategy': 'ddp', 'devices': N}}.") from None
        if issubclass(self.module_class, CentralizedMAGRPO):
            require(
                self.collaboration_mode == "centralized", "CentralizedMAGRPOConfig requires centralized collaboration."
            )
        self.check(self.module_class)
        if getattr(self, "collaboration_mode", None) == "centralized" and hasattr(self, "comparator_generation_mode"):
            self.comparator_generation_mode = "centralized"  # one joint actor: its comparator is centralized (CoMLRL)

    def module_values(self, module_class: type | None = None) -> dict[str, Any]:
        """The values of the fields ``module_class`` (default: this config's) accepts, under its names."""
        accepted = module_parameters(module_class or self.module_class)
        ours = {f.name: self.comlrl_names.get(f.name, f.name) for f in dataclasses.fields(self)}
        return {ours[name]: getattr(self, name) for name in ours if ours[name] in accepted}

    def unused_values(self, module_class: type) -> dict[str, Any]:
        """Fields ``module_class`` does not read (neither its own nor a run setting) that differ from the default."""
        accepted = module_parameters(module_class)
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if self.comlrl_names.get(f.name, f.name) not in accepted
            and f.name not in RUN_FIELDS
            and getattr(self, f.name) != f.default
        }

    def check(self, module_class: type) -> None:
        """Build ``module_class`` from these values with stand-ins for the objects a trainer gives (a model name,
        a reward, a transition, a critic), and a data module with the data settings: each checks its fields and
        loads nothing."""
        accepted = module_parameters(module_class)
        stand_ins = {
            "agents": "tiny",
            "reward_func": _dry_reward,
            "external_transition": _dry_transition,
            "critic_model": "tiny",
        }
        if not issubclass(module_class, IAC):  # MARLHF's critics default to its agents'; its MAGRPO family takes none
            del stand_ins["critic_model"]
        module_class(**self.module_values(module_class), **{k: v for k, v in stand_ins.items() if k in accepted})
        TaskDataModule(
            dataset=[{"prompt": ""}], eval_batch_size=self.eval_batch_size, prompts_per_step=self.prompts_per_step
        )


def _field(default: Any) -> dataclasses.Field:
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=functools.partial(type(default), default))
    return dataclasses.field(default=default)


def make_config(
    name: str,
    module_class: type,
    parent: type | None = None,
    defaults: dict[str, Any] | None = None,
    excluded: tuple[str, ...] = (),
    borrowed: tuple[type, tuple[str, ...]] | None = None,
) -> type:
    """The dataclass ``name`` configuring ``module_class``: the run settings (on a root config), the module's fields
    with CoMLRL's ``defaults`` (inherited from ``parent``), and ``borrowed`` fields of another module that CoMLRL's
    config declares too. ``excluded``: module fields CoMLRL's config does not have."""
    defaults = {**(parent.comlrl_defaults if parent else {}), **COMLRL_DEFAULTS.get(name, {}), **(defaults or {})}
    specs = (
        []
        if parent
        else [(k, annotation, _field(defaults.get(k, default))) for k, (default, annotation, _) in RUN_FIELDS.items()]
    )
    params = dict(module_parameters(module_class))
    if borrowed is not None:
        params.update({k: p for k, p in module_parameters(borrowed[0]).items() if k in borrowed[1]})
    names = COMLRL_NAMES.get(name, {})
    theirs = {ours: comlrl for comlrl, ours in names.items()}
    for field, param in params.items():
        if field in OBJECT_FIELDS or field in excluded:
            continue
        field = theirs.get(field, field)
        specs.append((field, param.annotation, _field(defaults.get(field, param.default))))
    doc = (
        f"CoMLRL's ``{name}``: the fields of :class:`comlrl_lightning.{module_class.__name__}` with CoMLRL's "
        f"defaults, plus the run settings (docs/compat.md)."
    )
    cls = dataclasses.make_dataclass(
        name,
        specs,
        bases=(parent or CoMLRLConfig,),
        namespace={
            "module_class": module_class,
            "comlrl_defaults": defaults,
            "comlrl_names": names,
            "__doc__": doc,
            "__module__": __name__,
        },
    )
    cls.__init__ = _keyword_init(cls)
    return cls


def _keyword_init(cls: type):
    """The dataclass ``__init__``, taking CoMLRL's older names (:data:`ALIASES`) and naming an unknown field."""
    generated = cls.__init__
    names = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(generated)
    def __init__(self, **values: Any) -> None:
        for old, new in ALIASES.items():
            if old in values:
                require(new not in values, f"{cls.__name__}: give {new} or its older name {old}, not both.")
                values[new] = values.pop(old)
        for unknown in sorted(set(values) - set(names)):
            close = difflib.get_close_matches(unknown, names, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise TypeError(
                f"{cls.__name__} has no field {unknown!r}.{hint} Its fields are listed by "
                f"dataclasses.fields({cls.__name__}) (docs/compat.md)."
            )
        generated(self, **values)

    return __init__


def _advantage_default(module_class: type) -> dict[str, str]:
    return {"advantage_mode": declared_fields(module_class)["advantage_mode"].default}


MAGRPOConfig = make_config("MAGRPOConfig", MAGRPO, defaults=_advantage_default(MAGRPO))
MAREINFORCEConfig = make_config("MAREINFORCEConfig", MAREINFORCE, MAGRPOConfig, _advantage_default(MAREINFORCE))
MARLOOConfig = make_config("MARLOOConfig", MARLOO, MAGRPOConfig, _advantage_default(MARLOO))
MAReMaxConfig = make_config("MAReMaxConfig", MAReMax, MAGRPOConfig, _advantage_default(MAReMax))
CentralizedMAGRPOConfig = make_config(
    "CentralizedMAGRPOConfig", CentralizedMAGRPO, MAGRPOConfig, {"num_turns": 1, "collaboration_mode": "centralized"}
)
IACConfig = make_config("IACConfig", IAC)
MAACConfig = make_config(
    "MAACConfig",
    MAAC,
    defaults=COMLRL_DEFAULTS["IACConfig"],
    excluded=("use_separate_critic", "value_clip_range", "value_head_hidden_dim"),
)
MADPOConfig = make_config("MADPOConfig", MADPO, defaults={"advantage_mode": "mean"}, borrowed=(MAGRPO, MADPO_UNUSED))
MARLHFConfig = make_config("MARLHFConfig", MARLHF, MADPOConfig)
MADPOIterConfig = make_config("MADPOIterConfig", MADPOIter, MADPOConfig)
MARLHFIterConfig = make_config("MARLHFIterConfig", MARLHFIter, MARLHFConfig)

CONFIGS = (
    MAGRPOConfig,
    MAREINFORCEConfig,
    MARLOOConfig,
    MAReMaxConfig,
    CentralizedMAGRPOConfig,
    IACConfig,
    MAACConfig,
    MADPOConfig,
    MARLHFConfig,
    MADPOIterConfig,
    MARLHFIterConfig,
)
