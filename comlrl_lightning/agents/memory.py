"""Will an update fit? A calibrated estimate of a training forward/backward's memory, checked before it runs.

A training forward of a causal LM keeps, per token and per layer, a few dozen hidden-size vectors for the
backward (attention through PyTorch's SDPA keeps no T×T matrices); with gradient checkpointing only the layer
inputs are kept and one layer is recomputed at a time. The constants below were measured on SmolLM2-135M in
float32 on CPU (peak RSS of one forward + backward, 500–1500 tokens per row, 1–4 rows): about 24 hidden-size
float32 vectors per token and layer without checkpointing, about 9 with it; the logits of the scored positions
are kept in float32 with their log-sum-exp. The estimate is meant to catch a configuration that clearly cannot
fit (tens of GB on a 24 GB machine) before the kernel's OOM killer does, not to budget the last hundred MB.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any, Sequence

import torch

VECTORS_PER_TOKEN_LAYER = 24.0  # kept for backward, without gradient checkpointing
VECTORS_PER_TOKEN_LAYER_CHECKPOINTED = 9.0


def _config(model: Any) -> Any:
    for candidate in (model, getattr(model, "model", None), getattr(model, "pretrained_model", None)):
        config = getattr(candidate, "config", None)
        if config is not None and getattr(config, "hidden_size", None):
            return config
    return None


def _language_model(model: Any) -> Any:
    """The causal LM (a value-head wrapper keeps it as ``.model``)."""
    return model if hasattr(type(model), "supports_gradient_checkpointing") else getattr(model, "model", model)


def is_checkpointing(model: Any) -> bool:
    """Activation (gradient) checkpointing is on (transformers 5 name, then 4)."""
    inner = _language_model(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(inner), name):
            return bool(getattr(inner, name))
    return False


def enable_checkpointing(model: Any) -> None:
    """Recompute each layer in the backward instead of keeping its activations (non-reentrant)."""
    inner = _language_model(model)
    if not getattr(inner, "supports_gradient_checkpointing", False):
        raise ValueError(f"model_config.gradient_checkpointing: {type(inner).__name__} does not support it.")
    if hasattr(inner, "activation_checkpointing_enable"):  # transformers 5
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def activation_bytes(model: Any, tokens: int, scored_positions: int) -> int | None:
    """Memory one training forward over ``tokens`` tokens, ``scored_positions`` of them projected onto the vocabulary,
    keeps for its backward (None: unknown model)."""
    config = _config(model)
    if config is None:
        return None
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1
    vocab = getattr(config, "vocab_size", 0) or 0
    element = next(model.parameters()).element_size()
    vectors = VECTORS_PER_TOKEN_LAYER_CHECKPOINTED if is_checkpointing(model) else VECTORS_PER_TOKEN_LAYER
    hidden = tokens * layers * config.hidden_size * vectors * element
    logits = scored_positions * vocab * 4 * 3  # float32 logits, their log-sum-exp pass and its gradient
    return int(hidden + logits)


def missing_state_bytes(parameters: list[torch.nn.Parameter], optimizer: Any) -> int:
    """Gradients and AdamW moments not allocated yet (before the first backward / optimizer step)."""
    total = 0
    for p in parameters:
        if not p.requires_grad:
            continue
        size = p.numel() * p.element_size()
        total += size if p.grad is None else 0
        total += 2 * size if optimizer is not None and not optimizer.state.get(p) else 0
    return total


def available_bytes(device: torch.device) -> int | None:
    """Memory a process can still take on ``device``: free CUDA memory, or the kernel's MemAvailable on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu" and os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return None


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """From now on, keep the memory this process frees for its next allocations instead of handing it back to the
    operating system (glibc's ``mallopt``: no separately mapped chunks, no trimming of the heap); whether it took
    effect (False on another C library). A training step on the CPU frees and allocates again ~1 GB of activations
    and gradients, and each page the system hands out anew costs a page fault: ~5 µs on a KVM guest, 200–300k of
    them, ~1 s, per update of two SmolLM2-135M agents (benchmarks/README.md#memory-kept-for-the-next-step). The
    process then stays at its peak memory, as PyTorch's caching allocator does on a GPU."""
    libc = ctypes.CDLL(None)  # the C library this process runs on
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def check_update_memory(
    forwards: Sequence[tuple[Any, int, int, Sequence[int]]],
    device: torch.device,
    trainable: list[torch.nn.Parameter],
    optimizer: Any,
    levers: str,
) -> None:
    """Raise a clear ``MemoryError`` when an update's largest forward (models are trained one after another) plus
    the optimizer state not allocated yet clearly exceeds the memory left on ``device``. ``forwards``: per forward,
    (model, tokens it runs, positions it scores, input shape); ``levers``: the fields that lower it, as text."""
    cost: dict[int, int] = {}
    for model, tokens, scored, _ in forwards:
        need = activation_bytes(model, tokens, scored)
        if need is None:
            return
        cost[id(model)] = max(cost.get(id(model), 0), need)
    available = available_bytes(device) if cost else None
    if available is None:
        return
    state = missing_state_bytes(trainable, optimizer)
    peak = max(cost.values()) + state
    if peak <= available:
        return
    rows, width = max((tuple(shape) for *_, shape in forwards), key=lambda rw: rw[0] * rw[1])
    gib = 2**30
    raise MemoryError(
        f"This update needs about {peak / gib:.1f} GB on {device} (its largest forward, {rows} rows × {width} "
        f"tokens: {max(cost.values()) / gib:.1f} GB kept for the backward; gradients and AdamW state not yet "
        f"allocated: {state / gib:.1f} GB) but about {available / gib:.1f} GB are available. Lower it with {levers}."
    )
