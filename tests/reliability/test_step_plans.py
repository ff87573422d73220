"""Step plans: the steady-state train_step path (``ProgramRunner.planned_step``).

After a committed single-algorithm step, the session binds the two
double-buffer configurations once and alternates them.  These tests check
that the planned path is taken, gives exactly the general path's results,
gives way to the general path whenever the state changed otherwise, and is a
transaction like the general path."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest
from reliability_models import COUNTER_FEED, assert_state_equal, counter_model, snapshot

from onnxtrain import TrainingSession, build
from onnxtrain.runtime.executor import Executor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_build import blobs, mlp  # noqa: E402


class Counting:
    """Count the calls of an Executor method (planned: run_binding; general: run_bound)."""

    def __init__(self, monkeypatch, name: str) -> None:
        self.calls = 0
        original = getattr(Executor, name)

        def wrapper(executor, *args, **kwargs):
            self.calls += 1
            return original(executor, *args, **kwargs)

        monkeypatch.setattr(Executor, name, wrapper)


def adamw_session(**kwargs):
    tm = build.training_model(mlp(), loss="cross_entropy", optimizer=build.AdamW(0.05))
    return TrainingSession(tm, **kwargs)


def test_steady_state_steps_take_the_plan(monkeypatch):
    sess = adamw_session()
    x, labels = blobs()
    planned = Counting(monkeypatch, "run_binding")
    general = Counting(monkeypatch, "run_bound")
    for _ in range(6):
        sess.train_step({"X": x, "target": labels}, fetch=False)
    assert general.calls == 1 and planned.calls == 5


def test_planned_steps_equal_general_steps_bit_for_bit():
    """check_finite disables plans: the same steps through the general path."""
    x, labels = blobs()
    a, b = adamw_session(), adamw_session(check_finite=True)
    for step in range(8):
        fetch = step % 3 == 0
        out_a = a.train_step({"X": x, "target": labels}, fetch=fetch)
        out_b = b.train_step({"X": x, "target": labels}, fetch=fetch)
        assert out_a.keys() == out_b.keys()
        for k in out_a:
            np.testing.assert_array_equal(out_a[k], out_b[k])
    assert_state_equal(dict(a.state), dict(b.state))


def test_plans_give_way_to_snapshots_load_state_and_other_algorithms(monkeypatch):
    sess = TrainingSession(counter_model(p0_shape=(16,), p1_shape=(4, 4)))
    general = Counting(monkeypatch, "run_bound")
    sess.train_step(COUNTER_FEED, algorithm=0)
    sess.train_step(COUNTER_FEED, algorithm=0)
    assert general.calls == 1  # the second one was planned
    view = sess.state  # pins the current buffers: the next step must not reuse them
    before = {k: view[k] for k in view}
    sess.train_step(COUNTER_FEED, algorithm=0)
    sess.train_step(COUNTER_FEED, algorithm=0)
    assert general.calls == 3
    assert_state_equal({k: view[k] for k in view}, before)  # the pinned version is intact
    del view
    gc.collect()
    sess.load_state({"P0": np.zeros(16), "P1": np.zeros((4, 4)), "c": np.array(0, np.int64)})
    sess.train_step(COUNTER_FEED, algorithm=0)
    assert general.calls == 4
    assert float(sess.state["P0"][0]) == 1.0
    sess.train_step(COUNTER_FEED, algorithm=1)  # another program: general path, new plans
    sess.train_step(COUNTER_FEED, algorithm=0)
    assert general.calls == 6
    sess.train_step(COUNTER_FEED, algorithm=0)
    assert general.calls == 6
    assert float(sess.state["P0"][0]) == 3.0


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("after", [False, True], ids=["before-run", "after-run"])
def test_a_failed_planned_step_commits_nothing(monkeypatch, exc, after):
    sess = TrainingSession(counter_model(p0_shape=(16,), p1_shape=(4, 4)))
    for _ in range(3):
        sess.train_step(COUNTER_FEED, algorithm=0)
    old = snapshot(sess)
    version = float(old["P0"][0])
    original = Executor.run_binding

    def failing(executor, *args, **kwargs):
        if not after:
            raise exc("injected before the run")
        original(executor, *args, **kwargs)
        raise exc("injected after the run wrote its outputs")

    monkeypatch.setattr(Executor, "run_binding", failing)
    for _ in range(2):  # both plans of the alternation
        with pytest.raises(exc, match="injected"):
            sess.train_step(COUNTER_FEED, algorithm=0)
        assert_state_equal(snapshot(sess), old)
    monkeypatch.setattr(Executor, "run_binding", original)
    sess.train_step(COUNTER_FEED, algorithm=0)
    sess.train_step(COUNTER_FEED, algorithm=0)
    assert float(sess.state["P0"][0]) == version + 2
