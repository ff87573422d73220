"""Optional fused kernels: an onnxruntime custom-op library built from C source.

Standard ONNX kernels stream every tensor through memory once per operation,
so an Adam update written as eleven of them costs eleven passes over each
parameter.  ``optim_kernels.c`` does the same arithmetic, in the same order and
with the same IEEE rounding, in one pass: the update rules that name a kernel
(``onnxtrain.optim.updates``; ``fuse.fuse_rule_calls`` puts the kernel in
place of each call): the builder's Adam/AdamW (``AdamUpdate``) and the
lowered spec ops Adam, Momentum (standard and Nesterov) and Adagrad
(``SpecAdam``, ``AdamStepSize``, ``Momentum``, ``Nesterov``, ``Adagrad``:
multi-tensor ops, one node for many small tensors; see docs/fused-kernels.md).
It also holds layer kernels that onnxruntime's standard ops run slowly
(``fuse_layers``: MaxPool with Indices, Relu's and BatchNormalization's
gradients, a convolution's column matrices, MaxPool's scatter) and the
filter reorder that puts convolutions on onnxruntime's NCHWc kernels
(``nchwc``).  ``llm_kernels.c``, compiled into the same library, has a
decoder's non-product kernels (RMSNorm, SiLU times a gate, RoPE, the
guarded softmax's gradient, the vocabulary cross-entropy: ``llm``,
``attention``, ``xent``).  Where one pass over memory is the whole cost,
large tensors are split over two threads.

The library is compiled on first use with the system C compiler (``$CC``,
else ``cc``) and cached by the hash of its source and flags, in
``$ONNXTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/onnxtrain``, else
``~/.cache/onnxtrain``.  It needs no onnxruntime headers and no Python
package.  Where there is no compiler, or the build or the load fails, onnxtrain
runs the standard kernels and ``status()`` says why.
``ONNXTRAIN_FUSED_KERNELS=0`` turns the library off.

This module does not import onnxruntime (the executor registers the library);
it only builds and finds it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from ..core.diskcache import cache_dir
from ..core.files import replacing

#: Module state that changes at run time: not part of any cache key.
__fingerprint__ = False

_HERE = Path(__file__).parent
#: The library's C sources, compiled together into one shared object (ort_api.h:
#: the onnxruntime C API they share, part of the cache key).
_SOURCES = (_HERE / "optim_kernels.c", _HERE / "llm_kernels.c")
_HEADERS = (_HERE / "ort_api.h",)
#: -ffp-contract=off: no fused multiply-adds, so results match the standard
#: kernels bit for bit; -fno-math-errno lets sqrt vectorize (errno only).
_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=hidden"]
#: Built without function multi-versioning where the compiler refuses it.
_FALLBACK_FLAGS = [*_FLAGS, "-DONNXTRAIN_NO_CLONES"]

_lock = threading.Lock()
_result: tuple[str | None, str] | None = None  # (path, reason when None)


def disabled_by_environment() -> bool:
    return os.environ.get("ONNXTRAIN_FUSED_KERNELS", "").strip().lower() in ("0", "false", "no", "off")


def _suffix() -> str:
    return ".dll" if sys.platform == "win32" else ".dylib" if sys.platform == "darwin" else ".so"


class _CompileError(Exception):
    """The compiler's complaint."""


def _compile(cc: str, flags: list[str], target: Path) -> str | None:
    """Compile into ``target`` atomically; the compiler's complaint on failure."""
    try:
        with replacing(target) as tmp:
            # (libm after the source: powf/pow of AdamStepSize)
            proc = subprocess.run([cc, *flags, "-o", tmp, *map(str, _SOURCES), "-lm"], capture_output=True,
                                  text=True, timeout=120)
            if proc.returncode != 0:
                raise _CompileError((proc.stderr or proc.stdout).strip()[-2000:] or f"{cc} exited {proc.returncode}")
        return None
    except _CompileError as exc:
        return str(exc)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cc}: {exc}"


def _build() -> tuple[str | None, str]:
    if sys.platform == "win32":
        return None, "fused kernels are built with a POSIX C compiler; not on Windows"
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None, f"no C compiler ({cc!r} is not on PATH)"
    source = b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in (*_SOURCES, *_HEADERS))
    errors = []
    for flags in (_FLAGS, _FALLBACK_FLAGS):
        key = hashlib.sha256(
            source + " ".join([cc, *flags, "-lm", platform.machine()]).encode()
        ).hexdigest()[:16]
        target = cache_dir() / f"optim_kernels-{key}{_suffix()}"
        if target.exists():
            return str(target), ""
        try:
            error = _compile(cc, flags, target)
        except OSError as exc:  # e.g. an unwritable cache directory
            error = f"cannot write {target.parent}: {exc}"
        if error is None:
            return str(target), ""
        errors.append(error)
    return None, "the C build failed: " + errors[-1]


def library() -> str | None:
    """Path of the built library, building it once per process; None if unavailable."""
    global _result
    if disabled_by_environment():
        return None
    with _lock:
        if _result is None:
            _result = _build()
        return _result[0]


def status() -> str:
    """One line: where the library is, or why it is not used."""
    if disabled_by_environment():
        return "off (ONNXTRAIN_FUSED_KERNELS=0)"
    path = library()
    assert _result is not None
    return f"built: {path}" if path else f"unavailable: {_result[1]}"


def _reset_for_tests() -> None:
    global _result
    with _lock:
        _result = None
