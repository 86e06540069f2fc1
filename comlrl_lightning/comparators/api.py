"""HTTP API comparator (``comparator_policy="api"``), stdlib only.

Supports CoMLRL's four request formats (docs/iterative.md#api-comparators):

* ``generic``           -- ``{prompt, agent_idx, num_return_sequences, ...}``, all candidates in one request;
* ``openai``            -- Chat Completions (``n`` per request, split by ``max_n_per_request``; one per
                           request for DeepSeek URLs/models);
* ``anthropic``         -- Messages API, one candidate per request, ``x-api-key`` + ``anthropic-version``;
* ``openai_responses``  -- Responses API, one candidate per request.

Beyond the reference: bounded retries with exponential backoff and jitter on timeouts, connection
errors, HTTP 429 (``Retry-After`` honoured) and 5xx; a concurrency limit shared by all requests of one
comparator; the API key is resolved at request time and never appears in ``repr`` or error text.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from comlrl_lightning.choices import Choice
from comlrl_lightning.runs import stop

__all__ = [
    "API_FORMATS",
    "API_FORMAT_ALIASES",
    "ApiComparator",
    "ApiComparatorConfig",
    "ComparatorAPIError",
    "ComparatorAPIInsufficientBalanceError",
    "normalize_api_format",
]

API_FORMAT = Choice(
    "comparator_api_format",
    {
        "generic": (),
        "openai": ("openai_chat", "chat"),
        "anthropic": ("anthropic_messages", "messages"),
        "openai_responses": ("responses", "codex"),
    },
    message="{field} must be one of: {allowed}.",
    spelling=lambda value: str(value if value is not None else "generic").strip().lower().replace("-", "_"),
)
API_FORMATS: Tuple[str, ...] = API_FORMAT.values
API_FORMAT_ALIASES: Dict[str, str] = API_FORMAT.aliases
normalize_api_format = API_FORMAT

ANTHROPIC_VERSION = "2023-06-01"
_DEFAULT_KEY_HEADER = "Authorization"
_DEFAULT_KEY_PREFIX = "Bearer"
_GENERIC_FALLBACK_FIELDS = ("completions", "responses", "outputs", "choices")
_ITEM_TEXT_KEYS = ("text", "content", "completion", "response")
_MAX_BODY_SNIPPET = 300
_MAX_SLEEP_S = 120.0
_SENSITIVE_HEADER_RE = re.compile(r"(auth|key|token|secret|cookie)", re.IGNORECASE)
log = logging.getLogger(__name__)


class ComparatorAPIError(ValueError):
    """Request/response failure of the API comparator (a ``ValueError``, as in CoMLRL)."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


class ComparatorAPIInsufficientBalanceError(RuntimeError):
    """HTTP 402 from the comparator endpoint."""

    def __init__(self, message: str):
        super().__init__(message)
        self.status = 402


class _RetryableError(Exception):
    def __init__(self, message: str, retry_after: Optional[float] = None, status: Optional[int] = None):
        super().__init__(message)
        self.retry_after = retry_after
        self.status = status


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class ApiComparatorConfig:
    """Settings for :class:`ApiComparator`; names mirror ``comparator_api_*`` of CoMLRL."""

    url: Optional[str] = None
    format: str = "generic"
    model: Optional[str] = None
    key: Optional[str] = None
    key_env: Optional[str] = None
    key_header: str = _DEFAULT_KEY_HEADER
    key_prefix: Optional[str] = _DEFAULT_KEY_PREFIX
    headers: Optional[Dict[str, str]] = None
    timeout: float = 120.0
    extra_body: Optional[Dict[str, Any]] = None
    response_field: str = "completions"
    max_n_per_request: Optional[int] = None
    # Robustness knobs: retries, waits, concurrency.
    max_retries: int = 3
    backoff_s: float = 1.0
    max_concurrency: int = 4
    max_retry_after_s: float = 60.0  # a server's Retry-After longer than this is capped (and said so in the log)
    deadline_s: Optional[float] = None  # total time one request may take, retries and waits included

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.strip():
            raise ValueError("comparator_api_url is required when comparator_policy='api'.")
        self.url = self.url.strip()
        if not self.url.lower().startswith(("http://", "https://")):
            raise ValueError("comparator_api_url must start with http:// or https://.")
        self.format = normalize_api_format(self.format)
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError("comparator_api_model must be a string or null.")
        if self.key is not None and not isinstance(self.key, str):
            raise ValueError("comparator_api_key must be a string or null.")
        if self.key_env is not None and (not isinstance(self.key_env, str) or not self.key_env.strip()):
            raise ValueError("comparator_api_key_env must be a non-empty string or null.")
        if not isinstance(self.key_header, str) or not self.key_header.strip():
            raise ValueError("comparator_api_key_header must be a non-empty string.")
        if self.key_prefix is not None and not isinstance(self.key_prefix, str):
            raise ValueError("comparator_api_key_prefix must be a string or null.")
        if self.headers is not None:
            if not isinstance(self.headers, Mapping):
                raise ValueError("comparator_api_headers must be a mapping of header names to values or null.")
            self.headers = {str(k): str(v) for k, v in self.headers.items()}
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not math.isfinite(self.timeout)
            or self.timeout <= 0
        ):
            raise ValueError("comparator_api_timeout must be > 0.")
        self.timeout = float(self.timeout)
        if self.extra_body is not None:
            if not isinstance(self.extra_body, Mapping):
                raise ValueError("comparator_api_extra_body must be a mapping or null.")
            self.extra_body = dict(self.extra_body)
        if not isinstance(self.response_field, str) or not self.response_field.strip():
            raise ValueError("comparator_api_response_field must be a non-empty string.")
        if self.max_n_per_request is not None and not _is_positive_int(self.max_n_per_request):
            raise ValueError("comparator_api_max_n_per_request must be >= 1 or null.")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError("comparator_api_max_retries must be >= 0.")
        if (
            isinstance(self.backoff_s, bool)
            or not isinstance(self.backoff_s, (int, float))
            or not math.isfinite(self.backoff_s)
            or self.backoff_s < 0
        ):
            raise ValueError("comparator_api_backoff_s must be >= 0.")
        self.backoff_s = float(self.backoff_s)
        if not _is_positive_int(self.max_concurrency):
            raise ValueError("comparator_api_max_concurrency must be >= 1.")
        for name in ("max_retry_after_s", "deadline_s"):
            value = getattr(self, name)
            if value is None and name == "deadline_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"comparator_api_{name} must be > 0{' or null' if name == 'deadline_s' else ''} (got {value!r})."
                )
            setattr(self, name, float(value))
        if self.key_env and not self.key and not os.environ.get(self.key_env):
            raise ValueError(
                f"comparator_api_key_env names the environment variable {self.key_env!r}, which is not "
                "set: export it before the run (the key itself never goes into a config)."
            )

    def __repr__(self) -> str:  # never print the key (or secret-looking header values)
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "key":
                value = None if value is None else "***"
            elif f.name == "headers" and value is not None:
                value = {k: ("***" if _SENSITIVE_HEADER_RE.search(k) else v) for k, v in value.items()}
            parts.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    __str__ = __repr__

    @classmethod
    def from_trainer_config(cls, config: Any, **overrides: Any) -> "ApiComparatorConfig":
        """Build from an object/mapping carrying ``comparator_api_*`` attributes (unset → defaults)."""
        kwargs: Dict[str, Any] = {}
        for f in fields(cls):
            name = f"comparator_api_{f.name}"
            if isinstance(config, Mapping):
                present, value = name in config, config.get(name)
            else:
                present, value = hasattr(config, name), getattr(config, name, None)
            if present and (
                value is not None
                or f.name in ("model", "key", "key_env", "key_prefix", "headers", "extra_body", "max_n_per_request")
            ):
                kwargs[f.name] = value
        kwargs.update(overrides)
        return cls(**kwargs)


def _json_safe(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return str(value)


def _drop_none(body: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


def _get_path(data: Any, path: str) -> Tuple[bool, Any]:
    current = data
    for part in path.split("."):
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        elif isinstance(current, list) and re.fullmatch(r"-?\d+", part) and -len(current) <= int(part) < len(current):
            current = current[int(part)]
        else:
            return False, None
    return True, current


def _item_text(item: Any) -> Optional[str]:
    """Text of a completion item: a string or a dict with text/content/completion/response/message.content."""
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        message = item.get("message")
        if isinstance(message, Mapping):
            text = _content_text(message.get("content"))
            if text is not None:
                return text
        for key in _ITEM_TEXT_KEYS:
            if key in item:
                text = _content_text(item[key])
                if text is not None:
                    return text
    return None


def _content_text(content: Any) -> Optional[str]:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # list of content parts, e.g. [{"type": "text", "text": ...}]
        texts = [p.get("text") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
        texts += [p for p in content if isinstance(p, str)]
        if texts:
            return "".join(texts)
    return None


def _is_deepseek(url: str, model: Optional[str]) -> bool:
    return "api.deepseek.com" in url.lower() or (model or "").lower().startswith("deepseek-")


class ApiComparator:
    """Samples comparator completions from a remote endpoint."""

    def __init__(
        self,
        config: Optional[ApiComparatorConfig] = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        **kwargs: Any,
    ):
        if config is None:
            config = ApiComparatorConfig(**kwargs)
        elif kwargs:
            raise TypeError("Pass either an ApiComparatorConfig or keyword fields, not both.")
        self.config = config
        self._sleep = sleep
        self._clock = clock
        self._semaphore = threading.BoundedSemaphore(config.max_concurrency)

    def __repr__(self) -> str:
        return f"ApiComparator({self.config!r})"

    # ------------------------------------------------------------------ key / headers
    def _resolve_key(self) -> Optional[str]:
        cfg = self.config
        if cfg.key:
            return cfg.key
        if cfg.key_env:
            value = os.environ.get(cfg.key_env)
            if not value:
                raise ValueError(
                    f"comparator_api_key_env names environment variable {cfg.key_env!r}, which is not set."
                )
            return value
        return None

    def _headers(self, key: Optional[str]) -> Dict[str, str]:
        cfg = self.config
        headers = {"Content-Type": "application/json"}
        if cfg.format == "anthropic":
            headers["anthropic-version"] = ANTHROPIC_VERSION
        headers.update(cfg.headers or {})
        if key:
            header, prefix = cfg.key_header, cfg.key_prefix
            if cfg.format == "anthropic" and header == _DEFAULT_KEY_HEADER and prefix == _DEFAULT_KEY_PREFIX:
                header, prefix = "x-api-key", None
            headers[header] = f"{prefix} {key}" if prefix else key
        return headers

    def _redact(self, text: str) -> str:
        secrets = []
        if self.config.key:
            secrets.append(self.config.key)
        if self.config.key_env and os.environ.get(self.config.key_env):
            secrets.append(os.environ[self.config.key_env])
        for secret in secrets:
            if secret:
                text = text.replace(secret, "***")
        return text

    def _snippet(self, raw: bytes | str) -> str:
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
        text = " ".join(text.split())
        if len(text) > _MAX_BODY_SNIPPET:
            text = text[:_MAX_BODY_SNIPPET] + "..."
        return self._redact(text)

    # ------------------------------------------------------------------ request bodies
    def build_body(
        self,
        prompt: str,
        n: int,
        *,
        agent_idx: int = 0,
        batch_item: Any = None,
        max_new_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
    ) -> Dict[str, Any]:
        cfg = self.config
        if cfg.format == "generic":
            body = {
                "prompt": prompt,
                "agent_idx": agent_idx,
                "num_return_sequences": n,
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                "batch_item": _json_safe(batch_item) if batch_item is not None else None,
                "model": cfg.model,
            }
        elif cfg.format == "openai":
            body = {
                "model": cfg.model,
                "messages": [{"role": "user", "content": prompt}],
                "n": n,
                "max_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
            }
        elif cfg.format == "anthropic":
            body = {
                "model": cfg.model,
                "max_tokens": max_new_tokens,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": temperature,
            }
        else:  # openai_responses
            body = {"model": cfg.model, "input": prompt, "max_output_tokens": max_new_tokens}
        body = _drop_none(body)
        if cfg.extra_body:
            body.update(cfg.extra_body)
        return body

    def request_sizes(self, num: int) -> List[int]:
        """Candidates asked for in each request to collect ``num`` completions."""
        cfg = self.config
        if num <= 0:
            return []
        if cfg.format == "generic":
            return [num]
        if cfg.format == "openai":
            if _is_deepseek(cfg.url, cfg.model):
                per = 1
            elif cfg.max_n_per_request is not None:
                per = max(1, min(cfg.max_n_per_request, num))
            else:
                per = num
            sizes = [per] * (num // per)
            if num % per:
                sizes.append(num % per)
            return sizes
        return [1] * num  # anthropic / openai_responses: no n parameter

    # ------------------------------------------------------------------ HTTP
    def _retry_delay(self, attempt: int, retry_after: Optional[float]) -> float:
        if retry_after is not None:
            cap = self.config.max_retry_after_s
            if retry_after > cap:
                log.warning(
                    "comparator API asked to retry after %.0f s; waiting comparator_api_max_retry_after_s = "
                    "%.0f s instead",
                    retry_after,
                    cap,
                )
            return min(max(retry_after, 0.0), cap)
        base = self.config.backoff_s * (2**attempt)
        return min(base + random.uniform(0.0, base * 0.25), _MAX_SLEEP_S)

    def _post_once(self, data: bytes, headers: Dict[str, str]) -> Any:
        cfg = self.config
        request = urllib.request.Request(cfg.url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=cfg.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            try:
                raw_err = exc.read()
            except Exception:  # pragma: no cover - body unreadable
                raw_err = b""
            code = exc.code
            snippet = self._snippet(raw_err)
            if code == 402:
                raise ComparatorAPIInsufficientBalanceError(
                    f"Comparator API request failed with HTTP 402 (insufficient balance / payment required): {snippet}"
                ) from None
            if code == 429 or 500 <= code < 600:
                retry_after = None
                header = exc.headers.get("Retry-After") if exc.headers is not None else None
                if header is not None:
                    try:
                        retry_after = float(header.strip())
                    except ValueError:
                        retry_after = None
                raise _RetryableError(f"HTTP {code}: {snippet}", retry_after=retry_after, status=code) from None
            raise ComparatorAPIError(
                f"Comparator API request failed with HTTP {code}: {snippet}", status=code
            ) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise _RetryableError(f"timed out after {cfg.timeout:g}s") from None
            raise _RetryableError(f"connection error: {self._snippet(str(reason))}") from None
        except (socket.timeout, TimeoutError):
            raise _RetryableError(f"timed out after {cfg.timeout:g}s") from None
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            raise _RetryableError(f"connection error: {type(exc).__name__}: {self._snippet(str(exc))}") from None
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ComparatorAPIError(f"Comparator API returned non-JSON response: {self._snippet(raw)}") from None

    def post(self, body: Dict[str, Any]) -> Any:
        """POST ``body`` (with retries) and return the decoded JSON."""
        cfg = self.config
        headers = self._headers(self._resolve_key())
        data = json.dumps(body).encode("utf-8")
        attempts = cfg.max_retries + 1
        last: Optional[_RetryableError] = None
        deadline = None if cfg.deadline_s is None else self._clock() + cfg.deadline_s
        for attempt in range(attempts):
            stop.check()  # a safe point per request (runs/stop.py); one under way finishes or times out
            try:
                with self._semaphore:
                    return self._post_once(data, headers)
            except _RetryableError as exc:
                last = exc
                if attempt + 1 < attempts:
                    wait = self._retry_delay(attempt, exc.retry_after)
                    if deadline is not None and self._clock() + wait > deadline:
                        raise ComparatorAPIError(
                            f"Comparator API request to {self._redact(cfg.url)} gave up after {attempt + 1} "
                            f"attempt(s): comparator_api_deadline_s = {cfg.deadline_s:g} s would pass before the next "
                            f"one (last error: {exc})",
                            status=exc.status,
                        ) from None
                    log.warning(
                        "comparator API attempt %d/%d failed (%s); retrying in %.1f s",
                        attempt + 1,
                        attempts,
                        self._redact(str(exc)),
                        wait,
                    )
                    stop.wait(wait, self._sleep)  # time.sleep in slices, with safe points
        assert last is not None
        if last.status is not None:
            raise ComparatorAPIError(
                f"Comparator API request failed with {last} (after {attempts} attempts)", status=last.status
            )
        raise ComparatorAPIError(
            f"Comparator API request to {self._redact(cfg.url)} failed after {attempts} attempts: {last}"
        )

    # ------------------------------------------------------------------ extraction
    def extract(self, data: Any) -> List[str]:
        """Completion texts of one response (may be empty)."""
        fmt = self.config.format
        if fmt == "generic":
            return self._extract_generic(data)
        if fmt == "openai":
            choices = data.get("choices") if isinstance(data, Mapping) else None
            if not isinstance(choices, list):
                raise self._missing("choices[].message.content or choices[].text", data)
            texts = []
            for choice in choices:
                if not isinstance(choice, Mapping):
                    continue
                text = None
                if isinstance(choice.get("message"), Mapping):
                    text = _content_text(choice["message"].get("content"))
                if text is None:
                    text = _content_text(choice.get("text"))
                if text is not None:
                    texts.append(text)
            return texts
        if fmt == "anthropic":
            content = data.get("content") if isinstance(data, Mapping) else None
            if not isinstance(content, list):
                raise self._missing("content[].text", data)
            for block in content:
                if (
                    isinstance(block, Mapping)
                    and block.get("type", "text") == "text"
                    and isinstance(block.get("text"), str)
                ):
                    return [block["text"]]
            return []
        # openai_responses
        output = data.get("output") if isinstance(data, Mapping) else None
        if not isinstance(output, list):
            if isinstance(data, Mapping) and isinstance(data.get("output_text"), str):
                return [data["output_text"]]
            raise self._missing("output[].content[].text", data)
        for item in output:
            if not isinstance(item, Mapping) or not isinstance(item.get("content"), list):
                continue
            for block in item["content"]:
                if (
                    isinstance(block, Mapping)
                    and block.get("type") in ("output_text", "text")
                    and isinstance(block.get("text"), str)
                ):
                    return [block["text"]]
        return []

    def _extract_generic(self, data: Any) -> List[str]:
        field = self.config.response_field
        found, value = _get_path(data, field)
        if not found and isinstance(data, Mapping):
            for name in _GENERIC_FALLBACK_FIELDS:
                if name in data:
                    found, value = True, data[name]
                    break
        if not found:
            tried = ", ".join(dict.fromkeys([field, *_GENERIC_FALLBACK_FIELDS]))
            raise self._missing(tried, data)
        if isinstance(value, (str, Mapping)):
            value = [value]
        if not isinstance(value, list):
            raise ComparatorAPIError(
                f"Comparator API response for format 'generic' has a non-list value at {field!r}: "
                f"{type(value).__name__}"
            )
        texts = []
        for item in value:
            text = _item_text(item)
            if text is None:
                raise ComparatorAPIError(
                    "Comparator API response for format 'generic' has a completion item without text "
                    "(expected a string or a dict with text/content/completion/response/message.content): "
                    f"{self._snippet(json.dumps(item, default=str))}"
                )
            texts.append(text)
        return texts

    def _missing(self, path: str, data: Any) -> ComparatorAPIError:
        keys = sorted(map(str, data.keys())) if isinstance(data, Mapping) else type(data).__name__
        return ComparatorAPIError(
            f"Comparator API response for format {self.config.format!r} is missing {path} "
            f"(got top-level keys: {keys}): {self._snippet(json.dumps(data, default=str))}"
        )

    def _no_completions(self, prompt_idx: Optional[int] = None) -> ComparatorAPIError:
        where = f" for prompt {prompt_idx}" if prompt_idx is not None else ""
        return ComparatorAPIError(
            f"Comparator API returned no completions{where} (format={self.config.format!r}, "
            f"url={self._redact(self.config.url)!r})."
        )

    def _request_texts(self, body: Dict[str, Any], prompt_idx: Optional[int]) -> List[str]:
        texts = self.extract(self.post(body))
        if not texts:
            raise self._no_completions(prompt_idx)
        return texts

    # ------------------------------------------------------------------ public sampling API
    def complete(
        self,
        prompt: str,
        num: int,
        *,
        agent_idx: int = 0,
        batch_item: Any = None,
        max_new_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
    ) -> List[str]:
        """``num`` completions of ``prompt`` (requests split as the format requires)."""
        return self.complete_many(
            [prompt],
            num,
            agent_idx=agent_idx,
            batch_items=None if batch_item is None else [batch_item],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
        )[0]

    def complete_many(
        self,
        prompts: Sequence[str],
        num: int,
        *,
        agent_idx: int | Sequence[int] = 0,
        batch_items: Optional[Sequence[Any]] = None,
        max_new_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
    ) -> List[List[str]]:
        """``num`` completions per prompt; all requests run concurrently (≤ ``max_concurrency``), in order."""
        if isinstance(prompts, str):
            raise TypeError("complete_many expects a list of prompts, not a single string.")
        prompts = list(prompts)
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise ValueError("num must be an integer >= 1.")
        agent_ids = list(agent_idx) if isinstance(agent_idx, Sequence) else [agent_idx] * len(prompts)
        items = list(batch_items) if batch_items is not None else [None] * len(prompts)
        if len(agent_ids) != len(prompts) or len(items) != len(prompts):
            raise ValueError("agent_idx and batch_items must have one entry per prompt.")
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)

        def body_for(i: int, n: int) -> Dict[str, Any]:
            return self.build_body(prompts[i], n, agent_idx=agent_ids[i], batch_item=items[i], **sampling)

        results: List[List[str]] = [[] for _ in prompts]
        tasks = [(i, n) for i in range(len(prompts)) for n in self.request_sizes(num)]
        if tasks:
            self._run(tasks, body_for, results)
        if self.config.format == "openai":
            # The server may return fewer than n choices: top up until num are collected.
            while True:
                todo = [(i, n) for i in range(len(prompts)) for n in self.request_sizes(num - len(results[i]))[:1]]
                if not todo:
                    break
                self._run(todo, body_for, results)
        return [texts[:num] for texts in results]

    def _run(
        self, tasks: List[Tuple[int, int]], body_for: Callable[[int, int], Dict[str, Any]], results: List[List[str]]
    ) -> None:
        workers = min(self.config.max_concurrency, len(tasks))
        if workers <= 1:
            outputs = [self._request_texts(body_for(i, n), i) for i, n in tasks]
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="comparator-api") as pool:
                futures = [pool.submit(self._request_texts, body_for(i, n), i) for i, n in tasks]
                outputs = [f.result() for f in futures]
        for (i, _), texts in zip(tasks, outputs):
            results[i].extend(texts)
