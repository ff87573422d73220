"""onnxruntime's own optimized form of a program, kept in the ``core.diskcache``
store (``ort-*`` entries; docs/startup.md).

The model as onnxruntime optimizes it (the session's graph optimizations,
ORT_ENABLE_ALL's layout rewrites included, saved by onnxruntime with
``optimized_model_filepath``) loads faster.  Its rewrites are done, so an
executor with options of its own loads it with graph optimizations off;
the caller's options apply theirs again, which find those already done.
Keyed by the exact model bytes, the optimization level, the custom-op
library, the onnxruntime build and the CPU (the layout rewrites are the
CPU's).  Made with options of its own, never the caller's (but see shared
weights below), and only for sessions on the CPU
provider whose options restrict no graph rewrite (``ORT_GRAPH_CONFIG_KEYS``),
on the store's writer thread ``ORT_DELAY`` seconds after the miss (or at
exit), off the first step's path.  An entry onnxruntime refuses is dropped.

A program whose frozen weights the executor shares with onnxruntime
(``SharedWeights``: held in onnxtrain's own files, given with
``add_initializer``) is keyed and stored with each weight named by the
SHA-256 of its data (``mapped.HELD``) instead of this process's file.  Its
form is the one its own first session makes (with the executor's options):
that session saves it, with the weights' data, to temporary files, and the
writer thread stores it.  onnxruntime may fold values of the weights alone
into new initializers: the entry keeps them (the key covers the weights'
data).  An entry is made only where every weight comes out of onnxruntime
as it went in, byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime as ort

from ..core import diskcache
from ..core.protos import all_tensors
from ..io import mapped
from .options import Recipe

#: Module state that changes at run time: not part of any cache key.
__fingerprint__ = False
_lock = threading.Lock()

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
        h = hashlib.sha256(f"onnxruntime {ort.__version__} {platform.machine()}\n".encode())
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
    options (theirs), or None when the options rule the cache out."""
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
    return level if level > 0 else None


#: Bytes of folded (non-weight) initializers an entry of a program with
#: shared weights may hold: more, and no entry is made.
MAX_FOLDED_BYTES = 16 * 2**20


class SharedWeights:
    """The weights an executor gives onnxruntime with ``add_initializer``
    (mapped placeholders of onnxtrain's own files, ``mapped.is_owned``), as
    the cache of optimized forms names them: by the SHA-256 of their data.
    ``model`` is the model the session loads, whose placeholders ``of``
    takes before ``mapped.rooted`` points them relative to "/"."""

    def __init__(self, model: onnx.ModelProto, placeholders: Sequence[onnx.TensorProto]) -> None:
        self.model = model
        self._placeholders = [onnx.TensorProto() for _ in placeholders]  # (as they are now)
        for mine, t in zip(self._placeholders, placeholders):
            mine.CopyFrom(t)
        self._digests: dict[str, str] | None = None
        #: name -> (location relative to "/", offset, length) and its data.
        self.rooted: dict[str, tuple[str, int, int]] = {}
        self.arrays: dict[str, np.ndarray] = {}
        for t in placeholders:
            path, offset, length = mapped.source(t)
            self.rooted[t.name] = (os.path.relpath(path, "/"), offset, length)
            self.arrays[t.name] = mapped.array(t)

    @classmethod
    def of(cls, model: onnx.ModelProto, names: Sequence[str]) -> SharedWeights | None:
        """None unless the weights ``names`` (main-graph initializers of
        ``model``) are the model's only external data, all of it in onnxtrain's
        own files (hashed once: another file would be hashed at every start)."""
        names = set(names)
        weights = [t for t in model.graph.initializer if t.name in names]
        if len(weights) != len(names) or not all(mapped.is_owned(t) for t in weights):
            return None
        if sum(t.data_location == onnx.TensorProto.EXTERNAL for t in all_tensors(model)) != len(weights):
            return None
        return cls(model, weights)

    @property
    def digest_of(self) -> dict[str, str]:
        """name -> the SHA-256 of its data (hashed when first asked, once per process)."""
        if self._digests is None:
            names = [t.name for t in self._placeholders]
            self._digests = dict(zip(names, mapped.owned_digests(self._placeholders)))
        return self._digests

    def neutral(self) -> bytes:
        """The model's serialization with each weight named by its digest (the key)."""
        weights = [t for t in self.model.graph.initializer if t.name in self.rooted]
        try:
            for t in weights:
                mapped.point(t, mapped.HELD + self.digest_of[t.name], 0, self.rooted[t.name][2])
            return self.model.SerializeToString()
        finally:
            for t in weights:
                mapped.point(t, *self.rooted[t.name])

    def stored(self, path: str, data_path: str) -> bytes | None:
        """The optimized model onnxruntime wrote to ``path`` (its initializers'
        data in ``data_path``) as an entry holds it: each weight named by its
        digest, where its data is the weight's byte for byte; folded tensors
        inline (``MAX_FOLDED_BYTES`` at most); else None."""
        model = onnx.load(path, load_external_data=False)
        folder = os.path.dirname(path)

        def data(t: onnx.TensorProto) -> np.ndarray | None:
            location, offset, length = mapped.source(t)
            if os.path.join(folder, location) != data_path:
                return None
            return np.memmap(data_path, np.uint8, "r", offset, (length,)) if length else np.zeros(0, np.uint8)

        for t in model.graph.initializer:
            expected = self.arrays.get(t.name)
            if expected is None or t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            got = data(t)
            if got is None or not np.array_equal(got, expected.reshape(-1).view(np.uint8)):
                return None  # onnxruntime changed a weight: not cached
            mapped.point(t, mapped.HELD + self.digest_of[t.name], 0, got.nbytes)
        folded = 0
        for t in all_tensors(model):
            if t.data_location != onnx.TensorProto.EXTERNAL or mapped.location(t).startswith(mapped.HELD):
                continue
            got = data(t)
            folded += 0 if got is None else got.nbytes
            if got is None or folded > MAX_FOLDED_BYTES:
                return None
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
            t.raw_data = got.tobytes()
        return model.SerializeToString()

    def restored(self, payload: bytes) -> bytes | None:
        """An entry's model with each weight pointed at this process's file
        again, or None where it names data this program does not share."""
        try:
            model = onnx.ModelProto.FromString(payload)
        except Exception:  # damaged
            return None
        layouts = {t.name: (t.data_type, list(t.dims)) for t in self._placeholders}
        for t in all_tensors(model):
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            location = mapped.location(t)
            if (not location.startswith(mapped.HELD) or self.digest_of.get(t.name) != location[len(mapped.HELD):]
                    or layouts[t.name] != (t.data_type, list(t.dims))):
                return None
            mapped.point(t, *self.rooted[t.name])
        return model.SerializeToString()


@dataclass(frozen=True)
class OrtKey:
    """Where the optimized form of one program is kept (``ort_key``)."""

    key: bytes
    level: int
    deterministic: bool


def ort_key(data: bytes, so: Any, providers: Any, library: str | None, label: str = "",
            shared: SharedWeights | None = None) -> OrtKey | None:
    """The entry of the optimized form of the serialized model ``data``
    of the program ``label`` about to be loaded by onnxruntime with options
    ``so`` (``ort_model``), or None where none is kept: only for training
    algorithms (the first step's program; ``run`` and ``evaluate`` compile
    theirs later, if ever), on the CPU provider, with options that leave
    every graph rewrite on."""
    if not diskcache.enabled() or len(data) > diskcache.MAX_ENTRY_BYTES or not label.endswith(".algorithm"):
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
    key = diskcache.make_key("ort", _ort_build(), str(level), str(deterministic), lib,
                             data if shared is None else shared.neutral())
    return OrtKey(key, level, deterministic)


def ort_model(keyed: OrtKey, data: bytes, so: Any, library: str | None, shared: SharedWeights | None = None,
              own: bool = False) -> tuple[bytes | None, Callable[[], None]] | None:
    """For the serialized model ``data`` about to be loaded by onnxruntime
    with options ``so`` (``keyed``: its ``ort_key``): the same model with
    the graph optimizations of ``so``'s level already applied (made earlier
    by onnxruntime itself, ``optimized_model_filepath``), and a function
    that drops it (should onnxruntime refuse it); or None.  Loading it with
    graph optimizations off makes the session ``so`` would make of
    ``data``; loading it with ``so`` applies them again, which finds them
    done.

    On a miss, the optimized model is made later on the writer thread, with
    options of its own (the user's are never changed).  A program with
    ``shared`` weights (``SharedWeights``, which ``so`` gives onnxruntime)
    is made by its own session instead, where ``so`` is the executor's
    (``own``): then the answer is (None, a function to call once the
    session is made), and ``so`` has the session save its optimized form."""
    global _ort_submitted
    key, level, deterministic = keyed.key, keyed.level, keyed.deterministic
    entry = diskcache.read("ort", key)
    drop = lambda: diskcache.remove(diskcache.entry_path("ort", key))  # noqa: E731
    if entry is not None and entry[0].get("level") == level:
        optimized = entry[1] if shared is None else shared.restored(entry[1])
        if optimized is not None:
            diskcache.count("ort.hit")
            return optimized, drop
        drop()
    diskcache.count("ort.miss")
    with _lock:
        if _ort_submitted >= ORT_MAX_MADE:
            return None
        _ort_submitted += 1
    if shared is not None:
        finish = _record(so, key, level, shared) if own else None
        return None if finish is None else (None, finish)
    diskcache.submit(lambda: _make_ort(key, data, level, deterministic, library), ORT_DELAY, optional=True)
    return None


def _record(so: Any, key: bytes, level: int, shared: SharedWeights) -> Callable[[], None] | None:
    """Have the session about to be made with ``so`` save its optimized form
    (and the weights' data, to check) to temporary files of the cache's
    folder; returns what to call once it is made (the entry is stored from
    the files on the writer thread, and ``so`` saves nothing again), or
    None where no file can be made."""
    try:
        folder = diskcache.directory()
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ort-", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError:
        return None
    data_file = tmp[: -len(".tmp")] + ".data.tmp"  # (a killed process's: evicted as stale)
    so.optimized_model_filepath = tmp
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                os.path.basename(data_file))

    def store() -> None:
        try:
            optimized = shared.stored(tmp, data_file) if os.path.getsize(tmp) else None
        except Exception:
            optimized = None
        finally:
            diskcache.remove(Path(tmp))
            diskcache.remove(Path(data_file))
        if optimized is None:
            diskcache.count("ort.bad")
            return
        diskcache.count("ort.made")
        diskcache.write_now("ort", key, {"level": level}, optimized)

    def finish() -> None:
        so.optimized_model_filepath = ""
        diskcache.submit(store, ORT_DELAY)

    return finish


def _make_ort(key: bytes, data: bytes, level: int, deterministic: bool, library: str | None) -> None:
    if not diskcache.enabled():
        return
    folder = diskcache.directory()
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
            diskcache.count("ort.bad")
            return
    except Exception:
        diskcache.count("ort.bad")
        return
    finally:
        if tmp is not None:
            diskcache.remove(Path(tmp))
    diskcache.count("ort.made")
    diskcache.write_now("ort", key, {"level": level}, optimized)


#: Sessions made ahead (``make_ahead``) by (entry key, recipe): those of the last call.
_ahead: dict[tuple[bytes, Recipe], Future] = {}


def make_ahead(sessions: Sequence[tuple[bytes, Recipe]]) -> None:
    """Make, in order, from each entry key and with its recipe's options,
    the session that the executor of that program would make, for ``ahead``
    to hand over: on a thread of its own while the program is being built
    (``runtime.firstrun``).  Nothing where they are made or being made
    already.  One call at a time: a new one drops what an older one made
    and nobody took."""
    with _lock:
        if all(s in _ahead for s in sessions):
            return
        _ahead.clear()
        made = [(s, _ahead.setdefault(s, Future())) for s in sessions]
    for (key, recipe), future in made:
        if future.done():  # (listed twice)
            continue
        sess = None
        try:
            sess = _session_of(key, recipe)
        except Exception:  # (a bad entry or recipe: the executor makes its own, as ever)
            pass
        finally:  # (answered whatever happens: ``ahead`` waits for it)
            future.set_result(sess)


def _session_of(key: bytes, recipe: Recipe) -> ort.InferenceSession | None:
    """The session ``Executor`` makes of the entry ``key`` (its rewrites done) with ``recipe``."""
    entry = diskcache.read("ort", key)
    so = recipe.options()
    if entry is None or entry[0].get("level") != _ort_level(so, None):
        return None
    if recipe.library:
        so.register_custom_ops_library(recipe.library)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(entry[1], sess_options=so, providers=["CPUExecutionProvider"])


def ahead(key: bytes, recipe: Recipe) -> ort.InferenceSession | None:
    """The session ``make_ahead`` made for the entry ``key`` and ``recipe``
    (waited for if under way, handed over once), or None where none was."""
    with _lock:
        made = _ahead.pop((key, recipe), None)
        if made is None:  # (what was asked for is another program's: none kept for nobody)
            _ahead.clear()
            return None
    sess = made.result()
    diskcache.count("ort.ahead" if sess is not None else "ort.ahead_failed")
    return sess


def _after_fork_in_child() -> None:
    """A forked child has made no optimized model yet, nor any session ahead."""
    global _lock, _ort_submitted
    _lock = threading.Lock()
    _ort_submitted = 0
    _ahead.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
