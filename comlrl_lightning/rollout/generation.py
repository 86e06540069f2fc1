"""The generation backend: how the rollout engine turns prompts into K sampled completions per agent.

The engine asks one thing of a backend::

    sample(models, tokenizers, inputs, K, sampling) -> list[Completions]

``inputs[j]`` are agent j's model inputs (chat template already applied); ``models[j]`` answers them with ``K``
samples each, and the result carries token ids (prompt and completion), the completion mask up to and including
EOS, and the decoded texts (``rollout/sampling.py``). :class:`HFGenerate` is Hugging Face ``generate``: one batched
call per model, agents on distinct devices in parallel threads. A faster engine (vLLM, see docs/scaling.md) plugs
in here without touching any algorithm.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Protocol, Sequence

from comlrl_lightning.rollout.sampling import Completions, SamplingConfig, sample_completions


class GenerationBackend(Protocol):
    def sample(self, models: Sequence[Any], tokenizers: Sequence[Any], inputs: Sequence[Sequence[str]], K: int,
               sampling: SamplingConfig) -> list[Completions]: ...


class HFGenerate:
    """Hugging Face ``generate`` (KV cache, no grad, eval mode), ``batch_size`` prompts per call; with
    ``concurrent`` (agents on distinct devices) the models generate at the same time, one thread each."""

    def __init__(self, batch_size: int | None = None, generation_kwargs: Mapping[str, Any] | None = None,
                 concurrent: bool = False):
        self.batch_size, self.generation_kwargs, self.concurrent = batch_size, dict(generation_kwargs or {}), concurrent

    def sample(self, models, tokenizers, inputs, K, sampling) -> list[Completions]:
        def one(i: int) -> Completions:
            return sample_completions(models[i], tokenizers[i], inputs[i], K, sampling, self.batch_size,
                                      self.generation_kwargs)

        if self.concurrent and len(inputs) > 1:
            with ThreadPoolExecutor(max_workers=len(inputs)) as pool:
                return list(pool.map(one, range(len(inputs))))
        return [one(i) for i in range(len(inputs))]
