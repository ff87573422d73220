"""Gradient rules: onnxruntime's attention ops as onnxruntime-genai writes them:
com.microsoft GroupQueryAttention (prompt mode) and com.microsoft
MultiHeadAttention (separate 3-D query/key/value, see ``mha_forward``).  The
rotary embeddings they use are in ``contrib_rotary``.

The gradient is written in standard ops:

* **Directly**, for GroupQueryAttention without ``attention_bias``,
  ``head_sink``, ``smooth_softmax`` or gradients to the cos/sin caches: the
  probabilities are computed once, and the softmax's, the products' and the
  rotation's gradients are written out, heads grouped by reshaping (no
  repeated keys, no sums over groups).  Where it can (no cache window, no qk
  output), the rule replaces the forward node by that
  computation (``gqa_direct``, ``VJPContext.replace_forward``): the training
  step computes the attention once, in the library's kernels, and the
  backward reads its probabilities.  Otherwise (``gqa_backward``) the forward
  node stays onnxruntime's fused kernel and the backward recomputes the
  probabilities, reading the rotated keys and the values from the node's
  present outputs where the past is empty.
* **By differentiating** a standard-op rewrite of the forward pass
  (``gqa_forward``, ``mha_forward``) through ``ctx.vjp_of_graph``, otherwise
  (recomputed in the backward; the forward node stays).
  The direct form is tested against this one and against float64.

Supported is the prompt (prefill) call a training step makes:

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

from dataclasses import dataclass

import numpy as np

from ...core.emitter import Emitter, np_dtype
from ...errors import GradientError
from ..registry import VJPContext, vjp
from .contrib_rotary import rotate

MS = "com.microsoft"


# ------------------------------------------------------- GroupQueryAttention
_GQA_REFUSED = {14: "q_norm_weight", 15: "k_norm_weight", 16: "query_seqlens", 12: "k_scale", 13: "v_scale",
                9: "position_ids"}


def _visible(e: Emitter, attrs: dict, seq: str, seqlens_k: str, rank: int) -> str:
    """Which key j query row i of entry b sees, [B, 1, .., S, S] of ``rank`` dims:
    j < seqlens_k[b] + 1, j <= i if causal, j > i - local_window_size if > 0."""
    pos = e.arange(seq)
    row, col = e.unsqueeze(pos, [1]), e.unsqueeze(pos, [0])  # [S, 1], [1, S]
    total = e.unsqueeze(e.Add(e.cast_to(seqlens_k, 7), e.ints([1])), list(range(1, rank)))  # [B, 1, ..]
    visible = e.Less(col, total)
    if int(attrs.get("causal", 1)):
        visible = e.And(visible, e.LessOrEqual(col, row))
    window = int(attrs.get("local_window_size", -1))
    if window > 0:
        visible = e.And(visible, e.Greater(col, e.Sub(row, e.ints([window]))))
    return visible


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
    visible = _visible(e, attrs, seq, seqlens_k, 4)  # [B, 1, S, S]
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


# --------------------------------------------- GroupQueryAttention, directly
#: Whether GroupQueryAttention's gradient takes the direct form where it
#: applies (tests set it False to compare with the differentiated rewrite).
DIRECT = True
#: Whether the direct form also replaces the forward node where it can
#: (``gqa_direct``; tests set it False to check the recomputing form).
REPLACE = True


def _direct_applies(ctx: VJPContext, attrs: dict) -> bool:
    """The direct form covers all but the bias, the sink and the caches' gradients."""
    if ctx.input(10) is not None or ctx.input(11) is not None or int(attrs.get("smooth_softmax", 0)):
        return False
    return not any(ctx.input(i) is not None and ctx.needs(i) for i in (7, 8))


def _heads(e: Emitter, t: str, heads: int) -> str:
    """[B, S, heads H] -> [B, S, heads, H]."""
    return e.Reshape(t, e.ints([0, 0, heads, -1]))


@dataclass
class _Direct:
    """What the direct form computes of the forward pass and its backward reads:
    the query heads grouped under their key head and scaled, Qg [B, Nkv, g S, H];
    the rotated keys and the values, K, V [B, Nkv, S, H]; the probabilities
    P [B, Nkv, g S, S]; tanh of the scaled scores under a softcap; the
    rotation's cos and sin [S, 1, half] (None without rotary)."""

    qg: str
    kt: str
    vt: str
    p: str
    alpha: str
    t: str | None
    c: str | None
    s: str | None


def _mask(e: Emitter, attrs: dict, seq: str, seqlens_k: str, et: int, total: str | None) -> tuple[str, str]:
    """(visible [B, 1, 1, S, S], the additive mask: 0 where visible, the lowest
    float elsewhere), emitted once for the nodes that share ``seqlens_k`` and
    ``total`` (their total_sequence_length, S in the prompt call, which the
    mask then reads: not a layer's own query, which later layers depend on)
    and the attributes that shape it: a decoder's layers build one."""
    if total is None:
        return _visible_and_mask(e, attrs, seq, seqlens_k, et)
    key = ("gqa_mask", seqlens_k, total, int(attrs.get("causal", 1)), int(attrs.get("local_window_size", -1)), et)
    if key not in e.memo:
        e.memo[key] = _visible_and_mask(e, attrs, e.reshape(e.Cast(total, to=7), [1]), seqlens_k, et)
    return e.memo[key]


def _visible_and_mask(e: Emitter, attrs: dict, seq: str, seqlens_k: str, et: int) -> tuple[str, str]:
    """``_visible`` of rank 5 and the additive mask made from it."""
    visible = _visible(e, attrs, seq, seqlens_k, 5)
    lowest = e.const(np.finfo(np_dtype(et)).min, dtype=et)
    return visible, e.Where(visible, e.const(0.0, dtype=et), lowest)


def _direct_forward(e: Emitter, attrs: dict, q: str, k: str | None, v: str | None, seqlens_k: str,
                    cos: str | None, sin: str | None, et: int, present: tuple[str, str] | None,
                    past: tuple[str | None, str | None] = (None, None), total: str | None = None) -> _Direct:
    """The direct form's forward half (see ``gqa_backward``); K and V are read
    from ``present`` when given, else computed and appended to ``past`` (as
    onnxruntime's present outputs are: a past that is not empty then fails
    the step at the mask, [S, S], as the recomputing form does)."""
    n, nkv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    g = n // nkv
    if k is None:
        qkv = e.Reshape(q, e.ints([0, 0, n + 2 * nkv, -1]))
        q4, k4, v4 = e.split(qkv, [n, nkv, nkv], axis=2)
    else:
        q4, k4, v4 = _heads(e, q, n), _heads(e, k, nkv), _heads(e, v, nkv)
    seq = e.shape_of(q4, 1, 2)
    rotary = bool(attrs.get("do_rotary"))
    inter = bool(attrs.get("rotary_interleaved", 0))
    c = s = None
    if rotary:
        c = e.unsqueeze(e.Slice(cos, e.ints([0]), seq, e.ints([0])), [1])  # [S, 1, half]
        s = e.unsqueeze(e.Slice(sin, e.ints([0]), seq, e.ints([0])), [1])
        q4 = rotate(e, q4, c, s, inter)
    if present is not None:
        kt, vt = present  # [B, Nkv, S, H]: the rotated keys, the values
    else:
        kt = e.Transpose(rotate(e, k4, c, s, inter) if rotary else k4, perm=[0, 2, 1, 3])
        vt = e.Transpose(v4, perm=[0, 2, 1, 3])
        kt, vt = (e.Concat(before, now, axis=2) if before else now for before, now in zip(past, (kt, vt)))
    scale = float(attrs.get("scale", 0.0) or 0.0)
    alpha = e.const(scale, dtype=et) if scale else e.Reciprocal(e.Sqrt(e.Cast(e.shape_of(q4, 3, 4), to=et)))
    grouped = e.ints([0, nkv, -1, 0])  # [B, N, S, H] -> [B, Nkv, g S, H]
    qg = e.Mul(e.Reshape(e.Transpose(q4, perm=[0, 2, 1, 3]), grouped), alpha)
    scores = e.MatMul(qg, e.Transpose(kt, perm=[0, 1, 3, 2]))  # [B, Nkv, g S, S]
    cap = float(attrs.get("softcap", 0.0) or 0.0)
    t = None
    if cap > 0:
        cc = e.const(cap, dtype=et)
        t = e.Tanh(e.Div(scores, cc))
        scores = e.Mul(t, cc)
    five = e.Concat(e.ints([0, 0, g, -1]), e.shape_of(scores, 3, 4), axis=0)  # [B, Nkv, g, S, S]
    visible, masked = _mask(e, attrs, seq, seqlens_k, et, total)
    p = e.Softmax(e.Add(e.Reshape(scores, five), masked), axis=-1)
    if int(attrs.get("local_window_size", -1)) > 0:  # a padding row may see no key at all: its probabilities are 0
        p = e.Mul(p, e.Cast(visible, to=et))
    p = e.Reshape(p, e.Shape(scores))
    return _Direct(qg, kt, vt, p, alpha, t, c, s)


def _direct_output(e: Emitter, attrs: dict, f: _Direct) -> str:
    """The attention's output [B, S, N H] from the direct form's forward half: P V."""
    og = e.MatMul(f.p, f.vt)  # [B, Nkv, g S, H]
    heads = e.Reshape(og, e.ints([0, int(attrs["num_heads"]), -1, 0]))  # [B, N, S, H]
    return e.Reshape(e.Transpose(heads, perm=[0, 2, 1, 3]), e.ints([0, 0, -1]))


def _direct_grads(e: Emitter, attrs: dict, q: str, k: str | None, v: str | None, et: int, dy: str,
                  f: _Direct) -> tuple[str, str | None, str | None]:
    """The direct form's backward half (see ``gqa_backward``)."""
    n, nkv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    grouped = e.ints([0, nkv, -1, 0])
    do = e.Reshape(e.Transpose(_heads(e, dy, n), perm=[0, 2, 1, 3]), grouped)  # [B, Nkv, g S, H]
    dvt = e.MatMul(e.Transpose(f.p, perm=[0, 1, 3, 2]), do)  # [B, Nkv, S, H]
    dp = e.MatMul(do, e.Transpose(f.vt, perm=[0, 1, 3, 2]))
    ds = e.Mul(f.p, e.Sub(dp, e.reduce_sum(e.Mul(dp, f.p), [-1], keepdims=True)))
    if f.t is not None:
        ds = e.Mul(ds, e.Sub(e.const(1.0, dtype=et), e.Mul(f.t, f.t)))
    dqt = e.Reshape(e.Mul(e.MatMul(ds, f.kt), f.alpha), e.ints([0, n, -1, 0]))  # [B, N, S, H]
    dkt = e.MatMul(e.Transpose(ds, perm=[0, 1, 3, 2]), f.qg)
    dq4, dk4, dv4 = (e.Transpose(x, perm=[0, 2, 1, 3]) for x in (dqt, dkt, dvt))  # [B, S, heads, H]
    if f.c is not None:
        inter = bool(attrs.get("rotary_interleaved", 0))
        dq4, dk4 = rotate(e, dq4, f.c, e.Neg(f.s), inter), rotate(e, dk4, f.c, e.Neg(f.s), inter)
    if k is None:
        return e.Reshape(e.Concat(dq4, dk4, dv4, axis=2), e.Shape(q)), None, None
    return e.Reshape(dq4, e.Shape(q)), e.Reshape(dk4, e.Shape(k)), e.Reshape(dv4, e.Shape(v))


def gqa_backward(e: Emitter, attrs: dict, q: str, k: str | None, v: str | None, seqlens_k: str,
                 cos: str | None, sin: str | None, et: int, dy: str,
                 present: tuple[str, str] | None, total: str | None = None) -> tuple[str, str | None, str | None]:
    """(dq, dk, dv) of GroupQueryAttention's prompt call, in standard ops (for
    packed QKV, dq is the gradient of the packed input and dk, dv are None),
    recomputing the probabilities.

    With the g = N / Nkv query heads of one key head stacked, Qg [B, Nkv, g S, H]
    (scaled by alpha), K, V [B, Nkv, S, H] (K rotated; from ``present`` when given):
      scores = Qg K^T, c tanh(scores / c) with a softcap c; masked entries get the
      lowest float (added), so that P = softmax(scores) is exactly 0 there
      dV = P^T dOg;  dP = dOg V^T;  dS = P (dP - rowsum(dP P)), times 1 - tanh^2
      under a softcap;  dQg = alpha dS K;  dK = dS^T Qg
    and the rotation's gradient is the inverse rotation of dQ and dK."""
    f = _direct_forward(e, attrs, q, k, v, seqlens_k, cos, sin, et, present, total=total)
    return _direct_grads(e, attrs, q, k, v, et, dy, f)


def gqa_direct(e: Emitter, attrs: dict, q: str, k: str | None, v: str | None, seqlens_k: str,
               cos: str | None, sin: str | None, et: int, dy: str,
               past: tuple[str | None, str | None], total: str | None = None) -> tuple[list[str], tuple]:
    """``gqa_backward`` with its forward half computed once, for the forward
    pass too: (the node's outputs [output, present key, present value], the
    gradients).  The rule replaces the node by it (``replace_forward``): the
    probabilities the backward reads are the forward's, not recomputed, and
    onnxruntime's fused kernel no longer runs in the training step."""
    f = _direct_forward(e, attrs, q, k, v, seqlens_k, cos, sin, et, None, past, total)
    return [_direct_output(e, attrs, f), f.kt, f.vt], _direct_grads(e, attrs, q, k, v, et, dy, f)


def _replaceable(ctx: VJPContext) -> bool:
    """Whether the direct form can stand for the node's forward pass too: no
    cache window (its present is a window, not the keys) and no qk output.
    (A past of static length > 0 is refused before; one of open length is
    the prompt's, empty, as for the gradient.)"""
    return not ctx.attr("sliding_window_cache", 0) and not any(ctx.outputs[3:])


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
    if DIRECT and _direct_applies(ctx, attrs):
        if REPLACE and ctx.may_replace and _replaceable(ctx):
            outputs, grads = gqa_direct(e, attrs, q, k, v, seqlens, cos, sin, et, dy, (ctx.input(3), ctx.input(4)),
                                        total=ctx.input(6))
            ctx.replace_forward(outputs + [""] * (len(ctx.outputs) - len(outputs)))
        else:
            present = None
            if not ctx.attr("sliding_window_cache", 0) and len(ctx.outputs) > 2 and all(ctx.outputs[1:3]):
                present = (ctx.outputs[1], ctx.outputs[2])
            grads = gqa_backward(e, attrs, q, k, v, seqlens, cos, sin, et, dy, present, total=ctx.input(6))
        result = [None] * len(ctx.inputs)
        for i, g in zip((0, 1, 2), grads):
            if g is not None and ctx.input(i) is not None and ctx.needs(i):
                e.dtypes[g] = et
                result[i] = g
        return tuple(result)
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
