"""Gradient rules of neural-network layers.

onnxruntime runs Conv, ConvTranspose, AveragePool, the global pools and
several normalizations only in float32, so those are checked with
``check_vjp_f32``: the float32 gradient against central differences of the
float32 loss with a unit step (exact for ops linear or bilinear in the checked
inputs) or of the float64 loss on the ONNX reference implementation."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_vjp, check_vjp_f32

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
    ((2, 3, 4), 1, 26),
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
    "opset,symbolic", [(9, False), (11, False), (11, True), (13, True), (22, False), (26, True)]
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


@pytest.mark.parametrize("opset", [26, 17, 12, 10])
@pytest.mark.parametrize("shape,attrs", MAXPOOL_CASES)
def test_max_pool(shape, attrs, opset):
    check_vjp("MaxPool", {"x": _distinct(*shape)}, attrs, opset=opset)


@pytest.mark.parametrize("opset", [11, 17])
@pytest.mark.parametrize("case", [1, 3, 5])
def test_max_pool_symbolic(case, opset):
    shape, attrs = MAXPOOL_CASES[case]
    check_vjp_f32("MaxPool", {"x": _distinct(*shape)}, attrs, opset=opset, symbolic=True, oracle="ort64")


# Before opset 10: no dilations or ceil_mode; before opset 8: no storage_order (and no Indices).
OLD_MAXPOOL_CASES = [c for c in MAXPOOL_CASES if "dilations" not in c[1] and "ceil_mode" not in c[1]]


@pytest.mark.parametrize("opset", [9, 8])
@pytest.mark.parametrize("shape,attrs", OLD_MAXPOOL_CASES)
def test_max_pool_opsets_8_9(shape, attrs, opset):
    # overlapping windows recompute the argmax (opset 8 always: it has no Scatter)
    check_vjp("MaxPool", {"x": _distinct(*shape)}, attrs, opset=opset)


@pytest.mark.parametrize("shape,attrs", [c for c in OLD_MAXPOOL_CASES if "storage_order" not in c[1]])
def test_max_pool_opset7(shape, attrs):
    # MaxPool-1 has no Indices output, and onnxruntime runs it in float32 only
    check_vjp_f32("MaxPool", {"x": _distinct(*shape)}, attrs, opset=7, oracle="reference")


@pytest.mark.parametrize("opset", [7, 8, 9])
def test_max_pool_old_opsets_negative_input_with_pads(opset):
    # every value < 0: a padded tap (which the recomputation sees as 0) must never win
    x = -np.abs(_distinct(1, 2, 5, 6)) - 1.0
    attrs = {"kernel_shape": [3, 3], "strides": [2, 1], "pads": [1, 2, 2, 1]}
    if opset == 7:
        check_vjp_f32("MaxPool", {"x": x}, attrs, opset=7, oracle="reference")
    else:
        check_vjp("MaxPool", {"x": x}, attrs, opset=opset)


@pytest.mark.parametrize("opset", [8, 9])
@pytest.mark.parametrize("shape,attrs", OLD_MAXPOOL_CASES)
def test_max_pool_old_opsets_ties_follow_indices(shape, attrs, opset):
    # with ties, the recomputed argmax is the first maximum, as MaxPool's Indices
    x = np.random.default_rng(3).integers(0, 3, size=shape).astype(np.float64)
    old = check_vjp("MaxPool", {"x": x}, attrs, opset=opset, directions=0)["x"]
    new = check_vjp("MaxPool", {"x": x}, attrs, opset=17, directions=0)["x"]
    np.testing.assert_allclose(old, new, atol=1e-12)
    assert np.count_nonzero(old) < x.size  # some windows did tie


def test_max_pool_opset9_needs_static_dims_for_overlapping_windows():
    # disjoint windows scatter by Indices, whatever the shape
    check_vjp_f32("MaxPool", {"x": _distinct(2, 2, 4, 6)}, {"kernel_shape": [2, 3], "strides": [2, 3]},
                  opset=9, symbolic=True, oracle="ort64")
    with pytest.raises(TrainingModelError, match="spatial dims of the input statically"):
        check_vjp_f32("MaxPool", {"x": _distinct(1, 1, 4, 4)}, {"kernel_shape": [2, 2]},
                      opset=9, symbolic=True, oracle="ort64")


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


@pytest.mark.parametrize("opset", [10, 11, 19, 26])
@pytest.mark.parametrize("case", [3, 5, 8])
def test_average_pool_opsets(case, opset):
    shape, attrs = AVGPOOL_CASES[case]
    if opset < 11 and "SAME" in attrs.get("auto_pad", ""):
        opset = 11
    check_vjp_f32("AveragePool", {"x": _rand(*shape)}, attrs, opset=opset, symbolic=opset >= 11)


@pytest.mark.parametrize("opset", [7, 8, 9])
@pytest.mark.parametrize("case", [0, 2, 3, 8, 9, 10, 11])
def test_average_pool_old_opsets(case, opset):
    # static shapes: no ConstantOfShape before 9, no broadcasting Max before 8
    shape, attrs = AVGPOOL_CASES[case]
    check_vjp_f32("AveragePool", {"x": _rand(*shape)}, attrs, opset=opset)


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
@pytest.mark.parametrize("opset", [7, 8])
def test_global_average_pool_old_opsets(opset, symbolic):
    # opset 7 has no Expand: the gradient is tiled
    check_vjp_f32("GlobalAveragePool", {"x": _rand(2, 3, 4, 5)}, opset=opset, symbolic=symbolic)


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


# ------------------------------------------------------------ ConvTranspose
CONV_T_CASES = [
    # (x shape, w shape, attrs, with bias)
    ((2, 3, 4), (3, 2, 3), {}, False),
    ((1, 2, 5), (2, 3, 3), {"strides": [2], "pads": [1, 0], "output_padding": [1]}, True),
    ((1, 4, 3, 3), (4, 3, 2, 2), {"group": 2, "strides": [2, 1], "dilations": [1, 2]}, False),
    ((2, 2, 3, 4), (2, 2, 3, 3), {"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 0]}, True),
    ((1, 2, 3, 3), (2, 1, 3, 2), {"strides": [2, 3], "output_shape": [8, 9]}, False),
    ((1, 2, 3, 3), (2, 1, 3, 2), {"strides": [2, 3], "output_shape": [6, 7]}, True),
    ((1, 2, 3, 3), (2, 1, 3, 2), {"strides": [2, 3], "output_shape": [6, 7], "auto_pad": "SAME_UPPER"}, False),
    ((1, 2, 3, 4), (2, 2, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}, False),
    ((1, 2, 4, 3), (2, 2, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}, True),
    ((1, 2, 2, 3, 2), (2, 2, 2, 2, 2), {"strides": [2, 1, 2], "pads": [0, 1, 0, 1, 0, 0]}, True),
]


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("xs,ws,attrs,bias", CONV_T_CASES)
def test_conv_transpose(xs, ws, attrs, bias, symbolic):
    inputs = {"x": _rand(*xs), "w": _rand(*ws, seed=1)}
    if bias:
        inputs["b"] = _rand(ws[1] * attrs.get("group", 1), seed=2)
    check_vjp_f32("ConvTranspose", inputs, attrs, opset=17, symbolic=symbolic)


@pytest.mark.parametrize("opset", [11, 22])
def test_conv_transpose_opsets(opset):
    xs, ws, attrs, _ = CONV_T_CASES[3]
    check_vjp_f32("ConvTranspose", {"x": _rand(*xs), "w": _rand(*ws, seed=1)}, attrs, opset=opset, symbolic=True)


# ------------------------------------------------------- BatchNormalization
def _bn_inputs(shape, seed=0):
    c = shape[1]
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal(shape),
        "scale": rng.uniform(0.5, 1.5, c),
        "b": rng.standard_normal(c),
        "mean": rng.standard_normal(c) * 0.1,
        "var": rng.uniform(0.5, 1.5, c),
    }


@pytest.mark.parametrize("opset", [9, 13, 15, 17])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 4), (2, 3, 2, 2)])
def test_batch_norm_inference(shape, opset):
    attrs = {"epsilon": 1e-3}
    if opset >= 14:
        attrs["training_mode"] = 0
    check_vjp("BatchNormalization", _bn_inputs(shape), attrs, opset=opset)


@pytest.mark.parametrize("opset,n_out", [(9, 5), (13, 5), (15, 3), (17, 3)])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 2, 2)])
def test_batch_norm_training(shape, opset, n_out):
    attrs = {"momentum": 0.8}
    if opset >= 14:
        attrs["training_mode"] = 1
    check_vjp(
        "BatchNormalization", _bn_inputs(shape, seed=1), attrs, opset=opset,
        wrt=["x", "scale", "b"], n_outputs=n_out, diff_outputs=[0],
    )


@pytest.mark.parametrize("training", [0, 1])
def test_batch_norm_symbolic(training):
    check_vjp(
        "BatchNormalization", _bn_inputs((2, 3, 4), seed=2), {"training_mode": training}, opset=15,
        wrt=["x", "scale", "b"], n_outputs=1 + 2 * training, diff_outputs=[0], symbolic=True,
    )
    check_vjp_f32(
        "BatchNormalization", _bn_inputs((2, 3, 4), seed=2), {"training_mode": training}, opset=15,
        wrt=["x", "scale", "b"], n_outputs=1 + 2 * training, diff_outputs=[0], symbolic=True,
        oracle="ort64",
    )


# --------------------------------------------------- Instance/Layer/Group norm
# onnx.reference runs these function ops only in float32 (its epsilon constants
# are float32), so the oracle is onnxruntime's float32 loss with a small step:
# truncation error O(eps^2), rounding error O(1e-7 / eps).
_SMOOTH32 = {"oracle": "ort", "eps": 1e-2, "rtol": 2e-3}


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 3, 2, 3), (1, 2, 2, 2, 2)])
def test_instance_norm(shape, symbolic):
    rng = np.random.default_rng(3)
    inputs = {"x": rng.standard_normal(shape), "s": rng.uniform(0.5, 1.5, shape[1]), "b": rng.standard_normal(shape[1])}
    check_vjp_f32("InstanceNormalization", inputs, {"epsilon": 1e-3}, symbolic=symbolic, **_SMOOTH32)


LAYER_NORM_CASES = [
    ((3, 4), -1, (4,), True),
    ((2, 3, 4), 1, (3, 4), True),
    ((2, 3, 4), -2, (3, 4), False),
    ((2, 3, 4), -1, (1, 4), True),
    ((2, 3, 4), 0, (2, 3, 4), True),
]


@pytest.mark.parametrize("n_out", [1, 3])
@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,axis,sshape,bias", LAYER_NORM_CASES)
def test_layer_norm(shape, axis, sshape, bias, symbolic, n_out):
    rng = np.random.default_rng(4)
    inputs = {"x": rng.standard_normal(shape), "s": rng.uniform(0.5, 1.5, sshape)}
    if bias:
        inputs["b"] = rng.standard_normal(sshape)
    attrs = {"axis": axis, "epsilon": 1e-3}
    if n_out == 1:
        # (check_vjp declares every output float64, but Mean/InvStdDev are float32
        # under the default stash_type, so the outputs are requested by the rule.)
        check_vjp("LayerNormalization", inputs, attrs, opset=17, symbolic=symbolic)
    check_vjp_f32(
        "LayerNormalization", inputs, attrs, opset=17, symbolic=symbolic, n_outputs=n_out,
        diff_outputs=[0], oracle="ort64",
    )


@pytest.mark.parametrize("opset,per_channel", [(18, False), (21, True)])
@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,groups", [((2, 4, 3), 2), ((1, 6, 2, 2), 3), ((2, 4, 2, 1), 4)])
def test_group_norm(shape, groups, symbolic, opset, per_channel):
    rng = np.random.default_rng(5)
    n = shape[1] if per_channel else groups
    inputs = {"x": rng.standard_normal(shape), "s": rng.uniform(0.5, 1.5, n), "b": rng.standard_normal(n)}
    # onnx 1.23's checker rejects GroupNormalization-18 as deprecated (its
    # per-group scale was replaced in opset 21); onnxruntime still runs it.
    check_vjp_f32(
        "GroupNormalization", inputs, {"num_groups": groups, "epsilon": 1e-3}, opset=opset,
        symbolic=symbolic, checker=opset >= 21, **_SMOOTH32,
    )


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("p,axis", [(2, -1), (2, 0), (1, 1), (1, -1)])
def test_lp_normalization(p, axis, symbolic):
    opset = 17 if symbolic else 11
    check_vjp("LpNormalization", {"x": _rand(3, 4)}, {"p": p, "axis": axis}, opset=opset, symbolic=symbolic)
    check_vjp_f32(
        "LpNormalization", {"x": _rand(3, 4)}, {"p": p, "axis": axis}, opset=opset, symbolic=symbolic,
        oracle="ort64",
    )


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,axes", [((2, 3, 2, 2), None), ((2, 3, 4), [1]), ((2, 3, 2, 2), [0, 1, 2, 3])])
def test_mean_variance_normalization(shape, axes, symbolic):
    attrs = {} if axes is None else {"axes": axes}
    check_vjp_f32("MeanVarianceNormalization", {"x": _rand(*shape)}, attrs, symbolic=symbolic, **_SMOOTH32)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize(
    "shape,attrs",
    [
        ((2, 5, 3, 3), {"size": 3}),
        ((1, 4, 2, 3), {"size": 3, "alpha": 0.5, "beta": 0.6, "bias": 1.5}),
        ((1, 3, 2, 2), {"size": 5, "alpha": 0.3}),
    ],
)
def test_lrn(shape, attrs, symbolic):
    # (onnx.reference's LRN disagrees with onnxruntime once alpha matters)
    check_vjp_f32("LRN", {"x": _rand(*shape)}, attrs, symbolic=symbolic, **_SMOOTH32)


# ------------------------------------------------------------------ Dropout
@pytest.mark.parametrize("opset", [10, 13, 17])
def test_dropout_inference_is_identity(opset):
    g = check_vjp("Dropout", {"x": _rand(3, 4)}, {}, opset=opset)
    assert g["x"].shape == (3, 4)


def test_dropout_constant_false_training_mode_is_identity():
    from onnx import helper, numpy_helper

    nodes = [
        helper.make_node("Constant", [], ["r"], value=numpy_helper.from_array(np.array(0.5))),
        helper.make_node("Constant", [], ["t"], value=numpy_helper.from_array(np.array(False))),
    ]
    check_vjp("Dropout", {"x": _rand(3, 4)}, node_inputs=["x", "r", "t"], extra_nodes=nodes, opset=13)


@pytest.mark.parametrize("ratio", [0.25, 0.6])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("as_input", [False, True])
def test_dropout_training(ratio, dtype, as_input):
    """dx = dy * mask / (1 - ratio), with the mask of the same run."""
    import onnx
    from onnx import TensorProto, helper

    from onnxtrain.autodiff import expand_gradients
    from onnxtrain.core.graph import PREVIEW_DOMAIN
    from onnxtrain.core.names import NameGen
    from onnxtrain.runtime.executor import Executor

    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("Dropout", ["x", "ratio", "training"], ["y", "mask"], seed=3),
        helper.make_node("Mul", ["y", "r"], ["w"]),
        helper.make_node("ReduceSum", ["w"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["x"], ["gx"], domain=PREVIEW_DOMAIN, xs=["x"], y="loss"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", et, ["n", 5]),
        helper.make_tensor_value_info("r", et, ["n", 5]),
        helper.make_tensor_value_info("ratio", et, []),
        helper.make_tensor_value_info("training", TensorProto.BOOL, []),
    ]
    outputs = [
        helper.make_tensor_value_info("gx", et, ["n", 5]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["n", 5]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(PREVIEW_DOMAIN, 1)],
    )
    model.ir_version = 8
    if not as_input:  # a constant training_mode is decided when building
        from onnx import numpy_helper

        model.graph.input.pop()
        model.graph.node.insert(
            0, helper.make_node("Constant", [], ["training"], value=numpy_helper.from_array(np.array(True)))
        )
    expand_gradients(model.graph, model.opset_import, NameGen(["x", "r", "ratio", "training", "y", "mask", "w", "loss", "gx"]), [i.name for i in model.graph.input])
    onnx.checker.check_model(model)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 5)).astype(dtype), "r": rng.standard_normal((4, 5)).astype(dtype), "ratio": np.array(ratio, dtype=dtype)}
    if as_input:
        feeds["training"] = np.array(True)
    gx, mask = Executor(model).run(feeds, ["gx", "mask"])
    assert gx.dtype == dtype and gx.shape == (4, 5)
    assert 0 < mask.sum() < mask.size
    np.testing.assert_allclose(gx, feeds["r"] * mask / (1 - ratio), rtol=1e-6)
    if as_input:  # the same graph in inference mode passes dy through
        feeds["training"] = np.array(False)
        gx, mask = Executor(model).run(feeds, ["gx", "mask"])
        np.testing.assert_allclose(gx, feeds["r"], rtol=1e-6)


# ------------------------------------------------------------------- LpPool
LPPOOL_CASES = [
    ((1, 2, 5, 5), {"kernel_shape": [2, 2]}, 11),
    ((1, 2, 5, 6), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2], "p": 1}, 11),
    ((2, 2, 7), {"kernel_shape": [3], "strides": [2], "p": 3}, 17),
    ((1, 2, 6, 5), {"kernel_shape": [2, 2], "dilations": [2, 1]}, 18),
    ((1, 2, 5, 6), {"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER", "strides": [2, 2]}, 18),
]


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,attrs,opset", LPPOOL_CASES)
def test_lp_pool(shape, attrs, opset, symbolic):
    x = _rand(*shape)
    if attrs.get("p") == 1:
        x = x + np.sign(x) * 0.2  # keep |x| away from the kink at 0
    check_vjp_f32("LpPool", {"x": x}, attrs, opset=opset, symbolic=symbolic, oracle="reference")


def test_lp_pool_ceil_mode():
    # The reference implementation and onnxruntime disagree on ceil_mode
    # windows; check against onnxruntime's own float32 loss.
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}
    check_vjp_f32("LpPool", {"x": _rand(1, 2, 5, 5)}, attrs, opset=18, symbolic=True, eps=1e-2, rtol=2e-3)


# ---------------------------------------------------------- RNN, GRU, LSTM
# onnxruntime runs these only in float32 and only with layout=0; they are
# smooth, so the oracle is onnxruntime's float32 loss with a small step.
def _rnn_inputs(kind, t=3, b=2, i=3, h=4, dirs=1, bias=True, init=True, peep=False, layout=0, seed=0):
    """Inputs and the node's input list (layout=1 puts the batch first)."""
    rng = np.random.default_rng(seed)
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[kind]
    x_shape = (b, t, i) if layout else (t, b, i)
    state_shape = (b, dirs, h) if layout else (dirs, b, h)
    inputs = {
        "x": rng.standard_normal(x_shape),
        "w": rng.standard_normal((dirs, gates * h, i)) * 0.5,
        "r": rng.standard_normal((dirs, gates * h, h)) * 0.5,
    }
    names = ["x", "w", "r", "", "", "", "", ""]
    if bias:
        inputs["b"] = rng.standard_normal((dirs, 2 * gates * h)) * 0.3
        names[3] = "b"
    if init:
        inputs["h0"] = rng.standard_normal(state_shape) * 0.5
        names[5] = "h0"
        if kind == "LSTM":
            inputs["c0"] = rng.standard_normal(state_shape) * 0.5
            names[6] = "c0"
    if peep:
        inputs["p"] = rng.standard_normal((dirs, 3 * h)) * 0.3
        names[7] = "p"
    while names and names[-1] == "":
        names.pop()
    return inputs, names


_RNN32 = {"oracle": "ort", "eps": 1e-2, "rtol": 3e-3}
DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}

RNN_CASES = [
    # (kind, direction, extra attrs, input options, opset)
    ("RNN", "forward", {}, {}, 17),
    ("RNN", "reverse", {"activations": ["Relu"]}, {"init": False}, 11),
    ("RNN", "bidirectional", {"activations": ["Tanh", "Sigmoid"]}, {"bias": False}, 17),
    ("GRU", "forward", {}, {}, 17),
    ("GRU", "reverse", {"linear_before_reset": 1}, {}, 17),
    ("GRU", "bidirectional", {"linear_before_reset": 1}, {"init": False}, 11),
    ("GRU", "bidirectional", {}, {"bias": False}, 22),
    ("LSTM", "forward", {}, {}, 17),
    ("LSTM", "reverse", {}, {"peep": True}, 17),
    ("LSTM", "bidirectional", {}, {"peep": True, "init": False}, 11),
    ("LSTM", "bidirectional", {}, {"peep": True}, 22),
    ("LSTM", "forward", {"activations": ["Sigmoid", "Tanh", "Relu"]}, {"bias": False}, 9),
]


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("kind,direction,attrs,opts,opset", RNN_CASES)
def test_recurrent(kind, direction, attrs, opts, opset, symbolic):
    dirs = DIRECTIONS[direction]
    inputs, names = _rnn_inputs(kind, dirs=dirs, **opts)
    n_out = 3 if kind == "LSTM" else 2
    check_vjp_f32(
        kind, inputs, {"hidden_size": 4, "direction": direction, **attrs}, node_inputs=names,
        n_outputs=n_out, opset=opset, symbolic=symbolic and opset >= 11, **_RNN32,
    )


@pytest.mark.parametrize(
    "kind,direction,attrs,opts",
    [
        ("RNN", "bidirectional", {}, {}),
        ("GRU", "bidirectional", {"linear_before_reset": 1}, {}),
        ("GRU", "reverse", {}, {}),
        ("LSTM", "bidirectional", {}, {"peep": True}),
    ],
)
def test_recurrent_each_input(kind, direction, attrs, opts):
    """One input at a time, so that an input with a small gradient (P, B)
    cannot hide behind the others."""
    inputs, names = _rnn_inputs(kind, dirs=DIRECTIONS[direction], seed=5, **opts)
    for x in inputs:
        check_vjp_f32(
            kind, inputs, {"hidden_size": 4, "direction": direction, **attrs}, node_inputs=names,
            n_outputs=3 if kind == "LSTM" else 2, wrt=[x], oracle="ort", eps=1e-2, rtol=1e-3,
        )


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_recurrent_only_sequence_output(kind):
    inputs, names = _rnn_inputs(kind, t=4, seed=1)
    check_vjp_f32(kind, inputs, {"hidden_size": 4}, node_inputs=names, n_outputs=1, symbolic=True, **_RNN32)


def test_recurrent_only_last_state():
    """Y is not an output of the node: the rule adds it."""
    inputs, names = _rnn_inputs("LSTM", seed=2)
    check_vjp_f32(
        "LSTM", inputs, {"hidden_size": 4}, node_inputs=names, n_outputs=3, diff_outputs=[1, 2], **_RNN32
    )


def test_recurrent_input_forget_refused():
    inputs, names = _rnn_inputs("LSTM")
    with pytest.raises(TrainingModelError, match="input_forget"):
        check_vjp_f32("LSTM", inputs, {"hidden_size": 4, "input_forget": 1}, node_inputs=names,
                      n_outputs=3, **_RNN32)


@pytest.mark.parametrize(
    "attrs",
    [{"clip": 100.0}, {"activations": ["Sigmoid", "Softsign", "Tanh"]}],
    ids=["clip", "softsign"],
)
def test_recurrent_configurations_beyond_the_direct_rule_use_the_scan_rewrite(attrs):
    """clip and other activations go to recurrent.py's general rule (a clip
    that never binds keeps finite differences away from its kinks)."""
    inputs, names = _rnn_inputs("LSTM")
    check_vjp_f32("LSTM", inputs, {"hidden_size": 4, **attrs}, node_inputs=names, n_outputs=3, **_RNN32)


def test_recurrent_sequence_lens_refused():
    inputs, names = _rnn_inputs("GRU")
    inputs = dict(inputs)
    inputs["lens"] = np.array([3, 2], dtype=np.int32)
    names = ["x", "w", "r", "b", "lens", "h0"]
    with pytest.raises(TrainingModelError, match="sequence_lens"):
        check_vjp_f32("GRU", inputs, {"hidden_size": 4}, node_inputs=names, wrt=["x"], n_outputs=2, **_RNN32)


# ------------------------------------------- statistics outputs (cotangents)
@pytest.mark.parametrize("opset,n_out", [(13, 5), (15, 3)])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 2, 2)])
def test_batch_norm_training_statistics_outputs(shape, opset, n_out):
    """A loss that reads the running statistics (and, before opset 14, the
    saved ones): they depend on x and on the input mean/var, so their
    cotangents reach x, mean and var (no silent zero)."""
    attrs = {"momentum": 0.8, "epsilon": 1e-2}
    if opset >= 14:
        attrs["training_mode"] = 1
    check_vjp(
        "BatchNormalization", _bn_inputs(shape, seed=3), attrs, opset=opset,
        wrt=["x", "scale", "b", "mean", "var"], n_outputs=n_out, diff_outputs=list(range(n_out)),
    )


def test_batch_norm_training_only_statistics_read():
    """Only running_mean/running_var feed the loss: Y gets no cotangent."""
    check_vjp(
        "BatchNormalization", _bn_inputs((3, 2, 2), seed=4), {"training_mode": 1, "momentum": 0.5},
        opset=15, wrt=["x", "mean", "var"], n_outputs=3, diff_outputs=[1, 2],
    )


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("size", [(2, 3, 4, 5), (2, 1, 3, 4, 2), (2, 3, 1, 1)])
@pytest.mark.parametrize("symbolic", [False])
def test_affine_grid(size, align, symbolic):
    """grid = theta applied to the normalized base grid; linear in theta.
    (All-symbolic shapes would hide whether the grid is 2-D or 3-D, which the
    rule refuses with a clear error: see the test below.)"""
    spatial = len(size) - 2
    theta = np.random.default_rng(6).standard_normal((size[0], spatial, spatial + 1))
    check_vjp(
        "AffineGrid", {"theta": theta, "size": np.array(size, dtype=np.int64)},
        {"align_corners": align}, opset=20, wrt=["theta"], symbolic=symbolic,
    )


def test_affine_grid_refuses_unknown_dimensionality():
    with pytest.raises(TrainingModelError, match="2-D or 3-D"):
        check_vjp(
            "AffineGrid", {"theta": np.zeros((1, 2, 3)), "size": np.array([1, 1, 2, 2], dtype=np.int64)},
            opset=20, wrt=["theta"], symbolic=True,
        )


# ------------------------------------------------ reductions before Expand
@pytest.mark.parametrize("attrs", [{}, {"keepdims": 0}, {"axes": [1], "keepdims": 0}, {"axes": [0, 2]}])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
def test_reduce_opset7_broadcasts_without_expand(op, attrs):
    # opset 7 has no Expand: the gradient is tiled back (a scalar dy first takes x's rank)
    check_vjp(op, {"x": _rand(2, 3, 4)}, attrs, opset=7)


# -------------------------------------------- every rule table at opsets 7 and 8
def _old_opset_params() -> list:
    """The cases of the elementwise, reduction and shape tables that run at
    opset 9, again at opsets 7 and 8 wherever their op exists there."""
    import test_grad_elementwise
    import test_grad_reduce
    import test_grad_shape
    from onnx import defs

    skip = {
        # onnxruntime has no float64 kernel for Max-6/Min-6 (opset 7), so the float64 check cannot run
        ("Max-1", 7), ("Max-2", 7), ("Min-3", 7),
        # the case broadcasts, which Sum-6 (opset 7) does not
        ("Sum-3", 7),
    }
    params = []
    for module in (test_grad_elementwise, test_grad_reduce, test_grad_shape):
        for case in module.CASES:
            if 9 not in case.opsets:
                continue
            for opset in (7, 8):
                try:
                    schema = defs.get_schema(case.op, opset, "")
                except defs.SchemaError:  # the op came later
                    continue
                if schema.deprecated or (case.id, opset) in skip:
                    continue
                params.append(pytest.param(case, opset, id=f"{case.id}-opset{opset}"))
    return params


@pytest.mark.parametrize("case, opset", _old_opset_params())
def test_rule_tables_at_opsets_7_8(case, opset):
    # no ConstantOfShape, OneHot, Scatter, Sign, NonZero or integer comparisons before 9, no Expand before 8
    from grad_cases import run_case

    run_case(case, opset, False)
