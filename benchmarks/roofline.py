"""The machine's limit, so that every benchmark is judged against what the hardware allows, not only against us.

Measured here, once per benchmark run:

* **matmul GFLOP/s**: the best of a few ``torch.mm`` of two 2048 x 2048 float32 matrices (2·n³ FLOPs), with one
  thread and with every thread (CPU), or on the GPU;
* **memory bandwidth GB/s**: the best bytes/s of a copy, a sum, an add and an addcmul over 256 MiB tensors (bytes
  read + bytes written). A lower estimate: on one CPU thread, kernels with more streams reach more (the fused AdamW
  step, 4 reads + 3 writes, measured ~1.5x this figure), so a bandwidth-bound phase can show a fraction above 1.

Derived for a causal LM of ``body`` non-embedding parameters, a vocabulary of V and hidden size H (the output
projection is a V x H matmul whether or not it is tied to the embeddings):

* FLOPs per generated token ≈ 2·(body + V·H): one forward of one position (attention over the context is small at
  these lengths and is left out, so the limit is optimistic);
* FLOPs per trained token ≈ 6·body (+ 6·V·H for each completion position, the only positions whose logits are
  computed): forward 2·, backward 4·; a prompt shared by K samples is encoded once, in sampling and in training;
* a decode step reads every weight once: at small batches generation is bound by bandwidth, not FLOPs;
* an AdamW step reads parameter, gradient and two moments and writes parameter and moments: 28 bytes per float32
  parameter, bandwidth-bound.

Each phase's lower bound is max(FLOPs / peak, bytes / bandwidth); ``fraction`` = lower bound / measured seconds
(1.0 = at the limit). The single-thread limit is used when the benchmark runs one thread.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Limits:
    device: str
    threads: int
    matmul_gflops: float
    bandwidth_gbs: float


def _best(fn, repeats: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure(device: str = "cpu", threads: int | None = None, n: int = 2048, mib: int = 256, repeats: int = 5) -> Limits:
    """Achieved matmul GFLOP/s and copy bandwidth on ``device`` (CPU: with ``threads`` torch threads)."""
    previous = torch.get_num_threads()
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        mm = _best(lambda: torch.mm(a, b), repeats, sync)
        src, other = torch.ones(mib * 2**20 // 4, device=device), torch.ones(mib * 2**20 // 4, device=device)
        dst = torch.empty_like(src)
        size = src.numel() * 4
        bandwidth = max(
            2 * size / _best(lambda: dst.copy_(src), repeats, sync),  # read + write
            size / _best(lambda: src.sum(), repeats, sync),  # read only
            3 * size / _best(lambda: torch.add(src, other, out=dst), repeats, sync),  # 2 reads + write
            4 * size / _best(lambda: torch.addcmul(src, other, src, out=dst), repeats, sync),
        )
        return Limits(device, torch.get_num_threads() if device == "cpu" else 0, 2 * n**3 / mm / 1e9, bandwidth / 1e9)
    finally:
        torch.set_num_threads(previous)


@dataclass
class ModelCosts:
    """What one token costs a causal LM: parameters by kind and bytes per parameter."""

    body: int  # parameters outside the embeddings and output projection
    vocab_hidden: int  # V·H: the output projection's matmul
    parameters: int  # every distinct parameter
    bytes_per_parameter: int

    @classmethod
    def of(cls, model) -> "ModelCosts":
        embeddings = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        distinct = {id(p): p for p in model.parameters()}
        total = sum(p.numel() for p in distinct.values())
        tables = embeddings.numel() + (head.weight.numel() if head is not None and head.weight is not embeddings else 0)
        return cls(total - tables, embeddings.numel(), total, embeddings.element_size())

    def generate_flops(self, rows: int) -> float:
        return 2.0 * rows * (self.body + self.vocab_hidden)

    def forward_flops(self, rows: int, width: int, scored: int) -> float:
        """One forward of ``rows`` rows of ``width`` tokens, ``scored`` of them projected to the vocabulary."""
        return 2.0 * rows * (width * self.body + scored * self.vocab_hidden)


def lower_bounds(
    costs: ModelCosts,
    limits: Limits,
    *,
    agents: int,
    prompts: int,
    k: int,
    prompt: int,
    tokens: int,
    trainable: int | None = None,
) -> dict[str, float]:
    """Seconds each phase of one team step needs at the limit: ``agents`` models, ``prompts`` prompts of ``prompt``
    tokens, ``k`` samples per prompt of ``tokens`` generated tokens each (each prompt prefilled once)."""
    flops, bandwidth = limits.matmul_gflops * 1e9, limits.bandwidth_gbs * 1e9
    rows, weights = prompts * k, costs.parameters * costs.bytes_per_parameter
    prefill = costs.forward_flops(prompts, prompt, 1) / flops
    decode = tokens * max(costs.generate_flops(rows) / flops, weights / bandwidth)
    # Scoring encodes each prompt once too: the prompts, then every row's completion (and its last prompt token).
    score = (costs.forward_flops(prompts, prompt - 1, 0) + costs.forward_flops(rows, tokens, tokens)) / flops
    trained = trainable if trainable is not None else costs.parameters
    return {
        "generate": agents * (prefill + decode),
        "score": agents * score,
        "update": agents * 3 * score,  # forward + backward (2x) of the same rows
        "optimizer": agents * 28 * trained / bandwidth,
    }


def describe(limits: list[Limits]) -> str:
    parts = [
        f"{lim.device}"
        + (f" x{lim.threads} threads" if lim.threads else "")
        + f": matmul {lim.matmul_gflops:.1f} GFLOP/s, memory {lim.bandwidth_gbs:.1f} GB/s"
        for lim in limits
    ]
    return "roofline: " + "; ".join(parts)


def machine_limits(device: str, threads: int) -> list[Limits]:
    """The limits the benchmark reports: on CPU with one thread and with every core; on CUDA the GPU."""
    if device == "cuda":
        return [measure("cuda")]
    counts = sorted({max(threads, 1), os.cpu_count() or 1})
    return [measure("cpu", t) for t in counts]


def as_dict(limits: list[Limits]) -> list[dict]:
    return [asdict(lim) for lim in limits]
