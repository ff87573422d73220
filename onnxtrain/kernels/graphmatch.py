"""Matching chains of standard ops in a program and replacing them by kernels.

``Index`` answers what a matcher asks of a graph: which default-domain node
writes a value, who reads it, the small constants, and (from onnx's shape
inference, shared by the plans made on one unchanged graph) element types and
static shapes.

A ``Fusion`` names the nodes a kernel replaces and the nodes that replace them.
``apply`` makes the fusions that are safe together: a fusion stands only if
every value of a node it removes that something else still reads (a node no
fusion removes, or a graph output) is written by its new nodes too.  A value
read only inside other fusions that stand may go: RMSNorm's x^2 is read by the
forward chain and, for its shape, by the backward chain, and both become
kernels.  Outputs a fusion marks optional are written only where read.

    >>> import onnx
    >>> from onnx import helper
    >>> g = helper.make_graph([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["y"])],
    ...     "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
    ...     [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    >>> ix = Index(g, [helper.make_opsetid("", 17)])
    >>> twice = Fusion(removed=[ix.node("y", "Neg"), ix.node("a", "Neg")],
    ...                added=[helper.make_node("Identity", ["x"], ["y"])])
    >>> apply(g, [twice])
    1
    >>> [n.op_type for n in g.node]
    ['Identity']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.graph import constant_values, infer_types, node_inputs, toposort
from ..core.names import NameGen


def _default(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")


class Index:
    """Producers, readers, constants, types and static shapes of ``graph``
    (``inferred``: a shared ``layers.shared_inference``; else inferred on first use)."""

    def __init__(self, graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto],
                 inferred: Callable | None = None) -> None:
        self.graph = graph
        self.nodes = list(graph.node)
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for i in node_inputs(n):
                self.readers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in graph.output}
        self.values = constant_values(graph)
        self._opsets = list(opset_imports)
        self._inferred = inferred
        self._types: tuple | None = None

    # ------------------------------------------------------------ structure
    def node(self, name: str | None, op_type: str, n_inputs: int | None = None) -> onnx.NodeProto | None:
        """The default-domain ``op_type`` node that writes ``name`` (with
        ``n_inputs`` inputs, when given), else None."""
        n = self.producer.get(name) if name else None
        if n is None or n.op_type != op_type or not _default(n):
            return None
        if n_inputs is not None and len(n.input) != n_inputs:
            return None
        return n

    def operands(self, node: onnx.NodeProto | None, op_type: str) -> list[tuple[str, str]]:
        """Both readings (a, b) of a commutative binary ``op_type`` node."""
        if node is None or node.op_type != op_type or not _default(node) or len(node.input) != 2:
            return []
        a, b = node.input
        return [(a, b), (b, a)] if a != b else [(a, b)]

    def other(self, node: onnx.NodeProto | None, op_type: str, name: str | None) -> str | None:
        """The operand of a commutative binary ``op_type`` node besides ``name``
        (None where ``name`` is not one of them)."""
        return next((b for a, b in self.operands(node, op_type) if a == name), None) if name else None

    def partners(self, name: str, op_type: str) -> list[tuple[onnx.NodeProto, str]]:
        """(node, the other operand) for every commutative binary ``op_type`` node reading ``name``."""
        found = []
        for n in self.reader_nodes(name, op_type):
            b = self.other(n, op_type, name)
            if b is not None:
                found.append((n, b))
        return found

    def reader_nodes(self, name: str, op_type: str | None = None) -> list[onnx.NodeProto]:
        """The nodes that read ``name`` (of ``op_type``, default domain, when given)."""
        found = self.readers.get(name, [])
        if op_type is None:
            return list(found)
        return [n for n in found if n.op_type == op_type and _default(n)]

    def opset(self, domain: str = "") -> int:
        """The graph's version of ``domain`` ("" and "ai.onnx" alike), 0 if none."""
        want = {"", "ai.onnx"} if domain in ("", "ai.onnx") else {domain}
        return max((int(o.version) for o in self._opsets if o.domain in want), default=0)

    def attr(self, node: onnx.NodeProto, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    # ------------------------------------------------------------ values
    def scalar(self, name: str | None) -> float | None:
        """The value of a one-element floating constant, else None."""
        v = self.values.get(name) if name else None
        if v is None or v.size != 1 or v.dtype.kind != "f":
            return None
        return float(v.reshape(-1)[0])

    def ints(self, name: str | None) -> list[int] | None:
        """The values of an integer constant, else None."""
        v = self.values.get(name) if name else None
        return None if v is None or v.dtype.kind not in "iu" else [int(x) for x in v.reshape(-1)]

    def axes(self, node: onnx.NodeProto) -> list[int] | None:
        """A reduction's axes: the attribute (older opsets) or a constant second input."""
        found = self.attr(node, "axes")
        if found is not None:
            return list(found)
        return self.ints(node.input[1]) if len(node.input) > 1 else None

    def _inference(self) -> tuple:
        if self._types is None:
            self._types = self._inferred() if self._inferred else infer_types(self.graph, self._opsets)
        return self._types

    def dtype(self, name: str) -> int | None:
        return self._inference()[0].get(name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The static shape of ``name`` (every dim known), else None."""
        d = self.dims(name)
        return d if d is not None and all(isinstance(x, int) for x in d) else None

    def dims(self, name: str) -> tuple | None:
        """The shape of ``name`` with symbolic dims (strings: equal names, equal
        sizes) where every dim is known or named, else None.  For matches whose
        kernels check the sizes they are given at run time."""
        s = self._inference()[1].get(name)
        if s is None or any(d is None for d in s):
            return None
        return tuple(s)

    def all_float(self, *names: str) -> bool:
        return all(self.dtype(n) == TensorProto.FLOAT for n in names)


@dataclass
class Fusion:
    """Kernel nodes ``added`` in place of the nodes ``removed``; outputs of
    ``added`` named in ``optional`` are written only where something reads them."""

    removed: list[onnx.NodeProto]
    added: list[onnx.NodeProto]
    optional: set[str] = field(default_factory=set)
    #: Constants the added nodes read, added to the graph with them.
    initializers: list[onnx.TensorProto] = field(default_factory=list)


def apply(graph: onnx.GraphProto, fusions: Sequence[Fusion]) -> int:
    """Make the ``fusions`` that stand together (see the module), in place;
    how many were made."""
    taken: set[int] = set()
    kept: list[Fusion] = []
    for f in fusions:  # the first of two overlapping fusions wins
        ids = {id(n) for n in f.removed}
        if not ids or ids & taken or len(ids) != len(f.removed):
            continue
        taken |= ids
        kept.append(f)
    nodes = list(graph.node)
    outputs = {o.name for o in graph.output}
    given = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    given |= {t.values.name for t in graph.sparse_initializer}
    while True:
        removed = {id(n) for f in kept for n in f.removed}
        read_outside = set(outputs)
        available = set(given)
        for n in nodes:
            if id(n) not in removed:
                read_outside.update(node_inputs(n))
                available.update(n.output)
        for f in kept:
            available.update(t.name for t in f.initializers)
            for n in f.added:
                read_outside.update(node_inputs(n))
                available.update(n.output)
        still = [f for f in kept if _stands(f, read_outside, available)]
        if len(still) == len(kept):
            break
        kept = still
    if not kept:
        return 0
    for f in kept:
        graph.initializer.extend(f.initializers)
        for n in f.added:
            for k, o in enumerate(n.output):
                if o in f.optional and o not in read_outside:
                    n.output[k] = ""
            while n.output and not n.output[-1]:
                del n.output[-1]
    # The new nodes go where the fusion's last removed node was.
    order = {id(n): i for i, n in enumerate(nodes)}
    at = {max(order[id(n)] for n in f.removed): f for f in kept}
    removed = {id(n) for f in kept for n in f.removed}
    out: list[onnx.NodeProto] = []
    for i, n in enumerate(nodes):
        if i in at:
            out.extend(at[i].added)
        if id(n) not in removed:
            out.append(n)
    available = [i.name for i in graph.input] + [t.name for t in graph.initializer]
    available += [t.values.name for t in graph.sparse_initializer]
    ordered = toposort(out, available, where="fused program")
    del graph.node[:]
    graph.node.extend(ordered)
    return len(kept)


def _stands(f: Fusion, read_outside: set[str], available: set[str]) -> bool:
    """What ``f`` drops and others read, it writes; what it reads exists."""
    written = {o for n in f.added for o in n.output if o}
    dropped = {o for n in f.removed for o in n.output if o}
    reads = {i for n in f.added for i in node_inputs(n)}
    return all(o in written for o in dropped if o in read_outside) and reads <= available


def kernel_node(op: str, inputs: list[str], outputs: list[str], name: str, domain: str) -> onnx.NodeProto:
    """A node of the kernel library's ``domain``."""
    return helper.make_node(op, inputs, outputs, name=name, domain=domain)


def constant(names: NameGen, hint: str, value: np.ndarray) -> onnx.TensorProto:
    """An initializer holding ``value`` under a fresh name, for ``Fusion.initializers``."""
    return numpy_helper.from_array(value, names.fresh(hint))


def same_constant(values: dict[str, np.ndarray], name: str, value: float) -> bool:
    """Whether ``name`` is a floating constant whose every element equals ``value``."""
    v = values.get(name)
    return v is not None and v.size > 0 and v.dtype.kind == "f" and bool((v == value).all())
