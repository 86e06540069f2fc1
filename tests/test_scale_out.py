"""Data-parallel training on Lightning's DDP strategy: two processes on CPU (gloo), launched as a user launches
them (``python -m comlrl_lightning fit --trainer.strategy ddp --trainer.devices 2``), and a two-"node" run on one
machine. Each rank's ``ddp_probe.Probe`` records what it trained on and a digest of its weights after every step.

What must hold (docs/scaling.md): the ranks hold identical weights after every update; the union of the items
the ranks saw is the epoch, none twice; logged metrics are the mean of the ranks' own values; ``env_step`` counts
every rank's joint actions; run files are written once; a resumed run continues exactly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_iterative_api import server  # noqa: F401  (the loopback comparator API)

from comlrl_lightning.data.tasks import EpochSampler, ShardedBatches
from comlrl_lightning.runs import ranks

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--model.init_args.agents",
    "tiny",
    "--model.init_args.max_new_tokens",
    "4",
    "--model.init_args.use_chat_template",
    "false",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.accelerator",
    "cpu",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FSDP = [
    "--trainer.strategy",
    "lightning.pytorch.strategies.ModelParallelStrategy",
    "--trainer.strategy.init_args.data_parallel_size",
    "2",
    "--trainer.strategy.init_args.tensor_parallel_size",
    "1",
]


def launch(
    tmp_path: Path,
    config: str,
    *args: str,
    devices: int = 2,
    env: dict | None = None,
    strategy: tuple[str, ...] = ("--trainer.strategy", "ddp"),
) -> subprocess.Popen:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "comlrl_lightning",
            "fit",
            "--config",
            str(REPO / "configs" / f"{config}.yaml"),
            *TINY,
            *strategy,
            "--trainer.devices",
            str(devices),
            "--trainer.callbacks+=ddp_probe.Probe",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            *args,
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO / "tests"),
            "PROBE_DIR": str(tmp_path / "probe"),
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            **(env or {}),
        },
    )


def ddp_fit(
    tmp_path: Path, config: str, *args: str, world: int = 2, fsdp: bool = False, export: bool = False
) -> list[dict]:
    """Run a 2-process fit (DDP, or models sharded with FSDP2); the probes of its ranks. ``export``: every rank
    calls the module's ``save_pretrained(tmp_path / "export")`` when the fit ends."""
    env = {"EXPORT_DIR": str(tmp_path / "export")} if export else None
    process = launch(tmp_path, config, *args, devices=world, env=env, **({"strategy": tuple(FSDP)} if fsdp else {}))
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    return probes(tmp_path, world)


def probes(tmp_path: Path, world: int) -> list[dict]:
    return [json.loads((tmp_path / "probe" / f"rank_{r}.json").read_text()) for r in range(world)]


def assert_same_weights_after_every_step(probes: list[dict]) -> None:
    steps = [p["steps"] for p in probes]
    assert len({len(s) for s in steps}) == 1, "the ranks made different numbers of steps"
    for at_step in zip(*steps):
        assert len({s["digest"] for s in at_step}) == 1, f"weights differ at step {at_step[0]['global_step']}"
        assert len({s["global_step"] for s in at_step}) == 1
        assert len({s["env_step"] for s in at_step}) == 1, "env_step differs across ranks"
    assert len({p["final_digest"] for p in probes}) == 1


def assert_epoch_covered_once(probes: list[dict], expected: list[str]) -> None:
    seen = [key for p in probes for batch in p["items"] for key in batch]
    assert sorted(seen) == sorted(expected), "the ranks' items are not the epoch exactly once"


# ----------------------------------------------------------------------------------------------- sharding (1 process)
def test_sharded_batches_split_every_global_batch_evenly_and_cover_the_epoch_once():
    for size, batch, world in [(9, 2, 2), (10, 2, 2), (7, 3, 3), (5, 4, 2), (1, 1, 2)]:
        order = EpochSampler(size, shuffle=True, seed=1).order()
        per_rank = [list(ShardedBatches(size, batch, True, 1, num_replicas=world, rank=r)) for r in range(world)]
        assert len({len(b) for b in per_rank}) == 1, "every rank must make the same number of steps"
        assert all(len(b) == len(ShardedBatches(size, batch, True, 1, num_replicas=world)) for b in per_rank)
        for step in zip(*per_rank):  # global batch = the ranks' parts in rank order, the epoch's order
            assert max(map(len, step)) - min(map(len, step)) <= 1 and all(len(b) <= batch for b in step)
        assert [i for step in zip(*per_rank) for part in step for i in part] == order


def test_one_process_batches_are_a_plain_loaders():
    sampler = ShardedBatches(7, 3, shuffle=False, seed=0)
    assert list(sampler) == [[0, 1, 2], [3, 4, 5], [6]] and len(sampler) == 3
    sampler.skip = 1  # resumed after one batch
    assert list(sampler) == [[3, 4, 5], [6]] and list(sampler) == [[0, 1, 2], [3, 4, 5], [6]]


def test_collectives_are_the_identity_in_one_process():
    assert not ranks.active() and ranks.rank() == 0 and ranks.world_size() == 1
    assert ranks.gather({"a": 1}) == [{"a": 1}] and ranks.broadcast(3) == 3
    assert ranks.reduce_sum([1.0, 2.0]) == [1.0, 2.0] and ranks.mean_of_ranks({"x": 2.0}) == {"x": 2.0}
    assert ranks.shard(list(range(5)), 1, 2) == [3, 4] and ranks.shard([1], 1, 2) == []
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    assert ranks.average_gradients([p], rows=4) == 4 and torch.equal(p.grad, torch.full((2,), 3.0))


def test_strategies_that_cannot_train_a_team_are_refused_with_the_fields_named():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from comlrl_lightning.algorithms.team import check_strategy
    from comlrl_lightning.config_errors import ConfigurationError

    def module(
        parallel="none",
        lora=None,
        name="MAGRPO",
        generation_dtype="model",
        backend="hf",
        sleep=False,
        devices=None,
        mode="colocate",
    ):
        return SimpleNamespace(
            vllm_mode=mode,
            parallel_training=parallel,
            lora=lora,
            algorithm_name=name,
            generation_dtype=generation_dtype,
            generation_backend=backend,
            vllm_enable_sleep_mode=sleep,
            team=SimpleNamespace(devices=devices),
        )

    with pytest.raises(ConfigurationError, match="trainer.strategy FSDPStrategy is not supported.*ModelParallel"):
        check_strategy(SimpleNamespace(strategy=FSDPStrategy(), world_size=2), module())
    with pytest.raises(ConfigurationError, match="parallel_training='mp'.*trainer.devices x trainer.num_nodes"):
        check_strategy(SimpleNamespace(strategy=DDPStrategy(), world_size=2), module("mp"))
    check_strategy(SimpleNamespace(strategy=DDPStrategy(), world_size=2), module())
    with pytest.raises(ConfigurationError, match="agent_devices/critic_devices without parallel_training: mp"):
        check_strategy(SimpleNamespace(strategy=DDPStrategy(), world_size=2), module(devices=["cpu"]))
    check_strategy(SimpleNamespace(strategy=DDPStrategy(), world_size=1), module("mp"))
    sharded = SimpleNamespace(
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), world_size=2
    )
    check_strategy(sharded, module())
    with pytest.raises(ConfigurationError, match="with a LoRA team"):
        check_strategy(sharded, module(lora={"base": "tiny"}))
    with pytest.raises(
        ConfigurationError, match="generation_backend: vllm with trainer.strategy ModelParallelStrategy"
    ):
        check_strategy(sharded, module(backend="vllm"))
    check_strategy(sharded, module(backend="vllm", mode="server"))  # rank 0 sends the gathered weights
    with pytest.raises(ConfigurationError, match="vllm_enable_sleep_mode: true needs a GPU"):
        check_strategy(SimpleNamespace(strategy=DDPStrategy(), world_size=1), module(backend="vllm", sleep=True))
    nccl = module(backend="vllm", mode="server")
    nccl.vllm_server_weight_transfer = "nccl"
    with pytest.raises(ConfigurationError, match="vllm_server_weight_transfer: nccl broadcasts the weights from the"):
        check_strategy(SimpleNamespace(strategy=DDPStrategy(), world_size=1), nccl)
    with pytest.raises(ConfigurationError, match="generation_dtype 'bfloat16' with trainer.strategy ModelParallel"):
        check_strategy(sharded, module(generation_dtype="bfloat16"))
    check_strategy(SimpleNamespace(strategy=DDPStrategy(), world_size=2), module(generation_dtype="bfloat16"))
    with pytest.raises(ConfigurationError, match="tensor_parallel_size must be 1"):
        check_strategy(
            SimpleNamespace(strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), world_size=2),
            module(),
        )


# ----------------------------------------------------------------------------------------------- 2 processes (gloo)
# A launch costs ~20 s on 2 cores (each rank imports torch, transformers and Lightning), so a run two tests read is
# launched once per module: the DDP runs the FSDP tests compare against are the plain DDP tests' runs.

# 9 items, 2 per rank and step: global batches of 4, 4 and 1 — rank 1's share of the last one is empty.
QUICKSTART_9 = [
    "--data.init_args.max_train_items",
    "9",
    "--model.init_args.max_grad_norm",
    "1.0",
    "--model.init_args.eval_interval",
    "2",
    "--model.init_args.eval_num_samples",
    "3",
    "--trainer.max_epochs",
    "1",
    "--trainer.max_steps",
    "-1",
]
# IAC with a critic LM per agent, evaluated after every update; every rank calls save_pretrained as the fit ends.
IAC_CRITICS = [
    "--data.init_args.max_train_items",
    "4",
    "--trainer.max_epochs",
    "1",
    "--trainer.max_steps",
    "-1",
    "--model.init_args.eval_interval",
    "1",
    "--model.init_args.max_grad_norm",
    "1.0",
    "--model.init_args.use_separate_critic",
    "true",
    "--model.init_args.critic_model",
    "tiny",
]


@pytest.fixture(scope="module")
def quickstart_ddp(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("quickstart_ddp")
    return root, ddp_fit(root, "quickstart", *QUICKSTART_9)


@pytest.fixture(scope="module")
def iac_ddp(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("iac_ddp")
    return root, ddp_fit(root, "iac", *IAC_CRITICS, export=True)


def test_magrpo_on_two_processes(quickstart_ddp):
    tmp_path, probes = quickstart_ddp
    from comlrl_lightning.envs.toy import story_tasks

    assert_same_weights_after_every_step(probes)
    assert_epoch_covered_once(probes, [json.dumps(x, sort_keys=True) for x in story_tasks()[:9]])
    assert [len(b) for b in probes[1]["items"]] == [2, 2, 0]
    for at_step in zip(*(p["steps"] for p in probes)):
        local = [s["local_reward_mean"] for s in at_step if s["batch_size"]]
        logged = at_step[0]["logged"]["rollout/turn_1/reward_mean"]
        assert logged == pytest.approx(sum(local) / len(local), rel=1e-6), "the logged reward is not global"
    # env_step: 9 items x K=4 joint actions, over both ranks
    assert probes[0]["steps"][-1]["env_step"] == 9 * 4
    lines = (tmp_path / "run" / "quickstart" / "version_0" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    evals = [row.split(",")[header.index("eval/turn_1/reward_mean")] for row in lines[1:]]
    assert any(evals), "evaluation metrics were not logged"
    assert not list((tmp_path / "run").glob("quickstart/version_1")), "a second rank wrote its own log directory"


def test_iac_on_two_processes(iac_ddp):
    _, probes = iac_ddp
    assert_same_weights_after_every_step(probes)
    from comlrl_lightning.envs.toy import story_tasks

    assert_epoch_covered_once(probes, [json.dumps(x, sort_keys=True) for x in story_tasks()[:4]])


def test_madpo_collects_a_share_per_rank_and_trains_on_every_pair_once_per_epoch(tmp_path):
    pairs_file = tmp_path / "pairs.json"
    probes = ddp_fit(
        tmp_path,
        "madpo",
        "--data.init_args.max_train_items",
        "6",
        "--trainer.max_epochs",
        "1",
        "--model.init_args.eval_interval",
        "0",
        "--data.init_args.pairs_file",
        str(pairs_file),
        "--model.init_args.train_batch_size",
        "2",
    )
    assert_same_weights_after_every_step(probes)
    written = json.loads(pairs_file.read_text())
    keys = [json.dumps([p["prompts"], p["winner_completions"], p["loser_completions"]]) for p in written["pairs"]]
    assert written["num_pairs"] > 0
    assert_epoch_covered_once(probes, keys)
    assert not list(tmp_path.glob("*.tmp*")), "an interrupted or duplicate write was left behind"


def test_madpo_iter_writes_each_replay_shard_once_and_every_rank_reads_it(tmp_path):
    probes = ddp_fit(
        tmp_path,
        "madpo_iter",
        "--data.init_args.max_train_items",
        "4",
        "--model.init_args.eval_interval",
        "0",
        "--model.init_args.preference_num_candidates",
        "2",
        "--model.init_args.dpo_epochs_per_round",
        "1",
        "--model.init_args.log_reward_distribution",
        "true",
    )
    assert_same_weights_after_every_step(probes)
    root = tmp_path / "run" / "madpo_iter" / "version_0"
    shards = sorted(p.name for p in (root / "preference_replay").iterdir())
    assert shards == ["iteration_0001.json", "iteration_0002.json"], shards
    assert sorted(p.name for p in (root / "reward_distributions").glob("*.json")) == shards
    assert not list(tmp_path.glob("run/**/*.tmp*"))
    assert (root / "policy_checkpoints" / "initial" / "agent_0").is_dir()


# The run's checkpoints every 2 updates, all kept (the default keeps the newest only): a run resumes from the
# checkpoint its own step 2 wrote, mid-run, as after a crash.
KEEP_EVERY_2 = [
    "--trainer.callbacks+=comlrl_lightning.callbacks.checkpoints.RunCheckpoints",
    "--trainer.callbacks.every_n_updates",
    "2",
    "--trainer.callbacks.save_top_k",
    "-1",
]
QUICKSTART_16 = [
    "--data.init_args.max_train_items",
    "16",
    "--trainer.max_steps",
    "4",
    "--model.init_args.eval_interval",
    "0",
]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> tuple[Path, list[dict]]:
    """``num_nodes=2``, one process per node, node ranks 0 and 1 — the multi-node path of Lightning's launcher — on
    one machine: 16 items in 4 global batches of 4, a checkpoint every 2 updates."""
    tmp_path = tmp_path_factory.mktemp("two_nodes")
    port = str(free_port())
    nodes = [
        launch(
            tmp_path,
            "quickstart",
            *QUICKSTART_16,
            *KEEP_EVERY_2,
            "--trainer.num_nodes",
            "2",
            devices=1,
            env={"NODE_RANK": str(n), "MASTER_PORT": port},
        )
        for n in (0, 1)
    ]
    for node in nodes:
        output, _ = node.communicate(timeout=600)
        assert node.returncode == 0, output[-4000:]
    return tmp_path, probes(tmp_path, 2)


def test_two_nodes_on_one_machine(two_nodes):
    _, probes_ = two_nodes
    assert [p["world_size"] for p in probes_] == [2, 2]
    assert_same_weights_after_every_step(probes_)
    from comlrl_lightning.envs.toy import story_tasks

    assert_epoch_covered_once(probes_, [json.dumps(x, sort_keys=True) for x in story_tasks()[:16]])


def test_a_two_process_run_resumes_exactly(tmp_path, two_nodes, monkeypatch):
    """The two-node run's step-2 checkpoint resumes on one node with two processes (the same world), then on one
    process."""
    common = QUICKSTART_16
    full_dir, full = two_nodes
    step2 = next((full_dir / "run" / "quickstart" / "version_0" / "checkpoints").glob("*step=2.ckpt"))
    resumed = ddp_fit(tmp_path / "resumed", "quickstart", *common, "--ckpt_path", str(step2))
    assert_same_weights_after_every_step(resumed)
    assert resumed[0]["final_digest"] == full[0]["final_digest"], "the resumed run diverged from the full one"
    assert [s["digest"] for s in resumed[0]["steps"]] == [s["digest"] for s in full[0]["steps"][2:]]
    # On one process instead, a plain run (docs/scaling.md: the data position moves to the same item, the buffers
    # are kept). It runs in this process: a launch would add ~10 s of imports, and no process group is started.
    from comlrl_lightning.cli import main

    monkeypatch.setenv("PROBE_DIR", str(tmp_path / "single" / "probe"))
    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            *TINY,
            *common,
            "--ckpt_path",
            str(step2),
            "--trainer.callbacks+=ddp_probe.Probe",
            "--trainer.default_root_dir",
            str(tmp_path / "single" / "run"),
        ]
    )
    assert not ranks.active()
    single = probes(tmp_path / "single", 1)
    assert [s["global_step"] for s in single[0]["steps"]] == [3, 4]
    assert single[0]["steps"][0]["env_step"] == full[0]["steps"][1]["env_step"] + 2 * 4  # 2 items x K=4
    # its two steps train on the items of the two-process run's third global batch
    assert sorted(k for b in single[0]["items"] for k in b) == sorted(full[0]["items"][2] + full[1]["items"][2])


def test_api_comparator_requests_are_split_across_ranks_never_sent_twice(tmp_path, server):  # noqa: F811
    """MADPOIter against the loopback comparator API on two processes: every task's comparator request is sent by
    exactly one rank, once per round and role."""
    from comlrl_lightning.envs.toy import story_tasks

    process = launch(
        tmp_path,
        "madpo_iter_api",
        "--model.init_args.comparator_api_url",
        server.url,
        "--model.init_args.num_iterations",
        "2",
        "--data.init_args.max_train_items",
        "4",
        "--data.init_args.prompts_per_step",
        "2",
        "--model.init_args.eval_interval",
        "0",
        "--model.init_args.comparator_api_max_concurrency",
        "1",
        env={"COMPARATOR_API_KEY": "not-a-real-key"},
    )
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    assert_same_weights_after_every_step(probes(tmp_path, 2))
    bodies = [json.dumps(r) for r in server.requests]
    for task in story_tasks()[:4]:
        sent = sum(task["topic"] in body for body in bodies)
        assert sent == 2 * 2, f"{task['topic']!r}: {sent} comparator requests, expected 2 rounds x 2 roles"
    assert len(bodies) == 4 * 2 * 2


def test_fsdp_shards_the_agents_trains_as_ddp_does_and_resumes_exactly(tmp_path, quickstart_ddp):
    """Agents sharded over 2 ranks (FSDP2 through Lightning's ModelParallelStrategy, gloo): the same gradients as
    DDP (gradient norms agree), the last global batch leaves rank 1 an empty share, evaluation runs, and a sharded
    checkpoint (a directory) resumes exactly."""
    common = QUICKSTART_9
    sharded = ddp_fit(tmp_path / "fsdp", "quickstart", *common, *KEEP_EVERY_2, fsdp=True)
    _, replicated = quickstart_ddp
    assert_same_weights_after_every_step(sharded)
    assert [len(b) for b in sharded[1]["items"]] == [2, 2, 0]
    for a, b in zip(sharded[0]["steps"], replicated[0]["steps"]):
        assert a["env_step"] == b["env_step"]
        for key in ("agent_0/grad_norm", "agent_1/grad_norm", "rollout/turn_1/reward_mean"):
            assert a["logged"][key] == pytest.approx(b["logged"][key], rel=1e-4), key
    step2 = next((tmp_path / "fsdp" / "run" / "quickstart" / "version_0" / "checkpoints").glob("epoch=0-step=2.ckpt"))
    assert step2.is_dir(), "a sharded run writes a distributed checkpoint directory"
    resumed = ddp_fit(tmp_path / "resumed", "quickstart", *common, "--ckpt_path", str(step2), fsdp=True)
    assert [s["digest"] for s in resumed[0]["steps"]] == [s["digest"] for s in sharded[0]["steps"][2:]]


def test_madpo_iter_with_sharded_agents_collects_trains_and_writes_policy_checkpoints_once(tmp_path):
    probes = ddp_fit(
        tmp_path,
        "madpo_iter",
        "--data.init_args.max_train_items",
        "4",
        "--model.init_args.eval_interval",
        "2",
        "--model.init_args.preference_num_candidates",
        "2",
        "--model.init_args.dpo_epochs_per_round",
        "1",
        fsdp=True,
    )
    assert_same_weights_after_every_step(probes)
    assert len({s["digest"] for s in probes[0]["steps"]}) == len(probes[0]["steps"]), "an update left the weights"
    root = tmp_path / "run" / "madpo_iter" / "version_0"
    assert sorted(p.name for p in (root / "preference_replay").iterdir()) == [
        "iteration_0001.json",
        "iteration_0002.json",
    ]
    checkpoints = sorted(p.name for p in (root / "policy_checkpoints").iterdir())
    assert checkpoints == ["initial", "iteration_0000", "iteration_0001"], checkpoints
    assert (root / "policy_checkpoints" / "iteration_0001" / "agent_1" / "config.json").is_file()


def assert_same_training(sharded: list[dict], replicated: list[dict], keys: list[str]) -> None:
    """FSDP and DDP took the same steps with the same gradients (norms per model) and rewards."""
    assert len(sharded[0]["steps"]) == len(replicated[0]["steps"])
    for a, b in zip(sharded[0]["steps"], replicated[0]["steps"]):
        for key in keys:
            assert (key in a["logged"]) == (key in b["logged"]), key
            if key in a["logged"]:
                assert a["logged"][key] == pytest.approx(b["logged"][key], rel=1e-4), key
    for key in keys:
        assert any(key in step["logged"] for step in sharded[0]["steps"]), f"{key} never logged"


def assert_same_export(sharded: Path, replicated: Path, files: list[str]) -> None:
    """The whole weights an FSDP run's ``save_pretrained`` wrote equal a DDP run's (float tolerance)."""
    from safetensors.torch import load_file

    for name in files:
        a, b = load_file(str(sharded / name)), load_file(str(replicated / name))
        assert a.keys() == b.keys(), name
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


def test_fsdp_shards_separate_critics_as_ddp_trains_them_and_exports_them_whole(tmp_path, iac_ddp):
    """IAC with a critic LM per agent: agents and critics sharded over 2 ranks train with DDP's gradients, and
    ``save_pretrained`` gathers each critic whole (backbone and value head) for rank 0 to write."""
    sharded = ddp_fit(tmp_path / "fsdp", "iac", *IAC_CRITICS, fsdp=True, export=True)
    ddp_dir, replicated = iac_ddp
    assert_same_weights_after_every_step(sharded)
    assert_same_training(
        sharded,
        replicated,
        [
            "agent_0/grad_norm",
            "agent_1/grad_norm",
            "critic_0/grad_norm",
            "critic_1/grad_norm",
            "turn_1/value_pred_mean",
        ],
    )
    files = [
        f"agent_{i}/{part}"
        for i in range(2)
        for part in ("model.safetensors", "critic/model.safetensors", "critic/value_head.safetensors")
    ]
    assert_same_export(tmp_path / "fsdp" / "export", ddp_dir / "export", files)


def test_fsdp_shards_the_reward_model_and_a_centralized_critic_in_marlhf(tmp_path):
    """MARLHF with MAAC as its RL stage: the reward model (trained in epoch 0, frozen after), the agents and the
    joint critic are all sharded; every update matches DDP's and the exported reward model is DDP's."""
    common = [
        "--data.init_args.max_train_items",
        "4",
        "--trainer.max_epochs",
        "2",
        "--trainer.max_steps",
        "-1",
        "--model.init_args.eval_interval",
        "0",
        "--model.init_args.max_grad_norm",
        "1.0",
        "--model.init_args.reward_model_name",
        "tiny",
        "--model.init_args.rl_algorithm",
        "maac",
        "--model.init_args.critic_model_name",
        "tiny",
    ]
    sharded = ddp_fit(tmp_path / "fsdp", "marlhf", *common, fsdp=True, export=True)
    replicated = ddp_fit(tmp_path / "ddp", "marlhf", *common, export=True)
    assert_same_weights_after_every_step(sharded)
    assert_same_training(sharded, replicated, ["reward_model/grad_norm", "agent_0/grad_norm", "critic_0/grad_norm"])
    assert_same_export(
        tmp_path / "fsdp" / "export",
        tmp_path / "ddp" / "export",
        [
            "reward_model/model.safetensors",
            "reward_model/value_head.safetensors",
            "critic/model.safetensors",
            "agent_1/model.safetensors",
        ],
    )
