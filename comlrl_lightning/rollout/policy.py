"""TeamPolicy: the one interface a module hands the data side.

Data modules (rollouts, preference pairs, rounds) and comparators need the team *as it is now* — its current
weights, tokenizers and the way it samples (formatters, chat template, sampling settings, generation backend) — and
the reward that scores what it wrote. They get exactly that, as a ``TeamPolicy``, never the LightningModule: data
flows from the policy to the data side and back to the module as batches, one way.

A module builds its policy once its models are loaded (``OnPolicyModule.policy``; a preference module's ``module.pairs.policy``).
The models are the live agents, so what the policy samples always comes from the weights of the moment it is
asked.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

import torch

from comlrl_lightning.rollout.backends.vllm import SAMPLING_AHEAD, sampling_ahead
from comlrl_lightning.rollout.rewards import RewardCaller
from comlrl_lightning.rollout.sampling import Completions
from comlrl_lightning.rollout.tree import Rollout, RolloutEngine
from comlrl_lightning.runs import stop


class TeamPolicy:
    """The agents' current policy: sample completions, build rollout trees, score with ``reward``.

    Args:
        engine: formatters, sampling settings, chat template and generation backend of the team.
        models: the live policy models, one per agent (a model repeated = shared weights).
        tokenizers: one per agent.
        reward: what scores the team's joint actions (the task reward; a module may swap in another, e.g.
            MARLHF's learned reward, by assigning it).
        collaboration: the centralized adapter of a one-actor team (counts joint answers it could not split).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        models: Sequence[torch.nn.Module],
        tokenizers: Sequence[Any],
        reward: RewardCaller | None = None,
        collaboration: Any = None,
    ):
        self.engine, self.models, self.tokenizers = engine, list(models), list(tokenizers)
        self.reward = reward or engine.reward
        self.collaboration = collaboration

    @property
    def num_agents(self) -> int:
        return len(self.models)

    def model(self, role: int) -> tuple[torch.nn.Module, Any]:
        """(model, tokenizer) of agent ``role``."""
        return self.models[role], self.tokenizers[role]

    def device(self, role: int = 0) -> torch.device:
        return next(self.models[role].parameters()).device

    def first_prompts(self, items: Sequence[Mapping[str, Any]]) -> list[list[str]]:
        """[N][M] formatted first-turn prompts of each agent for ``items``."""
        return self.engine.first_prompts(items)

    def model_input(self, tokenizer: Any, prompt: str) -> str:
        """What a model reads for a formatted prompt (the chat template applied when it is on)."""
        return self.engine.model_input(tokenizer, prompt)

    def take_weights(self) -> None:
        """The team's engines take its current weights now (``RolloutEngine.take_weights``)."""
        self.engine.take_weights(self.models, self.tokenizers)

    def rollout_ahead(self, items: Sequence[Mapping[str, Any]], **stamps: Any) -> Future:
        """One-step-off (``max_staleness``): the engines take the current weights now (the training thread, between
        updates), then ``items``' rollout is sampled in a daemon thread, with its own seed stream drawn from torch's
        here; a Future of the Rollout. The sampling is discardable work: a stop (Ctrl-C, SIGTERM) ends it at its next
        safe point, and a fit's end and the process's exit wait for it (``backends/vllm.py``: :func:`finish_sampling_ahead`)."""
        self.take_weights()
        seed = int(torch.randint(0, 2**31 - 1, ()))
        future: Future = Future()

        def run() -> None:
            try:
                with sampling_ahead(seed), torch.no_grad(), stop.discardable("the rollout sampled ahead"):
                    future.set_result(self.rollout(items, **stamps))
            except BaseException as err:  # handed to the training thread, which re-raises it in resolve()
                future.set_exception(err)
            finally:
                SAMPLING_AHEAD.discard(threading.current_thread())

        thread = threading.Thread(target=run, name="rollout_ahead", daemon=True)
        SAMPLING_AHEAD.add(thread)
        thread.start()
        return future

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[Sequence[str]],
        K: int,
        models: Sequence[torch.nn.Module] | None = None,
        tokenizers: Sequence[Any] | None = None,
    ) -> list[Completions]:
        """K completions per prompt, ``prompts[j]`` answered by agent j (or by ``models[j]``: a comparator)."""
        return self.engine.sample(list(models or self.models), list(tokenizers or self.tokenizers), prompts, K)

    @torch.no_grad()
    def rollout(
        self, items: Sequence[Mapping[str, Any]], *, policy_version: int = 0, env_step: int = 0, **kwargs: Any
    ) -> Rollout:
        """The rollout trees of ``items`` sampled now, scored with ``reward``."""
        return self.engine.rollout(
            self.models,
            self.tokenizers,
            items,
            policy_version=policy_version,
            env_step=env_step,
            reward=kwargs.pop("reward", None) or self.reward,
            **kwargs,
        )
