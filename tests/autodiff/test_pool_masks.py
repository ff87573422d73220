"""MaxPool's gradient placed by MaxUnpool (disjoint windows, float32) and the
Relu mask moved before the placement (``autodiff/masks.py``).

Both are rewrites of a gradient that the scatter-add form computes too, so
besides finite differences they are checked for equality with that form
(rewrites turned off), ties included: every element of a tied window holds
the same value, and only the first one may get the gradient."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_vjp, check_vjp_f32, expand, make_model
from onnx import TensorProto, helper

import onnxtrain.autodiff.expand as expand_module
import onnxtrain.autodiff.rules.pool as pool
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.runtime.executor import Executor

RELU = helper.make_node("Relu", ["x"], ["r"], name="relu")

# (x shape, MaxPool attributes, whether the windows are disjoint)
CASES = [
    ((2, 3, 6, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}, True),
    ((2, 3, 11, 11), {"kernel_shape": [2, 2], "strides": [2, 2]}, True),
    ((1, 2, 7, 7), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, True),
    ((1, 2, 6, 6), {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]}, True),
    ((1, 2, 9, 8), {"kernel_shape": [3, 2], "strides": [3, 3]}, True),
    ((2, 3, 10), {"kernel_shape": [2], "strides": [2]}, True),
    ((1, 2, 4, 6, 4), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}, True),
    ((1, 2, 9, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, False),
    ((1, 2, 6, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, False),
    ((2, 2, 5, 4), {"kernel_shape": [2, 2], "strides": [2, 2], "storage_order": 1}, False),
]


def _distinct(*shape, seed=0):
    """Values 0.1 apart, none within 0.05 of Relu's kink: stable argmax and mask."""
    n = int(np.prod(shape))
    perm = np.random.default_rng(seed).permutation(n)
    return (perm.reshape(shape) * 0.1 - n * 0.05 + 0.05).astype(np.float64)


def _ties(shape, seed=1):
    """Small integers, half of them negative: many tied windows, many zero ones."""
    return np.random.default_rng(seed).integers(-2, 3, size=shape).astype(np.float64)


def _pool(attrs):
    return helper.make_node("MaxPool", ["r"], ["out0"], name="op", **attrs)


def _gradient_program(shape, attrs, dtype, opset=17, relu=True):
    """x -> [Relu] -> MaxPool -> sum(y * dy); returns (expanded model, feeds)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = ([RELU] if relu else [helper.make_node("Identity", ["x"], ["r"])]) + [_pool(attrs)]
    nodes += [helper.make_node("Mul", ["out0", "dy"], ["p"]), helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0),
              helper.make_node("Gradient", ["x"], ["dx"], domain=PREVIEW_DOMAIN, xs=["x"], y="loss")]
    x = _ties(shape).astype(dtype)
    probe = Executor(make_model(nodes[:2], {"x": x}, ["out0"], opset, {"out0": elem})).run({"x": x}, ["out0"])[0]
    dy = np.random.default_rng(5).standard_normal(probe.shape).astype(dtype)
    feeds = {"x": x, "dy": dy}
    model = make_model(nodes, feeds, ["dx"], opset, {"dx": elem}, {"dx": list(shape)})
    return expand(model), feeds


def _reference(x, attrs, dy, relu=True):
    """The gradient by hand: dy to the first maximum of each window (row-major),
    times the Relu mask."""
    r = np.maximum(x, 0) if relu else x
    k = len(attrs["kernel_shape"])
    kernel, strides = attrs["kernel_shape"], attrs.get("strides", [1] * k)
    pads = attrs.get("pads", [0] * 2 * k)
    dx = np.zeros_like(x)
    for out in np.ndindex(*dy.shape):
        n, c, o = out[0], out[1], out[2:]
        best, at = -np.inf, None
        for tap in np.ndindex(*kernel):
            p = tuple(oi * s + t - pb for oi, s, t, pb in zip(o, strides, tap, pads))
            if all(0 <= pi < d for pi, d in zip(p, x.shape[2:])) and r[(n, c) + p] > best:
                best, at = r[(n, c) + p], p
        dx[(n, c) + at] += dy[out]
    return dx * (r > 0) if relu else dx


def _ops(model):
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("shape,attrs,disjoint", CASES)
def test_relu_max_pool_finite_differences(shape, attrs, disjoint):
    # float64: the scatter form with the folded mask
    check_vjp("MaxPool", {"x": _distinct(*shape)}, attrs, node_inputs=["r"], extra_nodes=[RELU], wrt=["x"])


@pytest.mark.parametrize("shape,attrs,disjoint", CASES)
def test_relu_max_pool_float32(shape, attrs, disjoint):
    check_vjp_f32("MaxPool", {"x": _distinct(*shape)}, attrs, node_inputs=["r"], extra_nodes=[RELU],
                  wrt=["x"], oracle="ort64")
    check_vjp_f32("MaxPool", {"x": _distinct(*shape)}, attrs, oracle="ort64")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("shape,attrs,disjoint", CASES)
def test_ties_match_the_scatter_form(shape, attrs, disjoint, relu, dtype, monkeypatch):
    new, feeds = _gradient_program(shape, attrs, dtype, relu=relu)
    got = Executor(new).run(feeds, ["dx"])[0]
    unpooled = disjoint and dtype == np.float32
    assert ("MaxUnpool" in _ops(new)) == unpooled
    assert ("ScatterElements" in _ops(new)) == (not unpooled)
    monkeypatch.setattr(expand_module, "fold_masks", lambda *a: 0)
    monkeypatch.setattr(pool, "_unpool_fits", lambda *a: False)
    old, _ = _gradient_program(shape, attrs, dtype, relu=relu)
    assert "MaxUnpool" not in _ops(old)
    want = Executor(old).run(feeds, ["dx"])[0]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, _reference(feeds["x"], attrs, feeds["dy"], relu), rtol=1e-6, atol=1e-6)
    assert np.count_nonzero(got) < got.size  # the ties and the mask did zero some


@pytest.mark.parametrize("shape,attrs,disjoint", CASES)
def test_the_mask_runs_on_the_pooled_tensor(shape, attrs, disjoint):
    model, _ = _gradient_program(shape, attrs, np.float32)
    nodes = {o: n for n in model.graph.node for o in n.output}
    (greater,) = [n for n in model.graph.node if n.op_type == "Greater"]
    pooled = next(n for n in model.graph.node if n.op_type == "MaxPool").output[0]
    if attrs.get("storage_order", 0):
        assert greater.input[0] == "r"  # the transposed layout is not folded
        return
    assert greater.input[0] == pooled
    (where,) = [n for n in model.graph.node if n.op_type == "Where"]
    assert where.input[0] == greater.output[0]
    assert nodes[where.input[1]].op_type != "MaxUnpool"


def test_no_fold_when_relu_output_has_another_reader():
    # r feeds the pool and the loss: its gradient is a sum, masked after the sum
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    extra = [RELU, helper.make_node("Identity", ["r"], ["out1"])]
    grads = check_vjp("MaxPool", {"x": _distinct(2, 2, 4, 4)}, attrs, node_inputs=["r"], n_outputs=1,
                      extra_nodes=extra, wrt=["x"])
    assert grads["x"].shape == (2, 2, 4, 4)
    nodes = [*extra, helper.make_node("MaxPool", ["r"], ["y"], **attrs),
             helper.make_node("ReduceSum", ["y"], ["s1"], keepdims=0),
             helper.make_node("ReduceSum", ["out1"], ["s2"], keepdims=0),
             helper.make_node("Add", ["s1", "s2"], ["loss"]),
             helper.make_node("Gradient", ["x"], ["dx"], domain=PREVIEW_DOMAIN, xs=["x"], y="loss")]
    x = _ties((2, 2, 4, 4)).astype(np.float32)
    model = expand(make_model(nodes, {"x": x}, ["dx"], 17, {"dx": TensorProto.FLOAT}, {"dx": [2, 2, 4, 4]}))
    (greater,) = [n for n in model.graph.node if n.op_type == "Greater"]
    assert greater.input[0] == "r"
    got = Executor(model).run({"x": x}, ["dx"])[0]
    ones = np.ones((2, 2, 2, 2))
    want = _reference(x.astype(np.float64), attrs, ones) + (x > 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)
