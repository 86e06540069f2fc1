"""The generation backends side by side on CPU: one table from the ``bench_step.py --backends`` runs.

Each ``results/backends_cpu_<task>_m<prompts>_k<K>.json`` is one run of

    python benchmarks/bench_step.py --task TASK --prompts M --k K --tokens 32 --repeats 1 --steps 2 \\
        --backends hf vllm transformers_cb --json benchmarks/results/backends_cpu_TASK_mM_kK.json

(the same workload through each backend, one process each, one warm-up step then two timed steps). This script
reads them all and writes ``results/backends_cpu.md``: generated tokens/s in the sampling phase, the whole step's
seconds, peak memory, and each backend's ratio to ``hf`` in the same run.

    python benchmarks/backends_table.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NAME = re.compile(r"backends_cpu_(\w+?)_m(\d+)_k(\d+)\.json$")


def rows() -> list[dict]:
    out = []
    for path in sorted(RESULTS.glob("backends_cpu_*_m*_k*.json")):
        match = NAME.search(path.name)
        if not match:
            continue
        report = json.loads(path.read_text())
        cfg = report["config"]
        tokens = cfg["agents"] * cfg["prompts"] * cfg["k"] * cfg["tokens"]
        base = report["impls"]["hf"]["phases"]
        for backend, impl in report["impls"].items():
            phases = impl["phases"]
            out.append(
                dict(
                    task=cfg["task"],
                    prompts=cfg["prompts"],
                    k=cfg["k"],
                    backend=backend,
                    prompt_tokens=round(report.get("prompt_tokens", 0)),
                    tokens_per_s=tokens / phases["generate"]["median"],
                    step_s=phases["step"]["median"],
                    peak_mib=impl["peak_mib"],
                    generate_vs_hf=phases["generate"]["median"] / base["generate"]["median"],
                    step_vs_hf=phases["step"]["median"] / base["step"]["median"],
                    load=report["machine"].get("load_average", [None])[0],
                    file=path.name,
                )
            )
    return out


def table(items: list[dict]) -> str:
    lines = [
        "| prompts | task (prompt tokens) | K | backend | generated tokens/s | step s | peak MiB | generate time / hf | step time / hf |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = {"hf": 0, "vllm": 1, "transformers_cb": 2}
    for r in sorted(items, key=lambda r: (r["task"], r["prompts"], r["k"], order.get(r["backend"], 9))):
        lines.append(
            f"| {r['prompts']} | {r['task']} ({r['prompt_tokens']}) | {r['k']} | `{r['backend']}` | "
            f"{r['tokens_per_s']:.1f} | {r['step_s']:.2f} | {r['peak_mib']:.0f} | "
            f"{r['generate_vs_hf']:.2f} | {r['step_vs_hf']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    items = rows()
    text = (
        "# Generation backends on CPU (`bench_step.py --backends`, `backends_table.py`)\n\n"
        "SmolLM2-135M-Instruct, two agents, T = 32 forced new tokens, 1 torch thread, float32; story prompts and "
        "real MBPP prompts through the coding formatters; one process per backend, one warm-up step then two "
        "timed steps (medians). Ratios are against `hf` in the same run (below 1: faster than `hf`). The "
        "machine was shared with other work while these ran (load averages are in each JSON file), so "
        "compare within a row group, not across groups.\n\n" + table(items) + "\n"
    )
    (RESULTS / "backends_cpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
