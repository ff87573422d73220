"""The gradient-check harness: one op, float64 central differences along random
directions, executed through onnxtrain's Gradient expansion on onnxruntime."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxtrain.autodiff import expand_gradients
from onnxtrain.executor import Executor
from onnxtrain.graph import PREVIEW_DOMAIN
from onnxtrain.names import NameGen


def _vi(name: str, arr: np.ndarray, symbolic: bool) -> onnx.ValueInfoProto:
    et = helper.np_dtype_to_tensor_dtype(arr.dtype)
    if symbolic:
        shape = [f"{name}_d{i}" for i in range(arr.ndim)]
    else:
        shape = list(arr.shape)
    return helper.make_tensor_value_info(name, et, shape)


def _model(nodes, feeds, outputs, opset, out_types=None, out_shapes=None):
    out_types = out_types or {}
    out_shapes = out_shapes or {}
    graph = helper.make_graph(
        nodes,
        "check",
        [_vi(k, v, False) for k, v in feeds.items()],
        [
            helper.make_tensor_value_info(o, out_types.get(o, TensorProto.DOUBLE), out_shapes.get(o))
            for o in outputs
        ],
    )
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    m = helper.make_model(graph, opset_imports=imports)
    m.ir_version = 8
    return m


def check_vjp(
    op_type: str,
    inputs: Mapping[str, np.ndarray],
    attrs: Mapping[str, Any] | None = None,
    *,
    wrt: Sequence[str] | None = None,
    n_outputs: int = 1,
    diff_outputs: Sequence[int] | None = None,
    opset: int = 17,
    symbolic: bool = False,
    extra_nodes: Sequence[onnx.NodeProto] = (),
    node_inputs: Sequence[str] | None = None,
    eps: float = 1e-6,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    seed: int = 0,
    directions: int = 2,
) -> dict[str, np.ndarray]:
    """Check the gradient rule of ``op_type`` at ``inputs``.

    Builds ``outs = op(inputs)``, ``loss = sum_k sum(R_k * outs_k)`` with random
    R_k, takes ``Gradient(xs=wrt, y=loss)`` through onnxtrain, and compares
    ``<grad, d>`` with ``(L(x + eps d) - L(x - eps d)) / (2 eps)`` in float64
    for random directions d.  Inputs named in ``wrt`` must be float64 for the
    finite differences; other inputs (indices, shapes) may be anything.

    ``node_inputs`` gives the node's input list when it differs from the keys
    of ``inputs`` (use '' for a skipped optional input).  ``extra_nodes`` run
    before the op (e.g. Constants).  Returns the analytic gradients."""
    rng = np.random.default_rng(seed)
    attrs = dict(attrs or {})
    wrt = list(wrt) if wrt is not None else [k for k, v in inputs.items() if v.dtype == np.float64]
    outs = [f"out{i}" for i in range(n_outputs)]
    diff_outputs = list(range(n_outputs)) if diff_outputs is None else list(diff_outputs)
    op_node = helper.make_node(
        op_type, list(node_inputs) if node_inputs is not None else list(inputs), outs, name="op", **attrs
    )
    nodes = list(extra_nodes) + [op_node]
    # loss = sum_k ReduceSum(out_k * R_k); R_k are inputs so their shape is free.
    probe = Executor(_model(nodes, dict(inputs), outs, opset)).run(dict(inputs), outs)
    weights = {f"R{k}": rng.standard_normal(probe[k].shape).astype(probe[k].dtype) for k in diff_outputs}
    terms = []
    for k in diff_outputs:
        nodes.append(helper.make_node("Mul", [outs[k], f"R{k}"], [f"w{k}"]))
        terms.append(f"w{k}")
    sums = []
    for t in terms:
        nodes.append(helper.make_node("ReduceSum", [t], [t + "_sum"], keepdims=0))
        sums.append(t + "_sum")
    nodes.append(helper.make_node("Sum", sums, ["loss"]))
    feeds = {**inputs, **weights}
    grads = [f"grad_{x}" for x in wrt]
    gnode = helper.make_node(
        "Gradient", list(wrt), grads, domain=PREVIEW_DOMAIN, xs=list(wrt), y="loss", name="G"
    )
    types = {"loss": helper.np_dtype_to_tensor_dtype(probe[diff_outputs[0]].dtype)}
    types.update({g: helper.np_dtype_to_tensor_dtype(inputs[x].dtype) for g, x in zip(grads, wrt)})
    shapes = {"loss": []}
    shapes.update({g: list(inputs[x].shape) for g, x in zip(grads, wrt)})
    loss_model = _model(nodes, feeds, ["loss"], opset, types, shapes)
    grad_model = _model(nodes + [gnode], feeds, ["loss"] + grads, opset, types, shapes)
    if symbolic:
        for m in (grad_model,):
            for vi in m.graph.input:
                if vi.name in inputs:
                    arr = inputs[vi.name]
                    vi.CopyFrom(_vi(vi.name, arr, True))
    available = [i.name for i in grad_model.graph.input]
    expand_gradients(grad_model.graph, grad_model.opset_import, NameGen(_all_names(grad_model)), available)
    onnx.checker.check_model(grad_model)
    analytic = Executor(grad_model).run(feeds, grads)
    forward = Executor(loss_model)
    for _ in range(directions):
        d = {x: rng.standard_normal(inputs[x].shape) for x in wrt}
        plus = dict(feeds)
        minus = dict(feeds)
        for x in wrt:
            plus[x] = inputs[x] + eps * d[x]
            minus[x] = inputs[x] - eps * d[x]
        numeric = (forward.run(plus, ["loss"])[0] - forward.run(minus, ["loss"])[0]) / (2 * eps)
        predicted = sum(float(np.sum(g * d[x])) for g, x in zip(analytic, wrt))
        np.testing.assert_allclose(
            predicted, numeric, rtol=rtol, atol=atol, err_msg=f"{op_type} directional derivative"
        )
    for g, x in zip(analytic, wrt):
        assert g.shape == inputs[x].shape, f"grad of {x}: shape {g.shape} != {inputs[x].shape}"
        assert g.dtype == inputs[x].dtype, f"grad of {x}: dtype {g.dtype} != {inputs[x].dtype}"
    return dict(zip(wrt, analytic))


def _all_names(model: onnx.ModelProto) -> set[str]:
    names = {i.name for i in model.graph.input} | {o.name for o in model.graph.output}
    for n in model.graph.node:
        names.update(n.input)
        names.update(n.output)
    return names
