"""Load a training model, check it against the spec, and list its state.

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

>>> import onnx
>>> load(b"not a model")
Traceback (most recent call last):
...
onnxtrain.errors.TrainingModelError: cannot parse the model: ...
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from .errors import TrainingModelError
from .graph import PREVIEW_DOMAIN, infer_types, shape_of_type, subgraphs

ModelLike = str | os.PathLike | bytes | onnx.ModelProto


# ---------------------------------------------------------------------- load
def load(model: ModelLike) -> tuple[onnx.ModelProto, Path | None]:
    """Parse a model from a path, bytes or a ModelProto (never modified).

    External data of every graph (main, training_info, subgraphs) is read here,
    relative to the model's folder, and may not point outside it."""
    if isinstance(model, onnx.ModelProto):
        base = None
        proto = model
        if _has_external(proto):
            raise TrainingModelError(
                "the ModelProto refers to external data; pass its path instead so "
                "the data can be found"
            )
        return proto, base
    if isinstance(model, (bytes, bytearray, memoryview)):
        data = bytes(model)
        base = None
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise TrainingModelError(f"cannot read model file {str(path)!r}: {exc}") from exc
        base = path.resolve().parent
    else:
        raise TypeError(
            f"model must be a path, bytes or onnx.ModelProto, not {type(model).__name__}"
        )
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise TrainingModelError(f"cannot parse the model: {exc}") from exc
    if not proto.HasField("graph"):
        raise TrainingModelError(
            "cannot parse the model: no main graph (is this an ONNX ModelProto?)"
        )
    if _has_external(proto):
        if base is None:
            raise TrainingModelError(
                "the model refers to external data; load it from its path so the data can be found"
            )
        load_external_data(proto, base)
    return proto, base


def all_graphs(model: onnx.ModelProto) -> list[tuple[str, onnx.GraphProto]]:
    """Every graph of a model with a label: main, training_info ones, subgraphs."""
    out: list[tuple[str, onnx.GraphProto]] = [("graph", model.graph)]
    for i, ti in enumerate(model.training_info):
        if ti.HasField("initialization"):
            out.append((f"training_info[{i}].initialization", ti.initialization))
        if ti.HasField("algorithm"):
            out.append((f"training_info[{i}].algorithm", ti.algorithm))
    stack = list(out)
    while stack:
        label, g = stack.pop()
        for n in g.node:
            for sg in subgraphs(n):
                item = (f"{label}/{n.name or n.op_type}", sg)
                out.append(item)
                stack.append(item)
    return out


def all_tensors(model: onnx.ModelProto) -> Iterable[onnx.TensorProto]:
    """Every TensorProto a model holds: initializers, sparse values, attributes."""
    for _, g in all_graphs(model):
        yield from g.initializer
        for st in g.sparse_initializer:
            yield st.values
            yield st.indices
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield a.t
                elif a.type == onnx.AttributeProto.TENSORS:
                    yield from a.tensors


def _has_external(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in all_tensors(model))


def load_external_data(model: onnx.ModelProto, base: Path) -> None:
    """Read external tensor data into the model (in place), refusing locations
    that escape ``base`` and ranges past the end of the file."""
    root = base.resolve()
    for t in all_tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        where = f"tensor {t.name!r}"
        location = info.get("location", "")
        if not location:
            raise TrainingModelError(f"{where}: external data without a location")
        if os.path.isabs(location) or location.startswith(("/", "\\")):
            raise TrainingModelError(f"{where}: external data location {location!r} is absolute")
        target = (root / location).resolve()
        if target != root and root not in target.parents:
            raise TrainingModelError(
                f"{where}: external data location {location!r} points outside the model's folder"
            )
        try:
            size = target.stat().st_size
            offset = int(info.get("offset", 0) or 0)
            length = int(info["length"]) if info.get("length") else size - offset
        except (OSError, ValueError) as exc:
            raise TrainingModelError(f"{where}: bad external data {location!r}: {exc}") from exc
        if offset < 0 or length < 0 or offset + length > size:
            raise TrainingModelError(
                f"{where}: external data range [{offset}, {offset + length}) lies past the end "
                f"of {location!r} ({size} bytes)"
            )
        expected = _numel(t.dims) * _itemsize(t.data_type)
        if expected is not None and expected != length:
            raise TrainingModelError(
                f"{where}: external data holds {length} bytes, its dims need {expected}"
            )
        with open(target, "rb") as f:
            f.seek(offset)
            t.raw_data = f.read(length)
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT


def _numel(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _itemsize(data_type: int) -> int | None:
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return None


# --------------------------------------------------------------------- state
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

    @property
    def training_info(self):
        return self.proto.training_info

    def initial_value(self, name: str) -> np.ndarray:
        """The initializer value of a state variable (a fresh array)."""
        var = self.state[name]
        graph = self._origin_graph(var.origin)
        if var.sparse:
            for st in graph.sparse_initializer:
                if st.values.name == name:
                    return _dense(st)
        for t in graph.initializer:
            if t.name == name:
                return numpy_helper.to_array(t).copy()
        raise KeyError(name)

    def _origin_graph(self, origin: str) -> onnx.GraphProto:
        if origin == "graph":
            return self.proto.graph
        index = int(origin[len("training_info[") : origin.index("]")])
        return self.proto.training_info[index].algorithm


def _dense(st: onnx.SparseTensorProto) -> np.ndarray:
    values = numpy_helper.to_array(st.values)
    indices = numpy_helper.to_array(st.indices).astype(np.int64)
    shape = tuple(int(d) for d in st.dims)
    out = np.zeros(shape, dtype=values.dtype)
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


def _check_graph_ssa(
    label: str,
    graph: onnx.GraphProto,
    defined: dict[str, str],
    outer: set[str] = frozenset(),
) -> None:
    """Inputs defined before use, each name defined once, no GraphCall.

    ``defined`` maps names already defined (by this or an earlier graph) to
    where they were defined, and is extended with this graph's names."""
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
        where = f"{label}.node[{idx}] ({node.name or node.op_type!r}, {node.op_type})"
        if node.op_type == "GraphCall":
            raise TrainingModelError(
                f"{where}: GraphCall (ONNX 1.7 training) was removed in ONNX 1.8 and is not "
                "supported; express the step as a TrainingInfoProto algorithm graph"
            )
        for name in node.input:
            if name and name not in defined and name not in outer:
                raise TrainingModelError(
                    f"{where}: input {name!r} is not defined before this node "
                    "(undefined, or the graph is not topologically sorted)"
                )
        for sg in subgraphs(node):
            _check_graph_ssa(f"{where}/{sg.name or 'body'}", sg, {}, outer | set(defined))
        seen_out: set[str] = set()
        for name in node.output:
            if not name:
                continue
            if name in defined or name in seen_out:
                prev = defined.get(name, where)
                raise TrainingModelError(
                    f"{where}: output {name!r} is already defined by {prev} (graphs must be SSA)"
                )
            seen_out.add(name)
            defined[name] = where
    seen: set[str] = set()
    for idx, o in enumerate(graph.output):
        if o.name in seen:
            raise TrainingModelError(f"{label}.output[{idx}]: duplicate output {o.name!r}")
        seen.add(o.name)
        if o.name not in defined and o.name not in outer:
            raise TrainingModelError(
                f"{label}.output[{idx}]: output {o.name!r} is produced by no node, input or initializer"
            )


def validate(proto: onnx.ModelProto, base_dir: Path | None = None) -> TrainingModel:
    """Check every spec rule and return the TrainingModel (raises TrainingModelError)."""
    if proto.ir_version and proto.ir_version < 3:
        raise TrainingModelError(f"ir_version {proto.ir_version} is too old (need >= 3)")
    if proto.training_info and proto.ir_version and proto.ir_version < 7:
        raise TrainingModelError(
            f"training_info needs ir_version >= 7, the model has {proto.ir_version}"
        )
    main = proto.graph
    main_defined: dict[str, str] = {}
    _check_graph_ssa("graph", main, main_defined)
    main_inits = _initializer_names(main)
    main_outputs = {o.name for o in main.output}

    state: dict[str, StateVar] = {}
    update_keys: dict[str, str] = {}
    for i, ti in enumerate(proto.training_info):
        label = f"training_info[{i}]"
        algo = ti.algorithm
        # R7 / R8: the combined graph M ⊕ A is SSA and sorted; A may read M, not the reverse.
        combined_defined = dict(main_defined)
        main_output_names = {o.name for o in main.output}
        for idx, o in enumerate(algo.output):
            if o.name in main_output_names:
                raise TrainingModelError(
                    f"{label}.algorithm.output[{idx}]: {o.name!r} is also an output of the main "
                    "graph; the combined graph would list it twice"
                )
        _check_graph_ssa(f"{label}.algorithm", algo, combined_defined)
        algo_inits = _initializer_names(algo)
        algo_outputs = {o.name for o in algo.output}

        # R6
        init = ti.initialization
        if ti.HasField("initialization"):
            for idx, inp in enumerate(init.input):
                raise TrainingModelError(
                    f"{label}.initialization.input[{idx}]: {inp.name!r}: an initialization graph "
                    "takes no inputs"
                )
            _check_graph_ssa(f"{label}.initialization", init, {})
        elif ti.initialization_binding:
            raise TrainingModelError(
                f"{label}.initialization_binding[0]: there is no initialization graph, so "
                "initialization_binding must be empty"
            )
        init_outputs = {o.name for o in init.output}

        for field_name, binding, values_ok, value_desc in (
            ("update_binding", ti.update_binding, algo_outputs | main_outputs,
             f"an output of {label}.algorithm or of the main graph"),
            ("initialization_binding", ti.initialization_binding, init_outputs,
             f"an output of {label}.initialization"),
        ):
            seen: set[str] = set()
            for idx, entry in enumerate(binding):
                where = f"{label}.{field_name}[{idx}]"
                key, value = entry.key, entry.value
                # R1 / R2
                if key in main_inits:
                    origin, info = "graph", main_inits[key]
                elif key in algo_inits:
                    origin, info = f"{label}.algorithm", algo_inits[key]
                else:
                    raise TrainingModelError(
                        f"{where}: key {key!r} is not an initializer of the main graph or of "
                        f"{label}.algorithm"
                    )
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

    model = TrainingModel(proto, base_dir, state)
    _check_binding_types(model)
    return model


def _check_binding_types(model: TrainingModel) -> None:
    """R11, statically where shape inference knows the bound value's type."""
    proto = model.proto
    for i, ti in enumerate(proto.training_info):
        label = f"training_info[{i}]"
        checks = []
        if ti.update_binding:
            combined = combined_graph(proto, i)
            checks.append(("update_binding", ti.update_binding, combined))
        if ti.initialization_binding:
            checks.append(("initialization_binding", ti.initialization_binding, ti.initialization))
        for field_name, binding, graph in checks:
            declared = {o.name: o.type for o in graph.output}
            dtypes, shapes = infer_types(graph, proto.opset_import)
            for idx, entry in enumerate(binding):
                var = model.state[entry.key]
                et = dtypes.get(entry.value)
                tp = declared.get(entry.value)
                if tp is not None and tp.HasField("tensor_type") and tp.tensor_type.elem_type:
                    et = tp.tensor_type.elem_type
                if et and et != var.elem_type:
                    raise TrainingModelError(
                        f"{label}.{field_name}[{idx}]: value {entry.value!r} has element type "
                        f"{_type_name(et)}, but state variable "
                        f"{entry.key!r} is {_type_name(var.elem_type)}"
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


def _type_name(elem_type: int) -> str:
    return onnx.TensorProto.DataType.Name(elem_type)


def combined_graph(proto: onnx.ModelProto, index: int) -> onnx.GraphProto:
    """M ⊕ A of training_info[index]: every list concatenated, main graph first."""
    main = proto.graph
    algo = proto.training_info[index].algorithm
    g = onnx.GraphProto()
    g.name = f"{main.name or 'main'}+training_info[{index}]"
    for fld in ("input", "initializer", "output", "node", "value_info", "sparse_initializer"):
        getattr(g, fld).extend(getattr(main, fld))
        getattr(g, fld).extend(getattr(algo, fld))
    return g


def uses_preview_ops(graph: onnx.GraphProto) -> bool:
    """Whether a graph (or a subgraph of it) has an ai.onnx.preview.training node."""
    for n in graph.node:
        if n.domain == PREVIEW_DOMAIN:
            return True
        if any(uses_preview_ops(sg) for sg in subgraphs(n)):
            return True
    return False
