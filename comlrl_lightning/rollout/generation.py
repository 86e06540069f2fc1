"""The generation backend: how the rollout engine turns prompts into K sampled completions per agent.

The engine asks one thing of a backend::

    sample(models, tokenizers, inputs, K, sampling) -> list[Completions]

``inputs[j]`` are agent j's model inputs (chat template already applied); ``models[j]`` answers them with ``K``
samples each, and the result carries token ids (prompt and completion), the completion mask up to and including
EOS, and the decoded texts (``rollout/sampling.py``). :class:`HFGenerate` is Hugging Face ``generate``: one batched
call per model, agents on distinct devices in parallel threads. A faster engine (vLLM, see docs/scaling.md) plugs
in here without touching any algorithm.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Protocol, Sequence

import torch

from comlrl_lightning.rollout.sampling import Completions, SamplingConfig, sample_completions

log = logging.getLogger(__name__)


class GenerationBackend(Protocol):
    def sample(self, models: Sequence[Any], tokenizers: Sequence[Any], inputs: Sequence[Sequence[str]], K: int,
               sampling: SamplingConfig) -> list[Completions]: ...


class HFGenerate:
    """Hugging Face ``generate`` (KV cache, inference mode, eval mode), ``batch_size`` prompts per call; with
    ``concurrent`` (agents on distinct devices) the models generate at the same time, one thread each.

    Agents that share weights answer in ONE call: agents given the same model (parameter sharing) and the agents of a
    LoRA team, whose rows each go through their own adapter (peft's mixed-adapter batch: ``adapter_names``)."""

    def __init__(self, batch_size: int | None = None, generation_kwargs: Mapping[str, Any] | None = None,
                 concurrent: bool = False):
        self.batch_size, self.generation_kwargs, self.concurrent = batch_size, dict(generation_kwargs or {}), concurrent

    def sample(self, models, tokenizers, inputs, K, sampling) -> list[Completions]:
        calls: dict[tuple[int, int], list[int]] = {}  # (generator, tokenizer) -> the agents it answers for
        for i, model in enumerate(models):
            calls.setdefault((id(generator_of(model)[0]), id(tokenizers[i])), []).append(i)
        groups = list(calls.values())
        copies: dict[int, Any] = {}
        if sampling.dtype != "model":  # refreshed here, before any thread starts
            held = sampling_copies(sampling.dtype)
            copies = {agents[0]: held(generator_of(models[agents[0]])[0]) for agents in groups}
            sampling = dataclasses.replace(sampling, keep_logprobs=False)  # a copy's log-probs are not the model's

        def one(agents: list[int]) -> list[Completions]:
            first = agents[0]
            if len(agents) == 1 and first not in copies:
                return [sample_completions(models[first], tokenizers[first], inputs[first], K, sampling,
                                           self.batch_size, self.generation_kwargs)]
            generator = copies[first] if first in copies else generator_of(models[first])[0]
            prompts = [prompt for i in agents for prompt in inputs[i]]
            names = [generator_of(models[i])[1] for i in agents for _ in inputs[i]]
            joint = sample_completions(generator, tokenizers[first], prompts, K, sampling, self.batch_size,
                                       self.generation_kwargs, adapters=None if names[0] is None else names)
            return joint.split([len(inputs[i]) for i in agents])

        if self.concurrent and len(groups) > 1:
            with ThreadPoolExecutor(max_workers=len(groups)) as pool:
                answers = list(pool.map(one, groups))
        else:
            answers = [one(agents) for agents in groups]
        out: list[Completions | None] = [None] * len(models)
        for agents, completions in zip(groups, answers):
            for i, c in zip(agents, completions):
                out[i] = c
        return out


def generator_of(model: Any) -> tuple[Any, str | None]:
    """What generates for ``model`` and under which adapter: an agent of a LoRA team (``agents/lora.py``) is its
    team's one peft model with the agent's adapter; any other model is itself."""
    shared = getattr(model, "shared_generator", None)
    return shared() if callable(shared) else (model, None)


class PackedLinear(torch.nn.Linear):
    """A ``nn.Linear`` of a CPU bf16 sampling copy whose forward multiplies by its weight in oneDNN's blocked
    layout (packed once per refresh). At the few rows of a decoding step the plain bf16 matmul re-lays the weight
    out on every call; the packed one does not: 0.12 against 0.19 ms for one of SmolLM2-135M's projections at 4 rows
    on one thread, 3.0 against 5.6 ms for its vocabulary projection (benchmarks/README.md). The result is the
    plain matmul's (tests/test_rollout.py)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.packed.dtype:
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 4)  # 4: a decoding batch


@functools.cache
def _packing_works() -> bool:
    """Whether this torch build packs bf16 linears for oneDNN and gets the plain matmul's result (checked once on a
    small layer, so a build without the private ops, or without bf16 support, samples unpacked)."""
    try:
        if not (torch.backends.mkldnn.is_available() and cpu_multiplies_in(torch.bfloat16)):
            return False
        layer = torch.nn.Linear(8, 16).to(torch.bfloat16)
        x = torch.randn(3, 2, 8, dtype=torch.bfloat16)
        plain = layer(x)
        layer.__class__ = PackedLinear
        layer.pack()
        return torch.allclose(layer(x).float(), plain.float(), atol=1e-2)
    except (AttributeError, RuntimeError):
        return False


def pack_linears(model: torch.nn.Module) -> int:
    """Make every plain ``nn.Linear`` of a CPU bf16 copy a :class:`PackedLinear` (or re-pack it after a refresh);
    returns how many. Anything else (another device or dtype, a build without oneDNN bf16) is left as it is."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or first.dtype != torch.bfloat16:
        return 0
    if not _packing_works():  # probed once per process
        return 0
    layers = [m for m in model.modules() if type(m) in (torch.nn.Linear, PackedLinear)]
    for layer in layers:
        layer.__class__ = PackedLinear
        layer.pack()
    return len(layers)


class SamplingCopies:
    """Half-precision copies of the models that generate (``generation_dtype``), one per weight set, refreshed from
    the training weights whenever those changed since the last sampling.

    Decoding a few rows at a time reads every weight once per token, so it is bound by memory bandwidth: a bf16 copy
    reads half the bytes (and bf16 matrix units do the rest); on CPU its linear layers multiply by weights packed
    for oneDNN (:class:`PackedLinear`). The samples then come from the rounded weights, like
    an inference engine's; training scores them with its own weights (the log-probs kept while sampling are
    dropped). A copy is refreshed when its model's weights changed: an update says so (:meth:`weights_changed`; the
    fused AdamW kernel writes in place without counting it), and any other in-place write (a checkpoint load) or
    move is seen through each parameter's version counter and storage. An unchanged model is not copied again.
    """

    def __init__(self, dtype: str):
        self.dtype = getattr(torch, dtype)
        self.held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (copy, stamp)

    def __call__(self, model: torch.nn.Module) -> torch.nn.Module:
        params = list(model.parameters())
        stamp = tuple((p.data_ptr(), p._version) for p in params)
        held = self.held.get(model)
        if held is None or next(held[0].parameters()).device != params[0].device:
            if params[0].device.type == "cpu" and not cpu_multiplies_in(self.dtype):
                _warn_emulated(self.dtype)
            clone = copy.deepcopy(model).to(self.dtype).requires_grad_(False).eval()
            for p in clone.parameters():
                p.grad = None
            pack_linears(clone)
            self.held[model] = (clone, stamp)
            return clone
        clone, seen = held
        if seen != stamp:
            with torch.no_grad():
                for target, source in zip(clone.parameters(), params):
                    target.copy_(source)
            pack_linears(clone)
            self.held[model] = (clone, stamp)
        return clone

    def weights_changed(self) -> None:
        """The training weights were updated: every copy is refreshed before it samples again."""
        for model, (clone, _) in list(self.held.items()):
            self.held[model] = (clone, None)


def cpu_multiplies_in(dtype: torch.dtype) -> bool:
    """Whether this CPU has matrix instructions for ``dtype`` that oneDNN uses (bf16: AVX512-BF16, AMX or
    AVX-NE-CONVERT; fp16: AVX512-FP16, AMX-FP16 or AVX-NE-CONVERT). Without them a half-precision matmul is emulated
    and runs slower than float32."""
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    try:
        return probe is None or bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _warn_emulated(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    log.warning("generation_dtype: %s on a CPU without %s matrix instructions: its matmuls are emulated, so "
                "sampling from the %s copy is slower than from the float32 weights here (bfloat16: 1.4x slower on an "
                "AMD EPYC with AVX2, benchmarks/README.md). Set generation_dtype: model on this machine.",
                name, name, name)


_COPIES: dict[str, SamplingCopies] = {}  # per dtype; each copy lives as long as its model


def sampling_copies(dtype: str) -> SamplingCopies:
    """The process's copies in ``dtype``: every engine that samples with a model (training, evaluation, pair
    collection, comparators) shares its one copy."""
    if dtype not in _COPIES:
        _COPIES[dtype] = SamplingCopies(dtype)
    return _COPIES[dtype]


def weights_changed() -> None:
    """Called after every update (``MultiAgentModule.update``): the copies are refreshed before they sample again."""
    for copies in _COPIES.values():
        copies.weights_changed()

