"""Walkers over a model's protos: every graph (subgraphs included) and every
tensor it holds (initializers, sparse values, attributes), with or without
a label saying where each one sits.  A leaf: onnx only.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from .walk import scan_within, subgraphs, walk_graphs, walk_roots  # noqa: F401  (walk_graphs: handed on)


def all_graphs(model: onnx.ModelProto) -> list[tuple[str, onnx.GraphProto]]:
    """Every graph of a model with a label: main, training_info ones, subgraphs."""
    out: list[tuple[str, onnx.GraphProto]] = [("graph", model.graph)]
    for i, ti in enumerate(model.training_info):
        if ti.HasField("initialization"):
            out.append((f"training_info[{i}].initialization", ti.initialization))
        if ti.HasField("algorithm"):
            out.append((f"training_info[{i}].algorithm", ti.algorithm))
    stack = list(out)
    while stack:
        label, g = stack.pop()
        for n in g.node:
            for sg in subgraphs(n):
                item = (f"{label}/{n.name or n.op_type}", sg)
                out.append(item)
                stack.append(item)
    return out


def all_tensors(model: onnx.ModelProto) -> Iterable[onnx.TensorProto]:
    """Every TensorProto a model holds: initializers, sparse values, attributes.

    The same tensors in the same order as ``labelled_tensors``, without
    making a label for each: every walk of a model at load goes through
    here (the checks, the size sums, the external-data scans)."""
    for tensors, _ in model_graph_contents(model):
        yield from tensors


def model_graph_contents(
    model: onnx.ModelProto,
) -> list[tuple[list[onnx.TensorProto], list[onnx.SparseTensorProto]]]:
    """``graph_contents`` of every graph, in ``walk_graphs``' order, with one
    look at each node's attributes: the scan that collects a graph's tensors
    finds its subgraphs too (a model's nodes are most of what a walk reads)."""
    return [contents for _, contents in scan_within(walk_roots(model), _scan)]


_A = onnx.AttributeProto
_TENSOR, _TENSORS = _A.TENSOR, _A.TENSORS
_SPARSE_TENSOR, _SPARSE_TENSORS = _A.SPARSE_TENSOR, _A.SPARSE_TENSORS
_GRAPH, _GRAPHS = _A.GRAPH, _A.GRAPHS
#: Attribute types that hold a tensor or a graph (every other type is skipped).
_HOLDERS = frozenset((_TENSOR, _TENSORS, _SPARSE_TENSOR, _SPARSE_TENSORS, _GRAPH, _GRAPHS))


def graph_contents(
    g: onnx.GraphProto,
) -> tuple[list[onnx.TensorProto], list[onnx.SparseTensorProto]]:
    """The tensors of one graph, not of its subgraphs (in ``labelled_tensors``'
    order), and its sparse tensors (sparse initializers, then sparse
    attributes), in one pass."""
    return _scan(g)[0]


def _scan(
    g: onnx.GraphProto,
) -> tuple[tuple[list[onnx.TensorProto], list[onnx.SparseTensorProto]], list[onnx.GraphProto]]:
    """(``graph_contents`` of one graph, its subgraphs: ``subgraphs`` of
    each node, in node order), from one pass over its nodes' attributes:
    ``scan_within``'s scan."""
    out = list(g.initializer)
    sparse = list(g.sparse_initializer)
    subs: list[onnx.GraphProto] = []
    for st in sparse:
        out.append(st.values)
        out.append(st.indices)
    for n in g.node:
        for a in n.attribute:
            t = a.type
            if t not in _HOLDERS:
                continue
            if t == _TENSOR:
                out.append(a.t)
            elif t == _TENSORS:
                out.extend(a.tensors)
            elif t == _GRAPH:
                subs.append(a.g)
            elif t == _GRAPHS:
                subs.extend(a.graphs)
            elif t == _SPARSE_TENSOR:
                st = a.sparse_tensor
                out.append(st.values)
                out.append(st.indices)
                sparse.append(st)
            else:  # _SPARSE_TENSORS
                for st in a.sparse_tensors:
                    out.append(st.values)
                    out.append(st.indices)
                    sparse.append(st)
    return (out, sparse), subs


def labelled_tensors(model: onnx.ModelProto) -> Iterable[tuple[str, onnx.TensorProto]]:
    """Every TensorProto of a model with where it is, for error messages."""
    for label, g in all_graphs(model):
        for i, t in enumerate(g.initializer):
            yield f"{label}.initializer[{i}] ({t.name!r})", t
        for i, st in enumerate(g.sparse_initializer):
            yield f"{label}.sparse_initializer[{i}].values ({st.values.name!r})", st.values
            yield f"{label}.sparse_initializer[{i}].indices ({st.values.name!r})", st.indices
        for where, a in _node_attributes(label, g):
            if a.type == onnx.AttributeProto.TENSOR:
                yield where, a.t
            elif a.type == onnx.AttributeProto.TENSORS:
                for j, t in enumerate(a.tensors):
                    yield f"{where}[{j}]", t
            else:
                for at, st in _sparse_attribute(where, a):
                    yield f"{at}.values", st.values
                    yield f"{at}.indices", st.indices


def labelled_sparse_tensors(
    model: onnx.ModelProto,
) -> Iterable[tuple[str, onnx.SparseTensorProto]]:
    """Every SparseTensorProto: sparse initializers and sparse attributes."""
    for label, g in all_graphs(model):
        for i, st in enumerate(g.sparse_initializer):
            yield f"{label}.sparse_initializer[{i}] ({st.values.name!r})", st
        for where, a in _node_attributes(label, g):
            yield from _sparse_attribute(where, a)


def _sparse_attribute(where: str, a: onnx.AttributeProto):
    """The sparse tensors an attribute holds, with where each is."""
    if a.type == onnx.AttributeProto.SPARSE_TENSOR:
        yield where, a.sparse_tensor
    elif a.type == onnx.AttributeProto.SPARSE_TENSORS:
        for j, st in enumerate(a.sparse_tensors):
            yield f"{where}[{j}]", st


def _node_attributes(label: str, g: onnx.GraphProto):
    for i, n in enumerate(g.node):
        for a in n.attribute:
            yield f"{label}.node[{i}] ({n.name or n.op_type!r}).{a.name}", a
