"""Gradient rules: control flow (If, Loop, Scan).

A subgraph's intermediate values are invisible outside its node, so the
backward pass of a branch or body recomputes that body's forward pass inside a
new subgraph and differentiates it there (``ctx.vjp_of_graph``).  Gradients of
the outer-scope values a subgraph reads (its implicit inputs) are returned
through ``ctx.accumulate``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from ...core.emitter import FLOAT_TYPES, Emitter
from ...core.graph import graph_names, shape_of_type
from ...errors import TrainingModelError
from ..registry import VJPContext, vjp


def _body_nodes(g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """A subgraph's nodes, with its own initializers turned into Constants."""
    consts = [
        helper.make_node("Constant", [], [t.name], value=t, name=f"{g.name}/{t.name}/const")
        for t in g.initializer
    ]
    return consts + list(g.node)


def _types(ctx: VJPContext, names: list[str]) -> dict[str, tuple[int, tuple | None]]:
    return {n: (ctx.dtype(n), ctx.shape(n)) for n in names if n}


@vjp("If")
def if_vjp(ctx, *dys):
    """y = cond ? then_branch() : else_branch()
    ->  d(outer v) = cond ? vjp(then_branch, dy)[v] : vjp(else_branch, dy)[v]

    Each backward branch recomputes its forward branch, then differentiates it
    with the output gradients as cotangents; the condition gets no gradient."""
    e = ctx.emit
    targets = [v for v in ctx.implicit_inputs if ctx.needs_name(v)]
    if not targets:
        return (None,)
    cotangents = list(dys)
    for o, d in zip(ctx.outputs, cotangents):
        if d is not None:
            e.dtypes.setdefault(d, ctx.dtype(o))
    branches = {}
    for attr in ("then_branch", "else_branch"):
        g = ctx.attr(attr)
        free = set(ctx.implicit_inputs) | {d for d in cotangents if d}
        nodes, grads = ctx.vjp_of_graph(
            _body_nodes(g), [o.name for o in g.output], cotangents, targets,
            _types(ctx, sorted(free)),
        )
        outputs = [helper.make_tensor_value_info(gr, ctx.dtype(t), None) for gr, t in zip(grads, targets)]
        branches[attr] = helper.make_graph(nodes, f"{g.name or attr}_grad", [], outputs)
    outs = e.op("If", [ctx.inputs[0]], outputs=len(targets), **branches)
    outs = outs if isinstance(outs, list) else [outs]
    _accumulate_outer(ctx, targets, outs)
    return (None,)


# ===================================================================== helpers
# Shared by Scan and Loop (and by the recurrent ops, which lower to Scan).

Type = tuple[int | None, tuple | None]


def _declared(v: onnx.ValueInfoProto) -> Type:
    """(elem_type, shape) a subgraph ValueInfo declares; None where it says nothing."""
    if not v.type.HasField("tensor_type"):
        return None, None
    return v.type.tensor_type.elem_type or None, shape_of_type(v.type)


def _merge(a: Type, b: Type) -> Type:
    """Combine what two sources know about one value's type (``a`` wins ties)."""
    et = a[0] or b[0]
    sa, sb = a[1], b[1]
    if sa is None or sb is None or len(sa) != len(sb):
        return et, sa if sa is not None else sb
    return et, tuple(x if x is not None else y for x, y in zip(sa, sb))


def _drop_axis(shape: tuple | None, axis: int) -> tuple | None:
    """The shape of one slice of a tensor scanned along ``axis``."""
    if shape is None:
        return None
    axis = axis % len(shape) if -len(shape) <= axis < len(shape) else None
    if axis is None:
        return None
    return shape[:axis] + shape[axis + 1 :]


def _outer(ctx: VJPContext, name: str) -> Type:
    return ctx.emit.dtypes.get(name), ctx.shape(name)


class Slots:
    """Types handed to ``vjp_of_graph``.  Unknown dimensions get fresh symbols,
    one per slot, so two unrelated unknown sizes are never taken as equal
    (a '?' shared by all would let static broadcasting checks go wrong)."""

    def __init__(self, ctx: VJPContext) -> None:
        self.ctx = ctx
        self.types: dict[str, tuple[int, tuple | None]] = {}

    def symbolic(self, t: Type, what: str) -> tuple[int, tuple | None]:
        et, shape = t
        if et is None:
            raise TrainingModelError(
                f"gradient of {self.ctx.node.op_type} node {self.ctx.node.name!r}: the element "
                f"type of {what!r} is unknown"
            )
        if shape is not None:
            shape = tuple(
                d if d is not None else self.ctx.emit.names.fresh(f"{what}_dim{k}")
                for k, d in enumerate(shape)
            )
        return et, shape

    def add(self, name: str, t: tuple[int, tuple | None]) -> None:
        self.types[name] = t


def _value_info(name: str, t: Type) -> onnx.ValueInfoProto:
    """A subgraph input/output declaration: static sizes kept, the rest left open."""
    et, shape = t
    dims = None if shape is None else [d if isinstance(d, int) else None for d in shape]
    return helper.make_tensor_value_info(name, et or 0, dims)


def _attr_graph(node: onnx.NodeProto, name: str) -> onnx.GraphProto:
    """The node's own (mutable) graph attribute."""
    for a in node.attribute:
        if a.name == name and a.type == onnx.AttributeProto.GRAPH:
            return a.g
    raise TrainingModelError(f"{node.op_type} node {node.name!r} has no {name!r} attribute")


def _set_ints(node: onnx.NodeProto, name: str, values: list[int]) -> None:
    for a in list(node.attribute):
        if a.name == name:
            node.attribute.remove(a)
    if values:
        node.attribute.append(helper.make_attribute(name, [int(v) for v in values]))


def _pad_outputs(ctx: VJPContext, count: int) -> None:
    """Give the node ``count`` named outputs (a trailing output left off gets a
    fresh unused name), so that outputs appended later line up with the body."""
    node = ctx.node
    out = list(node.output)
    while len(out) < count:
        out.append("")
    out = [o or ctx.emit.names.fresh(f"{node.name or node.op_type}/unused{k}") for k, o in enumerate(out)]
    del node.output[:]
    node.output.extend(out)


_RECORD_TAG = "onnxtrain: per-iteration record for the gradient"


def _record(ctx: VJPContext, body: onnx.GraphProto, name: str, t: Type, offset: int) -> tuple[str, bool]:
    """Make the forward node also output, stacked over iterations, the body
    value ``name`` (a body input such as a state): an Identity body output and
    one more scan output.  ``offset`` is how many body outputs precede the
    node's first output (Loop's condition).  Returns the stacked output's name
    and whether it is new: a record made for an earlier Gradient is reused."""
    body_outputs = [o.name for o in body.output]
    for n in body.node:
        if n.op_type == "Identity" and n.doc_string == _RECORD_TAG and list(n.input) == [name]:
            if n.output[0] in body_outputs:
                j = body_outputs.index(n.output[0]) - offset
                if 0 <= j < len(ctx.node.output) and ctx.node.output[j]:
                    return ctx.node.output[j], False
    names = ctx.emit.names
    inner = names.fresh(f"{name}/record")
    node = helper.make_node("Identity", [name], [inner], name=names.fresh(f"{name}/record_node"))
    node.doc_string = _RECORD_TAG
    body.node.append(node)
    body.output.append(_value_info(inner, t))
    outer = names.fresh(f"{ctx.node.name or ctx.node.op_type}/{name}/stacked")
    ctx.node.output.append(outer)
    if t[0] is not None:
        ctx.emit.dtypes[outer] = t[0]
    return outer, True


def _implicit_targets(ctx: VJPContext) -> list[str]:
    """Outer-scope float values the body reads and whose gradient is wanted."""
    return [
        v for v in ctx.implicit_inputs
        if ctx.needs_name(v) and ctx.emit.dtypes.get(v) in FLOAT_TYPES
    ]


def _cotangent_types(ctx: VJPContext, types: list[Type], dys) -> list[Type]:
    """Where neither the body nor inference typed a scan output, its incoming
    gradient's type tells (a cotangent is never dropped for want of a type)."""
    return [
        (t[0] or (ctx.emit.dtypes.get(d) if d is not None else None), t[1])
        for t, d in zip(types, dys)
    ]


def _accumulate_outer(ctx: VJPContext, targets: list[str], grads: list[str]) -> None:
    """Add ``grads`` (typed as their values) to the gradients of the outer
    values ``targets`` a subgraph reads."""
    for v, g in zip(targets, grads):
        ctx.emit.dtypes[g] = ctx.dtype(v)
        ctx.accumulate(v, g)


def _add_outer_types(ctx: VJPContext, slots: Slots) -> None:
    for v in ctx.implicit_inputs:
        if ctx.emit.dtypes.get(v) is not None:
            slots.add(v, slots.symbolic(_outer(ctx, v), v))


# ======================================================================== Scan
@dataclass
class _ScanSignature:
    """A Scan node read as the formula in ``scan_vjp``: ``n`` states, ``m``
    scan inputs and ``k`` scan outputs; their body names, directions, axes,
    and per-iteration types (``st_t`` of a state, ``x_t`` of a scan input's
    slice, ``y_t`` of a scan output's slice)."""

    n: int
    m: int
    k: int
    in_dirs: list[int]
    in_axes: list[int]
    out_dirs: list[int]
    out_axes: list[int]
    state_in: list[str]
    scan_in: list[str]
    state_out: list[str]
    scan_out: list[str]
    st_t: list[Type]
    x_t: list[Type]
    y_t: list[Type]


def _scan_signature(ctx: VJPContext, body: onnx.GraphProto, dys: list) -> _ScanSignature:
    e = ctx.emit
    node = ctx.node
    m = int(ctx.attr("num_scan_inputs"))
    n = len(node.input) - m
    k = len(body.output) - n
    in_axes = [int(v) for v in (ctx.attr("scan_input_axes") or [0] * m)]
    out_axes = [int(v) for v in (ctx.attr("scan_output_axes") or [0] * k)]
    outputs = list(node.output) + [""] * (n + k - len(node.output))
    x_t = [
        _merge(_declared(body.input[n + j]),
               (e.dtypes.get(node.input[n + j]), _drop_axis(ctx.shape(node.input[n + j]), in_axes[j])))
        for j in range(m)
    ]
    y_t = [
        _merge(_declared(body.output[n + i]),
               (e.dtypes.get(outputs[n + i]) if outputs[n + i] else None,
                _drop_axis(ctx.shape(outputs[n + i]), out_axes[i]) if outputs[n + i] else None))
        for i in range(k)
    ]
    return _ScanSignature(
        n=n, m=m, k=k,
        in_dirs=[int(v) for v in (ctx.attr("scan_input_directions") or [0] * m)],
        in_axes=in_axes,
        out_dirs=[int(v) for v in (ctx.attr("scan_output_directions") or [0] * k)],
        out_axes=out_axes,
        state_in=[body.input[i].name for i in range(n)],
        scan_in=[body.input[n + j].name for j in range(m)],
        state_out=[body.output[i].name for i in range(n)],
        scan_out=[body.output[n + i].name for i in range(k)],
        st_t=[_merge(_declared(body.input[i]), _outer(ctx, node.input[i])) for i in range(n)],
        x_t=x_t,
        y_t=_cotangent_types(ctx, y_t, dys[n:]),
    )


@vjp("Scan")
def scan_vjp(ctx, *dys):
    """Scan (opset 9+): s_0 = initial states; for t in processing order
        s_{t+1}, y_t = body(s_t, x_t)          (x_t: slices of the scan inputs)
    with outputs s_T and the stacked y_t.  Reverse mode walks t backwards:
        ds_t, dx_t, dw_t = vjp(body at (s_t, x_t))(ds_{t+1}, dy_t)
        dw = sum_t dw_t                         (w: outer values the body reads)
    starting from ds_T = d(final states).

    The forward Scan is extended to also output the stacked states s_t (an
    Identity of each state input as an extra scan output), so nothing is
    recomputed except the body itself, inside the backward Scan's body.  That
    backward Scan reads every stacked sequence in the opposite direction of
    the forward, carries ds and the dw accumulators as states, and emits dx_t
    in the opposite direction, so dx lines up with x.  The sequence length is
    never needed statically."""
    e = ctx.emit
    node = ctx.node
    if ctx.opset < 9:
        raise TrainingModelError(
            f"gradient of Scan node {node.name!r}: opset {ctx.opset} Scan (Scan-8, with a batch "
            "axis and sequence_lens) is not supported; use opset 9 or later"
        )
    body = _attr_graph(node, "body")
    e.names.reserve(graph_names(body))
    m = int(ctx.attr("num_scan_inputs"))
    n = len(node.input) - m
    dys = list(dys) + [None] * (len(body.output) - len(dys))
    sig = _scan_signature(ctx, body, dys)

    # Which states, scan inputs, outer values and scan outputs take part.
    fs = [i for i in range(n) if sig.st_t[i][0] in FLOAT_TYPES]
    need_x = [j for j in range(m) if ctx.needs(n + j) and sig.x_t[j][0] in FLOAT_TYPES]
    targets = _implicit_targets(ctx)
    cot = [k for k in range(sig.k) if dys[n + k] is not None and sig.y_t[k][0] in FLOAT_TYPES]
    result: list[str | None] = [None] * len(node.input)
    if not (any(ctx.needs(i) for i in fs) or need_x or targets):
        return result

    backward_body = _scan_backward_body(ctx, body, sig, fs, need_x, targets, cot)

    # Forward: record the state entering each iteration.
    _pad_outputs(ctx, n + sig.k)
    records = [_record(ctx, body, sig.state_in[i], sig.st_t[i], 0) for i in range(n)]
    recorded = [r for r, _ in records]
    added = sum(new for _, new in records)
    if added:
        _set_ints(node, "scan_output_directions", sig.out_dirs + [0] * added)
        _set_ints(node, "scan_output_axes", sig.out_axes + [0] * added)

    # Backward: one Scan over the records, the inputs and the cotangents, reversed.
    ds_init = [dys[i] if dys[i] is not None else e.zeros_like(node.input[i]) for i in fs]
    acc_init = [e.zeros_like(v) for v in targets]
    scan_inputs = recorded + list(node.input[n:]) + [dys[n + k] for k in cot]
    attrs = dict(
        body=backward_body,
        num_scan_inputs=len(scan_inputs),
        scan_input_directions=[1] * n + [1 - d for d in sig.in_dirs] + [1 - sig.out_dirs[k] for k in cot],
        scan_input_axes=[0] * n + sig.in_axes + [sig.out_axes[k] for k in cot],
    )
    if need_x:
        attrs["scan_output_directions"] = [1 - sig.in_dirs[j] for j in need_x]
        attrs["scan_output_axes"] = [sig.in_axes[j] for j in need_x]
    n_out = len(fs) + len(targets) + len(need_x)
    outs = e.op("Scan", ds_init + acc_init + scan_inputs, outputs=n_out, **attrs)
    outs = outs if isinstance(outs, list) else [outs]
    o_state = outs[: len(fs)]
    o_acc = outs[len(fs) : len(fs) + len(targets)]
    o_x = outs[len(fs) + len(targets) :]
    for i, o in zip(fs, o_state):
        e.dtypes[o] = sig.st_t[i][0]
        if ctx.needs(i):
            result[i] = o
    for j, o in zip(need_x, o_x):
        e.dtypes[o] = sig.x_t[j][0]
        result[n + j] = o
    _accumulate_outer(ctx, targets, o_acc)
    return result


def _scan_backward_body(
    ctx: VJPContext,
    body: onnx.GraphProto,
    sig: _ScanSignature,
    fs: list[int],
    need_x: list[int],
    targets: list[str],
    cot: list[int],
) -> onnx.GraphProto:
    """The backward Scan's body: states (ds of the float states ``fs``, the
    accumulators of the outer ``targets``), then scan inputs (the recorded
    states, the forward's scan inputs, the cotangents of the outputs ``cot``);
    it recomputes the forward body and outputs ds, the accumulators and dx of
    the scan inputs ``need_x``."""
    e = ctx.emit
    n, m = sig.n, sig.m
    forward_nodes = [_copy_node(x) for x in _body_nodes(body)]
    slots = Slots(ctx)
    st_sym = [slots.symbolic(sig.st_t[i], sig.state_in[i]) for i in range(n)]
    for i in range(n):
        slots.add(sig.state_in[i], st_sym[i])
    for j in range(m):
        slots.add(sig.scan_in[j], slots.symbolic(sig.x_t[j], sig.scan_in[j]))
    ds_in = [e.names.fresh(f"{sig.state_in[i]}/cotangent") for i in fs]
    for i, d in zip(fs, ds_in):
        slots.add(d, st_sym[i])
    dy_in = [e.names.fresh(f"{sig.scan_out[k]}/cotangent") for k in cot]
    for k, d in zip(cot, dy_in):
        slots.add(d, slots.symbolic(sig.y_t[k], sig.scan_out[k]))
    _add_outer_types(ctx, slots)
    acc_in = [e.names.fresh(f"{v}/grad_acc") for v in targets]

    wrt = [sig.state_in[i] for i in fs] + [sig.scan_in[j] for j in need_x] + targets
    vjp_nodes, grads = ctx.vjp_of_graph(
        forward_nodes,
        [sig.state_out[i] for i in fs] + [sig.scan_out[k] for k in cot],
        ds_in + dy_in,
        wrt,
        slots.types,
    )
    g_state = grads[: len(fs)]
    g_x = grads[len(fs) : len(fs) + len(need_x)]
    g_outer = grads[len(fs) + len(need_x) :]
    be = Emitter(e.opset, e.names, dict(e.dtypes), hint="scan_grad")
    acc_out = [be.Add(a, g) for a, g in zip(acc_in, g_outer)]

    b_inputs = (
        [_value_info(d, sig.st_t[i]) for i, d in zip(fs, ds_in)]
        + [_value_info(a, _outer(ctx, v)) for a, v in zip(acc_in, targets)]
        + [_value_info(sig.state_in[i], sig.st_t[i]) for i in range(n)]
        + [_value_info(sig.scan_in[j], sig.x_t[j]) for j in range(m)]
        + [_value_info(d, sig.y_t[k]) for k, d in zip(cot, dy_in)]
    )
    b_outputs = (
        [_value_info(g, sig.st_t[i]) for i, g in zip(fs, g_state)]
        + [_value_info(a, _outer(ctx, v)) for a, v in zip(acc_out, targets)]
        + [_value_info(g, sig.x_t[j]) for j, g in zip(need_x, g_x)]
    )
    return helper.make_graph(vjp_nodes + be.nodes, f"{body.name or 'scan_body'}_grad", b_inputs, b_outputs)


def _copy_node(node: onnx.NodeProto) -> onnx.NodeProto:
    c = onnx.NodeProto()
    c.CopyFrom(node)
    return c


# ======================================================================== Loop
@vjp("Loop")
def loop_vjp(ctx, *dys):
    """Loop: v_0 = initial values; for i = 0 .. T-1 (while cond holds)
        cond, v_{i+1}, y_i = body(i, cond, v_i)
    with outputs v_T and the stacked y_i.  Reverse mode:
        dv_i, dw_i = vjp(body at (i, true, v_i))(dv_{i+1}, dy_i),  dw = sum_i dw_i

    The forward Loop is extended to also output, stacked, the iteration number
    and every loop-carried value entering an iteration.  The number of
    iterations actually run, T, is the length of that stack, so any trip count
    or condition works.  A backward Loop runs T times with u = 0 .. T-1 and
    works on iteration i = T-1-u, gathering v_i and dy_i from the stacks,
    recomputing the body and carrying dv and the outer-value accumulators.
    The trip count and condition get no gradient."""
    e = ctx.emit
    node = ctx.node
    body = _attr_graph(node, "body")
    e.names.reserve(graph_names(body))
    n = len(node.input) - 2
    k_out = len(body.output) - 1 - n
    if n < 0 or k_out < 0:
        raise TrainingModelError(f"Loop node {node.name!r}: body and node signatures disagree")
    dys = list(dys) + [None] * (n + k_out - len(dys))
    outputs = list(node.output) + [""] * (n + k_out - len(node.output))
    iter_name = body.input[0].name
    v_in = [body.input[2 + i].name for i in range(n)]
    v_t = [_merge(_declared(body.input[2 + i]), _outer(ctx, node.input[2 + i])) for i in range(n)]
    y_t = [
        _merge(_declared(body.output[1 + n + k]),
               (e.dtypes.get(outputs[n + k]) if outputs[n + k] else None,
                _drop_axis(ctx.shape(outputs[n + k]), 0) if outputs[n + k] else None))
        for k in range(k_out)
    ]
    y_t = _cotangent_types(ctx, y_t, dys[n:])
    fs = [i for i in range(n) if v_t[i][0] in FLOAT_TYPES]
    targets = _implicit_targets(ctx)
    cot = [k for k in range(k_out) if dys[n + k] is not None and y_t[k][0] in FLOAT_TYPES]
    result: list[str | None] = [None] * len(node.input)
    if not (any(ctx.needs(2 + i) for i in fs) or targets):
        return result

    forward_nodes = [_copy_node(x) for x in _body_nodes(body)]

    # Forward: record the iteration number and each value entering an iteration.
    _pad_outputs(ctx, n + k_out)
    int_scalar = (onnx.TensorProto.INT64, ())
    rec_iter = _record(ctx, body, iter_name, int_scalar, 1)[0]
    rec_v = [_record(ctx, body, v_in[i], v_t[i], 1)[0] for i in range(n)]

    # T = number of iterations run; the backward Loop visits i = T-1-u.
    trips = e.Gather(e.Shape(rec_iter), e.scalar_int(0), axis=0)
    last = e.Sub(trips, e.scalar_int(1))

    # Backward: one Loop over i = T-1 .. 0, carrying dv and the accumulators.
    backward_body = _loop_backward_body(ctx, body, forward_nodes, v_t, y_t, fs, cot, targets, rec_v, last, dys)
    dv_init = [dys[i] if dys[i] is not None else e.zeros_like(node.input[2 + i]) for i in fs]
    acc_init = [e.zeros_like(v) for v in targets]
    true = e.const(np.asarray(True))
    outs = e.op("Loop", [trips, true] + dv_init + acc_init, outputs=len(fs) + len(targets),
                body=backward_body)
    outs = outs if isinstance(outs, list) else [outs]
    for i, o in zip(fs, outs[: len(fs)]):
        e.dtypes[o] = v_t[i][0]
        if ctx.needs(2 + i):
            result[2 + i] = o
    _accumulate_outer(ctx, targets, outs[len(fs) :])
    return result


def _loop_backward_body(
    ctx: VJPContext,
    body: onnx.GraphProto,
    forward_nodes: list[onnx.NodeProto],
    v_t: list[Type],
    y_t: list[Type],
    fs: list[int],
    cot: list[int],
    targets: list[str],
    rec_v: list[str],
    last: str,
    dys: list,
) -> onnx.GraphProto:
    """The backward Loop's body, run with u = 0 .. T-1 (``last`` = T-1): it
    gathers v_i (from the records ``rec_v``) and dy_i at i = T-1-u, recomputes
    the forward body (``forward_nodes``, copied before the records), and carries dv of the float loop-carried values ``fs``
    and the accumulators of the outer ``targets``."""
    e = ctx.emit
    n = len(v_t)
    int_scalar = (onnx.TensorProto.INT64, ())
    iter_name, cond_name = body.input[0].name, body.input[1].name
    v_in = [body.input[2 + i].name for i in range(n)]
    v_out = [body.output[1 + i].name for i in range(n)]
    scan_out = [body.output[1 + n + k].name for k in range(len(y_t))]
    slots = Slots(ctx)
    slots.add(iter_name, int_scalar)
    slots.add(cond_name, (onnx.TensorProto.BOOL, ()))
    v_sym = [slots.symbolic(v_t[i], v_in[i]) for i in range(n)]
    for i in range(n):
        slots.add(v_in[i], v_sym[i])
    dv_in = [e.names.fresh(f"{v_in[i]}/cotangent") for i in fs]
    for i, d in zip(fs, dv_in):
        slots.add(d, v_sym[i])
    u = e.names.fresh("loop_grad/u")
    cb = e.names.fresh("loop_grad/cond")
    pre = Emitter(e.opset, e.names, dict(e.dtypes), hint="loop_grad")
    t = pre.Sub(last, u)
    pre.op("Identity", [t], outputs=[iter_name])
    pre.op("Identity", [cb], outputs=[cond_name])
    for i in range(n):
        pre.op("Gather", [rec_v[i], t], outputs=[v_in[i]], axis=0)
    dy_t = []
    for k in cot:
        d = pre.Gather(dys[n + k], t, axis=0)
        slots.add(d, slots.symbolic(y_t[k], scan_out[k]))
        dy_t.append(d)
    _add_outer_types(ctx, slots)
    acc_in = [e.names.fresh(f"{v}/grad_acc") for v in targets]

    vjp_nodes, grads = ctx.vjp_of_graph(
        forward_nodes,
        [v_out[i] for i in fs] + [scan_out[k] for k in cot],
        dv_in + dy_t,
        [v_in[i] for i in fs] + targets,
        slots.types,
    )
    g_state, g_outer = grads[: len(fs)], grads[len(fs) :]
    post = Emitter(e.opset, e.names, dict(e.dtypes), hint="loop_grad")
    cond_out = post.Identity(cb)
    acc_out = [post.Add(a, g) for a, g in zip(acc_in, g_outer)]
    b_inputs = (
        [_value_info(u, int_scalar), _value_info(cb, (onnx.TensorProto.BOOL, ()))]
        + [_value_info(d, v_t[i]) for i, d in zip(fs, dv_in)]
        + [_value_info(a, _outer(ctx, v)) for a, v in zip(acc_in, targets)]
    )
    b_outputs = (
        [_value_info(cond_out, (onnx.TensorProto.BOOL, ()))]
        + [_value_info(g, v_t[i]) for i, g in zip(fs, g_state)]
        + [_value_info(a, _outer(ctx, v)) for a, v in zip(acc_out, targets)]
    )
    return helper.make_graph(
        pre.nodes + vjp_nodes + post.nodes, f"{body.name or 'loop_body'}_grad", b_inputs, b_outputs
    )

