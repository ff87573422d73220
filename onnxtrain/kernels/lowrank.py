"""A product of few columns and the sum that reads it -> the kernel library.

LoRA's forward adds its adapter's up-projection to the frozen product,
``y = base + (x A s) B``: a MatMul of K = r columns (the rank, 8-64), whose
[.., N] result onnxruntime writes only for one Add to read back.  At K = 16
the product is a pass over its output more than arithmetic, and MLAS runs it
well below its ceiling (L1: 8-47 GFLOP/s for these shapes).
``LowRankMatMulAddF32(c, a, b)`` writes ``c + a b`` in one pass: blocks of
4 rows x 32 columns of sums kept in registers, the K products accumulated in
order by fused multiply-adds, then c added.  Not the bits of onnxruntime's
MatMul (its order); tests/kernels/ checks it against float64.

Matched: MatMul(a, b) with b a 2-D [K, N] of K <= ``MAX_K`` and N >=
``MIN_N``, a of rank 2 or more, float32, read only by an Add whose other
operand has the product's dims (named dims alike: the kernel checks the
sizes it gets at run time).

The adapter's gradient ``dB = h^T dY`` (a Gemm with transA, h [M, r]) sums
over the M rows into r x N values, which MLAS also runs well below its
ceiling (47 GFLOP/s on L1).  ``LowRankTransAF32(a, b)`` writes ``a^T b`` for
a of K <= ``MAX_K`` columns, blocks of 8 x 32 sums in registers, each summed
over chunks of 64 rows by fused multiply-adds, the chunks then in order.  Matched: Gemm(a, b, transA=1)
without C, alpha 1, transB 0, a [M, K] of static K <= ``MAX_K``, b [M, N] of
static N >= ``MIN_N``, M named or at least ``MIN_M``, float32.  The adapter's
other gradient ``dA = x^T dH`` has the few columns on the other side (dH
[M, r]): it becomes ``Transpose(LowRankTransAF32(dH, x))``, the transpose of
an r x N result (MLAS ran these at 21-47 GFLOP/s on L1, the kernel at about
twice that).
"""

from __future__ import annotations

import onnx
from onnx import helper

from ..core.names import NameGen
from .graphmatch import Fusion, Index, kernel_node

#: Most columns K rewritten: beyond, onnxruntime's MatMul is the better product.
MAX_K = 64
#: Fewest output columns N rewritten: the kernels compute blocks of 32 columns
#: (the rest one by one), and narrow products are MLAS's (W1's last layer's
#: dW = h^T dY, N = 10, ran 3% slower as a whole step with the kernel).
MIN_N = 128
#: Fewest few columns K where they are on the right, a^T b with b [M, K]
#: (LoRA's dA = x^T dH, K its rank): the kernel sums blocks of 8 rows of its
#: [K, N] result, and a classifier's handful of classes (dW = x^T dY) stays
#: MLAS's.
MIN_K_RIGHT = 8
#: Fewest rows M of the gradient's sum a^T b where M is static (a batch of 64
#: rows is MLAS's: W1's and W7's dW; LoRA's M is a batch's tokens).
MIN_M = 256


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
        if bd is None or len(bd) != 2 or not 1 <= bd[0] <= MAX_K or bd[1] < MIN_N or ad is None or len(ad) < 2 \
                or ad[-1] != bd[0]:
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


def _gemm_ta(ix: Index, node: onnx.NodeProto) -> bool:
    """Gemm(a, b) = a^T b: transA, no transB, alpha 1, no C."""
    return (int(ix.attr(node, "transA", 0)) == 1 and int(ix.attr(node, "transB", 0)) == 0
            and float(ix.attr(node, "alpha", 1.0)) == 1.0 and (len(node.input) < 3 or not node.input[2]))


def _few_columns(ix: Index, a: str, b: str, min_k: int = 1) -> bool:
    """a [M, K] of static min_k <= K <= MAX_K and b [M, N] of static N >= MIN_N,
    M named or at least MIN_M rows, both float32: a^T b is the kernel's."""
    ad, bd = ix.dims(a), ix.dims(b)
    if ad is None or bd is None or len(ad) != 2 or len(bd) != 2:
        return False
    if not isinstance(ad[1], int) or not min_k <= ad[1] <= MAX_K or not isinstance(bd[1], int) or bd[1] < MIN_N:
        return False
    return not (isinstance(ad[0], int) and ad[0] < MIN_M) and ix.all_float(a, b)


def low_rank_gradients(ix: Index, names: NameGen, domain: str) -> list[Fusion]:
    fusions = []
    for g in [n for n in ix.nodes if n.op_type == "Gemm" and n.domain in ("", "ai.onnx") and _gemm_ta(ix, n)]:
        a, b = g.input[0], g.input[1]
        if _few_columns(ix, a, b):
            fusions.append(Fusion([g], [kernel_node("LowRankTransAF32", [a, b], list(g.output),
                                                    g.name + "/low_rank_t", domain)]))
        elif _few_columns(ix, b, a, MIN_K_RIGHT):  # a^T b = (b^T a)^T: LoRA's dA = x^T dH
            kn = names.fresh((g.output[0] or "gemm") + "/transposed")
            fusions.append(Fusion([g], [kernel_node("LowRankTransAF32", [b, a], [kn], g.name + "/low_rank_t", domain),
                                        helper.make_node("Transpose", [kn], list(g.output), perm=[1, 0],
                                                         name=g.name + "/low_rank_t/transpose")]))
    return fusions
