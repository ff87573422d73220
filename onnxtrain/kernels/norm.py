"""BatchNormalization's training gradient -> ``BatchNormGradF32`` (the kernel library).

The rule (``rules/norm.py``) recomputes the batch statistics and writes the
gradient with standard ops: about fifteen passes over the activation
(ReduceMean, Sub, Mul ...), 30 ms of a ResNet-18 step.  The kernel makes two
passes: one for four per-channel sums in double (about the channel's first
element, so the variance does not cancel), one for dx.  Its values are the
rule's to float32 rounding, not its bits (the sums run in another order and
precision, as any fused BatchNorm kernel's would): tests/runtime/
test_conv_kernels.py checks it against float64 and trains with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..core.graph import constant_values, infer_types, node_inputs, toposort
from ..core.names import NameGen
from .layers import const_ints, default_domain, drop_unread

#: The library op (domain ``fuse.KERNEL_DOMAIN``).
BN_GRAD_KERNEL = "BatchNormGradF32"


def _node(producer: dict, name: str, op_type: str) -> onnx.NodeProto | None:
    """The default-domain ``op_type`` node that writes ``name``, if that is what writes it."""
    node = producer.get(name)
    return node if node is not None and node.op_type == op_type and default_domain(node) else None


def _axes(node: onnx.NodeProto, values: dict) -> list[int] | None:
    """A reduction's or Unsqueeze's axes: an attribute (older opsets) or a constant input."""
    for a in node.attribute:
        if a.name == "axes":
            return list(a.ints)
    return const_ints(values, node.input[1]) if len(node.input) > 1 else None


def _reduce(node: onnx.NodeProto | None, op_type: str, values: dict, keepdims: int) -> tuple[str, list[int]] | None:
    """(input, axes) of a ``op_type`` reduction with ``keepdims``."""
    if node is None or node.op_type != op_type or not default_domain(node):
        return None
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    if int(a.get("keepdims", 1)) != keepdims or int(a.get("noop_with_empty_axes", 0)):
        return None
    axes = _axes(node, values)
    return (node.input[0], axes) if axes else None


def _operands(node: onnx.NodeProto | None, op_type: str) -> list[tuple[str, str]]:
    """Both readings (a, b) of a commutative binary node of ``op_type``."""
    if node is None or node.op_type != op_type or not default_domain(node) or len(node.input) != 2:
        return []
    a, b = node.input
    return [(a, b), (b, a)] if a != b else [(a, b)]


def _is_product(producer: dict, name: str, a: str, b: str) -> bool:
    """Whether ``name`` is Mul(a, b), in either order."""
    return any({p, q} == {a, b} for p, q in _operands(producer.get(name), "Mul"))


def _batch_stats(xhat: str, inv_std: str, axes: list[int], producer: dict, values: dict) -> tuple[str, str] | None:
    """(x, eps) where ``xhat`` and ``inv_std`` are the rule's ``_batch_stats``:
    xhat = (x - mean(x)) * inv_std, inv_std = 1 / sqrt(mean((x - mean(x))^2) + eps)."""
    recip = _node(producer, inv_std, "Reciprocal")
    sqrt = _node(producer, recip.input[0], "Sqrt") if recip is not None else None
    if sqrt is None:
        return None
    for centred, inv in _operands(producer.get(xhat), "Mul"):
        sub = _node(producer, centred, "Sub") if inv == inv_std else None
        if sub is None:
            continue
        x, mean_x = sub.input
        if _reduce(producer.get(mean_x), "ReduceMean", values, 1) != (x, axes):
            continue
        for var, eps in _operands(producer.get(sqrt.input[0]), "Add"):
            red = _reduce(producer.get(var), "ReduceMean", values, 1)
            e = values.get(eps)
            if (red is not None and red[1] == axes and _operands(producer.get(red[0]), "Mul") == [(centred, centred)]
                    and e is not None and e.size == 1 and e.dtype == np.float32):
                return x, eps
    return None


def _scaled(g: str, rank: int, producer: dict, values: dict) -> tuple[str, str] | None:
    """(dy, scale) where g = dy * Unsqueeze(scale) per channel of a rank-``rank`` tensor."""
    for dy, sc in _operands(producer.get(g), "Mul"):
        unsq = _node(producer, sc, "Unsqueeze")
        if unsq is not None and _axes(unsq, values) == list(range(1, rank - 1)):
            return dy, unsq.input[0]
    return None


def _bn_grad(root: onnx.NodeProto, producer: dict, consumers: dict, values: dict,
             types: dict, shapes: dict) -> dict | None:
    """The training-mode BatchNormalization gradient rooted at ``root`` as
    ``rules/norm.py`` writes it (``_batch_stats``, ``_normalize_backward``):
        dx = inv_std * ((g - mean(g)) - xhat * mean(g * xhat)),  g = dy * scale
    with xhat = (x - mean(x)) * inv_std, inv_std = 1 / sqrt(mean((x - mean(x))^2) + eps),
    means over every axis but 1: its tensors, else None."""
    for inv_std, d in _operands(root, "Mul"):
        outer = _node(producer, d, "Sub")
        inner = _node(producer, outer.input[0], "Sub") if outer is not None else None
        if inner is None:
            continue
        g, mean_g = inner.input
        found = _reduce(producer.get(mean_g), "ReduceMean", values, 1)
        if found is None or found[0] != g:
            continue
        axes = found[1]
        for xhat, mean_gx in _operands(producer.get(outer.input[1]), "Mul"):
            red = _reduce(producer.get(mean_gx), "ReduceMean", values, 1)
            if red is None or red[1] != axes or not _is_product(producer, red[0], g, xhat):
                continue
            stats = _batch_stats(xhat, inv_std, axes, producer, values)
            dims = shapes.get(stats[0]) if stats is not None else None
            if dims is None or len(dims) < 3 or axes != [0, *range(2, len(dims))]:
                continue
            x, eps = stats
            found = _scaled(g, len(dims), producer, values)
            if found is None:
                continue
            dy, scale = found
            if any(types.get(t) != TensorProto.FLOAT for t in (x, dy, scale)) or shapes.get(dy) != dims:
                continue
            return {"x": x, "dy": dy, "scale": scale, "eps": eps, "xhat": xhat, "axes": axes,
                    "dscale": _sum_of(consumers, producer, values, axes, dy, xhat),
                    "dbias": _sum_of(consumers, producer, values, axes, dy, None)}
    return None


def _sum_of(consumers: dict, producer: dict, values: dict, axes: list[int], dy: str, xhat: str | None) -> str | None:
    """The ReduceSum over ``axes`` (keepdims 0) of dy * xhat (of dy without
    xhat) that the rule writes for dscale (dbias), if there is one."""
    if xhat is None:
        readers = consumers.get(dy, ())
    else:
        readers = [r for m in consumers.get(dy, ()) if m.output and _is_product(producer, m.output[0], dy, xhat)
                   for r in consumers.get(m.output[0], ())]
    for r in readers:
        found = _reduce(r, "ReduceSum", values, 0)
        if found is not None and found[1] == axes:
            return r.output[0]
    return None


def bn_grad_plan(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                 inferred=None) -> dict[str, dict]:
    """{dx: tensors (``_bn_grad``)} for every training-mode BatchNormalization
    gradient the kernel computes."""
    nodes = list(graph.node)
    if not any(n.op_type == "ReduceMean" for n in nodes):
        return {}
    producer = {o: n for n in nodes for o in n.output if o}
    roots = [n for n in nodes if n.op_type == "Mul" and default_domain(n) and len(n.input) == 2
             and any(producer.get(i) is not None and producer[i].op_type == "Sub" for i in n.input)]
    if not roots:
        return {}
    consumers: dict[str, list] = {}
    for n in nodes:
        for i in node_inputs(n):
            consumers.setdefault(i, []).append(n)
    values = constant_values(graph)
    types, shapes = inferred() if inferred else infer_types(graph, opset_imports)
    plan = {}
    for root in roots:
        found = _bn_grad(root, producer, consumers, values, types, shapes)
        if found is not None:
            plan[root.output[0]] = found
    return plan


def fuse_bn_grads(graph: onnx.GraphProto, plan: dict[str, dict], domain: str) -> int:
    """Replace the gradients of ``plan`` (``bn_grad_plan``) by the ``domain``
    op, in place: its dx is the root's output and its dscale and dbias the
    rule's ReduceSums' (which go); what only they read goes too."""
    if not plan:
        return 0
    names = NameGen.from_graph(graph)
    # A ReduceSum that two gradients share (common subexpressions merged: two
    # BatchNorms fed one dy) is written by the first kernel only.
    sums: set[str] = set()
    for p in plan.values():
        for k in ("dscale", "dbias"):
            if p[k] in sums:
                p[k] = None
            elif p[k]:
                sums.add(p[k])
    nodes = []
    for node in graph.node:
        if node.output and node.output[0] in sums:
            continue  # (the kernel writes it)
        p = plan.get(node.output[0]) if node.op_type == "Mul" and node.output else None
        if p is None:
            nodes.append(node)
            continue
        outs = [node.output[0], p["dscale"] or names.fresh(node.output[0] + "_dscale"),
                p["dbias"] or names.fresh(node.output[0] + "_dbias")]
        nodes.append(helper.make_node(BN_GRAD_KERNEL, [p["x"], p["dy"], p["scale"], p["eps"]], outs,
                                      name=node.name, domain=domain))
    graph.ClearField("node")
    graph.node.extend(_ordered(nodes, graph))
    drop_unread(graph, {"Mul", "Sub", "Add", "ReduceMean", "ReduceSum", "Reciprocal", "Sqrt", "Unsqueeze"})
    return len(plan)


def _ordered(nodes: list, graph: onnx.GraphProto) -> list:
    """``nodes`` in an order where each runs after what it reads (the kernel
    takes the place of its last node, and may read the ReduceSums' inputs)."""
    available = [i.name for i in graph.input] + [t.name for t in graph.initializer]
    return toposort(nodes, available, where="fused program")


