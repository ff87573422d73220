"""Gradient rules: sequence and optional ops.

The gradient of a sequence-valued name is a sequence of the same length whose
elements are the gradients of its elements (shaped like them); the gradient of
an optional is an optional holding the gradient of its element.  The emitter
records such names (``Emitter.sequence_types`` / ``optional_types``) so that
several contributions add up element by element (SequenceMap(Add)).

Reading one element (SequenceAt) sends its gradient back as a sequence of zeros
with the gradient at that position; zero sequences, element lengths and sums of
sequences are built with SequenceMap, so these rules need opset >= 17.
Positions are normalised to non-negative indices at run time, since inserting
at a negative position counts from the back of a sequence of another length.
"""

from __future__ import annotations

from ...core.emitter import Emitter
from ...errors import TrainingModelError
from ..registry import VJPContext, no_grad, vjp

no_grad("SequenceLength", "SequenceEmpty", "OptionalHasElement")


def _seq(e: Emitter, name: str, et: int) -> str:
    e.sequence_types[name] = et
    return name


def _elem_type(ctx: VJPContext, dseq: str) -> int:
    et = ctx.emit.sequence_types.get(dseq)
    if et is None:
        raise TrainingModelError(
            f"gradient of {ctx.node.op_type} node {ctx.node.name!r}: the element type of the "
            f"sequence gradient {dseq!r} is unknown"
        )
    return et


def _position(e: Emitter, pos: str, seq: str) -> str:
    """``pos`` (int32/int64 scalar, may be negative) as a non-negative int64
    index into ``seq``."""
    p = e.cast_to(pos, 7)  # INT64
    e.dtypes[p] = 7
    n = e.SequenceLength(seq)
    e.dtypes[n] = 7
    zero = e.const(0, dtype=7)
    return e.Where(e.Less(p, zero), e.Add(p, n), p)


def _at(e: Emitter, seq: str, pos: str, et: int) -> str:
    out = e.SequenceAt(seq, pos)
    e.dtypes[out] = et
    return out


@vjp("SequenceConstruct")
def sequence_construct_vjp(ctx: VJPContext, ds):
    """S = [x_0, ..., x_{n-1}]  ->  dx_i = dS[i]."""
    e = ctx.emit
    out = []
    for i, x in enumerate(ctx.inputs):
        if not ctx.needs(i):
            out.append(None)
            continue
        out.append(_at(e, ds, e.const(i, dtype=7), ctx.dtype(x)))
    return out


@vjp("SequenceAt")
def sequence_at_vjp(ctx: VJPContext, dy):
    """y = S[p]  ->  dS = zeros like S, with dy at position p."""
    e = ctx.emit
    seq, pos = ctx.inputs[0], ctx.inputs[1]
    et = ctx.dtype(ctx.outputs[0])
    zeros = e.zeros_like_sequence(seq, et)
    p = _position(e, pos, seq)
    ds = e.SequenceInsert(e.SequenceErase(zeros, p), dy, p)
    return _seq(e, ds, et), None


@vjp("SequenceInsert")
def sequence_insert_vjp(ctx: VJPContext, ds_out):
    """S' = insert(S, t, p)  ->  dt = dS'[p], dS = erase(dS', p) (p = end when absent)."""
    e = ctx.emit
    seq = ctx.inputs[0]
    et = _elem_type(ctx, ds_out)
    pos = ctx.input(2)
    p = _position(e, pos, seq) if pos else e.SequenceLength(seq)
    dt = _at(e, ds_out, p, et) if ctx.needs(1) else None
    ds = _seq(e, e.SequenceErase(ds_out, p), et) if ctx.needs(0) else None
    return ds, dt, None


@vjp("SequenceErase")
def sequence_erase_vjp(ctx: VJPContext, ds_out):
    """S' = erase(S, p)  ->  dS = insert(dS', zeros like S[p], p) (p = last when absent)."""
    e = ctx.emit
    seq = ctx.inputs[0]
    et = _elem_type(ctx, ds_out)
    pos = ctx.input(1)
    if pos:
        p = _position(e, pos, seq)
    else:
        p = e.Sub(e.SequenceLength(seq), e.const(1, dtype=7))
    removed = _at(e, seq, p, et)
    ds = e.SequenceInsert(ds_out, e.zeros_like(removed), p)
    return _seq(e, ds, et), None


@vjp("ConcatFromSequence")
def concat_from_sequence_vjp(ctx: VJPContext, dy):
    """y = concat(S, axis) -> dS = split(dy, the elements' lengths along axis);
    with new_axis=1 (stack) -> dS = split(dy) into size-1 pieces, axis squeezed."""
    e = ctx.emit
    seq = ctx.inputs[0]
    axis = int(ctx.attr("axis"))
    et = ctx.dtype(ctx.outputs[0])
    if ctx.attr("new_axis"):
        ds = e.SplitToSequence(dy, axis=axis, keepdims=0)
        return _seq(e, ds, et)

    def length(b: Emitter, x: str) -> list[str]:
        shape = b.Shape(x)
        b.dtypes[shape] = 7
        ax = b.const([axis], dtype=7)
        # a negative axis counts from the back of the element's rank
        rank = b.Size(shape)
        ax = b.Where(b.Less(ax, b.const(0, dtype=7)), b.Add(ax, rank), ax)
        return [b.Gather(shape, ax)]

    lengths_seq = e.sequence_map([seq], [et], length, [7])[0]
    lengths = e.ConcatFromSequence(lengths_seq, axis=0)
    e.dtypes[lengths] = 7
    ds = e.SplitToSequence(dy, lengths, axis=axis)
    return _seq(e, ds, et)


@vjp("SplitToSequence")
def split_to_sequence_vjp(ctx: VJPContext, ds):
    """S = split(x, axis) -> dx = concat(dS, axis) (stacked back when the pieces
    were squeezed: no split input and keepdims=0)."""
    e = ctx.emit
    axis = int(ctx.attr("axis"))
    squeezed = not ctx.input(1) and not ctx.attr("keepdims")
    dx = e.ConcatFromSequence(ds, axis=axis, new_axis=1 if squeezed else 0)
    e.dtypes[dx] = ctx.dtype(ctx.inputs[0])
    return dx, None


@vjp("Optional")
def optional_vjp(ctx: VJPContext, dopt):
    """O = Optional(x)  ->  dx = the element of dO."""
    if not ctx.input(0):
        return ()
    e = ctx.emit
    dx = e.OptionalGetElement(dopt)
    e.dtypes[dx] = ctx.dtype(ctx.inputs[0])
    return (dx,)


@vjp("OptionalGetElement")
def optional_get_element_vjp(ctx: VJPContext, dy):
    """y = element of O  ->  dO = Optional(dy); a tensor input (opset >= 18
    passes tensors through) gets dy itself."""
    e = ctx.emit
    x = ctx.inputs[0]
    et = ctx.dtype(ctx.outputs[0])
    if x in e.dtypes and ctx.shape(x) is not None:
        return (dy,)
    dopt = e.op("Optional", [dy])
    e.optional_types[dopt] = et
    return (dopt,)
