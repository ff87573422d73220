"""Gradient rules: Softmax, LogSoftmax and Dropout."""

from __future__ import annotations

import numpy as np

from ..registry import VJPContext, no_grad, vjp


# ------------------------------------------------------------------ softmax
def _softmax_family(ctx: VJPContext, dy: str, log: bool) -> str:
    """The shared backward of Softmax (log=False) and LogSoftmax (log=True)."""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    if ctx.opset >= 13:
        axis = int(ctx.attr("axis", -1))
        g, yy = dy, y
    else:
        # Coerced to 2-D [prod(d0..d_{axis-1}), prod(d_axis..)]: the op runs along dim 1.
        coerce = int(ctx.attr("axis", 1))
        g, yy, axis = e.Flatten(dy, axis=coerce), e.Flatten(y, axis=coerce), 1
    if ctx.selected_by_where(y):
        # A masked softmax: rows that are NaN (every logit -inf) are replaced
        # downstream, so their incoming gradient is exactly zero; read them as
        # zero so that 0 * NaN does not turn that zero into NaN (for LogSoftmax,
        # exp(0) * sum(0) = 0 as well).
        yy = e.Where(e.IsNaN(yy), ctx.const(0.0, like=dy), yy)
    if log:
        # dx = dy - softmax * sum(dy), softmax = exp(y)
        dx = e.Sub(g, e.Mul(e.Exp(yy), e.reduce_sum(g, [axis], keepdims=True)))
    else:
        # dx = y * (dy - sum(dy * y))
        dx = e.Mul(yy, e.Sub(g, e.reduce_sum(e.Mul(g, yy), [axis], keepdims=True)))
    if ctx.opset < 13:
        dx = e.Reshape(dx, e.Shape(x))
    return dx


@vjp("Softmax")
def softmax_vjp(ctx, dy):
    """y = softmax(x)  ->  dx = y * (dy - sum_axis(dy * y))

    Opset < 13: the sum runs over every axis from ``axis`` on (2-D coercion).

    Masked rows.  A row of x that is all -inf (a query that sees no key) gives
    a row of NaN in y; exporters replace it by zeros with ``Where`` (TorchScript:
    ``Where(IsNaN(y), 0, y)``; the opset-23 Attention body: ``Where(row all
    masked, 0, y)``).  Where's rule sends exactly 0 to such a row, and the
    function ``Where(..., 0, softmax(x))`` is constant there, so its gradient
    is 0; the formula, though, would give 0 * NaN = NaN.  When a Where reads y
    (directly or through Cast/Identity), the rule reads y as
    ``y' = Where(IsNaN(y), 0, y)``: equal to y on every finite row, and on a NaN
    row (softmax is NaN on whole rows) dx = 0 * (0 - 0) = 0, as PyTorch gives.
    LogSoftmax alike: dx = 0 - exp(0) * 0 = 0 on such a row."""
    return (_softmax_family(ctx, dy, log=False),)


@vjp("LogSoftmax")
def log_softmax_vjp(ctx, dy):
    """y = log_softmax(x)  ->  dx = dy - exp(y) * sum_axis(dy)

    Opset < 13: the sum runs over every axis from ``axis`` on (2-D coercion)."""
    return (_softmax_family(ctx, dy, log=True),)


no_grad("Hardmax")


@vjp("Dropout")
def dropout_vjp(ctx, dy, *_):
    """training: y = x * mask / (1 - ratio)  ->  dx = dy * mask / (1 - ratio),
        d ratio = sum(dy * y) / (1 - ratio)   (the sampled mask held fixed)
    inference (no training_mode input, or a constant false one; always before
    opset 12, where runtimes treat Dropout as inference): y = x  ->  dx = dy,
        and y does not depend on ratio (d ratio = 0)

    The mask is the node's mask output (added to the node when absent)."""
    e = ctx.emit
    ratio_in = ctx.input(1)

    def inference():
        return (dy, ctx.zeros_like(ratio_in) if ratio_in and ctx.needs(1) else None)

    if ctx.opset < 12:
        return inference()
    mode = ctx.input(2)
    if mode is None:
        return inference()
    known = e.constants.get(mode)
    if known is not None and not bool(np.asarray(known).reshape(-1)[0]):
        return inference()
    et = ctx.dtype(ctx.inputs[0])
    ratio = e.cast_to(ratio_in, et) if ratio_in is not None else ctx.const(0.5, dtype=et)
    keep = e.Sub(ctx.const(1.0, dtype=et), ratio)
    scale = e.Div(ctx.const(1.0, dtype=et), keep)
    if known is None:  # decided at run time; the inference-mode mask is all true
        scale = e.Where(mode, scale, ctx.const(1.0, dtype=et))
    mask = e.Cast(ctx.forward_output(1), to=et)
    dx = e.Mul(e.Mul(dy, mask), scale)
    d_ratio = None
    if ratio_in is not None and ctx.needs(1):
        d_ratio = e.Div(e.reduce_sum(e.Mul(dy, ctx.outputs[0]), None, keepdims=False), keep)
        if known is None:
            d_ratio = e.Where(mode, d_ratio, ctx.const(0.0, dtype=et))
        d_ratio = e.cast_to(d_ratio, ctx.dtype(ratio_in))
    return (dx, d_ratio)
