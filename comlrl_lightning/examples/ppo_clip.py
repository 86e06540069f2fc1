"""Multi-agent PPO-clip on MAGRPO's machinery (docs/new_algorithm.md): MAGRPO's group advantages, the sampling
policy's token log-probs stored with every sample, PPO's clipped surrogate objective (Schulman et al. 2017,
arXiv:1707.06347) and ``ppo_epochs`` shuffled passes over every drained buffer. The stored log-probs travel with
the buffered samples, so a checkpoint taken while samples wait for their update keeps them."""

from dataclasses import dataclass

import torch
from torch import Tensor

from comlrl_lightning.algorithms import MAGRPO
from comlrl_lightning.algorithms.fields import FieldGroup, require
from comlrl_lightning.algorithms.reinforce import GroupRelative, PolicyBatch


@dataclass
class ClipFields(FieldGroup):
    """PPO's clipped surrogate.

    Args:
        clip_range: ε: the ratio π/π_old is clipped to [1 − ε, 1 + ε].
        ppo_epochs: passes over one drained buffer (each reshuffles its mini-batches).
    """

    clip_range: float = 0.2
    ppo_epochs: int = 2

    def check(self) -> None:
        require(self.clip_range > 0, f"clip_range must be > 0 (got {self.clip_range}).")
        require(self.ppo_epochs >= 1, f"ppo_epochs must be >= 1 (got {self.ppo_epochs}).")


class ClippedSurrogate(GroupRelative):
    """MAGRPO's objective with the clipped importance ratio against the rollout's own log-probs."""

    needs_sampling_logprobs = True  # π_old: kept while sampling, no scoring forward

    @property
    def passes(self) -> int:
        return self.host.ppo_epochs

    def after_rollout(self, rollout) -> None:
        """π_old: the sampling weights' token log-probs of every fresh sample."""
        m = self.host
        for agent in range(m.num_agents):
            samples, inputs = m.agent_inputs(rollout.nodes, agent)
            logprobs = m.sampling_logprobs(agent, samples, inputs).split([s.completion_ids.shape[0] for s in samples])
            for sample, rows in zip(samples, logprobs):
                sample.old_logprobs = rows[:, : sample.completion_ids.shape[1]]

    def policy_loss(self, agent: int, logp: Tensor, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        ratio = torch.exp(logp - batch.old_logprobs.to(logp.device))  # [B, T]
        clipped = ratio.clamp(1 - self.host.clip_range, 1 + self.host.clip_range)
        advantages = batch.advantages.to(logp.device)[:, None]
        surrogate = torch.minimum(ratio * advantages, clipped * advantages)
        loss = -(batch.weights.to(logp.device) * surrogate).sum()
        mask = batch.inputs.completion_mask.to(logp.device)
        return loss, {"clipped_tokens": ((ratio != clipped) & mask).sum().detach()}


class MAPPOClip(MAGRPO):
    """Multi-agent PPO-clip: MAGRPO's fields and loop, the clipped surrogate as the objective."""

    algorithm_name = "MAPPOClip"
    field_groups = (*MAGRPO.field_groups, ClipFields)
    objective_class = ClippedSurrogate
