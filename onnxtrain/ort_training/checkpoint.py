"""ONNX Runtime training checkpoints: the ``ODTC`` flatbuffer, read and written.

The format (``ort_training_checkpoint.fbs`` with ``Tensor`` from ``ort.fbs``,
file identifier ``ODTC``) is, field by field (the number is the slot):

- ``Checkpoint``: 0 version:int32, 1 module_state, 2 optimizer_groups:[OptimizerGroup],
  3 property_bag;
- ``ModuleState``: 0 requires_grad_params:[Tensor], 1 frozen_params:[Tensor],
  2 is_nominal_state:bool (tensors with their dims but no data);
- ``OptimizerGroup``: 0 group_name, 1 step:int64, 2 initial_learning_rate:float32,
  3 optimizer_states:[ParameterOptimizerState (0 param_name, 1 momentums:[Tensor])];
- ``PropertyBag``: 0 ints, 1 floats (float32), 2 strings: [(0 name, 1 value)];
- ``Tensor``: 0 name, 1 doc_string, 2 dims:[int64], 3 data_type (ONNX's numbering),
  4 raw_data:[uint8] (little-endian), 5 string_data, 6 external_data_offset.

This is the only module that imports ``flatbuffers`` (the ``ort-training`` extra).

>>> ck = Checkpoint(trainable={"w": np.ones((2, 2), np.float32)}, properties={"epoch": 3})
>>> back = loads(dumps(ck))
>>> back.trainable["w"].shape, back.properties
((2, 2), {'epoch': 3})
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from onnx import helper

from ..core.files import write_atomically

FILE_IDENTIFIER = b"ODTC"
#: The version ORT 1.19.2 writes and reads.
VERSION = 2


class CheckpointError(ValueError):
    """A file that is not a readable ODTC checkpoint."""


@dataclass
class OptimizerGroup:
    """One optimizer group: its step count, initial learning rate and, per
    parameter, its named momentum tensors (AdamW: ``momentum0``, ``momentum1``)."""

    name: str = "default"
    step: int = 0
    initial_learning_rate: float = 0.001
    states: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


@dataclass
class Checkpoint:
    """The content of an ODTC file (arrays in insertion order)."""

    trainable: dict[str, np.ndarray] = field(default_factory=dict)
    frozen: dict[str, np.ndarray] = field(default_factory=dict)
    nominal: bool = False
    optimizer_groups: list[OptimizerGroup] = field(default_factory=list)
    properties: dict[str, int | float | str] = field(default_factory=dict)
    version: int = VERSION


def _flatbuffers():
    try:
        import flatbuffers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reading or writing ONNX Runtime training checkpoints needs the flatbuffers "
            "package: pip install 'onnxtrain[ort-training]'"
        ) from exc
    return flatbuffers


# ------------------------------------------------------------------ reading
class _Reader:
    """Field access over one flatbuffer table (slot numbers as in the schema)."""

    def __init__(self, fb, buf: bytes, pos: int) -> None:
        self.fb = fb
        self.tab = fb.table.Table(buf, pos)

    def _offset(self, slot: int) -> int:
        return self.tab.Offset(4 + 2 * slot)

    def scalar(self, slot: int, flags, default):
        o = self._offset(slot)
        return self.tab.Get(flags, o + self.tab.Pos) if o else default

    def string(self, slot: int) -> str:
        o = self._offset(slot)
        return self.tab.String(o + self.tab.Pos).decode("utf-8") if o else ""

    def table(self, slot: int) -> "_Reader | None":
        o = self._offset(slot)
        return _Reader(self.fb, self.tab.Bytes, self.tab.Indirect(o + self.tab.Pos)) if o else None

    def tables(self, slot: int) -> list["_Reader"]:
        o = self._offset(slot)
        if not o:
            return []
        start = self.tab.Vector(o)
        return [_Reader(self.fb, self.tab.Bytes, self.tab.Indirect(start + 4 * i))
                for i in range(self.tab.VectorLen(o))]

    def numbers(self, slot: int, flags) -> np.ndarray:
        o = self._offset(slot)
        return self.tab.GetVectorAsNumpy(flags, o) if o else np.zeros(0, flags.N)


def _read_tensor(r: _Reader, nominal: bool) -> tuple[str, np.ndarray]:
    fb = r.fb
    name = r.string(0)
    dims = [int(d) for d in r.numbers(2, fb.number_types.Int64Flags)]
    data_type = r.scalar(3, fb.number_types.Int32Flags, 0)
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(data_type))
    except (KeyError, ValueError, TypeError):
        raise CheckpointError(f"tensor {name!r}: unsupported data type {data_type}") from None
    if dtype.kind in "OUS":
        raise CheckpointError(f"tensor {name!r}: string tensors are not supported")
    raw = r.numbers(4, fb.number_types.Uint8Flags)
    if r.scalar(6, fb.number_types.Int64Flags, -1) >= 0:
        raise CheckpointError(f"tensor {name!r}: external data in checkpoints is not supported")
    count = int(np.prod(dims, dtype=np.int64))
    if nominal and raw.size == 0:
        return name, np.zeros(dims, dtype)  # a named shape; Module refuses to run on it
    if raw.size != count * dtype.itemsize:
        raise CheckpointError(
            f"tensor {name!r}: {raw.size} bytes of data for shape {dims} of {dtype}"
        )
    arr = np.frombuffer(raw.tobytes(), dtype.newbyteorder("<")).astype(dtype).reshape(dims)
    return name, arr


def loads(data: bytes) -> Checkpoint:
    """Parse the bytes of an ODTC checkpoint."""
    fb = _flatbuffers()
    if len(data) < 8 or data[4:8] != FILE_IDENTIFIER:
        raise CheckpointError("not an ONNX Runtime training checkpoint (no ODTC file identifier)")
    try:
        root = _Reader(fb, data, fb.encode.Get(fb.packer.uoffset, data, 0))
        return _read_checkpoint(fb, root)
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or corrupt buffer
        raise CheckpointError(f"corrupt ODTC checkpoint: {exc}") from exc


def _read_checkpoint(fb, root: _Reader) -> Checkpoint:
    nt = fb.number_types
    ck = Checkpoint(version=root.scalar(0, nt.Int32Flags, 0))
    if ck.version > VERSION:
        raise CheckpointError(f"checkpoint version {ck.version} is newer than the supported "
                              f"{VERSION}")
    module = root.table(1)
    if module is not None:
        ck.nominal = bool(module.scalar(2, nt.BoolFlags, False))
        ck.trainable = dict(_read_tensor(t, ck.nominal) for t in module.tables(0))
        ck.frozen = dict(_read_tensor(t, ck.nominal) for t in module.tables(1))
    for g in root.tables(2):
        group = OptimizerGroup(g.string(0), int(g.scalar(1, nt.Int64Flags, 0)),
                               float(g.scalar(2, nt.Float32Flags, 0.0)))
        for s in g.tables(3):
            group.states[s.string(0)] = dict(_read_tensor(t, False) for t in s.tables(1))
        ck.optimizer_groups.append(group)
    bag = root.table(3)
    if bag is not None:
        for p in bag.tables(0):
            ck.properties[p.string(0)] = int(p.scalar(1, nt.Int64Flags, 0))
        for p in bag.tables(1):
            ck.properties[p.string(0)] = float(p.scalar(1, nt.Float32Flags, 0.0))
        for p in bag.tables(2):
            ck.properties[p.string(0)] = p.string(1)
    return ck


def load(path: str | os.PathLike) -> Checkpoint:
    """Read an ODTC checkpoint file."""
    with open(path, "rb") as f:
        return loads(f.read())


# ------------------------------------------------------------------ writing
def _vector_of(b, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def _write_tensor(fb, b, name: str, arr: np.ndarray, nominal: bool) -> int:
    arr = np.asarray(arr)
    data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
    name_off = b.CreateString(name)
    dims_off = b.CreateNumpyVector(np.asarray(arr.shape, dtype="<i8"))
    raw = b"" if nominal else np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes()
    raw_off = b.CreateNumpyVector(np.frombuffer(raw, np.uint8))
    b.StartObject(7)
    b.PrependUOffsetTRelativeSlot(0, name_off, 0)
    b.PrependUOffsetTRelativeSlot(2, dims_off, 0)
    b.PrependInt32Slot(3, data_type, 0)
    b.PrependUOffsetTRelativeSlot(4, raw_off, 0)
    return b.EndObject()


def _write_property(b, name: str, value, kind: str) -> int:
    name_off = b.CreateString(name)
    value_off = b.CreateString(value) if kind == "str" else None
    b.StartObject(2)
    b.PrependUOffsetTRelativeSlot(0, name_off, 0)
    if kind == "int":
        b.PrependInt64Slot(1, int(value), 0)
    elif kind == "float":
        b.PrependFloat32Slot(1, float(value), 0.0)
    else:
        b.PrependUOffsetTRelativeSlot(1, value_off, 0)
    return b.EndObject()


def property_kind(name: str, value) -> str:
    """"int", "float" or "str": the bag a property goes into (bool is refused, as ORT does)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"property {name!r}: bool is not a supported property type "
                        "(int, float or str)")
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    if isinstance(value, str):
        return "str"
    raise TypeError(f"property {name!r}: {type(value).__name__} is not a supported property "
                    "type (int, float or str)")


def dumps(ck: Checkpoint) -> bytes:
    """The bytes of ``ck`` as an ODTC checkpoint."""
    fb = _flatbuffers()
    b = fb.Builder(1024)
    trainable = [_write_tensor(fb, b, n, a, ck.nominal) for n, a in ck.trainable.items()]
    frozen = [_write_tensor(fb, b, n, a, ck.nominal) for n, a in ck.frozen.items()]
    trainable_vec, frozen_vec = _vector_of(b, trainable), _vector_of(b, frozen)
    b.StartObject(3)
    b.PrependUOffsetTRelativeSlot(0, trainable_vec, 0)
    b.PrependUOffsetTRelativeSlot(1, frozen_vec, 0)
    b.PrependBoolSlot(2, ck.nominal, False)
    module = b.EndObject()
    groups = []
    for g in ck.optimizer_groups:
        states = []
        for pname, moments in g.states.items():
            tensors = _vector_of(b, [_write_tensor(fb, b, n, a, False) for n, a in moments.items()])
            pname_off = b.CreateString(pname)
            b.StartObject(2)
            b.PrependUOffsetTRelativeSlot(0, pname_off, 0)
            b.PrependUOffsetTRelativeSlot(1, tensors, 0)
            states.append(b.EndObject())
        states_vec = _vector_of(b, states)
        gname = b.CreateString(g.name)
        b.StartObject(4)
        b.PrependUOffsetTRelativeSlot(0, gname, 0)
        b.PrependInt64Slot(1, int(g.step), 0)
        b.PrependFloat32Slot(2, float(g.initial_learning_rate), 0.0)
        b.PrependUOffsetTRelativeSlot(3, states_vec, 0)
        groups.append(b.EndObject())
    groups_vec = _vector_of(b, groups)
    bags: dict[str, list[int]] = {"int": [], "float": [], "str": []}
    for name, value in ck.properties.items():
        kind = property_kind(name, value)
        bags[kind].append(_write_property(b, name, value, kind))
    vecs = [_vector_of(b, bags[k]) for k in ("int", "float", "str")]
    b.StartObject(3)
    for slot, vec in enumerate(vecs):
        b.PrependUOffsetTRelativeSlot(slot, vec, 0)
    bag = b.EndObject()
    b.StartObject(4)
    b.PrependInt32Slot(0, int(ck.version), 0)
    b.PrependUOffsetTRelativeSlot(1, module, 0)
    b.PrependUOffsetTRelativeSlot(2, groups_vec, 0)
    b.PrependUOffsetTRelativeSlot(3, bag, 0)
    root = b.EndObject()
    b.Finish(root, file_identifier=FILE_IDENTIFIER)
    return bytes(b.Output())


def save(ck: Checkpoint, path: str | os.PathLike) -> None:
    """Write ``ck`` to ``path`` atomically."""
    write_atomically(path, dumps(ck))
