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
from typing import Any, Callable, Mapping, Protocol, Sequence

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


@dataclasses.dataclass(frozen=True)
class Packing:
    """A way for a CPU sampling copy's linear layers to multiply by their weights packed once per refresh:
    ``pack(weight, bias)`` makes the packed form of a weight of dtype ``takes``, rounded to ``weights``;
    ``multiply(x, packed, bias)`` is the layer's product for an input of dtype ``takes``. ``available()``: whether
    this build and CPU have what the packing needs (then probed once, :func:`packing_works`)."""

    name: str
    takes: torch.dtype
    weights: torch.dtype
    available: Callable[[], bool]
    pack: Callable[[torch.Tensor, torch.Tensor | None], Any]
    multiply: Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]
    fits: Callable[[torch.Tensor], bool] = lambda weight: True  # whether this weight can be packed this way
    threaded: bool = False  # whether to pack the layers on as many threads as torch uses (a single-threaded pack)


# A bf16 copy: weights in oneDNN's blocked layout. At the few rows of a decoding step the plain bf16 matmul re-lays
# the weight out on every call; the packed one does not: 0.12 against 0.19 ms for one of SmolLM2-135M's projections
# at 4 rows on one thread, 3.0 against 5.6 ms for its vocabulary projection (benchmarks/README.md).
BF16_BLOCKED = Packing(
    "bf16 (oneDNN blocked layout)", torch.bfloat16, torch.bfloat16,
    available=lambda: torch.backends.mkldnn.is_available() and cpu_multiplies_in(torch.bfloat16),
    pack=lambda weight, bias: torch.ops.mkldnn._reorder_linear_weight(weight, 4),  # 4: a decoding batch
    multiply=lambda x, packed, bias: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""))

# float16 on a CPU without fp16 matrix instructions: the weights are rounded to fp16 and packed for fbgemm, whose
# kernel widens them to float32 as it reads them (F16C) and multiplies in float32. Decoding reads half the bytes:
# one pass over SmolLM2-135M's products at 4 rows took 0.45 of the float32 decoding form's time on an AMD EPYC
# (1 thread), 0.52 at 16 rows (benchmarks/bench_products.py, benchmarks/README.md#float16-weights-on-a-cpu). A
# weight beyond fp16's range stays float32.
FP16_WEIGHTS = Packing(
    "fp16 weights, float32 products (fbgemm)", torch.float32, torch.float16,
    available=lambda: "fbgemm" in torch.backends.quantized.supported_engines,
    pack=lambda weight, bias: torch.ops.quantized.linear_prepack_fp16(weight, bias),
    multiply=lambda x, packed, bias: torch.ops.quantized.linear_dynamic_fp16(x, packed),
    fits=lambda weight: max(-weight.min().item(), weight.max().item()) <= torch.finfo(torch.float16).max,
    threaded=True)


class PackedLinear(torch.nn.Linear):
    """A ``nn.Linear`` of a CPU sampling copy whose forward multiplies by its weight packed once per refresh
    (:class:`Packing`); an input of another dtype, or a weight its packing cannot hold, takes the plain product.
    The result is the plain product's with the packing's weights (tests/test_rollout.py)."""

    packing: Packing
    packed: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != self.packing.takes:
            return super().forward(x)
        return self.packing.multiply(x, self.packed, self.bias)

    def pack(self, packing: Packing) -> None:
        weight = self.weight.detach()
        self.packing = packing
        bias = None if self.bias is None else self.bias.detach()
        self.packed = packing.pack(weight, bias) if packing.fits(weight) else None


@functools.cache
def packing_works(packing: Packing) -> bool:
    """Whether this torch build and CPU pack linears ``packing``'s way and get the plain product's result with the
    packing's weights (checked once per process on a small layer, so a build without the private ops, or a CPU
    without the instructions, samples unpacked)."""
    if not packing.available():
        return False
    try:
        layer = torch.nn.Linear(8, 16)
        rounded = layer.weight.detach().to(packing.weights)
        x = torch.randn(3, 2, 8).to(packing.takes)
        plain = torch.nn.functional.linear(x, rounded.to(packing.takes), layer.bias.detach().to(packing.takes))
        layer.to(packing.takes).__class__ = PackedLinear
        layer.pack(packing)
        return layer.packed is not None and torch.allclose(layer(x).float(), plain.float(), atol=1e-2)
    except (AttributeError, RuntimeError):
        return False


def pack_linears(model: torch.nn.Module, packing: Packing,
                 changed: Callable[[torch.Tensor], bool] | None = None) -> int:
    """Make every plain ``nn.Linear`` of a CPU sampling copy a :class:`PackedLinear` packed ``packing``'s way, and
    re-pack the packed ones (after a refresh: only those whose weight or bias is ``changed``, when given); returns
    how many were packed. Anything else (another device, weights not of the dtype the packing takes, a build or CPU
    it does not work on) is left as it is. The layers are packed by as many threads as torch uses."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or first.dtype != packing.takes:
        return 0
    if not packing_works(packing):  # probed once per process
        return 0

    def stale(layer: torch.nn.Module) -> bool:
        if type(layer) is torch.nn.Linear:
            return True
        return type(layer) is PackedLinear and (changed is None or changed(layer.weight)
                                                or (layer.bias is not None and changed(layer.bias)))

    layers = [m for m in model.modules() if stale(m)]
    for layer in layers:
        layer.__class__ = PackedLinear
    # fbgemm's fp16 packing converts weight by weight on one thread (~18 ns a weight: 2.4 s for SmolLM2-135M); the
    # op releases the GIL, so threads divide it.
    with ThreadPoolExecutor(max_workers=torch.get_num_threads() if packing.threaded else 1) as pool:
        list(pool.map(lambda layer: layer.pack(packing), layers))
    return len(layers)


class SamplingCopies:
    """Half-precision copies of the models that generate (``generation_dtype``), one per weight set, refreshed from
    the training weights whenever those changed since the last sampling.

    Decoding a few rows at a time reads every weight once per token, so it is bound by memory bandwidth: a
    half-precision copy reads half the bytes. Its form depends on the hardware:

    - on a GPU, or a CPU with the dtype's matrix instructions, the model cast to the dtype; on a CPU its linear
      layers multiply by bf16 weights packed for oneDNN (:data:`BF16_BLOCKED`);
    - ``float16`` on a CPU without fp16 matrix instructions (where fp16 matmuls are emulated): the model's own
      float32 tensors, shared, with its linear layers multiplying by fp16 copies of their weights in float32
      (:data:`FP16_WEIGHTS`). It costs the packs only: fp16, padded by fbgemm (~0.9x the float32 bytes of
      SmolLM2-135M's linear layers, whose inputs are 576 wide).

    The samples then come from the rounded weights, like an inference engine's; training scores them with its own
    weights (the log-probs kept while sampling are dropped). A copy is refreshed when its model's weights changed:
    an update says so (:meth:`weights_changed`; the fused AdamW kernel writes in place without counting it), and
    any other in-place write (a checkpoint load) or move is seen through each parameter's version counter and
    storage. An unchanged model is not copied again.
    """

    def __init__(self, dtype: str):
        self.dtype = getattr(torch, dtype)
        # model -> (copy, each parameter's (storage, version), device, updated since the copy was refreshed)
        self.held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, model: torch.nn.Module) -> torch.nn.Module:
        params = list(model.parameters())
        stamp = [(p.data_ptr(), p._version) for p in params]
        device = params[0].device
        held = self.held.get(model)
        if held is None or held[2] != device:
            clone = self._copy(model, device)
            self.held[model] = (clone, stamp, device, False)
            return clone
        clone, seen, _, updated = held
        # A parameter changed when its stamp did, or, after an update, when it is trained (the fused AdamW kernel
        # writes in place uncounted). A LoRA team's frozen base is neither: it is not copied or re-packed again.
        changed = [now != then or (updated and p.requires_grad) for p, now, then in zip(params, stamp, seen)]
        if any(changed):
            targets = list(clone.parameters())
            shared = targets[0] is params[0]
            if not shared:
                with torch.no_grad():
                    for target, source, change in zip(targets, params, changed):
                        if change:
                            target.copy_(source)
            refreshed = {id(t) for t, change in zip(targets, changed) if change}
            pack_linears(clone, FP16_WEIGHTS if shared else BF16_BLOCKED, changed=lambda t: id(t) in refreshed)
        self.held[model] = (clone, stamp, device, False)
        return clone

    def _copy(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        on_cpu = device.type == "cpu"
        float32 = next(model.parameters()).dtype == torch.float32
        if (self.dtype == torch.float16 and on_cpu and float32 and not cpu_multiplies_in(self.dtype)
                and packing_works(FP16_WEIGHTS)):
            # The module tree copied, every tensor shared with the model: only the packed weights are new.
            tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
            clone = copy.deepcopy(model, tensors).eval()
            pack_linears(clone, FP16_WEIGHTS)
            return clone
        if on_cpu and not cpu_multiplies_in(self.dtype):
            _warn_emulated(self.dtype)
        clone = copy.deepcopy(model).to(self.dtype).requires_grad_(False).eval()
        for p in clone.parameters():
            p.grad = None
        pack_linears(clone, BF16_BLOCKED)
        return clone

    def weights_changed(self) -> None:
        """The training weights were updated: every copy refreshes its trained parameters before it samples again."""
        for model, (clone, stamp, device, _) in list(self.held.items()):
            self.held[model] = (clone, stamp, device, True)


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
    # float16 is the fix for bfloat16 only (a float16 copy gets here where fp16 weights cannot be packed, or the model
    # is not float32)
    fix = ("generation_dtype: float16 (fp16 weights, float32 products, benchmarks/README.md#float16-weights-on-a-cpu) "
           "or generation_dtype: model" if dtype == torch.bfloat16 and packing_works(FP16_WEIGHTS)
           else "generation_dtype: model")
    log.warning("generation_dtype: %s on a CPU without %s matrix instructions: its matmuls are emulated, so "
                "sampling from the %s copy is slower than from the float32 weights here (bfloat16: 1.4x slower on an "
                "AMD EPYC with AVX2, benchmarks/README.md). Set %s on this machine.", name, name, name, fix)


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

