"""Synchronous against one-step-off rollouts from vLLM servers: wall time per update, in one run.

For each config, the run's servers are started once (``python -m comlrl_lightning serve --config C``, vLLM's CPU
build), then the same fit runs with ``max_staleness: 0`` (sample, then update) and ``max_staleness: 1`` (the next
step is sampled by the servers while this one updates), interleaved over the repeats so load hits both alike. Each
fit is its own process (``python -m comlrl_lightning fit``), with a callback that stamps the end of every update;
the time per update is the median gap between consecutive updates after the first (the first includes the first
weight sync and warm-up). The fit's ``metrics.csv`` gives each update's phase timings and ``rollout/policy_lag``.

    .venv/bin/python benchmarks/bench_async.py --json benchmarks/results/async_cpu.json
    .venv/bin/python benchmarks/bench_async.py --configs configs/quickstart.yaml --steps 6 --repeats 1
    python benchmarks/bench_async.py --device cuda --configs configs/magrpo.yaml  # gpu_check.sh (one GPU: by file)

On 2 CPU cores the servers and the trainer share the same cores, so the overlap can gain little: the benchmark
reports what it is (benchmarks/README.md, "Synchronous vs one-step-off rollouts").
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import Callback

from comlrl_lightning.serve import team_sources

REPO = Path(__file__).resolve().parents[1]


def server_args(device: str, kv_bytes: int, servers: int) -> list[str]:
    """``vllm serve`` arguments: on a CPU eager mode, float32 (the trainer's dtype) and a small KV cache; on a GPU
    that the trainer shares, a share of its memory for each server."""
    if device == "cpu":
        return [
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--kv-cache-memory-bytes",
            str(kv_bytes),
        ]
    return ["--max-model-len", "1024", "--gpu-memory-utilization", f"{0.5 / servers:.2f}"]


class UpdateClock(Callback):
    """Appends the wall-clock time of every update's end to the file ``$BENCH_ASYNC_CLOCK`` names."""

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
        if pl_module.run_state.updates_done and trainer.is_global_zero:
            with open(os.environ["BENCH_ASYNC_CLOCK"], "a") as out:
                out.write(f"{pl_module.run_state.updates_done} {time.monotonic()}\n")


def free_port(count: int) -> int:
    """A first port with ``count`` free ports after it."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + count < 65535 and all(_free(port + i) for i in range(count)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def server_config(config: Path, folder: Path, transfer: str = "file") -> Path:
    """``config`` with ``vllm_mode: server``; a ``tiny`` team gets attention heads vLLM's CPU kernels take (head size
    32: ``num_heads: 2, num_kv_heads: 1``), for the servers and the fit alike."""
    data = yaml.safe_load(config.read_text())
    init = data["model"]["init_args"]
    init.update(generation_backend="vllm", vllm_mode="server", eval_interval=0, vllm_server_weight_transfer=transfer)
    if init.get("agents") == "tiny" and not init.get("model_config"):
        init["model_config"] = {"model_kwargs": {"num_heads": 2, "num_kv_heads": 1}}
    path = folder / config.name
    path.write_text(yaml.safe_dump(data))
    return path


def start_servers(config: Path, args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, list[str]]:
    """``serve`` for ``config``; returns the process and the URLs it prints once every server answers."""
    command = [sys.executable, "-m", "comlrl_lightning", "serve", "--config", str(config), "--port", str(free_port(4))]
    command += ["--", *args]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    for line in process.stdout:
        print("  serve:", line.rstrip(), flush=True)
        if line.startswith("serving "):
            return process, line.split("[", 1)[1].split("]", 1)[0].split(", ")
    raise RuntimeError(f"serve --config {config} exited with status {process.wait()} before its servers answered")


def stop_servers(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=120)


def fit(config: Path, urls: list[str], staleness: int, steps: int, env: dict[str, str], device: str) -> dict[str, Any]:
    """One fit of ``steps`` updates from the servers; its update times, phase timings and policy lags."""
    with tempfile.TemporaryDirectory(prefix="bench_async_") as root:
        clock = Path(root) / "clock.txt"
        m = "--model.init_args."
        command = [sys.executable, "-m", "comlrl_lightning", "fit", "--config", str(config)]
        command += ["--trainer.max_steps", str(steps), "--trainer.default_root_dir", root]
        command += [
            "--trainer.enable_checkpointing",
            "false",
            f"{m}vllm_server_urls",
            f"[{', '.join(urls)}]",
            f"{m}max_staleness",
            str(staleness),
        ]
        command += [
            "--trainer.callbacks+=bench_async.UpdateClock",
            "--trainer.accelerator",
            device.replace("cuda", "gpu"),
        ]
        started = time.monotonic()
        done = subprocess.run(
            command,
            cwd=REPO,
            env={**env, "BENCH_ASYNC_CLOCK": str(clock), "PYTHONPATH": f"{REPO}:{REPO / 'benchmarks'}"},
            capture_output=True,
            text=True,
        )
        wall = time.monotonic() - started
        if done.returncode:
            raise RuntimeError(f"fit max_staleness={staleness} failed:\n{(done.stdout + done.stderr)[-4000:]}")
        stamps = [float(line.split()[1]) for line in clock.read_text().splitlines()]
        (metrics,) = Path(root).rglob("metrics.csv")
        rows = [r for r in csv.DictReader(metrics.open()) if r.get("rollout/policy_lag")]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    phases = sorted({k for r in rows for k in r if k.startswith("timing_s/")})
    return {
        "max_staleness": staleness,
        "updates": len(stamps),
        "seconds_per_update": statistics.median(gaps),
        "gaps": gaps,
        "fit_wall_seconds": wall,
        "policy_lag": [float(r["rollout/policy_lag"]) for r in rows],
        "phase_seconds": {p[len("timing_s/") :]: [float(r[p]) for r in rows if r.get(p)] for p in phases},
        "reward": [float(r["rollout/turn_1/reward_mean"]) for r in rows if r.get("rollout/turn_1/reward_mean")],
    }


def bench(config: Path, steps: int, repeats: int, kv_bytes: int, device: str, transfer: str) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    print(f"{config}: starting its servers", flush=True)
    folder = tempfile.TemporaryDirectory(prefix="bench_async_config_")
    served = server_config(config, Path(folder.name), transfer)
    servers = len(team_sources(yaml.safe_load(served.read_text()))[0])
    process, urls = start_servers(served, server_args(device, kv_bytes, servers), env)
    runs: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    try:
        for repeat in range(repeats):
            for staleness in (0, 1):
                run = fit(served, urls, staleness, steps, env, device)
                runs[staleness].append(run)
                print(
                    f"  repeat {repeat} max_staleness {staleness}: {run['seconds_per_update']:.2f} s/update "
                    f"(gaps {', '.join(f'{g:.2f}' for g in run['gaps'])}; policy lag {run['policy_lag']})",
                    flush=True,
                )
    finally:
        stop_servers(process)
        folder.cleanup()
    sync = statistics.median(r["seconds_per_update"] for r in runs[0])
    async_ = statistics.median(r["seconds_per_update"] for r in runs[1])
    return {
        "config": str(config.relative_to(REPO) if config.is_absolute() else config),
        "servers": len(urls),
        "weight_transfer": transfer,
        "steps": steps,
        "repeats": repeats,
        "sync_seconds_per_update": sync,
        "one_step_off_seconds_per_update": async_,
        "speedup": sync / async_,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="configs/quickstart.yaml,configs/magrpo.yaml", help="comma-separated")
    parser.add_argument("--steps", type=int, default=6, help="updates per fit (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=2, help="fits per mode, interleaved")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="each server's KV cache")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the trainer and servers run")
    parser.add_argument(
        "--weight-transfer",
        choices=("file", "nccl"),
        default="file",
        help="vllm_server_weight_transfer (nccl: servers on other GPUs)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    rows = [
        bench(Path(c), args.steps, args.repeats, args.kv_cache_mib * 2**20, args.device, args.weight_transfer)
        for c in args.configs.split(",")
    ]
    print(f"\n{'config':<28} {'servers':>7} {'sync s/update':>14} {'one-step-off':>13} {'ratio':>6}")
    for row in rows:
        print(
            f"{row['config']:<28} {row['servers']:>7} {row['sync_seconds_per_update']:>14.2f} "
            f"{row['one_step_off_seconds_per_update']:>13.2f} {row['speedup']:>6.2f}"
        )
    if args.json:
        machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
        machine["device"] = args.device
        machine["load_average"] = os.getloadavg()
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
