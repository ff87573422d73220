"""Gradient rules: losses (SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss).

Both pick one class per sample: with t = target[n, d1..dk] and the gathered
weight w_t = weight[t] (1 without weights, 0 where t == ignore_index),

    loss[n, d] = -w_t * input[n, t, d]       (input = log_prob for SCE)

reduced by 'none', 'sum' or 'mean' (sum divided by D = the summed w_t of the
non-ignored targets).  Targets get no gradient; the class weights do (the
loss is linear in them for 'none' and 'sum', a quotient for 'mean')."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import TrainingModelError
from ..registry import VJPContext, vjp
from ._common import int64, scatter_add_axis


@dataclass
class _Picks:
    """What both gradients need: the targets made safe to index with, the
    per-sample weights w_t (ignored samples weigh 0; None: all ones), and the
    factor ``coef`` that multiplies d loss / d loss[n, d] (dloss itself for
    'none' and 'sum', dloss / D for 'mean')."""

    safe_target: str
    kept: str | None  # 1.0 where the target is not ignored (None: nothing ignored)
    w_t: str | None
    coef: str
    reduction: str


def _picks(ctx: VJPContext, dloss: str, scores: str, target: str, weight: str | None) -> _Picks:
    e = ctx.emit
    et = ctx.dtype(scores)
    reduction = ctx.attr("reduction", "mean")
    ignore = ctx.attr("ignore_index")
    tt = ctx.dtype(target)
    if reduction not in ("none", "sum", "mean"):
        raise TrainingModelError(
            f"gradient of {ctx.node.op_type} node {ctx.node.name!r}: reduction must be "
            f"'none', 'sum' or 'mean', found {reduction!r}"
        )

    kept = None
    if ignore is not None:
        ignored = e.Equal(target, ctx.const(ignore, dtype=tt))
        safe_target = e.Where(ignored, ctx.const(0, dtype=tt), target)
        kept = e.Cast(e.Not(ignored), to=et)
    else:
        safe_target = target

    w_t = e.Gather(weight, safe_target, axis=0) if weight is not None else None
    if kept is not None:
        w_t = kept if w_t is None else e.Mul(w_t, kept)

    if reduction == "mean":
        total = e.reduce_sum(w_t, None, keepdims=False) if w_t is not None else e.Cast(e.Size(target), to=et)
        coef = e.Div(dloss, total)
    else:
        coef = dloss
    return _Picks(safe_target, kept, w_t, coef, reduction)


def _picked_input_grad(ctx: VJPContext, p: _Picks, scores: str, target: str) -> str:
    """d input[n, c, d] = -coef[n, d] * w_t  where c == t, 0 elsewhere

    Built as a ScatterElements of the per-sample values into zeros along the
    class axis; ignored targets are redirected to class 0 with value 0.
    (Both losses exist from opset 12, so ScatterElements is always there.)"""
    e = ctx.emit
    if p.w_t is not None:
        per_sample = e.Neg(e.Mul(p.coef, p.w_t))
    elif p.reduction == "none":
        per_sample = e.Neg(p.coef)
    else:  # a scalar: every sample scatters one value, so give it target's shape
        per_sample = e.Expand(e.Neg(p.coef), e.Shape(target))
    return e.ScatterElements(
        e.zeros_like(scores), e.unsqueeze(p.safe_target, [1]), e.unsqueeze(per_sample, [1]), axis=1
    )


def _weight_grad(ctx: VJPContext, p: _Picks, scores: str, weight: str) -> str:
    """d weight[c] = sum over the non-ignored samples with t == c of g[n, d], where

        'none', 'sum':  loss = sum(-w_t v)            g = -dloss * v
        'mean':         loss = sum(-w_t v) / sum(w_t)  g = dloss / D * (-v - loss)

    with v[n, d] = input[n, t, d] the picked score.  'mean' is the quotient
    rule: d(N / D) = dN / D - (N / D) dD / D, and N / D is the forward loss
    (reused).  The per-sample values are scatter-added into the C classes."""
    e = ctx.emit
    picked = e.GatherElements(scores, e.unsqueeze(p.safe_target, [1]), axis=1)
    v = e.squeeze(picked, [1])
    if p.reduction == "mean":
        g = e.Mul(p.coef, e.Neg(e.Add(v, ctx.outputs[0])))
    else:
        g = e.Neg(e.Mul(p.coef, v))
    if p.kept is not None:
        g = e.Mul(g, p.kept)
    flat_g = e.reshape(g, [-1])
    flat_t = e.reshape(int64(e, p.safe_target), [-1])
    return scatter_add_axis(ctx, flat_g, flat_t, e.Shape(weight), 0, 1, e.Shape(weight))


def _loss_grads(ctx: VJPContext, dloss: str, scores: str) -> tuple[str | None, str | None]:
    """(d scores, d weight) of the picking loss over ``scores`` (None where not needed)."""
    target, weight = ctx.inputs[1], ctx.input(2)
    need_w = weight is not None and ctx.needs(2)
    if not (ctx.needs(0) or need_w):
        return None, None
    p = _picks(ctx, dloss, scores, target, weight)
    dscores = _picked_input_grad(ctx, p, scores, target) if ctx.needs(0) else None
    dweight = _weight_grad(ctx, p, scores, weight) if need_w else None
    return dscores, dweight


@vjp("NegativeLogLikelihoodLoss")
def nll_loss_vjp(ctx, dloss):
    """loss[n, d] = -w_t * x[n, t, d]  (then reduced)
    ->  dx[n, c, d] = -coef[n, d] * w_t * [c == t]
        dweight[c] = sum_{t == c} -coef * x_t  ('none', 'sum'),
                     sum_{t == c} coef * (-x_t - loss)  ('mean', coef = dloss / sum w_t)"""
    x = ctx.inputs[0]
    if dloss is None:
        return (None,) * len(ctx.inputs)
    dx, dweight = _loss_grads(ctx, dloss, x)
    return (dx, None, dweight)[: len(ctx.inputs)]


@vjp("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_vjp(ctx, dloss, dlog_prob=None):
    """lp = log_softmax(scores, axis=1), loss[n, d] = -w_t * lp[n, t, d]  (then reduced)
    ->  g = dlog_prob - coef[n, d] * w_t * [c == t]
        dscores = g - softmax * sum_c(g),   softmax = exp(lp)
        dweight: the NegativeLogLikelihoodLoss weight gradient with x = lp

    lp is the forward node's log_prob output (added to the node if absent)."""
    e = ctx.emit
    weight = ctx.input(2)
    need_w = weight is not None and ctx.needs(2)
    if not (ctx.needs(0) or need_w):
        return (None,) * len(ctx.inputs)
    log_prob = ctx.forward_output(1)
    e.dtypes.setdefault(log_prob, ctx.dtype(ctx.inputs[0]))  # a new output: scores' type
    parts = []
    dweight = None
    if dloss is not None:
        dpicked, dweight = _loss_grads(ctx, dloss, log_prob)
        if dpicked is not None:
            parts.append(dpicked)
    dscores = None
    if ctx.needs(0):
        if dlog_prob is not None:
            parts.append(dlog_prob)
        if parts:
            g = e.sum_all(parts)
            total = e.reduce_sum(g, [1], keepdims=True)
            dscores = e.Sub(g, e.Mul(e.Exp(log_prob), total))
    return (dscores, None, dweight)[: len(ctx.inputs)]
