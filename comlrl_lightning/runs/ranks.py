"""Which share of the work this process does in a data-parallel run, and the few collectives that join the shares.

A run with D processes (Lightning's DDP strategy, any number of nodes) gives every process — a *rank* — its own
share of the dataset items; the shares are joined with the collectives below, over the process group the strategy
set up (no groups of our own). In a one-process run every function is the identity and costs nothing, so the same
code serves both (docs/scaling.md).

* :func:`shard` — a rank's part of a global batch: contiguous, as even as possible, possibly empty.
* :func:`gather` — every rank's Python object, in rank order, on every rank.
* :func:`reduce_sum` / :func:`reduce_max` — numbers summed or maxed over ranks.
* :func:`broadcast` — rank 0's object on every rank.
* :func:`average_gradients` — each parameter's gradient averaged over ranks, weighted by the rows each rank trained
  on, in one all-reduce per dtype and device; gradients that no rank has stay ``None``.
* :func:`rank_zero_first` — rank 0 writes (a file every rank then reads) and the others wait for it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")


def active() -> bool:
    """More than one process joined by an initialised default process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def shard(items: Sequence[T], index: int | None = None, size: int | None = None) -> list[T]:
    """Rank ``index``'s contiguous part of ``items`` split over ``size`` ranks: the first ``len % size`` ranks get one
    more; a rank gets nothing only when there are fewer items than ranks."""
    index = rank() if index is None else index
    size = world_size() if size is None else size
    base, extra = divmod(len(items), size)
    start = index * base + min(index, extra)
    return list(items[start : start + base + (index < extra)])


def _device() -> torch.device:
    """Where the backend's collectives take tensors (NCCL: the current CUDA device; gloo: CPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather(obj: T) -> list[T]:
    """``obj`` of every rank, in rank order, on every rank (pickled; for small objects and records)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def reduce_sum(values: Sequence[float] | float) -> Any:
    """Sum over ranks of a number or a list of numbers (float64: counts stay exact)."""
    return _reduce(values, dist.ReduceOp.SUM) if active() else values


def reduce_max(values: Sequence[float] | float) -> Any:
    return _reduce(values, dist.ReduceOp.MAX) if active() else values


def _reduce(values: Sequence[float] | float, op) -> Any:
    scalar = not isinstance(values, (list, tuple))
    tensor = torch.tensor([values] if scalar else list(values), dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=op)
    out = tensor.cpu().tolist()
    return out[0] if scalar else out


def broadcast(obj: T) -> T:
    """Rank 0's ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if active():
        dist.barrier()


@contextlib.contextmanager
def rank_zero_first() -> Iterator[bool]:
    """``with rank_zero_first() as writer:`` — the body's writes are done by rank 0 only (``writer`` is True there);
    every rank leaves the block after rank 0 has finished, so what it wrote can be read by all."""
    try:
        yield rank() == 0
    finally:
        barrier()


def mean_of_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Each metric's mean over the ranks that logged it (a rank with an empty share logs no rewards)."""
    if not active():
        return metrics
    every = gather(metrics)
    keys = sorted({k for m in every for k in m})
    return {k: sum(m[k] for m in every if k in m) / sum(k in m for m in every) for k in keys}


_BUCKET_BYTES = 256 * 2**20  # one all-reduce per ~256 MB of gradients (per dtype and device)


@torch.no_grad()
def average_gradients(params: Iterable[Tensor], rows: float) -> float:
    """Replace each gradient by the row-weighted mean of the ranks' gradients, Σ_r n_r·g_r / Σ_r n_r, so a rank whose
    share of a batch was short (or empty: ``rows`` 0) weighs in proportion. A parameter with a gradient on some rank
    but not on this one counts zero here; a parameter without a gradient on every rank keeps ``grad = None`` (the
    optimizer then skips it, as in one process). Returns Σ_r n_r."""
    params = [p for p in params if p.requires_grad]
    if not active():
        return rows
    has = torch.tensor(
        [float(p.grad is not None) for p in params] + [float(rows)], dtype=torch.float64, device=_device()
    )
    dist.all_reduce(has)
    total = float(has[-1])
    if total == 0:
        return 0.0
    synced = [p for p, h in zip(params, has[:-1].tolist()) if h > 0]
    for p in synced:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    for p in synced:
        groups = buckets.setdefault((p.grad.dtype, p.grad.device), [[]])
        if groups[-1] and sum(g.numel() * g.element_size() for g in groups[-1]) >= _BUCKET_BYTES:
            groups.append([])
        groups[-1].append(p.grad)
    for (_, device), groups in buckets.items():
        for grads in groups:
            flat = torch.cat([g.reshape(-1) for g in grads]).mul_(rows / total)
            moved = flat.to(_device()) if device != _device() else flat
            dist.all_reduce(moved)
            flat = moved.to(device) if moved is not flat else flat
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
    return total


@torch.no_grad()
def sharded_norm(local_parts: Iterable[Tensor]) -> float:
    """The 2-norm of tensors split over the ranks (each rank passes its local parts, e.g. FSDP shards)."""
    squares = sum(float(t.detach().double().pow(2).sum()) for t in local_parts)
    return math.sqrt(reduce_sum(squares))
