"""Gradient rules: normalization layers (BatchNormalization, InstanceNormalization,
LayerNormalization, GroupNormalization, LpNormalization, MeanVarianceNormalization, LRN)."""

from __future__ import annotations

import numpy as np

from ...errors import TrainingModelError
from ..registry import VJPContext, vjp
from ._common import dims_of


# ------------------------------------------------------------ normalization
def _per_channel(ctx: VJPContext, v: str, rank: int) -> str:
    """A (C,) vector shaped (C, 1, ..., 1) to broadcast against (N, C, D...)."""
    return ctx.emit.unsqueeze(v, list(range(1, rank - 1))) if rank > 2 else v


def _normalize_backward(ctx: VJPContext, g: str, xhat: str, inv_std: str, axes: list[int]) -> str:
    """x -> xhat = (x - mean(x)) * inv_std over ``axes``; given g = dL/dxhat:
    dx = inv_std * (g - mean(g) - xhat * mean(g * xhat))"""
    e = ctx.emit
    mean_g = e.reduce_mean(g, axes, keepdims=True)
    mean_gx = e.reduce_mean(e.Mul(g, xhat), axes, keepdims=True)
    return e.Mul(inv_std, e.Sub(e.Sub(g, mean_g), e.Mul(xhat, mean_gx)))


def _batch_stats(ctx: VJPContext, x: str, axes: list[int], eps: float) -> tuple[str, str]:
    """(xhat, inv_std) with the biased variance over ``axes``.

    The ONNX ops do not output their batch statistics, so the backward pass
    computes them (two reductions; the normalized output itself is not redone
    beyond xhat)."""
    e = ctx.emit
    centred = e.Sub(x, e.reduce_mean(x, axes, keepdims=True))
    var = e.reduce_mean(e.Mul(centred, centred), axes, keepdims=True)
    inv_std = e.Reciprocal(e.Sqrt(e.Add(var, ctx.const(eps, like=x))))
    return e.Mul(centred, inv_std), inv_std


@vjp("BatchNormalization")
def batch_norm_vjp(ctx, dy, *d_stats):
    """y = scale * xhat + B, xhat = (x - mu) / sqrt(var + eps), per channel

    Inference (training_mode=0; before opset 14, a node with only Y): mu, var
    are the inputs mean and var:
        dx = dy * scale / sqrt(var + eps), dscale = sum(dy * xhat), dB = sum(dy)
        dmean = -dB * scale / sqrt(var + eps), dvar = -dscale * scale / (2 (var + eps))
    Training (training_mode=1; before opset 14, a node with the extra outputs):
    mu, var are the batch statistics (biased variance) over N and the spatial
    axes, M elements per channel:
        dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * scale
    The running statistics r_mean = m * mean + (1 - m) * mu and
    r_var = m * var + (1 - m) * sigma2 (m = momentum) add
        dmean = m * d_rmean, dvar = m * d_rvar,
        dx += ((1 - m) * d_rmean + 2 (1 - m) * d_rvar * (x - mu)) / M
    and before opset 14 the saved statistics (onnxruntime's saved_mean = mu,
    saved_var = inv_std = (sigma2 + eps)^(-1/2)) add
        dx += (d_saved_mean - d_saved_var * inv_std^2 * xhat) / M."""
    e = ctx.emit
    x, scale = ctx.inputs[0], ctx.inputs[1]
    mean, var = ctx.inputs[3], ctx.inputs[4]
    r = ctx.require_rank(x)
    axes = [0] + list(range(2, r))
    eps = float(ctx.attr("epsilon"))
    if ctx.opset >= 14:
        training = bool(ctx.attr("training_mode", 0))
    else:
        training = sum(1 for o in ctx.outputs if o) > 1
    if training:
        xhat, inv_std = _batch_stats(ctx, x, axes, eps)
    else:
        inv_c = e.Reciprocal(e.Sqrt(e.Add(var, ctx.const(eps, like=var))))
        inv_std = _per_channel(ctx, inv_c, r)
        xhat = e.Mul(e.Sub(x, _per_channel(ctx, mean, r)), inv_std)
    if dy is None:
        dy = e.zeros_like(x)
    d_b = e.reduce_sum(dy, axes, keepdims=False) if (ctx.needs(2) or ctx.needs(3)) else None
    d_scale = e.reduce_sum(e.Mul(dy, xhat), axes, keepdims=False) if (ctx.needs(1) or ctx.needs(4)) else None
    dx = dmean = dvar = None
    if ctx.needs(0):
        if training:
            dx = _normalize_backward(ctx, e.Mul(dy, _per_channel(ctx, scale, r)), xhat, inv_std, axes)
        else:
            dx = e.Mul(dy, e.Mul(_per_channel(ctx, scale, r), inv_std))
    if not training and ctx.needs(3):
        dmean = e.Neg(e.Mul(d_b, e.Mul(scale, inv_c)))
    if not training and ctx.needs(4):
        half = ctx.const(-0.5, like=var)
        dvar = e.Mul(e.Mul(d_scale, scale), e.Mul(half, e.Mul(inv_c, inv_c)))
    if training:
        d_stats = tuple(d_stats) + (None,) * (4 - len(d_stats))
        d_rmean, d_rvar, d_smean, d_svar = d_stats
        momentum = float(ctx.attr("momentum"))
        et = ctx.dtype(x)
        stats = []  # per-channel terms, summed, then spread over the M elements
        if d_rmean is not None:
            stats.append(e.Mul(_per_channel(ctx, d_rmean, r), ctx.const(1.0 - momentum, dtype=et)))
        if d_rvar is not None:
            centred = e.Div(xhat, inv_std)
            stats.append(e.Mul(e.Mul(_per_channel(ctx, d_rvar, r), ctx.const(2.0 * (1.0 - momentum), dtype=et)), centred))
        if d_smean is not None:
            stats.append(_per_channel(ctx, d_smean, r))
        if d_svar is not None:
            stats.append(e.Neg(e.Mul(e.Mul(_per_channel(ctx, d_svar, r), e.Mul(inv_std, inv_std)), xhat)))
        if stats and ctx.needs(0):
            count = e.Cast(e.Div(e.Size(x), e.dim(x, 1)), to=et)
            total = stats[0]
            for t in stats[1:]:  # per-channel and x-shaped terms: Add broadcasts (no Expand at opset 7)
                total = e.Add(total, t)
            dx = e.Add(dx, e.Div(total, count))
        m = ctx.const(momentum, dtype=ctx.dtype(mean))
        if ctx.needs(3):
            dmean = e.Mul(d_rmean, m) if d_rmean is not None else e.zeros_like(mean)
        if ctx.needs(4):
            dvar = e.Mul(d_rvar, m) if d_rvar is not None else e.zeros_like(var)
    return (
        dx,
        d_scale if ctx.needs(1) else None,
        d_b if ctx.needs(2) else None,
        dmean,
        dvar,
    )


@vjp("InstanceNormalization")
def instance_norm_vjp(ctx, dy):
    """y = scale[c] * xhat + B[c], xhat normalized over the spatial axes of each (n, c)
    ->  dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * scale
        dscale = sum_{n, spatial}(dy * xhat), dB = sum_{n, spatial}(dy)"""
    e = ctx.emit
    x, scale = ctx.inputs[0], ctx.inputs[1]
    r = ctx.require_rank(x)
    spatial = list(range(2, r))
    xhat, inv_std = _batch_stats(ctx, x, spatial, float(ctx.attr("epsilon")))
    dx = (
        _normalize_backward(ctx, e.Mul(dy, _per_channel(ctx, scale, r)), xhat, inv_std, spatial)
        if ctx.needs(0)
        else None
    )
    d_scale = e.reduce_sum(e.Mul(dy, xhat), [0] + spatial, keepdims=False) if ctx.needs(1) else None
    d_b = e.reduce_sum(dy, [0] + spatial, keepdims=False) if ctx.needs(2) else None
    return dx, d_scale, d_b


@vjp("LayerNormalization")
def layer_norm_vjp(ctx, dy, d_mean=None, d_inv_std=None):
    """y = scale * xhat + B, xhat = (x - mean) * inv_std over axes [axis, rank),
    inv_std = (var + eps)^(-1/2), var = mean((x - mean)^2), M elements per group
    ->  dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * scale
           + (d_mean - d_inv_std * inv_std^2 * xhat) / M
        dscale = sum_broadcast(dy * xhat), dB = sum_broadcast(dy)

    mean and inv_std are the node's optional Mean/InvStdDev outputs (added to
    the node when absent; cast from stash_type to x's type).  Their own
    cotangents (a loss that reads them) enter dx through the last term:
    d mean / dx_i = 1 / M and d inv_std / dx_i = -inv_std^2 * xhat_i / M."""
    e = ctx.emit
    x, scale = ctx.inputs[0], ctx.inputs[1]
    bias = ctx.input(2)
    r = ctx.require_rank(x)
    axes = list(range(int(ctx.attr("axis")) % r, r))
    et = ctx.dtype(x)
    mean_out = ctx.forward_output(1)
    mean = e.cast_to(mean_out, et)
    inv_std = e.cast_to(ctx.forward_output(2), et)
    xhat = e.Mul(e.Sub(x, mean), inv_std)
    x_dims = dims_of(ctx, x, r)
    dx = d_scale = d_b = None
    if ctx.needs(0):
        parts = []
        if dy is not None:
            parts.append(_normalize_backward(ctx, e.Mul(dy, scale), xhat, inv_std, axes))
        stats = None
        if d_mean is not None:
            stats = e.cast_to(d_mean, et)
        if d_inv_std is not None:
            term = e.Mul(e.Mul(e.cast_to(d_inv_std, et), e.Mul(inv_std, inv_std)), xhat)
            stats = e.Neg(term) if stats is None else e.Sub(stats, term)
        if stats is not None:
            count = e.Cast(e.Div(e.Size(x), e.Size(mean_out)), to=et)
            parts.append(e.Div(e.Expand(stats, e.Shape(x)), count))
        dx = e.sum_all(parts)
    if dy is not None and ctx.needs(1):
        d_scale = ctx.unbroadcast(
            e.Mul(dy, xhat), scale, out_dims=x_dims, like_dims=dims_of(ctx, scale, ctx.require_rank(scale))
        )
    if dy is not None and bias is not None and ctx.needs(2):
        bias_dims = dims_of(ctx, bias, ctx.require_rank(bias))
        d_b = ctx.unbroadcast(dy, bias, out_dims=x_dims, like_dims=bias_dims)
    if dy is None:
        d_scale = e.zeros_like(scale) if ctx.needs(1) else None
        d_b = e.zeros_like(bias) if bias is not None and ctx.needs(2) else None
    return (dx, d_scale, d_b)[: len(ctx.inputs)]


@vjp("GroupNormalization")
def group_norm_vjp(ctx, dy):
    """x viewed as (N, G, rest); xhat normalized over rest per (n, g)
    y = scale * xhat + bias, per channel (opset >= 21) or per group (opset 18)
    ->  dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * scale (group view)
        dscale = sum(dy * xhat), dbias = sum(dy) over everything but the channel/group"""
    e = ctx.emit
    x, scale = ctx.inputs[0], ctx.inputs[1]
    groups = int(ctx.attr("num_groups"))
    eps = float(ctx.attr("epsilon"))
    r = ctx.require_rank(x)
    view = e.ints([0, groups, -1])
    xg = e.Reshape(x, view)
    xhat_g, inv_std = _batch_stats(ctx, xg, [2], eps)
    dyg = e.Reshape(dy, view)
    per_group = ctx.opset < 21
    if per_group:
        scale_v = e.unsqueeze(scale, [1])  # (G, 1) against (N, G, rest)
        g = e.Mul(dyg, scale_v)
        d_scale = e.reduce_sum(e.Mul(dyg, xhat_g), [0, 2], keepdims=False) if ctx.needs(1) else None
        d_b = e.reduce_sum(dyg, [0, 2], keepdims=False) if ctx.needs(2) else None
    else:
        g = e.Reshape(e.Mul(dy, _per_channel(ctx, scale, r)), view)
        xhat = e.Reshape(xhat_g, e.Shape(x))
        axes = [0] + list(range(2, r))
        d_scale = e.reduce_sum(e.Mul(dy, xhat), axes, keepdims=False) if ctx.needs(1) else None
        d_b = e.reduce_sum(dy, axes, keepdims=False) if ctx.needs(2) else None
    dx = e.Reshape(_normalize_backward(ctx, g, xhat_g, inv_std, [2]), e.Shape(x)) if ctx.needs(0) else None
    return dx, d_scale, d_b


@vjp("LpNormalization")
def lp_normalization_vjp(ctx, dy):
    """y = x / ||x||_p along axis (p = 1 or 2)
    ->  p = 2: dx = (dy - y * sum(dy * y)) / ||x||_2
        p = 1: dx = (dy - sign(x) * sum(dy * y)) / ||x||_1"""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    axis = int(ctx.attr("axis"))
    p = int(ctx.attr("p"))
    if p not in (1, 2):
        raise TrainingModelError(f"gradient of LpNormalization node {ctx.node.name!r}: p must be 1 or 2, found {p}")
    norm = e.reduce("ReduceL2" if p == 2 else "ReduceL1", x, [axis], keepdims=True)
    proj = e.reduce_sum(e.Mul(dy, y), [axis], keepdims=True)
    direction = y if p == 2 else e.sign(x)
    return (e.Div(e.Sub(dy, e.Mul(direction, proj)), norm),)


@vjp("MeanVarianceNormalization")
def mean_variance_normalization_vjp(ctx, dy):
    """y = c / (s + eps), c = x - mean(x), s = sqrt(mean(c^2)), eps = 1e-9 (the spec's function)
    ->  dc = dy / (s + eps) - c * mean(dy * c) / (s (s + eps)^2),  dx = dc - mean(dc)"""
    e = ctx.emit
    x = ctx.inputs[0]
    axes = [int(a) for a in ctx.attr("axes")]
    c = e.Sub(x, e.reduce_mean(x, axes, keepdims=True))
    s = e.Sqrt(e.reduce_mean(e.Mul(c, c), axes, keepdims=True))
    t = e.Add(s, ctx.const(1e-9, like=x))
    dc = e.Sub(
        e.Div(dy, t),
        e.Div(e.Mul(c, e.reduce_mean(e.Mul(dy, c), axes, keepdims=True)), e.Mul(s, e.Mul(t, t))),
    )
    return (e.Sub(dc, e.reduce_mean(dc, axes, keepdims=True)),)


@vjp("LRN")
def lrn_vjp(ctx, dy):
    """y = x * S^-beta, S[c] = bias + alpha/size * sum_{j in win(c)} x[j]^2,
    win(c) = [c - floor((size-1)/2), c + ceil((size-1)/2)] over channels
    ->  dx = dy * S^-beta - (2 alpha beta / size) * x * sum_{c: j in win(c)} dy[c] x[c] S[c]^(-beta-1)

    The channel-window sums are Convs with a (size, 1) ones kernel over the
    (N, 1, C, rest) view; the transposed window swaps the pads.  S is not an
    output of the op, so the backward pass computes it."""
    e = ctx.emit
    x = ctx.inputs[0]
    size = int(ctx.attr("size"))
    alpha, beta, bias = float(ctx.attr("alpha")), float(ctx.attr("beta")), float(ctx.attr("bias"))
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    et = ctx.dtype(x)
    ones = ctx.const(np.ones((1, 1, size, 1)), dtype=et)
    view = e.Concat(e.shape_of(x, 0, 1), e.ints([1]), e.shape_of(x, 1, 2), e.ints([-1]), axis=0)

    def window_sum(t: str, before: int, after: int) -> str:
        pads = [before, 0, after, 0] if before or after else None
        return e.Reshape(e.Conv(e.Reshape(t, view), ones, pads=pads), e.Shape(x))

    s = e.Add(ctx.const(bias, dtype=et), e.Mul(ctx.const(alpha / size, dtype=et), window_sum(e.Mul(x, x), lo, hi)))
    s_pow = e.Pow(s, ctx.const(-beta, dtype=et))  # S^-beta
    t = e.Div(e.Mul(e.Mul(dy, x), s_pow), s)  # dy * x * S^(-beta-1)
    back = window_sum(t, hi, lo)
    coef = ctx.const(2.0 * alpha * beta / size, dtype=et)
    return (e.Sub(e.Mul(dy, s_pow), e.Mul(coef, e.Mul(x, back))),)
