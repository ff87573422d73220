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

from ...errors import GradientError
from ..registry import VJPContext, vjp

MS = "com.microsoft"


def _unpack(ctx: VJPContext, packed: str, bits: int, et: int, rows: int, count: int) -> str:
    """uint8 bytes [rows, ..., nbytes] holding ``bits``-bit codes, low bits first,
    -> float codes [rows, count] (type ``et``; the trailing codes past ``count``,
    padding of the last byte, dropped).

    For 8 / bits codes per byte, code i of a byte v is floor(v / 2^(i bits)) mod 2^bits."""
    e = ctx.emit
    v = e.Cast(e.reshape(packed, [rows, -1, 1]), to=et)
    per_byte = 8 // bits
    if per_byte == 1:
        codes = v
    else:
        parts = []
        for i in range(per_byte):
            shifted = e.Floor(e.Div(v, ctx.const(float(2 ** (i * bits)), dtype=et))) if i else v
            parts.append(e.Mod(shifted, ctx.const(float(2 ** bits), dtype=et), fmod=1))
        codes = e.Concat(*parts, axis=2)
    flat = e.reshape(codes, [rows, -1])
    return e.slice(flat, [0], [count], [1])


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
    q = e.reshape(_unpack(ctx, b, bits, et, n, blocks * block), [n, blocks, block])
    if zp is None:
        zero = ctx.const(float(2 ** (bits - 1)), dtype=et)
    elif ctx.dtype(zp) == et:  # the float form: one zero point per block, as scales
        zero = e.reshape(zp, [n, blocks, 1])
    else:  # packed uint8, same packing as B, padded per row
        zero = e.reshape(_unpack(ctx, zp, bits, et, n, blocks), [n, blocks, 1])
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
    the gradient is that of the exact product.  g_idx (deprecated
    act-order) is refused."""
    e = ctx.emit
    a = ctx.inputs[0]
    if ctx.input(4) is not None:
        raise GradientError(
            f"gradient of MatMulNBits node {ctx.node.name!r}: g_idx (act-order) is not supported"
        )
    k, n = int(ctx.attr("K")), int(ctx.attr("N"))
    block = int(ctx.attr("block_size"))
    blocks = -(-k // block)
    grads: list[str | None] = [None] * len(ctx.inputs)
    if not (ctx.needs(0) or ctx.needs(2)):
        pass
    else:
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
