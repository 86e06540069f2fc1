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


def test_the_products_benchmark_times_every_form_it_names(tmp_path, monkeypatch, capsys):
    """``bench_products.py`` on the tiny model: one row per form and row count, each with a time, its ratio to
    ``F.linear`` and its fraction of the bandwidth limit (fp16 weights where this build and CPU pack them). It runs
    in this process (its imports are this process's; nothing it sets outlives it but torch's thread count, 1 here)."""
    import runpy

    import torch

    from comlrl_lightning.rollout.backends import hf_copies as generation

    out = tmp_path / "products.json"
    monkeypatch.setattr("sys.argv", ["bench_products.py", "--model", "tiny", "--rows", "1", "4", "--repeats", "1",
                                     "--json", str(out), "--threads", str(torch.get_num_threads())])
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    runpy.run_path(str(REPO / "benchmarks" / "bench_products.py"), run_name="__main__")
    assert "of the bandwidth limit" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    forms = {"linear", "columns"} | ({"fp16"} if generation.packing_works(generation.FP16_WEIGHTS) else set())
    assert {(r["rows"], r["form"]) for r in results} == {(n, f) for n in (1, 4) for f in forms}
    assert all(r["ms"] > 0 and r["fraction_of_limit"] > 0 for r in results)
    assert all(r["of_linear"] == 1.0 for r in results if r["form"] == "linear")


def test_the_checkpoint_benchmark_writes_the_same_checkpoint_both_ways(tmp_path, monkeypatch):
    """``bench_checkpoint.py``'s worker on a tiny team, in this process: each way writes the team's checkpoint (weights
    and AdamW's moments) and reports its time, size and peak-memory growth; the sizes agree."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_checkpoint

    threads = torch.get_num_threads()
    try:
        reports = [bench_checkpoint.worker(bench_checkpoint.parse_args(["--worker", way, "--model", "tiny",
                                                                        "--dir", str(tmp_path)]))
                   for way in bench_checkpoint.WAYS]
    finally:
        torch.set_num_threads(threads)
    assert [r["way"] for r in reports] == ["lightning", "file"]
    assert reports[0]["bytes"] == reports[1]["bytes"] > 0 and all(r["seconds"] > 0 for r in reports)
    assert not any(tmp_path.iterdir())  # each save's folder is removed
