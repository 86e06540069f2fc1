"""Half-precision sampling copies of the training weights for the ``hf`` backend (``generation_dtype``).

Decoding a few rows at a time reads every weight once per token, so it is bound by memory bandwidth: a copy in half
precision reads half the bytes. On a CPU its linear layers multiply by weights packed once per refresh
(:class:`Packing`); a packed layer is a :class:`PackedLinear` put in its parent module in place of the
``nn.Linear`` (sharing its weight), never the same object with another class.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from comlrl_lightning.rollout.weights import changed_parameters, weights_seen

log = logging.getLogger(__name__)


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
# the weight out on every call; the packed one does not (timed in benchmarks/README.md#the-decoding-products).
BF16_BLOCKED = Packing(
    "bf16 (oneDNN blocked layout)",
    torch.bfloat16,
    torch.bfloat16,
    available=lambda: torch.backends.mkldnn.is_available() and cpu_multiplies_in(torch.bfloat16),
    pack=lambda weight, bias: torch.ops.mkldnn._reorder_linear_weight(weight, 4),  # 4: a decoding batch
    multiply=lambda x, packed, bias: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
)

# float16 on a CPU without fp16 matrix instructions: the weights are rounded to fp16 and packed for fbgemm, whose
# kernel widens them to float32 as it reads them (F16C) and multiplies in float32. Decoding reads half the bytes:
# one pass over SmolLM2-135M's products at 4 rows took 0.45 of the float32 decoding form's time on an AMD EPYC
# (1 thread), 0.52 at 16 rows (benchmarks/bench_products.py, benchmarks/README.md#float16-weights-on-a-cpu). A
# weight beyond fp16's range stays float32.
FP16_WEIGHTS = Packing(
    "fp16 weights, float32 products (fbgemm)",
    torch.float32,
    torch.float16,
    available=lambda: "fbgemm" in torch.backends.quantized.supported_engines,
    pack=lambda weight, bias: torch.ops.quantized.linear_prepack_fp16(weight, bias),
    multiply=lambda x, packed, bias: torch.ops.quantized.linear_dynamic_fp16(x, packed),
    fits=lambda weight: max(-weight.min().item(), weight.max().item()) <= torch.finfo(torch.float16).max,
    threaded=True,
)


class PackedLinear(torch.nn.Linear):
    """A linear layer of a CPU sampling copy that multiplies by its weight packed once per refresh
    (:class:`Packing`), built from an ``nn.Linear`` whose ``weight`` and ``bias`` it shares (so a refresh of the
    copy's parameters is seen here); an input of another dtype, or a weight its packing cannot hold, takes the plain
    product. The result is the plain product's with the packing's weights (tests/test_rollout.py)."""

    def __init__(self, linear: torch.nn.Linear, packing: Packing, pack: bool = True):
        torch.nn.Module.__init__(self)  # not nn.Linear's: the parameters are the layer's own
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packing, self.packed = packing, None
        if pack:
            self.pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != self.packing.takes:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return self.packing.multiply(x, self.packed, self.bias)

    def pack(self) -> None:
        weight = self.weight.detach()
        bias = None if self.bias is None else self.bias.detach()
        self.packed = self.packing.pack(weight, bias) if self.packing.fits(weight) else None


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
        packed = PackedLinear(layer.to(packing.takes), packing)
        return packed.packed is not None and torch.allclose(packed(x).float(), plain.float(), atol=1e-2)
    except (AttributeError, RuntimeError):
        return False


def pack_linears(
    model: torch.nn.Module, packing: Packing, changed: Callable[[torch.Tensor], bool] | None = None
) -> int:
    """Put a :class:`PackedLinear` in place of every plain ``nn.Linear`` of a CPU sampling copy (in its parent
    module, sharing the layer's parameters), and re-pack the packed ones (after a refresh: only those whose weight
    or bias is ``changed``, when given); returns how many were packed. Anything else (another device, weights not of
    the dtype the packing takes, a build or CPU it does not work on) is left as it is. The layers are packed by as
    many threads as torch uses."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or first.dtype != packing.takes:
        return 0
    if not packing_works(packing):  # probed once per process
        return 0
    layers: list[PackedLinear] = []
    for parent in list(model.modules()):
        for name, layer in list(parent.named_children()):
            if type(layer) is torch.nn.Linear:
                packed = PackedLinear(layer, packing, pack=False)  # packed below, with the others
                setattr(parent, name, packed)
                layers.append(packed)
            elif type(layer) is PackedLinear and (
                changed is None or changed(layer.weight) or (layer.bias is not None and changed(layer.bias))
            ):
                layers.append(layer)
    # fbgemm's fp16 packing converts weight by weight on one thread (seconds per SmolLM2-135M agent:
    # benchmarks/README.md#float16-weights-on-a-cpu); the op releases the GIL, so threads divide it.
    with ThreadPoolExecutor(max_workers=torch.get_num_threads() if packing.threaded else 1) as pool:
        list(pool.map(lambda layer: layer.pack(), layers))
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
    weights (the log-probs kept while sampling are dropped). A copy is refreshed where its model's weights changed
    (``rollout/generation.py``: :func:`changed_parameters`, which sees updates, checkpoint loads and moves). An
    unchanged model is not copied again.
    """

    def __init__(self, dtype: str):
        self.dtype = getattr(torch, dtype)
        self.held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (copy, WeightsSeen, device)

    def __call__(self, model: torch.nn.Module) -> torch.nn.Module:
        params = list(model.parameters())
        device = params[0].device
        held = self.held.get(model)
        if held is None or held[2] != device:
            clone = self._copy(model, device)
            self.held[model] = (clone, weights_seen(model), device)
            return clone
        clone, seen, _ = held
        changed = changed_parameters(model, seen)
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
        self.held[model] = (clone, weights_seen(model), device)
        return clone

    def _copy(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        on_cpu = device.type == "cpu"
        float32 = next(model.parameters()).dtype == torch.float32
        if (
            self.dtype == torch.float16
            and on_cpu
            and float32
            and not cpu_multiplies_in(self.dtype)
            and packing_works(FP16_WEIGHTS)
        ):
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
    fix = (
        "generation_dtype: float16 (fp16 weights, float32 products, benchmarks/README.md#float16-weights-on-a-cpu) "
        "or generation_dtype: model"
        if dtype == torch.bfloat16 and packing_works(FP16_WEIGHTS)
        else "generation_dtype: model"
    )
    log.warning(
        "generation_dtype: %s on a CPU without %s matrix instructions: its matmuls are emulated, so "
        "sampling from the %s copy is slower than from the float32 weights here (bfloat16: 1.4x slower on an "
        "AMD EPYC with AVX2, benchmarks/README.md). Set %s on this machine.",
        name,
        name,
        name,
        fix,
    )


_COPIES: dict[str, SamplingCopies] = {}  # per dtype; each copy lives as long as its model


def sampling_copies(dtype: str) -> SamplingCopies:
    """The process's copies in ``dtype``: every engine that samples with a model (training, evaluation, pair
    collection, comparators) shares its one copy."""
    if dtype not in _COPIES:
        _COPIES[dtype] = SamplingCopies(dtype)
    return _COPIES[dtype]
