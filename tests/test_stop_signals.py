"""SIGTERM in every phase of a fit (issue 42): a ``fit`` through the CLI in its own process is sent SIGTERM in the middle
of collecting preference pairs, of a two-turn rollout, of an evaluation and of the reward-model stage. It exits with
143 within 30 s (a cluster's grace period), leaves the checkpoint of the last completed update and says what it
discarded; ``--ckpt_path last`` then ends with the weights and the per-update record of an uninterrupted run.

The phases are made observable and slow by ``tests/stop_fixtures.py``: the reward (or a callback) writes ``$STOP_MARK``
when the phase has started and pauses there, so the signal lands inside it."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from comlrl_lightning.analysis import load_run
from comlrl_lightning.cli import main
from comlrl_lightning.runs import stop

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
EXIT_BOUND_S = 30  # a cluster gives 30-120 s between SIGTERM and SIGKILL
SMALL = [
    "--model.init_args.agents=tiny",
    "--model.init_args.use_chat_template=false",
    "--model.init_args.max_new_tokens=4",
    "--model.init_args.reward_func=stop_fixtures.story_reward_slowed_at_call",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]
# Two turns, two samples per prompt, one reward call per turn (in training 2 joint actions at turn 1, 4 at turn 2; an
# evaluation of one item per batch: 1), 2 updates per step, an evaluation before steps 1 and 3: 6 updates.
MULTI_TURN = [
    "--config",
    str(REPO / "configs" / "magrpo_multiturn.yaml"),
    *SMALL,
    "--model.init_args.early_termination_threshold=null",
    "--model.init_args.eval_interval=2",
    "--data.init_args.eval_batch_size=1",
    "--trainer.max_steps=6",
]
MADPO = [
    "--config",
    str(REPO / "configs" / "madpo.yaml"),
    *SMALL,
    "--model.init_args.preference_num_candidates=4",
    "--model.init_args.eval_interval=0",
    "--data.init_args.prompts_per_step=1",
    "--data.init_args.max_train_items=8",
    "--trainer.max_epochs=1",
]
MARLHF = [
    "--config",
    str(REPO / "configs" / "marlhf.yaml"),
    *SMALL,
    "--model.init_args.reward_model_name=tiny",
    "--model.init_args.reward_max_length=64",
    "--model.init_args.reward_train_batch_size=1",
    "--model.init_args.preference_num_candidates=4",
    "--model.init_args.preference_pairs_per_sample=1",
    "--model.init_args.num_generations=2",
    "--model.init_args.eval_interval=0",
    "--data.init_args.max_train_items=4",
    "--trainer.max_steps=7",
]


def stopped_fit(tmp_path: Path, args: list[str], **phase: str) -> tuple[str, dict]:
    """``fit args`` in a process of its own into ``tmp_path/cut``, sent SIGTERM once the phase ``phase`` (the
    fixtures' variables) names has started; asserts it exits with 143 within the bound. Returns its stderr and the
    checkpoint ``last.ckpt`` points at."""
    mark = tmp_path / "phase-started"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.update(STOP_MARK=str(mark), **phase)
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "comlrl_lightning",
                "fit",
                *args,
                "--trainer.default_root_dir",
                str(tmp_path / "cut"),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + 600
            while not mark.exists():
                assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
                assert time.monotonic() < deadline, "the phase never started"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=EXIT_BOUND_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {EXIT_BOUND_S} s after SIGTERM")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 143, text[-3000:]
    last = next((tmp_path / "cut").glob("*/version_0/checkpoints/last.ckpt"))
    return text, torch.load(last, weights_only=False, map_location="cpu")


def updates_logged(root: Path) -> int:
    """The updates a run wrote a row for (a row with a loss)."""
    rows = load_run(root, verbose=False)
    loss = "loss" if "loss" in rows else "reward_model/loss"
    return int(rows[loss].notna().sum()) if loss in rows else 0


def assert_resumes_exactly(tmp_path: Path, args: list[str], reference: tuple[dict, "object"]) -> None:
    """``--ckpt_path last`` from the stopped run ends with the uninterrupted run's weights and per-update record."""
    weights, record = reference
    resumed = main(["fit", *args, "--trainer.default_root_dir", str(tmp_path / "cut"), "--ckpt_path", "last"])
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, weights[name], atol=0, rtol=0, msg=name)
    joined = load_run(tmp_path / "cut", verbose=False)
    assert joined["step"].tolist() == record["step"].tolist()
    for column in [c for c in record.columns if c == "loss" or c.startswith(("reward_model/loss", "eval/"))]:
        mine, theirs = joined[column].tolist(), record[column].tolist()
        assert [None if math.isnan(v) else v for v in mine] == [None if math.isnan(v) else v for v in theirs], column


def uninterrupted(root: Path, args: list[str]) -> tuple[dict, object]:
    cli = main(["fit", *args, "--trainer.default_root_dir", str(root)])
    return {k: v.clone() for k, v in cli.model.state_dict().items()}, load_run(root, verbose=False)


@pytest.fixture
def quiet_env(tmp_path, monkeypatch):
    """In-process runs: no fixture slows them, outputs (MADPO's pairs_file) under ``tmp_path``."""
    for name in ("STOP_MARK", "STOP_AT_CALL", "STOP_JOINT", "STOP_AT_UPDATE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(TESTS))


@pytest.fixture(scope="module")
def multi_turn_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_turn")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        return uninterrupted(root / "full", MULTI_TURN)
    finally:
        os.chdir(cwd)


def test_sigterm_mid_pair_collection(tmp_path, quiet_env):
    """MADPO collects its pairs before its first update: stopped at task 3 of 8, it writes its starting state (update
    0); the resumed fit collects them again and trains as the uninterrupted one."""
    err, checkpoint = stopped_fit(tmp_path, MADPO, STOP_AT_CALL="3")
    assert "SIGTERM during pair collection (" in err and "of 8 tasks done): discarded it" in err, err[-3000:]
    assert "the checkpoint of update 0 (the last completed) written to" in err
    assert checkpoint["global_step"] == 0 and "pairs" not in checkpoint.get("PreferenceDataModule", {})
    assert_resumes_exactly(tmp_path, MADPO, uninterrupted(tmp_path / "full", MADPO))


def test_sigterm_mid_multi_turn_rollout(tmp_path, quiet_env, multi_turn_reference):
    """Stopped after the first turn of step 2's rollout (its turn-1 reward is the second call scoring 2 joint
    actions): the partial rollout is discarded, the checkpoint is update 2's (step 1 made 2)."""
    err, checkpoint = stopped_fit(tmp_path, MULTI_TURN, STOP_JOINT="2", STOP_AT_CALL="2")
    assert "SIGTERM during the rollout of 1 task(s) after update 2: discarded it" in err, err[-3000:]
    assert checkpoint["global_step"] == 2 == updates_logged(tmp_path / "cut")
    assert_resumes_exactly(tmp_path, MULTI_TURN, multi_turn_reference)


def test_sigterm_mid_evaluation(tmp_path, quiet_env, multi_turn_reference):
    """Stopped in the evaluation before step 3 (its first item's first reward call, the fifth evaluation call: the
    first evaluation made four, two items of two turns): the checkpoint is update 4's, and the resumed fit evaluates
    again."""
    err, checkpoint = stopped_fit(tmp_path, MULTI_TURN, STOP_JOINT="1", STOP_AT_CALL="5")
    assert "SIGTERM during the evaluation at update 4 (0 of 2 batches done): discarded it" in err, err[-3000:]
    assert checkpoint["global_step"] == 4 == updates_logged(tmp_path / "cut")
    assert_resumes_exactly(tmp_path, MULTI_TURN, multi_turn_reference)


def test_sigterm_mid_reward_model_stage(tmp_path, quiet_env):
    """MARLHF's reward model trains one pair per update; stopped during update 2 of its stage, the step finishes
    and its checkpoint is written; the resumed fit trains the rest of the stage and the RL stage as the uninterrupted
    one."""
    err, checkpoint = stopped_fit(
        tmp_path, [*MARLHF, "--trainer.callbacks=stop_fixtures.PauseAfterUpdate"], STOP_AT_UPDATE="2"
    )
    assert checkpoint["global_step"] == 2 == updates_logged(tmp_path / "cut") and checkpoint["epoch"] == 0, err
    assert "SIGTERM: the step under way finished; the checkpoint of update 2 is" in err and "discarded" not in err
    assert_resumes_exactly(tmp_path, MARLHF, uninterrupted(tmp_path / "full", MARLHF))


# ----------------------------------------------------------------------------------------------- the safe points
@pytest.fixture
def stop_later():
    """``stop_later(seconds)`` asks for a stop (as the handler would) from another thread; cleared afterwards."""
    timers = []

    def later(seconds: float) -> None:
        timer = threading.Timer(seconds, stop.request, args=(signal.SIGTERM,))
        timers.append(timer)
        timer.start()

    yield later
    for timer in timers:
        timer.cancel()
    stop.clear()


def test_a_stop_raises_at_a_safe_point_of_a_discardable_phase_only(stop_later):
    stop.request(signal.SIGTERM)
    stop.check()  # outside a discardable phase (an update, a checkpoint being written): nothing
    stop.clear()
    with pytest.raises(stop.StopRequested, match=r"^SIGTERM during collecting \(2 of 5 tasks done\)$"):
        with stop.discardable("collecting", 5, "tasks") as phase:
            phase.done = 2
            stop.request(signal.SIGTERM)
            with stop.discardable("an inner phase"):  # checks on entry; the outermost phase is the one reported
                pytest.fail("a discardable phase entered after a stop")
    stop.clear()
    with stop.discardable("sampling"):
        stop.check()  # no stop asked for


def test_a_sandbox_wait_stops_at_a_requested_stop(stop_later):
    """A program that loops for its test's 30 s: a stop asked for while the trainer waits for its report ends the
    wait (the evaluator is killed by run_tests' clean-up); without the safe point the job would end as a Timeout."""
    from comlrl_lightning.envs.sandbox import Job, run_many

    job = Job("def spin():\n    while True:\n        pass\n", ["spin()"], entry_points=("spin",))
    stop_later(0.5)
    with pytest.raises(stop.StopRequested), stop.discardable("a reward"):
        run_many([job, job], timeout_per_test=30, timeout_total=60)


def test_an_api_comparator_request_is_not_sent_after_a_stop(stop_later, tcp_server):
    import socket

    from comlrl_lightning.comparators import ApiComparator, ApiComparatorConfig

    server, port = tcp_server
    comparator = ApiComparator(ApiComparatorConfig(url=f"http://127.0.0.1:{port}/x", timeout=2, max_retries=0))
    stop.request(signal.SIGTERM)
    with pytest.raises(stop.StopRequested), stop.discardable("pair collection"):
        comparator.post({"prompt": "p"})
    with pytest.raises(socket.timeout):
        server.accept()  # no connection was made


def test_a_reward_under_reward_timeout_is_left_behind_at_a_stop(stop_later):
    from comlrl_lightning.rollout.rewards import RewardCaller

    def slow_reward(a, b):
        time.sleep(30)
        return [1.0] * len(a)

    caller = RewardCaller(slow_reward, timeout=60)
    stop_later(0.5)
    with pytest.raises(stop.StopRequested), stop.discardable("a rollout"):
        caller([["x"], ["y"]])


def test_generation_stops_at_the_next_token():
    """A stop asked for while the first token is drawn (by a logits processor of the run's) raises at the second:
    ``generate`` does not run on to ``max_new_tokens``."""
    from comlrl_lightning.agents.factories import MODEL_FACTORIES
    from comlrl_lightning.rollout.backends.hf import sample_completions
    from comlrl_lightning.rollout.sampling import SamplingConfig

    model, tokenizer = MODEL_FACTORIES["tiny"]()
    steps = []

    def ask_for_a_stop(input_ids, scores):
        steps.append(input_ids.shape[1])
        stop.request(signal.SIGTERM)
        return scores

    try:
        with pytest.raises(stop.StopRequested), stop.discardable("a rollout"):
            sample_completions(
                model,
                tokenizer,
                ["a story"],
                2,
                SamplingConfig(max_new_tokens=64),
                None,
                {"logits_processor": [ask_for_a_stop]},
            )
    finally:
        stop.clear()
    assert len(steps) == 1
