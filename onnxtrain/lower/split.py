"""The data-parallel cut: one lowered training algorithm becomes two programs.

In data-parallel training every rank runs the same step on its own shard of
the global batch.  The gradients must be summed across ranks *between* the
backward pass and the optimizer, so the algorithm graph (after the FRONT
passes: Gradient expanded, optimizers lowered, standard ops only) is cut:

- **A** (forward + backward): feeds and state in; out come the values to
  reduce (``Reduced``), this rank's returned outputs (the loss of its shard)
  and the new values of rank-local state;
- **B** (clipping, schedules, optimizer, counters): state and the reduced
  values in; out come the other bound values, identical on every rank
  because B reads nothing that depends on the batch.

Which values are reduced:

- the outputs of Gradient nodes that B reads (or, where the model says so,
  other values: ``reduce=``, e.g. the builder's accumulated gradient sums);
- the new values of BatchNormalization running statistics (state variables
  a BatchNormalization node reads as its mean or var input): they depend on
  the batch, so they are averaged across ranks.

Every other binding must be computable in B.  One that depends on the batch
by another path would leave the ranks' states apart, so it is refused with a
``TrainingModelError`` naming the binding, unless its state variable is
declared rank-local (``local=``: the builder's gradient sums under
accumulation, which each rank keeps for itself as DDP's ``no_sync`` does).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from ..core.graph import infer_types, node_inputs
from ..errors import TrainingModelError
from .lowering import Lowering


@dataclass(frozen=True)
class Reduced:
    """A value summed across ranks: its name, numpy dtype and static shape,
    and the state variable it is bound to (BatchNormalization statistics) or
    None (a gradient, read by B)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    key: str | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class Between:
    """What runs between the halves of a cut, and what each half binds and returns."""

    reduced: list[Reduced] = field(default_factory=list)
    #: Bindings computed by A and committed as they are (rank-local state).
    local: list[tuple[str, str]] = field(default_factory=list)
    #: Bindings computed by B.
    updates: list[tuple[str, str]] = field(default_factory=list)
    #: Returned outputs: computed by A (this rank's) or by B (global).
    returned_a: list[str] = field(default_factory=list)
    returned_b: list[str] = field(default_factory=list)


@dataclass
class Cut:
    """Program A, program B (None when nothing needs it) and what runs between them."""

    a: Lowering
    b: Lowering | None
    between: Between


def _closure(producer: dict[str, onnx.NodeProto], targets: Iterable[str],
             stop: set[str]) -> list[onnx.NodeProto]:
    """The nodes ``targets`` depend on, not looking past the names in ``stop``."""
    live: dict[int, onnx.NodeProto] = {}
    stack = [t for t in targets if t not in stop]
    while stack:
        node = producer.get(stack.pop())
        if node is None or id(node) in live:
            continue
        live[id(node)] = node
        stack.extend(i for i in node_inputs(node) if i not in stop)
    return list(live.values())


def cut(low: Lowering, index: int, bindings: Sequence[tuple[str, str]], returned: Sequence[str],
        local: Iterable[str] = (), reduce: Sequence[str] | None = None) -> Cut:
    """Cut the lowered algorithm ``low`` of ``training_info[index]`` (see the module doc).

    ``bindings``: its update_binding pairs; ``returned``: the outputs a step
    returns; ``local``: rank-local state variables; ``reduce``: the values to
    reduce instead of the Gradient outputs."""
    g, tm = low.graph, low.tm
    nodes = list(g.node)
    order = {id(n): i for i, n in enumerate(nodes)}
    producer = {o: n for n in nodes for o in n.output if o}
    inits = {t.name for t in g.initializer} | {t.values.name for t in g.sparse_initializer}
    feeds = [i.name for i in g.input if i.name not in tm.state and i.name not in inits]
    where = f"training_info[{index}].update_binding"

    batch = _batch_values(nodes, order, feeds)
    result, bn = _sort_bindings(nodes, tm.state, bindings, batch, set(local))

    stop = set(reduce) if reduce is not None else set(low.gradients)
    b_targets = [v for _, v in result.updates]
    b_nodes = _closure(producer, b_targets, stop)
    made_in_b = {o for n in b_nodes for o in n.output if o}
    reads = [i for n in b_nodes for i in node_inputs(n)] + b_targets
    needed = _read_from_a(producer, reads, made_in_b, stop, batch, result.updates, where)
    missing = [n for n in (reduce or ()) if n not in producer]
    if missing:
        raise TrainingModelError(f"{where}: the value {missing[0]!r} to reduce is not computed")

    dtypes, shapes = infer_types(g, low.opset_imports, functions=tm.proto.functions)
    known = (low, dtypes, shapes, where)
    result.reduced = [_reduced(known, n, None) for n in needed] + [_reduced(known, v, k) for k, v in bn]
    result.returned_b = [r for r in returned if r in made_in_b]
    result.returned_a = [r for r in returned if r not in made_in_b]

    # Program A: everything its outputs need.
    a_out = needed + [v for _, v in bn] + [v for _, v in result.local] + result.returned_a
    a_nodes = sorted(_closure(producer, a_out, set()), key=lambda n: order[id(n)])
    a = low.copy(_part(g, a_nodes, [], _unique(a_out), dtypes, shapes), f"{low.label}[forward+backward]")
    b = None
    if b_targets or result.returned_b:
        b_nodes.sort(key=lambda n: order[id(n)])
        b_out = _unique(b_targets + result.returned_b)
        new_inputs = [helper.make_tensor_value_info(r.name, _elem(r.dtype), list(r.shape))
                      for r in result.reduced if r.key is None]
        b = low.copy(_part(g, b_nodes, new_inputs, b_out, dtypes, shapes), f"{low.label}[update]")
    return Cut(a, b, result)


def _batch_values(nodes: list[onnx.NodeProto], order: dict[int, int], feeds: list[str]) -> set[str]:
    """The values that depend on the batch (on a feed), found in node order."""
    batch = set(feeds)
    for n in sorted(nodes, key=lambda n: order[id(n)]):
        if any(i in batch for i in node_inputs(n)):
            batch.update(o for o in n.output if o)
    return batch


def _sort_bindings(nodes: list[onnx.NodeProto], state: dict, bindings: Sequence[tuple[str, str]],
                   batch: set[str], local: set[str]) -> tuple[Between, list[tuple[str, str]]]:
    """The bindings sorted into BatchNormalization statistics (returned beside), rank-local and B's."""
    bn_keys = {
        n.input[k] for n in nodes
        if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")
        for k in (3, 4) if len(n.input) > k and n.input[k] in state
    }
    result = Between()
    bn: list[tuple[str, str]] = []
    for key, value in bindings:
        if key in bn_keys and value in batch:
            bn.append((key, value))
        elif key in local:
            result.local.append((key, value))
        else:
            result.updates.append((key, value))
    return result, bn


def _read_from_a(producer: dict[str, onnx.NodeProto], reads: list[str], made_in_b: set[str],
                 stop: set[str], batch: set[str], updates: list[tuple[str, str]], where: str) -> list[str]:
    """The reduced values among B's ``reads``, in order; refuses a binding that reads the batch another way."""
    needed: list[str] = []
    for name in reads:
        if name in made_in_b or name in needed:
            continue
        if name in stop:
            needed.append(name)
        elif name in batch:
            key, value = next(
                (k, v) for k, v in updates
                if v == name or any(name in node_inputs(n) for n in _closure(producer, [v], stop))
            )
            raise TrainingModelError(
                f"{where}: state variable {key!r} is bound to {value!r}, which depends on the "
                f"batch through {name!r}, not only through the gradients: data-parallel "
                "training would leave the ranks' states apart (only gradients and "
                "BatchNormalization running statistics are reduced across ranks)"
            )
    return needed


def _reduced(known: tuple[Lowering, dict, dict, str], name: str, key: str | None) -> Reduced:
    """The Reduced for ``name`` (bound to state ``key`` or a gradient), from its inferred type and shape."""
    low, dtypes, shapes, where = known
    tm = low.tm
    shape = tm.state[key].shape if key else shapes.get(name)
    x = low.gradients.get(name)
    if shape is None and x is not None:
        shape = tm.state[x].shape if x in tm.state else shapes.get(x)
    elem = dtypes.get(name) or (tm.state[key].elem_type if key else None)
    if shape is None or any(not isinstance(d, int) for d in shape) or elem is None:
        raise TrainingModelError(
            f"{where}: {name!r} is reduced across ranks, so it needs a static shape "
            f"and a known type; found {elem}{shape}"
        )
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
    if dtype.kind != "f":
        raise TrainingModelError(f"{where}: {name!r} is reduced across ranks but is {dtype}")
    return Reduced(name, dtype, tuple(int(d) for d in shape), key)


def cut_of(low: Lowering) -> Cut:
    """The cut of the lowered algorithm ``low`` (of ``training_info[request.index]``),
    made once and kept on it: its bindings and returned outputs from the
    model, the rank-local state and the values to reduce from the request."""
    if low.cut is None:
        index, request = low.request.index, low.request
        bindings = [(e.key, e.value) for e in low.tm.proto.training_info[index].update_binding]
        bound = {v for _, v in bindings}
        returned = [o.name for o in low.graph.output if o.name not in bound]
        low.cut = cut(low, index, bindings, returned, request.local, request.reduce)
        for half in (low.cut.a, low.cut.b):
            if half is not None:
                half.between = low.cut.between
    return low.cut


def cut_forward(low: Lowering) -> Lowering:
    """Program A of the cut (forward + backward), to lower on its own."""
    return cut_of(low).a


def cut_update(low: Lowering) -> Lowering | None:
    """Program B of the cut (the update), or None where nothing needs it."""
    return cut_of(low).b


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _elem(dtype: np.dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(dtype)


def _part(g: onnx.GraphProto, nodes: list[onnx.NodeProto], new_inputs: list[onnx.ValueInfoProto],
          outputs: list[str], dtypes: dict, shapes: dict) -> onnx.GraphProto:
    """A graph of ``nodes`` from ``g``: the inputs and initializers they read
    (plus ``new_inputs``), and ``outputs`` typed from ``g`` or inference."""
    part = onnx.GraphProto()
    part.name = g.name
    read = {i for n in nodes for i in node_inputs(n)} | set(outputs)
    made = {o for n in nodes for o in n.output if o}
    new = {vi.name for vi in new_inputs}
    part.input.extend(vi for vi in g.input if vi.name in read and vi.name not in new)
    part.input.extend(new_inputs)
    part.initializer.extend(t for t in g.initializer if t.name in read)
    part.sparse_initializer.extend(t for t in g.sparse_initializer if t.values.name in read)
    part.node.extend(nodes)
    declared = {o.name: o for o in g.output}
    declared.update({vi.name: vi for vi in g.value_info if vi.name not in declared})
    for name in outputs:
        if name not in made and name not in new and name not in {i.name for i in part.input}:
            raise TrainingModelError(f"{g.name}: cannot compute {name!r} in this part")
        if name in declared:
            part.output.append(declared[name])
        else:
            shape = shapes.get(name)
            part.output.append(helper.make_tensor_value_info(
                name, dtypes.get(name, 0), None if shape is None else list(shape)))
    part.value_info.extend(vi for vi in g.value_info if vi.name in made and vi.name not in outputs)
    if any(o.name in new for o in part.output):  # a reduced value bound as it is
        raise TrainingModelError(f"{g.name}: a reduced gradient is bound directly; bind a copy")
    return part
