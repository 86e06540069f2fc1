"""``python -m comlrl_lightning serve --config CONFIG``: start the ``vllm serve`` processes a run's team samples from
(``vllm_mode: server``, docs/scaling.md#vllm-servers).

One server per weight set of the config's team — one per agent; a LoRA team: one server of its base with an
adapter slot per agent — on consecutive ports from ``--port``, each with vLLM's RL endpoints and the ``comlrl_file`` weight-transfer
backend. A factory model (``tiny``, ``smollm2-135m-instruct``) is saved to a folder first (the servers load
architectures and tokenizers from folders; the weights are the trainer's after its first sync). When every server
answers, the command prints the ``vllm_server_urls`` to give the fit, and waits; Ctrl-C (or SIGTERM) stops them all.
Each server logs to ``$COMLRL_LIGHTNING_CACHE/served/logs/server-<port>.log``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml


def team_sources(config: dict[str, Any]) -> tuple[list[str], dict[str, Any], list[str]]:
    """The source of each weight set of a config's team (one per agent; a LoRA team: its one base), the model
    kwargs of factory models, and the ``vllm serve`` arguments the team needs (a LoRA team's adapters)."""
    args = (config.get("model") or {}).get("init_args") or {}
    agents, n = args.get("agents"), args.get("num_agents")
    if agents is None:
        raise ValueError("the config names no agents (model.init_args.agents): there is nothing to serve.")
    kwargs = dict((args.get("model_config") or {}).get("model_kwargs") or {})
    sources = [str(a) for a in agents] if isinstance(agents, list) else [str(agents)] * int(n or 2)
    if args.get("lora_rank") is None:
        return sources, kwargs, []
    from comlrl_lightning.rollout.backends.vllm import _lora_rank_bucket

    rank = _lora_rank_bucket(int(args["lora_rank"]))
    return sources[:1], kwargs, ["--enable-lora", "--max-loras", str(len(sources)), "--max-lora-rank", str(rank)]


def model_folder(source: str, model_kwargs: dict[str, Any], cache: Path) -> str:
    """What ``vllm serve --model`` reads for ``source``: a hub id or a folder as it is, a factory model saved."""
    from comlrl_lightning.agents.factories import MODEL_FACTORIES

    if source not in MODEL_FACTORIES:
        return source
    # one folder per architecture: the same factory with other model_kwargs is another model
    key = json.dumps(model_kwargs, sort_keys=True)
    folder = cache / (f"{source}-{hashlib.sha256(key.encode()).hexdigest()[:10]}" if model_kwargs else source)
    if not (folder / "config.json").exists():
        model, tokenizer = MODEL_FACTORIES[source](**model_kwargs)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def transfer_backend(config: dict[str, Any]) -> str:
    """The servers' weight-transfer backend for a config's ``vllm_server_weight_transfer``: ``comlrl_file`` (file)
    or vLLM's ``nccl``."""
    args = (config.get("model") or {}).get("init_args") or {}
    chosen = args.get("vllm_server_weight_transfer") or "file"
    if chosen not in ("file", "nccl"):
        raise ValueError(f"model.init_args.vllm_server_weight_transfer must be file or nccl (got {chosen!r}).")
    return "comlrl_file" if chosen == "file" else "nccl"


def server_command(model: str, port: int, host: str, extra: list[str], backend: str = "comlrl_file") -> list[str]:
    """The ``vllm serve`` command of one weight set (the module form: the CPU wheel's ``vllm`` script cannot read
    its own version)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command += ["--host", host, "--port", str(port), "--weight-transfer-config", json.dumps({"backend": backend})]
    return command + extra


def server_gpus(spec: str | None, index: int) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` of server ``index``: from ``--gpus`` (``'0,1;2,3'``), else GPU ``index`` when the
    machine has GPUs (and none is chosen already), else nothing."""
    if spec:
        groups = spec.split(";")
        return {"CUDA_VISIBLE_DEVICES": groups[index % len(groups)].strip()}
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return {}
    import torch

    count = torch.cuda.device_count()
    return {"CUDA_VISIBLE_DEVICES": str(index % count)} if count else {}


def wait_until_up(urls: list[str], processes: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for url, process, log in zip(urls, processes, logs):
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"the vLLM server for {url} exited with status {process.returncode} (its log: {log})"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the vLLM server for {url} did not answer within {timeout:g} s") from None
                time.sleep(1)


def build_parser() -> argparse.ArgumentParser:
    """The ``serve`` subcommand's arguments."""
    parser = argparse.ArgumentParser(prog="python -m comlrl_lightning serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's config (its model.init_args.agents are served)")
    parser.add_argument("--port", type=int, default=8000, help="the first server's port; the next ones follow")
    parser.add_argument("--host", default="127.0.0.1", help="the address the servers listen on")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for every server to answer")
    parser.add_argument(
        "--gpus",
        default=None,
        help="the GPUs of each server, ';'-separated (e.g. '0,1;2,3' for tensor-parallel pairs; default: server i on "
        "GPU i when there are GPUs)",
    )
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more `vllm serve` arguments")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        config = yaml.safe_load(Path(args.config).read_text())
        sources, kwargs, team_args = team_sources(config)
        backend = transfer_backend(config)
    except (OSError, ValueError, yaml.YAMLError) as err:  # a config mistake: one line, no traceback
        raise SystemExit(f"serve: {err}") from None
    cache = Path(os.environ.get("COMLRL_LIGHTNING_CACHE", Path.home() / ".cache" / "comlrl_lightning")) / "served"
    extra = team_args + [a for a in args.vllm_args if a != "--"]
    # vLLM's weight-transfer routes; a LoRA team's adapters loaded at run time
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    urls = [f"http://{args.host}:{args.port + i}" for i in range(len(sources))]
    logs = [cache / "logs" / f"server-{args.port + i}.log" for i in range(len(sources))]
    logs[0].parent.mkdir(parents=True, exist_ok=True)
    processes = [
        subprocess.Popen(
            server_command(model_folder(s, kwargs, cache), args.port + i, args.host, extra, backend),
            env={**env, **server_gpus(args.gpus, i)},
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        for i, (s, log) in enumerate(zip(sources, logs))
    ]
    stop = lambda *_: [p.terminate() for p in processes]  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    try:
        wait_until_up(urls, processes, logs, args.timeout)
        listing = ", ".join(urls)
        print(f"serving {len(urls)} weight set(s): vllm_server_urls: [{listing}]", flush=True)
        print(f"  the servers' logs: {logs[0].parent}", flush=True)
        print(
            "  fit with: --model.init_args.generation_backend vllm --model.init_args.vllm_mode server "
            f"--model.init_args.vllm_server_urls '[{listing}]'",
            flush=True,
        )
        for process in processes:
            process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop()
        for process in processes:
            process.wait(timeout=60)
