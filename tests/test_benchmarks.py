"""The GPU check runs rarely (a GPU is lent to few sessions, for minutes): its CPU smoke mode runs here, so that the
script itself works when one is lent (benchmarks/README.md, "GPU check")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_passes_its_smoke_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
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
    monkeypatch.setattr(
        "sys.argv",
        [
            "bench_products.py",
            "--model",
            "tiny",
            "--rows",
            "1",
            "4",
            "--repeats",
            "1",
            "--json",
            str(out),
            "--threads",
            str(torch.get_num_threads()),
        ],
    )
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
        reports = [
            bench_checkpoint.worker(
                bench_checkpoint.parse_args(["--worker", way, "--model", "tiny", "--dir", str(tmp_path)])
            )
            for way in bench_checkpoint.WAYS
        ]
    finally:
        torch.set_num_threads(threads)
    assert [r["way"] for r in reports] == ["lightning", "file"]
    assert reports[0]["bytes"] == reports[1]["bytes"] > 0 and all(r["seconds"] > 0 for r in reports)
    assert not any(tmp_path.iterdir())  # each save's folder is removed


def test_the_environment_benchmark_writes_its_table_json_and_png(tmp_path, monkeypatch):
    """``environments.py --tiny --updates 1`` on one env (TL;DR, from its shipped config through the CLI), in this
    process: a table row, the JSON's before/after and curve, the PNG; an env whose config does not exist is
    skipped with its reason in the table."""
    if not (REPO.parent / "shared" / "data" / "tldr").is_dir():
        import pytest

        pytest.skip("the TL;DR config reads ../shared/data/tldr (the benchmark data; see docs/environments.md)")
    import torch

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import environments

    monkeypatch.setitem(environments.ENVS, "missing", environments.Env("no_such_config.yaml", 8, []))
    threads = torch.get_num_threads()
    try:
        environments.main(
            [
                "--tiny",
                "--only",
                "tldr,missing",
                "--seeds",
                "0",
                "--updates",
                "1",
                "--every",
                "0",
                "--max-new-tokens",
                "4",
                "--held-out",
                "2",
                "--eval-batch",
                "2",
                "--no-isolate",
                "--out",
                str(tmp_path),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "environments.json").read_text())
    tldr, missing = report["rows"]
    assert report["complete"] and report["updates"] == 1 and report["seeds"] == [0]
    assert missing["skipped"] and "no_such_config.yaml" in missing["note"]
    assert tldr["env"] == "tldr" and tldr["reward_range"] == [0.0, 3.0] and tldr["updates"] == "1"
    (run,) = tldr["runs"]
    assert run["settings"]["tokens"] == 4 and run["settings"]["model"] == "tiny"
    assert [step for step, _ in run["curve"]] == [0, 1]
    assert run["before"] == run["curve"][0][1] and run["after"] == run["curve"][1][1]
    assert 0.0 <= run["before"] <= 3.0 and "eval/turn_1/level_1_pass_rate" in run["evaluations"][0][1]
    assert "turn_1/level_1_pass_rate" in tldr["credit"] and run["train_curve"]["turn_1"]
    table = (tmp_path / "environments.md").read_text()
    assert "| tldr | [0, 3] |" in table and "| missing |" in table and "no_such_config.yaml" in table
    assert (tmp_path / "environments.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_async_benchmark_times_both_modes_from_real_servers(tmp_path):
    """``bench_async.py`` (also the GPU check's server and one-step-off rows, there with ``--device cuda``) on the
    quick start, two updates per mode: the servers start, both fits run, the one-step-off fit's policy lag is 1 after
    its first update and the synchronous one's 0."""
    from test_vllm import PROBLEM

    if PROBLEM is not None:
        pytest.skip(PROBLEM)
    out = tmp_path / "async.json"
    command = [sys.executable, str(REPO / "benchmarks" / "bench_async.py"), "--configs", "configs/quickstart.yaml"]
    done = subprocess.run(
        [*command, "--steps", "3", "--repeats", "1", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COMLRL_LIGHTNING_CACHE": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["servers"] == 2 and row["sync_seconds_per_update"] > 0 and row["one_step_off_seconds_per_update"] > 0
    assert [r["policy_lag"] for r in row["runs"]["0"]] == [[0.0, 0.0, 0.0]]
    assert [r["policy_lag"] for r in row["runs"]["1"]] == [[0.0, 1.0, 1.0]]
