"""Convolutions on the fast kernels: the column matrix of a weight gradient
(``Im2ColF32``, ``fuse_layers``) is the one the Slices make, bit for bit; the
NCHWc rewrite (``onnxtrain/nchwc.py``) reorders filters into onnxruntime's
layouts exactly and gives the standard ops' results to float32 rounding; and
CNNs train the same with and without both."""

from __future__ import annotations

import shutil

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.kernels import library as kernels
from onnxtrain.kernels.conv import IM2COL_KERNEL
from onnxtrain.kernels.fuse import KERNEL_DOMAIN, with_fused_kernels
from onnxtrain.kernels.nchwc import DOMAIN, REORDER_KERNEL, rewrite
from onnxtrain.runtime.executor import nchwc_block

needs_library = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
needs_nchwc = pytest.mark.skipif(nchwc_block() == 0, reason="this onnxruntime has no NCHWc kernels here")


def _session(model, library=None):
    so = ort.SessionOptions()
    if library:
        so.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _model(nodes, inputs, outputs, inits=(), domains=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
                              initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                              + [helper.make_opsetid(d, 1) for d in domains])
    model.ir_version = 8
    return model


# ------------------------------------------------------------------ filter layouts
def _blocked(f, block, blocked):
    """numpy transcription: OIHW -> [O/b][I/b][h][w][bi][bo] or [O/b][I][h][w][bo]."""
    o, i, kh, kw = f.shape
    if blocked:
        return f.reshape(o // block, block, i // block, block, kh, kw).transpose(0, 2, 4, 5, 3, 1)
    return f.reshape(o // block, block, i, kh, kw).transpose(0, 2, 3, 4, 1)


@needs_library
@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("shape,flip,blocked", [
    ((32, 16, 3, 3), 0, 1), ((32, 16, 3, 3), 1, 1), ((16, 48, 1, 1), 0, 1), ((48, 16, 2, 3), 1, 1),
    ((16, 3, 7, 7), 0, 0), ((32, 5, 3, 1), 0, 0),
])
def test_filter_reorder_is_onnxruntimes_layout(block, shape, flip, blocked):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    g = numpy_helper.from_array(np.array([block, flip, blocked], np.int64), "g")
    model = _model([helper.make_node(REORDER_KERNEL, ["w", "g"], ["r"], domain=KERNEL_DOMAIN)],
                   [("w", list(shape))], ["r"], [g], [KERNEL_DOMAIN])
    (r,) = _session(model, kernels.library()).run(None, {"w": w})
    f = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3) if flip else w
    assert r.shape == f.shape
    assert np.array_equal(r.reshape(-1), _blocked(f, block, blocked).reshape(-1))


@needs_library
def test_filter_reorder_refuses_partial_blocks():
    g = numpy_helper.from_array(np.array([16, 0, 1], np.int64), "g")
    model = _model([helper.make_node(REORDER_KERNEL, ["w", "g"], ["r"], domain=KERNEL_DOMAIN)],
                   [("w", [16, 8, 3, 3])], ["r"], [g], [KERNEL_DOMAIN])
    with pytest.raises(Exception, match="whole blocks"):
        _session(model, kernels.library()).run(None, {"w": np.zeros((16, 8, 3, 3), np.float32)})


@needs_nchwc
def test_the_probed_block_is_onnxruntimes():
    b = nchwc_block()
    assert b % 8 == 0
    x = np.arange(b * 2 * 3 * 2, dtype=np.float32).reshape(2, b, 3, 2)
    model = _model([helper.make_node("ReorderInput", ["x"], ["y"], domain=DOMAIN)], [("x", list(x.shape))], ["y"],
                   domains=[DOMAIN])
    (y,) = _session(model).run(None, {"x": x})
    # one block of channels: [n][h][w][c] within it
    assert np.array_equal(y.reshape(-1), x.transpose(0, 2, 3, 1).reshape(-1))


# ------------------------------------------------------------------ the NCHWc rewrite
def _conv_model(rng):
    """Every case the rewrite takes, and some it leaves."""
    def w(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    inits = [w("w1", (16, 3, 7, 7)), w("b1", (16,)), w("w2", (32, 16, 3, 3)), w("w3", (32, 32, 3, 3)),
             w("w4", (32, 16, 3, 3)), w("w5", (16, 16, 3, 2)), w("w6", (16, 32, 3, 3)), w("w7", (32, 8, 3, 3)),
             w("w8", (16, 32, 1, 1))]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], strides=[2, 2], pads=[3, 3, 3, 3]),  # plain input
        helper.make_node("Conv", ["c1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c2", "w3"], ["c3"], pads=[2, 2, 2, 2], dilations=[2, 2]),
        helper.make_node("ConvTranspose", ["c3", "w4"], ["t4"], pads=[1, 1, 1, 1]),  # stride 1: rewritten
        helper.make_node("ConvTranspose", ["t4", "w5"], ["t5"], pads=[0, 1, 2, 0], dilations=[1, 2]),
        helper.make_node("ConvTranspose", ["t5", "w6"], ["t6"], strides=[2, 2], pads=[1, 1, 1, 1]),  # stride 2: left
        helper.make_node("Conv", ["t6", "w7"], ["c7"], group=4, pads=[1, 1, 1, 1]),  # groups: left
        helper.make_node("Conv", ["c7", "w8"], ["c8"], strides=[2, 2]),
    ]
    return _model(nodes, [("x", [2, 3, 20, 20])], ["c8"], inits), 6


@needs_library
@needs_nchwc
def test_nchwc_rewrite_matches_the_standard_ops():
    rng = np.random.default_rng(0)
    model, expected = _conv_model(rng)
    fast, count = rewrite(model, nchwc_block(), KERNEL_DOMAIN)
    assert count == expected
    ops = [(n.domain, n.op_type) for n in fast.graph.node]
    assert ops.count((DOMAIN, "Conv")) == expected and ops.count((KERNEL_DOMAIN, REORDER_KERNEL)) == expected
    assert ops.count(("", "ConvTranspose")) == 1 and ops.count(("", "Conv")) == 1
    x = rng.standard_normal((2, 3, 20, 20)).astype(np.float32)
    (want,) = _session(model).run(None, {"x": x})
    (got,) = _session(fast, kernels.library()).run(None, {"x": x})
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("block", [8, 16])
def test_nchwc_rewrite_leaves_what_it_cannot_run(block):
    rng = np.random.default_rng(0)
    model, _ = _conv_model(rng)
    # 12 output channels, symbolic weight shape, float64: none taken
    w12 = numpy_helper.from_array(np.zeros((12, 16, 3, 3), np.float32), "w12")
    odd = _model([helper.make_node("Conv", ["x", "w12"], ["y"])], [("x", [1, 16, 5, 5])], ["y"], [w12])
    assert rewrite(odd, block, KERNEL_DOMAIN) == (odd, 0)
    assert rewrite(model, 4, KERNEL_DOMAIN) == (model, 0)  # no usable block
    sym = _model([helper.make_node("Conv", ["x", "w"], ["y"])], [("x", [1, 16, 5, 5]), ("w", ["m", 16, 3, 3])], ["y"])
    assert rewrite(sym, block, KERNEL_DOMAIN)[1] == 0
    auto = _model([helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER")],
                  [("x", [1, 16, 5, 5]), ("w", [16, 16, 3, 3])], ["y"])
    assert rewrite(auto, block, KERNEL_DOMAIN)[1] == 0


# ------------------------------------------------------------------ column matrices
def _cnn(c_in, widths, convs):
    """Conv layers of ``convs`` attributes (channels ``widths``) -> Relu -> mean -> MatMul."""
    rng = np.random.default_rng(0)
    nodes, inits, x, c = [], [], "X", c_in
    for k, (m, attrs) in enumerate(zip(widths, convs)):
        kernel = attrs.pop("k")
        inits.append(numpy_helper.from_array((rng.standard_normal((m, c, *kernel)) * 0.3).astype(np.float32), f"w{k}"))
        nodes += [helper.make_node("Conv", [x, f"w{k}"], [f"c{k}"], **attrs),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"])]
        x, c = f"r{k}", m
    inits.append(numpy_helper.from_array((rng.standard_normal((c, 3)) * 0.3).astype(np.float32), "wf"))
    nodes += [helper.make_node("ReduceMean", [x, "axes"], ["pooled"], keepdims=0),
              helper.make_node("MatMul", ["pooled", "wf"], ["logits"])]
    inits.append(numpy_helper.from_array(np.array([2, 3], np.int64), "axes"))
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, c_in, 13, 12])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 3])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _feeds(c_in):
    rng = np.random.default_rng(1)
    return {"X": rng.standard_normal((4, c_in, 13, 12)).astype(np.float32),
            "target": rng.integers(0, 3, 4).astype(np.int64)}


def _train_both(tm, op, count, feeds, steps=3, domain=KERNEL_DOMAIN):
    """Train ``tm`` with the kernels and without: [(losses, state)] for
    fused_kernels None and False.  The fused program holds ``count`` nodes of
    ``op`` (in ``domain``), the standard one none."""
    runs = []
    for fused in (None, False):
        sess = TrainingSession(tm, fused_kernels=fused)
        nodes = sess.programs(executed=True)["training_info[0].algorithm"].graph.node
        found = sum(n.op_type == op and n.domain == domain for n in nodes)
        assert found == (count if fused is None else 0), (op, found)
        losses = np.array([sess.train_step(feeds)["loss"] for _ in range(steps)])
        runs.append((losses, dict(sess.state)))
    return runs


def _same_bits(runs):
    (la, sa), (lb, sb) = runs
    assert la.tobytes() == lb.tobytes()
    assert {k: v.tobytes() for k, v in sa.items()} == {k: v.tobytes() for k, v in sb.items()}


def _close(runs):
    (la, sa), (lb, sb) = runs
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    for k, v in sb.items():
        np.testing.assert_allclose(sa[k], v, rtol=1e-4, atol=1e-5)


# Channel counts that are no NCHWc block: the Im2Col rewrite alone, bit for bit.
IM2COL_CASES = [
    {"k": [3, 3], "pads": [1, 1, 1, 1]},
    {"k": [3, 3], "strides": [2, 2], "pads": [1, 0, 2, 1]},
    {"k": [2, 3], "dilations": [2, 1], "pads": [0, 2, 1, 0]},
    {"k": [1, 1], "strides": [2, 2]},
    {"k": [3, 2], "strides": [1, 2], "dilations": [2, 2], "pads": [2, 1, 2, 1]},
]


@needs_library
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_im2col_trains_the_same_bit_for_bit(optimizer):
    widths = [12, 18, 70, 12, 11]  # C x taps > 64 from the second layer on; no multiple of 8
    model = _cnn(7, widths, [dict(c) for c in IM2COL_CASES])
    opt = build.AdamW(lr=0.01) if optimizer == "adamw" else build.SGD(lr=0.1)
    tm = build.training_model(model, loss="cross_entropy", optimizer=opt)
    # every weight gradient but the first layer's (7 x 9 taps: the one-Conv form)
    _same_bits(_train_both(tm, IM2COL_KERNEL, 4, _feeds(7)))


@needs_library
def test_im2col_plan_leaves_other_slices():
    model = _cnn(7, [12], [{"k": [3, 3], "pads": [1, 1, 1, 1]}])
    tm = build.training_model(model, loss="cross_entropy", optimizer=build.SGD(lr=0.1))
    program = TrainingSession(tm, fused_kernels=False).programs()["training_info[0].algorithm"]
    fused, _ = with_fused_kernels(program)
    assert [n.op_type for n in fused.graph.node].count(IM2COL_KERNEL) == 0  # 7 x 9 <= 64: no column matrix
    model = _cnn(7, [12, 10], [{"k": [3, 3], "pads": [1, 1, 1, 1]}, {"k": [3, 3], "pads": [1, 1, 1, 1]}])
    tm = build.training_model(model, loss="cross_entropy", optimizer=build.SGD(lr=0.1))
    program = TrainingSession(tm, fused_kernels=False).programs()["training_info[0].algorithm"]
    # a Pad with a nonzero value is no zero padding: left to onnxruntime
    for node in program.graph.node:
        if node.op_type == "Pad":
            value = helper.make_tensor(node.output[0] + "_v", TensorProto.FLOAT, [], [1.0])
            program.graph.initializer.append(value)
            node.input.append(value.name)
    fused, _ = with_fused_kernels(program)
    assert [n.op_type for n in fused.graph.node].count(IM2COL_KERNEL) == 0


# ------------------------------------------------------------------ training on NCHWc
@needs_library
@needs_nchwc
def test_cnn_trains_on_nchwc_kernels():
    """Channels in whole blocks: the convolutions and their input gradients run
    as NCHWc Convs; the training follows the standard ops' to rounding."""
    model = _cnn(3, [16, 32, 32], [{"k": [3, 3], "pads": [1, 1, 1, 1]},
                                   {"k": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                                   {"k": [3, 3], "pads": [1, 1, 1, 1]}])
    tm = build.training_model(model, loss="cross_entropy", optimizer=build.SGD(lr=0.05, momentum=0.9))
    # three forward convs and one input gradient (layer 3's; layer 2's has
    # stride 2, layer 1's is not needed)
    _close(_train_both(tm, "Conv", 4, _feeds(3), steps=4, domain=DOMAIN))


# ------------------------------------------------------------------ BatchNorm's gradient, pooling's scatter
def _bn_cnn(channels=6, pool=True, norm=True):
    """Conv [-> BatchNormalization] -> Relu [-> MaxPool 3x3/2 pad 1, overlapping] -> mean -> MatMul."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((channels, 3, 3, 3)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(channels)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(channels)).astype(np.float32), "beta"),
             numpy_helper.from_array(np.zeros(channels, np.float32), "mean"),
             numpy_helper.from_array(np.ones(channels, np.float32), "var"),
             numpy_helper.from_array((rng.standard_normal((channels, 3)) * 0.3).astype(np.float32), "wf"),
             numpy_helper.from_array(np.array([2, 3], np.int64), "axes")]
    if not norm:
        inits = [t for t in inits if t.name not in ("gamma", "beta", "mean", "var")]
    nodes = [helper.make_node("Conv", ["X", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["b"]),
             helper.make_node("Relu", ["b"], ["r"])]
    if not norm:
        nodes = [nodes[0], helper.make_node("Relu", ["c"], ["r"])]
    last = "r"
    if pool:
        nodes.append(helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
        last = "p"
    nodes += [helper.make_node("ReduceMean", [last, "axes"], ["pooled"], keepdims=0),
              helper.make_node("MatMul", ["pooled", "wf"], ["logits"])]
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 3, 13, 12])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 3])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


@needs_library
def test_pooling_scatter_trains_the_same_bit_for_bit():
    """Overlapping windows: MaxPool's gradient scatters into zeros (ScatterAddZerosF32)."""
    tm = build.training_model(_bn_cnn(pool=True, norm=False), loss="cross_entropy", optimizer=build.SGD(lr=0.1))
    _same_bits(_train_both(tm, "ScatterAddZerosF32", 1, _feeds(3)))


@needs_library
def test_scatter_kernel_refuses_indices_out_of_range():
    size = numpy_helper.from_array(np.array([4], np.int64), "n")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("ScatterAddZerosF32", ["n", "i", "u"], ["y"], domain=KERNEL_DOMAIN)], "s",
        [helper.make_tensor_value_info("i", TensorProto.INT64, [2]), helper.make_tensor_value_info("u", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[size]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 8
    s = _session(model, kernels.library())
    (y,) = s.run(None, {"i": np.array([3, -1], np.int64), "u": np.array([1.0, 2.0], np.float32)})
    assert y.tolist() == [0.0, 0.0, 0.0, 3.0]  # a negative index counts from the end, sums in order
    with pytest.raises(Exception, match="out of range"):
        s.run(None, {"i": np.array([4, 0], np.int64), "u": np.array([1.0, 2.0], np.float32)})


@needs_library
def test_batch_norm_gradient_kernel_matches_float64():
    """The kernel's dx, dscale, dbias against the rule's formulas in float64."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 6, 7, 3)) * 3 + 10).astype(np.float32)  # far from zero: no cancellation
    dy = rng.standard_normal(x.shape).astype(np.float32)
    scale = rng.standard_normal(6).astype(np.float32)
    eps = np.array([1e-5], np.float32)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("BatchNormGradF32", ["x", "dy", "s", "e"], ["dx", "ds", "db"], domain=KERNEL_DOMAIN)], "b",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "dy", "s", "e")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("dx", "ds", "db")]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 8
    dx, ds, db = _session(model, kernels.library()).run(None, {"x": x, "dy": dy, "s": scale, "e": eps})
    axes = (0, 2, 3)
    x64, dy64, s64 = x.astype(np.float64), dy.astype(np.float64), scale.astype(np.float64)[None, :, None, None]
    mu = x64.mean(axis=axes, keepdims=True)
    inv = 1 / np.sqrt(((x64 - mu) ** 2).mean(axis=axes, keepdims=True) + 1e-5)
    xhat = (x64 - mu) * inv
    g = dy64 * s64
    want = inv * (g - g.mean(axis=axes, keepdims=True) - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    np.testing.assert_allclose(dx, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(ds, (dy64 * xhat).sum(axis=axes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, dy64.sum(axis=axes), rtol=1e-5, atol=1e-5)


@needs_library
def test_cnn_with_batch_norm_trains_on_the_kernel():
    tm = build.training_model(_bn_cnn(pool=False), loss="cross_entropy", optimizer=build.SGD(lr=0.1, momentum=0.9))
    _close(_train_both(tm, "BatchNormGradF32", 1, _feeds(3), steps=4))


# ------------------------------------------------------------------ strided transposed windows
@needs_library
@pytest.mark.parametrize("attrs,k,size", [
    ({"strides": [2, 2], "pads": [1, 1, 0, 0]}, 3, 7),  # ResNet's strided input gradients
    ({"strides": [2, 2], "pads": [1, 1, 1, 1]}, 3, 4),
    ({"strides": [2, 3], "pads": [0, 1, 2, 0], "output_padding": [1, 0]}, 3, 5),
    ({"strides": [2, 2], "dilations": [2, 1], "pads": [1, 0, 0, 1]}, 2, 6),
    ({"strides": [3, 3]}, 4, 3),
])
def test_col2im_equals_conv_transpose_bit_for_bit(attrs, k, size):
    rng = np.random.default_rng(2)
    w = numpy_helper.from_array(rng.standard_normal((10, 6, k, k)).astype(np.float32), "w")
    model = _model([helper.make_node("ConvTranspose", ["z", "w"], ["y"], **attrs)], [("z", [3, 10, size, size])],
                   ["y"], [w])
    fused, count = with_fused_kernels(model)
    assert count == 1 and [n.op_type for n in fused.graph.node][-1] == "Col2ImF32"
    z = rng.standard_normal((3, 10, size, size)).astype(np.float32)
    (want,) = _session(model).run(None, {"z": z})
    (got,) = _session(fused, kernels.library()).run(None, {"z": z})
    assert got.shape == want.shape and got.tobytes() == want.tobytes()


def test_col2im_leaves_stride_one_and_1x1_windows():
    w = numpy_helper.from_array(np.ones((10, 6, 3, 3), np.float32), "w")
    w1 = numpy_helper.from_array(np.ones((10, 6, 1, 1), np.float32), "w1")
    model = _model([helper.make_node("ConvTranspose", ["z", "w"], ["y"], pads=[1, 1, 1, 1]),
                    helper.make_node("ConvTranspose", ["z", "w1"], ["y1"], strides=[2, 2])],
                   [("z", [3, 10, 5, 5])], ["y", "y1"], [w, w1])
    assert with_fused_kernels(model)[1] == 0
