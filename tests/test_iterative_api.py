"""MADPOIter against an OpenAI-chat-compatible comparator on a loopback HTTP server (127.0.0.1 only): the requests,
the pairs built from the API's texts, retries, and that the API key never reaches a file, a log, a checkpoint or
the hyper-parameters (docs/iterative.md#api-comparators)."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_magrpo import ITEMS

from comlrl_lightning import MADPOIter, PreferenceDataModule
from comlrl_lightning.envs import toy

SECRET = "sk-SECRET-123"
TEXTS = ("eee", "abc")  # letter_reward: 1.0 and 0.0


def agent_a_prompt(item):
    return "A: " + item["prompt"]


def agent_b_prompt(item):
    return "B: " + item["prompt"]


def openai_reply(body):
    n = int(body.get("n", 1))
    choices = [
        {"index": j, "message": {"role": "assistant", "content": TEXTS[j % 2]}, "finish_reason": "stop"}
        for j in range(n)
    ]
    return 200, {"id": "x", "object": "chat.completion", "choices": choices}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        with server.lock:
            index = len(server.requests)
            server.requests.append(
                {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
            )
        status, payload = server.script(index, body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.lock = threading.Lock()
    httpd.requests = []
    httpd.statuses = []
    httpd.script = lambda index, body: openai_reply(body)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions"
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def make_api_module(url, **overrides):
    kwargs = dict(
        agents="tiny",
        num_agents=2,
        reward_func=toy.letter_reward,
        formatters=[agent_a_prompt, agent_b_prompt],
        preference_num_candidates=4,
        comparator_num_candidates=2,
        preference_pairs_per_sample=2,
        train_batch_size=2,
        max_new_tokens=6,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        agent_learning_rate=1e-3,
        eval_interval=0,
        log_completions=False,
        num_iterations=2,
        comparator_policy="api",
        comparator_api_format="openai",
        comparator_api_url=url,
        comparator_api_model="m",
        comparator_api_key=SECRET,
    )
    kwargs.update(overrides)
    seed_everything(0)
    return MADPOIter(**kwargs)


def fit(module, root, callbacks=(), items=ITEMS[:2]):
    seed_everything(0)
    trainer = Trainer(
        logger=CSVLogger(root, name="run"),
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
    )
    data = PreferenceDataModule(dataset=items, show_progress=False, prompts_per_step=4)
    trainer.fit(module, datamodule=data)
    return trainer, data


def assert_secret_absent(root: Path):
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files
    leaks = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert not leaks, f"API key written to {leaks}"
    return files


def test_api_comparator_fit_requests_pairs_and_no_key_leak(server, tmp_path, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    module = make_api_module(server.url)
    ckpt_dir = tmp_path / "ckpt"
    trainer, data = fit(
        module, tmp_path / "logs", callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)]
    )
    assert trainer.current_epoch == 2

    # 2 rounds x 2 agents x 2 items, one request each (n = comparator_num_candidates = 2 <= no max_n_per_request)
    requests = server.requests
    assert len(requests) == 8
    for request in requests:
        assert request["path"] == "/v1/chat/completions"
        assert request["headers"]["authorization"] == f"Bearer {SECRET}"
        assert request["headers"]["content-type"] == "application/json"
        body = request["body"]
        assert body["model"] == "m" and body["n"] == 2 and body["max_tokens"] == 6
        assert body["temperature"] == 1.0 and body["top_p"] == 1.0
        assert set(body) == {"model", "messages", "n", "max_tokens", "temperature", "top_p"}
    contents = sorted(r["body"]["messages"][0]["content"] for r in requests)
    assert contents == sorted(["A: topic 0", "A: topic 1", "B: topic 0", "B: topic 1"] * 2)
    assert all(
        r["body"]["messages"] == [{"role": "user", "content": r["body"]["messages"][0]["content"]}] for r in requests
    )

    # every pair meets one API candidate: candidate 0 is "eee" (raw 1.0), candidate 1 "abc" (raw 0.0)
    log_dir = Path(trainer.log_dir)
    records = [
        r
        for v in (1, 2)
        for r in json.loads((log_dir / "preference_replay" / f"iteration_{v:04d}.json").read_text())["pairs"]
    ]
    assert records
    for record in records:
        text = "eee" if record["comparator_raw_reward"] == 1.0 else "abc"
        assert record["comparator_raw_reward"] in (0.0, 1.0)
        comparator_side = [text, text]
        assert comparator_side in (record["winner_completions"], record["loser_completions"])
        assert record["prompts"][0].startswith("A: ") and record["prompts"][1].startswith("B: ")
    assert any(r["winner_completions"] == ["eee", "eee"] for r in records)

    # the key is nowhere: files of the run (metrics, hparams, shards), checkpoints, logs, hparams
    files = assert_secret_absent(tmp_path)
    names = {p.name for p in files}
    assert {"metrics.csv", "hparams.yaml", "iteration_0001.json", "iteration_0002.json"} <= names
    assert list(ckpt_dir.glob("*.ckpt"))
    captured = capsys.readouterr()
    assert SECRET not in caplog.text and SECRET not in captured.out and SECRET not in captured.err
    assert caplog.records  # the run did log (so the check above looked at something)
    assert SECRET not in str(module.hparams) and SECRET not in repr(module.hparams)
    assert "comparator_api_key" not in module.hparams
    assert SECRET not in repr(data.rounds.comparator.client)


def test_api_server_error_is_retried_and_the_fit_completes(server, tmp_path):
    def script(index, body):
        if index == 0:
            return 500, {"error": {"message": "temporary"}}
        return openai_reply(body)

    server.script = script
    module = make_api_module(server.url, num_iterations=1, comparator_api_backoff_s=0)
    trainer, data = fit(module, tmp_path)
    assert trainer.current_epoch == 1
    requests = server.requests
    assert len(requests) == 4 + 1  # 2 agents x 2 items, the failed one sent again
    failed = requests[0]["body"]
    assert sum(r["body"] == failed for r in requests) == 2
    assert data.replay.shards and data.replay.shards[0].num_pairs > 0


def test_cli_config_redacts_the_key(server, tmp_path, monkeypatch):
    from comlrl_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "iter.yaml"
    config.write_text(f"""
seed_everything: 0
trainer:
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {tmp_path / "outputs"}, name: cli}}
  enable_progress_bar: false
  enable_model_summary: false
  accelerator: cpu
model:
  class_path: comlrl_lightning.MADPOIter
  init_args:
    agents: tiny
    num_agents: 2
    reward_func: comlrl_lightning.envs.toy.letter_reward
    num_iterations: 1
    preference_num_candidates: 2
    preference_pairs_per_sample: 2
    train_batch_size: 2
    max_new_tokens: 4
    temperature: 1.0
    top_p: 1.0
    top_k: null
    agent_learning_rate: 0.001
    eval_interval: 0
    log_completions: false
    comparator_policy: api
    comparator_api_format: openai
    comparator_api_url: {server.url}
    comparator_api_model: m
    comparator_api_backoff_s: 0
data:
  class_path: comlrl_lightning.PreferenceDataModule
  init_args:
    dataset:
      - {{prompt: topic 0, topic: topic 0}}
      - {{prompt: topic 1, topic: topic 1}}
    prompts_per_step: 2
    show_progress: false
""")
    main(["fit", "--config", str(config), "--model.init_args.comparator_api_key", SECRET])
    assert server.requests and all(r["headers"]["authorization"] == f"Bearer {SECRET}" for r in server.requests)
    saved = next((tmp_path / "outputs").rglob("config.yaml"))
    text = saved.read_text()
    assert "comparator_api_key: <redacted>" in text
    assert SECRET not in text
    assert (saved.parent / "preference_replay" / "iteration_0001.json").exists()
    files = assert_secret_absent(tmp_path / "outputs")
    assert any(p.suffix == ".ckpt" for p in files)  # the CLI's default checkpoint was scanned too
