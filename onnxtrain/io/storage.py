"""Model files on disk: external tensor data read at load, and models written
atomically, with external data for large ones.

Reading: ``load_external_data(model, folder)`` checks every external
location (relative, inside the model's folder, a regular file, a byte range
that exactly fits the tensor) before reading any byte.

Writing:

``write_model(model, path)`` never leaves a half-written file at ``path``:
every file is written under a temporary name in the destination folder,
flushed and fsynced, and then renamed over the destination, so ``path`` holds
either the previous complete model or the new one, whatever happens
(SIGKILL, power loss after the fsync, a full disk, an exception).

Models whose tensors add up to more than a threshold (1.5 GiB by default;
protobuf cannot serialize 2 GiB) are written with **external data**: tensor
bytes go to one data file next to the model, named
``<model file name>.<8 hex digits>.data``, and the model refers to it.  The
data file gets a fresh name on every write and is renamed into place before
the model, so the old model keeps pointing at its old, intact data until the
model rename switches both at once; data files of earlier writes to the same
path are then removed.  One writer per destination path at a time.

Temporary files are named ``.<file name>.<pid>.<random>.tmp``; a write
removes the ones left for the same destination by dead processes.

>>> import tempfile, onnx
>>> folder = tempfile.mkdtemp()
>>> m = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
>>> write_model(m, f"{folder}/m.onnx").name
'm.onnx'
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Container, Mapping
from pathlib import Path, PureWindowsPath
from typing import Any, BinaryIO

import numpy as np
import onnx
from google.protobuf.message import EncodeError
from onnx import numpy_helper

from ..core.files import (
    fsync_dir,
    process_folder,
    refuse_special,
    remove_stale_temp_files,
    replace_with,
    unlink_quietly,
    write_temp,
)
from ..core.protos import all_tensors, labelled_tensors
from ..core.walk import graphs_within
from ..errors import TrainingModelError
from . import mapped
from .tensors import check_dims, copy_fields, data_type_name, element_count, memory_limit, raw_bytes, stored_bytes

#: Module state that changes at run time: not part of any cache key.
__fingerprint__ = False

#: Default tensor bytes above which ``write_model`` switches to external data.
DEFAULT_EXTERNAL_DATA_THRESHOLD = 3 * 2**29  # 1.5 GiB
#: Environment variable overriding that threshold (a number of bytes, e.g. ``1e6``).
THRESHOLD_ENV = "ONNXTRAIN_EXTERNAL_DATA_THRESHOLD"
#: Initializers smaller than this stay inline even in external-data mode.
DEFAULT_MIN_EXTERNAL_BYTES = 1024
#: Tensors of at least this size start at a page boundary in the data file,
#: so that runtimes can memory-map them.
_PAGE_ALIGN_FROM = 2**20
_PAGE = 4096


# ------------------------------------------------------------------ reading
def load_external_data(
    model: onnx.ModelProto, base: Path, map_from: int | None = None
) -> list[onnx.TensorProto]:
    """Resolve the model's external tensor data (in place).

    Every location is checked before any byte is read: it must be relative,
    stay inside ``base`` once symlinks are resolved, name a regular file, and
    its [offset, offset + length) range must lie inside that file and hold
    exactly the bytes the tensor's dims and type need.  Then tensors of at
    least ``map_from`` bytes (default ``mapped.MAP_FROM``) of a type numpy
    views natively stay in their file: their location becomes the file's
    absolute path, trusted in this process (``onnxtrain.io.mapped``), and their
    data is memory-mapped when used.  Smaller ones are read into the model
    (one read per tensor; their total must fit in this machine's memory).
    Returns the tensors it resolved (their data length is checked already)."""
    root = base.resolve()
    floor = mapped.MAP_FROM if map_from is None else map_from
    plan: list[tuple[onnx.TensorProto, Path, int, int]] = []
    for where, t in labelled_tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        plan.append((t, *_external_range(t, where, root)))
    keep = [p for p in plan if p[3] >= max(floor, 1) and mapped.mappable(p[0].data_type)]
    kept = {id(p[0]) for p in keep}
    read = [p for p in plan if id(p[0]) not in kept]
    total = sum(length for _, _, _, length in read)
    limit = memory_limit()
    if total > limit:
        raise TrainingModelError(
            f"the model's external data adds up to {total} bytes, more than this machine's "
            f"memory ({limit} bytes)"
        )
    for t, target, offset, length in keep:
        mapped.point(t, mapped.trust(target), offset, length)
    for t, target, offset, length in read:
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
    check_dims(t, where)
    expected = raw_bytes(t.data_type, element_count(t.dims))
    if expected is None:
        raise TrainingModelError(f"{where}: {data_type_name(t.data_type)} cannot be external data")
    if expected != length:
        raise TrainingModelError(
            f"{where}: external data holds {length} bytes, but dims {list(t.dims)} of "
            f"{data_type_name(t.data_type)} need {expected}"
        )
    return target, offset, length


# ------------------------------------------------------------------ spilling
#: Inline tensors (of at least ``mapped.MAP_FROM`` bytes each) adding up to this
#: many bytes are moved out of the protobuf at load time (``spill``).
SPILL_FROM = 2**28
_spill_lock = threading.Lock()
_spill_folder: list[Path] = []


def _spill_dir() -> Path:
    """This process's folder for spilled tensors: in /dev/shm (memory, no disk
    I/O) where it exists, else the temporary folder; removed at exit."""
    with _spill_lock:
        if not _spill_folder:
            base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            _spill_folder.append(process_folder(parent=base))
        return _spill_folder[0]


def spill(model: onnx.ModelProto, threshold: int | None = None) -> onnx.ModelProto | None:
    """A copy of ``model`` whose large inline tensors live in a spill file and
    are mapped like external data (``onnxtrain.io.mapped``), or None when they
    add up to less than ``threshold`` (``SPILL_FROM``).

    A model whose weights are inside its protobuf (most exporters' output
    under 2 GiB) would otherwise be copied by onnxruntime once per program,
    and prepacked once more; spilled, every program shares one copy.  The
    file lives in this process's spill folder (memory-backed /dev/shm where
    there is one) until the process exits.  ``model`` is not modified."""
    limit = SPILL_FROM if threshold is None else threshold

    def big(t: onnx.TensorProto) -> bool:
        return (t.data_location != onnx.TensorProto.EXTERNAL and mapped.mappable(t.data_type)
                and (stored_bytes(t) or 0) >= mapped.MAP_FROM)

    if sum(stored_bytes(t) or 0 for t in all_tensors(model) if big(t)) < max(limit, 1):
        return None
    try:
        folder = _spill_dir()
    except OSError:
        return None  # no folder to spill to (no /dev/shm, a temporary folder not writable): as it is
    name = f"spill-{secrets.token_hex(6)}.data"
    sink = _DataSink(name, mapped.MAP_FROM, select=big)
    try:
        with open(folder / name, "wb") as f:
            sink.file = f
            skeleton = _skeleton_model(model, sink)
    except OSError:
        unlink_quietly(folder / name)
        return None  # no room: the model stays as it is
    path = mapped.trust(folder / name)
    for t in all_tensors(skeleton):
        if t.data_location == onnx.TensorProto.EXTERNAL and mapped.source(t)[0] == name:
            _, offset, length = mapped.source(t)
            mapped.point(t, path, offset, length)
    return skeleton


def materialized(model: onnx.ModelProto, deferred: Mapping[str, mapped.Deferred] | None = None
                 ) -> onnx.ModelProto:
    """A copy of ``model`` with every placeholder (``onnxtrain.io.mapped``) holding
    its data inline, or ``model`` itself when it has none: a self-contained
    ModelProto, as any tool expects one."""
    if not _has_placeholders(model):
        return model
    return _skeleton_model(model, _DataSink("", None, deferred))


def came_external(model: onnx.ModelProto) -> bool:
    """Whether some tensor of ``model`` maps a model's external data (not a
    file of onnxtrain's own: ``spill``, ``hold``)."""
    own = tuple(str(f) + os.sep for f in (*_spill_folder, *_held_folder))
    return any(mapped.is_mapped(t) and not mapped.source(t)[0].startswith(own) for t in all_tensors(model))


# ------------------------------------------------------------------ writing
def external_data_threshold() -> int:
    """The auto-mode threshold in bytes: ``$ONNXTRAIN_EXTERNAL_DATA_THRESHOLD`` or 1.5 GiB."""
    text = os.environ.get(THRESHOLD_ENV, "").strip()
    if not text:
        return DEFAULT_EXTERNAL_DATA_THRESHOLD
    try:
        value = int(float(text))
    except ValueError:
        raise ValueError(f"{THRESHOLD_ENV}={text!r} is not a number of bytes") from None
    if value < 0:
        raise ValueError(f"{THRESHOLD_ENV}={text!r} must be >= 0")
    return value


def write_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    external_data: bool | None = None,
    threshold: int | None = None,
    min_tensor_bytes: int = DEFAULT_MIN_EXTERNAL_BYTES,
    deferred: Mapping[str, mapped.Deferred] | None = None,
) -> Path:
    """Serialize ``model`` to ``path`` atomically: temp file in the same folder, fsync, rename.

    ``external_data``: ``True`` writes every initializer and tensor attribute
    (Constant values) of at least ``min_tensor_bytes``, in every graph (main,
    training_info algorithm and initialization graphs, subgraphs), to a data
    file next to the model;
    ``False`` writes one self-contained file (which protobuf limits to 2 GiB);
    ``None`` (default) chooses external data when the model's tensor bytes
    exceed ``threshold`` (default: ``external_data_threshold()``) or some of
    its tensors are mapped from external data already.  Placeholders (``onnxtrain.io.mapped``) are streamed into the data file:
    mapped tensors are copied file to file, ``deferred`` values (keyed by
    their placeholder's location) chunk by chunk, so no tensor is copied into
    a protobuf message; in a self-contained file they are written inline.
    ``model`` is not modified.  Returns the model's path."""
    target = Path(path)
    refuse_special(target)
    deferred = deferred or {}
    # The path as given, not resolved: a symlink at ``path`` is replaced by the
    # new file (as ``mv`` would), and the temporary files live next to it.
    folder = Path(os.path.abspath(target)).parent
    folder.mkdir(parents=True, exist_ok=True)
    name = target.name
    remove_stale_temp_files(folder, name)
    if external_data is None:
        limit = external_data_threshold() if threshold is None else threshold
        # Data that came from external data (mapped) stays external.
        external_data = tensor_bytes(model, deferred) > limit or (
            isinstance(model, onnx.ModelProto) and came_external(model))
    if not external_data:
        model = materialized(model, deferred)
        replace_with(folder, name, _serialize(model, ""))
        _remove_old_data_files(folder, name, keep=_locations(model))
        return target

    data_name = f"{name}.{secrets.token_hex(4)}.data"
    sink = _DataSink(data_name, min_tensor_bytes, deferred)
    holder: list[onnx.ModelProto] = []

    def write_data(f: BinaryIO) -> None:
        sink.file = f
        holder.append(_skeleton_model(model, sink))

    # Data first, under its own fresh name: nothing refers to it until the
    # model rename below, which switches to the new model and data at once.
    data_tmp = write_temp(folder, data_name, write_data)
    try:
        skeleton = holder[0]
        if sink.offset == 0:  # nothing was large enough to go external
            os.unlink(data_tmp)
            data_tmp = None
        model_tmp = write_temp(folder, name, _serialize(skeleton, " even with external data"))
        try:
            if data_tmp is not None:
                os.replace(data_tmp, folder / data_name)
                data_tmp = None
            os.replace(model_tmp, folder / name)
        except BaseException:
            unlink_quietly(model_tmp)
            raise
    except BaseException:
        if data_tmp is not None:
            unlink_quietly(data_tmp)
        raise
    fsync_dir(folder)
    # The new files are onnxtrain's own: a later load may map them.
    _remove_old_data_files(folder, name, keep=_locations(skeleton))
    return target


def tensor_bytes(model: onnx.ModelProto, deferred: Mapping[str, mapped.Deferred] | None = None) -> int:
    """Bytes of tensor data a model holds, from dims and types (nothing is
    copied), placeholders (``onnxtrain.io.mapped``) included."""
    total = 0
    for t in all_tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            total += stored_bytes(t) or 0
        elif mapped.is_mapped(t):
            total += mapped.source(t)[2]
        elif deferred and (value := mapped.deferred_of(t, deferred)) is not None:
            total += value.nbytes
    return total


def _has_placeholders(model: onnx.ModelProto) -> bool:
    if not isinstance(model, onnx.ModelProto):
        return False  # a stand-in with its own serialization
    return any(mapped.is_mapped(t) or mapped.is_deferred(t) for t in all_tensors(model))


def _serialize(model: onnx.ModelProto, how: str) -> bytes:
    try:
        return model.SerializeToString()
    except (ValueError, EncodeError) as exc:  # protobuf refuses messages of 2 GiB or more
        raise TrainingModelError(
            f"cannot serialize the model{how}: {exc} (protobuf's limit is 2 GiB; "
            "write it with external_data=True)"
        ) from exc


def _locations(model: onnx.ModelProto) -> set[str]:
    """External data files a model refers to."""
    out = set()
    for t in all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            out.update(e.value for e in t.external_data if e.key == "location")
    return out


def _remove_old_data_files(folder: Path, name: str, keep: set[str]) -> None:
    """Data files of earlier writes to ``folder/name`` that the new model does not use.

    A file a live session of this process reads from (``mapped.hold``: a
    session loaded from an earlier checkpoint at this path maps its weights
    there) stays: removing it would break that session's next export and any
    program it compiles later.  A later write, once no session holds it,
    removes it."""
    pattern = re.compile(rf"^{re.escape(name)}\.[0-9a-f]{{8}}\.data$")
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.name not in keep and pattern.match(entry.name) and entry.is_file(
            follow_symlinks=False
        ) and not mapped.in_use(entry.path):
            unlink_quietly(entry.path)


# ----------------------------------------------------------- external data
class _DataSink:
    """Appends tensor bytes to the data file and says where they went.

    With ``min_bytes=None`` nothing goes to a file: placeholders are written
    inline (a self-contained model)."""

    def __init__(self, location: str, min_bytes: int | None,
                 deferred: Mapping[str, mapped.Deferred] | None = None,
                 select: Callable[[onnx.TensorProto], bool] | None = None) -> None:
        self.location = location
        self.min_bytes = min_bytes
        self.select = select
        self.deferred = dict(deferred or {})
        #: Inside an initialization graph (``_skeleton_model`` sets it; ``hold`` reads it).
        self.cold = False
        self.file: BinaryIO | None = None
        self.offset = 0
        #: (path, offset, length) of a mapped range -> its offset in the data file.
        self.copied: dict[tuple[str, int, int], int] = {}

    def placeholder(self, t: onnx.TensorProto) -> bool:
        return mapped.is_mapped(t) or mapped.is_deferred(t)

    def wants(self, t: onnx.TensorProto) -> bool:
        """Whether ``t`` must be rewritten: a placeholder, or data large enough for the file."""
        if self.placeholder(t):
            return True
        if t.data_location == onnx.TensorProto.EXTERNAL or self.min_bytes is None:
            return False  # already-external ones stay as they are
        if self.select is not None and not self.select(t):
            return False
        size = stored_bytes(t)
        return size is not None and size >= max(self.min_bytes, 1)  # strings cannot be external

    def streams(self, t: onnx.TensorProto) -> bool:
        """Whether a placeholder goes to the data file (else it is written inline)."""
        return self.min_bytes is not None and self._length(t) >= max(self.min_bytes, 1)

    def _length(self, t: onnx.TensorProto) -> int:
        if mapped.is_mapped(t):
            return mapped.source(t)[2]
        return self._deferred(t).nbytes

    def _deferred(self, t: onnx.TensorProto) -> mapped.Deferred:
        value = mapped.deferred_of(t, self.deferred)
        if value is None:
            raise ValueError(f"tensor {t.name!r}: no value for deferred placeholder")
        return value

    def inline(self, t: onnx.TensorProto) -> bytes:
        """A placeholder's bytes, for a tensor written inline."""
        if mapped.is_mapped(t):
            return np.ascontiguousarray(mapped.array(t)).tobytes()
        return np.ascontiguousarray(self._deferred(t).value()).tobytes()

    def _align(self, size: int) -> int:
        align = _PAGE if size >= _PAGE_ALIGN_FROM else 64
        pad = -self.offset % align
        if pad:
            self.file.write(b"\0" * pad)
            self.offset += pad
        return self.offset

    def write(self, t: onnx.TensorProto) -> tuple[str, int, int]:
        """Append ``t``'s bytes: (location, offset, length) of where they went."""
        if self.placeholder(t):
            return (self.location, *self._stream(t))
        data = _tensor_data(t)
        start = self._align(len(data))
        self.file.write(data)
        self.offset += len(data)
        return self.location, start, len(data)

    def _stream(self, t: onnx.TensorProto) -> tuple[int, int]:
        """A placeholder's bytes into the file without a protobuf copy: a
        mapped range file to file (copy_file_range where the OS has it), a
        deferred value chunk by chunk."""
        length = self._length(t)
        if mapped.is_mapped(t):
            # A range written already (a weight and its starting value) is shared.
            key = mapped.source(t)
            if key in self.copied:
                return self.copied[key], length
            start = self.copied[key] = self._align(length)
            _copy_range(key[0], key[1], length, self.file)
        else:
            start = self._align(length)
            written = 0
            for chunk in self._deferred(t).chunks():
                self.file.write(chunk)
                written += len(chunk)
            if written != length:
                raise ValueError(f"tensor {t.name!r}: its value gave {written} of {length} bytes")
        self.offset += length
        return start, length


def _copy_range(path: str, offset: int, length: int, out: BinaryIO) -> None:
    """Append ``length`` bytes of ``path`` from ``offset`` to the open file ``out``."""
    out.flush()
    fd = out.fileno()
    with open(path, "rb", buffering=0) as src:
        left, pos = length, offset
        fast = hasattr(os, "copy_file_range")
        while left:
            n = 0
            if fast:
                try:
                    n = os.copy_file_range(src.fileno(), fd, min(left, 2**30), pos)
                except OSError:
                    fast = False  # another file system, or an old kernel: copy through memory
            if not fast:
                src.seek(pos)
                block = src.read(min(left, mapped.CHUNK_BYTES))
                n = os.write(fd, block) if block else 0
            if n <= 0:
                raise TrainingModelError(f"external data {path!r} ended before its range did")
            left -= n
            pos += n
    out.seek(0, os.SEEK_END)


def _skeleton_model(model: onnx.ModelProto, sink: _DataSink) -> onnx.ModelProto:
    """A copy of ``model`` whose large initializers (every graph) live in ``sink``."""
    out = onnx.ModelProto()
    copy_fields(model, out, ("graph", "training_info"))
    if model.HasField("graph"):
        _skeleton_graph(model.graph, out.graph, sink)
    for ti in model.training_info:
        new = out.training_info.add()
        copy_fields(ti, new, ("initialization", "algorithm"))
        for field in ("initialization", "algorithm"):
            if ti.HasField(field):
                sink.cold = field == "initialization"
                _skeleton_graph(getattr(ti, field), getattr(new, field), sink)
                sink.cold = False
    return out


def _skeleton_graph(src: onnx.GraphProto, dst: onnx.GraphProto, sink: _DataSink) -> None:
    """Copy ``src`` into ``dst`` with large initializers and tensor attributes external."""
    copy_fields(src, dst, ("initializer", "node"))
    for t in src.initializer:
        _put_tensor(t, dst.initializer.add(), sink)
    for n in src.node:
        new = dst.node.add()
        if not any(_attribute_goes_external(a, sink) for a in n.attribute):
            new.CopyFrom(n)
            continue
        copy_fields(n, new, ("attribute",))
        for a in n.attribute:
            _skeleton_attribute(a, new.attribute.add(), sink)


#: attribute type -> the field holding its graph(s) or tensor(s)
_ITEM_FIELDS = {
    onnx.AttributeProto.GRAPH: "g",
    onnx.AttributeProto.GRAPHS: "graphs",
    onnx.AttributeProto.TENSOR: "t",
    onnx.AttributeProto.TENSORS: "tensors",
}


def _skeleton_attribute(a: onnx.AttributeProto, dst: onnx.AttributeProto, sink: _DataSink) -> None:
    """``dst`` = ``a``, with its graphs skeletonized and its large tensors in the sink."""
    field = _ITEM_FIELDS.get(a.type)
    if field is None:
        dst.CopyFrom(a)
        return
    copy_fields(a, dst, (field,))
    graphs = a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    copy = _skeleton_graph if graphs else _put_tensor
    if a.type in (onnx.AttributeProto.GRAPHS, onnx.AttributeProto.TENSORS):
        for item in getattr(a, field):
            copy(item, getattr(dst, field).add(), sink)
    else:
        copy(getattr(a, field), getattr(dst, field), sink)


def _attribute_goes_external(a: onnx.AttributeProto, sink: _DataSink) -> bool:
    """Whether an attribute holds a graph (walked) or a tensor large enough for the data file."""
    if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return True
    if a.type == onnx.AttributeProto.TENSOR:
        return sink.wants(a.t)
    if a.type == onnx.AttributeProto.TENSORS:
        return any(sink.wants(t) for t in a.tensors)
    return False


def _put_tensor(t: onnx.TensorProto, dst: onnx.TensorProto, sink: _DataSink) -> None:
    """``dst`` = ``t``, its bytes in the data file if it is large enough."""
    if not sink.wants(t):
        dst.CopyFrom(t)
        return
    copy_fields(t, dst, _DATA_FIELDS)
    if sink.placeholder(t) and not sink.streams(t):
        dst.raw_data = sink.inline(t)
        return
    _point(dst, *sink.write(t))


_A = onnx.AttributeProto
#: A tensor's fields that hold its data, or say where it is.
_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "string_data", "int64_data",
                "double_data", "uint64_data", "external_data", "data_location")


def _point(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """``t`` (its data fields empty) points at ``length`` bytes of ``location`` from ``offset``."""
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        t.external_data.add(key=key, value=str(value))


def _held_in_place(model: onnx.ModelProto, sink: _HoldSink) -> list[tuple]:
    """What ``_skeleton_model`` does, without a copy: each tensor of ``model``
    that ``sink`` wants is written, and returned with where it went (to be
    pointed there once every write is done: a failed one changes nothing)."""
    moved: list[tuple] = []
    for graph, cold in [(model.graph, False)] + [(getattr(ti, f), f == "initialization") for ti in model.training_info
                                                 for f in ("initialization", "algorithm") if ti.HasField(f)]:
        sink.cold = cold
        for g in graphs_within([graph]):  # (the tensors _skeleton_graph puts: sparse ones stay)
            held = [a for n in g.node for a in n.attribute if a.type in (_A.TENSOR, _A.TENSORS)]
            tensors = [*g.initializer, *(t for a in held for t in ([a.t] if a.type == _A.TENSOR else a.tensors))]
            moved += [(t, *sink.write(t)) for t in tensors if sink.wants(t)]
    sink.cold = False
    return moved


def _tensor_data(t: onnx.TensorProto) -> bytes:
    """The bytes of an inline tensor as raw data (one copy of it)."""
    if t.HasField("raw_data"):
        return t.raw_data
    return numpy_helper.from_array(numpy_helper.to_array(t)).raw_data


# ------------------------------------------------------------------ holding
#: Inline tensors of at least this many bytes leave a session's model (``hold``).
HOLD_FROM = mapped.MAP_FROM
_held_folder: list[Path] = []


def _held_dir() -> Path:
    """This process's folder for held starting values: the temporary folder
    (on disk, whose pages the system may reclaim); removed at exit."""
    with _spill_lock:
        if not _held_folder:
            _held_folder.append(process_folder("held").resolve())
        return _held_folder[0]


def hold(model: onnx.ModelProto, state: Container[str], given: Mapping[int, tuple] | None = None,
         in_place: bool = False) -> onnx.ModelProto | None:
    """A copy of ``model`` with no tensor of ``HOLD_FROM`` bytes or more in its
    protobuf, or None when it has none (placeholders stay as they are).

    ``given``: by ``id``, (tensor it ``holds`` without raw_data, its bytes or array), held from there.
    ``in_place``: ``model`` itself is changed and returned, not copied (a model nobody else holds).
    - The frozen tensors (initializers of the main graph and of the
      algorithms that are not in ``state``, and Constant values there),
      which programs read at every run, go to one file in memory
      (``/dev/shm`` where there is one, as ``spill``).
    - The starting values (initializers in ``state`` and whatever the
      initialization graphs hold), which the state store maps copy-on-write
      (``mapped.private``) and then only ``initialize()`` reads, go to a
      temporary file on disk, whose pages the system may reclaim.

    Each becomes a mapped placeholder (``onnxtrain.io.mapped``): the session,
    every program and onnxruntime then share one copy, and no protobuf
    holds another.  Equal tensors (a builder's starting value of a weight
    and the weight itself) are written once.  A file is removed when the
    last session holding it (``mapped.hold``) lets go, or at exit.  Where no
    file can be written, the model stays as it is (None)."""
    if not given and not any(holds(t) for t in all_tensors(model)):
        return None  # (no copy made to find that out)
    for memory in (_spill_dir, _held_dir):
        sink = _HoldSink(state, memory, given or {})
        try:
            moved = _held_in_place(model, sink) if in_place else None
            skeleton = model if in_place else _skeleton_model(model, sink)
            sink.close()
        except OSError:  # no room (a small /dev/shm): everything on disk, or nothing
            sink.close(remove=True)
            continue
        if not sink.files:
            return None
        for t, *where in moved or ():
            for field in _DATA_FIELDS:
                t.ClearField(field)
            _point(t, *where)
        for held in sink.files.values():
            mapped.own(mapped.trust(held.path))
        return skeleton
    return None


def holds(t: onnx.TensorProto) -> bool:
    """Whether ``hold`` moves ``t`` to a file (its data, or the data given for it)."""
    return (t.data_location != onnx.TensorProto.EXTERNAL and mapped.mappable(t.data_type)
            and (stored_bytes(t) or 0) >= HOLD_FROM)


class _HeldFile:
    """A file of held tensors (``hold``), each written once."""

    def __init__(self, folder: Path) -> None:
        self.path = str(folder.resolve() / f"held-{secrets.token_hex(8)}.data")
        self.file = open(self.path, "wb+")
        self.offset = 0
        #: (type, dims, length) -> (offset, the data given for it or None) of tensors written with them.
        self.written: dict[tuple, list[tuple[int, Any]]] = {}

    def put(self, t: onnx.TensorProto, given: Any = None) -> tuple[int, int]:
        """Where ``t`` (its data: ``given``, else its own) is in the file."""
        data = _tensor_data(t) if given is None else given
        if not isinstance(data, bytes):
            data = memoryview(np.ascontiguousarray(data)).cast("B")
        size = len(data)
        key = (t.data_type, tuple(t.dims), size)
        for start, before in self.written.get(key, ()):
            if (given is not None and before is given) or self._holds(start, data):
                return start, size
        pad = -self.offset % _PAGE
        if pad:
            self.file.write(b"\0" * pad)
        self.file.write(data)  # (not joined to the padding: one copy of a large tensor fewer)
        start = self.offset + pad
        self.offset = start + size
        self.written.setdefault(key, []).append((start, given))
        return start, size

    def _holds(self, start: int, data: bytes) -> bool:
        """Whether the file holds ``data`` at ``start``, compared
        in pieces through a map of the file, the first of one page: weights of
        one shape differ there already.  (Read into bytes, each piece of a
        large tensor was fresh memory, slower than the write.)"""
        self.file.flush()
        skip = start % mmap.ALLOCATIONGRANULARITY  # (a map starts at a multiple of it: 64 KiB on Windows)
        with mmap.mmap(self.file.fileno(), skip + len(data), offset=start - skip, access=mmap.ACCESS_READ) as held:
            ours, theirs = np.frombuffer(held, np.uint8, len(data), skip), np.frombuffer(data, np.uint8)
            try:
                at, step = 0, _PAGE
                while at < len(data):
                    if not np.array_equal(ours[at:at + step], theirs[at:at + step]):
                        return False
                    at, step = at + step, 2**20
                return True
            finally:
                del ours  # (the map closes only once no array reads it)


class _HoldSink(_DataSink):
    """Where ``hold`` puts each tensor: frozen ones in memory, starting values on disk."""

    def __init__(self, state: Container[str], memory: Callable[[], Path], given: Mapping[int, tuple]) -> None:
        super().__init__("", HOLD_FROM)
        self.state = state
        self.memory = memory
        self.given = given
        self.files: dict[bool, _HeldFile] = {}

    def placeholder(self, t: onnx.TensorProto) -> bool:
        return False  # placeholders stay as they are

    def wants(self, t: onnx.TensorProto) -> bool:
        return holds(t)

    def write(self, t: onnx.TensorProto) -> tuple[str, int, int]:
        cold = self.cold or t.name in self.state
        held = self.files.get(cold)
        if held is None:
            held = self.files[cold] = _HeldFile(_held_dir() if cold else self.memory())
        entry = self.given.get(id(t))
        return (held.path, *held.put(t, entry[1] if entry is not None and entry[0] is t else None))

    def close(self, remove: bool = False) -> None:
        for held in self.files.values():
            held.file.close()
            if remove:
                unlink_quietly(Path(held.path))
