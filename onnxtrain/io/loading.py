"""Load a model from a path, bytes or a ModelProto, refusing hostile files.

Loading refuses hostile files with a message that says what is wrong:
unparsable bytes, other ONNX messages, tensor data that does not match its
dims (checked before anything is allocated, ``onnxtrain.io.tensors``), external
data outside the model's folder (``onnxtrain.io.storage``), strings that are not
UTF-8.

>>> load(b"not a model")
Traceback (most recent call last):
...
onnxtrain.errors.TrainingModelError: cannot parse the model (11 bytes): not a valid ONNX ModelProto: ...
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from ..core.protos import all_tensors
from ..errors import TrainingModelError
from . import mapped, storage
from .storage import load_external_data, spill
from .tensors import check_tensors, has_external, is_repeated, model_contents, stored_bytes


@dataclass(frozen=True)
class Checked:
    """A ModelProto that onnxtrain made from models it checked (the
    builder's, ``build.training_session``): ``load`` takes it as it is, with
    no hostile-file checks (its strings, its tensors' sizes) done again."""

    proto: onnx.ModelProto


ModelLike = str | os.PathLike | bytes | onnx.ModelProto | Checked


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

#: Module state that changes at run time: not part of any cache key.
__fingerprint__ = False


def load(model: ModelLike) -> tuple[onnx.ModelProto, Path | None]:
    """Parse a model from a path, bytes or a ModelProto (never modified).

    External data of every graph (main, training_info, subgraphs) is resolved
    here, relative to the model's folder, and may not point outside it: large
    tensors stay in their files, memory-mapped when used (``onnxtrain.io.mapped``),
    small ones are read in.  Inline tensors of a large model are moved out of
    the protobuf the same way (``storage.spill``).  Every
    tensor's stored data must match its dims and type (checked before any
    value is materialized), so a hostile file gives a TrainingModelError,
    never a MemoryError or a crash.  A ``Checked`` model is not checked again."""
    if isinstance(model, Checked):
        return _spilled(model.proto, list(all_tensors(model.proto))), None
    if isinstance(model, onnx.ModelProto):
        base = None
        proto = model
        # Mapped placeholders (a model built from a loaded one) are fine:
        # check_tensors checks their files are the ones validated at load.
        # One walk of the tensors serves the three looks at them.
        contents = model_contents(proto)
        tensors = [t for graph_tensors, _ in contents for t in graph_tensors]
        if any(t.data_location == onnx.TensorProto.EXTERNAL and not mapped.is_mapped(t)
               for t in tensors):
            raise TrainingModelError(
                "the ModelProto refers to external data; pass its path instead so "
                "the data can be found"
            )
        check_strings(proto)
        check_tensors(proto, contents=contents)
        return _spilled(proto, tensors), base
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
    if has_external(proto):
        if base is None:
            raise TrainingModelError(
                "the model refers to external data; load it from its path so the data can be found"
            )
        filled = load_external_data(proto, base)
    else:
        filled = []
    check_tensors(proto, skip=filled)
    return _spilled(proto, list(all_tensors(proto))), base


def _spilled(proto: onnx.ModelProto, tensors: list[onnx.TensorProto]) -> onnx.ModelProto:
    """``spill(proto) or proto``, without spill's own walk of the tensors when
    all of them (``tensors``, every tensor of ``proto``) hold less than it
    spills from: then it would return None."""
    inline = 0
    for t in tensors:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            inline += stored_bytes(t) or 0
    if inline < max(storage.SPILL_FROM, 1):
        return proto
    return spill(proto) or proto


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
    try:
        if _strings_ok(message):
            return
    except Exception:  # the walk below finds it again, and says where
        pass
    _check_strings(message, path)


#: Per message type: its (singular string, repeated string, singular
#: message, repeated message) field names.
_PLANS: dict = {}


def _plan(desc) -> tuple[tuple[str, ...], ...]:
    plan = _PLANS.get(desc)
    if plan is None:
        parts: tuple[list[str], ...] = ([], [], [], [])
        for fd in desc.fields:
            rep = is_repeated(fd)
            if fd.type == FieldDescriptor.TYPE_STRING:
                parts[1 if rep else 0].append(fd.name)
            elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                parts[3 if rep else 2].append(fd.name)
        plan = _PLANS[desc] = tuple(tuple(p) for p in parts)
    return plan


def _strings_ok(message) -> bool:
    """The fast path of ``check_strings``: True if every string is text (no paths kept).

    A message is read with one ``ListFields`` call (its set fields only),
    except a TensorProto, whose listing would copy its data: its fields are
    read by name (``_plan``)."""
    if message.DESCRIPTOR is _TENSOR_PROTO:
        return _tensor_strings_ok(message)
    kinds = _KINDS
    for fd, value in message.ListFields():
        kind = kinds.get(fd)
        if kind is None:
            kind = _kind(fd)
        if kind == _STRING:
            if value.__class__ is not str:
                return False
        elif kind == _STRINGS:
            for v in value:
                if v.__class__ is not str:
                    return False
        elif kind == _MESSAGE:
            if not _strings_ok(value):
                return False
        elif kind == _MESSAGES:
            for sub in value:
                if not _strings_ok(sub):
                    return False
    return True


_TENSOR_PROTO = onnx.TensorProto.DESCRIPTOR
#: What a field holds, for ``_strings_ok``: by field descriptor.
_KINDS: dict = {}
_OTHER, _STRING, _MESSAGE, _STRINGS, _MESSAGES = 0, 1, 2, 5, 6


def _kind(fd) -> int:
    kind = _STRING if fd.type == FieldDescriptor.TYPE_STRING else (
        _MESSAGE if fd.type == FieldDescriptor.TYPE_MESSAGE else _OTHER)
    if kind and is_repeated(fd):
        kind += 4
    _KINDS[fd] = kind
    return kind


def _tensor_strings_ok(message) -> bool:
    """``_strings_ok`` by field name (for a TensorProto: its data is not read)."""
    strings, repeated_strings, messages, repeated_messages = _plan(message.DESCRIPTOR)
    for name in strings:
        if getattr(message, name).__class__ is not str:
            return False
    for name in repeated_strings:
        for v in getattr(message, name):
            if v.__class__ is not str:
                return False
    for name in messages:
        if message.HasField(name) and not _strings_ok(getattr(message, name)):
            return False
    for name in repeated_messages:
        for sub in getattr(message, name):
            if not _strings_ok(sub):
                return False
    return True


def _check_strings(message, path: str) -> None:
    """The walk of ``check_strings`` that keeps the path, for its error message."""
    for fd in message.DESCRIPTOR.fields:
        if fd.type == FieldDescriptor.TYPE_STRING:
            try:
                value = getattr(message, fd.name)
                values = list(value) if is_repeated(fd) else [value]
                bad = next((v for v in values if not isinstance(v, str)), None)
            except UnicodeDecodeError as exc:
                bad = exc.object
            if bad is not None:
                raise TrainingModelError(
                    f"{path}.{fd.name}: {bytes(bad)[:32]!r} is not valid UTF-8"
                )
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            if is_repeated(fd):
                for i, sub in enumerate(getattr(message, fd.name)):
                    _check_strings(sub, f"{path}.{fd.name}[{i}]")
            elif message.HasField(fd.name):
                _check_strings(getattr(message, fd.name), f"{path}.{fd.name}")
