"""Gradient rules: quantization.

DequantizeLinear is linear in its float scale: y = (x - zero_point) * scale,
with x and zero_point integer (or float8/float4 storage formats, which carry
no gradient either).  The ops that produce integers (QuantizeLinear, the
integer and QLinear products) have discrete outputs: they are registered as
carrying no gradient, so that a fake-quantization pattern Q -> DQ
differentiates (to the derivative of the rounding, 0 almost everywhere)
instead of stopping at a missing rule.
BitCast's integer outputs carry no gradient either; its floating outputs are
refused (see its rule).
"""

from __future__ import annotations

from ...errors import GradientError, TrainingModelError
from ..registry import VJPContext, no_grad, vjp


def _dequantize_unit(ctx: VJPContext) -> str:
    """(x - zero_point) in y's type: the forward op again with a scale of ones.

    Reusing DequantizeLinear keeps every x type (int4, float8, ...) and every
    granularity (per tensor, per axis, blocked) exactly as the op reads them."""
    e = ctx.emit
    x, scale = ctx.inputs[0], ctx.inputs[1]
    attrs = {a: ctx.attr(a) for a in ("axis", "block_size", "output_dtype") if ctx.attr(a) is not None}
    return e.op("DequantizeLinear", [x, e.ones_like(scale), ctx.input(2)], **attrs)


@vjp("DequantizeLinear")
def dequantize_linear_vjp(ctx, dy):
    """y = (x - zp) * scale   (scale broadcast: per tensor, per axis, or per block of
    block_size entries along axis)
    ->  dscale = the sum of dy * (x - zp) over the entries each scale entry multiplies;
        x and zp (integers) get none

    Per axis the sum runs over every axis but ``axis``; per block the product is
    zero-padded along ``axis`` to whole blocks, viewed as (blocks, block_size)
    there and summed over block_size."""
    e = ctx.emit
    x, scale = ctx.inputs[0], ctx.inputs[1]
    if not ctx.needs(1):
        return (None,) * len(ctx.inputs)
    g = e.Mul(dy, _dequantize_unit(ctx))
    block = int(ctx.attr("block_size", 0) or 0)
    scale_shape = ctx.shape(scale)
    scale_rank = ctx.rank(scale)
    if scale_rank is None:
        raise TrainingModelError(
            f"gradient of DequantizeLinear node {ctx.node.name!r} needs the rank of the scale "
            f"{scale!r}, which shape inference could not determine"
        )
    per_tensor = scale_rank == 0 or (
        block == 0 and scale_shape is not None and tuple(scale_shape) == (1,)
    )
    if per_tensor:
        dscale = e.Reshape(e.reduce_sum(g, None, keepdims=False), e.Shape(scale))
    elif block == 0:
        rank = ctx.require_rank(x)
        axis = int(ctx.attr("axis", 1)) % rank
        dscale = e.reduce_sum(g, [a for a in range(rank) if a != axis], keepdims=False)
    else:
        rank = ctx.require_rank(x)
        axis = int(ctx.attr("axis", 1)) % rank
        blocks = e.dim(scale, axis)
        size = e.ints([block])
        missing = e.Sub(e.Mul(blocks, size), e.dim(x, axis))
        pads = e.Concat(
            e.ints([0] * (rank + axis)), missing, e.ints([0] * (rank - axis - 1)), axis=0
        )
        padded = e.Pad(g, pads)
        parts = []
        if axis > 0:
            parts.append(e.shape_of(x, 0, axis))
        parts += [blocks, size]
        if axis + 1 < rank:
            parts.append(e.shape_of(x, axis + 1))
        dscale = e.reduce_sum(e.Reshape(padded, e.concat(parts)), [axis + 1], keepdims=False)
    dscale = e.cast_to(dscale, ctx.dtype(scale))
    return (None, dscale, None)[: len(ctx.inputs)]


# Integer (or float8/float4) outputs: rounding, piecewise constant in every input.
no_grad("QuantizeLinear")
# Integer products of integer inputs, and their requantized QLinear forms.
no_grad("MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv")


@vjp("BitCast")
def bitcast_vjp(ctx, dy):
    """y = the bits of x read as another type of the same width.

    An integer y carries no gradient (the engine never asks for it).  A
    floating y read from floating bits (float16 <-> bfloat16) moves in jumps
    as mantissa bits turn into exponent bits: there is no derivative worth
    the name, and a zero would be a silent lie, so the rule refuses."""
    raise GradientError(
        f"BitCast node {ctx.node.name!r} reinterprets floating bits as another floating "
        f"type ({ctx.attr('to')}); that reinterpretation has no usable derivative"
    )
