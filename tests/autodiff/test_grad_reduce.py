"""Gradient checks of the reductions and scans (onnxtrain/autodiff/rules/reduce.py).

Every axes form is covered: the axes attribute (ReduceSum before opset 13, the
other reductions before 18), a constant axes input, a runtime axes input, no
axes (reduce everything), keepdims 0/1 and noop_with_empty_axes."""

from __future__ import annotations

import numpy as np
import pytest
from grad_cases import (
    Case,
    away,
    case_params,
    const_node,
    float32_params,
    ins,
    normal,
    run_case,
    run_case_float32,
    uniform,
)
from gradcheck import check_vjp


def i64(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def distinct(*shape: int):
    """Well separated values in random order (no near-ties for Max/Min)."""
    return lambda rng: (rng.permutation(np.prod(shape)).reshape(shape) - np.prod(shape) / 2) * 0.3


def axes_const(values):
    return lambda opset: [const_node("axes", values)]


def reduce_cases(op: str, draw, input_from: int, more: dict | None = None) -> list[Case]:
    """The axes forms of one reduction; ``input_from`` is the opset where axes
    became an input (13 for ReduceSum, 18 for the others)."""
    old = (11, input_from - 1) if input_from == 18 else (9, 11)
    new = (input_from, 21) if input_from == 18 else (13, 18)
    more = more or {}
    return [
        Case(f"{op}-attr", op, ins(x=draw), attrs={"axes": [1]}, opsets=old, **more),
        Case(
            f"{op}-attr-keepdims0",
            op,
            ins(x=draw),
            attrs={"axes": [0, -1], "keepdims": 0},
            opsets=old,
            **more,
        ),
        Case(f"{op}-all", op, ins(x=draw), opsets=old[:1] + new[-1:], **more),
        Case(
            f"{op}-all-keepdims0",
            op,
            ins(x=draw),
            attrs={"keepdims": 0},
            opsets=old[:1] + new[-1:],
            **more,
        ),
        Case(
            f"{op}-input",
            op,
            ins(x=draw),
            node_inputs=["x", "axes"],
            extra=axes_const([1]),
            opsets=new,
            **more,
        ),
        Case(
            f"{op}-input-keepdims0",
            op,
            ins(x=draw),
            attrs={"keepdims": 0},
            node_inputs=["x", "axes"],
            extra=axes_const([-1, 0]),
            opsets=new,
            **more,
        ),
        Case(f"{op}-runtime-axes", op, ins(x=draw, axes=i64(2)), opsets=new, **more),
        Case(
            f"{op}-runtime-axes-keepdims0",
            op,
            ins(x=draw, axes=i64(0, 2)),
            attrs={"keepdims": 0},
            opsets=new,
            **more,
        ),
        Case(
            f"{op}-runtime-empty-axes",
            op,
            ins(x=draw, axes=np.zeros(0, np.int64)),
            attrs={"keepdims": 0},
            opsets=new[:1],
            **more,
        ),
        Case(
            f"{op}-runtime-empty-axes-noop",
            op,
            ins(x=draw, axes=np.zeros(0, np.int64)),
            attrs={"noop_with_empty_axes": 1},
            opsets=new[:1],
            **more,
        ),
        Case(
            f"{op}-noop-empty",
            op,
            ins(x=draw),
            attrs={"noop_with_empty_axes": 1},
            opsets=new,
            **more,
        ),
        Case(
            f"{op}-empty-axes-reduce-all",
            op,
            ins(x=draw),
            node_inputs=["x", "axes"],
            extra=axes_const(np.zeros(0, np.int64)),
            opsets=new[:1],
            **more,
        ),
    ]


CASES = (
    reduce_cases("ReduceSum", normal(2, 3, 4), 13)
    + reduce_cases("ReduceMean", normal(2, 3, 4), 18)
    + reduce_cases("ReduceMax", distinct(2, 3, 4), 18)
    + reduce_cases("ReduceMin", distinct(2, 3, 4), 18)
    + reduce_cases("ReduceSumSquare", normal(2, 3, 4), 18)
    + reduce_cases("ReduceL1", away(2, 3, 4), 18)
    + reduce_cases("ReduceL2", normal(2, 3, 4), 18)
    + reduce_cases("ReduceLogSum", uniform(0.5, 2.0, 2, 3, 4), 18)
    + reduce_cases("ReduceLogSumExp", normal(2, 3, 4), 18)
    + reduce_cases("ReduceProd", uniform(0.5, 1.5, 2, 3, 4), 18)
    + [
        # The product is multilinear, so zeros are smooth points: one zero in a
        # reduced group, two zeros in another.
        Case(
            "ReduceProd-zeros",
            "ReduceProd",
            ins(x=np.array([[0.0, 1.5, -0.7], [0.0, 0.0, 2.0], [1.1, 0.9, -1.3]])),
            attrs={"axes": [1]},
            opsets=(11, 13),
        ),
        Case(
            "ReduceProd-zeros-input",
            "ReduceProd",
            ins(x=np.array([[0.0, 1.5, -0.7], [0.0, 0.0, 2.0], [1.1, 0.9, -1.3]])),
            node_inputs=["x", "axes"],
            extra=axes_const([0]),
            opsets=(18,),
        ),
        Case(
            "ReduceSum-size1",
            "ReduceSum",
            ins(x=normal(1, 3, 1)),
            attrs={"axes": [0, 2], "keepdims": 0},
            opsets=(9, 11),
        ),
        # ----------------------------------------------------------- CumSum
        Case("CumSum", "CumSum", ins(x=normal(3, 4), a=i64(1)), opsets=(11, 14, 18)),
        Case(
            "CumSum-exclusive",
            "CumSum",
            ins(x=normal(3, 4), a=i64(0)),
            attrs={"exclusive": 1},
            opsets=(11, 18),
        ),
        Case(
            "CumSum-reverse",
            "CumSum",
            ins(x=normal(3, 4), a=i64(-1)),
            attrs={"reverse": 1},
            opsets=(11, 18),
        ),
        Case(
            "CumSum-exclusive-reverse",
            "CumSum",
            ins(x=normal(2, 3, 4)),
            node_inputs=["x", "a"],
            extra=lambda opset: [const_node("a", 1)],
            attrs={"exclusive": 1, "reverse": 1},
            opsets=(11, 18),
        ),
    ]
)


@pytest.mark.parametrize("case, opset, symbolic", case_params(CASES))
def test_reduce_vjp(case, opset, symbolic):
    run_case(case, opset, symbolic)


@pytest.mark.parametrize("case, opset", float32_params(CASES))
def test_reduce_float32(case, opset):
    run_case_float32(case, opset)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_reduce_max_ties_split_evenly(op):
    """Two equal extremes in a row share that row's gradient."""
    x = np.array([[1.0, 3.0, 3.0], [-2.0, -2.0, 0.5]])
    g = check_vjp(op, {"x": x}, {"axes": [1], "keepdims": 1}, opset=13, directions=0)["x"]
    weights = check_vjp("ReduceSum", {"x": x}, {"axes": [1]}, opset=11, directions=0)["x"][:, 0]
    hits = x == (
        x.max(axis=1, keepdims=True) if op == "ReduceMax" else x.min(axis=1, keepdims=True)
    )
    expected = hits * (weights / hits.sum(axis=1))[:, None]
    np.testing.assert_allclose(g, expected)


def test_reduce_prod_zero_gradient_is_finite():
    x = np.array([[0.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    g = check_vjp("ReduceProd", {"x": x}, {"axes": [1], "keepdims": 0}, opset=13)["x"]
    assert np.all(np.isfinite(g))
    assert g[0, 1] == 0 and g[0, 2] == 0 and g[0, 0] != 0  # only the zero sees the others' product
    assert np.all(g[1] == 0)  # two zeros: every partial product contains a zero
