"""GELU written as elementwise nodes (exporters below opset 20; erf and tanh
forms) is differentiated as one op: the backward pass reads x only, never the
chain's inner values, and its gradient is GELU's (float64 numpy), whatever the
spelling.  Chains that are not exactly GELU, or that a Gradient cuts, are
differentiated node by node."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import expand_gradients
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen

SQRT2 = np.float32(math.sqrt(2.0))
SQRT_HALF = np.float32(math.sqrt(0.5))


def _const(name: str, value) -> object:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.float32)))


def chain(variant: str, k=SQRT2) -> list:
    """The forward nodes x -> y of one exporter's spelling of GELU."""
    if variant == "div":  # torch.onnx (TorchScript): ((x * (erf(x / sqrt2) + 1)) * 0.5
        return [_const("k", k), _const("one", 1.0), _const("half", 0.5),
                helper.make_node("Div", ["x", "k"], ["a"]), helper.make_node("Erf", ["a"], ["e"]),
                helper.make_node("Add", ["e", "one"], ["c"]), helper.make_node("Mul", ["x", "c"], ["m"]),
                helper.make_node("Mul", ["m", "half"], ["y"])]
    if variant == "mul":  # (1 + erf(x * (1/sqrt2))) * 0.5, then * x; operands swapped
        return [_const("k", SQRT_HALF), _const("one", 1.0), _const("half", 0.5),
                helper.make_node("Mul", ["k", "x"], ["a"]), helper.make_node("Erf", ["a"], ["e"]),
                helper.make_node("Add", ["one", "e"], ["c"]), helper.make_node("Mul", ["c", "half"], ["m"]),
                helper.make_node("Mul", ["x", "m"], ["y"])]
    if variant == "half_first":  # (x * 0.5) * (1 + erf(x / sqrt2))
        return [_const("k", SQRT2), _const("one", 1.0), _const("half", 0.5),
                helper.make_node("Mul", ["x", "half"], ["h"]),
                helper.make_node("Div", ["x", "k"], ["a"]), helper.make_node("Erf", ["a"], ["e"]),
                helper.make_node("Add", ["e", "one"], ["c"]), helper.make_node("Mul", ["h", "c"], ["y"])]
    beta, kappa = math.sqrt(2.0 / math.pi), 0.044715
    if variant == "gpt2":  # HF's gelu_new: (x * 0.5) * (1 + tanh(beta * (x + kappa * x^3)))
        return [_const("three", 3.0), _const("kappa", kappa), _const("beta", beta), _const("one", 1.0),
                _const("half", 0.5), helper.make_node("Mul", ["x", "half"], ["h"]),
                helper.make_node("Pow", ["x", "three"], ["p"]), helper.make_node("Mul", ["p", "kappa"], ["q"]),
                helper.make_node("Add", ["x", "q"], ["s"]), helper.make_node("Mul", ["s", "beta"], ["a"]),
                helper.make_node("Tanh", ["a"], ["e"]), helper.make_node("Add", ["e", "one"], ["c"]),
                helper.make_node("Mul", ["h", "c"], ["y"])]
    assert variant == "tanh"  # torch.onnx's gelu(approximate="tanh"): 0.5 * (x * (1 + tanh(...))), x^3 as x * (x * x)
    return [_const("kappa", kappa), _const("beta", beta), _const("one", 1.0), _const("half", 0.5),
            helper.make_node("Mul", ["x", "x"], ["xx"]), helper.make_node("Mul", ["x", "xx"], ["p"]),
            helper.make_node("Mul", ["kappa", "p"], ["q"]), helper.make_node("Add", ["x", "q"], ["s"]),
            helper.make_node("Mul", ["beta", "s"], ["a"]), helper.make_node("Tanh", ["a"], ["e"]),
            helper.make_node("Add", ["one", "e"], ["c"]), helper.make_node("Mul", ["x", "c"], ["m"]),
            helper.make_node("Mul", ["half", "m"], ["y"])]


def expanded(nodes: list, extra_loss: str | None = None, zs: tuple[str, ...] = (), wrt_k: bool = False):
    """The graph L = sum(r * y) [+ sum(extra_loss)], dL/dx [and dL/dk, with k
    an initializer], Gradient expanded."""
    nodes = [*nodes, helper.make_node("Mul", ["y", "r"], ["yr"]),
             helper.make_node("ReduceSum", ["yr"], ["loss0"], keepdims=0)]
    if extra_loss:
        nodes += [helper.make_node("ReduceSum", [extra_loss], ["s"], keepdims=0),
                  helper.make_node("Add", ["loss0", "s"], ["loss"])]
    else:
        nodes += [helper.make_node("Identity", ["loss0"], ["loss"])]
    xs = ["x", "k"] if wrt_k else ["x"]
    cut = {"zs": list(zs)} if zs else {}
    nodes.append(helper.make_node("Gradient", [*xs, *zs], ["d" + x for x in xs], domain=PREVIEW_DOMAIN,
                                  xs=xs, y="loss", **cut))
    initializers = []
    if wrt_k:  # k an initializer, differentiated: its Constant node goes
        nodes = [n for n in nodes if list(n.output) != ["k"]]
        initializers = [numpy_helper.from_array(SQRT2, "k")]
    shape = [4, 33]
    graph = helper.make_graph(
        nodes, "gelu",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "r")],
        [helper.make_tensor_value_info("d" + x, TensorProto.FLOAT, shape if x == "x" else []) for x in xs],
        initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    expand_gradients(graph, opsets, NameGen.from_graph(graph), ["x", "r", *(t.name for t in initializers)])
    model = helper.make_model(graph, opset_imports=opsets[:1])
    model.ir_version = 8
    return model


def run(model, x: np.ndarray, r: np.ndarray, outputs=("dx",)):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    got = sess.run(list(outputs), {"x": x, "r": r})
    return got[0] if len(outputs) == 1 else got


def inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = np.linspace(-5.0, 5.0, 132).reshape(4, 33).astype(np.float32)
    return x, rng.normal(size=(4, 33)).astype(np.float32)


def erf64(z: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(z)


def chain_slope64(x: np.ndarray, k: float) -> np.ndarray:
    """d/dx [x (1 + erf(x / k)) / 2] in float64; k = sqrt 2 is GELU's slope Phi(x) + x phi(x)."""
    x = x.astype(np.float64)
    return 0.5 * (1.0 + erf64(x / k)) + x * np.exp(-((x / k) ** 2)) / (k * math.sqrt(math.pi))


def tanh_slope64(x: np.ndarray) -> np.ndarray:
    """d/dx [x (1 + tanh(u)) / 2], u = sqrt(2/pi) (x + 0.044715 x^3), in float64."""
    x = x.astype(np.float64)
    beta = math.sqrt(2.0 / math.pi)
    t = np.tanh(beta * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * beta * (1.0 + 3 * 0.044715 * x * x)


def readers_of(model, name: str) -> list[str]:
    return [n.op_type for n in model.graph.node if name in n.input]


@pytest.mark.parametrize("variant", ["div", "mul", "half_first", "gpt2", "tanh"])
def test_gelu_chain_backward_reads_x_only(variant):
    nodes = chain(variant)
    model = expanded(nodes)
    inner = [o for n in nodes if n.op_type != "Constant" for o in n.output if o != "y"]
    for name in inner:
        # read by the next forward node only: nothing of the backward pass keeps it
        assert len(readers_of(model, name)) == 1, (name, readers_of(model, name))
    core = "Tanh" if variant in ("gpt2", "tanh") else "Erf"
    assert sum(n.op_type == core for n in model.graph.node) == 2  # the forward's, and the slope's
    x, r = inputs()
    want = r * (tanh_slope64(x) if core == "Tanh" else chain_slope64(x, math.sqrt(2.0)))
    np.testing.assert_allclose(run(model, x, r), want, rtol=2e-6, atol=2e-6)
    assert {n.output[0] for n in model.graph.node} >= set(inner)  # the forward nodes are still there


def test_inexact_constant_is_differentiated_node_by_node():
    """x / 1.414 is not GELU: its gradient is its own, not GELU's (they differ by up to 8e-5 here)."""
    model = expanded(chain("div", k=1.414))
    assert len(readers_of(model, "a")) == 2  # Erf, and Erf's gradient
    x, r = inputs()
    got = run(model, x, r)
    want = r * chain_slope64(x, float(np.float32(1.414)))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    assert np.max(np.abs(r * chain_slope64(x, math.sqrt(2.0)) - want)) > 2e-5  # ten times the tolerance


def test_inner_value_read_elsewhere():
    """c also feeds the loss: the chain's gradient still reaches x through both paths."""
    model = expanded(chain("div"), extra_loss="c")
    x, r = inputs()
    x64 = x.astype(np.float64)
    d_c = math.sqrt(2.0 / math.pi) * np.exp(-x64 * x64 / 2.0)  # d/dx (1 + erf(x / sqrt 2))
    np.testing.assert_allclose(run(model, x, r), r * chain_slope64(x, math.sqrt(2.0)) + d_c,
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("cut", ["a", "c"])
def test_cut_chain_keeps_its_cut(cut):
    """An inner value named in zs: the Gradient holds it fixed, so dL/dx = r * c / 2, not GELU's slope."""
    model = expanded(chain("div"), zs=(cut,))
    x, r = inputs()
    c = 1.0 + erf64(x.astype(np.float64) / math.sqrt(2.0))
    np.testing.assert_allclose(run(model, x, r), r * 0.5 * c, rtol=2e-6, atol=2e-6)


def test_differentiated_constant_is_not_folded_into_the_chain():
    """sqrt 2 as a trained initializer: dL/dk is wanted, so the chain is differentiated node by node."""
    model = expanded(chain("div"), wrt_k=True)
    x, r = inputs()
    dx, dk = run(model, x, r, outputs=("dx", "dk"))
    x64, k = x.astype(np.float64), math.sqrt(2.0)
    np.testing.assert_allclose(dx, r * chain_slope64(x, k), rtol=2e-6, atol=2e-6)
    # d/dk [x (1 + erf(x / k)) / 2] = -x^2 exp(-(x / k)^2) / (k^2 sqrt(pi))
    want_dk = np.sum(r * -x64 * x64 * np.exp(-((x64 / k) ** 2)) / (k * k * math.sqrt(math.pi)))
    np.testing.assert_allclose(dk, want_dk, rtol=1e-5)
