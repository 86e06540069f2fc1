"""``vllm_mode: server``: the team samples from ``vllm serve`` processes by URL (docs/scaling.md#vllm-servers).

A :class:`VLLMServerEngine` is the colocated engine (``backends/vllm.py``) with its two ends moved over HTTP, so
the sampling settings, seeds, stop strings, EOS ids, ``Completions`` records and the sync rules are the same:

* **sampling**: one ``/v1/completions`` request per prompt (``n=K``, the prompt's token ids, the request's seed
  drawn from torch's generator, the engine's log-probs of its tokens), sent concurrently: the server batches them;
* **weights**: whenever the training weights changed, vLLM's weight-transfer API (``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update`` with a new weight version); the tensors travel by the server's
  ``--weight-transfer-config`` backend — ``comlrl_file`` (``backends/vllm_plugin.py``: a safetensors file in
  shared memory) where trainer and server share a machine;
* **checked before every sampling**: the server's ``/weight_info`` must report the version of the last sync, else
  :class:`~comlrl_lightning.rollout.backends.vllm.StaleWeights`.

A server that does not answer within ``vllm_server_timeout`` seconds, or answers with an error, ends the run with one
line naming the URL, the request and what it answered (:class:`ServerError`).
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from comlrl_lightning.rollout.backends.vllm import StaleWeights, VLLMEngine, checkpoint_weights

# SamplingParams fields a request carries (the OpenAI API's extra parameters of vLLM).
_REQUEST_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "seed",
    "repetition_penalty",
    "min_p",
)


class ServerError(RuntimeError):
    """A vLLM server did not answer, or answered with an error."""


class VLLMServerEngine(VLLMEngine):
    """The engine of one weight set, served by ``url`` (module docstring).

    Args:
        generator: the training model whose weights the server samples with.
        tokenizer: its tokenizer.
        url: the server's base URL (``http://host:port``).
        timeout: seconds a request may take before the run stops.
    """

    def __init__(self, generator: nn.Module, tokenizer: Any, url: str, timeout: float = 600.0):
        self.adapters = list(getattr(generator, "peft_config", {}) or {})
        if self.adapters:
            raise ValueError(
                "vllm_mode: server samples full models; a LoRA team's adapters are not sent to a server yet: use "
                "vllm_mode: colocate for a LoRA team."
            )
        self.url, self.timeout = url.rstrip("/"), float(timeout)
        self.device = next(generator.parameters()).device
        self.sleep_mode, self.asleep = False, False
        self.seen, self.syncs, self.version = None, 0, 0
        self.adapter_folders: dict[str, str] = {}
        self.unsynced_adapters: set[str] = set()
        shm = Path("/dev/shm")
        self.folder = tempfile.TemporaryDirectory(prefix="comlrl_weights_", dir=shm if shm.is_dir() else None)
        self.model_name = self.call("GET", "/v1/models")["data"][0]["id"]
        self.call("POST", "/init_weight_transfer_engine", {"init_info": {}})

    # ------------------------------------------------------------------ HTTP
    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        """One request to the server; its JSON answer, or :class:`ServerError` naming the URL and the answer."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")[:300]
            raise ServerError(f"vLLM server {self.url} answered {method} {path} with HTTP {err.code}: {text}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ServerError(
                f"vLLM server {self.url} did not answer {method} {path} within vllm_server_timeout = "
                f"{self.timeout:g} s: {reason}"
            ) from None

    # ------------------------------------------------------------------ weights
    def _load_base(self, model: nn.Module) -> None:
        """The model's weights to the server under a new version (vLLM's weight-transfer API)."""
        from safetensors.torch import save_file

        path = os.path.join(self.folder.name, "weights.safetensors")
        save_file({name: tensor.contiguous().cpu() for name, tensor in checkpoint_weights(model)}, path)
        self.version += 1
        self.call("POST", "/start_weight_update")
        self.call("POST", "/update_weights", {"update_info": {"path": path}})
        self.call("POST", "/finish_weight_update", {"weight_version": str(self.version)})
        os.remove(path)

    def check_current(self, model: nn.Module, adapters: Sequence[str] = ()) -> None:
        """As colocated, and the server must report the version of the last sync."""
        super().check_current(model, adapters)
        served = self.call("GET", "/weight_info").get("weight_version")
        if served != str(self.version):
            raise StaleWeights(
                f"vLLM server {self.url} holds weight version {served!r}, not {str(self.version)!r}, the last one "
                "sent: sampling from it would train on samples of another policy (was the server restarted, or "
                "synced by another trainer?)."
            )

    # ------------------------------------------------------------------ sampling
    def generate(self, prompt_ids: list[list[int]], params: list, adapters: Sequence[str | None]) -> list[list[tuple]]:
        def one(ids: list[int], p: Any) -> list[tuple]:
            body = {name: getattr(p, name) for name in _REQUEST_FIELDS if getattr(p, name, None) is not None}
            body["stop_token_ids"] = list(body.get("stop_token_ids") or [])
            body.update(model=self.model_name, prompt=ids, logprobs=0, return_token_ids=True)
            answer = self.call("POST", "/v1/completions", body)
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]

        with ThreadPoolExecutor(max_workers=min(16, max(1, len(prompt_ids)))) as pool:
            return list(pool.map(one, prompt_ids, params))
