"""The linear products of one decoding step, form by form, against reading the weights once
(benchmarks/README.md#float16-weights-on-a-cpu).

A decoding step multiplies a few rows by every weight matrix of the model, in the model's order, so each matrix comes
from memory, not the caches. This times one such pass over a model's linear layers (the vocabulary projection
included) for each way the package can multiply them on a CPU:

    linear      ``F.linear(x, W)``: what the model runs by itself
    columns     ``(W @ xᵀ)ᵀ``: the timed decoding form (``rollout/backends/hf_products.py``)
    fp16        fp16 weights in float32 products, packed for fbgemm (``generation_dtype: float16`` on a CPU without
                fp16 matrix instructions, ``rollout/generation.py``)

and prints each pass's time, its ratio to ``linear`` and to the time that reading the weights takes at the
roofline's bandwidth (float32 bytes for the first two, fp16 bytes for the third: 1.0 is the limit).

    python benchmarks/bench_products.py --rows 1 4 8 16 32 --json benchmarks/results/products_amd.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import roofline
import torch
import torch.nn.functional as F

from comlrl_lightning.agents.factories import MODEL_FACTORIES
from comlrl_lightning.rollout.backends import hf_copies as generation
from comlrl_lightning.rollout.backends.hf_products import _by_columns


def forms() -> dict:
    """name -> (prepare(layers) -> state, multiply(layer, state, x), bytes per weight read)."""
    out = {
        "linear": (lambda layers: None, lambda i, layer, state, x: F.linear(x, layer.weight, layer.bias), 4),
        "columns": (lambda layers: None, lambda i, layer, state, x: _by_columns(layer, x), 4),
    }
    if generation.packing_works(generation.FP16_WEIGHTS):
        packing = generation.FP16_WEIGHTS
        out["fp16"] = (
            lambda layers: [packing.pack(layer.weight.detach(), layer.bias) for layer in layers],
            lambda i, layer, state, x: packing.multiply(x, state[i], layer.bias),
            2,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(MODEL_FACTORIES), help="a model factory")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32], help="rows per product")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--repeats", type=int, default=5, help="passes per form and row count (best is kept)")
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = MODEL_FACTORIES[args.model]()
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(layer.weight.numel() for layer in layers)
    limits = roofline.measure("cpu", args.threads)
    print(roofline.describe([limits]))
    print(f"{args.model}: {len(layers)} linear layers, {weights / 1e6:.1f}M weights; a pass reads each once")
    results = []
    with torch.inference_mode():
        prepared = {name: (prepare(layers), multiply, width) for name, (prepare, multiply, width) in forms().items()}
        for rows in args.rows:
            inputs = {n: torch.randn(rows, n) for n in {layer.in_features for layer in layers}}
            times: dict[str, list[float]] = {name: [] for name in prepared}
            for _ in range(args.repeats + 1):  # the forms alternate; each one's first pass warms it up
                for name, (state, multiply, _) in prepared.items():
                    start = time.perf_counter()
                    for i, layer in enumerate(layers):
                        multiply(i, layer, state, inputs[layer.in_features])
                    times[name].append(time.perf_counter() - start)
            best = {name: min(seconds[1:]) for name, seconds in times.items()}
            for name, (_, _, width) in prepared.items():
                floor = weights * width / (limits.bandwidth_gbs * 1e9)
                row = {
                    "rows": rows,
                    "form": name,
                    "ms": best[name] * 1e3,
                    "of_linear": best[name] / best["linear"],
                    "fraction_of_limit": floor / best[name],
                }
                results.append(row)
                print(
                    f"rows {rows:3d}  {name:8s} {row['ms']:8.1f} ms  {row['of_linear']:5.2f}x linear  "
                    f"{row['fraction_of_limit']:5.2f} of the bandwidth limit"
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "threads": args.threads,
                    "limits": roofline.as_dict([limits]),
                    "results": results,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
