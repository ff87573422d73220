"""Expand a node into its ONNX function body, so ops defined as functions
(Attention, RMSNormalization, model-local functions, ...) are differentiated
through the primitive ops they are made of.

A function-body expansion counts as a rule: ``expand`` uses it for an op that
has no registered rule, and only then.  An op with neither is an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from ..core.names import NameGen


def function_body(
    node: onnx.NodeProto,
    opset_imports: Sequence[onnx.OperatorSetIdProto],
    local_functions: Sequence[onnx.FunctionProto],
    input_types: Sequence[onnx.TypeProto | None],
) -> onnx.FunctionProto | None:
    """The FunctionProto defining ``node`` for the model's opset, or None."""
    for f in local_functions:
        if f.name == node.op_type and f.domain == node.domain:
            return f
    domain = "" if node.domain == "ai.onnx" else node.domain
    version = next((int(o.version) for o in opset_imports if o.domain in ((domain,) if domain else ("", "ai.onnx"))), 0)
    if not version:
        return None
    try:
        schema = onnx.defs.get_schema(node.op_type, version, domain)
    except onnx.defs.SchemaError:
        return None
    data = b""

    def body_version(available: Sequence[int]) -> int:
        """The newest body written for an opset <= the model's (bodies are
        only re-issued when they change)."""
        older = [int(v) for v in available if int(v) <= version]
        return max(older) if older else version

    try:
        if schema.has_function:
            data = schema.get_function_with_opset_version(
                body_version(schema.function_opset_versions)
            )
        elif schema.has_context_dependent_function:
            types = []
            for name, t in zip(node.input, input_types):
                if t is None and name:
                    return None  # a present input of unknown type
                types.append((t or onnx.TypeProto()).SerializeToString())  # omitted: untyped
            data = schema.get_context_dependent_function_with_opset_version(
                body_version(schema.context_dependent_function_opset_versions),
                node.SerializeToString(),
                types,
            )
    except Exception:  # onnx raises plain RuntimeErrors when a body cannot be built
        return None
    if not data:
        return None
    f = onnx.FunctionProto()
    f.ParseFromString(data)
    _add_schema_defaults(f, schema)
    if node.op_type == "Attention" and not domain:
        _guard_masked_rows(f)
    return f if f.node else None


def _guard_masked_rows(f: onnx.FunctionProto) -> None:
    """Give Attention bodies that lack it the guard later onnx releases write
    (onnx >= 1.23): a query row that sees no key has softmax NaN, and the op
    (onnxruntime's kernel, the newer body) outputs zeros there.  Each Softmax
    whose result no Where reads (directly or through Cast/Identity) gets
    ``Where(IsNaN(y), 0, y)`` after it: the same values on every other row,
    and the Softmax rule then sends no NaN back through such a row."""
    guarded = set()
    for n in f.node:
        if n.op_type == "Where":
            guarded.update(n.input)
    for n in f.node:  # a Cast/Identity whose output a Where reads guards its input too
        if n.op_type in ("Cast", "Identity") and n.output[0] in guarded:
            guarded.update(n.input)
    nodes = []
    for n in f.node:
        nodes.append(n)
        if n.op_type != "Softmax" or n.output[0] in guarded:
            continue
        y = n.output[0]
        raw, nan, zero, zero_like = (f"{y}__unguarded", f"{y}__isnan", f"{y}__zero", f"{y}__zero_like")
        n.output[0] = raw
        nodes += [
            onnx.helper.make_node("IsNaN", [raw], [nan]),
            onnx.helper.make_node("Constant", [], [zero], value_float=0.0),
            onnx.helper.make_node("CastLike", [zero, raw], [zero_like]),
            onnx.helper.make_node("Where", [nan, zero_like, raw], [y]),
        ]
    del f.node[:]
    f.node.extend(nodes)


def _add_schema_defaults(f: onnx.FunctionProto, schema: onnx.defs.OpSchema) -> None:
    """Give the body the schema's attribute defaults.  A schema body lists its
    attributes by name only (Swish: ``attribute: "alpha"``), so a reference
    ``@alpha`` the caller leaves unset must take the default (alpha = 1.0)
    from the schema; dropping it would leave e.g. a Constant without a value."""
    declared = {a.name for a in f.attribute_proto}
    for name in list(f.attribute):
        spec = schema.attributes.get(name)
        if name in declared or spec is None or not spec.default_value.name:
            continue
        default = onnx.AttributeProto()
        default.CopyFrom(spec.default_value)
        default.name = name
        f.attribute_proto.append(default)
        f.attribute.remove(name)


def inline(
    node: onnx.NodeProto, body: onnx.FunctionProto, names: NameGen
) -> list[onnx.NodeProto]:
    """The nodes of ``body`` with formal inputs/outputs bound to ``node``'s
    actual ones, internal names made fresh and attribute references resolved."""
    rename: dict[str, str] = {"": ""}
    for formal, actual in zip(body.input, node.input):
        rename[formal] = actual
    for formal in body.input[len(node.input) :]:
        rename[formal] = ""  # optional input left out by the caller
    for formal, actual in zip(body.output, node.output):
        rename[formal] = actual or names.fresh(f"{node.name or node.op_type}/{formal}")
    prefix = node.name or node.op_type
    given = {a.name: a for a in node.attribute}
    defaults = {a.name: a for a in body.attribute_proto}

    return [_copy_node(inner, rename, names, prefix, given, defaults) for inner in body.node]


def _copy_node(
    inner: onnx.NodeProto,
    rename: dict[str, str],
    names: NameGen,
    prefix: str,
    given: dict[str, onnx.AttributeProto],
    defaults: dict[str, onnx.AttributeProto],
) -> onnx.NodeProto:
    """One body node with fresh names, attribute references resolved, and its
    subgraphs (If branches, Loop bodies) renamed consistently."""
    n = onnx.NodeProto()
    n.CopyFrom(inner)
    n.name = names.fresh(f"{prefix}/{inner.name or inner.op_type}")
    del n.input[:]
    for i in inner.input:
        # A name defined nowhere in the body is an outer-scope read from a
        # subgraph the caller handed in (SequenceMap's body): it keeps its name.
        n.input.append(rename.get(i, i))
    del n.output[:]
    for o in inner.output:
        if o not in rename:
            rename[o] = names.fresh(f"{prefix}/{o}")
        n.output.append(rename[o])
    del n.attribute[:]
    for a in inner.attribute:
        if a.ref_attr_name:
            source = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
            if source is None:
                continue  # unset optional attribute: the op's own default applies
            resolved = onnx.AttributeProto()
            resolved.CopyFrom(source)
            resolved.name = a.name
            n.attribute.append(resolved)
        elif a.type == onnx.AttributeProto.GRAPH:
            b = onnx.AttributeProto()
            b.CopyFrom(a)
            b.g.CopyFrom(_copy_graph(a.g, rename, names, prefix, given, defaults))
            n.attribute.append(b)
        elif a.type == onnx.AttributeProto.GRAPHS:
            b = onnx.AttributeProto()
            b.CopyFrom(a)
            del b.graphs[:]
            for g in a.graphs:
                b.graphs.append(_copy_graph(g, rename, names, prefix, given, defaults))
            n.attribute.append(b)
        else:
            n.attribute.append(a)
    return n


def _copy_graph(
    g: onnx.GraphProto,
    outer: dict[str, str],
    names: NameGen,
    prefix: str,
    given: dict[str, onnx.AttributeProto],
    defaults: dict[str, onnx.AttributeProto],
) -> onnx.GraphProto:
    """A subgraph of a body: its own names fresh, outer names as renamed outside."""
    rename = dict(outer)
    local = [vi.name for vi in g.input] + [t.name for t in g.initializer]
    for nm in local:
        rename[nm] = names.fresh(f"{prefix}/{nm}")
    out = onnx.GraphProto()
    out.CopyFrom(g)
    out.name = names.fresh(f"{prefix}/{g.name or 'subgraph'}")
    for vi in out.input:
        vi.name = rename[vi.name]
    for t in out.initializer:
        t.name = rename[t.name]
    del out.node[:]
    for inner in g.node:
        for o in inner.output:  # defined inside the subgraph: local to it
            if o:
                rename[o] = names.fresh(f"{prefix}/{o}")
        out.node.append(_copy_node(inner, rename, names, prefix, given, defaults))
    for vi in out.output:
        vi.name = rename.get(vi.name, vi.name)
    del out.value_info[:]
    return out


def type_proto(elem_type: int | None, shape: tuple | None) -> onnx.TypeProto | None:
    """A tensor TypeProto from inferred facts (None if the type is unknown)."""
    if not elem_type:
        return None
    dims = None if shape is None else list(shape)  # None entries: unknown sizes
    return helper.make_tensor_type_proto(elem_type, dims)
