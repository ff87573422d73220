"""Layer ops and gradients that onnxruntime runs slowly -> the kernel library.

**MaxPool with its Indices output -> ``MaxPoolIndicesF32``.**
Differentiating MaxPool asks the forward node for its Indices (the gradient
is placed there).  onnxruntime computes MaxPool with Indices in a general
loop: on W2's first pool (64 x 32 x 26 x 26, 2 x 2 windows) it takes
2.6-2.9 ms against 0.2-0.3 ms without Indices.  The library's kernel gives
the same Y and Indices, bit for bit (the same comparison in the same order:
a window's first element, replaced only by a greater one), in about a tenth
of the time.  The rewrite is exact or not made: float32, 2-D windows
(rank-4 input with static height and width), dilation 1, row-major indices
(storage_order 0), explicit pads smaller than the window (auto_pad NOTSET)
and floor rounding (ceil_mode 0), so the output size is
(H + pads - k) // s + 1 on both axes, which the node takes as an input with
the rest of the geometry.

**Relu's gradient -> ``ReluGradF32/F64``.**  The rule writes
``Where(Greater(y, 0), dy, 0)``; onnxruntime's Where is a single-threaded
general broadcast loop, 10-30x slower than a Mul of the same size (W4's FFN
mask, 16 x 64 x 512, took about a third of the step).  The kernel computes
``(y > 0 ? dy : 0) + 0`` in one pass: the same bits (NaN in y gives 0, NaN
in dy passes where y > 0, and a selected -0.0 becomes +0.0, as onnxruntime's
Where adds its two selections).  Rewritten where y and dy have one static shape and
both zeros are +0.0 constants.

**MaxPool's gradient where windows overlap -> ``ScatterAddZerosF32``.**
The rule scatters dy into zeros at the Indices (``ScatterElements`` with
reduction "add" into a ConstantOfShape); onnxruntime copies the zeros and
scatters in a general loop.  The kernel zero-fills and adds in index order:
the same sums, the same bits.

Convolutions have modules of their own: ``fuse_conv`` (column matrices for
weight gradients, col2im for strided input gradients) and ``fuse_norm``
(BatchNormalization's gradient); ``nchwc`` puts convolutions on
onnxruntime's NCHWc kernels.

``tests/runtime/test_layer_kernels.py`` and ``test_conv_kernels.py`` check
each kernel against onnxruntime's own ops, bit for bit where the kernel
claims it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.graph import constant_values, infer_types, is_zero, node_inputs, read_counts
from ..core.names import NameGen

#: The library op (domain ``fuse.KERNEL_DOMAIN``).
POOL_KERNEL = "MaxPoolIndicesF32"


def shared_inference(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto]):
    """A function giving ``infer_types(graph, opset_imports)``, computed on its
    first call and kept: for the plans made on one unchanged graph."""
    kept: list = []

    def inferred():
        if not kept:
            kept.append(infer_types(graph, opset_imports))
        return kept[0]
    return inferred


def _geometry(node: onnx.NodeProto, dims) -> list[int] | None:
    """[kh, kw, sh, sw, pad_top, pad_left, oh, ow] when the kernel computes
    exactly what ``node`` does on an input of ``dims``, else None."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    kernel = list(a.get("kernel_shape", []))
    if len(kernel) != 2 or dims is None or len(dims) != 4:
        return None
    h, w = dims[2], dims[3]
    if not (isinstance(h, int) and isinstance(w, int)):
        return None
    strides = list(a.get("strides", [1, 1]))
    pads = list(a.get("pads", [0, 0, 0, 0]))
    if (list(a.get("dilations", [1, 1])) != [1, 1] or int(a.get("storage_order", 0)) != 0
            or int(a.get("ceil_mode", 0)) != 0 or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"")):
        return None
    if len(strides) != 2 or len(pads) != 4 or min(kernel + strides) < 1 or min(pads) < 0:
        return None
    if any(p >= k for p, k in zip(pads, kernel + kernel)):
        return None
    oh = (h + pads[0] + pads[2] - kernel[0]) // strides[0] + 1
    ow = (w + pads[1] + pads[3] - kernel[1]) // strides[1] + 1
    if oh < 1 or ow < 1:
        return None
    return [*kernel, *strides, pads[0], pads[1], oh, ow]


def max_pool_plan(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                  inferred=None) -> dict[str, list[int]]:
    """{Indices output: geometry} for every MaxPool with Indices that the
    kernel computes exactly.  Made on the graph as onnx can still infer it,
    before other rewrites put ops without schemas in it.  ``inferred``
    (``shared_inference``): the graph's types and shapes, where the caller
    shares them."""
    pools = [n for n in graph.node if n.op_type == "MaxPool" and n.domain in ("", "ai.onnx")
             and len(n.output) >= 2 and n.output[1]]
    if not pools:
        return {}
    types, shapes = inferred() if inferred else infer_types(graph, opset_imports)
    plan = {}
    for node in pools:
        x = node.input[0]
        if types.get(x) != TensorProto.FLOAT:
            continue
        geometry = _geometry(node, shapes.get(x))
        if geometry is None:
            continue
        inferred = shapes.get(node.output[0])
        if inferred is not None and list(inferred[2:]) != geometry[6:]:
            continue  # (onnx's inference disagrees: leave it to onnxruntime)
        plan[node.output[1]] = geometry
    return plan


def fuse_max_pools(graph: onnx.GraphProto, plan: dict[str, list[int]], domain: str) -> int:
    """Replace the MaxPool nodes of ``plan`` (``max_pool_plan``) by the
    ``domain`` op, in place.  Returns how many."""
    if not plan:
        return 0
    names = NameGen.from_graph(graph)
    count = 0
    for node in graph.node:
        if node.op_type != "MaxPool" or len(node.output) < 2 or node.output[1] not in plan:
            continue
        geometry = plan[node.output[1]]
        g = names.fresh(node.output[0] + "_window")
        graph.initializer.append(numpy_helper.from_array(np.asarray(geometry, dtype=np.int64), g))
        x, outputs = node.input[0], list(node.output[:2])
        del node.attribute[:]
        del node.input[:]
        del node.output[:]
        node.input.extend([x, g])
        node.output.extend(outputs)
        node.op_type, node.domain = POOL_KERNEL, domain
        count += 1
    return count


#: The library's Relu-gradient ops, by element type.
RELU_GRAD = {TensorProto.FLOAT: "ReluGradF32", TensorProto.DOUBLE: "ReluGradF64"}


def relu_grad_plan(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                   inferred=None) -> dict[str, tuple[str, str, int]]:
    """{Where output: (y, dy, element type)} for every ``Where(Greater(y, 0), dy, 0)``
    with y and dy of one static float32/float64 shape and +0.0 zeros."""
    nodes = list(graph.node)
    wheres = [n for n in nodes if n.op_type == "Where" and n.domain in ("", "ai.onnx") and len(n.input) == 3]
    if not wheres:
        return {}
    producer = {o: n for n in nodes for o in n.output if o}
    candidates = []
    for w in wheres:
        gt = producer.get(w.input[0])
        if gt is not None and gt.op_type == "Greater" and gt.domain in ("", "ai.onnx"):
            candidates.append((w, gt))
    if not candidates:
        return {}
    values = constant_values(graph)
    types, shapes = inferred() if inferred else infer_types(graph, opset_imports)
    plan = {}
    for w, gt in candidates:
        y, zero_y = gt.input
        dy, zero = w.input[1], w.input[2]
        et = types.get(y)
        if et not in RELU_GRAD or types.get(dy) != et or types.get(w.output[0]) != et:
            continue
        if not (is_zero(values, zero_y) and is_zero(values, zero, positive=True)):
            continue
        sy, sdy = shapes.get(y), shapes.get(dy)
        if sy is None or sy != sdy or not all(isinstance(d, int) for d in sy):
            continue
        plan[w.output[0]] = (y, dy, et)
    return plan


def fuse_relu_grads(graph: onnx.GraphProto, plan: dict[str, tuple[str, str, int]], domain: str) -> int:
    """Replace the Where nodes of ``plan`` (``relu_grad_plan``) by the ``domain``
    op, in place, and drop the Greater nodes nothing reads any more.
    Returns how many."""
    count = 0
    for node in graph.node:
        if node.op_type != "Where" or not node.output or node.output[0] not in plan:
            continue
        y, dy, et = plan[node.output[0]]
        del node.input[:]
        del node.attribute[:]
        node.input.extend([y, dy])
        node.op_type, node.domain = RELU_GRAD[et], domain
        count += 1
    if count:
        drop_unread(graph, {"Greater"})
    return count


# ------------------------------------------------------------ shared by the rewrites
def const_ints(values: dict[str, np.ndarray], name: str | None) -> list[int] | None:
    """The int values of a constant (``constant_values``), or None."""
    v = values.get(name) if name else None
    return None if v is None or v.dtype.kind not in "iu" else [int(x) for x in v.reshape(-1)]


def default_domain(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is in the default ONNX domain."""
    return node.domain in ("", "ai.onnx")


def drop_unread(graph: onnx.GraphProto, op_types: set[str]) -> None:
    """Remove nodes of ``op_types`` whose outputs nothing reads, repeatedly
    (a chain of them goes at once)."""
    while True:
        read = {i for n in graph.node for i in node_inputs(n)} | {o.name for o in graph.output}
        kept = [n for n in graph.node
                if not (n.op_type in op_types and default_domain(n) and not any(o in read for o in n.output if o))]
        if len(kept) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(kept)


# ------------------------------------------------------------ scatter-add into zeros
SCATTER_KERNEL = "ScatterAddZerosF32"


def scatter_plan(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                 inferred=None) -> dict[str, tuple[str, str, str]]:
    """{ScatterElements output: (size, indices, updates)} for every
    ``ScatterElements(ConstantOfShape(size), indices, updates, axis=0,
    reduction="add")`` of rank 1 into float32 zeros (MaxPool's gradient where
    windows overlap) whose zeros nothing else reads."""
    nodes = list(graph.node)
    scatters = [n for n in nodes if n.op_type == "ScatterElements" and default_domain(n) and len(n.input) == 3]
    if not scatters:
        return {}
    producer = {o: n for n in nodes for o in n.output if o}
    readers = read_counts(nodes, (o.name for o in graph.output))
    types = shapes = None
    plan = {}
    for sc in scatters:
        a = {x.name: helper.get_attribute_value(x) for x in sc.attribute}
        if a.get("reduction") != b"add" or int(a.get("axis", 0)) != 0:
            continue
        zeros = producer.get(sc.input[0])
        if (zeros is None or zeros.op_type != "ConstantOfShape" or not default_domain(zeros)
                or readers.get(sc.input[0]) != 1):
            continue
        value = [x.t for x in zeros.attribute if x.name == "value"]
        if value:
            v = numpy_helper.to_array(value[0])
            if v.dtype != np.float32 or v.size != 1 or v.reshape(-1)[0] != 0 or np.signbit(v.reshape(-1)[0]):
                continue
        if types is None:
            types, shapes = inferred() if inferred else infer_types(graph, opset_imports)
        if (types.get(sc.input[1]) != TensorProto.INT64 or types.get(sc.input[2]) != TensorProto.FLOAT
                or types.get(sc.output[0]) != TensorProto.FLOAT):
            continue
        # rank-1 zeros (a one-element shape), indices and updates: an
        # elementwise scatter (not rows of a matrix, as an embedding's gradient)
        if (list(shapes.get(zeros.input[0]) or []) != [1] or len(shapes.get(sc.input[1]) or ()) != 1
                or len(shapes.get(sc.input[2]) or ()) != 1):
            continue
        plan[sc.output[0]] = (zeros.input[0], sc.input[1], sc.input[2])
    return plan


def fuse_scatters(graph: onnx.GraphProto, plan: dict[str, tuple[str, str, str]], domain: str) -> int:
    """Replace the ScatterElements of ``plan`` (``scatter_plan``) by the
    ``domain`` op, in place, and drop their ConstantOfShapes.  Returns how many."""
    count = 0
    for node in graph.node:
        if node.op_type != "ScatterElements" or not node.output or node.output[0] not in plan:
            continue
        del node.input[:]
        del node.attribute[:]
        node.input.extend(plan[node.output[0]])
        node.op_type, node.domain = SCATTER_KERNEL, domain
        count += 1
    if count:
        drop_unread(graph, {"ConstantOfShape"})
    return count
