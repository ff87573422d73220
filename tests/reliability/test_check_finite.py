"""check_finite=True: a step that would write NaN or Inf into state commits nothing.

It raises FloatingPointError naming the variables.  Its cost is measured by
benchmarks/check_finite_cost.py (see docs/reliability.md).
"""

from __future__ import annotations

import numpy as np
import pytest
from models import linear_regression, mlp_classifier, tensor
from onnx import helper
from reliability_models import COUNTER_FEED, assert_state_equal, counter_model, snapshot

from onnxtrain import TrainingSession

X = np.ones((4, 3), np.float32)
T = np.ones((4, 1), np.float32)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_step_raises_and_commits_nothing(bad):
    sess = TrainingSession(linear_regression(), check_finite=True)
    sess.train_step({"X": X, "T": T})
    old = snapshot(sess)
    x = X.copy()
    x[0, 0] = bad
    with pytest.raises(FloatingPointError) as info:
        sess.train_step({"X": x, "T": T})
    msg = str(info.value)
    assert "training_info[0].algorithm" in msg and "'W'" in msg and "'B'" in msg
    assert "nothing was committed" in msg
    assert "step0" not in msg  # the int64 counter is not a float: never flagged
    assert_state_equal(snapshot(sess), old)
    sess.train_step({"X": X, "T": T})  # and the session goes on
    assert int(sess.state["step0"]) == 2


def test_without_the_guard_non_finite_values_are_committed():
    sess = TrainingSession(linear_regression())
    x = X.copy()
    x[0, 0] = np.nan
    sess.train_step({"X": x, "T": T})
    assert np.isnan(sess.state["W"]).all()


def test_finite_steps_are_unchanged_by_the_guard():
    plain = TrainingSession(mlp_classifier("adam"))
    guarded = TrainingSession(mlp_classifier("adam"), check_finite=True)
    rng = np.random.default_rng(0)
    for _ in range(10):
        feeds = {"X": rng.standard_normal((8, 4)).astype(np.float32), "label": rng.integers(0, 3, 8)}
        a, b = plain.train_step(feeds), guarded.train_step(feeds)
        assert a["loss"].tobytes() == b["loss"].tobytes()
    assert_state_equal(snapshot(plain), snapshot(guarded))


def _counter_with_x_in_second_algorithm() -> bytes:
    """training_info[1] adds X * 0 to P1: finite unless X is NaN or Inf."""
    m = counter_model(p0_shape=(4,), p1_shape=(2, 2))
    algo = m.training_info[1].algorithm
    algo.initializer.append(tensor("zero", np.float64(0)))
    node = next(n for n in algo.node if n.output[0] == "P1_new")
    node.output[0] = "P1_clean"
    algo.node.extend([helper.make_node("Mul", ["X", "zero"], ["x0"]),
                      helper.make_node("Add", ["P1_clean", "x0"], ["P1_new"])])
    return m.SerializeToString()


def test_algorithm_none_commits_nothing_when_a_later_algorithm_is_non_finite():
    sess = TrainingSession(_counter_with_x_in_second_algorithm(), check_finite=True)
    sess.train_step(COUNTER_FEED)
    old = snapshot(sess)
    with pytest.raises(FloatingPointError, match=r"training_info\[1\].*\['P1'\]"):
        sess.train_step({"X": np.array([np.inf])})
    assert_state_equal(snapshot(sess), old)  # P0 and c (algorithm 0, finite) not committed
    sess.train_step({"X": np.array([np.inf])}, algorithm=0)  # algorithm 0 alone is fine
    assert float(sess.state["c"]) == 2


def test_initialize_is_guarded_too():
    m = counter_model(p0_shape=(4,), p1_shape=(2, 2))
    init = m.training_info[1].initialization
    init.node[0].attribute[0].t.CopyFrom(tensor("P1_v", np.full((2, 2), np.nan)))
    sess = TrainingSession(m, check_finite=True)
    sess.train_step(COUNTER_FEED)
    old = snapshot(sess)
    with pytest.raises(FloatingPointError, match=r"training_info\[1\]\.initialization.*\['P1'\]"):
        sess.initialize()
    assert_state_equal(snapshot(sess), old)
