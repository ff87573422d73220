"""Gradient rules: reductions.

Every Reduce* op reads its axes from an attribute (before opset 13 for
ReduceSum, before 18 for the others) or from an optional second input.
``reduced_axes`` reads both forms; ``expand_back`` brings a reduced gradient
back to the input's shape, with keepdims=0 handled by re-inserting the axes
(statically when the axes are constant, with ScatterElements on the shape
otherwise)."""

from __future__ import annotations

import numpy as np

from ..registry import VJPContext, vjp


def reduced_axes(ctx: VJPContext) -> list[int] | str | None:
    """The reduced axes: a list of ints, a runtime tensor name, or None for all.

    An empty axes input with noop_with_empty_axes=1 gives [] (no reduction)."""
    axes_input = ctx.input(1)
    if axes_input is None:
        axes = ctx.attr("axes")
        if axes is not None:
            return list(axes)
        return [] if ctx.attr("noop_with_empty_axes", 0) else None
    const = constant_value(ctx, axes_input)
    if const is None:
        return axes_input
    if const.size == 0:
        return [] if ctx.attr("noop_with_empty_axes", 0) else None
    return [int(a) for a in const.reshape(-1)]


def constant_value(ctx: VJPContext, name: str) -> np.ndarray | None:
    """The value of ``name`` when a Constant node of the program produced it."""
    return ctx.emit.constants.get(name)


def expand_back(ctx: VJPContext, dy: str, x: str, axes, keepdims: bool) -> str:
    """Broadcast a gradient of the reduced output back to the shape of x."""
    e = ctx.emit
    if axes == []:
        return dy
    if not keepdims and axes is not None:
        if isinstance(axes, str):
            rank = e.Size(e.Shape(x))
            norm = e.Where(e.Less(axes, e.scalar_int(0)), e.Add(axes, rank), axes)
            ones = e.Expand(e.ints([1]), e.Shape(axes))
            kept = e.ScatterElements(e.Shape(x), e.reshape(norm, [-1]), e.reshape(ones, [-1]), axis=0)
            dy = e.Reshape(dy, kept)
        else:
            rank = ctx.require_rank(x)
            dy = e.unsqueeze(dy, sorted(a % rank for a in axes))
    return e.Expand(dy, e.Shape(x)) if e.opset >= 8 else e.Add(dy, e.zeros_like(x))


@vjp("ReduceSum")
def reduce_sum_vjp(ctx, dy):
    """y = sum_axes(x)  ->  dx = broadcast(dy)"""
    x = ctx.inputs[0]
    return (expand_back(ctx, dy, x, reduced_axes(ctx), bool(ctx.attr("keepdims", 1))),)


@vjp("ReduceMean")
def reduce_mean_vjp(ctx, dy):
    """y = mean_axes(x)  ->  dx = broadcast(dy) * size(y) / size(x)"""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    ratio = e.Div(e.Cast(e.Size(y), to=ctx.dtype(x)), e.Cast(e.Size(x), to=ctx.dtype(x)))
    dx = expand_back(ctx, dy, x, reduced_axes(ctx), bool(ctx.attr("keepdims", 1)))
    return (e.Mul(dx, ratio),)
