"""Gradient rules: recurrent layers (RNN, GRU, LSTM).

Each layer is lowered to an equivalent graph of standard ops: the input
projections X W^T + Wb for every time step at once (one MatMul), then one Scan
per direction whose body is the cell (the recurrence H_{t-1} R^T and the gate
nonlinearities).  The rule recomputes the layer with that graph and
differentiates it with ``ctx.vjp_of_graph``, which hands the Scan to the Scan
rule (control.py): the backward Scan walks the time steps in reverse order and
accumulates the gradients of R and of the recurrent biases.  Nothing depends
on the sequence length or batch size being known before run time.

Supported: every direction (forward, reverse, bidirectional), optional B,
initial_h, initial_c and P (LSTM peepholes), layout 0 and 1, clip, GRU's
linear_before_reset 0 and 1, and the activations that take no alpha/beta
parameters (Sigmoid, Tanh, Relu, Softsign, Softplus).  sequence_lens
(per-batch lengths) and LSTM's input_forget are refused with a
TrainingModelError.

The cell equations (ONNX spec; * is the matrix product, (.) elementwise):

    RNN   H = f(X W^T + H' R^T + Wb + Rb)
    GRU   z = f(X Wz^T + H' Rz^T + Wbz + Rbz)
          r = f(X Wr^T + H' Rr^T + Wbr + Rbr)
          h = g(X Wh^T + (r (.) H') Rh^T + Rbh + Wbh)        linear_before_reset=0
          h = g(X Wh^T + r (.) (H' Rh^T + Rbh) + Wbh)        linear_before_reset=1
          H = (1 - z) (.) h + z (.) H'
    LSTM  i = f(X Wi^T + H' Ri^T + Pi (.) C' + Wbi + Rbi)
          f = f(X Wf^T + H' Rf^T + Pf (.) C' + Wbf + Rbf)
          c = g(X Wc^T + H' Rc^T + Wbc + Rbc)
          C = f (.) C' + i (.) c
          o = f(X Wo^T + H' Ro^T + Po (.) C + Wbo + Rbo)
          H = o (.) h(C)

with gate blocks stacked in W, R, B in the orders z r h (GRU) and i o f c
(LSTM), peepholes P in the order i o f.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...core.emitter import Emitter, np_dtype
from ...errors import TrainingModelError
from ..registry import VJPContext, vjp
from .control import Slots

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
# Activations without parameters, by lower-case name (the spec's names are
# matched case-insensitively, as runtimes do).
ACTIVATIONS = {a.lower(): a for a in ("Sigmoid", "Tanh", "Relu", "Softsign", "Softplus")}

# Input positions: X, W, R, B, sequence_lens, initial_h, initial_c (LSTM), P (LSTM).
X, W, R, B, SEQ_LENS, INITIAL_H, INITIAL_C, P = range(8)


@dataclass
class _Spec:
    op: str
    gates: int
    reverse: list[bool]  # one per direction
    activations: list[list[str]]  # per direction
    clip: float | None
    linear_before_reset: int
    layout: int
    hidden_size: int | None


def _spec(node: onnx.NodeProto, opset: int) -> _Spec:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    where = f"{node.op_type} node {node.name!r}"
    if opset < 9:
        raise TrainingModelError(
            f"gradient of {where}: needs opset >= 9 (the gradient uses Scan-9), model has {opset}"
        )
    if len(node.input) > SEQ_LENS and node.input[SEQ_LENS]:
        raise TrainingModelError(
            f"gradient of {where}: sequence_lens is not supported; only full-length sequences "
            "(omit sequence_lens, or pad and mask the loss instead)"
        )
    if node.op_type == "LSTM" and int(attrs.get("input_forget", 0)):
        raise TrainingModelError(f"gradient of {where}: input_forget=1 is not supported")
    for a in ("activation_alpha", "activation_beta"):
        if a in attrs and list(attrs[a]):
            raise TrainingModelError(
                f"gradient of {where}: {a} is not supported; only activations without "
                f"parameters ({', '.join(sorted(ACTIVATIONS.values()))})"
            )
    direction = attrs.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    if direction not in ("forward", "reverse", "bidirectional"):
        raise TrainingModelError(f"{where}: unknown direction {direction!r}")
    reverse = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[direction]
    per = len(DEFAULT_ACTIVATIONS[node.op_type])
    given = [a.decode() if isinstance(a, bytes) else a for a in attrs.get("activations", [])]
    if not given:
        given = DEFAULT_ACTIVATIONS[node.op_type] * len(reverse)
    if len(given) != per * len(reverse):
        raise TrainingModelError(
            f"{where}: expected {per * len(reverse)} activations for direction {direction!r}, "
            f"got {len(given)}"
        )
    acts = []
    for name in given:
        if name.lower() not in ACTIVATIONS:
            raise TrainingModelError(
                f"gradient of {where}: activation {name!r} is not supported; supported: "
                f"{', '.join(sorted(ACTIVATIONS.values()))}"
            )
        acts.append(ACTIVATIONS[name.lower()])
    clip = attrs.get("clip")
    hidden = attrs.get("hidden_size")
    return _Spec(
        op=node.op_type,
        gates=GATES[node.op_type],
        reverse=reverse,
        activations=[acts[d * per : (d + 1) * per] for d in range(len(reverse))],
        clip=None if clip is None else float(clip),
        linear_before_reset=int(attrs.get("linear_before_reset", 0)),
        layout=int(attrs.get("layout", 0)),
        hidden_size=None if hidden is None else int(hidden),
    )


def _per_direction(e: Emitter, x: str, directions: int) -> list[str]:
    """[num_directions, ...] -> one tensor per direction without the leading axis."""
    return [e.squeeze(p, [0]) for p in e.split_equal(x, directions, 0)]


def _input(node: onnx.NodeProto, i: int) -> str | None:
    return node.input[i] if i < len(node.input) and node.input[i] else None


def lower_recurrent(node: onnx.NodeProto, e: Emitter, outputs: list[str]) -> None:
    """Emit into ``e`` standard ops computing ``node`` (RNN, GRU or LSTM), with
    its outputs Y, Y_h (, Y_c) written to the names in ``outputs`` ('' skips one).

    ``e.dtypes`` must know the element type of X."""
    s = _spec(node, e.opset)
    et = e.dtype(node.input[X])
    nd = len(s.reverse)
    x = node.input[X]
    if s.layout:
        x = e.Transpose(x, perm=[1, 0, 2])  # [batch, seq, in] -> [seq, batch, in]
    w_d = _per_direction(e, node.input[W], nd)
    r_d = _per_direction(e, node.input[R], nd)
    b_d = _per_direction(e, _input(node, B), nd) if _input(node, B) else None
    states = [INITIAL_H] + ([INITIAL_C] if s.op == "LSTM" else [])
    init: dict[int, list[str]] = {}
    zeros = None
    for k in states:
        name = _input(node, k)
        if name is None:
            if zeros is None:  # [batch, hidden] from X and R at run time
                shape = e.Concat(e.dim(x, 1), e.dim(node.input[R], 2), axis=0)
                zeros = e.op("ConstantOfShape", [shape],
                             value=numpy_helper.from_array(np.zeros(1, np_dtype(et))))
            init[k] = [zeros] * nd
        else:
            if s.layout:
                name = e.Transpose(name, perm=[1, 0, 2])
            init[k] = _per_direction(e, name, nd)
    p_d = _per_direction(e, _input(node, P), nd) if s.op == "LSTM" and _input(node, P) else None

    ys, hs_last, cs_last = [], [], []
    for d in range(nd):
        # Input projections for all time steps at once: [seq, batch, gates*hidden].
        xw = e.MatMul(x, e.Transpose(w_d[d], perm=[1, 0]))
        rb = None
        if b_d is not None:
            wb, rb = e.split_equal(b_d[d], 2)
            xw = e.Add(xw, wb)
        cell = _CELLS[s.op]
        body, n_states = cell(e, s, d, r_d[d], rb, p_d[d] if p_d is not None else None, et)
        init_states = [init[k][d] for k in states]
        rev = int(s.reverse[d])
        outs = e.op(
            "Scan", init_states + [xw], outputs=n_states + 1, body=body, num_scan_inputs=1,
            scan_input_directions=[rev], scan_output_directions=[rev],
        )
        hs_last.append(outs[0])
        if s.op == "LSTM":
            cs_last.append(outs[1])
        ys.append(outs[-1])

    y = e.concat([e.unsqueeze(v, [1]) for v in ys], axis=1)  # [seq, dirs, batch, hidden]
    y_h = e.concat([e.unsqueeze(v, [0]) for v in hs_last], axis=0)  # [dirs, batch, hidden]
    y_c = e.concat([e.unsqueeze(v, [0]) for v in cs_last], axis=0) if cs_last else None
    if s.layout:
        y = e.Transpose(y, perm=[2, 0, 1, 3])
        y_h = e.Transpose(y_h, perm=[1, 0, 2])
        y_c = e.Transpose(y_c, perm=[1, 0, 2]) if y_c is not None else None
    for name, value in zip(outputs, [y, y_h, y_c]):
        if name and value is not None:
            e.op("Identity", [value], outputs=[name])


# ---------------------------------------------------------------- cell bodies
def _body_emitter(e: Emitter) -> Emitter:
    return Emitter(e.opset, e.names, dict(e.dtypes), hint="cell")


def _gate(be: Emitter, s: _Spec, act: str, pre: str) -> str:
    """act(clip(pre)): the clip attribute bounds every activation's input."""
    if s.clip is not None:
        pre = be.clip(pre, -s.clip, s.clip)
    return be.op(act, [pre])


def _make_body(be, e, name, ins, outs, et, s):
    """The cell graph: inputs states..., xw_t; outputs states..., y_t.  Every
    value is [batch, width]; one batch symbol for all of them tells the
    gradient's shape reasoning that they broadcast trivially."""
    batch = e.names.fresh(f"{name}_batch")
    width = s.hidden_size
    gates = None if width is None else s.gates * width

    def decl(n, w):
        return helper.make_tensor_value_info(n, et, [batch, w])

    inputs = [decl(n, width) for n in ins[:-1]] + [decl(ins[-1], gates)]
    outputs = [decl(n, width) for n in outs]
    return helper.make_graph(be.nodes, e.names.fresh(name), inputs, outputs)


def _rnn_cell(e, s, d, r, rb, p, et):
    """H = f(xw_t + H' R^T + Rb)"""
    rt = e.Transpose(r, perm=[1, 0])
    be = _body_emitter(e)
    h, xw = be.names.fresh("rnn/h_prev"), be.names.fresh("rnn/xw_t")
    be.dtypes.update({h: et, xw: et})
    pre = be.Add(xw, be.MatMul(h, rt))
    if rb is not None:
        pre = be.Add(pre, rb)
    h_new = _gate(be, s, s.activations[d][0], pre)
    y = be.Identity(h_new)
    return _make_body(be, e, "rnn_cell", [h, xw], [h_new, y], et, s), 1


def _gru_cell(e, s, d, r, rb, p, et):
    """z, r gates from H' [Rz Rr]^T; candidate h with linear_before_reset 0 or 1."""
    f, g = s.activations[d]
    rz, rr, rh = e.split_equal(r, 3)
    rt_zr = e.Transpose(e.Concat(rz, rr, axis=0), perm=[1, 0])
    rt_h = e.Transpose(rh, perm=[1, 0])
    rb_zr = rb_h = None
    if rb is not None:
        bz, br, rb_h = e.split_equal(rb, 3)
        rb_zr = e.Concat(bz, br, axis=0)
    be = _body_emitter(e)
    h, xw = be.names.fresh("gru/h_prev"), be.names.fresh("gru/xw_t")
    be.dtypes.update({h: et, xw: et})
    xz, xr, xh = be.split_equal(xw, 3, axis=1)
    hzr = be.MatMul(h, rt_zr)
    if rb_zr is not None:
        hzr = be.Add(hzr, rb_zr)
    hz, hr = be.split_equal(hzr, 2, axis=1)
    z = _gate(be, s, f, be.Add(xz, hz))
    rg = _gate(be, s, f, be.Add(xr, hr))
    if s.linear_before_reset:
        lin = be.MatMul(h, rt_h)
        if rb_h is not None:
            lin = be.Add(lin, rb_h)
        pre = be.Add(xh, be.Mul(rg, lin))
    else:
        pre = be.Add(xh, be.MatMul(be.Mul(rg, h), rt_h))
        if rb_h is not None:
            pre = be.Add(pre, rb_h)
    cand = _gate(be, s, g, pre)
    h_new = be.Add(cand, be.Mul(z, be.Sub(h, cand)))  # (1 - z) h~ + z H'
    y = be.Identity(h_new)
    return _make_body(be, e, "gru_cell", [h, xw], [h_new, y], et, s), 1


def _lstm_cell(e, s, d, r, rb, p, et):
    """Gates i o f c from xw_t + H' R^T + Rb, peepholes on C' (i, f) and C (o)."""
    f_act, g_act, h_act = s.activations[d]
    rt = e.Transpose(r, perm=[1, 0])
    pi = po = pf = None
    if p is not None:
        pi, po, pf = e.split_equal(p, 3)
    be = _body_emitter(e)
    h, c, xw = be.names.fresh("lstm/h_prev"), be.names.fresh("lstm/c_prev"), be.names.fresh("lstm/xw_t")
    be.dtypes.update({h: et, c: et, xw: et})
    pre = be.Add(xw, be.MatMul(h, rt))
    if rb is not None:
        pre = be.Add(pre, rb)
    gi, go, gf, gc = be.split_equal(pre, 4, axis=1)
    if pi is not None:
        gi = be.Add(gi, be.Mul(pi, c))
        gf = be.Add(gf, be.Mul(pf, c))
    i = _gate(be, s, f_act, gi)
    fg = _gate(be, s, f_act, gf)
    cand = _gate(be, s, g_act, gc)
    c_new = be.Add(be.Mul(fg, c), be.Mul(i, cand))
    if po is not None:
        go = be.Add(go, be.Mul(po, c_new))
    o = _gate(be, s, f_act, go)
    h_new = be.Mul(o, be.op(h_act, [c_new]))
    y = be.Identity(h_new)
    return _make_body(be, e, "lstm_cell", [h, c, xw], [h_new, c_new, y], et, s), 2


_CELLS = {"RNN": _rnn_cell, "GRU": _gru_cell, "LSTM": _lstm_cell}


# ---------------------------------------------------------------------- rule
@vjp("RNN", "GRU", "LSTM")
def recurrent_vjp(ctx: VJPContext, *dys):
    """Recompute the layer as standard ops + Scan (see the module docstring) and
    differentiate that: d(X, W, R, B, initial_h, initial_c, P) = vjp(lowered)(dY, dY_h, dY_c).
    sequence_lens gets no gradient (and is refused when given)."""
    node = ctx.node
    e = ctx.emit
    _spec(node, ctx.opset)  # refuse unsupported configurations before emitting anything
    result: list[str | None] = [None] * len(node.input)
    differentiable = [X, W, R, B, INITIAL_H, INITIAL_C, P]
    wanted: list[int] = []
    seen: set[str] = set()
    for i in differentiable:
        if i < len(node.input) and node.input[i] and ctx.needs(i) and node.input[i] not in seen:
            wanted.append(i)  # a tensor fed twice gets its whole gradient once
            seen.add(node.input[i])
    if not wanted:
        return result
    le = Emitter(e.opset, e.names, dict(e.dtypes), hint=f"{node.name or node.op_type}/recompute")
    outs = [
        e.names.fresh(f"{o}/recomputed") if o and k < len(dys) and dys[k] is not None else ""
        for k, o in enumerate(node.output)
    ]
    lower_recurrent(node, le, outs)
    slots = Slots(ctx)
    for i in differentiable:
        name = _input(node, i)
        if name:
            slots.add(name, slots.symbolic((e.dtypes.get(name), ctx.shape(name)), name))
    cot_k = [k for k, o in enumerate(outs) if o]
    for k in cot_k:
        slots.add(dys[k], slots.symbolic((e.dtypes.get(node.input[X]), ctx.shape(node.output[k])),
                                         node.output[k]))
    nodes, grads = ctx.vjp_of_graph(
        le.nodes, [outs[k] for k in cot_k], [dys[k] for k in cot_k],
        [node.input[i] for i in wanted], slots.types,
    )
    e.nodes.extend(nodes)
    for i, gname in zip(wanted, grads):
        e.dtypes[gname] = e.dtypes.get(node.input[i], e.dtypes.get(node.input[X]))
        result[i] = gname
    return result
