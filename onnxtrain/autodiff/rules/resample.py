"""Gradient rules: resampling (Resize, Upsample, GridSample, AffineGrid)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from ...core.emitter import Emitter, np_dtype
from ...errors import GradientError, TrainingModelError
from ..registry import VJPContext, vjp
from ._common import constant_value, int64, zeros_of_shape


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


def axis_taps(
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
    base = e.op("AffineGrid", [unit_theta, unit_size], align_corners=int(ctx.attr("align_corners")))
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
    padding = ctx.attr("padding_mode")
    align = bool(ctx.attr("align_corners"))
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
        t, factor = axis_taps(ctx, c, d, mode, padding, align)
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
                pieces = e.split_equal(dyv, count, axis=1)
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
