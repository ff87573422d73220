"""Tables of gradient-rule cases shared by tests/autodiff/test_grad_*.py.

A ``Case`` names one op, its inputs (drawn from a domain where the op is
smooth: positive for Log, away from kinks for Relu ...), its attributes and the
opsets to check.  ``case_params`` expands a table into pytest parameters, one
per (case, opset, static or symbolic shapes); ``run_case`` runs the float64
finite-difference check and ``run_case_float32`` checks that float32 gradients
come back with the input's type and shape.

Symbolic shapes before opset 13 use a second loss: check_vjp's loss sum(R * y)
multiplies y (symbolic) by R (static), and the gradient of that Mul needs
ReduceSum over runtime axes, which opset 12 and older lack.  There the loss is
sum(y^2) (ReduceSumSquare over everything), whose gradient 2 y dy needs no
broadcasting yet still weights every element differently.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import gradcheck
import numpy as np
import onnx
import pytest
from gradcheck import check_vjp, make_model
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnxtrain.autodiff import expand_gradients
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.runtime.executor import Executor

#: Default opsets: an old one (signatures before the opset-13 changes), 13, 18.
OPSETS = (9, 13, 18)


@dataclass
class Case:
    """One op to check.  ``inputs`` maps input names to arrays (float64 ones are
    differentiated unless ``wrt`` says otherwise); ``extra`` builds nodes that
    run first (Constants), from the opset."""

    id: str
    op: str
    inputs: Callable[[np.random.Generator], dict[str, np.ndarray]]
    attrs: dict[str, Any] = field(default_factory=dict)
    opsets: Sequence[int] = OPSETS
    node_inputs: Sequence[str] | None = None
    extra: Callable[[int], list[onnx.NodeProto]] | None = None
    wrt: Sequence[str] | None = None
    n_outputs: int = 1
    diff_outputs: Sequence[int] | None = None
    #: Extra keyword arguments for check_vjp (tolerances).
    check: dict[str, Any] = field(default_factory=dict)
    #: (predicate(opset, symbolic), reason, exception) -> xfail.
    xfail: tuple | None = None
    #: Where the float64 check runs: "ort", or "reference" (onnx.reference) for
    #: ops onnxruntime runs only in float32 (Erf, Tan, Softplus, Gelu, ...).
    #: The float32 check always runs on onnxruntime.
    runtime: str = "ort"
    #: Opsets below this one run the float64 check on onnx.reference as well
    #: (onnxruntime's kernel for the op's older version is float32 only).
    reference_below: int = 0
    #: The rule sums a gradient over broadcast axes (binary and variadic ops).
    broadcasts: bool = False


#: From this opset on, ReduceSum takes runtime axes.
RUNTIME_AXES_FROM = 13

def case_params(cases: Sequence[Case]) -> list:
    """pytest parameters (case, opset, symbolic) for every opset, static and
    symbolic shapes; expected failures marked."""
    out = []
    for c in cases:
        for opset in c.opsets:
            for sym in (False, True):
                marks = []
                if c.xfail is not None and c.xfail[0](opset, sym):
                    marks.append(
                        pytest.mark.xfail(raises=c.xfail[2], strict=True, reason=c.xfail[1])
                    )
                tag = "sym" if sym else "static"
                out.append(
                    pytest.param(c, opset, sym, id=f"{c.id}-opset{opset}-{tag}", marks=marks)
                )
    return out


def float32_params(cases: Sequence[Case]) -> list:
    """One float32 parameter per case, at its newest opset with static shapes."""
    return [pytest.param(c, max(c.opsets), id=f"{c.id}-opset{max(c.opsets)}") for c in cases]


class Erf(OpRun):
    """Erf in the input's precision (onnx.reference's own Erf rounds to float32)."""

    op_domain = ""

    def _run(self, x):  # noqa: D102
        return (np.vectorize(math.erf, otypes=[x.dtype])(x),)


class Gelu(OpRun):
    """Gelu in the input's precision (onnx.reference's own Gelu rounds to float32)."""

    op_domain = ""

    def _run(self, x, approximate=None):  # noqa: D102
        if (approximate or "none") == "tanh":
            u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
            return ((0.5 * x * (1.0 + np.tanh(u))).astype(x.dtype),)
        cdf = 0.5 * (1.0 + np.vectorize(math.erf, otypes=[x.dtype])(x / math.sqrt(2.0)))
        return ((x * cdf).astype(x.dtype),)


class _ReferenceExecutor:
    """gradcheck's Executor interface over onnx's numpy reference evaluator."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._ref = ReferenceEvaluator(model, new_ops=[Erf, Gelu])

    def run(self, feeds: dict[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(v) for v in self._ref.run(list(output_names), dict(feeds))]


@contextmanager
def executor(runtime: str) -> Iterator[None]:
    """Run check_vjp's programs on onnxruntime ("ort") or on onnx.reference."""
    if runtime == "ort":
        yield
        return
    assert runtime == "reference", runtime
    saved = gradcheck.Executor
    gradcheck.Executor = _ReferenceExecutor
    try:
        yield
    finally:
        gradcheck.Executor = saved


def run_case(case: Case, opset: int, symbolic: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20240521)
    inputs = case.inputs(rng)
    with executor("reference" if opset < case.reference_below else case.runtime):
        return _check(case, inputs, opset, symbolic)


def _check(case: Case, inputs: dict[str, np.ndarray], opset: int, symbolic: bool) -> dict:
    if symbolic and opset < RUNTIME_AXES_FROM:
        return check_vjp_squared(case, inputs, opset)
    return check_vjp(
        case.op,
        inputs,
        case.attrs,
        wrt=case.wrt,
        opset=opset,
        symbolic=symbolic,
        node_inputs=case.node_inputs,
        extra_nodes=case.extra(opset) if case.extra else (),
        n_outputs=case.n_outputs,
        diff_outputs=case.diff_outputs,
        **case.check,
    )


def check_vjp_squared(
    case: Case, inputs: dict[str, np.ndarray], opset: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Like check_vjp with symbolic shapes, for loss = sum_k sum(y_k^2)."""
    rng = np.random.default_rng(seed)
    eps = case.check.get("eps", 1e-6)
    rtol, atol = case.check.get("rtol", 1e-5), case.check.get("atol", 1e-7)
    wrt = (
        list(case.wrt)
        if case.wrt is not None
        else [k for k, v in inputs.items() if v.dtype == np.float64]
    )
    outs = [f"out{i}" for i in range(case.n_outputs)]
    diff = list(range(case.n_outputs)) if case.diff_outputs is None else list(case.diff_outputs)
    names = list(case.node_inputs) if case.node_inputs is not None else list(inputs)
    nodes = list(case.extra(opset) if case.extra else [])
    nodes.append(helper.make_node(case.op, names, outs, name="op", **case.attrs))
    squares = ["loss"] if len(diff) == 1 else [f"sq{k}" for k in diff]
    for k, sq in zip(diff, squares):
        nodes.append(helper.make_node("ReduceSumSquare", [outs[k]], [sq], keepdims=0))
    if len(diff) > 1:
        nodes.append(helper.make_node("Sum", squares, ["loss"]))
    grads = [f"grad_{x}" for x in wrt]
    gnode = helper.make_node(
        "Gradient", wrt, grads, domain=PREVIEW_DOMAIN, xs=wrt, y="loss", name="G"
    )
    types = {g: helper.np_dtype_to_tensor_dtype(inputs[x].dtype) for g, x in zip(grads, wrt)}
    types["loss"] = onnx.TensorProto.DOUBLE
    shapes = {g: list(inputs[x].shape) for g, x in zip(grads, wrt)}
    shapes["loss"] = []
    loss_model = make_model(nodes, inputs, ["loss"], opset, types, shapes)
    grad_model = make_model(
        nodes + [gnode], inputs, ["loss"] + grads, opset, types, shapes, symbolic=inputs
    )
    expand_gradients(
        grad_model.graph, grad_model.opset_import, NameGen.from_graph(grad_model.graph), list(inputs)
    )
    onnx.checker.check_model(grad_model)
    analytic = gradcheck.Executor(grad_model).run(inputs, grads)
    forward = gradcheck.Executor(loss_model)
    for _ in range(2):
        d = {x: rng.standard_normal(inputs[x].shape) for x in wrt}
        plus = {**inputs, **{x: inputs[x] + eps * d[x] for x in wrt}}
        minus = {**inputs, **{x: inputs[x] - eps * d[x] for x in wrt}}
        numeric = (forward.run(plus, ["loss"])[0] - forward.run(minus, ["loss"])[0]) / (2 * eps)
        predicted = sum(float(np.sum(g * d[x])) for g, x in zip(analytic, wrt))
        np.testing.assert_allclose(predicted, numeric, rtol=rtol, atol=atol, err_msg=case.op)
    for g, x in zip(analytic, wrt):
        assert g.shape == inputs[x].shape and g.dtype == inputs[x].dtype, x
    return dict(zip(wrt, analytic))


def run_case_float32(case: Case, opset: int) -> None:
    """Differentiate the float32 version of ``case`` and check each gradient's
    element type and shape (no finite differences: float32 is too coarse)."""
    rng = np.random.default_rng(20240521)
    inputs64 = case.inputs(rng)
    wrt = (
        list(case.wrt)
        if case.wrt is not None
        else [k for k, v in inputs64.items() if v.dtype == np.float64]
    )
    inputs = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in inputs64.items()}
    outs = [f"out{i}" for i in range(case.n_outputs)]
    diff = list(range(case.n_outputs)) if case.diff_outputs is None else list(case.diff_outputs)
    nodes = list(case.extra(opset) if case.extra else [])
    for n in nodes:  # float32 versions of float64 Constants
        for a in n.attribute:
            if a.name == "value" and a.t.data_type == onnx.TensorProto.DOUBLE:
                arr = onnx.numpy_helper.to_array(a.t).astype(np.float32)
                a.t.CopyFrom(onnx.numpy_helper.from_array(arr, a.t.name))
    names = list(case.node_inputs) if case.node_inputs is not None else list(inputs)
    nodes.append(helper.make_node(case.op, names, outs, name="op", **case.attrs))
    sums = []
    for k in diff:
        nodes.append(helper.make_node("ReduceSum", [outs[k]], [f"s{k}"], keepdims=0))
        sums.append(f"s{k}")
    nodes.append(helper.make_node("Sum", sums, ["loss"]))
    grads = [f"grad_{x}" for x in wrt]
    nodes.append(
        helper.make_node("Gradient", wrt, grads, domain=PREVIEW_DOMAIN, xs=wrt, y="loss", name="G")
    )
    types = {}
    types.update({g: helper.np_dtype_to_tensor_dtype(inputs[x].dtype) for g, x in zip(grads, wrt)})
    shapes = {g: list(inputs[x].shape) for g, x in zip(grads, wrt)}
    model = make_model(nodes, inputs, grads, opset, types, shapes)
    expand_gradients(model.graph, model.opset_import, NameGen.from_graph(model.graph), list(inputs))
    onnx.checker.check_model(model)
    values = Executor(model).run(inputs, grads)
    for g, x in zip(values, wrt):
        assert g.dtype == np.float32, f"grad of {x}: dtype {g.dtype}"
        assert g.shape == inputs[x].shape, f"grad of {x}: shape {g.shape} != {inputs[x].shape}"
        assert np.all(np.isfinite(g)), f"grad of {x} is not finite"


def expand_only(op: str, inputs: dict[str, np.ndarray], attrs: dict | None = None, *, opset: int):
    """Expand the Gradient of sum(op(inputs)) w.r.t. the float inputs without
    running anything (for rules that must refuse a node onnxruntime cannot run)."""
    wrt = [k for k, v in inputs.items() if v.dtype == np.float64]
    nodes = [
        helper.make_node(op, list(inputs), ["out0"], name="op", **(attrs or {})),
        helper.make_node("ReduceSum", ["out0"], ["loss"], keepdims=0),
        helper.make_node(
            "Gradient",
            wrt,
            [f"grad_{x}" for x in wrt],
            domain=PREVIEW_DOMAIN,
            xs=wrt,
            y="loss",
            name="G",
        ),
    ]
    model = make_model(nodes, inputs, ["loss"], opset, {}, {"loss": []})
    expand_gradients(model.graph, model.opset_import, NameGen.from_graph(model.graph), list(inputs))
    return model


# ------------------------------------------------------------ input domains


def normal(*shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.standard_normal(shape)


def uniform(lo: float, hi: float, *shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.uniform(lo, hi, shape)


def away(*shape: int, points: Sequence[float] = (0.0,), gap: float = 0.1, scale: float = 1.0):
    """Normal draws (times ``scale``) kept at least ``gap`` from each of ``points``."""

    def draw(rng: np.random.Generator) -> np.ndarray:
        x = rng.standard_normal(shape) * scale
        for p in points:
            near = np.abs(x - p) < gap
            x = np.where(near, p + np.where(x >= p, gap, -gap) * 2, x)
        return x

    return draw


def ins(**draws: Callable[[np.random.Generator], np.ndarray] | np.ndarray):
    """An inputs callable from per-input draws (callables) or fixed arrays."""

    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {k: (v(rng) if callable(v) else np.asarray(v)) for k, v in draws.items()}

    return make


def scalar_node(name: str) -> list[onnx.NodeProto]:
    """Nodes turning the 1-element input ``name + '1'`` into the 0-d tensor ``name``.

    (check_vjp perturbs inputs with numpy arithmetic, which turns 0-d arrays into
    numpy scalars that onnxruntime refuses; so scalars enter as shape [1].)"""
    return [
        const_node(name + "_shape", np.zeros(0, np.int64)),
        helper.make_node("Reshape", [name + "1", name + "_shape"], [name]),
    ]


def const_node(name: str, value: Any, dtype: Any = np.int64) -> onnx.NodeProto:
    """A Constant node producing ``name``."""
    arr = np.asarray(value, dtype=dtype)
    return helper.make_node(
        "Constant", [], [name], value=onnx.numpy_helper.from_array(arr, name=name + "_value")
    )
