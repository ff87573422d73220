"""The portable training bundle's layout (docs/bundle.md, format version 1):
its file names, the element types it stores, and the state layout.

>>> entries, total = state_layout([("W", "float32", (2, 3), True), ("step", "int64", (), False)])
>>> [(e.name, e.offset, e.length) for e in entries], total
([('W', 0, 24), ('step', 64, 8)], 72)
>>> entries[1].to_json()["shape"]
[]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import BundleError

#: ``manifest.json``'s ``"format"``.
FORMAT = "onnxtrain-bundle"
#: The layout version this module writes and reads.
VERSION = 1

MANIFEST = "manifest.json"
STATE_FILE = "state.bin"
CONSTANTS_FILE = "constants.bin"
INFERENCE_MODEL = "inference.onnx"
TRAINING_MODEL = "training_model.onnx"

#: State variables start at multiples of this many bytes in state.bin (and
#: constants in constants.bin): aligned for any element type and SIMD loads.
ALIGN = 64
#: Constants of at least this many bytes go to constants.bin.
CONSTANT_MIN_BYTES = 1024
#: The highest IR version of the programs (what onnxruntime 1.20 and newer read).
MAX_IR_VERSION = 10

#: The element types a bundle stores: numpy's name -> ONNX element type.
DTYPES: dict[str, int] = {
    "float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE, "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16, "int8": TensorProto.INT8, "uint8": TensorProto.UINT8,
    "int16": TensorProto.INT16, "uint16": TensorProto.UINT16, "int32": TensorProto.INT32,
    "uint32": TensorProto.UINT32, "int64": TensorProto.INT64, "uint64": TensorProto.UINT64,
    "bool": TensorProto.BOOL,
}
#: ONNX element type -> the bundle's name.
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
            "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "bool": 1}


def program_file(kind: str, index: int | None = None) -> str:
    """``program_inference.onnx``, ``program_algorithm_0.onnx``, ``program_initialization_0.onnx``."""
    return f"program_{kind}.onnx" if index is None else f"program_{kind}_{index}.onnx"


def dtype_name(elem_type: int, where: str) -> str:
    """The bundle's name of an ONNX element type, or BundleError naming ``where``."""
    name = DTYPE_NAMES.get(elem_type)
    if name is None:
        found = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() \
            else str(elem_type)
        raise BundleError(f"{where}: element type {found} cannot be stored in a bundle "
                          f"(expected one of {', '.join(DTYPES)})")
    return name


def numpy_dtype(name: str) -> np.dtype:
    """numpy's dtype of a bundle element type (bfloat16: onnx's own, ml_dtypes)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(DTYPES[name]))


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def nbytes(dtype: str, shape: Iterable[int]) -> int:
    return int(np.prod(list(shape), dtype=np.int64)) * ITEMSIZE[dtype]


@dataclass(frozen=True)
class StateEntry:
    """One state variable's place in state.bin (a ``manifest["state"]`` item)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    trainable: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "length": self.length, "trainable": self.trainable}

    @property
    def elem_type(self) -> int:
        return DTYPES[self.dtype]


def state_layout(variables: Iterable[tuple[str, str, tuple[int, ...], bool]]
                 ) -> tuple[list[StateEntry], int]:
    """Entries for (name, dtype, shape, trainable) in order, each at the next
    multiple of ``ALIGN``; and the size of state.bin (the last entry's end)."""
    entries, end = [], 0
    for name, dtype, shape, trainable in variables:
        offset = aligned(end)
        length = nbytes(dtype, shape)
        entries.append(StateEntry(name, dtype, tuple(int(d) for d in shape), offset, length, trainable))
        end = offset + length
    return entries, end


def external_info(t: onnx.TensorProto) -> dict[str, str]:
    """A tensor's external_data entries as a dict (empty when it holds its data)."""
    if t.data_location != TensorProto.EXTERNAL:
        return {}
    return {e.key: e.value for e in t.external_data}
