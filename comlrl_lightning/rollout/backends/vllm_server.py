"""``vllm_mode: server``: the team samples from ``vllm serve`` processes by URL (docs/scaling.md#vllm-servers).

A :class:`VLLMServerEngine` is the colocated engine (``backends/vllm.py``) with its two ends moved over HTTP, so
the sampling settings, seeds, stop strings, EOS ids, ``Completions`` records and the sync rules are the same:

* **sampling**: one ``/v1/completions`` request per prompt (``n=K``, the prompt's token ids, the request's seed
  drawn from torch's generator, the engine's log-probs of its tokens), sent concurrently: the server batches them;
* **weights**: whenever the training weights changed, vLLM's weight-transfer API (``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update`` with a new weight version); the tensors travel by the server's
  ``--weight-transfer-config`` backend — ``comlrl_file`` (``backends/vllm_plugin.py``: a safetensors file in
  shared memory) where trainer and server share a machine. A LoRA team is one server: its frozen base goes once,
  each agent's adapter, when it changed, through ``/v1/load_lora_adapter`` (in place), and each request names its
  agent's adapter;
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

from comlrl_lightning.rollout.backends.vllm import StaleWeights, VLLMEngine, VLLMGenerate, checkpoint_weights

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
        weights_dir: where the weight files are written for the server to read (``comlrl_file``): a folder the
            server's machine sees at the same path (null: ``/dev/shm``, i.e. the same machine).
    """

    def __init__(
        self, generator: nn.Module, tokenizer: Any, url: str, timeout: float = 600.0, weights_dir: str | None = None
    ):
        from comlrl_lightning.runs import ranks

        if ranks.world_size() > 1:
            raise ValueError(
                "vllm_mode: server trains in one process for now: under data parallelism every rank would push its "
                "weights to the same server. Use one training process (the servers sample in parallel), or "
                "vllm_mode: colocate with DDP."
            )
        self.adapters = list(getattr(generator, "peft_config", {}) or {})  # a LoRA team: one server, one base
        self.url, self.timeout = url.rstrip("/"), float(timeout)
        self.device = next(generator.parameters()).device
        self.sleep_mode, self.asleep = False, False
        self.seen, self.syncs, self.version = None, 0, 0
        self.adapter_folders: dict[str, str] = {}
        self.unsynced_adapters: set[str] = set()
        shm = Path("/dev/shm")
        root = weights_dir if weights_dir is not None else (shm if shm.is_dir() else None)
        self.folder = tempfile.TemporaryDirectory(prefix="comlrl_weights_", dir=root)
        self.model_name = self.call("GET", "/v1/models")["data"][0]["id"]
        self.call("POST", "/init_weight_transfer_engine", {"init_info": {}})

    # ------------------------------------------------------------------ HTTP
    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        """One request to the server; its JSON answer (or its text), or :class:`ServerError` naming the URL and the
        answer."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                body = answer.read()
            try:
                return json.loads(body or b"null")
            except ValueError:  # some routes answer plain text (vLLM's adapter loading)
                return body.decode(errors="replace")
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
        base = model.get_base_model() if self.adapters else model
        save_file({name: tensor.contiguous().cpu() for name, tensor in checkpoint_weights(base)}, path)
        self.version += 1
        self.call("POST", "/start_weight_update")
        self.call("POST", "/update_weights", {"update_info": {"path": path}})
        self.call("POST", "/finish_weight_update", {"weight_version": str(self.version)})
        os.remove(path)

    def _load_adapters(self, model: nn.Module, names: Sequence[str]) -> None:
        """A LoRA team's changed adapters: written to the shared folder, loaded in place by the server
        (``/v1/load_lora_adapter``; the server runs with ``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, as ``serve`` starts it)."""
        root = Path(self.folder.name) / "adapters"
        for name in names:
            model.save_pretrained(root, selected_adapters=[name])  # root/<name>/ (the default adapter: root)
            folder = str(root / name if (root / name).is_dir() else root)
            self.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder, "load_inplace": True})
            self.adapter_folders[name] = folder

    def check_current(self, model: nn.Module, adapters: Sequence[str] = ()) -> None:
        """As colocated, and the server must report the version of the last sync."""
        super().check_current(model, adapters)
        self.check_pinned()

    def check_pinned(self) -> None:
        """The server holds the version of the last sync (what a sampling-ahead thread checks: it reads no
        training weights)."""
        served = self.call("GET", "/weight_info").get("weight_version")
        if served != str(self.version):
            raise StaleWeights(
                f"vLLM server {self.url} holds weight version {served!r}, not {str(self.version)!r}, the last one "
                "sent: sampling from it would train on samples of another policy (was the server restarted, or "
                "synced by another trainer?)."
            )

    # ------------------------------------------------------------------ sampling
    def generate(self, prompt_ids: list[list[int]], params: list, adapters: Sequence[str | None]) -> list[list[tuple]]:
        def one(ids: list[int], p: Any, adapter: str | None) -> list[tuple]:
            body = {name: getattr(p, name) for name in _REQUEST_FIELDS if getattr(p, name, None) is not None}
            body["stop_token_ids"] = list(body.get("stop_token_ids") or [])
            body.update(model=adapter or self.model_name, prompt=ids, logprobs=0, return_token_ids=True)
            answer = self.call("POST", "/v1/completions", body)
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]

        with ThreadPoolExecutor(max_workers=min(16, max(1, len(prompt_ids)))) as pool:
            return list(pool.map(one, prompt_ids, params, list(adapters) or [None] * len(prompt_ids)))


class VLLMServers(VLLMGenerate):
    """The ``vllm`` backend with ``vllm_mode: server``: each weight set's engine is its server.

    Args:
        server_urls: the ``vllm serve`` URL of each weight set, in the team's order (one URL: all of them).
        server_timeout: seconds a server request may take.
        server_weights_dir: where weight files for the servers are written (null: ``/dev/shm``).
        generation_kwargs, ...: as :class:`~comlrl_lightning.rollout.backends.vllm.VLLMGenerate`.
    """

    def __init__(
        self,
        server_urls: Sequence[str],
        server_timeout: float = 600.0,
        server_weights_dir: str | None = None,
        **options: Any,
    ):
        super().__init__(**options)
        self.server_urls, self.server_timeout = list(server_urls), float(server_timeout)
        self.server_weights_dir = server_weights_dir

    def make_engine(self, generator: nn.Module, tokenizer: Any, index: int) -> VLLMServerEngine:
        url = self.server_urls[index if len(self.server_urls) > 1 else 0]
        return VLLMServerEngine(generator, tokenizer, url, self.server_timeout, self.server_weights_dir)
