"""API comparator against a scripted loopback HTTP server (127.0.0.1 only)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from comlrl_lightning.comparators import (
    API_FORMATS,
    ApiComparator,
    ApiComparatorConfig,
    ComparatorAPIError,
    normalize_api_format,
)

SECRET = "sk-test-SECRET-123456"


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = []  # (path, headers dict (lower-cased), body)
        self.script = None  # callable(index, body) -> (status, headers, bytes | obj) or "sleep:<s>"
        self.active = 0
        self.max_active = 0
        self.delay = 0.0


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output quiet
        pass

    def do_POST(self):
        state: _State = self.server.state
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw
        with state.lock:
            index = len(state.requests)
            state.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            state.active += 1
            state.max_active = max(state.max_active, state.active)
        try:
            status, headers, payload, delay = state.script(index, body)
            if delay:
                time.sleep(delay)
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        finally:  # the request is done before its answer is sent: a client that reads it may start the next one
            with state.lock:
                state.active -= 1
        try:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.state = _State()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/endpoint"
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=2)


def ok(payload, delay=0.0, headers=None):
    return (200, headers, payload, delay)


def make(server, **kw):
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout", 5.0)
    return ApiComparator(ApiComparatorConfig(url=server.url, **kw))


def bodies(server):
    return [b for _, _, b in server.state.requests]


# ---------------------------------------------------------------------------- config


def test_formats_and_aliases():
    assert API_FORMATS == ("generic", "openai", "anthropic", "openai_responses")
    assert normalize_api_format("responses") == "openai_responses"
    assert normalize_api_format("codex") == "openai_responses"
    assert normalize_api_format("chat") == "openai"
    assert normalize_api_format("openai_chat") == "openai"
    assert normalize_api_format("messages") == "anthropic"
    with pytest.raises(ValueError, match="comparator_api_format must be one of"):
        normalize_api_format("grpc")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "comparator_api_url is required when comparator_policy='api'."),
        ({"url": "  "}, "comparator_api_url is required"),
        (
            {"url": "http://127.0.0.1:1", "max_n_per_request": 0},
            "comparator_api_max_n_per_request must be >= 1 or null.",
        ),
        ({"url": "http://127.0.0.1:1", "timeout": 0}, "comparator_api_timeout"),
        ({"url": "http://127.0.0.1:1", "format": "soap"}, "comparator_api_format"),
        ({"url": "http://127.0.0.1:1", "max_retries": -1}, "comparator_api_max_retries"),
        ({"url": "http://127.0.0.1:1", "max_concurrency": 0}, "comparator_api_max_concurrency"),
        ({"url": "http://127.0.0.1:1", "headers": "x"}, "comparator_api_headers"),
        ({"url": "http://127.0.0.1:1", "extra_body": [1]}, "comparator_api_extra_body"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ApiComparatorConfig(**kwargs)


def test_config_defaults_and_from_trainer_config():
    cfg = ApiComparatorConfig(url="http://127.0.0.1:1", format="responses")
    assert cfg.format == "openai_responses"
    assert (cfg.key_header, cfg.key_prefix, cfg.timeout, cfg.response_field) == (
        "Authorization",
        "Bearer",
        120.0,
        "completions",
    )
    assert (cfg.max_retries, cfg.backoff_s, cfg.max_concurrency, cfg.max_n_per_request) == (3, 1.0, 4, None)

    class Trainer:
        comparator_api_url = "http://127.0.0.1:1"
        comparator_api_format = "chat"
        comparator_api_model = "m"
        comparator_api_timeout = 7
        comparator_api_max_n_per_request = 2
        comparator_api_headers = None

    cfg = ApiComparatorConfig.from_trainer_config(Trainer())
    assert (cfg.format, cfg.model, cfg.timeout, cfg.max_n_per_request) == ("openai", "m", 7.0, 2)
    cfg = ApiComparatorConfig.from_trainer_config({"comparator_api_url": "http://127.0.0.1:1"}, max_retries=0)
    assert cfg.max_retries == 0 and cfg.format == "generic"


# ---------------------------------------------------------------------------- formats


def test_generic_request_and_extraction(server):
    server.state.script = lambda i, b: ok({"completions": ["a", {"text": "b"}, {"message": {"content": "c"}}]})
    comp = make(server, model="gen-model", key=SECRET, headers={"X-Custom": "yes"}, extra_body={"seed": 7})
    out = comp.complete(
        "hello",
        2,
        agent_idx=1,
        batch_item={"task_id": 3, "obj": object()},
        max_new_tokens=16,
        temperature=0.5,
        top_p=0.9,
        top_k=None,
    )
    assert out == ["a", "b"]  # truncated to num
    ((path, headers, body),) = server.state.requests
    assert path == "/v1/endpoint"
    assert headers["authorization"] == f"Bearer {SECRET}"
    assert headers["content-type"] == "application/json"
    assert headers["x-custom"] == "yes"
    assert body["prompt"] == "hello" and body["agent_idx"] == 1 and body["num_return_sequences"] == 2
    assert body["max_new_tokens"] == 16 and body["temperature"] == 0.5 and body["top_p"] == 0.9
    assert "top_k" not in body  # None dropped
    assert body["model"] == "gen-model" and body["seed"] == 7
    assert body["batch_item"]["task_id"] == 3 and isinstance(body["batch_item"]["obj"], str)


@pytest.mark.parametrize(
    "payload, field, expected",
    [
        ({"data": {"outs": [{"completion": "x"}, "y"]}}, "data.outs", ["x", "y"]),
        ({"result": [{"texts": ["p", "q"]}]}, "result.0.texts", ["p", "q"]),
        ({"responses": [{"response": "r1"}, {"content": "r2"}]}, "completions", ["r1", "r2"]),
        ({"outputs": ["o1", "o2"]}, "missing.path", ["o1", "o2"]),
        ({"choices": [{"message": {"content": "c1"}}, {"text": "c2"}]}, "completions", ["c1", "c2"]),
    ],
)
def test_generic_dotted_path_and_fallbacks(server, payload, field, expected):
    server.state.script = lambda i, b: ok(payload)
    assert make(server, response_field=field).complete("p", 2) == expected


def test_generic_missing_field_names_format_and_path(server):
    server.state.script = lambda i, b: ok({"foo": 1})
    with pytest.raises(ValueError, match=r"format 'generic' is missing data\.outs, completions, responses"):
        make(server, response_field="data.outs").complete("p", 1)


def test_openai_body_headers_and_split_by_max_n(server):
    def script(i, body):
        n = body["n"]
        return ok(
            {"choices": [{"index": k, "message": {"role": "assistant", "content": f"r{i}-{k}"}} for k in range(n)]}
        )

    server.state.script = script
    comp = make(
        server,
        format="openai",
        model="gpt-x",
        key=SECRET,
        max_n_per_request=2,
        extra_body={"presence_penalty": 0.1},
        max_concurrency=1,
    )
    out = comp.complete("hi", 5, max_new_tokens=32, temperature=0.7, top_p=None, top_k=50)
    assert len(out) == 5
    sent = bodies(server)
    assert [b["n"] for b in sent] == [2, 2, 1]
    body = sent[0]
    assert body["model"] == "gpt-x" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_tokens"] == 32 and body["temperature"] == 0.7 and body["presence_penalty"] == 0.1
    assert "top_p" not in body and "top_k" not in body
    assert server.state.requests[0][1]["authorization"] == f"Bearer {SECRET}"
    assert out == ["r0-0", "r0-1", "r1-0", "r1-1", "r2-0"]


def test_openai_all_in_one_and_top_up_when_fewer_returned(server):
    def script(i, body):  # returns at most 2 choices whatever n is
        return ok({"choices": [{"text": f"t{i}{k}"} for k in range(min(2, body["n"]))]})

    server.state.script = script
    out = make(server, format="chat").complete("p", 3)
    assert [b["n"] for b in bodies(server)] == [3, 1]
    assert out == ["t00", "t01", "t10"]


@pytest.mark.parametrize("model, path", [("deepseek-chat", "/v1/chat"), ("other", "/api.deepseek.com/chat")])
def test_deepseek_one_per_request(server, model, path):
    server.state.script = lambda i, b: ok({"choices": [{"message": {"content": f"d{i}"}}] * b["n"]})
    url = server.url.rsplit("/v1/", 1)[0] + path
    comp = ApiComparator(
        ApiComparatorConfig(url=url, format="openai", model=model, max_n_per_request=4, max_concurrency=1)
    )
    assert comp.complete("p", 3) == ["d0", "d1", "d2"]
    assert [b["n"] for b in bodies(server)] == [1, 1, 1]


def test_anthropic_format(server, monkeypatch):
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", SECRET)
    server.state.script = lambda i, b: ok(
        {
            "content": [
                {"type": "thinking", "thinking": "hmm"},
                {"type": "text", "text": f"a{i}"},
                {"type": "text", "text": "second"},
            ]
        }
    )
    comp = make(server, format="anthropic", model="claude-x", key_env="TEST_ANTHROPIC_KEY", max_concurrency=1)
    assert comp.complete("hey", 2, max_new_tokens=64, temperature=0.3, top_p=0.5) == ["a0", "a1"]
    assert len(server.state.requests) == 2
    _, headers, body = server.state.requests[0]
    assert headers["x-api-key"] == SECRET and "authorization" not in headers
    assert headers["anthropic-version"] == "2023-06-01"
    assert body == {
        "model": "claude-x",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hey"}],
        "temperature": 0.3,
    }


def test_anthropic_custom_key_header_kept(server):
    server.state.script = lambda i, b: ok({"content": [{"type": "text", "text": "z"}]})
    make(server, format="anthropic", key=SECRET, key_header="X-Gateway-Key", key_prefix="Token").complete("p", 1)
    headers = server.state.requests[0][1]
    assert headers["x-gateway-key"] == f"Token {SECRET}" and "x-api-key" not in headers


def test_anthropic_missing_content(server):
    server.state.script = lambda i, b: ok({"type": "message"})
    with pytest.raises(ValueError, match=r"format 'anthropic' is missing content\[\]\.text"):
        make(server, format="anthropic").complete("p", 1)


def test_openai_responses_format(server):
    server.state.script = lambda i, b: ok(
        {
            "output": [
                {"type": "reasoning", "summary": []},
                {
                    "type": "message",
                    "content": [{"type": "output_text", "text": f"o{i}"}, {"type": "output_text", "text": "x"}],
                },
            ]
        }
    )
    comp = make(
        server,
        format="codex",
        model="gpt-5",
        key=SECRET,
        extra_body={"reasoning": {"effort": "low"}},
        max_concurrency=1,
    )
    assert comp.complete("q", 2, max_new_tokens=100, temperature=0.9) == ["o0", "o1"]
    _, headers, body = server.state.requests[0]
    assert headers["authorization"] == f"Bearer {SECRET}"
    assert body == {"model": "gpt-5", "input": "q", "max_output_tokens": 100, "reasoning": {"effort": "low"}}


def test_openai_missing_choices(server):
    server.state.script = lambda i, b: ok({"id": "x"})
    with pytest.raises(ValueError, match=r"format 'openai' is missing choices"):
        make(server, format="openai").complete("p", 1)


# ---------------------------------------------------------------------------- errors and retries


def test_retry_on_503_then_success(server):
    server.state.script = lambda i, b: (503, None, {"error": "busy"}, 0) if i < 2 else ok({"completions": ["ok"]})
    sleeps = []
    comp = ApiComparator(ApiComparatorConfig(url=server.url, backoff_s=0.01), sleep=sleeps.append)
    assert comp.complete("p", 1) == ["ok"]
    assert len(server.state.requests) == 3
    assert len(sleeps) == 2 and 0.01 <= sleeps[0] <= 0.0125 and 0.02 <= sleeps[1] <= 0.025  # exp backoff + jitter


def test_retry_exhausted_on_5xx(server):
    server.state.script = lambda i, b: (500, None, b"internal boom", 0)
    with pytest.raises(ComparatorAPIError, match=r"HTTP 500: internal boom \(after 3 attempts\)") as info:
        make(server, max_retries=2).complete("p", 1)
    assert info.value.status == 500 and len(server.state.requests) == 3


def test_429_honours_retry_after(server):
    server.state.script = lambda i, b: (
        (429, {"Retry-After": "0"}, {"error": "rate"}, 0) if i == 0 else ok({"completions": ["fine"]})
    )
    sleeps = []
    comp = ApiComparator(ApiComparatorConfig(url=server.url, backoff_s=5.0), sleep=sleeps.append)
    assert comp.complete("p", 1) == ["fine"]
    assert sleeps == [0.0]


def test_every_retry_is_logged_with_its_reason_and_wait(server, caplog):
    server.state.script = lambda i, b: (503, None, {"error": "busy"}, 0) if i < 2 else ok({"completions": ["ok"]})
    sleeps = []
    comp = ApiComparator(ApiComparatorConfig(url=server.url, backoff_s=0.01), sleep=sleeps.append)
    with caplog.at_level("WARNING", logger="comlrl_lightning.comparators.api"):
        assert comp.complete("p", 1) == ["ok"]
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) == 2 and all("HTTP 503" in m for m in retries)
    assert retries[0].startswith("comparator API attempt 1/4 failed") and f"{sleeps[0]:.1f} s" in retries[0]


def test_a_long_retry_after_is_capped_and_said(server, caplog):
    server.state.script = lambda i, b: (
        (429, {"Retry-After": "3600"}, {"error": "rate"}, 0) if i == 0 else ok({"completions": ["fine"]})
    )
    sleeps = []
    comp = ApiComparator(ApiComparatorConfig(url=server.url, max_retry_after_s=2.5), sleep=sleeps.append)
    with caplog.at_level("WARNING", logger="comlrl_lightning.comparators.api"):
        assert comp.complete("p", 1) == ["fine"]
    assert sleeps == [2.5]
    assert any("retry after 3600 s; waiting comparator_api_max_retry_after_s" in r.getMessage() for r in caplog.records)


def test_the_total_deadline_ends_the_retries(server):
    server.state.script = lambda i, b: (503, None, {"error": "busy"}, 0)
    now = [0.0]
    comp = ApiComparator(
        ApiComparatorConfig(url=server.url, backoff_s=4.0, max_retries=10, deadline_s=10.0),
        sleep=lambda s: now.__setitem__(0, now[0] + s),
        clock=lambda: now[0],
    )
    with pytest.raises(ComparatorAPIError, match=r"gave up after 2 attempt\(s\): comparator_api_deadline_s = 10 s"):
        comp.complete("p", 1)
    assert len(server.state.requests) == 2  # 4 s wait, then 8 s would pass the 10 s deadline


def test_an_unset_key_env_fails_when_the_config_is_built(monkeypatch):
    monkeypatch.delenv("COMLRL_TEST_NO_SUCH_KEY", raising=False)
    with pytest.raises(
        ValueError,
        match="comparator_api_key_env names the environment variable 'COMLRL_TEST_NO_SUCH_KEY', which is not set",
    ):
        ApiComparatorConfig(url="http://127.0.0.1:1/v1", key_env="COMLRL_TEST_NO_SUCH_KEY")


def test_no_retry_on_400(server):
    server.state.script = lambda i, b: (400, None, b"bad   model\n name", 0)
    with pytest.raises(ValueError, match=r"Comparator API request failed with HTTP 400: .*bad model name") as info:
        make(server).complete("p", 1)
    assert info.value.status == 400 and len(server.state.requests) == 1


def test_402_insufficient_balance(server):
    server.state.script = lambda i, b: (402, None, {"error": "Insufficient Balance"}, 0)
    with pytest.raises(RuntimeError, match="insufficient balance"):
        make(server).complete("p", 1)
    assert len(server.state.requests) == 1


def test_non_json_response(server):
    server.state.script = lambda i, b: ok(b"<html>gateway</html>")
    with pytest.raises(ValueError, match=r"Comparator API returned non-JSON response: <html>gateway</html>"):
        make(server).complete("p", 1)
    assert len(server.state.requests) == 1


@pytest.mark.parametrize(
    "fmt, payload",
    [
        ("generic", {"completions": []}),
        ("openai", {"choices": []}),
        ("anthropic", {"content": []}),
        ("openai_responses", {"output": []}),
    ],
)
def test_empty_completions(server, fmt, payload):
    server.state.script = lambda i, b: ok(payload)
    with pytest.raises(ValueError, match="Comparator API returned no completions"):
        make(server, format=fmt).complete("p", 2)


def test_timeout_retries_then_clear_error(server):
    server.state.script = lambda i, b: ok({"completions": ["late"]}, delay=0.5)
    comp = make(server, timeout=0.1, max_retries=1)
    with pytest.raises(ComparatorAPIError, match=r"failed after 2 attempts: timed out after 0\.1s"):
        comp.complete("p", 1)
    assert len(server.state.requests) == 2


def test_connection_refused_retries_then_error():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    sleeps = []
    comp = ApiComparator(
        ApiComparatorConfig(url=f"http://127.0.0.1:{port}/x", max_retries=2, backoff_s=0.0), sleep=sleeps.append
    )
    with pytest.raises(ComparatorAPIError, match="failed after 3 attempts: connection error"):
        comp.complete("p", 1)
    assert len(sleeps) == 2


def test_key_from_env_never_leaks(server, monkeypatch):
    monkeypatch.setenv("TEST_COMPARATOR_KEY", SECRET)
    server.state.script = lambda i, b: (401, None, {"error": f"invalid key {SECRET}"}, 0)
    cfg = ApiComparatorConfig(url=server.url, key_env="TEST_COMPARATOR_KEY", format="openai")
    comp = ApiComparator(cfg)
    with pytest.raises(ValueError) as info:
        comp.complete("p", 1)
    assert server.state.requests[0][1]["authorization"] == f"Bearer {SECRET}"
    assert "HTTP 401" in str(info.value) and SECRET not in str(info.value)
    literal = ApiComparatorConfig(url=server.url, key=SECRET, headers={"Authorization": f"Bearer {SECRET}"})
    for text in (repr(cfg), str(cfg), repr(comp), repr(literal), str(literal), repr(ApiComparator(literal))):
        assert SECRET not in text
    assert "key='***'" in repr(literal)


def test_missing_env_key_is_clear_error(server, monkeypatch):
    monkeypatch.delenv("TEST_COMPARATOR_KEY_UNSET", raising=False)
    server.state.script = lambda i, b: ok({"completions": ["x"]})
    with pytest.raises(ValueError, match="TEST_COMPARATOR_KEY_UNSET"):
        make(server, key_env="TEST_COMPARATOR_KEY_UNSET").complete("p", 1)
    assert server.state.requests == []


# ---------------------------------------------------------------------------- concurrency


def test_concurrency_limit_and_order(server):
    def script(i, body):  # later prompts answer faster, so completion order differs from submission order
        idx = int(body["prompt"].split("-")[1])
        return ok(
            {"completions": [f"{body['prompt']}:{k}" for k in range(body["num_return_sequences"])]},
            delay=0.1 + 0.02 * (7 - idx),
        )  # long enough that two requests overlap even on a busy machine

    server.state.script = script
    comp = make(server, max_concurrency=2)
    prompts = [f"prompt-{i}" for i in range(8)]
    out = comp.complete_many(prompts, 2, agent_idx=list(range(8)))
    assert out == [[f"prompt-{i}:0", f"prompt-{i}:1"] for i in range(8)]
    assert server.state.max_active <= 2
    assert server.state.max_active == 2
    assert sorted(b["agent_idx"] for b in bodies(server)) == list(range(8))


def test_concurrency_limit_across_split_requests(server):
    server.state.script = lambda i, b: ok(
        {"content": [{"type": "text", "text": b["messages"][0]["content"]}]}, delay=0.03
    )
    comp = make(server, format="anthropic", max_concurrency=3)
    out = comp.complete_many(["a", "b", "c"], 3)
    assert out == [["a"] * 3, ["b"] * 3, ["c"] * 3]
    assert len(server.state.requests) == 9 and server.state.max_active <= 3


def test_concurrency_shared_between_threads(server):
    server.state.script = lambda i, b: ok({"completions": ["x"]}, delay=0.03)
    comp = make(server, max_concurrency=2)
    threads = [threading.Thread(target=comp.complete_many, args=(["p"] * 3, 1)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(server.state.requests) == 9 and server.state.max_active <= 2
