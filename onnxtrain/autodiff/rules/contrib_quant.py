"""Gradient rules: com.microsoft MatMulNBits, the block-quantized matrix
product of onnxruntime-genai's int4 models (and of onnxruntime's
MatMulNBitsQuantizer).

The rule differentiates with respect to the activation A, the float
``scales`` and the bias; the packed codes B and the zero points are frozen
(integers, or in the float zero-point form a quantization constant: asking
for their gradient is an error, never a silent zero).  The backward pass
unpacks the codes with standard float ops (Floor, Mod), so it runs wherever
the model's float type runs, including float64.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ...errors import GradientError
from ..registry import VJPContext, vjp
from ._common import scatter_add_axis, wrap_negative

MS = "com.microsoft"


def _codes(ctx: VJPContext, packed: str, bits: int, et: int) -> str:
    """uint8 bytes [rows, ...] holding ``bits``-bit codes, low bits first,
    -> every code as a float of type ``et``, [rows, nbytes * 8 / bits].

    For 8 / bits codes per byte, code i of a byte v is floor(v / 2^(i bits)) mod 2^bits:
    (v >> i bits) & (2^bits - 1) on the bytes themselves where the opset has
    BitwiseAnd (18), one Cast after; in float arithmetic before it.  The codes
    are small integers, so both give the same floats; the integer form moves
    a quarter of the bytes (it is the per-step cost of QLoRA's backward)."""
    e = ctx.emit
    per_byte = 8 // bits
    if per_byte > 1 and ctx.opset >= 18:
        u8 = TensorProto.UINT8
        v = e.reshape(packed, [0, -1, 1])
        mask = ctx.const(np.uint8(2 ** bits - 1), dtype=u8)
        parts = [e.BitwiseAnd(e.BitShift(v, ctx.const(np.uint8(i * bits), dtype=u8), direction="RIGHT")
                              if i else v, mask) for i in range(per_byte)]
        return e.Cast(e.reshape(e.Concat(*parts, axis=2), [0, -1]), to=et)
    v = e.Cast(e.reshape(packed, [0, -1, 1]), to=et)
    if per_byte == 1:
        return e.reshape(v, [0, -1])
    parts = []
    for i in range(per_byte):
        shifted = e.Floor(e.Div(v, ctx.const(float(2 ** (i * bits)), dtype=et))) if i else v
        parts.append(e.Mod(shifted, ctx.const(float(2 ** bits), dtype=et), fmod=1))
    return e.reshape(e.Concat(*parts, axis=2), [0, -1])


def _unpack(ctx: VJPContext, packed: str, bits: int, et: int, count: int) -> str:
    """The first ``count`` codes of each row (the rest pad the last byte or block)."""
    return ctx.emit.slice(_codes(ctx, packed, bits, et), [0], [count], [1])


def dequantized_weight(ctx: VJPContext) -> tuple[str, str]:
    """(W, U) for a MatMulNBits node: W [N, K] = (q - zp) * scale, the weight the
    node multiplies by (transposed: Y = A W^T), and U [N, blocks, block_size] =
    q - zp, zero-padded along K to whole blocks (dW / dscale, blockwise)."""
    e = ctx.emit
    a, b, scales = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]
    zp = ctx.input(3)
    bits = int(ctx.attr("bits", 4))
    block = int(ctx.attr("block_size"))
    k, n = int(ctx.attr("K")), int(ctx.attr("N"))
    blocks = -(-k // block)
    et = ctx.dtype(a)
    if bits not in (2, 4, 8):
        raise GradientError(
            f"gradient of MatMulNBits node {ctx.node.name!r}: bits={bits} is not supported (2, 4 or 8)"
        )
    if int(ctx.attr("weight_prepacked", 0) or 0):
        raise GradientError(
            f"gradient of MatMulNBits node {ctx.node.name!r}: B is prepacked for an execution provider"
        )
    q = e.reshape(_unpack(ctx, b, bits, et, blocks * block), [n, blocks, block])
    if zp is None:
        zero = ctx.const(float(2 ** (bits - 1)), dtype=et)
    elif ctx.dtype(zp) == et:  # the float form: one zero point per block, as scales
        zero = e.reshape(zp, [n, blocks, 1])
    else:  # packed uint8, same packing as B, padded per row
        zero = e.reshape(_unpack(ctx, e.reshape(zp, [n, -1]), bits, et, blocks), [n, blocks, 1])
    u = e.Sub(q, zero)
    w = e.Mul(u, e.reshape(scales, [n, blocks, 1]))
    w = e.slice(e.reshape(w, [n, blocks * block]), [0], [k], [1])
    return w, u


@vjp("MatMulNBits", domain=MS)
def matmul_nbits_vjp(ctx, dy):
    """Y = A W^T (+ bias),  W[n, k] = (q[n, k] - zp[n, k / bs]) * scale[n, k / bs]
    (q the codes of B, bs = block_size, zp 2^(bits-1) when absent)
    ->  dA = dY W,   dbias = sum over all but the last axis of dY,
        dscale[n, j] = sum_{k in block j} (q - zp)[n, k] * G[n, k],
        G = dY2^T A2 (A and dY flattened to [M, K] and [M, N])

    accuracy_level 4 rounds A to int8 blocks inside onnxruntime's forward
    pass; the rule treats that rounding as the identity (straight-through):
    the gradient is that of the exact product.  Training the scales of an
    accuracy_level 4 node is refused: onnxruntime 1.32 gets that node's
    forward pass wrong when its scales are fed at run time (with B a
    constant, it returns values off by the size of the output).  A session's
    programs never get here with one: ``lower.pipeline.exact_quantized_products``
    runs such nodes at accuracy_level 1 first.  g_idx (deprecated act-order)
    is refused."""
    e = ctx.emit
    a = ctx.inputs[0]
    if ctx.input(4) is not None:
        raise GradientError(
            f"gradient of MatMulNBits node {ctx.node.name!r}: g_idx (act-order) is not supported"
        )
    if ctx.needs(2) and int(ctx.attr("accuracy_level", 0) or 0) == 4:
        raise GradientError(
            f"MatMulNBits node {ctx.node.name!r}: its scales are trained with accuracy_level=4, and "
            "onnxruntime (1.32) computes accuracy_level 4 wrongly when the scales are not a constant "
            "initializer, as trained state is: set the node's accuracy_level to 0 or 1 (the exact float "
            "product) to train the scales, or keep them frozen (QLoRA does)"
        )
    k, n = int(ctx.attr("K")), int(ctx.attr("N"))
    block = int(ctx.attr("block_size"))
    blocks = -(-k // block)
    grads: list[str | None] = [None] * len(ctx.inputs)
    if ctx.needs(0) or ctx.needs(2):
        w, u = dequantized_weight(ctx)
        if ctx.needs(0):
            grads[0] = e.MatMul(dy, w)
        if ctx.needs(2):
            g = e.MatMul(e.Transpose(e.reshape(dy, [-1, n]), perm=[1, 0]), e.reshape(a, [-1, k]))
            if blocks * block != k:
                g = e.Pad(g, e.ints([0, 0, 0, blocks * block - k]))
            g = e.reshape(g, [n, blocks, block])
            ds = e.reduce_sum(e.Mul(g, u), [2], keepdims=False)
            grads[2] = e.Reshape(ds, e.Shape(ctx.inputs[2]))
    if ctx.input(5) is not None and ctx.needs(5):
        rank = ctx.require_rank(a)
        grads[5] = e.reduce_sum(dy, list(range(rank - 1)), keepdims=False)
    return tuple(grads)


@vjp("GatherBlockQuantized", domain=MS)
def gather_block_quantized_vjp(ctx, dy):
    """y[i, k] = (q[idx_i, k] - zp[idx_i, k / bs]) * scale[idx_i, k / bs]
    (data: uint8 rows of ``bits``-bit codes packed along the last axis, gathered
    along axis 0, quantized along the last axis in blocks of bs; zp 2^(bits-1)
    when absent; an out-of-range index gives a zero row)
    ->  dscale[v, j] = sum_{i: idx_i = v} sum_{k in block j} dy[i, k] (q - zp)[v, k]
        data, indices and zero points get none

    Supported: uint8 data, gather_axis 0, quantize_axis the last axis (as
    onnxruntime-genai writes a tied int4 embedding)."""
    e = ctx.emit
    data, idx, scales = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]
    zp = ctx.input(3)
    grads: list[str | None] = [None] * len(ctx.inputs)
    if not ctx.needs(2):
        return tuple(grads)
    name = ctx.node.name
    rank = ctx.require_rank(data)
    axes = int(ctx.attr("gather_axis", 0)) % rank, int(ctx.attr("quantize_axis", 1)) % rank
    if ctx.dtype(data) != TensorProto.UINT8 or axes != (0, rank - 1):
        raise GradientError(
            f"gradient of GatherBlockQuantized node {name!r}: only uint8 data gathered along axis 0 and "
            "quantized along its last axis is supported"
        )
    if rank != 2:
        raise GradientError(f"gradient of GatherBlockQuantized node {name!r}: data of rank {rank} (2 expected)")
    bits, block = int(ctx.attr("bits", 4)), int(ctx.attr("block_size", 128))
    et = ctx.dtype(scales)
    blocks = e.shape_of(scales, 1, 2)
    width = e.Mul(blocks, e.ints([block]))
    q = e.Slice(_codes(ctx, data, bits, et), e.ints([0]), width, e.ints([1]))
    q = e.Reshape(q, e.Concat(e.shape_of(scales, 0, 1), blocks, e.ints([block]), axis=0))  # [V, blocks, bs]
    if zp is None:
        u = e.Sub(q, ctx.const(float(2 ** (bits - 1)), dtype=et))
    else:
        z = e.Slice(_codes(ctx, zp, bits, et), e.ints([0]), blocks, e.ints([1]))
        u = e.Sub(q, e.unsqueeze(z, [2]))
    rows = e.shape_of(data, 0, 1)
    flat_idx = wrap_negative(e, e.cast_to(e.reshape(idx, [-1]), 7), rows)
    inside = e.And(e.GreaterOrEqual(flat_idx, e.ints([0])), e.Less(flat_idx, rows))
    safe_idx = e.Where(inside, flat_idx, e.ints([0]))
    k = e.shape_of(dy, -1)
    g = e.Reshape(dy, e.Concat(e.ints([-1]), k, axis=0))  # [M, K]
    g = e.Mul(g, e.unsqueeze(e.Cast(inside, to=et), [1]))  # out-of-range rows: zero output, no gradient
    g = e.Pad(g, e.Concat(e.ints([0, 0, 0]), e.Sub(width, k), axis=0))
    g = e.Reshape(g, e.Concat(e.ints([-1]), blocks, e.ints([block]), axis=0))  # [M, blocks, bs]
    per_row = e.reduce_sum(e.Mul(g, e.Gather(u, safe_idx, axis=0)), [2], keepdims=False)  # [M, blocks]
    grads[2] = scatter_add_axis(ctx, per_row, safe_idx, rows, 0, 2, e.Shape(scales))
    return tuple(grads)

