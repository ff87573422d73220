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

**A convolution's column matrix -> ``Im2ColF32``.**  The weight gradient
(``Window.patches``) stacks one strided Slice of the channel-major, padded
input per kernel tap into the column matrix [C*K, N*P] that its one MatMul
contracts.  onnxruntime runs those Slices (and the Transpose, Pad and Concat
around them) as separate passes over memory: 75 ms of a ResNet-18 step.  The
kernel writes the same matrix from the input in one pass: copies, so the
same bits, and the MatMul after it is unchanged.  Rewritten where the input
is float32, rank 4 with a static shape, and every Slice, the Pad (zeros,
+0.0) and the Reshape are the ones ``patches`` writes.

``tests/runtime/test_layer_kernels.py`` checks all three against onnxruntime's
own ops, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph import constant_values, infer_types, is_zero, node_inputs, read_counts, toposort
from .names import NameGen

#: The library ops (domain ``fuse.KERNEL_DOMAIN``).
POOL_KERNEL = "MaxPoolIndicesF32"
IM2COL_KERNEL = "Im2ColF32"


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
        read = {i for n in graph.node for i in node_inputs(n)} | {o.name for o in graph.output}
        kept = [n for n in graph.node if not (n.op_type == "Greater" and n.output[0] not in read)]
        if len(kept) != len(graph.node):
            del graph.node[:]
            graph.node.extend(kept)
    return count


# ------------------------------------------------------------ column matrices
def _ints(values: dict[str, np.ndarray], name: str | None) -> list[int] | None:
    v = values.get(name) if name else None
    return None if v is None or v.dtype.kind not in "iu" else [int(x) for x in v.reshape(-1)]


def _default(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")


def _im2col_geometry(reshape: onnx.NodeProto, producer: dict, values: dict, shapes: dict,
                     types: dict) -> tuple[str, list[int]] | None:
    """(x, [kh, kw, sh, sw, dh, dw, pad_top, pad_left, oh, ow]) when ``reshape``
    makes the column matrix of the float32 image x as ``Window.patches`` writes
    it: Reshape(Concat(Unsqueeze(Slice(Transpose(Pad(x))), [1])..., axis=1),
    [C*K, N*oh*ow]), taps in row-major order; else None."""
    stacked = producer.get(reshape.input[0])
    if stacked is None or not _default(stacked):
        return None
    if stacked.op_type == "Concat":
        axis = {a.name: a.i for a in stacked.attribute}.get("axis")
        if axis != 1:
            return None
        parts = [producer.get(i) for i in stacked.input]
    else:
        parts = [stacked]
    slices = []
    for u in parts:
        if (u is None or u.op_type != "Unsqueeze" or not _default(u) or len(u.input) != 2
                or _ints(values, u.input[1]) != [1]):
            return None
        sl = producer.get(u.input[0])
        if sl is None or sl.op_type != "Slice" or not _default(sl) or len(sl.input) < 3:
            return None
        slices.append(sl)
    source = slices[0].input[0]
    if any(sl.input[0] != source for sl in slices):
        return None
    tr = producer.get(source)
    if tr is None or tr.op_type != "Transpose" or not _default(tr):
        return None
    if [list(a.ints) for a in tr.attribute if a.name == "perm"] != [[1, 0, 2, 3]]:
        return None
    x, pads = tr.input[0], [0, 0, 0, 0]
    pad = producer.get(x)
    if pad is not None and pad.op_type == "Pad" and _default(pad):
        mode = {a.name: a.s for a in pad.attribute}.get("mode", b"constant")
        p = _ints(values, pad.input[1]) if len(pad.input) > 1 else None
        if (mode != b"constant" or p is None or len(p) != 8 or p[:2] != [0, 0] or p[4:6] != [0, 0]
                or min(p) < 0 or len(pad.input) > 3 and pad.input[3]):
            return None
        if len(pad.input) > 2 and pad.input[2] and not is_zero(values, pad.input[2], positive=True):
            return None
        x, pads = pad.input[0], [p[2], p[3], p[6], p[7]]
    dims = shapes.get(x)
    if (types.get(x) != TensorProto.FLOAT or dims is None or len(dims) != 4
            or not all(isinstance(d, int) and d > 0 for d in dims)):
        return None
    n, c, h, w = dims
    hp, wp = h + pads[0] + pads[2], w + pads[1] + pads[3]
    taps = []
    for sl in slices:
        starts, ends = _ints(values, sl.input[1]), _ints(values, sl.input[2])
        axes = _ints(values, sl.input[3]) if len(sl.input) > 3 and sl.input[3] else [0, 1, 2, 3][:len(starts or [])]
        steps = _ints(values, sl.input[4]) if len(sl.input) > 4 and sl.input[4] else [1] * len(axes or [])
        if starts is None or ends is None or axes != [2, 3] or steps is None or len(starts) != 2 \
                or len(ends) != 2 or len(steps) != 2 or min(steps) < 1:
            return None
        taps.append((starts, ends, steps))
    k = len(taps)
    kw = sum(1 for st, _, _ in taps if st[0] == taps[0][0][0])
    if kw < 1 or k % kw:
        return None
    kh = k // kw
    dh = taps[kw][0][0] if kh > 1 else 1
    dw = taps[1][0][1] if kw > 1 else 1
    steps = taps[0][2]
    oh = (taps[0][1][0] - taps[0][0][0] - 1) // steps[0] + 1
    ow = (taps[0][1][1] - taps[0][0][1] - 1) // steps[1] + 1
    if min(dh, dw, oh, ow) < 1:
        return None
    for t, (st, en, sp) in enumerate(taps):
        i, j = divmod(t, kw)
        if st != [i * dh, j * dw] or sp != steps:
            return None
        if en != [st[0] + (oh - 1) * steps[0] + 1, st[1] + (ow - 1) * steps[1] + 1] or en[0] > hp or en[1] > wp:
            return None
    if _ints(values, reshape.input[1]) != [c * k, n * oh * ow]:
        return None
    return x, [kh, kw, *steps, dh, dw, pads[0], pads[1], oh, ow]


def im2col_plan(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                inferred=None) -> dict[str, tuple[str, list[int]]]:
    """{column matrix: (x, geometry)} for every column matrix of a conv weight
    gradient that the kernel makes exactly (``_im2col_geometry``).
    ``inferred``: as for ``max_pool_plan``."""
    nodes = list(graph.node)
    reshapes = [n for n in nodes if n.op_type == "Reshape" and _default(n) and len(n.input) == 2]
    if not reshapes:
        return {}
    producer = {o: n for n in nodes for o in n.output if o}
    candidates = [r for r in reshapes if (producer.get(r.input[0]) is not None
                  and producer[r.input[0]].op_type in ("Concat", "Unsqueeze"))]
    if not candidates:
        return {}
    values = constant_values(graph)
    types, shapes = inferred() if inferred else infer_types(graph, opset_imports)
    plan = {}
    for r in candidates:
        found = _im2col_geometry(r, producer, values, shapes, types)
        if found is not None:
            plan[r.output[0]] = found
    return plan


def fuse_im2cols(graph: onnx.GraphProto, plan: dict[str, tuple[str, list[int]]], domain: str) -> int:
    """Replace the Reshapes of ``plan`` (``im2col_plan``) by the ``domain`` op,
    in place, and drop the Slices, Unsqueezes, Concats, Transposes and Pads
    nothing reads any more.  Returns how many."""
    if not plan:
        return 0
    names = NameGen.from_graph(graph)
    count = 0
    for node in graph.node:
        if node.op_type != "Reshape" or not node.output or node.output[0] not in plan:
            continue
        x, geometry = plan[node.output[0]]
        g = names.fresh(node.output[0] + "_window")
        graph.initializer.append(numpy_helper.from_array(np.asarray(geometry, dtype=np.int64), g))
        del node.input[:]
        del node.attribute[:]
        node.input.extend([x, g])
        node.op_type, node.domain = IM2COL_KERNEL, domain
        count += 1
    if count:
        _drop_unread(graph, {"Concat", "Unsqueeze", "Slice", "Transpose", "Pad"})
    return count


def _drop_unread(graph: onnx.GraphProto, op_types: set[str]) -> None:
    """Remove nodes of ``op_types`` whose outputs nothing reads, repeatedly
    (a chain of them goes at once)."""
    while True:
        read = {i for n in graph.node for i in node_inputs(n)} | {o.name for o in graph.output}
        kept = [n for n in graph.node
                if not (n.op_type in op_types and _default(n) and not any(o in read for o in n.output if o))]
        if len(kept) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(kept)


# ------------------------------------------------------------ BatchNorm's gradient
BN_GRAD_KERNEL = "BatchNormGradF32"


def _reduce(node: onnx.NodeProto | None, op_type: str, values: dict, keepdims: int) -> tuple[str, list[int]] | None:
    """(input, axes) of a ``op_type`` reduction with ``keepdims``, axes as an
    attribute (before opset 18) or a constant input."""
    if node is None or node.op_type != op_type or not _default(node):
        return None
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    if int(a.get("keepdims", 1)) != keepdims or int(a.get("noop_with_empty_axes", 0)):
        return None
    axes = list(a["axes"]) if "axes" in a else _ints(values, node.input[1]) if len(node.input) > 1 else None
    return (node.input[0], axes) if axes else None


def _operands(node: onnx.NodeProto | None, op_type: str) -> list[tuple[str, str]]:
    """Both readings (a, b) of a commutative binary node of ``op_type``."""
    if node is None or node.op_type != op_type or not _default(node) or len(node.input) != 2:
        return []
    a, b = node.input
    return [(a, b), (b, a)] if a != b else [(a, b)]


def _bn_grad(root: onnx.NodeProto, producer: dict, consumers: dict, values: dict,
             types: dict, shapes: dict) -> dict | None:
    """The training-mode BatchNormalization gradient rooted at ``root`` as
    ``rules/norm.py`` writes it (``_batch_stats``, ``_normalize_backward``):
        dx = inv_std * ((g - mean(g)) - xhat * mean(g * xhat)),  g = dy * scale
    with xhat = (x - mean(x)) * inv_std, inv_std = 1 / sqrt(mean((x - mean(x))^2) + eps),
    means over every axis but 1: its tensors, else None."""
    for inv_std, d in _operands(root, "Mul"):
        outer = producer.get(d)
        if outer is None or outer.op_type != "Sub" or not _default(outer):
            continue
        inner, tail = producer.get(outer.input[0]), producer.get(outer.input[1])
        if inner is None or inner.op_type != "Sub" or not _default(inner):
            continue
        g, mean_g = inner.input
        found = _reduce(producer.get(mean_g), "ReduceMean", values, 1)
        if found is None or found[0] != g:
            continue
        axes = found[1]
        for xhat, mean_gx in _operands(tail, "Mul"):
            red = _reduce(producer.get(mean_gx), "ReduceMean", values, 1)
            if red is None or red[1] != axes:
                continue
            if not any({p, q} == {g, xhat} for p, q in _operands(producer.get(red[0]), "Mul")):
                continue
            for centred, inv in _operands(producer.get(xhat), "Mul"):
                if inv != inv_std:
                    continue
                sub = producer.get(centred)
                if sub is None or sub.op_type != "Sub" or not _default(sub):
                    continue
                x, mean_x = sub.input
                if _reduce(producer.get(mean_x), "ReduceMean", values, 1) != (x, axes):
                    continue
                recip = producer.get(inv_std)
                sqrt = producer.get(recip.input[0]) if recip is not None and recip.op_type == "Reciprocal" else None
                if sqrt is None or sqrt.op_type != "Sqrt":
                    continue
                for var, eps in _operands(producer.get(sqrt.input[0]), "Add"):
                    red = _reduce(producer.get(var), "ReduceMean", values, 1)
                    if red is None or red[1] != axes:
                        continue
                    if _operands(producer.get(red[0]), "Mul") != [(centred, centred)]:
                        continue
                    e = values.get(eps)
                    if e is None or e.size != 1 or e.dtype != np.float32:
                        continue
                    for dy, sc in _operands(producer.get(g), "Mul"):
                        unsq = producer.get(sc)
                        if unsq is None or unsq.op_type != "Unsqueeze" or not _default(unsq):
                            continue
                        dims = shapes.get(x)
                        if dims is None or len(dims) < 3 or axes != [0, *range(2, len(dims))]:
                            continue
                        a = {t.name: helper.get_attribute_value(t) for t in unsq.attribute}
                        uaxes = list(a["axes"]) if "axes" in a else _ints(values, unsq.input[1]) if len(unsq.input) > 1 else None
                        if uaxes != list(range(1, len(dims) - 1)):
                            continue
                        scale = unsq.input[0]
                        if any(types.get(t) != TensorProto.FLOAT for t in (x, dy, scale)) or shapes.get(dy) != dims:
                            continue
                        return {"x": x, "dy": dy, "scale": scale, "eps": eps, "xhat": xhat, "axes": axes,
                                "dscale": _sum_of(consumers, producer, values, axes, dy, xhat),
                                "dbias": _sum_of(consumers, producer, values, axes, dy, None)}
    return None


def _sum_of(consumers: dict, producer: dict, values: dict, axes: list[int], dy: str, xhat: str | None) -> str | None:
    """The ReduceSum over ``axes`` (keepdims 0) of dy * xhat (of dy without
    xhat) that the rule writes for dscale (dbias), if there is one."""
    if xhat is None:
        readers = consumers.get(dy, ())
    else:
        readers = [r for m in consumers.get(dy, ()) if any({p, q} == {dy, xhat} for p, q in _operands(m, "Mul"))
                   for r in consumers.get(m.output[0], ())]
    for r in readers:
        if _reduce(r, "ReduceSum", values, 0) is not None and _reduce(r, "ReduceSum", values, 0)[1] == axes:
            return r.output[0]
    return None


def bn_grad_plan(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                 inferred=None) -> dict[str, dict]:
    """{dx: tensors (``_bn_grad``)} for every training-mode BatchNormalization
    gradient the kernel computes."""
    nodes = list(graph.node)
    if not any(n.op_type == "ReduceMean" for n in nodes):
        return {}
    producer = {o: n for n in nodes for o in n.output if o}
    roots = [n for n in nodes if n.op_type == "Mul" and _default(n) and len(n.input) == 2
             and any(producer.get(i) is not None and producer[i].op_type == "Sub" for i in n.input)]
    if not roots:
        return {}
    consumers: dict[str, list] = {}
    for n in nodes:
        for i in node_inputs(n):
            consumers.setdefault(i, []).append(n)
    values = constant_values(graph)
    types, shapes = inferred() if inferred else infer_types(graph, opset_imports)
    plan = {}
    for root in roots:
        found = _bn_grad(root, producer, consumers, values, types, shapes)
        if found is not None:
            plan[root.output[0]] = found
    return plan


def fuse_bn_grads(graph: onnx.GraphProto, plan: dict[str, dict], domain: str) -> int:
    """Replace the gradients of ``plan`` (``bn_grad_plan``) by the ``domain``
    op, in place: its dx is the root's output and its dscale and dbias the
    rule's ReduceSums' (which go); what only they read goes too."""
    if not plan:
        return 0
    names = NameGen.from_graph(graph)
    # A ReduceSum that two gradients share (common subexpressions merged: two
    # BatchNorms fed one dy) is written by the first kernel only.
    sums: set[str] = set()
    for p in plan.values():
        for k in ("dscale", "dbias"):
            if p[k] in sums:
                p[k] = None
            elif p[k]:
                sums.add(p[k])
    nodes = []
    for node in graph.node:
        if node.output and node.output[0] in sums:
            continue  # (the kernel writes it)
        p = plan.get(node.output[0]) if node.op_type == "Mul" and node.output else None
        if p is None:
            nodes.append(node)
            continue
        outs = [node.output[0], p["dscale"] or names.fresh(node.output[0] + "_dscale"),
                p["dbias"] or names.fresh(node.output[0] + "_dbias")]
        nodes.append(helper.make_node(BN_GRAD_KERNEL, [p["x"], p["dy"], p["scale"], p["eps"]], outs,
                                      name=node.name, domain=domain))
    graph.ClearField("node")
    graph.node.extend(_ordered(nodes, graph))
    _drop_unread(graph, {"Mul", "Sub", "Add", "ReduceMean", "ReduceSum", "Reciprocal", "Sqrt", "Unsqueeze"})
    return len(plan)


def _ordered(nodes: list, graph: onnx.GraphProto) -> list:
    """``nodes`` in an order where each runs after what it reads (the kernel
    takes the place of its last node, and may read the ReduceSums' inputs)."""
    available = [i.name for i in graph.input] + [t.name for t in graph.initializer]
    return toposort(nodes, available, where="fused program")


# ------------------------------------------------------------ scatter-add into zeros
SCATTER_KERNEL = "ScatterAddZerosF32"


def scatter_plan(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                 inferred=None) -> dict[str, tuple[str, str, str]]:
    """{ScatterElements output: (size, indices, updates)} for every
    ``ScatterElements(ConstantOfShape(size), indices, updates, axis=0,
    reduction="add")`` of rank 1 into float32 zeros (MaxPool's gradient where
    windows overlap) whose zeros nothing else reads."""
    nodes = list(graph.node)
    scatters = [n for n in nodes if n.op_type == "ScatterElements" and _default(n) and len(n.input) == 3]
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
        if (zeros is None or zeros.op_type != "ConstantOfShape" or not _default(zeros)
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
        _drop_unread(graph, {"ConstantOfShape"})
    return count


# ------------------------------------------------------------ strided transposed windows
COL2IM_KERNEL = "Col2ImF32"


def col2im_plan(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                inferred=None) -> dict[str, tuple[str, str, list[int]]]:
    """{output: (z, w, geometry)} for every float32 ConvTranspose with a stride
    above 1 (a strided Conv's input gradient, ``Window.scatter``), a window
    larger than 1x1, one group, no bias and static shapes.  onnxruntime runs it as one GEMM per image
    (W^T times that image's [M, P] slice: narrow, about 70 GFLOP/s on
    ResNet-18) and a col2im; ``fuse_col2ims`` makes it one GEMM over the whole
    batch and the library's col2im, the same sums in the same order."""
    nodes = [n for n in graph.node if n.op_type == "ConvTranspose" and _default(n) and len(n.input) == 2]
    if not nodes:
        return {}
    types, shapes = inferred() if inferred else infer_types(graph, opset_imports)
    plan = {}
    for node in nodes:
        z, w = node.input
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        zd, wd = shapes.get(z), shapes.get(w)
        if (types.get(z) != TensorProto.FLOAT or types.get(w) != TensorProto.FLOAT or zd is None or wd is None
                or len(zd) != 4 or len(wd) != 4 or not all(isinstance(d, int) and d > 0 for d in [*zd, *wd])):
            continue
        strides = list(a.get("strides", [1, 1]))
        dil = list(a.get("dilations", [1, 1]))
        pads = list(a.get("pads", [0, 0, 0, 0]))
        outpad = list(a.get("output_padding", [0, 0]))
        if (int(a.get("group", 1)) != 1 or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"") or "output_shape" in a
                or len(strides) != 2 or len(dil) != 2 or len(pads) != 4 or len(outpad) != 2
                or max(strides) < 2 or min(strides + dil) < 1 or min(pads + outpad) < 0 or wd[0] != zd[1]):
            continue
        n, m, oh, ow = zd
        c, kh, kw = wd[1:]
        if kh * kw == 1:
            continue  # (a 1x1 window: onnxruntime's own is faster, no col2im)
        h = strides[0] * (oh - 1) + outpad[0] + (kh - 1) * dil[0] + 1 - pads[0] - pads[2]
        w_ = strides[1] * (ow - 1) + outpad[1] + (kw - 1) * dil[1] + 1 - pads[1] - pads[3]
        inferred_y = shapes.get(node.output[0])
        if h < 1 or w_ < 1 or (inferred_y is not None and list(inferred_y) != [n, c, h, w_]):
            continue
        plan[node.output[0]] = (z, w, [kh, kw, *strides, *dil, pads[0], pads[1], oh, ow, c, n, h, w_])
    return plan


def fuse_col2ims(graph: onnx.GraphProto, plan: dict[str, tuple[str, str, list[int]]], domain: str) -> int:
    """Replace the ConvTransposes of ``plan`` (``col2im_plan``): z laid out
    [M, N*P], cols = Gemm(W as [M, C*K], that, transA) and the ``domain``
    op's col2im.  Returns how many."""
    if not plan:
        return 0
    names = NameGen.from_graph(graph)
    nodes = []

    def ints(values, hint):
        name = names.fresh(hint)
        graph.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
        return name

    for node in graph.node:
        if node.op_type != "ConvTranspose" or not node.output or node.output[0] not in plan:
            nodes.append(node)
            continue
        y = node.output[0]
        z, w, g = plan[y]
        kh, kw, oh, ow, c, n = g[0], g[1], g[8], g[9], g[10], g[11]
        zt, z2, w2, cols = (names.fresh(y + s) for s in ("_zt", "_z2", "_w2", "_cols"))
        nodes += [helper.make_node("Transpose", [z], [zt], perm=[1, 0, 2, 3]),
                  helper.make_node("Reshape", [zt, ints([-1, n * oh * ow], y + "_zshape")], [z2]),
                  helper.make_node("Reshape", [w, ints([-1, c * kh * kw], y + "_wshape")], [w2]),
                  helper.make_node("Gemm", [w2, z2], [cols], transA=1),
                  helper.make_node(COL2IM_KERNEL, [cols, ints(g, y + "_window")], [y], name=node.name, domain=domain)]
    graph.ClearField("node")
    graph.node.extend(nodes)
    return len(plan)
