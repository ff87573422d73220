"""A step is a transaction: after any failure the state is fully old or fully new.

Three kinds of fault injection:

1. ``Executor.run_bound`` patched to raise (RuntimeError or KeyboardInterrupt)
   before or after onnxruntime ran, on the first or a later program of
   ``train_step(algorithm=None)`` and of ``initialize()``;
2. ``KeyboardInterrupt`` raised at *every* line executed in session.py and
   executor.py during a call (a ``sys.settrace`` hook counts the lines of a
   clean call, then one run per line raises at that line), which covers feed
   checking, staging before the run, the run, after the run before the commit,
   and the commit itself, for ``train_step`` (one and several algorithms),
   ``initialize()`` and ``load_state()``;
3. real SIGALRM signals whose handler raises KeyboardInterrupt, at random
   moments during a loop of steps.

The counter model makes every state version identifiable (every element of
every variable equals the step count), so "mixed" is easy to see.  Old and
new states are compared byte for byte.
"""

from __future__ import annotations

import gc
import linecache
import os
import random
import signal
import sys

import numpy as np
import onnx
import proposed_fixes
import pytest
from reliability_models import (
    COUNTER_FEED,
    assert_state_equal,
    counter_model,
    counter_version,
    snapshot,
)

import onnxtrain.lower.programs as programs_mod
import onnxtrain.parallel.step as parallel_step_mod
import onnxtrain.runtime.executor as executor_mod
import onnxtrain.runtime.runner as runner_mod
import onnxtrain.runtime.state as state_mod
import onnxtrain.session as session_mod
from onnxtrain import TrainingSession
from onnxtrain.runtime.executor import Executor

#: Files whose lines the injector interrupts (programs: feed checks; proposed_fixes:
#: the replacement methods).
SOURCES = {
    os.path.abspath(session_mod.__file__),
    os.path.abspath(runner_mod.__file__),
    os.path.abspath(parallel_step_mod.__file__),
    os.path.abspath(executor_mod.__file__),
    os.path.abspath(programs_mod.__file__),
    os.path.abspath(state_mod.__file__),
    os.path.abspath(proposed_fixes.__file__),
}


@pytest.fixture(scope="module")
def counter_bytes() -> bytes:
    return counter_model(p0_shape=(16,), p1_shape=(4, 4)).SerializeToString()


def fresh(counter_bytes, steps: int = 3) -> TrainingSession:
    sess = TrainingSession(counter_bytes)
    for _ in range(steps):
        sess.train_step(COUNTER_FEED)
    return sess


# ------------------------------------------------------------ scenarios
def _op_step_all(sess):
    sess.train_step(COUNTER_FEED)


def _op_step_0(sess):
    sess.train_step(COUNTER_FEED, algorithm=0)


def _op_step_1(sess):
    sess.train_step(COUNTER_FEED, algorithm=1)


def _op_initialize(sess):
    sess.initialize()


def _op_load_state(sess):
    state = sess.state_info
    sess.load_state({name: np.full(var.shape, 9, var.dtype) for name, var in state.items()})


SCENARIOS = {
    "train_step(None)": (_op_step_all, None),
    "train_step(0)": (_op_step_0, None),
    # P1 catches up with P0 only after algorithm 0 ran alone, so old != new.
    "train_step(1)": (_op_step_1, _op_step_0),
    "initialize": (_op_initialize, None),
    "load_state": (_op_load_state, None),
}


class LineInterrupt:
    """A sys.settrace hook: raise KeyboardInterrupt at the ``at``-th line
    executed in onnxtrain's step files (SOURCES) (``at=None``: only count).

    One kind of line event is skipped: CPython reports the ``with`` line
    again when a with-block *exits*, at an instruction outside the block's
    exception table, so raising there would skip ``__exit__`` (and leave a
    lock held).  A real KeyboardInterrupt cannot arrive there: signals are
    handled only at function entry, backward jumps and after a call returns,
    that is after ``__exit__`` ran.  Every other line is fair game."""

    def __init__(self, at: int | None = None) -> None:
        self.at = at
        self.count = 0
        self.where: tuple[str, int] | None = None
        self._seen: dict = {}

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename in SOURCES:
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event != "line":
            return self._local
        seen = self._seen.setdefault(frame, set())
        line = frame.f_lineno
        if line in seen and _is_with_line(frame.f_code.co_filename, line):
            return self._local
        seen.add(line)
        if self.count == self.at:
            self.where = (frame.f_code.co_name, line)
            self._seen.clear()
            raise KeyboardInterrupt(f"injected at {self.where}")
        self.count += 1
        return self._local


def _is_with_line(filename: str, line: int) -> bool:
    return linecache.getline(filename, line).lstrip().startswith(("with ", "async with "))


def _traced(op, sess, tracer) -> BaseException | None:
    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        op(sess)
    except KeyboardInterrupt as exc:
        return exc
    finally:
        sys.settrace(old)
        tracer._seen.clear()
    return None


def run_exhaustive_interrupts(counter_bytes, name: str) -> dict:
    """Interrupt ``name``'s operation at every line; check old-or-new each time."""
    op, setup = SCENARIOS[name]
    sess = fresh(counter_bytes)
    if setup:
        setup(sess)
    old = snapshot(sess)
    op(sess)
    new = snapshot(sess)
    assert new.keys() == old.keys()
    assert any(new[k].tobytes() != old[k].tobytes() for k in old), "the op must change state"

    sess.load_state(old)
    counter = LineInterrupt()
    assert _traced(op, sess, counter) is None
    assert_state_equal(snapshot(sess), new)
    total = counter.count
    outcomes = {"old": 0, "new": 0}
    where = set()
    for at in range(total):
        sess.load_state(old)
        tracer = LineInterrupt(at)
        exc = _traced(op, sess, tracer)
        assert exc is not None, f"no interrupt at line event {at} ({tracer.where})"
        where.add(tracer.where[0])
        state = snapshot(sess)
        is_old = all(state[k].tobytes() == old[k].tobytes() for k in old)
        is_new = all(state[k].tobytes() == new[k].tobytes() for k in old)
        assert is_old or is_new, (
            f"{name}: interrupted at {tracer.where} (line event {at} of {total}) left a mixed "
            f"state: {_describe(state, old, new)}"
        )
        outcomes["old" if is_old else "new"] += 1
        # The session still works: the same operation from the old state gives the new one.
        sess.load_state(old)
        op(sess)
        assert_state_equal(snapshot(sess), new)
    return {"lines": total, "functions": where, **outcomes}


def _describe(state, old, new) -> str:
    parts = []
    for k in state:
        tag = ("old" if state[k].tobytes() == old[k].tobytes()
               else "new" if state[k].tobytes() == new[k].tobytes() else "other")
        parts.append(f"{k}={tag}")
    return ", ".join(parts)


# Phases of a train_step, each named by a function whose lines must have been
# interrupted (any one of the names; the code may be refactored around them).
STEP_PHASES = {
    "feed checking": {"checked", "check_names", "check_feeds", "check"},
    "before the run": {"run_and_stage", "targets", "current"},
    "the run": {"run_bound"},
    "the commit": {"commit"},
}


def _missing_phases(functions: set[str]) -> list[str]:
    return [phase for phase, names in STEP_PHASES.items() if not names & functions]



@pytest.mark.parametrize(
    "name",
    [
        "train_step(None)",
        "train_step(0)",
        "train_step(1)",
        "initialize",
        "load_state",
    ],
)
def test_interrupt_at_every_line_current_code(counter_bytes, name):
    result = run_exhaustive_interrupts(counter_bytes, name)
    assert result["old"] > 0


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_interrupt_at_every_line_with_proposed_commit(counter_bytes, name, monkeypatch):
    proposed_fixes.apply(monkeypatch)
    result = run_exhaustive_interrupts(counter_bytes, name)
    assert result["old"] > 0 and result["lines"] > 10
    if name.startswith("train_step"):
        assert not _missing_phases(result["functions"]), _missing_phases(result["functions"])
    if name == "load_state":
        assert {"load_state", "replace"} <= result["functions"]
    if name == "initialize":
        assert {"initialize", "run_and_stage", "run_bound", "commit"} <= result["functions"]


# --------------------------------------------- run_bound raising (1)
class FailingRunBound:
    """Executor.run_bound that raises at its ``fail_at``-th call, before or after running."""

    def __init__(self, fail_at: int, after: bool, exc: type[BaseException]) -> None:
        self.fail_at = fail_at
        self.after = after
        self.exc = exc
        self.calls = 0
        self.original = Executor.run_bound

    def __get__(self, executor, owner=None):  # behave like a method when set on the class
        return lambda *args, **kwargs: self.call(executor, *args, **kwargs)

    def call(self, executor, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at and not self.after:
            raise self.exc("injected before the run")
        out = self.original(executor, *args, **kwargs)
        if self.calls == self.fail_at:
            raise self.exc("injected after the run wrote its outputs")
        return out


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("after", [False, True], ids=["before-run", "after-run"])
@pytest.mark.parametrize("fail_at", [1, 2], ids=["first-program", "second-program"])
@pytest.mark.parametrize("op", ["train_step(None)", "initialize"])
def test_run_bound_failure_commits_nothing(counter_bytes, monkeypatch, exc, after, fail_at, op):
    sess = fresh(counter_bytes)
    run = (lambda s: s.train_step(COUNTER_FEED)) if op == "train_step(None)" else TrainingSession.initialize
    run(sess)  # compile every program and warm the binding caches first
    sess.train_step(COUNTER_FEED)
    old = snapshot(sess)
    failing = FailingRunBound(fail_at, after, exc)
    monkeypatch.setattr(Executor, "run_bound", failing)
    with pytest.raises(exc, match="injected"):
        run(sess)
    assert failing.calls == fail_at
    assert_state_equal(snapshot(sess), old)
    monkeypatch.setattr(Executor, "run_bound", failing.original)
    # Still usable, and the next step continues from the old state.
    version = counter_version(snapshot(sess))
    sess.train_step(COUNTER_FEED)
    assert counter_version(snapshot(sess)) == version + 1


def test_failure_in_second_algorithm_rolls_back_the_first(counter_bytes, monkeypatch):
    """algorithm=None is one transaction: algorithm 0's staged update is dropped."""
    sess = fresh(counter_bytes)
    old = snapshot(sess)
    monkeypatch.setattr(Executor, "run_bound", FailingRunBound(2, True, RuntimeError))
    with pytest.raises(RuntimeError):
        sess.train_step(COUNTER_FEED)
    assert_state_equal(snapshot(sess), old)


def test_bad_feed_in_any_phase_of_a_multi_algorithm_step_commits_nothing(counter_bytes):
    sess = fresh(counter_bytes)
    old = snapshot(sess)
    for feeds in ({}, {"X": np.zeros(1, np.float32)}, {"X": np.zeros((1, 1))},
                  {"X": np.zeros(1), "nope": 1}, {"X": np.zeros(1), "P0": np.zeros(16)}):
        with pytest.raises(ValueError):
            sess.train_step(feeds)
        assert_state_equal(snapshot(sess), old)


# ------------------------------------------------------- real signals (3)
def _signal_storm(counter_bytes, seed: int, rounds: int) -> dict:
    """Steps under SIGALRM at random moments; every state seen is a whole version."""
    if not hasattr(signal, "setitimer"):
        pytest.skip("no setitimer on this platform")

    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGALRM")

    rng = random.Random(seed)
    sess = fresh(counter_bytes, steps=0)
    previous = signal.signal(signal.SIGALRM, interrupt)
    interrupted = completed = 0
    # An interrupt inside a gc callback (hypothesis installs one) would be
    # swallowed as "unraisable"; no automatic collections during the storm.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, 2e-3))
                for _ in range(50):
                    op = rng.choice((_op_step_all, _op_step_all, _op_step_0, _op_initialize))
                    op(sess)
                    completed += 1
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            state = snapshot(sess)
            # Whole versions only: P0 and c move together; P1 is P0's or one behind.
            p0 = set(np.unique(state["P0"]).tolist())
            p1 = set(np.unique(state["P1"]).tolist())
            assert len(p0) == 1 and len(p1) == 1, (p0, p1)
            assert p0 == {float(state["c"])}, (p0, state["c"])
    finally:
        signal.signal(signal.SIGALRM, previous)
        if gc_was_enabled:
            gc.enable()
    return {"interrupted": interrupted, "completed": completed}


def test_random_sigalrm_interrupts_with_proposed_commit(counter_bytes, monkeypatch):
    """(Against the current commit, a 2,000-round storm did catch a mixed state,
    P0 = 9 with c = 8; the line-injection tests above show that deterministically.)"""
    proposed_fixes.apply(monkeypatch)
    result = _signal_storm(counter_bytes, seed=1, rounds=150)
    assert result["interrupted"] > 50


# ------------------------------------------- onnxruntime writing into inputs
def _bn_post_processed_model():
    """Training-mode BatchNormalization whose running statistics are not graph
    outputs themselves: the update binds 0.5 * running_mean (and var)."""
    from onnx import TensorProto, helper, numpy_helper

    f = TensorProto.FLOAT
    inits = [
        numpy_helper.from_array(np.ones(3, np.float32), "scale"),
        numpy_helper.from_array(np.zeros(3, np.float32), "bias"),
        numpy_helper.from_array(np.full(3, 0.25, np.float32), "mean"),
        numpy_helper.from_array(np.full(3, 2.0, np.float32), "var"),
    ]
    main = helper.make_graph(
        [helper.make_node("BatchNormalization", ["X", "scale", "bias", "mean", "var"], ["Y"])],
        "main", [helper.make_tensor_value_info("X", f, ["N", 3])],
        [helper.make_tensor_value_info("Y", f, ["N", 3])], inits,
    )
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    algo = helper.make_graph(
        [
            helper.make_node("BatchNormalization", ["X", "scale", "bias", "mean", "var"],
                             ["Yt", "rm", "rv"], training_mode=1, momentum=0.5),
            helper.make_node("Mul", ["rm", "half"], ["mean_new"]),
            helper.make_node("Mul", ["rv", "half"], ["var_new"]),
        ],
        "algo", [], [helper.make_tensor_value_info(n, f, [3]) for n in ("mean_new", "var_new")], [half],
    )
    ti = onnx.TrainingInfoProto()
    ti.algorithm.CopyFrom(algo)
    for k, v in (("mean", "mean_new"), ("var", "var_new")):
        ti.update_binding.add(key=k, value=v)
    model = helper.make_model(main, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 8
    model.training_info.append(ti)
    return model



def test_batch_norm_running_statistics_never_touch_committed_state():
    """onnxruntime writes BatchNormalization's running statistics into its
    mean/var input buffers when those outputs are not graph outputs; the
    programs give it private copies, so a step that fails after the run
    leaves the state exactly as it was and a snapshot taken before never moves."""
    sess = TrainingSession(_bn_post_processed_model())
    x = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    before = {k: sess.state[k] for k in ("mean", "var")}
    view = sess.state  # a pinned snapshot
    original = executor_mod.Executor.run_bound

    def fail_after(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise RuntimeError("injected after onnxruntime ran")

    executor_mod.Executor.run_bound = fail_after
    try:
        with pytest.raises(RuntimeError, match="injected"):
            sess.train_step({"X": x})
    finally:
        executor_mod.Executor.run_bound = original
    for k in before:
        assert sess.state[k].tobytes() == before[k].tobytes(), k
        assert view[k].tobytes() == before[k].tobytes(), k
    sess.train_step({"X": x})
    want_mean = 0.5 * (0.5 * 0.25 + 0.5 * x.mean(0))
    np.testing.assert_allclose(sess.state["mean"], want_mean, rtol=1e-6)
    assert view["mean"].tobytes() == before["mean"].tobytes()
