"""Attention's products over a mask's zeros -> the kernel library.

A causal mask (or padding) leaves the probabilities ``p = Softmax(s + mask)``
exactly zero past each row's last kept key, and the softmax's gradient
``ds`` zero there too.  The four products that read them still multiply
every zero: ``o = p v``, ``dv = p^T do``, ``dq = ds k`` and ``dk^T = q^T ds``
(each as a MatMul, the transposed ones through a Transpose of the last two
axes, the scaled ones followed by a Mul by one value).  Under a causal mask
that is half their work.  The library's products over zero tails find each
row's length to its last nonzero at run time and leave the zeros past it
out:

| kernel | replaces | tailed operand |
|---|---|---|
| ``TailMatMulF32(a, b[, alpha][, kept])`` | ``MatMul(a, b)`` [then ``Mul(., alpha)``] | a's rows |
| ``TailMatMulTransAF32(a, b[, alpha][, kept])`` | ``MatMul(Transpose(a), b)`` [...] | a's rows (as stored) |
| ``MatMulTailBF32(a, b[, alpha][, kept])`` | ``MatMul(a, b)`` [...] | b's rows |

Each row's length comes from the kernel that wrote the tailed operand where
it can say (``kept``, its optional second output: the masked softmax knows
where it wrote its zeros, the gradients look at each row just written; the
guard keeps its input's zeros, so its input's lengths bound its rows), and
from a scan of the operand otherwise (a scaled one: a Mul by an infinity
would make NaN of the zeros).

Which operands are tailed is a matter of speed, not of correctness: the
kernels give the product of any values (in their order of summation: not
onnxruntime's bits; tests/kernels/ compares them with float64), but for
what a skipped zero would add against an infinity or a NaN of the other
operand (the standard product's NaN).  The tailed operands taken are the
outputs of the masked softmax kernels this rewrite writes (``attention``:
``MaskedSoftmaxF32``, the guard that reads it, the gradients whose
probabilities it wrote), with rows of ``attention.MIN_ROW`` or more, of
static or named dims of one rank in both operands (the kernels check the
sizes they get), float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from ..core.names import NameGen
from .attention import MIN_ROW
from .graphmatch import Fusion, Index, kernel_node

#: The kernels whose outputs hold a mask's zeros: the masked softmax (of
#: scores, or of the product that makes them), and those that read its
#: probabilities (input 0 of the guard, input 1 of the gradients).
MASKED = {"MaskedSoftmaxF32", "MatMulMaskedSoftmaxF32"}
READERS = {"SoftmaxGuardF32": 0, "SoftmaxGradF32": 1, "SoftmaxGradPlainF32": 1}
#: The readers that pass their input's zeros on as they are (its lengths bound theirs).
KEEPERS = {"SoftmaxGuardF32"}


@dataclass
class Writer:
    """The kernel node that writes a tailed value's rows' lengths (``kept``,
    its output 1), and the fusion that adds it."""

    fusion: Fusion
    node: onnx.NodeProto

    def kept(self, names: NameGen) -> str:
        """The name of the lengths, asked of the node (an optional output: written where read)."""
        if len(self.node.output) < 2:
            self.node.output.append(names.fresh(self.node.output[0] + "_kept"))
            self.fusion.optional.add(self.node.output[1])
        return self.node.output[1]


def tailed_values(planned: Sequence[Fusion]) -> dict[str, Writer]:
    """The values of the ``planned`` fusions that hold a mask's zero tails,
    each with the kernel that can write its rows' lengths."""
    added = [(f, n) for f in planned for n in f.added]
    tailed = {n.output[0]: Writer(f, n) for f, n in added if n.op_type in MASKED}
    for f, n in added:
        if n.op_type in READERS and n.input[READERS[n.op_type]] in tailed:
            source = n.input[READERS[n.op_type]]
            tailed[n.output[0]] = tailed[source] if n.op_type in KEEPERS else Writer(f, n)
    return tailed


def scores_products(ix: Index, planned: Sequence[Fusion]) -> None:
    """The ``planned`` masked softmaxes of a MatMul's scores (read by nothing
    else, as large as the sum: the mask is what broadcasts) take the product
    in (``MatMulMaskedSoftmaxF32(a, b, mask)``: the scores of a row's masked
    keys are never multiplied), in place."""
    for f in planned:
        for node in [n for n in f.added if n.op_type == "MaskedSoftmaxF32"]:
            found = _scores(ix, f, node)
            if found is not None:
                mm, mask = found
                node.op_type = "MatMulMaskedSoftmaxF32"
                node.input[:] = [*mm.input, mask]
                f.removed.insert(0, mm)


def _scores(ix: Index, f: Fusion, node: onnx.NodeProto) -> tuple[onnx.NodeProto, str] | None:
    """(the MatMul, the mask) where one operand of the masked softmax ``node`` is such scores."""
    add = next((n for n in f.removed if n.op_type == "Add"), None)
    total = ix.dims(add.output[0]) if add is not None else None
    for scores, mask in (node.input, reversed(node.input)):
        mm = ix.node(scores, "MatMul")
        if mm is None or mm.domain not in ("", "ai.onnx") or scores in ix.outputs:
            continue
        if ix.readers.get(scores, []) != [add] or ix.dims(scores) != total or not _fits(ix, *mm.input, scores):
            continue
        return mm, mask
    return None


def _swaps_last_two(ix: Index, node: onnx.NodeProto, rank: int) -> bool:
    perm = ix.attr(node, "perm")
    return perm is not None and list(perm) == [*range(rank - 2), rank - 1, rank - 2]


def _alpha(ix: Index, mul: onnx.NodeProto, value: str) -> str | None:
    """The other operand of ``mul`` (a Mul reading ``value``) where it is one float value, else None."""
    alpha = ix.other(mul, "Mul", value)
    dims = ix.dims(alpha) if alpha is not None else None
    if dims is None or len(dims) > 1 or (dims and dims[0] != 1) or not ix.all_float(alpha):
        return None
    return alpha


def _scale(ix: Index, product: str) -> tuple[list[onnx.NodeProto], str, list[str]]:
    """(the Mul, its output, [alpha]) where ``product`` is read only by a Mul
    by one float value; else ([], product, [])."""
    readers = ix.readers.get(product, [])
    alpha = _alpha(ix, readers[0], product) if len(readers) == 1 and product not in ix.outputs else None
    return ([readers[0]], readers[0].output[0], [alpha]) if alpha is not None else ([], product, [])


def _fits(ix: Index, a: str, b: str, tailed: str) -> bool:
    """a and b of one rank >= 2 and one leading shape, float32, the tailed rows long."""
    ad, bd, td = ix.dims(a), ix.dims(b), ix.dims(tailed)
    if ad is None or bd is None or td is None or len(ad) != len(bd) or len(ad) < 2 or ad[:-2] != bd[:-2]:
        return False
    return (td[-1] >= MIN_ROW if isinstance(td[-1], int) else True) and ix.all_float(a, b)


def _scaled(ix: Index, tailed: dict[str, Writer]) -> dict[str, Writer | None]:
    """``tailed`` and what a Mul by one float value makes of them (the
    scale's gradient), whose zeros stay zeros (but for an infinite scale:
    those have no writer of their lengths, and are scanned)."""
    found: dict[str, Writer | None] = dict(tailed)
    for name in tailed:
        for mul, _ in ix.partners(name, "Mul"):
            if _alpha(ix, mul, name) is not None:
                found.setdefault(mul.output[0], None)
    return found


def products(ix: Index, domain: str, tailed: dict[str, Writer], names: NameGen) -> list[Fusion]:
    """The MatMuls that read a ``tailed`` value (or one scaled), as the kernels of the table."""
    scaled = _scaled(ix, tailed)
    fusions = []
    for mm in [n for n in ix.nodes if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]:
        a, b = mm.input
        found = _product(ix, mm, a, b, scaled)
        if found is None:
            continue
        op, inputs, removed, operand = found
        muls, out, alpha = _scale(ix, mm.output[0])
        writer = scaled[operand]
        kept = [alpha[0] if alpha else "", writer.kept(names)] if writer is not None else alpha
        fusions.append(Fusion([*removed, mm, *muls], [kernel_node(op, inputs + kept, [out], mm.name + "/tail", domain)]))
    return fusions


def _product(ix: Index, mm: onnx.NodeProto, a: str, b: str, tailed: dict) -> tuple | None:
    """(kernel, its inputs, the nodes it replaces besides mm, the tailed
    operand) for one MatMul, else None."""
    if a in tailed and _fits(ix, a, b, a):
        return "TailMatMulF32", [a, b], [], a
    t = ix.node(a, "Transpose")
    rank = len(ix.dims(a) or ())
    if t is not None and t.input[0] in tailed and rank >= 2 and _swaps_last_two(ix, t, rank) \
            and _fits(ix, t.input[0], b, t.input[0]):
        only = ix.readers.get(a, []) == [mm] and a not in ix.outputs
        return "TailMatMulTransAF32", [t.input[0], b], [t] if only else [], t.input[0]
    if b in tailed and _fits(ix, a, b, b):
        return "MatMulTailBF32", [a, b], [], b
    return None
