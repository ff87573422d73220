"""On-disk caches that make a session's construction and first step cheap
(docs/startup.md).

Three kinds of entries live under ``<cache dir>/startup/`` (the directory of
``onnxtrain.kernels.cache_dir()``: ``$ONNXTRAIN_CACHE_DIR``, else
``$XDG_CACHE_HOME/onnxtrain``, else ``~/.cache/onnxtrain``):

- ``infer-*``: the answer of ``graph.infer_types`` (onnx shape inference
  plus onnxtrain's rank propagation): element types and shapes.  Keyed by
  the exact bytes it hands onnx, what else it reads (every initializer's
  type and dims, the small ones' values) and the onnx build.  Every call
  goes through it: the builder's, validation's, the passes'.
- ``program-*``: a lowered inference or training-algorithm program
  (``programs.py``): the model the pipeline of ``passes.py`` made, and the
  fused-kernel rewrite of it (``fuse.with_fused_kernels``).  Keyed by the
  training model's *skeleton* (the model bytes with the data of its state
  variables left out: names, types and dims stay; the initialization graphs
  left out: see ``model_digest``), the program's label, onnxtrain's code
  (``code_digest``: every source file; ``runtime_digest``: the gradient
  rules registered and the constants of the lowering modules as they are
  now) and the onnx, onnxruntime and protobuf versions.  Lowering these
  programs never reads a state variable's value (state variables become
  graph inputs before any pass runs) nor an initialization graph, so a
  checkpoint of the same model finds the entries its initial version wrote.
- ``ort-*``: onnxruntime's own optimized form of a program (its graph
  optimizations up to ORT_ENABLE_EXTENDED, saved by onnxruntime with
  ``optimized_model_filepath``), which loads faster; loading it applies the
  session's optimizations again, which find those already done.  Keyed by
  the exact model bytes, the optimization level, the custom-op library, the
  onnxruntime build and the CPU.  Made with options of its own, never the
  caller's, and only for sessions on the CPU provider whose options restrict
  no graph rewrite (``ORT_GRAPH_CONFIG_KEYS``).

Safety:

- writes are atomic (a temporary file in the same folder, fsync, rename) and
  racing writers of one key write the same bytes; they run on a background
  thread (``flush`` waits for them; so does interpreter exit, for up to 5 s),
  and the optimized onnxruntime models are made there ``ORT_DELAY`` seconds
  after the miss (or at exit), off the first step's path;
- every read is verified: a magic line, the full key (not only the file
  name), and the SHA-256 of the payload; an entry that fails any check, does
  not parse or that onnxruntime refuses is deleted and rebuilt, never used;
- a cache that cannot be read or written (permissions, full disk) is a miss,
  never an error, and a model error is never cached: a program is stored
  only after it was built;
- no entry is over ``MAX_ENTRY_BYTES`` (models with more frozen weights
  than that are not cached), and the cache holds at most ``MAX_ENTRIES``
  entries: a write past that deletes the least recently used ones (a hit
  touches its entry).

``ONNXTRAIN_PROGRAM_CACHE=0`` (or ``false``/``no``/``off``) turns all three
off: nothing is read or written.  The fused-kernel library (``kernels``) has
its own switch.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import struct
import sys
import tempfile
import threading
import time
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import onnx

ENV = "ONNXTRAIN_PROGRAM_CACHE"
#: Bump when the entry layout or the meaning of a key changes.
FORMAT = 3
MAGIC = b"onnxtrain-startup-cache\n"
#: Entries kept (each a few KB to a few hundred KB); older ones go first.
MAX_ENTRIES = 2000
#: No entry is larger: models with more non-state data (frozen weights) than
#: this are not cached (their programs would copy the weights to disk).
MAX_ENTRY_BYTES = 64 << 20

_HEADER = struct.Struct("<32s32sII")  # key, sha256(meta + payload), len(meta), len(payload)

_lock = threading.Lock()
_code_digest: bytes | None = None
_onnx_digest: bytes | None = None
#: Hits and misses by kind, for tests and docs/startup.md.
stats: dict[str, int] = {}
_stats_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def directory() -> Path:
    from .kernels import cache_dir

    return cache_dir() / "startup"


def _count(what: str) -> None:
    with _stats_lock:
        stats[what] = stats.get(what, 0) + 1


# ------------------------------------------------------------------ keys
def _onnx_build() -> bytes:
    """The onnx build shape inference runs in: its version and its C extension."""
    global _onnx_digest
    if _onnx_digest is None:
        h = hashlib.sha256(f"onnx {onnx.__version__} format {FORMAT}\n".encode())
        ext = sys.modules.get("onnx.onnx_cpp2py_export")
        path = getattr(ext, "__file__", None)
        if path:
            try:
                st = os.stat(path)
                h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:
                pass
        _onnx_digest = h.digest()
    return _onnx_digest


def code_digest() -> bytes:
    """Digest of what a lowered program depends on besides the model: every
    onnxtrain source file (and the kernel source), and the versions of onnx,
    onnxruntime and protobuf.  A file is identified by its path, size, inode
    and modification and change times: any write to it changes its change
    time (``st_ctime``, which no tool can set back), so an edited, replaced
    or reinstalled file is a new key, at the cost of a stat, not a read."""
    global _code_digest
    if _code_digest is None:
        import google.protobuf
        import onnxruntime

        from . import __version__
        from .executor import MAX_IR_VERSION

        h = hashlib.sha256(_onnx_build())
        h.update(f"onnxtrain {__version__} onnxruntime {onnxruntime.__version__} "
                 f"protobuf {google.protobuf.__version__} ir {MAX_IR_VERSION}\n".encode())
        root = str(Path(__file__).resolve().parent)
        for path, st in sorted(_sources(root)):
            h.update(f"{path[len(root):]}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0"
                     f"{st.st_ctime_ns}\n".encode())
        _code_digest = h.digest()
    return _code_digest


#: The modules whose state lowering reads (their source is in ``code_digest``;
#: ``runtime_digest`` covers what was changed since they were imported).
_LOWERING_MODULES = ("onnxtrain.passes", "onnxtrain.programs", "onnxtrain.graph", "onnxtrain.combine",
                     "onnxtrain.names", "onnxtrain.emitter", "onnxtrain.fuse", "onnxtrain.split",
                     "onnxtrain.model", "onnxtrain.tensors", "onnxtrain.executor", "onnxtrain.optim",
                     "onnxtrain.autodiff")


def runtime_digest() -> bytes:
    """Digest of what lowering reads besides its source files, as it is now:
    every gradient rule registered (``onnxtrain.autodiff.vjp`` and friends,
    user rules by their code), and the module-level constants and tables of
    the lowering modules (a test or a user may have replaced one; replacing a
    module's function is not seen)."""
    h = hashlib.sha256(b"runtime\n")
    names = sorted(n for n in list(sys.modules)
                   if n.startswith(_LOWERING_MODULES) and n.split(".")[1] in _SHORT_NAMES)
    for name in names:
        h.update(_module_digest(name))
    registry = sys.modules.get("onnxtrain.autodiff.registry")
    if registry is not None:
        for rule in registry.REGISTRY.rules():
            h.update(f"\nrule {rule.domain} {rule.op_type} {rule.kind} {rule.reason!r} "
                     f"{sorted(rule.nondiff)} {_describe(rule.fn, 0)}".encode())
    return h.digest()


def _module_digest(name: str) -> bytes:
    """A module's constants and tables as they are now (their functions by
    name; a module's own functions are its source, hashed by code_digest)."""
    d = getattr(sys.modules.get(name), "__dict__", None) or {}
    parts = [name]
    for k, v in list(d.items()):
        if type(v) in _DESCRIBED and k[:2] != "__":
            parts.append(f"{k}={_describe(v, 2)}")
    return "\n".join(sorted(parts)).encode()


_SHORT_NAMES = frozenset(n.split(".")[1] for n in _LOWERING_MODULES)
_SCALARS = (int, float, str, bytes, bool, type(None))
_DESCRIBED = frozenset((*_SCALARS, tuple, frozenset, list, set, dict))


def _describe(v: Any, depth: int) -> str | None:
    """A deterministic description of a module-level value (None: not described)."""
    t = type(v)
    if t in _SCALARS:
        return repr(v)
    memo = _memo.get(id(v))
    if memo is not None and memo[0] is v:
        return memo[1]
    if t is types.FunctionType:
        mod = v.__module__ or ""
        if mod.startswith("onnxtrain.") or mod == "onnxtrain":
            desc = f"{mod}.{v.__qualname__}"
        else:
            desc = f"{mod}.{v.__qualname__}#{_code_of(v.__code__)}"
        return _remember(v, desc)
    if isinstance(v, type):
        return _remember(v, f"{v.__module__}.{v.__qualname__}")
    if t is types.ModuleType:
        return None
    if depth <= 0:
        return t.__qualname__
    if t in (tuple, frozenset):
        items = [_describe(x, depth - 1) for x in v]
        if t is frozenset:
            items.sort(key=str)
        desc = ("(" if t is tuple else "{") + ",".join(map(str, items)) + (")" if t is tuple else "}")
        # immutable all the way down (scalars, functions, classes): remembered
        if all(type(x) in _SCALARS or type(x) is types.FunctionType or isinstance(x, type) for x in v):
            _remember(v, desc)
        return desc
    if t is list:
        return "[" + ",".join(str(_describe(x, depth - 1)) for x in v) + "]"
    if t is set:
        return "{" + ",".join(sorted(str(_describe(x, depth - 1)) for x in v)) + "}"
    if t is dict and 0 < len(v) <= 256 and all(type(k) in (str, int) for k in v):
        # tables (op -> function, ...); not runtime caches, whose keys are objects' ids
        return "{" + ",".join(sorted(f"{k!r}:{_describe(x, depth - 1)}" for k, x in v.items())) + "}"
    return t.__qualname__


#: Descriptions of immutable values, by id (the value is kept, so the id stays its own).
_memo: dict[int, tuple[Any, str]] = {}


def _remember(v: Any, desc: str) -> str:
    _memo[id(v)] = (v, desc)
    return desc


def _code_of(code: types.CodeType) -> str:
    """The code of a function defined outside onnxtrain (its source is not hashed)."""
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        h.update((_code_of(c) if isinstance(c, types.CodeType) else repr(c)).encode())
    return h.hexdigest()[:16]


def _sources(folder: str) -> list[tuple[str, os.stat_result]]:
    out = []
    with os.scandir(folder) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                if e.name != "__pycache__" and not e.name.startswith("."):
                    out += _sources(e.path)
            elif e.name.endswith((".py", ".c")):
                out.append((e.path, e.stat()))
    return out


def model_digest(proto: onnx.ModelProto, state: Any) -> bytes | None:
    """SHA-256 of the model's skeleton: its serialization with the data of
    the dense state initializers ``state`` left out (name, type and dims
    kept, in place), and without the initialization graphs (whose programs
    are not cached: they hold a model's initial weights as constants, and
    lowering them is cheap).  Everything else, other initializers, sparse
    ones, metadata and bindings included, is hashed as it is.  None when
    the skeleton is over MAX_ENTRY_BYTES (frozen weights: programs that
    large are not cached)."""
    from .tensors import copy_fields

    if _frozen_raw_bytes(proto, state) > MAX_ENTRY_BYTES:
        return None  # known without copying the frozen weights into a skeleton
    h = hashlib.sha256(b"model\n")
    top = onnx.ModelProto()
    copy_fields(proto, top, skip=("graph", "training_info"))
    parts = [top, _graph_skeleton(proto.graph, state)]
    for ti in proto.training_info:
        rest = onnx.TrainingInfoProto()
        copy_fields(ti, rest, skip=("algorithm", "initialization"))
        parts += [rest, _graph_skeleton(ti.algorithm, state)]
    # Serialized once: ByteSize serializes too (protobuf's upb build).
    total = 0
    for p in parts:
        data = p.SerializeToString()
        total += len(data)
        if total > MAX_ENTRY_BYTES:
            return None
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def _frozen_raw_bytes(proto: onnx.ModelProto, state: Any) -> int:
    """A lower bound of the skeleton's size: the raw_data bytes of the
    initializers it keeps (not state, in the graphs it holds), from their
    dims (``load`` checked that raw_data holds exactly that many)."""
    from .tensors import stored_bytes

    total = 0
    for g in [proto.graph, *(ti.algorithm for ti in proto.training_info)]:
        for t in g.initializer:
            if (t.data_location != onnx.TensorProto.EXTERNAL and t.name not in state
                    and t.HasField("raw_data")):
                total += stored_bytes(t) or 0
    return total


def _graph_skeleton(g: onnx.GraphProto, state: Any) -> onnx.GraphProto:
    from .tensors import copy_fields

    out = onnx.GraphProto()
    copy_fields(g, out, skip=("initializer",))
    for t in g.initializer:
        if t.name in state:
            out.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        else:
            out.initializer.append(t)
    return out


def _key(kind: str, *parts: bytes | str) -> bytes:
    h = hashlib.sha256(f"{kind}\0{FORMAT}\0".encode())
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


# ------------------------------------------------------------------ entries
def _path(kind: str, key: bytes) -> Path:
    return directory() / f"{kind}-{key.hex()[:40]}"


def read(kind: str, key: bytes) -> tuple[dict, bytes] | None:
    """(meta, payload) of a verified entry, or None (missing, unreadable,
    corrupt, another key: a bad entry is removed)."""
    path = _path(kind, key)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    entry = _verify(data, key)
    if entry is None:
        _count(f"{kind}.corrupt")
        _remove(path)
        return None
    try:
        os.utime(path)  # least recently used goes first
    except OSError:
        pass
    return entry


def _verify(data: bytes, key: bytes) -> tuple[dict, bytes] | None:
    n = len(MAGIC)
    if len(data) < n + _HEADER.size or data[:n] != MAGIC:
        return None
    stored_key, digest, meta_len, payload_len = _HEADER.unpack_from(data, n)
    body = data[n + _HEADER.size:]
    if stored_key != key or len(body) != meta_len + payload_len:
        return None
    if hashlib.sha256(body).digest() != digest:
        return None
    try:
        meta = json.loads(body[:meta_len].decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    return meta, body[meta_len:]


def write(kind: str, key: bytes, meta: dict, payload: bytes) -> None:
    """Store an entry atomically, in the background: a writer thread does
    the file work (an fsync costs milliseconds) WRITE_DELAY seconds later,
    so that a cold start neither waits for the disk nor shares the
    interpreter with the writer (``flush`` writes at once; so does
    interpreter exit).  Failures are ignored (the cache is an optimization);
    an entry that a crash leaves half written fails verification and is
    rebuilt."""
    _submit(lambda: _write_now(kind, key, meta, payload), WRITE_DELAY)


def _submit(job: Callable[[], None], delay: float, optional: bool = False) -> None:
    """Run ``job`` on the writer thread, ``delay`` seconds from now at the
    earliest (and at the latest when ``flush`` or interpreter exit asks).
    An ``optional`` job is dropped at exit once ``EXIT_BUDGET`` is spent."""
    global _writer, _outstanding
    with _lock:
        if _writer is None:
            writer = threading.Thread(target=_work, name="onnxtrain-cache", daemon=True)
            try:
                writer.start()
            except RuntimeError:  # no new threads (interpreter shutdown): not cached
                return
            _writer = writer
        _jobs.append((time.monotonic() + delay, optional, job))
        _outstanding += 1
        _cv.notify_all()


def flush(timeout: float | None = None) -> bool:
    """Run every pending job now (deferred ones too) and wait until they
    are done; False on timeout."""
    global _force
    with _cv:
        _force = True
        _cv.notify_all()
        try:
            return _cv.wait_for(lambda: _outstanding == 0, timeout)
        finally:
            _force = False


#: Seconds between storing an entry and writing it (see ``write``).
WRITE_DELAY = 0.5
#: Seconds interpreter exit spends on optional jobs (optimized onnxruntime
#: models not made yet); the entry writes always run.
EXIT_BUDGET = 1.0
#: Pending jobs of the writer thread: (earliest start, optional, job).
_jobs: list = []
_outstanding = 0
_force = False
_exit_deadline: float | None = None
_cv = threading.Condition(_lock)
_writer: threading.Thread | None = None


def _work() -> None:
    global _writer, _outstanding
    try:  # the writer yields to the threads doing real work (Linux: per-thread nice)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
    while True:
        with _lock:
            while True:
                now = time.monotonic()
                ready = next((j for j in _jobs if _force or j[0] <= now), None)
                if ready is not None:
                    _jobs.remove(ready)
                    break
                if not _jobs:
                    _writer = None
                    return
                _cv.wait(min(j[0] for j in _jobs) - now)
        try:
            if not (ready[1] and _exit_deadline is not None and time.monotonic() > _exit_deadline):
                ready[2]()
        except Exception:  # pragma: no cover  (the writer must not die with jobs queued)
            pass
        finally:
            with _lock:
                _outstanding -= 1
                _cv.notify_all()


@atexit.register
def _flush_at_exit() -> None:
    """Finish the writes; give optional jobs EXIT_BUDGET seconds.  The job
    under way is always let finish (never a thread left inside onnxruntime
    while the interpreter shuts down); 30 s bounds the wait all the same."""
    global _exit_deadline
    _exit_deadline = time.monotonic() + EXIT_BUDGET
    flush(timeout=30.0)


def _after_fork_in_child() -> None:
    """A forked child has no writer thread: its queue starts empty."""
    global _lock, _stats_lock, _cv, _writer, _jobs, _outstanding, _force, _ort_submitted
    _lock = threading.Lock()
    _stats_lock = threading.Lock()
    _cv = threading.Condition(_lock)
    _writer, _jobs, _outstanding, _force, _ort_submitted = None, [], 0, False, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _write_now(kind: str, key: bytes, meta: dict, payload: bytes) -> None:
    folder = directory()
    meta_bytes = json.dumps(meta, sort_keys=True).encode()
    body = meta_bytes + payload
    data = MAGIC + _HEADER.pack(key, hashlib.sha256(body).digest(), len(meta_bytes), len(payload)) + body
    path = _path(kind, key)
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _count(f"{kind}.write")
        _evict(folder)
    except OSError:
        pass
    finally:
        if tmp is not None:
            _remove(Path(tmp))


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _evict(folder: Path) -> None:
    """Keep at most MAX_ENTRIES entries, dropping the least recently used,
    and remove temporary files a killed writer left (older than an hour)."""
    try:
        now = time.time()
        entries = []
        with os.scandir(folder) as it:
            for e in it:
                if not e.is_file(follow_symlinks=False):
                    continue
                if e.name.startswith("."):
                    if e.name.endswith(".tmp") and now - e.stat().st_mtime > 3600:
                        _remove(Path(e.path))
                elif e.name.startswith(("infer-", "program-", "ort-")):
                    entries.append(e)
        if len(entries) <= MAX_ENTRIES:
            return
        entries.sort(key=lambda e: e.stat().st_mtime_ns)
        for e in entries[: len(entries) - MAX_ENTRIES * 3 // 4]:
            _remove(Path(e.path))
    except OSError:
        pass


# ------------------------------------------------------------------ shape inference
#: Domains whose op schemas are onnx's own (in ``_onnx_build``).  A model
#: that imports another one may rely on schemas registered at run time
#: (``onnx.defs.register_schema``): nothing about it is cached.
_STANDARD_DOMAINS = frozenset(("", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training"))


def _standard_domains(model: onnx.ModelProto) -> bool:
    imports = list(model.opset_import) + [o for f in model.functions for o in f.opset_import]
    return all(o.domain in _STANDARD_DOMAINS for o in imports)


def types_key(model: onnx.ModelProto, data: bytes, extra: bytes) -> bytes | None:
    """The key of ``graph.infer_types``'s answer for the inference model
    ``model`` (serialized: ``data``) and ``extra`` (what else it reads), or
    None when not cached (cache off; a domain whose schemas may be
    registered at run time)."""
    if not enabled() or not _standard_domains(model):
        return None
    return _key("infer", _onnx_build(), code_digest(), _module_digest("onnxtrain.graph"), data, extra)


def get_types(key: bytes) -> tuple[dict[str, int], dict[str, tuple | None]] | None:
    """``(dtypes, shapes)`` stored under ``key``, or None."""
    entry = read("infer", key)
    if entry is not None:
        try:
            obj = json.loads(entry[1])
            dtypes = {str(k): int(v) for k, v in obj["dtypes"].items()}
            shapes = {str(k): None if v is None else tuple(v) for k, v in obj["shapes"].items()}
            _count("infer.hit")
            return dtypes, shapes
        except Exception:  # verified bytes that do not decode: treat as corrupt
            _count("infer.corrupt")
            _remove(_path("infer", key))
    _count("infer.miss")
    return None


def put_types(key: bytes, dtypes: dict[str, int], shapes: dict[str, tuple | None]) -> None:
    payload = json.dumps({"dtypes": dtypes, "shapes": shapes}, separators=(",", ":")).encode()
    write("infer", key, {"kind": "types"}, payload)


# ------------------------------------------------------------------ programs
def model_key(tm: Any) -> bytes | None:
    """The cache key prefix of a TrainingModel (computed once), or None when
    the cache is off or does not take the model (it imports an op domain of
    its own, or holds over MAX_ENTRY_BYTES of non-state data)."""
    if not enabled():
        return None
    key = getattr(tm, "cache_key", None)
    if key is None:
        # Another domain's ops may lean on schemas registered at run time
        # (``onnx.defs.register_schema``), which no key covers: not cached.
        digest = model_digest(tm.proto, tm.state) if _standard_domains(tm.proto) else None
        key = b"" if digest is None else _key("model", code_digest(), runtime_digest(), digest)
        tm.cache_key = key
    return key or None


def program_model(tm: Any, label: str, build: Callable[[], onnx.ModelProto]) -> onnx.ModelProto:
    """The lowered model of program ``label`` of ``tm``: from the cache, or
    ``build()`` (which raises model errors as usual) then stored.  Either way
    the model may get its fused-kernel rewrite registered (``fused_for``)."""
    prefix = model_key(tm)
    if prefix is None:
        return build()
    key = _key("program", prefix, label)
    entry = read("program", key)
    if entry is not None:
        meta, payload = entry
        try:
            model = _parse_program(meta, payload, label)
        except Exception:
            model = None
            _count("program.corrupt")
            _remove(_path("program", key))
        if model is not None:
            _count("program.hit")
            _watch_fused(model, key, meta, payload)
            return model
    _count("program.miss")
    model = build()
    if model.ByteSize() > MAX_ENTRY_BYTES:
        return model
    blob = model.SerializeToString()
    meta = {"label": label, "program": len(blob)}
    write("program", key, meta, blob)
    _watch_fused(model, key, meta, blob)
    return model


def _parse_program(meta: dict, payload: bytes, label: str) -> onnx.ModelProto:
    if meta.get("label") != label:
        raise ValueError("label mismatch")
    n = int(meta["program"])
    if not 0 < n <= len(payload):
        raise ValueError("bad length")
    return onnx.ModelProto.FromString(payload[:n])


#: Program models whose fused-kernel rewrite is known or wanted, by id:
#: id -> (model, key, meta, payload, (fused model, count) or None).  Bounded:
#: an entry nobody asks for (a session that never trains) is dropped.
_fused: OrderedDict[int, tuple] = OrderedDict()
_FUSED_KEEP = 64


def _watch_fused(model: onnx.ModelProto, key: bytes, meta: dict, payload: bytes) -> None:
    known = None
    if "fused" in meta:
        try:
            count = int(meta["fused_count"])
            n, m = int(meta["program"]), int(meta["fused"])
            if count == 0:
                known = (model, 0)
            elif m > 0 and n + m == len(payload):
                known = (onnx.ModelProto.FromString(payload[n:n + m]), count)
        except Exception:
            known = None
    with _lock:
        _fused[id(model)] = (model, key, meta, payload, known)
        while len(_fused) > _FUSED_KEEP:
            _fused.popitem(last=False)


def fused_for(model: onnx.ModelProto, compute: Callable[[onnx.ModelProto], tuple], variant: int = 0) -> tuple:
    """``compute(model)`` (``fuse.with_fused_kernels``) for a program model:
    from the program's cache entry when it holds the answer, else computed
    and added to the entry.  Models the cache did not hand out are just
    computed.  ``variant``: what else the answer depends on (the NCHWc block
    of this machine's onnxruntime): an entry made for another is recomputed."""
    with _lock:
        watched = _fused.pop(id(model), None)
    if watched is None or watched[0] is not model:
        return compute(model)
    _, key, meta, payload, known = watched
    if known is not None and int(meta.get("variant", 0)) != variant:
        known = None
    if known is not None:
        _count("fused.hit")
        fused, count = known
        return (model if count == 0 else fused), count
    result = compute(model)
    fused, count = result
    _count("fused.miss")
    if enabled():
        n = int(meta["program"])
        extra = b"" if count == 0 or fused is model else fused.SerializeToString()
        new_meta = dict(meta, fused=len(extra), fused_count=int(count), variant=int(variant))
        write("program", key, new_meta, payload[:n] + extra)
    return result


# ------------------------------------------------------------------ onnxruntime
#: Session config entries that restrict or change graph rewrites: with any
#: of them set, no optimized model is used or made (it would be made
#: without them).
ORT_GRAPH_CONFIG_KEYS = (
    "optimization.disable_specified_optimizers",
    "optimization.minimal_build_optimizations",
    "optimization.constant_folding_max_output_size_in_bytes",
    "optimization.enable_cast_chain_elimination",
    "optimization.enable_gelu_approximation",
    "session.graph_optimizations_loop_level",
    "session.disable_aot_function_inlining",
    "session.disable_quant_qdq",
    "session.disable_double_qdq_remover",
    "session.disable_qdq_constant_folding",
    "session.enable_quant_qdq_cleanup",
    "session.qdqisint8allowed",
    "session.enable_dq_matmulnbits_fusion",
    "mlas.enable_gemm_fastmath_arm64_bfloat16",
)
#: Seconds between a miss and making the optimized model (on the writer
#: thread, or at interpreter exit if that comes first): off the start's path.
ORT_DELAY = 1.0
#: Optimized models one process makes at most (a test suite or a sweep
#: creates many sessions: the background work stays small).
ORT_MAX_MADE = 4
_ort_digest: bytes | None = None
_ort_submitted = 0


def _ort_build() -> bytes:
    """onnxruntime's version and library, and the CPU it runs on."""
    global _ort_digest
    if _ort_digest is None:
        import platform

        import onnxruntime

        h = hashlib.sha256(f"onnxruntime {onnxruntime.__version__} {platform.machine()}\n".encode())
        capi = sys.modules.get("onnxruntime.capi.onnxruntime_pybind11_state")
        for path in (getattr(capi, "__file__", None), "/proc/cpuinfo"):
            if path is None:
                continue
            try:
                if path == "/proc/cpuinfo":
                    with open(path, "rb") as f:
                        text = f.read(1 << 16)
                    # the first processor's identity and feature flags
                    lines = [ln for ln in text.split(b"\n\n")[0].split(b"\n")
                             if ln.split(b":")[0].strip() in (b"vendor_id", b"model name", b"flags",
                                                                 b"Features", b"CPU part")]
                    h.update(b"\n".join(lines))
                else:
                    st = os.stat(path)
                    h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:
                pass
        _ort_digest = h.digest()
    return _ort_digest


def _ort_level(so: Any, providers: Any) -> int | None:
    """The optimization level to make an optimized model at for these
    options (at most ORT_ENABLE_EXTENDED: hardware independent), or None
    when the options rule the cache out."""
    import onnxruntime as ort

    if providers:
        names = [p if isinstance(p, str) else None for p in providers]
        if names != ["CPUExecutionProvider"]:
            return None
    try:
        if so.has_providers() or so.optimized_model_filepath:
            return None
        for key in ORT_GRAPH_CONFIG_KEYS:
            try:
                so.get_session_config_entry(key)
            except Exception:  # not set: what we want
                continue
            return None
        level = int(so.graph_optimization_level)
    except Exception:
        return None
    level = min(level, int(ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED))
    return level if level > 0 else None


def ort_model(data: bytes, so: Any, providers: Any, library: str | None, label: str = ""
              ) -> tuple[bytes, Callable[[], None]] | None:
    """For the serialized model ``data`` of the program ``label`` about to
    be loaded by onnxruntime with options ``so``: the same model with
    onnxruntime's graph optimizations up to ORT_ENABLE_EXTENDED already
    applied (made earlier by onnxruntime itself, ``optimized_model_filepath``),
    and a function that drops it (should onnxruntime refuse it); or None.
    Loading it with ``so`` applies the user's optimizations again, which
    finds those done.  Only for training algorithms (the first step's
    program; ``run`` and ``evaluate`` compile theirs later, if ever).

    On a miss, the optimized model is made later on the writer thread, with
    options of its own (the user's are never changed)."""
    global _ort_submitted
    if not enabled() or len(data) > MAX_ENTRY_BYTES or not label.endswith(".algorithm"):
        return None
    level = _ort_level(so, providers)
    if level is None:
        return None
    lib = ""
    if library:
        try:
            st = os.stat(library)
            lib = f"{library}\0{st.st_size}\0{st.st_mtime_ns}"
        except OSError:
            return None
    deterministic = bool(getattr(so, "use_deterministic_compute", False))
    key = _key("ort", _ort_build(), str(level), str(deterministic), lib, data)
    entry = read("ort", key)
    if entry is not None and entry[0].get("level") == level:
        _count("ort.hit")
        return entry[1], lambda: _remove(_path("ort", key))
    _count("ort.miss")
    with _lock:
        if _ort_submitted >= ORT_MAX_MADE:
            return None
        _ort_submitted += 1
    _submit(lambda: _make_ort(key, data, level, deterministic, library), ORT_DELAY, optional=True)
    return None


def _make_ort(key: bytes, data: bytes, level: int, deterministic: bool, library: str | None) -> None:
    import onnxruntime as ort

    if not enabled():
        return
    folder = directory()
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ort-", suffix=".onnx.tmp", dir=folder)
        os.close(fd)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel(level)
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.log_severity_level = 4
        so.use_deterministic_compute = deterministic
        so.optimized_model_filepath = tmp
        if library:
            so.register_custom_ops_library(library)
        ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        with open(tmp, "rb") as f:
            optimized = f.read()
        before, after = onnx.ModelProto.FromString(data).graph, onnx.ModelProto.FromString(optimized).graph
        # The same interface, or it is not the same program.
        if ([i.name for i in before.input] != [i.name for i in after.input]
                or [o.name for o in before.output] != [o.name for o in after.output]):
            _count("ort.bad")
            return
    except Exception:
        _count("ort.bad")
        return
    finally:
        if tmp is not None:
            _remove(Path(tmp))
    _count("ort.made")
    _write_now("ort", key, {"level": level}, optimized)


def clear() -> None:
    """Delete every entry (``onnxtrain.cache.clear()``; tests)."""
    flush()
    folder = directory()
    try:
        with os.scandir(folder) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    _remove(Path(e.path))
    except OSError:
        pass
