"""Gradient rules: Conv, ConvTranspose, Col2Im and DeformConv (geometry in window.py)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from ...core.emitter import np_dtype
from ...errors import GradientError, TrainingModelError
from ..registry import VJPContext, vjp
from ._common import constant_value, int64, zeros_of_shape
from .resample import axis_taps
from .window import Pads, Window, kernel_dims, spatial_rank


def _bias_grad(ctx: VJPContext, dy: str, k: int) -> str:
    """dB[m] = sum over batch and spatial axes of dy[:, m]"""
    return ctx.emit.reduce_sum(dy, [0] + list(range(2, k + 2)), keepdims=False)


# --------------------------------------------------------------------- Conv
@vjp("Conv")
def conv_vjp(ctx, dy):
    """y[n,m,o] = sum_{c in group(m), k} w[m,c,k] x_pad[n,c,o*s + k*dil] + b[m]
    ->  dx = ConvTranspose(dy, w) with the same strides, dilations, group, cropped to x
        dw = Conv(x^T, dy^T) with strides and dilations swapped (see Window.correlate)
        db = sum over batch and spatial axes of dy"""
    x, w = ctx.inputs[0], ctx.inputs[1]
    k = spatial_rank(ctx, w, x)
    group = int(ctx.attr("group"))
    win = Window(ctx, x, ctx.outputs[0], k, kernel_dims(ctx, w, k), weight=w)
    dx = win.scatter(dy, w, group) if ctx.needs(0) else None
    dw = win.correlate(x, dy, group) if ctx.needs(1) else None
    db = _bias_grad(ctx, dy, k) if ctx.input(2) and ctx.needs(2) else None
    return (dx, dw, db)[: len(ctx.inputs)]


# ------------------------------------------------------------ ConvTranspose
def _conv_transpose_pads(ctx: VJPContext, x: str, k: int, kernel: list[int | None]) -> tuple[Pads, Pads]:
    """The crop of ConvTranspose's full output: begin/end pads.

    Explicit pads are used as they are.  With output_shape or auto_pad SAME_*,
    total = max(0, s*(D-1) + output_padding + (K-1)*dil + 1 - out), where out
    is output_shape or D*s, split as the spec says: SAME_UPPER puts the larger
    half at the end, otherwise at the beginning.  (A larger output_shape adds
    zeros at the end, which no input reaches.)"""
    e = ctx.emit
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    out_shape = ctx.attr("output_shape")
    if out_shape is None and auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        if auto_pad == "VALID":
            return [0] * k, [0] * k
        pads = [int(v) for v in ctx.attr("pads", [0] * (2 * k))]
        return pads[:k], pads[k:]
    strides = [int(v) for v in ctx.attr("strides", [1] * k)]
    dil = [int(v) for v in ctx.attr("dilations", [1] * k)]
    outpad = [int(v) for v in ctx.attr("output_padding", [0] * k)]
    out_shape = [int(v) for v in out_shape[-k:]] if out_shape is not None else None
    upper = auto_pad == "SAME_UPPER"
    xs = ctx.shape(x)
    dims = [d if isinstance(d, int) else None for d in xs[2:]] if xs and len(xs) == k + 2 else [None] * k
    if all(d is not None for d in dims) and all(d is not None for d in kernel):
        begin, end = [], []
        for i in range(k):
            target = out_shape[i] if out_shape is not None else dims[i] * strides[i]
            total = strides[i] * (dims[i] - 1) + outpad[i] + (kernel[i] - 1) * dil[i] + 1 - target
            total = max(total, 0)
            small = total // 2
            begin.append(small if upper else total - small)
            end.append(total - begin[-1])
        return begin, end
    d = e.shape_of(x, 2)
    kern = e.ints(kernel) if all(v is not None for v in kernel) else e.shape_of(ctx.inputs[1], 2)
    one = e.ints([1])
    target = e.ints(out_shape) if out_shape is not None else e.Mul(d, e.ints(strides))
    full = e.Add(
        e.Add(e.Mul(e.ints(strides), e.Sub(d, one)), e.ints(outpad)),
        e.Add(e.Mul(e.Sub(kern, one), e.ints(dil)), one),
    )
    total = e.Sub(full, target)
    zero = e.ints([0])
    total = e.Where(e.Less(total, zero), zero, total)
    small = e.Div(total, e.ints([2]))
    big = e.Sub(total, small)
    return (small, big) if upper else (big, small)


@vjp("ConvTranspose")
def conv_transpose_vjp(ctx, dy):
    """y = crop_pads(full), full[n, g*Cog+co, i*s + k*dil] += x[n, ci, i] w[ci, co, k] + b
    ->  dx = Conv(dy, w) with the same strides, dilations, group and pads
        dw = the Conv weight gradient with x as output gradient and dy as input
        db = sum over batch and spatial axes of dy

    (ConvTranspose is the transpose of the Conv from y's space to x's space.)"""
    e = ctx.emit
    x, w = ctx.inputs[0], ctx.inputs[1]
    y = ctx.outputs[0]
    k = spatial_rank(ctx, w, x)
    group = int(ctx.attr("group"))
    kernel = kernel_dims(ctx, w, k)
    pads = _conv_transpose_pads(ctx, x, k, kernel)
    # The window of the Conv that maps y's space to x's space.
    win = Window(ctx, y, x, k, kernel, weight=w, pads=pads)
    outpad = [int(v) for v in ctx.attr("output_padding", [0] * k)]
    dx = dw = db = None
    if ctx.needs(0):
        if win.static_pads and all(p >= 0 for p in win.begin + win.end):
            dx = e.Conv(
                dy,
                w,
                strides=win.strides,
                dilations=win.dilations,
                pads=list(win.begin) + list(win.end) if any(win.begin) or any(win.end) else None,
                group=group if group != 1 else None,
            )
        else:
            if e.opset < 11:
                raise TrainingModelError(
                    f"gradient of ConvTranspose node {ctx.node.name!r}: runtime or negative pads "
                    f"need opset >= 11, model has {e.opset}"
                )
            begin = e.ints(win.begin) if win.static_pads else win.begin
            end = e.ints(win.end) if win.static_pads else win.end
            zeros2 = e.ints([0, 0])
            padded = e.Pad(dy, e.Concat(zeros2, begin, zeros2, end, axis=0))
            dx = e.Conv(padded, w, strides=win.strides, dilations=win.dilations, group=group if group != 1 else None)
        if any(o >= s for o, s in zip(outpad, win.strides)) or ctx.attr("output_shape") is not None:
            # output_padding >= stride (or a grown output_shape) leaves extra rows: keep D
            win.require_runtime_slices()
            dx = e.slice(dx, e.ints([0] * k), e.shape_of(x, 2), axes=list(range(2, k + 2)))
    if ctx.needs(1):
        dw = win.correlate(dy, x, group)
    if ctx.input(2) and ctx.needs(2):
        db = _bias_grad(ctx, dy, k)
    return (dx, dw, db)[: len(ctx.inputs)]


@vjp("Col2Im")
def col2im_vjp(ctx, dy):
    """y[n, c, p] = sum over (k, l) with p = l * s + k * dil - pad of x[n, c * K + k, l]
    (K = prod(block_shape) offsets k in a block, l the block positions)
    ->  dx[n, c * K + k, l] = dy_pad[n, c, l * s + k * dil]: the im2col of dy,
        a Conv of each channel with the K one-hot kernels (the identity viewed as
        [K, 1, block...]); image_shape and block_shape get none"""
    x, image_shape, block_shape = ctx.inputs
    e = ctx.emit
    if not ctx.needs(0):
        return None, None, None
    block_value = constant_value(ctx, block_shape)
    if block_value is not None:
        block = [int(v) for v in block_value.reshape(-1)]
        size = int(np.prod(block))
        kernel = ctx.const(np.eye(size).reshape([size, 1] + block), like=x)
    else:
        size = e.reduce("ReduceProd", int64(e, block_shape), None, keepdims=True)
        zero = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(ctx.dtype(x))))
        eye = e.EyeLike(e.op("ConstantOfShape", [e.Concat(size, size, axis=0)], value=zero))
        kernel = e.Reshape(eye, e.Concat(size, e.ints([1]), int64(e, block_shape), axis=0))
    attrs = {
        "strides": ctx.attr("strides"),
        "dilations": ctx.attr("dilations"),
        "pads": ctx.attr("pads"),
    }
    images = e.Reshape(dy, e.Concat(e.ints([-1, 1]), e.shape_of(dy, 2), axis=0))  # [N * C, 1, img]
    cols = e.Conv(images, kernel, **attrs)  # [N * C, K, L1, .., Lk]
    return e.reshape_to(cols, e.Shape(x)), None, None


# ------------------------------------------------------------------ DeformConv
@vjp("DeformConv")
def deform_conv_vjp(ctx, dy):
    """y[n, m, o] = sum_{c in group(m), k} W[m, c, k] col[n, c, k, o] + B[m],
    col[n, c, k, o] = mask[n, g(c), k, o] * S[n, c, k, o],
    S[n, c, k, o] = bilinear(x[n, c], p),  p = o * stride - pad + k * dilation + offset[n, g(c), k, o]
    (taps outside x are 0; g(c) the offset group of channel c)
    ->  dcol = W^T dy per group,  dW = dy col^T (summed over n),  dB = sum dy,
        dmask = sum_{c in g} dcol * S,  dS = dcol * mask,
        dx = scatter-add of dS * w_tap at the 4 taps of every sampling point,
        doffset_i = sum_{c in g} dS * sum_taps x[tap] dw_tap / dp_i

    S (the sampled columns) is not an output of the op, so the backward pass
    samples x again; everything else reads its inputs.  2-D only, like the
    runtime; kernel, output and image sizes may be dynamic."""
    e = ctx.emit
    x, w, offset = ctx.inputs[:3]
    mask = ctx.input(4)
    wanted = [ctx.needs(i) and ctx.input(i) is not None for i in range(len(ctx.inputs))]
    wanted += [False] * (5 - len(wanted))
    if not any(wanted):
        return (None,) * len(ctx.inputs)
    if ctx.require_rank(x) != 4:
        raise GradientError(
            f"gradient of DeformConv node {ctx.node.name!r}: only 2-D inputs are supported"
        )
    et = ctx.dtype(x)
    group = int(ctx.attr("group"))
    offset_groups = int(ctx.attr("offset_group"))
    strides = [int(v) for v in ctx.attr("strides", [1, 1])]
    dilations = [int(v) for v in ctx.attr("dilations", [1, 1])]
    pads = [int(v) for v in ctx.attr("pads", [0, 0, 0, 0])]
    batch = e.dim(x, 0)
    kh, kw = e.dim(w, 2), e.dim(w, 3)
    oh, ow = e.dim(offset, 2), e.dim(offset, 3)
    taps_count, out_count = e.Mul(kh, kw), e.Mul(oh, ow)
    per_offset_group = e.Concat(batch, e.ints([offset_groups, -1]), axis=0)  # [N, G, -1]

    # sampling points per axis: p[n, g, (kh, kw, oh, ow)] = base + offset
    off = e.Reshape(offset, e.Concat(batch, e.ints([offset_groups]), kh, kw, e.ints([2]), oh, ow, axis=0))
    coords = []
    for axis, (k_len, o_len) in enumerate(((kh, oh), (kw, ow))):
        along_kernel = e.Mul(e.Cast(e.arange(k_len), to=et), ctx.const(float(dilations[axis]), like=x))
        along_output = e.Sub(
            e.Mul(e.Cast(e.arange(o_len), to=et), ctx.const(float(strides[axis]), like=x)),
            ctx.const(float(pads[axis]), like=x),
        )
        k_view, o_view = ([-1, 1, 1, 1], [1, 1, -1, 1]) if axis == 0 else ([1, -1, 1, 1], [1, 1, 1, -1])
        base = e.Add(e.reshape(along_kernel, k_view), e.reshape(along_output, o_view))
        component = e.squeeze(e.Gather(off, e.ints([axis]), axis=4), [4])  # [N, G, kh, kw, oh, ow]
        coords.append(e.Reshape(e.Add(component, base), per_offset_group))  # [N, G, P]
    ty, _ = axis_taps(ctx, coords[0], e.Cast(e.dim(x, 2), to=et), "linear", "zeros", True)
    tx, _ = axis_taps(ctx, coords[1], e.Cast(e.dim(x, 3), to=et), "linear", "zeros", True)

    # the 4 taps of every point: flat index into H * W, weight, d weight / d (py, px)
    width = e.dim(x, 3)
    indices, weights, dpy, dpx = [], [], [], []
    for a in range(2):
        for b in range(2):
            iy = e.Cast(ty.index[a], to=TensorProto.INT64)
            ix = e.Cast(tx.index[b], to=TensorProto.INT64)
            indices.append(e.Add(e.Mul(iy, width), ix))
            weights.append(e.Mul(ty.weight[a], tx.weight[b]))
            dpy.append(e.Mul(ty.slope[a], tx.weight[b]))
            dpx.append(e.Mul(ty.weight[a], tx.slope[b]))
    pixels = e.Mul(e.dim(x, 2), width)
    xg = e.Reshape(x, e.Concat(per_offset_group, pixels, axis=0))  # [N, G, Cg, H * W]
    index = e.unsqueeze(e.concat(indices, axis=2), [2])  # [N, G, 1, 4P]
    index = e.Expand(index, e.Concat(e.shape_of(xg, 0, 3), e.dim(index, 3), axis=0))
    values = e.GatherElements(xg, index, axis=3)  # [N, G, Cg, 4P]
    corners = e.Split(values, outputs=4, axis=3, num_outputs=4)
    sampled = e.sum_all([e.Mul(v, e.unsqueeze(wt, [2])) for v, wt in zip(corners, weights)])

    # columns [N, G, Cg, K, O]; the grouped products see them as [N, group, Cgw * K, O]
    s5 = e.Reshape(sampled, e.Concat(per_offset_group, taps_count, out_count, axis=0))
    m5 = None
    if mask is not None:
        mask_view = e.Concat(batch, e.ints([offset_groups, 1]), taps_count, out_count, axis=0)
        m5 = e.Reshape(mask, mask_view)
    col = s5 if m5 is None else e.Mul(s5, m5)
    per_group = e.Concat(batch, e.ints([group, -1]), out_count, axis=0)
    wg = e.Reshape(w, e.Concat(e.ints([group, -1]), e.Mul(e.dim(w, 1), taps_count), axis=0))
    dyg = e.Reshape(dy, per_group)  # [N, group, Mg, O]
    results: list[str | None] = [None] * len(ctx.inputs)
    if wanted[1]:
        per_n = e.MatMul(dyg, e.Transpose(e.Reshape(col, per_group), perm=[0, 1, 3, 2]))
        results[1] = e.Reshape(e.reduce_sum(per_n, [0], keepdims=False), e.Shape(w))
    if wanted[3]:
        results[3] = e.reduce_sum(dy, [0, 2, 3], keepdims=False)
    if wanted[0] or wanted[2] or wanted[4]:
        dcol = e.MatMul(e.Transpose(wg, perm=[0, 2, 1]), dyg)  # [N, group, Cgw * K, O]
        dcol = e.Reshape(dcol, e.Shape(s5))
        if wanted[4]:
            results[4] = e.Reshape(e.reduce_sum(e.Mul(dcol, s5), [2], keepdims=False), e.Shape(mask))
        ds = e.Reshape(dcol if m5 is None else e.Mul(dcol, m5), e.Shape(sampled))  # [N, G, Cg, P]
        if wanted[0]:
            upd = e.Mul(e.concat([ds] * 4, axis=3), e.unsqueeze(e.concat(weights, axis=2), [2]))
            zeros = zeros_of_shape(e, e.Shape(xg), et)
            summed = e.ScatterElements(zeros, index, upd, axis=3, reduction="add")
            results[0] = e.Reshape(summed, e.Shape(x))
        if wanted[2]:
            point_view = e.Concat(batch, e.ints([offset_groups]), taps_count, e.ints([1]), out_count, axis=0)
            grads = []
            for partial in (dpy, dpx):
                slope = e.sum_all([e.Mul(v, e.unsqueeze(p, [2])) for v, p in zip(corners, partial)])
                per_point = e.reduce_sum(e.Mul(ds, slope), [2], keepdims=False)  # [N, G, P]
                grads.append(e.Reshape(per_point, point_view))  # [N, G, K, 1, O]
            results[2] = e.Reshape(e.Concat(*grads, axis=3), e.Shape(offset))
    return tuple(results)
