"""The preference side of a module (``module.pairs``): what MADPO trains on and MARLHF's reward model learns from.

Users give tasks, not preferences. When a fit starts the module hands its ``PreferenceDataModule`` one
``PairPlan`` (:meth:`Pairs.attach`): the team policy that samples ``preference_num_candidates`` aligned joint
candidates per task (single turn, the task reward as the oracle), the selection rules, the pairs per update and
the passes over them; the data module collects and serves the pairs. An iterative variant adds its rounds
(``rounds_class``: ``module.rounds``, ``algorithms/iterative.py``: comparator, replay, the fit's epochs); this object
runs their checks, callbacks and checkpoint entry for the module that composes it.
"""

from __future__ import annotations

from typing import Any

from comlrl_lightning.algorithms.fields import require
from comlrl_lightning.core.pairs import PreferencePair
from comlrl_lightning.data.preferences import PairPlan, PreferenceDataModule
from comlrl_lightning.rollout.policy import TeamPolicy


class Pairs:
    """``module.pairs``: the module's pair collection (module docstring). ``batch_size`` pairs per update,
    ``passes`` over them per pair epoch; ``pair_epochs`` (MARLHF: 1) makes only that many epochs serve pairs."""

    def __init__(self, module: Any, batch_size: int, passes: int = 1, pair_epochs: int | None = None):
        self.module, self.batch_size, self.passes, self.pair_epochs = module, batch_size, passes, pair_epochs
        self.rounds = module.rounds_class(module) if module.rounds_class is not None else None
        self.last_batch: list[PreferencePair] = []
        self._policy: TeamPolicy | None = None

    def check(self) -> None:
        """The rules of pair collection (the fields alone: they may run before the team is assembled), and an
        iterative variant's (:meth:`check_rounds`, once it is), before any model loads."""
        m = self.module
        require(m.num_turns == 1, f"{m.algorithm_name} currently supports num_turns=1 only.")
        require(
            m.joint_mode == "aligned",
            getattr(
                m,
                "aligned_only",
                f"{m.algorithm_name} preference generation currently supports aligned joint_mode only.",
            )
            + f" Got joint_mode={m.joint_mode!r}.",
        )
        require(
            m.pair_selection in m.pair_selections,
            f"pair_selection must be one of: {', '.join(m.pair_selections)} (got {m.pair_selection!r}).",
        )

    def check_rounds(self) -> None:
        if self.rounds is not None:
            self.rounds.check()

    @property
    def policy(self) -> TeamPolicy:
        """The team as the data side sees it: the live agents sampling K_c aligned candidates per task, the task
        reward as the oracle; built once the models are loaded."""
        if self._policy is None:
            m = self.module
            engine = m.make_engine(num_generations=m.preference_num_candidates, num_turns=1, joint_mode="aligned")
            self._policy = TeamPolicy(
                engine, m.policy_models(), m.tokenizers, reward=m.task_reward, collaboration=m.collaboration
            )
        return self._policy

    def plan(self) -> PairPlan:
        """What ``PreferenceDataModule`` collects and serves for this module."""
        m = self.module
        plan = PairPlan(
            self.policy,
            m.preference_num_candidates,
            m.pair_selection,
            m.preference_pairs_per_sample,
            self.batch_size,
            passes=self.passes,
            name=m.algorithm_name,
            whole=m.sharded_models(),
            pair_epochs=self.pair_epochs,
        )
        return self.rounds.extend(plan) if self.rounds is not None else plan

    def attach(self, data: Any) -> None:
        """Hand the plan to the fit's data module (when the fit starts: the models are loaded)."""
        if not isinstance(data, PreferenceDataModule):
            raise TypeError(
                f"{self.module.algorithm_name} trains on preference pairs its data module collects: use "
                f"comlrl_lightning.PreferenceDataModule as the data (got {type(data).__name__})."
            )
        data.attach(self.plan())

    def is_empty_round(self, batch: list[Any]) -> bool:
        """The no-op batch ``PreferenceDataModule`` serves for a round without pairs (every rank's is empty)."""
        return self.rounds is not None and not batch

    def records(self, max_nodes: int) -> list[dict[str, Any]]:
        """What the agents wrote in the last batch of pairs (``CompletionsLogger``)."""
        return [
            {
                "env_step": self.module.env_step,
                "turn": 1,
                "prompts": p.prompts,
                "completions": [[w, l] for w, l in zip(p.winner_completions, p.loser_completions)],
                "rewards": [p.winner_reward, p.loser_reward],
            }
            for p in self.last_batch[:max_nodes]
        ]

    # ------------------------------------------------------------------ an iterative variant's rounds
    def fit_epochs(self) -> int | None:
        return self.rounds.fit_epochs() if self.rounds is not None else None

    def setup(self, trainer: Any, stage: str) -> None:
        if stage == "fit" and self.rounds is not None:
            self.rounds.fix_epochs(trainer)

    def callbacks(self) -> list[Any]:
        return self.rounds.callbacks() if self.rounds is not None else []

    def save(self, state: dict[str, Any]) -> None:
        """Into the checkpoint's ``state``: the rounds' folders."""
        if self.rounds is not None:
            state["iterative"] = self.rounds.state_dict()

    def load(self, state: dict[str, Any]) -> None:
        if state.get("iterative") and self.rounds is not None:
            self.rounds.load_state_dict(state["iterative"])
