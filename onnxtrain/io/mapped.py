"""Tensor data kept out of the protobuf: mapped external data and deferred values.

A large model's weights never pass through protobuf here.  Two kinds of
placeholder TensorProto (``data_location = EXTERNAL``, dims and type set, no
data) stand for them:

- **mapped**: external data that ``onnxtrain.io.storage`` validated when it
  loaded a model from its path (the range fits the tensor, the file lies in
  the model's folder).  The location is rewritten to the file's absolute
  path and the file is recorded as *trusted* in this process.  ``array(t)``
  is a read-only ``numpy.memmap`` of the range, one per range in the process
  while it is in use, so every program shares the same pages (the executor
  hands them to onnxruntime without a copy).  A ModelProto passed in memory
  may hold mapped tensors only for trusted files: a model built from a
  loaded one (``build.training_model(path)``) keeps its weights mapped,
  while an absolute path nobody validated is still refused.
- **deferred**: a value that exists only while a file is written (a state
  variable's current value, a merged LoRA weight).  The location is
  ``onnxtrain:deferred/<key>``; the writer streams ``Deferred.chunks()`` into
  the data file, so the value is never copied into a protobuf message.

Small external tensors (under ``MAP_FROM`` bytes) are read in at load time
like before: shape constants and scalars stay plain data.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from ..core.fingerprint import sha256_all
from ..core.protos import all_tensors
from ..errors import TrainingModelError

#: Module state that changes at run time: not part of any cache key.
__fingerprint__ = False

#: External tensors of at least this many bytes are mapped, not read.
MAP_FROM = 2**20
#: Location prefix of deferred placeholders.
DEFERRED = "onnxtrain:deferred/"
#: Location prefix of a held placeholder named by its data's SHA-256 instead
#: of this process's file (``owned_digests``): what a cache key or entry holds.
HELD = "onnxtrain:held/"
#: Owned data (bytes together) from which ``owned_digests`` hashes on several threads.
PARALLEL_HASH_BYTES = 16 * 2**20
#: Bytes per chunk when a value is streamed or computed piecewise.
CHUNK_BYTES = 64 * 2**20

_T = onnx.TensorProto
_lock = threading.Lock()
#: Resolved files whose ranges onnxtrain validated -> (device, inode, size, mtime_ns).
_trusted: dict[str, tuple[int, int, int, int]] = {}
#: (path, offset, dtype, shape) -> the memmap of that range, while someone holds it.
_maps: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _identity(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def trust(path: str | os.PathLike) -> str:
    """Record a validated data file (by its resolved path); returns that path."""
    resolved = str(Path(path).resolve())
    with _lock:
        _trusted[resolved] = _identity(resolved)
    return resolved


#: Resolved data files that live sessions read from -> how many sessions.
_held: dict[str, int] = {}
#: Files onnxtrain wrote for its sessions (``storage.hold``): removed when the
#: last session holding them lets go.
_owned: set[str] = set()
#: (path, offset, length) of a range of an owned file -> the SHA-256 (hex) of
#: its data.  An owned file never changes once written (``private`` maps it
#: copy-on-write), so each range is hashed once while the file lives.
_owned_digests: dict[tuple[str, int, int], str] = {}


def own(path: str) -> None:
    """Record a trusted file as onnxtrain's own: once no session holds it
    (``hold``) any more, it is removed and no longer trusted."""
    with _lock:
        _owned.add(path)


def hold(model: onnx.ModelProto) -> Callable[[], None]:
    """Record that a session reads the files ``model``'s mapped tensors point
    at; returns the function that lets go of them (call it once)."""
    paths = {source(t)[0] for t in all_tensors(model) if is_mapped(t)}
    with _lock:
        for p in paths:
            _held[p] = _held.get(p, 0) + 1

    def release() -> None:
        gone = []
        with _lock:
            for p in paths:
                left = _held.get(p, 0) - 1
                if left > 0:
                    _held[p] = left
                    continue
                _held.pop(p, None)
                if p in _owned:
                    # (maps made of it stay valid: their pages go with them)
                    _owned.discard(p)
                    _trusted.pop(p, None)
                    gone.append(p)
            for key in [k for k in _owned_digests if k[0] in gone]:
                del _owned_digests[key]
        for p in gone:
            try:
                os.unlink(p)
            except OSError:
                pass

    return release


def in_use(path: str | os.PathLike) -> bool:
    """Whether a live session of this process reads data from ``path``."""
    try:
        resolved = str(Path(path).resolve())
    except (OSError, RuntimeError):
        return False
    with _lock:
        return resolved in _held


def mappable(data_type: int) -> bool:
    """Element types numpy views natively (not bfloat16, float8 or 4-bit ones)."""
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(data_type))
    except (KeyError, TypeError, ValueError):
        return False
    return dtype.kind in "fiub" and dtype.type.__module__ == "numpy"


def _info(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def location(t: onnx.TensorProto) -> str:
    """The location an external tensor names ("" where it names none)."""
    return _info(t).get("location", "")


def is_mapped(t: onnx.TensorProto) -> bool:
    """Whether ``t`` is a placeholder for a range of a trusted file."""
    if t.data_location != _T.EXTERNAL:
        return False
    where = location(t)
    return os.path.isabs(where) and where in _trusted


def is_owned(t: onnx.TensorProto) -> bool:
    """Whether ``t`` is a mapped placeholder of a file onnxtrain wrote for
    its sessions (``own``): a location that names this process's file, not
    the data."""
    if not is_mapped(t):
        return False
    with _lock:
        return location(t) in _owned


def owned_digests(tensors: Iterable[onnx.TensorProto]) -> list[str]:
    """The SHA-256 (hex) of each tensor's data, in order: placeholders of
    onnxtrain's own files (``is_owned``; ValueError for any other), each range
    hashed once while its file lives (on several threads from
    ``PARALLEL_HASH_BYTES``)."""
    tensors = list(tensors)
    if not all(is_owned(t) for t in tensors):
        raise ValueError("owned_digests: a tensor is not a placeholder of onnxtrain's own file")
    sources = [source(t) for t in tensors]
    with _lock:
        known = {s: _owned_digests.get(s) for s in sources}
    todo = {s: t for s, t in zip(sources, tensors) if known[s] is None}
    if todo:
        fresh = dict(zip(todo, sha256_all([array(t) for t in todo.values()], PARALLEL_HASH_BYTES)))
        known.update(fresh)
        with _lock:  # (not for a file let go meanwhile)
            _owned_digests.update((s, d) for s, d in fresh.items() if s[0] in _owned)
    return [known[s] for s in sources]


def is_deferred(t: onnx.TensorProto) -> bool:
    return t.data_location == _T.EXTERNAL and location(t).startswith(DEFERRED)


def source(t: onnx.TensorProto) -> tuple[str, int, int]:
    """(absolute path, offset, length) of a mapped tensor."""
    info = _info(t)
    return info["location"], int(info.get("offset") or 0), int(info["length"])


def point(t: onnx.TensorProto, path: str, offset: int, length: int) -> None:
    """Make ``t`` (its data already dropped or never read) refer to ``length``
    bytes at ``offset`` of ``path`` as external data: a mapped placeholder
    when ``path`` is a trusted file's absolute path, a plain external
    reference (a bundle's ``state.bin``) when it is relative."""
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                  "string_data"):
        t.ClearField(field)
    del t.external_data[:]
    t.data_location = _T.EXTERNAL
    for key, value in (("location", path), ("offset", str(offset)), ("length", str(length))):
        t.external_data.add(key=key, value=value)


def check_trusted(t: onnx.TensorProto, where: str) -> None:
    """A mapped tensor's file is unchanged since it was validated, and its range fits."""
    path, offset, length = source(t)
    with _lock:
        known = _trusted.get(path)
    try:
        now = _identity(path)
    except OSError as exc:
        raise TrainingModelError(f"{where}: cannot read external data {path!r}: {exc}") from exc
    if known is None or now != known:
        raise TrainingModelError(
            f"{where}: external data file {path!r} changed since onnxtrain loaded it; load the model again"
        )
    if offset < 0 or offset + length > now[2]:
        raise TrainingModelError(f"{where}: external data range lies past the end of {path!r}")


def _layout(t: onnx.TensorProto) -> tuple[np.dtype, tuple[int, ...]]:
    """(numpy dtype, shape) of a tensor's data."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)), tuple(int(d) for d in t.dims)


def array(t: onnx.TensorProto) -> np.ndarray:
    """A read-only view of a mapped tensor's data (shared while anyone holds it)."""
    path, offset, length = source(t)
    dtype, shape = _layout(t)
    key = (path, offset, dtype.str, shape)
    with _lock:
        arr = _maps.get(key)
        if arr is None:
            if length == 0:
                arr = np.zeros(shape, dtype)
                arr.flags.writeable = False
            else:
                arr = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
            _maps[key] = arr
    return arr


def rooted(model: onnx.ModelProto, copy: bool = True) -> onnx.ModelProto:
    """``model`` (a copy unless ``copy=False``) with each mapped placeholder's
    location relative to "/": what onnx's checker and onnxruntime accept
    (they refuse absolute locations) while still naming the real file."""
    out = model
    if copy:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    for t in all_tensors(out):
        if is_mapped(t):
            path, offset, length = source(t)
            point(t, os.path.relpath(path, "/"), offset, length)
    return out


def read(t: onnx.TensorProto) -> np.ndarray:
    """A fresh, writable copy of a mapped tensor's data, read from its file
    (no mapping: the file's pages are not counted in this process's memory)."""
    path, offset, length = source(t)
    dtype, shape = _layout(t)
    out = np.empty(shape, dtype)
    view = memoryview(out.reshape(-1)).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        got = 0
        while got < length:
            n = f.readinto(view[got:])
            if not n:
                raise TrainingModelError(f"external data {path!r} ended before tensor {t.name!r} did")
            got += n
    return out


def private(t: onnx.TensorProto) -> np.ndarray:
    """A writable array of a mapped tensor of onnxtrain's own file (``own``),
    mapped copy-on-write: a page is read from the file when first touched and
    copied when first written; the file never changes.  No fresh memory is
    filled up front, which on a machine whose pages cost most at first touch
    is most of ``read``'s time (a starting value the first step only reads).
    Where there is no such map (not POSIX) or nothing to map: ``read``."""
    path, offset, length = source(t)
    if os.name != "posix" or length == 0 or not is_owned(t):
        return read(t)
    dtype, shape = _layout(t)
    count = int(np.prod(shape, dtype=np.int64))
    if dtype.itemsize * count != length:
        raise TrainingModelError(f"tensor {t.name!r}: {length} bytes in {path!r} do not fit its dims")
    skip = offset % mmap.ALLOCATIONGRANULARITY  # (a map starts at a multiple of it)
    with open(path, "rb") as f:
        pages = mmap.mmap(f.fileno(), skip + length, access=mmap.ACCESS_COPY, offset=offset - skip)
    # A plain array (the map is its base and stays while it does).
    return np.frombuffer(pages, dtype, count, skip).reshape(shape)


def to_array(t: onnx.TensorProto) -> np.ndarray:
    """The value of any loaded tensor: mapped ones as a read-only view."""
    if is_mapped(t):
        return array(t)
    from onnx import numpy_helper

    return numpy_helper.to_array(t)


# ---------------------------------------------------------------- deferred
@dataclass
class Deferred:
    """A value written only when a file is: ``produce()`` returns the array,
    or an iterable of C-ordered row blocks whose bytes follow one another."""

    dtype: np.dtype
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray | Iterable[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def chunks(self) -> Iterator[memoryview]:
        """The value's bytes, in pieces of at most about ``CHUNK_BYTES``.
        Computed blocks are produced by a helper thread while the caller
        writes the previous ones (numpy and file writes release the GIL)."""
        value = self.produce()
        blocks = [value] if isinstance(value, np.ndarray) else _ahead(iter(value))
        for block in blocks:
            flat = np.ascontiguousarray(block).reshape(-1)
            step = max(1, CHUNK_BYTES // max(flat.itemsize, 1))
            for start in range(0, flat.size, step):
                yield memoryview(flat[start:start + step]).cast("B")

    def value(self) -> np.ndarray:
        value = self.produce()
        if isinstance(value, np.ndarray):
            return value.reshape(self.shape)
        return np.concatenate([np.asarray(b).reshape(-1) for b in value]).reshape(self.shape)


def _ahead(blocks: Iterator[np.ndarray], depth: int = 2) -> Iterator[np.ndarray]:
    """``blocks``, computed up to ``depth`` ahead in a helper thread (errors re-raised here)."""
    import queue

    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(item: object) -> bool:
        """Queue ``item`` unless the consumer has stopped (then False)."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for block in blocks:
                if not put(block):
                    return
            put(done)
        except BaseException as exc:  # handed to the consumer
            put(exc)

    thread = threading.Thread(target=work, name="onnxtrain-deferred", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def defer(t: onnx.TensorProto, key: str, value: Deferred, table: dict[str, Deferred]) -> None:
    """Make ``t`` a deferred placeholder for ``value`` (registered in ``table``)."""
    location = DEFERRED + key
    t.data_type = onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
    del t.dims[:]
    t.dims.extend(value.shape)
    point(t, location, 0, value.nbytes)
    table[location] = value


def of_array(arr: np.ndarray) -> Deferred:
    """A deferred value that is ``arr`` itself (written without a copy)."""
    return Deferred(arr.dtype, tuple(arr.shape), lambda: arr)


def rows(shape: tuple[int, ...], itemsize: int) -> int:
    """Rows of a 2-D (or higher) value per block of about ``CHUNK_BYTES``."""
    per_row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize if len(shape) > 1 else itemsize
    return max(1, CHUNK_BYTES // max(per_row, 1))


def deferred_of(t: onnx.TensorProto, table: Mapping[str, Deferred]) -> Deferred | None:
    if not is_deferred(t):
        return None
    return table.get(_info(t)["location"])
