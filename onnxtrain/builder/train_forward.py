"""The training-mode copy of the forward pass (Dropout and BatchNormalization).

The main graph is the inference graph (rule R10); the builder's algorithm
graph needs the same forward pass with Dropout active and BatchNormalization
using batch statistics and updating its running ones.  ``training_forward``
copies only the nodes whose values differ in training mode, keeping the
shapes exporters declared for what it copies.  ``batchnorm_var`` chooses how
running_var is updated: the ONNX rule (biased batch variance) or PyTorch's
(unbiased).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..core.emitter import Emitter
from ..core.graph import DEFAULT_DOMAINS, node_inputs, subgraphs
from .cache import warn

#: ``batchnorm_var`` values: how training-mode BatchNormalization updates running_var.
BATCHNORM_VAR = ("auto", "biased", "unbiased")


def resolve_batchnorm_var(choice: Any, proto: onnx.ModelProto) -> str:
    """"biased" (the ONNX rule) or "unbiased" (PyTorch's); "auto" picks
    "unbiased" when the model's producer_name is "pytorch" (any case)."""
    if choice not in BATCHNORM_VAR:
        raise ValueError(f"batchnorm_var must be one of {list(BATCHNORM_VAR)}, got {choice!r}")
    if choice == "auto":
        return "unbiased" if proto.producer_name.strip().lower() == "pytorch" else "biased"
    return choice


def training_forward(
    e: Emitter, main: onnx.GraphProto, prediction: str, opset: int,
    types: Callable[[str, str], onnx.ValueInfoProto | None], batchnorm_var: str = "biased",
) -> tuple[str, list[tuple[str, str]], list[onnx.ValueInfoProto]]:
    """Copy the part of the forward pass that runs differently in training mode.

    Nodes on the path to ``prediction`` are copied from the first Dropout or
    BatchNormalization on: those ops in training mode, the nodes downstream
    of them with renamed inputs; every copy writes fresh names.  Nodes
    upstream are shared with the main graph (their values are the same).
    ``types(original, new)`` gives the value_info of a copied value under its
    new name (the original's type and shape): exporters declare shapes that
    shape inference cannot derive (a Reshape to a computed shape), and ops
    such as BatchNormalization need them.  Returns the copy's prediction (the
    main one when nothing differs), (running statistic initializer, its new
    value) pairs and the value_info of the renamed values."""
    nodes = list(main.node)
    needed = _ancestors(nodes, prediction)
    inits = {t.name: t for t in main.initializer}
    renamed: dict[str, str] = {}
    stats: list[tuple[str, str]] = []
    value_info: list[onnx.ValueInfoProto] = []
    for position, node in enumerate(nodes):
        if position not in needed:
            continue
        kind = node.op_type if node.domain in DEFAULT_DOMAINS else ""
        mode_op = kind in ("Dropout", "BatchNormalization")
        if not mode_op and not any(i in renamed for i in node_inputs(node)):
            continue
        copy, slots = _training_copy(e, node, kind, renamed, opset)
        del copy.output[:]
        for original, hint in slots:
            if not original and hint == "":
                copy.output.append("")
                continue
            new = e.names.fresh(f"train/{original or hint}")
            copy.output.append(new)
            if original:
                renamed[original] = new
                if original in e.dtypes:
                    e.dtypes[new] = e.dtypes[original]
                vi = types(original, new)
                if vi is not None:
                    value_info.append(vi)
        if kind == "Dropout":
            e.dtypes[copy.output[1]] = TensorProto.BOOL
        e.nodes.append(copy)
        if kind == "BatchNormalization":
            _running_statistics(e, node, copy, inits, batchnorm_var, stats, value_info)
    return renamed.get(prediction, prediction), stats, value_info


def _training_copy(
    e: Emitter, node: onnx.NodeProto, kind: str, renamed: dict[str, str], opset: int
) -> tuple[onnx.NodeProto, list[tuple[str, str]]]:
    """A fresh-named copy of ``node`` reading the renamed values, in training mode, and its
    output slots: (original output or "", name hint) each."""
    if subgraphs(node):
        raise ValueError(
            f"train_mode: node {node.name or node.op_type!r} ({node.op_type}) has a subgraph and "
            "depends on Dropout/BatchNormalization; its training-mode copy is not supported "
            "(use train_mode=False)"
        )
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = e.names.fresh(f"train/{node.name or node.op_type}")
    del copy.input[:]
    copy.input.extend(renamed.get(i, i) for i in node.input)
    if kind == "Dropout":
        _dropout_training(e, copy)
        slots = [(node.output[0], "output"), (_output(node, 1), "mask")]
    elif kind == "BatchNormalization":
        _batch_norm_training(copy, opset)
        extra = ["running_mean", "running_var"] + (["saved_mean", "saved_var"] if opset < 14 else [])
        slots = [(node.output[0], "Y")] + [("", hint) for hint in extra]
    else:
        slots = [(o, o) for o in node.output]
    return copy, slots


def _running_statistics(
    e: Emitter, node: onnx.NodeProto, copy: onnx.NodeProto, inits: dict[str, onnx.TensorProto],
    batchnorm_var: str, stats: list[tuple[str, str]], value_info: list[onnx.ValueInfoProto],
) -> None:
    """The types of a training BatchNormalization's extra outputs, and its (statistic, new value) pairs."""
    for stat, new in zip(node.input[3:5], copy.output[1:3]):
        e.dtypes[new] = e.dtypes.get(stat, TensorProto.FLOAT)
        if stat in inits:
            t = inits[stat]
            value_info.append(helper.make_tensor_value_info(new, t.data_type, list(t.dims)))
    for extra_out in copy.output[3:5]:  # opset 13: saved mean / variance, shaped like a stat
        e.dtypes[extra_out] = e.dtypes.get(node.input[3], TensorProto.FLOAT)
    new_stats = list(copy.output[1:3])
    if batchnorm_var == "unbiased" and node.input[4] in inits:
        new_stats[1] = _unbiased_running_var(e, node, copy.input[0], new_stats[1])
        t = inits[node.input[4]]
        value_info.append(helper.make_tensor_value_info(new_stats[1], t.data_type, list(t.dims)))
    for stat, new in zip(node.input[3:5], new_stats):
        if stat not in inits:
            warn(
                f"train_mode: BatchNormalization node {node.name or node.op_type!r} reads its "
                f"running statistic from {stat!r}, which is not an initializer; the statistic "
                "is not updated by training",
                stacklevel=7,  # the caller of training_model
            )
            continue
        if any(key == stat for key, _ in stats):
            raise ValueError(
                f"train_mode: initializer {stat!r} is the running statistic of two "
                "BatchNormalization nodes; it can be updated by only one"
            )
        stats.append((stat, new))


def _unbiased_running_var(e: Emitter, node: onnx.NodeProto, x: str, onnx_var: str) -> str:
    """PyTorch's running variance from the ONNX one (same batch, same momentum).

    With m the ONNX momentum (PyTorch's is 1 - m), v the old running
    variance, b the biased batch variance and n = N * prod(spatial dims) the
    number of values per channel:

        onnx  = m v + (1 - m) b
        torch = m v + (1 - m) b n / (n - 1) = onnx + (onnx - m v) / (n - 1)

    since (1 - m) b = onnx - m v.  n is read from the runtime shape of X as
    size(X) / shape(X)[1]; n - 1 is clamped to >= 1 (with n = 1 the batch
    variance is 0, and onnx - m v = 0 too)."""
    old = node.input[4]
    momentum = next((a.f for a in node.attribute if a.name == "momentum"), 0.9)
    e.hint = "batchnorm"
    channels = e.Gather(e.Shape(x), e.scalar_int(1), axis=0)
    n = e.Div(e.Size(x), channels)
    n_minus_1 = e.Max(e.Sub(n, e.scalar_int(1)), e.scalar_int(1))
    increment = e.Sub(onnx_var, e.Mul(e.const(momentum, like=old), old))
    return e.Add(onnx_var, e.Div(increment, e.Cast(n_minus_1, to=e.dtype(old))))


def _output(node: onnx.NodeProto, i: int) -> str:
    return node.output[i] if len(node.output) > i else ""


def _ancestors(nodes: Sequence[onnx.NodeProto], output: str) -> set[int]:
    """Positions of the nodes ``output`` depends on."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    seen: set[int] = set()
    stack = [output]
    while stack:
        i = producer.get(stack.pop())
        if i is None or i in seen:
            continue
        seen.add(i)
        stack.extend(node_inputs(nodes[i]))
    return seen


def _dropout_training(e: Emitter, node: onnx.NodeProto) -> None:
    """Inputs (data, ratio, training_mode=true); the seed attribute is kept.

    ratio defaults to 0.5 as in the spec.  The caller names the outputs
    (output, mask): the backward pass reuses the mask."""
    ratio = node.input[1] if len(node.input) > 1 and node.input[1] else e.const(0.5, dtype=np.float32)
    data = node.input[0]
    del node.input[:]
    node.input.extend([data, ratio, e.const(np.asarray(True))])


def _batch_norm_training(node: onnx.NodeProto, opset: int) -> None:
    """BatchNormalization in training mode (the caller names its outputs).

    Opset >= 14: training_mode=1, outputs (Y, running_mean, running_var).
    Opset 13: training mode is chosen by the extra outputs (Y, running_mean,
    running_var, saved_mean, saved_var).  running = momentum * running +
    (1 - momentum) * batch statistic, as ONNX defines it (the batch variance
    is the biased one)."""
    if opset >= 14:
        kept = [a for a in node.attribute if a.name != "training_mode"]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.append(helper.make_attribute("training_mode", 1))
