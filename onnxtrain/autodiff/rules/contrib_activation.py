"""Gradient rules: onnxruntime's com.microsoft activations (FastGelu, QuickGelu,
Gelu, BiasGelu), as onnxruntime's transformer optimizer and some model
builders write them.  Each is elementwise; an optional bias added before the
activation gets the gradient summed over the axes it is broadcast along."""

from __future__ import annotations

import math

from ..registry import VJPContext, vjp
from .elementwise import gelu_slope

MS = "com.microsoft"

#: FastGelu's tanh approximation: 0.5 x (1 + tanh(A x + B x^3)), A = sqrt(2 / pi), B = 0.044715 A.
_A = math.sqrt(2.0 / math.pi)
_B = 0.044715 * _A


def _with_bias(ctx: VJPContext, dx: str, bias_index: int) -> tuple[str | None, str | None]:
    """(dX, dbias): dbias = dx summed down to the bias's shape."""
    bias = ctx.input(bias_index)
    d_bias = ctx.unbroadcast(dx, bias, out=ctx.inputs[0]) if bias is not None and ctx.needs(bias_index) else None
    return (dx if ctx.needs(0) else None), d_bias


def _biased_input(ctx: VJPContext, bias_index: int) -> str:
    bias = ctx.input(bias_index)
    return ctx.emit.Add(ctx.inputs[0], bias) if bias is not None else ctx.inputs[0]


@vjp("FastGelu", domain=MS)
def fast_gelu_vjp(ctx, dy):
    """y = 0.5 x (1 + t), t = tanh(A x + B x^3), x = X (+ bias), A = sqrt(2/pi), B = 0.044715 A
    ->  dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) (A + 3 B x^2)),  dbias = dx summed over broadcast axes"""
    e = ctx.emit
    x = _biased_input(ctx, 1)
    c = lambda v: ctx.const(v, like=x)  # noqa: E731
    x2 = e.Mul(x, x)
    t = e.Tanh(e.Mul(x, e.Add(c(_A), e.Mul(c(_B), x2))))
    inner = e.Add(c(_A), e.Mul(c(3 * _B), x2))
    slope = e.Add(e.Mul(c(0.5), e.Add(c(1.0), t)), e.Mul(e.Mul(c(0.5), x), e.Mul(e.Sub(c(1.0), e.Mul(t, t)), inner)))
    return _with_bias(ctx, e.Mul(dy, slope), 1)


@vjp("QuickGelu", domain=MS)
def quick_gelu_vjp(ctx, dy):
    """y = x s, s = sigmoid(alpha x)  (alpha default 1.702)
    ->  dx = dy (s + alpha x s (1 - s))"""
    e = ctx.emit
    x = ctx.inputs[0]
    alpha = ctx.const(float(ctx.attr("alpha", 1.702)), like=x)
    s = e.Sigmoid(e.Mul(alpha, x))
    one = ctx.const(1.0, like=x)
    slope = e.Add(s, e.Mul(e.Mul(alpha, x), e.Mul(s, e.Sub(one, s))))
    return (e.Mul(dy, slope),)


@vjp("Gelu", domain=MS)
def ms_gelu_vjp(ctx, dy):
    """y = x Phi(x) (exact, erf)  ->  dx = dy (Phi(x) + x phi(x))"""
    return (ctx.emit.Mul(dy, gelu_slope(ctx, ctx.inputs[0])),)


@vjp("BiasGelu", domain=MS)
def bias_gelu_vjp(ctx, dy):
    """y = x Phi(x), x = A + B (B a bias over the last axis)
    ->  dA = dy (Phi(x) + x phi(x)),  dB = dA summed over the leading axes"""
    x = _biased_input(ctx, 1)
    return _with_bias(ctx, ctx.emit.Mul(dy, gelu_slope(ctx, x)), 1)
