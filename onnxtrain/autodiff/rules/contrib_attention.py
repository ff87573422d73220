"""Gradient rules: onnxruntime's attention ops as onnxruntime-genai writes them:
com.microsoft GroupQueryAttention (prompt mode), com.microsoft RotaryEmbedding
and the ONNX RotaryEmbedding (opset 23); and com.microsoft MultiHeadAttention
(separate 3-D query/key/value, see ``mha_forward``).

RotaryEmbedding is a rotation of pairs of channels, linear in its input: its
gradient is the inverse rotation (sine negated), written with standard ops.

GroupQueryAttention's (and MultiHeadAttention's) gradient differentiates a standard-op rewrite of its
forward pass (``gqa_forward``), recomputed inside the backward pass through
``ctx.vjp_of_graph``: the forward node itself stays onnxruntime's fused
kernel.  Supported is the prompt (prefill) call a training step makes:

* past key/value empty (fed with a zero-length sequence axis; with
  ``sliding_window_cache=1``, as Gemma-2 models have it, onnxruntime wants a
  capacity of at least ``local_window_size`` rows: feed zeros, the prompt does
  not read them); the present outputs are not differentiated (they are the
  new keys and values, a cache).  A non-empty past that is not static cannot
  be told apart at build time: the rule assumes the prompt call, where every
  batch entry has seqlens_k[b] < S;
* packed QKV (``key``/``value`` absent) or separate q, k, v;
* ``do_rotary`` (interleaved or not, full or partial rotary dimension) with
  positions 0..S-1, cos/sin caches as inputs;
* grouped KV heads, ``scale``, ``softcap``, ``local_window_size``,
  ``smooth_softmax``, ``causal`` (0 or 1);
* ``seqlens_k`` padding: batch entry b holds T_b = seqlens_k[b] + 1 valid
  tokens, right-aligned padding after them.  Query row i of entry b sees key
  j when j <= i (causal), j > i - local_window_size (window) and j < T_b.
  Rows i >= T_b are padding: onnxruntime leaves them unspecified; the rewrite
  lets them attend to the valid keys before them, as a padded PyTorch batch
  does, so their gradient is finite and is that of PyTorch.

* ``attention_bias`` (added after the softcap) and ``head_sink`` (a per-head
  logit in the softmax's sum), both differentiated.

Refused with a clear error: position_ids, q/k norm weights, query_seqlens,
a quantized KV cache, the qk output.
"""

from __future__ import annotations

import numpy as np

from ...emitter import Emitter, np_dtype
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


# ------------------------------------------------------- GroupQueryAttention
_GQA_REFUSED = {14: "q_norm_weight", 15: "k_norm_weight", 16: "query_seqlens", 12: "k_scale", 13: "v_scale",
                9: "position_ids"}


def gqa_forward(e: Emitter, attrs: dict, q: str, k: str | None, v: str | None, seqlens_k: str,
                cos: str | None, sin: str | None, et: int, attn_bias: str | None = None,
                head_sink: str | None = None) -> tuple[str, str, str]:
    """GroupQueryAttention's prompt call in standard ops: (output [B, S, N H],
    keys [B, Nkv, S, H] after rotary, values [B, Nkv, S, H]).

    scores = scale * q_h k_{h/g}^T  (g = N / Nkv, heads grouped)
    softcap c > 0: scores = c tanh(scores / c)
    scores += attention_bias (after the softcap, as onnxruntime adds it)
    visible(b, i, j) = j < seqlens_k[b] + 1, and j <= i if causal, and
                       j > i - local_window_size if that is > 0 (W keys, itself included)
    p = softmax over the visible j (head_sink: with an extra logit sink[h] in the
        sum; smooth_softmax: the same with sink 0),
        0 for a (padding) row without any visible key
    out = p v_{h/g}, heads concatenated."""
    n, nkv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    if k is None:  # packed [B, S, (N + 2 Nkv) H]
        qkv = e.Reshape(q, e.ints([0, 0, n + 2 * nkv, -1]))
        q4, k4, v4 = e.split(qkv, [n, nkv, nkv], axis=2)
    else:
        q4 = e.Reshape(q, e.ints([0, 0, n, -1]))
        k4 = e.Reshape(k, e.ints([0, 0, nkv, -1]))
        v4 = e.Reshape(v, e.ints([0, 0, nkv, -1]))
    seq = e.shape_of(q4, 1, 2)
    if attrs.get("do_rotary"):
        inter = bool(attrs.get("rotary_interleaved", 0))
        c = e.unsqueeze(e.Slice(cos, e.ints([0]), seq, e.ints([0])), [1])  # [S, 1, half]
        s = e.unsqueeze(e.Slice(sin, e.ints([0]), seq, e.ints([0])), [1])
        q4, k4 = rotate(e, q4, c, s, inter), rotate(e, k4, c, s, inter)
    q4 = e.Transpose(q4, perm=[0, 2, 1, 3])  # [B, N, S, H]
    k4 = e.Transpose(k4, perm=[0, 2, 1, 3])  # [B, Nkv, S, H]
    v4 = e.Transpose(v4, perm=[0, 2, 1, 3])
    kk, vv = k4, v4
    if n != nkv:  # repeat each kv head g times: [B, Nkv, g, S, H] -> [B, N, S, H]
        full = e.Shape(q4)
        grouped = e.Concat(e.shape_of(k4, 0, 2), e.ints([n // nkv]), e.shape_of(k4, 2), axis=0)
        kk = e.Reshape(e.Expand(e.unsqueeze(k4, [2]), grouped), full)
        vv = e.Reshape(e.Expand(e.unsqueeze(v4, [2]), grouped), full)
    scale = float(attrs.get("scale", 0.0) or 0.0)
    if scale:
        alpha = e.const(scale, dtype=et)
    else:
        alpha = e.Reciprocal(e.Sqrt(e.Cast(e.shape_of(q4, 3, 4), to=et)))
    scores = e.Mul(e.MatMul(q4, e.Transpose(kk, perm=[0, 1, 3, 2])), alpha)
    cap = float(attrs.get("softcap", 0.0) or 0.0)
    if cap > 0:
        c = e.const(cap, dtype=et)
        scores = e.Mul(e.Tanh(e.Div(scores, c)), c)
    if attn_bias is not None:
        scores = e.Add(scores, attn_bias)
    pos = e.arange(seq)
    row, col = e.unsqueeze(pos, [1]), e.unsqueeze(pos, [0])  # [S, 1], [1, S]
    total = e.unsqueeze(e.Add(e.cast_to(seqlens_k, 7), e.ints([1])), [1, 2, 3])  # [B, 1, 1, 1]
    visible = e.Less(col, total)
    if int(attrs.get("causal", 1)):
        visible = e.And(visible, e.LessOrEqual(col, row))
    window = int(attrs.get("local_window_size", -1))
    if window > 0:
        visible = e.And(visible, e.Greater(col, e.Sub(row, e.ints([window]))))
    lowest = e.const(np.finfo(np_dtype(et)).min, dtype=et)
    scores = e.Where(visible, scores, lowest)
    if head_sink is not None or int(attrs.get("smooth_softmax", 0)):
        column = e.Concat(e.shape_of(scores, 0, 3), e.ints([1]), axis=0)
        if head_sink is None:
            sink = e.const(np.zeros((1, 1, 1, 1)), dtype=et)
        else:
            sink = e.reshape(head_sink, [1, -1, 1, 1])
        p = e.Softmax(e.Concat(scores, e.Expand(sink, column), axis=-1), axis=-1)
        p = e.Slice(p, e.ints([0]), seq, e.ints([-1]))
    else:
        p = e.Softmax(scores, axis=-1)
    # Exact zeros where masked already; a (padding) row with no visible key gets 0.
    p = e.Mul(p, e.Cast(visible, to=et))
    out = e.Transpose(e.MatMul(p, vv), perm=[0, 2, 1, 3])
    return e.Reshape(out, e.ints([0, 0, -1])), k4, v4


@vjp("GroupQueryAttention", domain=MS)
def group_query_attention_vjp(ctx, dy, d_present_k=None, d_present_v=None, *d_rest):
    """out = GQA(q, k, v) in prompt mode (see the module docstring and ``gqa_forward``)
    ->  d(q, k, v) = the vector-Jacobian product of ``gqa_forward``, built by
        differentiating its standard-op graph (recomputed in the backward pass);
        past/present, seqlens_k and total_sequence_length get none"""
    name = ctx.node.name
    if any(d is not None for d in (d_present_k, d_present_v, *d_rest)):
        raise GradientError(
            f"GroupQueryAttention node {name!r}: a gradient flows into its present key/value or qk "
            "outputs; only the attention output is differentiated"
        )
    for i, what in _GQA_REFUSED.items():
        if ctx.input(i) is not None:
            raise GradientError(f"gradient of GroupQueryAttention node {name!r}: input {what} is not supported")
    for i in (3, 4):
        shape = ctx.shape(ctx.inputs[i]) if ctx.input(i) else None
        if ctx.attr("sliding_window_cache", 0):
            break  # a windowed cache has a capacity even before the prompt; P = 0 all the same
        if shape is not None and len(shape) == 4 and isinstance(shape[2], int) and shape[2] > 0:
            raise GradientError(
                f"gradient of GroupQueryAttention node {name!r}: only the prompt call (empty past "
                f"key/value) is differentiated; {ctx.inputs[i]!r} has {shape[2]} past positions"
            )
    attrs = {a: ctx.attr(a) for a in ("num_heads", "kv_num_heads", "scale", "softcap", "local_window_size",
                                      "do_rotary", "rotary_interleaved", "smooth_softmax", "causal")}
    attrs = {a: v for a, v in attrs.items() if v is not None}
    if any(ctx.attr(a) for a in ("k_quant_type", "v_quant_type")) and ctx.attr("k_quant_type", "NONE") != "NONE":
        raise GradientError(f"gradient of GroupQueryAttention node {name!r}: quantized KV cache")
    e = ctx.emit
    q, k, v = ctx.inputs[0], ctx.input(1), ctx.input(2)
    seqlens, cos, sin = ctx.inputs[5], ctx.input(7), ctx.input(8)
    attn_bias, head_sink = ctx.input(10), ctx.input(11)
    et = ctx.dtype(q)
    sub = Emitter(e.opset, e.names, dtypes=dict(e.dtypes), hint=f"{name or 'gqa'}/fwd")
    out, _, _ = gqa_forward(sub, attrs, q, k, v, seqlens, cos, sin, et, attn_bias, head_sink)
    wrt = [i for i in (0, 1, 2, 7, 8, 10, 11) if ctx.input(i) is not None and ctx.needs(i)]
    if not wrt:
        return (None,) * len(ctx.inputs)
    names = [ctx.inputs[i] for i in wrt]
    types = {x: (ctx.dtype(x), ctx.shape(x)) for x in [q, k, v, seqlens, cos, sin, attn_bias, head_sink] if x}
    types[dy] = (ctx.dtype(dy), ctx.shape(ctx.outputs[0]))
    nodes, grads = ctx.vjp_of_graph(sub.nodes, [out], [dy], names, types)
    e.nodes.extend(nodes)
    result: list[str | None] = [None] * len(ctx.inputs)
    for i, x, g in zip(wrt, names, grads):
        e.dtypes[g] = ctx.dtype(x)
        result[i] = g
    return tuple(result)


# -------------------------------------------------------- MultiHeadAttention
_MHA_REFUSED = {6: "past_key", 7: "past_value", 8: "past_sequence_length", 9: "cache_indirection"}


def mha_forward(e: Emitter, attrs: dict, q: str, k: str, v: str, bias: str | None, mask: str | None,
                attn_bias: str | None, et: int) -> str:
    """MultiHeadAttention (3-D query/key/value) in standard ops:

    Q, K, V = query + bq, key + bk, value + bv (bias split [D, D, Dv]), N heads
    scores = scale Q_h K_h^T + attention_bias
             + filter where key_padding_mask[b, j] == 0 (mask [B, L])
             + filter where j > i if unidirectional      (filter = mask_filter_value;
               unidirectional is self-attention: key length = query length)
    out = softmax(scores) V_h, heads concatenated.  The masks are additive, as
    onnxruntime applies them: a row whose keys are all masked gets the softmax
    of its unmasked scores."""
    n = int(attrs["num_heads"])
    if bias is not None:
        dq, dv = e.shape_of(q, 2, 3), e.shape_of(v, 2, 3)
        bq, bk, bv = e.op("Split", [bias, e.Concat(dq, dq, dv, axis=0)], outputs=3, axis=0)
        q, k, v = e.Add(q, bq), e.Add(k, bk), e.Add(v, bv)
    q4, k4, v4 = (e.Transpose(e.Reshape(t, e.ints([0, 0, n, -1])), perm=[0, 2, 1, 3]) for t in (q, k, v))
    scale = float(attrs.get("scale", 0.0) or 0.0)
    alpha = e.const(scale, dtype=et) if scale else e.Reciprocal(e.Sqrt(e.Cast(e.shape_of(q4, 3, 4), to=et)))
    scores = e.Mul(e.MatMul(q4, e.Transpose(k4, perm=[0, 1, 3, 2])), alpha)
    if attn_bias is not None:
        scores = e.Add(scores, attn_bias)
    fill = e.const(float(attrs.get("mask_filter_value", -10000.0)), dtype=et)
    zero = e.const(0.0, dtype=et)
    if mask is not None:  # [B, L], 0 = padding
        keep = e.Greater(e.unsqueeze(mask, [1, 2]), e.const(0, dtype=e.dtype(mask)))
        scores = e.Add(scores, e.Where(keep, zero, fill))
    if int(attrs.get("unidirectional", 0)):
        rows, cols = e.arange(e.shape_of(q4, 2, 3)), e.arange(e.shape_of(k4, 2, 3))
        later = e.Greater(e.unsqueeze(cols, [0]), e.unsqueeze(rows, [1]))
        scores = e.Add(scores, e.Where(later, fill, zero))
    p = e.Softmax(scores, axis=-1)
    out = e.Transpose(e.MatMul(p, v4), perm=[0, 2, 1, 3])
    return e.Reshape(out, e.ints([0, 0, -1]))


@vjp("MultiHeadAttention", domain=MS)
def multi_head_attention_vjp(ctx, dy, *d_rest):
    """out = MHA(query, key, value) with 3-D separate inputs (see ``mha_forward``)
    ->  the vector-Jacobian product of ``mha_forward``'s standard-op graph,
        recomputed in the backward pass; gradients to query, key, value, bias
        and attention_bias.  Refused: packed QKV/KV, past state, 1-D or 3-D
        key_padding_mask, gradients into present/qk outputs."""
    name = ctx.node.name
    if any(d is not None for d in d_rest):
        raise GradientError(f"MultiHeadAttention node {name!r}: only the attention output is differentiated")
    for i, what in _MHA_REFUSED.items():
        if ctx.input(i) is not None:
            raise GradientError(f"gradient of MultiHeadAttention node {name!r}: input {what} is not supported")
    q, k, v = ctx.inputs[0], ctx.input(1), ctx.input(2)
    if k is None or v is None or ctx.rank(q) != 3 or ctx.rank(k) != 3 or ctx.rank(v) != 3:
        raise GradientError(
            f"gradient of MultiHeadAttention node {name!r}: only separate 3-D query, key and value are supported"
        )
    mask = ctx.input(4)
    if mask is not None and ctx.rank(mask) != 2:
        raise GradientError(f"gradient of MultiHeadAttention node {name!r}: key_padding_mask must be [B, L]")
    e = ctx.emit
    attrs = {a: ctx.attr(a) for a in ("num_heads", "scale", "mask_filter_value", "unidirectional")}
    attrs = {a: v for a, v in attrs.items() if v is not None}
    sub = Emitter(e.opset, e.names, dtypes=dict(e.dtypes), hint=f"{name or 'mha'}/fwd")
    bias, attn_bias = ctx.input(3), ctx.input(5)
    out = mha_forward(sub, attrs, q, k, v, bias, mask, attn_bias, ctx.dtype(q))
    wrt = [i for i in (0, 1, 2, 3, 5) if ctx.input(i) is not None and ctx.needs(i)]
    result: list[str | None] = [None] * len(ctx.inputs)
    if not wrt:
        return tuple(result)
    names = [ctx.inputs[i] for i in wrt]
    types = {x: (ctx.dtype(x), ctx.shape(x)) for x in (q, k, v, bias, mask, attn_bias) if x}
    types[dy] = (ctx.dtype(dy), ctx.shape(ctx.outputs[0]))
    nodes, grads = ctx.vjp_of_graph(sub.nodes, [out], [dy], names, types)
    e.nodes.extend(nodes)
    for i, x, g in zip(wrt, names, grads):
        e.dtypes[g] = ctx.dtype(x)
        result[i] = g
    return tuple(result)
