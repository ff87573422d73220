"""A float32 gradient check, for ops that onnxruntime runs only in float32
(Conv, ConvTranspose, AveragePool, InstanceNormalization, LRN, ...) and for
checking the dtype and shape of float32 gradients of every op.

The analytic gradient is computed in float32 by onnxtrain's expansion on
onnxruntime.  The finite-difference oracle is either

* ``oracle="ort"``: the float32 loss on onnxruntime with a large step
  (``eps=1``).  Exact up to rounding for ops that are linear or bilinear in
  the checked inputs (the loss is then quadratic along the direction, where
  central differences have no truncation error);
* ``oracle="ort64"``: the float64 loss on onnxruntime with a small step, for
  nonlinear ops that onnxruntime also runs in float64;
* ``oracle="reference"``: the float64 loss on ``onnx.reference``, the ONNX
  reference implementation, with a small step; for nonlinear ops that
  onnxruntime runs only in float32.  (It does not implement the 2-D coercion
  of Softmax-family ops before opset 13: use "ort64" there.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.autodiff import expand_gradients
from onnxtrain.executor import Executor
from onnxtrain.graph import PREVIEW_DOMAIN
from onnxtrain.names import NameGen


def _value_info(name: str, arr: np.ndarray, symbolic: bool) -> onnx.ValueInfoProto:
    shape = [f"{name}_s{i}" for i in range(arr.ndim)] if symbolic else list(arr.shape)
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), shape)


def _build(nodes, feeds, outputs, out_types, opset, out_shapes=None, symbolic=False, symbolic_names=()):
    out_shapes = out_shapes or {}
    inputs = [_value_info(k, v, symbolic and k in symbolic_names) for k, v in feeds.items()]
    graph = helper.make_graph(
        list(nodes),
        "check32",
        inputs,
        [helper.make_tensor_value_info(o, out_types[o], out_shapes.get(o)) for o in outputs],
    )
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 8
    return model


def _match_weight_dims(model: onnx.ModelProto, diff_outputs: Sequence[int], ranks) -> None:
    """Give out_k dims (inferred ones, else fresh symbols) in value_info and the
    weight R_k the same dims, so that the loss's Mul sees equal shapes on both
    sides however little shape inference knows about out_k."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.node.pop()  # the Gradient node
    inferred = onnx.shape_inference.infer_shapes(probe)
    found = {vi.name: vi for vi in inferred.graph.value_info}
    weights = {vi.name: vi for vi in model.graph.input}
    for k in diff_outputs:
        dims: list = [f"out{k}_s{i}" for i in range(ranks[k])]
        out = found.get(f"out{k}")
        if out is not None and out.type.tensor_type.HasField("shape"):
            odims = out.type.tensor_type.shape.dim
            if len(odims) == ranks[k]:
                for i, od in enumerate(odims):
                    if od.HasField("dim_value"):
                        dims[i] = od.dim_value
                    elif od.HasField("dim_param") and od.dim_param:
                        dims[i] = od.dim_param
        r = weights[f"R{k}"]
        et = r.type.tensor_type.elem_type
        r.CopyFrom(helper.make_tensor_value_info(r.name, et, dims))
        model.graph.value_info.append(helper.make_tensor_value_info(f"out{k}", et, dims))


def _run_op(node: onnx.NodeProto, feeds: Mapping[str, np.ndarray], outs: list[str], opset: int):
    """Run the op alone (output types from shape inference)."""
    model = _build([node], feeds, [], {}, opset)
    inferred = onnx.shape_inference.infer_shapes(model)
    found = {vi.name: vi for vi in inferred.graph.value_info}
    for o in outs:
        # ops without shape inference (some function ops): assume float32
        et = found[o].type.tensor_type.elem_type if o in found else TensorProto.FLOAT
        model.graph.output.append(helper.make_tensor_value_info(o, et, None))
    return Executor(model).run(dict(feeds), outs)


def _names(model: onnx.ModelProto) -> set[str]:
    used = {i.name for i in model.graph.input} | {o.name for o in model.graph.output}
    for n in model.graph.node:
        used.update(n.input)
        used.update(n.output)
    return used


def check_vjp_f32(
    op_type: str,
    inputs: Mapping[str, np.ndarray],
    attrs: Mapping[str, Any] | None = None,
    *,
    wrt: Sequence[str] | None = None,
    n_outputs: int = 1,
    diff_outputs: Sequence[int] | None = None,
    opset: int = 17,
    symbolic: bool = False,
    node_inputs: Sequence[str] | None = None,
    oracle: str = "ort",
    eps: float | None = None,
    rtol: float = 1e-4,
    seed: int = 0,
    directions: int = 2,
    checker: bool = True,
) -> dict[str, np.ndarray]:
    """Check ``op_type``'s gradient rule in float32 (see the module docstring).

    ``inputs`` may be given in float64: floating inputs are cast to float32
    for the analytic run.  Returns the float32 gradients after checking that
    they are float32 and shaped like their inputs.  ``checker=False`` skips
    ``onnx.checker`` on the expanded model (for ops it deems deprecated)."""
    rng = np.random.default_rng(seed)
    attrs = dict(attrs or {})
    x64 = {k: np.asarray(v) for k, v in inputs.items()}
    x32 = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in x64.items()}
    wrt = list(wrt) if wrt is not None else [k for k, v in x32.items() if v.dtype == np.float32]
    outs = [f"out{i}" for i in range(n_outputs)]
    diff_outputs = list(range(n_outputs)) if diff_outputs is None else list(diff_outputs)
    node_ins = list(node_inputs) if node_inputs is not None else list(inputs)
    op_node = helper.make_node(op_type, node_ins, outs, name="op", **attrs)

    def loss_nodes(weights: Mapping[str, np.ndarray]) -> list[onnx.NodeProto]:
        nodes = [op_node]
        sums = []
        for k in diff_outputs:
            nodes.append(helper.make_node("Mul", [outs[k], f"R{k}"], [f"w{k}"]))
            nodes.append(helper.make_node("ReduceSum", [f"w{k}"], [f"s{k}"], keepdims=0))
            sums.append(f"s{k}")
        nodes.append(helper.make_node("Sum", sums, ["loss"]))
        return nodes

    probe = _run_op(op_node, x32, outs, opset)
    r64 = {f"R{k}": rng.standard_normal(probe[k].shape) for k in diff_outputs}
    r32 = {k: v.astype(np.float32) for k, v in r64.items()}

    grads = [f"grad_{x}" for x in wrt]
    gnode = helper.make_node(
        "Gradient", list(wrt), grads, domain=PREVIEW_DOMAIN, xs=list(wrt), y="loss", name="G"
    )
    feeds32 = {**x32, **r32}
    types = {"loss": TensorProto.FLOAT, **{g: TensorProto.FLOAT for g in grads}}
    shapes = {"loss": [], **{g: list(x32[x].shape) for g, x in zip(grads, wrt)}}
    model = _build(
        loss_nodes(r32) + [gnode], feeds32, ["loss"] + grads, types, opset, shapes, symbolic, set(inputs)
    )
    if symbolic:
        _match_weight_dims(model, diff_outputs, [p.ndim for p in probe])
    available = [i.name for i in model.graph.input]
    expand_gradients(model.graph, model.opset_import, NameGen(_names(model)), available)
    if checker:
        onnx.checker.check_model(model)
    analytic = Executor(model).run(feeds32, grads)
    for g, x in zip(analytic, wrt):
        assert g.dtype == np.float32, f"grad of {x}: dtype {g.dtype} != float32"
        assert g.shape == x32[x].shape, f"grad of {x}: shape {g.shape} != {x32[x].shape}"

    if oracle == "ort":
        step = 1.0 if eps is None else eps
        fwd = Executor(
            _build(loss_nodes(r32), feeds32, ["loss"], {"loss": TensorProto.FLOAT}, opset, {"loss": []})
        )
        base, dt = feeds32, np.float32

        def loss_at(feeds):
            return float(fwd.run(feeds, ["loss"])[0])
    elif oracle == "ort64":
        step = 1e-6 if eps is None else eps
        fwd64 = Executor(
            _build(
                loss_nodes(r64), {**x64, **r64}, ["loss"], {"loss": TensorProto.DOUBLE}, opset, {"loss": []}
            )
        )
        base, dt = {**x64, **r64}, np.float64

        def loss_at(feeds):
            return float(fwd64.run(feeds, ["loss"])[0])
    elif oracle == "reference":
        step = 1e-6 if eps is None else eps
        ref = ReferenceEvaluator(
            _build(
                loss_nodes(r64), {**x64, **r64}, ["loss"], {"loss": TensorProto.DOUBLE}, opset, {"loss": []}
            )
        )
        base, dt = {**x64, **r64}, np.float64

        def loss_at(feeds):
            return float(ref.run(["loss"], feeds)[0])
    else:
        raise ValueError(f"unknown oracle {oracle!r}")

    for _ in range(directions):
        d = {x: np.asarray(rng.standard_normal(x32[x].shape)) for x in wrt}
        plus, minus = dict(base), dict(base)
        for x in wrt:
            plus[x] = np.asarray(base[x] + step * d[x], dtype=dt)
            minus[x] = np.asarray(base[x] - step * d[x], dtype=dt)
            if oracle == "ort":  # the step actually taken, after rounding
                d[x] = (plus[x].astype(np.float64) - minus[x]) / (2 * step)
        numeric = (loss_at(plus) - loss_at(minus)) / (2 * step)
        terms = [g.astype(np.float64) * d[x] for g, x in zip(analytic, wrt)]
        predicted = sum(float(np.sum(t)) for t in terms)
        scale = sum(float(np.sum(np.abs(t))) for t in terms) + 1e-30
        assert abs(predicted - numeric) <= rtol * scale, (
            f"{op_type} float32 directional derivative: analytic {predicted!r}, "
            f"numeric {numeric!r} (scale {scale:.3g})"
        )
    return dict(zip(wrt, analytic))
