"""Convolution windows that onnxruntime's standard ops run slowly -> the kernel library.

**A convolution's column matrix -> ``Im2ColF32``.**  The weight gradient
(``Window.patches``) stacks one strided Slice of the channel-major, padded
input per kernel tap into the column matrix [C*K, N*P] that its one MatMul
contracts.  onnxruntime runs those Slices (and the Transpose, Pad and Concat
around them) as separate passes over memory: 75 ms of a ResNet-18 step.  The
kernel writes the same matrix from the input in one pass: copies, so the
same bits, and the MatMul after it is unchanged.  Rewritten where the input
is float32, rank 4 with a static shape, and every Slice, the Pad (zeros,
+0.0) and the Reshape are the ones ``patches`` writes.

**A strided input gradient -> one GEMM and ``Col2ImF32``.**  The rule writes
a strided Conv's input gradient as a ConvTranspose (``Window.scatter``).
onnxruntime runs it as one GEMM per image, W^T [C*K, M] times that image's
[M, P] (narrow: about 70 GFLOP/s on ResNet-18's strided layers), then a
col2im.  Here z is laid out [M, N*P] once, one Gemm (transA) makes the
whole batch's column matrix, and the library's col2im sums the taps in the
order onnxruntime's does: the same bits.  Not for 1x1 windows (onnxruntime
skips its col2im there) or stride 1 (``nchwc`` takes those).

``tests/runtime/test_conv_kernels.py`` checks both bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.graph import constant_values, infer_types, is_zero
from ..core.names import NameGen
from .layers import const_ints, default_domain, drop_unread

#: The library ops (domain ``fuse.KERNEL_DOMAIN``).
IM2COL_KERNEL = "Im2ColF32"
COL2IM_KERNEL = "Col2ImF32"


def _im2col_geometry(reshape: onnx.NodeProto, producer: dict, values: dict, shapes: dict,
                     types: dict) -> tuple[str, list[int]] | None:
    """(x, [kh, kw, sh, sw, dh, dw, pad_top, pad_left, oh, ow]) when ``reshape``
    makes the column matrix of the float32 image x as ``Window.patches`` writes
    it: Reshape(Concat(Unsqueeze(Slice(Transpose(Pad(x))), [1])..., axis=1),
    [C*K, N*oh*ow]), taps in row-major order; else None."""
    stacked = producer.get(reshape.input[0])
    if stacked is None or not default_domain(stacked):
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
        if (u is None or u.op_type != "Unsqueeze" or not default_domain(u) or len(u.input) != 2
                or const_ints(values, u.input[1]) != [1]):
            return None
        sl = producer.get(u.input[0])
        if sl is None or sl.op_type != "Slice" or not default_domain(sl) or len(sl.input) < 3:
            return None
        slices.append(sl)
    source = slices[0].input[0]
    if any(sl.input[0] != source for sl in slices):
        return None
    tr = producer.get(source)
    if tr is None or tr.op_type != "Transpose" or not default_domain(tr):
        return None
    if [list(a.ints) for a in tr.attribute if a.name == "perm"] != [[1, 0, 2, 3]]:
        return None
    x, pads = tr.input[0], [0, 0, 0, 0]
    pad = producer.get(x)
    if pad is not None and pad.op_type == "Pad" and default_domain(pad):
        mode = {a.name: a.s for a in pad.attribute}.get("mode", b"constant")
        p = const_ints(values, pad.input[1]) if len(pad.input) > 1 else None
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
        starts, ends = const_ints(values, sl.input[1]), const_ints(values, sl.input[2])
        axes = const_ints(values, sl.input[3]) if len(sl.input) > 3 and sl.input[3] else [0, 1, 2, 3][:len(starts or [])]
        steps = const_ints(values, sl.input[4]) if len(sl.input) > 4 and sl.input[4] else [1] * len(axes or [])
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
    if const_ints(values, reshape.input[1]) != [c * k, n * oh * ow]:
        return None
    return x, [kh, kw, *steps, dh, dw, pads[0], pads[1], oh, ow]


def im2col_plan(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                inferred=None) -> dict[str, tuple[str, list[int]]]:
    """{column matrix: (x, geometry)} for every column matrix of a conv weight
    gradient that the kernel makes exactly (``_im2col_geometry``).
    ``inferred``: as for ``max_pool_plan``."""
    nodes = list(graph.node)
    reshapes = [n for n in nodes if n.op_type == "Reshape" and default_domain(n) and len(n.input) == 2]
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
        drop_unread(graph, {"Concat", "Unsqueeze", "Slice", "Transpose", "Pad"})
    return count


# ------------------------------------------------------------ strided transposed windows
def col2im_plan(graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                inferred=None) -> dict[str, tuple[str, str, list[int]]]:
    """{output: (z, w, geometry)} for every float32 ConvTranspose with a stride
    above 1 (a strided Conv's input gradient, ``Window.scatter``), a window
    larger than 1x1, one group, no bias and static shapes.  onnxruntime runs it as one GEMM per image
    (W^T times that image's [M, P] slice: narrow, about 70 GFLOP/s on
    ResNet-18) and a col2im; ``fuse_col2ims`` makes it one GEMM over the whole
    batch and the library's col2im, the same sums in the same order."""
    nodes = [n for n in graph.node if n.op_type == "ConvTranspose" and default_domain(n) and len(n.input) == 2]
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
