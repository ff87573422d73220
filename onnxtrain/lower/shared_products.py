"""Narrow products that share their left operand, batched into one before
the gradients are expanded.

LoRA puts a rank-r adapter on each projection, and the projections of a
layer read one activation: the query, key and value (and the MLP's gate and
up) each compute ``x A_i`` with ``A_i`` [d, r].  Apart, each of these
products reads all of ``x``, and so does each of their gradients:

    dA_i = x^T dh_i        dx += dh_i A_i^T        (a pass over [rows, d] each)

Batched as ``h = x [A_1 .. A_k]`` and split, the gradient rules of Concat,
MatMul and Split make one product of each of these, and one term of ``dx``:
``x`` is read and ``dx`` written once per layer instead of k times.

``batch(graph, opset, names)``: MatMul nodes of the top-level graph whose
right operand is a graph input or initializer of static shape [d, n] with
n <= ``MAX_COLUMNS``, grouped by (left operand, d, element type); a group of
two or more becomes Concat, MatMul, Split writing the same outputs, at the
place of its first node (the operands are defined there: graph inputs and
the shared left operand).  Wider products (the projections themselves) are
left alone: their concatenation would copy the weights at every step.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx

from ..core.emitter import Emitter
from ..core.names import NameGen

#: The widest right operand batched (a LoRA rank; a projection is far wider).
MAX_COLUMNS = 64


def _operands(graph: onnx.GraphProto) -> dict[str, tuple[int, int, int]]:
    """Graph inputs and initializers of static 2-D shape: name -> (rows, columns, element type)."""
    found = {}
    for vi in graph.input:
        t = vi.type.tensor_type
        dims = t.shape.dim if t.HasField("shape") else []
        if len(dims) == 2 and all(d.HasField("dim_value") for d in dims):
            found[vi.name] = (dims[0].dim_value, dims[1].dim_value, t.elem_type)
    for init in graph.initializer:
        if len(init.dims) == 2:
            found[init.name] = (int(init.dims[0]), int(init.dims[1]), init.data_type)
    return found


def _groups(graph: onnx.GraphProto, operands: dict[str, tuple[int, int, int]]) -> Iterator[list[int]]:
    """Positions of the MatMul nodes of each batchable group (two or more)."""
    groups: dict[tuple, list[int]] = {}
    for i, node in enumerate(graph.node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        shape = operands.get(node.input[1])
        if shape is not None and shape[1] <= MAX_COLUMNS and node.input[0] != node.input[1]:
            groups.setdefault((node.input[0], shape[0], shape[2]), []).append(i)
    yield from (g for g in groups.values() if len(g) > 1)


def batch(graph: onnx.GraphProto, opset: int, names: NameGen) -> int:
    """Batch the groups of the module docstring, in place; how many products went."""
    operands = _operands(graph)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    count = 0
    for group in _groups(graph, operands):
        count += len(group)
        members = [graph.node[i] for i in group]
        e = Emitter(opset, names, hint=f"{members[0].name or members[0].output[0]}/batched")
        right = [m.input[1] for m in members]
        product = e.MatMul(members[0].input[0], e.Concat(*right, axis=1))
        e.split(product, [operands[r][1] for r in right], axis=-1, outputs=[m.output[0] for m in members])
        replaced[group[0]] = e.nodes
        replaced.update((i, []) for i in group[1:])
    if count:
        nodes = [m for i, node in enumerate(graph.node) for m in replaced.get(i, [node])]
        del graph.node[:]
        graph.node.extend(nodes)
    return count
