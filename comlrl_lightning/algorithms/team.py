"""The team a module trains, and where it trains: the sources and their tokenizers, formatters and reward (a
centralized team is one model writing every role), a LoRA team's plan, the devices of each agent, and the
strategies a team trains under (one device, DDP, FSDP2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from comlrl_lightning.agents import load_agents, resolve_devices, resolve_single_device, save_agents
from comlrl_lightning.agents.loading import context_problem, validate_agent_sources
from comlrl_lightning.agents.lora import LoRATeam, adapter_base, is_adapter_dir
from comlrl_lightning.agents.memory import enable_checkpointing
from comlrl_lightning.agents.sharding import full_state_dicts, is_sharded, shard
from comlrl_lightning.algorithms.fields import require
from comlrl_lightning.config_errors import ConfigurationError, require_config
from comlrl_lightning.rollout.centralized import CentralizedCollaboration, TaggedCentralizedAdapter, check_adapter
from comlrl_lightning.rollout.rewards import build_formatters, check_reward_signature
from comlrl_lightning.runs import ranks

MODEL_CONFIG_KEYS = (
    "dtype",
    "torch_dtype",
    "attn_implementation",
    "special_tokens",
    "model_kwargs",
    "gradient_checkpointing",
)


@dataclass
class Team:
    """What the module is built from: the actors it trains and the formatters/reward they are scored with; once
    assembled (:func:`assemble_team`), also where each agent lives and learns and how it is loaded."""

    agents: Any
    num_agents: int | None
    tokenizers: Any
    formatters: Any
    reward_func: Any
    collaboration: CentralizedCollaboration | None = None
    sources: list[Any] = field(default_factory=list)  # the validated agent sources, one per agent
    lora: dict[str, Any] | None = None  # a LoRA team's plan (lora_plan), else None
    devices: list[torch.device] | None = None  # each agent's device (None: where the trainer places the module)
    learning_rates: list[float] = field(default_factory=list)  # each agent's
    model_config: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool = False  # model_config.gradient_checkpointing


def assemble_team(values: Mapping[str, Any]) -> Team:
    """The team the fields ``values`` describe, checked before any model loads: the model config, a centralized
    team's joint actor, a LoRA plan, the sources (each resolvable), each agent's device and learning rate, and the
    reward and formatters against the number of roles."""
    config = dict(values["model_config"] or {})
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
    team = team_for(
        values["collaboration_mode"],
        values["agents"],
        values["num_agents"],
        values["tokenizers"],
        values["formatters"],
        values["reward_func"],
        values["centralized_adapter"],
    )
    team.model_config, team.gradient_checkpointing = config, config.get("gradient_checkpointing", False)
    team.lora = lora_plan(team.agents, team.num_agents, values)
    if team.lora is not None:  # the team's sources: the base once per agent
        team.agents = [team.lora["base"]] * team.lora["num_agents"]
        require(
            values["parallel_training"] == "none",
            "parallel_training='mp' places whole agents on devices; a LoRA team (lora_rank, or adapter folders "
            "as agents) shares one base model, so it runs where the trainer places it: remove "
            "parallel_training/agent_devices.",
        )
    team.sources = validate_agent_sources(
        team.agents,
        team.num_agents,
        team.tokenizers,
        dtype=config.get("dtype", config.get("torch_dtype")),
        model_kwargs=config.get("model_kwargs"),
        special_tokens=config.get("special_tokens"),
    )
    team.num_agents = len(team.sources)
    problem = context_problem(team.sources, values.get("max_new_tokens"), config.get("model_kwargs"))
    require(problem is None, problem or "")  # read from the models' configs, no weights loaded
    team.devices, team.learning_rates = placement(values, team.num_agents)
    roles = team.collaboration.num_roles if team.collaboration is not None else team.num_agents
    check_reward_signature(values["reward_func"], roles)
    build_formatters(values["formatters"], roles)  # one per role (or one for all), each callable
    return team


def placement(values: Mapping[str, Any], n: int) -> tuple[list[torch.device] | None, list[float]]:
    """Each of the ``n`` agents' device and learning rate. ``parallel_training: mp``: each agent on its own device;
    otherwise the whole team on ONE device, the first named (none named, or auto: None, where the trainer puts the
    module)."""
    devices = values["agent_devices"]
    mp = values["parallel_training"] == "mp"
    require(not mp or devices is not None, "parallel_training='mp' requires explicit agent_devices.")
    placed = resolve_devices(devices, n, kind="agent_devices") if mp else team_placement(devices, n, "agent_devices")
    rates = values["agent_learning_rate"]
    rates = list(rates) if isinstance(rates, (list, tuple)) else [rates] * n
    require(len(rates) == n, f"agent_learning_rate must be one value or one per agent ({n}), got {len(rates)}.")
    return placed, [float(r) for r in rates]


def load_team(team: Team) -> tuple[list[nn.Module], list[Any]]:
    """The agents' models (training mode) and tokenizers: one per agent (the same object where agents share
    weights), or a LoRA team's one base with an adapter view per agent (``agents/lora.py``)."""
    config, lora = team.model_config, team.lora
    models, tokenizers = load_agents(
        team.sources[:1] if lora else team.sources,
        num_agents=1 if lora else team.num_agents,
        tokenizers=team.tokenizers,
        dtype=config.get("dtype", config.get("torch_dtype")),
        attn_implementation=config.get("attn_implementation", "sdpa"),
        model_kwargs=config.get("model_kwargs"),
        special_tokens=config.get("special_tokens"),
    )
    if lora:
        views = LoRATeam(
            models[0], team.num_agents, adapters=lora["adapters"], base_name=lora["base"], **lora["settings"]
        )
        models, tokenizers = views.views, tokenizers * team.num_agents
    return [m.train() for m in models], tokenizers  # from_pretrained gives eval mode


def team_for(
    collaboration_mode: str,
    agents: Any,
    num_agents: int | None,
    tokenizers: Any,
    formatters: Any,
    reward_func: Any,
    adapter: Any = None,
) -> Team:
    """``decentralized``: N agents, as given. ``centralized`` (the paper's single-model baseline): ONE actor writes a
    joint answer for the ``num_agents`` roles; its formatter is the adapter's joint prompt and its reward splits the
    answer and calls the user's N-role reward (``rollout.centralized.CentralizedCollaboration``)."""
    if collaboration_mode == "decentralized":
        return Team(agents, num_agents, tokenizers, formatters, reward_func)
    actors = list(agents) if isinstance(agents, (list, tuple)) else [agents]
    require(len(actors) == 1, f"Centralized collaboration requires exactly one actor model (got {len(actors)}).")
    require(
        not (isinstance(tokenizers, (list, tuple)) and len(tokenizers) != 1),
        "Centralized collaboration requires one actor tokenizer.",
    )
    num_roles = 2 if num_agents is None else int(num_agents)
    collaboration = CentralizedCollaboration(
        check_adapter(adapter or TaggedCentralizedAdapter()),
        build_formatters(formatters, num_roles),
        reward_func,
        num_roles,
    )
    return Team(actors, 1, tokenizers, [collaboration.formatter], collaboration, collaboration)


def freeze(model: nn.Module) -> None:
    """``model`` never learns: no gradients, so no optimizer state either (a frozen agent of ``trained_agents``; a LoRA
    team's agent freezes its own adapter only)."""
    own = getattr(model, "freeze", None)
    if callable(own):
        own()
    else:
        model.requires_grad_(False)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What training ``model`` updates: its parameters that require gradients, or — an agent of a LoRA team, which
    shares its module with the other agents — its own adapter's."""
    own = getattr(model, "trainable_parameters", None)
    return list(own()) if callable(own) else [p for p in model.parameters() if p.requires_grad]


def lora_plan(agents: Any, num_agents: int | None, fields: Mapping[str, Any]) -> dict[str, Any] | None:
    """The LoRA team the fields ask for (``lora_rank``, or adapter folders as ``agents``), else None: the base source,
    the team size, the adapter folders to load and the LoRA settings of fresh adapters."""
    sources = list(agents) if isinstance(agents, (list, tuple)) else [agents]
    folders = [s for s in sources if is_adapter_dir(s)]
    if folders:
        require(
            len(folders) == len(sources),
            "agents: either every agent is a saved LoRA adapter folder or none is "
            f"(got {len(folders)} adapter folders among {len(sources)} agents).",
        )
        bases = {adapter_base(f) for f in folders}
        require(
            len(bases) == 1,
            f"agents: the adapter folders were trained on different base models {sorted(bases)}; "
            "a LoRA team shares one base.",
        )
        return {"base": bases.pop(), "num_agents": len(folders), "adapters": [str(f) for f in folders], "settings": {}}
    if fields.get("lora_rank") is None:
        return None
    distinct = {s if isinstance(s, str) else id(s) for s in sources}
    require(
        len(distinct) == 1 and isinstance(sources[0], str),
        f"lora_rank={fields['lora_rank']}: a LoRA team puts one adapter per agent on ONE base model; set agents to "
        f"one model name or path (got {sources!r}). Teams of different models train as full copies (lora_rank: "
        "null).",
    )
    n = len(sources) if isinstance(agents, (list, tuple)) else (num_agents or 2)
    settings = {
        "rank": fields["lora_rank"],
        "alpha": fields["lora_alpha"],
        "dropout": fields["lora_dropout"],
        "target_modules": fields["lora_target_modules"],
    }
    return {"base": sources[0], "num_agents": n, "adapters": [], "settings": settings}


def check_strategy(trainer: Any, module: Any) -> None:
    """The strategies a team trains under: one device; Lightning's DDP (any launcher: ``ddp``, ``ddp_spawn``,
    ``ddp_notebook``; any number of nodes); or agents sharded over the ranks with FSDP2 (``ModelParallelStrategy``,
    ``tensor_parallel_size: 1``: agents, critics and reward models). ``parallel_training: mp``
    places agents on several devices of ONE process; combined with several processes, every process would claim the
    same devices."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    strategy, name = trainer.strategy, type(trainer.strategy).__name__
    if isinstance(strategy, ModelParallelStrategy):
        check_sharded(strategy, module)
    elif not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or "DeepSpeed" in name:
        raise ConfigurationError(
            f"trainer.strategy {name} is not supported; use a single device (trainer.devices: 1), data-parallel "
            "training (trainer.strategy: ddp, any trainer.devices and trainer.num_nodes), or agents sharded with "
            "FSDP2 (trainer.strategy: lightning.pytorch.strategies.ModelParallelStrategy with tensor_parallel_size: "
            "1; Lightning's FSDPStrategy is FSDP1, which this project does not use) (docs/scaling.md)."
        )
    accelerator = type(getattr(trainer, "accelerator", None)).__name__
    require_config(
        not module.vllm_enable_sleep_mode or module.generation_backend != "vllm" or accelerator == "CUDAAccelerator",
        f"vllm_enable_sleep_mode: true needs a GPU (its memory is what sleep mode releases), but the trainer "
        f"runs on {accelerator.removesuffix('Accelerator')}: set vllm_enable_sleep_mode: false.",
    )
    require_config(
        getattr(module, "vllm_server_weight_transfer", "file") != "nccl" or accelerator == "CUDAAccelerator",
        f"vllm_server_weight_transfer: nccl broadcasts the weights from the trainer's GPU, but the trainer runs on "
        f"{accelerator.removesuffix('Accelerator')}: set vllm_server_weight_transfer: file.",
    )
    if module.parallel_training != "mp" and module.team.devices is not None and trainer.world_size > 1:
        raise ConfigurationError(
            f"agent_devices/critic_devices without parallel_training: mp place the whole team on ONE device "
            f"({module.team.devices[0]}), but trainer.strategy {name} runs {trainer.world_size} processes "
            "(trainer.devices x trainer.num_nodes), each with its own device: remove agent_devices and critic_devices "
            "(each process then places its team), or run one process (docs/scaling.md)."
        )
    if module.parallel_training == "mp" and trainer.world_size > 1:
        raise ConfigurationError(
            f"parallel_training='mp' places agents on the devices of one process, but trainer.strategy {name} runs "
            f"{trainer.world_size} processes (trainer.devices x trainer.num_nodes). Use one of them: "
            "parallel_training: mp with trainer.devices: 1, or trainer.strategy: ddp with parallel_training: none "
            "(docs/scaling.md)."
        )


def check_sharded(strategy: Any, module: Any) -> None:
    """What agents sharded with FSDP2 (``ModelParallelStrategy``) can train with."""
    require_config(
        getattr(strategy, "_tensor_parallel_size", 1) == 1,
        f"trainer.strategy ModelParallelStrategy: tensor_parallel_size must be 1 (got "
        f"{strategy._tensor_parallel_size!r}; its default `auto` is every device of a node): agents are "
        "sharded over the data-parallel ranks with FSDP2 and tensor parallelism is not available. Set "
        "trainer.strategy.init_args.tensor_parallel_size 1 and data_parallel_size to the number of "
        "processes.",
    )
    require_config(
        module.lora is None,
        "trainer.strategy ModelParallelStrategy (FSDP) with a LoRA team "
        "(lora_rank) is not available: a LoRA team's base is frozen and held once, "
        "so use trainer.strategy ddp.",
    )
    servers = module.generation_backend == "vllm" and getattr(module, "vllm_mode", "colocate") == "server"
    require_config(
        module.generation_backend == "hf" or servers,
        f"generation_backend: {module.generation_backend} with trainer.strategy ModelParallelStrategy "
        "(FSDP) is not available in this process: the engine would need each sharded agent's whole weights after "
        "every update. Use vLLM servers (vllm_mode: server: the weights are gathered whole and rank 0 sends them), "
        "trainer.strategy ddp with this backend, or generation_backend: hf under FSDP.",
    )
    require_config(
        module.generation_dtype == "model",
        f"generation_dtype {module.generation_dtype!r} with trainer.strategy ModelParallelStrategy "
        "(FSDP) is not available: a sharded agent has no whole weights to copy between steps. Set "
        "generation_dtype: model, or load the agents in bf16 (model_config: {dtype: bfloat16}).",
    )


def team_placement(spec: Any, n: int, kind: str) -> list[torch.device] | None:
    """Without ``parallel_training: mp``: CoMLRL's one device for the whole team of ``n`` — the first entry of
    ``spec`` — or None (the trainer places the team) when ``spec`` is null, ``auto`` or starts with ``auto``."""
    first = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
    if spec is None or (isinstance(first, str) and first.strip().lower() == "auto"):
        return None
    return [resolve_single_device(spec, kind=kind)] * n


def check_first_items(datamodule: Any, stage: str | None, formatters: list[Any]) -> None:
    """Try every formatter on the first item of each split the run reads (training and evaluation items for a fit,
    the stage's items otherwise), so that a formatter that cannot read a dataset's items fails before any model
    loads, naming the formatter, the split and the error (a ``ConfigurationError``)."""
    first_items = getattr(datamodule, "first_items", None)
    if not callable(first_items):
        return
    for split, item in first_items(stage).items():
        for i, formatter in enumerate(formatters):
            try:
                formatter(item)
            except Exception as err:  # noqa: BLE001 - user code: any error is reported the same way
                text = err.args[0] if isinstance(err, KeyError) and err.args else err
                name = f"formatters[{i}]" if len(formatters) > 1 else "formatters"
                raise ConfigurationError(
                    f"{name} failed on the first item of the {split} ({type(err).__name__}: {text})"
                ) from err


def load_models(module: Any, wrap_agents: Callable[[list[nn.Module]], list[nn.Module]] | None = None) -> None:
    """``configure_model``: load the team (gradient checkpointing on each distinct model when asked; then
    ``wrap_agents``, when given, e.g. IAC's value heads on the actors) and the
    model parts' models once (each registered under its part's name); then, under FSDP2 (``ModelParallelStrategy``), shard every model of
    ``module.sharded_models()`` not sharded yet. Idempotent."""
    if "agents" not in module._modules:
        models, module._tokenizers = load_team(module.team)
        for model in {id(m): m for m in models}.values():
            apply_gradient_checkpointing(module.team, model)
        if wrap_agents is not None:
            models = wrap_agents(models)
        for i in module.agent_schedule.frozen:  # trained_agents: the others sample with frozen weights
            freeze(models[i])
        module._modules["agents"] = nn.ModuleList(models)
        for part in module.model_parts():
            part.module = part.build(module._tokenizers, module._modules["agents"])
            module._modules[part.name] = part.module
    strategy = module._trainer.strategy if module._trainer is not None else None
    if type(strategy).__name__ == "ModelParallelStrategy":
        for model in module.sharded_models():
            if not is_sharded(model):
                shard(model, strategy.device_mesh["data_parallel"])


def agent_groups(agents: Any, among: Any = None) -> list[list[int]]:
    """Agent indices grouped by model identity (a group of several = shared weights); with ``among``, the groups
    of those agents only."""
    groups: dict[int, list[int]] = {}
    for i, model in enumerate(agents):
        groups.setdefault(id(model), []).append(i)
    return [g for g in groups.values() if among is None or set(g) & set(among)]


def apply_gradient_checkpointing(team: Team, model: nn.Module) -> None:
    """Turn on ``model_config.gradient_checkpointing`` for a trained model (agent or critic)."""
    if team.gradient_checkpointing:
        enable_checkpointing(model)


def place_models(module: Any) -> None:
    """When a fit starts: each agent on its device (``agent_devices``), then each model part's models on theirs."""
    if module.team.devices is not None:
        for model, device in zip(module.agents, module.team.devices):
            model.to(device)
    for part in module.model_parts():
        part.place()


def export(module: Any, root: Path) -> None:
    """``save_pretrained``: ``root/agent_{i}/`` per agent (weights and tokenizer, HF format; sharded agents are
    gathered on every rank, rank 0 writes), then each model part's models."""
    states = full_state_dicts(list(module.agents))
    with ranks.rank_zero_first() as writer:
        if writer:
            save_agents(list(module.agents), module.tokenizers, root, state_dicts=states)
    for part in module.model_parts():
        part.save_pretrained(root, module.tokenizers)
