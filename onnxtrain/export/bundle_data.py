"""The bundle's two data files: ``state.bin`` (every state variable, laid
out as the manifest says) and ``constants.bin`` (constants of 1 KiB or more,
stored once however many models refer to them: content-addressed).

Both hold raw little-endian bytes, each item at a multiple of 64 bytes,
with zeros between items.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import BinaryIO

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import BundleError
from ..io import mapped
from .bundle_format import (
    CONSTANT_MIN_BYTES,
    DTYPE_NAMES,
    ITEMSIZE,
    StateEntry,
    aligned,
    numpy_dtype,
)


def write_state(f: BinaryIO, entries: list[StateEntry], values: Mapping[str, np.ndarray]) -> int:
    """Write ``values`` to ``f`` at their entries' offsets; returns the bytes written.

    Each value must have its entry's dtype and shape (a scalar stays a scalar)."""
    at = 0
    for e in entries:
        value = np.asarray(values[e.name])
        if value.dtype != numpy_dtype(e.dtype) or tuple(value.shape) != e.shape:
            raise BundleError(f"state variable {e.name!r} is {value.dtype}{list(value.shape)}, "
                              f"expected {e.dtype}{list(e.shape)}")
        f.write(bytes(e.offset - at))
        f.write(as_bytes(value))
        at = e.offset + e.length
    return at


def as_bytes(value: np.ndarray) -> np.ndarray:
    """The bytes of an array in C order, as a flat uint8 view (no copy when it is contiguous)."""
    return np.ascontiguousarray(value).reshape(-1).view(np.uint8)


def tensor_bytes(t: onnx.TensorProto) -> bytes | np.ndarray | None:
    """The raw little-endian bytes of a tensor of a bundle element type (None
    for other types: strings, 4-bit and 8-bit floats stay where they are)."""
    dtype = DTYPE_NAMES.get(t.data_type)
    if dtype is None:
        return None
    if mapped.is_mapped(t):
        return as_bytes(mapped.read(t))
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return None  # (not loaded: left as it is)
    if t.HasField("raw_data"):
        return t.raw_data
    return as_bytes(numpy_helper.to_array(t).astype(numpy_dtype(dtype), copy=False))


def declared_bytes(t: onnx.TensorProto) -> int:
    """A tensor's data size from its type and dims (0 for types a bundle does not store)."""
    dtype = DTYPE_NAMES.get(t.data_type)
    if dtype is None:
        return 0
    return int(np.prod(list(t.dims), dtype=np.int64)) * ITEMSIZE[dtype]


class ConstantStore:
    """constants.bin, being written: ``put`` moves a tensor's data there (once
    per distinct content) and makes the tensor refer to it."""

    def __init__(self, f: BinaryIO, location: str) -> None:
        self.f = f
        self.location = location
        self.size = 0
        self._at: dict[bytes, tuple[int, int]] = {}

    def put(self, t: onnx.TensorProto) -> bool:
        """Store ``t``'s data if it holds 1 KiB or more of a bundle element
        type; whether it now refers to constants.bin."""
        if declared_bytes(t) < CONSTANT_MIN_BYTES:
            return False
        data = tensor_bytes(t)
        if data is None:
            return False
        key = hashlib.sha256(data).digest()
        place = self._at.get(key)
        if place is None:
            offset = aligned(self.size)
            self.f.write(bytes(offset - self.size))
            self.f.write(data)
            self.size = offset + len(data)
            place = self._at[key] = (offset, len(data))
        mapped.point(t, self.location, *place)
        return True
