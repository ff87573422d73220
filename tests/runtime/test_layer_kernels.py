"""The kernel library's layer ops (``onnxtrain/fuse_layers.py``):
MaxPoolIndicesF32 gives the same Y and Indices as onnxruntime's MaxPool, and
ReluGradF32/F64 the same bits as Where(Greater(y, 0), dy, 0), ties, NaN,
signed zeros and infinities included; the rewrites are made only where they
are exact; and a CNN trains the same with and without them."""

from __future__ import annotations

import shutil

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.kernels import library as kernels
from onnxtrain.kernels.fuse import KERNEL_DOMAIN, with_fused_kernels
from onnxtrain.kernels.layers import POOL_KERNEL, RELU_GRAD, max_pool_plan, relu_grad_plan

needs_library = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)

GEOMETRIES = [
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 3]},
    {"kernel_shape": [2, 2], "strides": [1, 1], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [2, 0, 1, 1]},
    {"kernel_shape": [1, 1], "strides": [2, 3]},
    {"kernel_shape": [4, 4], "strides": [3, 3], "pads": [0, 3, 2, 0]},
]
SHAPES = [(2, 3, 8, 8), (1, 2, 11, 9), (3, 1, 5, 6)]


def _pool_model(shape, attrs, opset=17):
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("i", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _run(model, x, library=None):
    so = ort.SessionOptions()
    if library:
        so.register_custom_ops_library(library)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _inputs(shape, kind, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "ties":
        return rng.integers(-1, 2, size=shape).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[rng.random(flat.size) < 0.3] = np.nan
    flat[rng.random(flat.size) < 0.2] = -np.inf
    flat[rng.random(flat.size) < 0.1] = np.finfo(np.float32).min
    flat[rng.random(flat.size) < 0.05] = np.inf
    if kind == "no-winner":  # whole planes that nothing beats: NaN and -inf only
        x[0] = np.where(rng.random(x[0].shape) < 0.5, np.nan, -np.inf)
    return x


@needs_library
@pytest.mark.parametrize("kind", ["random", "ties", "special", "no-winner"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("attrs", GEOMETRIES)
def test_kernel_equals_onnxruntime_bit_for_bit(attrs, shape, kind):
    model = _pool_model(shape, attrs)
    fused, count = with_fused_kernels(model)
    assert count == 1 and fused.graph.node[0].op_type == POOL_KERNEL
    x = _inputs(shape, kind)
    want_y, want_i = _run(model, x)
    got_y, got_i = _run(fused, x, kernels.library())
    assert got_y.dtype == np.float32 and got_i.dtype == np.int64
    assert got_y.tobytes() == want_y.tobytes()
    np.testing.assert_array_equal(got_i, want_i)


@pytest.mark.parametrize("attrs,dtype,dims,why", [
    ({"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, TensorProto.FLOAT, [1, 1, 7, 7], "ceil_mode"),
    ({"kernel_shape": [2, 2], "dilations": [2, 2]}, TensorProto.FLOAT, [1, 1, 7, 7], "dilations"),
    ({"kernel_shape": [2, 2], "storage_order": 1}, TensorProto.FLOAT, [1, 1, 6, 6], "column-major"),
    ({"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER"}, TensorProto.FLOAT, [1, 1, 6, 6], "auto_pad"),
    ({"kernel_shape": [2, 2], "pads": [2, 0, 0, 0]}, TensorProto.FLOAT, [1, 1, 6, 6], "pad as wide as the window"),
    ({"kernel_shape": [2, 2]}, TensorProto.DOUBLE, [1, 1, 6, 6], "float64"),
    ({"kernel_shape": [2, 2]}, TensorProto.FLOAT16, [1, 1, 6, 6], "float16"),
    ({"kernel_shape": [2]}, TensorProto.FLOAT, [1, 1, 6], "1-D"),
    ({"kernel_shape": [2, 2, 2]}, TensorProto.FLOAT, [1, 1, 4, 4, 4], "3-D"),
    ({"kernel_shape": [2, 2]}, TensorProto.FLOAT, [1, 1, "h", 6], "symbolic height"),
])
def test_rewrite_only_where_exact(attrs, dtype, dims, why):
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", dtype, dims)],
                              [helper.make_tensor_value_info("y", dtype, None),
                               helper.make_tensor_value_info("i", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert max_pool_plan(model.graph, list(model.opset_import)) == {}, why
    assert with_fused_kernels(model) == (model, 0)


def test_no_rewrite_without_indices_and_symbolic_batch_is_fine():
    plain = _pool_model([2, 2, 6, 6], {"kernel_shape": [2, 2]})
    del plain.graph.node[0].output[1]
    del plain.graph.output[1]
    assert max_pool_plan(plain.graph, list(plain.opset_import)) == {}
    batch = _pool_model(["n", "c", 6, 6], {"kernel_shape": [2, 2], "strides": [2, 2]})
    assert max_pool_plan(batch.graph, list(batch.opset_import)) == {"i": [2, 2, 2, 2, 0, 0, 3, 3]}


@needs_library
def test_kernel_refuses_bad_geometry_with_an_error():
    node = helper.make_node(POOL_KERNEL, ["x", "g"], ["y", "i"], domain=KERNEL_DOMAIN)
    g = numpy_helper.from_array(np.array([2, 2, 0, 2, 0, 0, 3, 3], np.int64), "g")
    graph = helper.make_graph([node], "bad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("i", TensorProto.INT64, None)], initializer=[g])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 8
    with pytest.raises(Exception, match="bad window geometry"):
        _run(model, np.zeros((1, 1, 6, 6), np.float32), kernels.library())


def _cnn():
    """Conv -> Relu -> MaxPool 2x2 -> Conv -> Relu -> MaxPool 3x3/2 pad 1 -> Gemm."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((4, 1, 3, 3)) * 0.5).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(np.full(4, 0.1, np.float32), "b1")  # a positive bias: tied windows
    w2 = numpy_helper.from_array((rng.standard_normal((6, 4, 3, 3)) * 0.3).astype(np.float32), "w2")
    wf = numpy_helper.from_array((rng.standard_normal((6 * 3 * 3, 3)) * 0.2).astype(np.float32), "wf")
    nodes = [
        helper.make_node("Conv", ["X", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("MatMul", ["f", "wf"], ["logits"]),
    ]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [8, 1, 11, 11])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [8, 3])],
                              initializer=[w1, b1, w2, wf])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@needs_library
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_cnn_trains_the_same_with_the_kernel(optimizer):
    opt = build.AdamW(lr=0.01) if optimizer == "adamw" else build.SGD(lr=0.1)
    tm = build.training_model(_cnn(), loss="cross_entropy", optimizer=opt)
    rng = np.random.default_rng(1)
    x = np.where(rng.random((8, 1, 11, 11)) < 0.5, 0.0, rng.standard_normal((8, 1, 11, 11))).astype(np.float32)
    feeds = {"X": x, "target": rng.integers(0, 3, 8).astype(np.int64)}
    states = []
    for fused in (None, False):
        sess = TrainingSession(tm, fused_kernels=fused)
        ops = [n.op_type for n in sess.programs(executed=True)["training_info[0].algorithm"].graph.node]
        assert (ops.count(POOL_KERNEL) == 2) == (fused is None)
        assert (ops.count(RELU_GRAD[TensorProto.FLOAT]) == 2) == (fused is None)
        losses = [sess.train_step(feeds)["loss"].tobytes() for _ in range(4)]
        states.append((losses, {k: v.tobytes() for k, v in sess.state.items()}))
    assert states[0] == states[1]


# ------------------------------------------------------------------ Relu's gradient
def _relu_grad_model(shape_y, shape_dy, dtype=TensorProto.FLOAT, zero=0.0, zero_y=0.0):
    np_t = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [numpy_helper.from_array(np.array(zero_y, np_t), "zy"), numpy_helper.from_array(np.array(zero, np_t), "z")]
    nodes = [helper.make_node("Greater", ["y", "zy"], ["c"]), helper.make_node("Where", ["c", "dy", "z"], ["dx"])]
    graph = helper.make_graph(nodes, "relu_grad", [helper.make_tensor_value_info("y", dtype, shape_y),
                                                   helper.make_tensor_value_info("dy", dtype, shape_dy)],
                              [helper.make_tensor_value_info("dx", dtype, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _special(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    flat = x.reshape(-1)
    for value, share in ((np.nan, 0.1), (np.inf, 0.05), (-np.inf, 0.05), (0.0, 0.1), (-0.0, 0.1)):
        flat[rng.random(flat.size) < share] = value
    return x


@needs_library
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4, 5), (16, 64, 33), (1,)])
def test_relu_grad_equals_where_bit_for_bit(shape, dtype):
    model = _relu_grad_model(list(shape), list(shape), dtype)
    fused, count = with_fused_kernels(model)
    assert count == 1 and [n.op_type for n in fused.graph.node] == [RELU_GRAD[dtype]]
    np_t = helper.tensor_dtype_to_np_dtype(dtype)
    feeds = {"y": _special(shape, np_t, 1), "dy": _special(shape, np_t, 2)}
    so = ort.SessionOptions()
    want = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    so.register_custom_ops_library(kernels.library())
    got = ort.InferenceSession(fused.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("change", ["broadcast", "symbolic", "float16", "nonzero", "negative-zero",
                                    "nonzero-threshold", "other-reader"])
def test_relu_grad_rewrite_only_where_exact(change):
    shape_y, shape_dy, dtype, zero, zero_y = [4, 5], [4, 5], TensorProto.FLOAT, 0.0, 0.0
    if change == "broadcast":
        shape_y = [4, 1]
    elif change == "symbolic":
        shape_y = shape_dy = ["n", 5]
    elif change == "float16":
        dtype = TensorProto.FLOAT16
    elif change == "nonzero":
        zero = 0.5
    elif change == "negative-zero":
        zero = -0.0
    elif change == "nonzero-threshold":
        zero_y = 1.0
    model = _relu_grad_model(shape_y, shape_dy, dtype, zero, zero_y)
    if change == "other-reader":  # the rewrite is still made; the Greater stays for its reader
        model.graph.output.append(helper.make_tensor_value_info("c", TensorProto.BOOL, None))
        fused, count = with_fused_kernels(model)
        assert count == 1 and sorted(n.op_type for n in fused.graph.node) == ["Greater", "ReluGradF32"]
        return
    assert relu_grad_plan(model.graph, list(model.opset_import)) == {}
    assert with_fused_kernels(model) == (model, 0)
