"""``vllm_mode: server``: the team samples from ``vllm serve`` processes by URL (docs/scaling.md#vllm-servers).

A :class:`VLLMServerEngine` is the colocated engine (``backends/vllm.py``) with its two ends moved over HTTP, so
the sampling settings, seeds, stop strings, EOS ids, ``Completions`` records and the sync rules are the same:

* **sampling**: one ``/v1/completions`` request per prompt (``n=K``, the prompt's token ids, the request's seed
  drawn from torch's generator, the engine's log-probs of its tokens), sent concurrently: the server batches them;
* **weights**: whenever the training weights changed, vLLM's weight-transfer API (``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update`` with a new weight version); the tensors travel by the server's
  ``--weight-transfer-config`` backend — ``comlrl_file`` (``backends/vllm_plugin.py``: a safetensors file in
  shared memory, or a shared folder), or ``nccl``: vLLM's own trainer-side engine broadcasts them from the
  trainer's GPU (``NCCLTrainerWeightTransferEngine``, which drives the same routes). A LoRA team is one server: its
  frozen base goes once, each agent's adapter, when it changed, through ``/v1/load_lora_adapter`` (in place), and
  each request names its agent's adapter. Under data parallelism rank 0 sends (:meth:`VLLMServers.pin`);
* **checked before every sampling**: the server's ``/weight_info`` must report the version of the last sync, else
  :class:`~comlrl_lightning.rollout.backends.vllm.StaleWeights`.

A server that does not answer within ``vllm_server_timeout`` seconds, or answers with an error, ends the run with one
line naming the URL, the request and what it answered (:class:`ServerError`).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

from torch import nn

from comlrl_lightning.rollout.backends.vllm import (
    StaleWeights,
    VLLMEngine,
    VLLMGenerate,
    checkpoint_weights,
    finish_sampling_ahead,
)
from comlrl_lightning.runs import ranks

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
        transfer: ``file`` (``comlrl_file``) or ``nccl`` (vLLM's NCCL engine; the trainer on a GPU).
    """

    def __init__(
        self,
        generator: nn.Module,
        tokenizer: Any,
        url: str,
        timeout: float = 600.0,
        weights_dir: str | None = None,
        transfer: str = "file",
    ):
        self.sender = ranks.rank() == 0  # under data parallelism rank 0 sends the weights (the ranks hold the same)
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
        self.transfer, self.nccl = transfer, None  # nccl: the trainer is on a GPU (team.check_strategy)
        self.routes = WeightSyncRoutes(self)
        if self.sender and transfer == "file":  # nccl: vLLM's trainer engine initialises the server (_send_nccl)
            self.routes.init_weight_transfer_engine({})

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
        """The model's weights to the server under a new version (vLLM's weight-transfer API); under data
        parallelism every rank counts the version and rank 0 sends (an FSDP2 shard is gathered whole first: a
        collective, so every rank runs this)."""
        from safetensors.torch import save_file

        base = model.get_base_model() if self.adapters else model
        if self.transfer == "nccl":
            return self._send_nccl(base)
        path = os.path.join(self.folder.name, "weights.safetensors")
        tensors = {}
        for name, tensor in whole_weights(base):  # FSDP2: every rank gathers each tensor
            if self.sender:
                tensors[name] = tensor.contiguous().cpu()
        self.version += 1
        if not self.sender:
            return
        save_file(tensors, path)
        self.routes.start_weight_update()
        self.routes.update_weights({"path": path})
        self.routes.finish_weight_update()
        os.remove(path)

    def _send_nccl(self, base: nn.Module) -> None:
        """The weights by vLLM's trainer-side NCCL engine: set up once (the server joins an NCCL group with this
        process, rank 0 of it, at a port of this machine), then each sync broadcasts every tensor from the GPU while
        the server receives (``start`` → ``update`` → ``finish``, driven by the engine through
        :class:`WeightSyncRoutes`, which names the new version). Under data parallelism every rank iterates the weights (an FSDP2 shard is
        gathered whole) and rank 0 sends."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if self.nccl is None:
            workers = int(self.call("GET", "/get_world_size")["world_size"]) if self.sender else 0
            address, port = reachable_address(self.url), free_port()
            info = NCCLTrainerInitInfo(address, port, 1 + workers, rank=ranks.rank())
            source = checkpoint_source(base)
            self.nccl = WeightTransferTrainerFactory.trainer_init(info, client=self.routes, source=source)
        self.version += 1  # what finish_weight_update names
        self.nccl.send_weights()

    def _load_adapters(self, model: nn.Module, names: Sequence[str]) -> None:
        """A LoRA team's changed adapters: written to the shared folder, loaded in place by the server
        (``/v1/load_lora_adapter``; the server runs with ``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, as ``serve`` starts it)."""
        root = Path(self.folder.name) / "adapters"
        for name in names:
            folder = str(root / name)  # the other ranks: held by the server, rank 0 sent it
            if self.sender:
                model.save_pretrained(root, selected_adapters=[name])  # root/<name>/ (the default adapter: root)
                folder = str(root / name if (root / name).is_dir() else root)
                body = {"lora_name": name, "lora_path": folder, "load_inplace": True}
                self.call("POST", "/v1/load_lora_adapter", body)
            self.adapter_folders[name] = folder

    def sync(self, model: nn.Module, adapters: Sequence[str] = ()) -> None:
        """As colocated, once no rollout samples ahead on the weights the server holds (its weights change only
        between samplings)."""
        finish_sampling_ahead()
        super().sync(model, adapters)

    def ensure_current(self, model: nn.Module, adapters: Sequence[str | None] = ()) -> None:
        """As colocated in one process; under data parallelism the weights were sent where every rank passes
        (:meth:`VLLMServers.pin`), so here they are only checked."""
        wanted = [a for a in dict.fromkeys(adapters) if a is not None]
        if ranks.world_size() == 1:
            return super().ensure_current(model, adapters)
        if self.stale(model, wanted):
            raise StaleWeights(
                f"vLLM server {self.url}: under data parallelism the servers take the weights where every rank passes "
                "(the start of a rollout or an evaluation), and this sampling comes after they changed; sample here "
                "in one training process, or with vllm_mode: colocate."
            )
        self.check_pinned()

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


class WeightSyncRoutes:
    """vLLM's weight-sync client protocol (what its trainer-side engines drive) over ``engine``'s requests: a server
    that fails ends the run naming its URL, and the update finishes under ``engine``'s new version."""

    def __init__(self, engine: VLLMServerEngine):
        self.engine = engine

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.engine.call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.engine.call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.call("POST", "/finish_weight_update", {"weight_version": str(self.engine.version)})


def whole_weights(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """``model``'s weights under their checkpoint names, a sharded (FSDP2) tensor gathered whole (a collective:
    every rank iterates)."""
    for name, tensor in checkpoint_weights(model):
        yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def checkpoint_source(model: nn.Module) -> Any:
    """vLLM's ``WeightSource`` (what its trainer-side engines send) over :func:`whole_weights`; its metadata reads the
    global shapes without gathering."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class CheckpointSource(WeightSource):
        def metadata(self) -> list:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in checkpoint_weights(model)]

        def __iter__(self):
            return whole_weights(model)

    return CheckpointSource()


def reachable_address(url: str) -> str:
    """This machine's address on the route to ``url``'s host (what a server there connects back to; no packet is
    sent)."""
    host = urllib.parse.urlparse(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class VLLMServers(VLLMGenerate):
    """The ``vllm`` backend with ``vllm_mode: server``: each weight set's engine is its server.

    Args:
        server_urls: the ``vllm serve`` URL of each weight set, in the team's order (one URL: all of them).
        server_timeout: seconds a server request may take.
        server_weights_dir: where weight files for the servers are written (null: ``/dev/shm``).
        server_weight_transfer: ``file`` or ``nccl`` (:class:`VLLMServerEngine`'s ``transfer``).
        generation_kwargs, ...: as :class:`~comlrl_lightning.rollout.backends.vllm.VLLMGenerate`.
    """

    def __init__(
        self,
        server_urls: Sequence[str],
        server_timeout: float = 600.0,
        server_weights_dir: str | None = None,
        server_weight_transfer: str = "file",
        **options: Any,
    ):
        super().__init__(**options)
        self.server_urls, self.server_timeout = list(server_urls), float(server_timeout)
        self.server_weights_dir, self.server_weight_transfer = server_weights_dir, server_weight_transfer

    def make_engine(self, generator: nn.Module, tokenizer: Any, index: int) -> VLLMServerEngine:
        url = self.server_urls[index if len(self.server_urls) > 1 else 0]
        return VLLMServerEngine(
            generator, tokenizer, url, self.server_timeout, self.server_weights_dir, self.server_weight_transfer
        )

    def pin(self, models, tokenizers) -> None:
        """The servers take the current training weights now. Under data parallelism (DDP, FSDP2) every rank calls
        this at the same point of each step (``TeamPolicy.take_weights``): a weight set is sent when it changed on any
        rank, by rank 0, and every rank waits until it has been sent; sampling then only checks the version."""
        if ranks.world_size() == 1:
            return super().pin(models, tokenizers)
        for engine, generator, adapters in self.weight_sets(models, tokenizers):
            if ranks.reduce_max(float(engine.stale(generator, adapters))):
                engine.sync(generator, adapters)
        ranks.barrier()
