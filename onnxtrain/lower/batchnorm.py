"""BatchNormalization in training mode as standard ops, for providers that refuse it.

onnxruntime's CUDA provider refuses ``BatchNormalization`` with
``training_mode=1`` from opset 14 on ("Training mode does not support BN
opset 14 (or higher) yet", onnxruntime 1.31), which every training program
of a network with batch norm holds in its forward pass.  ``standard_batch_norm``
writes each such node as the arithmetic the spec gives it, over the axes
other than the channel axis (1):

    mean = ReduceMean(X),  var = ReduceMean((X - mean)²)       (population variance)
    Y = (X - mean) / sqrt(var + epsilon) * scale + B
    running_mean = input_mean * momentum + mean * (1 - momentum)
    running_var  = input_var  * momentum + var  * (1 - momentum)

The node's backward graph (made before, by autodiff) reads only its
inputs and outputs, so it is unchanged.  A node whose input rank shape
inference cannot tell, or whose inputs differ in element type, stays.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..core.graph import infer_types
from ..core.names import NameGen


def is_training_batch_norm(node: onnx.NodeProto) -> bool:
    return node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and any(
        a.name == "training_mode" and a.i == 1 for a in node.attribute)


def standard_batch_norm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with its main graph's training-mode batch norms as standard
    ops (a copy where one changes; ``model`` itself otherwise), and how many."""
    if not any(is_training_batch_norm(n) for n in model.graph.node):
        return model, 0
    dtypes, shapes = infer_types(model.graph, list(model.opset_import), model.ir_version)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = NameGen({v for n in out.graph.node for v in (*n.input, *n.output)}
                    | {t.name for t in out.graph.initializer} | {i.name for i in out.graph.input})
    nodes, count = [], 0
    for node in out.graph.node:
        written = _written(node, dtypes, shapes, opset, names) if is_training_batch_norm(node) else None
        if written is None:
            nodes.append(node)
        else:
            nodes.extend(written)
            count += 1
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return (out, count) if count else (model, 0)


def _written(node: onnx.NodeProto, dtypes: dict, shapes: dict, opset: int,
             names: NameGen) -> list[onnx.NodeProto] | None:
    """The standard ops of one training-mode node, or None where it must stay."""
    x = node.input[0]
    shape = shapes.get(x)
    types = {dtypes.get(v) for v in node.input[:5]}
    if shape is None or len(shape) < 2 or len(types) != 1 or None in types:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    eps, momentum = float(attrs.get("epsilon", 1e-5)), float(attrs.get("momentum", 0.9))
    dtype = helper.tensor_dtype_to_np_dtype(types.pop())
    rank = len(shape)
    base = NameGen.base(node.name or node.output[0])
    nodes: list[onnx.NodeProto] = []

    def fresh(hint: str) -> str:
        return names.fresh(f"{base}/{hint}")

    def const(hint: str, value) -> str:
        name = fresh(hint)
        nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name)))
        return name

    def op(op_type: str, inputs: list[str], hint: str, output: str | None = None, **kw) -> str:
        out = output or fresh(hint)
        nodes.append(helper.make_node(op_type, inputs, [out], name=fresh(op_type), **kw))
        return out

    axes = [0, *range(2, rank)]

    def mean_of(v: str, hint: str) -> str:
        if opset >= 18:
            return op("ReduceMean", [v, const("axes", np.array(axes, np.int64))], hint, keepdims=1)
        return op("ReduceMean", [v], hint, axes=axes, keepdims=1)

    def per_channel(v: str, hint: str) -> str:  # [C] -> [1, C, 1, ...]
        return op("Unsqueeze", [v, const("channel_axes", np.array(axes, np.int64))], hint)

    mean = mean_of(x, "mean")
    centered = op("Sub", [x, mean], "centered")
    var = mean_of(op("Mul", [centered, centered], "squared"), "var")
    std = op("Sqrt", [op("Add", [var, const("epsilon", np.array(eps, dtype))], "var_eps")], "std")
    normed = op("Div", [centered, std], "normed")
    scaled = op("Mul", [normed, per_channel(node.input[1], "scale")], "scaled")
    op("Add", [scaled, per_channel(node.input[2], "bias")], "y", output=node.output[0])
    keep, take = const("momentum", np.array(momentum, dtype)), const("one_minus_momentum", np.array(1 - momentum, dtype))
    flat = const("flat", np.array([-1], np.int64))
    for i, (batch, hint) in enumerate(((mean, "running_mean"), (var, "running_var")), start=1):
        if len(node.output) > i and node.output[i]:
            new = op("Mul", [op("Reshape", [batch, flat], f"batch_{hint}"), take], f"new_{hint}")
            old = op("Mul", [node.input[2 + i], keep], f"old_{hint}")
            op("Add", [old, new], hint, output=node.output[i])
    return nodes
