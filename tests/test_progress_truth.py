"""What a run says about itself (issue: truthful progress): a resumed run counts the updates it did, the rich bar's
time left comes from the measured seconds per update, an evaluation names the unit the bar counts, and a log file
gets a line at least every ``min_interval`` seconds in every phase."""

from __future__ import annotations

import io
import time
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest

from comlrl_lightning.callbacks import progress
from comlrl_lightning.callbacks.progress import UpdateLineProgressBar, evaluation_label, training_done


def fake_trainer(step: int, max_steps: int = 24) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, max_steps=max_steps, max_epochs=-1, is_global_zero=True)


def test_a_resumed_run_counts_the_updates_it_did_and_those_in_all():
    """A run resumed at update 3 that stopped at 5 printed "training done: 5 updates"."""
    assert training_done(fake_trainer(5), 3, 100.0) == "training done: 2 updates this run (5 in all) in 1m40s"
    assert training_done(fake_trainer(5), 0, 42.0) == "training done: 5 updates in 42s"


def test_an_evaluation_names_what_the_bar_counts():
    """ "Evaluating 4 items ... 0/24" beside a count of updates: the label now says whose count it is."""
    assert evaluation_label(fake_trainer(3), 4) == "Update 3: evaluating 4 items"


@pytest.mark.skipif(not progress._RICH_AVAILABLE, reason="rich is not installed")
def test_the_rich_bar_shows_the_time_left_from_the_measured_pace():
    """Rich estimates from the last 30 s only: with updates slower than that it showed ``-:--:--`` forever."""
    column = progress.UpdateTimeColumn(style="")
    task = SimpleNamespace(fields={"eta": 750.0}, finished=False, elapsed=250.0, finished_time=None)
    assert column.render(task).plain == "0:04:10 • 0:12:30"
    task = SimpleNamespace(fields={}, finished=False, elapsed=5.0, finished_time=None, time_remaining=None)
    assert column.render(task).plain == "0:00:05 • -:--:--"  # before the first update: nothing measured yet


def test_a_log_file_gets_a_line_in_every_phase_at_least_every_interval():
    """Between "training: 5 updates, from update 3" and the first update line a redirected log was silent for 4
    minutes (a first rollout, an evaluation): now a heartbeat line names what the run is in and for how long."""
    bar = UpdateLineProgressBar(min_interval=0.2)
    trainer = fake_trainer(3, 5)
    bar._trainer = trainer
    bar.pace = progress._Pace()
    bar.pace.start(trainer)
    out = io.StringIO()
    with redirect_stdout(out):
        bar._last_step, bar._last_line = 3, time.monotonic()
        bar._in(bar._next_update(trainer))
        bar._heartbeat = progress.threading.Thread(target=bar._beat, daemon=True)
        bar._heartbeat.start()
        try:
            deadline = time.monotonic() + 30
            while "... update 4/5 in progress for" not in out.getvalue():
                assert time.monotonic() < deadline, out.getvalue()
                time.sleep(0.05)
            bar.on_evaluation_start(trainer, 4, final=False)
            while "... evaluation of 4 items at update 3 in progress for" not in out.getvalue():
                assert time.monotonic() < deadline, out.getvalue()
                time.sleep(0.05)
        finally:
            bar._stop_heartbeat()
    assert "evaluation of 4 items at update 3 ..." in out.getvalue()
