"""Gradient rules: onnxruntime's fused normalizations, as the onnxruntime-genai
builder and onnxruntime's transformer optimizer write them.

* ``SimplifiedLayerNormalization`` (RMS norm; onnxruntime registers it in the
  default domain, and a model may also spell it in com.microsoft);
* com.microsoft ``SkipSimplifiedLayerNormalization`` (residual add + RMS norm)
  and ``SkipLayerNormalization`` (residual add + layer norm), whose fourth
  output, the sum ``input + skip (+ bias)``, feeds the next residual and so
  carries a gradient of its own.

The optional statistics outputs (mean, inv_std_var) are not differentiated:
a loss that reads them is refused.  ``stash_type`` only matters for 16-bit
inputs (onnxruntime then accumulates in float32); the rules compute in the
input's type.  The rules read only the node's inputs (they recompute the
statistics), never its outputs.
"""

from __future__ import annotations

from ...errors import GradientError
from ..registry import VJPContext, vjp

MS = "com.microsoft"


def _refuse_stats(ctx: VJPContext, *d_stats: str | None) -> None:
    if any(d is not None for d in d_stats):
        raise GradientError(
            f"{ctx.node.op_type} node {ctx.node.name!r}: a gradient flows into its mean/inv_std_var "
            "outputs; only the normalized output and the residual sum are differentiated"
        )


def _rms_backward(ctx: VJPContext, s: str, gamma: str, dy: str, axes: list[int], eps: float):
    """y = s * r * gamma, r = (mean(s^2) + eps)^(-1/2) over ``axes``
    ->  ds = r * (g - s * r^2 * mean(g * s)),  g = dy * gamma
        dgamma_full = dy * s * r   (summed over the leading axes by the caller)"""
    e = ctx.emit
    ms = e.reduce_mean(e.Mul(s, s), axes, keepdims=True)
    r = e.Reciprocal(e.Sqrt(e.Add(ms, ctx.const(eps, like=s))))
    g = e.Mul(dy, gamma)
    proj = e.reduce_mean(e.Mul(g, s), axes, keepdims=True)
    ds = e.Mul(r, e.Sub(g, e.Mul(s, e.Mul(e.Mul(r, r), proj))))
    return ds, e.Mul(dy, e.Mul(s, r))


def _ln_backward(ctx: VJPContext, s: str, gamma: str, dy: str, axes: list[int], eps: float):
    """y = xhat * gamma (+ beta), xhat = (s - mean(s)) * r, r = (var(s) + eps)^(-1/2)
    ->  ds = r * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * gamma
        dgamma_full = dy * xhat"""
    e = ctx.emit
    c = e.Sub(s, e.reduce_mean(s, axes, keepdims=True))
    var = e.reduce_mean(e.Mul(c, c), axes, keepdims=True)
    r = e.Reciprocal(e.Sqrt(e.Add(var, ctx.const(eps, like=s))))
    xhat = e.Mul(c, r)
    g = e.Mul(dy, gamma)
    mean_g = e.reduce_mean(g, axes, keepdims=True)
    mean_gx = e.reduce_mean(e.Mul(g, xhat), axes, keepdims=True)
    ds = e.Mul(r, e.Sub(e.Sub(g, mean_g), e.Mul(xhat, mean_gx)))
    return ds, e.Mul(dy, xhat)


def _leading_sum(ctx: VJPContext, t: str, lead: int) -> str:
    """Sum ``t`` over its first ``lead`` axes (the axes the scale is broadcast along)."""
    return ctx.emit.reduce_sum(t, list(range(lead)), keepdims=False) if lead else t


@vjp("SimplifiedLayerNormalization")
@vjp("SimplifiedLayerNormalization", domain=MS)
def simplified_layer_norm_vjp(ctx, dy, d_inv_std=None):
    """y = x * r * scale,  r = (mean(x^2) + epsilon)^(-1/2) over axes [axis, rank)
    ->  dx = r * (g - x * r^2 * mean(g * x)),  g = dy * scale
        dscale = sum over the axes before ``axis`` of dy * x * r"""
    _refuse_stats(ctx, d_inv_std)
    e = ctx.emit
    x, scale = ctx.inputs[0], ctx.inputs[1]
    rank = ctx.require_rank(x)
    axis = int(ctx.attr("axis", -1)) % rank
    axes = list(range(axis, rank))
    if dy is None:
        dy = e.zeros_like(x)
    dx, dscale_full = _rms_backward(ctx, x, scale, dy, axes, float(ctx.attr("epsilon", 1e-5)))
    dscale = None
    if ctx.needs(1):
        lead = rank - ctx.require_rank(scale)
        dscale = _leading_sum(ctx, dscale_full, lead)
    return (dx if ctx.needs(0) else None, dscale)


def _skip_sum(ctx: VJPContext, bias_index: int | None) -> str:
    """input + skip (+ bias), as the op computes it (skip may broadcast over batch)."""
    e = ctx.emit
    s = e.Add(ctx.inputs[0], ctx.inputs[1])
    bias = ctx.input(bias_index) if bias_index is not None else None
    return e.Add(s, bias) if bias is not None else s


def _skip_grads(ctx: VJPContext, ds: str, rank: int, bias_index: int | None):
    """Gradients of input, skip and bias from the gradient ``ds`` of their sum."""
    e = ctx.emit
    x, skip = ctx.inputs[0], ctx.inputs[1]
    # skip is (B, S, H), (1, S, H) or (S, H): summed back over what it was broadcast along
    d_skip = ctx.unbroadcast(ds, skip, out=x) if ctx.needs(1) else None
    d_bias = None
    if bias_index is not None and ctx.input(bias_index) is not None and ctx.needs(bias_index):
        d_bias = e.reduce_sum(ds, list(range(rank - 1)), keepdims=False)
    return (ds if ctx.needs(0) else None), d_skip, d_bias


@vjp("SkipSimplifiedLayerNormalization", domain=MS)
def skip_simplified_layer_norm_vjp(ctx, dy, d_mean=None, d_inv_std=None, d_sum=None):
    """s = input + skip (+ bias),  y = s * r * gamma,  r = (mean(s^2) + epsilon)^(-1/2)
    over the last axis; output 3 is s itself (input_skip_bias_sum)
    ->  ds = r * (g - s * r^2 * mean(g * s)) + d_sum,  g = dy * gamma
        dinput = ds, dskip = ds summed over the axes skip is broadcast along,
        dbias = dgamma-style sum of ds over all but the last axis,
        dgamma = sum over all but the last axis of dy * s * r"""
    _refuse_stats(ctx, d_mean, d_inv_std)
    return _skip_norm(ctx, dy, d_sum, _rms_backward, gamma=2, beta=None, bias=3, eps=1e-12)


@vjp("SkipLayerNormalization", domain=MS)
def skip_layer_norm_vjp(ctx, dy, d_mean=None, d_inv_std=None, d_sum=None):
    """s = input + skip (+ bias),  y = xhat * gamma + beta,
    xhat = (s - mean(s)) * r,  r = (var(s) + epsilon)^(-1/2) over the last axis;
    output 3 is s (input_skip_bias_sum)
    ->  ds = r * (g - mean(g) - xhat * mean(g * xhat)) + d_sum,  g = dy * gamma
        dinput = ds, dskip = ds (summed over skip's broadcast axes), dbias = sum(ds),
        dgamma = sum(dy * xhat), dbeta = sum(dy), sums over all but the last axis"""
    _refuse_stats(ctx, d_mean, d_inv_std)
    return _skip_norm(ctx, dy, d_sum, _ln_backward, gamma=2, beta=3, bias=4, eps=1e-12)


def _skip_norm(ctx: VJPContext, dy, d_sum, backward, gamma: int, beta: int | None, bias: int, eps: float):
    e = ctx.emit
    x = ctx.inputs[0]
    rank = ctx.require_rank(x)
    s = _skip_sum(ctx, bias)
    n_in = len(ctx.inputs)
    grads: list[str | None] = [None] * n_in
    ds = None
    if dy is not None:
        ds, dgamma_full = backward(ctx, s, ctx.inputs[gamma], dy, [rank - 1], float(ctx.attr("epsilon", eps)))
        if ctx.needs(gamma):
            grads[gamma] = e.reduce_sum(dgamma_full, list(range(rank - 1)), keepdims=False)
        if beta is not None and ctx.input(beta) is not None and ctx.needs(beta):
            grads[beta] = e.reduce_sum(dy, list(range(rank - 1)), keepdims=False)
    else:  # only the residual sum is read: gamma and beta get zeros
        if ctx.needs(gamma):
            grads[gamma] = e.zeros_like(ctx.inputs[gamma])
        if beta is not None and ctx.input(beta) is not None and ctx.needs(beta):
            grads[beta] = e.zeros_like(ctx.inputs[beta])
    if d_sum is not None:
        ds = d_sum if ds is None else e.Add(ds, d_sum)
    if ds is None:  # no gradient reaches the node's differentiated outputs
        ds = e.zeros_like(x)
    grads[0], grads[1], d_bias = _skip_grads(ctx, ds, rank, bias if bias < n_in else None)
    if bias < n_in:
        grads[bias] = d_bias
    return tuple(grads)
