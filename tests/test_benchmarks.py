"""The GPU check runs rarely (a GPU is lent to few sessions, for minutes): its CPU smoke mode runs here, so that the
script itself works when one is lent (benchmarks/README.md, "GPU check")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_passes_its_smoke_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads(out.read_text())
    for check in ("magrpo", "fsdp", "lora", "shared_prefix"):
        assert report[check]["pass"], (check, report[check])
    assert report["shared_prefix"]["float32"]["rows_identical"] == 1.0, report["shared_prefix"]
    assert report["shared_prefix"]["float32"]["max_logprob_gap"] < 1e-4
    assert {row["dtype"] for row in report["throughput"]} == {"bfloat16", "float32"}
