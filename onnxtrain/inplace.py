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
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import onnx

from .fuse import KERNEL_DOMAIN
from .graph import node_inputs

#: Standard ops that compute output element i from input element i alone
#: (or from broadcast operands), so an input may share the output's buffer.
ELEMENTWISE = frozenset({
    "Abs", "Add", "Ceil", "Clip", "Div", "Exp", "Floor", "Log", "Max", "Min", "Mul", "Neg",
    "Pow", "Reciprocal", "Relu", "Sign", "Sqrt", "Sub", "Sum", "Where",
})


def inplace_keys(graph: onnx.GraphProto, bindings: Sequence[tuple[str, str]]) -> set[str]:
    """The keys of ``bindings`` ((state variable, value) pairs of the program
    whose graph is ``graph``) whose new value may be written over the old one."""
    producer: dict[str, onnx.NodeProto] = {}
    readers: dict[str, list[int]] = defaultdict(list)
    for index, node in enumerate(graph.node):
        for out in node.output:
            producer[out] = node
        for name in set(node_inputs(node)):
            readers[name].append(index)
    position = {id(n): i for i, n in enumerate(graph.node)}
    uses = Counter(v for _, v in bindings)
    ancestry: dict[int, set[int]] = {}

    def ancestors(index: int) -> set[int]:
        """Indices of the nodes ``graph.node[index]`` depends on (iterative DFS)."""
        if index in ancestry:
            return ancestry[index]
        seen: set[int] = set()
        stack = [index]
        while stack:
            node = graph.node[stack.pop()]
            for name in node_inputs(node):
                p = producer.get(name)
                if p is not None and position[id(p)] not in seen:
                    seen.add(position[id(p)])
                    stack.append(position[id(p)])
        ancestry[index] = seen
        return seen

    safe: set[str] = set()
    for key, value in bindings:
        node = producer.get(value)
        if node is None or uses[value] > 1 or key == value:
            continue
        index = position[id(node)]
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue
        others = [r for r in readers.get(key, ()) if r != index]
        if others and not set(others) <= ancestors(index):
            continue
        if key in node.input:
            fused = node.domain == KERNEL_DOMAIN
            standard = node.domain in ("", "ai.onnx") and node.op_type in ELEMENTWISE
            if not (fused or standard):
                continue
        safe.add(key)
    return safe
