"""Human-readable summaries of a TrainingSession: text for ``repr``, HTML for notebooks.

Both show, at a glance: the inference inputs and outputs, every algorithm
(what it must be fed, what it returns, which state it updates), and every
state variable with its dtype, shape and role:

- ``trainable``   a parameter some algorithm differentiates and updates
                  (``onnxtrain.trainable`` metadata, else an ``xs`` of a Gradient node);
- ``optimizer``   optimizer state: moments, accumulators, step counters
                  (``onnxtrain.optimizer_state`` metadata, else a state variable
                  held by an algorithm graph);
- ``state``       any other bound initializer of the main graph (running
                  statistics, frozen parameters that are still bound, ...).

>>> from onnxtrain import TrainingSession
>>> from onnxtrain.demo import build_classifier
>>> print(session_text(TrainingSession(build_classifier(n_in=4, hidden=3, n_out=2))))
TrainingSession: 1 algorithm, 13 state variables (4 trainable, 23 parameters)
  inputs:   X: float32[N, 4]
  outputs:  logits: float32[N, 2]
  training_info[0]: feeds X, label -> returns logits, loss; updates 13 variables; initialization sets 13
  state variables:
    name       dtype    shape   role
    W1         float32  [4, 3]  trainable
    b1         float32  [3]     trainable
    W2         float32  [3, 2]  trainable
    b2         float32  [2]     trainable
    W1.adam_m  float32  [4, 3]  optimizer
    b1.adam_m  float32  [3]     optimizer
    W2.adam_m  float32  [3, 2]  optimizer
    b2.adam_m  float32  [2]     optimizer
    W1.adam_v  float32  [4, 3]  optimizer
    b1.adam_v  float32  [3]     optimizer
    W2.adam_v  float32  [3, 2]  optimizer
    b2.adam_v  float32  [2]     optimizer
    step       int64    []      optimizer
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from .io.metadata import model_metadata

__all__ = ["session_text", "session_html", "state_rows", "algorithm_rows", "describe_value", "model_text",
           "parameter_text"]

PREVIEW_DOMAIN = "ai.onnx.preview.training"
ROLES = ("trainable", "state", "optimizer")
#: repr lists at most this many state variables (the HTML lists them all).
MAX_TEXT_ROWS = 40


@dataclass(frozen=True)
class StateRow:
    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str
    origin: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class AlgorithmRow:
    index: int
    feeds: list[str]
    returns: list[str]
    updates: list[str]
    initializes: int


def describe_value(vi: onnx.ValueInfoProto) -> str:
    """``float32[N, 64]`` for a tensor value; the type's kind otherwise."""
    t = vi.type
    if t.WhichOneof("value") != "tensor_type":
        return t.WhichOneof("value") or "?"
    tt = t.tensor_type
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
    except (KeyError, TypeError, ValueError):
        dtype = onnx.TensorProto.DataType.Name(tt.elem_type) if tt.elem_type else "?"
    if not tt.HasField("shape"):
        return f"{dtype}[?]"
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
            for d in tt.shape.dim]
    return f"{dtype}[{', '.join(dims)}]"


def _names(value: Any) -> set[str]:
    """Every string in a JSON value (a list of names, or a dict of names / lists)."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return set(value) | {n for v in value.values() for n in _names(v)}
    if isinstance(value, list):
        return {n for v in value for n in _names(v)}
    return set()


def _gradient_xs(model: onnx.ModelProto) -> set[str]:
    xs: set[str] = set()
    graphs = [model.graph] + [ti.algorithm for ti in model.training_info]
    for g in graphs:
        for node in g.node:
            if node.op_type == "Gradient" and node.domain == PREVIEW_DOMAIN:
                for a in node.attribute:
                    if a.name == "xs":
                        xs.update(s.decode() for s in a.strings)
    return xs


def state_rows(sess: Any) -> list[StateRow]:
    """One row per state variable with its role: trainable first, then state, then optimizer."""
    model = sess.model
    try:
        meta = model_metadata(model)
    except ValueError:
        meta = {}
    trainable = _names(meta["trainable"]) if "trainable" in meta else _gradient_xs(model)
    optimizer = _names(meta.get("optimizer_state"))
    rows = []
    for name, var in sess.state_info.items():
        if name in trainable:
            role = "trainable"
        elif name in optimizer or ("optimizer_state" not in meta and var.origin != "graph"):
            role = "optimizer"
        else:
            role = "state"
        rows.append(StateRow(name, str(var.dtype), tuple(var.shape), role, var.origin))
    # Parameters first, then other state, then optimizer state (stable within each).
    return sorted(rows, key=lambda r: ROLES.index(r.role))


def algorithm_rows(sess: Any) -> list[AlgorithmRow]:
    rows = []
    for i, (feeds, outs) in enumerate(zip(sess.algorithm_inputs, sess.algorithm_outputs)):
        ti = sess.model.training_info[i]
        rows.append(AlgorithmRow(i, list(feeds), list(outs), [b.key for b in ti.update_binding],
                                 len(ti.initialization_binding)))
    return rows


def plural(n: int, word: str) -> str:
    """``1 epoch``, ``2 epochs``: a count and its noun.

    >>> plural(1, "step"), plural(3, "step")
    ('1 step', '3 steps')
    """
    return f"{n} {word}" + ("" if n == 1 else "s")


def _headline(sess: Any, rows: list[StateRow]) -> str:
    trainable = [r for r in rows if r.role == "trainable"]
    params = sum(r.size for r in trainable)
    return (f"TrainingSession: {plural(sess.num_algorithms, 'algorithm')}, "
            f"{plural(len(rows), 'state variable')} "
            f"({len(trainable)} trainable, {params:,} parameters)")


def _io(sess: Any) -> tuple[list[str], list[str]]:
    inputs = [f"{n}: {describe_value(vi)}" for n, vi in sess.inference_inputs.items()]
    out_types = {o.name: o for o in sess.model.graph.output}
    outputs = [f"{n}: {describe_value(out_types[n])}" if n in out_types else n
               for n in sess.inference_outputs]
    return inputs, outputs


def _algorithm_line(a: AlgorithmRow) -> str:
    init = f"; initialization sets {a.initializes}" if a.initializes else ""
    return (f"training_info[{a.index}]: feeds {', '.join(a.feeds) or 'nothing'} -> returns "
            f"{', '.join(a.returns) or 'nothing'}; updates {plural(len(a.updates), 'variable')}{init}")


def _cycle_line(sess: Any) -> str | None:
    try:
        cycle = model_metadata(sess.model).get("cycle")
    except ValueError:
        return None
    return None if cycle is None else f"cycle (algorithm per batch): {cycle}"


def _table(header: Iterable[str], rows: list[tuple[str, ...]], indent: str) -> list[str]:
    header = tuple(header)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = []
    for row in [header, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row, widths)]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def session_text(sess: Any) -> str:
    """A short multi-line description: inputs, outputs, algorithms, state (see the module doc)."""
    rows = state_rows(sess)
    lines = [_headline(sess, rows)]
    inputs, outputs = _io(sess)
    lines.append(f"  inputs:   {', '.join(inputs) or 'none'}")
    lines.append(f"  outputs:  {', '.join(outputs) or 'none'}")
    for a in algorithm_rows(sess):
        lines.append("  " + _algorithm_line(a))
    cycle = _cycle_line(sess)
    if cycle:
        lines.append("  " + cycle)
    if rows:
        lines.append("  state variables:")
        shown = rows[:MAX_TEXT_ROWS]
        lines += _table(("name", "dtype", "shape", "role"),
                        [(r.name, r.dtype, str(list(r.shape)), r.role) for r in shown], "    ")
        if len(rows) > len(shown):
            lines.append(f"    ... {len(rows) - len(shown)} more (sess.state_info lists them all)")
    return "\n".join(lines)


def session_html(sess: Any) -> str:
    """The same as session_text, as HTML for Jupyter."""
    esc = html.escape
    rows = state_rows(sess)
    inputs, outputs = _io(sess)
    parts = [f"<div class='onnxtrain-session'><b>{esc(_headline(sess, rows))}</b>",
             "<table>",
             f"<tr><th style='text-align:left'>inputs</th><td style='text-align:left'>"
             f"{esc(', '.join(inputs) or 'none')}</td></tr>",
             f"<tr><th style='text-align:left'>outputs</th><td style='text-align:left'>"
             f"{esc(', '.join(outputs) or 'none')}</td></tr>"]
    for a in algorithm_rows(sess):
        label, _, rest = _algorithm_line(a).partition(": ")
        parts.append(f"<tr><th style='text-align:left'>{esc(label)}</th>"
                     f"<td style='text-align:left'>{esc(rest)}</td></tr>")
    cycle = _cycle_line(sess)
    if cycle:
        label, _, rest = cycle.partition(": ")
        parts.append(f"<tr><th style='text-align:left'>{esc(label)}</th>"
                     f"<td style='text-align:left'>{esc(rest)}</td></tr>")
    parts.append("</table>")
    if rows:
        body = "".join(
            f"<tr><td>{esc(r.name)}</td><td>{esc(r.dtype)}</td><td>{esc(str(list(r.shape)))}</td>"
            f"<td>{esc(r.role)}</td><td>{esc(r.origin)}</td></tr>"
            for r in rows
        )
        table = ("<table><tr><th>state variable</th><th>dtype</th><th>shape</th><th>role</th>"
                 f"<th>held by</th></tr>{body}</table>")
        if len(rows) > MAX_TEXT_ROWS:
            table = f"<details><summary>{len(rows)} state variables</summary>{table}</details>"
        parts.append(table)
    parts.append("</div>")
    return "".join(parts)


# ------------------------------------------------------------ model anatomy
def _op_counts(graph: onnx.GraphProto) -> str:
    """``Gemm x2, Relu`` : op types in first-seen order with their counts."""
    counts: dict[str, int] = {}
    for node in graph.node:
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(op if n == 1 else f"{op} x{n}" for op, n in counts.items()) or "no nodes"


def _graph_lines(graph: onnx.GraphProto, indent: str) -> list[str]:
    lines = [f"{indent}nodes ({len(graph.node)}): {_op_counts(graph)}"]
    if graph.input:
        lines.append(f"{indent}inputs: " + ", ".join(
            f"{vi.name}: {describe_value(vi)}" for vi in graph.input))
    if graph.output:
        lines.append(f"{indent}outputs: " + ", ".join(
            f"{vi.name}: {describe_value(vi)}" for vi in graph.output))
    if graph.initializer:
        shown = ", ".join(t.name for t in graph.initializer[:12])
        more = f", ... ({len(graph.initializer)} in all)" if len(graph.initializer) > 12 else ""
        lines.append(f"{indent}initializers: {shown}{more}")
    return lines


def model_text(model: Any) -> str:
    """What is inside a (training) model: the main graph, each TrainingInfoProto
    (algorithm, initialization, both bindings) and the onnxtrain metadata.

    ``model``: a ModelProto, a path or bytes.  Nothing is validated or compiled:
    this describes even a model the session would reject.

    >>> from onnxtrain.demo import build_classifier
    >>> for line in model_text(build_classifier(n_in=4, hidden=3, n_out=2)).splitlines()[:8]:
    ...     print(line)
    model: ir_version 10, opsets ai.onnx 17, ai.onnx.preview.training 1
    main graph 'digits_mlp':
      nodes (3): Gemm x2, Relu
      inputs: X: float32[N, 4]
      outputs: logits: float32[N, 2]
      initializers: W1, b1, W2, b2
    training_info[0]:
      algorithm 'digits_mlp_adam':
    """
    from .io.model import load

    proto, _ = load(model)
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in proto.opset_import)
    lines = [f"model: ir_version {proto.ir_version}, opsets {opsets}",
             f"main graph {proto.graph.name!r}:"]
    lines += _graph_lines(proto.graph, "  ")
    if not proto.training_info:
        lines.append("training_info: none (an inference model)")
    for i, ti in enumerate(proto.training_info):
        lines.append(f"training_info[{i}]:")
        lines.append(f"  algorithm {ti.algorithm.name!r}:")
        lines += _graph_lines(ti.algorithm, "    ")
        if ti.HasField("initialization"):
            lines.append(f"  initialization {ti.initialization.name!r}:")
            lines += _graph_lines(ti.initialization, "    ")
        else:
            lines.append("  initialization: none")
        for title, bindings in (("update_binding", ti.update_binding),
                                ("initialization_binding", ti.initialization_binding)):
            pairs = ", ".join(f"{b.key} <- {b.value}" for b in bindings)
            lines.append(f"  {title} ({len(bindings)}): {pairs or 'none'}")
    meta = [(p.key, p.value) for p in proto.metadata_props if p.key.startswith("onnxtrain.")]
    if meta:
        lines.append("metadata:")
        lines += [f"  {k} = {v}" for k, v in meta]
    return "\n".join(lines)


# ------------------------------------------------------------ builder's choice
def parameter_text(model: Any, indent: str = "  ") -> str:
    """What ``build.training_model(trainable=None)`` would train in an inference
    model: one row per floating-point initializer, "train" or "constant" with
    a one-word reason (``build.parameter_choices`` states the rule), what
    ``build.LoRA(targets=None)`` does with it (``lora``: "target", "head" for
    a language model's output head, left out; shown when some weight is
    either), the PyTorch name (``known as``) where the exporter recorded one,
    and a note under each doubtful choice.

    >>> from onnx import TensorProto, helper, numpy_helper
    >>> g = helper.make_graph(
    ...     [helper.make_node("MatMul", ["X", "W"], ["h"]), helper.make_node("Pow", ["h", "p"], ["Y"])],
    ...     "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
    ...     [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 2])],
    ...     [numpy_helper.from_array(np.ones((2, 2), np.float32), "W"),
    ...      numpy_helper.from_array(np.array(3.0, np.float32), "p")])
    >>> print(parameter_text(helper.make_model(g)))
    builder's default (trainable=None): 1 trained (4 parameters), 1 constant
      name  dtype    shape   choice    reason  lora
      W     float32  [2, 2]  train     weight  target
      p     float32  []      constant  scalar  -
    """
    from .builder.parameters import parameter_choices
    from .io.model import load

    proto, _ = load(model)
    inits = {t.name: t for t in proto.graph.initializer}
    # Identity copies of a shared initializer are parameters of their own (the builder unties them).
    for n in proto.graph.node:
        if n.op_type == "Identity" and n.input and n.input[0] in inits:
            inits.setdefault(n.output[0], inits[n.input[0]])
    choices = parameter_choices(proto.graph)
    trained = [c for c in choices if c.trainable]
    for c in choices:  # (an untied copy: the initializer it copies)
        if c.name not in inits:
            inits[c.name] = inits[c.copy_of]
    size = sum(math.prod(inits[c.name].dims) for c in trained)
    lines = [f"builder's default (trainable=None): {len(trained)} trained ({size:,} parameters), "
             f"{plural(len(choices) - len(trained), 'constant')}"]
    rows = []
    named = any(c.known_as for c in choices)  # exporter records name some weights
    lora = any(c.lora for c in choices)  # what build.LoRA(targets=None) adapts
    for c in choices:
        t = inits[c.name]
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).name
        rows.append((c.name, dtype, str(list(t.dims)), "train" if c.trainable else "constant",
                     c.reason + (" (doubtful)" if c.doubt else ""))
                    + ((c.lora or "-",) if lora else ()) + ((c.known_as,) if named else ()))
    header = (("name", "dtype", "shape", "choice", "reason") + (("lora",) if lora else ())
              + (("known as",) if named else ()))
    lines += _table(header, rows, indent)
    for c in choices:
        for note in (c.doubt, c.tie):
            if note:
                lines.append(f"{indent}note: {c.name}: {note}")
    return "\n".join(lines)
