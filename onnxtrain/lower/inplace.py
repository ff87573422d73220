"""Which state variables an update program may overwrite in place.

In the memory-lean mode (``TrainingSession(memory="lean")``) the optimizer
program B writes a new value of a state variable ``k`` into ``k``'s own
buffer instead of a second one.  onnxruntime does not know the output and
the input share memory, so that is only correct when no node reads ``k``
after the node P that produces the new value has started writing it:

- every node other than P that reads ``k`` is an ancestor of P (it runs
  before P in any topological order, so it has read ``k`` already);
- P, if it reads ``k`` itself, reads element i before it writes element i:
  a standard elementwise op (``k`` has the output's shape, bindings
  guarantee it), or one of onnxtrain's fused optimizer kernels, which
  handle overlapping inputs and outputs;
- the new value is produced by a node (not an input passed through) and is
  bound to one variable only.

Anything else keeps its second buffer.  The analysis is static, on the graph
onnxruntime is given; it is checked against the double-buffered step, bit
for bit, in tests/runtime/test_lean_memory.py.

The gradients B reads live in buffers the session owns and refills every
step, so B's temporaries can live there too: ``with_scratch_outputs`` makes
an elementwise value computed from a gradient (SGD's ``lr·g``) a graph output
that the session binds over that gradient's buffer, under the same rules.
onnxruntime never writes over a graph input itself, so without this the
value would take a buffer of the weight's size.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Container, Sequence

import onnx

from ..kernels.conv import COL2IM_KERNEL, IM2COL_KERNEL
from ..kernels.fuse import KERNEL_DOMAIN
from ..kernels.layers import POOL_KERNEL, SCATTER_KERNEL
from ..kernels.nchwc import REORDER_KERNEL
from ..kernels.norm import BN_GRAD_KERNEL

#: Library kernels that are not elementwise over what they write.
_NOT_ELEMENTWISE = (POOL_KERNEL, SCATTER_KERNEL, IM2COL_KERNEL, COL2IM_KERNEL, BN_GRAD_KERNEL, REORDER_KERNEL)
from ..core.graph import infer_types, node_inputs

#: Standard ops that compute output element i from input element i alone
#: (or from broadcast operands), so an input may share the output's buffer.
ELEMENTWISE = frozenset({
    "Abs", "Add", "Ceil", "Clip", "Div", "Exp", "Floor", "Log", "Max", "Min", "Mul", "Neg",
    "Pow", "Reciprocal", "Relu", "Sign", "Sqrt", "Sub", "Sum", "Where",
})


class _Order:
    """Producers, readers and ancestry of a graph's nodes."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer: dict[str, onnx.NodeProto] = {}
        self.readers: dict[str, list[int]] = defaultdict(list)
        for index, node in enumerate(graph.node):
            for out in node.output:
                self.producer[out] = node
            for name in set(node_inputs(node)):
                self.readers[name].append(index)
        self.position = {id(n): i for i, n in enumerate(graph.node)}
        self._ancestry: dict[int, set[int]] = {}

    def ancestors(self, index: int) -> set[int]:
        """Indices of the nodes ``graph.node[index]`` depends on (iterative DFS)."""
        if index not in self._ancestry:
            seen: set[int] = set()
            stack = [index]
            while stack:
                for name in node_inputs(self.graph.node[stack.pop()]):
                    p = self.producer.get(name)
                    if p is not None and self.position[id(p)] not in seen:
                        seen.add(self.position[id(p)])
                        stack.append(self.position[id(p)])
            self._ancestry[index] = seen
        return self._ancestry[index]

    def read_before(self, name: str, index: int) -> bool:
        """Whether every reader of ``name`` but node ``index`` runs before it."""
        others = [r for r in self.readers.get(name, ()) if r != index]
        return not others or set(others) <= self.ancestors(index)


def _elementwise(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in ELEMENTWISE


def with_scratch_outputs(model: onnx.ModelProto, owned: Container[str]
                         ) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``model`` with elementwise values computed from the inputs in ``owned``
    (buffers the caller refills before every run) made graph outputs, and
    {output: input} to bind each over its input's buffer.  A value qualifies
    when its node is a standard elementwise op, it has the input's static
    shape and type, and every other reader of the input runs before it.
    ``model`` is not modified; without candidates it is returned as is."""
    graph = model.graph
    inputs = {i.name for i in graph.input if i.name in owned}
    if not inputs:
        return model, {}
    order = _Order(graph)
    outputs = {o.name for o in graph.output}
    types, shapes = infer_types(graph, model.opset_import)
    chosen: dict[str, str] = {}
    for index, node in enumerate(graph.node):
        if not _elementwise(node) or len(node.output) != 1 or node.output[0] in outputs:
            continue
        out = node.output[0]
        for name in node.input:
            if (name in inputs and name not in chosen.values() and types.get(out) == types.get(name)
                    and shapes.get(out) is not None and shapes.get(out) == shapes.get(name)
                    and all(isinstance(d, int) for d in shapes[out])
                    and order.read_before(name, index)):
                chosen[out] = name
                break
    if not chosen:
        return model, {}
    out_model = onnx.ModelProto()
    out_model.CopyFrom(model)
    for value, name in chosen.items():
        source = next(i for i in graph.input if i.name == name)
        vi = out_model.graph.output.add()
        vi.CopyFrom(source)
        vi.name = value
    return out_model, chosen


def _fused_update(node: onnx.NodeProto) -> bool:
    """A kernel of the library that is elementwise over each tensor it writes
    (the optimizer updates and Relu's gradient)."""
    return node.domain == KERNEL_DOMAIN and node.op_type not in _NOT_ELEMENTWISE


def inplace_keys(graph: onnx.GraphProto, bindings: Sequence[tuple[str, str]]) -> set[str]:
    """The keys of ``bindings`` ((state variable, value) pairs of the program
    whose graph is ``graph``) whose new value may be written over the old one."""
    order = _Order(graph)
    uses = Counter(v for _, v in bindings)
    safe: set[str] = set()
    for key, value in bindings:
        node = order.producer.get(value)
        if node is None or uses[value] > 1 or key == value:
            continue
        index = order.position[id(node)]
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue
        if not order.read_before(key, index):
            continue
        if key in node.input and not (_fused_update(node) or _elementwise(node)):
            continue
        safe.add(key)
    return safe
