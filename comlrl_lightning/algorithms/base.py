"""MultiAgentModule: N agents in one LightningModule, one optimizer step per team update.

Lightning decisions (DESIGN §2):

* Manual optimization. Every update steps all agents at once through ONE ``torch.optim.AdamW`` holding one
  parameter group per distinct agent model (lr per agent), so ``trainer.global_step`` counts team updates and
  ``max_steps`` means "updates" (Lightning would otherwise count N steps per update, issue 17958).
* The same model object given twice is one set of weights: it gets one parameter group and one optimizer
  state, trained on the sum of the sharing agents' losses. (CoMLRL keeps one AdamW per agent and steps the
  shared weights once per agent — an m-fold step; we take the single-model objective instead.)
* ``env_step`` (joint actions evaluated, CoMLRL's x-axis) is logged with every metric and checkpointed.
* Checkpoints also carry the RNG states so ``ckpt_path`` resume samples what an uninterrupted run would.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from comlrl_lightning.agents import (
    CausalLMWithValueHead,
    load_agents,
    normalize_parallel_training,
    resolve_devices,
    save_agents,
)
from comlrl_lightning.agents.loading import validate_agent_sources
from comlrl_lightning.agents.memory import (
    activation_bytes,
    available_bytes,
    enable_checkpointing,
    missing_state_bytes,
)
from comlrl_lightning.core.advantages import suffix_returns
from comlrl_lightning.rollout.centralized import CentralizedCollaboration, TaggedCentralizedAdapter, check_adapter
from comlrl_lightning.rollout.rewards import build_formatters, check_reward_signature
from comlrl_lightning.rollout.sampling import ScoringInputs, select_rows, token_logprobs


class MultiAgentModule(LightningModule):
    """Base of every algorithm family: loading, optimizers, devices, export, checkpoint state.

    Args:
        agents: one source for a homogeneous team of ``num_agents`` copies — a factory name (``tiny``,
            ``tiny-5m``, ``smollm2-135m-instruct``), a hub id or a local path — or a list with one source or
            loaded model per agent (repeat the same model object to share weights).
        num_agents: team size (default: ``len(agents)`` for a list, else 2).
        tokenizers: one tokenizer (shared), one per agent, a source string, or None (load with each agent).
        model_config: ``dtype`` (e.g. ``bfloat16``), ``attn_implementation`` (default ``sdpa``),
            ``special_tokens``, ``model_kwargs`` passed to ``from_pretrained``, ``gradient_checkpointing``
            (recompute each layer in the backward: ~2.5× less activation memory for ~30% more update time).
        agent_learning_rate: AdamW learning rate, one value or one per agent.
        weight_decay: AdamW weight decay (CoMLRL uses PyTorch's default 0.01).
        max_grad_norm: clip each agent's gradient norm to this value (None: no clipping, as CoMLRL).
        parallel_training: ``none`` (all agents on the trainer's device) or ``mp`` (each agent on its own device
            from ``agent_devices``; agents sample concurrently).
        agent_devices: device spec (REFERENCE §6.1): ``auto``, ``"cuda:1"``, or a list of 1 or N devices.
    """

    def __init__(
        self,
        agents: str | Sequence[Any] = "tiny",
        num_agents: int | None = None,
        tokenizers: Any = None,
        model_config: dict[str, Any] | None = None,
        agent_learning_rate: float | list[float] = 5e-6,
        weight_decay: float = 0.01,
        max_grad_norm: float | None = None,
        parallel_training: str | None = "none",
        agent_devices: str | list[str] | None = None,
    ):
        super().__init__()
        self.automatic_optimization = False
        # ---- validation before any model loads
        model_config = dict(model_config or {})
        unknown = set(model_config) - {"dtype", "torch_dtype", "attn_implementation", "special_tokens", "model_kwargs",
                                       "gradient_checkpointing"}
        if unknown:
            raise ValueError(f"model_config has unknown keys {sorted(unknown)}; allowed: dtype, attn_implementation, "
                             "special_tokens, model_kwargs, gradient_checkpointing.")
        if not isinstance(model_config.get("gradient_checkpointing", False), bool):
            raise ValueError("model_config.gradient_checkpointing must be true or false "
                             f"(got {model_config['gradient_checkpointing']!r}).")
        dtype = model_config.get("dtype", model_config.get("torch_dtype"))
        sources = validate_agent_sources(agents, num_agents, tokenizers, dtype=dtype,
                                         model_kwargs=model_config.get("model_kwargs"),
                                         special_tokens=model_config.get("special_tokens"))
        self.num_agents = len(sources)
        self.parallel_training = normalize_parallel_training(parallel_training)
        if self.parallel_training == "mp" and agent_devices is None:
            raise ValueError("parallel_training='mp' requires explicit agent_devices.")
        if self.parallel_training != "mp" and agent_devices is not None:
            raise ValueError(f"agent_devices is used only with parallel_training='mp' (got parallel_training="
                             f"{self.parallel_training!r}, agent_devices={agent_devices!r}): set parallel_training: "
                             "mp to place each agent on its device, or remove agent_devices (the trainer's "
                             "accelerator/devices place the whole team).")
        self.agent_devices = resolve_devices(agent_devices, self.num_agents, kind="agent_devices") \
            if agent_devices is not None else None
        lrs = agent_learning_rate if isinstance(agent_learning_rate, (list, tuple)) else [agent_learning_rate] * self.num_agents
        if len(lrs) != self.num_agents:
            raise ValueError(f"agent_learning_rate must be one value or one per agent ({self.num_agents}), got {len(lrs)}.")
        if any(lr <= 0 for lr in lrs):
            raise ValueError(f"agent_learning_rate must be > 0 (got {list(lrs)}).")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0 (got {weight_decay}).")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or null (got {max_grad_norm}).")
        self.agent_learning_rates = [float(lr) for lr in lrs]
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        self.gradient_checkpointing = model_config.get("gradient_checkpointing", False)
        # ---- load
        models, self.tokenizers = load_agents(
            sources,
            num_agents=self.num_agents,
            tokenizers=tokenizers,
            dtype=dtype,
            attn_implementation=model_config.get("attn_implementation", "sdpa"),
            model_kwargs=model_config.get("model_kwargs"),
            special_tokens=model_config.get("special_tokens"),
        )
        self.agents = nn.ModuleList(models).train()  # from_pretrained returns eval mode; CoMLRL trains in train mode
        for model in {id(m): m for m in models}.values():
            self.apply_gradient_checkpointing(model)
        self.env_step = 0
        self.reference = None  # set by the ReferenceModels callback when the reference-KL penalty is on
        self.collaboration: CentralizedCollaboration | None = None  # one joint actor for all roles (centralized)
        self._eval_records: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ agents
    def agent_groups(self) -> list[list[int]]:
        """Agent indices grouped by model identity (a group of several = shared weights)."""
        groups: dict[int, list[int]] = {}
        for i, model in enumerate(self.agents):
            groups.setdefault(id(model), []).append(i)
        return list(groups.values())

    def policy_model(self, i: int) -> nn.Module:
        """Agent i's language model for sampling and scoring (the backbone when a value head wraps it, so
        scoring does not compute values it would throw away)."""
        model = self.agents[i]
        return model.model if isinstance(model, CausalLMWithValueHead) else model

    def apply_gradient_checkpointing(self, model: nn.Module) -> None:
        """Turn on ``model_config.gradient_checkpointing`` for a trained model (agent or critic); generation runs
        in eval mode, where it has no effect."""
        if self.gradient_checkpointing:
            enable_checkpointing(model)

    def check_update_fits(self, forwards: Sequence[tuple[nn.Module, ScoringInputs]]) -> None:
        """Raise a clear ``MemoryError`` before the backward when the update's largest forward (one agent's
        micro-batch: models are trained one after another) plus the optimizer state not allocated yet clearly
        exceeds the memory left on the device (``agents/memory.py`` says how it is estimated)."""
        if not forwards:
            return
        cost = {id(m): 0 for m, _ in forwards}
        for model, inputs in forwards:
            rows, width = inputs.input_ids.shape
            need = activation_bytes(model, rows, width, inputs.completion_ids.shape[1] + 1)
            if need is None:
                return
            cost[id(model)] = max(cost[id(model)], need)
        device = self.agent_device(0)
        available = available_bytes(device)
        if available is None:
            return
        trainable = [p for p in self.parameters() if p.requires_grad]
        state = missing_state_bytes(trainable, self.optimizers() if self._trainer is not None else None)
        peak = max(cost.values()) + state
        if peak <= available:
            return
        rows, width = max(((i.input_ids.shape[0], i.input_ids.shape[1]) for _, i in forwards),
                          key=lambda rw: rw[0] * rw[1])
        gib = 2**30
        raise MemoryError(
            f"This update needs about {peak / gib:.1f} GB on {device} (its largest forward, {rows} rows × {width} "
            f"tokens: {max(cost.values()) / gib:.1f} GB kept for the backward; gradients and AdamW state not yet "
            f"allocated: {state / gib:.1f} GB) but about {available / gib:.1f} GB are available. Lower it with "
            f"micro_batch_tokens (tokens per forward, now {getattr(self, 'micro_batch_tokens', None)}), "
            f"micro_batch_size (rows per forward, now {getattr(self, 'micro_batch_size', None)}), "
            f"model_config.gradient_checkpointing (now {self.gradient_checkpointing}; ~2.5x less), or shorter "
            f"sequences (max_new_tokens, now {getattr(self, 'max_new_tokens', None)}).")

    @property
    def samples_concurrently(self) -> bool:
        """Agents on distinct devices (``parallel_training: mp``) generate at the same time, one thread each."""
        return self.parallel_training == "mp" and len(set(map(str, self.agent_devices))) > 1

    def agent_device(self, i: int) -> torch.device:
        return next(self.agents[i].parameters()).device

    def describe_step(self) -> str:
        """Where a run is, for error messages: the update and env_step counters."""
        return f"update {self.global_step} (env_step {self.env_step})"

    def fit_epochs(self) -> int | None:
        """Epochs a fit must run when the algorithm fixes them (iterative rounds), else None (``trainer.max_epochs``
        decides). The CLI uses it as the default of ``trainer.max_epochs``."""
        return None

    def save_pretrained(self, output_dir: str | Path) -> None:
        """``output_dir/agent_{i}/`` with each agent's weights and tokenizer (HF format)."""
        save_agents(list(self.agents), self.tokenizers, output_dir)

    # ------------------------------------------------------------------ Lightning hooks
    def configure_optimizers(self):
        groups = [
            {"params": [p for p in self.agents[ids[0]].parameters() if p.requires_grad],
             "lr": self.agent_learning_rates[ids[0]], "agents": ids}
            for ids in self.agent_groups()
        ]
        return torch.optim.AdamW(groups, weight_decay=self.weight_decay, betas=(0.9, 0.999), eps=1e-8)

    def setup(self, stage: str) -> None:
        if stage == "fit":
            # During fit, evaluation runs on CoMLRL's schedule (EvaluationCallback), not in Lightning's validation
            # loop: switch the loop off for this fit (restored in teardown, so a later trainer.validate works).
            self._limit_val_batches = self.trainer.limit_val_batches
            self.trainer.limit_val_batches = 0

    def teardown(self, stage: str) -> None:
        if stage == "fit" and hasattr(self, "_limit_val_batches"):
            self.trainer.limit_val_batches = self._limit_val_batches

    def on_fit_start(self) -> None:
        for logger in self.loggers:  # W&B charts against env_step (CoMLRL's x-axis) instead of global_step
            if type(logger).__name__ == "WandbLogger":
                logger.experiment.define_metric("env_step")
                logger.experiment.define_metric("*", step_metric="env_step")
        if self.parallel_training == "mp":
            # Model placement: each whole agent on its own device (Lightning moved everything to one).
            for model, device in zip(self.agents, self.agent_devices):
                model.to(device)

    def clip_and_measure_gradients(self) -> dict[str, float]:
        """Gradient norm per agent (and per critic, if any), clipped to ``max_grad_norm`` when it is set."""
        norms = {}
        models = [([f"agent_{i}" for i in ids], self.agents[ids[0]]) for ids in self.agent_groups()]
        models += [([f"critic_{j}"], critic) for j, critic in enumerate(getattr(self, "critics", []))]
        for names, model in models:
            params = [p for p in model.parameters() if p.grad is not None]
            if not params:
                continue
            if self.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            else:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
            for name in names:
                norms[f"{name}/grad_norm"] = float(norm)
        return norms

    def configure_callbacks(self):
        """The optional parts this module's config turns on (attributes set by the algorithm's __init__)."""
        from comlrl_lightning.callbacks import CompletionsLogger, EvaluationCallback, ReferenceModels

        callbacks = []
        if getattr(self, "reference_kl_enabled", False) and self.reference_kl_coef > 0:  # never load unused models
            callbacks.append(ReferenceModels(self.reference_devices, self.micro_batch_size))
        if getattr(self, "eval_interval", 0) > 0 and self.eval_num_samples > 0:
            callbacks.append(EvaluationCallback(self.eval_interval, self.eval_num_samples))
        if getattr(self, "log_completions", False):
            callbacks.append(CompletionsLogger())
        return callbacks

    @torch.no_grad()
    def score_no_grad(self, agent: int, inputs: ScoringInputs) -> Tensor:
        """Agent ``agent``'s token log-probs [B, T] (CPU) in eval mode, micro-batched."""
        model = self.policy_model(agent)
        was_training = model.training
        model.eval()
        rows = inputs.input_ids.shape[0]
        step = getattr(self, "micro_batch_size", None) or rows
        try:
            return torch.cat([token_logprobs(model, select_rows(inputs, slice(s, s + step))).cpu()
                              for s in range(0, rows, step)])
        finally:
            model.train(was_training)

    # ------------------------------------------------------------------ evaluation
    # ``evaluation_record(items)`` plays the evaluation episodes of a batch, ``evaluation_metrics(records)``
    # reduces them; the schedule (EvaluationCallback) and the `validate` loop call ``evaluate`` / these.
    @torch.no_grad()
    def evaluation_record(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One sampled trajectory per item over all turns through ``self.engine`` (no tree, no early
        termination), scored with the task reward. Algorithms without a rollout engine override this pair."""
        rollout = self.engine.rollout(self.agents, self.tokenizers, items, num_generations=1,
                                      early_termination=False, policy_version=self.global_step)
        rewards = torch.zeros(len(items), self.num_turns)
        completions = [[[] for _ in items] for _ in range(self.num_agents)]  # [agent][item][turn]
        for b, root in enumerate(rollout.roots):
            node, t = root, 0
            while node is not None:
                rewards[b, t] = node.rewards[0]
                for i, agent in enumerate(node.agents):
                    completions[i][b].append(agent.texts[0])
                node, t = node.children.get(0), t + 1
        # What the eval logger gets as ``prompts``: each item's own ``prompt`` field, as CoMLRL passes it.
        prompts = [item.get("prompt") for item in items]
        return {"rewards": rewards, "completions": completions, "items": list(items), "prompts": prompts}

    def evaluation_metrics(self, records: list[dict[str, Any]]) -> dict[str, float]:
        rewards = torch.cat([r["rewards"] for r in records])
        returns = suffix_returns(rewards, self.discount)
        metrics = {"env_step": float(self.env_step)}
        for t in range(self.num_turns):
            metrics[f"eval/turn_{t + 1}/reward_mean"] = float(rewards[:, t].mean())
            metrics[f"eval/turn_{t + 1}/expected_return"] = float(returns[:, t].mean())
        if self.eval_logger is not None and self.eval_aggregator is not None:
            items = [it for r in records for it in r["items"]]
            completions = [[c for r in records for c in r["completions"][i]] for i in range(self.num_agents)]
            if self.collaboration is not None:  # the user's logger sees each role's part of the joint answer
                completions = self.collaboration.split_turns(completions[0], items)
            per_sample = call_filtered(self.eval_logger, agent_completions_turns=completions, batch_items=items,
                                        prompts=[p for r in records for p in r["prompts"]],
                                        test_cases=[it.get("test", "") for it in items],
                                        entry_points=[it.get("entry_point", "") for it in items])
            aggregated = call_filtered(self.eval_aggregator, metrics=per_sample, num_turns=self.num_turns)
            for key, value in (aggregated or {}).items():
                metrics[key if key.startswith("eval/") else f"eval/{key}"] = float(value)
        return metrics

    def evaluate(self, items: Sequence[Any], batch_size: int = 1) -> dict[str, float]:
        """Evaluation metrics over ``items`` (in batches of ``batch_size``) with the task reward."""
        records = [self.evaluation_record(items[s : s + batch_size]) for s in range(0, len(items), batch_size)]
        return self.evaluation_metrics(records)

    def validation_step(self, batch: list[Any], batch_idx: int):
        self._eval_records.append(self.evaluation_record(batch))

    def on_validation_epoch_start(self) -> None:
        self._eval_records = []

    def on_validation_epoch_end(self) -> None:
        if self._eval_records:
            self.log_dict(self.evaluation_metrics(self._eval_records))
        self._eval_records = []

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["comlrl_lightning"] = {
            "env_step": self.env_step,
            "rng": _rng_state(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("comlrl_lightning", {})
        self.env_step = int(state.get("env_step", 0))
        self._rng_to_restore = state.get("rng")

    def on_train_start(self) -> None:
        # Restore RNG after Lightning's own start-up (which may draw random numbers) for exact resume.
        rng = getattr(self, "_rng_to_restore", None)
        if rng:
            _set_rng_state(rng)
            self._rng_to_restore = None


COLLABORATION_MODES = ("decentralized", "centralized")


@dataclass
class Team:
    """What the module is built from: the actors it trains and the formatters/reward they are scored with."""

    agents: Any
    num_agents: int | None
    tokenizers: Any
    formatters: Any
    reward_func: Any
    collaboration: CentralizedCollaboration | None = None


def team_for(collaboration_mode: str, agents: Any, num_agents: int | None, tokenizers: Any, formatters: Any,
             reward_func: Any, adapter: Any = None) -> Team:
    """``decentralized``: N agents, as given. ``centralized`` (REFERENCE §5.15): ONE actor writes a joint answer for
    the ``num_agents`` roles; its formatter is the adapter's joint prompt and its reward splits the answer and calls
    the user's N-role reward (``rollout.centralized.CentralizedCollaboration``)."""
    mode = str(collaboration_mode).strip().lower()
    if mode not in COLLABORATION_MODES:
        raise ValueError(f"collaboration_mode must be decentralized or centralized. (got {collaboration_mode!r})")
    if mode == "decentralized":
        return Team(agents, num_agents, tokenizers, formatters, reward_func)
    actors = list(agents) if isinstance(agents, (list, tuple)) else [agents]
    if len(actors) != 1:
        raise ValueError(f"Centralized collaboration requires exactly one actor model (got {len(actors)}).")
    if isinstance(tokenizers, (list, tuple)) and len(tokenizers) != 1:
        raise ValueError(f"Centralized collaboration requires one actor tokenizer (got {len(tokenizers)}).")
    if not callable(reward_func):
        raise ValueError("reward_func must be a callable.")
    num_roles = 2 if num_agents is None else int(num_agents)
    collaboration = CentralizedCollaboration(check_adapter(adapter or TaggedCentralizedAdapter()),
                                             build_formatters(formatters, num_roles), reward_func, num_roles)
    return Team(actors, 1, tokenizers, [collaboration.formatter], collaboration, collaboration)


def team_size(kwargs: Mapping[str, Any]) -> int:
    """The number of agents (roles) the module will have, for the checks that run before models load (a list of
    agents that disagrees with ``num_agents`` is reported by the agents' own check)."""
    num_agents, agents = kwargs.get("num_agents"), kwargs.get("agents", "tiny")
    if str(kwargs.get("collaboration_mode", "")).strip().lower() == "centralized":
        return 2 if num_agents is None else int(num_agents)  # roles; the one actor is not the team size
    if isinstance(agents, (list, tuple)) and agents:
        return len(agents)
    return 2 if num_agents is None else int(num_agents)


def _rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) RNG states as tensors and plain values (``weights_only``-loadable)."""
    version, mt_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, torch.tensor(mt_state, dtype=torch.int64), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state.tolist()), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def call_filtered(func, **kwargs):
    """Call with the keyword arguments ``func`` names (all of them if it takes ``**kwargs``)."""
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return func(**kwargs)
    return func(**{k: v for k, v in kwargs.items() if k in params})


def plain_hparams(local_vars: dict[str, Any]) -> dict[str, Any]:
    """Hyper-parameters worth saving: plain values, and import paths of callables (not model objects)."""
    out = {}
    for key, value in local_vars.items():
        if key in ("self", "__class__") or key.startswith("_"):
            continue
        if callable(value) and hasattr(value, "__module__") and hasattr(value, "__qualname__"):
            out[key] = f"{value.__module__}.{value.__qualname__}"
        elif value is None or isinstance(value, (str, int, float, bool)):
            out[key] = value
        elif isinstance(value, (list, tuple, dict)) and all(isinstance(v, (str, int, float, bool)) for v in
                                                              (value.values() if isinstance(value, dict) else value)):
            out[key] = value
    return out


def check_config(checks: Sequence[tuple[bool, str]], *, reward_func: Any, eval_interval: int = 0,
                 eval_num_samples: int = 0, eval_logger: Any = None, eval_aggregator: Any = None,
                 micro_batch_size: int | None = None, micro_batch_tokens: int | None = None,
                 reward_timeout: float | None = None, num_agents: int | None = None,
                 formatters: Any = None) -> None:
    """Raise ``ValueError`` for the first broken rule — the ones every algorithm shares, then ``checks``
    (``(ok, message)`` pairs whose message names the field and the allowed values). Called before models load."""
    if reward_func is None or not callable(reward_func):
        raise ValueError("reward_func must be a callable (give its import path in YAML, e.g. "
                         "reward_func: comlrl_lightning.envs.toy.story_reward).")
    shared = [
        (micro_batch_size is None or micro_batch_size >= 1, "micro_batch_size must be >= 1 or null."),
        (micro_batch_tokens is None or micro_batch_tokens >= 1, "micro_batch_tokens must be >= 1 or null."),
        (reward_timeout is None or reward_timeout > 0, "reward_timeout must be > 0 seconds or null."),
        (eval_interval >= 0, "eval_interval must be >= 0."),
        (eval_num_samples >= 0, "eval_num_samples must be >= 0."),
        ((eval_logger is None) == (eval_aggregator is None),
         "eval_logger and eval_aggregator must be given together (one without the other would be ignored)."),
    ]
    for ok, message in [*shared, *checks]:
        if not ok:
            raise ValueError(message)
    if num_agents is not None and num_agents >= 1:  # a team size below 1 is the agents check's to report
        check_reward_signature(reward_func, num_agents)
        build_formatters(formatters, num_agents)  # one per agent (or one for all), each callable

