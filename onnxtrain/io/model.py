"""Check a loaded training model against the spec and list its state (TrainingModel).

Spec rules (DESIGN.md §2; M = main graph, A = algorithm, I = initialization):

- R1  an update_binding key is an initializer of M or of A (same TrainingInfoProto)
- R2  an initialization_binding key is an initializer of M or of A (same TrainingInfoProto)
- R3  an update_binding value is an output of A or of M
- R4  an initialization_binding value is an output of I
- R5  keys are unique in each binding list; update keys unique across TrainingInfoProtos
- R6  I has no inputs, and may be absent only when initialization_binding is empty
- R7  M followed by A is a valid graph: SSA, topologically sorted, no duplicate outputs
- R8  A may read M's values, never the other way round
- R11 a bound value has the element type (and shape) of its state variable

R9 (state starts at initializer values, bindings applied at once) and R10
(inference changes nothing) are the session's business.

The other stages of reading a model live beside this module:
``onnxtrain.io.loading`` (parsing, hostile-file checks), ``onnxtrain.io.tensors``
(the tensor walker and tensor checks), ``onnxtrain.io.storage`` (external data,
writing) and ``onnxtrain.io.combine`` (M ⊕ A).  Their public names are
re-exported here.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import onnx
from onnx import numpy_helper

from ..core.graph import PREVIEW_DOMAIN, infer_types, shape_of_type, subgraphs
from ..core.protos import all_graphs, all_tensors, labelled_sparse_tensors, labelled_tensors
from ..errors import TrainingModelError
from . import mapped
from .combine import combined_graph, copy_graph, uses_preview_ops
from .loading import MAX_PROTO_BYTES, Checked, ModelLike, check_strings, load
from .storage import hold, load_external_data
from .tensors import check_sparse_tensor, check_tensor, check_tensors, data_type_name, memory_limit

__all__ = [
    "MAX_PROTO_BYTES",
    "Checked",
    "ModelLike",
    "StateVar",
    "TrainingModel",
    "all_graphs",
    "all_tensors",
    "check_sparse_tensor",
    "check_strings",
    "check_tensor",
    "check_tensors",
    "check_graph_ssa",
    "combined_graph",
    "copy_graph",
    "labelled_sparse_tensors",
    "labelled_tensors",
    "load",
    "load_external_data",
    "memory_limit",
    "uses_preview_ops",
    "validate",
]


@dataclass(frozen=True)
class StateVar:
    """A state variable: an initializer named as a key by some binding."""

    name: str
    origin: str  # "graph" or "training_info[i].algorithm"
    elem_type: int
    shape: tuple[int, ...]
    sparse: bool = False

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type))


@dataclass
class TrainingModel:
    """A loaded, validated training model and what the session needs of it."""

    proto: onnx.ModelProto
    base_dir: Path | None
    state: dict[str, StateVar] = field(default_factory=dict)
    #: The program cache's key of this model (``onnxtrain.lower.program_cache.model_key``, computed on first use).
    cache_key: bytes | None = field(default=None, repr=False, compare=False)
    #: What that key holds by reference (``program_cache.References``, set with it).
    cache_refs: Any = field(default=None, repr=False, compare=False)

    @property
    def training_info(self):
        return self.proto.training_info

    def initial_value(self, name: str, readonly: bool = False) -> np.ndarray:
        """The initializer value of a state variable (a fresh array).

        ``readonly=True`` skips one copy of the tensor: the array may then be
        read-only (for callers that copy it anyway, such as the state store).
        A mapped tensor (``onnxtrain.io.mapped``) is a fresh array either way
        (see ``fresh_values``): read from a user's file, mapped copy-on-write
        from one of onnxtrain's own (``initial_values``)."""
        return self.initial_values([name], readonly)[name]

    def initial_values(self, names: Iterable[str], readonly: bool = False) -> dict[str, np.ndarray]:
        """``initial_value`` of each of ``names``, each graph searched once.
        A starting value in a file of onnxtrain's own (``storage.hold``) is a
        private map of it (``mapped.private``): its pages are read when first
        touched and copied when first written, so no fresh memory is filled
        at construction."""
        names = list(names)
        wanted: dict[str, dict[str, StateVar]] = {}
        for name in names:
            var = self.state[name]
            wanted.setdefault(var.origin, {})[name] = var
        out: dict[str, np.ndarray] = {}
        for origin, group in wanted.items():
            graph = self._origin_graph(origin)
            if any(v.sparse for v in group.values()):
                for st in graph.sparse_initializer:
                    var = group.get(st.values.name)
                    if var is not None and var.sparse:
                        out[var.name] = _dense(st)
            for t in graph.initializer:
                var = group.get(t.name)
                if var is None or var.sparse:
                    continue
                if mapped.is_mapped(t):
                    out[t.name] = mapped.private(t)  # (read from a file not onnxtrain's own)
                else:
                    value = numpy_helper.to_array(t)
                    out[t.name] = value if readonly else value.copy()
        missing = [n for n in names if n not in out]
        if missing:
            raise KeyError(missing[0])
        return {n: out[n] for n in names}

    def tensor_bytes(self) -> int:
        """Bytes of the initializers of every graph, mapped ones included, and
        of sparse state variables as the dense arrays the session holds."""
        from .storage import tensor_bytes

        sparse = sum(int(np.prod(v.shape, dtype=np.int64)) * v.dtype.itemsize
                     for v in self.state.values() if v.sparse)
        return tensor_bytes(self.proto) + sparse

    def fresh_values(self) -> set[str]:
        """State variables whose ``initial_value`` is always a fresh array the
        caller owns (those of mapped external data, read or mapped
        copy-on-write, and sparse ones)."""
        out = {name for name, var in self.state.items() if var.sparse}
        dense = {(var.origin, name) for name, var in self.state.items() if not var.sparse}
        for origin in {origin for origin, _ in dense}:  # (each graph read once)
            out.update(t.name for t in self._origin_graph(origin).initializer
                       if (origin, t.name) in dense and mapped.is_mapped(t))
        return out

    def _origin_graph(self, origin: str) -> onnx.GraphProto:
        if origin == "graph":
            return self.proto.graph
        index = int(origin[len("training_info[") : origin.index("]")])
        return self.proto.training_info[index].algorithm


#: Zeros of at least this many bytes come from a fresh anonymous map (``_zeros``).
ZEROS_MAPPED_FROM = mapped.MAP_FROM


def _zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A writable array of zeros whose pages the system gives when first
    written (the shared zero page until then): a large one is a fresh
    anonymous map, since ``np.zeros`` (calloc) clears memory it reuses up
    front, which costs a step's worth of page faults at construction (a
    sparse moment's starting zeros).  A private map: a shared one (mmap's
    default) is shared memory, which gets a page of its own for every page
    read, so W6's first step, which only reads its moments' zeros, took
    20 MB more and 5,000 faults (docs/performance.md, round 27)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes < ZEROS_MAPPED_FROM:
        return np.zeros(shape, dtype)
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
    return np.frombuffer(mmap.mmap(-1, nbytes, **private), dtype).reshape(shape)


def _dense(st: onnx.SparseTensorProto) -> np.ndarray:
    values = numpy_helper.to_array(st.values)
    indices = numpy_helper.to_array(st.indices).astype(np.int64)
    shape = tuple(int(d) for d in st.dims)
    out = _zeros(shape, values.dtype)
    if indices.ndim == 1:
        out.reshape(-1)[indices] = values
    else:
        out[tuple(indices.T)] = values
    return out


# ---------------------------------------------------------------- validation
def _initializer_names(g: onnx.GraphProto) -> dict[str, tuple[int, tuple[int, ...], bool]]:
    out = {t.name: (t.data_type, tuple(int(d) for d in t.dims), False) for t in g.initializer}
    for st in g.sparse_initializer:
        out[st.values.name] = (st.values.data_type, tuple(int(d) for d in st.dims), True)
    return out


class _NodePlace:
    """Where a node is (``graph.node[3] ('mm', MatMul)``), as text when asked."""

    __slots__ = ("label", "index", "node")

    def __init__(self, label: str, index: int, node: onnx.NodeProto) -> None:
        self.label, self.index, self.node = label, index, node

    def __str__(self) -> str:
        node = self.node
        return f"{self.label}.node[{self.index}] ({node.name or node.op_type!r}, {node.op_type})"


def check_graph_ssa(
    label: str,
    graph: onnx.GraphProto,
    defined: dict[str, object],
    outer: set[str] = frozenset(),
) -> None:
    """Inputs defined before use (topological order), each name defined once
    (SSA), no GraphCall; subgraphs too.  TrainingModelError names the first
    place that breaks a rule (validation's R7; the passes' postcondition,
    ``lower.checks``).

    ``outer``: names defined outside ``graph`` (an enclosing scope).
    ``defined`` maps names already defined (by this or an earlier graph) to
    where they were defined (text, or an object whose ``str`` is), and is
    extended with this graph's names."""
    for kind, names in (
        ("input", [i.name for i in graph.input]),
        ("initializer", [t.name for t in graph.initializer]),
        ("sparse_initializer", [t.values.name for t in graph.sparse_initializer]),
    ):
        for idx, name in enumerate(names):
            if not name:
                raise TrainingModelError(f"{label}.{kind}[{idx}]: empty name")
            ir3_style = kind == "initializer" and defined.get(name) == f"{label}.input"
            if name in defined and not ir3_style:
                raise TrainingModelError(
                    f"{label}.{kind}[{idx}]: name {name!r} is already defined by {defined[name]}"
                )
            defined.setdefault(name, f"{label}.{kind}")
    for idx, node in enumerate(graph.node):
        # (where the node is, as text, only when a message needs it: this runs
        # after every pass of every program, so it is kept lean)
        place = _NodePlace(label, idx, node)
        if node.op_type == "GraphCall":
            raise TrainingModelError(
                f"{place}: GraphCall (ONNX 1.7 training) was removed in ONNX 1.8 and is not "
                "supported; express the step as a TrainingInfoProto algorithm graph"
            )
        for name in node.input:
            if name and name not in defined and name not in outer:
                raise TrainingModelError(
                    f"{place}: input {name!r} is not defined before this node "
                    "(undefined, or the graph is not topologically sorted)"
                )
        if node.attribute:
            for sg in subgraphs(node):
                check_graph_ssa(f"{place}/{sg.name or 'body'}", sg, {}, outer | set(defined))
        for name in node.output:
            if not name:
                continue
            if name in defined:
                raise TrainingModelError(
                    f"{place}: output {name!r} is already defined by {defined[name]} (graphs must be SSA)"
                )
            defined[name] = place
    seen: set[str] = set()
    for idx, o in enumerate(graph.output):
        if o.name in seen:
            raise TrainingModelError(f"{label}.output[{idx}]: duplicate output {o.name!r}")
        seen.add(o.name)
        if o.name not in defined and o.name not in outer:
            raise TrainingModelError(
                f"{label}.output[{idx}]: output {o.name!r} is produced by no node, input or initializer"
            )


def _check_attribute_text(proto: onnx.ModelProto) -> None:
    """String attributes of standard and training ops are UTF-8 text.

    AttributeProto keeps strings as bytes; onnxtrain decodes those of ONNX
    and ai.onnx.preview.training ops (Gradient's xs/zs/y, modes, ...), so a
    stray byte must be an error that says where, not a UnicodeDecodeError."""
    for label, g in all_graphs(proto):
        for i, n in enumerate(g.node):
            if n.domain not in ("", "ai.onnx", PREVIEW_DOMAIN):
                continue
            for a in n.attribute:
                for value in [a.s, *a.strings]:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise TrainingModelError(
                            f"{label}.node[{i}] ({n.name or n.op_type!r}, {n.op_type}).{a.name}: "
                            f"attribute string {value[:32]!r} is not UTF-8 text ({exc.reason})"
                        ) from None


def validate(
    proto: onnx.ModelProto, base_dir: Path | None = None, tensors_checked: bool = False
) -> TrainingModel:
    """Check every spec rule and return the TrainingModel (raises TrainingModelError).

    ``tensors_checked=True`` skips re-measuring every tensor's data, for a
    proto that ``load`` just returned (it checks them): a pass over the
    weights saved."""
    if not tensors_checked:
        check_tensors(proto)
    _check_attribute_text(proto)
    _check_ir_version(proto)
    main = proto.graph
    main_defined: dict[str, object] = {}
    check_graph_ssa("graph", main, main_defined)
    main_inits = _initializer_names(main)
    main_outputs = {o.name for o in main.output}

    state: dict[str, StateVar] = {}
    update_keys: dict[str, str] = {}
    for i, ti in enumerate(proto.training_info):
        label = f"training_info[{i}]"
        _check_algorithm(label, ti.algorithm, main_outputs, main_defined)
        _check_initialization(label, ti)
        inits = (main_inits, _initializer_names(ti.algorithm))
        algo_outputs = {o.name for o in ti.algorithm.output}
        init_outputs = {o.name for o in ti.initialization.output}
        for field_name, binding, values in (
            ("update_binding", ti.update_binding,
             (algo_outputs | main_outputs, f"an output of {label}.algorithm or of the main graph")),
            ("initialization_binding", ti.initialization_binding,
             (init_outputs, f"an output of {label}.initialization")),
        ):
            _check_binding(label, field_name, binding, values, inits, update_keys, state)

    model = TrainingModel(proto, base_dir, state)
    _check_binding_types(model)
    return model


def _check_ir_version(proto: onnx.ModelProto) -> None:
    """The model's ir_version is new enough for ONNX, and for training_info if it has any."""
    if proto.ir_version and proto.ir_version < 3:
        raise TrainingModelError(f"ir_version {proto.ir_version} is too old (need >= 3)")
    if proto.training_info and proto.ir_version and proto.ir_version < 7:
        raise TrainingModelError(
            f"training_info needs ir_version >= 7, the model has {proto.ir_version}"
        )


def _check_algorithm(
    label: str, algo: onnx.GraphProto, main_outputs: set[str], main_defined: dict[str, object]
) -> None:
    """R7 / R8: the combined graph M ⊕ A is SSA and sorted; A may read M, not the reverse."""
    combined_defined = dict(main_defined)
    for idx, o in enumerate(algo.output):
        if o.name in main_outputs:
            raise TrainingModelError(
                f"{label}.algorithm.output[{idx}]: {o.name!r} is also an output of the main "
                "graph; the combined graph would list it twice"
            )
    check_graph_ssa(f"{label}.algorithm", algo, combined_defined)


def _check_initialization(label: str, ti: onnx.TrainingInfoProto) -> None:
    """R6: the initialization graph takes no inputs, and is absent only with no initialization_binding."""
    if ti.HasField("initialization"):
        for idx, inp in enumerate(ti.initialization.input):
            raise TrainingModelError(
                f"{label}.initialization.input[{idx}]: {inp.name!r}: an initialization graph "
                "takes no inputs"
            )
        check_graph_ssa(f"{label}.initialization", ti.initialization, {})
    elif ti.initialization_binding:
        raise TrainingModelError(
            f"{label}.initialization_binding[0]: there is no initialization graph, so "
            "initialization_binding must be empty"
        )


def _bound_initializer(where: str, label: str, key: str, inits: tuple[dict, dict]) -> tuple[str, tuple]:
    """R1 / R2: the graph a binding key's initializer is in (main first), and its (type, shape, sparse)."""
    main_inits, algo_inits = inits
    if key in main_inits:
        return "graph", main_inits[key]
    if key in algo_inits:
        return f"{label}.algorithm", algo_inits[key]
    raise TrainingModelError(
        f"{where}: key {key!r} is not an initializer of the main graph or of {label}.algorithm"
    )


def _check_binding(
    label: str,
    field_name: str,
    binding,
    values: tuple[set[str], str],
    inits: tuple[dict, dict],
    update_keys: dict[str, str],
    state: dict[str, StateVar],
) -> None:
    """R1-R5 for one binding list, each entry's state variable recorded in ``state``."""
    values_ok, value_desc = values
    seen: set[str] = set()
    for idx, entry in enumerate(binding):
        where = f"{label}.{field_name}[{idx}]"
        key, value = entry.key, entry.value
        origin, info = _bound_initializer(where, label, key, inits)
        # R5
        if key in seen:
            raise TrainingModelError(f"{where}: key {key!r} appears twice in {field_name}")
        seen.add(key)
        if field_name == "update_binding":
            if key in update_keys:
                raise TrainingModelError(
                    f"{where}: key {key!r} is already updated by {update_keys[key]}; "
                    "update_binding keys must be unique across all TrainingInfoProtos"
                )
            update_keys[key] = where
        # R3 / R4
        if value not in values_ok:
            raise TrainingModelError(f"{where}: value {value!r} is not {value_desc}")
        elem, shape, sparse = info
        prev = state.get(key)
        if prev is not None and prev.origin != origin:
            raise TrainingModelError(
                f"{where}: key {key!r} names initializers of both {prev.origin} and {origin}"
            )
        state[key] = StateVar(key, origin, elem, shape, sparse)


def _check_binding_types(model: TrainingModel) -> None:
    """R11, statically where shape inference knows the bound value's type."""
    proto = model.proto
    for i, ti in enumerate(proto.training_info):
        label = f"training_info[{i}]"
        checks = []
        if ti.update_binding:
            declared = {o.name: o.type for g in (proto.graph, ti.algorithm) for o in g.output}
            checks.append(("update_binding", ti.update_binding, declared, lambda i=i: _combined_types(proto, i)))
        if ti.initialization_binding:
            init = ti.initialization
            checks.append(("initialization_binding", ti.initialization_binding,
                           {o.name: o.type for o in init.output},
                           lambda init=init: infer_types(init, proto.opset_import)))
        for field_name, binding, declared, inferred in checks:
            # Values declared with their element type and shape need no inference.
            if all(_full_type(declared.get(e.value), model.state[e.key]) for e in binding):
                dtypes, shapes = {}, {}
            else:
                dtypes, shapes = inferred()
            for idx, entry in enumerate(binding):
                var = model.state[entry.key]
                et = dtypes.get(entry.value)
                tp = declared.get(entry.value)
                if tp is not None and tp.HasField("tensor_type") and tp.tensor_type.elem_type:
                    et = tp.tensor_type.elem_type
                if et and et != var.elem_type:
                    raise TrainingModelError(
                        f"{label}.{field_name}[{idx}]: value {entry.value!r} has element type "
                        f"{data_type_name(et)}, but state variable "
                        f"{entry.key!r} is {data_type_name(var.elem_type)}"
                    )
                shape = shapes.get(entry.value)
                if tp is not None:
                    shape = shape_of_type(tp) or shape
                if shape is not None and all(isinstance(d, int) for d in shape):
                    if tuple(shape) != var.shape:
                        raise TrainingModelError(
                            f"{label}.{field_name}[{idx}]: value {entry.value!r} has shape "
                            f"{list(shape)}, but state variable {entry.key!r} has shape {list(var.shape)}"
                        )


def _full_type(tp: onnx.TypeProto | None, var: StateVar) -> bool:
    """A declared tensor type that says all the check reads: its element type
    and its shape.  A declared scalar counts only for a scalar variable (for
    any other the check goes through inference, as it always did; for a
    scalar, inference could only show the declaration wrong, which the
    run shows as well)."""
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.elem_type:
        return False
    tt = tp.tensor_type
    return tt.HasField("shape") and (len(tt.shape.dim) > 0 or var.shape == ())


def _combined_types(proto: onnx.ModelProto, index: int) -> tuple[dict, dict]:
    """``infer_types`` of main ⊕ algorithm ``index``, without copying weights."""
    drop, stand_ins = _data_free_initializers(proto.graph, proto.training_info[index].algorithm)
    combined = combined_graph(proto, index, exclude_initializers=drop)
    combined.initializer.extend(stand_ins)
    return infer_types(combined, proto.opset_import)


def _data_free_initializers(*graphs: onnx.GraphProto) -> tuple[set[str], list[onnx.TensorProto]]:
    """Initializers whose data shape inference does not need, and stand-ins for them.

    Inference needs only the names, types and dims of initializers, except
    1-D integer tensors (shapes, axes), whose values it propagates.  Returns
    (names to leave out of a graph copy, data-free TensorProtos to put there
    instead), so that validating a large model never copies its weights."""
    names: set[str] = set()
    stand_ins: list[onnx.TensorProto] = []
    for g in graphs:
        for t in g.initializer:
            if t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and len(t.dims) <= 1:
                continue
            names.add(t.name)
            stand_ins.append(onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims))
    return names, stand_ins


def held(tm: TrainingModel) -> TrainingModel:
    """``tm`` with no large tensor left in its protobuf (``storage.hold``): its
    frozen weights in one shared-memory buffer that every program and
    onnxruntime map, its starting values in a file the state store maps
    copy-on-write (issue 36: the weights held once). ``tm`` itself where nothing moves."""
    proto = hold(tm.proto, tm.state)
    return tm if proto is None else replace(tm, proto=proto, cache_key=None, cache_refs=None)
