"""QLoRA's backward through int4 weights -> the kernel library.

The gradient of ``MatMulNBits`` (``autodiff/rules/contrib_quant.py``) needs
dA = dY W, W [N, K] = (q - zp) * scale the weight the node multiplies by.
Its rule writes W with standard ops, at every step: the codes' bytes shifted
and masked (BitShift, BitwiseAnd, Concat), a Cast, the zero points, the
scales, Reshapes and Slices: on L3 (docs/performance.md) about 0.6 s of
elementwise work and copies per step, more than all its products.

``DequantizeNBitsF32(B, scales, G, [zp], [zpf])`` reads the codes and writes
W in one pass, any block size, 2, 4 or 8 bits, zero points packed as B is,
in float, or absent (2^(bits-1)); G holds K, N, bits and block_size.  Its
operations are the rule's (code as a float, minus the zero point, times the
scale): W is the same bits, so dY W is too, and onnxruntime's MatMul still
does the product.  The rewrite matches the rule's chain from the MatMul
that reads W up to the MatMulNBits node's own B, scales and zero points.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from ..core.names import NameGen
from .graphmatch import Fusion, Index, constant, kernel_node, same_constant

#: Ops of the rule's code unpacking (``contrib_quant._codes``: the integer
#: form from opset 18, the float form before).
CODE_OPS = frozenset({"Reshape", "BitShift", "BitwiseAnd", "Concat", "Cast", "Div", "Floor", "Mod"})
MS = "com.microsoft"


def _slice_to(ix: Index, node: onnx.NodeProto | None, stop: int, axis: int = 1) -> str | None:
    """The input of Slice(x, [0], [stop], [axis]) (step 1), else None."""
    if node is None or len(node.input) < 4:
        return None
    steps = ix.ints(node.input[4]) if len(node.input) > 4 and node.input[4] else [1]
    if ix.ints(node.input[1]) != [0] or ix.ints(node.input[2]) != [stop] or ix.ints(node.input[3]) != [axis]:
        return None
    return node.input[0] if steps == [1] else None


def _reshaped(ix: Index, name: str | None, shape: list[int]) -> onnx.NodeProto | None:
    """The Reshape writing ``name`` to the constant ``shape``, else None."""
    node = ix.node(name, "Reshape")
    return node if node is not None and ix.ints(node.input[1]) == shape else None


def _codes(ix: Index, name: str, leaf: str) -> list[onnx.NodeProto] | None:
    """The nodes unpacking ``leaf``'s bytes into ``name`` (only ``CODE_OPS``,
    reading ``leaf`` and constants), else None."""
    nodes, stack, seen = [], [name], set()
    while stack:
        value = stack.pop()
        if value == leaf or value in seen or value in ix.values:
            continue
        seen.add(value)
        node = ix.producer.get(value)
        if node is None or node.op_type not in CODE_OPS or node.domain not in ("", "ai.onnx"):
            return None
        nodes.append(node)
        stack.extend(i for i in node.input if i)
    return nodes if any(leaf in n.input for n in nodes) else None


def _zero(ix: Index, name: str, m: dict) -> tuple[list[onnx.NodeProto], str | None, str | None] | None:
    """(nodes, packed zp, float zp) for the rule's zero point ``name``, else None."""
    n, blocks, bits, zp = m["n"], m["blocks"], m["bits"], m["zp"]
    if zp is None:
        return ([], None, None) if same_constant(ix.values, name, float(2 ** (bits - 1))) else None
    top = _reshaped(ix, name, [n, blocks, 1])
    if top is None:
        return None
    if ix.dtype(zp) == TensorProto.FLOAT:
        return ([top], None, zp) if top.input[0] == zp else None
    sl = ix.node(top.input[0], "Slice")
    codes = _slice_to(ix, sl, blocks)
    unpack = _codes(ix, codes, zp) if codes else None
    # (the rule unpacks the zero points as rows of codes: Reshape(zp, [N, -1]) first)
    if unpack is None or not any(node.op_type == "Reshape" and node.input[0] == zp
                                 and ix.ints(node.input[1]) == [n, -1] for node in unpack):
        return None
    return [top, sl, *unpack], zp, None


def _weight(ix: Index, w: str, nodes_by_b: dict[str, dict]) -> tuple[list[onnx.NodeProto], dict, list] | None:
    """(the rule's nodes writing W, its MatMulNBits, the zero point's inputs), else None."""
    top = ix.node(w, "Slice")
    for m in nodes_by_b.values():
        n, k, blocks, block = m["n"], m["k"], m["blocks"], m["block"]
        r5 = _reshaped(ix, _slice_to(ix, top, k), [n, blocks * block]) if top else None
        chain = [top] if r5 else []
        if r5 is None and blocks * block == k:
            r5 = _reshaped(ix, w, [n, k])
        mul = ix.node(r5.input[0], "Mul") if r5 else None
        for u, rs in ix.operands(mul, "Mul"):
            rs_node = _reshaped(ix, rs, [n, blocks, 1])
            sub = ix.node(u, "Sub")
            if rs_node is None or rs_node.input[0] != m["scales"] or sub is None:
                continue
            q = _reshaped(ix, sub.input[0], [n, blocks, block])
            sl = ix.node(q.input[0], "Slice") if q else None
            codes = _slice_to(ix, sl, blocks * block)
            unpack = _codes(ix, codes, m["b"]) if codes else None
            zero = _zero(ix, sub.input[1], m)
            if unpack is None or zero is None:
                continue
            return [*chain, r5, mul, rs_node, sub, q, sl, *unpack, *zero[0]], m, [zero[1], zero[2]]
    return None


def _nbits_nodes(ix: Index) -> dict[str, dict]:
    """B -> what the kernel needs of each float32 MatMulNBits node reading it."""
    found = {}
    for node in ix.nodes:
        if node.op_type != "MatMulNBits" or node.domain != MS or len(node.input) < 3:
            continue
        bits, block = int(ix.attr(node, "bits", 4)), int(ix.attr(node, "block_size", 0))
        k, n = int(ix.attr(node, "K", 0)), int(ix.attr(node, "N", 0))
        if bits not in (2, 4, 8) or block < 1 or (block * bits) % 8 or k < 1 or n < 1:
            continue
        if ix.dtype(node.input[2]) != TensorProto.FLOAT or ix.dtype(node.input[1]) != TensorProto.UINT8:
            continue
        zp = node.input[3] if len(node.input) > 3 and node.input[3] else None
        found[node.input[1]] = {"b": node.input[1], "scales": node.input[2], "zp": zp, "bits": bits, "block": block,
                                "k": k, "n": n, "blocks": -(-k // block)}
    return found


def dequantizations(ix: Index, names: NameGen, domain: str) -> list[Fusion]:
    by_b = _nbits_nodes(ix)
    if not by_b:
        return []
    fusions = []
    for mm in [n for n in ix.nodes if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]:
        found = _weight(ix, mm.input[1], by_b)
        if found is None:
            continue
        nodes, m, (zp, zpf) = found
        g = constant(names, "nbits_geometry", np.asarray([m["k"], m["n"], m["bits"], m["block"]], np.int64))
        inputs = [m["b"], m["scales"], g.name, zp or "", zpf or ""]
        while not inputs[-1]:
            inputs.pop()
        fusions.append(Fusion(nodes, [kernel_node("DequantizeNBitsF32", inputs, [mm.input[1]],
                                                  names.fresh("dequantize_nbits"), domain)], initializers=[g]))
    return fusions
