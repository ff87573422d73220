"""Reverse-mode expansion of ``ai.onnx.preview.training.Gradient`` nodes.

``Gradient(xs=[...], zs=[...], y=name)(x values..., z values...)`` computes
d sum(y) / d x for each x in xs at the point given by its inputs.  ``expand_gradients``
replaces each such node by standard ONNX ops:

1. If an input value differs from the tensor it stands for, the part of the
   forward graph that depends on it is cloned with the value substituted, and
   the Gradient node is rewritten to refer to the clone.
2. The differentiated subgraph is every node on a path from a name in xs to y.
   Names in xs and zs are leaves: the graph is cut there, so an intermediate
   tensor in xs acts as an independent variable.
3. Starting from ones shaped like y, each node's rule turns output gradients
   into input gradients, which accumulate with Add/Sum.  Forward activations
   are read directly: nothing of the forward pass is computed twice.  A rule
   may replace its forward node by nodes it emitted, which then compute its
   outputs (``VJPContext.replace_forward``: a fused op whose backward needs
   what it computes inside, as attention's probabilities).

Gradient nodes are expanded in topological order, so a Gradient that
differentiates the output of another (higher order) sees only standard ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx
from onnx import helper

from ..core.emitter import FLOAT_TYPES, Emitter
from ..core.graph import (
    PREVIEW_DOMAIN,
    constant_values,
    infer_types,
    node_inputs,
    opset_version,
    toposort,
    value_types,
)
from ..core.names import NameGen
from ..errors import GradientError
from . import rules as _rules  # noqa: F401  (registers every rule)
from .composites import stand_ins
from .inline import function_body, inline, type_proto
from .masks import fold_masks
from .registry import REGISTRY, Rule, VJPContext


def is_gradient(node: onnx.NodeProto) -> bool:
    return node.op_type == "Gradient" and node.domain == PREVIEW_DOMAIN


def _gradient_attrs(node: onnx.NodeProto) -> tuple[list[str], list[str], str]:
    xs: list[str] = []
    zs: list[str] = []
    y = ""
    for a in node.attribute:
        if a.name == "xs":
            xs = [s.decode() for s in a.strings]
        elif a.name == "zs":
            zs = [s.decode() for s in a.strings]
        elif a.name == "y":
            y = a.s.decode()
    where = f"Gradient node {node.name!r}"
    if not y:
        raise GradientError(f"{where}: attribute 'y' is missing")
    if not xs:
        raise GradientError(f"{where}: attribute 'xs' is missing or empty")
    if len(node.input) != len(xs) + len(zs):
        raise GradientError(
            f"{where}: has {len(node.input)} inputs but xs and zs name "
            f"{len(xs) + len(zs)} tensors; the inputs are the values of xs then zs"
        )
    if len(node.output) > len(xs):
        raise GradientError(
            f"{where}: has {len(node.output)} outputs but only {len(xs)} names in xs"
        )
    for i, v in enumerate(node.input):
        if not v:
            raise GradientError(f"{where}: input {i} is empty; every x and z needs a value")
    return xs, zs, y


class _Inline:
    """Ask the driver to replace ``node`` by ``body`` (its function body) and retry."""

    def __init__(self, node: onnx.NodeProto, body: list[onnx.NodeProto]) -> None:
        self.node = node
        self.body = body


def expand_gradients(
    graph: onnx.GraphProto,
    opset_imports: Sequence[onnx.OperatorSetIdProto],
    names: NameGen,
    available: Sequence[str],
    functions: Sequence[onnx.FunctionProto] = (),
    replace_forward: bool = True,
) -> None:
    """Replace every Gradient node of ``graph`` (in place) by standard ops.

    ``available`` lists the names defined outside the nodes (inputs,
    initializers); ``functions`` are the model's local functions.  Ops on a
    differentiated path that have no rule but an ONNX function body are
    inlined first.  ``replace_forward=False``: no rule replaces its forward
    node (``VJPContext.replace_forward``; where activations are recomputed,
    a fused forward that keeps nothing is the better one).  The node list
    ends topologically sorted."""
    opset = opset_version(opset_imports) or 1
    nodes = toposort([_copy(n) for n in graph.node], available)
    while True:
        idx = next((i for i, n in enumerate(nodes) if is_gradient(n)), None)
        if idx is None:
            break
        _set_nodes(graph, nodes)
        dtypes, shapes = infer_types(graph, opset_imports, functions=functions)
        constants = constant_values(graph)
        result = _expand_one(
            nodes, idx, opset, names, dtypes, shapes, constants, opset_imports, functions, graph, replace_forward
        )
        if isinstance(result, _Inline):
            at = next(i for i, n in enumerate(nodes) if n is result.node)
            nodes = nodes[:at] + result.body + nodes[at + 1 :]
        else:
            added, replaced = result
            nodes = [n for n in nodes[:idx] + added + nodes[idx + 1 :] if id(n) not in replaced]
        nodes = toposort(nodes, available)
    _set_nodes(graph, nodes)
    if fold_masks(nodes, graph, names):  # (edits nodes in place; they may need a new order)
        _set_nodes(graph, toposort(nodes, available))


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    c = onnx.NodeProto()
    c.CopyFrom(node)
    return c


def _graph_of(nodes: list[onnx.NodeProto]) -> onnx.GraphProto:
    g = onnx.GraphProto()
    g.node.extend(nodes)
    return g


def _set_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    del graph.node[:]
    graph.node.extend(nodes)


def _expand_one(
    nodes: list[onnx.NodeProto],
    idx: int,
    opset: int,
    names: NameGen,
    dtypes: dict[str, int],
    shapes: dict[str, tuple | None],
    constants: dict,
    opset_imports: Sequence[onnx.OperatorSetIdProto] = (),
    functions: Sequence[onnx.FunctionProto] = (),
    graph: onnx.GraphProto | None = None,
    replace_forward: bool = True,
) -> tuple[list[onnx.NodeProto], set[int]] | _Inline:
    """The nodes that replace the Gradient node ``nodes[idx]`` (the steps of
    the module doc) with the ids of the forward nodes a rule replaced
    (``VJPContext.replace_forward``: they go), or an ``_Inline`` request for
    an op on its path that has no rule but a function body."""
    gnode = nodes[idx]
    xs, zs, y = _gradient_attrs(gnode)
    producer = {o: n for n in nodes for o in n.output if o}
    position = {id(n): i for i, n in enumerate(nodes)}
    values = list(gnode.input)
    sources = list(xs) + list(zs)

    # 1. Substitution: inputs that are not the named tensors themselves.
    rename = {s: v for s, v in zip(sources, values) if v != s}
    if rename:
        return _substitute(gnode, nodes, producer, position, xs, zs, y, rename, names), set()

    # 2. The subgraph between the sources and y (sources are leaves), and the
    #    values on it that depend on an x.
    relevant = _upstream(y, set(sources), producer, position)
    active = _active(relevant, xs, dtypes)
    request = _inline_request(relevant, active, dtypes, shapes, names, opset_imports, functions,
                              lambda: graph or _graph_of(nodes))
    if request is not None:
        return request
    _check_rules(relevant, active, xs, y)

    # 3. The reverse pass, then one output per named x.
    emit = Emitter(opset, names, dtypes, hint=gnode.name or "grad", constants=constants)
    grads: dict[str, list[str]] = {}
    if y in active:
        grads[y] = [emit.ones_like(y)]
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in node_inputs(n):
            readers.setdefault(i, []).append(n)

    def subgraph_vjp(outer_emit, body_nodes, outputs, cotangents, wrt, types):
        return vjp_of_graph(
            body_nodes, outputs, cotangents, wrt, types, opset_imports, names, functions, replace_forward
        )

    chains = stand_ins(relevant, producer, readers, constants, active)  # differentiated as one op: composites.py
    replaced: set[int] = set()
    for n in reversed(relevant):
        dys = [emit.sum_all(grads[o]) if o and o in grads else None for o in n.output]
        if all(d is None for d in dys):
            continue
        may_replace = replace_forward and id(n) not in chains  # (a stand-in is no forward node)
        n = chains.get(id(n), n)
        rule = _usable_rule(n, xs, y)
        if rule.kind == "zero":
            continue
        needs = [bool(i) and i in active for i in n.input]
        ctx = VJPContext(n, emit, shapes, needs, names.fresh, active, subgraph_vjp, readers, may_replace)
        for o, d in zip(n.output, dys):
            if d is not None:
                grads[o] = [d]
        _add_rule_gradients(ctx, rule, dys, needs, active, grads, dtypes, y)
        if ctx.replacement is not None:  # the node's outputs now come from what the rule emitted
            for old, new in zip(n.output, ctx.replacement):
                if old:
                    emit.op("Identity", [new], outputs=[old])
            replaced.add(id(n))

    for k, out in enumerate(gnode.output):
        if not out:
            continue
        contributions = grads.get(xs[k])
        total = emit.sum_all(contributions) if contributions else emit.zeros_like(values[k])
        emit.op("Identity", [total], outputs=[out])
    return emit.nodes, replaced


def _upstream(y: str, leaves: set[str], producer: dict[str, onnx.NodeProto],
              position: dict[int, int]) -> list[onnx.NodeProto]:
    """The nodes ``y`` depends on, not looking past ``leaves``, in graph order."""
    found: list[onnx.NodeProto] = []
    seen: set[int] = set()
    stack = [y]
    while stack:
        name = stack.pop()
        if name in leaves or name not in producer:
            continue
        n = producer[name]
        if id(n) in seen:
            continue
        seen.add(id(n))
        found.append(n)
        stack.extend(node_inputs(n))
    found.sort(key=lambda n: position[id(n)])
    return found


def _active(relevant: list[onnx.NodeProto], xs: list[str], dtypes: dict[str, int]) -> set[str]:
    """The values that depend on an x through differentiable ops: float (or
    untyped) outputs of nodes reading one, past no zero-gradient op."""
    active: set[str] = set(xs)
    for n in relevant:
        rule = REGISTRY.get(n.domain, n.op_type)
        if rule is not None and rule.kind == "zero":
            continue
        if any(i in active for i in node_inputs(n)):
            for o in n.output:
                if o and (dtypes.get(o) in FLOAT_TYPES or o not in dtypes):
                    active.add(o)
    return active


def _inline_request(
    relevant: list[onnx.NodeProto],
    active: set[str],
    dtypes: dict[str, int],
    shapes: dict[str, tuple | None],
    names: NameGen,
    opset_imports: Sequence[onnx.OperatorSetIdProto],
    functions: Sequence[onnx.FunctionProto],
    graph: Callable[[], onnx.GraphProto],
) -> _Inline | None:
    """The first op on the path with no rule whose function body inlines, as
    a request to inline it; None when there is none."""
    for n in relevant:
        if REGISTRY.get(n.domain, n.op_type) is None and any(i in active for i in node_inputs(n)):
            types = [type_proto(dtypes.get(i), shapes.get(i)) if i else None for i in n.input]
            if any(t is None and i for t, i in zip(types, n.input)):
                # Not a tensor (a sequence, an optional): ask inference for the full type.
                full = value_types(graph(), opset_imports, functions)
                types = [t if t is not None or not i else full.get(i) for t, i in zip(types, n.input)]
            body = function_body(n, opset_imports, functions, types)
            if body is not None:
                try:
                    return _Inline(n, inline(n, body, names))
                except ValueError:
                    pass
    return None


def _where(n: onnx.NodeProto) -> str:
    return f"node {n.name!r} ({n.domain + '.' if n.domain else ''}{n.op_type})"


def _usable_rule(n: onnx.NodeProto, xs: list[str], y: str) -> Rule:
    """The rule of ``n``'s op; GradientError when it has none or refuses."""
    rule = REGISTRY.get(n.domain, n.op_type)
    if rule is None:
        raise GradientError(
            f"no gradient rule for op {n.op_type!r}"
            f"{' in domain ' + repr(n.domain) if n.domain else ''}, needed by {_where(n)} "
            f"on the path from {xs} to {y!r}"
        )
    if rule.kind == "refused":
        raise GradientError(f"{_where(n)} is not differentiable: {rule.reason}")
    return rule


def _add_rule_gradients(ctx: VJPContext, rule: Rule, dys: list[str | None], needs: list[bool], active: set[str],
                        grads: dict[str, list[str]], dtypes: dict[str, int], y: str) -> None:
    """Run ``rule`` on node ``ctx.node`` with output gradients ``dys`` and add
    its input gradients (and the implicit ones, of values its subgraphs read)
    to ``grads``.  A rule that returns too many, or none for an input that
    needs one, is an error naming the node."""
    n = ctx.node
    result = rule.fn(ctx, *dys)
    if isinstance(result, str):
        result = (result,)
    result = list(result)
    while len(result) > len(n.input) and result[-1] is None:
        result.pop()  # entries for optional inputs the node leaves out
    if len(result) > len(n.input):
        raise GradientError(
            f"gradient rule of {n.op_type} returned {len(result)} gradients for "
            f"{len(n.input)} inputs ({_where(n)})"
        )
    for i, dx in enumerate(result):
        if dx is not None and needs[i]:
            grads.setdefault(n.input[i], []).append(dx)
    for i in range(len(n.input)):
        if (
            needs[i]
            and (i >= len(result) or result[i] is None)
            and i not in rule.nondiff
            and dtypes.get(n.input[i]) in FLOAT_TYPES
            # a tensor read twice (Mul(a, a)) may get its whole gradient in one slot
            and not any(
                dx is not None and n.input[j] == n.input[i] for j, dx in enumerate(result)
            )
        ):
            raise GradientError(
                f"{_where(n)}: its rule gives no gradient for input {i} ({n.input[i]!r}), on "
                f"which {y!r} depends; differentiating with respect to it is not supported"
            )
    for name, dxs in ctx.implicit_grads.items():
        if name in active:
            grads.setdefault(name, []).extend(dxs)


#: Float element types by width, for summing terms of different types.
_FLOAT_WIDTH = {
    onnx.TensorProto.BFLOAT16: 0, onnx.TensorProto.FLOAT16: 1,
    onnx.TensorProto.FLOAT: 2, onnx.TensorProto.DOUBLE: 3,
}


def vjp_of_graph(
    body_nodes: Sequence[onnx.NodeProto],
    outputs: Sequence[str],
    cotangents: Sequence[str | None],
    wrt: Sequence[str],
    types: dict[str, tuple[int, tuple | None]],
    opset_imports: Sequence[onnx.OperatorSetIdProto],
    names: NameGen,
    functions: Sequence[onnx.FunctionProto] = (),
    replace_forward: bool = True,
) -> tuple[list[onnx.NodeProto], list[str]]:
    """Differentiate a subgraph body: nodes computing the body's forward pass,
    then d/d(wrt) of sum_k <outputs[k], cotangents[k]>.

    Free names of the body, the cotangents and ``wrt`` are typed by ``types``;
    they become inputs of a scratch graph that is expanded like any other and
    then dropped, so the returned nodes read them from the enclosing scope.
    Returns (nodes, one gradient name per wrt)."""
    scratch = onnx.GraphProto()
    scratch.name = "subgraph_vjp"
    copies = [_copy(n) for n in body_nodes]
    produced = {o for n in copies for o in n.output if o}
    free: list[str] = []
    for n in copies:
        for i in node_inputs(n):
            if i and i not in produced and i not in free:
                free.append(i)
    for extra in list(cotangents) + list(wrt):
        if extra and extra not in produced and extra not in free:
            free.append(extra)
    for name in free:
        if name not in types:
            raise GradientError(f"subgraph differentiation: the type of {name!r} is unknown")
        et, shape = types[name]
        # Unknown sizes get distinct symbols: one shared "?" would claim they are equal.
        dims = None if shape is None else [
            d if d is not None else f"unk_{name}_{i}" for i, d in enumerate(shape)
        ]
        scratch.input.append(helper.make_tensor_value_info(name, et, dims))
    terms = []
    # The body's outputs may differ in float type (a body computing in float32
    # and casting one output back to double): the terms are summed in the
    # widest type among them.  A cotangent has its output's type.
    term_type = {c: types[c][0] for c in cotangents if c and c in types}
    widest = max(term_type.values(), key=lambda t: _FLOAT_WIDTH.get(t, -1), default=None)
    for out, cot in zip(outputs, cotangents):
        if not cot:
            continue
        prod = names.fresh(f"{out}/vjp_term")
        total = names.fresh(f"{out}/vjp_sum")
        copies.append(helper.make_node("Mul", [out, cot], [prod], name=names.fresh("vjp_mul")))
        copies.append(helper.make_node("ReduceSum", [prod], [total], keepdims=0, name=names.fresh("vjp_sum")))
        if cot in term_type and term_type[cot] != widest:
            wide = names.fresh(f"{out}/vjp_sum_cast")
            copies.append(helper.make_node("Cast", [total], [wide], to=widest, name=names.fresh("vjp_cast")))
            total = wide
        terms.append(total)
    grads = [names.fresh(f"{w}/vjp_grad") for w in wrt]
    if terms:
        objective = names.fresh("vjp_objective")
        copies.append(helper.make_node("Sum", terms, [objective], name=names.fresh("vjp_total")))
        copies.append(
            helper.make_node(
                "Gradient", list(wrt), grads, domain=PREVIEW_DOMAIN, xs=list(wrt),
                y=objective, name=names.fresh("vjp_gradient"),
            )
        )
    scratch.node.extend(copies)
    if terms:
        expand_gradients(scratch, opset_imports, names, free, functions, replace_forward)
        nodes = list(scratch.node)
    else:
        emit = Emitter(opset_version(opset_imports) or 1, names, {w: types[w][0] for w in wrt})
        for w, g in zip(wrt, grads):
            emit.op("Identity", [emit.zeros_like(w)], outputs=[g])
        nodes = copies + emit.nodes
    return nodes, grads


def _check_rules(relevant: list[onnx.NodeProto], active: set[str], xs: list[str], y: str) -> None:
    """Fail before emitting anything if a node on the path has no usable rule."""
    for n in relevant:
        if any(i in active for i in node_inputs(n)):
            _usable_rule(n, xs, y)


def _substitute(
    gnode: onnx.NodeProto,
    nodes: list[onnx.NodeProto],
    producer: dict[str, onnx.NodeProto],
    position: dict[int, int],
    xs: list[str],
    zs: list[str],
    y: str,
    rename: dict[str, str],
    names: NameGen,
) -> list[onnx.NodeProto]:
    """Clone the forward nodes between the substituted sources and y, reading
    the Gradient's input values, and point a rewritten Gradient at the clone."""
    upstream = _upstream(y, set(xs) | set(zs), producer, position)

    mapping = dict(rename)
    clones: list[onnx.NodeProto] = []
    for n in upstream:
        if not any(i in mapping for i in node_inputs(n)):
            continue
        if any(i in mapping for i in node_inputs(n) if i not in n.input):
            raise GradientError(
                f"Gradient node {gnode.name!r}: cannot substitute a value read inside the "
                f"subgraph of node {n.name!r} ({n.op_type})"
            )
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = names.fresh((n.name or n.op_type) + "/at_point")
        del c.input[:]
        c.input.extend(mapping.get(i, i) if i else i for i in n.input)
        del c.output[:]
        for o in n.output:
            if o:
                mapping[o] = names.fresh(o + "/at_point")
                c.output.append(mapping[o])
            else:
                c.output.append("")
        clones.append(c)

    g = helper.make_node(
        "Gradient",
        list(gnode.input),
        list(gnode.output),
        name=gnode.name,
        domain=PREVIEW_DOMAIN,
        xs=[mapping.get(x, x) for x in xs],
        y=mapping.get(y, y),
        **({"zs": [mapping.get(z, z) for z in zs]} if zs else {}),
    )
    return clones + [g]
