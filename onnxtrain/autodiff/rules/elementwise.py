"""Gradient rules: elementwise arithmetic, unary math and activations.

Binary and variadic ops broadcast; ``ctx.unbroadcast`` sums each gradient back
to the shape of its input.  Unary rules reuse the forward output ``y`` where
the derivative is a function of it (Exp, Sigmoid, Tanh, Sqrt, ...), so nothing
of the forward pass is computed twice.

At a kink the rules take one side, stated in each docstring: Relu, Clip,
ThresholdedRelu, Shrink and HardSigmoid give 0 there; LeakyRelu, PRelu, Elu,
Selu and Celu give the slope of their x <= 0 branch; Abs gives sign(0) = 0.
Max/Min split the gradient evenly between tied inputs.
"""

from __future__ import annotations

import math

from ...core.emitter import FLOAT_TYPES
from ...errors import GradientError
from ..registry import VJPContext, vjp

# ----------------------------------------------------------------- helpers


def is_float(ctx: VJPContext, name: str) -> bool:
    """Whether ``name`` has a floating element type (gradients exist only there)."""
    return ctx.emit.dtypes.get(name) in FLOAT_TYPES


def where_zero(ctx: VJPContext, cond: str, value: str) -> str:
    """``value`` where ``cond`` holds, 0 elsewhere (shaped like the broadcast of both)."""
    return ctx.emit.Where(cond, value, ctx.const(0.0, like=value))


def _unary(ctx: VJPContext, dy: str, dydx: str) -> tuple[str]:
    """dx = dy * dydx for a one-input op."""
    return (ctx.emit.Mul(dy, dydx),)


# -------------------------------------------------------------- arithmetic


@vjp("Add")
def add_vjp(ctx, dy):
    """y = a + b  ->  da = dy, db = dy   (summed over broadcast axes)"""
    a, b = ctx.inputs
    return (
        ctx.unbroadcast(dy, like=a) if ctx.needs(0) else None,
        ctx.unbroadcast(dy, like=b) if ctx.needs(1) else None,
    )


@vjp("Sub")
def sub_vjp(ctx, dy):
    """y = a - b  ->  da = dy, db = -dy   (summed over broadcast axes)"""
    a, b = ctx.inputs
    return (
        ctx.unbroadcast(dy, like=a) if ctx.needs(0) else None,
        ctx.unbroadcast(ctx.emit.Neg(dy), like=b) if ctx.needs(1) else None,
    )


@vjp("Mul")
def mul_vjp(ctx, dy):
    """y = a * b  ->  da = dy * b, db = dy * a

    A square (a and b the same tensor) gets its whole gradient in slot 0:
    2 dy a = (2 dy) a, bitwise the sum of the two products, with the scaling
    folded into dy when dy is a constant (MSE's mean)."""
    a, b = ctx.inputs
    e = ctx.emit
    if a == b and ctx.needs(0):
        return ctx.unbroadcast(e.Mul(e.Mul(dy, e.const(2.0, like=dy)), a), like=a), None
    return (
        ctx.unbroadcast(e.Mul(dy, b), like=a) if ctx.needs(0) else None,
        ctx.unbroadcast(e.Mul(dy, a), like=b) if ctx.needs(1) else None,
    )


@vjp("Div")
def div_vjp(ctx, dy):
    """y = a / b  ->  da = dy / b, db = -dy * a / b^2 = -dy * y / b   (reuses y)"""
    a, b = ctx.inputs
    (y,) = ctx.outputs
    e = ctx.emit
    da = db = None
    if ctx.needs(0):
        da = ctx.unbroadcast(e.Div(dy, b), like=a)
    if ctx.needs(1):
        db = ctx.unbroadcast(e.Neg(e.Div(e.Mul(dy, y), b)), like=b)
    return da, db


@vjp("Neg")
def neg_vjp(ctx, dy):
    """y = -x  ->  dx = -dy"""
    return (ctx.emit.Neg(dy),)


@vjp("Pow")
def pow_vjp(ctx, dy):
    """y = a ^ b  ->  da = dy * b * a^(b-1), db = dy * y * log(a)

    b may have another element type than a (opset >= 12).  Real a^b is not
    differentiable in b where a <= 0: db is taken as 0 there (log(a) is
    replaced by 0), which also keeps 0 * log(0) from producing NaN.

    A constant b of 2 or 3 (RMSNorm's x^2) needs no Pow: a^1 is a and a^2 is
    a * a, the same numbers (pow(a, 1) = a exactly, and onnxruntime computes
    Pow(a, 2) as a * a), at the cost of a Mul instead of a libm pow per element."""
    a, b = ctx.inputs
    (y,) = ctx.outputs
    e = ctx.emit
    da = db = None
    if ctx.needs(0):
        bf = e.cast_to(b, ctx.dtype(a))
        power = _power_less_one(ctx, a, b)
        if power is None:
            power = e.Pow(a, e.Sub(bf, ctx.const(1.0, like=a)))
        slope = e.Mul(bf, power)
        da = ctx.unbroadcast(e.Mul(dy, slope), like=a)
    if ctx.needs(1) and is_float(ctx, b):
        positive = e.Greater(a, ctx.const(0.0, like=a))
        log_a = e.Log(e.Where(positive, a, ctx.const(1.0, like=a)))
        grad = e.cast_to(e.Mul(e.Mul(dy, y), log_a), ctx.dtype(b))
        db = ctx.unbroadcast(grad, like=b)
    return da, db


def _power_less_one(ctx: VJPContext, a: str, b: str) -> str | None:
    """a^(b-1) without Pow where b is a constant 2 or 3 (every element), else None."""
    known = ctx.emit.constants.get(b)
    if known is None or known.size == 0 or not (known == known.reshape(-1)[0]).all():
        return None
    p = float(known.reshape(-1)[0])
    if p == 2.0:
        return a
    if p == 3.0:
        return ctx.emit.Mul(a, a)
    return None


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


@vjp("Mean")
def mean_vjp(ctx, dy):
    """y = (x1 + ... + xn) / n  ->  dxi = dy / n   (summed over broadcast axes)"""
    xs = ctx.inputs
    share = ctx.emit.Div(dy, ctx.const(float(len(xs)), like=dy))
    return tuple(ctx.unbroadcast(share, like=x) if ctx.needs(i) else None for i, x in enumerate(xs))


@vjp("Max", "Min")
def minmax_vjp(ctx, dy):
    """y = max(x1, ..., xn) (or min)  ->  dxi = dy * [xi == y] / #{j : xj == y}

    Ties split the gradient evenly between the inputs that reach the extremum
    (the average of the one-sided derivatives), then each share is summed over
    the axes its input was broadcast along."""
    xs = ctx.inputs
    (y,) = ctx.outputs
    e = ctx.emit
    if len(xs) == 1:
        return (dy,)
    et = ctx.dtype(y)
    hits = [e.Cast(ctx.emit.float_equal(x, y), to=et) for x in xs]
    share = e.Div(dy, e.sum_all(hits))
    return tuple(
        ctx.unbroadcast(e.Mul(share, hit), like=x) if ctx.needs(i) else None
        for i, (x, hit) in enumerate(zip(xs, hits))
    )


@vjp("Mod")
def mod_vjp(ctx, dy):
    """y = fmod(a, b) = a - b * trunc(a / b)  ->  da = dy, db = -dy * trunc(a / b)

    Float Mod requires fmod=1.  trunc(a / b) is read off the forward output as
    (a - y) / b, an integer up to rounding.  Integer Mod has no gradient."""
    a, b = ctx.inputs
    (y,) = ctx.outputs
    e = ctx.emit
    if not (ctx.needs(0) or ctx.needs(1)):
        return None, None
    if not ctx.attr("fmod"):
        raise GradientError(f"Mod node {ctx.node.name!r}: float Mod needs fmod=1, found fmod=0")
    da = ctx.unbroadcast(dy, like=a) if ctx.needs(0) else None
    db = None
    if ctx.needs(1):
        quotient = e.Div(e.Sub(a, y), b)
        db = ctx.unbroadcast(e.Neg(e.Mul(dy, quotient)), like=b)
    return da, db


@vjp("Where")
def where_vjp(ctx, dy):
    """y = cond ? a : b  ->  da = cond ? dy : 0, db = cond ? 0 : dy   (cond gets none)"""
    cond, a, b = ctx.inputs
    e = ctx.emit
    zero = ctx.const(0.0, like=dy)
    return (
        None,
        ctx.unbroadcast(e.Where(cond, dy, zero), like=a) if ctx.needs(1) else None,
        ctx.unbroadcast(e.Where(cond, zero, dy), like=b) if ctx.needs(2) else None,
    )


@vjp("Cast")
def cast_vjp(ctx, dy):
    """y = cast(x)  ->  dx = cast(dy) back to x's type; none when x is not floating"""
    (x,) = ctx.inputs
    if not (ctx.needs(0) and is_float(ctx, x)):
        return (None,)
    return (ctx.emit.cast_to(dy, ctx.dtype(x)),)


@vjp("CastLike", nondiff=(1,))
def cast_like_vjp(ctx, dy):
    """y = cast(x, like target)  ->  dx = cast(dy) back to x's type; target gets none"""
    x = ctx.inputs[0]
    if not (ctx.needs(0) and is_float(ctx, x)):
        return None, None
    return ctx.emit.cast_to(dy, ctx.dtype(x)), None


# ------------------------------------------------------------- unary math


@vjp("Sqrt")
def sqrt_vjp(ctx, dy):
    """y = sqrt(x)  ->  dx = dy / (2 y)   (reuses y)"""
    (y,) = ctx.outputs
    e = ctx.emit
    return (e.Div(dy, e.Mul(ctx.const(2.0, like=y), y)),)


@vjp("Exp")
def exp_vjp(ctx, dy):
    """y = exp(x)  ->  dx = dy * y   (reuses y)"""
    return _unary(ctx, dy, ctx.outputs[0])


@vjp("Log")
def log_vjp(ctx, dy):
    """y = log(x)  ->  dx = dy / x"""
    return (ctx.emit.Div(dy, ctx.inputs[0]),)


@vjp("Reciprocal")
def reciprocal_vjp(ctx, dy):
    """y = 1 / x  ->  dx = -dy / x^2 = -dy * y^2   (reuses y)"""
    (y,) = ctx.outputs
    e = ctx.emit
    return (e.Neg(e.Mul(dy, e.Mul(y, y))),)


@vjp("Abs")
def abs_vjp(ctx, dy):
    """y = |x|  ->  dx = dy * sign(x)   (0 at x = 0)"""
    return _unary(ctx, dy, ctx.emit.sign(ctx.inputs[0]))


@vjp("Erf")
def erf_vjp(ctx, dy):
    """y = erf(x)  ->  dx = dy * 2 / sqrt(pi) * exp(-x^2)"""
    (x,) = ctx.inputs
    e = ctx.emit
    gauss = e.Exp(e.Neg(e.Mul(x, x)))
    return _unary(ctx, dy, e.Mul(gauss, ctx.const(2.0 / math.sqrt(math.pi), like=x)))


@vjp("Sin")
def sin_vjp(ctx, dy):
    """y = sin(x)  ->  dx = dy * cos(x)"""
    return _unary(ctx, dy, ctx.emit.Cos(ctx.inputs[0]))


@vjp("Cos")
def cos_vjp(ctx, dy):
    """y = cos(x)  ->  dx = -dy * sin(x)"""
    e = ctx.emit
    return (e.Neg(e.Mul(dy, e.Sin(ctx.inputs[0]))),)


@vjp("Tan")
def tan_vjp(ctx, dy):
    """y = tan(x)  ->  dx = dy * (1 + y^2)   (reuses y)"""
    (y,) = ctx.outputs
    e = ctx.emit
    return _unary(ctx, dy, e.Add(ctx.const(1.0, like=y), e.Mul(y, y)))


def _one_minus_square(ctx: VJPContext, x: str) -> str:
    """1 - x^2"""
    e = ctx.emit
    return e.Sub(ctx.const(1.0, like=x), e.Mul(x, x))


@vjp("Asin")
def asin_vjp(ctx, dy):
    """y = asin(x)  ->  dx = dy / sqrt(1 - x^2)"""
    e = ctx.emit
    return (e.Div(dy, e.Sqrt(_one_minus_square(ctx, ctx.inputs[0]))),)


@vjp("Acos")
def acos_vjp(ctx, dy):
    """y = acos(x)  ->  dx = -dy / sqrt(1 - x^2)"""
    e = ctx.emit
    return (e.Neg(e.Div(dy, e.Sqrt(_one_minus_square(ctx, ctx.inputs[0])))),)


@vjp("Atan")
def atan_vjp(ctx, dy):
    """y = atan(x)  ->  dx = dy / (1 + x^2)"""
    (x,) = ctx.inputs
    e = ctx.emit
    return (e.Div(dy, e.Add(ctx.const(1.0, like=x), e.Mul(x, x))),)


@vjp("Sinh")
def sinh_vjp(ctx, dy):
    """y = sinh(x)  ->  dx = dy * cosh(x)"""
    return _unary(ctx, dy, ctx.emit.Cosh(ctx.inputs[0]))


@vjp("Cosh")
def cosh_vjp(ctx, dy):
    """y = cosh(x)  ->  dx = dy * sinh(x)"""
    return _unary(ctx, dy, ctx.emit.Sinh(ctx.inputs[0]))


@vjp("Asinh")
def asinh_vjp(ctx, dy):
    """y = asinh(x)  ->  dx = dy / sqrt(x^2 + 1)"""
    (x,) = ctx.inputs
    e = ctx.emit
    return (e.Div(dy, e.Sqrt(e.Add(e.Mul(x, x), ctx.const(1.0, like=x)))),)


@vjp("Acosh")
def acosh_vjp(ctx, dy):
    """y = acosh(x)  ->  dx = dy / sqrt(x^2 - 1)"""
    (x,) = ctx.inputs
    e = ctx.emit
    return (e.Div(dy, e.Sqrt(e.Sub(e.Mul(x, x), ctx.const(1.0, like=x)))),)


@vjp("Atanh")
def atanh_vjp(ctx, dy):
    """y = atanh(x)  ->  dx = dy / (1 - x^2)"""
    return (ctx.emit.Div(dy, _one_minus_square(ctx, ctx.inputs[0])),)


# ------------------------------------------------------------ activations


@vjp("Relu")
def relu_vjp(ctx, dy):
    """y = max(x, 0)  ->  dx = dy * [y > 0]   (0 at the kink)"""
    (y,) = ctx.outputs
    return (where_zero(ctx, ctx.emit.Greater(y, ctx.const(0.0, like=y)), dy),)


@vjp("Sigmoid")
def sigmoid_vjp(ctx, dy):
    """y = 1 / (1 + exp(-x))  ->  dx = dy * y * (1 - y)   (reuses y)"""
    (y,) = ctx.outputs
    e = ctx.emit
    return _unary(ctx, dy, e.Mul(y, e.Sub(ctx.const(1.0, like=y), y)))


@vjp("Tanh")
def tanh_vjp(ctx, dy):
    """y = tanh(x)  ->  dx = dy * (1 - y^2)   (reuses y)"""
    return _unary(ctx, dy, _one_minus_square(ctx, ctx.outputs[0]))


@vjp("LeakyRelu")
def leaky_relu_vjp(ctx, dy):
    """y = x > 0 ? x : alpha x  ->  dx = x > 0 ? dy : alpha dy"""
    (x,) = ctx.inputs
    e = ctx.emit
    alpha = ctx.const(ctx.attr("alpha"), like=x)
    positive = e.Greater(x, ctx.const(0.0, like=x))
    return (e.Where(positive, dy, e.Mul(dy, alpha)),)


@vjp("PRelu")
def prelu_vjp(ctx, dy):
    """y = x > 0 ? x : slope x  ->  dx = x > 0 ? dy : slope dy, dslope = x > 0 ? 0 : dy x

    slope broadcasts to x, so dslope is summed over the broadcast axes."""
    x, slope = ctx.inputs
    e = ctx.emit
    positive = e.Greater(x, ctx.const(0.0, like=x))
    zero = ctx.const(0.0, like=x)
    dx = e.Where(positive, dy, e.Mul(dy, slope)) if ctx.needs(0) else None
    dslope = None
    if ctx.needs(1):
        dslope = ctx.unbroadcast(e.Where(positive, zero, e.Mul(dy, x)), like=slope)
    return dx, dslope


@vjp("Elu")
def elu_vjp(ctx, dy):
    """y = x > 0 ? x : alpha (exp(x) - 1)  ->  dx = x > 0 ? dy : dy (y + alpha)   (reuses y)"""
    (x,) = ctx.inputs
    (y,) = ctx.outputs
    e = ctx.emit
    alpha = ctx.const(ctx.attr("alpha"), like=x)
    positive = e.Greater(x, ctx.const(0.0, like=x))
    return (e.Where(positive, dy, e.Mul(dy, e.Add(y, alpha))),)


@vjp("Selu")
def selu_vjp(ctx, dy):
    """y = gamma (x > 0 ? x : alpha (exp(x) - 1))

    dx = x > 0 ? gamma dy : dy (y + gamma alpha)   (reuses y)"""
    (x,) = ctx.inputs
    (y,) = ctx.outputs
    e = ctx.emit
    alpha = ctx.attr("alpha", 1.67326319217681884765625)
    gamma = ctx.attr("gamma", 1.05070102214813232421875)
    positive = e.Greater(x, ctx.const(0.0, like=x))
    inside = e.Mul(dy, ctx.const(gamma, like=x))
    outside = e.Mul(dy, e.Add(y, ctx.const(gamma * alpha, like=x)))
    return (e.Where(positive, inside, outside),)


@vjp("Celu")
def celu_vjp(ctx, dy):
    """y = max(0, x) + min(0, alpha (exp(x / alpha) - 1))

    dx = x > 0 ? dy : dy exp(x / alpha) = dy (y / alpha + 1)   (reuses y)"""
    (x,) = ctx.inputs
    (y,) = ctx.outputs
    e = ctx.emit
    alpha = ctx.const(ctx.attr("alpha"), like=x)
    positive = e.Greater(x, ctx.const(0.0, like=x))
    slope = e.Add(e.Div(y, alpha), ctx.const(1.0, like=x))
    return (e.Where(positive, dy, e.Mul(dy, slope)),)


@vjp("ThresholdedRelu")
def thresholded_relu_vjp(ctx, dy):
    """y = x > alpha ? x : 0  ->  dx = x > alpha ? dy : 0"""
    (x,) = ctx.inputs
    above = ctx.emit.Greater(x, ctx.const(ctx.attr("alpha"), like=x))
    return (where_zero(ctx, above, dy),)


@vjp("Shrink")
def shrink_vjp(ctx, dy):
    """y = x < -lambd ? x + bias : x > lambd ? x - bias : 0  ->  dx = |x| > lambd ? dy : 0"""
    (x,) = ctx.inputs
    e = ctx.emit
    lambd = ctx.attr("lambd")
    outside = e.Or(e.Less(x, ctx.const(-lambd, like=x)), e.Greater(x, ctx.const(lambd, like=x)))
    return (where_zero(ctx, outside, dy),)


@vjp("HardSigmoid")
def hard_sigmoid_vjp(ctx, dy):
    """y = max(0, min(1, alpha x + beta))  ->  dx = 0 < y < 1 ? alpha dy : 0   (reuses y)"""
    (y,) = ctx.outputs
    e = ctx.emit
    alpha = ctx.attr("alpha")
    inside = e.And(e.Greater(y, ctx.const(0.0, like=y)), e.Less(y, ctx.const(1.0, like=y)))
    return (where_zero(ctx, inside, e.Mul(dy, ctx.const(alpha, like=y))),)


@vjp("HardSwish")
def hard_swish_vjp(ctx, dy):
    """y = x max(0, min(1, x / 6 + 1/2))  ->  dx = dy * (x < -3 ? 0 : x > 3 ? 1 : x / 3 + 1/2)"""
    (x,) = ctx.inputs
    e = ctx.emit
    ramp = e.Add(e.Div(x, ctx.const(3.0, like=x)), ctx.const(0.5, like=x))
    slope = e.Where(
        e.Greater(x, ctx.const(3.0, like=x)),
        ctx.const(1.0, like=x),
        e.Where(e.Less(x, ctx.const(-3.0, like=x)), ctx.const(0.0, like=x), ramp),
    )
    return _unary(ctx, dy, slope)


@vjp("Softplus")
def softplus_vjp(ctx, dy):
    """y = log(1 + exp(x))  ->  dx = dy * sigmoid(x)"""
    return _unary(ctx, dy, ctx.emit.Sigmoid(ctx.inputs[0]))


@vjp("Softsign")
def softsign_vjp(ctx, dy):
    """y = x / (1 + |x|)  ->  dx = dy / (1 + |x|)^2"""
    (x,) = ctx.inputs
    e = ctx.emit
    denom = e.Add(ctx.const(1.0, like=x), e.Abs(x))
    return (e.Div(dy, e.Mul(denom, denom)),)


@vjp("Mish")
def mish_vjp(ctx, dy):
    """y = x tanh(softplus(x))

    dx = dy * (t + x sigmoid(x) (1 - t^2))  with t = tanh(softplus(x))"""
    (x,) = ctx.inputs
    e = ctx.emit
    t = e.Tanh(e.Softplus(x))
    slope = e.Add(t, e.Mul(e.Mul(x, e.Sigmoid(x)), _one_minus_square(ctx, t)))
    return _unary(ctx, dy, slope)


def gelu_slope(ctx, x: str) -> str:
    """d/dx [x Phi(x)] = Phi(x) + x phi(x):  Phi(x) = (1 + erf(x / sqrt 2)) / 2, phi(x) = exp(-x^2 / 2) / sqrt(2 pi)."""
    e = ctx.emit
    c = lambda v: ctx.const(v, like=x)  # noqa: E731
    cdf = e.Mul(c(0.5), e.Add(c(1.0), e.Erf(e.Mul(x, c(math.sqrt(0.5))))))
    pdf = e.Mul(e.Exp(e.Mul(e.Mul(x, x), c(-0.5))), c(1.0 / math.sqrt(2.0 * math.pi)))
    return e.Add(cdf, e.Mul(x, pdf))


@vjp("Gelu")
def gelu_vjp(ctx, dy):
    """y = x Phi(x)  ->  dx = dy * (Phi(x) + x phi(x))

    approximate='none': Phi(x) = (1 + erf(x / sqrt 2)) / 2, phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
    approximate='tanh': y = x (1 + tanh(u)) / 2 with u = sqrt(2 / pi) (x + 0.044715 x^3), so
        dx = dy * ((1 + t) / 2 + x (1 - t^2) u' / 2),  t = tanh(u),
        u' = sqrt(2 / pi) (1 + 3 * 0.044715 x^2)."""
    (x,) = ctx.inputs
    e = ctx.emit
    approximate = ctx.attr("approximate")
    if approximate == "none":
        return _unary(ctx, dy, gelu_slope(ctx, x))
    if approximate == "tanh":
        half = ctx.const(0.5, like=x)
        k = math.sqrt(2.0 / math.pi)
        c = 0.044715
        x2 = e.Mul(x, x)
        u = e.Mul(ctx.const(k, like=x), e.Add(x, e.Mul(ctx.const(c, like=x), e.Mul(x2, x))))
        t = e.Tanh(u)
        du = e.Mul(
            ctx.const(k, like=x),
            e.Add(ctx.const(1.0, like=x), e.Mul(ctx.const(3.0 * c, like=x), x2)),
        )
        left = e.Mul(half, e.Add(ctx.const(1.0, like=x), t))
        right = e.Mul(e.Mul(half, x), e.Mul(_one_minus_square(ctx, t), du))
        return _unary(ctx, dy, e.Add(left, right))
    raise GradientError(
        f"Gelu node {ctx.node.name!r}: approximate must be 'none' or 'tanh', found {approximate!r}"
    )


@vjp("Clip")
def clip_vjp(ctx, dy):
    """y = min(max(x, lo), hi)  ->  dx = lo < x < hi ? dy : 0,
    dlo = sum(x < lo < hi ? dy : 0), dhi = sum(max(x, lo) > hi ? dy : 0)

    The gradient flows strictly inside the bounds: at x == lo or x == hi no
    input gets any.  Before opset 11 the bounds are float attributes, from 11
    optional scalar inputs (then they get gradients too)."""
    e = ctx.emit
    x = ctx.inputs[0]
    if ctx.opset < 11:
        # an absent bound is no bound (not the schema's float extremes)
        lo_value = ctx.attr("min") if ctx.has_attr("min") else None
        hi_value = ctx.attr("max") if ctx.has_attr("max") else None
        lo = None if lo_value is None else ctx.const(lo_value, like=x)
        hi = None if hi_value is None else ctx.const(hi_value, like=x)
    else:
        lo, hi = ctx.input(1), ctx.input(2)
    inside = None
    for bound_ok in (
        None if lo is None else e.Greater(x, lo),
        None if hi is None else e.Less(x, hi),
    ):
        if bound_ok is not None:
            inside = bound_ok if inside is None else e.And(inside, bound_ok)
    dx = None
    if ctx.needs(0):
        dx = dy if inside is None else where_zero(ctx, inside, dy)
    dlo = dhi = None
    if lo is not None and ctx.needs(1):
        below = e.Less(x, lo)
        if hi is not None:
            below = e.And(below, e.Less(lo, hi))
        dlo = _sum_to_scalar_like(ctx, where_zero(ctx, below, dy), lo)
    if hi is not None and ctx.needs(2):
        raised = x if lo is None else e.Max(x, lo)
        dhi = _sum_to_scalar_like(ctx, where_zero(ctx, e.Greater(raised, hi), dy), hi)
    return (dx, dlo, dhi)[: len(ctx.inputs)]


def _sum_to_scalar_like(ctx: VJPContext, grad: str, like: str) -> str:
    """Sum every element of ``grad`` into a tensor shaped like the one-element ``like``."""
    e = ctx.emit
    return e.Reshape(e.reduce_sum(grad, None, keepdims=False), e.Shape(like))
