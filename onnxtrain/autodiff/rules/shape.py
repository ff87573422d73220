"""Gradient rules: ops that move, copy or select elements.

Every rule here is linear in the differentiated input, so its gradient is the
adjoint data movement: Reshape back, Transpose by the inverse permutation,
Concat <-> Split, Slice/Gather -> scatter into zeros (adding where an element
was read more than once), Pad -> crop and fold the padding back.

Sizes come from Shape at run time, so symbolic dimensions are fine; static
shapes only decide what can be skipped.  Ranks must be known statically where
a rule builds per-axis index tensors (Slice, Pad, Gather, Tile, ...).

Scatter-add is available as ScatterElements(reduction='add') from opset 16;
before that ``scatter_add_axis`` contracts with a one-hot matrix instead.
"""

from __future__ import annotations

import numpy as np

from ...core.emitter import Emitter
from ...errors import GradientError, TrainingModelError
from ..registry import VJPContext, vjp
from ._common import (
    along_axis,
    clamp,
    constant_value,
    int64,
    one_hot,
    scatter_add_axis,
    with_dim,
    wrap_negative,
    zeros_of_shape,
)

# ------------------------------------------------------------------ helpers


def _static_dim(ctx: VJPContext, x: str, axis: int) -> int | None:
    shape = ctx.shape(x)
    if shape is None:
        return None
    d = shape[axis]
    return d if isinstance(d, int) else None


def _no_grad_rest(ctx: VJPContext, dx: str | None) -> tuple:
    """dx for input 0, None for the others (shapes, axes, indices)."""
    return (dx,) + (None,) * (len(ctx.inputs) - 1)


# ------------------------------------------------------------ reshaping


@vjp("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape_vjp(ctx, dy):
    """y = reshape(x)  ->  dx = reshape(dy, shape(x))   (shape or axes inputs get none)

    The backward Reshape reads Shape(x) literally (allowzero=1 from opset 14),
    so a zero-sized dim of x stays zero-sized."""
    x = ctx.inputs[0]
    e = ctx.emit
    return _no_grad_rest(ctx, e.reshape_to(dy, e.Shape(x)) if ctx.needs(0) else None)


@vjp("Transpose")
def transpose_vjp(ctx, dy):
    """y = transpose(x, perm)  ->  dx = transpose(dy, perm^-1)

    Without perm the axes are reversed, which is its own inverse."""
    perm = ctx.attr("perm")
    if perm is None:
        return (ctx.emit.Transpose(dy),)
    inverse = [int(p) for p in np.argsort(perm)]
    return (ctx.emit.Transpose(dy, perm=inverse),)


@vjp("Expand")
def expand_vjp(ctx, dy):
    """y = expand(x, shape)  ->  dx = dy summed over the broadcast axes; shape gets none"""
    x = ctx.inputs[0]
    return _no_grad_rest(ctx, ctx.unbroadcast(dy, like=x) if ctx.needs(0) else None)


@vjp("Tile")
def tile_vjp(ctx, dy):
    """y = tile(x, r)  ->  dx = sum over the copies: reshape dy to
    [r0, d0, r1, d1, ...] and sum the r axes."""
    x, repeats = ctx.inputs[:2]
    e = ctx.emit
    if not ctx.needs(0):
        return None, None
    rank = ctx.require_rank(x)
    if rank == 0:
        return dy, None
    pairs = e.Concat(
        e.unsqueeze(int64(e, repeats), [1]), e.unsqueeze(e.Shape(x), [1]), axis=1
    )  # [[r0, d0], [r1, d1], ...]
    blocks = e.Reshape(dy, e.reshape(pairs, [-1]))
    return e.reduce_sum(blocks, list(range(0, 2 * rank, 2)), keepdims=False), None


@vjp("DepthToSpace")
def depth_to_space_vjp(ctx, dy):
    """y = depth_to_space(x, b)  ->  dx = the inverse rearrangement of dy

    DCR mode: SpaceToDepth(dy, b).  CRD mode: x = [N, C, H, W] was viewed as
    [N, C/b^2, b, b, H, W] and permuted by (0, 1, 4, 2, 5, 3); view dy as
    [N, C/b^2, H, b, W, b] and permute back by (0, 1, 3, 5, 2, 4)."""
    (x,) = ctx.inputs
    e = ctx.emit
    b = int(ctx.attr("blocksize"))
    if ctx.attr("mode", "DCR") == "DCR":
        return (e.SpaceToDepth(dy, blocksize=b),)
    block = e.ints([b])
    view = e.Concat(e.dim(x, 0), e.dim(dy, 1), e.dim(x, 2), block, e.dim(x, 3), block, axis=0)
    moved = e.Transpose(e.Reshape(dy, view), perm=[0, 1, 3, 5, 2, 4])
    return (e.Reshape(moved, e.Shape(x)),)


@vjp("SpaceToDepth")
def space_to_depth_vjp(ctx, dy):
    """y = space_to_depth(x, b, mode)  ->  dx = depth_to_space(dy, b, mode)   (its inverse)

    SpaceToDepth orders each block's values depth-column-row ("DCR", the only
    order before opset 28) or column-row-depth ("CRD", opset 28); DepthToSpace
    with the same mode (opset >= 11) undoes either permutation."""
    b = int(ctx.attr("blocksize"))
    mode = ctx.attr("mode", "DCR")
    if ctx.opset >= 11:
        return (ctx.emit.DepthToSpace(dy, blocksize=b, mode=mode),)
    return (ctx.emit.DepthToSpace(dy, blocksize=b),)


# ---------------------------------------------------------- concat / split


@vjp("Concat")
def concat_vjp(ctx, dy):
    """y = concat(x1, ..., xn; axis)  ->  dxi = dy[o_i : o_i + size_i] along axis,
    with offsets o_i the running sum of the runtime sizes."""
    xs = ctx.inputs
    e = ctx.emit
    if len(xs) == 1:
        return (dy,)
    axis = int(ctx.attr("axis"))
    if axis < 0:
        axis += ctx.require_rank(xs[0])
    sizes = [_static_dim(ctx, x, axis) for x in xs]
    if all(s is not None for s in sizes):
        # Static sizes: one Split (an optimisation; the runtime path below is general).
        pieces = e.split(dy, sizes, axis=axis)
        return tuple(p if ctx.needs(i) else None for i, p in enumerate(pieces))
    grads: list[str | None] = []
    start = e.ints([0])
    for i, x in enumerate(xs):
        end = e.Add(start, e.dim(x, axis))
        grads.append(e.slice_axis(dy, start, end, axis) if ctx.needs(i) else None)
        start = end
    return tuple(grads)


@vjp("Split")
def split_vjp(ctx, *dys):
    """y1, ..., yn = split(x; axis)  ->  dx = concat(dy1, ..., dyn; axis)

    An output nobody differentiates contributes zeros of its shape.  The sizes
    (attribute, input or num_outputs) get no gradient."""
    e = ctx.emit
    axis = int(ctx.attr("axis", 0))
    if not ctx.needs(0):
        return _no_grad_rest(ctx, None)
    pieces = [dy if dy is not None else e.zeros_like(y) for dy, y in zip(dys, ctx.outputs)]
    return _no_grad_rest(ctx, e.concat(pieces, axis=axis))


# -------------------------------------------------------------- slicing


def _slice_spec(ctx: VJPContext, rank: int) -> list[tuple[int, str, str, int | None]]:
    """(axis, start, step, static step sign) per sliced axis; start/step are
    1-element int64 tensors.  Before opset 10 the bounds are attributes; from 10
    they are inputs and may be runtime values, but the axes must be constants."""
    e = ctx.emit
    if ctx.opset < 10:
        starts = [int(s) for s in ctx.attr("starts")]
        axes = ctx.attr("axes")
        axes = list(range(len(starts))) if axes is None else [int(a) for a in axes]
        return [(a % rank, e.ints([s]), e.ints([1]), 1) for a, s in zip(axes, starts)]
    starts = int64(e, ctx.inputs[1])
    axes_name, steps_name = ctx.input(3), ctx.input(4)
    if axes_name is not None:
        axes_value = constant_value(ctx, axes_name)
        if axes_value is None:
            raise GradientError(
                f"Slice node {ctx.node.name!r}: the gradient needs constant axes, "
                f"but {axes_name!r} is computed at run time"
            )
        axes = [int(a) % rank for a in axes_value.reshape(-1)]
    else:
        known = constant_value(ctx, ctx.inputs[1])
        count = known.size if known is not None else (ctx.shape(ctx.inputs[1]) or (None,))[0]
        if not isinstance(count, int):
            raise GradientError(
                f"Slice node {ctx.node.name!r}: the gradient needs the number of sliced "
                "axes, but neither axes nor the length of starts is known statically"
            )
        axes = list(range(count))
    steps_value = constant_value(ctx, steps_name) if steps_name is not None else None
    spec = []
    for j, a in enumerate(axes):
        start = e.slice(starts, [j], [j + 1])
        if steps_name is None:
            step, sign = e.ints([1]), 1
        else:
            step = e.slice(int64(e, steps_name), [j], [j + 1])
            sign = None if steps_value is None else (1 if steps_value.reshape(-1)[j] > 0 else -1)
        spec.append((a, start, step, sign))
    return spec


@vjp("Slice")
def slice_vjp(ctx, dy):
    """y = x[s : e : k] (per sliced axis)  ->  dx = zeros with dy scattered at
    positions s' + k * i, i = 0 .. len(y) - 1 along each sliced axis.

    s' is the start after Slice's clamping: s < 0 counts from the end, then
    s' = clamp(s, 0, n) for k > 0 and clamp(s, 0, n - 1) for k < 0; the end is
    not needed since the output length is known.  Axes are undone one at a
    time (the slice is a product of per-axis selections).

    Before opset 10 (attribute bounds, step 1), where the sliced dims of x are
    known statically, dx = Pad(dy) with pads s' and n - e' (e' = clamp(e, s', n)
    after the same wrapping): Pad-2 needs no Scatter (opset 9) or
    ConstantOfShape (opset 9).  From opset 11, where every step is a constant
    1, dx = Pad(dy) with pads s' and n - s' - len(y) computed at run time:
    the same numbers as the scatter (dy copied, +0 elsewhere) in one copy, not
    a zero fill, index tensors and a ScatterElements per axis."""
    x = ctx.inputs[0]
    e = ctx.emit
    if not ctx.needs(0):
        return _no_grad_rest(ctx, None)
    rank = ctx.require_rank(x)
    if ctx.opset < 10:
        pads = _slice_pads_before_10(ctx, rank)
        if pads is not None:
            return _no_grad_rest(ctx, e.Pad(dy, pads=pads, mode="constant"))
        if ctx.opset < 9:
            raise TrainingModelError(
                f"gradient of Slice node {ctx.node.name!r}: at opset {ctx.opset} it needs the "
                f"sliced dims of {x!r} statically"
            )
    spec = _slice_spec(ctx, rank)
    if ctx.opset >= 11 and _unit_steps(ctx):
        return _no_grad_rest(ctx, _slice_pad(ctx, dy, spec, rank))
    grad = dy
    for axis, start, step, sign in spec:
        n = e.dim(x, axis)
        begin = wrap_negative(e, start, n)
        if sign is None:
            upper = e.Where(e.Less(step, e.ints([0])), e.Sub(n, e.ints([1])), n)
        else:
            upper = n if sign > 0 else e.Sub(n, e.ints([1]))
        begin = clamp(e, begin, e.ints([0]), upper)
        positions = e.Add(begin, e.Mul(step, e.arange(e.dim(grad, axis))))
        where = e.Expand(along_axis(e, positions, axis, rank), e.Shape(grad))
        target = with_dim(e, e.Shape(grad), axis, rank, e.Shape(x))
        grad = e.scatter_elements(zeros_of_shape(e, target, ctx.dtype(dy)), where, grad, axis)
    return _no_grad_rest(ctx, grad)


def _unit_steps(ctx: VJPContext) -> bool:
    """Whether every step of a Slice (opset >= 10) is statically 1."""
    steps = ctx.input(4)
    if steps is None:
        return True
    known = constant_value(ctx, steps)
    return known is not None and bool((known == 1).all())


def _slice_pad(ctx: VJPContext, dy: str, spec: list, rank: int) -> str:
    """dx of a step-1 Slice (opset >= 11): dy padded with s' before and
    n - s' - len(y) after each sliced axis (s' clamped to [0, n] as Slice does)."""
    e = ctx.emit
    x = ctx.inputs[0]
    pads = _static_slice_pads(ctx, [axis for axis, _, _, _ in spec], rank)
    if pads is not None:  # (constants: no shape arithmetic left for the runtime)
        return e.Pad(dy, e.ints(pads), mode="constant")
    zero = e.ints([0])
    before, after = [zero] * rank, [zero] * rank
    for axis, start, _, _ in spec:
        n = e.dim(x, axis)
        begin = clamp(e, wrap_negative(e, start, n), zero, n)
        before[axis] = begin
        after[axis] = e.Sub(e.Sub(n, begin), e.dim(dy, axis))
    return e.Pad(dy, e.Concat(*before, *after, axis=0), mode="constant")


def _static_slice_pads(ctx: VJPContext, axes: list[int], rank: int) -> list[int] | None:
    """The pads of ``_slice_pad`` where the starts are constants and the sliced
    dims of x and y static, else None."""
    starts = constant_value(ctx, ctx.inputs[1])
    if starts is None or starts.size != len(axes):
        return None
    before, after = [0] * rank, [0] * rank
    for axis, start in zip(axes, starts.reshape(-1)):
        n, m = _static_dim(ctx, ctx.inputs[0], axis), _static_dim(ctx, ctx.outputs[0], axis)
        if n is None or m is None:
            return None
        begin = min(max(int(start) + n if start < 0 else int(start), 0), n)
        before[axis], after[axis] = begin, n - begin - m
    return before + after


def _slice_pads_before_10(ctx: VJPContext, rank: int) -> list[int] | None:
    """Pad-2 pads that undo an opset < 10 Slice, or None where a sliced dim is not static."""
    starts = [int(v) for v in ctx.attr("starts")]
    ends = [int(v) for v in ctx.attr("ends")]
    axes = ctx.attr("axes")
    axes = list(range(len(starts))) if axes is None else [int(a) % rank for a in axes]
    before, after = [0] * rank, [0] * rank
    for a, st, en in zip(axes, starts, ends):
        n = _static_dim(ctx, ctx.inputs[0], a)
        if n is None:
            return None
        st = min(max(st + n if st < 0 else st, 0), n)
        en = min(max(en + n if en < 0 else en, st), n)
        before[a], after[a] = st, n - en
    return before + after


# ------------------------------------------------------- gather / scatter


@vjp("Gather")
def gather_vjp(ctx, dy):
    """y = take(x, idx, axis)  ->  dx[.., j, ..] = sum over idx[i] == j of dy[.., i, ..]

    The index dimensions of dy are flattened into one, then scatter-added."""
    data, indices = ctx.inputs
    e = ctx.emit
    if not ctx.needs(0):
        return None, None
    rank = ctx.require_rank(data)
    axis = int(ctx.attr("axis")) % rank
    n = e.dim(data, axis)
    idx = e.reshape(int64(e, indices), [-1])
    if e.opset >= 9:  # (before, one_hot wraps negative indices itself)
        idx = wrap_negative(e, idx, n)
    parts = []
    if axis > 0:
        parts.append(e.shape_of(data, 0, axis))
    parts.append(e.ints([-1]))
    if axis + 1 < rank:
        parts.append(e.shape_of(data, axis + 1))
    flat = e.Reshape(dy, e.concat(parts))
    return scatter_add_axis(ctx, flat, idx, n, axis, rank, e.Shape(data), _static_dim(ctx, data, axis)), None


@vjp("GatherElements")
def gather_elements_vjp(ctx, dy):
    """y[p] = x[p with p_axis := idx[p]]  ->  dx = scatter-add of dy at those positions

    Opset >= 16: ScatterElements(reduction='add').  Before: one-hot of idx
    along a new last axis, times dy, summed over ``axis``, moved into place
    and zero-padded where idx is smaller than x."""
    data, indices = ctx.inputs
    e = ctx.emit
    if not ctx.needs(0):
        return None, None
    rank = ctx.require_rank(data)
    axis = int(ctx.attr("axis")) % rank
    n = e.dim(data, axis)
    idx = wrap_negative(e, int64(e, indices), n)
    et = ctx.dtype(dy)
    if e.opset >= 16:
        zeros = zeros_of_shape(e, e.Shape(data), et)
        return e.ScatterElements(zeros, idx, dy, axis=axis, reduction="add"), None
    placed = _scatter_add_elements(ctx, idx, dy, axis, rank, n, None, et)
    missing = e.Sub(e.Shape(data), e.Shape(placed))
    pads = e.Concat(e.ints([0] * rank), missing, axis=0)
    return e.Pad(placed, pads), None


def _scatter_add_elements(
    ctx: VJPContext, idx: str, dy: str, axis: int, rank: int, n: str, n_static: int | None, et: int
) -> str:
    """out[p with p_axis := j] = sum over i with idx[p with p_axis := i] == j of dy[...]:
    the one-hot of idx along a new last axis, times dy, summed over ``axis``
    and moved into place (n entries along ``axis``, idx's extent elsewhere)."""
    e = ctx.emit
    onehot = one_hot(ctx, idx, n, n_static, rank, et)  # idx.shape + [n]
    spread = e.Mul(onehot, e.unsqueeze(dy, [rank]))
    summed = e.reduce_sum(spread, [axis], keepdims=False)  # idx.shape without axis, + [n]
    perm = list(range(axis)) + [rank - 1] + list(range(axis, rank - 1))
    return e.Transpose(summed, perm=perm) if perm != list(range(rank)) else summed


def _full_nd_indices(ctx: VJPContext, indices: str, batch_dims: int) -> str:
    """GatherND indices with the batch_dims leading coordinates made explicit:
    [..., k] -> [..., batch_dims + k], so they address x without batching."""
    e = ctx.emit
    idx = int64(e, indices)
    if batch_dims == 0:
        return idx
    q = ctx.require_rank(indices)
    lead = e.shape_of(indices, 0, q - 1)  # indices.shape[:-1]
    coords = []
    for b in range(batch_dims):
        positions = e.reshape(e.arange(e.dim(indices, b)), [1] * b + [-1] + [1] * (q - 1 - b))
        coords.append(e.Expand(positions, e.Concat(lead, e.ints([1]), axis=0)))
    return e.Concat(*coords, idx, axis=q - 1)


def _normalize_nd(ctx: VJPContext, idx: str, data: str) -> str:
    """Make negative GatherND/ScatterND coordinates non-negative (k = idx.shape[-1])."""
    e = ctx.emit
    dims = e.slice_axis(e.Shape(data), e.ints([0]), e.dim(idx, -1), 0)
    return wrap_negative(e, idx, dims)


@vjp("GatherND")
def gather_nd_vjp(ctx, dy):
    """y[i] = x[idx[i]]  ->  dx = scatter-add of dy at the addressed slices of x

    Opset >= 16: ScatterND(reduction='add').  Before: the first k coordinates
    are linearized (strides of x's first k dims) and the rule of Gather along
    axis 0 of x viewed as [d0 * ... * d(k-1), rest...] does the rest."""
    data, indices = ctx.inputs
    e = ctx.emit
    if not ctx.needs(0):
        return None, None
    idx = _normalize_nd(ctx, _full_nd_indices(ctx, indices, int(ctx.attr("batch_dims", 0))), data)
    et = ctx.dtype(dy)
    if e.opset >= 16:
        zeros = zeros_of_shape(e, e.Shape(data), et)
        return e.ScatterND(zeros, idx, dy, reduction="add"), None
    q = ctx.require_rank(indices)
    k = (ctx.shape(indices) or (None,))[-1]
    if not isinstance(k, int):
        raise TrainingModelError(
            f"GatherND node {ctx.node.name!r}: before opset 16 the gradient needs the "
            f"last dimension of {indices!r} statically"
        )
    k += int(ctx.attr("batch_dims", 0))
    rank = ctx.require_rank(data)
    # Row-major strides of x's first k dims: stride_j = d(j+1) * ... * d(k-1).
    strides = []
    for j in range(k):
        if j == k - 1:
            strides.append(e.ints([1]))
        else:
            strides.append(e.reduce("ReduceProd", e.shape_of(data, j + 1, k), None, keepdims=True))
    linear = e.reduce_sum(e.Mul(idx, e.concat(strides)), [q - 1], keepdims=False)
    rest = [e.shape_of(data, k)] if k < rank else []
    count = e.reduce("ReduceProd", e.shape_of(data, 0, k), None, keepdims=True)
    flat_dy = e.Reshape(dy, e.concat([e.ints([-1])] + rest))
    flat_shape = e.concat([count] + rest)
    flat = scatter_add_axis(
        ctx, flat_dy, e.reshape(linear, [-1]), count, 0, 1 + rank - k, flat_shape
    )
    return e.Reshape(flat, e.Shape(data)), None


def _scatter_reduction(ctx: VJPContext) -> str:
    reduction = ctx.attr("reduction", "none")
    if reduction not in ("none", "add"):
        raise GradientError(
            f"{ctx.node.op_type} node {ctx.node.name!r}: no gradient for "
            f"reduction={reduction!r} (only 'none' and 'add')"
        )
    return reduction


@vjp("ScatterElements")
def scatter_elements_vjp(ctx, dy):
    """y = x with y[p(idx)] = u (or += u for reduction='add')
    ->  dx = dy with the overwritten positions zeroed (all of dy for 'add'),
        du = gather_elements(dy, idx); idx gets none"""
    data, indices, updates = ctx.inputs
    e = ctx.emit
    axis = int(ctx.attr("axis"))
    reduction = _scatter_reduction(ctx)
    ddata = dupdates = None
    if ctx.needs(0):
        if reduction == "add":
            ddata = dy
        else:
            ddata = e.ScatterElements(dy, indices, e.zeros_like(updates), axis=axis)
    if ctx.needs(2):
        dupdates = e.GatherElements(dy, indices, axis=axis)
    return ddata, None, dupdates


@vjp("ScatterND")
def scatter_nd_vjp(ctx, dy):
    """y = x with y[idx[i]] = u[i] (or += for reduction='add')
    ->  dx = dy with the overwritten slices zeroed (all of dy for 'add'),
        du = gather_nd(dy, idx); idx gets none"""
    data, indices, updates = ctx.inputs
    e = ctx.emit
    reduction = _scatter_reduction(ctx)
    ddata = dupdates = None
    if ctx.needs(0):
        ddata = dy if reduction == "add" else e.ScatterND(dy, indices, e.zeros_like(updates))
    if ctx.needs(2):
        dupdates = e.GatherND(dy, indices)
    return ddata, None, dupdates


# ------------------------------------------------------------------ Pad


def _pad_index(e: Emitter, mode: str, i: str, n: str) -> str:
    """The source position in x of padded position i (i counted from x's start)."""
    last = e.Sub(n, e.ints([1]))
    if mode == "edge":
        return clamp(e, i, e.ints([0]), last)
    if mode == "reflect":
        # x[-i] for i < 0 and x[2 (n - 1) - i] for i > n - 1 (pads are at most n - 1).
        r = e.Abs(i)
        return e.Where(e.Greater(r, last), e.Sub(e.Add(last, last), r), r)
    if mode == "wrap":
        return e.Mod(i, n)
    raise GradientError(f"Pad: no gradient for mode {mode!r}")


def _pad_source(mode: str, i: np.ndarray, n: int) -> np.ndarray:
    """``_pad_index`` for static positions."""
    if mode == "edge":
        return np.clip(i, 0, n - 1)
    if mode == "reflect":
        r = np.abs(i)
        return np.where(r > n - 1, 2 * (n - 1) - r, r)
    if mode == "wrap":
        return np.mod(i, n)
    raise GradientError(f"Pad: no gradient for mode {mode!r}")


@vjp("Pad")
def pad_vjp(ctx, dy):
    """y = pad(x)  ->  constant mode: dx = pad(dy, -pads) (crops what was added,
    and zero-fills what negative pads cut), dvalue = sum(dy) - sum(dx);
    edge/reflect/wrap: each padded position copies some x position, so per
    axis dx is the scatter-add of dy at those source positions."""
    x = ctx.inputs[0]
    e = ctx.emit
    mode = ctx.attr("mode")
    if ctx.opset < 11:
        pads: list[int] | str = [int(p) for p in ctx.attr("pads")]
        axes_name = None
    else:
        pads = int64(e, ctx.inputs[1])
        axes_name = ctx.input(3)
    dx = dvalue = None
    if mode == "constant":
        if isinstance(pads, list):
            dx = e.Pad(dy, pads=[-p for p in pads], mode="constant")
        else:
            dx = e.Pad(dy, e.Neg(pads), None, axes_name)
        if ctx.needs(2):
            outside = e.Sub(
                e.reduce_sum(dy, None, keepdims=False), e.reduce_sum(dx, None, keepdims=False)
            )
            dvalue = e.Reshape(outside, e.Shape(ctx.inputs[2]))
        return (dx if ctx.needs(0) else None, None, dvalue, None)[: len(ctx.inputs)]
    if not ctx.needs(0):
        return _no_grad_rest(ctx, None)
    rank = ctx.require_rank(x)
    if axes_name is None:
        axes = list(range(rank))
    else:
        axes_value = constant_value(ctx, axes_name)
        if axes_value is None:
            raise GradientError(
                f"Pad node {ctx.node.name!r}: the gradient needs constant axes, "
                f"but {axes_name!r} is computed at run time"
            )
        axes = [int(a) % rank for a in axes_value.reshape(-1)]
    static = pads if isinstance(pads, list) else constant_value(ctx, ctx.inputs[1])
    grad = dy
    for j, axis in enumerate(axes):
        if static is not None and int(static[j]) == 0 and int(static[j + len(axes)]) == 0:
            continue
        n, n_static = e.dim(x, axis), _static_dim(ctx, x, axis)
        if static is not None and n_static is not None:
            # every position is known when building (and opsets 7-8 lack integer comparisons)
            begin = int(static[j])
            i = np.arange(n_static + begin + int(static[j + len(axes)]), dtype=np.int64) - begin
            source = e.const(_pad_source(mode, i, n_static))
        else:
            before = e.ints([int(static[j])]) if static is not None else e.slice(pads, [j], [j + 1])
            source = _pad_index(e, mode, e.Sub(e.arange(e.dim(grad, axis)), before), n)
        target = with_dim(e, e.Shape(grad), axis, rank, e.Shape(x))
        grad = scatter_add_axis(ctx, grad, source, n, axis, rank, target, n_static)
    return _no_grad_rest(ctx, grad)


# ---------------------------------------------------------------- masks


@vjp("Trilu")
def trilu_vjp(ctx, dy):
    """y = triangle(x, k)  ->  dx = triangle(dy, k)   (the same mask; k gets none)"""
    upper = int(ctx.attr("upper"))
    return _no_grad_rest(ctx, ctx.emit.Trilu(dy, ctx.input(1), upper=upper))


@vjp("TopK")
def topk_vjp(ctx, dvalues, dindices=None):
    """values, indices = topk(x, k, axis)  ->  dx = zeros with dvalues scattered at
    indices along axis (each position is picked at most once); k gets none.

    Before opset 9 (no Scatter): the one-hot of the indices times dvalues,
    summed over the k picks (needs the size of x along axis statically)."""
    x = ctx.inputs[0]
    e = ctx.emit
    if dvalues is None or not ctx.needs(0):
        return (None,) * len(ctx.inputs)
    rank = ctx.require_rank(x)
    axis = int(ctx.attr("axis")) % rank
    indices = ctx.forward_output(1)
    if e.opset < 9:
        n_static = _static_dim(ctx, x, axis)
        dx = _scatter_add_elements(ctx, indices, dvalues, axis, rank, e.dim(x, axis), n_static, ctx.dtype(x))
        return (dx,) + (None,) * (len(ctx.inputs) - 1)
    dx = e.scatter_elements(e.zeros_like(x), indices, dvalues, axis)
    return (dx,) + (None,) * (len(ctx.inputs) - 1)


# ------------------------------------------------- more selections and scatters


def gather_elements(e: Emitter, data: str, idx: str, axis: int, rank: int) -> str:
    """GatherElements(data, idx, axis), also before opset 11.

    Before opset 11, every element of idx is turned into a flat position in
    data (idx along ``axis``, its own coordinate along the other axes, times
    data's row-major strides) and read with a Gather from the flat data."""
    if e.opset >= 11:
        return e.GatherElements(data, idx, axis=axis)
    idx = wrap_negative(e, int64(e, idx), e.dim(data, axis))
    stride = e.ints([1])
    flat = None
    for d in reversed(range(rank)):
        if d == axis:
            coord = idx
        else:
            coord = along_axis(e, e.arange(e.dim(idx, d)), d, rank)
        term = e.Mul(coord, stride)
        flat = term if flat is None else e.Add(flat, term)
        stride = e.Mul(stride, e.dim(data, d))
    return e.Gather(e.reshape(data, [-1]), flat, axis=0)


@vjp("Scatter")
def scatter_vjp(ctx, dy):
    """Scatter (opsets 9-10; ScatterElements under its old name):
    y = x with y[p(idx)] = u
    ->  dx = dy with the overwritten positions zeroed, du = gather_elements(dy, idx);
        idx gets none"""
    data, indices, updates = ctx.inputs
    e = ctx.emit
    rank = ctx.require_rank(data)
    axis = int(ctx.attr("axis")) % rank
    ddata = dupdates = None
    if ctx.needs(0):
        ddata = e.scatter_elements(dy, indices, e.zeros_like(updates), axis)
    if ctx.needs(2):
        dupdates = gather_elements(e, dy, indices, axis, rank)
    return ddata, None, dupdates


@vjp("Compress")
def compress_vjp(ctx, dy):
    """y = the slices of x (along axis; the elements of flat x without axis)
    where condition is true
    ->  dx = zeros with dy scattered back at the positions NonZero(condition);
        condition gets none"""
    x, condition = ctx.inputs[:2]
    e = ctx.emit
    if not ctx.needs(0):
        return None, None
    positions = e.reshape(e.NonZero(condition), [-1])
    zeros = zeros_of_shape(e, e.Shape(x), ctx.dtype(dy))
    axis = ctx.attr("axis")
    if axis is None:
        flat = e.scatter_elements(e.reshape(zeros, [-1]), positions, e.reshape(dy, [-1]), 0)
        return e.reshape_to(flat, e.Shape(x)), None
    rank = ctx.require_rank(x)
    axis = int(axis) % rank
    where = e.Expand(along_axis(e, positions, axis, rank), e.Shape(dy))
    return e.scatter_elements(zeros, where, dy, axis), None


@vjp("ReverseSequence")
def reverse_sequence_vjp(ctx, dy):
    """y = x with the first seq_lens[b] time steps of every batch entry b reversed
    ->  dx = ReverseSequence(dy) with the same lengths (the permutation is its
        own inverse); sequence_lens gets none"""
    attrs = {a: ctx.attr(a) for a in ("batch_axis", "time_axis") if ctx.attr(a) is not None}
    return ctx.emit.ReverseSequence(dy, ctx.inputs[1], **attrs), None


@vjp("TensorScatter")
def tensor_scatter_vjp(ctx, dy):
    """present = past with update[b, .., t, ..] written at position p(b, t) along
    axis, p(b, t) = write_indices[b] + t (mod max_len in 'circular' mode)
    ->  dpast = dy with the written positions zeroed,
        dupdate = gather_elements(dy, p) along axis; write_indices get none"""
    past, update = ctx.inputs[:2]
    e = ctx.emit
    rank = ctx.require_rank(past)
    axis = int(ctx.attr("axis")) % rank
    mode = ctx.attr("mode")
    if mode not in ("linear", "circular"):
        raise GradientError(f"TensorScatter node {ctx.node.name!r}: unknown mode {mode!r}")
    if axis == 0:
        raise GradientError(
            f"TensorScatter node {ctx.node.name!r}: axis 0 is the batch axis that "
            "write_indices index; the sequence axis must be another one"
        )
    write = ctx.input(2)
    steps = e.unsqueeze(e.arange(e.dim(update, axis)), [0])  # [1, S]
    if write is None:
        pos = steps
    else:
        pos = e.Add(e.unsqueeze(int64(e, write), [1]), steps)  # [B, S]
    if mode == "circular":
        pos = e.Mod(pos, e.dim(past, axis))
    # [B, S] -> [B, 1, .., S (at axis), .., 1], then update's shape
    lifted = [a for a in range(1, rank) if a != axis]
    idx = e.Expand(e.unsqueeze(pos, lifted) if lifted else pos, e.Shape(update))
    dpast = dupdate = None
    if ctx.needs(0):
        dpast = e.ScatterElements(dy, idx, e.zeros_like(update), axis=axis)
    if ctx.needs(1):
        dupdate = e.GatherElements(dy, idx, axis=axis)
    return (dpast, dupdate, None)[: len(ctx.inputs)]


@vjp("Unique")
def unique_vjp(ctx, dy, *_):
    """y = the distinct elements of x (flat; the distinct slices along axis),
    inverse = for each x element (slice) its entry in y, counts = its multiplicity
    ->  dx = dy[inverse] / counts[inverse]

    Equal x entries are one y entry: its gradient is shared evenly among them
    (as ReduceMax shares ties), so the rule reads the inverse_indices and
    counts outputs (added to the node when absent).  The other outputs are
    integer."""
    (x,) = ctx.inputs
    e = ctx.emit
    if dy is None or not ctx.needs(0):
        return (None,)
    et = ctx.dtype(x)
    inverse = ctx.forward_output(2)
    counts = ctx.forward_output(3)
    share = e.Cast(e.Gather(counts, inverse, axis=0), to=et)
    axis = ctx.attr("axis")
    if axis is None:
        flat = e.Div(e.Gather(dy, inverse, axis=0), share)
        return (e.reshape_to(flat, e.Shape(x)),)
    rank = ctx.require_rank(x)
    axis = int(axis) % rank
    picked = e.Gather(dy, inverse, axis=axis)
    return (e.Div(picked, along_axis(e, share, axis, rank)),)
