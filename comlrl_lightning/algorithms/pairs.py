"""The preference side of a module (``module.pairs``): what MADPO trains on and MARLHF's reward model learns from.

Users give tasks, not preferences. When a fit starts the module hands its ``PreferenceDataModule`` one
``PairPlan`` (:meth:`Pairs.attach`): the team policy that samples ``preference_num_candidates`` aligned joint
candidates per task (single turn, the task reward as the oracle), the selection rules, the pairs per update and
the passes over them; the data module collects and serves the pairs. An iterative variant adds its rounds
(``rounds_class``: ``module.rounds``, ``algorithms/iterative.py``: comparator, replay, the fit's epochs); this object
runs their checks, callbacks and checkpoint entry for the module that composes it.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch
from torch import Tensor

from comlrl_lightning.algorithms.fields import require
from comlrl_lightning.core.pairs import PreferencePair
from comlrl_lightning.data.preferences import PairPlan, PreferenceDataModule
from comlrl_lightning.rollout.policy import TeamPolicy
from comlrl_lightning.rollout.sampling import ScoringInputs, micro_batches


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
        # pair_selection needs no rule here: its field's type lists the choices (PreferenceFields: core/pairs.py's;
        # the iterative variants', IterativePreferenceFields: core/replay.py's) and rejects any other value.

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


def pair_micro_batches(
    num_pairs: int,
    max_pairs: int | None,
    max_tokens: int | None = None,
    prompt_lengths: Sequence[int] = (),
    width: int = 0,
    groups: Sequence[Hashable] | None = None,
    share_prompts: bool = False,
) -> list[slice | Tensor]:
    """The pairs of each forward of one preference update (MADPO's margins, MARLHF's reward model), planned by the
    on-policy planner (``rollout.sampling.micro_batches``). A micro-batch of pairs is their winner and loser rows, in
    one forward: at most ``max_pairs`` pairs (``micro_batch_size``; null: no limit) and, with ``max_tokens``
    (``micro_batch_tokens``), at most that many tokens in a forward — a pair over the budget is a micro-batch of its
    own. Pair j's two rows are a prompt of ``prompt_lengths[j]`` tokens followed by at most ``width`` tokens (padded
    to the micro-batch's longest, as a forward pads them); with ``share_prompts``, pairs of one ``groups`` key share
    their prompt, encoded once (``token_logprobs``), so a micro-batch costs each distinct prompt once plus ``2·width``
    per pair, else ``2 × (prompt + width)`` per pair — what ``forward_tokens`` counts. ``prompt_lengths`` (only read
    with a token budget) should be a pair's longest over the forwards it takes part in (one per agent), so the
    budget holds for each. Returned as :func:`micro_batches` returns rows (slices, or index tensors with a budget)."""
    if max_tokens is None or num_pairs == 0:
        step = max_pairs or max(num_pairs, 1)
        return [slice(s, min(s + step, num_pairs)) for s in range(0, num_pairs, step)]
    # One planning row per pair: its prompt (ids = its group's index, so pairs of one group count as sharing it)
    # and a completion of 2·width tokens (both rows' continuations), or, not shared, of width tokens at half the
    # budget (2 × (prompt + width) <= budget).
    lengths = torch.as_tensor(list(prompt_lengths), dtype=torch.long)
    keys = list(groups) if groups is not None else list(range(num_pairs))
    index = {key: k for k, key in enumerate(dict.fromkeys(keys))}
    group = torch.tensor([index[key] for key in keys], dtype=torch.long)
    prompt_width = int(lengths.max())
    shared = share_prompts and int(lengths.min()) >= 2  # token_logprobs shares no prompt of one token
    tail = 2 * width if shared else width
    prompt_mask = torch.arange(prompt_width) >= (prompt_width - lengths)[:, None]  # left-padded prompts
    attention_mask = torch.cat([prompt_mask.long(), torch.ones(num_pairs, tail, dtype=torch.long)], dim=1)
    completion_ids = torch.zeros(num_pairs, tail, dtype=torch.long)
    plan = ScoringInputs(
        input_ids=torch.cat([torch.where(prompt_mask, group[:, None], 0), completion_ids], dim=1),
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp_min(0),
        completion_ids=completion_ids,
        completion_mask=torch.ones(num_pairs, tail, dtype=torch.bool),
    )
    return micro_batches(plan, max_pairs, max_tokens if shared else max_tokens // 2, shared)
