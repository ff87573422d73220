"""Gradient checks of the elementwise rules (onnxtrain/autodiff/rules/elementwise.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from grad_cases import (
    Case,
    away,
    case_params,
    const_node,
    executor,
    expand_only,
    float32_params,
    ins,
    normal,
    run_case,
    run_case_float32,
    scalar_node,
    uniform,
)
from gradcheck import check_vjp
from onnx import TensorProto, helper

from onnxtrain.errors import GradientError

#: onnxruntime runs these ops only in float32 (or, for Shrink, computes in
#: float32 inside its double kernel): their float64 check runs on onnx.reference.
REF = dict(runtime="reference")
#: Binary and variadic ops: gradients are summed over broadcast axes.
BCAST = dict(broadcasts=True)

CASES = [
    # ---------------------------------------------------------- arithmetic
    Case("Add", "Add", ins(a=normal(2, 3, 4), b=normal(3, 1)), **BCAST),
    Case("Sub", "Sub", ins(a=normal(2, 3, 4), b=normal(3, 1)), **BCAST),
    Case("Sub-same", "Sub", ins(a=normal(3, 4), b=normal(3, 4)), **BCAST),
    Case("Sub-size1", "Sub", ins(a=normal(1, 4), b=normal(3, 1)), **BCAST),
    Case("Mul", "Mul", ins(a=normal(2, 3, 4), b=normal(4)), **BCAST),
    Case("Div", "Div", ins(a=normal(2, 3), b=away(1, 3, gap=0.5)), **BCAST),
    Case("Div-lead", "Div", ins(a=normal(3), b=away(2, 3, gap=0.5)), **BCAST),
    Case("Neg", "Neg", ins(x=normal(2, 3))),
    Case("Pow", "Pow", ins(a=uniform(0.5, 2.0, 2, 3), b=normal(3)), **BCAST),
    Case(
        "Pow-scalar-exp",
        "Pow",
        ins(a=uniform(0.5, 2.0, 2, 3), b1=uniform(2.0, 3.0, 1)),
        node_inputs=["a", "b"],
        extra=lambda opset: scalar_node("b"),
    ),
    # A negative base with an integral exponent: only the base is differentiable.
    Case(
        "Pow-negative-base",
        "Pow",
        ins(a=uniform(-2.0, -0.5, 2, 3)),
        node_inputs=["a", "three"],
        extra=lambda opset: [const_node("three", 3.0, np.float64)],
    ),
    # RMSNorm's square: a constant exponent 2 differentiates without Pow.
    Case(
        "Pow-square",
        "Pow",
        ins(a=normal(2, 3)),
        node_inputs=["a", "two"],
        extra=lambda opset: [const_node("two", 2.0, np.float64)],
    ),
    Case(
        "Pow-int-exponent",
        "Pow",
        ins(a=normal(2, 3), b=np.array([2, 3, 1], dtype=np.int64)),
        opsets=(12, 13, 18),
        **BCAST,
    ),
    Case("Sum-3", "Sum", ins(a=normal(2, 3), b=normal(3), c=normal(1, 1)), **BCAST),
    Case("Mean-3", "Mean", ins(a=normal(2, 3), b=normal(3), c=normal(2, 1)), **REF, **BCAST),
    Case("Max-2", "Max", ins(a=normal(2, 3), b=normal(3)), **BCAST),
    Case("Min-3", "Min", ins(a=normal(2, 3), b=normal(3), c=normal(2, 1)), **BCAST),
    Case("Max-1", "Max", ins(a=normal(2, 3))),
    Case(
        "Mod-fmod",
        "Mod",
        ins(a=uniform(0.3, 4.0, 2, 3), b=uniform(0.7, 1.9, 3)),
        attrs={"fmod": 1},
        opsets=(10, 13, 18),
        **BCAST,
    ),
    Case(
        "Where",
        "Where",
        ins(c=lambda rng: rng.random((2, 3)) > 0.5, a=normal(2, 3), b=normal(3)),
        **BCAST,
    ),
    # float64 -> float32 (extra node) -> float64 (the op): the gradient crosses both
    # Casts; float32 rounding in the loss needs a large difference step.
    Case(
        "Cast-from-float",
        "Cast",
        ins(x=normal(2, 3)),
        attrs={"to": 11},
        node_inputs=["x32"],
        extra=lambda opset: [helper.make_node("Cast", ["x"], ["x32"], to=1)],
        check=dict(eps=1e-2, rtol=1e-3, atol=1e-4),
    ),
    Case("Cast-double", "Cast", ins(x=normal(2, 3)), attrs={"to": 11}),
    Case("CastLike", "CastLike", ins(x=normal(2, 3), t=np.zeros(1)), opsets=(15, 18), wrt=["x"]),
    Case("Identity", "Identity", ins(x=normal(2, 3))),
    # ---------------------------------------------------------- unary math
    Case("Sqrt", "Sqrt", ins(x=uniform(0.2, 3.0, 2, 3))),
    Case("Exp", "Exp", ins(x=normal(2, 3))),
    Case("Log", "Log", ins(x=uniform(0.2, 3.0, 2, 3))),
    Case("Reciprocal", "Reciprocal", ins(x=away(2, 3, gap=0.5))),
    Case("Abs", "Abs", ins(x=away(2, 3))),
    Case("Erf", "Erf", ins(x=normal(2, 3)), **REF),
    Case("Sin", "Sin", ins(x=normal(2, 3))),
    Case("Cos", "Cos", ins(x=normal(2, 3))),
    Case("Tan", "Tan", ins(x=uniform(-1.2, 1.2, 2, 3)), **REF),
    Case("Asin", "Asin", ins(x=uniform(-0.9, 0.9, 2, 3)), **REF),
    Case("Acos", "Acos", ins(x=uniform(-0.9, 0.9, 2, 3)), **REF),
    Case("Atan", "Atan", ins(x=normal(2, 3)), **REF),
    Case("Sinh", "Sinh", ins(x=normal(2, 3)), **REF),
    Case("Cosh", "Cosh", ins(x=normal(2, 3)), **REF),
    Case("Asinh", "Asinh", ins(x=normal(2, 3)), **REF),
    Case("Acosh", "Acosh", ins(x=uniform(1.2, 3.0, 2, 3)), **REF),
    Case("Atanh", "Atanh", ins(x=uniform(-0.9, 0.9, 2, 3)), **REF),
    # --------------------------------------------------------- activations
    Case("Relu", "Relu", ins(x=away(2, 3))),
    Case("Sigmoid", "Sigmoid", ins(x=normal(2, 3))),
    Case("Tanh", "Tanh", ins(x=normal(2, 3))),
    Case("LeakyRelu", "LeakyRelu", ins(x=away(2, 3)), attrs={"alpha": 0.2}, **REF),
    Case("PRelu", "PRelu", ins(x=away(2, 3, 4), s=normal(3, 1)), **REF, **BCAST),
    Case("PRelu-scalar-slope", "PRelu", ins(x=away(2, 3), s=normal(1)), **REF, **BCAST),
    Case("Elu", "Elu", ins(x=away(2, 3)), attrs={"alpha": 0.7}, **REF),
    Case("Selu", "Selu", ins(x=away(2, 3)), **REF),
    Case("Celu", "Celu", ins(x=away(2, 3)), attrs={"alpha": 1.5}, opsets=(12, 13, 18), **REF),
    Case(
        "ThresholdedRelu",
        "ThresholdedRelu",
        ins(x=away(2, 3, points=(0.5,))),
        attrs={"alpha": 0.5},
        opsets=(10, 13, 18),
        **REF,
    ),
    Case("Shrink", "Shrink", ins(x=away(2, 3, points=(-0.5, 0.5))), attrs={"bias": 0.1}, **REF),
    Case("HardSigmoid", "HardSigmoid", ins(x=away(2, 3, points=(-2.5, 2.5), scale=3.0)), **REF),
    Case(
        "HardSwish",
        "HardSwish",
        ins(x=away(2, 3, points=(-3.0, 3.0), scale=3.0)),
        opsets=(14, 18),
        **REF,
    ),
    Case("Softplus", "Softplus", ins(x=normal(2, 3)), **REF),
    Case("Softsign", "Softsign", ins(x=normal(2, 3)), **REF),
    Case("Mish", "Mish", ins(x=normal(2, 3)), opsets=(18, 22), **REF),
    Case("Gelu", "Gelu", ins(x=normal(2, 3)), opsets=(20, 26), **REF),
    Case(
        "Gelu-tanh",
        "Gelu",
        ins(x=normal(2, 3)),
        attrs={"approximate": "tanh"},
        opsets=(20, 26),
        check=dict(rtol=1e-7, atol=1e-9),
        **REF,
    ),
    # ---------------------------------------------------------------- Clip
    Case(
        "Clip-attrs",
        "Clip",
        ins(x=away(2, 3, points=(-0.5, 0.5))),
        attrs={"min": -0.5, "max": 0.5},
        opsets=(9,),
        **REF,
    ),
    Case(
        "Clip-min-attr",
        "Clip",
        ins(x=away(2, 3, points=(-0.5,))),
        attrs={"min": -0.5},
        opsets=(9,),
        **REF,
    ),
    Case(
        "Clip-inputs",
        "Clip",
        ins(x=away(3, 4, points=(-0.5, 0.5)), lo1=uniform(-0.6, -0.4, 1), hi1=uniform(0.4, 0.6, 1)),
        node_inputs=["x", "lo", "hi"],
        extra=lambda opset: scalar_node("lo") + scalar_node("hi"),
        opsets=(11, 13, 18),
        reference_below=12,
    ),
    Case(
        "Clip-max-only",
        "Clip",
        ins(x=away(3, 4, points=(0.5,)), hi1=uniform(0.4, 0.6, 1)),
        node_inputs=["x", "", "hi"],
        extra=lambda opset: scalar_node("hi"),
        opsets=(11, 13, 18),
        reference_below=12,
    ),
    Case(
        "Clip-min-only",
        "Clip",
        ins(x=away(3, 4, points=(-0.5,)), lo1=uniform(-0.6, -0.4, 1)),
        node_inputs=["x", "lo"],
        extra=lambda opset: scalar_node("lo"),
        opsets=(12, 18),
    ),
    Case(
        "Clip-const-bounds",
        "Clip",
        ins(x=away(3, 4, points=(-0.5, 0.5))),
        node_inputs=["x", "lo", "hi"],
        opsets=(11, 18),
        reference_below=12,
        extra=lambda opset: [const_node("lo", -0.5, np.float64), const_node("hi", 0.5, np.float64)],
    ),
    Case("Clip-none", "Clip", ins(x=normal(2, 3)), opsets=(11, 13), reference_below=12),
]


@pytest.mark.parametrize("case, opset, symbolic", case_params(CASES))
def test_elementwise_vjp(case, opset, symbolic):
    run_case(case, opset, symbolic)


@pytest.mark.parametrize("case, opset", float32_params(CASES))
def test_elementwise_float32(case, opset):
    run_case_float32(case, opset)


# ---------------------------------------------------------------- specifics


def _gelu_tanh_derivative(x: np.ndarray) -> np.ndarray:
    """d/dx of x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2, by the product rule in numpy."""
    k = math.sqrt(2.0 / math.pi)
    u = k * (x + 0.044715 * x**3)
    t = np.tanh(u)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x)


def test_gelu_tanh_matches_numpy_derivative():
    """Regression: the tanh-approximate Gelu gradient is that of the tanh formula,
    not that of the exact erf Gelu (a peer got this wrong)."""
    x = np.linspace(-4.0, 4.0, 33).reshape(3, 11)
    # onnxruntime has no float64 Gelu kernel: run the float64 programs on onnx.reference.
    with executor("reference"):
        got = check_vjp("Gelu", {"x": x}, {"approximate": "tanh"}, opset=20, rtol=1e-7, atol=1e-9)[
            "x"
        ]
        # check_vjp weights the output by random R; recover dL/dy = R by differentiating
        # Identity the same way (same seed, same shapes -> same R).
        weights = check_vjp("Identity", {"x": x}, opset=20)["x"]
        exact = check_vjp("Gelu", {"x": x}, opset=20)["x"]
    np.testing.assert_allclose(got, weights * _gelu_tanh_derivative(x), rtol=1e-12, atol=1e-14)
    # The exact (erf) Gelu's derivative differs by far more than rounding.
    assert np.max(np.abs(exact - got)) > 1e-5


def test_sigmoid_tanh_exp_reuse_forward_output():
    """Sigmoid, Tanh, Exp and Sqrt gradients read y, not a second forward op."""
    import onnx
    from onnx import helper

    from onnxtrain.autodiff import expand_gradients
    from onnxtrain.core.graph import PREVIEW_DOMAIN
    from onnxtrain.core.names import NameGen

    for op in ("Sigmoid", "Tanh", "Exp", "Sqrt"):
        g = helper.make_graph(
            [
                helper.make_node(op, ["x"], ["y"]),
                helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
                helper.make_node(
                    "Gradient", ["x"], ["dx"], domain=PREVIEW_DOMAIN, xs=["x"], y="loss"
                ),
            ],
            "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, [2])],
            [helper.make_tensor_value_info("dx", onnx.TensorProto.DOUBLE, [2])],
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
        expand_gradients(g, opsets, NameGen(["x", "y", "loss", "dx"]), ["x"])
        ops = [n.op_type for n in g.node]
        assert ops.count(op) == 1, (op, ops)


def test_constant_square_and_cube_differentiate_without_pow():
    """Pow(a, 2) and Pow(a, 3): the slope is 2 * a and 3 * (a * a), no Pow kernel
    (a libm pow per element); any other exponent keeps Pow(a, b - 1)."""
    from onnxtrain.autodiff import expand_gradients
    from onnxtrain.core.graph import PREVIEW_DOMAIN
    from onnxtrain.core.names import NameGen

    for p, pows in ((2.0, 0), (3.0, 0), (2.5, 1)):
        g = helper.make_graph(
            [
                const_node("b", p, np.float32),
                helper.make_node("Pow", ["a", "b"], ["y"]),
                helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
                helper.make_node("Gradient", ["a"], ["da"], domain=PREVIEW_DOMAIN, xs=["a"], y="loss"),
            ],
            "g",
            [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])],
            [helper.make_tensor_value_info("da", TensorProto.FLOAT, [2, 3])],
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
        expand_gradients(g, opsets, NameGen(["a", "b", "y", "loss", "da"]), ["a"])
        ops = [n.op_type for n in g.node]
        assert ops.count("Pow") == 1 + pows, (p, ops)


def test_onnxruntime_pow_of_one_and_two_are_exact():
    """What makes the Pow-free slope the same numbers: onnxruntime's Pow(a, 1)
    is a and Pow(a, 2) is a * a, bit for bit (float and double, every class of
    value: subnormals, huge, negative, +-0, +-inf; NaN stays NaN)."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    for dtype, tt in ((np.float32, TensorProto.FLOAT), (np.float64, TensorProto.DOUBLE)):
        info = np.finfo(dtype)
        special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, info.tiny, info.tiny / 8, -info.tiny / 3,
                            info.max, -info.max, 1.0, -1.0], dtype)
        bits = rng.integers(0, 2 ** 31 if dtype == np.float32 else 2 ** 62, 200_000)
        raw = bits.astype(np.uint32 if dtype == np.float32 else np.uint64).view(dtype)
        a = np.concatenate([special, raw, -raw]).astype(dtype)
        for p in (1.0, 2.0):
            g = helper.make_graph(
                [helper.make_node("Pow", ["a", "p"], ["y"])], "pow",
                [helper.make_tensor_value_info("a", tt, [a.size])],
                [helper.make_tensor_value_info("y", tt, [a.size])],
                [helper.make_tensor("p", tt, [], [p])],
            )
            m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
            m.ir_version = 8
            y = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
            with np.errstate(over="ignore", invalid="ignore"):  # (inf and NaN squared, on purpose)
                want = a if p == 1.0 else a * a
            nan = np.isnan(want)  # (NaN payloads may be quieted: any NaN is a NaN)
            assert np.array_equal(np.isnan(y), nan), (dtype, p)
            assert y[~nan].tobytes() == want[~nan].tobytes(), (dtype, p)


def test_mod_without_fmod_is_an_error():
    with pytest.raises(GradientError, match="fmod=1"):
        expand_only("Mod", {"a": np.ones((2,)) * 3.5, "b": np.ones((2,))}, opset=13)


def test_minmax_ties_split_evenly():
    """Max(a, b) with a == b everywhere: each input gets half of the gradient."""
    a = np.array([[1.0, 2.0, 3.0]])
    grads = check_vjp("Max", {"a": a, "b": a.copy()}, opset=13, directions=0)
    np.testing.assert_allclose(grads["a"], grads["b"])
    weights = check_vjp("Identity", {"a": a}, opset=13, directions=0)["a"]
    np.testing.assert_allclose(grads["a"], weights / 2)


def test_clip_gradient_zero_outside_bounds():
    x = np.array([-2.0, -0.2, 0.3, 2.0])
    got = check_vjp(
        "Clip",
        {"x": x, "lo1": np.array([-1.0]), "hi1": np.array([1.0])},
        opset=13,
        node_inputs=["x", "lo", "hi"],
        extra_nodes=scalar_node("lo") + scalar_node("hi"),
    )
    assert got["x"][0] == 0 and got["x"][3] == 0
    assert got["x"][1] != 0 and got["x"][2] != 0


@pytest.mark.parametrize("opset", [7, 8])
def test_runtime_broadcast_before_opset_9_is_refused_clearly(opset):
    """Add of [N, 3] and [M, 3] with N, M unknown: whether an input was broadcast
    along axis 0 is known only at run time, and the ops that decide it (Where,
    ConstantOfShape, NonZero) are opset 9.  Before that the rule refuses with
    an error naming the node, the input and the axis, instead of emitting ops
    the opset lacks."""
    from onnxtrain.autodiff import expand_gradients
    from onnxtrain.core.names import NameGen
    from onnxtrain.errors import TrainingModelError

    g = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"], name="add"),
         helper.make_node("ReduceSum", ["c"], ["y"], keepdims=0),
         helper.make_node("Gradient", ["a", "b"], ["ga", "gb"], domain="ai.onnx.preview.training",
                          xs=["a", "b"], y="y")],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["M", 3])],
        [helper.make_tensor_value_info("ga", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("gb", TensorProto.FLOAT, None)])
    imports = [helper.make_opsetid("", opset), helper.make_opsetid("ai.onnx.preview.training", 1)]
    with pytest.raises(TrainingModelError, match=r"Add node 'add'.*'a'.*axes \[0\].*opset >= 9"):
        expand_gradients(g, imports, NameGen(["a", "b", "c", "y", "ga", "gb"]), ["a", "b"], [])
