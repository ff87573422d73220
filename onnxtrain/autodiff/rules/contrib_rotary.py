"""Gradient rules: the rotary embeddings, com.microsoft RotaryEmbedding and the
ONNX RotaryEmbedding (opset 23), and ``rotate``, the rotation written in
standard ops that the attention rules share.

RotaryEmbedding is a rotation of pairs of channels, linear in its input: its
gradient is the inverse rotation (sine negated), written with standard ops.
"""

from __future__ import annotations

from ...core.emitter import Emitter
from ...errors import GradientError
from ..registry import VJPContext, vjp
from ._common import scatter_add_axis

MS = "com.microsoft"
_BIG = 2**62

# ------------------------------------------------------------------- rotary
def rotate(e: Emitter, x: str, cos: str, sin: str, interleaved: bool) -> str:
    """Rotate the leading 2 * half channels of x [..., D] by the angles whose
    cosines and sines are ``cos``/``sin`` [..., half] (broadcast against
    x[..., :half]); channels past 2 * half pass through.

    Halves:       y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin  (x1 = x[:half], x2 = x[half:2 half])
    Interleaved:  the same on the pairs (x[2i], x[2i+1])."""
    half = e.shape_of(cos, -1)
    rot = e.Mul(half, e.ints([2]))
    axis = -1
    xr = e.Slice(x, e.ints([0]), rot, e.ints([axis]))
    rest = e.Slice(x, rot, e.ints([_BIG]), e.ints([axis]))
    if interleaved:
        pairs = e.Reshape(xr, e.Concat(e.shape_of(xr, 0, -1), half, e.ints([2]), axis=0))
        x1, x2 = e.split(pairs, [1, 1], axis=-1)
        c, s = e.unsqueeze(cos, [-1]), e.unsqueeze(sin, [-1])
        y1 = e.Sub(e.Mul(x1, c), e.Mul(x2, s))
        y2 = e.Add(e.Mul(x2, c), e.Mul(x1, s))
        yr = e.Reshape(e.Concat(y1, y2, axis=-1), e.Shape(xr))
    else:
        x1 = e.Slice(x, e.ints([0]), half, e.ints([axis]))
        x2 = e.Slice(x, half, rot, e.ints([axis]))
        yr = e.Concat(
            e.Sub(e.Mul(x1, cos), e.Mul(x2, sin)), e.Add(e.Mul(x2, cos), e.Mul(x1, sin)), axis=-1
        )
    return e.Concat(yr, rest, axis=-1)


def _pairs(e: Emitter, t: str, half: str, interleaved: bool) -> tuple[str, str]:
    """(t1, t2), the two members of each rotated pair of t [..., D], each [..., half]."""
    if interleaved:
        rot = e.Slice(t, e.ints([0]), e.Mul(half, e.ints([2])), e.ints([-1]))
        pairs = e.Reshape(rot, e.Concat(e.shape_of(rot, 0, -1), half, e.ints([2]), axis=0))
        t1, t2 = e.split(pairs, [1, 1], axis=-1)
        return e.squeeze(t1, [-1]), e.squeeze(t2, [-1])
    return (e.Slice(t, e.ints([0]), half, e.ints([-1])),
            e.Slice(t, half, e.Mul(half, e.ints([2])), e.ints([-1])))


def _rotary_vjp(ctx: VJPContext, dy: str, position_ids: str | None, cos: str, sin: str, onnx_op: bool,
                cache_index: int) -> tuple[str | None, str | None, str | None]:
    """(dx, dcos, dsin) of y = R(p) x, in the op's own layouts.

    dx = R^T dy, the rotation by the negated angle.  With (x1, x2) and
    (g1, g2) the pairs of x and dy: y1 = x1 c - x2 s, y2 = x2 c + x1 s, so
    dc[p] = sum over heads and tokens at position p of g1 x1 + g2 x2 and
    ds[p] = the same of g2 x1 - g1 x2 (scattered back into the cache rows).

    Layouts: 4-D input [B, N, S, H]; 3-D input [B, S, N * H] with N from
    ``num_heads`` (else H = 2 * half, full rotation).  The caches are
    [max_pos, half] indexed by position_ids, or (ONNX op without position_ids)
    [B, S, half] already gathered.  com.microsoft position_ids may be one offset
    (shape [1]): positions offset + 0..S-1."""
    e = ctx.emit
    x = ctx.inputs[0]
    rank = ctx.require_rank(x)
    interleaved = bool(ctx.attr("interleaved", 0))
    heads = int(ctx.attr("num_heads", 0) or 0)
    half = e.shape_of(cos, -1)

    def heads_view(t: str) -> str:  # -> [B, S, N, H]
        if rank == 4:
            return e.Transpose(t, perm=[0, 2, 1, 3])
        head = e.ints([-1]) if heads else e.Mul(half, e.ints([2]))
        return e.Reshape(t, e.Concat(e.ints([0, 0, heads if heads else -1]), head, axis=0))

    g = heads_view(dy)
    seq = e.shape_of(g, 1, 2)
    pos = None
    if position_ids is not None and ctx.rank(position_ids) == 1:  # one offset (com.microsoft)
        pos = e.Add(e.arange(seq), e.cast_to(e.reshape(position_ids, []), 7))  # [S]
    elif position_ids is not None:
        pos = e.cast_to(position_ids, 7)  # [B, S]
    c, s = (e.Gather(cos, pos, axis=0), e.Gather(sin, pos, axis=0)) if pos is not None else (cos, sin)
    c, s = e.unsqueeze(c, [-2]), e.unsqueeze(s, [-2])  # broadcast over heads
    dx = None
    if ctx.needs(0):
        dx = rotate(e, g, c, e.Neg(s), interleaved)
        dx = e.Transpose(dx, perm=[0, 2, 1, 3]) if rank == 4 else e.Reshape(dx, e.Shape(x))
    d_cache: list[str | None] = [None, None]
    if ctx.needs(cache_index) or ctx.needs(cache_index + 1):
        x1, x2 = _pairs(e, heads_view(x), half, interleaved)
        g1, g2 = _pairs(e, g, half, interleaved)
        per_token = [e.reduce_sum(e.Add(e.Mul(g1, x1), e.Mul(g2, x2)), [2], keepdims=False),  # [B, S, half]
                     e.reduce_sum(e.Sub(e.Mul(g2, x1), e.Mul(g1, x2)), [2], keepdims=False)]
        for k, (cache, d) in enumerate(zip((cos, sin), per_token)):
            if not ctx.needs(cache_index + k):
                continue
            if pos is None:  # the ONNX op's gathered [B, S, half] caches
                d_cache[k] = d
                continue
            if ctx.rank(position_ids) == 1:
                d, idx = e.reduce_sum(d, [0], keepdims=False), pos  # [S, half], [S]
            else:
                d = e.Reshape(d, e.Concat(e.ints([-1]), half, axis=0))  # [B S, half]
                idx = e.reshape(pos, [-1])
            d_cache[k] = scatter_add_axis(ctx, d, idx, e.shape_of(cache, 0, 1), 0, 2, e.Shape(cache))
    return dx, d_cache[0], d_cache[1]


@vjp("RotaryEmbedding", domain=MS)
def ms_rotary_embedding_vjp(ctx, dy):
    """y = R(p) x: pairs of channels rotated by angle(p) (cos/sin_cache[p]), p the
    token's position (position_ids, or offset + s); inputs input, position_ids,
    cos_cache, sin_cache
    ->  dx = R(p)^T dy = the same rotation with sin negated; the caches' rows
        get the products of the pairs (see ``_rotary_vjp``); position_ids none"""
    if ctx.attr("is_packed_batching", 0):
        raise GradientError(f"gradient of RotaryEmbedding node {ctx.node.name!r}: packed batching is not supported")
    if float(ctx.attr("scale", 1.0) or 1.0) != 1.0:
        raise GradientError(f"gradient of RotaryEmbedding node {ctx.node.name!r}: scale != 1 is not supported")
    dx, dcos, dsin = _rotary_vjp(ctx, dy, ctx.inputs[1], ctx.inputs[2], ctx.inputs[3], False, 2)
    return dx, None, dcos, dsin


@vjp("RotaryEmbedding")
def rotary_embedding_vjp(ctx, dy):
    """y = R(p) x (ONNX RotaryEmbedding, opset 23; inputs X, cos_cache, sin_cache,
    position_ids)  ->  dx = R(p)^T dy = the same rotation with sin negated;
    dcos, dsin as for com.microsoft's (gathered [B, S, half] caches without
    position_ids get the per-token sums directly)"""
    dx, dcos, dsin = _rotary_vjp(ctx, dy, ctx.input(3), ctx.inputs[1], ctx.inputs[2], True, 1)
    return dx, dcos, dsin, None
