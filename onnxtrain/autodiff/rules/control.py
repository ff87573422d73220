"""Gradient rules: control flow (If, Loop, Scan).

A subgraph's intermediate values are invisible outside its node, so the
backward pass of a branch or body recomputes that body's forward pass inside a
new subgraph and differentiates it there (``ctx.vjp_of_graph``).  Gradients of
the outer-scope values a subgraph reads (its implicit inputs) are returned
through ``ctx.accumulate``."""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from ..registry import VJPContext, vjp


def _body_nodes(g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """A subgraph's nodes, with its own initializers turned into Constants."""
    consts = [
        helper.make_node("Constant", [], [t.name], value=t, name=f"{g.name}/{t.name}/const")
        for t in g.initializer
    ]
    return consts + list(g.node)


def _types(ctx: VJPContext, names: list[str]) -> dict[str, tuple[int, tuple | None]]:
    return {n: (ctx.dtype(n), ctx.shape(n)) for n in names if n}


@vjp("If")
def if_vjp(ctx, *dys):
    """y = cond ? then_branch() : else_branch()
    ->  d(outer v) = cond ? vjp(then_branch, dy)[v] : vjp(else_branch, dy)[v]

    Each backward branch recomputes its forward branch, then differentiates it
    with the output gradients as cotangents; the condition gets no gradient."""
    e = ctx.emit
    targets = [v for v in ctx.implicit_inputs if ctx.needs_name(v)]
    if not targets:
        return (None,)
    cotangents = list(dys)
    for o, d in zip(ctx.outputs, cotangents):
        if d is not None:
            e.dtypes.setdefault(d, ctx.dtype(o))
    branches = {}
    for attr in ("then_branch", "else_branch"):
        g = ctx.attr(attr)
        free = set(ctx.implicit_inputs) | {d for d in cotangents if d}
        nodes, grads = ctx.vjp_of_graph(
            _body_nodes(g), [o.name for o in g.output], cotangents, targets,
            _types(ctx, sorted(free)),
        )
        outputs = [helper.make_tensor_value_info(gr, ctx.dtype(t), None) for gr, t in zip(grads, targets)]
        branches[attr] = helper.make_graph(nodes, f"{g.name or attr}_grad", [], outputs)
    outs = e.op("If", [ctx.inputs[0]], outputs=len(targets), **branches)
    outs = outs if isinstance(outs, list) else [outs]
    for t, o in zip(targets, outs):
        e.dtypes[o] = ctx.dtype(t)
        ctx.accumulate(t, o)
    return (None,)
