"""The fused Adam kernel (onnxtrain/kernels): the rewrite, the library, the fallbacks.

The fused program must give bit-for-bit the standard program's results, so
each check runs both and compares exactly."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain import TrainingSession, build, kernels
from onnxtrain.fuse import KERNEL_DOMAIN, fuse_adam_updates, with_fused_kernels

from test_build import (TorchRule, assert_trajectories_close, blobs, initial_params, mlp, run_oracle,
                        run_session)

needs_library = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
ALGORITHM = "training_info[0].algorithm"


def fused_ops(sess: TrainingSession) -> list[str]:
    prog = sess.programs(executed=True)[ALGORITHM]
    return [n.op_type for n in prog.graph.node if n.domain == KERNEL_DOMAIN]


def train(model, x, labels, steps, **kwargs):
    sess = TrainingSession(model, **kwargs)
    losses = [float(sess.train_step({"X": x, "target": labels})["loss"]) for _ in range(steps)]
    return sess, losses


@needs_library
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("optimizer", [
    build.AdamW(0.05, weight_decay=0.1),
    build.Adam(0.05),
    build.Adam(0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),  # L2: g + wd p feeds the kernel
])
def test_fused_equals_standard_bit_for_bit(dtype, optimizer):
    model = mlp(sizes=(4, 16, 3), dtype=dtype)
    x, labels = blobs(dtype=dtype)
    tm = build.training_model(model, loss="cross_entropy", optimizer=optimizer)
    fused, fused_losses = train(tm, x, labels, 12, fused_kernels=True)
    plain, plain_losses = train(tm, x, labels, 12, fused_kernels=False)
    suffix = "F32" if dtype == np.float32 else "F64"
    assert fused_ops(fused) == [f"AdamUpdate{suffix}"] * 4  # W1, b1, W2, b2
    assert fused_ops(plain) == []
    assert fused_losses == plain_losses
    for name, value in plain.state.items():
        np.testing.assert_array_equal(fused.state[name], value, err_msg=name)
    assert fused_losses[-1] < fused_losses[0]


@needs_library
def test_default_session_fuses_and_follows_the_numpy_adamw_rule():
    """float64, 30 steps (bias corrections with t > 1), against a numpy transcription."""
    model = mlp(sizes=(4, 6, 3), dtype=np.float64)
    x, labels = blobs(dtype=np.float64)
    hp = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    tm = build.training_model(model, loss="cross_entropy", optimizer=build.AdamW(0.02, **hp))
    expected = run_oracle(initial_params(model), TorchRule("adamw", **hp), 0.02, x, labels, 30)
    sess, got = run_session(tm, x, labels, 30)
    assert len(fused_ops(sess)) == 4  # the default (fused_kernels=None) uses the library
    assert_trajectories_close(got, expected, rtol=1e-10, atol=1e-12)


def _adam_graph(shape=(3, 4), dtype=TensorProto.FLOAT, extra_reader=None, decay=True):
    """The per-parameter update as build.AdamW writes it, over graph inputs."""
    def vi(name, s):
        return helper.make_tensor_value_info(name, dtype, list(s))
    nodes = [helper.make_node("Constant", [], [c], value=helper.make_tensor(c, dtype, [], [val]))
             for c, val in [("b1", 0.9), ("c1", 0.1), ("b2", 0.999), ("c2", 0.001), ("eps", 1e-8),
                            ("s", 0.01), ("d", 0.99)]]
    nodes += [
        helper.make_node("Mul", ["p", "d"], ["pd"]) if decay else helper.make_node("Identity", ["p"], ["pd"]),
        helper.make_node("Mul", ["b1", "m"], ["bm"]),
        helper.make_node("Mul", ["g", "c1"], ["cg"]),
        helper.make_node("Add", ["cg", "bm"], ["m_new"]),
        helper.make_node("Mul", ["v", "b2"], ["bv"]),
        helper.make_node("Mul", ["g", "g"], ["gg"]),
        helper.make_node("Mul", ["c2", "gg"], ["cgg"]),
        helper.make_node("Add", ["bv", "cgg"], ["v_new"]),
        helper.make_node("Sqrt", ["v_new"], ["sq"]),
        helper.make_node("Add", ["eps", "sq"], ["den"]),
        helper.make_node("Div", ["m_new", "den"], ["q"]),
        helper.make_node("Mul", ["q", "s"], ["upd"]),
        helper.make_node("Sub", ["pd", "upd"], ["p_new"]),
    ]
    outputs = [vi("p_new", shape), vi("m_new", shape), vi("v_new", shape)]
    if extra_reader:
        outputs.append(vi(extra_reader, shape))
    graph = helper.make_graph(nodes, "adam", [vi(n, shape) for n in ("p", "g", "m", "v")], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_rewrite_matches_any_operand_order():
    model = _adam_graph()
    fused, count = with_fused_kernels(model)
    assert count == 1
    node = next(n for n in fused.graph.node if n.domain == KERNEL_DOMAIN)
    assert node.op_type == "AdamUpdateF32"
    assert list(node.input[:4]) == ["p", "g", "m", "v"]
    assert list(node.input[4:10]) == ["b1", "c1", "b2", "c2", "eps", "s"]
    assert node.input[10] == "d"
    assert list(node.output) == ["p_new", "m_new", "v_new"]
    assert {o.domain for o in fused.opset_import} >= {"", KERNEL_DOMAIN}
    # Nothing of the eleven standard kernels is left.
    assert [n.op_type for n in fused.graph.node if n.op_type != "Constant"] == ["AdamUpdateF32"]


def test_rewrite_without_decay_adds_a_constant_one():
    model = _adam_graph(decay=False)
    fused, count = with_fused_kernels(model)
    assert count == 1
    node = next(n for n in fused.graph.node if n.domain == KERNEL_DOMAIN)
    assert node.input[0] == "pd"  # the Identity stays; its output is the parameter
    one = next(t for t in fused.graph.initializer if t.name == node.input[10])
    assert onnx.numpy_helper.to_array(one) == 1


@pytest.mark.parametrize("reader", ["q", "den", "gg", "upd"])
def test_rewrite_leaves_updates_whose_intermediates_are_read(reader):
    """An intermediate that something else reads must still be computed: no rewrite."""
    model = _adam_graph(extra_reader=reader)
    assert fuse_adam_updates(model.graph, list(model.opset_import)) == 0


@pytest.mark.parametrize("shape,dtype", [((1,), TensorProto.FLOAT), ((3, 4), TensorProto.FLOAT16),
                                         (("N", 4), TensorProto.FLOAT)])
def test_rewrite_needs_static_float_shapes_of_several_elements(shape, dtype):
    model = _adam_graph(shape=shape, dtype=dtype)
    assert fuse_adam_updates(model.graph, list(model.opset_import)) == 0


@needs_library
def test_kernel_rejects_mismatched_operands_with_an_error():
    """The kernel checks its operands and fails the run (no crash, no garbage)."""
    model = with_fused_kernels(_adam_graph())[0]
    node = next(n for n in model.graph.node if n.domain == KERNEL_DOMAIN)
    # Feed g with fewer elements than p: declare it dynamic so onnxruntime accepts the feed.
    g_in = next(i for i in model.graph.input if i.name == "g")
    g_in.type.tensor_type.shape.dim[0].dim_param = "G"
    model.ir_version = 8
    so = ort.SessionOptions()
    so.register_custom_ops_library(kernels.library())
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    f = np.ones((3, 4), np.float32)
    out = sess.run(None, {"p": f, "g": f, "m": f, "v": f})
    assert all(o.shape == (3, 4) for o in out)
    with pytest.raises(Exception, match="same number of elements"):
        sess.run(None, {"p": f, "g": np.ones((2, 4), np.float32), "m": f, "v": f})
    assert node.op_type == "AdamUpdateF32"


def test_environment_turns_the_library_off(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FUSED_KERNELS", "0")
    assert kernels.library() is None
    assert "off" in kernels.status()
    model = mlp()
    x, labels = blobs()
    tm = build.training_model(model, optimizer=build.AdamW(0.01))
    sess = TrainingSession(tm)
    assert fused_ops(sess) == []
    sess.train_step({"X": x, "target": labels})
    with pytest.raises(RuntimeError, match="off"):
        TrainingSession(tm, fused_kernels=True)


def test_no_compiler_falls_back_to_standard_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    kernels._reset_for_tests()
    try:
        assert kernels.library() is None
        assert "no C compiler" in kernels.status()
        model = mlp()
        x, labels = blobs()
        tm = build.training_model(model, optimizer=build.AdamW(0.01))
        sess = TrainingSession(tm)
        before = sess.state["W1"].copy()
        sess.train_step({"X": x, "target": labels})
        assert not np.array_equal(sess.state["W1"], before)
        assert fused_ops(sess) == []
        assert "no C compiler" in sess.fused_kernels_note
        with pytest.raises(RuntimeError, match="no C compiler"):
            TrainingSession(tm, fused_kernels=True)
    finally:
        monkeypatch.undo()
        kernels._reset_for_tests()


@needs_library
def test_failed_build_reports_the_compiler_error(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'broken toolchain' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    kernels._reset_for_tests()
    try:
        assert kernels.library() is None
        assert "broken toolchain" in kernels.status()
        assert not any((tmp_path / "cache").glob("*.so"))  # no half-written library left
    finally:
        monkeypatch.undo()
        kernels._reset_for_tests()


@needs_library
def test_library_is_cached_by_source_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path))
    kernels._reset_for_tests()
    try:
        path = kernels.library()
        assert path is not None and path.startswith(str(tmp_path))
        mtime = (tmp_path / path.rsplit("/", 1)[1]).stat().st_mtime_ns
        kernels._reset_for_tests()
        assert kernels.library() == path  # found, not rebuilt
        assert (tmp_path / path.rsplit("/", 1)[1]).stat().st_mtime_ns == mtime
    finally:
        monkeypatch.undo()
        kernels._reset_for_tests()


@pytest.mark.parametrize("case", ["default", "custom"])
def test_spec_adam_op_keeps_its_own_lowering(case):
    """The spec's Adam op (eps added before the bias correction, post-update
    decay) is lowered differently; the rewrite only takes the builder's form."""
    from test_optim import _attrs, lower, make_model

    model = make_model("Adam", [(4,), (2, 3)], TensorProto.FLOAT, TensorProto.FLOAT, _attrs("Adam", case))
    assert with_fused_kernels(lower(model))[1] == 0


@needs_library
def test_fused_kernels_true_is_refused_off_cpu():
    model = mlp()
    tm = build.training_model(model, optimizer=build.AdamW(0.01))
    with pytest.raises(ValueError, match="CPU"):
        TrainingSession(tm, providers=["CUDAExecutionProvider"], fused_kernels=True)
    with pytest.raises(TypeError):
        TrainingSession(tm, fused_kernels="yes")
