"""A product of few columns and the sum that reads it -> the kernel library.

LoRA's forward adds its adapter's up-projection to the frozen product,
``y = base + (x A s) B``: a MatMul of K = r columns (the rank, 8-64), whose
[.., N] result onnxruntime writes only for one Add to read back.  At K = 16
the product is a pass over its output more than arithmetic, and MLAS runs it
well below its ceiling (L1: 8-47 GFLOP/s for these shapes).
``LowRankMatMulAddF32(c, a, b)`` writes ``c + a b`` in one pass: per row, the
K products summed in order into a float per column, then c added.  Not the
bits of onnxruntime's MatMul (its order, its fused multiply-adds); tests/
kernels/ checks it against float64.

Matched: MatMul(a, b) with b a 2-D [K, N] of K <= ``MAX_K``, a of rank 2 or
more, float32, read only by an Add whose other operand has the product's
dims (named dims alike: the kernel checks the sizes it gets at run time).
"""

from __future__ import annotations

import onnx

from .graphmatch import Fusion, Index, kernel_node

#: Most columns K rewritten: beyond, onnxruntime's MatMul is the better product.
MAX_K = 64


def _operand(ix: Index, add: onnx.NodeProto, product: str) -> str | None:
    """The Add's other operand where it has the product's dims, else None."""
    other = ix.other(add, "Add", product)
    dims = ix.dims(product)
    return other if other is not None and dims is not None and ix.dims(other) == dims else None


def low_rank_sums(ix: Index, domain: str) -> list[Fusion]:
    fusions = []
    for mm in [n for n in ix.nodes if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]:
        a, b = mm.input
        bd, ad = ix.shape(b), ix.dims(a)
        if bd is None or len(bd) != 2 or not 1 <= bd[0] <= MAX_K or ad is None or len(ad) < 2 or ad[-1] != bd[0]:
            continue
        adds = ix.reader_nodes(mm.output[0], "Add")
        if len(adds) != 1 or len(ix.readers.get(mm.output[0], [])) != 1 or mm.output[0] in ix.outputs:
            continue
        c = _operand(ix, adds[0], mm.output[0])
        if c is None or not ix.all_float(a, b, c):
            continue
        fusions.append(Fusion([mm, adds[0]], [kernel_node("LowRankMatMulAddF32", [c, a, b], [adds[0].output[0]],
                                                          adds[0].name + "/low_rank", domain)]))
    return fusions
