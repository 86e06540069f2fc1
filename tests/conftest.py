import os
import socket

import pytest

# Never reach the network from tests: a hub lookup hangs ~50 s before failing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads, and on a shared CPU OpenMP's waiting threads cost ~10x (measured:
# tests/test_compat.py + test_madpo.py 9 s with one thread, 133 s with two on a loaded 2-core machine). Child
# processes (DDP ranks, notebook kernels) inherit the variable; set it to use more.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The files that take longest, slowest first (summed test time on 2 cores, 2026-12-02: 329, 111, 94, 77, 67, 58 s;
# most start processes: DDP ranks, CLI runs, notebook kernels). `make test` hands whole files to its workers in
# collection order, so these go first and the short files fill in around them; a long file started last would run on
# alone.
LONGEST_FIRST = (
    "test_scale_out.py",
    "test_learning.py",
    "test_stop_signals.py",  # 99 s: four CLI runs in processes of their own, each resumed
    "test_bad_configs.py",
    "test_notebooks.py",
    "test_configs.py",
    "test_cli.py",
    "test_run_record.py",
    "test_readme.py",
)  # the last two: 60, 35 s


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def tcp_server():
    """A listening TCP socket on 127.0.0.1 (accept times out after 0.3 s) and its port."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.3)
    try:
        yield server, server.getsockname()[1]
    finally:
        server.close()
