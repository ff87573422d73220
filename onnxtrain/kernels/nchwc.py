"""Convolutions -> onnxruntime's NCHWc kernels, with their filters reordered every step.

onnxruntime's CPU provider has faster convolutions than its Conv: MLAS's
direct NCHWc kernels (domain ``com.microsoft.nchwc``), on tensors whose
channels are laid out in blocks of 8 or 16.  Its own graph optimizer uses
them only for filters that are constant initializers, reordered once when
the session is made.  A training program's filters are state: they change
every step, so onnxruntime keeps its im2col + GEMM Conv there (about 20% to
2x slower on ResNet-18's layers) and its ConvTranspose (slower still).

This pass writes the NCHWc form itself.  Per convolution:

    Wr = ReorderFilterF32(W, [block, flip, blocked])   (the kernel library)
    Xr = ReorderInput(X)                               (if X is blocked)
    Yr = Conv[nchwc](Xr, Wr, B)
    Y  = ReorderOutput(Yr, channels=O)

- ``Conv``: 2-D, one group, float32, explicit pads (auto_pad NOTSET), output
  channels a multiple of the block, input channels a multiple of it too
  (blocked input) or fewer than one block (a first layer's RGB image, read as
  it is).
- ``ConvTranspose`` with stride 1 (the input gradient of a stride-1 Conv, as
  ``Window.scatter`` writes it): the same sums as a Conv of the same input
  with the filter flipped in space and its channel axes swapped, padded by
  the window's reach less the crop.  The filter reorder does the flip.

Each rewritten op computes the same sums as the op it replaces, in another
order: results agree to float32 rounding, not bit for bit (onnxruntime's own
optimizer makes the same trade for inference).  The block is onnxruntime's
(``executor.nchwc_block``, probed); the session passes it in.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.names import NameGen

#: onnxruntime's NCHWc contrib-op domain.
DOMAIN = "com.microsoft.nchwc"
#: The kernel library's filter reorder.
REORDER_KERNEL = "ReorderFilterF32"


def _declared(graph: onnx.GraphProto) -> dict[str, tuple[int, list[int] | None]]:
    """{name: (element type, static dims or None)} of the graph's inputs,
    initializers and value_info."""
    out: dict[str, tuple[int, list[int] | None]] = {}
    for vi in [*graph.input, *graph.value_info]:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim] \
            if t.HasField("shape") else None
        out[vi.name] = (t.elem_type, dims if dims is not None and None not in dims else None)
    for init in graph.initializer:
        out[init.name] = (init.data_type, list(init.dims))
    return out


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _plan(node: onnx.NodeProto, declared: dict, block: int) -> dict | None:
    """How to run ``node`` as an NCHWc Conv: its filter, whether flipped,
    input channels blocked or not, the Conv's attributes and its output
    channels; None to leave it."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("Conv", "ConvTranspose"):
        return None
    if len(node.input) < 2 or not node.input[0] or not node.input[1]:
        return None
    elem, dims = declared.get(node.input[1], (None, None))
    if elem != TensorProto.FLOAT or dims is None or len(dims) != 4 or min(dims) < 1:
        return None
    a = _attrs(node)
    if int(a.get("group", 1)) != 1 or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", b""):
        return None
    kernel = dims[2:]
    if list(a.get("kernel_shape", kernel)) != kernel:
        return None
    strides = list(a.get("strides", [1, 1]))
    dilations = list(a.get("dilations", [1, 1]))
    pads = list(a.get("pads", [0, 0, 0, 0]))
    if len(strides) != 2 or len(dilations) != 2 or len(pads) != 4 or min(strides + dilations) < 1:
        return None
    if node.op_type == "Conv":
        out_ch, in_ch, flip = dims[0], dims[1], False
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    else:
        if (strides != [1, 1] or "output_shape" in a or any(a.get("output_padding", [0, 0]))
                or (len(node.input) > 2 and node.input[2])):
            return None
        reach = [(k - 1) * d for k, d in zip(kernel, dilations)]
        pads = [reach[0] - pads[0], reach[1] - pads[1], reach[0] - pads[2], reach[1] - pads[3]]
        out_ch, in_ch, flip, bias = dims[1], dims[0], True, None
    if min(pads) < 0 or out_ch % block:
        return None
    if in_ch % block == 0:
        blocked = True
    elif in_ch < block and not flip:
        blocked = False
    else:
        return None
    return {"flip": flip, "blocked": blocked, "out": out_ch, "bias": bias,
            "attrs": {"kernel_shape": kernel, "strides": strides, "dilations": dilations, "pads": pads}}


def has_convolutions(model: onnx.ModelProto) -> bool:
    return any(n.op_type in ("Conv", "ConvTranspose") for n in model.graph.node)


def rewrite(model: onnx.ModelProto, block: int, kernel_domain: str) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with every convolution ``_plan`` accepts run by
    onnxruntime's NCHWc kernels (channel block ``block``; below 8, none), and
    how many (0: ``model`` itself).  ``kernel_domain``: the kernel library's
    domain (for the filter reorder)."""
    graph = model.graph
    if block < 8 or not has_convolutions(model):
        return model, 0
    declared = _declared(graph)
    plans = {i: p for i, n in enumerate(graph.node) if (p := _plan(n, declared, block)) is not None}
    if not plans:
        return model, 0
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    names = NameGen.from_graph(g)
    # One layout initializer per kind of reorder, not one per conv.
    layouts: dict[tuple[int, int], str] = {}
    nodes = []
    for i, node in enumerate(g.node):
        plan = plans.get(i)
        if plan is None:
            nodes.append(node)
            continue
        x, w, y = node.input[0], node.input[1], node.output[0]
        kind = (int(plan["flip"]), int(plan["blocked"]))
        if kind not in layouts:
            layouts[kind] = names.fresh("nchwc_filter_layout")
            g.initializer.append(numpy_helper.from_array(np.asarray([block, *kind], dtype=np.int64), layouts[kind]))
        geometry = layouts[kind]
        wr = names.fresh(y + "_filter")
        nodes.append(helper.make_node(REORDER_KERNEL, [w, geometry], [wr], domain=kernel_domain))
        if plan["blocked"]:
            xr = names.fresh(y + "_nchwc_in")
            nodes.append(helper.make_node("ReorderInput", [x], [xr], domain=DOMAIN))
            x = xr
        yr = names.fresh(y + "_nchwc")
        inputs = [x, wr] + ([plan["bias"]] if plan["bias"] else [])
        nodes.append(helper.make_node("Conv", inputs, [yr], name=node.name, domain=DOMAIN, **plan["attrs"]))
        nodes.append(helper.make_node("ReorderOutput", [yr], [y], domain=DOMAIN, channels=plan["out"]))
    del g.node[:]
    g.node.extend(nodes)
    for domain in (DOMAIN, kernel_domain):
        if not any(o.domain == domain for o in out.opset_import):
            out.opset_import.append(helper.make_opsetid(domain, 1))
    return out, len(plans)
