"""Gradient rules: pooling (MaxPool with its Indices or, before opset 8, a
mask; AveragePool, LpPool, the global pools, MaxUnpool) and regions of
interest (RoiAlign, MaxRoiPool).  Window geometry lives in window.py."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, numpy_helper

from ...core.emitter import np_dtype
from ...errors import GradientError, TrainingModelError
from ..registry import VJPContext, no_grad, vjp
from ._common import int64, scatter_add_axis
from .window import Window


# ------------------------------------------------------------------ MaxPool
def _flat_zeros(ctx: VJPContext, x: str) -> str:
    """A 1-D zero tensor with as many elements as x (x's element type)."""
    e = ctx.emit
    zero = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(ctx.dtype(x))))
    return e.op("ConstantOfShape", [e.reshape(e.Size(x), [1])], value=zero)


@vjp("MaxPool")
def max_pool_vjp(ctx, dy, *_):
    """y[o] = x[idx[o]] (idx: the forward's Indices output, flat over N*C*spatial)
    ->  dx = scatter-add of dy at idx (into a flat zero tensor, reshaped to x)

    storage_order=1 indices count the spatial axes column-major: scatter into
    that layout, then transpose the spatial axes back.  Opset >= 16 uses
    ScatterElements(reduction='add').  Opsets 10-15 scatter without
    reduction, one class of output positions at a time (o_i mod m_i, with
    m_i = ceil(window extent / stride)), within which windows are disjoint, so
    no index repeats: acc = Scatter(acc, idx_c, Gather(acc, idx_c) + dy_c).
    The classes are strided Slices (opset >= 10); at opset 9 a single class
    (disjoint windows) still scatters by Indices.  Otherwise (opsets 7-8, where
    MaxPool-7 has no Indices and no Scatter exists, and overlapping windows at
    opset 9) the argmax is recomputed from x and y: see ``_max_pool_by_mask``.
    Disjoint windows with static shapes place dy with MaxUnpool instead
    (``_unpool_fits``)."""
    e = ctx.emit
    x = ctx.inputs[0]
    k = len(ctx.attr("kernel_shape"))
    if e.opset < 10 and (e.opset < 9 or len(_pool_classes(ctx, k)) > 1):
        return (_max_pool_by_mask(ctx, dy, k),)
    if _unpool_fits(ctx, k):
        # Disjoint windows: no index repeats, so placing dy is MaxUnpool, one
        # pass over dx instead of zeros + a generic scatter-add (4-10x faster
        # in onnxruntime).  Its kernel/stride attributes only bound the shape
        # it infers, which output_shape overrides: 1s make that bound y's shape.
        ones = [1] * k
        idx = ctx.forward_output(1)
        dx = e.op("MaxUnpool", [dy, idx, e.Shape(x)], kernel_shape=ones, strides=ones)
        dims = ctx.shape(x)
        if all(isinstance(d, int) for d in dims):
            # onnx infers no dims from MaxUnpool's output_shape: a Reshape to
            # the constant shape (free in onnxruntime) keeps them known downstream.
            dx = e.Reshape(dx, e.ints(list(dims)))
        return (dx,)
    if e.opset >= 16:
        idx = e.reshape(ctx.forward_output(1), [-1])
        upd = e.reshape(dy, [-1])
        flat = e.ScatterElements(_flat_zeros(ctx, x), idx, upd, axis=0, reduction="add")
    else:
        flat = _scatter_add_by_class(ctx, x, ctx.forward_output(1), dy, k)
    if int(ctx.attr("storage_order", 0)) == 1:
        perm = [0, 1] + list(range(k + 1, 1, -1))
        col = e.Reshape(flat, e.Gather(e.Shape(x), e.ints(perm), axis=0))
        return (e.Transpose(col, perm=perm),)
    return (e.Reshape(flat, e.Shape(x)),)


_UNPOOL_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)


def _unpool_fits(ctx: VJPContext, k: int) -> bool:
    """Whether MaxUnpool places MaxPool's gradient: windows that cannot overlap
    ((kernel - 1) * dilation < stride on every axis), row-major Indices, and a
    static y no larger than x on any spatial axis (MaxUnpool's shape bound).
    float and float16 only: onnxruntime has no double MaxUnpool kernel."""
    if ctx.dtype(ctx.inputs[0]) not in _UNPOOL_TYPES:
        return False
    if int(ctx.attr("storage_order", 0)) != 0 or len(_pool_classes(ctx, k)) != 1:
        return False
    xs, ys = ctx.shape(ctx.inputs[0]), ctx.shape(ctx.outputs[0])
    if xs is None or ys is None or len(xs) != k + 2 or len(ys) != k + 2:
        return False
    spatial = list(zip(xs[2:], ys[2:]))
    return all(isinstance(a, int) and isinstance(b, int) and b <= a for a, b in spatial)


def _pool_classes(ctx: VJPContext, k: int) -> list[list[int]]:
    """The classes of output positions (o_i mod m_i per axis) whose windows are disjoint."""
    kernel = [int(v) for v in ctx.attr("kernel_shape")]
    strides = [int(v) for v in ctx.attr("strides", [1] * k)]
    dil = [int(v) for v in ctx.attr("dilations", [1] * k)]
    period = [math.ceil(((kk - 1) * d + 1) / s) for kk, d, s in zip(kernel, dil, strides)]
    classes = [[]]
    for m in period:
        classes = [c + [r] for c in classes for r in range(m)]
    return classes


def _scatter_add_by_class(ctx: VJPContext, x: str, idx: str, dy: str, k: int) -> str:
    e = ctx.emit
    classes = _pool_classes(ctx, k)
    period = [max(c[i] for c in classes) + 1 for i in range(k)]
    acc = _flat_zeros(ctx, x)
    if len(classes) == 1:
        return e.scatter_elements(acc, e.reshape(idx, [-1]), e.reshape(dy, [-1]), axis=0)
    axes = list(range(2, k + 2))
    big = [2**62] * k
    for c in classes:
        idx_c = e.reshape(e.slice(idx, c, big, axes=axes, steps=period), [-1])
        dy_c = e.reshape(e.slice(dy, c, big, axes=axes, steps=period), [-1])
        acc = e.scatter_elements(acc, idx_c, e.Add(e.Gather(acc, idx_c, axis=0), dy_c), axis=0)
    return acc


def _pool_taps(d: int, o: int, kk: int, s: int, dil: int, pb: int) -> tuple[np.ndarray, np.ndarray]:
    """Along one spatial axis: the input position p = o*s + t*dil - pb of tap t
    of window o, laid out as [o*K + t], clipped into [0, D) (for Gather), and
    whether it lies inside the input (not in the padding)."""
    pos = (np.arange(o)[:, None] * s + np.arange(kk)[None, :] * dil - pb).reshape(-1)
    inside = (pos >= 0) & (pos < d)
    return np.clip(pos, 0, d - 1).astype(np.int64), inside


def _max_pool_by_mask(ctx: VJPContext, dy: str, k: int) -> str:
    """MaxPool's gradient without Indices or scatter ops (valid from opset 7).

    Per axis i, the window taps of every output position are gathered with a
    static index list: patch[nc, o, t] = x[nc, o*s + t*dil - pb] (o, t and the
    positions are multi-indices over the k spatial axes; K = prod(kernel) taps).
    A tap is the argmax of its window when it lies inside x (a tap in the
    padding never is) and patch == y, the first such tap in row-major order
    (the one MaxPool's Indices report):
        hit[o, t]   = inside(o, t) * [patch[o, t] >= y[o]]
        first[o, t] = hit[o, t] * [sum_{t' < t} hit[o, t'] == 0]
    dx is the transpose of the gathering applied to first * dy: per axis a
    MatMul with the one-hot matrix S_i[o*K_i + t, p] = [p == o*s + t*dil - pb],
        dx[nc, p] = sum_{o, t} S[(o, t), p] * first[nc, o, t] * dy[nc, o].
    Needs the spatial dims and pads statically."""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    kernel = [int(v) for v in ctx.attr("kernel_shape")]
    win = Window(ctx, x, y, k, kernel, has_dilations=ctx.opset >= 10)
    if not win.static_pads or any(d is None for d in win.in_dims):
        raise TrainingModelError(
            win.where(
                f"at opset {ctx.opset} the gradient recomputes the argmax of each window and "
                "needs the spatial dims of the input statically; give the input a static "
                "shape or use opset >= 10"
            )
        )
    ceil_mode = int(ctx.attr("ceil_mode", 0))
    et = ctx.dtype(x)
    dt = np_dtype(et)
    outs, index, inside = [], [], []
    for d, kk, s, dl, pb, pe in zip(win.in_dims, kernel, win.strides, win.dilations, win.begin, win.end):
        span = d + pb + pe - ((kk - 1) * dl + 1)
        o = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (o - 1) * s >= d + pb:  # a last window starting in the end padding is dropped
            o -= 1
        pos, ok = _pool_taps(d, o, kk, s, dl, pb)
        outs.append(o)
        index.append(pos)
        inside.append(ok.reshape(o, kk))
    n_out, n_taps = math.prod(outs), math.prod(kernel)
    # patches: [NC, O1*K1, ..., Ok*Kk] -> [NC, P, K] with P = prod(O), K = prod(kernel)
    t = e.reshape(x, [-1] + list(win.in_dims))
    for i in range(k):
        t = e.Gather(t, e.const(index[i]), axis=i + 1)
    interleaved = [v for o, kk in zip(outs, kernel) for v in (o, kk)]
    to_taps_last = [0] + [1 + 2 * i for i in range(k)] + [2 + 2 * i for i in range(k)]
    t = e.Transpose(e.reshape(t, [-1] + interleaved), perm=to_taps_last)
    patch = e.reshape(t, [-1, n_out, n_taps])
    # inside[(o_1..o_k), (t_1..t_k)] = prod_i inside_i[o_i, t_i]
    valid = np.ones([1] * (2 * k), dtype=bool)
    for i, ok in enumerate(inside):
        shape = [1] * (2 * k)
        shape[i], shape[k + i] = ok.shape
        valid = valid & ok.reshape(shape)
    valid = valid.reshape(n_out, n_taps).astype(dt)
    hit = e.Mul(e.Cast(e.Not(e.Less(patch, e.reshape(y, [-1, n_out, 1]))), to=et), e.const(valid))
    if n_taps > 1:
        earlier = np.triu(np.ones((n_taps, n_taps), dtype=dt), 1)  # [t', t] = 1 where t' < t
        before = e.MatMul(hit, e.const(earlier))
        hit = e.Mul(hit, e.Cast(e.Less(before, ctx.const(0.5, dtype=et)), to=et))
    g = e.Mul(hit, e.reshape(dy, [-1, n_out, 1]))
    # back to [NC, O1*K1, ..., Ok*Kk], then the transposed gathering axis by axis (last first)
    back = [0] * (2 * k + 1)
    for j, p in enumerate(to_taps_last):
        back[p] = j
    g = e.Transpose(e.reshape(g, [-1] + outs + kernel), perm=back)
    dims = [o * kk for o, kk in zip(outs, kernel)]
    g = e.reshape(g, [-1] + dims)
    for i in reversed(range(k)):
        d = win.in_dims[i]
        sel = np.zeros((dims[i], d), dtype=dt)
        rows = np.flatnonzero(inside[i].reshape(-1))
        sel[rows, index[i][rows]] = 1
        after = math.prod(dims[i + 1:])
        if after == 1:
            g = e.MatMul(e.reshape(g, [-1, dims[i]]), e.const(sel))
        else:
            g = e.MatMul(e.const(np.ascontiguousarray(sel.T)), e.reshape(g, [-1, dims[i], after]))
        dims[i] = d
    return e.Reshape(g, e.Shape(x))


@vjp("GlobalMaxPool")
def global_max_pool_vjp(ctx, dy):
    """y[n,c] = max over spatial of x[n,c]
    ->  dx = dy * [x == y] / count(x == y)   (ties share the gradient equally)"""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    r = ctx.require_rank(x)
    hit = e.Cast(e.Not(e.Less(x, y)), to=ctx.dtype(x))  # x <= y everywhere: equality
    count = e.reduce_sum(hit, list(range(2, r)), keepdims=True)
    return (e.Div(e.Mul(hit, dy), count),)


# -------------------------------------------------------------- AveragePool
@vjp("AveragePool")
def average_pool_vjp(ctx, dy):
    """y[o] = sum_{k: valid} x[o*s + k*dil - pb] / div(o)
    ->  dx = ConvTranspose(dy / div, ones kernel), per channel (N*C single-channel images)

    count_include_pad=1 without ceil_mode: div = prod(kernel).  Otherwise
    div(o) = c(o) / u(o), with c(o) the number of valid positions in window o
    (a Conv of ones over ones padded with zeros) and u = AveragePool(ones)
    (the op itself decides how it divides an overhanging ceil_mode window);
    for count_include_pad=0, u = 1."""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    kernel = [int(v) for v in ctx.attr("kernel_shape")]
    k = len(kernel)
    win = Window(ctx, x, y, k, kernel, has_dilations=ctx.opset >= 19)
    et = ctx.dtype(x)
    ones_k = ctx.const(np.ones([1, 1] + kernel), dtype=et)
    include_pad = int(ctx.attr("count_include_pad", 0))
    ceil_mode = int(ctx.attr("ceil_mode", 0))
    if include_pad and not ceil_mode:
        z = e.Mul(dy, ctx.const(1.0 / float(np.prod(kernel)), dtype=et))
    else:
        scale = _inverse_divisor(ctx, win, ones_k, include_pad, et)
        z = e.Mul(dy, scale)
    # One single-channel image per (n, c).
    z = e.Reshape(z, e.Concat(e.ints([-1, 1]), e.shape_of(y, 2), axis=0))
    dx = win.scatter(z, ones_k)
    return (e.Reshape(dx, e.Shape(x)),)


def _inverse_divisor(ctx: VJPContext, win: Window, ones_k: str, include_pad: int, et: int) -> str:
    """1 / div(o) for every output position, shaped (1, 1, O...)."""
    e = ctx.emit
    k = win.k
    if all(d is not None for d in win.in_dims):
        image = ctx.const(np.ones([1, 1] + list(win.in_dims)), dtype=et)
    elif e.opset >= 9:
        one = numpy_helper.from_array(np.ones(1, dtype=np_dtype(et)))
        image = e.op("ConstantOfShape", [e.Concat(e.ints([1, 1]), win.in_shape_rt(), axis=0)], value=one)
    else:  # no ConstantOfShape: ones shaped like one channel of x
        image = e.ones_like(e.slice(win.x, [0, 0], [1, 1], axes=[0, 1]))
    # c: valid positions per window.  Zero padding marks invalid positions; in
    # ceil_mode, s-1 extra zeros at the end make the floor-mode Conv reach every window.
    ceil_mode = int(ctx.attr("ceil_mode", 0))
    extra = [s - 1 if ceil_mode else 0 for s in win.strides]
    if win.static_pads:
        pads = list(win.begin) + [p + q for p, q in zip(win.end, extra)]
        counts = e.Conv(
            image, ones_k, strides=win.strides, dilations=win.dilations, pads=pads if any(pads) else None
        )
    else:
        if e.opset < 11:
            raise TrainingModelError(win.where(f"runtime pads need opset >= 11, model has {e.opset}"))
        zeros2 = e.ints([0, 0])
        pads = e.Concat(zeros2, win.begin, zeros2, e.Add(win.end, e.ints(extra)), axis=0)
        counts = e.Conv(e.Pad(image, pads), ones_k, strides=win.strides, dilations=win.dilations)
    if any(extra):
        win.require_runtime_slices()
        counts = e.slice(counts, e.ints([0] * k), e.shape_of(win.y, 2), axes=list(range(2, k + 2)))
    # a window with no valid position divides nothing: counts >= 1 (Max-6 does not broadcast)
    if e.opset >= 8:
        counts = e.Max(counts, ctx.const(1.0, dtype=et))
    else:
        counts = e.Add(counts, e.Cast(e.Less(counts, ctx.const(0.5, dtype=et)), to=et))
    if not include_pad:
        return e.Reciprocal(counts)
    attrs = {
        a: ctx.attr(a)
        for a in ("kernel_shape", "strides", "pads", "auto_pad", "ceil_mode", "count_include_pad", "dilations")
        if ctx.attr(a) is not None
    }
    per_window = e.AveragePool(image, **attrs)  # = c / div
    return e.Div(per_window, counts)


@vjp("GlobalAveragePool")
def global_average_pool_vjp(ctx, dy):
    """y[n,c] = mean over spatial of x[n,c]  ->  dx = broadcast(dy) * size(y) / size(x)"""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    et = ctx.dtype(x)
    ratio = e.Div(e.Cast(e.Size(y), to=et), e.Cast(e.Size(x), to=et))
    return (e.expand_to(e.Mul(dy, ratio), x),)


# ------------------------------------------------------------------- LpPool
@vjp("LpPool")
def lp_pool_vjp(ctx, dy):
    """y[o] = (sum_{window} |x|^p)^(1/p)   (padding counts as 0)
    ->  dx = |x|^(p-1) sign(x) * ConvTranspose(dy * y^(1-p), ones kernel), per channel

    (windows with y = 0 pass no gradient)."""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    kernel = [int(v) for v in ctx.attr("kernel_shape")]
    k = len(kernel)
    p = float(ctx.attr("p"))
    et = ctx.dtype(x)
    win = Window(ctx, x, y, k, kernel, has_dilations=ctx.opset >= 18)
    zero = ctx.const(0.0, dtype=et)
    if p == 1.0:
        z = dy
    else:
        # y = 0 only when the whole window is 0, where |x|^(p-1) = 0 kills the
        # term anyway: use 1 there instead of dividing by 0.
        safe = e.Where(e.Greater(y, zero), y, ctx.const(1.0, dtype=et))
        z = e.Mul(dy, e.Pow(safe, ctx.const(1.0 - p, dtype=et)))
    z = e.Reshape(z, e.Concat(e.ints([-1, 1]), e.shape_of(y, 2), axis=0))
    ones_k = ctx.const(np.ones([1, 1] + kernel), dtype=et)
    back = e.Reshape(win.scatter(z, ones_k), e.Shape(x))
    if p == 1.0:
        local = e.sign(x)
    elif p == 2.0:
        local = x
    else:
        local = e.Mul(e.Pow(e.Abs(x), ctx.const(p - 1.0, dtype=et)), e.sign(x))
    return (e.Mul(back, local),)


# ------------------------------------------------- unpooling, col2im, Lp pooling
@vjp("MaxUnpool")
def max_unpool_vjp(ctx, dy):
    """y = zeros (output_shape, or the shape inferred from the pooling attributes),
    y.flat[I] = x   (I: MaxPool's Indices, flat over the whole tensor)
    ->  dx = dy.flat[I]; I and output_shape get none"""
    x, indices = ctx.inputs[:2]
    e = ctx.emit
    if not ctx.needs(0):
        return (None,) * len(ctx.inputs)
    picked = e.Gather(e.reshape(dy, [-1]), e.reshape(int64(e, indices), [-1]), axis=0)
    return (e.Reshape(picked, e.Shape(x)),) + (None,) * (len(ctx.inputs) - 1)


@vjp("GlobalLpPool")
def global_lp_pool_vjp(ctx, dy):
    """y[n, c] = (sum over spatial |x|^p)^(1/p)
    ->  dx = dy * sign(x) |x|^(p-1) * y^(1-p)   (0 where y = 0)"""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    p = float(ctx.attr("p"))
    zero, one = ctx.const(0.0, like=x), ctx.const(1.0, like=x)
    sign = e.sign(x)
    if p == 1.0:
        return (e.Mul(dy, sign),)
    safe = e.Where(e.Greater(y, zero), y, one)
    scale = e.Mul(dy, e.Pow(safe, ctx.const(1.0 - p, like=x)))
    if p == 2.0:
        local = x
    else:
        local = e.Mul(e.Pow(e.Abs(x), ctx.const(p - 1.0, like=x)), sign)
    return (e.Mul(scale, local),)


# The selected box indices are integers.
no_grad("NonMaxSuppression")


# ------------------------------------------------------------- regions of interest
def _one_hot_images(ctx: VJPContext, x: str) -> str:
    """[1, H * W, H, W]: channel k is the image with a single 1 at flat position k."""
    e = ctx.emit
    hw = e.reduce("ReduceProd", e.shape_of(x, 2), None, keepdims=True)
    zero = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(ctx.dtype(x))))
    eye = e.EyeLike(e.op("ConstantOfShape", [e.Concat(hw, hw, axis=0)], value=zero))
    return e.Reshape(eye, e.Concat(e.ints([1]), hw, e.shape_of(x, 2), axis=0))


def _per_roi_to_batch(ctx: VJPContext, per_roi: str, batch_index: str, x: str) -> str:
    """Sum [R, C, H * W] per-roi gradients into x's batch entries (batch_index [R])."""
    e = ctx.emit
    shaped = e.Reshape(per_roi, e.Concat(e.ints([-1]), e.shape_of(x, 1), axis=0))  # [R, C, H, W]
    return scatter_add_axis(ctx, shaped, int64(e, batch_index), e.dim(x, 0), 0, 4, e.Shape(x))


@vjp("RoiAlign")
def roi_align_vjp(ctx, dy):
    """mode 'avg': y[r, c, p] = sum_k A[r, p, k] x[b(r), c, k], A the bilinear sample
    weights of bin p of roi r averaged over its sampling points (k over H * W)
    ->  dx[b, c, k] = sum_{r: b(r) = b} sum_p A[r, p, k] dy[r, c, p]

    A is read off the op itself, applied to the H * W one-hot images (one
    batch entry; every roi reads it), so every coordinate mode, the adaptive
    sampling ratio and the spatial scale are as the runtime computes them.
    That costs O(R * (H W)^2) memory.  rois and batch_indices get none; a
    gradient asked of the rois is an error, as is mode 'max' (its max over
    the weighted taps w * x picks the smallest weight for negative x, which
    such probes cannot recover)."""
    e = ctx.emit
    x, rois, batch_index = ctx.inputs
    where = f"gradient of RoiAlign node {ctx.node.name!r}"
    if ctx.needs(1):
        raise GradientError(
            f"{where}: the rois {rois!r} get no gradient (the op is differentiated with "
            "respect to X only; treat the boxes as constants)"
        )
    if not ctx.needs(0):
        return None, None, None
    if ctx.attr("mode") != "avg":
        raise GradientError(f"{where}: mode={ctx.attr('mode')!r} is not supported, only 'avg'")
    attrs = {
        a: ctx.attr(a)
        for a in (
            "coordinate_transformation_mode", "mode", "output_height", "output_width",
            "sampling_ratio", "spatial_scale",
        )
        if ctx.attr(a) is not None
    }
    first = e.Mul(int64(e, batch_index), e.ints([0]))
    first = e.cast_to(first, ctx.dtype(batch_index))
    weights = e.RoiAlign(_one_hot_images(ctx, x), rois, first, **attrs)  # [R, HW, oh, ow]
    a = e.Reshape(weights, e.Concat(e.dim(weights, 0), e.dim(weights, 1), e.ints([-1]), axis=0))
    g = e.Reshape(dy, e.Concat(e.shape_of(dy, 0, 2), e.ints([-1]), axis=0))  # [R, C, P]
    per_roi = e.MatMul(g, e.Transpose(a, perm=[0, 2, 1]))  # [R, C, HW]
    return _per_roi_to_batch(ctx, per_roi, batch_index, x), None, None


@vjp("MaxRoiPool")
def max_roi_pool_vjp(ctx, dy):
    """y[r, c, p] = max over the pixels k of bin p of roi r of x[b(r), c, k]
    ->  dx[b, c, k] = sum_{r: b(r) = b} sum_p dy[r, c, p] [k in bin p, x[b, c, k] = y[r, c, p]] / ties

    Bin membership is the op itself on the H * W one-hot images (1 where pixel
    k lies in the bin), so the runtime's rounding of the boxes is kept; ties
    share the gradient.  O(R * C * (H W) * bins) memory.  rois get none (a
    gradient asked of them is an error)."""
    e = ctx.emit
    x, rois = ctx.inputs
    if ctx.needs(1):
        raise GradientError(
            f"gradient of MaxRoiPool node {ctx.node.name!r}: the rois {rois!r} get no gradient "
            "(the op is differentiated with respect to X only; treat the boxes as constants)"
        )
    et = ctx.dtype(x)
    attrs = {a: ctx.attr(a) for a in ("pooled_shape", "spatial_scale") if ctx.attr(a) is not None}
    # every roi on batch entry 0 (the one-hot images' only one)
    boxes_only = e.Mul(rois, ctx.const(np.array([0.0, 1.0, 1.0, 1.0, 1.0]), like=rois))
    member = e.MaxRoiPool(_one_hot_images(ctx, x), boxes_only, **attrs)  # [R, HW, ph, pw]
    member = e.Reshape(member, e.Concat(e.dim(member, 0), e.dim(member, 1), e.ints([-1]), axis=0))
    batch_index = e.Cast(e.Gather(rois, e.scalar_int(0), axis=1), to=TensorProto.INT64)
    xf = e.Reshape(x, e.Concat(e.shape_of(x, 0, 2), e.ints([-1]), axis=0))  # [N, C, HW]
    xr = e.unsqueeze(e.Gather(xf, batch_index, axis=0), [3])  # [R, C, HW, 1]
    y = e.Reshape(ctx.outputs[0], e.Concat(e.shape_of(dy, 0, 2), e.ints([1, -1]), axis=0))  # [R, C, 1, P]
    g = e.Reshape(dy, e.Concat(e.shape_of(dy, 0, 2), e.ints([1, -1]), axis=0))
    inside = e.Greater(e.unsqueeze(member, [1]), ctx.const(0.5, like=x))  # [R, 1, HW, P]
    hit = e.Cast(e.And(inside, ctx.emit.float_equal(xr, y)), to=et)  # [R, C, HW, P]
    ties = e.Max(e.reduce_sum(hit, [2], keepdims=True), ctx.const(1.0, like=x))
    per_roi = e.reduce_sum(e.Mul(hit, e.Div(g, ties)), [3], keepdims=False)  # [R, C, HW]
    return _per_roi_to_batch(ctx, per_roi, batch_index, x), None
