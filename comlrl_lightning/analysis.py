"""Read a finished (or running) run back and plot it: metrics, reward histograms per round, what the agents wrote.

    from comlrl_lightning.analysis import load_run, plot_run
    run = load_run("outputs/magrpo")              # newest training run under it (a resumed one joined to its start),
                                                   # or a version_N folder, or the file itself
    plot_run(run, "rewards")                       # a matplotlib Figure; kinds: see ``PLOT_KINDS``
    plot_run(run, ["lengths", "kl", "timing"])    # several kinds in one figure

``load_run`` reads Lightning's ``CSVLogger`` file (``metrics.csv``) or, where there is none, the TensorBoard
event files of a ``TensorBoardLogger`` run. The metric names are the ones the modules log (README "Metrics",
docs/iterative.md "Metrics"); the x-axis is ``env_step``, the joint actions evaluated so far — the x-axis of the
CoMLRL paper (Liu et al., arXiv:2508.04652) — or Lightning's ``step`` for a run that did not log it. A row at
``step`` s is update s+1 (made from the samples of the weights after s updates) or an evaluation of the weights
after s updates (docs/algorithms.md#metrics-and-steps).

A folder holds training runs (``<name>/version_<n>/``) and the evaluations of them (``validate``, ``test`` and
``predict`` log into ``<run>/<subcommand>/version_<m>/``): ``load_run`` on a folder takes the newest training run,
and a run resumed from a checkpoint (``resumed_from.txt`` in its folder names it) is joined to the run it resumed,
back to its start; it prints (``verbose``) and records (``frame.attrs["run_dirs"]``) the folders it read.
"""

from __future__ import annotations

import io
import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from comlrl_lightning.callbacks.charts import COMPARATOR_COLOR, TARGET_COLOR
from comlrl_lightning.core.distributions import SIDES
from comlrl_lightning.runs.files import RESUMED_FROM

__all__ = [
    "PLOT_KINDS",
    "RunFigure",
    "load_run",
    "load_reward_distributions",
    "predictions_table",
    "plot_run",
    "plot_reward_distributions",
    "find_run_file",
]

CSV_NAME = "metrics.csv"
EVENTS_GLOB = "events.out.tfevents.*"
DISTRIBUTIONS_DIR = "reward_distributions"
EVALUATION_FOLDERS = ("validate", "test", "predict")  # <run>/<subcommand>/version_<m>/: evaluations, not training


# ---------------------------------------------------------------------------------------------------- loading
def find_run_file(path: str | Path) -> Path:
    """The metrics source of a run: ``path`` itself if it is a ``metrics.csv`` or an event file, else the newest
    ``metrics.csv`` of a *training* run under ``path``, else the newest folder of TensorBoard event files under it
    (returned as that folder). Evaluation runs (``<run>/validate|test|predict/version_<m>/``) are taken only when
    ``path`` holds nothing else (or is one). Pass a ``version_N`` folder to choose a run."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"Run path {str(path)!r} does not exist.")
    if path.is_file():
        if path.name == CSV_NAME or path.match(EVENTS_GLOB):
            return path
        raise ValueError(
            f"Run path {str(path)!r} is neither a {CSV_NAME} nor a TensorBoard event file ({EVENTS_GLOB})."
        )
    sources = list(path.rglob(CSV_NAME)) or list({e.parent for e in path.rglob(EVENTS_GLOB)})
    if not sources:
        raise FileNotFoundError(
            f"No {CSV_NAME} (CSVLogger) or TensorBoard event file ({EVENTS_GLOB}, TensorBoardLogger) under "
            f"{str(path)!r}. A run writes them under <trainer.default_root_dir>/<name>/version_<n>/."
        )
    training = [s for s in sources if not _is_evaluation(s)]
    return max(training or sources, key=_written)


def _folder(source: Path) -> Path:
    return source if source.is_dir() else source.parent


def _written(source: Path) -> float:
    return (
        max((p.stat().st_mtime for p in source.glob(EVENTS_GLOB)), default=0.0)
        if source.is_dir()
        else source.stat().st_mtime
    )


def _is_evaluation(source: Path) -> bool:
    """An evaluation run (``validate``/``test``): a ``metrics.csv`` with only ``eval/``/``test/`` metrics, or event
    files in a ``<run>/validate|test/version_<m>/`` folder."""
    if source.is_file():
        with source.open(encoding="utf-8") as f:
            header = f.readline().strip().split(",")
        return all(c in ("step", "epoch", "env_step") or c.startswith(("eval/", "test/")) for c in header if c)
    return source.parent.name in EVALUATION_FOLDERS and source.name.startswith("version_")


def _source_in(folder: Path) -> Path | None:
    """The metrics source in a run folder itself (not below it)."""
    if (folder / CSV_NAME).is_file():
        return folder / CSV_NAME
    return folder if any(folder.glob(EVENTS_GLOB)) else None


def _resumed_from(folder: Path) -> Path | None:
    """The run folder the run in ``folder`` resumed from (its ``resumed_from.txt`` names the checkpoint), if any; a
    run folder moved since is looked for beside ``folder`` under its old name."""
    marker = folder / RESUMED_FROM
    if not marker.is_file():
        return None
    checkpoint = Path(marker.read_text(encoding="utf-8").strip())
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    for candidate in (run, folder.parent / run.name):
        if candidate != folder and _source_in(candidate) is not None:
            return candidate
    return None


def load_run(path: str | Path, verbose: bool = True) -> pd.DataFrame:
    """A run's logged metrics, one row per update or evaluation, one column per metric (NaN where a row lacks it).

    ``path``: a run directory (any folder above its files works: the newest training run is taken, see
    ``find_run_file``), a ``metrics.csv`` or a TensorBoard event file. A run resumed from a checkpoint is joined to
    the runs before it, back to its start (rows an interrupted run logged after the checkpoint it was resumed from
    are dropped: the resumed run did those updates again). The index is ``env_step`` when the run logged it (rows
    logged without it, if any, take the previous row's value), else Lightning's ``step``; the ``step`` column is
    kept. ``frame.attrs``: ``source`` (the file or folder read last), ``run_dir`` (its folder), ``sources`` and
    ``run_dirs`` (every part, oldest first). ``verbose`` prints which folders were read.
    """
    source = find_run_file(path)
    chain = [source]
    while (previous := _resumed_from(_folder(chain[0]))) is not None and previous not in {_folder(s) for s in chain}:
        chain.insert(0, _source_in(previous))
    frames = [_read_csv(s) if s.name == CSV_NAME else _read_events(s) for s in chain]
    for i in range(len(frames) - 1):  # an earlier part up to where the next one started again
        if not frames[i + 1].empty and "step" in frames[i]:
            frames[i] = frames[i][frames[i]["step"] < frames[i + 1]["step"].min()]
    frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    if frame.empty:
        raise ValueError(f"The run file {str(source)!r} holds no metrics yet.")
    if "env_step" in frame and frame["env_step"].notna().any():
        frame["env_step"] = frame["env_step"].ffill().fillna(0.0)
        frame = frame.set_index("env_step")
    else:
        frame = frame.drop(columns=["env_step"], errors="ignore").set_index("step", drop=False)
        frame.index.name = "step"
    frame.attrs["source"] = str(source)
    frame.attrs["run_dir"] = str(_folder(source))
    frame.attrs["sources"] = [str(s) for s in chain]
    frame.attrs["run_dirs"] = [str(_folder(s)) for s in chain]
    if verbose:
        parts = [
            f"{_folder(s)} (steps {int(f['step'].min())}-{int(f['step'].max())})"
            if len(f) and "step" in f
            else str(_folder(s))
            for s, f in zip(chain, frames)
        ]
        print(f"load_run: read {' + '.join(parts)}" + (" (a resumed run, joined)" if len(chain) > 1 else ""))
    return frame


def _read_csv(path: Path) -> pd.DataFrame:
    frame = pd.read_csv(path)
    if "step" not in frame:
        raise ValueError(f"{str(path)!r} has no 'step' column: not a Lightning CSVLogger {CSV_NAME}.")
    return frame


def _read_events(folder: Path) -> pd.DataFrame:
    """TensorBoard scalars as rows like the CSV's. TensorBoard stores one (wall time, step, value) per metric, not
    rows; every logging call of this package carries ``env_step``, so each ``env_step`` event marks one row and a
    metric belongs to the row of its step whose ``env_step`` was written nearest in time (an evaluation and an
    update logged at the same step are a training step apart; one call's scalars are written together)."""
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    events = pd.DataFrame(
        [
            (e.wall_time, e.step, tag, e.value)
            for tag in accumulator.Tags()["scalars"]
            for e in accumulator.Scalars(tag)
        ],
        columns=["wall_time", "step", "tag", "value"],
    )
    if events.empty:
        return events
    events = events.sort_values("wall_time", kind="stable").reset_index(drop=True)
    anchors = events[events["tag"] == "env_step"][["wall_time", "step"]].reset_index(drop=True)
    anchors["row"] = range(len(anchors))
    if len(anchors):
        events = pd.merge_asof(
            events,
            anchors.rename(columns={"wall_time": "anchor_time"}),
            left_on="wall_time",
            right_on="anchor_time",
            by="step",
            direction="nearest",
        )
    else:
        events["row"] = float("nan")
    orphans = events["row"].isna()  # steps without any env_step: one row per step
    events.loc[orphans, "row"] = len(anchors) + events.loc[orphans, "step"].rank(method="dense") - 1
    frame = events.pivot_table(index="row", columns="tag", values="value", aggfunc="last")
    order = events.groupby("row").agg(step=("step", "first"), wall_time=("wall_time", "min"))
    frame = frame.join(order).sort_values(["step", "wall_time"], kind="stable").drop(columns="wall_time")
    frame.columns.name = None
    return frame.reset_index(drop=True)


def load_reward_distributions(path: str | Path) -> list[dict[str, Any]]:
    """The per-round reward histograms an iterative run wrote (``reward_distributions/iteration_XXXX.json``, with
    ``log_reward_distribution: true``; docs/iterative.md), sorted by round. ``path``: the run directory, a folder
    above it, or the ``reward_distributions`` folder."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"Run path {str(path)!r} does not exist.")
    files = (
        sorted(path.glob("iteration_*.json"))
        if path.name == DISTRIBUTIONS_DIR
        else sorted(path.rglob(f"{DISTRIBUTIONS_DIR}/iteration_*.json"))
    )
    if not files:
        raise FileNotFoundError(
            f"No {DISTRIBUTIONS_DIR}/iteration_XXXX.json under {str(path)!r}: only MADPOIter/MARLHFIter runs with "
            "log_reward_distribution=true (and a reward_func.reward_range) write them."
        )
    records = [json.loads(f.read_text(encoding="utf-8")) for f in files]
    return sorted(records, key=lambda r: r["iteration"])


def predictions_table(predictions: Iterable[Any] | str | Path) -> pd.DataFrame:
    """What a team answered, one row per item and turn: the item's ``prompt`` (or the whole item), ``turn``, one
    column per agent (``agent_0``, ...) and the team ``reward``.

    ``predictions``: what ``Trainer.predict(module, datamodule=...)`` returns (a list of batches of answers, see
    ``MultiAgentModule.predict_step``), a flat list of answers, or the ``predictions.jsonl`` the ``predict``
    subcommand writes."""
    if isinstance(predictions, (str, Path)):
        lines = Path(predictions).expanduser().read_text(encoding="utf-8").splitlines()
        answers = [json.loads(line) for line in lines if line.strip()]
    else:
        answers = [a for batch in predictions for a in (batch if isinstance(batch, list) else [batch])]
    rows = []
    for answer in answers:
        if not isinstance(answer, dict) or not {"item", "agents", "rewards"} <= set(answer):
            raise ValueError(
                "predictions must be Trainer.predict's answers: dicts with 'item', 'agents' and "
                f"'rewards' (got {type(answer).__name__})."
            )
        item = answer["item"]
        label = item.get("prompt", json.dumps(item, default=str)) if isinstance(item, dict) else str(item)
        for t, reward in enumerate(answer["rewards"]):
            row = {"prompt": label, "turn": t + 1}
            row.update({f"agent_{i}": agent["completions"][t] for i, agent in enumerate(answer["agents"])})
            rows.append({**row, "reward": reward})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------- plotting
class RunFigure(Figure):
    """A matplotlib ``Figure`` that Jupyter shows as a PNG when it is a cell's value, without ``pyplot``: nothing
    is kept in pyplot's global figure list, so a figure is shown once and freed with its last reference. Save it
    with ``savefig`` as any figure."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", bbox_inches="tight")
        return buffer.getvalue()


@dataclass(frozen=True)
class Panel:
    """One chart: the metrics whose names match ``pattern`` (a regular expression), on one y-axis."""

    title: str
    pattern: str
    ylabel: str
    stacked: bool = False  # stacked areas (parts of a whole, e.g. time per phase) instead of lines
    x: str | None = None  # a column to draw against instead of the run's index (e.g. the round number)


_TURN = r"turn_\d+"
PLOT_KINDS: dict[str, tuple[Panel, ...]] = {
    "rewards": (Panel("team reward", rf"^(rollout/)?{_TURN}/reward_mean$", "team reward"),),
    "eval": (Panel("evaluation", r"^eval/", "value"),),
    "lengths": (
        Panel("completion length", r"^completions/mean_length$", "tokens"),
        Panel("completions cut at max_new_tokens", r"^completions/clipped_ratio$", "fraction"),
    ),
    # The quantities advantages are built from: returns (G), and for actor-critic the critic's value and target
    # (A = target − V); then the advantages' own statistics, and the share of samples without a learning signal.
    "advantages": (
        Panel("returns and critic values", rf"^{_TURN}/(expected_return|value_pred_mean|value_target_mean)$", "value"),
        Panel("advantages", r"advantage_(mean|std)$", "advantage"),
        Panel("samples with advantage 0", r"zero_advantage_ratio$", "fraction"),
    ),
    "kl": (
        Panel("KL to the reference", rf"^{_TURN}/reference_kl_mean$", "KL (nats)"),
        Panel("KL penalty", rf"^{_TURN}/reference_kl_penalty_mean$", "β · KL"),
    ),
    "timing": (Panel("time per phase", r"^timing_s/", "seconds per update", stacked=True),),
    "policy_lag": (Panel("policy lag (0 = on-policy)", r"^rollout/policy_lag$", "updates"),),
    "loss": (
        Panel("loss", r"^(loss|agent_\d+/loss|turn_\d+/(policy|value)_loss)$", "loss"),
        Panel("gradient norm", r"^(agent|critic)_\d+/grad_norm$", "norm"),
    ),
    "dpo": (
        Panel("DPO accuracy", r"^dpo/accuracy$", "fraction of pairs"),
        Panel("DPO margins", r"^(dpo/joint_margin_mean|agent_\d+/margin_mean)$", "log-likelihood margin"),
        Panel("reward gap of the pairs", r"^dpo/reward_gap_mean$", "reward"),
    ),
    "reward_model": (
        Panel("reward-model accuracy", r"^reward_model/accuracy$", "fraction of pairs"),
        Panel("reward-model loss", r"^reward_model/loss$", "Bradley–Terry loss"),
        Panel("reward-model margin", r"^reward_model/margin_mean$", "score margin"),
    ),
    "iterations": tuple(
        Panel(title, pattern, ylabel, x="iter/current_iteration")
        for title, pattern, ylabel in (
            ("reward per round", r"^iter/(target|comparator)_reward_mean$", "raw reward"),
            ("current vs comparator", r"^iter/(current_win_rate|tie_rate)$", "rate"),
            ("pairs per round", r"^iter/(current|train|total)_preference_pairs$", "pairs"),
        )
    ),
}


def plot_run(
    run: pd.DataFrame | str | Path, kind: str | Sequence[str] = "rewards", *, title: str | None = None
) -> Figure:
    """A Figure of one kind of metric (or several kinds, one chart each) against the run's x-axis.

    ``run``: ``load_run``'s frame or anything ``load_run`` accepts. ``kind``: a key of ``PLOT_KINDS`` — ``rewards``
    (team reward of the sampled rollouts ± one standard deviation, and of the updated nodes), ``eval``, ``lengths``,
    ``advantages`` (returns and critic values), ``kl``, ``timing`` (seconds per phase, stacked), ``policy_lag``,
    ``loss``, ``dpo``, ``reward_model``, ``iterations`` — or a list of them. Charts whose metrics the run did
    not log are left out with a warning naming them; if none is left the figure says so instead of raising.
    """
    frame = run if isinstance(run, pd.DataFrame) else load_run(run)
    kinds = [kind] if isinstance(kind, str) else list(kind)
    for k in kinds:
        if k not in PLOT_KINDS:
            raise ValueError(f"kind must be one of {sorted(PLOT_KINDS)}, got {k!r}.")
    panels = [(p, _matching(frame, p.pattern)) for k in kinds for p in PLOT_KINDS[k]]
    missing = [p for p, columns in panels if not columns]
    panels = [(p, columns) for p, columns in panels if columns]
    if missing:
        warnings.warn(
            f"This run logged no metric for {', '.join(repr(p.title) for p in missing)} "
            f"(looked for {', '.join(p.pattern for p in missing)}); left out of the figure.",
            stacklevel=2,
        )
    if not panels:
        figure = RunFigure(figsize=(6, 1.5))
        figure.text(
            0.5,
            0.5,
            f"Nothing to plot for {', '.join(kinds)}: the run logged none of these metrics.",
            ha="center",
            va="center",
            wrap=True,
        )
        return figure
    ncols = min(len(panels), 2)
    nrows = math.ceil(len(panels) / ncols)
    figure = RunFigure(figsize=(7.4 * ncols, 3.4 * nrows), layout="constrained")
    axes = figure.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (panel, columns) in zip(axes, panels):
        _draw(ax, frame, panel, columns)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if title:
        figure.suptitle(title)
    return figure


def _matching(frame: pd.DataFrame, pattern: str) -> list[str]:
    regex = re.compile(pattern)
    return [c for c in frame.columns if regex.search(str(c)) and frame[c].notna().any()]


def _x_axis(frame: pd.DataFrame, panel: Panel, columns: list[str]) -> pd.DataFrame:
    """The frame indexed by the panel's x: its own column if it has one, else the run's index — but Lightning's
    ``step`` where a metric was logged several times at one ``env_step`` (updates that evaluate no joint action,
    such as MARLHF's reward-model updates)."""
    if panel.x is not None and panel.x in frame:
        return frame.dropna(subset=[panel.x]).set_index(panel.x, drop=False)
    if frame.index.name != "step" and "step" in frame and any(frame[c].dropna().index.has_duplicates for c in columns):
        return frame.set_index("step", drop=False)
    return frame


def _draw(ax: Any, frame: pd.DataFrame, panel: Panel, columns: list[str]) -> None:
    frame = _x_axis(frame, panel, columns)
    if panel.stacked:
        parts = frame[columns].dropna(how="all").fillna(0.0)
        ax.stackplot(parts.index, parts.T.to_numpy(), labels=[c.split("/")[-1] for c in columns], alpha=0.85)
    else:
        for column in columns:  # one line and one legend entry per metric, even where two happen to be equal
            series = frame[column].dropna()
            (line,) = ax.plot(series.index, series.to_numpy(), marker="." if len(series) < 60 else None, label=column)
            spread = column.removesuffix("reward_mean") + "reward_std"  # a rollout reward's standard deviation
            if column.endswith("reward_mean") and spread in frame:
                both = frame[[column, spread]].dropna()
                ax.fill_between(
                    both.index,
                    both[column] - both[spread],
                    both[column] + both[spread],
                    color=line.get_color(),
                    alpha=0.15,
                    linewidth=0,
                )
    ax.set_title(panel.title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps, joint actions and rounds are counts
    ax.set_xlabel({"iter/current_iteration": "round"}.get(frame.index.name, frame.index.name or "step"))
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    # Beside the chart, never over the data; constrained layout makes room for it.
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def plot_reward_distributions(run: str | Path | Sequence[dict[str, Any]], part: str = "candidate") -> Figure:
    """Reward histograms per round of an iterative run: the current policy's ("target") candidates against the
    comparator's, one chart per round (``part="candidate"``: every candidate; ``"selected"``: the training pairs).
    ``run``: a run directory or ``load_reward_distributions``' records."""
    if part not in ("candidate", "selected"):
        raise ValueError(f"part must be one of ['candidate', 'selected'], got {part!r}.")
    records = load_reward_distributions(run) if isinstance(run, (str, Path)) else list(run)
    if not records:
        raise ValueError("No reward-distribution records to plot.")
    figure = RunFigure(figsize=(4.2 * len(records), 3.2), layout="constrained")
    axes = figure.subplots(1, len(records), squeeze=False)[0]
    for ax, record in zip(axes, records):
        edges = record["bin_edges"]
        width = (edges[1] - edges[0]) / 2
        for offset, side, color in zip((0.0, width), SIDES, (TARGET_COLOR, COMPARATOR_COLOR)):
            stats = record[part][side]
            mean = "" if stats["mean"] is None else f", mean {stats['mean']:.2f}"
            ax.bar(
                [e + offset for e in edges[:-1]],
                stats["counts"],
                width=width,
                align="edge",
                color=color,
                label=f"{side} (n={stats['sample_count']}{mean})",
            )
        ax.set_ylim(0, 1.45 * max(1, *(max(record[part][side]["counts"]) for side in SIDES)))
        ax.set_title(f"round {record['iteration']}")
        ax.set_xlabel("raw reward")
        ax.set_ylabel("count")
        ax.legend(fontsize="small")
    figure.suptitle("reward distribution: " + ("all candidates" if part == "candidate" else "training pairs"))
    return figure
