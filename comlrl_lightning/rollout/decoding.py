"""The vocabulary projection of a decoding step on a CPU (benchmarks/README.md#the-vocabulary-projection).

Each decoding step multiplies a few rows (the K samples of a few prompts) by the vocabulary matrix, the largest
weight of a small model (49152 x 576 floats, 113 MB, for SmolLM2-135M). The step reads all of it, so its floor is
memory bandwidth. How close a BLAS gets to that floor for so few rows depends on the library and the CPU. With MKL
on an AMD EPYC (1 thread, 4 rows), ``F.linear(x, W)`` took 31 ms, ``(W @ xᵀ)ᵀ`` 14 ms, and reading the matrix once
10 ms.

So while a model decodes (:func:`fast_vocab_projection`, around ``generate``), a large vocabulary projection on the
CPU times both forms once per shape and row count, and keeps ``W @ xᵀ`` where it is clearly the faster. The two are
the same sums, accumulated in another order: the logits agree to float rounding (tests/test_rollout.py). Training's
forward, with its many rows, is left alone.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

# A weight smaller than this stays in the caches between steps, where the plain product does well.
LARGE_WEIGHT_BYTES = 16 * 2**20
# More rows than this make the product compute-bound, where the plain product does well.
MAX_ROWS = 64
# W @ xᵀ is kept only when it takes less than this fraction of the plain product's time, so that a near tie, whose
# timing noise could go either way, does not change the kernel (and the logits' last bits) from run to run.
CLEARLY_FASTER = 0.8

_CHOICES: dict[tuple, bool] = {}  # (dtype, out features, in features, rows) -> multiply as W @ xᵀ


def _plain(layer: torch.nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _by_columns(layer: torch.nn.Linear, x: Tensor) -> Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = torch.mm(layer.weight, flat.t()).t()
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _best_seconds(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def columns_faster(layer: torch.nn.Linear, x: Tensor) -> bool:
    """Whether ``W @ xᵀ`` is clearly faster than ``F.linear`` for ``layer`` at ``x``'s rows: timed once per shape
    and row count in a process (both forms warmed up, then the best of three each)."""
    rows = x.numel() // x.shape[-1]
    key = (x.dtype, *layer.weight.shape, rows)
    if key not in _CHOICES:
        _plain(layer, x)  # warm-up
        _by_columns(layer, x)
        plain = _best_seconds(lambda: _plain(layer, x))
        columns = _best_seconds(lambda: _by_columns(layer, x))
        _CHOICES[key] = columns < CLEARLY_FASTER * plain
    return _CHOICES[key]


def _project(layer: torch.nn.Linear, x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1]
    skinny = 0 < rows <= MAX_ROWS and not torch.is_grad_enabled() and x.dtype == layer.weight.dtype
    return _by_columns(layer, x) if skinny and columns_faster(layer, x) else _plain(layer, x)


def _projects_on_cpu(layer: object) -> bool:
    return (type(layer) is torch.nn.Linear and layer.weight.device.type == "cpu"
            and layer.weight.numel() * layer.weight.element_size() >= LARGE_WEIGHT_BYTES)


@contextlib.contextmanager
def fast_vocab_projection(model: torch.nn.Module) -> Iterator[None]:
    """While the block runs (a ``generate`` under ``inference_mode``), ``model``'s output embedding, when it is a
    large plain ``nn.Linear`` on the CPU, multiplies in the form timed faster on this machine. Anything else (a GPU,
    a LoRA- or FSDP-wrapped head, a packed sampling copy, a small vocabulary) is left as it is."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not _projects_on_cpu(head) or "forward" in vars(head):  # a forward set on the instance (accelerate's hooks)
        yield
        return
    head.forward = _project.__get__(head)
    try:
        yield
    finally:
        del head.forward
