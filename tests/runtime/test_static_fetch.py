"""Fetched outputs of a static declared shape are written into buffers bound once.

A small output the program declares in full (a loss, a metric) is bound to a
buffer of its own on the first fetch, and each run returns a copy of it; other
fetched outputs (shapes that follow the feeds) are bound afresh each run.
The values must be what a plain run gives, every returned array must be the
caller's own (a later step never changes it), and a binding fetched with
different output lists must hand each name its own value."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from onnxtrain import TrainingSession, build
from onnxtrain.runtime import executor as executor_module
from onnxtrain.runtime.executor import Executor, new_buffer

F32 = TensorProto.FLOAT


def _program():
    """X [N, 2], state S [2] -> S_new = S + 1, a = sum(X) [], b = X * S [N, 2], c = S - 1 [2]."""
    one = helper.make_tensor("one", F32, [], [1.0])
    nodes = [helper.make_node("Add", ["S", "one"], ["S_new"]),
             helper.make_node("ReduceSum", ["X"], ["a"], keepdims=0),
             helper.make_node("Mul", ["X", "S"], ["b"]),
             helper.make_node("Sub", ["S", "one"], ["c"])]
    graph = helper.make_graph(
        nodes, "p",
        [helper.make_tensor_value_info("X", F32, ["N", 2]), helper.make_tensor_value_info("S", F32, [2])],
        [helper.make_tensor_value_info("S_new", F32, [2]), helper.make_tensor_value_info("a", F32, []),
         helper.make_tensor_value_info("b", F32, ["N", 2]), helper.make_tensor_value_info("c", F32, [2])],
        [one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return Executor(model)


def test_one_binding_fetched_with_different_lists_gives_each_name_its_value():
    ex = _program()
    s = np.array([2.0, 3.0], np.float32)
    state_in = {"S": new_buffer(s, ("cpu", 0))}
    state_out = {"S_new": new_buffer(np.zeros(2, np.float32), ("cpu", 0))}
    entry = ex.binding(state_in, state_out)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    expected = {"a": np.float32(15.0), "b": x * s, "c": s - 1}
    for fetch in (["a", "b"], ["b"], ["c", "a"], ["b", "c", "a"], ["a"]):
        out = ex.run_binding(entry, {"X": x}, fetch, 1)
        assert list(out) == fetch
        for name in fetch:
            np.testing.assert_array_equal(out[name], expected[name], err_msg=f"{name} of {fetch}")
    # the dynamic output follows a new batch size, next to the static ones
    x2 = np.ones((5, 2), np.float32)
    out = ex.run_binding(entry, {"X": x2}, ["c", "b", "a"], 1)
    np.testing.assert_array_equal(out["b"], x2 * s)
    assert out["a"] == 10.0 and out["a"].shape == () and out["a"].dtype == np.float32


def test_returned_values_are_copies_the_next_run_leaves_alone():
    ex = _program()
    state_in = {"S": new_buffer(np.zeros(2, np.float32), ("cpu", 0))}
    state_out = {"S_new": new_buffer(np.zeros(2, np.float32), ("cpu", 0))}
    entry = ex.binding(state_in, state_out)
    first = ex.run_binding(entry, {"X": np.ones((2, 2), np.float32)}, ["a", "c"], 1)
    second = ex.run_binding(entry, {"X": np.full((2, 2), 2.0, np.float32)}, ["a", "c"], 1)
    assert first["a"] == 4.0 and second["a"] == 8.0
    first["c"][:] = 99.0  # the caller's own array: writing it changes no later result
    third = ex.run_binding(entry, {"X": np.ones((2, 2), np.float32)}, ["c"], 1)
    np.testing.assert_array_equal(third["c"], [-1.0, -1.0])


def _regression():
    x_vi = helper.make_tensor_value_info("X", F32, ["N", 3])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "w"], ["pred"])], "lin", [x_vi],
        [helper.make_tensor_value_info("pred", F32, ["N", 1])],
        [helper.make_tensor("w", F32, [3, 1], [0.1, -0.2, 0.3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return build.training_model(model, loss="mse", optimizer=build.Adam(lr=0.05))


def test_training_losses_and_state_equal_the_per_run_binding_bit_for_bit(monkeypatch):
    rng = np.random.default_rng(0)
    batches = [{"X": rng.standard_normal((n, 3)).astype(np.float32),
                "target": rng.standard_normal((n, 1)).astype(np.float32)} for n in (8, 8, 8, 5, 8, 8)]

    def train():
        sess = TrainingSession(_regression())
        outs = [sess.train_step(b) for b in batches]
        return outs, {k: np.array(v) for k, v in sess.state.items()}

    outs, state = train()
    monkeypatch.setattr(executor_module, "STATIC_FETCH_ELEMENTS", -1)  # every output bound per run
    ref_outs, ref_state = train()
    losses = [o["loss"] for o in outs]
    assert all(type(v) is np.ndarray and v.shape == () for v in losses)
    assert len({id(v) for v in losses}) == len(losses)
    for o, r in zip(outs, ref_outs):
        assert sorted(o) == sorted(r)
        for k in o:
            np.testing.assert_array_equal(o[k], r[k])
            assert o[k].dtype == r[k].dtype and o[k].shape == r[k].shape
    for k in state:
        np.testing.assert_array_equal(state[k], ref_state[k])
