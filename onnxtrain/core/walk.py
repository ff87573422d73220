"""The graphs of a model: its main graph, its training graphs and every
subgraph below them (If branches, Loop and Scan bodies).

The one walker of the package (``core.graph`` and ``core.protos`` hand it
on); it imports nothing of onnxtrain's, so every module of ``core`` may use it.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

_GRAPH, _GRAPHS = onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """Graph-valued attributes of a node (If branches, Loop/Scan bodies)."""
    out: list[onnx.GraphProto] = []
    for a in node.attribute:
        if a.type == _GRAPH:
            out.append(a.g)
        elif a.type == _GRAPHS:
            out.extend(a.graphs)
    return out


def graphs_within(roots: Iterable[onnx.GraphProto]) -> list[onnx.GraphProto]:
    """``roots``, then every graph nested in their nodes' attributes."""
    out = list(roots)
    stack = list(out)
    while stack:
        for n in stack.pop().node:
            for sg in subgraphs(n):
                out.append(sg)
                stack.append(sg)
    return out


def walk_roots(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    """The graphs a walk starts from: the main graph, then each training
    info's initialization and algorithm graphs (those it has)."""
    roots = [model.graph]
    for ti in model.training_info:
        if ti.HasField("initialization"):
            roots.append(ti.initialization)
        if ti.HasField("algorithm"):
            roots.append(ti.algorithm)
    return roots


def walk_graphs(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    """The main graph, the training graphs and every subgraph of them."""
    return graphs_within(walk_roots(model))
