"""The bundle's programs: the standard-op models ``onnxtrain.lower.programs``
makes, made portable, and their manifest entries.

Each program is the model Python's standard path runs (never the fused-kernel
or NCHWc rewrite), then:

- model-local functions inlined, and every node checked to be a standard
  op (domain ``''`` or ``ai.onnx``, subgraphs included), else BundleError
  naming the node and its op;
- top-level Constant nodes of 1 KiB or more turned into initializers, and
  initializers of 1 KiB or more moved to constants.bin (``ConstantStore``);
- state inputs that nothing reads left out (the inference program of a
  model with gradient accumulators reads the weights, not the sums);
- the IR version capped at 10, the opset imports reduced to the default domain.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import helper, inliner

from ..core.graph import DEFAULT_DOMAINS, node_inputs, subgraphs
from ..core.names import NameGen
from ..errors import BundleError
from ..lower.programs import Program
from .bundle_data import ConstantStore, declared_bytes
from .bundle_format import CONSTANT_MIN_BYTES, MAX_IR_VERSION, dtype_name


def portable(program: Program, state: set[str], store: ConstantStore) -> onnx.ModelProto:
    """``program``'s model (a copy) made portable as the module doc says."""
    model = onnx.ModelProto()
    model.CopyFrom(program.model)
    if model.functions:
        model = inliner.inline_local_functions(model)
        del model.functions[:]
    check_standard_ops(model.graph, program.label)
    constants_to_initializers(model.graph)
    drop_unread_inputs(model.graph, state)
    imports = [o for o in model.opset_import if o.domain in DEFAULT_DOMAINS]
    if not imports:
        raise BundleError(f"{program.label}: the program imports no default-domain opset")
    del model.opset_import[:]
    model.opset_import.extend(imports)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    for t in model.graph.initializer:
        store.put(t)
    return model


def check_standard_ops(graph: onnx.GraphProto, label: str) -> None:
    """BundleError naming the first node (subgraphs included) outside the default domain."""
    stack = [(graph, label)]
    while stack:
        g, where = stack.pop()
        for i, node in enumerate(g.node):
            if node.domain not in DEFAULT_DOMAINS:
                raise BundleError(
                    f"{where}: node {i} ({node.name or node.op_type!r}) is the op "
                    f"{node.domain}.{node.op_type}, not a standard ONNX op; a bundle's programs use "
                    "only the '' and 'ai.onnx' domains (JavaScript's onnxruntime has no other)")
            stack.extend((sg, f"{where}/{node.name or node.op_type}") for sg in subgraphs(node))


def constants_to_initializers(graph: onnx.GraphProto) -> None:
    """Top-level ``Constant(value=T)`` nodes of 1 KiB or more become
    initializers (which constants.bin can hold); one that is a graph output
    becomes an initializer read by an Identity of the output's name."""
    outputs = {o.name for o in graph.output}
    names: NameGen | None = None
    kept: list[onnx.NodeProto] = []
    changed = False
    for node in graph.node:
        value = _large_value(node)
        if value is None:
            kept.append(node)
            continue
        changed = True
        t = graph.initializer.add()
        t.CopyFrom(value)
        out = node.output[0]
        if out in outputs:
            names = names or NameGen.from_graph(graph)
            t.name = names.fresh(f"{out}/value")
            kept.append(helper.make_node("Identity", [t.name], [out], name=names.fresh(f"{out}/copy")))
        else:
            t.name = out
    if changed:
        del graph.node[:]
        graph.node.extend(kept)


def _large_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    if node.op_type != "Constant" or node.domain not in DEFAULT_DOMAINS or len(node.attribute) != 1:
        return None
    (a,) = node.attribute
    if a.name != "value" or a.type != onnx.AttributeProto.TENSOR:
        return None
    return a.t if declared_bytes(a.t) >= CONSTANT_MIN_BYTES else None


def drop_unread_inputs(graph: onnx.GraphProto, state: set[str]) -> None:
    """Leave out the state inputs no node (or subgraph) reads and no output is."""
    read = {o.name for o in graph.output}
    for node in graph.node:
        read.update(node_inputs(node))
    kept = [vi for vi in graph.input if vi.name not in state or vi.name in read]
    if len(kept) != len(graph.input):
        del graph.input[:]
        graph.input.extend(kept)


def describe(vi: onnx.ValueInfoProto, where: str) -> dict[str, Any]:
    """A feed's manifest entry: name, dtype (null if unknown), shape (ints for
    static sizes, strings for symbolic ones, null for an unnamed size; null
    for an unknown rank)."""
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        raise BundleError(f"{where}: input {vi.name!r} is not a tensor; a bundle's feeds are tensors")
    dtype = dtype_name(tt.elem_type, f"{where}: input {vi.name!r}") if tt.elem_type else None
    shape = None
    if tt.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
    return {"name": vi.name, "dtype": dtype, "shape": shape}


def entry(kind: str, program: Program, model: onnx.ModelProto, file: str, state: set[str]
          ) -> dict[str, Any]:
    """The manifest entry of ``program`` (``kind``: "inference", "algorithm"
    or "initialization"), written to ``file`` as ``model``."""
    inputs = {vi.name: vi for vi in model.graph.input}
    label = program.label
    out: dict[str, Any] = {"label": label, "file": file}
    if kind != "initialization":
        out["feeds"] = [describe(inputs[n], label) for n in program.feeds]
        out["optional_feeds"] = [describe(inputs[n], label) for n in program.optional_feeds]
        out["state_inputs"] = [vi.name for vi in model.graph.input if vi.name in state]
    out["outputs"] = [o.name for o in model.graph.output]
    if kind == "algorithm":
        out["returned"] = list(program.returned)
    if kind != "inference":
        out["bindings"] = [{"key": k, "value": v} for k, v in program.bindings]
    return out


def default_opset(model: onnx.ModelProto) -> int:
    return max(o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS)
