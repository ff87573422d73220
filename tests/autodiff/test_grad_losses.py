"""Gradient rules of SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

Targets are integer inputs outside ``wrt``; weights are inputs too but get no
gradient (the rules return None for them)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gradcheck import check_vjp, check_vjp_f32

SHAPES = [(5, 4), (3, 4, 2), (2, 3, 2, 2), (1, 3)]
IGNORE = [None, 1, -1]


def _case(shape, ignore, weighted, seed=0, label_dtype=np.int64):
    rng = np.random.default_rng(seed)
    n, c = shape[0], shape[1]
    target_shape = (n,) + shape[2:]
    target = rng.integers(0, c, size=target_shape).astype(label_dtype)
    if ignore is not None:
        # ignore some targets, but never all of them ('mean' would divide by 0)
        flat = target.reshape(-1)
        flat[::2] = ignore
        if flat.size == 1:
            flat[0] = 0
    inputs = {"x": rng.standard_normal(shape), "t": target}
    if weighted:
        inputs["w"] = rng.uniform(0.5, 2.0, size=c)
    attrs = {} if ignore is None else {"ignore_index": ignore}
    return inputs, attrs


LOSS_CASES = [
    (shape, reduction, ignore, weighted)
    for shape, reduction, ignore, weighted in itertools.product(
        SHAPES, ["none", "sum", "mean"], IGNORE, [False, True]
    )
    # keep the table small: every reduction/ignore/weight combination on two
    # shapes, the rest on 'mean'
    if shape in ((5, 4), (3, 4, 2)) or reduction == "mean"
]


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("shape,reduction,ignore,weighted", LOSS_CASES)
def test_loss(op, shape, reduction, ignore, weighted):
    inputs, attrs = _case(shape, ignore, weighted)
    attrs["reduction"] = reduction
    check_vjp(op, inputs, attrs, wrt=["x"], opset=13)


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("opset", [12, 17, 22, 26])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_loss_opsets(op, opset, reduction):
    inputs, attrs = _case((3, 4, 2), 1, True, seed=1)
    check_vjp(op, inputs, {**attrs, "reduction": reduction}, wrt=["x"], opset=opset)


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 2, 2)])
def test_loss_symbolic(op, shape, reduction):
    inputs, attrs = _case(shape, -1, True, seed=2)
    check_vjp(op, inputs, {**attrs, "reduction": reduction}, wrt=["x"], opset=17, symbolic=True)


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_loss_symbolic_opset12_float32_int32_targets(op):
    inputs, attrs = _case((3, 4, 2), 1, False, seed=3, label_dtype=np.int32)
    check_vjp_f32(op, inputs, attrs, wrt=["x"], opset=12, symbolic=True, oracle="ort64")


@pytest.mark.parametrize("diff_outputs", [[0, 1], [1]])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_sce_log_prob_output(diff_outputs, reduction):
    inputs, attrs = _case((3, 4, 2), 1, True, seed=4)
    check_vjp(
        "SoftmaxCrossEntropyLoss", inputs, {**attrs, "reduction": reduction}, wrt=["x"],
        n_outputs=2, diff_outputs=diff_outputs, opset=17,
    )


def test_loss_skipped_weight_input():
    inputs, attrs = _case((4, 3), None, False, seed=5)
    check_vjp(
        "SoftmaxCrossEntropyLoss", inputs, attrs, wrt=["x"], node_inputs=["x", "t", ""], opset=17
    )


def test_sce_float32():
    inputs, attrs = _case((4, 5, 3), 2, True, seed=6)
    g = check_vjp_f32("SoftmaxCrossEntropyLoss", inputs, attrs, wrt=["x"], oracle="ort64", symbolic=True)
    assert g["x"].dtype == np.float32


# ------------------------------------------------- the class weights' gradient
WEIGHT_CASES = [
    (shape, reduction, ignore)
    for shape in ((5, 4), (3, 4, 2))
    for reduction in ("none", "sum", "mean")
    for ignore in (None, 1)
]


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("shape,reduction,ignore", WEIGHT_CASES)
def test_loss_weight_gradient(op, shape, reduction, ignore):
    """d loss / d weight: linear for 'none' and 'sum', the quotient rule for 'mean'."""
    inputs, attrs = _case(shape, ignore, True, seed=7)
    check_vjp(op, inputs, {**attrs, "reduction": reduction}, wrt=["x", "w"], opset=13)


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("opset", [12, 15, 17])
def test_loss_weight_gradient_opsets_and_symbolic(op, opset):
    """Before opset 16 the weights' scatter-add is a one-hot product; symbolic shapes."""
    inputs, attrs = _case((2, 3, 2, 2), -1, True, seed=8)
    check_vjp(op, inputs, {**attrs, "reduction": "mean"}, wrt=["w"], opset=opset)
    if opset >= 13:
        check_vjp(op, inputs, {**attrs, "reduction": "sum"}, wrt=["x", "w"], opset=opset, symbolic=True)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_sce_weight_gradient_with_log_prob_output(reduction):
    inputs, attrs = _case((3, 4, 2), 1, True, seed=9)
    check_vjp(
        "SoftmaxCrossEntropyLoss", inputs, {**attrs, "reduction": reduction}, wrt=["w"],
        n_outputs=2, opset=17,
    )


def test_weight_gradient_float32():
    inputs, attrs = _case((4, 5, 3), 2, True, seed=10)
    g = check_vjp_f32(
        "NegativeLogLikelihoodLoss", inputs, attrs, wrt=["x", "w"], oracle="ort64", symbolic=True
    )
    assert g["w"].dtype == np.float32 and np.any(g["w"])
