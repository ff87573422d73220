"""Gradient rules of neural-network layers.

onnxruntime runs Conv, ConvTranspose, AveragePool, the global pools and
several normalizations only in float32, so those are checked with
``check_vjp_f32``: the float32 gradient against central differences of the
float32 loss with a unit step (exact for ops linear or bilinear in the checked
inputs) or of the float64 loss on the ONNX reference implementation."""

from __future__ import annotations

import numpy as np
import pytest

from gradcheck import check_vjp
from gradcheck_f32 import check_vjp_f32
from onnxtrain.errors import TrainingModelError


def _rand(*shape, seed=0):
    return np.asarray(np.random.default_rng(seed + 7 * len(shape)).standard_normal(shape))


def _distinct(*shape, seed=0):
    """Values 0.1 apart in random order, so that max-pooling's argmax is stable."""
    n = int(np.prod(shape))
    perm = np.random.default_rng(seed).permutation(n)
    return (perm.reshape(shape) * 0.1 - n * 0.05).astype(np.float64)


# ------------------------------------------------------------------ Softmax
SOFTMAX_CASES = [
    # (shape, axis or None for the default, opset)
    ((3, 4), None, 11),
    ((2, 3, 4), None, 11),
    ((2, 3, 4), 0, 11),
    ((2, 3, 4), 2, 12),
    ((2, 1, 4, 3), -1, 12),
    ((2, 3, 4), -2, 12),
    ((3, 4), None, 13),
    ((2, 3, 4), None, 13),
    ((2, 3, 4), 1, 17),
    ((2, 1, 4, 3), 0, 17),
    ((2, 3, 4), -2, 21),
    ((1, 5), None, 17),
]


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape,axis,opset", SOFTMAX_CASES)
def test_softmax(op, shape, axis, opset):
    attrs = {} if axis is None else {"axis": axis}
    check_vjp(op, {"x": _rand(*shape)}, attrs, opset=opset)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("opset,axis", [(11, 1), (12, -2), (13, 1), (17, None)])
def test_softmax_symbolic(op, opset, axis):
    attrs = {} if axis is None else {"axis": axis}
    check_vjp_f32(op, {"x": _rand(2, 3, 4)}, attrs, opset=opset, symbolic=True, oracle="ort64")
    if opset >= 13:
        check_vjp(op, {"x": _rand(2, 3, 4)}, attrs, opset=opset, symbolic=True)


def test_hardmax_has_zero_gradient():
    g = check_vjp_f32("Hardmax", {"x": _rand(3, 4)}, oracle="reference")
    assert not np.any(g["x"])


# --------------------------------------------------------------------- Conv
CONV_CASES = [
    # (x shape, w shape, attrs, with bias)
    ((2, 3, 7), (4, 3, 3), {}, False),
    ((2, 4, 9), (6, 2, 3), {"group": 2, "strides": [2], "pads": [1, 2]}, True),
    ((1, 2, 11), (3, 2, 2), {"dilations": [2], "strides": [3]}, False),
    ((2, 3, 6, 5), (4, 3, 3, 2), {}, True),
    ((2, 3, 6, 5), (4, 3, 3, 2), {"pads": [1, 0, 2, 1], "strides": [2, 1]}, False),
    ((1, 2, 7, 6), (3, 2, 2, 3), {"dilations": [2, 1], "strides": [1, 2], "pads": [0, 1, 1, 0]}, True),
    ((1, 6, 5, 5), (6, 2, 3, 3), {"group": 3, "strides": [2, 2]}, False),
    ((2, 4, 5, 5), (4, 1, 3, 3), {"group": 4, "pads": [1, 1, 1, 1]}, True),
    ((1, 2, 6, 7), (3, 2, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, False),
    ((1, 2, 7, 6), (3, 2, 2, 3), {"auto_pad": "SAME_LOWER", "strides": [2, 1]}, True),
    ((1, 2, 7, 8), (2, 2, 3, 3), {"auto_pad": "VALID", "strides": [2, 3]}, False),
    ((2, 3, 5, 5), (2, 3, 1, 1), {"strides": [2, 2]}, False),
    ((1, 1, 9, 9), (1, 1, 2, 2), {"strides": [3, 3], "kernel_shape": [2, 2]}, False),
    ((1, 2, 4, 5, 3), (3, 2, 2, 3, 2), {"strides": [1, 2, 1], "pads": [1, 0, 0, 0, 1, 1]}, True),
    ((1, 4, 4, 3, 3), (2, 2, 2, 2, 2), {"group": 2, "dilations": [1, 2, 1]}, False),
    ((1, 2, 5, 4, 4), (2, 2, 3, 1, 2), {"auto_pad": "SAME_UPPER", "strides": [2, 1, 2]}, True),
]


def _conv_inputs(xs, ws, bias):
    inputs = {"x": _rand(*xs), "w": _rand(*ws, seed=1)}
    if bias:
        inputs["b"] = _rand(ws[0], seed=2)
    return inputs


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("xs,ws,attrs,bias", CONV_CASES)
def test_conv(xs, ws, attrs, bias, symbolic):
    check_vjp_f32("Conv", _conv_inputs(xs, ws, bias), attrs, opset=17, symbolic=symbolic)


@pytest.mark.parametrize(
    "opset,symbolic", [(9, False), (11, False), (11, True), (13, True), (22, False)]
)
@pytest.mark.parametrize("case", [1, 9, 13])
def test_conv_opsets(case, opset, symbolic):
    xs, ws, attrs, bias = CONV_CASES[case]
    check_vjp_f32("Conv", _conv_inputs(xs, ws, bias), attrs, opset=opset, symbolic=symbolic)


def test_conv_wrt_weight_only():
    g = check_vjp_f32("Conv", _conv_inputs((2, 3, 6, 5), (4, 3, 3, 2), False), wrt=["w"])
    assert set(g) == {"w"}


def test_conv_symbolic_opset9_is_refused():
    with pytest.raises(TrainingModelError, match="opset 9 < 10"):
        check_vjp_f32(
            "Conv", _conv_inputs((1, 2, 6, 7), (3, 2, 3, 3), False), {"strides": [2, 2]},
            opset=9, symbolic=True,
        )


# ------------------------------------------------------------------ MaxPool
MAXPOOL_CASES = [
    # (x shape, attrs)
    ((2, 3, 6, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((1, 2, 5, 6), {"kernel_shape": [3, 3]}),
    ((1, 2, 7, 6), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}),
    ((1, 2, 6, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 2, 7, 7), {"kernel_shape": [2, 2], "dilations": [2, 2]}),
    ((2, 2, 5, 4), {"kernel_shape": [2, 3], "storage_order": 1}),
    ((2, 1, 4, 5), {"kernel_shape": [3, 2], "strides": [1, 2], "storage_order": 1, "pads": [1, 1, 1, 0]}),
    ((2, 3, 9), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    ((1, 2, 4, 5, 4), {"kernel_shape": [2, 3, 2], "strides": [1, 2, 2]}),
    ((1, 1, 4, 4, 3), {"kernel_shape": [2, 2, 2], "storage_order": 1}),
    ((1, 2, 6, 5), {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]}),
]


@pytest.mark.parametrize("opset", [17, 12, 10])
@pytest.mark.parametrize("shape,attrs", MAXPOOL_CASES)
def test_max_pool(shape, attrs, opset):
    check_vjp("MaxPool", {"x": _distinct(*shape)}, attrs, opset=opset)


@pytest.mark.parametrize("opset", [11, 17])
@pytest.mark.parametrize("case", [1, 3, 5])
def test_max_pool_symbolic(case, opset):
    shape, attrs = MAXPOOL_CASES[case]
    check_vjp_f32("MaxPool", {"x": _distinct(*shape)}, attrs, opset=opset, symbolic=True, oracle="ort64")


def test_max_pool_opset9():
    check_vjp("MaxPool", {"x": _distinct(2, 2, 4, 6)}, {"kernel_shape": [2, 3], "strides": [2, 3]}, opset=9)
    with pytest.raises(TrainingModelError, match="overlapping windows"):
        check_vjp("MaxPool", {"x": _distinct(1, 1, 4, 4)}, {"kernel_shape": [2, 2]}, opset=9)


def test_max_pool_float32():
    check_vjp_f32("MaxPool", {"x": _distinct(2, 3, 5, 5)}, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, oracle="ort64")


# -------------------------------------------------------------- AveragePool
AVGPOOL_CASES = [
    ((2, 3, 6, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((1, 2, 5, 6), {"kernel_shape": [3, 3]}),
    ((1, 2, 7, 6), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}),
    ((1, 2, 7, 6), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "count_include_pad": 1}),
    ((1, 2, 6, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 2, 6, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ((1, 2, 6, 6), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1, "pads": [1, 1, 0, 0]}),
    ((1, 2, 6, 6), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1, "pads": [1, 1, 0, 0], "count_include_pad": 1}),
    ((1, 2, 6, 5), {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 2, 6, 5), {"kernel_shape": [2, 3], "auto_pad": "SAME_LOWER", "strides": [2, 2], "count_include_pad": 1}),
    ((2, 3, 9), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    ((1, 2, 4, 5, 4), {"kernel_shape": [2, 3, 2], "strides": [1, 2, 2], "pads": [0, 1, 0, 1, 0, 1]}),
]


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,attrs", AVGPOOL_CASES)
def test_average_pool(shape, attrs, symbolic):
    check_vjp_f32("AveragePool", {"x": _rand(*shape)}, attrs, opset=17, symbolic=symbolic)


@pytest.mark.parametrize("opset", [10, 11, 19, 22])
@pytest.mark.parametrize("case", [3, 5, 8])
def test_average_pool_opsets(case, opset):
    shape, attrs = AVGPOOL_CASES[case]
    if opset < 11 and "SAME" in attrs.get("auto_pad", ""):
        opset = 11
    check_vjp_f32("AveragePool", {"x": _rand(*shape)}, attrs, opset=opset, symbolic=opset >= 11)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [2, 2], "dilations": [2, 1]},
        {"kernel_shape": [3, 2], "dilations": [2, 2], "strides": [2, 1], "ceil_mode": 1, "pads": [1, 0, 1, 1]},
        {"kernel_shape": [2, 2], "dilations": [1, 2], "count_include_pad": 1, "pads": [1, 1, 0, 1]},
    ],
)
def test_average_pool_dilations(attrs, symbolic):
    check_vjp_f32("AveragePool", {"x": _rand(1, 2, 7, 6)}, attrs, opset=19, symbolic=symbolic)


# ------------------------------------------------------------ Global pools
@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 3, 4, 5), (1, 2, 2, 3, 2), (2, 1, 1, 1)])
def test_global_average_pool(shape, symbolic):
    check_vjp_f32("GlobalAveragePool", {"x": _rand(*shape)}, symbolic=symbolic)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 3, 4, 5), (1, 2, 2, 3, 2), (2, 1, 1, 1)])
def test_global_max_pool(shape, symbolic):
    # Piecewise linear: with values 0.1 apart, a step of 0.01 keeps the argmax,
    # and the float32 loss is linear along the direction.
    check_vjp_f32("GlobalMaxPool", {"x": _distinct(*shape)}, symbolic=symbolic, eps=1e-2, rtol=1e-3)


def test_global_max_pool_ties_share_the_gradient():
    x = np.zeros((1, 1, 2, 2))
    x[0, 0, 0, 1] = x[0, 0, 1, 0] = 1.0
    g = check_vjp_f32("GlobalMaxPool", {"x": x}, oracle="ort", eps=1e-3, rtol=1e-2, directions=0)
    nz = g["x"][0, 0][x[0, 0] == 1.0]
    assert np.allclose(nz[0], nz[1]) and not np.any(g["x"][0, 0][x[0, 0] == 0.0])
