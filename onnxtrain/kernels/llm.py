"""A decoder's non-product work -> the kernel library (``llm_kernels.c``).

A Llama-style decoder exported by torch's dynamo exporter writes RMSNorm as
Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul, its MLP gate as Sigmoid,
Mul, Mul, RoPE as Mul, Slice, Slice, Neg, Concat, Mul, Add, and the autodiff
rules write their gradients as a dozen more elementwise kernels each: every
one a pass over an activation.  ``rewrite`` replaces these chains, forward
and backward, by one kernel each, only in the program onnxruntime runs
(``sess.programs()`` stays standard ops):

| kernel | replaces | same bits? |
|---|---|---|
| ``RmsNormF32`` | x^2, its row mean, + eps, sqrt, 1/s, x * r, w * n | no: the row sum runs in double |
| ``RmsNormGradF32`` | the rule's 14 kernels from dy to dx, the Sum of dy's terms (q, k, v's input gradients) and the Sum with the residual's gradient | no: the row sum runs in double |
| ``SiluMulF32`` | silu = a * sigmoid(a), h = silu * b (the Sigmoid stays) | yes |
| ``SiluMulGradF32`` | the rule's 8 kernels (and the Add of dh's two parts) | yes |
| ``RopeF32`` / ``RopeGradF32`` | ``attention``: rotate-half RoPE and its gradient | yes |
| ``SoftmaxGuardF32`` / ``SoftmaxGradF32`` | ``attention``: Where(IsNaN(p), 0, p) and the guarded softmax's gradient | yes / no (row sum) |
| ``MaskedSoftmaxF32`` | ``attention``: Softmax(scores + mask), the mask broadcast | no: the library's exp, the row sum in double |
| ``SoftmaxGradPlainF32`` | ``attention``: p * (dp - sum(dp * p)), no guard (the Softmax and GroupQueryAttention rules) | no: row sum |
| ``RotateHalvesF32`` | ``attention``: the attention rules' rotation (halves: Slices, Muls, Sub, Add, Concats) | yes |
| ``LowRankMatMulAddF32`` | ``lowrank``: c + a b for b [K, N] of few columns (LoRA's up-projection and its Add) | no: the product's order |
| ``LowRankTransAF32`` | ``lowrank``: Gemm(a, b, transA) for a [M, K] of few columns (LoRA's dB = h^T dY) | no: the product's order |
| ``CrossEntropyF32`` / ``CrossEntropyGradF32`` | ``xent``: SoftmaxCrossEntropyLoss and its gradient | no: double sums, the library's exp |
| ``TailMatMulF32`` and two more | ``tails``: the products that read the masked softmax's probabilities or their gradient, its zeros left out | no: the product's order |
| ``MatMulMaskedSoftmaxF32`` | ``tails``: the scores' MatMul and the masked softmax, the masked keys never multiplied | no: the product's order |
| ``DequantizeNBitsF32`` | ``nbits``: MatMulNBits' weight unpacked for its gradient dA = dY W | yes |

Each match is the exact chain the exporter and the rules write, in either
operand order of Add and Mul, on float32 values of static shape (SiLU, and
the cross-entropy's rows: named dims too, which their kernels check at run
time; the two softmax kernels that round differently: rows of 64 or more,
or named in a GroupQueryAttention program, the masked one broadcasting as
the Add does); anything else keeps its standard ops.  ``graphmatch.apply`` makes a
match only where nothing outside the fused chains reads what it drops.  tests/kernels/
compares each kernel with its standard chain (bit for bit where claimed) and
both with float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper

from ..core.graph import node_inputs
from ..core.names import NameGen
from . import attention, lowrank, nbits, tails, xent
from .graphmatch import Fusion, Index, apply, kernel_node, same_constant
from .layers import drop_unread

#: Most dy terms RmsNormGradF32 sums itself (its inputs: 6, then the terms; 16 in all).
MAX_TERMS = 10
#: onnxruntime-genai's decoder ops: a program holding one (its GroupQueryAttention
#: replaced or not, see contrib_attention) is a decoder, whose named softmax
#: rows are its sequence.
DECODER_OPS = frozenset({"GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization"})
#: The op types a program must have for any rewrite here to apply.
ANCHORS = frozenset({"Pow", "Sigmoid", "Softmax", "SoftmaxCrossEntropyLoss", "Concat", "MatMulNBits"})


def rewrite(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto], domain: str,
            inferred: Callable | None = None) -> int:
    """Replace the chains of the module's table by ``domain`` kernels, in
    place; how many fusions were made."""
    if not ANCHORS & {n.op_type for n in graph.node}:
        return 0
    ix = Index(graph, opset_imports, inferred)
    names = NameGen.from_graph(graph)
    decoder = any(n.domain == "com.microsoft" and n.op_type in DECODER_OPS for n in graph.node)
    fusions = (rms_norms(ix, names, domain) + silu_muls(ix, domain) + attention.ropes(ix, names, domain)
               + attention.softmaxes(ix, domain) + attention.masked_softmaxes(ix, domain, decoder)
               + attention.plain_softmax_grads(ix, domain, decoder) + attention.rotations(ix, names, domain)
               + xent.cross_entropies(ix, names, domain)
               + nbits.dequantizations(ix, names, domain) + lowrank.low_rank_sums(ix, domain)
               + lowrank.low_rank_gradients(ix, names, domain))
    tails.scores_products(ix, fusions)
    fusions += tails.products(ix, domain, tails.tailed_values(fusions), names)
    count = apply(graph, fusions)
    if count:
        _drop_dead(graph, domain)
    return count


def _drop_dead(graph: onnx.GraphProto, domain: str) -> None:
    """Remove what the fusions left unread: library nodes (a guard of the
    softmax that only the fused gradient read), then the standard ops that fed
    only what went (the forward's IsNaN, constants, shapes)."""
    while True:
        read = {i for n in graph.node for i in node_inputs(n)} | {o.name for o in graph.output}
        kept = [n for n in graph.node if n.domain != domain or any(o in read for o in n.output if o)]
        if len(kept) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(kept)
    drop_unread(graph, {"Constant", "Shape", "IsNaN", "Where"})


# ------------------------------------------------------------ RMSNorm
def _last_axis(ix: Index, node: onnx.NodeProto, rank: int) -> bool:
    """A reduction over the last axis only, keeping it."""
    axes = ix.axes(node)
    return (axes is not None and len(axes) == 1 and axes[0] % rank == rank - 1
            and int(ix.attr(node, "keepdims", 1)) == 1 and not int(ix.attr(node, "noop_with_empty_axes", 0)))


def _rms_forward(ix: Index, pw: onnx.NodeProto) -> dict | None:
    """The chain y = w * (x * 1 / sqrt(mean(x^2) + eps)) from its Pow, else None."""
    x, two = pw.input
    shape = ix.shape(x)
    if not same_constant(ix.values, two, 2.0) or not shape or not ix.all_float(x):
        return None
    rank, d = len(shape), shape[-1]
    means = [n for n in ix.reader_nodes(pw.output[0], "ReduceMean") if _last_axis(ix, n, rank)]
    if len(means) != 1:
        return None
    mean = means[0]
    for add, eps in ix.partners(mean.output[0], "Add"):
        sqrt = next(iter(ix.reader_nodes(add.output[0], "Sqrt")), None)
        rec = next(iter(ix.reader_nodes(sqrt.output[0], "Reciprocal")), None) if sqrt else None
        if rec is None or ix.scalar(eps) is None or not ix.all_float(eps):
            continue
        for mul_n in [n for n, other in ix.partners(rec.output[0], "Mul") if other == x]:
            for mul_y, w in ix.partners(mul_n.output[0], "Mul"):
                if ix.shape(w) == (d,) and ix.all_float(w):
                    return {"x": x, "w": w, "eps": eps, "d": d, "rank": rank, "pow": pw, "mean": mean,
                            "add": add, "sqrt": sqrt, "rec": rec, "mul_n": mul_n, "mul_y": mul_y}
    return None


def _only_reader(ix: Index, name: str, node: onnx.NodeProto) -> bool:
    return [id(n) for n in ix.readers.get(name, [])] == [id(node)] and name not in ix.outputs


def _times_two(ix: Index, name: str | None, x: str) -> onnx.NodeProto | None:
    """The node writing ``name`` = Mul(x, 2), else None."""
    node = ix.node(name, "Mul")
    return node if same_constant(ix.values, ix.other(node, "Mul", x) or "", 2.0) else None


def _rms_backward(ix: Index, f: dict) -> dict | None:
    """The rule's gradient of ``f`` (``_rms_forward``) from its dy, else None:
        g = dy * w; t1 = g * r; t2 = Expand(((-(sum(g * x) * (r * r))) / (2 s)) * c, shape(x^2)) * (2 x)
    summed by an Add(t1, t2) or a Sum with other terms."""
    x, w, r, s = f["x"], f["w"], f["rec"].output[0], f["sqrt"].output[0]
    for mul3, g in ix.partners(r, "Mul"):
        mul2 = ix.node(g, "Mul")
        dy = ix.other(mul2, "Mul", w)
        if dy is None or ix.shape(dy) != ix.shape(x):
            continue
        mul4 = next((n for n, other in ix.partners(g, "Mul") if other == x), None)
        red = next(iter(ix.reader_nodes(mul4.output[0], "ReduceSum")), None) if mul4 else None
        if red is None or not _last_axis(ix, red, f["rank"]):
            continue
        found = _rms_scale_chain(ix, red, r, s, f["d"])
        if found is None:
            continue
        mul8, inv_d, chain = found
        expand = next(iter(ix.reader_nodes(mul8.output[0], "Expand")), None)
        shape_node = ix.node(expand.input[1], "Shape") if expand else None
        if shape_node is None or shape_node.input[0] != f["pow"].output[0]:
            continue
        for mul10, two_x in ix.partners(expand.output[0], "Mul"):
            mul9 = _times_two(ix, two_x, x)
            root = _sum_root(ix, mul3.output[0], mul10.output[0]) if mul9 else None
            if root is None:
                continue
            removed = [mul2, mul3, mul4, red, *chain, mul8, expand, mul9, mul10, root[0]]
            if _only_reader(ix, shape_node.output[0], expand):
                removed.append(shape_node)
            terms = [dy]
            total = ix.node(dy, "Sum")  # (dy's terms, summed in the kernel in the Sum's order)
            if total is not None and _only_reader(ix, dy, mul2) and len(total.input) <= MAX_TERMS and all(
                    ix.shape(t) == ix.shape(x) for t in total.input):
                terms = list(total.input)
                removed.append(total)
            return {"dy": terms, "inv_d": inv_d, "root": root[0], "others": root[1], "removed": removed}
    return None


def _rms_scale_chain(ix: Index, red: onnx.NodeProto, r: str, s: str, d: int):
    """(Mul_8, its 1/D constant, the nodes) of ((-(red * (r * r))) / (2 s)) * (1/D)."""
    for mul6, rr in ix.partners(red.output[0], "Mul"):
        mul5 = ix.node(rr, "Mul")
        if mul5 is None or list(mul5.input) != [r, r]:
            continue
        neg = next(iter(ix.reader_nodes(mul6.output[0], "Neg")), None)
        div = next(iter(ix.reader_nodes(neg.output[0], "Div")), None) if neg else None
        if div is None or div.input[0] != neg.output[0]:
            continue
        mul7 = _times_two(ix, div.input[1], s)
        for mul8, c in ix.partners(div.output[0], "Mul") if mul7 else ():
            value = ix.scalar(c)
            if value is not None and ix.all_float(c) and np.float32(value) == np.float32(1.0 / d):
                return mul8, c, [mul5, mul6, neg, mul7, div]
    return None


def _sum_root(ix: Index, t1: str, t2: str) -> tuple[onnx.NodeProto, list[str]] | None:
    """The Add(t1, t2), or a Sum reading both (with the other terms), that sums two gradient terms."""
    for node in ix.reader_nodes(t1):
        if node.domain not in ("", "ai.onnx") or t2 not in node.input:
            continue
        if node.op_type == "Add" and sorted(node.input) == sorted([t1, t2]):
            return node, []
        if node.op_type == "Sum" and list(node.input).count(t1) == 1 and list(node.input).count(t2) == 1:
            others = [i for i in node.input if i not in (t1, t2)]
            if all(ix.shape(o) == ix.shape(t1) for o in others):
                return node, others
    return None


def rms_norms(ix: Index, names: NameGen, domain: str) -> list[Fusion]:
    fusions = []
    for pw in [n for n in ix.nodes if n.op_type == "Pow" and n.domain in ("", "ai.onnx")]:
        f = _rms_forward(ix, pw)
        if f is None:
            continue
        r, s, n = f["rec"].output[0], f["sqrt"].output[0], f["mul_n"].output[0]
        forward = kernel_node("RmsNormF32", [f["x"], f["w"], f["eps"]], [f["mul_y"].output[0], r, s, n],
                              names.fresh("rms_norm"), domain)
        fusions.append(Fusion([pw, f["mean"], f["add"], f["sqrt"], f["rec"], f["mul_n"], f["mul_y"]], [forward],
                              optional={s, n}))
        b = _rms_backward(ix, f)
        if b is None:
            continue
        added, acc = [], b["others"]
        if len(acc) > 1:  # more terms than one: summed first
            total = names.fresh(b["root"].output[0] + "_rest")
            added.append(helper.make_node("Sum", acc, [total], name=names.fresh("rms_norm_grad_rest")))
            acc = [total]
        added.append(kernel_node("RmsNormGradF32", [f["x"], f["w"], r, s, b["inv_d"], acc[0] if acc else "", *b["dy"]],
                                 [b["root"].output[0]], names.fresh("rms_norm_grad"), domain))
        fusions.append(Fusion(b["removed"], added))
    return fusions


# ------------------------------------------------------------ SiLU * gate
def _silu_backward(ix: Index, a: str, s: str, silu: str):
    """The rule's gradient of h = silu * b from Sub(1, s):
        ds = dh * b; db = dh * silu; da = ds * s + (ds * a) * (s * (1 - s))
    -> (h's Mul, b, dh, db's Mul, [nodes]), else None."""
    for sub in ix.reader_nodes(s, "Sub"):
        if sub.input[1] != s or not same_constant(ix.values, sub.input[0], 1.0):
            continue
        for mul17 in [n for n, other in ix.partners(sub.output[0], "Mul") if other == s]:
            for mul18, u in ix.partners(mul17.output[0], "Mul"):
                mul16 = ix.node(u, "Mul")
                ds = ix.other(mul16, "Mul", a)
                mul12 = ix.node(ds, "Mul")
                mul15 = next((n for n, other in ix.partners(ds, "Mul") if other == s), None) if ds else None
                root = _sum_root(ix, mul15.output[0], mul18.output[0]) if mul12 and mul15 else None
                if root is None or root[1]:
                    continue
                for dh, b in ix.operands(mul12, "Mul"):
                    fwd = [n for n, other in ix.partners(silu, "Mul") if other == b]
                    db = [n for n, other in ix.partners(silu, "Mul") if other == dh]
                    if len(fwd) == 1 and len(db) == 1 and fwd[0] is not db[0] and ix.dims(b) == ix.dims(a):
                        return fwd[0], b, dh, db[0], [mul12, db[0], mul15, mul16, sub, mul17, mul18, root[0]]
    return None


def silu_muls(ix: Index, domain: str) -> list[Fusion]:
    fusions = []
    for sig in [n for n in ix.nodes if n.op_type == "Sigmoid" and n.domain in ("", "ai.onnx")]:
        s = sig.output[0]
        a = sig.input[0]
        for silu_node in [n for n, other in ix.partners(s, "Mul") if other == a]:
            silu = silu_node.output[0]
            shape = ix.dims(a)
            if shape is None or not ix.all_float(a, s):
                continue
            back = _silu_backward(ix, a, s, silu)
            if back is not None:
                h_node, b, dh, db_node, nodes = back
            else:
                hs = [(n, other) for n, other in ix.partners(silu, "Mul") if ix.dims(other) == shape]
                if len(hs) != 1:
                    continue
                h_node, b = hs[0]
            if not ix.all_float(b):
                continue
            fusions.append(Fusion([silu_node, h_node],
                                  [kernel_node("SiluMulF32", [a, s, b], [h_node.output[0], silu],
                                               sig.name + "/silu_mul", domain)], optional={silu}))
            if back is None or ix.dims(dh) != shape:
                continue
            inputs = [dh, a, b, s]
            add = ix.node(dh, "Add", 2)
            if (add is not None and ix.dims(add.input[0]) == shape and ix.dims(add.input[1]) == shape
                    and {id(n) for n in ix.readers.get(dh, [])} == {id(nodes[0]), id(db_node)}
                    and dh not in ix.outputs):
                inputs = [add.input[0], a, b, s, add.input[1]]  # dh's two parts, added in the kernel
                nodes = [add, *nodes]
            fusions.append(Fusion(nodes, [kernel_node("SiluMulGradF32", inputs, [nodes[-1].output[0], db_node.output[0]],
                                                      sig.name + "/silu_mul_grad", domain)],
                                  optional={db_node.output[0]}))
    return fusions
