"""Build the executable programs of a training model.

One program per use: ``inference`` (M), ``algorithm i`` (M ⊕ A_i) and
``initialization i`` (I_i).  Each is a plain ONNX model of standard ops:

1. take the graph (combining M and A_i for an algorithm),
2. turn every state variable it holds into a graph input (fed from the state),
3. expand Gradient nodes into backward graphs (autodiff),
4. lower Adam / Momentum / Adagrad to standard ops (optim),
5. fold scaled updates of Gemm products into the Gemm (fuse),
6. prune nodes no output needs and sort topologically,
7. drop the ai.onnx.preview.training import; the executor caps the IR version.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .autodiff import expand_gradients
from .errors import TrainingModelError
from .executor import MAX_IR_VERSION
from .fuse import fuse_gemm_updates
from .graph import (
    PREVIEW_DOMAIN,
    node_inputs,
    opset_version,
    outer_references,
    prune,
    subgraphs,
    toposort,
)
from .model import TrainingModel, combined_graph, copy_graph, uses_preview_ops
from .names import NameGen
from .optim import lower_optimizers


#: Default-domain opset given to programs of models that import none.
DEFAULT_OPSET = 17


@dataclass(frozen=True)
class FeedSpec:
    """What one input accepts, precomputed so a step checks feeds cheaply."""

    name: str
    dtype: np.dtype | None
    dims: tuple[int | None, ...] | None  # None: any rank; None entries: any size
    text: str  # e.g. "float32['N', 4]", for messages

    @classmethod
    def of(cls, vi: onnx.ValueInfoProto) -> FeedSpec:
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else None
        dims = None
        shown: Any = ""
        if tt.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
            shown = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
        return cls(vi.name, dtype, dims, f"{dtype.name if dtype is not None else '?'}{shown}")

    def check(self, value: Any, caller: str) -> np.ndarray:
        """The feed as a C-contiguous array of the right dtype and rank (or ValueError)."""
        arr = value if value.__class__ is np.ndarray else self._convert(value, caller)
        if arr.dtype != self.dtype and self.dtype is not None:
            raise ValueError(
                f"{caller}: feed {self.name!r} has dtype {arr.dtype}, expected {self.text}"
            )
        dims = self.dims
        if dims is not None:
            shape = arr.shape
            if len(shape) != len(dims):
                self._bad_shape(shape, caller)
            for axis, size in self.fixed:
                if shape[axis] != size:
                    self._bad_shape(shape, caller)
        if not arr.flags.c_contiguous:
            arr = np.array(arr, order="C")
        return arr

    @property
    def fixed(self) -> tuple[tuple[int, int], ...]:
        """(axis, size) of every statically known dimension."""
        cached = self.__dict__.get("_fixed")
        if cached is None:
            cached = tuple((a, d) for a, d in enumerate(self.dims or ()) if d is not None)
            object.__setattr__(self, "_fixed", cached)
        return cached

    def _convert(self, value: Any, caller: str) -> np.ndarray:
        if isinstance(value, np.ndarray):
            return value
        try:
            return np.asarray(value, dtype=self.dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(
                f"{caller}: feed {self.name!r} cannot be converted to {self.dtype}: {exc}"
            ) from exc

    def _bad_shape(self, shape: tuple, caller: str) -> None:
        raise ValueError(
            f"{caller}: feed {self.name!r} has shape {list(shape)}, expected {self.text}"
        )


@dataclass
class Program:
    """A standard-op ONNX model plus how the session feeds and reads it."""

    label: str
    model: onnx.ModelProto
    #: Inputs the caller must feed: name -> ValueInfoProto.
    feeds: dict[str, onnx.ValueInfoProto] = field(default_factory=dict)
    #: Inputs that have a default (an initializer) and may be fed to override it.
    optional_feeds: dict[str, onnx.ValueInfoProto] = field(default_factory=dict)
    #: State variables read by the program (fed from the session's state).
    state_inputs: list[str] = field(default_factory=list)
    #: Output names in the order the program produces them.
    outputs: list[str] = field(default_factory=list)
    #: (state variable, output) pairs applied after a run.
    bindings: list[tuple[str, str]] = field(default_factory=list)
    #: Checks of the inputs above, and of state variables fed as overrides.
    feed_specs: list[FeedSpec] = field(default_factory=list)
    optional_specs: dict[str, FeedSpec] = field(default_factory=dict)
    state_specs: dict[str, FeedSpec] = field(default_factory=dict)
    #: Outputs a step returns: those no binding consumes, in program order.
    returned: list[str] = field(default_factory=list)
    #: Symbolic dims shared by several feeds: symbol -> [(feed, axis), ...].
    shared_dims: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    #: The binding plan: state variables written, the output each reads (first
    #: binding of an output), and (key, source key) pairs for outputs bound twice.
    bound_keys: tuple[str, ...] = ()
    bound_values: tuple[str, ...] = ()
    bound_copies: tuple[tuple[str, str], ...] = ()
    #: Every state variable a run writes: bound_keys, then the copies' keys.
    target_keys: tuple[str, ...] = ()


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {o.name for o in graph.output}
    names |= {t.name for t in graph.initializer} | {v.name for v in graph.value_info}
    names |= {t.values.name for t in graph.sparse_initializer}
    stack = [graph]
    while stack:
        g = stack.pop()
        for n in g.node:
            names.update(n.input)
            names.update(n.output)
            names.add(n.name)
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    stack.append(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    stack.extend(a.graphs)
    return names


def build_program(
    tm: TrainingModel,
    label: str,
    graph: onnx.GraphProto,
    bindings: list[tuple[str, str]] | None = None,
    state_left_out: Iterable[str] = (),
) -> Program:
    """Lower one graph (already combined where needed) into a Program.

    ``state_left_out``: state variables whose initializers the caller already
    left out of ``graph`` (they become inputs all the same)."""
    proto = tm.proto
    state_here = {
        name
        for name in [t.name for t in graph.initializer]
        + [t.values.name for t in graph.sparse_initializer]
        if name in tm.state
    } | set(state_left_out)
    # State variables become inputs fed from the session's buffers: copying
    # their initializer data here would double the memory of a large model.
    g = copy_graph(graph, exclude_initializers=state_here)
    _state_to_inputs(g, tm, state_here)

    names = NameGen(_all_names(g))
    available = [i.name for i in g.input] + [t.name for t in g.initializer]
    available += [t.values.name for t in g.sparse_initializer]
    opset_imports = list(proto.opset_import)
    if not any(o.domain in ("", "ai.onnx") for o in opset_imports):
        # Lowered Gradient/optimizer ops are default-domain ops; models that
        # import only ai.onnx.preview.training (ONNX's own test cases) get one.
        opset_imports.append(helper.make_opsetid("", DEFAULT_OPSET))
    try:
        if uses_preview_ops(g):
            expand_gradients(g, opset_imports, names, available, proto.functions)
            lower_optimizers(g, opset_imports, names)
            fuse_gemm_updates(g, opset_imports)
        outputs = [o.name for o in g.output]
        nodes = prune(toposort(list(g.node), available, where=label), outputs)
        nodes = _elide_output_identities(nodes, g)
        nodes = _shield_batch_norm_inputs(nodes, g, opset_version(opset_imports), names)
    except TrainingModelError as exc:
        raise type(exc)(f"{label}: {exc}") from exc
    del g.node[:]
    g.node.extend(nodes)
    if uses_preview_ops(g):
        left = sorted({n.op_type for n in g.node if n.domain == PREVIEW_DOMAIN})
        raise TrainingModelError(f"{label}: unsupported ai.onnx.preview.training ops {left}")
    _prune_unused_initializers(g)

    imports = [o for o in opset_imports if o.domain != PREVIEW_DOMAIN]
    model = helper.make_model(g, opset_imports=imports, producer_name="onnxtrain")
    ir = max(proto.ir_version, 4) if proto.ir_version else 8
    model.ir_version = min(ir, MAX_IR_VERSION)
    model.functions.extend(proto.functions)

    init_names = {t.name for t in g.initializer}
    program = Program(label=label, model=model, bindings=list(bindings or []))
    for vi in g.input:
        if vi.name in tm.state:
            program.state_inputs.append(vi.name)
        elif vi.name in init_names:
            program.optional_feeds[vi.name] = vi
        else:
            program.feeds[vi.name] = vi
    program.outputs = [o.name for o in g.output]
    program.feed_specs = [FeedSpec.of(vi) for vi in program.feeds.values()]
    program.optional_specs = {n: FeedSpec.of(vi) for n, vi in program.optional_feeds.items()}
    for vi in g.input:
        if vi.name in tm.state:
            program.state_specs[vi.name] = FeedSpec.of(vi)
    symbols: dict[str, list[tuple[str, int]]] = {}
    for vi in list(program.feeds.values()) + list(program.optional_feeds.values()):
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            for axis, d in enumerate(tt.shape.dim):
                if d.HasField("dim_param") and d.dim_param:
                    symbols.setdefault(d.dim_param, []).append((vi.name, axis))
    program.shared_dims = {k: v for k, v in symbols.items() if len(v) > 1}
    bound = {v for _, v in program.bindings}
    program.returned = [o for o in program.outputs if o not in bound]
    first: dict[str, str] = {}
    copies = []
    for key, value in program.bindings:
        if value in first:
            copies.append((key, first[value]))
        else:
            first[value] = key
    program.bound_keys = tuple(first.values())
    program.bound_values = tuple(first)
    program.bound_copies = tuple(copies)
    program.target_keys = program.bound_keys + tuple(k for k, _ in copies)
    return program


def _state_to_inputs(g: onnx.GraphProto, tm: TrainingModel, state_here: set[str]) -> None:
    """Replace state initializers by graph inputs of the same type and shape."""
    declared = {i.name for i in g.input}
    kept = [t for t in g.initializer if t.name not in state_here]
    kept_sparse = [t for t in g.sparse_initializer if t.values.name not in state_here]
    del g.initializer[:]
    g.initializer.extend(kept)
    del g.sparse_initializer[:]
    g.sparse_initializer.extend(kept_sparse)
    for name in sorted(state_here, key=list(tm.state).index):
        var = tm.state[name]
        vi = helper.make_tensor_value_info(name, var.elem_type, list(var.shape))
        if name in declared:
            for existing in g.input:
                if existing.name == name:
                    existing.CopyFrom(vi)
        else:
            g.input.append(vi)


def _elide_output_identities(nodes: list[onnx.NodeProto], g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Drop ``b = Identity(a)`` where b is a graph output, by letting a's
    producer write b directly (onnxruntime keeps such Identities: one kernel
    and one copy per step each, e.g. for a loss or a bound update).

    Only when a is an intermediate value: produced by a node of this graph,
    not a graph input, initializer or output, and not read by a subgraph."""
    outputs = {o.name for o in g.output}
    fixed = {i.name for i in g.input} | {t.name for t in g.initializer}
    fixed |= {t.values.name for t in g.sparse_initializer} | outputs
    producer = {o: n for n in nodes for o in n.output if o}
    captured: set[str] = set()
    for n in nodes:
        for sub in subgraphs(n):
            captured |= outer_references(sub)
    rename: dict[str, str] = {}
    kept = []
    for n in nodes:
        if (
            n.op_type == "Identity"
            and n.domain in ("", "ai.onnx")
            and n.output[0] in outputs
            and n.input[0] in producer
            and n.input[0] not in fixed
            and n.input[0] not in captured
            and n.input[0] not in rename
        ):
            rename[n.input[0]] = n.output[0]
            continue
        kept.append(n)
    if not rename:
        return nodes
    for n in kept:
        for i, name in enumerate(n.input):
            if name in rename:
                n.input[i] = rename[name]
        for i, name in enumerate(n.output):
            if name in rename:
                n.output[i] = rename[name]
    keep_vi = [vi for vi in g.value_info if vi.name not in rename]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    return kept


def _shield_batch_norm_inputs(
    nodes: list[onnx.NodeProto], g: onnx.GraphProto, opset: int, names: NameGen
) -> list[onnx.NodeProto]:
    """Give every training-mode BatchNormalization a private copy of its
    mean/var inputs when they are graph inputs or initializers.

    onnxruntime 1.31 writes the running statistics into the buffers of those
    inputs when the running_mean/running_var outputs are not graph outputs.
    Fed from state, that would change the committed state before the step
    commits (and under a concurrent ``run()``).  The copy is Max(v, v): a
    per-channel vector, which onnxruntime neither aliases nor removes (it does
    both to Identity)."""
    fixed = {i.name for i in g.input} | {t.name for t in g.initializer}
    out: list[onnx.NodeProto] = []
    for n in nodes:
        if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx"):
            training = (
                any(a.name == "training_mode" and a.i for a in n.attribute)
                if opset >= 14
                else sum(1 for o in n.output if o) > 1
            )
            if training:
                for k in (3, 4):
                    if len(n.input) > k and n.input[k] in fixed:
                        copy = names.fresh(f"{n.input[k]}/bn_private")
                        out.append(helper.make_node("Max", [n.input[k], n.input[k]], [copy],
                                                    name=names.fresh("bn_private_copy")))
                        n.input[k] = copy
        out.append(n)
    return out


def _prune_unused_initializers(g: onnx.GraphProto) -> None:
    used: set[str] = {o.name for o in g.output}
    for n in g.node:
        used.update(node_inputs(n))
    declared = {i.name for i in g.input}
    kept = [t for t in g.initializer if t.name in used or t.name in declared]
    if len(kept) != len(g.initializer):
        del g.initializer[:]
        g.initializer.extend(kept)


def inference_program(tm: TrainingModel) -> Program:
    return build_program(tm, "inference", tm.proto.graph)


def algorithm_program(tm: TrainingModel, index: int) -> Program:
    ti = tm.proto.training_info[index]
    bindings = [(e.key, e.value) for e in ti.update_binding]
    state = {
        name
        for g in (tm.proto.graph, ti.algorithm)
        for name in [t.name for t in g.initializer] + [t.values.name for t in g.sparse_initializer]
        if name in tm.state
    }
    combined = combined_graph(tm.proto, index, exclude_initializers=state)
    return build_program(tm, f"training_info[{index}].algorithm", combined, bindings, state)


def initialization_program(tm: TrainingModel, index: int) -> Program | None:
    ti = tm.proto.training_info[index]
    if not ti.HasField("initialization"):
        return None
    bindings = [(e.key, e.value) for e in ti.initialization_binding]
    return build_program(tm, f"training_info[{index}].initialization", ti.initialization, bindings)
