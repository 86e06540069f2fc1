"""MAGRPO with an entropy bonus: the loss subtracts β·Σ_t w_t·H_t, the policy's entropy at each completion token
weighted as the policy term is (docs/new_algorithm.md). One flag asks scoring for the entropy; one field, one
override."""

from typing import Any

from comlrl_lightning.algorithms import MAGRPO


class EntropyMAGRPO(MAGRPO):
    """Args:
    entropy_coef: β, the weight of the entropy bonus."""

    needs_token_entropy = True  # scoring returns H_t beside log π (PolicyBatch.entropy)

    def __init__(self, entropy_coef: float = 0.01, **kwargs: Any):
        self._store(EntropyMAGRPO.__init__, locals())
        super().__init__(**kwargs)

    def policy_loss(self, agent, logp, batch):
        loss, diagnostics = super().policy_loss(agent, logp, batch)
        bonus = (batch.weights.to(logp.device) * batch.entropy).sum()
        return loss - self.entropy_coef * bonus, {**diagnostics, "entropy_bonus": bonus.detach()}
