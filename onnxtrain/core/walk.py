"""The graphs of a model: its main graph, its training graphs and every
subgraph below them (If branches, Loop and Scan bodies).

The one walker of the package (``core.graph`` and ``core.protos`` hand it
on); it imports nothing of onnxtrain's, so every module of ``core`` may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import onnx

_GRAPH, _GRAPHS = onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS
T = TypeVar("T")


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
    return [g for g, _ in scan_within(roots, lambda g: (None, [sg for n in g.node for sg in subgraphs(n)]))]


def scan_within(
    roots: Iterable[onnx.GraphProto],
    scan: Callable[[onnx.GraphProto], tuple[T, list[onnx.GraphProto]]],
) -> list[tuple[onnx.GraphProto, T]]:
    """Each graph of ``graphs_within(roots)``, in its order, with what
    ``scan`` found in it: ``scan(g)`` returns (its result, the graphs nested
    in ``g``'s nodes, in node order), so that one pass over a graph's nodes
    can serve both."""
    order = list(roots)
    found: dict[int, T] = {}
    stack = list(order)
    while stack:
        g = stack.pop()
        found[id(g)], subs = scan(g)
        order.extend(subs)
        stack.extend(subs)
    return [(g, found[id(g)]) for g in order]


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
