"""onnxruntime's own optimized form of a program, kept in the ``core.diskcache``
store (``ort-*`` entries; docs/startup.md).

The model as onnxruntime optimizes it (graph optimizations up to
ORT_ENABLE_EXTENDED, saved by onnxruntime with ``optimized_model_filepath``)
loads faster; loading it applies the session's optimizations again, which
find those already done.  Keyed by the exact model bytes, the optimization
level, the custom-op library, the onnxruntime build and the CPU.  Made with
options of its own, never the caller's, and only for sessions on the CPU
provider whose options restrict no graph rewrite (``ORT_GRAPH_CONFIG_KEYS``),
on the store's writer thread ``ORT_DELAY`` seconds after the miss (or at
exit), off the first step's path.  An entry onnxruntime refuses is dropped.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import onnx
import onnxruntime as ort

from ..core import diskcache

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
    options (at most ORT_ENABLE_EXTENDED: hardware independent), or None
    when the options rule the cache out."""
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
    key = diskcache.make_key("ort", _ort_build(), str(level), str(deterministic), lib, data)
    entry = diskcache.read("ort", key)
    if entry is not None and entry[0].get("level") == level:
        diskcache.count("ort.hit")
        return entry[1], lambda: diskcache.remove(diskcache.entry_path("ort", key))
    diskcache.count("ort.miss")
    with _lock:
        if _ort_submitted >= ORT_MAX_MADE:
            return None
        _ort_submitted += 1
    diskcache.submit(lambda: _make_ort(key, data, level, deterministic, library), ORT_DELAY, optional=True)
    return None


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



def _after_fork_in_child() -> None:
    """A forked child has made no optimized model yet."""
    global _lock, _ort_submitted
    _lock = threading.Lock()
    _ort_submitted = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
