"""MAGRPO minus an entropy bonus β·Σ_t w_t·H_t, H_t weighted as the policy term (docs/new_algorithm.md)."""

from dataclasses import dataclass

from comlrl_lightning.algorithms import MAGRPO, GroupRelative
from comlrl_lightning.algorithms.fields import FieldGroup


@dataclass
class EntropyFields(FieldGroup):
    """Args:
    entropy_coef: β, the weight of the entropy bonus."""

    entropy_coef: float = 0.01


class EntropyBonus(GroupRelative):
    needs_token_entropy = True  # scoring returns H_t beside log π (PolicyBatch.entropy)

    def policy_loss(self, agent, logp, batch):
        loss, diagnostics = super().policy_loss(agent, logp, batch)
        bonus = (batch.weights.to(logp.device) * batch.entropy).sum()
        return loss - self.host.entropy_coef * bonus, {**diagnostics, "entropy_bonus": bonus.detach()}


class EntropyMAGRPO(MAGRPO):
    field_groups = (*MAGRPO.field_groups, EntropyFields)
    objective_class = EntropyBonus
