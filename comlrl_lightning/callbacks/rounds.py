"""RoundMetrics: what each round of iterative preference training collected, for the loggers (docs/iterative.md).

When a round's pairs are ready (``PreferenceDataModule.last_round``, before its first training batch) it logs
``iter/*``: the round, new/total/training pair counts, both sides' mean raw reward, the current policy's win and
tie rates, and parse failures of joint answers. With ``reward_range`` (``log_reward_distribution``) it also
writes ``reward_distributions/iteration_XXXX.json`` (histograms of both sides' raw rewards and of the training
pairs'), the same histograms as SVG charts beside it, as HTML panels in W&B and as TensorBoard histograms.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback

from comlrl_lightning.callbacks.charts import CHART_KINDS, svg_chart
from comlrl_lightning.core.distributions import distribution_metrics, distribution_record
from comlrl_lightning.data.rounds import RoundReport
from comlrl_lightning.runs.files import RunDirectories, write_json_atomic


class RoundMetrics(Callback):
    """Logs each round's report once (added by the iterative modules).

    Args:
        reward_range: (low, high) of the task reward: also write and log reward distributions (None: don't).
    """

    def __init__(self, reward_range: tuple[float, float] | None = None):
        self.reward_range = reward_range
        self.dirs = RunDirectories()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        report: RoundReport | None = getattr(trainer.datamodule, "last_round", None)
        if report is None or report.logged:
            return
        report.logged = True
        metrics, plots = round_metrics(report, pl_module.env_step), {}
        if self.reward_range is not None and trainer.is_global_zero:
            plots = self.write_distributions(trainer, report, metrics)
        metrics = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            if plots and type(logger).__name__ == "WandbLogger":
                import wandb

                logger.experiment.log({k: wandb.Html(v) for k, v in plots.items()}, commit=False)
            if plots and type(logger).__name__ == "TensorBoardLogger":
                for side, values in (("target", report.target_raw), ("comparator", report.comparator_raw)):
                    if values:
                        logger.experiment.add_histogram(
                            f"iter/reward_distribution/{side}", torch.tensor(values), global_step=report.iteration + 1
                        )
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})

    def write_distributions(self, trainer, report: RoundReport, metrics: dict[str, float]) -> dict[str, str]:
        """The round's distribution record and charts as files; adds the distribution metrics; returns the
        charts (SVG) by panel name."""
        low, high = self.reward_range
        label = f"iteration_{report.iteration + 1:04d}"
        record = distribution_record(
            report.iteration + 1,
            low,
            high,
            target=report.target_raw,
            comparator=report.comparator_raw,
            selected_target=[p.target_raw_reward for p in report.train if p.target_raw_reward is not None],
            selected_comparator=[p.comparator_raw_reward for p in report.train if p.comparator_raw_reward is not None],
        )
        directory = self.dirs.get(trainer, "reward_distributions")
        write_json_atomic(record, directory / f"{label}.json")
        metrics.update(distribution_metrics(record, pair_count=len(report.train)))
        plots = {}
        for part, prefix in (
            ("candidate", "iter/reward_distribution"),
            ("selected", "iter/selected_reward_distribution"),
        ):
            for kind in CHART_KINDS:
                svg = svg_chart(record[part], record["bin_edges"], kind)
                plots[f"{prefix}/{label}/{kind}_plot"] = svg
                # The same chart as a file, for loggers without HTML panels (CSV, TensorBoard).
                (directory / f"{label}_{part}_{kind}.svg").write_text(svg, encoding="utf-8")
        return plots

    def state_dict(self) -> dict[str, Any]:
        return {"run_dirs": self.dirs.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dirs.load_state_dict(state_dict.get("run_dirs", {}))


def round_metrics(report: RoundReport, env_step: int) -> dict[str, float]:
    """``iter/*`` of one round."""
    wins, losses, ties = report.outcomes
    comparisons = max(wins + losses + ties, 1)
    metrics = {
        "iter/current_iteration": float(report.iteration + 1),
        "iter/current_preference_pairs": float(len(report.fresh)),
        "iter/total_preference_pairs": float(report.total_pairs),
        "iter/train_preference_pairs": float(len(report.train)),
        "iter/target_reward_mean": _mean(report.target_raw),
        "iter/comparator_reward_mean": _mean(report.comparator_raw),
        "iter/current_win_rate": wins / comparisons,
        "iter/tie_rate": ties / comparisons,
        "env_step": float(env_step),
    }
    if report.comparator_parse_failures is not None:
        metrics["iter/comparator_parse_failures"] = float(report.comparator_parse_failures)
    if report.collaboration_parse_failures is not None:
        metrics["iter/collaboration_parse_failures"] = float(report.collaboration_parse_failures)
    return metrics


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
