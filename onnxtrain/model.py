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

Loading also refuses hostile files with a message that says what is wrong:
unparsable bytes, other ONNX messages, tensor data that does not match its
dims (checked before anything is allocated), external data outside the
model's folder, strings that are not UTF-8.

>>> load(b"not a model")
Traceback (most recent call last):
...
onnxtrain.errors.TrainingModelError: cannot parse the model (11 bytes): not a valid ONNX ModelProto: ...
>>> t = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[2**40, 2**40])
>>> check_tensor(t, "graph.initializer[0]")
Traceback (most recent call last):
...
onnxtrain.errors.TrainingModelError: graph.initializer[0]: float_data holds 0 values, but dims [1099511627776, 1099511627776] of FLOAT need 1208925819614629174706176
"""

from __future__ import annotations

import os
import stat
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PureWindowsPath

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, EncodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from onnx import numpy_helper

from .errors import TrainingModelError
from .graph import PREVIEW_DOMAIN, infer_types, shape_of_type, subgraphs

ModelLike = str | os.PathLike | bytes | onnx.ModelProto


# ---------------------------------------------------------------------- load
#: protobuf cannot parse a message of 2 GiB or more; larger models keep their
#: tensors in external data files.
MAX_PROTO_BYTES = 2**31 - 1

#: Other messages a file is often mistaken for: (type, a field that marks it).
_LOOKALIKES = (
    (onnx.GraphProto, ("node", "initializer", "input", "output")),
    (onnx.NodeProto, ("op_type",)),
    (onnx.TensorProto, ("dims", "raw_data", "float_data", "int64_data", "int32_data")),
    (onnx.TrainingInfoProto, ("algorithm", "initialization", "update_binding")),
    (onnx.FunctionProto, ("node", "domain")),
)


def load(model: ModelLike) -> tuple[onnx.ModelProto, Path | None]:
    """Parse a model from a path, bytes or a ModelProto (never modified).

    External data of every graph (main, training_info, subgraphs) is read here,
    relative to the model's folder, and may not point outside it.  Every
    tensor's stored data must match its dims and type (checked before any
    value is materialized), so a hostile file gives a TrainingModelError,
    never a MemoryError or a crash."""
    if isinstance(model, onnx.ModelProto):
        base = None
        proto = model
        if _has_external(proto):
            raise TrainingModelError(
                "the ModelProto refers to external data; pass its path instead so "
                "the data can be found"
            )
        check_strings(proto)
        check_tensors(proto)
        return proto, base
    if isinstance(model, (bytes, bytearray, memoryview)):
        data = bytes(model)
        base = None
        source = f"{len(data)} bytes"
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model)
        data = _read_model_file(path)
        base = path.resolve().parent
        source = f"file {str(path)!r}"
    else:
        raise TypeError(
            f"model must be a path, bytes or onnx.ModelProto, not {type(model).__name__}"
        )
    proto = _parse_model(data, source)
    del data
    check_strings(proto)
    if _has_external(proto):
        if base is None:
            raise TrainingModelError(
                "the model refers to external data; load it from its path so the data can be found"
            )
        filled = load_external_data(proto, base)
    else:
        filled = []
    check_tensors(proto, skip=filled)
    return proto, base


def _read_model_file(path: Path) -> bytes:
    """The bytes of a model file: a regular file under protobuf's 2 GiB limit."""
    try:
        st = path.stat()
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise TrainingModelError(f"cannot read model file {str(path)!r}: {exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise TrainingModelError(f"model file {str(path)!r} is not a regular file")
    if st.st_size > MAX_PROTO_BYTES:
        raise TrainingModelError(
            f"model file {str(path)!r} is {st.st_size} bytes; protobuf cannot parse 2 GiB or "
            "more, so models this large must keep their tensors in external data"
        )
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TrainingModelError(f"cannot read model file {str(path)!r}: {exc}") from exc


def _parse_model(data: bytes, source: str) -> onnx.ModelProto:
    """ModelProto.ParseFromString with errors that say what the bytes look like."""
    proto = onnx.ModelProto()
    if len(data) > MAX_PROTO_BYTES:
        raise TrainingModelError(
            f"cannot parse the model ({source}): {len(data)} bytes is over protobuf's 2 GiB limit"
        )
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise TrainingModelError(
            f"cannot parse the model ({source}): not a valid ONNX ModelProto: "
            f"{exc}{_lookalike(data)}"
        ) from exc
    if not proto.HasField("graph"):
        raise TrainingModelError(
            f"cannot parse the model ({source}): it has no main graph, so it is not an ONNX "
            f"ModelProto{_lookalike(data)}"
        )
    return proto


def _lookalike(data: bytes) -> str:
    """'; the data parses as an onnx.X, ...' if the bytes are cleanly another ONNX message."""
    if not data or len(data) > 64 * 2**20:
        return ""
    for cls, marks in _LOOKALIKES:
        msg = cls()
        try:
            msg.ParseFromString(data)
        except (DecodeError, RuntimeError, ValueError):
            continue
        if len(UnknownFieldSet(msg)) or not any(_is_set(msg, m) for m in marks):
            continue
        if msg.SerializeToString() != data:
            continue
        return f"; the data parses as an onnx.{cls.__name__}, not an onnx.ModelProto"
    return ""


def _is_set(msg, name: str) -> bool:
    value = getattr(msg, name)
    if isinstance(value, (str, bytes)):
        return bool(value)
    try:
        return len(value) > 0
    except TypeError:
        return msg.HasField(name)


def check_strings(message, path: str = "model") -> None:
    """Every string field holds valid UTF-8.

    proto2 does not check when parsing: for a bad string, protobuf's getter
    returns ``bytes`` instead of ``str`` (or raises, depending on the
    protobuf build), and the failure surfaces later, wherever the value is
    first used.  Here it is found at load, with the field's path."""
    for fd in message.DESCRIPTOR.fields:
        if fd.type == FieldDescriptor.TYPE_STRING:
            try:
                value = getattr(message, fd.name)
                values = list(value) if _is_repeated(fd) else [value]
                bad = next((v for v in values if not isinstance(v, str)), None)
            except UnicodeDecodeError as exc:
                bad = exc.object
            if bad is not None:
                raise TrainingModelError(
                    f"{path}.{fd.name}: {bytes(bad)[:32]!r} is not valid UTF-8"
                )
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            if _is_repeated(fd):
                for i, sub in enumerate(getattr(message, fd.name)):
                    check_strings(sub, f"{path}.{fd.name}[{i}]")
            elif message.HasField(fd.name):
                check_strings(getattr(message, fd.name), f"{path}.{fd.name}")


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
    for _, t in labelled_tensors(model):
        yield t


def labelled_tensors(model: onnx.ModelProto) -> Iterable[tuple[str, onnx.TensorProto]]:
    """Every TensorProto of a model with where it is, for error messages."""
    for label, g in all_graphs(model):
        for i, t in enumerate(g.initializer):
            yield f"{label}.initializer[{i}] ({t.name!r})", t
        for i, st in enumerate(g.sparse_initializer):
            yield f"{label}.sparse_initializer[{i}].values ({st.values.name!r})", st.values
            yield f"{label}.sparse_initializer[{i}].indices ({st.values.name!r})", st.indices
        for where, a in _node_attributes(label, g):
            if a.type == onnx.AttributeProto.TENSOR:
                yield where, a.t
            elif a.type == onnx.AttributeProto.TENSORS:
                for j, t in enumerate(a.tensors):
                    yield f"{where}[{j}]", t
            elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
                yield f"{where}.values", a.sparse_tensor.values
                yield f"{where}.indices", a.sparse_tensor.indices
            elif a.type == onnx.AttributeProto.SPARSE_TENSORS:
                for j, st in enumerate(a.sparse_tensors):
                    yield f"{where}[{j}].values", st.values
                    yield f"{where}[{j}].indices", st.indices


def labelled_sparse_tensors(
    model: onnx.ModelProto,
) -> Iterable[tuple[str, onnx.SparseTensorProto]]:
    """Every SparseTensorProto: sparse initializers and sparse attributes."""
    for label, g in all_graphs(model):
        for i, st in enumerate(g.sparse_initializer):
            yield f"{label}.sparse_initializer[{i}] ({st.values.name!r})", st
        for where, a in _node_attributes(label, g):
            if a.type == onnx.AttributeProto.SPARSE_TENSOR:
                yield where, a.sparse_tensor
            elif a.type == onnx.AttributeProto.SPARSE_TENSORS:
                for j, st in enumerate(a.sparse_tensors):
                    yield f"{where}[{j}]", st


def _node_attributes(label: str, g: onnx.GraphProto):
    for i, n in enumerate(g.node):
        for a in n.attribute:
            yield f"{label}.node[{i}] ({n.name or n.op_type!r}).{a.name}", a


def _has_external(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in all_tensors(model))


def load_external_data(model: onnx.ModelProto, base: Path) -> list[onnx.TensorProto]:
    """Read external tensor data into the model (in place).

    Every location is checked before any byte is read: it must be relative,
    stay inside ``base`` once symlinks are resolved, name a regular file, and
    its [offset, offset + length) range must lie inside that file and hold
    exactly the bytes the tensor's dims and type need.  The total must fit in
    this machine's memory.  Then each tensor is read straight into the model
    (one read per tensor).  Returns the tensors it filled (their data length
    is checked already)."""
    root = base.resolve()
    plan: list[tuple[onnx.TensorProto, Path, int, int]] = []
    for where, t in labelled_tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        plan.append((t, *_external_range(t, where, root)))
    total = sum(length for _, _, _, length in plan)
    limit = memory_limit()
    if total > limit:
        raise TrainingModelError(
            f"the model's external data adds up to {total} bytes, more than this machine's "
            f"memory ({limit} bytes)"
        )
    for t, target, offset, length in plan:
        with open(target, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise TrainingModelError(
                f"tensor {t.name!r}: external data file {target.name!r} ended after "
                f"{len(data)} of {length} bytes (was it truncated while loading?)"
            )
        t.raw_data = data
        del data
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
    return [t for t, _, _, _ in plan]


def _external_range(t: onnx.TensorProto, where: str, root: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor, after every safety check."""
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location", "")
    if not location:
        raise TrainingModelError(f"{where}: external data without a location")
    if "\x00" in location:
        raise TrainingModelError(f"{where}: external data location {location!r} has a NUL byte")
    if (
        os.path.isabs(location)
        or location.startswith(("/", "\\"))
        or PureWindowsPath(location).drive
    ):
        raise TrainingModelError(f"{where}: external data location {location!r} is absolute")
    if t.data_type == onnx.TensorProto.STRING:
        raise TrainingModelError(f"{where}: a STRING tensor cannot be stored as external data")
    try:
        target = (root / location).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a symlink loop
        raise TrainingModelError(f"{where}: bad external data location {location!r}: {exc}") from exc
    if root not in target.parents:
        raise TrainingModelError(
            f"{where}: external data location {location!r} points outside the model's folder"
        )
    try:
        st = target.stat()
    except OSError as exc:
        raise TrainingModelError(f"{where}: cannot read external data {location!r}: {exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise TrainingModelError(f"{where}: external data {location!r} is not a regular file")
    size = st.st_size
    try:
        offset = int(info.get("offset") or 0)
        length = int(info["length"]) if info.get("length") else size - offset
    except ValueError as exc:
        raise TrainingModelError(f"{where}: bad external data offset or length: {exc}") from exc
    if offset < 0 or length < 0 or offset + length > size:
        raise TrainingModelError(
            f"{where}: external data range [{offset}, {offset + length}) lies past the end "
            f"of {location!r} ({size} bytes)"
        )
    _check_dims(t, where)
    expected = _raw_bytes(t.data_type, _numel(t.dims))
    if expected is None:
        raise TrainingModelError(f"{where}: {_data_type_name(t.data_type)} cannot be external data")
    if expected != length:
        raise TrainingModelError(
            f"{where}: external data holds {length} bytes, but dims {list(t.dims)} of "
            f"{_data_type_name(t.data_type)} need {expected}"
        )
    return target, offset, length


def memory_limit() -> int:
    """Bytes of physical memory: no tensor or total may claim more."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**40


# ------------------------------------------------------------ tensor checks
_T = onnx.TensorProto
#: data_type -> (bits per element, the typed field holding values without raw_data,
#: typed entries per element).  Types below 8 bits pack their values into bytes,
#: one byte per typed entry.
_STORAGE: dict[int, tuple[int, str, int]] = {
    _T.FLOAT: (32, "float_data", 1),
    _T.UINT8: (8, "int32_data", 1),
    _T.INT8: (8, "int32_data", 1),
    _T.UINT16: (16, "int32_data", 1),
    _T.INT16: (16, "int32_data", 1),
    _T.INT32: (32, "int32_data", 1),
    _T.INT64: (64, "int64_data", 1),
    _T.BOOL: (8, "int32_data", 1),
    _T.FLOAT16: (16, "int32_data", 1),
    _T.DOUBLE: (64, "double_data", 1),
    _T.UINT32: (32, "uint64_data", 1),
    _T.UINT64: (64, "uint64_data", 1),
    _T.COMPLEX64: (64, "float_data", 2),
    _T.COMPLEX128: (128, "double_data", 2),
    _T.BFLOAT16: (16, "int32_data", 1),
}
for _name, _bits in (
    ("FLOAT8E4M3FN", 8), ("FLOAT8E4M3FNUZ", 8), ("FLOAT8E5M2", 8), ("FLOAT8E5M2FNUZ", 8),
    ("FLOAT8E8M0", 8), ("UINT4", 4), ("INT4", 4), ("FLOAT4E2M1", 4), ("UINT2", 2), ("INT2", 2),
):
    if _name in _T.DataType.keys():
        _STORAGE[_T.DataType.Value(_name)] = (_bits, "int32_data", 1)
_TYPED_FIELDS = (
    "float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data"
)


def _data_type_name(data_type: int) -> str:
    try:
        return _T.DataType.Name(data_type)
    except ValueError:
        return f"data_type {data_type}"


def _raw_bytes(data_type: int, numel: int) -> int | None:
    """Bytes of raw_data that ``numel`` elements need (None: not a fixed-size type)."""
    storage = _STORAGE.get(data_type)
    if storage is None:
        return None
    return (numel * storage[0] + 7) // 8


def _check_dims(t: onnx.TensorProto, where: str) -> None:
    for axis, d in enumerate(t.dims):
        if d < 0:
            raise TrainingModelError(f"{where}: dims[{axis}] is {d}; tensor dims must be >= 0")


def _raw_length(t: onnx.TensorProto) -> int:
    """len(t.raw_data) without copying the bytes out of protobuf.

    Reading ``raw_data`` copies it (a whole tensor), so the length comes from
    the serialized sizes instead: the field costs 1 tag byte, a varint length
    and the data, and every other field is copied into a bare TensorProto to
    be measured.  Unknown fields, or sizes that do not add up, fall back to
    the copy."""
    if len(UnknownFieldSet(t)):
        return len(t.raw_data)
    meta = onnx.TensorProto()
    for fd in t.DESCRIPTOR.fields:
        if fd.name == "raw_data":
            continue
        value = getattr(t, fd.name)
        if _is_repeated(fd):
            getattr(meta, fd.name).extend(value)
        elif fd.message_type is not None:
            if t.HasField(fd.name):
                getattr(meta, fd.name).CopyFrom(value)
        elif t.HasField(fd.name):
            setattr(meta, fd.name, value)
    try:
        field = t.ByteSize() - meta.ByteSize()  # 1 + varint(len) + len
    except EncodeError:  # a tensor of 2 GiB or more has no serialized size
        return len(t.raw_data)
    for width in range(1, 11):
        n = field - 1 - width
        if n >= 0 and _varint_width(n) == width:
            return n
    return len(t.raw_data)


def _is_repeated(fd) -> bool:
    is_repeated = getattr(fd, "is_repeated", None)  # protobuf >= 5.28
    if is_repeated is not None:
        return bool(is_repeated)
    return fd.label == fd.LABEL_REPEATED


def _varint_width(n: int) -> int:
    width = 1
    while n >= 0x80:
        n >>= 7
        width += 1
    return width


def check_tensor(t: onnx.TensorProto, where: str) -> None:
    """The stored data of ``t`` matches its dims and data_type (before any value is read).

    Refuses unknown types, negative dims, data in both raw_data and a typed
    field, data in the wrong typed field, and any count or byte length that
    differs from what the dims need, e.g. dims [2**40, 2**40] with 16 bytes."""
    data_type = t.data_type
    if data_type not in _STORAGE and data_type != _T.STRING:
        raise TrainingModelError(
            f"{where}: {'no data_type' if data_type == 0 else _data_type_name(data_type)}"
            " is not a tensor element type onnxtrain can read"
        )
    _check_dims(t, where)
    if t.HasField("segment"):
        raise TrainingModelError(f"{where}: segmented tensors are not supported")
    if t.data_location == _T.EXTERNAL:
        raise TrainingModelError(f"{where}: external data was not loaded")
    numel = _numel(t.dims)
    type_name = _data_type_name(data_type)
    shape = f"dims {list(t.dims)} of {type_name}"
    typed = [f for f in _TYPED_FIELDS if len(getattr(t, f))]
    has_raw = t.HasField("raw_data")
    if has_raw and typed:
        raise TrainingModelError(f"{where}: holds data both in raw_data and in {typed[0]}")
    if data_type == _T.STRING:
        if has_raw:
            raise TrainingModelError(f"{where}: a STRING tensor cannot use raw_data")
        found, expected, fld = len(t.string_data), numel, "string_data"
    elif has_raw:
        found, expected = _raw_length(t), _raw_bytes(data_type, numel)
        if found != expected:
            raise TrainingModelError(
                f"{where}: raw_data holds {found} bytes, but {shape} need {expected}"
            )
        return
    else:
        bits, fld, per = _STORAGE[data_type]
        expected = (numel * bits + 7) // 8 if bits < 8 else numel * per
        if typed and typed != [fld]:
            raise TrainingModelError(
                f"{where}: a {type_name} tensor keeps its values in {fld} or raw_data, "
                f"not in {typed[0]}"
            )
        found = len(getattr(t, fld))
    if found != expected:
        raise TrainingModelError(
            f"{where}: {fld} holds {found} values, but {shape} need {expected}"
        )


def check_sparse_tensor(st: onnx.SparseTensorProto, where: str) -> None:
    """A sparse tensor's values, indices and dims agree, indices are in range,
    and its dense form would fit in memory."""
    for axis, d in enumerate(st.dims):
        if d < 0:
            raise TrainingModelError(f"{where}: dims[{axis}] is {d}; tensor dims must be >= 0")
    values, indices = st.values, st.indices
    if len(values.dims) != 1:
        raise TrainingModelError(
            f"{where}: values must be 1-D [NNZ], found dims {list(values.dims)}"
        )
    nnz = int(values.dims[0])
    rank = len(st.dims)
    if indices.data_type != _T.INT64:
        raise TrainingModelError(
            f"{where}: indices must be INT64, found {_data_type_name(indices.data_type)}"
        )
    if list(indices.dims) not in ([nnz], [nnz, rank]):
        raise TrainingModelError(
            f"{where}: indices dims {list(indices.dims)} must be [NNZ] or [NNZ, rank] "
            f"= [{nnz}] or [{nnz}, {rank}]"
        )
    dense = _numel(st.dims)
    dense_bytes = _raw_bytes(values.data_type, dense) or dense
    if dense_bytes > memory_limit():
        raise TrainingModelError(
            f"{where}: dims {list(st.dims)} would need {dense_bytes} bytes dense, more than "
            f"this machine's memory"
        )
    if nnz == 0:
        return
    idx = numpy_helper.to_array(indices)
    if idx.ndim == 1:
        bad = (idx < 0) | (idx >= dense)
    else:
        bad = ((idx < 0) | (idx >= np.asarray(list(st.dims), dtype=np.int64))).any(axis=1)
    if bad.any():
        first = int(np.argmax(bad))
        raise TrainingModelError(
            f"{where}: index {idx[first].tolist()} is out of range for dims {list(st.dims)}"
        )


def check_tensors(model: onnx.ModelProto, skip: Iterable[onnx.TensorProto] = ()) -> None:
    """Every tensor of every graph holds exactly the data its dims and type need.

    Measuring a tensor's raw_data costs a pass over it (protobuf has no O(1)
    length), so the tensors in ``skip`` (checked already) are not measured
    again.  (They are matched by identity: protobuf keeps one Python object
    per sub-message while it is referenced, and ``skip`` references them.)"""
    checked = {id(t): t for t in skip}
    for where, t in labelled_tensors(model):
        if checked.get(id(t)) is not t:
            check_tensor(t, where)
    for where, st in labelled_sparse_tensors(model):
        check_sparse_tensor(st, where)


def _numel(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


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

    def initial_value(self, name: str, readonly: bool = False) -> np.ndarray:
        """The initializer value of a state variable (a fresh array).

        ``readonly=True`` skips one copy of the tensor: the array may then be
        read-only (for callers that copy it anyway, such as the state store)."""
        var = self.state[name]
        graph = self._origin_graph(var.origin)
        if var.sparse:
            for st in graph.sparse_initializer:
                if st.values.name == name:
                    return _dense(st)
        for t in graph.initializer:
            if t.name == name:
                value = numpy_helper.to_array(t)
                return value if readonly else value.copy()
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
            drop, stand_ins = _data_free_initializers(proto.graph, ti.algorithm)
            combined = combined_graph(proto, i, exclude_initializers=drop)
            combined.initializer.extend(stand_ins)
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
    return _data_type_name(elem_type)


def combined_graph(
    proto: onnx.ModelProto, index: int, exclude_initializers: Container[str] = ()
) -> onnx.GraphProto:
    """M ⊕ A of training_info[index]: every list concatenated, main graph first.

    Initializers (dense or sparse) named in ``exclude_initializers`` are left
    out: callers that feed state variables as inputs need not copy their data."""
    main = proto.graph
    algo = proto.training_info[index].algorithm
    g = onnx.GraphProto()
    g.name = f"{main.name or 'main'}+training_info[{index}]"
    for fld in ("input", "output", "node", "value_info"):
        getattr(g, fld).extend(getattr(main, fld))
        getattr(g, fld).extend(getattr(algo, fld))
    for source in (main, algo):
        g.initializer.extend(t for t in source.initializer if t.name not in exclude_initializers)
        g.sparse_initializer.extend(
            st for st in source.sparse_initializer if st.values.name not in exclude_initializers
        )
    return g


def copy_graph(graph: onnx.GraphProto, exclude_initializers: Container[str] = ()) -> onnx.GraphProto:
    """A copy of ``graph`` without the initializers (dense or sparse) named in
    ``exclude_initializers`` (their data is never copied)."""
    g = onnx.GraphProto()
    for fd in graph.DESCRIPTOR.fields:
        if fd.name in ("initializer", "sparse_initializer"):
            continue
        if _is_repeated(fd):
            getattr(g, fd.name).extend(getattr(graph, fd.name))
        elif graph.HasField(fd.name):
            if fd.message_type is not None:
                getattr(g, fd.name).CopyFrom(getattr(graph, fd.name))
            else:
                setattr(g, fd.name, getattr(graph, fd.name))
    g.initializer.extend(t for t in graph.initializer if t.name not in exclude_initializers)
    g.sparse_initializer.extend(
        st for st in graph.sparse_initializer if st.values.name not in exclude_initializers
    )
    return g


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


def uses_preview_ops(graph: onnx.GraphProto) -> bool:
    """Whether a graph (or a subgraph of it) has an ai.onnx.preview.training node."""
    for n in graph.node:
        if n.domain == PREVIEW_DOMAIN:
            return True
        if any(uses_preview_ops(sg) for sg in subgraphs(n)):
            return True
    return False
