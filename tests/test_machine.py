"""A run on a machine it shares: cores busy with other processes (fewer intra-op threads, said in one line) and a disk
that fills up (the checkpoint's space checked first, the previous checkpoint kept, the weights' whereabouts named)."""

from __future__ import annotations

import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from comlrl_lightning import cpu_threads
from comlrl_lightning.callbacks import checkpoints
from comlrl_lightning.callbacks.checkpoints import CheckpointNotWritten, FileCheckpointIO, checkpoint_bytes

REPO = Path(__file__).resolve().parents[1]
Usage = namedtuple("Usage", "total used free")


# ----------------------------------------------------------------------------------------------- cores in use
@pytest.mark.parametrize(
    "threads,cores,busy,expected",
    [
        (2, 2, 0.1, None),  # an idle machine: torch's own number
        (2, 2, 0.4, None),  # 1.6 cores free: two threads within half a core of them
        (2, 2, 0.6, 1),  # 1.4 free: the second thread would wait for a core
        (2, 2, 1.0, 1),  # one core taken (a single-thread job)
        (2, 2, 2.0, 1),  # both taken (a 2-thread torch job): never below one thread
        (16, 16, 4.0, 12),
        (4, 16, 10.0, None),  # fewer threads than free cores already
        (1, 2, 2.0, None),
    ],
)
def test_threads_for_gives_one_thread_per_free_core(threads, cores, busy, expected):
    assert cpu_threads.threads_for(threads, cores, busy) == expected


def test_busy_cores_counts_the_affinity_cores_busy_ticks_over_the_interval():
    # /proc/stat: user nice system idle iowait irq softirq steal; cpu2 is not this process's core
    samples = iter(
        [
            "cpu  0 0 0 0 0 0 0 0\ncpu0 100 0 0 100 0 0 0 0\ncpu1 50 0 0 50 0 0 0 0\ncpu2 0 0 0 0 0 0 0 0\n",
            "cpu  0 0 0 0 0 0 0 0\ncpu0 130 0 10 130 30 0 0 0\ncpu1 140 0 10 50 0 0 0 0\ncpu2 9 0 0 0 0 0 0 0\n",
        ]
    )
    slept = []
    busy = cpu_threads.busy_cores([0, 1], seconds=0.2, read=lambda: next(samples), sleep=slept.append)
    # cpu0: 40 busy of 100 ticks (idle and iowait are not busy); cpu1: 100 of 100
    assert busy == pytest.approx(0.4 + 1.0) and slept == [0.2]


def test_a_cpu_run_on_busy_cores_runs_fewer_threads_and_names_the_setting(monkeypatch):
    lines, threads = [], torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda cpus: 1.9)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the run's own choice: left alone
        monkeypatch.setattr(cpu_threads, "_decided", [])
        torch.set_num_threads(2)
        assert cpu_threads.fit_threads_to_free_cores(lines.append) is None and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(cpu_threads, "_decided", [])
        assert cpu_threads.fit_threads_to_free_cores(lines.append) == 1 and torch.get_num_threads() == 1
        assert len(lines) == 1 and "1.9 of this run's 2 cores are busy" in lines[0], lines
        assert "OMP_NUM_THREADS=2 keeps 2" in lines[0], lines
        torch.set_num_threads(2)
        assert cpu_threads.fit_threads_to_free_cores(lines.append) is None  # once per process
        assert torch.get_num_threads() == 2 and len(lines) == 1
    finally:
        torch.set_num_threads(threads)


def test_vllm_servers_on_this_machine_count_as_busy_cores(monkeypatch):
    """Idle when the run starts, a local server samples while the run trains: each counts as one busy core."""
    lines, threads = [], torch.get_num_threads()
    here = ["http://127.0.0.1:8000", "http://localhost:8001", "http://127.0.0.1:8000", "http://gpu-node-7:8000"]
    assert cpu_threads.local_servers(here) == 2  # the same URL once; another host is not here
    assert cpu_threads.local_servers(["http://127.0.1.1:8000"]) == 1  # any loopback address
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda cpus: 0.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(cpu_threads, "_decided", [])
        assert cpu_threads.fit_threads_to_free_cores(lines.append) is None  # free cores: left alone
        monkeypatch.setattr(cpu_threads, "_decided", [])
        assert cpu_threads.fit_threads_to_free_cores(lines.append, servers=2) == 1 and torch.get_num_threads() == 1
        assert "and 2 vLLM servers on this machine sample" in lines[0], lines
    finally:
        torch.set_num_threads(threads)


def test_runs_on_cpu_follows_the_accelerator():
    assert cpu_threads.runs_on_cpu("cpu") and not cpu_threads.runs_on_cpu("gpu")
    assert cpu_threads.runs_on_cpu("auto") == (not torch.cuda.is_available() and not torch.backends.mps.is_available())


# ----------------------------------------------------------------------------------------------- a full disk
def test_checkpoint_bytes_counts_each_storage_once():
    weights = torch.zeros(1000)  # 4,000 bytes
    state = {"a": weights, "b": [weights[:10], (torch.zeros(50, dtype=torch.float64),)], "n": 3}  # a view: same storage
    assert checkpoint_bytes(state) == 4000 + 400


def test_a_full_disk_is_found_before_a_byte_is_written(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "epoch=0-step=1.ckpt"
    FileCheckpointIO().save_checkpoint({"step": 1}, path)
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda folder: Usage(10**9, 10**9 - 500_000, 500_000))
    monkeypatch.setattr(torch, "save", lambda *a, **k: pytest.fail("torch.save ran on a full disk"))
    with pytest.raises(CheckpointNotWritten) as error:
        FileCheckpointIO().save_checkpoint({"step": 2, "w": torch.zeros(1_000_000)}, path)  # 4 MB + 1 MiB margin
    assert str(error.value) == (
        f"checkpoint {path} not written: {path.parent} has 500 kB free, the checkpoint needs 5.0 MB"
    )
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert torch.load(path)["step"] == 1


def test_a_checkpoint_that_cannot_be_written_keeps_the_previous_one_and_says_where_the_weights_are(
    tmp_path, monkeypatch, capsys
):
    from comlrl_lightning.cli import main

    save, writes = torch.save, []

    def disk_full_at_the_second_checkpoint(obj, f, *args, **kwargs):
        if ".partial-" in str(getattr(f, "name", "")):
            writes.append(f.name)
            if len(writes) == 2:
                f.write(b"PK\x03\x04 half a checkpoint")
                raise RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_the_second_checkpoint)
    monkeypatch.setattr(checkpoints, "at_terminal", lambda: True)  # someone is there to answer the offer
    monkeypatch.setattr("builtins.input", lambda prompt: str(tmp_path / "elsewhere"))
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                str(REPO / "configs" / "quickstart.yaml"),
                "--trainer.max_steps=2",
                "--checkpoint_every_n_updates=1",
                "--trainer.enable_progress_bar=false",
                "--model.init_args.max_new_tokens=4",
                "--trainer.default_root_dir",
                str(tmp_path / "run"),
            ]
        )
    err = capsys.readouterr().err
    folder = tmp_path / "run" / "quickstart" / "version_0" / "checkpoints"
    previous = folder / "epoch=0-step=1.ckpt"
    assert exit_info.value.code == 1 and "Traceback" not in err and err.count("error:") == 1, err
    line = next(line for line in err.splitlines() if line.startswith("error:"))
    assert f"checkpoint {folder / 'epoch=0-step=2.ckpt'} not written (" in line, line
    assert f"{folder} has " in line and " free, the checkpoint needs " in line, line  # the folder, the space
    assert f"the previous checkpoint {previous} (update 1) is kept" in line, line  # where the weights are
    assert "weights after update 2 are only in memory" in line and "save_pretrained" in line, line
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]  # nothing partial
    assert (folder / "last.ckpt").resolve() == previous and torch.load(previous, weights_only=False)["global_step"] == 1
    # the offer, accepted: the agents after update 2, in HF format, in the folder given
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["agent_0", "agent_1"]
    assert (tmp_path / "elsewhere" / "agent_0" / "config.json").is_file()
