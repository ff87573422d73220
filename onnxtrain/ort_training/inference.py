"""The inference model ``Module.export_model_for_inferencing`` writes.

The forward model is cut at the requested outputs: only the nodes they need
stay, the parameters become initializers with their current values, and
inputs nothing reads any more (labels, targets) are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from ..core.graph import prune


def inference_model(forward: onnx.ModelProto, values: dict[str, np.ndarray],
                    outputs: Sequence[str]) -> onnx.ModelProto:
    """``forward`` cut at ``outputs`` (names of values it computes or takes in)."""
    if isinstance(outputs, str) or not outputs:
        raise ValueError("export_model_for_inferencing: graph_output_names must be a non-empty "
                         "list of names")
    graph = forward.graph
    produced = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    for name in outputs:
        if name not in produced:
            raise ValueError(f"export_model_for_inferencing: {name!r} is not a value of the model")
    needed = set(outputs)
    nodes = prune(list(graph.node), needed)
    needed = set(needed) | {i for n in nodes for i in n.input if i}
    declared = {v.name: v for v in (*graph.value_info, *graph.output, *graph.input)}
    out = onnx.ModelProto()
    out.CopyFrom(forward)
    g = out.graph
    for field in ("node", "output", "input", "initializer", "value_info"):
        g.ClearField(field)
    g.node.extend(nodes)
    g.input.extend(i for i in graph.input if i.name in needed and i.name not in values)
    g.initializer.extend(t for t in graph.initializer if t.name in needed and t.name not in values)
    g.initializer.extend(numpy_helper.from_array(np.asarray(v), n) for n, v in values.items()
                         if n in needed)
    for name in outputs:
        vi = onnx.ValueInfoProto()
        if name in declared:
            vi.CopyFrom(declared[name])
        else:
            vi.name = name
        g.output.append(vi)
    g.value_info.extend(v for v in graph.value_info if v.name in needed and v.name not in outputs)
    return out
