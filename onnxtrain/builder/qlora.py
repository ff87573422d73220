"""QLoRA: low-rank adapters on quantized weights (see ``lora``).

Two quantized layouts are LoRA targets, each named by its codes initializer:

    com.microsoft MatMulNBits(X, B, scales[, zero_points])   target: B
        Y = X·W,  W[k, n] = (q[n, k] - zp[n, k // bs]) · scale[n, k // bs]
        q: ``bits``-bit codes packed low bits first into B [N, blocks, bs·bits/8]
    DequantizeLinear(x, scale[, zp]) -> W -> MatMul/Gemm    target: x
        W = (x - zp) · scale  (per tensor, per axis or blocked)

The codes (and scales and zero points) stay initializers no binding names:
frozen, and never turned into a float copy by the builder.  The adapters
``B.lora_A`` [in, r] and ``B.lora_B`` [r, out] have the activation dtype
(the scales' type) and the adapter branch is the one of ``lora``:
``Y = MatMulNBits(X, …) + s·(X·A)·B``.  onnxruntime runs MatMulNBits itself
(with the node's ``accuracy_level``: level 4 rounds X to int8 per block),
so ``sess.run`` is what onnxruntime computes; its gradient rule sees that
rounding as the identity (straight-through).

``export`` keeps a quantized target's side branch (exact: codes, scales and
zero points bit for bit, every original node kept); ``requantize`` is the
explicit alternative that merges ``W + s·A·B`` and quantizes it again, with
a report of the error this adds (``requantized``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..core.emitter import FLOAT_TYPES
from ..core.graph import DEFAULT_DOMAINS, identity_source, node_inputs
from ..io import mapped

#: Integer element types DequantizeLinear codes may have.
CODE_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4,
                        TensorProto.INT16, TensorProto.UINT16})
NBITS = ("com.microsoft", "MatMulNBits")


@dataclass
class Quantized:
    """One quantized target: ``kind`` "MatMulNBits" or "DequantizeLinear",
    the node reading the codes (``node``, a position), the features
    (``n_in``, ``n_out``), the activation dtype (``elem_type``), and the
    MatMul/Gemm uses (``uses``: ``lora.Use``-like tuples, filled by the
    caller) plus the DequantizeLinear output they read (``value``)."""

    kind: str
    node: int
    n_in: int
    n_out: int
    elem_type: int
    transposed: bool = False
    value: str = ""
    uses: list = field(default_factory=list)


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _kind(n: onnx.NodeProto) -> str:
    return n.op_type if n.domain in DEFAULT_DOMAINS else f"{n.domain}.{n.op_type}"


def quantized_targets(graph: onnx.GraphProto, make_use) -> tuple[dict[str, Quantized], dict[str, str]]:
    """(codes name -> Quantized, codes name -> why not) of ``graph``.

    ``make_use(position, operand, transposed)`` builds one use record.  A
    MatMulNBits node's B is eligible when it is an initializer read by that
    node only; a DequantizeLinear's x when it is a 2-D integer initializer
    read by that node only, with initializer scale (and zero point), and
    the output read only as a MatMul/Gemm weight against an activation in
    one orientation (not a graph output)."""
    source = identity_source(graph)
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, list[int]] = {}
    for pos, n in enumerate(graph.node):
        for name in node_inputs(n):
            readers.setdefault(source(name), []).append(pos)
    outputs = {source(o.name) for o in graph.output} | {i.name for i in graph.input}
    found: dict[str, Quantized] = {}
    why: dict[str, str] = {}
    for pos, n in enumerate(graph.node):
        kind = _kind(n)
        if (n.domain, n.op_type) == NBITS:
            codes = n.input[1] if len(n.input) > 1 else ""
            if codes not in inits:
                continue
            scales = inits.get(n.input[2]) if len(n.input) > 2 else None
            if len(set(readers.get(codes, []))) != 1 or codes in outputs:
                why[codes] = "its codes are read by more than one node"
            elif len(n.input) > 4 and n.input[4]:
                why[codes] = "MatMulNBits with g_idx (act-order) is not supported"
            elif scales is None:
                why[codes] = "its scales are not an initializer"
            else:
                found[codes] = Quantized("MatMulNBits", pos, int(_attr(n, "K", 0)),
                                         int(_attr(n, "N", 0)), scales.data_type,
                                         uses=[make_use(pos, 1, False)])
        elif kind == "DequantizeLinear":
            codes = n.input[0]
            t = inits.get(codes)
            if t is None or t.data_type not in CODE_TYPES or len(t.dims) != 2:
                continue
            extra = [i for i in n.input[1:] if i]
            if any(source(i) not in inits for i in extra):
                why[codes] = "its scale or zero point is not an initializer"
                continue
            if len(set(readers.get(codes, []))) != 1 or codes in outputs:
                why[codes] = "its codes are read by more than one node"
                continue
            value = n.output[0]
            uses, bad = _weight_uses(graph, value, sorted(set(readers.get(value, []))), source, inits,
                                     make_use)
            scale = inits[source(n.input[1])]
            if bad is None and (not uses or source(value) in outputs):
                bad = "its dequantized value is not (only) a MatMul/Gemm weight"
            if bad is None and len({u.transposed for u in uses}) > 1:
                bad = "its MatMul/Gemm uses read it in both orientations"
            if bad is None and scale.data_type not in FLOAT_TYPES:
                bad = "its scale is not floating point"
            if bad is not None:
                why[codes] = bad
                continue
            d0, d1 = int(t.dims[0]), int(t.dims[1])
            tr = uses[0].transposed
            found[codes] = Quantized("DequantizeLinear", pos, d1 if tr else d0, d0 if tr else d1,
                                     scale.data_type, tr, value, uses)
    return found, why


def _weight_uses(graph: onnx.GraphProto, value: str, positions: list[int], source: Callable[[str], str],
                 inits: dict[str, onnx.TensorProto], make_use) -> tuple[list, str | None]:
    """The use records of the dequantized ``value`` read by the nodes at ``positions``, or why
    one is not a MatMul/Gemm weight against an activation (then the records so far)."""
    uses, bad = [], None
    for upos in positions:
        u = graph.node[upos]
        ukind = _kind(u)
        if ukind == "Identity":
            continue
        explicit = list(u.input)
        idx = next(i for i, name in enumerate(explicit) if source(name) == value)
        if ukind not in ("MatMul", "Gemm") or idx > 1:
            bad = f"its dequantized value is read by {ukind} node {u.name or ukind!r}"
            break
        if source(explicit[1 - idx]) in inits:
            bad = f"{ukind} node {u.name or ukind!r} multiplies it with an initializer"
            break
        if ukind == "MatMul":
            transposed = idx == 0
        else:
            transposed = (idx == 0) != bool(_attr(u, "transA" if idx == 0 else "transB", 0))
        uses.append(make_use(upos, idx, transposed))
    return uses, bad


# ------------------------------------------------------------------ (de)quantization
def _nbits_params(node: onnx.NodeProto) -> tuple[int, int, int, int]:
    return (int(_attr(node, "K", 0)), int(_attr(node, "N", 0)), int(_attr(node, "bits", 4)),
            int(_attr(node, "block_size", 0)))


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first ``count`` ``bits``-bit codes of each row of ``packed``
    (uint8, low bits first), as uint8 [rows, count]."""
    per = 8 // bits
    rows = packed.reshape(packed.shape[0], -1)
    mask = (1 << bits) - 1
    out = np.stack([(rows >> (bits * j)) & mask for j in range(per)], axis=-1)
    return out.reshape(rows.shape[0], -1)[:, :count].astype(np.uint8)


def pack_codes(codes: np.ndarray, bits: int, row_bytes: int) -> np.ndarray:
    """Inverse of ``unpack_codes``: uint8 [rows, row_bytes]."""
    per = 8 // bits
    rows = codes.shape[0]
    padded = np.zeros((rows, row_bytes * per), np.uint8)
    padded[:, :codes.shape[1]] = codes
    padded = padded.reshape(rows, row_bytes, per).astype(np.uint32)
    out = np.zeros((rows, row_bytes), np.uint32)
    for j in range(per):
        out |= padded[:, :, j] << (bits * j)
    return out.astype(np.uint8)


def nbits_weight(node: onnx.NodeProto, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """The float64 weight W [K, N] a MatMulNBits node multiplies by (its
    dequantized codes), from ``arrays`` holding its B, scales and zero points."""
    k, n, bits, bs = _nbits_params(node)
    blocks = (k + bs - 1) // bs
    q = unpack_codes(np.asarray(arrays[node.input[1]]).reshape(n, -1), bits, blocks * bs)
    q = q.reshape(n, blocks, bs).astype(np.float64)
    scales = np.asarray(arrays[node.input[2]], np.float64).reshape(n, blocks)
    zname = node.input[3] if len(node.input) > 3 else ""
    if not zname:
        zp = np.full((n, blocks), float(1 << (bits - 1)))
    else:
        z = np.asarray(arrays[zname])
        if z.dtype == np.uint8:
            zp = unpack_codes(z.reshape(n, -1), bits, blocks).astype(np.float64)
        else:
            zp = z.astype(np.float64).reshape(n, blocks)
    w = (q - zp[:, :, None]) * scales[:, :, None]
    return w.reshape(n, blocks * bs)[:, :k].T


def quantize_nbits(node: onnx.NodeProto, w: np.ndarray, zp_like: np.ndarray | None,
                   scale_dtype: np.dtype) -> dict[int, np.ndarray]:
    """Codes, scales (and zero points) of ``w`` [K, N] in ``node``'s format,
    block by block, keyed by input index: symmetric (no zero points: codes
    around 2**(bits-1), scale = max|w| / (2**(bits-1) - 1)) or asymmetric
    (zero points as ``zp_like``: the block's min..max over 0..2**bits-1)."""
    k, n, bits, bs = _nbits_params(node)
    blocks = (k + bs - 1) // bs
    top = (1 << bits) - 1
    wb = np.zeros((n, blocks * bs))
    wb[:, :k] = np.asarray(w, np.float64).T
    wb = wb.reshape(n, blocks, bs)
    if zp_like is None:
        half = 1 << (bits - 1)
        scale = np.abs(wb).max(axis=2) / (half - 1)
        scale = scale.astype(scale_dtype).astype(np.float64)
        safe = np.where(scale == 0, 1.0, scale)
        q = np.clip(np.rint(wb / safe[:, :, None]) + half, 0, top)
        zp = None
    else:
        lo, hi = np.minimum(wb.min(axis=2), 0.0), np.maximum(wb.max(axis=2), 0.0)
        scale = ((hi - lo) / top).astype(scale_dtype).astype(np.float64)
        safe = np.where(scale == 0, 1.0, scale)
        zpf = np.clip(np.rint(-lo / safe), 0, top)
        q = np.clip(np.rint(wb / safe[:, :, None]) + zpf[:, :, None], 0, top)
        if zp_like.dtype == np.uint8:
            zp = pack_codes(zpf.astype(np.uint8), bits, zp_like.size // n).reshape(zp_like.shape)
        else:
            zp = zpf.astype(zp_like.dtype).reshape(zp_like.shape)
    row_bytes = bs * bits // 8
    codes = pack_codes(q.reshape(n * blocks, bs).astype(np.uint8), bits, row_bytes)
    out = {1: codes.reshape(n, blocks, row_bytes), 2: scale.astype(scale_dtype)}
    if zp is not None:
        out[3] = zp
    return out


def _dq_broadcast(node: onnx.NodeProto, shape: tuple[int, ...], a: np.ndarray) -> np.ndarray:
    """A DequantizeLinear scale or zero point ``a`` broadcast to ``shape``."""
    if a.ndim == 0 or a.size == 1:
        return np.broadcast_to(a.reshape(()), shape)
    axis = int(_attr(node, "axis", 1)) % len(shape)
    block = int(_attr(node, "block_size", 0))
    if block:
        return np.repeat(a, block, axis=axis)[tuple(slice(0, s) for s in shape)]
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return a.reshape(view)


def dq_weight(node: onnx.NodeProto, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """The float64 value of a DequantizeLinear node on initializer inputs."""
    x = np.asarray(arrays[node.input[0]]).astype(np.float64)
    scale = _dq_broadcast(node, x.shape, np.asarray(arrays[node.input[1]], np.float64))
    zname = node.input[2] if len(node.input) > 2 else ""
    zp = _dq_broadcast(node, x.shape, np.asarray(arrays[zname]).astype(np.float64)) if zname else 0.0
    return (x - zp) * scale


def quantize_dq(node: onnx.NodeProto, w: np.ndarray, x: np.ndarray, scale: np.ndarray,
                zp: np.ndarray | None) -> dict[int, np.ndarray]:
    """New codes (and scale) for a DequantizeLinear node's weight ``w``,
    same granularity and types: the scale spans the block's range."""
    ranges = {"int4": (-8, 7), "uint4": (0, 15)}  # ml_dtypes' 4-bit types (onnx's arrays)
    if x.dtype.kind in "iu":
        lo_q, hi_q = int(np.iinfo(x.dtype).min), int(np.iinfo(x.dtype).max)
    elif x.dtype.name in ranges:
        lo_q, hi_q = ranges[x.dtype.name]
    else:
        raise ValueError(f"requantize: codes of type {x.dtype} are not supported")
    w = np.asarray(w, np.float64)

    def reduce(fn, arr):
        if scale.size == 1:
            return fn(arr).reshape(scale.shape)
        axis = int(_attr(node, "axis", 1)) % arr.ndim
        block = int(_attr(node, "block_size", 0))
        other = 1 - axis
        if block:
            pad = (-arr.shape[axis]) % block
            widths = [(0, 0), (0, 0)]
            widths[axis] = (0, pad)
            padded = np.pad(arr, widths)
            moved = np.moveaxis(padded, axis, 0).reshape(-1, block, arr.shape[other])
            return np.moveaxis(fn(moved, axis=1), 0, axis).reshape(scale.shape)
        return fn(arr, axis=other).reshape(scale.shape)

    if zp is None or not np.any(zp) and lo_q < 0:
        new_scale = reduce(np.max, np.abs(w)) / max(hi_q, 1)
        new_zp = None if zp is None else np.zeros_like(zp)
    else:
        lo, hi = np.minimum(reduce(np.min, w), 0.0), np.maximum(reduce(np.max, w), 0.0)
        new_scale = (hi - lo) / (hi_q - lo_q)
        new_zp = np.clip(np.rint(lo_q - lo / np.where(new_scale == 0, 1, new_scale)), lo_q, hi_q)
    new_scale = new_scale.astype(scale.dtype)
    s = _dq_broadcast(node, w.shape, new_scale.astype(np.float64))
    z = 0.0 if new_zp is None else _dq_broadcast(node, w.shape, new_zp.astype(np.float64))
    q = np.clip(np.rint(w / np.where(s == 0, 1, s)) + z, lo_q, hi_q).astype(x.dtype)
    out = {0: q, 1: new_scale}
    if new_zp is not None:
        out[2] = new_zp.astype(zp.dtype)
    return out


# ------------------------------------------------------------------ requantization
def base_weight(graph: onnx.GraphProto, entry: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                ) -> np.ndarray:
    """The float64 base weight of a quantized target entry, as [in, out]."""
    node = _codes_reader(graph, entry["weight"])
    if (node.domain, node.op_type) == NBITS:
        return nbits_weight(node, arrays)
    w = dq_weight(node, arrays)
    return w.T if entry["transposed"] else w


def _codes_reader(graph: onnx.GraphProto, codes: str) -> onnx.NodeProto:
    for n in graph.node:
        if ((n.domain, n.op_type) == NBITS and len(n.input) > 1 and n.input[1] == codes) or (
                _kind(n) == "DequantizeLinear" and n.input[0] == codes):
            return n
    raise ValueError(f"no MatMulNBits or DequantizeLinear node reads {codes!r}")


def requantize_entry(graph: onnx.GraphProto, entry: Mapping[str, Any], a: np.ndarray, b: np.ndarray,
                     ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """(new initializer values, error report) of one quantized target whose
    merged weight ``W + s·A·B`` is quantized again in its node's format.

    The report: ``update_norm`` ||s·A·B||, ``update_error`` the norm of what
    requantizing changed against that merged weight relative to
    ||s·A·B||, and ``max_abs_error`` its largest entry."""
    inits = {t.name: t for t in graph.initializer}
    node = _codes_reader(graph, entry["weight"])
    arrays = {name: mapped.to_array(inits[name]) for name in node.input if name in inits}
    w = base_weight(graph, entry, arrays)
    delta = float(entry["scale"]) * (a.astype(np.float64) @ b.astype(np.float64))
    merged = w + delta
    if (node.domain, node.op_type) == NBITS:
        z = node.input[3] if len(node.input) > 3 and node.input[3] else None
        new = quantize_nbits(node, merged, arrays[z] if z else None, arrays[node.input[2]].dtype)
        values = {node.input[i]: v.reshape(arrays[node.input[i]].shape) for i, v in new.items()}
        after = nbits_weight(node, {**arrays, **values})
    else:
        stored = merged.T if entry["transposed"] else merged
        z = node.input[2] if len(node.input) > 2 and node.input[2] else None
        new = quantize_dq(node, stored, arrays[node.input[0]], arrays[node.input[1]],
                          arrays[z] if z else None)
        values = {node.input[i]: v for i, v in new.items()}
        after = dq_weight(node, {**arrays, **values})
        after = after.T if entry["transposed"] else after
    err = after - merged
    norm = float(np.linalg.norm(delta))
    report = {"update_norm": norm,
              "update_error": float(np.linalg.norm(err)) / norm if norm else 0.0,
              "max_abs_error": float(np.abs(err).max()) if err.size else 0.0}
    return values, report
