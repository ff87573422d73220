"""Runtime bugs that slipped past the suite (issue 26, requirement 8).

Each test was checked against the one-line bug it names: planted by hand,
the test fails; reverted, it passes.

- **In-place reader order:** a state variable read both before and after the
  node that writes its new value may not be written in place.
- **The state lock:** a reader thread during a memory-lean step sees the old
  or the new weights, never a mixture of the two.
- **Cache eviction:** the startup cache drops the least *recently used*
  entries: a hit refreshes an entry (LRU, not FIFO).
- **The Adam fusion matcher:** m' and v' must read the same gradient.
- **String checks:** ``TrainingSession(ModelProto)`` checks every string is
  UTF-8, as loading from bytes or a path does.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import numpy as np
import onnx
import pytest
from models import linear_regression, model, tensor, training_info, vi
from onnx import TensorProto, helper
from reliability_models import COUNTER_FEED, counter_model

from onnxtrain import TrainingModelError, TrainingSession
from onnxtrain.core import diskcache as cache
from onnxtrain.core.emitter import Emitter
from onnxtrain.core.names import NameGen
from onnxtrain.kernels.fuse import fuse_rule_calls
from onnxtrain.lower.inplace import inplace_keys
from onnxtrain.optim import apply

F32 = TensorProto.FLOAT
F64 = TensorProto.DOUBLE


# ------------------------------------------------------------ in-place reader order
def update_graph(late_reader: bool) -> onnx.GraphProto:
    """W_new = W - g * ReduceSum(W) (W read before its update), and with
    ``late_reader`` also ``late = W * 2``, which nothing orders before the
    Sub: onnxruntime may run it after W_new was written."""
    nodes = [
        helper.make_node("ReduceSum", ["W"], ["norm"], keepdims=0),
        helper.make_node("Mul", ["g", "norm"], ["d"]),
        helper.make_node("Sub", ["W", "d"], ["W_new"]),
    ]
    if late_reader:
        nodes.append(helper.make_node("Mul", ["W", "two"], ["late"]))
    return helper.make_graph(nodes, "update", [], [])


def test_a_variable_read_before_and_after_its_update_is_not_written_in_place():
    """Bug caught: ``read_before`` asking that *some* other reader of the
    variable precede the writer instead of *every* one
    (``set(others) <= self.ancestors(index)`` written as
    ``bool(set(others) & self.ancestors(index))``)."""
    assert inplace_keys(update_graph(late_reader=False), [("W", "W_new")]) == {"W"}
    assert inplace_keys(update_graph(late_reader=True), [("W", "W_new")]) == set()
    # A late reader that needs the new value too surely runs after the write.
    g = update_graph(late_reader=False)
    g.node.append(helper.make_node("Sub", ["W_new", "W"], ["delta"]))
    assert inplace_keys(g, [("W", "W_new")]) == set()


def test_lean_steps_of_a_late_reader_equal_safe_steps():
    """The same graph trained: W_new = W - 0.01 * sum(W), D_new = W_new - W.
    memory="lean" must give the double-buffered result bit for bit (D is the
    step, not 0 as when W is overwritten before D_new reads it).  Bug caught:
    the one of the test above, end to end."""
    info = training_info(
        [helper.make_node("ReduceSum", ["W"], ["s"], keepdims=0),
         helper.make_node("Mul", ["s", "rate"], ["d"]),
         helper.make_node("Sub", ["W", "d"], ["W_new"]),
         helper.make_node("Sub", ["W_new", "W"], ["D_new"]),
         helper.make_node("Identity", ["s"], ["total"])],
        [tensor("rate", np.float64(0.01))], [],
        [vi("W_new", F64, [8]), vi("D_new", F64, [8]), vi("total", F64, [])],
        [("W", "W_new"), ("D", "D_new")])
    m = model([helper.make_node("Mul", ["W", "D"], ["Y"])], [], [vi("Y", F64, [8])],
              [tensor("W", np.arange(8.0)), tensor("D", np.zeros(8))], [info])
    safe, lean = TrainingSession(m), TrainingSession(m, memory="lean")
    for _ in range(3):
        safe.train_step({})
        lean.train_step({})
    assert float(safe.state["D"][0]) < 0
    for name in ("W", "D"):
        assert lean.state[name].tobytes() == safe.state[name].tobytes(), name


# ------------------------------------------------------------ the state lock
def test_a_reader_during_lean_steps_sees_old_or_new_weights_never_a_mix():
    """memory="lean" writes the counter model's state in place: P0 (2 MiB)
    and c by training_info[0]'s update, P1 by training_info[1]'s, and
    initialize() resets them all to 7 through two initialization graphs.  A
    thread calling run() meanwhile must get one version in every element of
    P0, P1 and c (the model holds its step count in each).

    Bugs caught: ``StateStore.exclusive()`` yielding without taking its
    mutex (a reader's snapshot goes on while the buffers are written); and,
    found by this test and fixed, readers let in between the in-place write
    of one algorithm and the commit of the whole step (they saw P0 and c of
    the new step with P1 of the old one)."""
    n = 1 << 18
    sess = TrainingSession(counter_model(p0_shape=(n,), p1_shape=(2, 2)), memory="lean")
    sess.train_step(COUNTER_FEED)
    done = threading.Event()
    seen: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not done.is_set():
                y = sess.run(COUNTER_FEED)["Y"]
                seen.append((float(y.min()), float(y.max())))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    steps, deadline = 0, time.monotonic() + 20.0
    try:
        # Enough steps that the reader overlaps many of them.
        while (steps < 40 or len(seen) < 20) and steps < 2000 and time.monotonic() < deadline:
            if steps % 10 == 9:
                sess.initialize()
            else:
                sess.train_step(COUNTER_FEED)
            steps += 1
    finally:
        done.set()
        thread.join(30.0)
    assert not errors, errors
    assert len(seen) >= 5, f"the reader ran only {len(seen)} times in {steps} steps"
    mixed = [s for s in seen if s[0] != s[1]]
    assert not mixed, f"{len(mixed)} of {len(seen)} reads mixed two versions, e.g. {mixed[:3]}"
    y = sess.run(COUNTER_FEED)["Y"]
    assert y.min() == y.max() == float(sess.state["c"])


# ------------------------------------------------------------ cache eviction
@pytest.fixture()
def private_cache(tmp_path, monkeypatch):
    """A startup cache of our own, on, holding at most 4 entries."""
    cache.flush()
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(cache.ENV, "1")
    monkeypatch.setattr(cache, "MAX_ENTRIES", 4)
    yield tmp_path / "cache"
    cache.flush()


def test_cache_eviction_is_least_recently_used_not_first_in(private_cache):
    """Four entries written oldest first; a hit on the oldest; a fifth write
    evicts down to three: the two least recently used go (entries 1 and 2),
    the one just read stays.

    Bug caught: ``cache.read`` no longer touching the entry it returns
    (``os.utime(path)`` removed), which makes eviction first-in first-out."""
    keys = [hashlib.sha256(f"entry {i}".encode()).digest() for i in range(5)]
    paths: dict[int, object] = {}
    now = time.time()
    for i in range(4):
        cache.write("infer", keys[i], {"i": i}, b"payload %d" % i)
        cache.flush()
        (paths[i],) = set(private_cache.rglob("infer-*")) - set(paths.values())
        # Distinct, old modification times in write order (a coarse clock gives ties).
        os.utime(paths[i], (now - 1000 + i, now - 1000 + i))
    assert cache.read("infer", keys[0]) == ({"i": 0}, b"payload 0")  # the hit
    cache.write("infer", keys[4], {"i": 4}, b"payload 4")
    cache.flush()
    left = [i for i in range(5) if cache.read("infer", keys[i]) is not None]
    assert left == [0, 3, 4], f"entries left after eviction: {left}"


# ------------------------------------------------------------ update-rule calls
def adam_update(g_v: str) -> onnx.ModelProto:
    """One call of the rule Adam over p, g1, g2, m, v, with v' then made to
    read ``g_v`` (m' reads g1):

        m' = b1*m + c1*g1;  v' = b2*v + c2*(g_v*g_v);  p' = p - step*(m'/(Sqrt(v') + eps))
    """
    shape = [4, 3]
    scalars = {"b1": 0.9, "c1": 0.1, "b2": 0.999, "c2": 0.001, "eps": 1e-8, "step": 0.01}
    names = ("p", "g1", "g2", "m", "v")
    e = Emitter(17, NameGen(names), dict.fromkeys(names, F32))
    operands = {k: e.const(v, dtype=F32) for k, v in scalars.items()}
    out = apply(e, "Adam", {**operands, "p": "p", "g": "g1", "m": "m", "v": "v"},
                {"p_new": "p_new", "m_new": "m_new", "v_new": "v_new"})
    square = next(n for n in e.nodes if n.op_type == "Mul" and list(n.input) == ["g1", "g1"])
    square.input[:] = [g_v, g_v]
    inputs = [helper.make_tensor_value_info(n, F32, shape) for n in names]
    outputs = [helper.make_tensor_value_info(out[k], F32, shape) for k in ("p_new", "m_new", "v_new")]
    return helper.make_model(helper.make_graph(e.nodes, "adam", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17)])


def test_rule_call_refuses_moments_of_different_gradients():
    """Bug caught: the call check binding a formal operand anew at each use
    (``env.setdefault(fi, ai) != ai`` dropped from ``rules._match``), so m' of
    g1 and v' of g2 fuse into one kernel that reads g1 for both."""
    same = adam_update("g1")
    assert fuse_rule_calls(same.graph, same.opset_import) == 1  # the call is recognised
    assert [n.op_type for n in same.graph.node if n.op_type != "Constant"] == ["AdamUpdateF32"]
    different = adam_update("g2")
    before = different.SerializeToString()
    assert fuse_rule_calls(different.graph, different.opset_import) == 0
    assert different.SerializeToString() == before


# ------------------------------------------------------------ string checks
def test_a_model_proto_with_invalid_utf8_gets_the_projects_error():
    """protobuf parses a proto2 string that is not UTF-8 and hands it back as
    bytes; the session must refuse it at construction, naming the field, as it
    does for bytes and paths (not a TypeError from deep inside).

    Bug caught: ``check_strings(proto)`` skipped for a ModelProto argument in
    ``loading.load``."""
    data = linear_regression().SerializeToString()
    bad = onnx.ModelProto.FromString(data.replace(b"initialization", b"initia\x87ization", 1))
    with pytest.raises(TrainingModelError, match=r"training_info\[0\]\.initialization\.name.*UTF-8"):
        TrainingSession(bad)
    bad_name = onnx.ModelProto.FromString(data.replace(b"XW", b"X\xff", 2))
    with pytest.raises(TrainingModelError, match="is not valid UTF-8"):
        TrainingSession(bad_name)
