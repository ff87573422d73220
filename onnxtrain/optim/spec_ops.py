"""Lower ``ai.onnx.preview.training`` Adam, Momentum and Adagrad to standard ONNX ops.

onnxruntime has no kernels for these ops, so each node is replaced, where it
stands, by default-domain ops (Cast, Greater, Where, Pow, Sqrt and arithmetic,
all valid from opset 9 on) that write the node's own output names.  Each
lowering mirrors the function of the same name in ``reference.py``, line by
line; the pseudo-code of the spec is quoted in the comments.  What is
computed once per node (the rate, Momentum's beta) is written here; each
tensor's update is a call of the update rule of the same math
(``updates``: SpecAdam, AdamStepSize, Momentum, Nesterov, Adagrad, and
WeightDecay for ``norm_coefficient``), which the fused kernels replace by name.

The attributes are Python values, folded into Constants of X's element type.
T is a runtime tensor, so ``T > 0 ? a : b`` becomes ``Where(Greater(T, 0), a, b)``;
both branches are computed, and at T = 0 the unused Adam branch divides 0 by
0: Where discards that NaN.

>>> from onnx import TensorProto, helper
>>> from onnxtrain.core.names import NameGen
>>> from onnxtrain.core.graph import PREVIEW_DOMAIN
>>> vi = helper.make_tensor_value_info
>>> node = helper.make_node("Adagrad", ["R", "T", "X", "G", "H"], ["X2", "H2"],
...                         domain=PREVIEW_DOMAIN)
>>> graph = helper.make_graph(
...     [node], "g",
...     [vi("R", TensorProto.FLOAT, []), vi("T", TensorProto.INT64, [])]
...     + [vi(v, TensorProto.FLOAT, [3]) for v in "XGH"],
...     [vi("X2", TensorProto.FLOAT, [3]), vi("H2", TensorProto.FLOAT, [3])])
>>> imports = [helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
>>> lower_optimizers(graph, imports, NameGen())
>>> [n.op_type for n in graph.node if n.domain]
[]
>>> sorted({"X2", "H2"} & {o for n in graph.node for o in n.output})
['H2', 'X2']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from ..core.emitter import Emitter, np_dtype
from ..core.graph import PREVIEW_DOMAIN, graph_names, infer_types, opset_version, subgraphs
from ..core.names import NameGen
from ..errors import TrainingModelError
from .common import SIGNATURES, OptimizerCall, constant, describe, split_node
from .rules import apply

#: Where (opset 9) is the newest op the lowerings need.
MIN_OPSET = 9

_X_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE)


def is_optimizer(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is an Adam, Momentum or Adagrad node of the preview domain."""
    return node.domain == PREVIEW_DOMAIN and node.op_type in SIGNATURES


def lower_optimizers(
    graph: onnx.GraphProto,
    opset_imports: Sequence[onnx.OperatorSetIdProto],
    names: NameGen,
) -> None:
    """Replace every optimizer node of ``graph`` (in place) by standard ops.

    The replacement nodes take the optimizer node's place in the node list and
    write its output names, so the order stays topological and downstream
    nodes and graph outputs are untouched.  Element types come from shape
    inference; the default domain must be imported at opset 9 or newer."""
    _refuse_nested(graph, "graph")
    if not any(is_optimizer(n) for n in graph.node):
        return
    opset = opset_version(opset_imports, "")
    if opset < MIN_OPSET:
        found = f"opset {opset}" if opset else "no import of the default domain"
        raise TrainingModelError(
            f"graph {graph.name!r}: lowering Adam/Momentum/Adagrad needs the default "
            f"ONNX domain at opset >= {MIN_OPSET}, found {found}"
        )
    names.reserve(graph_names(graph))
    dtypes, _ = infer_types(graph, opset_imports)

    lowered: list[onnx.NodeProto] = []
    for node in graph.node:
        if not is_optimizer(node):
            lowered.append(_copy(node))
            continue
        call = split_node(node, SIGNATURES[node.op_type])
        et = _element_type(call, dtypes)
        emit = Emitter(opset, names, dtypes, hint=node.name or node.op_type)
        _LOWERINGS[node.op_type](emit, call, et)
        lowered.extend(emit.nodes)
    del graph.node[:]
    graph.node.extend(lowered)


# ------------------------------------------------------------------ lowerings
# Each per-tensor update is a call of the rule of the same math (``updates``);
# what is computed once per node (the rate, Momentum's beta) stays here.
def _lower_adam(emit: Emitter, call: OptimizerCall, et: int) -> None:
    d = np_dtype(et)
    a = call.attrs
    c = _constants(emit, d)
    one = constant(1, d)
    alpha = constant(a["alpha"], d)
    beta = constant(a["beta"], d)
    # R_adjusted = T > 0 ? R * Sqrt(1 - beta**T) / (1 - alpha**T) : R
    # (one scalar for all tensors of the node)
    rate = {"r": emit.cast_to(call.r, et), "t": call.t, "one_h": c(one), "beta": c(beta), "one_v": c(one),
            "alpha": c(alpha), "zero": emit.scalar_int(0)}
    r_adjusted = apply(emit, "AdamStepSize", rate)["r_new"]
    # X_final = (1 - norm_coefficient_post) * X_new
    # (with norm_coefficient_post = 0 the factor is exactly 1: X_new is final)
    ncp = constant(a["norm_coefficient_post"], d)
    scalars = {"alpha": c(alpha), "oma": c(one - alpha), "beta": c(beta), "omb": c(one - beta),
               "eps": c(a["epsilon"]), "r": r_adjusted, "post": c(one - ncp) if ncp != 0 else None}
    for i in range(call.n):
        ins, outs = call.tensor_inputs(i), call.tensor_outputs(i)
        if not any(outs.values()):
            continue
        # G_regularized = norm_coefficient * X + G
        g_reg = _regularized_gradient(emit, c, ins["X"], ins["G"], a["norm_coefficient"])
        # V_new = alpha * V + (1 - alpha) * G_regularized
        # H_new = beta * H + (1 - beta) * G_regularized * G_regularized
        # X_new = X - R_adjusted * V_new / (Sqrt(H_new) + epsilon)
        apply(emit, "SpecAdam", {**scalars, "x": ins["X"], "g": g_reg, "v": ins["V"], "h": ins["H"]},
              {"x_new": outs["X"], "v_new": outs["V"], "h_new": outs["H"]})


def _lower_momentum(emit: Emitter, call: OptimizerCall, et: int) -> None:
    d = np_dtype(et)
    a = call.attrs
    c = _constants(emit, d)
    R = emit.cast_to(call.r, et)
    # beta_adjusted = T > 0 ? beta : 1
    beta_adjusted = emit.Where(_t_positive(emit, call), c(a["beta"]), c(1))
    if a["mode"] == "standard":
        # V_new = alpha * V + beta_adjusted * G_regularized;  X_new = X - R * V_new
        rule, scalars = "Momentum", {"alpha": c(a["alpha"]), "beta": beta_adjusted, "r": R}
    else:
        # X_new = X - R * (G_regularized + alpha * V_new)
        rule, scalars = "Nesterov", {"alpha": c(a["alpha"]), "beta": beta_adjusted, "alpha2": c(a["alpha"]),
                                     "r": R}
    for i in range(call.n):
        ins, outs = call.tensor_inputs(i), call.tensor_outputs(i)
        if not any(outs.values()):
            continue
        # G_regularized = norm_coefficient * X + G
        g_reg = _regularized_gradient(emit, c, ins["X"], ins["G"], a["norm_coefficient"])
        apply(emit, rule, {**scalars, "x": ins["X"], "g": g_reg, "v": ins["V"]},
              {"x_new": outs["X"], "v_new": outs["V"]})


def _lower_adagrad(emit: Emitter, call: OptimizerCall, et: int) -> None:
    d = np_dtype(et)
    a = call.attrs
    c = _constants(emit, d)
    R = emit.cast_to(call.r, et)
    T = emit.Cast(call.t, to=et)
    # r = R / (1 + T * decay_factor)
    r = emit.Div(R, emit.Add(c(1), emit.Mul(T, c(a["decay_factor"]))))
    for i in range(call.n):
        ins, outs = call.tensor_inputs(i), call.tensor_outputs(i)
        if not any(outs.values()):
            continue
        # G_regularized = norm_coefficient * X + G
        g_reg = _regularized_gradient(emit, c, ins["X"], ins["G"], a["norm_coefficient"])
        # H_new = H + G_regularized * G_regularized
        # X_new = X - r * G_regularized / (Sqrt(H_new) + epsilon)
        apply(emit, "Adagrad", {"eps": c(a["epsilon"]), "r": r, "x": ins["X"], "g": g_reg, "h": ins["H"]},
              {"x_new": outs["X"], "h_new": outs["H"]})


_LOWERINGS = {"Adam": _lower_adam, "Momentum": _lower_momentum, "Adagrad": _lower_adagrad}


# -------------------------------------------------------------------- helpers
def _constants(emit: Emitter, d: np.dtype) -> Callable[[Any], str]:
    """A maker of 0-D Constants of X's type ``d``, one node per distinct value.

    Values given as numpy scalars of ``d`` (such as ``one - alpha``) keep the
    arithmetic the reference does in that type."""
    made: dict[Any, str] = {}

    def const(value: Any) -> str:
        v = constant(value, d)
        if v.item() not in made:
            made[v.item()] = emit.const(v)
        return made[v.item()]

    return const


def _regularized_gradient(
    emit: Emitter, c: Callable[[Any], str], x: str, g: str, coefficient: float
) -> str:
    """norm_coefficient * X + G, the gradient of the loss plus 0.5 * nc * ||X||^2
    (a ``WeightDecay`` call).  With nc = 0 this is G (for finite X), so no
    pass over X is spent on it."""
    if coefficient == 0:
        return g
    return apply(emit, "WeightDecay", {"nc": c(coefficient), "x": x, "g": g})["g_new"]


def _t_positive(emit: Emitter, call: OptimizerCall) -> str:
    """T > 0, decided on the int64 T itself."""
    return emit.Greater(call.t, emit.scalar_int(0))


def _element_type(call: OptimizerCall, dtypes: dict[str, int]) -> int:
    """The common element type (float or double) of every X, G, V, H and output.

    The spec gives them one type constraint; R (float or double) is cast to
    it and T must be int64."""
    where = call.where
    found = {
        name: dtypes[name]
        for group in (*call.inputs.values(), *call.outputs.values())
        for name in group
        if name and name in dtypes
    }
    kinds = sorted({onnx.TensorProto.DataType.Name(t) for t in found.values()})
    if not found:
        raise TrainingModelError(
            f"{where}: cannot determine the element type of the optimized tensors "
            f"{call.inputs['X']}; declare the types of the graph inputs"
        )
    if len(kinds) > 1:
        detail = ", ".join(f"{k}: {onnx.TensorProto.DataType.Name(t)}" for k, t in found.items())
        raise TrainingModelError(
            f"{where}: X, G and the optimizer state must share one element type, found {detail}"
        )
    et = next(iter(found.values()))
    if et not in _X_TYPES:
        raise TrainingModelError(
            f"{where}: optimized tensors must be FLOAT or DOUBLE, found {kinds[0]}"
        )
    r_type = dtypes.get(call.r)
    if r_type is not None and r_type not in _X_TYPES:
        raise TrainingModelError(
            f"{where}: learning rate R {call.r!r} must be FLOAT or DOUBLE, found "
            f"{onnx.TensorProto.DataType.Name(r_type)}"
        )
    t_type = dtypes.get(call.t)
    if t_type is not None and t_type != TensorProto.INT64:
        raise TrainingModelError(
            f"{where}: iteration count T {call.t!r} must be INT64, found "
            f"{onnx.TensorProto.DataType.Name(t_type)}"
        )
    return et


def _refuse_nested(graph: onnx.GraphProto, where: str) -> None:
    """Optimizer nodes inside If/Loop/Scan bodies are not lowered: say so."""
    for node in graph.node:
        for sub in subgraphs(node):
            for inner in sub.node:
                if is_optimizer(inner):
                    raise TrainingModelError(
                        f"{where}: {describe(inner)} sits inside a subgraph of "
                        f"{node.op_type} node {node.name!r}; optimizer ops are only "
                        "lowered at the top level of a graph"
                    )
            _refuse_nested(sub, f"{where} > {node.op_type} {node.name!r}")


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    c = onnx.NodeProto()
    c.CopyFrom(node)
    return c


__all__ = ["MIN_OPSET", "is_optimizer", "lower_optimizers"]
