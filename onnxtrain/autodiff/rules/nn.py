"""Gradient rules: neural-network layers (softmax, convolution, pooling,
normalization, dropout).

Sliding-window ops (Conv, ConvTranspose, the pools) share ``_Window``, which
reads strides, dilations, pads and auto_pad and resolves the pads statically
where the spatial dims are known and at run time otherwise.  Their gradients
are again sliding-window ops: the transpose of a window sum is a
ConvTranspose, and the weight gradient of a convolution is a convolution of
the input with the output gradient acting as the kernel."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from onnx import numpy_helper

from ...emitter import np_dtype
from ...errors import TrainingModelError
from ..registry import VJPContext, no_grad, vjp

Pads = list[int] | str  # static ints, or a runtime int64 tensor with one entry per spatial axis


# ------------------------------------------------------------------ softmax
def _softmax_family(ctx: VJPContext, dy: str, log: bool) -> str:
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    if ctx.opset >= 13:
        axis = int(ctx.attr("axis", -1))
        g, yy = dy, y
    else:
        # Coerced to 2-D [prod(d0..d_{axis-1}), prod(d_axis..)]: the op runs along dim 1.
        coerce = int(ctx.attr("axis", 1))
        g, yy, axis = e.Flatten(dy, axis=coerce), e.Flatten(y, axis=coerce), 1
    if log:
        # dx = dy - softmax * sum(dy), softmax = exp(y)
        dx = e.Sub(g, e.Mul(e.Exp(yy), e.reduce_sum(g, [axis], keepdims=True)))
    else:
        # dx = y * (dy - sum(dy * y))
        dx = e.Mul(yy, e.Sub(g, e.reduce_sum(e.Mul(g, yy), [axis], keepdims=True)))
    if ctx.opset < 13:
        dx = e.Reshape(dx, e.Shape(x))
    return dx


@vjp("Softmax")
def softmax_vjp(ctx, dy):
    """y = softmax(x)  ->  dx = y * (dy - sum_axis(dy * y))

    Opset < 13: the sum runs over every axis from ``axis`` on (2-D coercion)."""
    return (_softmax_family(ctx, dy, log=False),)


@vjp("LogSoftmax")
def log_softmax_vjp(ctx, dy):
    """y = log_softmax(x)  ->  dx = dy - exp(y) * sum_axis(dy)

    Opset < 13: the sum runs over every axis from ``axis`` on (2-D coercion)."""
    return (_softmax_family(ctx, dy, log=True),)


no_grad("Hardmax")


# ----------------------------------------------------------- window geometry
class _Window:
    """Geometry of a sliding-window op along its k spatial axes.

    ``begin``/``end`` are the pads, static ints where they can be known when
    building and runtime int64 vectors otherwise (auto_pad SAME over dynamic
    spatial dims).  ``in_dims``/``out_dims`` are the static spatial dims of the
    op's input and output (None where unknown); ``kernel`` the static kernel
    dims (None where unknown)."""

    def __init__(
        self,
        ctx: VJPContext,
        x: str,
        y: str,
        k: int,
        kernel: Sequence[int | None],
        kernel_rt: str | None = None,
        has_dilations: bool = True,
    ) -> None:
        self.ctx = ctx
        self.x, self.y, self.k = x, y, k
        self.strides = [int(v) for v in ctx.attr("strides", [1] * k)]
        self.dilations = (
            [int(v) for v in ctx.attr("dilations", [1] * k)] if has_dilations else [1] * k
        )
        self.kernel = list(kernel)
        self._kernel_rt = kernel_rt
        self.in_dims = self._spatial(x)
        # ONNX shape inference does not drop ceil_mode windows that start in
        # the end padding, the runtime does: do not trust static output dims there.
        self.out_dims = [None] * k if ctx.attr("ceil_mode", 0) else self._spatial(y)
        self.auto_pad = ctx.attr("auto_pad", "NOTSET")
        self.begin, self.end = self._pads()

    def _spatial(self, name: str) -> list[int | None]:
        s = self.ctx.shape(name)
        if s is None or len(s) != self.k + 2:
            return [None] * self.k
        return [d if isinstance(d, int) else None for d in s[2:]]

    @property
    def static_kernel(self) -> bool:
        return all(isinstance(d, int) for d in self.kernel)

    @property
    def static_pads(self) -> bool:
        return not isinstance(self.begin, str)

    def kernel_rt(self) -> str:
        """The kernel dims as a runtime int64 vector."""
        if self.static_kernel:
            return self.ctx.emit.ints(self.kernel)
        if self._kernel_rt is None:
            raise TrainingModelError(self._where("the kernel shape is unknown"))
        return self._kernel_rt

    def in_shape_rt(self) -> str:
        """The input's spatial dims as a runtime int64 vector."""
        return self.ctx.emit.shape_of(self.x, 2)

    def _where(self, what: str) -> str:
        n = self.ctx.node
        return f"gradient of {n.op_type} node {n.name!r}: {what}"

    def _pads(self) -> tuple[Pads, Pads]:
        k = self.k
        if self.auto_pad in ("NOTSET", ""):
            pads = [int(v) for v in self.ctx.attr("pads", [0] * (2 * k))]
            return pads[:k], pads[k:]
        if self.auto_pad == "VALID":
            return [0] * k, [0] * k
        if self.auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
            raise TrainingModelError(self._where(f"unknown auto_pad {self.auto_pad!r}"))
        upper = self.auto_pad == "SAME_UPPER"
        if self.static_kernel and all(d is not None for d in self.in_dims):
            begin, end = [], []
            for d, s, dl, kk in zip(self.in_dims, self.strides, self.dilations, self.kernel):
                total = max(0, (-(-d // s) - 1) * s + (kk - 1) * dl + 1 - d)
                small, big = total // 2, total - total // 2
                begin.append(small if upper else big)
                end.append(big if upper else small)
            return begin, end
        # total = max(0, (ceil(D/s) - 1) * s + (K - 1) * dil + 1 - D), split as the spec says.
        e = self.ctx.emit
        d = self.in_shape_rt()
        s, dl = e.ints(self.strides), e.ints(self.dilations)
        one = e.ints([1])
        out = e.Div(e.Sub(e.Add(d, s), one), s)
        total = e.Sub(
            e.Add(e.Add(e.Mul(e.Sub(out, one), s), e.Mul(e.Sub(self.kernel_rt(), one), dl)), one), d
        )
        zero = e.ints([0])
        total = e.Where(e.Less(total, zero), zero, total)
        small = e.Div(total, e.ints([2]))
        big = e.Sub(total, small)
        return (small, big) if upper else (big, small)

    def require_runtime_slices(self) -> None:
        if self.ctx.opset < 10:
            raise TrainingModelError(
                self._where(
                    "the spatial dims are not all known statically, and opset "
                    f"{self.ctx.opset} < 10 has no Slice with runtime bounds"
                )
            )

    # ------------------------------------------------------ transposed window
    def scatter(self, z: str, w: str, group: int = 1) -> str:
        """The transpose of the window sum ``y[o] = sum_k w[k] x[o*s + k*dil - pb]``:
        ConvTranspose of z (laid out like y) with kernel w, cropped to x's spatial dims.

        With everything static, the crop is exact through pads/output_padding;
        otherwise the full ConvTranspose (pads 0, output_padding s-1, which is
        long enough) is sliced to [pb, pb + D)."""
        e = self.ctx.emit
        k = self.k
        exact = (
            self.static_kernel
            and self.static_pads
            and all(d is not None for d in self.in_dims + self.out_dims)
        )
        if exact:
            begin, end, outpad = [], [], []
            for i in range(k):
                full = self.strides[i] * (self.out_dims[i] - 1) + (self.kernel[i] - 1) * self.dilations[i] + 1
                crop_end = full - self.begin[i] - self.in_dims[i]
                begin.append(self.begin[i])
                end.append(max(crop_end, 0))
                outpad.append(max(-crop_end, 0))
            return e.ConvTranspose(
                z,
                w,
                strides=self.strides,
                dilations=self.dilations,
                pads=begin + end,
                output_padding=outpad if any(outpad) else None,
                group=group if group != 1 else None,
            )
        self.require_runtime_slices()
        full = e.ConvTranspose(
            z,
            w,
            strides=self.strides,
            dilations=self.dilations,
            output_padding=[s - 1 for s in self.strides] if any(s > 1 for s in self.strides) else None,
            group=group if group != 1 else None,
        )
        start_t = e.ints(self.begin) if self.static_pads else self.begin
        ends = e.Add(start_t, self.in_shape_rt())
        return e.slice(full, start_t, ends, axes=list(range(2, k + 2)))

    # --------------------------------------------------------- weight gradient
    def correlate(self, inp: str, dout: str, group: int) -> str:
        """dW[m, c, k] = sum_{n,o} dout[n, m, o] * inp_padded[n, g(m)*Cg + c, o*s + k*dil]

        A Conv whose batch is inp's channels (within a group), whose channels
        are (group, batch) and whose kernel is dout with batch and channels
        swapped: strides and dilations trade places."""
        e = self.ctx.emit
        k = self.k
        if group == 1:
            xt = e.Transpose(inp, perm=[1, 0] + list(range(2, k + 2)))
        else:
            spatial = e.shape_of(inp, 2)
            split = e.Reshape(inp, e.Concat(e.shape_of(inp, 0, 1), e.ints([group, -1]), spatial, axis=0))
            moved = e.Transpose(split, perm=[2, 1, 0] + list(range(3, k + 3)))
            xt = e.Reshape(moved, e.Concat(e.ints([0, -1]), spatial, axis=0))
        dt = e.Transpose(dout, perm=[1, 0] + list(range(2, k + 2)))
        if self.static_pads:
            r = e.Conv(
                xt,
                dt,
                strides=self.dilations,
                dilations=self.strides,
                pads=list(self.begin) + list(self.end) if any(self.begin) or any(self.end) else None,
                group=group if group != 1 else None,
            )
        else:
            if e.opset < 11:
                raise TrainingModelError(self._where(f"runtime pads need opset >= 11, model has {e.opset}"))
            zeros2 = e.ints([0, 0])
            pads = e.Concat(zeros2, self.begin, zeros2, self.end, axis=0)
            r = e.Conv(
                e.Pad(xt, pads),
                dt,
                strides=self.dilations,
                dilations=self.strides,
                group=group if group != 1 else None,
            )
        # The result may be longer than the kernel when the forward op left
        # trailing input unused (r >= dil); keep the first K.
        exact = self.static_kernel and self.static_pads and all(
            d is not None for d in self.in_dims + self.out_dims
        )
        if exact:
            longer = False
            for i in range(k):
                span = self.in_dims[i] + self.begin[i] + self.end[i]
                got = (span - self.strides[i] * (self.out_dims[i] - 1) - 1) // self.dilations[i] + 1
                longer = longer or got != self.kernel[i]
            if longer:
                r = e.slice(r, [0] * k, self.kernel, axes=list(range(2, k + 2)))
        else:
            self.require_runtime_slices()
            r = e.slice(r, e.ints([0] * k), self.kernel_rt(), axes=list(range(2, k + 2)))
        return e.Transpose(r, perm=[1, 0] + list(range(2, k + 2)))


def _spatial_rank(ctx: VJPContext, *names: str) -> int:
    """Number of spatial axes: from kernel_shape, else from a known rank."""
    ks = ctx.attr("kernel_shape")
    if ks is not None:
        return len(ks)
    for n in names:
        r = ctx.rank(n)
        if r is not None:
            return r - 2
    raise TrainingModelError(
        f"gradient of {ctx.node.op_type} node {ctx.node.name!r} needs the number of "
        "spatial axes: give kernel_shape or inputs of known rank"
    )


def _kernel_dims(ctx: VJPContext, w: str, k: int) -> list[int | None]:
    ks = ctx.attr("kernel_shape")
    if ks is not None:
        return [int(v) for v in ks]
    s = ctx.shape(w)
    if s is not None and len(s) == k + 2:
        return [d if isinstance(d, int) else None for d in s[2:]]
    return [None] * k


def _bias_grad(ctx: VJPContext, dy: str, k: int) -> str:
    """dB[m] = sum over batch and spatial axes of dy[:, m]"""
    return ctx.emit.reduce_sum(dy, [0] + list(range(2, k + 2)), keepdims=False)


# --------------------------------------------------------------------- Conv
@vjp("Conv")
def conv_vjp(ctx, dy):
    """y[n,m,o] = sum_{c in group(m), k} w[m,c,k] x_pad[n,c,o*s + k*dil] + b[m]
    ->  dx = ConvTranspose(dy, w) with the same strides, dilations, group, cropped to x
        dw = Conv(x^T, dy^T) with strides and dilations swapped (see _Window.correlate)
        db = sum over batch and spatial axes of dy"""
    x, w = ctx.inputs[0], ctx.inputs[1]
    k = _spatial_rank(ctx, w, x)
    group = int(ctx.attr("group", 1))
    kernel_rt = ctx.emit.shape_of(w, 2) if not all(_kernel_dims(ctx, w, k)) else None
    win = _Window(ctx, x, ctx.outputs[0], k, _kernel_dims(ctx, w, k), kernel_rt)
    dx = win.scatter(dy, w, group) if ctx.needs(0) else None
    dw = win.correlate(x, dy, group) if ctx.needs(1) else None
    db = _bias_grad(ctx, dy, k) if ctx.input(2) and ctx.needs(2) else None
    return (dx, dw, db)[: len(ctx.inputs)]


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
    ScatterElements(reduction='add').  Earlier opsets scatter without
    reduction, one class of output positions at a time (o_i mod m_i, with
    m_i = ceil(window extent / stride)), within which windows are disjoint, so
    no index repeats: acc = Scatter(acc, idx_c, Gather(acc, idx_c) + dy_c)."""
    e = ctx.emit
    x = ctx.inputs[0]
    k = len(ctx.attr("kernel_shape"))
    idx = e.reshape(ctx.forward_output(1), [-1])
    upd = e.reshape(dy, [-1])
    if e.opset >= 16:
        flat = e.ScatterElements(_flat_zeros(ctx, x), idx, upd, axis=0, reduction="add")
    else:
        flat = _scatter_add_by_class(ctx, x, ctx.forward_output(1), dy, k)
    if int(ctx.attr("storage_order", 0)) == 1:
        perm = [0, 1] + list(range(k + 1, 1, -1))
        col = e.Reshape(flat, e.Gather(e.Shape(x), e.ints(perm), axis=0))
        return (e.Transpose(col, perm=perm),)
    return (e.Reshape(flat, e.Shape(x)),)


def _scatter_add_by_class(ctx: VJPContext, x: str, idx: str, dy: str, k: int) -> str:
    e = ctx.emit
    kernel = [int(v) for v in ctx.attr("kernel_shape")]
    strides = [int(v) for v in ctx.attr("strides", [1] * k)]
    dil = [int(v) for v in ctx.attr("dilations", [1] * k)]
    period = [math.ceil(((kk - 1) * d + 1) / s) for kk, d, s in zip(kernel, dil, strides)]
    classes = [[]]
    for m in period:
        classes = [c + [r] for c in classes for r in range(m)]
    scatter = "ScatterElements" if e.opset >= 11 else "Scatter"
    acc = _flat_zeros(ctx, x)
    if len(classes) == 1:
        return e.op(scatter, [acc, e.reshape(idx, [-1]), e.reshape(dy, [-1])], axis=0)
    if e.opset < 10:
        raise TrainingModelError(
            f"gradient of MaxPool node {ctx.node.name!r}: overlapping windows need "
            f"strided Slice (opset >= 10), model has {e.opset}"
        )
    axes = list(range(2, k + 2))
    big = [2**62] * k
    for c in classes:
        idx_c = e.reshape(e.slice(idx, c, big, axes=axes, steps=period), [-1])
        dy_c = e.reshape(e.slice(dy, c, big, axes=axes, steps=period), [-1])
        acc = e.op(scatter, [acc, idx_c, e.Add(e.Gather(acc, idx_c, axis=0), dy_c)], axis=0)
    return acc


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
    win = _Window(ctx, x, y, k, kernel, has_dilations=ctx.opset >= 19)
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


def _inverse_divisor(ctx: VJPContext, win: _Window, ones_k: str, include_pad: int, et: int) -> str:
    """1 / div(o) for every output position, shaped (1, 1, O...)."""
    e = ctx.emit
    k = win.k
    one = numpy_helper.from_array(np.ones(1, dtype=np_dtype(et)))
    image = e.op("ConstantOfShape", [e.Concat(e.ints([1, 1]), win.in_shape_rt(), axis=0)], value=one)
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
        zeros2 = e.ints([0, 0])
        pads = e.Concat(zeros2, win.begin, zeros2, e.Add(win.end, e.ints(extra)), axis=0)
        counts = e.Conv(e.Pad(image, pads), ones_k, strides=win.strides, dilations=win.dilations)
    if any(extra):
        win.require_runtime_slices()
        counts = e.slice(counts, e.ints([0] * k), e.shape_of(win.y, 2), axes=list(range(2, k + 2)))
    counts = e.Max(counts, ctx.const(1.0, dtype=et))  # a window with no valid position divides nothing
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
    return (e.Expand(e.Mul(dy, ratio), e.Shape(x)),)
