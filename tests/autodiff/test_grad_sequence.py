"""Gradient rules of sequence and optional ops (onnxtrain/autodiff/rules/sequence.py).

Each check builds a small graph around one node named "op" (the op under
test), reads tensors back out of the sequence or optional it makes or
consumes, takes loss = sum_k sum(R_k * out_k) with random R_k, and compares
<Gradient(loss), d> with float64 central differences along random directions
d, on onnxruntime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import expand_gradients
from onnxtrain.autodiff.registry import REGISTRY
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.errors import TrainingModelError
from onnxtrain.runtime.executor import Executor

OPSET = 18


def _model(nodes, feeds, outputs, opset, shapes=None):
    shapes = shapes or {}
    graph = helper.make_graph(
        list(nodes),
        "seq_check",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
         for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, TensorProto.DOUBLE, shapes.get(o)) for o in outputs],
    )
    m = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    )
    m.ir_version = 8
    return m


def check_graph(
    nodes: Sequence[onnx.NodeProto],
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    wrt: Sequence[str] | None = None,
    opset: int = OPSET,
    eps: float = 1e-6,
    seed: int = 0,
    directions: int = 2,
) -> dict[str, np.ndarray]:
    """Check d loss / d wrt for loss = sum_k sum(R_k * outputs_k) of ``nodes``."""
    rng = np.random.default_rng(seed)
    wrt = list(wrt) if wrt is not None else [k for k, v in inputs.items() if v.dtype == np.float64]
    nodes = list(nodes)
    probe = Executor(_model(nodes, dict(inputs), outputs, opset)).run(dict(inputs), list(outputs))
    weights = {f"R{k}": rng.standard_normal(p.shape) for k, p in enumerate(probe)}
    sums = []
    for k, o in enumerate(outputs):
        nodes.append(helper.make_node("Mul", [o, f"R{k}"], [f"w{k}"]))
        nodes.append(helper.make_node("ReduceSum", [f"w{k}"], [f"s{k}"], keepdims=0))
        sums.append(f"s{k}")
    nodes.append(helper.make_node("Sum", sums, ["loss"]))
    feeds = {**inputs, **weights}
    grads = [f"grad_{x}" for x in wrt]
    gnode = helper.make_node("Gradient", wrt, grads, domain=PREVIEW_DOMAIN, xs=wrt, y="loss", name="G")
    shapes = {"loss": [], **{g: list(inputs[x].shape) for g, x in zip(grads, wrt)}}
    loss_model = _model(nodes, feeds, ["loss"], opset, shapes)
    grad_model = _model(nodes + [gnode], feeds, ["loss"] + grads, opset, shapes)
    available = [i.name for i in grad_model.graph.input]
    expand_gradients(grad_model.graph, grad_model.opset_import, NameGen.from_graph(grad_model.graph), available)
    onnx.checker.check_model(grad_model)
    analytic = Executor(grad_model).run(feeds, grads)
    forward = Executor(loss_model)
    for _ in range(directions):
        d = {x: rng.standard_normal(inputs[x].shape) for x in wrt}
        plus = {**feeds, **{x: inputs[x] + eps * d[x] for x in wrt}}
        minus = {**feeds, **{x: inputs[x] - eps * d[x] for x in wrt}}
        numeric = (forward.run(plus, ["loss"])[0] - forward.run(minus, ["loss"])[0]) / (2 * eps)
        predicted = sum(float(np.sum(g * d[x])) for g, x in zip(analytic, wrt))
        np.testing.assert_allclose(predicted, numeric, rtol=1e-5, atol=1e-7)
    for g, x in zip(analytic, wrt):
        assert g.shape == inputs[x].shape and g.dtype == inputs[x].dtype
    return dict(zip(wrt, analytic))


rng = np.random.default_rng(7)
A = rng.standard_normal((2, 3))
B = rng.standard_normal((4, 3))
C = rng.standard_normal((1, 3))


def n(op, ins, outs, name=None, **attrs):
    return helper.make_node(op, ins, outs, name=name or f"{op}_{outs[0]}", **attrs)


def i64(v):
    return np.array(v, dtype=np.int64)


def const(name, value):
    return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(value, name))


def construct(name="S", op=False):
    return n("SequenceConstruct", ["a", "b", "c"], [name], name="op" if op else None)


def at(seq, pos, out):
    return [const(f"{out}_pos", i64(pos)), n("SequenceAt", [seq, f"{out}_pos"], [out])]


ABC = {"a": A, "b": B, "c": C}


# ------------------------------------------------------------------ cases
def test_sequence_construct():
    nodes = [construct(op=True), *at("S", 0, "y0"), *at("S", 2, "y2"), *at("S", -3, "y3")]
    g = check_graph(nodes, ABC, ["y0", "y2", "y3"])
    assert not g["b"].any()  # b is never read back


def test_sequence_at_sums_positions():
    nodes = [construct(), const("p", i64(-2)), n("SequenceAt", ["S", "p"], ["y"], name="op"),
             *at("S", 1, "z"), *at("S", 0, "w")]
    check_graph(nodes, ABC, ["y", "z", "w"])


@pytest.mark.parametrize("pos", [None, 0, 1, -1, 3])
def test_sequence_insert(pos):
    t = rng.standard_normal((5, 3))
    ins = ["S", "t"] + ([] if pos is None else ["p"])
    nodes = [construct(), *([] if pos is None else [const("p", i64(pos))]),
             n("SequenceInsert", ins, ["S2"], name="op"),
             n("ConcatFromSequence", ["S2"], ["y"], axis=0), *at("S2", 1, "z")]
    check_graph(nodes, {**ABC, "t": t}, ["y", "z"])


@pytest.mark.parametrize("pos", [None, 0, 1, -1, -3])
def test_sequence_erase(pos):
    ins = ["S"] + ([] if pos is None else ["p"])
    nodes = [construct(), *([] if pos is None else [const("p", i64(pos))]),
             n("SequenceErase", ins, ["S2"], name="op"),
             n("ConcatFromSequence", ["S2"], ["y"], axis=0), *at("S", 0, "z")]
    check_graph(nodes, ABC, ["y", "z"])


@pytest.mark.parametrize("axis", [0, -2])
def test_concat_from_sequence(axis):
    nodes = [construct(), n("ConcatFromSequence", ["S"], ["y"], name="op", axis=axis),
             *at("S", 1, "z")]
    check_graph(nodes, ABC, ["y", "z"])


@pytest.mark.parametrize("axis", [0, 2, -1])
def test_concat_from_sequence_new_axis(axis):
    x = {"a": rng.standard_normal((2, 3)), "b": rng.standard_normal((2, 3)), "c": rng.standard_normal((2, 3))}
    nodes = [construct(), n("ConcatFromSequence", ["S"], ["y"], name="op", axis=axis, new_axis=1)]
    check_graph(nodes, x, ["y"])


@pytest.mark.parametrize(
    "split, attrs",
    [(None, {}), (None, {"keepdims": 0}), (None, {"axis": 1}), (i64(2), {"axis": 0}),
     (i64([1, 3, 1]), {"axis": 0}), (i64([2, 1]), {"axis": -1})],
)
def test_split_to_sequence(split, attrs):
    x = rng.standard_normal((5, 3))
    ins = ["x"] + ([] if split is None else ["split"])
    nodes = [*([] if split is None else [const("split", split)]),
             n("SplitToSequence", ins, ["S"], name="op", **attrs),
             *at("S", 0, "y0"), *at("S", -1, "y1"), n("SequenceLength", ["S"], ["len"])]
    check_graph(nodes, {"x": x}, ["y0", "y1"])


def test_split_then_concat_round_trip():
    x = rng.standard_normal((4, 3))
    nodes = [n("SplitToSequence", ["x"], ["S"], name="op", axis=1),
             n("ConcatFromSequence", ["S"], ["y"], axis=0), *at("S", 2, "z")]
    check_graph(nodes, {"x": x}, ["y", "z"])


def test_optional():
    nodes = [n("Optional", ["a"], ["o"], name="op"), n("OptionalGetElement", ["o"], ["y"]),
             n("OptionalHasElement", ["o"], ["has"]), n("Mul", ["y", "a"], ["z"])]
    check_graph(nodes, {"a": A}, ["y", "z"])


def test_optional_get_element_read_twice():
    nodes = [n("Optional", ["a"], ["o"]), n("OptionalGetElement", ["o"], ["y"], name="op"),
             n("OptionalGetElement", ["o"], ["y2"]), n("Sin", ["y2"], ["z"])]
    check_graph(nodes, {"a": A}, ["y", "z"])


def test_optional_get_element_of_tensor():
    nodes = [n("OptionalGetElement", ["a"], ["y"], name="op"), n("Sin", ["y"], ["z"])]
    check_graph(nodes, {"a": A}, ["y", "z"])


def test_sequence_gradients_need_opset_17():
    nodes = [construct(), const("p", i64(0)), n("SequenceAt", ["S", "p"], ["y"], name="op")]
    with pytest.raises(TrainingModelError, match="SequenceMap"):
        check_graph(nodes, ABC, ["y"], opset=16)


def test_registrations():
    for op in ("SequenceLength", "SequenceEmpty", "OptionalHasElement"):
        assert REGISTRY.get("", op).kind == "zero"
    for op in ("SequenceConstruct", "SequenceAt", "SequenceInsert", "SequenceErase",
               "ConcatFromSequence", "SplitToSequence", "Optional", "OptionalGetElement"):
        assert REGISTRY.get("", op).kind == "vjp"


@pytest.mark.xfail(strict=True, raises=TrainingModelError,
                   reason="SequenceMap's body is inlined (a Loop over the sequence), but the Loop "
                   "rule cannot yet carry a sequence-typed loop state")
def test_sequence_map_through_its_function_body():
    """SequenceMap has no rule: its ONNX function body (a Loop over the
    sequence) is inlined and differentiated with the Loop and sequence rules."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["e", "e"], ["sq"]), helper.make_node("Mul", ["sq", "w"], ["out"])],
        "square_times_w",
        [helper.make_tensor_value_info("e", TensorProto.DOUBLE, None)],
        [helper.make_tensor_value_info("out", TensorProto.DOUBLE, None)],
    )
    x = {**ABC, "w": rng.standard_normal(())}
    nodes = [construct(), n("SequenceMap", ["S"], ["M"], name="op", body=body),
             n("ConcatFromSequence", ["M"], ["y"], axis=0)]
    assert REGISTRY.get("", "SequenceMap") is None  # the body is the rule
    check_graph(nodes, x, ["y"])
