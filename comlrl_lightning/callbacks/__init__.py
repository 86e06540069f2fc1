"""Optional parts of a run, as Lightning callbacks (the algorithm adds the ones its config turns on)."""

from comlrl_lightning.callbacks.checkpoints import RunCheckpoints
from comlrl_lightning.callbacks.completions import CompletionsLogger
from comlrl_lightning.callbacks.evaluation import EvaluationCallback
from comlrl_lightning.callbacks.policy_checkpoints import PolicyCheckpoints
from comlrl_lightning.callbacks.predictions import PredictionWriter
from comlrl_lightning.callbacks.reference import ReferenceModels
from comlrl_lightning.callbacks.rounds import RoundMetrics
from comlrl_lightning.callbacks.timing import PhaseTimer

__all__ = [
    "RunCheckpoints",
    "CompletionsLogger",
    "EvaluationCallback",
    "PhaseTimer",
    "PolicyCheckpoints",
    "PredictionWriter",
    "ReferenceModels",
    "RoundMetrics",
]
