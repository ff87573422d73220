"""Gradient rules: losses (SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss).

Both pick one class per sample: with t = target[n, d1..dk] and the gathered
weight w_t = weight[t] (1 without weights, 0 where t == ignore_index),

    loss[n, d] = -w_t * input[n, t, d]       (input = log_prob for SCE)

reduced by 'none', 'sum' or 'mean' (sum divided by the summed w_t of the
non-ignored targets).  Targets and weights get no gradient."""

from __future__ import annotations

from ...errors import TrainingModelError
from ..registry import VJPContext, vjp


def _picked_input_grad(ctx: VJPContext, dloss: str, scores: str, target: str, weight: str | None) -> str:
    """d input[n, c, d] = -coef[n, d] * w_t  where c == t, 0 elsewhere

    with coef = dloss (none), dloss broadcast (sum), dloss / sum(w_t) (mean).
    Built as a ScatterElements of the per-sample values into zeros along the
    class axis; ignored targets are redirected to class 0 with value 0."""
    e = ctx.emit
    et = ctx.dtype(scores)
    reduction = ctx.attr("reduction", "mean")
    ignore = ctx.attr("ignore_index")
    tt = ctx.dtype(target)

    if ignore is not None:
        ignored = e.Equal(target, ctx.const(ignore, dtype=tt))
        safe_target = e.Where(ignored, ctx.const(0, dtype=tt), target)
    else:
        ignored, safe_target = None, target

    # w_t, the weight of each sample's target (None: all ones).
    w_t = e.Gather(weight, safe_target, axis=0) if weight is not None else None
    if ignored is not None:
        kept = e.Cast(e.Not(ignored), to=et)
        w_t = kept if w_t is None else e.Mul(w_t, kept)

    if reduction in ("none", "sum"):
        coef = dloss
    elif reduction == "mean":
        total = e.reduce_sum(w_t, None, keepdims=False) if w_t is not None else e.Cast(e.Size(target), to=et)
        coef = e.Div(dloss, total)
    else:
        raise TrainingModelError(
            f"gradient of {ctx.node.op_type} node {ctx.node.name!r}: reduction must be "
            f"'none', 'sum' or 'mean', found {reduction!r}"
        )
    if w_t is not None:
        per_sample = e.Neg(e.Mul(coef, w_t))
    elif reduction == "none":
        per_sample = e.Neg(coef)
    else:  # a scalar: every sample scatters one value, so give it target's shape
        per_sample = e.Expand(e.Neg(coef), e.Shape(target))
    # (both losses exist from opset 12, so ScatterElements is always there)
    return e.ScatterElements(
        e.zeros_like(scores), e.unsqueeze(safe_target, [1]), e.unsqueeze(per_sample, [1]), axis=1
    )


@vjp("NegativeLogLikelihoodLoss")
def nll_loss_vjp(ctx, dloss):
    """loss[n, d] = -w_t * x[n, t, d]  (then reduced)
    ->  dx[n, c, d] = -coef[n, d] * w_t * [c == t]"""
    x, target = ctx.inputs[0], ctx.inputs[1]
    weight = ctx.input(2)
    dx = _picked_input_grad(ctx, dloss, x, target, weight) if ctx.needs(0) else None
    return (dx, None, None)[: len(ctx.inputs)]


@vjp("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_vjp(ctx, dloss, dlog_prob=None):
    """lp = log_softmax(scores, axis=1), loss[n, d] = -w_t * lp[n, t, d]  (then reduced)
    ->  g = dlog_prob - coef[n, d] * w_t * [c == t]
        dscores = g - softmax * sum_c(g),   softmax = exp(lp)

    lp is the forward node's log_prob output (added to the node if absent)."""
    e = ctx.emit
    scores, target = ctx.inputs[0], ctx.inputs[1]
    weight = ctx.input(2)
    if not ctx.needs(0):
        return (None, None, None)[: len(ctx.inputs)]
    log_prob = ctx.forward_output(1)
    parts = []
    if dloss is not None:
        parts.append(_picked_input_grad(ctx, dloss, scores, target, weight))
    if dlog_prob is not None:
        parts.append(dlog_prob)
    g = e.sum_all(parts)
    total = e.reduce_sum(g, [1], keepdims=True)
    dscores = e.Sub(g, e.Mul(e.Exp(log_prob), total))
    return (dscores, None, None)[: len(ctx.inputs)]
