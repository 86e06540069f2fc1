"""Every configuration field, declared once, typed and described.

Each group below is a dataclass: one line per field (name, type, default), its description in the group's
``Args:``, and :meth:`FieldGroup.check` for the rules of its own fields (``Literal`` choices are put in their
canonical spelling first, any case). An algorithm lists the groups it uses (``MultiAgentModule.field_groups``)
and may change a default (``field_defaults``); its keyword-only ``__init__`` signature, which the CLI, ``--help``,
``--print_config`` and Python's keyword passing read, is generated from them (:func:`signature_of`), so the YAML
names stay flat (``model.init_args.num_generations``). Checks that involve several groups (the reward against the
team size, devices against placement) run in ``MultiAgentModule.check_config`` once every group is built, still
before any model is loaded. ``compat``'s CoMLRL configs are made from the same declarations
(:func:`declared_fields`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import re
import typing
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Sequence, get_args, get_origin

from comlrl_lightning.agents import normalize_parallel_training
from comlrl_lightning.agents.devices import PARALLEL_TRAINING
from comlrl_lightning.comparators.api import API_FORMAT, ApiComparatorConfig
from comlrl_lightning.comparators.sources import COMPARATOR_GENERATION_MODE, COMPARATOR_POLICY
from comlrl_lightning.core.advantages import RewardAggregation
from comlrl_lightning.core.losses import (
    ImportanceSamplingMode,
    KlEstimator,
    LossAggregation,
    importance_sampling_weights,
    kl_estimate,
    token_loss_weights,
)
from comlrl_lightning.core.pairs import PairSelection, select_pairs
from comlrl_lightning.core.replay import REPLAY_MODE
from comlrl_lightning.core.schedules import AgentOrder, LogRatio
from comlrl_lightning.rollout.generation import GenerationBackendName, make_backend
from comlrl_lightning.rollout.rewards import check_component_weights
from comlrl_lightning.rollout.sampling import GenerationDtype, SamplingConfig, validate_generation_kwargs
from comlrl_lightning.rollout.tree import JOINT_MODE

ParallelTraining = PARALLEL_TRAINING.Literal  # null: an alias of none (stored as none)
CollaborationMode = Literal["decentralized", "centralized"]
LrDecay = Literal["constant", "linear", "cosine"]
AdamWImplementation = Literal["auto", "fused", "foreach", "for-loop"]
JointMode = JOINT_MODE.Literal  # align/crossed: aliases of aligned/cross
KlPlacement = Literal["reward", "loss"]
CriticType = Literal["v", "q"]
# The choices whose values a lower layer acts on are declared there (imported above): LossAggregation and
# KlEstimator (core/losses.py), GenerationDtype (rollout/sampling.py), PairSelection (core/pairs.py) and
# IterativePairSelection (core/replay.py, the iterative variants' field: ``algorithms/iterative.py``).
# Choice errors with their own wording (the field, the value and the choices are still named).
CHOICE_MESSAGES = {
    "collaboration_mode": "collaboration_mode must be decentralized or centralized (got {value!r}).",
    "joint_mode": JOINT_MODE.message.replace("{aliases}", ""),
    "preference_scoring_reward": "preference_scoring_reward must be one of: task, reward_model. (got {value!r})",
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


def check_choice(name: str, annotation: Any, value: Any) -> Any:
    """``value`` in its canonical spelling when ``annotation`` is a ``Literal`` (CoMLRL accepts any case from
    Python); a value outside the choices is rejected: ``<field> must be one of: a, b, c (got 'x').`` (CoMLRL's own
    wording where it has one, :data:`CHOICE_MESSAGES`). The same rule the CLI applies to YAML."""
    allowed = choices_of(annotation)
    if allowed is None or value is None:
        return value
    spelled = str(value).strip().lower() if isinstance(value, str) else value
    if spelled not in allowed:
        template = CHOICE_MESSAGES.get(name, "{name} must be one of: {allowed} (got {value!r}).")
        raise ValueError(template.format(name=name, value=value, allowed=", ".join(map(str, allowed))))
    return spelled


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def default_of(owner: Callable[..., Any], name: str) -> Any:
    """The default that ``owner`` (a lower layer's settings dataclass or function) gives its parameter ``name``. A
    field whose value ends up there declares ``= default_of(owner, name)``: the default is written once, where the
    value is used, and the field (``--help``, the generated signature) shows the same."""
    default = inspect.signature(owner).parameters[name].default
    if default is inspect.Parameter.empty:
        raise TypeError(f"{owner.__qualname__} has no default for {name!r}")
    return default


class FieldGroup:
    """Base of the groups. A group is a dataclass: one line per field (name, type, default), its description in
    the class docstring's ``Args:``; ``__post_init__`` puts every ``Literal`` choice in its canonical spelling, then
    :meth:`check` runs the group's own rules and derives what the group derives."""

    # Fields kept under another module attribute (``agents`` is the name of the loaded team).
    attribute_names: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        self.normalize()
        hints = type_hints(type(self))
        for field in dataclasses.fields(self):
            setattr(self, field.name, check_choice(field.name, hints[field.name], getattr(self, field.name)))
        self.check()

    def normalize(self) -> None:
        """Spellings of a field that are not choices of its ``Literal`` (run before the choices are checked)."""

    def check(self) -> None:
        """The rules of this group's fields (the ones across groups are the module's ``check_config``)."""

    def values(self) -> dict[str, Any]:
        """``{field: value}`` (the objects themselves, not copies)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


@functools.lru_cache(maxsize=None)
def type_hints(group: type) -> dict[str, Any]:
    return typing.get_type_hints(group)


_ARG = re.compile(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*):\s?(.*)$")


def described(klass: type) -> dict[str, str]:
    """``{name: description}`` of the ``Args:`` section of ``klass``'s own docstring (Google style: one
    ``name: text`` line per field, continuation lines indented deeper)."""
    doc = inspect.cleandoc(vars(klass).get("__doc__") or "")
    found: dict[str, list[str]] = {}
    section, indent, current = False, None, None
    for line in doc.splitlines():
        if line.strip() == "Args:":
            section, indent, current = True, None, None
            continue
        if not section or not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        match = _ARG.match(line)
        if match and (indent is None or depth == indent):
            indent, current = depth, match.group(2)
            found[current] = [match.group(3).strip()]
        elif current is not None and depth > indent:
            found[current].append(line.strip())
        else:  # the section ends at the first line that is neither
            section = False
    return {name: " ".join(lines) for name, lines in found.items()}


@dataclasses.dataclass(frozen=True)
class Declared:
    """One field of a module: its type, default (the module's, where it sets its own; ``inspect.Parameter.empty``
    for a required field) and description."""

    name: str
    annotation: Any
    default: Any
    description: str


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()  # what --help shows; each group instance still gets its own
    return inspect.Parameter.empty


def field_classes(module_class: type) -> list[type]:
    """The classes along ``module_class``'s MRO (nearest first) whose field defaults and descriptions it takes: the
    modules' own classes, not Lightning's or torch's, and not those that only lend it methods (``lends_methods``:
    MARLHF's RL backend, whose fields MARLHF declares itself)."""
    lent = vars(module_class).get("lends_methods", ())
    return [k for k in module_class.__mro__ if hasattr(k, "field_groups") and k not in lent]


def field_defaults(module_class: type) -> dict[str, Any]:
    """The defaults ``module_class`` sets for its groups' fields (``field_defaults`` along its MRO, nearest last)."""
    defaults: dict[str, Any] = {}
    for klass in reversed(field_classes(module_class)):
        defaults.update(vars(klass).get("field_defaults", {}))
    return defaults


@functools.lru_cache(maxsize=None)
def declared_fields(module_class: type) -> dict[str, Declared]:
    """Every field of ``module_class``, in the order of its ``field_groups``: the groups' declarations, with the
    defaults of ``field_defaults`` and the descriptions of ``Args:`` sections along the module's MRO (nearest
    first) taking precedence over the group's own. Computed once per class (do not mutate the result)."""
    defaults = field_defaults(module_class)
    notes: dict[str, str] = {}
    for klass in reversed(field_classes(module_class)):
        notes.update(described(klass))
    declared: dict[str, Declared] = {}
    for group in module_class.field_groups:
        hints = type_hints(group)
        docs: dict[str, str] = {}
        for klass in reversed(group.__mro__):
            docs.update(described(klass))
        for field in dataclasses.fields(group):
            if field.name in declared:
                raise TypeError(f"{module_class.__name__}: field {field.name!r} is declared by two groups")
            declared[field.name] = Declared(
                field.name,
                hints[field.name],
                defaults[field.name] if field.name in defaults else _default(field),
                notes.get(field.name, docs.get(field.name, "")),
            )
    unknown = sorted(set(defaults) - set(declared))
    if unknown:
        raise TypeError(f"{module_class.__name__}.field_defaults names no field: {unknown}")
    return declared


def signature_of(module_class: type) -> inspect.Signature:
    """The keyword-only signature the CLI, ``--help`` and Python's keyword passing read."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in declared_fields(module_class).values():
        params.append(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.annotation)
        )
    return inspect.Signature(params)


def args_docstring(module_class: type) -> str:
    """The ``Args:`` section of every field, for the generated ``__init__``."""
    lines = [f"Build a {module_class.__name__} from its fields (``algorithms/fields.py``).", "", "Args:"]
    lines += [f"    {f.name}: {f.description}" for f in declared_fields(module_class).values()]
    return "\n".join(lines)


def build_groups(module_class: type, values: dict[str, Any]) -> list[FieldGroup]:
    """The groups of ``module_class`` from keyword ``values`` (the module's ``field_defaults``, else the group's own
    defaults, for the rest); an unknown keyword is named, with the closest fields."""
    declared = declared_fields(module_class)
    unknown = sorted(set(values) - set(declared))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(declared), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise TypeError(f"{module_class.__name__} got an unexpected keyword argument {unknown[0]!r}.{hint}")
    chosen = {**field_defaults(module_class), **values}
    return [
        group(**{field.name: chosen[field.name] for field in dataclasses.fields(group) if field.name in chosen})
        for group in module_class.field_groups
    ]


@dataclasses.dataclass
class AgentFields(FieldGroup):
    """The team and where it runs.

    Args:
        agents: the team (required): one source for ``num_agents`` independent copies (a factory name
            ``smollm2-135m-instruct``, ``tiny``/``tiny-5m`` for random test models, a hub id or a local path), or a
            list with one source or loaded model per agent (the same model object twice shares weights).
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

    attribute_names: ClassVar[dict[str, str]] = {"agents": "agent_sources", "tokenizers": "tokenizer_sources"}

    agents: str | Sequence[Any] | None = None  # required: a run never falls back to a random test model
    num_agents: int | None = None
    tokenizers: Any = None
    model_config: dict[str, Any] | None = None
    parallel_training: ParallelTraining | None = "none"
    agent_devices: str | list[str] | None = None
    lora_rank: int | None = None
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: str | list[str] = "all-linear"

    def normalize(self) -> None:
        self.parallel_training = normalize_parallel_training(self.parallel_training)  # null -> none; ddp: where

    def check(self) -> None:
        require(
            self.agents is not None,
            "agents is required (got None): name the team's models (smollm2-135m-instruct, a hub id or a local path, a "
            "list for one per agent; tiny is a random 138K-parameter test model that learns nothing useful).",
        )
        lora_rank = self.lora_rank
        require(
            lora_rank is None or (isinstance(lora_rank, int) and lora_rank >= 1),
            f"lora_rank must be an integer >= 1 or null (got {lora_rank!r}).",
        )
        require(self.lora_alpha > 0, f"lora_alpha must be > 0 (got {self.lora_alpha!r}).")
        require(0 <= self.lora_dropout < 1, f"lora_dropout must be in [0, 1) (got {self.lora_dropout!r}).")


AgentUpdateSchedule = Literal["simultaneous", "alternating", "sequential"]
VllmMode = Literal["colocate", "server"]
VllmWeightTransfer = Literal["file", "nccl"]


@dataclasses.dataclass
class ScheduleFields(FieldGroup):
    """Which agents learn, and when (``algorithms/schedule.py``; docs/algorithms.md#who-trains-when).

    Args:
        trained_agents: the agents that are updated (null: all); the others sample with frozen weights: no
            gradients, no optimizer state (a fixed partner, a judge, an older copy).
        agent_update_schedule: ``simultaneous`` (every trained agent steps at every update), ``alternating``
            (blocks of ``alternate_every`` updates train one agent or group in turn) or ``sequential`` (HAPPO /
            HAGRPO: every update steps the agents one after another, each later agent's advantage weighted by the
            clipped ratio product of those before it).
        alternate_every: updates per block of an ``alternating`` schedule.
        alternate_groups: the blocks' agents in turn, e.g. ``[[0], [1]]`` (null: each trained agent alone, in order).
        sequential_order: a ``sequential`` update's order: ``fixed`` (the trained agents in order), ``reversed``, or
            ``shuffled`` (a fresh order per update, drawn from the run's seed and the update index).
        m_clip_min: the sequential weight M (the product of the earlier agents' π_new/π_old) is clipped below to this.
        m_clip_max: ... and above to this.
        m_log_ratio: each earlier agent's ratio from the ``sum`` of its tokens' log-ratios (the sequence's ratio) or
            their ``mean`` (HAGRPO's ``normalize_log_prob_by_length``).
    """

    trained_agents: list[int] | None = None
    agent_update_schedule: AgentUpdateSchedule = "simultaneous"
    alternate_every: int = 1
    alternate_groups: list[list[int]] | None = None
    sequential_order: AgentOrder = "fixed"
    m_clip_min: float = 0.1
    m_clip_max: float = 2.0
    m_log_ratio: LogRatio = "sum"

    def check(self) -> None:
        require(self.alternate_every >= 1, f"alternate_every must be >= 1 (got {self.alternate_every!r}).")
        require(
            0 < self.m_clip_min <= 1 <= self.m_clip_max,
            f"m_clip_min and m_clip_max must satisfy 0 < m_clip_min <= 1 <= m_clip_max (got {self.m_clip_min!r}, "
            f"{self.m_clip_max!r}).",
        )


@dataclasses.dataclass
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

    reward_func: Callable[..., Any] | None = None
    reward_processor: Callable[[float], float] | None = None
    reward_timeout: float | None = None
    formatters: list[Callable[..., str]] | None = None
    use_chat_template: bool = False
    collaboration_mode: CollaborationMode = "decentralized"
    centralized_adapter: Any = None

    def check(self) -> None:
        require(
            self.reward_func is not None and callable(self.reward_func),
            "reward_func must be a callable (give its import path in YAML, e.g. "
            "reward_func: comlrl_lightning.envs.toy.story_reward).",
        )
        require(
            self.reward_processor is None or callable(self.reward_processor), "reward_processor must be a callable."
        )
        require(self.reward_timeout is None or self.reward_timeout > 0, "reward_timeout must be > 0 seconds or null.")


@dataclasses.dataclass
class RewardComponentFields(FieldGroup):
    """A reward that returns named components, ``{name: float}`` per joint action (its levels), and how they become
    advantages (the team reward is their weighted sum either way, ``reward_processor`` applied to it).

    Args:
        reward_aggregation: ``sum`` (the components' weighted sum is normalised as one reward, CoMLRL's behaviour) or
            ``normalize_components`` (each component is normalised within its group, then the weighted sum: GDPO;
            needs a reward that returns components).
        reward_component_weights: ``{component name: weight}`` in the team reward and in the sum of normalised
            components; a name not given weighs 1.0, a name the reward does not return is an error (null: all 1.0).
    """

    reward_aggregation: RewardAggregation = "sum"
    reward_component_weights: dict[str, float] | None = None

    def check(self) -> None:
        self.reward_component_weights = check_component_weights(self.reward_component_weights)


@dataclasses.dataclass
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
        vllm_mode: ``vllm``: ``colocate`` (an engine in each training process) or ``server`` (``vllm serve``
            processes at ``vllm_server_urls``; docs/scaling.md#vllm-servers).
        vllm_server_urls: ``vllm_mode: server``: one URL per distinct agent model, in the team's order (one URL: all).
        vllm_server_timeout: ``vllm_mode: server``: seconds a server request may take before the run stops.
        vllm_server_weights_dir: ``vllm_mode: server``: where the weights are written for the servers to read, a
            folder they see at the same path (null: ``/dev/shm``: servers on the trainer's machine).
        vllm_server_weight_transfer: ``vllm_mode: server``: how the weights reach the servers: ``file`` (written to
            ``vllm_server_weights_dir``; any machine) or ``nccl`` (broadcast from the trainer's GPU to the servers'
            over NCCL; the servers started with ``--weight-transfer-config '{"backend": "nccl"}'``, as ``serve`` does
            for such a config).
    """

    max_new_tokens: int = default_of(SamplingConfig, "max_new_tokens")
    temperature: float = default_of(SamplingConfig, "temperature")
    top_p: float = default_of(SamplingConfig, "top_p")
    top_k: int | None = default_of(SamplingConfig, "top_k")
    generation_backend: GenerationBackendName = "hf"
    generation_kwargs: dict[str, Any] | None = None
    generation_batch_size: int | None = None
    generation_dtype: GenerationDtype = default_of(SamplingConfig, "dtype")
    vllm_gpu_memory_utilization: float = 0.3
    vllm_enable_sleep_mode: bool = False
    vllm_max_model_len: int | None = None
    vllm_mode: VllmMode = "colocate"
    vllm_server_urls: list[str] | None = None
    vllm_server_timeout: float = 600.0
    vllm_server_weights_dir: str | None = None
    vllm_server_weight_transfer: VllmWeightTransfer = "file"

    def check(self) -> None:
        max_new_tokens = self.max_new_tokens
        # The sampler's own settings (it checks their ranges), built once: the module samples with this object.
        self.sampling = SamplingConfig(
            max_new_tokens, self.temperature, self.top_p, self.top_k, dtype=self.generation_dtype
        )
        validate_generation_kwargs(self.generation_kwargs)
        require(
            self.generation_batch_size is None or self.generation_batch_size >= 1,
            "generation_batch_size must be >= 1 or null.",
        )
        require(
            0 < self.vllm_gpu_memory_utilization <= 1,
            f"vllm_gpu_memory_utilization must be in (0, 1] (got {self.vllm_gpu_memory_utilization}).",
        )
        require(
            self.vllm_max_model_len is None or self.vllm_max_model_len > max_new_tokens,
            f"vllm_max_model_len must be null or more than max_new_tokens ({max_new_tokens}), got "
            f"{self.vllm_max_model_len}.",
        )
        server = self.vllm_mode == "server"
        require(
            not server or self.generation_backend == "vllm",
            f"vllm_mode: server samples through vLLM servers; generation_backend is {self.generation_backend!r}: set "
            "generation_backend: vllm.",
        )
        require(
            server == bool(self.vllm_server_urls),
            "vllm_mode: server needs vllm_server_urls (the URL of each `vllm serve` process, e.g. "
            "[http://localhost:8000])"
            if server
            else "vllm_server_urls is set but vllm_mode is colocate: set vllm_mode: server, or remove the URLs.",
        )
        require(self.vllm_server_timeout > 0, f"vllm_server_timeout must be > 0 (got {self.vllm_server_timeout}).")

    def server_options(self) -> dict[str, Any]:
        """``vllm_mode: server``'s options of the vLLM backend."""
        return {
            "server_urls": self.vllm_server_urls,
            "server_timeout": self.vllm_server_timeout,
            "server_weights_dir": self.vllm_server_weights_dir,
            "server_weight_transfer": self.vllm_server_weight_transfer,
        }

    def make_backend(self, concurrent: bool) -> Any:
        """The generation backend these fields choose (``concurrent``: agents on distinct devices sample at once)."""
        return make_backend(
            self.generation_backend,
            batch_size=self.generation_batch_size,
            generation_kwargs=self.generation_kwargs,
            concurrent=concurrent,
            gpu_memory_utilization=self.vllm_gpu_memory_utilization,
            enable_sleep_mode=self.vllm_enable_sleep_mode,
            max_model_len=self.vllm_max_model_len,
            **(self.server_options() if self.vllm_mode == "server" else {}),
        )


@dataclasses.dataclass
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

    agent_learning_rate: float | list[float] = 5e-6
    weight_decay: float = 0.01
    adamw_implementation: AdamWImplementation = "auto"
    max_grad_norm: float | None = None
    lr_warmup_steps: int = 0
    lr_decay: LrDecay = "constant"
    lr_decay_steps: int | None = None
    lr_min_ratio: float = 0.0
    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = None
    keep_freed_cpu_memory: bool = False

    def check(self) -> None:
        rate = self.agent_learning_rate
        rates = rate if isinstance(rate, (list, tuple)) else [rate]
        require(all(r > 0 for r in rates), f"agent_learning_rate must be > 0 (got {list(rates)}).")
        require(self.weight_decay >= 0, f"weight_decay must be >= 0 (got {self.weight_decay}).")
        clip = self.max_grad_norm
        require(clip is None or clip > 0, f"max_grad_norm must be > 0 or null (got {clip}).")
        require(self.lr_warmup_steps >= 0, f"lr_warmup_steps must be >= 0 (got {self.lr_warmup_steps}).")
        require(
            self.lr_decay_steps is None or self.lr_decay_steps >= 1,
            f"lr_decay_steps must be >= 1 or null (got {self.lr_decay_steps}).",
        )
        require(0.0 <= self.lr_min_ratio <= 1.0, f"lr_min_ratio must be in [0, 1] (got {self.lr_min_ratio}).")
        require(self.micro_batch_size is None or self.micro_batch_size >= 1, "micro_batch_size must be >= 1 or null.")
        require(
            self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
            "micro_batch_tokens must be >= 1 or null.",
        )


@dataclasses.dataclass
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

    eval_interval: int = 16
    eval_num_samples: int = 4
    eval_logger: Callable[..., Any] | None = None
    eval_aggregator: Callable[..., Any] | None = None
    log_completions: bool = True
    eval_at_end: bool = True

    def check(self) -> None:
        require(self.eval_interval >= 0, "eval_interval must be >= 0.")
        require(self.eval_num_samples >= 0, "eval_num_samples must be >= 0.")
        require(
            (self.eval_logger is None) == (self.eval_aggregator is None),
            "eval_logger and eval_aggregator must be given together (one without the other would be ignored).",
        )


@dataclasses.dataclass
class JointActionFields(FieldGroup):
    """Turns and joint actions.

    Args:
        num_turns: turns per episode (> 1 needs ``external_transition``).
        joint_mode: ``aligned`` (agent i's k-th sample with every other agent's k-th) or ``cross`` (every
            combination); ``align``/``crossed`` are aliases.
    """

    num_turns: int = 1
    joint_mode: JointMode = "aligned"

    def check(self) -> None:
        require(self.num_turns >= 1, "num_turns must be >= 1.")
        self.joint_mode = JOINT_MODE(self.joint_mode)  # after the Literal check: CoMLRL's message for a typo


@dataclasses.dataclass
class RolloutFields(FieldGroup):
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
        max_staleness: one-step-off rollouts (``vllm_mode: server``): the next step's rollout is sampled by the
            servers while this step updates; records more than this many updates old when their buffer drains are
            not trained on (0: sample then update, as without servers).
    """

    num_generations: int = 4
    discount: float = 1.0
    early_termination_threshold: float | None = None
    external_transition: Callable[..., Any] | None = None
    external_prompt_passthrough: bool = False
    rollout_buffer_size: int = 2
    train_batch_size: int | None = None
    advantage_normalization: bool = True
    loss_aggregation: LossAggregation = default_of(token_loss_weights, "aggregation")
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: ImportanceSamplingMode = default_of(importance_sampling_weights, "mode")
    vllm_importance_sampling_cap: float = default_of(importance_sampling_weights, "cap")
    max_staleness: int = 0

    def check(self) -> None:
        require(
            self.vllm_importance_sampling_cap > 0,
            f"vllm_importance_sampling_cap must be > 0 (got {self.vllm_importance_sampling_cap}).",
        )
        require(self.max_staleness >= 0, f"max_staleness must be >= 0 (got {self.max_staleness}).")
        require(self.num_generations >= 1, "num_generations must be >= 1.")
        require(0.0 <= self.discount <= 1.0, "discount must be in [0, 1].")
        require(self.rollout_buffer_size >= 1, "rollout_buffer_size must be >= 1.")
        if self.train_batch_size is None:  # derived: what the run uses is what the hyper-parameters record
            self.train_batch_size = self.rollout_buffer_size
        require(self.train_batch_size >= 1, "train_batch_size must be >= 1.")


@dataclasses.dataclass
class ReferenceKLFields(FieldGroup):
    """The KL penalty towards the initial agents (frozen copies held by a callback, never loaded when off).

    Args:
        reference_kl_enabled: penalise divergence from the initial agents.
        reference_kl_coef: the penalty's weight beta (0: off).
        reference_kl_estimator: ``k1``, ``k2`` or ``k3`` (Schulman's estimators).
        reference_kl_placement: ``reward`` (on the returns, before the baseline) or ``loss`` (a per-token term).
        reference_devices: where the reference copies live (default: each agent's device).
    """

    reference_kl_enabled: bool = False
    reference_kl_coef: float = 0.1
    reference_kl_estimator: KlEstimator = default_of(kl_estimate, "estimator")
    reference_kl_placement: KlPlacement = "reward"
    reference_devices: str | list[str] | None = None

    def check(self) -> None:
        require(self.reference_kl_coef >= 0, "reference_kl_coef must be >= 0.")


@dataclasses.dataclass
class DynamicSamplingFields(FieldGroup):
    """Dynamic sampling (DAPO's ``filter_groups``): drop the nodes that give every agent zero advantage, refill the step
    with extra dataset items (``data/dynamic_sampling.py``).

    Args:
        dynamic_sampling: drop rollout-tree nodes whose every agent's K credited returns tie (within 1e-6 of their
            scale) and refill with the nodes of extra prompts, up to the step's own node count.
        dynamic_sampling_max_extra_prompts: extra dataset items one training step may roll out to refill, per process
            (null: as many as the step's own items; 0: drop without refilling).
    """

    dynamic_sampling: bool = False
    dynamic_sampling_max_extra_prompts: int | None = None

    def check(self) -> None:
        require(
            self.dynamic_sampling_max_extra_prompts is None or self.dynamic_sampling_max_extra_prompts >= 0,
            f"dynamic_sampling_max_extra_prompts must be >= 0 or null (got {self.dynamic_sampling_max_extra_prompts}).",
        )


@dataclasses.dataclass
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

    attribute_names: ClassVar[dict[str, str]] = {"critics": "critic_sources"}

    use_separate_critic: bool = True
    critic_model: str | None = None
    critics: Sequence[Any] | None = None
    critic_type: CriticType = "v"
    critic_learning_rate: float | None = 5e-6
    critic_value_head_hidden_dim: int | None = None
    value_head_hidden_dim: int | None = None
    value_clip_range: float | None = 0.2
    value_loss_coef: float = 0.6
    critic_devices: str | list[str] | None = None
    metrics_callback: Callable[..., Any] | None = None

    def check(self) -> None:
        require(self.value_loss_coef > 0, "value_loss_coef must be > 0.")
        require(self.value_clip_range is None or self.value_clip_range > 0, "value_clip_range must be > 0 or null.")
        require(
            self.critic_learning_rate is None or self.critic_learning_rate > 0,
            "critic_learning_rate must be > 0 or null.",
        )
        for name in ("critic_value_head_hidden_dim", "value_head_hidden_dim"):
            require(getattr(self, name) is None or getattr(self, name) >= 0, f"{name} must be >= 0 or null.")


@dataclasses.dataclass
class PreferenceFields(FieldGroup):
    """How the preference algorithms turn sampled candidates into pairs (the task reward is the oracle).

    Args:
        preference_num_candidates: completions each agent samples per task (joint candidate k pairs every
            agent's k-th).
        preference_pairs_per_sample: pairs kept per task (null: all; must be null with ``pair_selection: all``).
        pair_selection: ``reward_gap`` (largest score gaps first), ``random``, ``all``; the iterative variants add
            ``comparator_reward``.
    """

    preference_num_candidates: int = 80
    preference_pairs_per_sample: int | None = default_of(select_pairs, "limit")
    pair_selection: PairSelection = default_of(select_pairs, "selection")

    def check(self) -> None:
        require(self.preference_num_candidates >= 2, "preference_num_candidates must be >= 2.")
        require(
            self.preference_pairs_per_sample is None or self.preference_pairs_per_sample >= 1,
            "preference_pairs_per_sample must be >= 1 or null.",
        )
        require(
            self.pair_selection != "all" or self.preference_pairs_per_sample is None,
            "preference_pairs_per_sample must be null when pair_selection='all'.",
        )


# Iterative preference training. Choices list the canonical names first, then their aliases (any case from
# Python; the CLI takes the spellings listed): each declared once, where its values are used.
ReplayMode = REPLAY_MODE.Literal
ComparatorPolicy = COMPARATOR_POLICY.Literal
GenerationMode = COMPARATOR_GENERATION_MODE.Literal
ApiFormat = API_FORMAT.Literal


@dataclasses.dataclass
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

    num_iterations: int = 6
    preference_replay_mode: ReplayMode = "current"
    preference_replay_k: int | None = None
    preference_replay_lambda: float | None = None
    preference_replay_sample_size: int | None = None
    preference_replay_dir: str | None = None
    log_reward_distribution: bool = False
    policy_checkpoint_dir: str | None = None

    def normalize(self) -> None:
        self.preference_replay_mode = REPLAY_MODE(self.preference_replay_mode)

    def check(self) -> None:
        require(isinstance(self.num_iterations, int) and self.num_iterations >= 1, "num_iterations must be >= 1.")
        mode = self.preference_replay_mode
        k, lam = self.preference_replay_k, self.preference_replay_lambda
        historical = (
            "preference_replay_sample_size is only valid when preference_replay_mode is 'nearest_k', "
            "'all_history', or 'lambda_decay'."
        )
        require(
            mode != "current" or k in (None, 1),
            "preference_replay_k is only valid when preference_replay_mode='nearest_k'.",
        )
        require(mode != "current" or self.preference_replay_sample_size is None, historical)
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
        require_positive_or_none(self.preference_replay_sample_size, "preference_replay_sample_size")
        for name in ("preference_replay_dir", "policy_checkpoint_dir"):
            given = getattr(self, name)
            require(
                given is None or not Path(given).expanduser().exists() or Path(given).expanduser().is_dir(),
                f"{name} must be a directory; {given!r} is a file.",
            )


@dataclasses.dataclass
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

    comparator_policy: ComparatorPolicy = "current"
    comparator_generation_mode: GenerationMode = "decentralized"
    comparator_centralized_agent_index: int = 0
    comparator_model_name: str | None = None
    comparator_agents: list[Any] | None = None
    comparator_tokenizers: Any = None
    comparator_devices: str | list[str] | None = None
    comparator_num_candidates: int | None = None
    comparator_history_k: int | None = None
    centralized_comparator_adapter: Any = None
    # comparator_api_<name> is ApiComparatorConfig's <name> (check() builds one): its defaults are the client's.
    comparator_api_url: str | None = default_of(ApiComparatorConfig, "url")
    comparator_api_format: ApiFormat = default_of(ApiComparatorConfig, "format")
    comparator_api_model: str | None = default_of(ApiComparatorConfig, "model")
    comparator_api_max_n_per_request: int | None = default_of(ApiComparatorConfig, "max_n_per_request")
    comparator_api_timeout: float = default_of(ApiComparatorConfig, "timeout")
    comparator_api_headers: dict[str, str] | None = default_of(ApiComparatorConfig, "headers")
    # a credential: never printed
    comparator_api_key: str | None = dataclasses.field(default=default_of(ApiComparatorConfig, "key"), repr=False)
    comparator_api_key_env: str | None = default_of(ApiComparatorConfig, "key_env")
    comparator_api_key_header: str = default_of(ApiComparatorConfig, "key_header")
    comparator_api_key_prefix: str | None = default_of(ApiComparatorConfig, "key_prefix")
    comparator_api_response_field: str = default_of(ApiComparatorConfig, "response_field")
    comparator_api_extra_body: dict[str, Any] | None = default_of(ApiComparatorConfig, "extra_body")
    comparator_api_max_retries: int = default_of(ApiComparatorConfig, "max_retries")
    comparator_api_backoff_s: float = default_of(ApiComparatorConfig, "backoff_s")
    comparator_api_max_concurrency: int = default_of(ApiComparatorConfig, "max_concurrency")
    comparator_api_max_retry_after_s: float = default_of(ApiComparatorConfig, "max_retry_after_s")
    comparator_api_deadline_s: float | None = default_of(ApiComparatorConfig, "deadline_s")

    def normalize(self) -> None:
        self.comparator_policy = COMPARATOR_POLICY(self.comparator_policy)
        self.comparator_generation_mode = COMPARATOR_GENERATION_MODE(self.comparator_generation_mode)
        self.comparator_api_format = API_FORMAT(self.comparator_api_format)

    def check(self) -> None:
        require_positive_or_none(self.comparator_num_candidates, "comparator_num_candidates")
        require_positive_or_none(self.comparator_api_max_n_per_request, "comparator_api_max_n_per_request")
        self.api_config = None  # the api comparator's client settings, checked now rather than at round 1
        if self.comparator_policy == "api":
            require(bool(self.comparator_api_url), "comparator_api_url is required when comparator_policy='api'.")
            prefix = "comparator_api_"
            self.api_config = ApiComparatorConfig(
                **{name[len(prefix) :]: value for name, value in self.values().items() if name.startswith(prefix)}
            )


def require_positive_or_none(value: Any, name: str) -> None:
    require(
        value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
        f"{name} must be >= 1 or null.",
    )


# ---------------------------------------------------------------------------------- a module's generated __init__
def install_init(module_class: type, initialize: Callable[[Any, dict[str, Any]], None]) -> None:
    """Give ``module_class`` the keyword-only ``__init__`` of its fields (the signature and ``Args:`` the CLI reads),
    which hands the keyword values to ``initialize(module, values)``. A class that writes its own is refused."""
    require(
        "__init__" not in vars(module_class) or getattr(module_class.__init__, "generated", False),
        f"{module_class.__name__} writes __init__: declare its fields in a group (a FieldGroup dataclass added to "
        "field_groups) and its run state in init_state(); its __init__ is generated (docs/new_algorithm.md).",
    )

    def __init__(self, **values: Any) -> None:
        initialize(self, values)

    __init__.__signature__ = signature_of(module_class)
    __init__.__doc__ = args_docstring(module_class)
    __init__.__qualname__ = f"{module_class.__qualname__}.__init__"
    __init__.__module__ = module_class.__module__
    __init__.generated = True
    module_class.__init__ = __init__
    if not has_learning_rule(module_class):
        # A base of the families (MultiAgentModule, OnPolicyModule) is abstract: the CLI neither lists it among the
        # model.class_path choices nor accepts it (one line: "... is abstract"), and Python refuses to build one.
        module_class.__abstractmethods__ = frozenset({"objective_class"})


def has_learning_rule(module_class: type) -> bool:
    """Whether ``module_class`` can train: it names its ``objective_class``, or makes its objective itself (a
    ``make_objective`` below the base's: MARLHF takes its RL backend's)."""
    makers = [klass for klass in module_class.__mro__ if "make_objective" in vars(klass)]
    return hasattr(module_class, "objective_class") or len(makers) > 1


def store_fields(module: Any, groups: list[FieldGroup], secret: Sequence[str]) -> dict[str, Any]:
    """Every field of ``groups`` as an attribute of ``module`` (the objects themselves; a credential named in
    ``secret`` stays in its group: never an attribute or hyper-parameter); returns the stored values by field name."""
    stored: dict[str, Any] = {}
    for group in groups:
        for name, value in group.values().items():
            if name not in secret:
                object.__setattr__(module, group.attribute_names.get(name, name), value)
                stored[name] = value
    return stored


def effective_hparams(field_values: dict[str, Any], attributes: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters a module saves: its fields as the run uses them — a field's value, or the module's
    attribute of that name (``attributes``) where a rule derived it (``num_agents`` from the team,
    ``train_batch_size`` from ``rollout_buffer_size``, IAC's ``value_clip_range``) — so that a checkpoint
    rebuilds the same run."""
    values = dict(field_values)
    for key, value in field_values.items():
        derived = attributes.get(key, value)
        if derived != value and plain_hparams({key: derived}):
            values[key] = derived
    return plain_hparams(values)


def plain_hparams(values: dict[str, Any]) -> dict[str, Any]:
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
