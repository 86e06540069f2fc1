"""MAGRPO with an entropy bonus: the loss subtracts β·Σ_t w_t·H_t, the policy's entropy at each completion token
weighted as the policy term is (docs/new_algorithm.md). One flag asks scoring for the entropy; one field group,
one override."""

from dataclasses import dataclass

from comlrl_lightning.algorithms import MAGRPO
from comlrl_lightning.algorithms.fields import FieldGroup


@dataclass
class EntropyFields(FieldGroup):
    """Args:
    entropy_coef: β, the weight of the entropy bonus."""

    entropy_coef: float = 0.01


class EntropyMAGRPO(MAGRPO):
    field_groups = (*MAGRPO.field_groups, EntropyFields)
    needs_token_entropy = True  # scoring returns H_t beside log π (PolicyBatch.entropy)

    def policy_loss(self, agent, logp, batch):
        loss, diagnostics = super().policy_loss(agent, logp, batch)
        bonus = (batch.weights.to(logp.device) * batch.entropy).sum()
        return loss - self.entropy_coef * bonus, {**diagnostics, "entropy_bonus": bonus.detach()}
