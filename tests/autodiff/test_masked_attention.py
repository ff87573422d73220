"""Masked attention is NaN-safe: values a mask replaces get exactly zero gradient.

A causal mask over a left-padded row leaves query rows that see no key.  With
an additive -inf mask their softmax row is NaN, which exporters replace by
zeros (TorchScript: ``Where(IsNaN(p), 0, p)``; opset-23 ``Attention``'s body:
``Where(row all masked, 0, p)``).  The gradients must be finite and equal
PyTorch's, which gives those rows zero gradient.  References:
tests/data/masks/masked_attention.npz, made by
scripts/make_masked_attention_refs.py (PyTorch float64
``scaled_dot_product_attention`` on the same values).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import expand_gradients
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.runtime.executor import Executor

DATA = Path(__file__).resolve().parent.parent / "data" / "masks" / "masked_attention.npz"
REF = np.load(DATA)
CASES = sorted({k.split("/")[0] for k in REF.files})


def case(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    spec = json.loads(str(REF[f"{name}/spec"]))
    return spec, {k.split("/")[1]: REF[k] for k in REF.files if k.startswith(name + "/")}


def attention_nodes(spec: dict, head: int) -> list[onnx.NodeProto]:
    """q, k, v, mask -> out, by the TorchScript exporter's pattern or by Attention."""
    if spec["graph"] == "attention":
        attrs = {"is_causal": 1} if spec["causal"] == "attr" else {}
        return [helper.make_node("Attention", ["q", "k", "v", "mask"], ["out"], **attrs)]
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s0"]),
        helper.make_node("Constant", [], ["scale"], value=numpy_helper.from_array(
            np.array(1 / np.sqrt(head), np.float32))),
        helper.make_node("Mul", ["s0", "scale"], ["s1"]),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0, np.float32))),
    ]
    bias = "mask"
    if spec["mask"] == "bool":  # the exporter turns a boolean mask into an additive one
        nodes += [helper.make_node("Constant", [], ["ninf"], value=numpy_helper.from_array(
                      np.array(-np.inf, np.float32))),
                  helper.make_node("Where", ["mask", "zero", "ninf"], ["bias"])]
        bias = "bias"
    return nodes + [
        helper.make_node("Add", ["s1", bias], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["p_safe"]),
        helper.make_node("MatMul", ["p_safe", "v"], ["out"]),
    ]


def gradients(spec: dict, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """out and d(sum(R * out))/d(q, k, v), computed by onnxtrain on onnxruntime (float32)."""
    feeds = {k: arrays[k] for k in ("q", "k", "v", "mask", "R")}
    nodes = attention_nodes(spec, arrays["q"].shape[-1]) + [
        helper.make_node("Mul", ["out", "R"], ["w"]),
        helper.make_node("ReduceSum", ["w"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["q", "k", "v"], ["dq", "dk", "dv"], domain=PREVIEW_DOMAIN,
                         xs=["q", "k", "v"], y="loss"),
    ]
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "dq", "dk", "dv")]
    model = helper.make_model(helper.make_graph(nodes, "masked", inputs, outputs), opset_imports=[
        helper.make_opsetid("", 23 if spec["graph"] == "attention" else 17),
        helper.make_opsetid(PREVIEW_DOMAIN, 1)])
    model.ir_version = 10
    expand_gradients(model.graph, model.opset_import, NameGen.from_graph(model.graph), list(feeds))
    got = Executor(model).run(feeds, ["out", "dq", "dk", "dv"])
    return dict(zip(("out", "dq", "dk", "dv"), got))


def blind_rows(spec: dict, mask: np.ndarray) -> list[tuple[int, int]]:
    """(batch, query) pairs that see no key."""
    full = np.broadcast_to(mask if mask.dtype == bool else mask == 0, (mask.shape[0], 1, 5, 5))
    if spec["causal"] == "attr":
        full = full & np.tril(np.ones((5, 5), bool))
    return [(b, t) for b in range(full.shape[0]) for t in range(5) if not full[b, 0, t].any()]


@pytest.mark.parametrize("name", CASES)
def test_masked_attention_gradients_equal_pytorch(name):
    spec, arrays = case(name)
    got = gradients(spec, arrays)
    for key in ("dq", "dk", "dv"):
        assert np.isfinite(got[key]).all(), f"{name}: {key} has NaN/inf"
        np.testing.assert_allclose(got[key], arrays[key], rtol=2e-5, atol=2e-6, err_msg=f"{name} {key}")
    np.testing.assert_allclose(got["out"], arrays["out"], rtol=2e-5, atol=2e-6)


def test_reference_cases_cover_the_masks_asked_for():
    """Blind query rows exist exactly in the left-padded causal cases; with a
    -inf or boolean mask they are NaN rows before the Where, and PyTorch and
    onnxtrain give them exactly zero gradient."""
    seen = set()
    for name in CASES:
        spec, arrays = case(name)
        seen.add((spec["graph"], spec["mask"], spec["causal"], spec["pad"]))
        rows = blind_rows(spec, arrays["mask"])
        assert bool(rows) == (spec["pad"] == "left"), name
        if rows and spec["mask"] != "min":  # a finite minimum gives a uniform row instead
            got = gradients(spec, arrays)
            for b, t in rows:
                assert not got["dq"][b, :, t].any() and not arrays["dq"][b, :, t].any()
    graphs = {s[0] for s in seen}
    assert graphs == {"torchscript", "attention"}
    assert {s[1] for s in seen} == {"bool", "neginf", "min"} and {s[3] for s in seen} == {"left", "right"}
    assert ("attention", "bool", "attr", "left") in seen  # is_causal with a padding mask


def test_log_softmax_nan_row_gets_zero_gradient_through_a_cast():
    """LogSoftmax alike, with a Cast between the op and the Where: the all -inf
    row is NaN forward, replaced by 0, and gets exactly zero gradient; the
    other rows get dx = dy - softmax(x) * sum(dy)."""
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    x[1] = -np.inf
    dy = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    nodes = [
        helper.make_node("LogSoftmax", ["x"], ["y"], axis=-1),
        helper.make_node("Cast", ["y"], ["yc"], to=TensorProto.FLOAT),
        helper.make_node("IsNaN", ["yc"], ["nan"]),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0, np.float32))),
        helper.make_node("Where", ["nan", "zero", "yc"], ["ys"]),
        helper.make_node("Mul", ["ys", "R"], ["w"]),
        helper.make_node("ReduceSum", ["w"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["x"], ["dx"], domain=PREVIEW_DOMAIN, xs=["x"], y="loss"),
    ]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 4]) for n in ("x", "R")]
    model = helper.make_model(helper.make_graph(nodes, "ls", vi, [helper.make_tensor_value_info(
        "dx", TensorProto.FLOAT, None)]), opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid(PREVIEW_DOMAIN, 1)])
    model.ir_version = 10
    expand_gradients(model.graph, model.opset_import, NameGen.from_graph(model.graph), ["x", "R"])
    (dx,) = Executor(model).run({"x": x, "R": dy}, ["dx"])
    assert not dx[1].any()
    rows = [0, 2]
    p = np.exp(x[rows] - x[rows].max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(dx[rows], dy[rows] - p * dy[rows].sum(1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_attention_bodies_without_the_masked_row_guard_get_it():
    """onnx < 1.23 writes Attention's body without ``Where(row masked, 0, y)``
    after its Softmax (onnxruntime's kernel outputs zeros there all the same):
    the inliner adds the guard, so the Softmax rule sends no NaN back; a body
    that has it is left as it is."""
    from onnx import helper

    from onnxtrain.autodiff.inline import _guard_masked_rows

    bare = helper.make_function("", "Attention", ["s"], ["o"], [
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("Identity", ["p"], ["o"])], [helper.make_opsetid("", 23)])
    _guard_masked_rows(bare)
    ops = [n.op_type for n in bare.node]
    assert ops == ["Softmax", "IsNaN", "Constant", "CastLike", "Where", "Identity"]
    assert bare.node[4].output[0] == "p" and bare.node[0].output[0] != "p"
    guarded = helper.make_function("", "Attention", ["s", "m"], ["o"], [
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("Cast", ["p"], ["pc"], to=1),
        helper.make_node("Where", ["m", "z", "pc"], ["o"])], [helper.make_opsetid("", 23)])
    before = guarded.SerializeToString()
    _guard_masked_rows(guarded)
    assert guarded.SerializeToString() == before


def _run_body(f: onnx.FunctionProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The body's nodes as a graph, run by onnxruntime."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, feeds[n].shape) for n in f.input]
    model = helper.make_model(
        helper.make_graph(list(f.node), "body", inputs,
                          [helper.make_tensor_value_info(f.output[0], TensorProto.FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    (out,) = Executor(model).run(feeds, [f.output[0]])
    return out


def test_the_added_guard_zeroes_the_masked_row_and_keeps_the_others():
    """Run: a row of scores that is all -inf (softmax NaN) comes out as zeros,
    a finite row as its softmax, bit for bit.

    Bug caught: the guard's ``Where`` operands swapped (``Where(isnan, y, 0)``:
    NaN kept, every finite row zeroed)."""
    from onnxtrain.autodiff.inline import _guard_masked_rows

    body = helper.make_function("", "Attention", ["s"], ["o"], [
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("Identity", ["p"], ["o"])], [helper.make_opsetid("", 23)])
    bare = onnx.FunctionProto()
    bare.CopyFrom(body)
    _guard_masked_rows(body)
    s = np.array([[-np.inf] * 4, [0.5, -1.0, 2.0, 0.0]], np.float32)
    unguarded, guarded = _run_body(bare, {"s": s}), _run_body(body, {"s": s})
    assert np.isnan(unguarded[0]).all()  # the row the guard is for
    np.testing.assert_array_equal(guarded[0], np.zeros(4, np.float32))
    np.testing.assert_array_equal(guarded[1], unguarded[1])
    assert abs(float(guarded[1].sum()) - 1.0) < 1e-6


def _strip_guards(f: onnx.FunctionProto) -> int:
    """Remove each ``Where`` that reads a Softmax result (directly or through
    Cast/Identity), as onnx < 1.23 writes Attention's body; returns how many."""
    producer = {o: n for n in f.node for o in n.output}

    def from_softmax(name: str) -> bool:
        n = producer.get(name)
        while n is not None and n.op_type in ("Cast", "Identity"):
            n = producer.get(n.input[0])
        return n is not None and n.op_type == "Softmax"

    dropped = {n.output[0]: n.input[2] for n in f.node if n.op_type == "Where" and from_softmax(n.input[2])}
    kept = [n for n in f.node if not (n.op_type == "Where" and n.output[0] in dropped)]
    for n in kept:
        n.input[:] = [dropped.get(i, i) for i in n.input]
    del f.node[:]
    f.node.extend(kept)
    return len(dropped)


class _BodyWithoutGuard:
    """onnx's Attention schema, with the body it gives stripped of its guard."""

    def __init__(self, schema) -> None:
        self._schema = schema
        self.stripped = 0

    def __getattr__(self, name):
        return getattr(self._schema, name)

    def get_context_dependent_function_with_opset_version(self, *args):
        f = onnx.FunctionProto()
        f.ParseFromString(self._schema.get_context_dependent_function_with_opset_version(*args))
        self.stripped += _strip_guards(f)
        return f.SerializeToString()


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("att_") and "_left" in n
                                  and "min" not in n])
def test_a_body_without_the_guard_gets_it_and_the_gradients_stay_right(name, monkeypatch):
    """onnx 1.22 writes Attention's body without the guard, 1.23 with it: give
    the inliner a body without it, whatever onnx is installed, and the
    left-padded cases (query rows that see no key) still get finite
    gradients equal to PyTorch's, the guard's Where after the Softmax.

    Bug caught: ``_guard_masked_rows`` not called by ``function_body`` (with
    onnx >= 1.23 every other test passes, the body guards itself)."""
    from onnxtrain.autodiff.inline import function_body

    real = onnx.defs.get_schema
    fakes: list[_BodyWithoutGuard] = []

    def get_schema(op_type, *args, **kwargs):
        schema = real(op_type, *args, **kwargs)
        if op_type != "Attention":
            return schema
        fakes.append(_BodyWithoutGuard(schema))
        return fakes[-1]

    monkeypatch.setattr(onnx.defs, "get_schema", get_schema)
    spec, arrays = case(name)
    types = [helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(arrays[k].dtype), arrays[k].shape)
             for k in ("q", "k", "v", "mask")]
    body = function_body(attention_nodes(spec, arrays["q"].shape[-1])[0], [helper.make_opsetid("", 23)], [],
                         types)
    if tuple(int(p) for p in onnx.__version__.split(".")[:2]) >= (1, 23):
        assert sum(f.stripped for f in fakes) >= 1  # the installed body had a guard, now removed
    producer = {o: n for n in body.node for o in n.output}
    softmax = [n.output[0] for n in body.node if n.op_type == "Softmax"]
    guards = [n for n in body.node if n.op_type == "Where" and n.input[2] in softmax
              and producer[n.input[0]].op_type == "IsNaN"]
    assert len(guards) == len(softmax) == 1, [n.op_type for n in body.node]
    got = gradients(spec, arrays)
    for key in ("dq", "dk", "dv"):
        assert np.isfinite(got[key]).all(), f"{name}: {key} has NaN/inf"
        np.testing.assert_allclose(got[key], arrays[key], rtol=2e-5, atol=2e-6, err_msg=f"{name} {key}")
