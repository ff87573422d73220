"""Attention's non-product chains -> the kernel library (see ``llm``).

**RoPE** (rotate-half): ``y = x * cos + Concat(-x[h:], x[:h]) * sin`` over the
last axis (D = 2h), cos and sin one [S, D] table broadcast over the leading
axes.  ``RopeF32`` computes it in one pass, each element with the chain's
operations (a Mul, a Neg, a Mul, an Add): the same bits.  Its gradient as the
rules write it, ``Sum(Pad(-Split(dy * sin)[0]), Pad(Split(dy * sin)[1]),
dy * cos)``, is ``RopeGradF32``: the same operations, the Pads' zeros
added as the Sum adds them (in any order of the Sum's terms the same bits:
one of the three is a +0 at every element).
The gradient is matched on its own, whatever forward produced it.

**The guarded softmax.**  The dynamo exporter writes scaled dot-product
attention's probabilities as ``Where(IsNaN(p), 0, p)``, p = Softmax(scores):
a fully masked row is NaN and becomes 0.  onnxruntime's Where is a general
broadcast loop, several times a Mul's cost on the [B, H, S, S] tensor.
``SoftmaxGuardF32`` is that guard in one pass (the same bits: NaN becomes +0,
anything else is copied, -0 included, as onnxruntime's Where does).
The softmax rule's gradient through the guard, ``Where(IsNaN(p), 0, dq)``,
p recomputed as guarded, then ``q * (e - sum(e * q))``, is
``SoftmaxGradF32`` from dq and p: the same operations but for the row sum,
which runs in double.

**The masked softmax.**  ``Softmax(scores + mask)`` over the last axis, the
mask broadcast over heads (the exporter's attention; GroupQueryAttention's
recomputed probabilities in its gradient), is ``MaskedSoftmaxF32``: one pass
per row that never writes ``scores + mask``, broadcasting the two as the Add
does.  Both softmax kernels that round differently from onnxruntime take
rows of ``MIN_ROW`` or more, or named rows in a GroupQueryAttention program
(an onnxruntime-genai decoder, whose rows are its sequence): a small
model's attention keeps onnxruntime's bits, as its bundle on
onnxruntime-node reproduces them.  The Add's sums are the same
bits; the softmax uses the library's exp and a row sum in double, so it is
compared with float64, not bit for bit.  A row with a NaN, or all -inf, is
NaN as the standard Softmax makes it (the guard above then zeroes it).
The gradient ``p * (dp - sum(dp * p))`` without a guard (GroupQueryAttention's
rule) is ``SoftmaxGradPlainF32``, the guarded kernel's operations less the
Wheres; its row sum runs in double.

**The rules' rotation.**  ``autodiff.rules.contrib_rotary.rotate`` (halves)
writes ``Concat(Concat(x1 c - x2 s, x2 c + x1 s), rest)`` from three Slices
of x whose bounds it computes from cos's last dim; ``RotateHalvesF32`` is
that in one pass, the same bits (each element's Mul, Mul, Sub or Add).
"""

from __future__ import annotations

import onnx

from ..core.names import NameGen
from .graphmatch import Fusion, Index, kernel_node


def _last(ix: Index, node: onnx.NodeProto, axis_name: str, rank: int) -> bool:
    axis = ix.attr(node, axis_name, 0)
    return axis % rank == rank - 1


def _slice(ix: Index, node: onnx.NodeProto | None, x: str, start: int, stop: int, d: int) -> bool:
    """Whether ``node`` is Slice(x) of [start, stop) on the last axis (stop clamped to d), step 1."""
    if node is None or node.input[0] != x or len(node.input) < 4:
        return False
    starts, ends, axes = ix.ints(node.input[1]), ix.ints(node.input[2]), ix.ints(node.input[3])
    steps = ix.ints(node.input[4]) if len(node.input) > 4 and node.input[4] else [1]
    rank = len(ix.shape(x))
    if starts is None or ends is None or axes is None or steps != [1] or len(axes) != 1:
        return False
    return (axes[0] % rank == rank - 1 and starts == [start]
            and min(ends[0] if ends[0] >= 0 else ends[0] + d, d) == stop)


def _table(ix: Index, name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``name`` is a float [.., S, D] table (leading dims 1) for x of ``shape``."""
    t = ix.shape(name)
    return (t is not None and ix.all_float(name) and len(t) >= 2 and len(t) <= len(shape)
            and tuple(t[-2:]) == tuple(shape[-2:]) and all(v == 1 for v in t[:-2]))


def _rope_forward(ix: Index, cat: onnx.NodeProto) -> dict | None:
    """y = x * cos + Concat(-x[h:], x[:h]) * sin from the Concat, else None."""
    if len(cat.input) != 2:
        return None
    neg = ix.node(cat.input[0], "Neg")
    if neg is None:
        return None
    hi = ix.node(neg.input[0], "Slice")
    x = hi.input[0] if hi is not None else None
    shape = ix.shape(x) if x else None
    if not shape or len(shape) < 2 or shape[-1] % 2 or not ix.all_float(x) or not _last(ix, cat, "axis", len(shape)):
        return None
    d = shape[-1]
    lo = ix.node(cat.input[1], "Slice")
    if not (_slice(ix, hi, x, d // 2, d, d) and _slice(ix, lo, x, 0, d // 2, d)):
        return None
    for sm in ix.reader_nodes(cat.output[0], "Mul"):
        sin = next((b for a, b in ix.operands(sm, "Mul") if a == cat.output[0]), None)
        if sin is None or not _table(ix, sin, shape):
            continue
        for add in ix.reader_nodes(sm.output[0], "Add"):
            c = next((b for a, b in ix.operands(add, "Add") if a == sm.output[0]), None)
            mul_c = ix.node(c, "Mul")
            cos = next((b for a, b in ix.operands(mul_c, "Mul") if a == x), None)
            if cos is not None and _table(ix, cos, shape):
                return {"x": x, "cos": cos, "sin": sin, "y": add.output[0],
                        "nodes": [mul_c, hi, lo, neg, cat, sm, add]}
    return None


def _pad(ix: Index, node: onnx.NodeProto | None, before: int, after: int, rank: int) -> bool:
    """Whether ``node`` is a zero Pad of ``before`` and ``after`` on the last axis only."""
    if node is None or len(node.input) < 2 or (len(node.input) > 2 and any(node.input[2:])):
        return False
    mode = ix.attr(node, "mode", b"constant")
    pads = ix.ints(node.input[1])
    want = [0] * (2 * rank)
    want[rank - 1], want[2 * rank - 1] = before, after
    return mode in (b"constant", "constant") and pads == want


def _rope_backward(ix: Index, split: onnx.NodeProto) -> dict | None:
    """dx = Sum(Pad(-s0, [h, 0]), Pad(s1, [0, h]), dy * cos) with (s0, s1) = Split(dy * sin), else None."""
    if len(split.output) != 2 or not all(split.output):
        return None
    dsm = ix.node(split.input[0], "Mul")
    shape = ix.shape(split.input[0])
    if dsm is None or not shape or len(shape) < 2 or shape[-1] % 2 or not _last(ix, split, "axis", len(shape)):
        return None
    rank, h = len(shape), shape[-1] // 2
    sizes = ix.ints(split.input[1]) if len(split.input) > 1 and split.input[1] else None
    if sizes is None and ix.attr(split, "split") is not None:
        sizes = list(ix.attr(split, "split"))
    if sizes is not None and sizes != [h, h]:
        return None
    negs = ix.reader_nodes(split.output[0], "Neg")
    hi_pads = [p for n in negs for p in ix.reader_nodes(n.output[0], "Pad") if _pad(ix, p, h, 0, rank)]
    lo_pads = [p for p in ix.reader_nodes(split.output[1], "Pad") if _pad(ix, p, 0, h, rank)]
    if len(negs) != 1 or len(hi_pads) != 1 or len(lo_pads) != 1:
        return None
    for root in ix.reader_nodes(hi_pads[0].output[0], "Sum"):
        terms = list(root.input)
        if len(terms) != 3 or lo_pads[0].output[0] not in terms:
            continue
        third = [t for t in terms if t not in (hi_pads[0].output[0], lo_pads[0].output[0])]
        mul_c = ix.node(third[0], "Mul") if len(third) == 1 else None
        for dy, sin in ix.operands(dsm, "Mul"):
            cos = next((b for a, b in ix.operands(mul_c, "Mul") if a == dy and b != sin), None)
            if (cos is None or ix.shape(dy) != shape or not ix.all_float(dy)
                    or not _table(ix, sin, shape) or not _table(ix, cos, shape)):
                continue
            return {"dy": dy, "cos": cos, "sin": sin, "dx": root.output[0],
                    "nodes": [dsm, split, negs[0], hi_pads[0], lo_pads[0], mul_c, root]}
    return None


def ropes(ix: Index, names: NameGen, domain: str) -> list[Fusion]:
    fusions = []
    for node in ix.nodes:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Concat":
            f = _rope_forward(ix, node)
            if f is not None:
                fusions.append(Fusion(f["nodes"], [kernel_node("RopeF32", [f["x"], f["cos"], f["sin"]], [f["y"]],
                                                               names.fresh("rope"), domain)]))
        elif node.op_type == "Split":
            b = _rope_backward(ix, node)
            if b is not None:
                fusions.append(Fusion(b["nodes"], [kernel_node("RopeGradF32", [b["dy"], b["cos"], b["sin"]],
                                                               [b["dx"]], names.fresh("rope_grad"), domain)]))
    return fusions


# ------------------------------------------------------------ guarded softmax
def _is_zero(ix: Index, name: str) -> bool:
    v = ix.values.get(name)
    return v is not None and v.size == 1 and v.dtype.kind == "f" and float(v.reshape(-1)[0]) == 0.0


def _guard(ix: Index, where: onnx.NodeProto) -> str | None:
    """p where ``where`` is Where(IsNaN(p), 0, p), else None."""
    if len(where.input) != 3:
        return None
    isnan = ix.node(where.input[0], "IsNaN")
    if isnan is None or isnan.input[0] != where.input[2] or not _is_zero(ix, where.input[1]):
        return None
    return where.input[2]


def _softmax_grad(ix: Index, p: str, nan: str) -> list[dict]:
    """The rule's gradient through the guard, from Where(nan, 0, dq):
        e = Where(nan, 0, dq); q = Where(IsNaN(p), 0, p) (any guard of p);
        dx = q * (e - ReduceSum(e * q, last axis))."""
    shape = ix.shape(p)
    found = []
    for we in ix.reader_nodes(nan, "Where"):
        if we.input[0] != nan or not _is_zero(ix, we.input[1]) or we.input[2] == p:
            continue
        e = we.output[0]
        for mul in ix.reader_nodes(e, "Mul"):
            q = next((b for a, b in ix.operands(mul, "Mul") if a == e), None)
            wq = ix.node(q, "Where", 3)
            if wq is None or _guard(ix, wq) != p:
                continue
            red = next(iter(ix.reader_nodes(mul.output[0], "ReduceSum")), None)
            axes = ix.axes(red) if red is not None else None
            if red is None or axes is None or [a % len(shape) for a in axes] != [len(shape) - 1]:
                continue
            if int(ix.attr(red, "keepdims", 1)) != 1:
                continue
            sub = next((n for n in ix.reader_nodes(red.output[0], "Sub") if list(n.input) == [e, red.output[0]]), None)
            out = next((n for n in ix.reader_nodes(sub.output[0], "Mul")
                        if (q, sub.output[0]) in ix.operands(n, "Mul")), None) if sub else None
            if out is None or ix.shape(we.input[2]) != shape or not ix.all_float(we.input[2]):
                continue
            found.append({"dq": we.input[2], "dx": out.output[0], "nodes": [we, mul, red, sub, out]})
    return found


def softmaxes(ix: Index, domain: str) -> list[Fusion]:
    fusions = []
    for where in [n for n in ix.nodes if n.op_type == "Where" and n.domain in ("", "ai.onnx")]:
        p = _guard(ix, where)
        shape = ix.shape(p) if p else None
        if not shape or not ix.all_float(p) or ix.shape(where.output[0]) != shape:
            continue
        fusions.append(Fusion([where], [kernel_node("SoftmaxGuardF32", [p], [where.output[0]],
                                                    where.name + "/guard", domain)]))
        for g in _softmax_grad(ix, p, where.input[0]):
            fusions.append(Fusion(g["nodes"], [kernel_node("SoftmaxGradF32", [g["dq"], p], [g["dx"]],
                                                           g["nodes"][-1].name + "/softmax_grad", domain)]))
    return fusions


# ------------------------------------------------------------ masked softmax
#: Shortest softmax rows the two kernels that round differently from
#: onnxruntime take (a static last dim): a small model's attention keeps
#: onnxruntime's bits, which its bundle reproduces on onnxruntime-node.
MIN_ROW = 64


def _long_rows(dims: tuple, named: bool) -> bool:
    """Rows of ``MIN_ROW`` or more, or named where ``named`` allows it."""
    return dims[-1] >= MIN_ROW if isinstance(dims[-1], int) else named


def masked_softmaxes(ix: Index, domain: str, named: bool = False) -> list[Fusion]:
    """Softmax(Add(a, b)) over the last axis of float32 values whose ranks are
    known (the kernel broadcasts a and b as the Add does), the sum read only by
    the Softmax, rows ``_long_rows``."""
    fusions = []
    for sm in [n for n in ix.nodes if n.op_type == "Softmax" and n.domain in ("", "ai.onnx")]:
        add = ix.node(sm.input[0], "Add", 2)
        out = ix.dims(sm.input[0]) if add is not None else None
        if out is None or not 1 <= len(out) <= 8 or not _long_rows(out, named) or not ix.all_float(*add.input):
            continue
        axis = ix.attr(sm, "axis", -1 if ix.opset() >= 13 else 1)  # (1 before opset 13, and 2-D rows)
        if axis % len(out) != len(out) - 1:
            continue
        fusions.append(Fusion([add, sm], [kernel_node("MaskedSoftmaxF32", list(add.input), [sm.output[0]],
                                                      sm.name + "/masked", domain)]))
    return fusions


def _plain_softmax_grad(ix: Index, red: onnx.NodeProto) -> dict | None:
    """dx = p * (dp - ReduceSum(dp * p, last axis, keepdims)) from its ReduceSum,
    dp and p of one known rank, neither a guard's Where (``softmaxes`` takes
    the guarded form), else None."""
    mul = ix.node(red.input[0], "Mul")
    dims = ix.dims(red.input[0]) if mul is not None else None
    if dims is None or ix.axes(red) is None or int(ix.attr(red, "keepdims", 1)) != 1:
        return None
    if [a % len(dims) for a in ix.axes(red)] != [len(dims) - 1]:
        return None
    for dp, p in ix.operands(mul, "Mul"):
        if ix.node(dp, "Where") or ix.node(p, "Where") or not ix.all_float(dp, p):
            continue
        if ix.dims(dp) is None or ix.dims(p) is None or not len(ix.dims(dp)) == len(ix.dims(p)) == len(dims):
            continue
        sub = next((n for n in ix.reader_nodes(red.output[0], "Sub") if list(n.input) == [dp, red.output[0]]), None)
        out = next((n for n, other in ix.partners(sub.output[0], "Mul") if other == p), None) if sub else None
        if out is not None:
            return {"dq": dp, "p": p, "dx": out.output[0], "nodes": [mul, red, sub, out]}
    return None


def plain_softmax_grads(ix: Index, domain: str, named: bool = False) -> list[Fusion]:
    """The softmax gradient without a guard, as GroupQueryAttention's rule
    and the Softmax rule write it: ``SoftmaxGradPlainF32(dp, p)``, which checks
    at run time that the two have one shape (their dims may be named
    differently), rows ``_long_rows``."""
    fusions = []
    for red in [n for n in ix.nodes if n.op_type == "ReduceSum" and n.domain in ("", "ai.onnx")]:
        g = _plain_softmax_grad(ix, red)
        if g is not None and _long_rows(ix.dims(g["p"]), named):
            fusions.append(Fusion(g["nodes"], [kernel_node("SoftmaxGradPlainF32", [g["dq"], g["p"]], [g["dx"]],
                                                           g["nodes"][-1].name + "/softmax_grad", domain)]))
    return fusions


# ------------------------------------------------------------ the rules' rotation
def _shape_last(ix: Index, name: str) -> str | None:
    """t where ``name`` = Shape(t, start=-1) (its last dim, a 1-D tensor), else None."""
    node = ix.node(name, "Shape")
    if node is None or ix.attr(node, "start") != -1 or ix.attr(node, "end") is not None:
        return None
    return node.input[0]


def _sliced(ix: Index, name: str, start: str | int, end: str | int) -> str | None:
    """x where ``name`` = Slice(x, start, end) on the last axis, step 1 (an int
    bound: a constant of that value, a str: that tensor), else None."""
    node = ix.node(name, "Slice")
    if node is None or len(node.input) < 4 or (len(node.input) > 4 and node.input[4]
                                               and ix.ints(node.input[4]) != [1]):
        return None
    x = node.input[0]
    dims = ix.dims(x)
    if dims is None or ix.ints(node.input[3]) not in ([-1], [len(dims) - 1]):
        return None
    for bound, given in ((start, node.input[1]), (end, node.input[2])):
        if isinstance(bound, str) and given != bound:
            return None
        if isinstance(bound, int):
            v = ix.ints(given)
            if v is None or len(v) != 1 or (v[0] != bound if bound < 2**31 else v[0] < 2**31):
                return None
    return x


def _rotation(ix: Index, cat: onnx.NodeProto) -> dict | None:
    """The rules' ``rotate`` (halves) from its outer Concat(Concat(x1 c - x2 s,
    x2 c + x1 s), rest), half = Shape(c, start=-1), else None."""
    if len(cat.input) != 2 or ix.attr(cat, "axis") != -1:
        return None
    inner = ix.node(cat.input[0], "Concat", 2)
    sub = ix.node(inner.input[0], "Sub") if inner is not None and ix.attr(inner, "axis") == -1 else None
    add = ix.node(inner.input[1], "Add", 2) if sub is not None else None
    m1, m2 = (ix.node(i, "Mul", 2) for i in sub.input) if add is not None else (None, None)
    if m1 is None or m2 is None:
        return None
    for x1, c in ix.operands(m1, "Mul"):
        halves = [r.output[0] for r in ix.reader_nodes(c, "Shape") if _shape_last(ix, r.output[0]) == c]
        half = next((h for h in halves if _sliced(ix, x1, 0, h) is not None), None)
        x = _sliced(ix, x1, 0, half) if half is not None else None
        rot = next((n.output[0] for n, two in ix.partners(half, "Mul") if ix.ints(two) == [2]), None) if x else None
        if rot is None or _sliced(ix, cat.input[1], rot, 2**62) != x:
            continue
        for x2, sn in ix.operands(m2, "Mul"):
            if _sliced(ix, x2, half, rot) != x:
                continue
            m3, m4 = (ix.node(i, "Mul", 2) for i in add.input)
            want = {(x2, c), (c, x2)}, {(x1, sn), (sn, x1)}
            terms = [set(ix.operands(m, "Mul")) for m in (m3, m4)]
            if not ((terms[0] & want[0] and terms[1] & want[1]) or (terms[0] & want[1] and terms[1] & want[0])):
                continue
            if not ix.all_float(x, c, sn) or ix.dims(x) is None or not 1 <= len(ix.dims(x)) <= 8:
                continue
            slices = [ix.producer[n] for n in (x1, x2, cat.input[1])]
            return {"x": x, "cos": c, "sin": sn, "y": cat.output[0],
                    "nodes": [*slices, m1, m2, m3, m4, sub, add, inner, cat]}
    return None


def rotations(ix: Index, names: NameGen, domain: str) -> list[Fusion]:
    """The attention rules' rotation (``autodiff.rules.contrib_rotary.rotate``,
    halves) -> ``RotateHalvesF32``: GroupQueryAttention's gradient rotates the
    recomputed queries and, inversely, dq and dk with it."""
    fusions = []
    for cat in [n for n in ix.nodes if n.op_type == "Concat" and n.domain in ("", "ai.onnx")]:
        r = _rotation(ix, cat)
        if r is not None:
            fusions.append(Fusion(r["nodes"], [kernel_node("RotateHalvesF32", [r["x"], r["cos"], r["sin"]], [r["y"]],
                                                           names.fresh("rotate"), domain)]))
    return fusions
