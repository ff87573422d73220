"""Activation recompute: keep fewer forward activations, recompute the rest
just before the backward pass reads them.

Reverse-mode autodiff reads forward values ("saved activations") in the
backward program: the input of a MatMul for its weight gradient, the output
of a Softmax, Gelu's input.  onnxruntime frees a buffer after its last
reader, so every saved activation lives from its forward node to its backward
reader, and at the turn from forward to backward all of them are alive at
once: that sum is the activation memory of a step.

Recompute keeps a chosen set K of values and, for every other saved
activation v, reads a clone v' instead, computed by copies of the forward
nodes between K and v.  The copies compute the same function of the same
inputs, so v' = v bit for bit (where onnxruntime's kernels are
deterministic) and the gradients do not change.  Only the schedule changes:

    forward  f1 f2 ... fn | backward bn ... b2 b1           (v1..vn alive at "|")
    forward  f1 f2 ... fn | bn [f'k..f'1] ... b1             (only K alive at "|")

Two things make the copies pay off under onnxruntime, which orders nodes
itself (and differently once a model has been through its optimizer and
serialized, as the program cache does), merges equal subexpressions and
frees a buffer after its last reader:

- each chain of copies starts from a *gated* read of a kept value,
  ``c' = Reshape(c, Shape(c) + z)``, where ``z`` is an int64 zero computed
  from one element t0 of each of some backward values t
  (``Cast(Less(t0, t0))``: x < x is false, NaN included).  Reshape aliases
  its input (no copy), but c' is a new value that exists only once those t
  do: the copies can neither run early nor be merged with the forward nodes
  they copy (their inputs differ);
- the t of a chain are a *barrier*: every backward node placed (in the
  program's own order, the reverse of the forward) between the previous
  chain and this one that no other node of that stretch reads.  The copies
  of a segment thus run as a group right before its backward, after the
  backward of the segment above it, weight gradients included, and die
  with it.

The option (``build.training_model(..., recompute=...)``, recorded as the
model metadata ``onnxtrain.recompute`` and applied when a session lowers the
training algorithm, right after the Gradient node is expanded):

- ``None`` / ``False``: off (the default);
- ``"elementwise"``: selective recompute of cheap ops (elementwise math and
  activations, casts and layout ops, Softmax and the normalizations): a
  saved value of such an op is recomputed when the values its copy needs
  take fewer bytes than it does, counting only values not already saved
  (Gelu's output from its input, which Gelu's gradient saves anyway; a
  LayerNormalization output from its input).  MatMul/Conv outputs are never
  recomputed.  Costs little time; saves what such pairs hold;
- ``"blocks"``: checkpointing at the narrow points of the forward pass (one
  or two values that carry everything later nodes read, e.g. the residual
  stream of a transformer between and inside its blocks, with its normalized
  copy where a fused norm hands on both, the activation between two layers
  of an MLP or CNN); the checkpoints are chosen to
  minimize (bytes of the checkpoints + bytes saved by the largest segment),
  the sqrt(n) rule of Chen et al. 2016 with real sizes.  Costs about one
  more forward pass;
- an int k >= 1: the same with at most k segments of balanced size
  (k = 1: nothing recomputed);
- a list of value names: exactly those checkpoints (main-graph values on
  the path to the loss; a training-mode copy of them is used where the
  builder made one).

In the checkpoint modes the segment after the last checkpoint is not
recomputed (its backward runs first, right after the forward), as in
``torch.utils.checkpoint.checkpoint_sequential``.

The option is read and checked where it is recorded
(``io.metadata.recompute_option``, ``recompute_spec``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..core.emitter import Emitter
from ..core.graph import infer_types, node_inputs, opset_version, subgraphs, toposort, upstream_values
from ..core.names import NameGen
from ..errors import TrainingModelError

__all__ = ["Report", "apply", "saved_activations"]

#: Ops whose values ``"elementwise"`` may recompute: cost linear in their
#: input, no randomness.
CHEAP_OPS = frozenset({
    # elementwise math and activations
    "Abs", "Neg", "Reciprocal", "Sqrt", "Exp", "Log", "Erf", "Sin", "Cos", "Tan", "Tanh",
    "Sigmoid", "HardSigmoid", "HardSwish", "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu",
    "Gelu", "Softplus", "Softsign", "Mish", "ThresholdedRelu", "Clip", "Sign", "Floor", "Ceil",
    "Round", "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Where", "Not",
    "And", "Or", "Xor", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "IsNaN",
    "IsInf", "Shrink", "Cast", "CastLike", "Identity",
    # layout
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Split", "Slice",
    "Concat", "Gather",
    # row-wise normalizations
    "Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization",
    "BatchNormalization", "InstanceNormalization", "GroupNormalization",
})

#: Ops never copied: a copy would draw other random numbers.
RANDOM_OPS = frozenset({
    "Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
    "Multinomial", "Bernoulli",
})

#: Contrib ops a copy recomputes exactly (deterministic kernels, no state).
COPYABLE_CONTRIB = frozenset(("com.microsoft", op) for op in (
    "MatMulNBits", "GroupQueryAttention", "SkipSimplifiedLayerNormalization",
    "SkipLayerNormalization", "SimplifiedLayerNormalization", "RotaryEmbedding",
    "FusedMatMul", "Gelu", "FastGelu", "BiasGelu", "QuickGelu",
))

#: Readers that only look at a value's shape: they read the copy where there
#: is one (with shapes open until run time, onnxruntime would keep the
#: original alive until the reader runs), else the original.
SHAPE_READERS = frozenset({"Shape", "Size"})

_NUMERIC = frozenset({
    TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16,
    TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
    TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
})

#: Most cut positions the checkpoint search weighs (it is quadratic in them).
_MAX_CANDIDATES = 128

#: Most values a checkpoint cut may hold (a decoder block built of contrib
#: norms hands on two: the normalized value and the residual sum).
_MAX_CUT_VALUES = 2

#: Size assumed for a symbolic dimension when estimating bytes.
_SYMBOLIC_DIM = 64


# ------------------------------------------------------------------ analysis
@dataclass
class Report:
    """What ``apply`` did to one program."""

    mode: str
    #: Kept values that recomputed chains start from (checkpoint modes: the checkpoints).
    checkpoints: list[str] = field(default_factory=list)
    #: Saved activations now recomputed, and the forward nodes copied for them.
    recomputed: list[str] = field(default_factory=list)
    copied_nodes: int = 0
    #: Estimated bytes of saved activations before and after (symbolic dims as 64).
    saved_before: int = 0
    saved_after: int = 0


class _Forward:
    """The forward part of an expanded training program and its saved activations.

    forward nodes: the ancestors of the differentiated values ``ys`` (the
    loss); every other node is backward (or an update).  A saved activation
    is a forward value that a backward node reads (Shape/Size readers aside).
    """

    def __init__(self, graph: onnx.GraphProto, ys: Sequence[str], dtypes: dict[str, int],
                 shapes: dict[str, Any], data_inputs: Iterable[str]) -> None:
        self.nodes = list(graph.node)
        self.dtypes, self.shapes = dtypes, shapes
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.pos = {id(n): i for i, n in enumerate(self.nodes)}
        self.graph_outputs = {o.name for o in graph.output}
        anc = upstream_values(self.producer, ys)
        self.is_forward = {id(n): any(o in anc for o in n.output if o) for n in self.nodes}
        self.order = [n for n in self.nodes if self.is_forward[id(n)]]
        self.fpos = {id(n): i for i, n in enumerate(self.order)}
        # Values computed from the data (not only from weights and constants).
        data = set(data_inputs)
        for n in self.order:
            if any(i in data for i in node_inputs(n)):
                data.update(o for o in n.output if o)
        self.data = data
        # Late nodes: backward nodes that depend on the loss (they run after
        # the forward); for each, its position, a value to probe (numeric,
        # shape known) and the first position of a late node reading it.
        late_values = dict.fromkeys(ys, -1)
        self.late: list[int] = []
        self.probe: dict[int, str] = {}
        self.first_late_reader: dict[int, int] = {}
        for i, n in enumerate(self.nodes):
            if self.is_forward[id(n)]:
                continue
            reads = [late_values[v] for v in node_inputs(n) if v in late_values]
            if not reads:
                continue
            for p in reads:
                if p >= 0:
                    self.first_late_reader.setdefault(p, i)
            outs = [o for o in n.output if o]
            late_values.update(dict.fromkeys(outs, i))
            self.late.append(i)
            probe = next((o for o in outs if dtypes.get(o) in _NUMERIC and shapes.get(o) is not None), None)
            if probe is not None:
                self.probe[i] = probe
        self.ys = list(ys)
        # Saved activations: forward value -> its backward readers.
        # Backward readers of a value's shape alone: {forward value: their positions}.
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        self.shape_reads: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            if self.is_forward[id(n)]:
                continue
            for v in node_inputs(n):
                p = self.producer.get(v)
                if p is None or not self.is_forward[id(p)] or self.fixed(v):
                    continue
                if n.op_type in SHAPE_READERS:
                    self.shape_reads.setdefault(v, []).append(i)
                else:
                    self.readers.setdefault(v, []).append(n)
        self.saved = sorted(self.readers, key=lambda v: self.fpos[id(self.producer[v])])

    def copyable(self, n: onnx.NodeProto) -> bool:
        return ((n.domain in ("", "ai.onnx") or (n.domain, n.op_type) in COPYABLE_CONTRIB)
                and n.op_type not in RANDOM_OPS
                and n.op_type != "Constant" and not subgraphs(n))

    def fixed(self, v: str) -> bool:
        """Never recomputed: inputs, weights and what only they determine,
        outputs of nodes that cannot be copied, graph outputs, shape-like values."""
        n = self.producer.get(v)
        if n is None or not self.is_forward[id(n)] or not self.copyable(n):
            return True
        if v not in self.data or v in self.graph_outputs:
            return True
        shape = self.shapes.get(v)
        if shape is not None and (len(shape) == 0 or (
                len(shape) == 1 and self.dtypes.get(v) in (TensorProto.INT64, TensorProto.INT32,
                                                            TensorProto.BOOL))):
            return True
        return False

    def nbytes(self, v: str) -> int:
        shape = self.shapes.get(v)
        et = self.dtypes.get(v, TensorProto.FLOAT)
        try:
            item = np.dtype(helper.tensor_dtype_to_np_dtype(et)).itemsize
        except Exception:
            item = 4
        if shape is None:
            return item * _SYMBOLIC_DIM ** 2
        return item * math.prod(d if isinstance(d, int) and d >= 0 else _SYMBOLIC_DIM for d in shape)


def saved_activations(graph: onnx.GraphProto, ys: Sequence[str],
                      opset_imports: Sequence[onnx.OperatorSetIdProto],
                      data_inputs: Iterable[str] | None = None) -> dict[str, int]:
    """Forward values of an expanded training program that its backward nodes
    read (``ys``: the differentiated values, the loss), with their estimated
    bytes: what a step keeps alive from the forward to the backward.

    ``data_inputs``: graph inputs that carry data (default: every input with
    no initializer and no binding-like name; pass the feeds for precision)."""
    dtypes, shapes = infer_types(graph, opset_imports)
    if data_inputs is None:
        inits = {t.name for t in graph.initializer}
        data_inputs = [i.name for i in graph.input if i.name not in inits]
    fw = _Forward(graph, ys, dtypes, shapes, data_inputs)
    return {v: fw.nbytes(v) for v in fw.saved}


# ------------------------------------------------------------------ choosing K
def _kept_elementwise(fw: _Forward) -> set[str]:
    """Greedy in forward order: recompute a saved value of a cheap op when the
    values its copy needs (through other cheap ops, stopping at kept or fixed
    values) add fewer bytes to the kept set than the value itself takes."""
    kept = set(fw.saved)
    for v in fw.saved:
        p = fw.producer[v]
        if p.op_type not in CHEAP_OPS:
            continue
        new: set[str] = set()
        seen: set[str] = set()
        stack = list(node_inputs(p))
        while stack:
            u = stack.pop()
            if u in seen or u in kept or fw.fixed(u):
                continue
            seen.add(u)
            q = fw.producer[u]
            if q.op_type in CHEAP_OPS:
                stack.extend(node_inputs(q))
            else:
                new.add(u)
        if sum(fw.nbytes(u) for u in new) < fw.nbytes(v):
            kept.discard(v)
            kept |= new
    return kept


def _crossings(fw: _Forward) -> list[set[str]]:
    """For each boundary b (after forward node b): the non-fixed values
    produced at or before b that forward nodes after b read."""
    last_read: dict[str, int] = {}
    for i, n in enumerate(fw.order):
        for v in node_inputs(n):
            if v in fw.producer and not fw.fixed(v):
                last_read[v] = i
    out: list[set[str]] = []
    live: set[str] = set()
    ends: dict[int, list[str]] = {}
    for v, i in last_read.items():
        ends.setdefault(i, []).append(v)
    for b, n in enumerate(fw.order):
        for v in ends.get(b, ()):
            live.discard(v)
        for o in n.output:
            if o in last_read and last_read[o] > b:
                live.add(o)
        out.append(set(live))
    return out


def _segment_plan(fw: _Forward, segments: int | None) -> tuple[set[str], list[str]]:
    """Checkpoints at cuts of the forward pass that hold at most
    ``_MAX_CUT_VALUES`` values.

    saved(a, b) = bytes the backward reads of values made after cut a up to
    cut b, the checkpoint at b left out (it is kept anyway).
    Over a grid of bounds B, the cuts of least total size keeping every
    saved(a, b) <= B (dynamic programming; at most k - 1 cuts for
    ``segments=k``, any number for None, "blocks"); of those, the ones that
    minimize max saved(a, b) + bytes of the cuts, the estimated peak."""
    crossings = _crossings(fw)
    saved_at = [0] * len(fw.order)
    for v in fw.saved:
        saved_at[fw.fpos[id(fw.producer[v])]] += fw.nbytes(v)
    prefix = [int(x) for x in np.cumsum(saved_at)] if saved_at else []
    total = prefix[-1] if prefix else 0
    cands = [b for b, c in enumerate(crossings) if 0 < len(c) <= _MAX_CUT_VALUES and 0 < prefix[b] < total]
    if not cands or total == 0:
        return set(fw.saved), []
    cut_cost = {b: sum(fw.nbytes(v) for v in crossings[b]) for b in cands}
    if len(cands) > _MAX_CANDIDATES:
        # Deep models cut everywhere: keep the smallest cut of each of
        # _MAX_CANDIDATES equal stretches of saved bytes (the DP is quadratic).
        bins: dict[int, int] = {}
        for b in cands:
            k = prefix[b] * _MAX_CANDIDATES // (total + 1)
            if k not in bins or cut_cost[b] <= cut_cost[bins[k]]:
                bins[k] = b
        cands = sorted(bins.values())
    kept_at = {b: sum(fw.nbytes(v) for v in crossings[b] if v in fw.readers) for b in cands}

    def seg(a: int | None, b: int | None) -> int:
        """saved(a, b); None: the start, or the end of the forward."""
        start = prefix[a] if a is not None else 0
        return (prefix[b] - kept_at[b] if b is not None else total) - start

    def max_segment(chosen: list[int]) -> int:
        edges: list[int | None] = [None, *chosen, None]
        return max(seg(a, b) for a, b in zip(edges, edges[1:]))

    chosen: list[int] = []
    if segments is not None and segments <= 1:
        return set(fw.saved), []
    cap = None if segments is None else segments - 1
    best_est = float(total)
    smallest = max(max(saved_at), 1)
    for k in range(41):
        bound = smallest * (total / smallest) ** (k / 40)
        picked = _cheapest_cuts(cands, seg, cut_cost, bound, cap)
        if not picked:
            continue
        est = max_segment(picked) + sum(cut_cost[b] for b in picked)
        if est < best_est:
            chosen, best_est = picked, est
    if not chosen:
        return set(fw.saved), []
    kept: set[str] = set()
    for b in chosen:
        kept |= crossings[b]
    tail = max(chosen)
    kept |= {v for v in fw.saved if fw.fpos[id(fw.producer[v])] > tail}
    return kept, [next(iter(crossings[b])) for b in chosen]


def _cheapest_cuts(cands: list[int], seg: Any, cost: dict[int, int], bound: float,
                   max_cuts: int | None = None) -> list[int] | None:
    """The cuts of least total cost keeping every segment <= bound, at most
    ``max_cuts`` of them (None if impossible).  best[c][j]: the least cost of
    c cuts ending with cut j = cost[j] + min over i of best[c - 1][i] with
    seg(i, j) <= bound (the start is cut 0 of cost 0)."""
    points: list[int | None] = [None, *cands]
    n = len(points)
    inf = float("inf")
    fits = [[seg(points[i], points[j]) <= bound for j in range(n)] for i in range(n)]
    if max_cuts is None:  # any number of cuts: one row, best[j] over every count
        flat, flat_back = [0.0] + [inf] * (n - 1), [-1] * n
        for j in range(1, n):
            for i in range(j):
                if flat[i] < inf and fits[i][j] and flat[i] + cost[points[j]] < flat[j]:
                    flat[j], flat_back[j] = flat[i] + cost[points[j]], i
        end = min((j for j in range(n) if flat[j] < inf and seg(points[j], None) <= bound),
                  key=lambda j: flat[j], default=-1)
        chosen = []
        while end > 0:
            chosen.append(points[end])
            end = flat_back[end]
        return sorted(chosen) if chosen or seg(None, None) <= bound else None
    limit = min(max_cuts, n - 1)
    best = [[inf] * n for _ in range(limit + 1)]
    back = [[-1] * n for _ in range(limit + 1)]
    best[0][0] = 0.0
    for c in range(1, limit + 1):
        prev, row, brow = best[c - 1], best[c], back[c]
        for j in range(1, n):
            for i in range(j):
                if prev[i] < inf and fits[i][j] and prev[i] + cost[points[j]] < row[j]:
                    row[j], brow[j] = prev[i] + cost[points[j]], i
    end, count, value = -1, -1, inf
    for c in range(limit + 1):
        for j in range(n):
            if best[c][j] < value and seg(points[j], None) <= bound:
                end, count, value = j, c, best[c][j]
    if end < 0:
        return None
    chosen = []
    while count > 0:
        chosen.append(points[end])
        end, count = back[count][end], count - 1
    return sorted(chosen)


def _resolve(fw: _Forward, name: str) -> str:
    """A checkpoint name as a forward value: itself, or the builder's
    training-mode copy of it (``train/<name>``)."""
    p = fw.producer.get(name)
    if p is not None and fw.is_forward[id(p)]:
        return name
    clean = NameGen.base(f"train/{name}")
    matches = [v for v, n in fw.producer.items() if fw.is_forward[id(n)]
               and (v == clean or (v.startswith(clean + "_") and v[len(clean) + 1:].isdigit()))]
    if len(matches) == 1:
        return matches[0]
    raise TrainingModelError(
        f"recompute: checkpoint {name!r} is not a value on the path to the loss {fw.ys}")


# ------------------------------------------------------------------ rewriting
def apply(graph: onnx.GraphProto, spec: Any, ys: Sequence[str], names: NameGen,
          opset_imports: Sequence[onnx.OperatorSetIdProto], data_inputs: Iterable[str],
          functions: Sequence[onnx.FunctionProto] = ()) -> Report:
    """Rewrite an expanded training program (in place) so that the saved
    activations outside the kept set are recomputed by gated copies of their
    forward nodes, placed just before their first backward reader (later
    where one reads a value made after that: the graph stays sorted).

    ``spec``: the option as ``io.metadata.recompute_option`` returns it (None: nothing to do)."""
    if spec is None:
        return Report("off")
    mode = spec if isinstance(spec, str) else next(iter(spec))
    report = Report(mode)
    opset = opset_version(opset_imports)
    if opset < 13:
        raise TrainingModelError(f"recompute needs default-domain opset >= 13, the model has {opset}")
    dtypes, shapes = infer_types(graph, opset_imports, functions=functions)
    fw = _Forward(graph, ys, dtypes, shapes, data_inputs)
    report.saved_before = sum(fw.nbytes(v) for v in fw.saved)
    kept = _kept(fw, mode, spec, report)
    targets = [v for v in fw.saved if v not in kept]
    if not targets:
        report.saved_after = report.saved_before
        return report
    copies = _copied_nodes(fw, targets, kept)
    deadline = _deadlines(fw, targets, copies)
    placed: dict[int, list[onnx.NodeProto]] = {}
    zero_at = _gates(fw, copies, deadline, opset, names, dtypes, placed)
    renamed = _emit_copies(fw, copies, deadline, zero_at, opset, names, dtypes, placed)
    _place(graph, fw, targets, renamed, placed)

    report.recomputed = targets
    report.copied_nodes = len(copies)
    copied = {o for n in copies for o in n.output if o}
    roots = {u for n in copies for u in node_inputs(n) if u not in copied and not fw.fixed(u)}
    report.saved_after = sum(fw.nbytes(v) for v in ({v for v in fw.saved if v in kept} | roots))
    return report


def _kept(fw: _Forward, mode: str, spec: Any, report: Report) -> set[str]:
    """The saved activations kept as they are (the others are recomputed)."""
    if mode == "elementwise":
        return _kept_elementwise(fw)
    if mode == "checkpoints":
        points = [_resolve(fw, n) for n in spec["checkpoints"]]
        tail = max(fw.fpos[id(fw.producer[p])] for p in points)
        report.checkpoints = points
        return set(points) | {v for v in fw.saved if fw.fpos[id(fw.producer[v])] > tail}
    kept, report.checkpoints = _segment_plan(fw, spec.get("segments") if isinstance(spec, dict) else None)
    return kept


def _copied_nodes(fw: _Forward, targets: list[str], kept: set[str]) -> list[onnx.NodeProto]:
    """The forward nodes to copy, in forward order: from each target back to
    kept or fixed values."""
    copy_ids: set[int] = set()
    stack = list(targets)
    while stack:
        n = fw.producer[stack.pop()]
        if id(n) in copy_ids:
            continue
        copy_ids.add(id(n))
        stack.extend(u for u in node_inputs(n) if u not in kept and not fw.fixed(u))
    return [n for n in fw.order if id(n) in copy_ids]


def _deadlines(fw: _Forward, targets: list[str], copies: list[onnx.NodeProto]) -> dict[int, int]:
    """The deadline of each copy (by id): the position of the first backward
    node that needs it, directly or through other copies."""
    first_read = {v: min(fw.pos[id(r)] for r in fw.readers[v]) for v in targets}
    deadline: dict[int, int] = {}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in copies:
        for u in node_inputs(n):
            consumers.setdefault(u, []).append(n)
    for v, places in fw.shape_reads.items():
        first_read[v] = min(first_read.get(v, len(fw.nodes)), *places)
    for n in reversed(copies):
        d = min((first_read[o] for o in n.output if o in first_read), default=len(fw.nodes))
        for o in n.output:
            for m in consumers.get(o, ()):
                d = min(d, deadline[id(m)])
        deadline[id(n)] = d
    return deadline


def _gates(fw: _Forward, copies: list[onnx.NodeProto], deadline: dict[int, int], opset: int,
           names: NameGen, dtypes: dict[str, int], placed: dict[int, list[onnx.NodeProto]]) -> dict[int, str]:
    """The int64 zero that gates the chain roots of each deadline d (its
    nodes go to ``placed[d]``), by d.

    The barrier of d: the late nodes between the previous deadline and d
    that no late node before d reads (the sinks of that stretch of the
    backward; all others are their ancestors).  So the copies for d run
    after everything the backward order puts before them, weight gradients
    included, whatever order onnxruntime prefers otherwise (it may defer
    nodes it fused)."""
    produced_by_copy = {o for n in copies for o in n.output if o}
    root_deadlines = sorted({deadline[id(n)] for n in copies
                             if not any(i in produced_by_copy for i in node_inputs(n))})
    zero_at: dict[int, str] = {}
    previous = 0
    for d in root_deadlines:
        start = bisect.bisect_left(fw.late, previous)
        stop = bisect.bisect_left(fw.late, d)
        sinks = [p for p in fw.late[start:stop] if fw.first_late_reader.get(p, d) >= d and p in fw.probe]
        if not sinks:  # nothing new since the previous barrier: wait for the last late value
            sinks = [p for p in fw.late[:stop] if p in fw.probe][-1:]
        z = Emitter(opset, names, dict(dtypes), hint="recompute/gate")
        flags = []
        for p in sinks:
            t = fw.probe[p]
            rank = len(fw.shapes[t])
            # One element of t, sliced on every axis (a flattening Reshape would
            # make onnx's shape inference track every element), compared with itself.
            probe = z.slice(t, [0] * rank, [1] * rank, list(range(rank))) if rank else t
            flags.append(z.Cast(z.Less(probe, probe), to=TensorProto.INT64))
        if not flags:  # no late value at all before d: wait for the loss itself
            flags.append(z.Cast(z.Less(fw.ys[0], fw.ys[0]), to=TensorProto.INT64))
        total = flags[0] if len(flags) == 1 else z.Max(*flags)
        zero_at[d] = z.reduce_sum(total, None, keepdims=False)
        placed.setdefault(d, []).extend(z.nodes)
        previous = d
    return zero_at


def _emit_copies(fw: _Forward, copies: list[onnx.NodeProto], deadline: dict[int, int], zero_at: dict[int, str],
                 opset: int, names: NameGen, dtypes: dict[str, int],
                 placed: dict[int, list[onnx.NodeProto]]) -> dict[str, str]:
    """The copies (into ``placed`` at their deadlines), a chain root reading
    its first data input through the gate ``c' = Reshape(c, Shape(c) + z)``
    (Reshape aliases it: no copy); {forward value: its recomputed copy}."""
    emit = Emitter(opset, names, dict(dtypes), hint="recompute")
    renamed: dict[str, str] = {}
    for n in copies:
        start = len(emit.nodes)
        inputs = [renamed.get(i, i) if i else i for i in n.input]
        if not any(i in renamed for i in n.input if i):
            k = next(k for k, i in enumerate(n.input) if i and i in fw.data)
            c = n.input[k]
            inputs[k] = emit.Reshape(c, emit.Add(emit.Shape(c), zero_at[deadline[id(n)]]))
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = names.fresh(f"{n.name or n.output[0] or n.op_type}/copy")
        del c.input[:]
        c.input.extend(inputs)
        del c.output[:]
        for o in n.output:
            if o:
                renamed[o] = names.fresh(f"{o}/recompute")
            c.output.append(renamed[o] if o else "")
        emit.nodes.append(c)
        placed.setdefault(deadline[id(n)], []).extend(emit.nodes[start:])
    return renamed


def _place(graph: onnx.GraphProto, fw: _Forward, targets: list[str], renamed: dict[str, str],
           placed: dict[int, list[onnx.NodeProto]]) -> None:
    """Backward readers read the copies; the new nodes go just before their
    deadline, or (a reader before the loss, whose gate waits for it) where
    a stable topological sort puts them."""
    target_set = set(targets)
    out: list[onnx.NodeProto] = []
    for i, n in enumerate(fw.nodes):
        out.extend(placed.get(i, ()))
        if not fw.is_forward[id(n)]:
            # A shape reader reads any copy there is, so the original dies with the forward.
            moved = renamed if n.op_type in SHAPE_READERS else target_set
            for k, v in enumerate(n.input):
                if v in moved:
                    n.input[k] = renamed[v]
        out.append(n)
    out.extend(placed.get(len(fw.nodes), ()))
    if not _sorted(out, graph):
        out = toposort(out, _defined_before(graph))
    del graph.node[:]
    graph.node.extend(out)


def _defined_before(graph: onnx.GraphProto) -> set[str]:
    """What a graph defines before its first node: inputs and initializers."""
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    return names | {t.values.name for t in graph.sparse_initializer}


def _sorted(nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> bool:
    """Whether every node reads only values defined before it (outer-scope
    names of subgraphs aside: the placement moves only top-level nodes)."""
    made = {o for n in nodes for o in n.output if o}
    defined: set[str] = set()
    for n in nodes:
        if any(i in made and i not in defined for i in node_inputs(n)):
            return False
        defined.update(o for o in n.output if o)
    return True
