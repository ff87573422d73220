"""Tensors of a model: one walker over every graph's tensors, their storage
layout, and the checks that their stored data matches their dims and type.

Loading (``onnxtrain.io.loading``, ``onnxtrain.io.storage``) and writing
(``onnxtrain.io.storage.write_model``) both walk a model's tensors with
``labelled_tensors`` / ``all_tensors`` and size them with ``raw_bytes``.

>>> t = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[2**40, 2**40])
>>> check_tensor(t, "graph.initializer[0]")
Traceback (most recent call last):
...
onnxtrain.errors.TrainingModelError: graph.initializer[0]: float_data holds 0 values, but dims [1099511627776, 1099511627776] of FLOAT need 1208925819614629174706176
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np
import onnx
from google.protobuf.message import EncodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from onnx import numpy_helper

from ..core.protos import all_tensors, labelled_sparse_tensors, labelled_tensors, model_graph_contents
from ..errors import TrainingModelError
from . import mapped


def has_external(model: onnx.ModelProto, mapped_ok: bool = False) -> bool:
    """Whether some tensor of the model keeps its data in an external file
    (``mapped_ok``: other than the mapped placeholders of ``onnxtrain.io.mapped``)."""
    return any(t.data_location == onnx.TensorProto.EXTERNAL
               and not (mapped_ok and mapped.is_mapped(t)) for t in all_tensors(model))


def has_mapped(model: onnx.ModelProto) -> bool:
    """Whether some tensor of the model is a mapped placeholder."""
    return any(mapped.is_mapped(t) for t in all_tensors(model))


# ----------------------------------------------------------- protobuf fields
def is_repeated(fd) -> bool:
    """Whether a protobuf field descriptor is a repeated field."""
    repeated = getattr(fd, "is_repeated", None)  # protobuf >= 5.28
    if repeated is not None:
        return bool(repeated)
    return fd.label == fd.LABEL_REPEATED


def copy_fields(src, dst, skip: Iterable[str] = ()) -> None:
    """Copy every set field of the message ``src`` into ``dst`` except those in ``skip``."""
    for fd in src.DESCRIPTOR.fields:
        name = fd.name
        if name in skip:
            continue
        value = getattr(src, name)
        if is_repeated(fd):
            if len(value):
                getattr(dst, name).extend(value)
        elif src.HasField(name):
            if fd.message_type is not None:
                getattr(dst, name).CopyFrom(value)
            else:
                setattr(dst, name, value)


# ------------------------------------------------------------ tensor checks
def memory_limit() -> int:
    """Bytes of physical memory: no tensor or total may claim more."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**40



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


def data_type_name(data_type: int) -> str:
    try:
        return _T.DataType.Name(data_type)
    except ValueError:
        return f"data_type {data_type}"


def raw_bytes(data_type: int, numel: int) -> int | None:
    """Bytes of raw_data that ``numel`` elements need (None: not a fixed-size type)."""
    storage = _STORAGE.get(data_type)
    if storage is None:
        return None
    return (numel * storage[0] + 7) // 8


def stored_bytes(t: onnx.TensorProto) -> int | None:
    """Bytes of data ``t``'s dims and type need (negative dims count as 0;
    None: a type without a fixed size, such as STRING).  Nothing is copied."""
    n = 1
    for d in t.dims:
        n *= max(int(d), 0)
    return raw_bytes(t.data_type, n)


def check_dims(t: onnx.TensorProto, where: str) -> None:
    for axis, d in enumerate(t.dims):
        if d < 0:
            raise TrainingModelError(f"{where}: dims[{axis}] is {d}; tensor dims must be >= 0")


def raw_length(t: onnx.TensorProto) -> int:
    """len(t.raw_data), at the least cost the protobuf build allows.

    With the upb build (protobuf's default), reading ``raw_data`` makes one
    copy of the bytes, and ``ByteSize`` serializes the tensor (two copies),
    so the length is read directly.  With the C++ build, reading
    ``raw_data`` copies the tensor while ``ByteSize`` is computed without
    one, so the length comes from the serialized sizes instead: the field
    costs 1 tag byte, a varint length and the data, and every other field is
    copied into a bare TensorProto to be measured.  Unknown fields, or sizes
    that do not add up, fall back to the copy."""
    if not _MEASURE_BY_SIZE or len(UnknownFieldSet(t)):
        return len(t.raw_data)
    meta = onnx.TensorProto()
    copy_fields(t, meta, skip=("raw_data",))
    try:
        field = t.ByteSize() - meta.ByteSize()  # 1 + varint(len) + len
    except EncodeError:  # a tensor of 2 GiB or more has no serialized size
        return len(t.raw_data)
    for width in range(1, 11):
        n = field - 1 - width
        if n >= 0 and _varint_width(n) == width:
            return n
    return len(t.raw_data)


def _protobuf_backend() -> str:
    try:
        from google.protobuf.internal import api_implementation

        return api_implementation.Type()
    except Exception:  # an unknown build: measure by sizes, which is always right
        return "cpp"


#: Whether ``raw_length`` measures by serialized sizes (only the C++ build
#: computes them without copying the data).
_MEASURE_BY_SIZE = _protobuf_backend() == "cpp"


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
            f"{where}: {'no data_type' if data_type == 0 else data_type_name(data_type)}"
            " is not a tensor element type onnxtrain can read"
        )
    check_dims(t, where)
    if t.HasField("segment"):
        raise TrainingModelError(f"{where}: segmented tensors are not supported")
    if t.data_location == _T.EXTERNAL:
        if mapped.is_mapped(t):
            mapped.check_trusted(t, where)
            length = mapped.source(t)[2]
            if raw_bytes(data_type, element_count(t.dims)) != length:
                raise TrainingModelError(
                    f"{where}: external data holds {length} bytes, which dims {list(t.dims)} "
                    f"of {data_type_name(data_type)} do not need"
                )
            if t.HasField("raw_data") or any(len(getattr(t, f)) for f in _TYPED_FIELDS):
                raise TrainingModelError(f"{where}: holds data and refers to external data")
            return
        raise TrainingModelError(f"{where}: external data was not loaded")
    numel = element_count(t.dims)
    typed = [f for f in _TYPED_FIELDS if len(getattr(t, f))]
    has_raw = t.HasField("raw_data")
    if has_raw and typed:
        raise TrainingModelError(f"{where}: holds data both in raw_data and in {typed[0]}")
    if data_type == _T.STRING:
        if has_raw:
            raise TrainingModelError(f"{where}: a STRING tensor cannot use raw_data")
        found, expected, fld = len(t.string_data), numel, "string_data"
    elif has_raw:
        found, expected = raw_length(t), raw_bytes(data_type, numel)
        if found != expected:
            raise TrainingModelError(
                f"{where}: raw_data holds {found} bytes, but {_shape(t)} need {expected}"
            )
        return
    else:
        bits, fld, per = _STORAGE[data_type]
        expected = (numel * bits + 7) // 8 if bits < 8 else numel * per
        if typed and typed != [fld]:
            raise TrainingModelError(
                f"{where}: a {data_type_name(data_type)} tensor keeps its values in {fld} or raw_data, "
                f"not in {typed[0]}"
            )
        found = len(getattr(t, fld))
    if found != expected:
        raise TrainingModelError(
            f"{where}: {fld} holds {found} values, but {_shape(t)} need {expected}"
        )


def _shape(t: onnx.TensorProto) -> str:
    return f"dims {list(t.dims)} of {data_type_name(t.data_type)}"


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
            f"{where}: indices must be INT64, found {data_type_name(indices.data_type)}"
        )
    if list(indices.dims) not in ([nnz], [nnz, rank]):
        raise TrainingModelError(
            f"{where}: indices dims {list(indices.dims)} must be [NNZ] or [NNZ, rank] "
            f"= [{nnz}] or [{nnz}, {rank}]"
        )
    dense = element_count(st.dims)
    dense_bytes = raw_bytes(values.data_type, dense) or dense
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


def model_contents(
    model: onnx.ModelProto,
) -> list[tuple[list[onnx.TensorProto], list[onnx.SparseTensorProto]]]:
    """Per graph (``all_graphs``' order), its tensors and sparse tensors
    (``graph_contents``): one walk, for callers that look at the tensors
    more than once (``loading.load``).  Valid while ``model`` is not changed."""
    return model_graph_contents(model)


def check_tensors(model: onnx.ModelProto, skip: Iterable[onnx.TensorProto] = (),
                  contents: list | None = None) -> None:
    """Every tensor of every graph holds exactly the data its dims and type need.

    Measuring a tensor's raw_data costs a pass over it (protobuf has no O(1)
    length), so the tensors in ``skip`` (checked already) are not measured
    again.  (They are matched by identity: protobuf keeps one Python object
    per sub-message while it is referenced, and ``skip`` references them.)

    Every tensor is checked without making its label; only when one fails
    does a second, labelled walk (the same tensors in the same order, the
    same checks) find it again to say where it is.  ``contents``: the
    model's ``model_contents``, when the caller has it."""
    checked = {id(t): t for t in skip}
    try:
        _check_all(model_contents(model) if contents is None else contents, checked)
        return
    except TrainingModelError as exc:
        first = exc
    for where, t in labelled_tensors(model):
        if checked.get(id(t)) is not t:
            check_tensor(t, where)
    for where, st in labelled_sparse_tensors(model):
        check_sparse_tensor(st, where)
    raise first  # not reached: the labelled walk fails where the first one did


def _check_all(contents: list, checked: dict) -> None:
    """``check_tensors``' walk without labels (errors say "" for where).  A
    graph's sparse tensors are checked after all its tensors, their values
    and indices among them, as in the labelled walk."""
    for tensors, sparse in contents:
        for t in tensors:
            if checked.get(id(t)) is not t:
                check_tensor(t, "")
        for st in sparse:
            check_sparse_tensor(st, "")


def element_count(dims: Iterable[int]) -> int:
    """The number of elements of a tensor with these dims."""
    n = 1
    for d in dims:
        n *= int(d)
    return n
