"""Helpers shared by the rule modules of several op families: static facts
about values (``constant_value``, ``dims_of``), int64 index arithmetic and
the scatter-add that is the adjoint of a gather (``one_hot``,
``scatter_add_axis``).  A helper used by one family stays in its module."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from ...core.emitter import Emitter, np_dtype
from ...errors import TrainingModelError
from ..registry import Dim, VJPContext


def constant_value(ctx: VJPContext, name: str) -> np.ndarray | None:
    """The value of ``name`` when a Constant node of the program produced it."""
    return ctx.emit.constants.get(name)


def dims_of(ctx: VJPContext, name: str, rank: int) -> tuple[Dim, ...]:
    """Static dims of ``name`` (None where unknown), padded to ``rank`` entries."""
    s = ctx.shape(name)
    if s is None or len(s) != rank:
        return (None,) * rank
    return tuple(s)


def zeros_of_shape(e: Emitter, shape: str, et: int) -> str:
    """A zero tensor of element type ``et`` and the runtime shape ``shape`` (opset >= 9)."""
    fill = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(et)))
    return e.op("ConstantOfShape", [shape], value=fill)


def int64(e: Emitter, x: str) -> str:
    return e.cast_to(x, TensorProto.INT64)


def wrap_negative(e: Emitter, idx: str, n: str) -> str:
    """Indices counted from the end (-1 is the last) made non-negative: idx < 0 ? idx + n : idx."""
    return e.Where(e.Less(idx, e.ints([0])), e.Add(idx, n), idx)


def clamp(e: Emitter, x: str, lo: str, hi: str) -> str:
    """min(max(x, lo), hi) for int64 tensors (integer Min/Max need opset 12)."""
    x = e.Where(e.Less(x, lo), lo, x)
    return e.Where(e.Greater(x, hi), hi, x)


def along_axis(e: Emitter, idx: str, axis: int, rank: int) -> str:
    """A 1-D tensor reshaped to [1, .., -1 (at axis), .., 1] so it broadcasts along ``axis``."""
    return e.reshape(idx, [1] * axis + [-1] + [1] * (rank - axis - 1))


def with_dim(e: Emitter, shape: str, axis: int, rank: int, from_shape: str) -> str:
    """``shape`` with its entry at ``axis`` taken from ``from_shape``."""
    mask = e.const(np.arange(rank) == axis)
    return e.Where(mask, from_shape, shape)


def one_hot(ctx: VJPContext, idx: str, n: str, n_static: int | None, idx_rank: int, et: int) -> str:
    """[idx.shape..., n] in element type ``et``: 1 where idx == j, for idx in [-n, n).

    OneHot from opset 9 (onnxruntime has no float64 OneHot: built in int64,
    then cast; 0/1 exact).  Before, with n known statically, Equal against a
    constant range: (idx == j) or (idx == j - n), which also counts negative
    indices from the end (integer Less, for wrapping them first, needs opset 9)."""
    e = ctx.emit
    if e.opset >= 9:
        return e.Cast(e.OneHot(idx, n, e.ints([0, 1]), axis=-1), to=et)
    if n_static is None:
        raise TrainingModelError(
            f"gradient of {ctx.node.op_type} node {ctx.node.name!r}: opset {e.opset} has no OneHot; "
            "the gathered axis needs a static size"
        )
    col = e.unsqueeze(idx, [idx_rank])
    j = np.arange(n_static, dtype=np.int64)
    hit = e.Or(e.Equal(col, e.const(j)), e.Equal(col, e.const(j - n_static)))
    return e.Cast(hit, to=et)


def scatter_add_axis(
    ctx: VJPContext, dy: str, idx: str, n: str, axis: int, rank: int, out_shape: str,
    n_static: int | None = None,
) -> str:
    """out[.., j, ..] = sum over i with idx[i] == j of dy[.., i, ..]   (the adjoint of Gather).

    ``dy`` has len(idx) entries along ``axis``; ``out_shape`` is dy's shape with
    n there; idx holds non-negative int64 positions, repeats allowed.
    From opset 16 this is ScatterElements(reduction='add'); before, dy is
    contracted with the one-hot matrix onehot(idx, n) along ``axis`` (which,
    before opset 9, needs ``n_static``, n known statically)."""
    e = ctx.emit
    et = ctx.dtype(dy)
    if e.opset >= 16:
        where = e.Expand(along_axis(e, idx, axis, rank), e.Shape(dy))
        zeros = zeros_of_shape(e, out_shape, et)
        return e.ScatterElements(zeros, where, dy, axis=axis, reduction="add")
    onehot = one_hot(ctx, idx, n, n_static, 1, et)  # [len(idx), n]
    if axis == rank - 1:
        return e.MatMul(dy, onehot)
    perm = [i for i in range(rank) if i != axis] + [axis]
    moved = e.MatMul(e.Transpose(dy, perm=perm), onehot)
    return e.Transpose(moved, perm=[int(p) for p in np.argsort(perm)])
