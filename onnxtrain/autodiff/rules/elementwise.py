"""Gradient rules: elementwise arithmetic and unary math.

Binary ops broadcast; ``ctx.unbroadcast`` sums each gradient back to the shape
of its input."""

from __future__ import annotations

from ..registry import vjp


@vjp("Add")
def add_vjp(ctx, dy):
    """y = a + b  ->  da = dy, db = dy   (summed over broadcast axes)"""
    a, b = ctx.inputs
    return (
        ctx.unbroadcast(dy, like=a) if ctx.needs(0) else None,
        ctx.unbroadcast(dy, like=b) if ctx.needs(1) else None,
    )


@vjp("Mul")
def mul_vjp(ctx, dy):
    """y = a * b  ->  da = dy * b, db = dy * a"""
    a, b = ctx.inputs
    e = ctx.emit
    return (
        ctx.unbroadcast(e.Mul(dy, b), like=a) if ctx.needs(0) else None,
        ctx.unbroadcast(e.Mul(dy, a), like=b) if ctx.needs(1) else None,
    )


@vjp("Identity")
def identity_vjp(ctx, dy):
    """y = x  ->  dx = dy"""
    return (dy,)


@vjp("Sum")
def sum_vjp(ctx, dy):
    """y = x1 + ... + xn  ->  dxi = dy   (summed over broadcast axes)"""
    return tuple(
        ctx.unbroadcast(dy, like=x) if ctx.needs(i) else None for i, x in enumerate(ctx.inputs)
    )
