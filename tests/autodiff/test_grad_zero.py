"""Zero-gradient ops (onnxtrain/autodiff/rules/zero.py): their outputs carry no
gradient, and an op without any rule stays an error."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gradcheck import check_vjp
from onnx import helper

from onnxtrain.autodiff import expand_gradients
from onnxtrain.autodiff.registry import REGISTRY
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.errors import GradientError

ZERO_OPS = [
    "Shape",
    "Size",
    "Equal",
    "Less",
    "LessOrEqual",
    "Greater",
    "GreaterOrEqual",
    "Not",
    "And",
    "Or",
    "Xor",
    "ArgMax",
    "ArgMin",
    "Floor",
    "Ceil",
    "Round",
    "Sign",
    "NonZero",
    "OneHot",
    "IsNaN",
    "IsInf",
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Bernoulli",
    "Multinomial",
    "ConstantOfShape",
    "Constant",
    "EyeLike",
    "Range",
    "BitShift",
    "BitwiseAnd",
    "BitwiseOr",
    "BitwiseXor",
    "BitwiseNot",
]


@pytest.mark.parametrize("op", ZERO_OPS)
def test_registered_as_zero(op):
    rule = REGISTRY.get("", op)
    assert rule is not None and rule.kind == "zero"


def _node(op, inputs, out, **attrs):
    return helper.make_node(op, inputs, [out], **attrs)


# y = x * f(x) with f piecewise constant: dy/dx = f(x), the f branch adds nothing.
PIECEWISE = [
    ("Floor", lambda x: np.floor(x), []),
    ("Ceil", lambda x: np.ceil(x), []),
    ("Round", lambda x: np.round(x), []),
    ("Sign", lambda x: np.sign(x), []),
]


@pytest.mark.parametrize("op, f, _", PIECEWISE, ids=[p[0] for p in PIECEWISE])
@pytest.mark.parametrize("opset", [11, 18])
def test_piecewise_constant_branch_gives_nothing(op, f, _, opset):
    x = np.array([[0.3, -1.7, 2.4], [1.2, -0.4, 3.6]])
    grads = check_vjp(
        "Mul", {"x": x}, node_inputs=["x", "fx"], extra_nodes=[_node(op, ["x"], "fx")], opset=opset
    )
    weights = check_vjp("Identity", {"x": x}, opset=opset, directions=0)["x"]
    np.testing.assert_allclose(grads["x"], weights * f(x))


@pytest.mark.parametrize("opset", [9, 13, 18])
def test_masks_shapes_and_indices_give_nothing(opset):
    """y = x * cast(x > 0) + gather(x, argmax(x)) reshaped by shape(x): only the
    Mul and Gather paths carry gradient."""
    x = np.array([[0.3, -1.7, 2.4], [1.2, -0.4, 3.6]])
    extra = [
        _node("Constant", [], "zero", value=onnx.numpy_helper.from_array(np.array(0.0))),
        _node("Greater", ["x", "zero"], "pos"),
        _node("Cast", ["pos"], "mask", to=onnx.TensorProto.DOUBLE),
        _node("Mul", ["x", "mask"], "relu"),
        _node("ArgMax", ["x"], "am", axis=1, keepdims=1),
        _node(
            "GatherElements" if opset >= 11 else "Identity",
            ["x", "am"] if opset >= 11 else ["x"],
            "g",
            **({"axis": 1} if opset >= 11 else {}),
        ),
        _node("Shape", ["x"], "sx"),
        _node("Expand", ["g", "sx"], "gb"),
    ]
    check_vjp("Add", {"x": x}, node_inputs=["relu", "gb"], extra_nodes=extra, opset=opset)


def _expand(nodes, opset=17):
    g = helper.make_graph(
        nodes
        + [helper.make_node("Gradient", ["x"], ["dx"], domain=PREVIEW_DOMAIN, xs=["x"], y="loss")],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, [2])],
        [helper.make_tensor_value_info("dx", onnx.TensorProto.DOUBLE, [2])],
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    names = NameGen({"x", "dx"} | {o for n in nodes for o in n.output})
    expand_gradients(g, opsets, names, ["x"])
    return g


def test_unknown_op_is_an_error_not_a_zero():
    nodes = [
        helper.make_node("Frobnicate", ["x"], ["y"], domain="example.custom", name="mystery"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    with pytest.raises(GradientError, match="no gradient rule for op 'Frobnicate'"):
        _expand(nodes)


def test_gradient_through_only_zero_ops_is_zeros():
    """loss = sum(cast(x > 0)): every path goes through Greater, so dx = 0."""
    nodes = [
        helper.make_node(
            "Constant", [], ["zero"], value=onnx.numpy_helper.from_array(np.array(0.0))
        ),
        helper.make_node("Greater", ["x", "zero"], ["pos"]),
        helper.make_node("Cast", ["pos"], ["mask"], to=onnx.TensorProto.DOUBLE),
        helper.make_node("ReduceSum", ["mask"], ["loss"], keepdims=0),
    ]
    g = _expand(nodes)
    from onnxtrain.runtime.executor import Executor

    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (dx,) = Executor(model).run({"x": np.array([1.0, -2.0])}, ["dx"])
    np.testing.assert_array_equal(dx, np.zeros(2))
