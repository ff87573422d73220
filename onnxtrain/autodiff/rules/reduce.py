"""Gradient rules: reductions and scans.

Every Reduce* op reads its axes from an attribute (before opset 13 for
ReduceSum, before 18 for the others) or from an optional second input.
``reduced_axes`` reads both forms; ``expand_back`` brings a reduced gradient
back to the input's shape, with keepdims=0 handled by re-inserting the axes
(statically when the axes are constant, with ScatterElements on the shape
otherwise).  Rules that need the forward output at x's shape (max, L2, log-sum)
bring y back the same way."""

from __future__ import annotations

import numpy as np

from ..registry import VJPContext, vjp
from ._common import constant_value


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
            kept = e.ScatterElements(
                e.Shape(x), e.reshape(norm, [-1]), e.reshape(ones, [-1]), axis=0
            )
            if not ctx.attr("noop_with_empty_axes", 0):
                # Empty runtime axes reduced every axis: y kept no dimension at all.
                every = e.Expand(e.ints([1]), e.Shape(e.Shape(x)))
                kept = e.Where(e.Equal(e.Size(axes), e.scalar_int(0)), every, kept)
            dy = e.Reshape(dy, kept)
        else:
            rank = ctx.require_rank(x)
            dy = e.unsqueeze(dy, sorted(a % rank for a in axes))
    if e.opset < 8 and not keepdims and axes is None:
        # Tile (opset 7's Expand) needs dy at x's rank
        r = ctx.rank(x)
        if r is None:
            return e.Add(dy, e.zeros_like(x))
        dy = e.reshape(dy, [1] * r)
    return e.expand_to(dy, x)


@vjp("ReduceSum")
def reduce_sum_vjp(ctx, dy):
    """y = sum_axes(x)  ->  dx = broadcast(dy)"""
    x = ctx.inputs[0]
    return (expand_back(ctx, dy, x, reduced_axes(ctx), bool(ctx.attr("keepdims"))),)


@vjp("ReduceMean")
def reduce_mean_vjp(ctx, dy):
    """y = mean_axes(x)  ->  dx = broadcast(dy * size(y) / size(x))

    The ratio is a constant when both shapes are static."""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    et = ctx.dtype(x)
    n_x, n_y = _static_numel(ctx.shape(x)), _static_numel(ctx.shape(y))
    if n_x is not None and n_y is not None:
        ratio = ctx.const(n_y / n_x if n_x else 0.0, dtype=et)  # static shapes: no runtime Size
    else:
        size_y = ctx.const(float(n_y), dtype=et) if n_y is not None else e.Cast(e.Size(y), to=et)
        ratio = e.Div(size_y, e.Cast(e.Size(x), to=et))
    # scale the (smaller) cotangent before broadcasting it back
    return (expand_back(ctx, e.Mul(dy, ratio), x, reduced_axes(ctx), bool(ctx.attr("keepdims"))),)


def _static_numel(shape) -> int | None:
    """The element count of a fully static shape, else None."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64))


def reduce_as_forward(ctx: VJPContext, op_type: str, t: str, axes) -> str:
    """Reduce ``t`` (shaped like x) over the forward node's axes, keeping dims.

    Runtime axes keep the node's noop_with_empty_axes, so an axes tensor that
    turns out empty reduces the same way it did forward."""
    e = ctx.emit
    if isinstance(axes, str):
        noop = int(ctx.attr("noop_with_empty_axes", 0))
        return e.op(op_type, [t, axes], keepdims=1, noop_with_empty_axes=noop)
    return e.reduce(op_type, t, axes, keepdims=True)


def _broadcast_parts(ctx: VJPContext, dy: str) -> tuple[str, str, str, list[int] | str | None]:
    """x, dy and y brought back to x's shape, and the reduced axes."""
    x, y = ctx.inputs[0], ctx.outputs[0]
    axes = reduced_axes(ctx)
    keepdims = bool(ctx.attr("keepdims", 1))
    return (
        x,
        expand_back(ctx, dy, x, axes, keepdims),
        expand_back(ctx, y, x, axes, keepdims),
        axes,
    )


@vjp("ReduceSumSquare")
def reduce_sum_square_vjp(ctx, dy):
    """y = sum_axes(x^2)  ->  dx = 2 x broadcast(dy)"""
    x, dyb, _, _ = _broadcast_parts(ctx, dy)
    e = ctx.emit
    return (e.Mul(e.Mul(dyb, x), ctx.const(2.0, like=x)),)


@vjp("ReduceL1")
def reduce_l1_vjp(ctx, dy):
    """y = sum_axes(|x|)  ->  dx = sign(x) broadcast(dy)   (0 at x = 0)"""
    x, dyb, _, _ = _broadcast_parts(ctx, dy)
    return (ctx.emit.Mul(dyb, ctx.emit.sign(x)),)


@vjp("ReduceL2")
def reduce_l2_vjp(ctx, dy):
    """y = sqrt(sum_axes(x^2))  ->  dx = x / y broadcast(dy)   (0 where y = 0)"""
    x, dyb, yb, _ = _broadcast_parts(ctx, dy)
    e = ctx.emit
    zero = ctx.const(0.0, like=x)
    safe = e.Where(e.Greater(yb, zero), yb, ctx.const(1.0, like=x))
    return (e.Mul(dyb, e.Div(x, safe)),)


@vjp("ReduceLogSum")
def reduce_log_sum_vjp(ctx, dy):
    """y = log(sum_axes(x))  ->  dx = broadcast(dy) / sum = broadcast(dy) exp(-y)   (reuses y)"""
    _, dyb, yb, _ = _broadcast_parts(ctx, dy)
    e = ctx.emit
    return (e.Mul(dyb, e.Exp(e.Neg(yb))),)


@vjp("ReduceLogSumExp")
def reduce_log_sum_exp_vjp(ctx, dy):
    """y = log(sum_axes(exp(x)))  ->  dx = broadcast(dy) exp(x - y)   (softmax over the axes)"""
    x, dyb, yb, _ = _broadcast_parts(ctx, dy)
    e = ctx.emit
    return (e.Mul(dyb, e.Exp(e.Sub(x, yb))),)


@vjp("ReduceMax", "ReduceMin")
def reduce_max_vjp(ctx, dy):
    """y = max_axes(x) (or min)  ->  dx = broadcast(dy) [x == y] / #{x == y}

    Ties share the gradient evenly (the average of the one-sided derivatives)."""
    x, dyb, yb, axes = _broadcast_parts(ctx, dy)
    e = ctx.emit
    hit = e.Cast(ctx.emit.float_equal(x, yb), to=ctx.dtype(x))
    count = reduce_as_forward(ctx, "ReduceSum", hit, axes)
    return (e.Mul(dyb, e.Div(hit, count)),)


@vjp("ReduceProd")
def reduce_prod_vjp(ctx, dy):
    """y = prod_axes(x)  ->  dx_i = broadcast(dy) * prod_{j != i} x_j

    prod_{j != i} x_j is y / x_i when no x_j is 0; with exactly one zero it is
    the product of the nonzeros at the zero and 0 elsewhere; with two or more
    zeros it is 0 everywhere.  Computed that way, so zeros give no NaN."""
    x, dyb, _, axes = _broadcast_parts(ctx, dy)
    e = ctx.emit
    zero, one = ctx.const(0.0, like=x), ctx.const(1.0, like=x)
    is_zero = ctx.emit.float_equal(x, zero)
    zeros = reduce_as_forward(ctx, "ReduceSum", e.Cast(is_zero, to=ctx.dtype(x)), axes)
    nonzero_x = e.Where(is_zero, one, x)
    rest = reduce_as_forward(ctx, "ReduceProd", nonzero_x, axes)  # product of the nonzeros
    at_zero = e.Where(ctx.emit.float_equal(zeros, one), rest, zero)
    elsewhere = e.Where(ctx.emit.float_equal(zeros, zero), e.Div(rest, nonzero_x), zero)
    return (e.Mul(dyb, e.Where(is_zero, at_zero, elsewhere)),)


# ------------------------------------------------------------------ scans


@vjp("CumSum")
def cumsum_vjp(ctx, dy):
    """y_i = sum_{j <= i} x_j (j < i when exclusive; from the end when reverse)
    ->  dx_j = sum_{i >= j} dy_i: CumSum(dy) with the same exclusive flag and
    the opposite direction; axis gets none"""
    x, axis = ctx.inputs
    reverse = int(ctx.attr("reverse"))
    exclusive = int(ctx.attr("exclusive"))
    return ctx.emit.CumSum(dy, axis, exclusive=exclusive, reverse=1 - reverse), None


@vjp("CumProd")
def cumprod_vjp(ctx, dy):
    """y_i = prod_{k <= i} x_k (k < i when exclusive; from the end when reverse)
    ->  dx_j = sum_{i >= j} dy_i prod_{k <= i, k != j} x_k     (i > j when exclusive)

    Where x_j != 0 the product is y_i / x_j, so dx_j = T_j / x_j with T the
    cumulative sum of dy * y taken the other way (same exclusive flag).  Where
    x_j == 0 the product vanishes unless j is the only zero among the k it
    multiplies; with x' = x with its zeros replaced by 1, Q = CumProd(x') and
    one_zero_i = [exactly one zero among those k],
        dx_j = S_j,  S = the reversed cumulative sum of dy * Q * one_zero
    (0 for every zero but the first, whose prefixes all hold two zeros).  All
    of it is cumulative ops along the node's axis, so the axis may be a
    runtime value, and zeros are exact.  Reuses y.  The axis gets none."""
    x, axis = ctx.inputs
    y = ctx.outputs[0]
    e = ctx.emit
    if not ctx.needs(0):
        return None, None
    exclusive = int(ctx.attr("exclusive")) or None
    reverse = int(ctx.attr("reverse"))
    back = 1 - reverse or None  # the adjoint accumulates the other way
    forth = reverse or None
    zero, one = ctx.const(0.0, like=x), ctx.const(1.0, like=x)
    is_zero = ctx.emit.float_equal(x, zero)
    safe = e.Where(is_zero, one, x)
    total = e.CumSum(e.Mul(dy, y), axis, exclusive=exclusive, reverse=back)
    nonzero_part = e.Div(total, safe)
    zeros_seen = e.CumSum(e.Cast(is_zero, to=ctx.dtype(x)), axis, exclusive=exclusive, reverse=forth)
    one_zero = e.Cast(ctx.emit.float_equal(zeros_seen, one), to=ctx.dtype(x))
    products = e.CumProd(safe, axis, exclusive=exclusive, reverse=forth)
    zero_part = e.CumSum(e.Mul(e.Mul(dy, products), one_zero), axis, exclusive=exclusive, reverse=back)
    return e.Where(is_zero, zero_part, nonzero_part), None


# ------------------------------------------------------------ determinant


@vjp("Det")
def det_vjp(ctx, dy):
    """y = det(X) over the last two axes  ->  dX = dy * C,  C_ij = (-1)^(i+j) det(M_ij)

    C is the cofactor matrix (det(X) inv(X)^T where X is invertible, and still
    exact where it is not); M_ij is X without row i and column j.  The minors
    are the op itself on a batch of n^2 matrices gathered from the bordered
    matrix B = [[1, 0], [0, X]]: removing row i + 1 and column j + 1 of B leaves
    diag(1, M_ij), whose determinant is det(M_ij), and which is never 0 x 0
    (so 1 x 1 inputs work too).  Memory is O(n^4) per matrix."""
    (x,) = ctx.inputs
    e = ctx.emit
    rank = ctx.require_rank(x)
    batch = rank - 2
    n = e.dim(x, -1)
    one = ctx.const(1.0, like=x)
    bordered = e.Pad(x, e.ints([0] * batch + [1, 1] + [0] * batch + [0, 0]))
    rows = e.Range(e.scalar_int(0), e.reshape(e.Add(n, e.ints([1])), []), e.scalar_int(1))
    first = e.Equal(rows, e.ints([0]))
    corner = e.And(e.unsqueeze(first, [1]), e.unsqueeze(first, [0]))
    bordered = e.Where(corner, one, bordered)
    k = e.Range(e.scalar_int(0), e.reshape(n, []), e.scalar_int(1))
    i = e.unsqueeze(k, [1])
    # keep[i, k] = the k-th row (column) of B left after removing row (column) i + 1
    keep = e.Add(e.unsqueeze(k, [0]), e.Cast(e.Greater(e.unsqueeze(k, [0]), i), to=7))
    picked = e.Gather(e.Gather(bordered, keep, axis=batch), keep, axis=batch + 2)
    # [..., i, k, j, l] -> [..., i, j, k, l]
    perm = list(range(batch)) + [batch, batch + 2, batch + 1, batch + 3]
    minors = e.Det(e.Transpose(picked, perm=perm))  # [..., n, n]
    parity = e.Mod(e.Add(i, e.unsqueeze(k, [0])), e.ints([2]))
    sign = e.Sub(one, e.Mul(ctx.const(2.0, like=x), e.Cast(parity, to=ctx.dtype(x))))
    cofactor = e.Mul(minors, sign)
    return (e.Mul(e.unsqueeze(dy, [batch, batch + 1]), cofactor),)
