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
    """Hugging Face ``generate`` (KV cache, inference mode, eval mode), ``batch_size`` prompts per call; with
    ``concurrent`` (agents on distinct devices) the models generate at the same time, one thread each.

    Agents that share weights answer in ONE call: agents given the same model (parameter sharing) and the agents of a
    LoRA team, whose rows each go through their own adapter (peft's mixed-adapter batch: ``adapter_names``)."""

    def __init__(self, batch_size: int | None = None, generation_kwargs: Mapping[str, Any] | None = None,
                 concurrent: bool = False):
        self.batch_size, self.generation_kwargs, self.concurrent = batch_size, dict(generation_kwargs or {}), concurrent

    def sample(self, models, tokenizers, inputs, K, sampling) -> list[Completions]:
        calls: dict[tuple[int, int], list[int]] = {}  # (generator, tokenizer) -> the agents it answers for
        for i, model in enumerate(models):
            calls.setdefault((id(generator_of(model)[0]), id(tokenizers[i])), []).append(i)

        def one(agents: list[int]) -> list[Completions]:
            first = agents[0]
            if len(agents) == 1:
                return [sample_completions(models[first], tokenizers[first], inputs[first], K, sampling,
                                           self.batch_size, self.generation_kwargs)]
            generator = generator_of(models[first])[0]
            prompts = [prompt for i in agents for prompt in inputs[i]]
            names = [generator_of(models[i])[1] for i in agents for _ in inputs[i]]
            joint = sample_completions(generator, tokenizers[first], prompts, K, sampling, self.batch_size,
                                       self.generation_kwargs, adapters=None if names[0] is None else names)
            return joint.split([len(inputs[i]) for i in agents])

        groups = list(calls.values())
        if self.concurrent and len(groups) > 1:
            with ThreadPoolExecutor(max_workers=len(groups)) as pool:
                answers = list(pool.map(one, groups))
        else:
            answers = [one(agents) for agents in groups]
        out: list[Completions | None] = [None] * len(models)
        for agents, completions in zip(groups, answers):
            for i, c in zip(agents, completions):
                out[i] = c
        return out


def generator_of(model: Any) -> tuple[Any, str | None]:
    """What generates for ``model`` and under which adapter: an agent of a LoRA team (``agents/lora.py``) is its
    team's one peft model with the agent's adapter; any other model is itself."""
    shared = getattr(model, "shared_generator", None)
    return shared() if callable(shared) else (model, None)
