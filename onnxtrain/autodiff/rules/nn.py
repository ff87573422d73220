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
from onnx import TensorProto, helper, numpy_helper

from ...emitter import Emitter, np_dtype
from ...errors import GradientError, TrainingModelError
from .recurrent import recurrent_vjp
from ..registry import VJPContext, no_grad, vjp
from .linalg import dims_of, sum_to
from .reduce import constant_value
from .elementwise import float_equal
from .shape import arange, int64, reshape_to, scatter_add_axis, zeros_of_shape

Pads = list[int] | str  # static ints, or a runtime int64 tensor with one entry per spatial axis


# ------------------------------------------------------------------ softmax
def _softmax_family(ctx: VJPContext, dy: str, log: bool) -> str:
    """The shared backward of Softmax (log=False) and LogSoftmax (log=True)."""
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
    dims (None where unknown, then read at run time from ``weight``)."""

    def __init__(
        self,
        ctx: VJPContext,
        x: str,
        y: str,
        k: int,
        kernel: Sequence[int | None],
        weight: str | None = None,
        has_dilations: bool = True,
        pads: tuple[Pads, Pads] | None = None,
    ) -> None:
        self.ctx = ctx
        self.x, self.y, self.k = x, y, k
        self.strides = [int(v) for v in ctx.attr("strides", [1] * k)]
        self.dilations = (
            [int(v) for v in ctx.attr("dilations", [1] * k)] if has_dilations else [1] * k
        )
        self.kernel = list(kernel)
        self._weight = weight
        self.in_dims = self._spatial(x)
        # ONNX shape inference does not drop ceil_mode windows that start in
        # the end padding, the runtime does: do not trust static output dims there.
        self.out_dims = [None] * k if ctx.attr("ceil_mode", 0) else self._spatial(y)
        self.auto_pad = ctx.attr("auto_pad", "NOTSET")
        self.begin, self.end = pads if pads is not None else self._pads()

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
        if self._weight is None:
            raise TrainingModelError(self.where("the kernel shape is unknown"))
        return self.ctx.emit.shape_of(self._weight, 2)

    def in_shape_rt(self) -> str:
        """The input's spatial dims as a runtime int64 vector."""
        return self.ctx.emit.shape_of(self.x, 2)

    def where(self, what: str) -> str:
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
            raise TrainingModelError(self.where(f"unknown auto_pad {self.auto_pad!r}"))
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
                self.where(
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
    def _patch_form(self, inp: str, group: int) -> str | None:
        """Which explicit-patch form suits this weight gradient, if any (see ``patches``)."""
        shape = self.ctx.shape(inp)
        if (
            group != 1
            or self.ctx.opset < 13
            or not (self.static_kernel and self.static_pads)
            or shape is None
            or not all(isinstance(d, int) and d > 0 for d in shape)
            or not all(isinstance(d, int) and d > 0 for d in self.in_dims + self.out_dims)
            or self.ctx.dtype(inp) not in (TensorProto.FLOAT, TensorProto.DOUBLE)
        ):
            return None
        taps = math.prod(self.kernel)
        if shape[1] * taps <= 64:
            return "conv"
        return "slices" if taps <= 49 else None

    def patches(self, inp: str, dout: str, form: str) -> str:
        """dW[m, c, k] = sum_{n,o} dout[n, m, o] * inp_padded[n, c, o*s + k*dil], with the
        patches inp_padded[n, c, o*s + k*dil] made explicit and contracted by MatMul
        (onnxruntime's Conv with the batch as channels is slow for this, 2-4x).

        ``conv`` (few channels x taps): all patches at once, a Conv with one-hot
        filters (group = C) -> [N, C*K, P]; dW = sum_n dout_n @ patches_n^T.
        ``slices`` (many channels): per tap, the strided Slice of inp_padded
        -> [N, C, P]; dW[:, :, tap] = sum_n dout_n @ slice_n^T."""
        e = self.ctx.emit
        k = self.k
        n, c = self.ctx.shape(inp)[:2]
        outs = math.prod(self.out_dims)
        taps = math.prod(self.kernel)
        dy3 = e.reshape(dout, [n, -1, outs])  # [N, M, P]
        if form == "conv":
            # Filter ch * K + t picks tap t of channel ch.
            onehot = np.tile(np.eye(taps), (c, 1)).reshape(c * taps, 1, *self.kernel)
            onehot = onehot.astype(np_dtype(self.ctx.dtype(inp)))
            pads = list(self.begin) + list(self.end)
            cols = e.Conv(
                inp,
                e.const(onehot),
                strides=self.strides,
                dilations=self.dilations,
                pads=pads if any(pads) else None,
                group=c if c != 1 else None,
            )
            cols = e.Transpose(e.reshape(cols, [n, c * taps, outs]), perm=[0, 2, 1])  # [N, P, C*K]
            dw = e.reduce_sum(e.MatMul(dy3, cols), [0], keepdims=False)  # [M, C*K]
            return e.reshape(dw, [-1, c, *self.kernel])
        padded = inp
        if any(self.begin) or any(self.end):
            zeros2 = [0, 0]
            padded = e.Pad(inp, e.ints(zeros2 + list(self.begin) + zeros2 + list(self.end)))
        columns = []
        for tap in np.ndindex(*self.kernel):
            starts = [t * d for t, d in zip(tap, self.dilations)]
            ends = [st + (o - 1) * s + 1 for st, o, s in zip(starts, self.out_dims, self.strides)]
            piece = e.slice(padded, starts, ends, axes=list(range(2, k + 2)), steps=self.strides)
            piece = e.Transpose(e.reshape(piece, [n, c, outs]), perm=[0, 2, 1])  # [N, P, C]
            columns.append(e.unsqueeze(e.reduce_sum(e.MatMul(dy3, piece), [0], keepdims=False), [2]))
        dw = e.concat(columns, axis=2) if len(columns) > 1 else columns[0]  # [M, C, K]
        return e.reshape(dw, [-1, c, *self.kernel])

    def correlate(self, inp: str, dout: str, group: int) -> str:
        """dW[m, c, k] = sum_{n,o} dout[n, m, o] * inp_padded[n, g(m)*Cg + c, o*s + k*dil]

        With static shapes and one group: explicit patches and MatMul (``patches``).
        Otherwise a Conv whose batch is inp's channels (within a group), whose
        channels are (group, batch) and whose kernel is dout with batch and
        channels swapped: strides and dilations trade places."""
        e = self.ctx.emit
        k = self.k
        form = self._patch_form(inp, group)
        if form is not None:
            return self.patches(inp, dout, form)
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
                raise TrainingModelError(self.where(f"runtime pads need opset >= 11, model has {e.opset}"))
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
    win = _Window(ctx, x, ctx.outputs[0], k, _kernel_dims(ctx, w, k), weight=w)
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
    ScatterElements(reduction='add').  Opsets 10-15 scatter without
    reduction, one class of output positions at a time (o_i mod m_i, with
    m_i = ceil(window extent / stride)), within which windows are disjoint, so
    no index repeats: acc = Scatter(acc, idx_c, Gather(acc, idx_c) + dy_c).
    The classes are strided Slices (opset >= 10); at opset 9 a single class
    (disjoint windows) still scatters by Indices.  Otherwise (opsets 7-8, where
    MaxPool-7 has no Indices and no Scatter exists, and overlapping windows at
    opset 9) the argmax is recomputed from x and y: see ``_max_pool_by_mask``."""
    e = ctx.emit
    x = ctx.inputs[0]
    k = len(ctx.attr("kernel_shape"))
    if e.opset < 10 and (e.opset < 9 or len(_pool_classes(ctx, k)) > 1):
        return (_max_pool_by_mask(ctx, dy, k),)
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
    scatter = "ScatterElements" if e.opset >= 11 else "Scatter"
    acc = _flat_zeros(ctx, x)
    if len(classes) == 1:
        return e.op(scatter, [acc, e.reshape(idx, [-1]), e.reshape(dy, [-1])], axis=0)
    axes = list(range(2, k + 2))
    big = [2**62] * k
    for c in classes:
        idx_c = e.reshape(e.slice(idx, c, big, axes=axes, steps=period), [-1])
        dy_c = e.reshape(e.slice(dy, c, big, axes=axes, steps=period), [-1])
        acc = e.op(scatter, [acc, idx_c, e.Add(e.Gather(acc, idx_c, axis=0), dy_c)], axis=0)
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
    win = _Window(ctx, x, y, k, kernel, has_dilations=ctx.opset >= 10)
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
    k = _spatial_rank(ctx, w, x)
    group = int(ctx.attr("group", 1))
    kernel = _kernel_dims(ctx, w, k)
    pads = _conv_transpose_pads(ctx, x, k, kernel)
    # The window of the Conv that maps y's space to x's space.
    win = _Window(ctx, y, x, k, kernel, weight=w, pads=pads)
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
    eps = float(ctx.attr("epsilon", 1e-5))
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
        momentum = float(ctx.attr("momentum", 0.9))
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
    xhat, inv_std = _batch_stats(ctx, x, spatial, float(ctx.attr("epsilon", 1e-5)))
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
    axes = list(range(int(ctx.attr("axis", -1)) % r, r))
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
        d_scale = sum_to(ctx, e.Mul(dy, xhat), scale, x_dims, dims_of(ctx, scale, ctx.require_rank(scale)))
    if dy is not None and bias is not None and ctx.needs(2):
        d_b = sum_to(ctx, dy, bias, x_dims, dims_of(ctx, bias, ctx.require_rank(bias)))
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
    eps = float(ctx.attr("epsilon", 1e-5))
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
    axis = int(ctx.attr("axis", -1))
    p = int(ctx.attr("p", 2))
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
    axes = [int(a) for a in ctx.attr("axes", [0, 2, 3])]
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
    alpha, beta, bias = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75)), float(ctx.attr("bias", 1.0))
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


@vjp("Dropout")
def dropout_vjp(ctx, dy, *_):
    """training: y = x * mask / (1 - ratio)  ->  dx = dy * mask / (1 - ratio),
        d ratio = sum(dy * y) / (1 - ratio)   (the sampled mask held fixed)
    inference (no training_mode input, or a constant false one; always before
    opset 12, where runtimes treat Dropout as inference): y = x  ->  dx = dy,
        and y does not depend on ratio (d ratio = 0)

    The mask is the node's mask output (added to the node when absent)."""
    e = ctx.emit
    ratio_in = ctx.input(1)

    def inference():
        return (dy, ctx.zeros_like(ratio_in) if ratio_in and ctx.needs(1) else None)

    if ctx.opset < 12:
        return inference()
    mode = ctx.input(2)
    if mode is None:
        return inference()
    known = e.constants.get(mode)
    if known is not None and not bool(np.asarray(known).reshape(-1)[0]):
        return inference()
    et = ctx.dtype(ctx.inputs[0])
    ratio = e.cast_to(ratio_in, et) if ratio_in is not None else ctx.const(0.5, dtype=et)
    keep = e.Sub(ctx.const(1.0, dtype=et), ratio)
    scale = e.Div(ctx.const(1.0, dtype=et), keep)
    if known is None:  # decided at run time; the inference-mode mask is all true
        scale = e.Where(mode, scale, ctx.const(1.0, dtype=et))
    mask = e.Cast(ctx.forward_output(1), to=et)
    dx = e.Mul(e.Mul(dy, mask), scale)
    d_ratio = None
    if ratio_in is not None and ctx.needs(1):
        d_ratio = e.Div(e.reduce_sum(e.Mul(dy, ctx.outputs[0]), None, keepdims=False), keep)
        if known is None:
            d_ratio = e.Where(mode, d_ratio, ctx.const(0.0, dtype=et))
        d_ratio = e.cast_to(d_ratio, ctx.dtype(ratio_in))
    return (dx, d_ratio)


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
    p = float(ctx.attr("p", 2))
    et = ctx.dtype(x)
    win = _Window(ctx, x, y, k, kernel, has_dilations=ctx.opset >= 18)
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


# ------------------------------------------------------- RNN, GRU and LSTM
# The recurrences run as Scan ops, so the sequence length may be dynamic.
# Every hidden state H_t is the forward output Y (added to the node when
# absent).  The pre-activations of all steps come from Y by batched MatMuls;
# only LSTM's cell states C_t, which the op does not output, need a forward
# Scan.  The backward pass is a Scan in reverse processing order that carries
# dH (and dC) and emits the pre-activation gradients of every step; the
# weight gradients are then single Gemms over all steps.

#: Activations whose derivative follows from their output y.
_ACT_DERIVATIVES = {
    "Sigmoid": lambda e, y: e.Mul(y, e.Sub(e.const(1.0, like=y), y)),
    "Tanh": lambda e, y: e.Sub(e.const(1.0, like=y), e.Mul(y, y)),
    "Relu": lambda e, y: e.Cast(e.Greater(y, e.const(0.0, like=y)), to=e.dtype(y)),
}


def _act(e: Emitter, name: str, x: str) -> str:
    """Apply the activation ``name`` (an ONNX op of the same name)."""
    return e.op(name, [x])


def _act_grad(e: Emitter, name: str, y: str) -> str:
    """The activation's derivative, from its output y."""
    return _ACT_DERIVATIVES[name](e, y)


class _NeedsGeneralPath(TrainingModelError):
    """A recurrent configuration the direct rule does not cover (clip, layout=1,
    other activations, unknown hidden size); the general rule of recurrent.py,
    which rewrites the layer as a Scan, handles it instead."""


class _Recurrence:
    """What the RNN-family rules share: attributes, per-direction slices of
    the inputs, time shifts, and the Scan builder."""

    def __init__(self, ctx: VJPContext, default_acts: list[str]) -> None:
        self.ctx = ctx
        self.e = ctx.emit
        op = ctx.node.op_type
        self.where = f"gradient of {op} node {ctx.node.name!r}"
        direction = ctx.attr("direction", "forward")
        self.dirs = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}.get(direction)
        if self.dirs is None:
            raise TrainingModelError(f"{self.where}: unknown direction {direction!r}")
        if ctx.input(4) is not None:
            raise TrainingModelError(f"{self.where}: sequence_lens is not supported")
        if ctx.attr("clip") is not None:
            raise _NeedsGeneralPath(f"{self.where}: the clip attribute")
        acts = ctx.attr("activations") or default_acts * len(self.dirs)
        for a in acts:
            if a not in _ACT_DERIVATIVES:
                raise _NeedsGeneralPath(
                    f"{self.where}: activation {a!r} is not supported "
                    f"(supported: {sorted(_ACT_DERIVATIVES)})"
                )
        if ctx.attr("activation_alpha") or ctx.attr("activation_beta"):
            raise TrainingModelError(f"{self.where}: activation_alpha/beta are not supported")
        per = len(default_acts)
        self.acts = [acts[i * per : (i + 1) * per] for i in range(len(self.dirs))]
        hidden = ctx.attr("hidden_size")
        if hidden is None:
            rs = ctx.shape(ctx.inputs[2])
            hidden = rs[-1] if rs is not None and isinstance(rs[-1], int) else None
        if hidden is None:
            raise _NeedsGeneralPath(f"{self.where}: hidden_size unknown")
        self.h = int(hidden)
        if ctx.attr("layout", 0):
            raise _NeedsGeneralPath(f"{self.where}: layout=1 (batch first)")
        self.x = ctx.inputs[0]
        self.y = ctx.forward_output(0)  # (T, D, B, H)
        self.et = ctx.dtype(ctx.inputs[0])

    def dir_slice(self, t: str | None, d: int, axis: int = 0) -> str | None:
        """t[d] along ``axis`` (the direction axis), that axis removed."""
        if t is None:
            return None
        return self.e.Gather(t, self.e.const(np.asarray(d, dtype=np.int64)), axis=axis)

    def state_input(self, i: int, d: int) -> str:
        """initial_h / initial_c of direction d, zeros when absent: (B, H)."""
        name = self.ctx.input(i)
        if name is not None:
            return self.dir_slice(name, d)
        e = self.e
        zero = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(self.et)))
        shape = e.Concat(e.shape_of(self.x, 1, 2), e.ints([self.h]), axis=0)
        return e.op("ConstantOfShape", [shape], value=zero)

    def shift(self, seq: str, first: str, reverse: bool) -> str:
        """The previous step of every step in processing order: [first, seq[:-1]]
        forward, [seq[1:], first] in reverse."""
        e = self.e
        head = e.unsqueeze(first, [0])
        if reverse:
            return e.Concat(e.slice(seq, [1], [2**62], [0]), head, axis=0)
        return e.Concat(head, e.slice(seq, [0], [-1], [0]), axis=0)

    def scan(self, states: list[str], xs: list[str], body, n_out: int, backward: bool, reverse: bool):
        """Scan over axis 0 of ``xs``; ``body(sub_emitter, state_names, x_names)``
        returns (new states, per-step outputs).  Processing order: forward in
        time unless ``reverse``; ``backward`` flips it."""
        e = self.e
        sub = Emitter(e.opset, e.names, dict(e.dtypes), hint=f"{e.hint}/scan")
        s_in = [e.names.fresh(f"{e.hint}/scan_state") for _ in states]
        x_in = [e.names.fresh(f"{e.hint}/scan_in") for _ in xs]
        for n in s_in + x_in:
            sub.dtypes[n] = self.et
        new_states, outs = body(sub, s_in, x_in)
        body_outs = [sub.Identity(t) for t in list(new_states) + list(outs)]
        graph = helper.make_graph(
            sub.nodes,
            e.names.fresh(f"{e.hint}/scan_body"),
            # every state and step slice is (batch, features); Scan-9 wants ranks
            [helper.make_tensor_value_info(n, self.et, [None, None]) for n in s_in + x_in],
            [helper.make_tensor_value_info(n, self.et, [None, None]) for n in body_outs],
        )
        flip = int(backward != reverse)
        res = e.op(
            "Scan",
            states + xs,
            outputs=len(states) + n_out,
            body=graph,
            num_scan_inputs=len(xs),
            scan_input_directions=[flip] * len(xs) if flip else None,
            scan_output_directions=[flip] * n_out if flip and n_out else None,
        )
        return res[: len(states)], res[len(states) :]

    def seq_matmul(self, seq: str, w: str, trans: bool) -> str:
        """(T, B, K) @ w^T (w: (M, K)) if trans else (T, B, M) @ w."""
        e = self.e
        return e.MatMul(seq, e.Transpose(w, perm=[1, 0]) if trans else w)

    def step_gemm(self, da: str, seq: str, cols: int) -> str:
        """sum_t da_t^T seq_t: (T, B, M), (T, B, K) -> (M, K) as one Gemm."""
        e = self.e
        flat_a = e.reshape(da, [-1, cols])
        flat_s = e.Reshape(seq, e.Concat(e.ints([-1]), e.shape_of(seq, 2), axis=0))
        c = None if e.opset >= 11 else self.ctx.const(0.0, like=da)
        return e.Gemm(flat_a, flat_s, c, transA=1, beta=None if c is None else 0.0)

    def sum_steps(self, t: str) -> str:
        return self.e.reduce_sum(t, [0, 1], keepdims=False)

    def stack(self, per_dir: list[str], axis: int = 0) -> str:
        """Stack per-direction tensors along a new axis."""
        items = [self.e.unsqueeze(t, [axis]) for t in per_dir]
        return self.e.concat(items, axis=axis)

    def dy_dir(self, dy: str | None, d: int) -> str:
        """The gradient of Y for direction d, (T, B, H); zeros when Y has none."""
        if dy is None:
            return self.e.zeros_like(self.dir_slice(self.y, d, axis=1))
        return self.dir_slice(dy, d, axis=1)

    def dstate_dir(self, dstate: str | None, d: int, like: str) -> str:
        """The gradient of Y_h/Y_c for direction d; zeros when it has none."""
        if dstate is None:
            return self.e.zeros_like(like)
        return self.dir_slice(dstate, d)


def _rnn_results(rec: _Recurrence, dx: list[str], grads: dict[int, list[str]]) -> list[str | None]:
    """Assemble per-direction gradients into one entry per node input."""
    ctx, e = rec.ctx, rec.e
    out: list[str | None] = [None] * len(ctx.inputs)
    if ctx.needs(0):
        out[0] = e.sum_all(dx)
    for i, per_dir in grads.items():
        if i < len(ctx.inputs) and ctx.input(i) is not None and ctx.needs(i):
            out[i] = rec.stack(per_dir)
    return out


@vjp("RNN")
def rnn_vjp(ctx, dy, dy_h=None):
    """H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb)
    ->  backward Scan: dH = dY_t + dH_next, da_t = dH * f'(H_t), dH_prev = da_t R
        dX_t = da_t W, dW = sum_t da_t^T X_t, dR = sum_t da_t^T H_{t-1},
        dB = [sum da, sum da], d initial_h = dH_prev after the first step"""
    try:
        rec = _Recurrence(ctx, ["Tanh"])
    except _NeedsGeneralPath:
        return recurrent_vjp(ctx, dy, dy_h)
    e = rec.e
    w_all, r_all = ctx.inputs[1], ctx.inputs[2]
    dx, grads = [], {1: [], 2: [], 3: [], 5: []}
    for d, reverse in enumerate(rec.dirs):
        (f,) = rec.acts[d]
        w, r = rec.dir_slice(w_all, d), rec.dir_slice(r_all, d)
        y = rec.dir_slice(rec.y, d, axis=1)
        h0 = rec.state_input(5, d)
        h_prev = rec.shift(y, h0, reverse)

        def body(sub, states, xs, f=f, r=r):
            (dh_next,) = states
            dy_t, y_t = xs
            da = sub.Mul(sub.Add(dy_t, dh_next), _act_grad(sub, f, y_t))
            return [sub.MatMul(da, r)], [da]

        start = rec.dstate_dir(dy_h, d, h0)
        (dh0,), (da,) = rec.scan([start], [rec.dy_dir(dy, d), y], body, 1, backward=True, reverse=reverse)
        dx.append(rec.seq_matmul(da, w, trans=False))
        grads[1].append(rec.step_gemm(da, rec.x, rec.h))
        grads[2].append(rec.step_gemm(da, h_prev, rec.h))
        s = rec.sum_steps(da)
        grads[3].append(e.Concat(s, s, axis=0))
        grads[5].append(dh0)
    return _rnn_results(rec, dx, grads)


@vjp("GRU")
def gru_vjp(ctx, dy, dy_h=None):
    """z = f(X Wz^T + H_prev Rz^T + bz), r = f(X Wr^T + H_prev Rr^T + br),
    h~ = g(X Wh^T + (r * H_prev) Rh^T + Rbh + Wbh)         (linear_before_reset=0)
    h~ = g(X Wh^T + r * (H_prev Rh^T + Rbh) + Wbh)         (linear_before_reset=1)
    H = (1 - z) * h~ + z * H_prev
    ->  backward Scan with dH = dY_t + dH_next:
        dh~ = dH (1 - z), dz = dH (H_prev - h~), da_h = dh~ g'(h~)
        lbr=0: q = da_h Rh, dr = q * H_prev, dH_prev = dH z + q r + [da_z, da_r] R_zr
        lbr=1: dr = da_h * u, du = da_h * r, dH_prev = dH z + du Rh + [da_z, da_r] R_zr
        da_z = dz f'(z), da_r = dr f'(r); weight gradients sum over steps."""
    try:
        rec = _Recurrence(ctx, ["Sigmoid", "Tanh"])
    except _NeedsGeneralPath:
        return recurrent_vjp(ctx, dy, dy_h)
    e = rec.e
    h = rec.h
    lbr = bool(ctx.attr("linear_before_reset", 0))
    w_all, r_all = ctx.inputs[1], ctx.inputs[2]
    b_all = ctx.input(3)
    dx, grads = [], {1: [], 2: [], 3: [], 5: []}
    for d, reverse in enumerate(rec.dirs):
        fa, ga = rec.acts[d]
        w, r = rec.dir_slice(w_all, d), rec.dir_slice(r_all, d)
        r_zr, r_h = e.split(r, [2 * h, h], axis=0)
        y = rec.dir_slice(rec.y, d, axis=1)
        h0 = rec.state_input(5, d)
        h_prev = rec.shift(y, h0, reverse)
        ax = rec.seq_matmul(rec.x, w, trans=True)
        if b_all is not None:
            wb, rb = e.split(rec.dir_slice(b_all, d), [3 * h, 3 * h], axis=0)
            ax = e.Add(ax, wb)
            rb_zr, rb_h = e.split(rb, [2 * h, h], axis=0)
        ax_zr, ax_h = e.split(ax, [2 * h, h], axis=-1)
        a_zr = e.Add(ax_zr, rec.seq_matmul(h_prev, r_zr, trans=True))
        if b_all is not None:
            a_zr = e.Add(a_zr, rb_zr)
        z, rg = e.split(_act(e, fa, a_zr), [h, h], axis=-1)
        if lbr:
            u = rec.seq_matmul(h_prev, r_h, trans=True)
            if b_all is not None:
                u = e.Add(u, rb_h)
            a_h = e.Add(ax_h, e.Mul(rg, u))
        else:
            a_h = e.Add(ax_h, rec.seq_matmul(e.Mul(rg, h_prev), r_h, trans=True))
            if b_all is not None:
                a_h = e.Add(a_h, rb_h)
        hh = _act(e, ga, a_h)

        def body(sub, states, xs, fa=fa, ga=ga, r_zr=r_zr, r_h=r_h):
            (dh_next,) = states
            dy_t, z_t, r_t, hh_t, hp_t = xs[:5]
            dh = sub.Add(dy_t, dh_next)
            one = sub.const(1.0, like=z_t)
            da_h = sub.Mul(sub.Mul(dh, sub.Sub(one, z_t)), _act_grad(sub, ga, hh_t))
            dz = sub.Mul(dh, sub.Sub(hp_t, hh_t))
            dh_prev = sub.Mul(dh, z_t)
            if lbr:
                u_t = xs[5]
                dr = sub.Mul(da_h, u_t)
                du = sub.Mul(da_h, r_t)
                dh_prev = sub.Add(dh_prev, sub.MatMul(du, r_h))
                extra = [du]
            else:
                q = sub.MatMul(da_h, r_h)
                dr = sub.Mul(q, hp_t)
                dh_prev = sub.Add(dh_prev, sub.Mul(q, r_t))
                extra = []
            da_zr = sub.Concat(
                sub.Mul(dz, _act_grad(sub, fa, z_t)), sub.Mul(dr, _act_grad(sub, fa, r_t)), axis=-1
            )
            dh_prev = sub.Add(dh_prev, sub.MatMul(da_zr, r_zr))
            return [dh_prev], [da_zr, da_h] + extra

        scan_in = [rec.dy_dir(dy, d), z, rg, hh, h_prev] + ([u] if lbr else [])
        start = rec.dstate_dir(dy_h, d, h0)
        (dh0,), outs = rec.scan([start], scan_in, body, 2 + lbr, backward=True, reverse=reverse)
        da_zr, da_h = outs[0], outs[1]
        da = e.Concat(da_zr, da_h, axis=-1)
        dx.append(rec.seq_matmul(da, w, trans=False))
        grads[1].append(rec.step_gemm(da, rec.x, 3 * h))
        if lbr:
            du = outs[2]
            dr_h = rec.step_gemm(du, h_prev, h)
            rb_h_grad = rec.sum_steps(du)
        else:
            dr_h = rec.step_gemm(da_h, e.Mul(rg, h_prev), h)
            rb_h_grad = rec.sum_steps(da_h)
        grads[2].append(e.Concat(rec.step_gemm(da_zr, h_prev, 2 * h), dr_h, axis=0))
        s = rec.sum_steps(da)
        s_zr = rec.sum_steps(da_zr)
        grads[3].append(e.Concat(s, s_zr, rb_h_grad, axis=0))
        grads[5].append(dh0)
    return _rnn_results(rec, dx, grads)


@vjp("LSTM")
def lstm_vjp(ctx, dy, dy_h=None, dy_c=None):
    """i = f(a_i + P_i C_prev), f_ = f(a_f + P_f C_prev), g = g(a_c), C = f_ C_prev + i g,
    o = f(a_o + P_o C), H = o h(C), with a = X W^T + H_prev R^T + Wb + Rb (gates i, o, f, c)
    ->  C_t from a forward Scan (the op does not output it), then a backward Scan with
        dH = dY_t + dH_next, da_o = dH h(C) f'(o), dC = dC_next + dH o h'(C) + da_o P_o,
        da_i = dC g f'(i), da_f = dC C_prev f'(f_), da_c = dC i g'(g),
        dC_prev = dC f_ + da_i P_i + da_f P_f, dH_prev = [da_i, da_o, da_f, da_c] R
    dW, dR, dB, dP sum over the steps; d initial_h/c are the final Scan states."""
    try:
        rec = _Recurrence(ctx, ["Sigmoid", "Tanh", "Tanh"])
    except _NeedsGeneralPath:
        return recurrent_vjp(ctx, dy, dy_h, dy_c)
    e = rec.e
    h = rec.h
    if ctx.attr("input_forget", 0):
        raise TrainingModelError(f"{rec.where}: input_forget=1 is not supported")
    w_all, r_all = ctx.inputs[1], ctx.inputs[2]
    b_all, p_all = ctx.input(3), ctx.input(7)
    dx, grads = [], {1: [], 2: [], 3: [], 5: [], 6: [], 7: []}
    for d, reverse in enumerate(rec.dirs):
        fa, ga, ha = rec.acts[d]
        w, r = rec.dir_slice(w_all, d), rec.dir_slice(r_all, d)
        y = rec.dir_slice(rec.y, d, axis=1)
        h0, c0 = rec.state_input(5, d), rec.state_input(6, d)
        h_prev = rec.shift(y, h0, reverse)
        a = e.Add(rec.seq_matmul(rec.x, w, trans=True), rec.seq_matmul(h_prev, r, trans=True))
        if b_all is not None:
            wb, rb = e.split(rec.dir_slice(b_all, d), [4 * h, 4 * h], axis=0)
            a = e.Add(a, e.Add(wb, rb))
        a_i, a_o, a_f, a_c = e.split(a, [h] * 4, axis=-1)
        if p_all is not None:
            p_i, p_o, p_f = e.split(rec.dir_slice(p_all, d), [h] * 3, axis=0)
        else:
            p_i = p_o = p_f = None

        def cell(sub, states, xs, fa=fa, ga=ga, p_i=p_i, p_f=p_f):
            (c_prev,) = states
            ai, af, ac = xs
            if p_i is not None:
                ai, af = sub.Add(ai, sub.Mul(p_i, c_prev)), sub.Add(af, sub.Mul(p_f, c_prev))
            c = sub.Add(sub.Mul(_act(sub, fa, af), c_prev), sub.Mul(_act(sub, fa, ai), _act(sub, ga, ac)))
            return [c], [c]

        _, (c_all,) = rec.scan([c0], [a_i, a_f, a_c], cell, 1, backward=False, reverse=reverse)
        c_prev = rec.shift(c_all, c0, reverse)
        peep = (lambda t, p, c: t if p is None else e.Add(t, e.Mul(p, c)))
        gi = _act(e, fa, peep(a_i, p_i, c_prev))
        gf = _act(e, fa, peep(a_f, p_f, c_prev))
        go = _act(e, fa, peep(a_o, p_o, c_all))
        gg = _act(e, ga, a_c)
        hc = _act(e, ha, c_all)

        def body(sub, states, xs, fa=fa, ga=ga, ha=ha, p_i=p_i, p_o=p_o, p_f=p_f, r=r):
            dh_next, dc_next = states
            dy_t, i_t, f_t, o_t, g_t, hc_t, cp_t = xs
            dh = sub.Add(dy_t, dh_next)
            da_o = sub.Mul(sub.Mul(dh, hc_t), _act_grad(sub, fa, o_t))
            dc = sub.Add(dc_next, sub.Mul(sub.Mul(dh, o_t), _act_grad(sub, ha, hc_t)))
            if p_o is not None:
                dc = sub.Add(dc, sub.Mul(da_o, p_o))
            da_i = sub.Mul(sub.Mul(dc, g_t), _act_grad(sub, fa, i_t))
            da_f = sub.Mul(sub.Mul(dc, cp_t), _act_grad(sub, fa, f_t))
            da_c = sub.Mul(sub.Mul(dc, i_t), _act_grad(sub, ga, g_t))
            dc_prev = sub.Mul(dc, f_t)
            if p_i is not None:
                dc_prev = sub.Add(dc_prev, sub.Add(sub.Mul(da_i, p_i), sub.Mul(da_f, p_f)))
            da = sub.Concat(da_i, da_o, da_f, da_c, axis=-1)
            return [sub.MatMul(da, r), dc_prev], [da]

        starts = [rec.dstate_dir(dy_h, d, h0), rec.dstate_dir(dy_c, d, c0)]
        scan_in = [rec.dy_dir(dy, d), gi, gf, go, gg, hc, c_prev]
        (dh0, dc0), (da,) = rec.scan(starts, scan_in, body, 1, backward=True, reverse=reverse)
        dx.append(rec.seq_matmul(da, w, trans=False))
        grads[1].append(rec.step_gemm(da, rec.x, 4 * h))
        grads[2].append(rec.step_gemm(da, h_prev, 4 * h))
        s = rec.sum_steps(da)
        grads[3].append(e.Concat(s, s, axis=0))
        grads[5].append(dh0)
        grads[6].append(dc0)
        if p_all is not None:
            d_i, d_o, d_f, _ = e.split(da, [h] * 4, axis=-1)
            grads[7].append(
                e.Concat(
                    rec.sum_steps(e.Mul(d_i, c_prev)),
                    rec.sum_steps(e.Mul(d_o, c_all)),
                    rec.sum_steps(e.Mul(d_f, c_prev)),
                    axis=0,
                )
            )
    return _rnn_results(rec, dx, grads)


# ------------------------------------------------------------ Resize, Upsample
class _ResizeSpec:
    """How a Resize (opsets 10-19+) or Upsample (7-9) node maps each axis.

    ``axes``: the resized axes, and for each its position j in the node's
    per-axis lists (scales, sizes, roi).  ``scales``/``sizes``/``roi`` name the
    inputs (None where absent); Upsample-7 keeps its scales in an attribute."""

    def __init__(self, ctx: VJPContext, rank: int) -> None:
        self.ctx = ctx
        self.rank = rank
        op = ctx.node.op_type
        self.upsample = op == "Upsample"
        self.mode = ctx.attr("mode", "nearest")
        self.coordinate = ctx.attr("coordinate_transformation_mode", "half_pixel")
        self.policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
        self.roi = self.scales = self.sizes = None
        self.static_scales: list[float] | None = None
        if self.upsample and ctx.opset < 9:
            self.static_scales = [float(s) for s in ctx.attr("scales")]
        elif self.upsample or ctx.opset < 11:
            self.scales = ctx.inputs[1]
        else:
            self.roi = ctx.input(1)
            if ctx.input(3) is not None:
                self.sizes = ctx.inputs[3]
            else:
                self.scales = ctx.input(2)
        axes = ctx.attr("axes")
        self.axes = list(range(rank)) if axes is None else [int(a) % rank for a in axes]

    def where(self, what: str) -> str:
        n = self.ctx.node
        return f"gradient of {n.op_type} node {n.name!r}: {what}"

    def unchanged(self, j: int, axis: int, x: str, y: str) -> bool:
        """Whether axis ``axis`` is statically known to be copied as it is."""
        if self.coordinate == "tf_crop_and_resize":
            return False  # the roi moves even a same-size axis
        if self.static_scales is not None:
            return self.static_scales[axis] == 1.0
        xs, ys = self.ctx.shape(x), self.ctx.shape(y)
        if xs is not None and ys is not None and isinstance(xs[axis], int) and xs[axis] == ys[axis]:
            # same size: every coordinate mode maps o to o (scale 1)
            if self.sizes is not None:
                return True
            value = constant_value(self.ctx, self.scales) if self.scales else None
            return value is not None and float(value.reshape(-1)[j]) == 1.0
        return False

    def _attrs(self) -> dict:
        ctx = self.ctx
        if self.upsample or ctx.opset < 11:
            return {"mode": self.mode}
        names = [
            "mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside", "nearest_mode",
        ]
        if ctx.opset >= 18:
            names.append("antialias")
        attrs = {a: ctx.attr(a) for a in names if ctx.attr(a) is not None}
        if self.coordinate == "tf_crop_and_resize":
            attrs["extrapolation_value"] = 0.0  # a constant fill carries no gradient of x
        return attrs

    def axis_matrix(self, j: int, axis: int, x: str) -> str:
        """R = the op applied along one axis to the identity: R[i, o] is the weight
        of x[i] in y[o] along ``axis`` (the axis's interpolation matrix, transposed).

        The op is separable, so its adjoint is one R^T per resized axis; building
        R with the op itself keeps every mode, coordinate transformation, cubic
        coefficient, exclude_outside and antialias filter exactly as the runtime
        computes them.  The identity's rows are a batch axis of scale 1."""
        ctx, e = self.ctx, self.ctx.emit
        et = ctx.dtype(x)
        n = e.dim(x, axis)
        if e.opset >= 9:
            square = e.op(
                "ConstantOfShape",
                [e.Concat(n, n, axis=0)],
                value=numpy_helper.from_array(np.zeros(1, dtype=np_dtype(et))),
            )
            eye = e.EyeLike(square)
        else:
            size = (ctx.shape(x) or [None] * self.rank)[axis]
            if not isinstance(size, int):
                raise TrainingModelError(
                    self.where(f"opset {e.opset} has no EyeLike: axis {axis} needs a static size")
                )
            eye = ctx.const(np.eye(size), like=x)
        attrs = self._attrs()
        if self.static_scales is not None:  # Upsample-7
            return e.Upsample(eye, scales=[1.0, self.static_scales[axis]], **attrs)
        one_f = e.const(np.ones(1, dtype=np.float32))
        if self.sizes is not None:
            sizes2 = e.Concat(n, e.slice(int64(e, self.sizes), [j], [j + 1]), axis=0)
            scales2 = None
        else:
            scales2 = e.Concat(one_f, e.slice(self.scales, [j], [j + 1]), axis=0)
            sizes2 = None
        if self.upsample:
            return e.Upsample(eye, scales2, **attrs)
        if e.opset < 11:
            return e.Resize(eye, scales2, **attrs)
        roi2 = None
        if self.coordinate == "tf_crop_and_resize":
            count = len(self.axes)
            roi_t = ctx.dtype(self.roi)
            start = e.slice(self.roi, [j], [j + 1])
            end = e.slice(self.roi, [count + j], [count + j + 1])
            zero, one = e.const(np.zeros(1), dtype=roi_t), e.const(np.ones(1), dtype=roi_t)
            roi2 = e.Concat(zero, start, one, end, axis=0)
        if e.opset < 13:
            # roi and scales are required inputs before opset 13: empty when unused
            roi2 = roi2 if roi2 is not None else e.const(np.zeros(0, dtype=np.float32))
            scales2 = scales2 if scales2 is not None else e.const(np.zeros(0, dtype=np.float32))
        return e.Resize(eye, roi2, scales2, sizes2, **attrs)


def _apply_along(e: Emitter, g: str, rt: str, axis: int, rank: int) -> str:
    """g[.., o, ..] -> sum_o g[.., o, ..] * rt[o, i]  along ``axis``."""
    if axis == rank - 1:
        return e.MatMul(g, rt)
    perm = [a for a in range(rank) if a != axis] + [axis]
    moved = e.MatMul(e.Transpose(g, perm=perm), rt)
    return e.Transpose(moved, perm=[int(p) for p in np.argsort(perm)])


@vjp("Resize", "Upsample")
def resize_vjp(ctx, dy):
    """y = resize(x): per resized axis a linear map, y = x x_1 W_1 ... x_k W_k
    (W_a[o, i]: the weight of x[.., i, ..] in y[.., o, ..] along axis a)
    ->  dx = dy x_1 W_1^T ... x_k W_k^T

    W_a^T is the op applied to an identity matrix along one axis (see
    ``_ResizeSpec.axis_matrix``), so nearest, linear and cubic modes, every
    coordinate transformation, axes, and antialias are handled as the runtime
    computes them; axes statically known to keep their size (scale 1) are
    skipped.  tf_crop_and_resize's extrapolated entries are constants (no
    gradient).  keep_aspect_ratio_policy not_larger/not_smaller (nearest only):
    the op is applied to the running index 1..size(x) instead, which gives the
    source of every y entry (0: extrapolated), and dy is scatter-added there.

    roi, scales and sizes get none: they are sizes and coordinates, not data;
    a gradient asked of them is an error."""
    x = ctx.inputs[0]
    e = ctx.emit
    for i in range(1, len(ctx.inputs)):
        if ctx.input(i) is not None and ctx.needs(i):
            raise GradientError(
                f"gradient of {ctx.node.op_type} node {ctx.node.name!r}: input {i} "
                f"({ctx.inputs[i]!r}: roi or scales) gets no gradient; the op is differentiated "
                "with respect to X only (treat the roi and the scales as constants)"
            )
    if not ctx.needs(0):
        return (None,) * len(ctx.inputs)
    rank = ctx.require_rank(x)
    spec = _ResizeSpec(ctx, rank)
    if spec.policy != "stretch" and spec.sizes is not None:  # the policy only acts on sizes
        if spec.mode != "nearest":
            raise GradientError(
                spec.where(
                    f"keep_aspect_ratio_policy={spec.policy!r} with mode={spec.mode!r} is not "
                    "supported (the runtime's scale then differs from sizes / input size, which "
                    "the per-axis adjoint cannot reproduce); only mode='nearest' is"
                )
            )
        return (_resize_by_source(ctx, dy),) + (None,) * (len(ctx.inputs) - 1)
    g = dy
    y = ctx.outputs[0]
    for j, axis in enumerate(spec.axes):
        if spec.unchanged(j, axis, x, y):
            continue
        r = spec.axis_matrix(j, axis, x)
        g = _apply_along(e, g, e.Transpose(r, perm=[1, 0]), axis, rank)
    return (g,) + (None,) * (len(ctx.inputs) - 1)


def _resize_by_source(ctx: VJPContext, dy: str) -> str:
    """Nearest Resize as a gather: y[o] = x[src(o)], src = Resize(1..size(x)) - 1
    (the same node on an int32 index tensor; 0 marks an extrapolated entry)
    ->  dx = scatter-add of dy at src (slot 0 collects the extrapolated entries)."""
    e = ctx.emit
    x = ctx.inputs[0]
    count = e.reshape(e.Size(x), [1])
    ramp = e.Range(e.scalar_int(1), e.reshape(e.Add(count, e.ints([1])), []), e.scalar_int(1))
    index = e.Reshape(e.Cast(ramp, to=TensorProto.INT32), e.Shape(x))
    names = ("mode", "coordinate_transformation_mode", "nearest_mode", "axes", "keep_aspect_ratio_policy")
    attrs = {a: ctx.attr(a) for a in names if ctx.attr(a) is not None}
    if ctx.attr("coordinate_transformation_mode") == "tf_crop_and_resize":
        attrs["extrapolation_value"] = 0.0
    source = e.Resize(index, *ctx.inputs[1:], **attrs)
    flat = e.reshape(e.Cast(source, to=TensorProto.INT64), [-1])
    zeros = zeros_of_shape(e, e.Add(count, e.ints([1])), ctx.dtype(dy))
    summed = e.ScatterElements(zeros, flat, e.reshape(dy, [-1]), axis=0, reduction="add")
    return e.Reshape(e.slice(summed, [1], [2**62], [0]), e.Shape(x))


# ------------------------------------------------------------------ GridSample
def _cubic_weights(ctx: VJPContext, t: str, a: float) -> tuple[list[str], list[str]]:
    """Keys' cubic convolution weights of the taps at offsets -1, 0, 1, 2 from
    floor(c), t = c - floor(c), and their derivatives in t:

        far(u)  = a u^3 - 5a u^2 + 8a u - 4a      (1 < u < 2)
        near(u) = (a + 2) u^3 - (a + 3) u^2 + 1   (u <= 1)
        w = [far(1 + t), near(t), near(1 - t), far(2 - t)]"""
    e = ctx.emit

    def c(v: float) -> str:
        return ctx.const(v, like=t)

    def far(u: str) -> tuple[str, str]:
        value = e.Sub(e.Mul(e.Add(e.Mul(e.Sub(e.Mul(c(a), u), c(5 * a)), u), c(8 * a)), u), c(4 * a))
        slope = e.Add(e.Mul(e.Sub(e.Mul(c(3 * a), u), c(10 * a)), u), c(8 * a))
        return value, slope

    def near(u: str) -> tuple[str, str]:
        value = e.Add(e.Mul(e.Mul(e.Sub(e.Mul(c(a + 2), u), c(a + 3)), u), u), c(1.0))
        slope = e.Mul(e.Sub(e.Mul(c(3 * (a + 2)), u), c(2 * (a + 3))), u)
        return value, slope

    one = c(1.0)
    w0, s0 = far(e.Add(t, one))
    w1, s1 = near(t)
    w2, s2 = near(e.Sub(one, t))
    w3, s3 = far(e.Sub(c(2.0), t))
    return [w0, w1, w2, w3], [s0, s1, e.Neg(s2), e.Neg(s3)]


class _Taps:
    """The taps of one spatial axis: integer positions (float, already mapped
    into [0, d - 1] by the padding mode), weights with the zeros-padding
    validity folded in, and the weights' derivatives in the coordinate."""

    def __init__(self, index: list[str], weight: list[str], slope: list[str] | None) -> None:
        self.index, self.weight, self.slope = index, weight, slope


def _reflect(ctx: VJPContext, c: str, lo: str, hi: str) -> tuple[str, str]:
    """c reflected at lo and hi until it lies in [lo, hi], and the derivative (+-1):
    u = (c - lo) / (hi - lo), m = u mod 2, c' = lo + (hi - lo) * (m if m <= 1 else 2 - m)."""
    e = ctx.emit
    span = e.Sub(hi, lo)
    safe = e.Where(e.Greater(span, ctx.const(0.0, like=c)), span, ctx.const(1.0, like=c))
    two = ctx.const(2.0, like=c)
    m = e.Mod(e.Div(e.Sub(c, lo), safe), two, fmod=1)
    m = e.Where(e.Less(m, ctx.const(0.0, like=c)), e.Add(m, two), m)
    rising = e.LessOrEqual(m, ctx.const(1.0, like=c))
    folded = e.Add(lo, e.Mul(span, e.Where(rising, m, e.Sub(two, m))))
    sign = e.Where(rising, ctx.const(1.0, like=c), ctx.const(-1.0, like=c))
    return folded, sign


def _sample_bounds(ctx: VJPContext, d: str, align: bool) -> tuple[str, str]:
    """[lo, hi]: the coordinates inside an axis of length d (pixel centres at
    0 .. d - 1; with align_corners=0 the pixels' outer edges, -0.5 .. d - 0.5)."""
    e = ctx.emit
    if align:
        return ctx.const(0.0, like=d), e.Sub(d, ctx.const(1.0, like=d))
    half = ctx.const(0.5, like=d)
    return e.Neg(half), e.Sub(d, half)


def _axis_taps(
    ctx: VJPContext, c: str, d: str, mode: str, padding: str, align: bool
) -> tuple[_Taps, str | None]:
    """Taps of one axis of length d (float) at coordinates c (pixel units, already
    rounded for 'nearest'), and d c' / d c of the padding mode's coordinate
    mapping (None: 1).

    Border padding clamps the coordinate to [0, d - 1] for linear and nearest
    (equal in value to clamping only the taps, and the slope is 0 there either
    way) and, as onnxruntime does for cubic, only the taps for cubic.
    Reflection folds the coordinate into [lo, hi], then the taps."""
    e = ctx.emit
    zero, one = ctx.const(0.0, like=c), ctx.const(1.0, like=c)
    last = e.Sub(d, one)
    factor = None
    if padding == "border" and mode != "cubic":
        inside = e.And(e.Greater(c, zero), e.Less(c, last))
        factor = e.Cast(inside, to=ctx.dtype(c))
        c = e.Max(e.Min(c, last), zero)
    elif padding == "reflection":
        lo, hi = _sample_bounds(ctx, d, align)
        c, factor = _reflect(ctx, c, lo, hi)
        if mode == "nearest":
            c = e.Round(c)

    def place(i: str) -> tuple[str, str | None]:
        """(position clamped into the axis, validity for zeros padding)."""
        if padding == "zeros":
            valid = e.Cast(e.And(e.GreaterOrEqual(i, zero), e.LessOrEqual(i, last)), to=ctx.dtype(c))
            return e.Max(e.Min(i, last), zero), valid
        if padding == "reflection":
            if align:
                low, high = e.Neg(i), e.Sub(e.Add(last, last), i)
            else:
                low, high = e.Sub(e.Neg(i), one), e.Sub(e.Add(d, last), i)
            i = e.Where(e.Less(i, zero), low, e.Where(e.Greater(i, last), high, i))
        return e.Max(e.Min(i, last), zero), None

    if mode == "nearest":
        index, valid = place(c)
        weight = valid if valid is not None else ctx.ones_like(c)
        return _Taps([index], [weight], None), factor
    base = e.Floor(c)
    t = e.Sub(c, base)
    if mode == "linear":
        offsets = [0.0, 1.0]
        weights, slopes = [e.Sub(one, t), t], [e.Neg(ctx.ones_like(t)), ctx.ones_like(t)]
    else:
        offsets = [-1.0, 0.0, 1.0, 2.0]
        weights, slopes = _cubic_weights(ctx, t, -0.75)
    index, weight, slope = [], [], []
    for off, w, s in zip(offsets, weights, slopes):
        i, valid = place(e.Add(base, ctx.const(off, like=c)) if off else base)
        index.append(i)
        weight.append(w if valid is None else e.Mul(w, valid))
        slope.append(s if valid is None else e.Mul(s, valid))
    return _Taps(index, weight, slope), factor


@vjp("AffineGrid")
def affine_grid_vjp(ctx, dgrid):
    """grid[n, p, i] = sum_j theta[n, i, j] * base[p, j]   (p: the D x H x W or
    H x W sampling positions, base[p] = (x, y[, z], 1) their normalized
    coordinates, which depend on size and align_corners only)
    ->  dtheta[n, i, j] = sum_p dgrid[n, p, i] * base[p, j]

    The op is linear in theta, so base comes from the op itself: the batch of
    unit matrices E_j (E_j[0, j] = 1, zero elsewhere) gives
    AffineGrid(E_j)[.., 0] = base[.., j].  The size input gets no gradient."""
    e = ctx.emit
    theta, size = ctx.inputs[0], ctx.inputs[1]
    if not ctx.needs(0):
        return None, None
    tshape = ctx.shape(theta)
    sshape = ctx.shape(size)
    if tshape is not None and len(tshape) == 3 and isinstance(tshape[1], int):
        spatial = int(tshape[1])
    elif sshape is not None and len(sshape) == 1 and isinstance(sshape[0], int):
        spatial = int(sshape[0]) - 2
    elif ctx.rank(ctx.outputs[0]) is not None:
        spatial = ctx.rank(ctx.outputs[0]) - 2
    else:
        raise GradientError(
            f"AffineGrid node {ctx.node.name!r}: the gradient needs to know whether the grid is "
            "2-D or 3-D (the shape of theta or the length of size), which is not known statically"
        )
    cols = spatial + 1
    units = np.zeros((cols, spatial, cols))
    for j in range(cols):
        units[j, 0, j] = 1.0
    unit_theta = ctx.const(units, like=theta)
    unit_size = e.Concat(e.ints([cols]), e.slice(int64(e, size), [1], [2 + spatial]), axis=0)
    base = e.op("AffineGrid", [unit_theta, unit_size], align_corners=int(ctx.attr("align_corners", 0)))
    letters = "dhw"[-spatial:]
    # base[j, <positions>, 0] -> dtheta = einsum(dgrid[n, <positions>, i], base[j, <positions>])
    base0 = e.squeeze(e.slice(base, [0], [1], axes=[spatial + 1]), [spatial + 1])
    dtheta = e.Einsum(dgrid, base0, equation=f"n{letters}i,j{letters}->nij")
    return dtheta, None


@vjp("GridSample")
def grid_sample_vjp(ctx, dy):
    """y[n, c, o] = sum over the taps p of w_p(c(o)) x[n, c, p]: the taps around the
    sampling point c(o) (pixel units, from grid[n, o] reversed: grid's last axis
    lists W, H, D ...), with c = (g + 1)(d - 1) / 2 (align_corners) or
    ((g + 1) d - 1) / 2, mapped by the padding mode (border clamps, reflection
    folds; zeros drops taps outside x) and weighted per axis by 1 - t, t
    (linear), Keys' cubic (a = -0.75, 4 taps) or 1 (nearest, c rounded)
    ->  dx = scatter-add of w_p * dy at the taps
        dgrid_i = sum_c sum_p dy x[p] dw_p / dc_i * dc'_i / dc_i * dc_i / dg_i
    (nearest: the grid gets 0, its output is piecewise constant in the grid)."""
    e = ctx.emit
    x, grid = ctx.inputs
    if not (ctx.needs(0) or ctx.needs(1)):
        return None, None
    rank = ctx.require_rank(x)
    k = rank - 2
    mode = ctx.attr("mode", "bilinear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)  # opset 16's names
    padding = ctx.attr("padding_mode", "zeros")
    align = bool(ctx.attr("align_corners", 0))
    et = ctx.dtype(x)
    nc = e.shape_of(x, 0, 2)
    xf = e.Reshape(x, e.Concat(nc, e.ints([-1]), axis=0))  # [N, C, S]
    dyf = e.Reshape(dy, e.Concat(nc, e.ints([-1]), axis=0))  # [N, C, P]
    batch = e.Concat(e.shape_of(grid, 0, 1), e.ints([-1]), axis=0)
    one, half = ctx.const(1.0, like=x), ctx.const(0.5, like=x)

    taps, factors, scales, strides = [], [], [], []
    stride = e.ints([1])
    for i in reversed(range(k)):
        strides.insert(0, stride)
        stride = e.Mul(stride, e.dim(x, 2 + i))
    coords, lengths = [], []
    for i in range(k):
        g = e.Reshape(e.Gather(grid, e.scalar_int(k - 1 - i), axis=-1), batch)  # [N, P]
        d = e.Cast(e.dim(x, 2 + i), to=et)
        if align:
            scale = e.Mul(e.Sub(d, one), half)
            c = e.Mul(e.Add(g, one), scale)
        else:
            scale = e.Mul(d, half)
            c = e.Sub(e.Mul(e.Add(g, one), scale), half)
        coords.append(e.Round(c) if mode == "nearest" else c)
        lengths.append(d)
        scales.append(scale)
    for c, d in zip(coords, lengths):
        t, factor = _axis_taps(ctx, c, d, mode, padding, align)
        taps.append(t)
        factors.append(factor)

    # every combination of one tap per axis: flat index, weight, per-axis partials
    combos = [[]]
    for i in range(k):
        combos = [c + [p] for c in combos for p in range(len(taps[i].index))]
    indices, weights = [], []
    partials: list[list[str]] = [[] for _ in range(k)]
    for combo in combos:
        flat = None
        for i, p in enumerate(combo):
            term = e.Mul(e.Cast(taps[i].index[p], to=TensorProto.INT64), strides[i])
            flat = term if flat is None else e.Add(flat, term)
        indices.append(flat)
        w = None
        for i, p in enumerate(combo):
            w = taps[i].weight[p] if w is None else e.Mul(w, taps[i].weight[p])
        weights.append(w)
        if mode != "nearest" and ctx.needs(1):
            for i in range(k):
                part = taps[i].slope[combo[i]]
                for j, p in enumerate(combo):
                    if j != i:
                        part = e.Mul(part, taps[j].weight[p])
                partials[i].append(part)
    index = e.concat(indices, axis=1)  # [N, T * P]
    index_c = e.Expand(e.unsqueeze(index, [1]), e.Concat(nc, e.dim(index, 1), axis=0))
    dx = dgrid = None
    if ctx.needs(0):
        upd = e.Mul(e.concat([dyf] * len(weights), axis=2), e.unsqueeze(e.concat(weights, axis=1), [1]))
        zeros = zeros_of_shape(e, e.Shape(xf), et)
        dx = e.Reshape(e.ScatterElements(zeros, index_c, upd, axis=2, reduction="add"), e.Shape(x))
    if ctx.needs(1):
        if mode == "nearest":
            dgrid = ctx.zeros_like(grid)
        else:
            values = e.GatherElements(xf, index_c, axis=2)  # [N, C, T * P]
            dyv = e.reduce_sum(e.Mul(values, e.concat([dyf] * len(weights), axis=2)), [1], keepdims=False)
            count = len(weights)
            if count == 1:
                pieces = [dyv]
            else:  # equal pieces of P
                pieces = e.Split(dyv, outputs=count, axis=1, num_outputs=count if e.opset >= 18 else None)
            out_shape = e.shape_of(grid, 0, rank - 1)
            per_axis = []
            for i in range(k):
                total = e.sum_all([e.Mul(p, w) for p, w in zip(pieces, partials[i])])
                if factors[i] is not None:
                    total = e.Mul(total, factors[i])
                total = e.Mul(total, scales[i])
                per_axis.append(e.unsqueeze(e.Reshape(total, out_shape), [rank - 1]))
            dgrid = e.concat(per_axis[::-1], axis=rank - 1)
    return dx, dgrid


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
    return reshape_to(e, cols, e.Shape(x)), None, None


@vjp("GlobalLpPool")
def global_lp_pool_vjp(ctx, dy):
    """y[n, c] = (sum over spatial |x|^p)^(1/p)
    ->  dx = dy * sign(x) |x|^(p-1) * y^(1-p)   (0 where y = 0)"""
    e = ctx.emit
    x, y = ctx.inputs[0], ctx.outputs[0]
    p = float(ctx.attr("p", 2))
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
    if ctx.attr("mode", "avg") != "avg":
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
    hit = e.Cast(e.And(inside, float_equal(ctx, xr, y)), to=et)  # [R, C, HW, P]
    ties = e.Max(e.reduce_sum(hit, [2], keepdims=True), ctx.const(1.0, like=x))
    per_roi = e.reduce_sum(e.Mul(hit, e.Div(g, ties)), [3], keepdims=False)  # [R, C, HW]
    return _per_roi_to_batch(ctx, per_roi, batch_index, x), None


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
    group = int(ctx.attr("group", 1))
    offset_groups = int(ctx.attr("offset_group", 1))
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
        along_kernel = e.Mul(e.Cast(arange(e, k_len), to=et), ctx.const(float(dilations[axis]), like=x))
        along_output = e.Sub(
            e.Mul(e.Cast(arange(e, o_len), to=et), ctx.const(float(strides[axis]), like=x)),
            ctx.const(float(pads[axis]), like=x),
        )
        k_view, o_view = ([-1, 1, 1, 1], [1, 1, -1, 1]) if axis == 0 else ([1, -1, 1, 1], [1, 1, 1, -1])
        base = e.Add(e.reshape(along_kernel, k_view), e.reshape(along_output, o_view))
        component = e.squeeze(e.Gather(off, e.ints([axis]), axis=4), [4])  # [N, G, kh, kw, oh, ow]
        coords.append(e.Reshape(e.Add(component, base), per_offset_group))  # [N, G, P]
    ty, _ = _axis_taps(ctx, coords[0], e.Cast(e.dim(x, 2), to=et), "linear", "zeros", True)
    tx, _ = _axis_taps(ctx, coords[1], e.Cast(e.dim(x, 3), to=et), "linear", "zeros", True)

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
