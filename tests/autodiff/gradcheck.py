"""The gradient-check harness: one op, its gradient taken through onnxtrain's
Gradient expansion on onnxruntime, compared with central differences of the
loss along random directions.

The loss is ``L = sum_k sum(R_k * out_k)`` with random weights R_k, so the
directional derivative along d is ``<dL/dx, d>`` and its central difference is
``(L(x + eps d) - L(x - eps d)) / (2 eps)``.  ``oracle`` says where the
analytic gradient runs and how the finite difference is taken:

* ``"fd64"`` (default): the analytic gradient in the inputs' own dtype
  (float64 for the checked inputs), the loss in float64 on the same runtime
  with a small step; compared with ``rtol``/``atol``.
* ``"ort"``, ``"ort64"``, ``"reference"``: for ops that onnxruntime runs only
  in float32 (Conv, ConvTranspose, AveragePool, InstanceNormalization, LRN,
  ...) and to check the dtype and shape of float32 gradients.  Floating inputs
  are cast to float32 for the analytic run; the oracle is

  - ``"ort"``: the float32 loss on onnxruntime with a large step (``eps=1``).
    Exact up to rounding for ops that are linear or bilinear in the checked
    inputs (the loss is then quadratic along the direction, where central
    differences have no truncation error);
  - ``"ort64"``: the float64 loss on onnxruntime with a small step, for
    nonlinear ops that onnxruntime also runs in float64;
  - ``"reference"``: the float64 loss on ``onnx.reference``, the ONNX
    reference implementation, with a small step, for nonlinear ops that
    onnxruntime runs only in float32.  (It does not implement the 2-D
    coercion of Softmax-family ops before opset 13: use "ort64" there.)

  The float32 check passes when ``|analytic - numeric| <= rtol * scale`` with
  ``scale = sum |g * d|``.

``check_vjp_f32`` is ``check_vjp`` with ``oracle="ort"`` by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.autodiff import expand_gradients
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.runtime.executor import Executor

FLOAT32_ORACLES = ("ort", "ort64", "reference")


def value_info(name: str, arr: np.ndarray, symbolic: bool) -> onnx.ValueInfoProto:
    """A graph input for ``arr``: its dims, or fresh symbols when ``symbolic``."""
    shape = [f"{name}_s{i}" for i in range(arr.ndim)] if symbolic else list(arr.shape)
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), shape)


def make_model(
    nodes: Iterable[onnx.NodeProto],
    feeds: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    opset: int,
    out_types: Mapping[str, int] | None = None,
    out_shapes: Mapping[str, Any] | None = None,
    symbolic: Iterable[str] = (),
) -> onnx.ModelProto:
    """A model over ``nodes`` with ``feeds`` as inputs (those named in
    ``symbolic`` with symbolic dims); outputs are DOUBLE unless ``out_types``
    says otherwise."""
    out_types = out_types or {}
    out_shapes = out_shapes or {}
    symbolic = set(symbolic)
    graph = helper.make_graph(
        list(nodes),
        "check",
        [value_info(k, v, k in symbolic) for k, v in feeds.items()],
        [
            helper.make_tensor_value_info(o, out_types.get(o, TensorProto.DOUBLE), out_shapes.get(o))
            for o in outputs
        ],
    )
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 8
    return model


def expand(model: onnx.ModelProto, checker: bool = True) -> onnx.ModelProto:
    """Expand the model's Gradient node in place (then run onnx.checker)."""
    available = [i.name for i in model.graph.input]
    expand_gradients(model.graph, model.opset_import, NameGen.from_graph(model.graph), available)
    if checker:
        onnx.checker.check_model(model)
    return model


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
    oracle: str = "fd64",
    eps: float | None = None,
    rtol: float | None = None,
    atol: float = 1e-7,
    seed: int = 0,
    directions: int = 2,
    checker: bool = True,
) -> dict[str, np.ndarray]:
    """Check the gradient rule of ``op_type`` at ``inputs`` (see the module docstring).

    ``wrt`` defaults to the float64 inputs ("fd64") or every floating input
    (float32 oracles).  ``node_inputs`` gives the node's input list when it
    differs from the keys of ``inputs`` (use '' for a skipped optional input).
    ``extra_nodes`` run before the op (e.g. Constants).  ``checker=False``
    skips ``onnx.checker`` on the expanded model (for ops it deems
    deprecated).  Returns the analytic gradients, after checking that each has
    its input's shape and dtype (float32 for the float32 oracles)."""
    if oracle != "fd64" and oracle not in FLOAT32_ORACLES:
        raise ValueError(f"unknown oracle {oracle!r}")
    outs = [f"out{i}" for i in range(n_outputs)]
    diff_outputs = list(range(n_outputs)) if diff_outputs is None else list(diff_outputs)
    op_node = helper.make_node(
        op_type, list(node_inputs) if node_inputs is not None else list(inputs), outs, name="op",
        **dict(attrs or {}),
    )
    forward = [*extra_nodes, op_node]
    args = (op_type, inputs, forward, outs, diff_outputs, wrt, opset, symbolic, seed, directions)
    if oracle == "fd64":
        return _check_fd64(*args, 1e-6 if eps is None else eps,
                           1e-5 if rtol is None else rtol, atol, checker)
    return _check_f32(*args, oracle, eps, 1e-4 if rtol is None else rtol, checker)


def check_vjp_f32(*args, oracle: str = "ort", **kwargs) -> dict[str, np.ndarray]:
    """``check_vjp`` with a float32 oracle, ``"ort"`` unless told otherwise."""
    if oracle not in FLOAT32_ORACLES:
        raise ValueError(f"check_vjp_f32 takes a float32 oracle {FLOAT32_ORACLES}, not {oracle!r}")
    return check_vjp(*args, oracle=oracle, **kwargs)


def _loss_nodes(forward, outs, diff_outputs) -> list[onnx.NodeProto]:
    """``forward`` then loss = sum_k ReduceSum(out_k * R_k); the R_k are inputs."""
    nodes = list(forward)
    sums = []
    for k in diff_outputs:
        nodes.append(helper.make_node("Mul", [outs[k], f"R{k}"], [f"w{k}"]))
        nodes.append(helper.make_node("ReduceSum", [f"w{k}"], [f"w{k}_sum"], keepdims=0))
        sums.append(f"w{k}_sum")
    nodes.append(helper.make_node("Sum", sums, ["loss"]))
    return nodes


def _gradient_node(wrt: Sequence[str]) -> tuple[onnx.NodeProto, list[str]]:
    grads = [f"grad_{x}" for x in wrt]
    node = helper.make_node(
        "Gradient", list(wrt), grads, domain=PREVIEW_DOMAIN, xs=list(wrt), y="loss", name="G"
    )
    return node, grads


def _check_fd64(op_type, inputs, forward, outs, diff_outputs, wrt, opset, symbolic, seed,
                directions, eps, rtol, atol, checker) -> dict[str, np.ndarray]:
    """The analytic gradient in the inputs' dtype against float64 central differences."""
    rng = np.random.default_rng(seed)
    wrt = list(wrt) if wrt is not None else [k for k, v in inputs.items() if v.dtype == np.float64]
    probe = Executor(make_model(forward, dict(inputs), outs, opset)).run(dict(inputs), outs)
    weights = {f"R{k}": rng.standard_normal(probe[k].shape).astype(probe[k].dtype) for k in diff_outputs}
    nodes = _loss_nodes(forward, outs, diff_outputs)
    feeds = {**inputs, **weights}
    gnode, grads = _gradient_node(wrt)
    types = {"loss": helper.np_dtype_to_tensor_dtype(probe[diff_outputs[0]].dtype)}
    types.update({g: helper.np_dtype_to_tensor_dtype(inputs[x].dtype) for g, x in zip(grads, wrt)})
    shapes = {"loss": [], **{g: list(inputs[x].shape) for g, x in zip(grads, wrt)}}
    loss_model = make_model(nodes, feeds, ["loss"], opset, types, shapes)
    grad_model = make_model(
        nodes + [gnode], feeds, ["loss"] + grads, opset, types, shapes, set(inputs) if symbolic else ()
    )
    analytic = Executor(expand(grad_model, checker)).run(feeds, grads)
    run_loss = Executor(loss_model)
    for _ in range(directions):
        d = {x: rng.standard_normal(inputs[x].shape) for x in wrt}
        plus = dict(feeds)
        minus = dict(feeds)
        for x in wrt:
            plus[x] = inputs[x] + eps * d[x]
            minus[x] = inputs[x] - eps * d[x]
        numeric = (run_loss.run(plus, ["loss"])[0] - run_loss.run(minus, ["loss"])[0]) / (2 * eps)
        predicted = sum(float(np.sum(g * d[x])) for g, x in zip(analytic, wrt))
        np.testing.assert_allclose(
            predicted, numeric, rtol=rtol, atol=atol, err_msg=f"{op_type} directional derivative"
        )
    for g, x in zip(analytic, wrt):
        assert g.shape == inputs[x].shape, f"grad of {x}: shape {g.shape} != {inputs[x].shape}"
        assert g.dtype == inputs[x].dtype, f"grad of {x}: dtype {g.dtype} != {inputs[x].dtype}"
    return dict(zip(wrt, analytic))


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


def _run_forward(forward, feeds: Mapping[str, np.ndarray], outs: list[str], opset: int):
    """Run the op alone (output types from shape inference)."""
    model = make_model(forward, feeds, [], opset)
    inferred = onnx.shape_inference.infer_shapes(model)
    found = {vi.name: vi for vi in inferred.graph.value_info}
    for o in outs:
        # ops without shape inference (some function ops): assume float32
        et = found[o].type.tensor_type.elem_type if o in found else TensorProto.FLOAT
        model.graph.output.append(helper.make_tensor_value_info(o, et, None))
    return Executor(model).run(dict(feeds), outs)


def _check_f32(op_type, inputs, forward, outs, diff_outputs, wrt, opset, symbolic, seed,
               directions, oracle, eps, rtol, checker) -> dict[str, np.ndarray]:
    """The analytic gradient in float32 against a float32 or float64 oracle."""
    rng = np.random.default_rng(seed)
    x64 = {k: np.asarray(v) for k, v in inputs.items()}
    x32 = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in x64.items()}
    wrt = list(wrt) if wrt is not None else [k for k, v in x32.items() if v.dtype == np.float32]
    probe = _run_forward(forward, x32, outs, opset)
    r64 = {f"R{k}": rng.standard_normal(probe[k].shape) for k in diff_outputs}
    r32 = {k: v.astype(np.float32) for k, v in r64.items()}
    nodes = _loss_nodes(forward, outs, diff_outputs)

    gnode, grads = _gradient_node(wrt)
    feeds32 = {**x32, **r32}
    types = {"loss": TensorProto.FLOAT, **{g: TensorProto.FLOAT for g in grads}}
    shapes = {"loss": [], **{g: list(x32[x].shape) for g, x in zip(grads, wrt)}}
    model = make_model(
        nodes + [gnode], feeds32, ["loss"] + grads, opset, types, shapes, set(inputs) if symbolic else ()
    )
    if symbolic:
        _match_weight_dims(model, diff_outputs, [p.ndim for p in probe])
    analytic = Executor(expand(model, checker)).run(feeds32, grads)
    for g, x in zip(analytic, wrt):
        assert g.dtype == np.float32, f"grad of {x}: dtype {g.dtype} != float32"
        assert g.shape == x32[x].shape, f"grad of {x}: shape {g.shape} != {x32[x].shape}"

    loss_type = {"loss": TensorProto.FLOAT if oracle == "ort" else TensorProto.DOUBLE}
    base = feeds32 if oracle == "ort" else {**x64, **r64}
    dt = np.float32 if oracle == "ort" else np.float64
    step = (1.0 if oracle == "ort" else 1e-6) if eps is None else eps
    loss_model = make_model(nodes, base, ["loss"], opset, loss_type, {"loss": []})
    if oracle == "reference":
        ref = ReferenceEvaluator(loss_model)

        def loss_at(feeds):
            return float(ref.run(["loss"], feeds)[0])
    else:
        run_loss = Executor(loss_model)

        def loss_at(feeds):
            return float(run_loss.run(feeds, ["loss"])[0])

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
