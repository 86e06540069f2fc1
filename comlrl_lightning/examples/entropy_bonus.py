"""MAGRPO minus an entropy bonus β·Σ_t w_t·H_t, H_t weighted as the policy term (docs/new_algorithm.md)."""

from dataclasses import dataclass

from comlrl_lightning.algorithms import MAGRPO, GroupRelative
from comlrl_lightning.algorithms.fields import FieldGroup
from comlrl_lightning.algorithms.reinforce import register_policy_loss


@dataclass
class EntropyFields(FieldGroup):
    """Args:
    entropy_coef: β, the weight of the entropy bonus."""

    entropy_coef: float = 0.01


@register_policy_loss("entropy_bonus")  # from now on `policy_loss: entropy_bonus` is valid in any MAGRPO config
class EntropyBonus(GroupRelative):
    uses_entropy = True  # scoring returns H_t beside log π (PolicyBatch.entropy)

    def __init__(self, entropy_coef: float, **settings):
        super().__init__(**settings)
        self.entropy_coef = entropy_coef

    def loss(self, logp, batch):
        loss, metrics = super().loss(logp, batch)
        bonus = (batch.weights.to(logp.device) * batch.entropy).sum()
        return loss - self.entropy_coef * bonus, {**metrics, "entropy_bonus": bonus.detach()}


class EntropyMAGRPO(MAGRPO):
    field_groups = (*MAGRPO.field_groups, EntropyFields)
    field_defaults = {"policy_loss": "entropy_bonus"}
