"""The linear products of a decoding step on a CPU (benchmarks/README.md#the-decoding-products).

Each decoding step multiplies a few rows (the K samples of a few prompts) by every weight matrix of the model, and
reads each matrix from memory: the step goes through all of them (540 MB for SmolLM2-135M in float32) before it
comes back to a layer, so none is still in the caches. Its floor is memory bandwidth. How close a BLAS gets to that
floor for so few rows depends on the library, the CPU, the shapes and the rows. With MKL on an AMD EPYC (1 thread),
``(W @ xᵀ)ᵀ`` took 0.68–0.71 of ``F.linear(x, W)``'s time over all of SmolLM2-135M's layers at 4 rows (0.45 for the
vocabulary projection alone), and 1.3–1.5 at 12 rows.

So while a model decodes (:func:`fast_decoding_products`, around ``generate``), its large CPU linear layers time both
forms once per process, thread count and row count, and use ``W @ xᵀ`` where it is clearly the faster. The timing
goes through the layers in the model's order, as a decoding step does, so each product reads its matrix from memory.
The two forms are the same sums, accumulated in another order: the logits agree to float rounding
(tests/test_rollout.py). Training's forward, with its many rows, is left alone.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# The layers of one weight shape whose matrices, together, are smaller than this stay in the caches between steps,
# where the plain product does well: they are left alone.
LARGE_WEIGHT_BYTES = 16 * 2**20
# More rows than this make the product compute-bound, where the plain product does well.
MAX_ROWS = 8
# W @ xᵀ is kept only when it takes less than this fraction of the plain product's time, so that a near tie, whose
# timing noise could go either way, does not change the kernel (and the logits' last bits) from run to run.
CLEARLY_FASTER = 0.8

_CHOICES: dict[tuple, bool] = {}  # (threads, rows, the layers' weight shapes) -> multiply as W @ xᵀ


def _plain(layer: torch.nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _by_columns(layer: torch.nn.Linear, x: Tensor) -> Tensor:
    flat = x.reshape(-1, x.shape[-1])
    # Contiguous, as F.linear's: the next layer's product (and attention) is slower on a transposed input.
    out = torch.mm(layer.weight, flat.t()).t().contiguous()
    if layer.bias is not None:
        out += layer.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _shape(layer: torch.nn.Linear) -> tuple:
    return (layer.weight.dtype, *layer.weight.shape, layer.bias is not None)


def columns_faster(layers: Sequence[torch.nn.Linear], rows: int, repeats: int = 3) -> bool:
    """Whether ``W @ xᵀ`` is clearly faster than ``F.linear`` for ``layers`` at ``rows`` rows. A pass multiplies by
    every layer in order, as a decoding step does; each form's time is its best of ``repeats`` passes after one
    warm-up pass (the forms alternate)."""
    # Ones, not a random draw: the sampling that follows stays as seeded.
    inputs = {
        shape: torch.ones(rows, shape[2], dtype=shape[0], device=layer.weight.device)
        for shape, layer in {_shape(layer): layer for layer in layers}.items()
    }

    def one_pass(form) -> float:
        start = time.perf_counter()
        for layer in layers:
            form(layer, inputs[_shape(layer)])
        return time.perf_counter() - start

    forms = (_plain, _by_columns)
    with torch.no_grad():
        for form in forms:
            one_pass(form)
        passes = [[one_pass(form) for form in forms] for _ in range(repeats)]
    plain, columns = (min(run[i] for run in passes) for i in range(len(forms)))
    return columns < CLEARLY_FASTER * plain


class _Products:
    """The form each row count multiplies in, for one model's large layers: timed once per process, thread count,
    row count and set of weight shapes (:func:`columns_faster`)."""

    def __init__(self, layers: Sequence[torch.nn.Linear]):
        self.layers = layers
        self.shapes = frozenset(map(_shape, layers))  # a frozenset keeps its hash: the key below is cheap

    def by_columns(self, rows: int) -> bool:
        key = (torch.get_num_threads(), rows, self.shapes)
        if key not in _CHOICES:
            _CHOICES[key] = columns_faster(self.layers, rows)
        return _CHOICES[key]

    def multiply(self, layer: torch.nn.Linear, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        skinny = 0 < rows <= MAX_ROWS and not torch.is_grad_enabled() and x.dtype == layer.weight.dtype
        return _by_columns(layer, x) if skinny and self.by_columns(rows) else _plain(layer, x)


def _multiplies_on_cpu(module: object) -> bool:
    """A plain ``nn.Linear`` with plain CPU tensors, whose forward is the class's (not one set on the instance, as
    accelerate's hooks do). A LoRA layer's base layer is one; a packed sampling copy or a sharded layer is not."""
    return (
        type(module) is torch.nn.Linear
        and type(module.weight.data) is torch.Tensor
        and module.weight.device.type == "cpu"
        and "forward" not in vars(module)
    )


def large_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """``model``'s CPU linear layers, in its order, whose weight shape it holds ``LARGE_WEIGHT_BYTES`` or more of."""
    layers = [m for m in model.modules() if _multiplies_on_cpu(m)]
    held: dict[tuple, dict[int, int]] = defaultdict(dict)  # shape -> distinct weights -> bytes
    for layer in layers:
        held[_shape(layer)][id(layer.weight)] = layer.weight.numel() * layer.weight.element_size()
    return [layer for layer in layers if sum(held[_shape(layer)].values()) >= LARGE_WEIGHT_BYTES]


@contextlib.contextmanager
def fast_decoding_products(model: torch.nn.Module) -> Iterator[None]:
    """While the block runs (a ``generate`` under ``inference_mode``), ``model``'s large CPU linear layers
    (:func:`large_linears`) multiply a few rows in the form timed faster on this machine. Anything else (a GPU, a
    small model, a packed sampling copy) is left as it is; the layers' own forwards are back afterwards."""
    layers = large_linears(model)
    products = _Products(layers)
    for layer in layers:
        layer.forward = functools.partial(products.multiply, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
