"""Gradient rules of MatMul, Gemm and Einsum against float64 central differences."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_vjp, check_vjp_f32
from onnx import helper

from onnxtrain.errors import TrainingModelError


def _rand(*shape, seed=0):
    return np.asarray(np.random.default_rng(seed + len(shape)).standard_normal(shape))


# ------------------------------------------------------------------- MatMul
MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((4,), (4,)),
    ((2, 3, 4), (4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (3, 4, 5)),
    ((1, 3, 4), (2, 4, 5)),
    ((2, 3, 4), (4,)),
    ((4,), (2, 4, 5)),
    ((1, 4), (4, 1)),
    ((2, 2, 3, 4), (2, 1, 4, 1)),
]


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES)
def test_matmul(sa, sb, symbolic):
    check_vjp("MatMul", {"a": _rand(*sa), "b": _rand(*sb, seed=1)}, opset=17, symbolic=symbolic)


@pytest.mark.parametrize("opset", [9, 11, 13, 26])
@pytest.mark.parametrize("sa,sb", [((4,), (2, 4, 5)), ((2, 1, 3, 4), (3, 4, 5)), ((3, 4), (4, 5))])
def test_matmul_opsets(sa, sb, opset):
    check_vjp("MatMul", {"a": _rand(*sa), "b": _rand(*sb, seed=1)}, opset=opset)


@pytest.mark.parametrize("opset", [10, 12])
@pytest.mark.parametrize("sa,sb", [((2, 1, 3, 4), (3, 4, 5)), ((1, 3, 4), (2, 4, 5)), ((4,), (2, 4, 5))])
def test_matmul_symbolic_before_opset13(sa, sb, opset):
    # Symbolic broadcast batch dims before ReduceSum takes runtime axes: the
    # rule sums with Where/Slice at run time.  (check_vjp's own loss Mul needs
    # opset 13 for symbolic shapes, hence the float32 harness here.)
    check_vjp_f32(
        "MatMul", {"a": _rand(*sa), "b": _rand(*sb, seed=1)}, opset=opset, symbolic=True,
        oracle="ort64",
    )


def test_matmul_symbolic_broadcast_opset9_is_refused():
    with pytest.raises(TrainingModelError, match="opset 9 < 10"):
        check_vjp_f32(
            "MatMul", {"a": _rand(1, 3, 4), "b": _rand(2, 4, 5)}, opset=9, symbolic=True,
            oracle="ort64",
        )


@pytest.mark.parametrize("sa,sb", [((2, 3, 4), (4, 5)), ((4,), (4,)), ((1, 3, 4), (2, 4, 5))])
def test_matmul_float32(sa, sb):
    check_vjp_f32("MatMul", {"a": _rand(*sa), "b": _rand(*sb, seed=1)}, symbolic=True)


def test_matmul_wrt_one_operand():
    g = check_vjp("MatMul", {"a": _rand(3, 4), "b": _rand(4, 5)}, wrt=["b"])
    assert set(g) == {"b"}


# --------------------------------------------------------------------- Gemm
GEMM_C = [None, (), (5,), (1, 5), (3, 1), (3, 5), (1, 1)]


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("c_shape", GEMM_C)
@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_gemm(ta, tb, c_shape, symbolic):
    a = _rand(4, 3) if ta else _rand(3, 4)
    b = _rand(5, 4, seed=1) if tb else _rand(4, 5, seed=1)
    inputs = {"a": a, "b": b}
    if c_shape is not None:
        inputs["c"] = _rand(*c_shape, seed=2)
    attrs = {"transA": ta, "transB": tb, "alpha": 0.7, "beta": -1.3}
    if c_shape == ():  # check_vjp cannot perturb 0-D inputs; the float64 oracle can
        check_vjp_f32("Gemm", inputs, attrs, opset=17, symbolic=symbolic, oracle="ort64")
    else:
        check_vjp("Gemm", inputs, attrs, opset=17, symbolic=symbolic)


@pytest.mark.parametrize("opset", [9, 11, 13, 26])
@pytest.mark.parametrize("c_shape", [(5,), (3, 1), ()])
def test_gemm_opsets(c_shape, opset):
    inputs = {"a": _rand(4, 3), "b": _rand(5, 4, seed=1), "c": _rand(*c_shape, seed=2)}
    attrs = {"transA": 1, "transB": 1, "alpha": 2.0}
    if c_shape == ():
        check_vjp_f32("Gemm", inputs, attrs, opset=opset, oracle="ort64")
    else:
        check_vjp("Gemm", inputs, attrs, opset=opset)


@pytest.mark.parametrize("c_shape", [(5,), (3, 1), (1, 5)])
def test_gemm_symbolic_opset11(c_shape):
    inputs = {"a": _rand(3, 4), "b": _rand(4, 5, seed=1), "c": _rand(*c_shape, seed=2)}
    check_vjp_f32("Gemm", inputs, {"beta": 0.5}, opset=11, symbolic=True, oracle="ort64")


def test_gemm_float32():
    inputs = {"a": _rand(4, 3), "b": _rand(4, 5, seed=1), "c": _rand(5, seed=2)}
    check_vjp_f32("Gemm", inputs, {"transA": 1, "alpha": 0.5}, symbolic=True)


def test_gemm_emits_one_gemm_per_matrix_gradient():
    """dA and dB are each a single Gemm: no Transpose, MatMul or scaling Mul."""
    from onnx import TensorProto

    from onnxtrain.autodiff import expand_gradients
    from onnxtrain.core.graph import PREVIEW_DOMAIN
    from onnxtrain.core.names import NameGen

    nodes = [
        helper.make_node("Gemm", ["a", "b"], ["y"], transA=1, transB=1, alpha=3.0),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        helper.make_node(
            "Gradient", ["a", "b"], ["ga", "gb"], domain=PREVIEW_DOMAIN, xs=["a", "b"], y="loss"
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 3]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [5, 4]),
        ],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("ga", "gb")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    )
    expand_gradients(model.graph, model.opset_import, NameGen(["a", "b", "y", "loss", "ga", "gb"]), ["a", "b"])
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Gemm") == 3
    assert not {"Transpose", "MatMul", "Mul"} & set(ops)


# ------------------------------------------------------------------- Einsum
EINSUM_CASES = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij->ji", [(3, 4)]),
    ("ij->i", [(3, 4)]),
    ("i,i->", [(4,), (4,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("abc,cd,de->abe", [(2, 3, 4), (4, 2), (2, 3)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 5, 4, 2)]),
    ("...ij,jk->...ik", [(2, 3, 4), (4, 2)]),
    ("i...j,j->i...", [(3, 2, 1, 4), (4,)]),
    ("...i,i...->...", [(2, 3), (3, 2)]),
    ("bi,bi->b", [(4, 3), (4, 3)]),
]


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("eq,shapes", EINSUM_CASES)
def test_einsum(eq, shapes, symbolic):
    inputs = {f"x{i}": _rand(*s, seed=i) for i, s in enumerate(shapes)}
    check_vjp("Einsum", inputs, {"equation": eq}, opset=17, symbolic=symbolic)


@pytest.mark.parametrize("opset", [12, 13])
def test_einsum_opsets(opset):
    inputs = {"x0": _rand(2, 1, 3, 4), "x1": _rand(1, 5, 4, 2, seed=1)}
    check_vjp("Einsum", inputs, {"equation": "...ij,...jk->...ik"}, opset=opset)


def test_einsum_float32():
    inputs = {"x0": _rand(2, 3, 4), "x1": _rand(4, 5, seed=1)}
    check_vjp_f32("Einsum", inputs, {"equation": "bij,jk->bik"}, symbolic=True)


def test_einsum_diagonal_is_refused():
    with pytest.raises(TrainingModelError, match="repeats a subscript"):
        check_vjp("Einsum", {"x0": _rand(3, 3)}, {"equation": "ii->i"})
