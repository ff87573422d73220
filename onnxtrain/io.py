"""Writing models to disk: atomically, and (for large models) with external data.

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

import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import onnx
from google.protobuf.message import EncodeError
from onnx import numpy_helper

from .errors import TrainingModelError

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
#: Temporary files older than this are stale even if their pid seems alive.
STALE_TEMP_SECONDS = 24 * 3600


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
) -> Path:
    """Serialize ``model`` to ``path`` atomically: temp file in the same folder, fsync, rename.

    ``external_data``: ``True`` writes every initializer and tensor attribute
    (Constant values) of at least ``min_tensor_bytes``, in every graph (main,
    training_info algorithm and initialization graphs, subgraphs), to a data
    file next to the model;
    ``False`` writes one self-contained file (which protobuf limits to 2 GiB);
    ``None`` (default) chooses external data when the model's tensor bytes
    exceed ``threshold`` (default: ``external_data_threshold()``).
    ``model`` is not modified.  Returns the model's path."""
    target = Path(path)
    # The path as given, not resolved: a symlink at ``path`` is replaced by the
    # new file (as ``mv`` would), and the temporary files live next to it.
    folder = Path(os.path.abspath(target)).parent
    folder.mkdir(parents=True, exist_ok=True)
    name = target.name
    remove_stale_temp_files(folder, name)
    if external_data is None:
        limit = external_data_threshold() if threshold is None else threshold
        external_data = tensor_bytes(model) > limit
    if not external_data:
        _atomic_write(folder, name, _serialize(model, ""))
        _remove_old_data_files(folder, name, keep=_locations(model))
        return target

    data_name = f"{name}.{secrets.token_hex(4)}.data"
    sink = _DataSink(data_name, min_tensor_bytes)
    holder: list[onnx.ModelProto] = []

    def write_data(f: BinaryIO) -> None:
        sink.file = f
        holder.append(_skeleton_model(model, sink))

    # Data first, under its own fresh name: nothing refers to it until the
    # model rename below, which switches to the new model and data at once.
    data_tmp = _write_temp(folder, data_name, write_data)
    try:
        skeleton = holder[0]
        if sink.offset == 0:  # nothing was large enough to go external
            os.unlink(data_tmp)
            data_tmp = None
        model_tmp = _write_temp(folder, name, _serialize(skeleton, " even with external data"))
        try:
            if data_tmp is not None:
                os.replace(data_tmp, folder / data_name)
                data_tmp = None
            os.replace(model_tmp, folder / name)
        except BaseException:
            _unlink(model_tmp)
            raise
    except BaseException:
        if data_tmp is not None:
            _unlink(data_tmp)
        raise
    _fsync_dir(folder)
    _remove_old_data_files(folder, name, keep=_locations(skeleton))
    return target


def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes of tensor data a model holds, from dims and types (nothing is copied)."""
    total = 0
    for t in _every_tensor(model):
        bits = _BITS.get(t.data_type)
        if bits is None or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        n = 1
        for d in t.dims:
            n *= max(int(d), 0)
        total += (n * bits + 7) // 8
    return total


# ------------------------------------------------------------ atomic files
def _serialize(model: onnx.ModelProto, how: str) -> bytes:
    try:
        return model.SerializeToString()
    except (ValueError, EncodeError) as exc:  # protobuf refuses messages of 2 GiB or more
        raise TrainingModelError(
            f"cannot serialize the model{how}: {exc} (protobuf's limit is 2 GiB; "
            "write it with external_data=True)"
        ) from exc


def _atomic_write(folder: Path, name: str, data: bytes) -> None:
    tmp = _write_temp(folder, name, data)
    try:
        os.replace(tmp, folder / name)
    except BaseException:
        _unlink(tmp)
        raise
    _fsync_dir(folder)


def _write_temp(
    folder: Path, name: str, content: bytes | Callable[[BinaryIO], object]
) -> str:
    """A fully written and fsynced temporary file for ``folder / name``; returns its path.

    ``content``: the bytes, or a function that writes them to the open file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.{os.getpid()}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _fsync_dir(folder: Path) -> None:
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def _unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _umask() -> int:
    """The process umask, read without changing it (Linux); 0o022 elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _temp_pattern(name: str) -> re.Pattern:
    data = r"(?:\.[0-9a-f]{8}\.data)?"
    return re.compile(rf"^\.{re.escape(name)}{data}\.(?:(\d+)\.)?[A-Za-z0-9_]+\.tmp$")


def remove_stale_temp_files(folder: str | os.PathLike, name: str) -> list[str]:
    """Remove temporary files that interrupted writes of ``folder/name`` left.

    A temporary file is stale when the process that wrote it (its pid is in
    the name) is gone, or when it is older than a day.  Returns the removed
    names.  Files of live writers are kept, so concurrent exports of other
    paths in the same folder are never disturbed."""
    pattern = _temp_pattern(name)
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        m = pattern.match(entry.name)
        if not m or not entry.is_file(follow_symlinks=False):
            continue
        pid = int(m.group(1)) if m.group(1) else None
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS
        except OSError:
            continue
        if old or (pid is not None and not _pid_alive(pid)):
            try:
                os.unlink(entry.path)
                removed.append(entry.name)
            except OSError:
                pass
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def _locations(model: onnx.ModelProto) -> set[str]:
    """External data files a model refers to."""
    out = set()
    for t in _every_tensor(model):
        if t.data_location == _T.EXTERNAL:
            out.update(e.value for e in t.external_data if e.key == "location")
    return out


def _remove_old_data_files(folder: Path, name: str, keep: set[str]) -> None:
    """Data files of earlier writes to ``folder/name`` that the new model does not use."""
    pattern = re.compile(rf"^{re.escape(name)}\.[0-9a-f]{{8}}\.data$")
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.name not in keep and pattern.match(entry.name) and entry.is_file(
            follow_symlinks=False
        ):
            _unlink(entry.path)


# ----------------------------------------------------------- external data
_T = onnx.TensorProto
_BITS = {
    _T.FLOAT: 32, _T.UINT8: 8, _T.INT8: 8, _T.UINT16: 16, _T.INT16: 16, _T.INT32: 32,
    _T.INT64: 64, _T.BOOL: 8, _T.FLOAT16: 16, _T.DOUBLE: 64, _T.UINT32: 32, _T.UINT64: 64,
    _T.COMPLEX64: 64, _T.COMPLEX128: 128, _T.BFLOAT16: 16,
}
for _name, _bits in (
    ("FLOAT8E4M3FN", 8), ("FLOAT8E4M3FNUZ", 8), ("FLOAT8E5M2", 8), ("FLOAT8E5M2FNUZ", 8),
    ("FLOAT8E8M0", 8), ("UINT4", 4), ("INT4", 4), ("FLOAT4E2M1", 4), ("UINT2", 2), ("INT2", 2),
):
    if _name in _T.DataType.keys():
        _BITS[_T.DataType.Value(_name)] = _bits


def _every_tensor(model: onnx.ModelProto) -> Iterable[onnx.TensorProto]:
    """Initializers, sparse parts and attribute tensors of every graph."""
    graphs = [model.graph] if model.HasField("graph") else []
    for ti in model.training_info:
        graphs += [g for f, g in (("initialization", ti.initialization),
                                  ("algorithm", ti.algorithm)) if ti.HasField(f)]
    while graphs:
        g = graphs.pop()
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
                elif a.type == onnx.AttributeProto.GRAPH:
                    graphs.append(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    graphs.extend(a.graphs)


class _DataSink:
    """Appends tensor bytes to the data file and says where they went."""

    def __init__(self, location: str, min_bytes: int) -> None:
        self.location = location
        self.min_bytes = min_bytes
        self.file: BinaryIO | None = None
        self.offset = 0

    def wants(self, t: onnx.TensorProto) -> bool:
        bits = _BITS.get(t.data_type)
        if bits is None or t.data_location == _T.EXTERNAL:
            return False  # strings cannot be external; already-external ones stay as they are
        n = 1
        for d in t.dims:
            n *= max(int(d), 0)
        return (n * bits + 7) // 8 >= max(self.min_bytes, 1)

    def write(self, t: onnx.TensorProto) -> tuple[int, int]:
        if t.HasField("raw_data"):
            data = t.raw_data  # one copy of this tensor, released below
        else:
            data = numpy_helper.from_array(numpy_helper.to_array(t)).raw_data
        align = _PAGE if len(data) >= _PAGE_ALIGN_FROM else 64
        pad = -self.offset % align
        if pad:
            self.file.write(b"\0" * pad)
            self.offset += pad
        start = self.offset
        self.file.write(data)
        self.offset += len(data)
        return start, len(data)


def _copy_fields(src, dst, skip: tuple[str, ...]) -> None:
    """Copy every set field of ``src`` into ``dst`` except those in ``skip``."""
    for fd in src.DESCRIPTOR.fields:
        name = fd.name
        if name in skip:
            continue
        value = getattr(src, name)
        if _is_repeated(fd):
            if len(value):
                getattr(dst, name).extend(value)
        elif src.HasField(name):
            if fd.message_type is not None:
                getattr(dst, name).CopyFrom(value)
            else:
                setattr(dst, name, value)


def _is_repeated(fd) -> bool:
    is_repeated = getattr(fd, "is_repeated", None)  # protobuf >= 5.28
    if is_repeated is not None:
        return bool(is_repeated)
    return fd.label == fd.LABEL_REPEATED


def _skeleton_model(model: onnx.ModelProto, sink: _DataSink) -> onnx.ModelProto:
    """A copy of ``model`` whose large initializers (every graph) live in ``sink``."""
    out = onnx.ModelProto()
    _copy_fields(model, out, ("graph", "training_info"))
    if model.HasField("graph"):
        _skeleton_graph(model.graph, out.graph, sink)
    for ti in model.training_info:
        new = out.training_info.add()
        _copy_fields(ti, new, ("initialization", "algorithm"))
        for field in ("initialization", "algorithm"):
            if ti.HasField(field):
                _skeleton_graph(getattr(ti, field), getattr(new, field), sink)
    return out


def _skeleton_graph(src: onnx.GraphProto, dst: onnx.GraphProto, sink: _DataSink) -> None:
    """Copy ``src`` into ``dst`` with large initializers and tensor attributes external."""
    _copy_fields(src, dst, ("initializer", "node"))
    for t in src.initializer:
        _put_tensor(t, dst.initializer.add(), sink)
    for n in src.node:
        new = dst.node.add()
        if not any(_attribute_goes_external(a, sink) for a in n.attribute):
            new.CopyFrom(n)
            continue
        _copy_fields(n, new, ("attribute",))
        for a in n.attribute:
            na = new.attribute.add()
            if a.type == onnx.AttributeProto.GRAPH:
                _copy_fields(a, na, ("g",))
                _skeleton_graph(a.g, na.g, sink)
            elif a.type == onnx.AttributeProto.GRAPHS:
                _copy_fields(a, na, ("graphs",))
                for g in a.graphs:
                    _skeleton_graph(g, na.graphs.add(), sink)
            elif a.type == onnx.AttributeProto.TENSOR:
                _copy_fields(a, na, ("t",))
                _put_tensor(a.t, na.t, sink)
            elif a.type == onnx.AttributeProto.TENSORS:
                _copy_fields(a, na, ("tensors",))
                for t in a.tensors:
                    _put_tensor(t, na.tensors.add(), sink)
            else:
                na.CopyFrom(a)


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
    _copy_fields(t, dst, ("raw_data", "float_data", "int32_data", "string_data", "int64_data",
                          "double_data", "uint64_data", "external_data", "data_location"))
    offset, length = sink.write(t)
    dst.data_location = _T.EXTERNAL
    for key, value in (("location", sink.location), ("offset", offset), ("length", length)):
        dst.external_data.add(key=key, value=str(value))
