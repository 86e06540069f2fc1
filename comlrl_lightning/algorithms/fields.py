"""Every configuration field, declared once, typed and described.

Each group below is a small class whose ``__init__`` takes its fields, checks each one on its own (the allowed
values of a ``Literal`` field, ranges), stores them as attributes and passes the rest on with
``super().__init__(**kwargs)``. An algorithm is the groups it uses plus :class:`MultiAgentModule`
(``algorithms/base.py``)::

    class MAGRPO(RolloutFields, ReferenceKLFields, OnPolicyModule): ...

so a field has one declaration, one default and one description wherever it appears, the YAML names stay flat
(``model.init_args.num_generations``) and ``--help`` / ``--print_config`` show every field's description (the
CLI reads the ``Args:`` sections below and follows the ``**kwargs`` chain). A subclass changes a default by
re-declaring only that parameter and passing it on (``IAC`` samples one completion per prompt by default).
Checks that involve several groups (the reward against the team size, devices against placement) run in
``MultiAgentModule.check_config`` once every group is stored, still before any model is loaded.
"""

from __future__ import annotations

import functools
import inspect
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, get_args, get_origin

from comlrl_lightning.agents import check_model_sources, normalize_parallel_training
from comlrl_lightning.agents.devices import PARALLEL_TRAINING
from comlrl_lightning.comparators.api import API_FORMAT, ApiComparatorConfig
from comlrl_lightning.comparators.sources import COMPARATOR_GENERATION_MODE, COMPARATOR_POLICY
from comlrl_lightning.core.losses import ImportanceSamplingMode
from comlrl_lightning.core.replay import REPLAY_MODE
from comlrl_lightning.rollout.centralized import TaggedCentralizedAdapter, check_adapter
from comlrl_lightning.rollout.generation import GenerationBackendName
from comlrl_lightning.rollout.tree import JOINT_MODE

ParallelTraining = PARALLEL_TRAINING.Literal  # null: an alias of none (stored as none)
CollaborationMode = Literal["decentralized", "centralized"]
LrDecay = Literal["constant", "linear", "cosine"]
AdamWImplementation = Literal["auto", "fused", "foreach", "for-loop"]
JointMode = JOINT_MODE.Literal  # align/crossed: aliases of aligned/cross
LossAggregation = Literal["seq_sum", "token_mean", "seq_mean_token_mean", "dr_grpo"]
KlEstimator = Literal["k1", "k2", "k3"]
KlPlacement = Literal["reward", "loss"]
CriticType = Literal["v", "q"]
GenerationDtype = Literal["model", "bfloat16", "float16"]
PairSelection = Literal["reward_gap", "random", "all"]
IterativePairSelection = Literal["reward_gap", "random", "all", "comparator_reward"]  # the iterative variants'
# Choice errors with their own wording (the field, the value and the choices are still named).
CHOICE_MESSAGES = {
    "collaboration_mode": "collaboration_mode must be decentralized or centralized (got {value!r}).",
    "joint_mode": JOINT_MODE.message.replace("{aliases}", ""),
}


def choices_of(annotation: Any) -> tuple[str, ...] | None:
    """The allowed values of a ``Literal`` annotation (also inside ``Optional``), else None."""
    if get_origin(annotation) is Literal:
        return tuple(get_args(annotation))
    for arg in get_args(annotation):
        found = choices_of(arg)
        if found is not None:
            return found
    return None


def check_choices(function: Callable, values: dict[str, Any], owner: type | None = None) -> dict[str, Any]:
    """``values`` with every ``Literal`` field's choice in its canonical spelling (CoMLRL accepts any case from
    Python); a value outside the choices is rejected: ``<field> must be one of: a, b, c (got 'x').`` (CoMLRL's own
    wording where it has one, :data:`CHOICE_MESSAGES`). The same rule the CLI applies to YAML. ``owner``: the class
    being built; a field it re-declares (``MADPOIter``'s ``pair_selection``) is checked against that declaration,
    as the CLI does."""
    hints = typing.get_type_hints(function)
    checked = dict(values)
    for name, value in values.items():
        allowed = choices_of(declared_annotation(owner, name) if owner is not None else hints.get(name))
        if allowed is None or value is None:
            continue
        spelled = str(value).strip().lower() if isinstance(value, str) else value
        if spelled not in allowed:
            template = CHOICE_MESSAGES.get(name, "{name} must be one of: {allowed} (got {value!r}).")
            raise ValueError(template.format(name=name, value=value, allowed=", ".join(map(str, allowed))))
        checked[name] = spelled
    return checked


@functools.lru_cache(maxsize=None)
def declared_annotation(owner: type, name: str) -> Any:
    """The annotation of parameter ``name`` in the first ``__init__`` of ``owner``'s MRO that declares it (the
    declaration Python's keyword passing, the CLI and ``--help`` use)."""
    for klass in owner.__mro__:
        init = vars(klass).get("__init__")
        if init is not None and name in inspect.signature(init).parameters:
            return typing.get_type_hints(init).get(name)
    return None


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _fields(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in ("self", "kwargs", "__class__")}


class FieldGroup:
    """Base of the groups: checks the ``Literal`` fields of the caller's ``__init__``, stores every field (also
    in ``self.field_values``, which the hyper-parameters are saved from) and continues the chain."""

    def _store(self, function: Callable, values: dict[str, Any], rename: dict[str, str] | None = None) -> None:
        """``rename``: fields kept under another attribute (``agents`` is the name of the loaded team)."""
        fields = check_choices(function, _fields(values), type(self))
        self.__dict__.setdefault("field_values", {}).update(fields)
        for name, value in fields.items():  # plain attributes, set before nn.Module.__init__ runs
            object.__setattr__(self, (rename or {}).get(name, name), value)


class AgentFields(FieldGroup):
    """The team and where it runs.

    Args:
        agents: the team: one source for ``num_agents`` independent copies (a factory name ``tiny``/``tiny-5m``/
            ``smollm2-135m-instruct``, a hub id or a local path), or a list with one source or loaded model per
            agent (the same model object twice shares weights).
        num_agents: team size (default: the length of the ``agents`` list, else 2).
        tokenizers: one tokenizer for all agents, one per agent, a source string, or null (each agent's own).
        model_config: loading options: ``dtype``, ``attn_implementation``, ``special_tokens``, ``model_kwargs``,
            ``gradient_checkpointing`` (recompute layers in the backward: ~2.5x less activation memory).
        parallel_training: ``none`` (one device for the whole team) or ``mp`` (each agent on its own device from
            ``agent_devices``; agents on distinct devices generate concurrently); ``null`` means ``none``.
        agent_devices: with ``parallel_training: mp``: ``auto``, one device for all, or one per agent. Without it
            (as CoMLRL): the whole team on the first device given (null or ``auto``: where the trainer puts it).
        lora_rank: train a LoRA team: ONE frozen base model (``agents``) with one adapter of this rank per agent
            (null: every agent a full trainable copy). Adapter folders saved by a LoRA team as ``agents`` load one.
        lora_alpha: LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank).
        lora_dropout: dropout on the LoRA input.
        lora_target_modules: the layers that get adapters: ``all-linear`` or a list of module names
            (e.g. ``[q_proj, v_proj]``).
    """

    def __init__(
        self,
        agents: str | Sequence[Any] = "tiny",
        num_agents: int | None = None,
        tokenizers: Any = None,
        model_config: dict[str, Any] | None = None,
        parallel_training: ParallelTraining | None = "none",
        agent_devices: str | list[str] | None = None,
        lora_rank: int | None = None,
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        lora_target_modules: str | list[str] = "all-linear",
        **kwargs: Any,
    ):
        parallel_training = normalize_parallel_training(parallel_training)  # null/None -> none; ddp: where to go
        self._store(AgentFields.__init__, locals(), {"agents": "agent_sources", "tokenizers": "tokenizer_sources"})
        require(
            lora_rank is None or (isinstance(lora_rank, int) and lora_rank >= 1),
            f"lora_rank must be an integer >= 1 or null (got {lora_rank!r}).",
        )
        require(lora_alpha > 0, f"lora_alpha must be > 0 (got {lora_alpha!r}).")
        require(0 <= lora_dropout < 1, f"lora_dropout must be in [0, 1) (got {lora_dropout!r}).")
        super().__init__(**kwargs)


class TaskFields(FieldGroup):
    """What the agents are asked and how the team is scored.

    Args:
        reward_func: the team reward, ``reward_func(*agent_completions, prompts=None, batch_items=None) ->
            list[float]``: one completion list per agent, one reward per joint action (an import path in YAML).
        reward_processor: applied to every reward (``float -> float``), e.g. ``ScaleShift``.
        reward_timeout: seconds one reward call may take; a call that hangs fails the run, naming the step
            (null: no limit).
        formatters: ``item -> prompt`` per agent, or one for all (default: the item's ``prompt``).
        use_chat_template: wrap prompts in the tokenizer's chat template (off: CoMLRL's raw prompts).
        collaboration_mode: ``decentralized`` (N agents) or ``centralized`` (one model writes every role's part
            of a joint answer).
        centralized_adapter: builds the joint prompt and splits the joint answer (default: ``<agent_i>`` tags).
    """

    def __init__(
        self,
        reward_func: Callable[..., Any] | None = None,
        reward_processor: Callable[[float], float] | None = None,
        reward_timeout: float | None = None,
        formatters: list[Callable[..., str]] | None = None,
        use_chat_template: bool = False,
        collaboration_mode: CollaborationMode = "decentralized",
        centralized_adapter: Any = None,
        **kwargs: Any,
    ):
        self._store(TaskFields.__init__, locals())
        require(
            reward_func is not None and callable(reward_func),
            "reward_func must be a callable (give its import path in YAML, e.g. "
            "reward_func: comlrl_lightning.envs.toy.story_reward).",
        )
        require(reward_processor is None or callable(reward_processor), "reward_processor must be a callable.")
        require(reward_timeout is None or reward_timeout > 0, "reward_timeout must be > 0 seconds or null.")
        super().__init__(**kwargs)


class SamplingFields(FieldGroup):
    """How completions are sampled (always sampling), and by which engine.

    Args:
        max_new_tokens: longest completion, in tokens.
        temperature: sampling temperature (> 0).
        top_p: nucleus sampling mass in (0, 1].
        top_k: sample among the k most likely tokens (null: all).
        generation_backend: the engine every sampling goes through: ``hf`` (Hugging Face ``generate`` on the
            training weights), ``vllm`` (a vLLM engine in this process, weights synced after every update) or
            ``transformers_cb`` (transformers' continuous batching on the training weights). Training always
            scores the samples with the training model (docs/scaling.md#generation-backends).
        generation_kwargs: more sampling arguments (not the ones that have their own field); ``hf``: any
            ``generate`` argument, e.g. ``cache_implementation: static``; ``vllm``: ``min_new_tokens``,
            ``repetition_penalty``, ``min_p``, ``stop_strings``; ``transformers_cb``: the first three.
        generation_batch_size: prompts per ``generate`` call of the ``hf`` backend (null: all of a step's prompts).
        generation_dtype: the ``hf`` backend samples with the training weights as they are (``model``), or with a
            ``bfloat16`` / ``float16`` copy of them refreshed after each update (memory-bound decoding reads half the
            bytes; the samples come from the rounded weights, training scores them with its own). On a CPU without
            fp16 matrix units (AVX2), ``float16`` keeps float32 products over fp16 weights.
        vllm_gpu_memory_utilization: ``vllm``: share of the GPU's memory each engine may take (weights and KV cache).
        vllm_enable_sleep_mode: ``vllm``: engines release their GPU memory during each update (GPU only).
        vllm_max_model_len: ``vllm``: prompt + completion tokens an engine is sized for (null: the model's maximum).
    """

    def __init__(
        self,
        max_new_tokens: int = 256,
        temperature: float = 0.6,
        top_p: float = 0.6,
        top_k: int | None = 50,
        generation_backend: GenerationBackendName = "hf",
        generation_kwargs: dict[str, Any] | None = None,
        generation_batch_size: int | None = None,
        generation_dtype: GenerationDtype = "model",
        vllm_gpu_memory_utilization: float = 0.3,
        vllm_enable_sleep_mode: bool = False,
        vllm_max_model_len: int | None = None,
        **kwargs: Any,
    ):
        self._store(SamplingFields.__init__, locals())
        require(max_new_tokens >= 1, f"max_new_tokens must be >= 1 (got {max_new_tokens}).")
        require(temperature > 0, f"temperature must be > 0 (got {temperature}).")
        require(0 < top_p <= 1, f"top_p must be in (0, 1] (got {top_p}).")
        require(top_k is None or top_k >= 1, f"top_k must be >= 1 or null (got {top_k}).")
        reserved = sorted(
            {"do_sample", "temperature", "top_p", "top_k", "max_new_tokens", "num_return_sequences", "num_beams"}
            & set(generation_kwargs or {})
        )
        require(
            not reserved,
            f"generation_kwargs must not set {reserved}: sampling is always on and these have "
            "their own fields (temperature, top_p, top_k, max_new_tokens, num_generations).",
        )
        require(
            generation_batch_size is None or generation_batch_size >= 1, "generation_batch_size must be >= 1 or null."
        )
        require(
            0 < vllm_gpu_memory_utilization <= 1,
            f"vllm_gpu_memory_utilization must be in (0, 1] (got {vllm_gpu_memory_utilization}).",
        )
        require(
            vllm_max_model_len is None or vllm_max_model_len > max_new_tokens,
            f"vllm_max_model_len must be null or more than max_new_tokens ({max_new_tokens}), got "
            f"{vllm_max_model_len}.",
        )
        super().__init__(**kwargs)


class OptimizationFields(FieldGroup):
    """The optimizer (one AdamW, a parameter group per distinct model), its schedule and the update's forwards.

    Args:
        agent_learning_rate: AdamW learning rate, one value or one per agent.
        weight_decay: AdamW weight decay (PyTorch's 0.01, as CoMLRL).
        adamw_implementation: AdamW's kernel: ``auto`` (``fused`` where the device supports it and no model is
            sharded, else ``foreach``), ``fused`` (one kernel for all tensors), ``foreach`` or ``for-loop``.
        max_grad_norm: clip each model's gradient norm to this (null: no clipping, as CoMLRL).
        lr_warmup_steps: updates of linear warm-up from 0 to the learning rate (0: none).
        lr_decay: after warm-up: ``constant``, or ``linear``/``cosine`` decay towards ``lr_min_ratio`` x the rate,
            reached just after the last of ``lr_decay_steps`` updates.
        lr_decay_steps: updates the schedule spans, warm-up included (null: ``trainer.max_steps``).
        lr_min_ratio: the decayed learning rate's floor, as a fraction of the learning rate.
        micro_batch_size: rows per forward of an update (gradients accumulate; null: all rows at once).
        micro_batch_tokens: at most this many tokens per forward (rows x longest row; a prompt shared by K rows
            counted once): bounds update memory for long prompts (null: no budget).
        keep_freed_cpu_memory: on a CPU, the process keeps the memory a step frees for the next one instead of
            returning it to the system, which hands pages out anew at a page fault each (glibc, process-wide: the
            process stays at its peak memory; opt-in).
    """

    def __init__(
        self,
        agent_learning_rate: float | list[float] = 5e-6,
        weight_decay: float = 0.01,
        adamw_implementation: AdamWImplementation = "auto",
        max_grad_norm: float | None = None,
        lr_warmup_steps: int = 0,
        lr_decay: LrDecay = "constant",
        lr_decay_steps: int | None = None,
        lr_min_ratio: float = 0.0,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = None,
        keep_freed_cpu_memory: bool = False,
        **kwargs: Any,
    ):
        self._store(OptimizationFields.__init__, locals())
        rates = agent_learning_rate if isinstance(agent_learning_rate, (list, tuple)) else [agent_learning_rate]
        require(all(r > 0 for r in rates), f"agent_learning_rate must be > 0 (got {list(rates)}).")
        require(weight_decay >= 0, f"weight_decay must be >= 0 (got {weight_decay}).")
        require(max_grad_norm is None or max_grad_norm > 0, f"max_grad_norm must be > 0 or null (got {max_grad_norm}).")
        require(lr_warmup_steps >= 0, f"lr_warmup_steps must be >= 0 (got {lr_warmup_steps}).")
        require(
            lr_decay_steps is None or lr_decay_steps >= 1,
            f"lr_decay_steps must be >= 1 or null (got {lr_decay_steps}).",
        )
        require(0.0 <= lr_min_ratio <= 1.0, f"lr_min_ratio must be in [0, 1] (got {lr_min_ratio}).")
        require(micro_batch_size is None or micro_batch_size >= 1, "micro_batch_size must be >= 1 or null.")
        require(micro_batch_tokens is None or micro_batch_tokens >= 1, "micro_batch_tokens must be >= 1 or null.")
        super().__init__(**kwargs)


class EvaluationFields(FieldGroup):
    """Evaluation during training and what is logged.

    Args:
        eval_interval: evaluate every this many training batches (0: never).
        eval_num_samples: evaluation items (the first ones of the eval set), one trajectory each.
        eval_logger: per-sample metrics of an evaluation (``agent_completions_turns``, ``batch_items``,
            ``prompts``, ``test_cases``, ``entry_points``: the ones it names).
        eval_aggregator: reduces ``eval_logger``'s output to ``eval/<key>`` metrics.
        log_completions: write what the agents said to ``completions.jsonl`` (and a W&B table).
        eval_at_end: evaluate the trained team once more when a fit ends (unless its last update was just evaluated,
            or evaluation is off).
    """

    def __init__(
        self,
        eval_interval: int = 16,
        eval_num_samples: int = 4,
        eval_logger: Callable[..., Any] | None = None,
        eval_aggregator: Callable[..., Any] | None = None,
        log_completions: bool = True,
        eval_at_end: bool = True,
        **kwargs: Any,
    ):
        self._store(EvaluationFields.__init__, locals())
        require(eval_interval >= 0, "eval_interval must be >= 0.")
        require(eval_num_samples >= 0, "eval_num_samples must be >= 0.")
        require(
            (eval_logger is None) == (eval_aggregator is None),
            "eval_logger and eval_aggregator must be given together (one without the other would be ignored).",
        )
        super().__init__(**kwargs)


class JointActionFields(FieldGroup):
    """Turns and joint actions.

    Args:
        num_turns: turns per episode (> 1 needs ``external_transition``).
        joint_mode: ``aligned`` (agent i's k-th sample with every other agent's k-th) or ``cross`` (every
            combination); ``align``/``crossed`` are aliases.
    """

    def __init__(self, num_turns: int = 1, joint_mode: JointMode = "aligned", **kwargs: Any):
        self._store(JointActionFields.__init__, locals())
        require(num_turns >= 1, "num_turns must be >= 1.")
        self.joint_mode = self.field_values["joint_mode"] = JOINT_MODE(self.joint_mode)
        super().__init__(**kwargs)


class RolloutFields(JointActionFields):
    """The rollout tree and the update schedule of the on-policy families.

    Args:
        num_generations: samples per agent per prompt (K).
        discount: gamma in G = r + gamma * mean(child returns).
        early_termination_threshold: a node whose mean reward is strictly above this opens no children (null:
            never).
        external_transition: the next turn's prompts from this turn's completions (``num_turns > 1``).
        external_prompt_passthrough: later turns use the transition's prompt verbatim (not through the formatter).
        rollout_buffer_size: nodes (joint samples for actor-critic) collected before the buffer is trained on.
        train_batch_size: nodes per update (null: ``rollout_buffer_size``).
        advantage_normalization: standardise advantages within each group (or per agent and turn).
        loss_aggregation: ``seq_sum`` (CoMLRL), ``token_mean``, ``seq_mean_token_mean`` or ``dr_grpo``.
        vllm_importance_sampling_correction: ``vllm``: weight each token's policy-gradient term by the ratio of the
            training model's probability of the sampled token to the engine's, truncated or masked (trl's names;
            off: the loss is the plain on-policy one over the engine's samples).
        vllm_importance_sampling_mode: ``token_truncate`` / ``token_mask`` (ratio per token, capped or zeroed above
            the cap) or ``sequence_truncate`` / ``sequence_mask`` (one ratio per completion).
        vllm_importance_sampling_cap: the ratio's cap C.
    """

    def __init__(
        self,
        num_generations: int = 4,
        discount: float = 1.0,
        early_termination_threshold: float | None = None,
        external_transition: Callable[..., Any] | None = None,
        external_prompt_passthrough: bool = False,
        rollout_buffer_size: int = 2,
        train_batch_size: int | None = None,
        advantage_normalization: bool = True,
        loss_aggregation: LossAggregation = "seq_sum",
        vllm_importance_sampling_correction: bool = False,
        vllm_importance_sampling_mode: ImportanceSamplingMode = "token_truncate",
        vllm_importance_sampling_cap: float = 2.0,
        **kwargs: Any,
    ):
        self._store(RolloutFields.__init__, locals())
        require(
            vllm_importance_sampling_cap > 0,
            f"vllm_importance_sampling_cap must be > 0 (got {vllm_importance_sampling_cap}).",
        )
        require(num_generations >= 1, "num_generations must be >= 1.")
        require(0.0 <= discount <= 1.0, "discount must be in [0, 1].")
        require(rollout_buffer_size >= 1, "rollout_buffer_size must be >= 1.")
        self.train_batch_size = rollout_buffer_size if train_batch_size is None else train_batch_size
        self.field_values["train_batch_size"] = train_batch_size
        require(self.train_batch_size >= 1, "train_batch_size must be >= 1.")
        super().__init__(**kwargs)


class ReferenceKLFields(FieldGroup):
    """The KL penalty towards the initial agents (frozen copies held by a callback, never loaded when off).

    Args:
        reference_kl_enabled: penalise divergence from the initial agents.
        reference_kl_coef: the penalty's weight beta (0: off).
        reference_kl_estimator: ``k1``, ``k2`` or ``k3`` (Schulman's estimators).
        reference_kl_placement: ``reward`` (on the returns, before the baseline) or ``loss`` (a per-token term).
        reference_devices: where the reference copies live (default: each agent's device).
    """

    def __init__(
        self,
        reference_kl_enabled: bool = False,
        reference_kl_coef: float = 0.1,
        reference_kl_estimator: KlEstimator = "k3",
        reference_kl_placement: KlPlacement = "reward",
        reference_devices: str | list[str] | None = None,
        **kwargs: Any,
    ):
        self._store(ReferenceKLFields.__init__, locals())
        require(reference_kl_coef >= 0, "reference_kl_coef must be >= 0.")
        super().__init__(**kwargs)


class CriticFields(FieldGroup):
    """The critics of the actor-critic family (IAC: one per agent; MAAC: one over the joint text).

    Args:
        use_separate_critic: a separate critic LM per agent (else a value head on the actor's backbone; MAAC
            always has a separate critic).
        critic_model: the critics' source (factory name, hub id or path), one for every agent.
        critics: one critic source or model per agent (MAAC: one), instead of ``critic_model``.
        critic_type: ``v`` (V(h) from the prompt) or ``q`` (Q(h, a) from the prompt and the completion).
        critic_learning_rate: the critics' learning rate (null: ``agent_learning_rate``).
        critic_value_head_hidden_dim: hidden width of a separate critic's value head (null: linear).
        value_head_hidden_dim: hidden width of the value head on the actor (null: linear).
        value_clip_range: PPO-style value clipping for a value head on the actor (null: none).
        value_loss_coef: weight of the value loss in the update's loss.
        critic_devices: with ``parallel_training: mp``: the critics' devices (one, or one per critic).
        metrics_callback: ``rollouts -> dict``, averaged into the log as ``turn_t/<key>``.
    """

    def __init__(
        self,
        use_separate_critic: bool = True,
        critic_model: str | None = None,
        critics: Sequence[Any] | None = None,
        critic_type: CriticType = "v",
        critic_learning_rate: float | None = 5e-6,
        critic_value_head_hidden_dim: int | None = None,
        value_head_hidden_dim: int | None = None,
        value_clip_range: float | None = 0.2,
        value_loss_coef: float = 0.6,
        critic_devices: str | list[str] | None = None,
        metrics_callback: Callable[..., Any] | None = None,
        **kwargs: Any,
    ):
        self._store(CriticFields.__init__, locals(), {"critics": "critic_sources"})
        require(value_loss_coef > 0, "value_loss_coef must be > 0.")
        require(value_clip_range is None or value_clip_range > 0, "value_clip_range must be > 0 or null.")
        require(critic_learning_rate is None or critic_learning_rate > 0, "critic_learning_rate must be > 0 or null.")
        for name in ("critic_value_head_hidden_dim", "value_head_hidden_dim"):
            require(locals()[name] is None or locals()[name] >= 0, f"{name} must be >= 0 or null.")
        super().__init__(**kwargs)


class PreferenceFields(JointActionFields):
    """How the preference algorithms turn sampled candidates into pairs (the task reward is the oracle).

    Args:
        preference_num_candidates: completions each agent samples per task (joint candidate k pairs every
            agent's k-th).
        preference_pairs_per_sample: pairs kept per task (null: all; must be null with ``pair_selection: all``).
        pair_selection: ``reward_gap`` (largest score gaps first), ``random``, ``all``; the iterative variants add
            ``comparator_reward``.
    """

    def __init__(
        self,
        preference_num_candidates: int = 80,
        preference_pairs_per_sample: int | None = 16,
        pair_selection: PairSelection = "reward_gap",
        **kwargs: Any,
    ):
        self._store(PreferenceFields.__init__, locals())
        require(preference_num_candidates >= 2, "preference_num_candidates must be >= 2.")
        require(
            preference_pairs_per_sample is None or preference_pairs_per_sample >= 1,
            "preference_pairs_per_sample must be >= 1 or null.",
        )
        require(
            self.pair_selection != "all" or preference_pairs_per_sample is None,
            "preference_pairs_per_sample must be null when pair_selection='all'.",
        )
        super().__init__(**kwargs)


# Iterative preference training. Choices list the canonical names first, then their aliases (any case from
# Python; the CLI takes the spellings listed): each declared once, where its values are used.
ReplayMode = REPLAY_MODE.Literal
ComparatorPolicy = COMPARATOR_POLICY.Literal
GenerationMode = COMPARATOR_GENERATION_MODE.Literal
ApiFormat = API_FORMAT.Literal


class ReplayFields(FieldGroup):
    """The rounds of iterative preference training and what each round trains on.

    Args:
        num_iterations: rounds of collect → replay → train.
        preference_replay_mode: which stored rounds a round trains on: ``current``, ``nearest_k``, ``all_history``
            or ``lambda_decay`` (aliases latest, recent_k, lambda, ...).
        preference_replay_k: rounds ``nearest_k`` draws from.
        preference_replay_lambda: weight decay per round back for ``lambda_decay``, in [0, 1].
        preference_replay_sample_size: pairs drawn from the history per round (null: as many as the round has).
        preference_replay_dir: where the rounds' pairs are stored (null: ``<log dir>/preference_replay``).
        log_reward_distribution: per round, histograms of both sides' rewards (needs ``reward_func.reward_range``).
        policy_checkpoint_dir: save the agents every round here (null: only when the comparator is ``history``).
    """

    def __init__(
        self,
        num_iterations: int = 6,
        preference_replay_mode: ReplayMode = "current",
        preference_replay_k: int | None = None,
        preference_replay_lambda: float | None = None,
        preference_replay_sample_size: int | None = None,
        preference_replay_dir: str | None = None,
        log_reward_distribution: bool = False,
        policy_checkpoint_dir: str | None = None,
        **kwargs: Any,
    ):
        require(isinstance(num_iterations, int) and num_iterations >= 1, "num_iterations must be >= 1.")
        preference_replay_mode = REPLAY_MODE(preference_replay_mode)
        self._store(ReplayFields.__init__, locals())
        mode, k, lam = preference_replay_mode, preference_replay_k, preference_replay_lambda
        historical = (
            "preference_replay_sample_size is only valid when preference_replay_mode is 'nearest_k', "
            "'all_history', or 'lambda_decay'."
        )
        require(
            mode != "current" or k in (None, 1),
            "preference_replay_k is only valid when preference_replay_mode='nearest_k'.",
        )
        require(mode != "current" or preference_replay_sample_size is None, historical)
        require(
            mode != "nearest_k" or k is not None,
            "preference_replay_k is required when preference_replay_mode='nearest_k'.",
        )
        require(mode != "nearest_k" or (isinstance(k, int) and k >= 1), "preference_replay_k must be >= 1.")
        require(
            mode in ("current", "nearest_k") or k is None,
            "preference_replay_k is only valid when preference_replay_mode='nearest_k'.",
        )
        require(
            mode != "lambda_decay" or lam is not None,
            "preference_replay_lambda is required when preference_replay_mode='lambda_decay'.",
        )
        require(
            mode != "lambda_decay" or (isinstance(lam, (int, float)) and 0.0 <= float(lam) <= 1.0),
            "preference_replay_lambda must be in [0, 1].",
        )
        require(
            mode == "lambda_decay" or lam is None,
            "preference_replay_lambda is only valid when preference_replay_mode='lambda_decay'.",
        )
        require_positive_or_none(preference_replay_sample_size, "preference_replay_sample_size")
        for name, given in (
            ("preference_replay_dir", preference_replay_dir),
            ("policy_checkpoint_dir", policy_checkpoint_dir),
        ):
            require(
                given is None or not Path(given).expanduser().exists() or Path(given).expanduser().is_dir(),
                f"{name} must be a directory; {given!r} is a file.",
            )
        super().__init__(**kwargs)


class ComparatorFields(FieldGroup):
    """The other side of each comparison in iterative preference training.

    Args:
        comparator_policy: the other side of each comparison: ``current``, ``current_copy``, ``model``,
            ``history`` or ``api``.
        comparator_generation_mode: ``decentralized`` (a comparator per role) or ``centralized`` (one writes all).
        comparator_centralized_agent_index: the role whose comparator writes the joint answer (centralized).
        comparator_model_name: the ``model`` comparator's source, for every role.
        comparator_agents: ``model`` comparators, one source or model per role (or one for all).
        comparator_tokenizers: tokenizers of ``comparator_agents`` given as models (default: the agents').
        comparator_devices: where comparator models sample (default: the agents' devices).
        comparator_num_candidates: the comparator's samples per task (null: ``preference_num_candidates``).
        comparator_history_k: ``history``: compare with the policy as it was k rounds back.
        centralized_comparator_adapter: builds the joint prompt and splits the joint answer (default: tags).
        comparator_api_url: the ``api`` comparator's endpoint.
        comparator_api_format: ``generic``, ``openai``, ``anthropic`` or ``openai_responses``.
        comparator_api_model: the model name sent to the API.
        comparator_api_max_n_per_request: completions per request (null: all at once where the format allows).
        comparator_api_timeout: seconds per request.
        comparator_api_headers: extra HTTP headers.
        comparator_api_key: the API key itself (never saved or logged; prefer ``comparator_api_key_env``).
        comparator_api_key_env: the environment variable holding the API key.
        comparator_api_key_header: the header the key is sent in.
        comparator_api_key_prefix: the key's prefix in that header (``Bearer``).
        comparator_api_response_field: where the completions are in a ``generic`` response.
        comparator_api_extra_body: extra fields of every request body.
        comparator_api_max_retries: retries of a request on timeouts, 429 and 5xx.
        comparator_api_backoff_s: first retry wait, doubled each retry.
        comparator_api_max_concurrency: requests in flight at once.
        comparator_api_max_retry_after_s: the longest ``Retry-After`` honoured (longer ones are capped, logged).
        comparator_api_deadline_s: the total time one request may take with its retries (null: no limit).
    """

    def __init__(
        self,
        comparator_policy: ComparatorPolicy = "current",
        comparator_generation_mode: GenerationMode = "decentralized",
        comparator_centralized_agent_index: int = 0,
        comparator_model_name: str | None = None,
        comparator_agents: list[Any] | None = None,
        comparator_tokenizers: Any = None,
        comparator_devices: str | list[str] | None = None,
        comparator_num_candidates: int | None = None,
        comparator_history_k: int | None = None,
        centralized_comparator_adapter: Any = None,
        comparator_api_url: str | None = None,
        comparator_api_format: ApiFormat = "generic",
        comparator_api_model: str | None = None,
        comparator_api_max_n_per_request: int | None = None,
        comparator_api_timeout: float = 120.0,
        comparator_api_headers: dict[str, str] | None = None,
        comparator_api_key: str | None = None,
        comparator_api_key_env: str | None = None,
        comparator_api_key_header: str = "Authorization",
        comparator_api_key_prefix: str | None = "Bearer",
        comparator_api_response_field: str = "completions",
        comparator_api_extra_body: dict[str, Any] | None = None,
        comparator_api_max_retries: int = 3,
        comparator_api_backoff_s: float = 1.0,
        comparator_api_max_concurrency: int = 4,
        comparator_api_max_retry_after_s: float = 60.0,
        comparator_api_deadline_s: float | None = None,
        **kwargs: Any,
    ):
        comparator_policy = COMPARATOR_POLICY(comparator_policy)
        comparator_generation_mode = COMPARATOR_GENERATION_MODE(comparator_generation_mode)
        comparator_api_format = API_FORMAT(comparator_api_format)
        fields = {k: v for k, v in locals().items() if k != "comparator_api_key"}  # never a hyper-parameter
        self._store(ComparatorFields.__init__, fields)
        require_positive_or_none(comparator_num_candidates, "comparator_num_candidates")
        require_positive_or_none(comparator_api_max_n_per_request, "comparator_api_max_n_per_request")
        object.__setattr__(self, "api_config", None)  # set before nn.Module's __init__ runs
        if comparator_policy == "api":  # every comparator_api_* check, now rather than at round 1
            require(bool(comparator_api_url), "comparator_api_url is required when comparator_policy='api'.")
            object.__setattr__(
                self,
                "api_config",
                ApiComparatorConfig(
                    key=comparator_api_key,
                    **{
                        name[len("comparator_api_") :]: value
                        for name, value in fields.items()
                        if name.startswith("comparator_api_")
                    },
                ),
            )
        super().__init__(**kwargs)

    def check_comparator(self, roles: int, centralized_team: bool) -> None:
        """The rules that involve the team: ``roles`` comparator roles; a centralized team (one joint actor)."""
        index = self.comparator_centralized_agent_index
        if self.comparator_generation_mode == "centralized":
            require(index >= 0, "comparator_centralized_agent_index must be >= 0.")
            require(index < roles, "comparator_centralized_agent_index must be smaller than num_agents.")
        if centralized_team:  # one joint actor: its comparator answers the same joint prompt, keeping joint text
            require(index == 0, "Centralized collaboration has only actor index 0.")
            self.comparator_generation_mode = "centralized"
        named_model = self.comparator_model_name is not None or self.comparator_agents is not None
        if self.comparator_policy == "model":
            require(
                named_model, "comparator_model_name or comparator_agents is required when comparator_policy='model'."
            )
            agents = self.comparator_agents
            require(
                agents is None or (isinstance(agents, (list, tuple)) and len(agents) in (1, roles)),
                f"comparator_agents must list 1 or num_agents ({roles}) models.",
            )
            check_model_sources(agents, "comparator_agents")
            check_model_sources(self.comparator_model_name, "comparator_model_name")
            tokenizers = self.comparator_tokenizers
            require(
                not isinstance(tokenizers, (list, tuple)) or len(tokenizers) in (1, roles),
                f"comparator_tokenizers must list 1 or num_agents ({roles}) tokenizers "
                f"(got {len(tokenizers) if isinstance(tokenizers, (list, tuple)) else 0}).",
            )
        else:
            require(
                not named_model,
                "comparator_model_name and comparator_agents are only valid when comparator_policy='model'.",
            )
            require(
                self.comparator_tokenizers is None,
                "comparator_tokenizers is only valid when comparator_policy='model'.",
            )
        if self.comparator_policy == "history":
            self.comparator_history_k = 1 if self.comparator_history_k is None else self.comparator_history_k
            require(self.comparator_history_k >= 1, "comparator_history_k must be >= 1.")
        else:
            require(
                self.comparator_history_k is None,
                "comparator_history_k is only valid when comparator_policy='history'.",
            )
        self.centralized_comparator_adapter = check_adapter(
            self.centralized_comparator_adapter or TaggedCentralizedAdapter(), "centralized_comparator_adapter"
        )


def require_positive_or_none(value: Any, name: str) -> None:
    require(
        value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
        f"{name} must be >= 1 or null.",
    )
