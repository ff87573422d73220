"""Gradient rules: recurrent layers (RNN, GRU, LSTM).

One rule for the three ops, hand-derived per cell (``_rnn``, ``_gru``,
``_lstm``; the math in their docstrings): the hidden states H_t come from the
op's own output Y, every pre-activation of every step is rebuilt from them
with batched MatMuls (one product of [X_t, H_{t-1}] with [W, R] where the
opset allows), LSTM's cell states C_t from a short forward Scan, and one
backward Scan per direction carries dH (and dC) through the steps in reverse
processing order.  Everything in that recurrence that does not depend on the
incoming gradient (activation derivatives, clip masks, peephole terms) is
computed for all steps at once before it, so the Scan's body is a handful of
elementwise ops and one MatMul a step; the weight gradients are then one
Gemm over all steps.  Nothing depends on the sequence length or batch size
being known before run time.

``lower_recurrent`` writes the same layer as standard ops and a Scan over the
cell: the float64 forward the gradient tests check the rule against
(onnxruntime runs these ops in float32 only).

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
# The rule reads the hidden states H_t from the op's own output Y (added to
# the node when absent) and rebuilds every pre-activation of every step from
# them with batched MatMuls; only LSTM's cell states C_t, which the op does not
# output, take a forward Scan (two elementwise ops a step without peepholes).
# Every factor of the backward recurrence that does not depend on the
# incoming gradient (activation derivatives, clip masks, peephole terms) is
# computed for all steps at once beforehand, so the backward Scan's body is
# the recurrence alone: a few elementwise ops and one MatMul a step.  The
# weight gradients are then one Gemm each over all steps.


def _act_grad(e: Emitter, act: str, y: str, pre: str | None) -> str:
    """act'(pre) from the activation's output y = act(pre) (Softplus from pre):

        Sigmoid y (1 - y)    Tanh 1 - y^2    Relu [y > 0]
        Softsign (1 - |y|)^2 (= 1 / (1 + |pre|)^2)    Softplus sigmoid(pre)"""
    one = e.const(1.0, like=y)
    if act == "Sigmoid":
        return e.Mul(y, e.Sub(one, y))
    if act == "Tanh":
        return e.Sub(one, e.Mul(y, y))
    if act == "Relu":
        return e.Cast(e.Greater(y, e.const(0.0, like=y)), to=e.dtype(y))
    if act == "Softsign":
        m = e.Sub(one, e.Abs(y))
        return e.Mul(m, m)
    return e.Sigmoid(pre)  # Softplus


class _Layer:
    """One RNN/GRU/LSTM node seen by its rule: the spec, the inputs of one
    direction in time-major layout, and the helpers the three cells share."""

    def __init__(self, ctx: VJPContext) -> None:
        self.ctx, self.e = ctx, ctx.emit
        self.s = _spec(ctx.node, ctx.opset)
        self.nd = len(self.s.reverse)
        self.et = ctx.dtype(ctx.node.input[X])
        e = self.e
        batch_first = self.s.layout == 1
        x = ctx.node.input[X]
        self.x = e.Transpose(x, perm=[1, 0, 2]) if batch_first else x  # [T, N, I]
        y = ctx.forward_output(0)
        e.dtypes[y] = self.et
        self.y = e.Transpose(y, perm=[1, 2, 0, 3]) if batch_first else y  # [T, D, N, H]

    def state_major(self, name: str | None) -> str | None:
        """initial_h/c or dY_h/c as [D, N, H] (layout 1 has them [N, D, H])."""
        if name is None or not self.s.layout:
            return name
        return self.e.Transpose(name, perm=[1, 0, 2])

    def part(self, t: str | None, d: int, axis: int = 0) -> str | None:
        """Direction d of t along ``axis``, that axis removed."""
        if t is None:
            return None
        if self.nd == 1:
            return self.e.squeeze(t, [axis])
        return self.e.Gather(t, self.e.const(np.asarray(d, dtype=np.int64)), axis=axis)

    def first(self, seq: str) -> str:
        """seq[0]: one step's [N, H]."""
        return self.e.Gather(seq, self.e.const(np.asarray(0, dtype=np.int64)), axis=0)

    def initial(self, i: int, d: int, like: str) -> str:
        """initial_h/initial_c of direction d; zeros of ``like`` step's shape when absent."""
        name = self.state_major(_input(self.ctx.node, i))
        if name is not None:
            return self.part(name, d)
        return self.e.zeros_like(like)

    def shift(self, seq: str, first: str, reverse: bool) -> str:
        """Each step's predecessor in processing order: [first, seq[:-1]] forward,
        [seq[1:], first] in reverse."""
        e = self.e
        head = e.unsqueeze(first, [0])
        if reverse:
            return e.Concat(e.slice(seq, [1], [2**62], [0]), head, axis=0)
        return e.Concat(head, e.slice(seq, [0], [-1], [0]), axis=0)

    def by(self, seq: str, w: str) -> str:
        """seq [T, N, K] times w^T (w [M, K]): [T, N, M]."""
        return self.e.MatMul(seq, self.e.Transpose(w, perm=[1, 0]))

    def gate(self, d: int, k: int, pre: str) -> tuple[str, str]:
        """(activation k of direction d at pre, its derivative there), the clip
        applied: act(clip(pre)), act'(clip(pre)) [|pre| <= clip]."""
        e, act = self.e, self.s.activations[d][k]
        if self.s.clip is not None:
            inside = e.Cast(e.Not(e.Greater(e.Abs(pre), e.const(self.s.clip, like=pre))), to=self.et)
            pre = e.clip(pre, -self.s.clip, self.s.clip)
        y = e.op(act, [pre])
        grad = _act_grad(e, act, y, pre)
        if self.s.clip is not None:
            grad = e.Mul(grad, inside)
        return y, grad

    def scan(self, states: list[str], xs: list[str], body, n_out: int, reverse: bool):
        """A Scan over axis 0 of ``xs`` against the processing order of the
        direction (last step first); ``body(sub, states, xs)`` returns
        (new states, per-step outputs).  Outputs stay in time order."""
        e = self.e
        sub = Emitter(e.opset, e.names, dict(e.dtypes), hint=f"{e.hint}/step")
        s_in = [e.names.fresh(f"{e.hint}/state") for _ in states]
        x_in = [e.names.fresh(f"{e.hint}/x_t") for _ in xs]
        for n in s_in + x_in:
            sub.dtypes[n] = self.et
        new_states, outs = body(sub, s_in, x_in)
        body_outs, seen = [], set(s_in + x_in)
        for t in list(new_states) + list(outs):  # a graph output names a fresh value once
            body_outs.append(sub.Identity(t) if t in seen else t)
            seen.add(t)
        graph = helper.make_graph(
            sub.nodes, e.names.fresh(f"{e.hint}/step_body"),
            [helper.make_tensor_value_info(n, self.et, [None, None]) for n in s_in + x_in],
            [helper.make_tensor_value_info(n, self.et, [None, None]) for n in body_outs],
        )
        flip = int(not reverse)
        res = e.op("Scan", states + xs, outputs=len(states) + n_out, body=graph,
                   num_scan_inputs=len(xs),
                   scan_input_directions=[flip] * len(xs) if flip else None,
                   scan_output_directions=[flip] * n_out if flip and n_out else None)
        return res[: len(states)], res[len(states):]

    def step_gemm(self, da: str, seq: str) -> str:
        """sum_t da_t^T seq_t: [T, N, M], [T, N, K] -> [M, K] as one Gemm."""
        e = self.e
        return e.gemm(e.Flatten(da, axis=2), e.Flatten(seq, axis=2), transA=1)

    def joined(self, h_prev: str) -> str | None:
        """[X_t, H_{t-1}] for every step ([T, N, I + H]), where one product with
        [W, R] may stand for two (Slice with run-time bounds needs opset 10)."""
        return self.e.Concat(self.x, h_prev, axis=-1) if self.e.opset >= 10 else None

    def input_and_recurrent(self, da: str, xh: str | None, h_prev: str, grads) -> None:
        """dW = sum_t da_t^T X_t and dR = sum_t da_t^T H_{t-1} (those wanted),
        both from one Gemm over [X, H'] where both are."""
        e = self.e
        if xh is not None and self.wants(W) and self.wants(R):
            g = self.step_gemm(da, xh)
            width = self.e.dim(self.x, 2)
            grads[W].append(e.Slice(g, e.ints([0]), width, e.ints([1])))
            grads[R].append(e.Slice(g, width, e.ints([2**62]), e.ints([1])))
            return
        if self.wants(W):
            grads[W].append(self.step_gemm(da, self.x))
        if self.wants(R):
            grads[R].append(self.step_gemm(da, h_prev))

    def sum_steps(self, t: str) -> str:
        return self.e.reduce_sum(t, [0, 1], keepdims=False)

    def results(self, dx: list[str], grads: dict[int, list[str]]) -> list[str | None]:
        """Per-direction gradients stacked along the direction axis, one per input."""
        ctx, e = self.ctx, self.e
        node = ctx.node
        out: list[str | None] = [None] * len(node.input)
        if dx:
            g = e.sum_all(dx)
            out[X] = e.Transpose(g, perm=[1, 0, 2]) if self.s.layout else g
        for i, per_dir in grads.items():
            if not per_dir:
                continue
            g = e.concat([e.unsqueeze(t, [0]) for t in per_dir], axis=0)
            if self.s.layout and i in (INITIAL_H, INITIAL_C):
                g = e.Transpose(g, perm=[1, 0, 2])
            out[i] = g
        return out

    def wants(self, i: int) -> bool:
        return _input(self.ctx.node, i) is not None and self.ctx.needs(i)


def _rnn(lay: _Layer, dys) -> list[str | None]:
    """H_t = f(a_t), a_t = X_t W^T + H_{t-1} R^T + Wb + Rb.  With dH_t = dY_t +
    dH_{t+1}: da_t = dH_t f'(a_t), dH_{t-1} = da_t R; dX_t = da_t W,
    dW = sum_t da_t^T X_t, dR = sum_t da_t^T H_{t-1}, dWb = dRb = sum_t da_t."""
    e, node = lay.e, lay.ctx.node
    dy = dys[0] if dys[0] is None or not lay.s.layout else e.Transpose(dys[0], perm=[1, 2, 0, 3])
    dy_h = lay.state_major(dys[1] if len(dys) > 1 else None)
    dx, grads = [], {W: [], R: [], B: [], INITIAL_H: []}
    for d, reverse in enumerate(lay.s.reverse):
        w, r = lay.part(node.input[W], d), lay.part(node.input[R], d)
        y = lay.part(lay.y, d, axis=1)
        h0 = lay.initial(INITIAL_H, d, lay.first(y))
        h_prev = lay.shift(y, h0, reverse)
        pre = None
        if lay.s.clip is not None or lay.s.activations[d][0] == "Softplus":
            pre = e.Add(lay.by(lay.x, w), lay.by(h_prev, r))
            if _input(node, B):
                wb, rb = e.split_equal(lay.part(node.input[B], d), 2)
                pre = e.Add(pre, e.Add(wb, rb))
            _, k = lay.gate(d, 0, pre)
        else:
            k = _act_grad(e, lay.s.activations[d][0], y, None)
        dy_d = lay.part(dy, d, axis=1)

        def body(sub, states, xs, r=r, with_dy=dy_d is not None):
            dh = sub.Add(xs[0], states[0]) if with_dy else states[0]
            da = sub.Mul(dh, xs[-1])
            return [sub.MatMul(da, r)], [da]

        start = lay.part(dy_h, d) if dy_h is not None else e.zeros_like(h0)
        (dh0,), (da,) = lay.scan([start], ([dy_d] if dy_d is not None else []) + [k], body, 1, reverse)
        if lay.wants(X):
            dx.append(e.MatMul(da, w))
        lay.input_and_recurrent(da, lay.joined(h_prev), h_prev, grads)
        if lay.wants(B):
            sb = lay.sum_steps(da)
            grads[B].append(e.Concat(sb, sb, axis=0))
        if lay.wants(INITIAL_H):
            grads[INITIAL_H].append(dh0)
    return lay.results(dx, grads)


def _gru(lay: _Layer, dys) -> list[str | None]:
    """z = f(a_z), r = f(a_r), h~ = g(a_h), H = (1 - z) h~ + z H' with
    a_zr = X W_zr^T + H' R_zr^T + Wb_zr + Rb_zr and
    a_h = X W_h^T + (r H') R_h^T + Rb_h + Wb_h  (linear_before_reset 0) or
    a_h = X W_h^T + r u + Wb_h, u = H' R_h^T + Rb_h  (linear_before_reset 1).
    With dH = dY_t + dH_next, K_h = (1 - z) g'(a_h), K_z = (H' - h~) f'(a_z):
        da_h = dH K_h, da_z = dH K_z,
        lbr 1: du = da_h r, da_r = da_h u f'(a_r),
               dH' = dH z + [da_z, da_r, du] R
        lbr 0: q = da_h R_h, da_r = q H' f'(a_r),
               dH' = dH z + q r + [da_z, da_r] R_zr;
    dW = sum da^T X with da = [da_z, da_r, da_h]; dR_zr = sum [da_z, da_r]^T H',
    dR_h = sum du^T H' (lbr 1) or sum da_h^T (r H') (lbr 0);
    dWb = sum da; dRb = sum [da_z, da_r, du or da_h]."""
    e, node = lay.e, lay.ctx.node
    lbr = lay.s.linear_before_reset
    dy = dys[0] if dys[0] is None or not lay.s.layout else e.Transpose(dys[0], perm=[1, 2, 0, 3])
    dy_h = lay.state_major(dys[1] if len(dys) > 1 else None)
    dx, grads = [], {W: [], R: [], B: [], INITIAL_H: []}
    for d, reverse in enumerate(lay.s.reverse):
        w, r = lay.part(node.input[W], d), lay.part(node.input[R], d)
        r_z, r_r, r_h = e.split_equal(r, 3)
        r_zr = e.Concat(r_z, r_r, axis=0)
        y = lay.part(lay.y, d, axis=1)
        h0 = lay.initial(INITIAL_H, d, lay.first(y))
        h_prev = lay.shift(y, h0, reverse)
        ax_z, ax_r, ax_h = e.split_equal(lay.by(lay.x, w), 3, axis=-1)
        a_zr = lay.by(h_prev, r_zr)
        if _input(node, B):
            wb, rb = e.split_equal(lay.part(node.input[B], d), 2)
            (wb_z, wb_r, wb_h), (rb_z, rb_r, rb_h) = e.split_equal(wb, 3), e.split_equal(rb, 3)
            a_zr = e.Add(a_zr, e.Concat(e.Add(wb_z, rb_z), e.Add(wb_r, rb_r), axis=0))
            ax_h = e.Add(ax_h, wb_h)
        a_z, a_r = e.split_equal(a_zr, 2, axis=-1)
        a_z, a_r = e.Add(a_z, ax_z), e.Add(a_r, ax_r)
        z, fz = lay.gate(d, 0, a_z)
        rg, fr = lay.gate(d, 0, a_r)
        if lbr:
            u = lay.by(h_prev, r_h)
            if _input(node, B):
                u = e.Add(u, rb_h)
            a_h = e.Add(ax_h, e.Mul(rg, u))
        else:
            rh = e.Mul(rg, h_prev)
            a_h = e.Add(ax_h, lay.by(rh, r_h))
            if _input(node, B):
                a_h = e.Add(a_h, rb_h)
        hh, gh = lay.gate(d, 1, a_h)
        one = e.const(1.0, like=z)
        k_h = e.Mul(e.Sub(one, z), gh)
        k_z = e.Mul(e.Sub(h_prev, hh), fz)
        dy_d = lay.part(dy, d, axis=1)
        lead = [dy_d] if dy_d is not None else []
        start = lay.part(dy_h, d) if dy_h is not None else e.zeros_like(h0)
        if lbr:
            k_r = e.Mul(e.Mul(k_h, u), fr)
            k_all = e.Concat(k_z, k_r, e.Mul(k_h, rg), axis=-1)

            def body(sub, states, xs, r=r, n=len(lead)):
                dh = sub.Add(xs[0], states[0]) if n else states[0]
                zt, kt = xs[n:]
                t = sub.Mul(sub.Concat(dh, dh, dh, axis=-1), kt)
                return [sub.Add(sub.Mul(dh, zt), sub.MatMul(t, r))], [dh]

            (dh0,), (dh_all,) = lay.scan([start], lead + [z, k_all], body, 1, reverse)
            da_h = e.Mul(dh_all, k_h)
            da_z, da_r = e.Mul(dh_all, k_z), e.Mul(dh_all, k_r)
            dlast = e.Mul(da_h, rg)  # du
            h_side = h_prev
        else:
            k_r = e.Mul(h_prev, fr)

            def body(sub, states, xs, r_h=r_h, r_zr=r_zr, n=len(lead)):
                dh = sub.Add(xs[0], states[0]) if n else states[0]
                zt, rt, kht, kzt, krt = xs[n:]
                q = sub.MatMul(sub.Mul(dh, kht), r_h)
                dzr = sub.Concat(sub.Mul(dh, kzt), sub.Mul(q, krt), axis=-1)
                prev = sub.Add(sub.Add(sub.Mul(dh, zt), sub.Mul(q, rt)), sub.MatMul(dzr, r_zr))
                return [prev], [dh, dzr]

            (dh0,), (dh_all, dzr_all) = lay.scan([start], lead + [z, rg, k_h, k_z, k_r], body, 2,
                                                 reverse)
            da_h = e.Mul(dh_all, k_h)
            da_z, da_r = e.split_equal(dzr_all, 2, axis=-1)
            dlast = da_h
            h_side = rh
        da = e.Concat(da_z, da_r, da_h, axis=-1)
        if lay.wants(X):
            dx.append(e.MatMul(da, w))
        if lay.wants(W):
            grads[W].append(lay.step_gemm(da, lay.x))
        if lay.wants(R):
            grads[R].append(e.Concat(lay.step_gemm(e.Concat(da_z, da_r, axis=-1), h_prev),
                                     lay.step_gemm(dlast, h_side), axis=0))
        if lay.wants(B):
            s_z, s_r = lay.sum_steps(da_z), lay.sum_steps(da_r)
            grads[B].append(e.Concat(s_z, s_r, lay.sum_steps(da_h), s_z, s_r, lay.sum_steps(dlast),
                                     axis=0))
        if lay.wants(INITIAL_H):
            grads[INITIAL_H].append(dh0)
    return lay.results(dx, grads)


def _lstm(lay: _Layer, dys) -> list[str | None]:
    """i = f(a_i + P_i C'), f_ = f(a_f + P_f C'), g = g(a_c), C = f_ C' + i g,
    o = f(a_o + P_o C), H = o h(C), a = X W^T + H' R^T + Wb + Rb (gates i o f c).
    C_t comes from a forward Scan; then, with dH = dY_t + dH_next and the
    per-step factors K_o = h(C) f'(o), K_c = o h'(C) + K_o P_o,
    K_i = g f'(i), K_f = C' f'(f_), K_g = i g'(g), F = f_ + K_i P_i + K_f P_f:
        dC = dC_next + dH K_c,  [da_i, da_o, da_f, da_c] = [dC, dH, dC, dC] K,
        dC' = dC F,  dH' = da R;
    dW, dR, dB, dP sum over the steps (dP_i = sum da_i C', dP_o = sum da_o C,
    dP_f = sum da_f C'); d initial_h/c are the final Scan states."""
    e, node = lay.e, lay.ctx.node
    dy = dys[0] if dys[0] is None or not lay.s.layout else e.Transpose(dys[0], perm=[1, 2, 0, 3])
    dy_h = lay.state_major(dys[1] if len(dys) > 1 else None)
    dy_c = lay.state_major(dys[2] if len(dys) > 2 else None)
    peep = _input(node, P)
    dx, grads = [], {W: [], R: [], B: [], INITIAL_H: [], INITIAL_C: [], P: []}
    for d, reverse in enumerate(lay.s.reverse):
        w, r = lay.part(node.input[W], d), lay.part(node.input[R], d)
        y = lay.part(lay.y, d, axis=1)
        h0 = lay.initial(INITIAL_H, d, lay.first(y))
        c0 = lay.initial(INITIAL_C, d, h0)
        h_prev = lay.shift(y, h0, reverse)
        xh = lay.joined(h_prev)
        if xh is not None:
            a = lay.by(xh, e.Concat(w, r, axis=1))
        else:
            a = e.Add(lay.by(lay.x, w), lay.by(h_prev, r))
        if _input(node, B):
            wb, rb = e.split_equal(lay.part(node.input[B], d), 2)
            a = e.Add(a, e.Add(wb, rb))
        a_i, a_o, a_f, a_c = e.split_equal(a, 4, axis=-1)
        g, k_gd = lay.gate(d, 1, a_c)
        if peep:
            p_i, p_o, p_f = e.split_equal(lay.part(peep, d), 3)

            def cell(sub, states, xs, act=lay.s.activations[d][0], p_i=p_i, p_f=p_f):
                (c_prev,) = states
                ai, af, gt = xs
                it = _gate(sub, lay.s, act, sub.Add(ai, sub.Mul(p_i, c_prev)))
                ft = _gate(sub, lay.s, act, sub.Add(af, sub.Mul(p_f, c_prev)))
                c = sub.Add(sub.Mul(ft, c_prev), sub.Mul(it, gt))
                return [c], [sub.Identity(c)]

            _, (c_all,) = lay.scan([c0], [a_i, a_f, g], cell, 1, not reverse)
            c_prev = lay.shift(c_all, c0, reverse)
            i, k_id = lay.gate(d, 0, e.Add(a_i, e.Mul(p_i, c_prev)))
            f, k_fd = lay.gate(d, 0, e.Add(a_f, e.Mul(p_f, c_prev)))
        else:
            i, k_id = lay.gate(d, 0, a_i)
            f, k_fd = lay.gate(d, 0, a_f)

            def cell(sub, states, xs):  # C = f_ C' + i g
                c = sub.Add(sub.Mul(xs[0], states[0]), xs[1])
                return [c], [sub.Identity(c)]

            _, (c_all,) = lay.scan([c0], [f, e.Mul(i, g)], cell, 1, not reverse)
            c_prev = lay.shift(c_all, c0, reverse)
        o, k_od = lay.gate(d, 0, e.Add(a_o, e.Mul(p_o, c_all)) if peep else a_o)
        hc = e.op(lay.s.activations[d][2], [c_all])
        k_o = e.Mul(hc, k_od)
        k_c = e.Mul(o, _act_grad(e, lay.s.activations[d][2], hc, c_all))
        k_i, k_f, k_g = e.Mul(g, k_id), e.Mul(c_prev, k_fd), e.Mul(i, k_gd)
        carry = f
        if peep:
            k_c = e.Add(k_c, e.Mul(k_o, p_o))
            carry = e.Add(f, e.Add(e.Mul(k_i, p_i), e.Mul(k_f, p_f)))
        k_all = e.Concat(k_i, k_o, k_f, k_g, axis=-1)
        dy_d = lay.part(dy, d, axis=1)
        lead = [dy_d] if dy_d is not None else []

        def body(sub, states, xs, r=r, n=len(lead)):
            dh_next, dc_next = states
            dh = sub.Add(xs[0], dh_next) if n else dh_next
            kct, kt, ft = xs[n:]
            dc = sub.Add(dc_next, sub.Mul(dh, kct))
            da = sub.Mul(sub.Concat(dc, dh, dc, dc, axis=-1), kt)
            return [sub.MatMul(da, r), sub.Mul(dc, ft)], [da]

        starts = [lay.part(dy_h, d) if dy_h is not None else e.zeros_like(h0),
                  lay.part(dy_c, d) if dy_c is not None else e.zeros_like(c0)]
        (dh0, dc0), (da,) = lay.scan(starts, lead + [k_c, k_all, carry], body, 1, reverse)
        if lay.wants(X):
            dx.append(e.MatMul(da, w))
        lay.input_and_recurrent(da, xh, h_prev, grads)
        if lay.wants(B):
            sb = lay.sum_steps(da)
            grads[B].append(e.Concat(sb, sb, axis=0))
        if lay.wants(INITIAL_H):
            grads[INITIAL_H].append(dh0)
        if lay.wants(INITIAL_C):
            grads[INITIAL_C].append(dc0)
        if peep and lay.wants(P):
            d_i, d_o, d_f, _ = e.split_equal(da, 4, axis=-1)
            grads[P].append(e.Concat(lay.sum_steps(e.Mul(d_i, c_prev)), lay.sum_steps(e.Mul(d_o, c_all)),
                                     lay.sum_steps(e.Mul(d_f, c_prev)), axis=0))
    return lay.results(dx, grads)


_RULES = {"RNN": _rnn, "GRU": _gru, "LSTM": _lstm}


@vjp("RNN", "GRU", "LSTM")
def recurrent_vjp(ctx: VJPContext, *dys):
    """d(X, W, R, B, initial_h, initial_c, P) from (dY, dY_h, dY_c): the hand-derived
    backward recurrence of the cell (``_rnn``, ``_gru``, ``_lstm``, their math in
    their docstrings).  sequence_lens gets no gradient (and is refused when given)."""
    lay = _Layer(ctx)
    return _RULES[ctx.node.op_type](lay, list(dys) + [None] * (3 - len(dys)))
