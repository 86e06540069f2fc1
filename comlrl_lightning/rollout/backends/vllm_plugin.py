"""A vLLM plugin: the ``comlrl_file`` weight-transfer engine, for ``vllm_mode: server`` where no GPU transport is.

vLLM's weight-transfer API (``/init_weight_transfer_engine`` → ``/start_weight_update`` → ``/update_weights`` →
``/finish_weight_update``, docs/scaling.md#vllm-servers) moves the trainer's tensors with an engine named by the
server's ``--weight-transfer-config``: NCCL or CUDA IPC between GPUs. ``comlrl_file`` is the same protocol over a
file: the trainer writes the changed tensors as one safetensors file (under ``/dev/shm`` where it exists, so the
bytes stay in memory), the update names its path, and the server's worker reads and loads them into its model. It
runs wherever the trainer and the server share a filesystem (one machine; the suite's CPU servers).

vLLM loads it in every process through the ``vllm.general_plugins`` entry point (``pyproject.toml``):
:func:`register` adds the engine to vLLM's registry, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENGINE = "comlrl_file"


def register() -> None:
    """vLLM's plugin hook: make ``comlrl_file`` a weight-transfer backend (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    registry = getattr(WeightTransferEngineFactory, "_registry", {})
    if ENGINE not in registry:
        WeightTransferEngineFactory.register_engine(ENGINE, __name__, "FileWeightTransferEngine")


def _engine_class() -> type:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class FileInitInfo(WeightTransferInitInfo):
        """Nothing to agree on: the update names its file."""

    @dataclass
    class FileUpdateInfo(WeightTransferUpdateInfo):
        path: str = ""  # a safetensors file of checkpoint-named tensors

    class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
        """Loads the tensors of the file an update names into the worker's model (checkpoint names, so vLLM's own
        ``load_weights`` maps them onto its fused layers), inside vLLM's layerwise reload."""

        init_info_cls = FileInitInfo
        update_info_cls = FileUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: Any) -> None:
            pass

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            from comlrl_lightning.rollout.backends.vllm import repack_cpu_embeddings

            finalize_layerwise_reload(self.model, self.model_config)
            if self.device.type == "cpu":
                repack_cpu_embeddings(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # a file read is done when it returns

        def receive_weights(self, update_info: Any) -> None:
            from safetensors.torch import load_file

            self.model.load_weights(list(load_file(update_info.path, device=str(self.device)).items()))

        def shutdown(self) -> None:
            pass

    return FileWeightTransferEngine


def __getattr__(name: str) -> Any:  # vLLM imports the engine class by name, lazily, inside its own process
    if name == "FileWeightTransferEngine":
        cls = _engine_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
