"""The vocabulary cross-entropy -> the kernel library (see ``llm``).

``SoftmaxCrossEntropyLoss`` over a language model's logits [N, C] (C the
vocabulary) is, in onnxruntime, its function body: a LogSoftmax writing the
log-probabilities [N, C], a GatherElements and the mean.  Its rule's gradient
reads those log-probabilities back: Exp, a ScatterElements of the picked
values into zeros [N, C], a ReduceSum over the classes, a Mul and a Sub, each
a pass over N x C floats (32 MB for L1's 1024 tokens and 8000 classes).

``CrossEntropyF32(scores, target, ignore)`` writes the loss and each row's
log-sum-exp (double [N]) instead of the log-probabilities;
``CrossEntropyGradF32(scores, lse, safe target, v)`` writes the rule's
gradient ``onehot(t) * v - softmax * v`` in one pass, the softmax recomputed
from the scores (v: the rule's per-row value -coef * w, computed by its small
standard ops as before).  Not the same bits: sums in double, the library's
exp (about a float ulp) in place of onnxruntime's; tests/kernels/ checks both
against float64.  Matched for reduction="mean", no class weights, 2-D float
scores with a static number of classes, ``VOCABULARY`` or more, int64 targets,
the log-probabilities read only by the rule's gradient.  The rows N may be a
named dim, and the targets' and the rule's per-row values 1-D of any length:
the kernels check that they hold N values at run time.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..core.names import NameGen
from .graphmatch import Fusion, Index, constant, kernel_node

#: The ignore index given to the kernel when the node has none (no int64 target is it).
NO_IGNORE = np.iinfo(np.int64).min
#: Fewest classes rewritten: a vocabulary.  Below, the standard chain is a few
#: small passes, and its numbers (onnxruntime's own, to the bit) are kept.
VOCABULARY = 256


def _zeros_like(ix: Index, name: str, of: str) -> list[onnx.NodeProto] | None:
    """[ConstantOfShape, Shape] where ``name`` = ConstantOfShape(Shape(of)) of +0.0 float."""
    cos = ix.node(name, "ConstantOfShape")
    shape = ix.node(cos.input[0], "Shape") if cos is not None else None
    if shape is None or shape.input[0] != of or len(shape.attribute):
        return None
    value = ix.attr(cos, "value")
    if value is not None:
        v = numpy_helper.to_array(value)
        if v.dtype != np.float32 or v.size != 1 or v.reshape(-1)[0] != 0 or np.signbit(v.reshape(-1)[0]):
            return None
    return [cos, shape]


def _unsqueezed(ix: Index, name: str) -> tuple[str, onnx.NodeProto] | None:
    """(t, the node) where ``name`` = Unsqueeze(t, [1]) of a 1-D t."""
    node = ix.node(name, "Unsqueeze")
    if node is None:
        return None
    axes = ix.axes(node)
    t = node.input[0]
    shape = ix.dims(t)
    return (t, node) if axes in ([1], [-1]) and shape is not None and len(shape) == 1 else None


def _backward(ix: Index, lp: str) -> dict | None:
    """d = g - Exp(lp) * ReduceSum(g, [1]) with g = ScatterElements(zeros(lp), Unsqueeze(t), Unsqueeze(v), axis=1)."""
    for exp in ix.reader_nodes(lp, "Exp"):
        for mul in ix.reader_nodes(exp.output[0], "Mul"):
            tot = next((b for a, b in ix.operands(mul, "Mul") if a == exp.output[0]), None)
            red = ix.node(tot, "ReduceSum")
            if red is None or ix.axes(red) not in ([1], [-1]) or int(ix.attr(red, "keepdims", 1)) != 1:
                continue
            g = red.input[0]
            sc = ix.node(g, "ScatterElements", 3)
            if sc is None or int(ix.attr(sc, "axis", 0)) != 1 or ix.attr(sc, "reduction", b"none") not in (b"none", "none"):
                continue
            zeros = _zeros_like(ix, sc.input[0], lp)
            target, value = _unsqueezed(ix, sc.input[1]), _unsqueezed(ix, sc.input[2])
            sub = next((s for s in ix.reader_nodes(mul.output[0], "Sub") if list(s.input) == [g, mul.output[0]]), None)
            if zeros is None or target is None or value is None or sub is None:
                continue
            if ix.dtype(target[0]) != TensorProto.INT64 or not ix.all_float(value[0]):
                continue
            nodes = [exp, mul, red, sc, sub, *zeros, target[1], value[1]]
            return {"target": target[0], "value": value[0], "d": sub.output[0], "nodes": nodes}
    return None


def cross_entropies(ix: Index, names: NameGen, domain: str) -> list[Fusion]:
    fusions = []
    for sce in [n for n in ix.nodes if n.op_type == "SoftmaxCrossEntropyLoss" and n.domain in ("", "ai.onnx")]:
        if len(sce.input) > 2 and sce.input[2]:
            continue  # class weights
        reduction = ix.attr(sce, "reduction", b"mean")
        scores, target = sce.input[0], sce.input[1]
        shape = ix.dims(scores)
        if (reduction not in (b"mean", "mean") or not shape or len(shape) != 2 or not isinstance(shape[1], int)
                or shape[1] < VOCABULARY or not ix.all_float(scores)):
            continue
        if ix.dtype(target) != TensorProto.INT64 or len(ix.dims(target) or ()) != 1 or len(sce.output) < 2:
            continue
        lp = sce.output[1]
        back = _backward(ix, lp)
        if back is None:
            continue
        ignore = ix.attr(sce, "ignore_index")
        ignore = constant(names, "xent_ignore", np.asarray([NO_IGNORE if ignore is None else ignore], np.int64))
        lse = names.fresh(lp + "_lse")
        fusions.append(Fusion([sce], [kernel_node("CrossEntropyF32", [scores, target, ignore.name],
                                                  [sce.output[0], lse], sce.name + "/xent", domain)],
                              initializers=[ignore]))
        fusions.append(Fusion(back["nodes"], [kernel_node("CrossEntropyGradF32",
                                                          [scores, lse, back["target"], back["value"]],
                                                          [back["d"]], sce.name + "/xent_grad", domain)]))
    return fusions
