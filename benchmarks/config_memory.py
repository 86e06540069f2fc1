"""Peak resident memory of every shipped config for a short run: each config's own model (the embedded SmolLM2),
its own prompts and data, ``--steps`` updates with completions capped at ``--max-new-tokens``, evaluation off.

    python benchmarks/config_memory.py                          # every config in configs/
    python benchmarks/config_memory.py --configs configs/travel_magrpo.yaml --max-new-tokens 24

Each config runs in its own process (``python -m comlrl_lightning fit``); its peak RSS is the kernel's
``ru_maxrss`` of that process. A run whose RSS passes ``--kill-gb`` is stopped (reported as ``killed``) so the
machine never reaches the OOM killer. A config with an API comparator talks to a loopback stand-in server. Results go to ``benchmarks/results/config_memory.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _Comparator(BaseHTTPRequestHandler):
    """A loopback stand-in for an OpenAI-compatible comparator endpoint (configs with comparator_api_url)."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        choices = [
            {"index": j, "message": {"role": "assistant", "content": "A short answer."}, "finish_reason": "stop"}
            for j in range(int(body.get("n", 1)))
        ]
        data = json.dumps({"choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def api_stand_in(config: Path) -> tuple[list[str], ThreadingHTTPServer | None]:
    if "comparator_api_url" not in config.read_text():
        return [], None
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Comparator)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
    return [f"--model.init_args.comparator_api_url={url}"], server


def run_config(config: Path, steps: int, max_new_tokens: int, kill_bytes: int, extra: list[str]) -> dict:
    api_flags, server = api_stand_in(config)
    try:
        return _run(config, steps, max_new_tokens, kill_bytes, [*api_flags, *extra])
    finally:
        if server is not None:
            server.shutdown()


def _run(config: Path, steps: int, max_new_tokens: int, kill_bytes: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as root:
        cmd = [
            sys.executable,
            "-m",
            "comlrl_lightning",
            "fit",
            "--config",
            str(config),
            f"--trainer.max_steps={steps}",
            f"--trainer.default_root_dir={root}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false",
            f"--model.init_args.max_new_tokens={max_new_tokens}",
            "--model.init_args.eval_interval=0",
            "--data.init_args.max_train_items=8",
            *extra,
        ]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "offline",
            "TOKENIZERS_PARALLELISM": "false",
            "COMPARATOR_API_KEY": os.environ.get("COMPARATOR_API_KEY", "stand-in"),
        }
        start = time.monotonic()
        with open(Path(root) / "log.txt", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            killed = False
            while True:  # reap it ourselves: wait4 gives this child's own peak RSS
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if rss_bytes(proc.pid) > kill_bytes:
                    proc.kill()
                    killed = True
                time.sleep(0.2)
            proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - start
        tail = (Path(root) / "log.txt").read_text(errors="replace").strip().splitlines()[-3:]
        return {
            "config": config.name,
            "returncode": proc.returncode,
            "killed": killed,
            "seconds": round(seconds, 1),
            "peak_rss_gb": round(usage.ru_maxrss * 1024 / 2**30, 2),
            "log_tail": tail,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", type=Path, default=sorted((REPO / "configs").glob("*.yaml")))
    parser.add_argument("--steps", type=int, default=2, help="updates per run")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--kill-gb", type=float, default=20.0, help="stop a run whose RSS passes this")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "config_memory.json")
    parser.add_argument("extra", nargs="*", help="more CLI flags for every run (after --)")
    args = parser.parse_args()
    rows = []
    for config in args.configs:
        row = run_config(config, args.steps, args.max_new_tokens, int(args.kill_gb * 2**30), args.extra)
        rows.append(row)
        status = "killed" if row["killed"] else ("ok" if row["returncode"] == 0 else f"exit {row['returncode']}")
        print(f"{row['config']:36s} {status:8s} peak {row['peak_rss_gb']} GB  {row['seconds']} s", flush=True)
        if status != "ok":
            print("   " + "\n   ".join(row["log_tail"]), flush=True)
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "steps": args.steps,
        "max_new_tokens": args.max_new_tokens,
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
