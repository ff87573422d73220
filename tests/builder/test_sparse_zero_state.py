"""Zero-filled state the builder creates (optimizer moments, momentum buffers,
Adagrad sums, gradient sums) is stored as an empty sparse initializer from
``plan.SPARSE_ZERO_BYTES`` on: the model does not carry its dense zeros.

The oracle is the dense form of the same model (the threshold patched out of
reach): losses and every state variable agree bit for bit."""

from __future__ import annotations

import mmap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_build import mlp

import onnxtrain.builder.plan as builder
from onnxtrain import TrainingSession, build
from onnxtrain.io.model import validate
from onnxtrain.io.storage import write_model

F32 = TensorProto.FLOAT
STEPS = 4


def two_layer(n_in=96, n_hidden=192, n_out=4, seed=0) -> onnx.ModelProto:
    """X -> MatMul W1 [96, 192] (72 KiB: sparse state) -> Add b1 -> Relu -> MatMul W2 (dense state)."""
    rng = np.random.default_rng(seed)
    inits = {
        "W1": rng.standard_normal((n_in, n_hidden)) / np.sqrt(n_in),
        "b1": rng.standard_normal(n_hidden) * 0.1,
        "W2": rng.standard_normal((n_hidden, n_out)) / np.sqrt(n_hidden),
    }
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
         helper.make_node("Relu", ["h1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["Y"])],
        "two_layer", [helper.make_tensor_value_info("X", F32, ["N", n_in])],
        [helper.make_tensor_value_info("Y", F32, ["N", n_out])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def batches(n=STEPS, rows=8, seed=1):
    rng = np.random.default_rng(seed)
    return [{"X": rng.standard_normal((rows, 96)).astype(np.float32),
             "target": rng.standard_normal((rows, 4)).astype(np.float32)} for _ in range(n)]


def build_both(monkeypatch, model, **kwargs) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(sparse form, dense form) of the same training model."""
    sparse = build.training_model(model, loss="mse", **kwargs)
    with monkeypatch.context() as m:
        m.setattr(builder, "SPARSE_ZERO_BYTES", float("inf"))
        dense = build.training_model(model, loss="mse", **kwargs)
    return sparse, dense


def sparse_names(proto: onnx.ModelProto) -> dict[str, str]:
    """Sparse initializer -> the graph that holds it."""
    out = {st.values.name: "graph" for st in proto.graph.sparse_initializer}
    for i, ti in enumerate(proto.training_info):
        out.update({st.values.name: f"training_info[{i}].algorithm" for st in ti.algorithm.sparse_initializer})
    return out


def dense_names(proto: onnx.ModelProto) -> dict[str, str]:
    out = {t.name: "graph" for t in proto.graph.initializer}
    for i, ti in enumerate(proto.training_info):
        out.update({t.name: f"training_info[{i}].algorithm" for t in ti.algorithm.initializer})
    return out


def run(model, feeds, cycle) -> tuple[TrainingSession, list[bytes]]:
    sess = TrainingSession(model)
    losses = [sess.train_step(f, algorithm=cycle[i % len(cycle)])["loss"].tobytes()
              for i, f in enumerate(feeds)]
    return sess, losses


def assert_state_bitwise(a: TrainingSession, b: TrainingSession) -> None:
    sa, sb = dict(a.state), dict(b.state)
    assert sa.keys() == sb.keys()
    for name in sb:
        x, y = np.asarray(sa[name]), np.asarray(sb[name])
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), f"{name}: not bit for bit"


OPTIMIZERS = {
    "sgd-momentum": lambda: build.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd-nesterov": lambda: build.SGD(lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda: build.Adam(lr=1e-2),
    "adamw": lambda: build.AdamW(lr=1e-2, weight_decay=0.1),
    "adagrad": lambda: build.Adagrad(lr=0.05),
}


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sparse_zero_state_trains_bit_for_bit_like_the_dense_form(monkeypatch, name, accumulate):
    sparse, dense = build_both(monkeypatch, two_layer(), optimizer=OPTIMIZERS[name](),
                               accumulate=accumulate, clip_grad_norm=5.0 if accumulate > 1 else None)
    slots = [s for s, _ in OPTIMIZERS[name]().slots()]
    expected = {f"W1.{s}" for s in slots} | ({"W1.grad_accum"} if accumulate > 1 else set())
    where = sparse_names(sparse)
    assert set(where) == expected
    assert not sparse_names(dense)
    # Each variable stays in the graph it lived in (its dense form's), with its dims.
    dense_where = dense_names(dense)
    assert all(dense_where[n] == g for n, g in where.items())
    for g in [sparse.graph] + [ti.algorithm for ti in sparse.training_info]:
        for st in g.sparse_initializer:
            assert list(st.dims) == [96, 192] and list(st.values.dims) == [0]
            assert st.values.data_type == F32 and list(st.indices.dims) == [0]
    onnx.checker.check_model(sparse)
    tm = validate(sparse)
    assert {n for n, v in tm.state.items() if v.sparse} == expected
    assert all(tm.state[n].shape == (96, 192) for n in expected)
    np.testing.assert_array_equal(tm.initial_value("W1." + slots[0]), np.zeros((96, 192), np.float32))

    cycle = [0] if accumulate == 1 else [0, 1]
    feeds = batches(2 * STEPS)
    s_sess, s_losses = run(sparse, feeds, cycle)
    d_sess, d_losses = run(dense, feeds, cycle)
    assert s_losses == d_losses
    assert_state_bitwise(s_sess, d_sess)
    assert np.any(np.asarray(s_sess.state[f"W1.{slots[0]}"]) != 0)


def _over_an_anonymous_map(a: np.ndarray) -> bool:
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(a.obj if isinstance(a, memoryview) else a, mmap.mmap)


def test_large_sparse_zeros_start_as_untouched_pages(monkeypatch):
    """Round 15: a sparse state variable's zeros of ``ZEROS_MAPPED_FROM``
    bytes or more are a fresh anonymous map (pages given when first
    written: ``np.zeros`` may clear reused memory up front), smaller ones
    plain zeros; training on them is bit for bit the dense form's."""
    from onnxtrain.io import model as io_model

    sparse, dense = build_both(monkeypatch, two_layer(), optimizer=build.Adam(lr=1e-2))
    tm = validate(sparse)
    name = next(n for n, v in tm.state.items() if v.sparse)
    small = tm.initial_value(name)
    assert not _over_an_anonymous_map(small) and not small.any()
    monkeypatch.setattr(io_model, "ZEROS_MAPPED_FROM", 96 * 192 * 4)
    large = tm.initial_value(name)
    assert _over_an_anonymous_map(large) and large.flags.writeable and large.shape == (96, 192)
    assert not large.any()
    feeds = batches(STEPS)
    s_sess, s_losses = run(sparse, feeds, [0])
    d_sess, d_losses = run(dense, feeds, [0])
    assert s_losses == d_losses
    assert_state_bitwise(s_sess, d_sess)


def test_export_and_reload_of_a_training_model_with_sparse_state(monkeypatch, tmp_path):
    sparse, dense = build_both(monkeypatch, two_layer(), optimizer=build.AdamW(lr=1e-2))
    feeds = batches(2 * STEPS)
    s_sess, _ = run(sparse, feeds[:STEPS], [0])
    d_sess, d_losses = run(dense, feeds, [0])
    path = s_sess.export(tmp_path / "checkpoint.onnx", training=True)
    reloaded = onnx.load(str(path))
    assert not sparse_names(reloaded)  # written back dense: training filled them in
    again, losses = run(str(path), feeds[STEPS:], [0])
    assert losses == d_losses[STEPS:]
    assert_state_bitwise(again, d_sess)
    # initialize() resets the sparse variables to zeros like the dense ones.
    s_sess.initialize()
    assert not np.any(np.asarray(s_sess.state["W1.adam_m"]))
    # The inference export carries none of the optimizer state.
    inference = s_sess.to_model()
    assert {t.name for t in inference.graph.initializer} == {"W1", "b1", "W2"}
    assert not inference.graph.sparse_initializer


def test_small_state_and_nonzero_fills_stay_dense(monkeypatch):
    small = build.training_model(mlp(), optimizer=build.AdamW(lr=1e-2), accumulate=2)
    assert not sparse_names(small)
    # Adagrad's initial_accumulator_value: only a +0.0 fill is all-zero bits.
    for value in (0.1, -0.0):
        tm = build.training_model(two_layer(), loss="mse",
                                  optimizer=build.Adagrad(lr=0.1, initial_accumulator_value=value))
        assert not sparse_names(tm)
    # The threshold is inclusive, in bytes.
    monkeypatch.setattr(builder, "SPARSE_ZERO_BYTES", 96 * 192 * 4)
    assert set(sparse_names(build.training_model(two_layer(), loss="mse", optimizer=build.Adam()))) == {
        "W1.adam_m", "W1.adam_v"}
    monkeypatch.setattr(builder, "SPARSE_ZERO_BYTES", 96 * 192 * 4 + 1)
    assert not sparse_names(build.training_model(two_layer(), loss="mse", optimizer=build.Adam()))


def test_large_weight_model_does_not_carry_its_moments(monkeypatch, tmp_path):
    from onnxtrain.io import storage

    rows, cols = 4096, 1024
    w = np.full((rows, cols), 0.01, np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "big",
        [helper.make_tensor_value_info("X", F32, ["N", rows])],
        [helper.make_tensor_value_info("Y", F32, ["N", cols])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sparse, dense = build_both(monkeypatch, model, optimizer=build.AdamW(lr=1e-3))
    # In memory the weight is held twice (the initializer, and the Constant the
    # initialization graph resets it to); the moments no longer add two more.
    assert dense.ByteSize() > 4 * w.nbytes
    assert sparse.ByteSize() < 2 * w.nbytes + 2**16
    assert set(sparse_names(sparse)) == {"W.adam_m", "W.adam_v"}
    onnx.checker.check_model(sparse)
    state = validate(sparse).state
    assert state["W.adam_m"].sparse and state["W.adam_m"].shape == (rows, cols)
    # From a model with external data the weight is stored once: the whole
    # serialized training model is about the weight's size.
    base = tmp_path / "base" / "model.onnx"
    write_model(model, base, external_data=True)
    # Keep the weight mapped (from 256 MiB by default): a mapped range written twice
    # (the weight and its starting value) is stored once.
    monkeypatch.setattr(storage, "SPILL_FROM", 2**20)
    out = tmp_path / "train" / "model.onnx"
    write_model(build.training_model(str(base), loss="mse", optimizer=build.AdamW(lr=1e-3)), out)
    written = sum(f.stat().st_size for f in out.parent.iterdir())
    assert written < 1.1 * w.nbytes, f"{written} bytes written for a {w.nbytes}-byte weight"
