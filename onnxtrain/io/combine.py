"""Graph combination: the main graph followed by a training algorithm (M ⊕ A),
and graph copies that leave out initializer data.

Spec rule R7 reads "M followed by A is a valid graph"; ``combined_graph`` is
that graph: every list (inputs, outputs, nodes, value_info, initializers) of
M, then the same list of A.
"""

from __future__ import annotations

from collections.abc import Container

import onnx

from ..core.graph import PREVIEW_DOMAIN, subgraphs
from .tensors import copy_fields


def combined_graph(
    proto: onnx.ModelProto, index: int, exclude_initializers: Container[str] = (),
    into: onnx.GraphProto | None = None,
) -> onnx.GraphProto:
    """M ⊕ A of training_info[index]: every list concatenated, main graph first.

    Initializers (dense or sparse) named in ``exclude_initializers`` are left
    out: callers that feed state variables as inputs need not copy their data.
    ``into``: an empty GraphProto to build it in (e.g. the graph of a model), returned."""
    main = proto.graph
    algo = proto.training_info[index].algorithm
    g = onnx.GraphProto() if into is None else into
    g.name = f"{main.name or 'main'}+training_info[{index}]"
    for fld in ("input", "output", "node", "value_info"):
        getattr(g, fld).extend(getattr(main, fld))
        getattr(g, fld).extend(getattr(algo, fld))
    for source in (main, algo):
        g.initializer.extend(t for t in source.initializer if t.name not in exclude_initializers)
        g.sparse_initializer.extend(
            st for st in source.sparse_initializer if st.values.name not in exclude_initializers
        )
    return g


def copy_graph(graph: onnx.GraphProto, exclude_initializers: Container[str] = (),
               into: onnx.GraphProto | None = None) -> onnx.GraphProto:
    """A copy of ``graph`` without the initializers (dense or sparse) named in
    ``exclude_initializers`` (their data is never copied); ``into``: an
    empty GraphProto to copy into (e.g. the graph of a model), returned."""
    g = onnx.GraphProto() if into is None else into
    copy_fields(graph, g, skip=("initializer", "sparse_initializer"))
    g.initializer.extend(t for t in graph.initializer if t.name not in exclude_initializers)
    g.sparse_initializer.extend(
        st for st in graph.sparse_initializer if st.values.name not in exclude_initializers
    )
    return g


def uses_preview_ops(graph: onnx.GraphProto) -> bool:
    """Whether a graph (or a subgraph of it) has an ai.onnx.preview.training node."""
    for n in graph.node:
        if n.domain == PREVIEW_DOMAIN:
            return True
        if any(uses_preview_ops(sg) for sg in subgraphs(n)):
            return True
    return False
