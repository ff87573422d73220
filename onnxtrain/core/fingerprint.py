"""Fingerprints for cache keys: what a cached answer depends on besides its input.

- ``onnx_build``: the onnx build shape inference runs in;
- ``code_digest``: every onnxtrain source file (and the kernel source) and the
  versions of the libraries it runs on, by a stat each, not a read;
- ``module_digest``: a module's constants and tables as they are now (a test
  or a user may have replaced one since it was imported); ``layers_digest``:
  those of every loaded module of some of onnxtrain's layers;
- ``sha256_all``: the digests of data a key counts by reference (weights);
- ``standard_domains``: whether every op of a model means what onnx's build
  (and onnxtrain's rules, in the runtime digest) says: an op of another
  domain with a schema registered at run time is in no key.
"""

from __future__ import annotations

import hashlib
import os
import sys
import types
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

import onnx

from .._version import __version__
from .diskcache import FORMAT
from .walk import graphs_within, walk_graphs

#: Descriptions memoized here change at run time: not part of any key.
__fingerprint__ = False

_code_digest: bytes | None = None
_onnx_digest: bytes | None = None


def onnx_build() -> bytes:
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


def _version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def package_root() -> Path:
    """The folder of the top-level onnxtrain package, wherever this module sits in it."""
    return Path(sys.modules[__name__.partition(".")[0]].__file__).resolve().parent


def code_digest() -> bytes:
    """Digest of onnxtrain's code: every source file (and the kernel source),
    and the versions of onnx and protobuf.  A file is identified by its path,
    size, inode and modification and change times: any write to it changes
    its change time (``st_ctime``, which no tool can set back), so an edited,
    replaced or reinstalled file is a new key, at the cost of a stat, not a
    read."""
    global _code_digest
    if _code_digest is None:
        h = hashlib.sha256(onnx_build())
        h.update(f"onnxtrain {__version__} protobuf {_version_of('protobuf')}\n".encode())
        root = str(package_root())
        for path, st in sorted(_sources(root)):
            h.update(f"{path[len(root):]}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0"
                     f"{st.st_ctime_ns}\n".encode())
        _code_digest = h.digest()
    return _code_digest


def module_digest(name: str) -> bytes:
    """A module's constants and tables as they are now (their functions by
    name; a module's own functions are its source, hashed by code_digest).
    Empty for a module that is not loaded or that keeps run-time state
    (``__fingerprint__ = False``)."""
    module = sys.modules.get(name)
    d = getattr(module, "__dict__", None) or {}
    if d.get("__fingerprint__", True) is False:
        return b""
    parts = [name]
    for k, v in list(d.items()):
        if type(v) in _DESCRIBED and k[:2] != "__":
            parts.append(f"{k}={describe(v, 2)}")
    return "\n".join(sorted(parts)).encode()


def layers_digest(layers: Sequence[str]) -> bytes:
    """``module_digest`` of every loaded module of onnxtrain's ``layers``
    (package names under onnxtrain, e.g. "builder"), in name order."""
    root = __name__.partition(".")[0]
    prefixes = tuple(f"{root}.{layer}" for layer in layers)
    names = sorted(n for n in list(sys.modules)
                   if n in prefixes or n.startswith(tuple(p + "." for p in prefixes)))
    h = hashlib.sha256(b"layers\n")
    for name in names:
        h.update(module_digest(name))
    return h.digest()


def sha256_all(buffers: Sequence[Any], parallel_from: int) -> list[str]:
    """The SHA-256 (hex) of each buffer (bytes, a contiguous array), in order;
    on up to four threads when they hold ``parallel_from`` bytes or more
    together (hashlib lets go of the interpreter while it hashes)."""
    views = [v.cast("B") if v.nbytes else memoryview(b"") for v in map(memoryview, buffers)]
    workers = min(4, os.cpu_count() or 1, len(views))
    if workers < 2 or sum(v.nbytes for v in views) < parallel_from:
        return [hashlib.sha256(v).hexdigest() for v in views]
    with ThreadPoolExecutor(workers, thread_name_prefix="onnxtrain-hash") as pool:
        return list(pool.map(lambda v: hashlib.sha256(v).hexdigest(), views))


_SCALARS = (int, float, str, bytes, bool, type(None))
_DESCRIBED = frozenset((*_SCALARS, tuple, frozenset, list, set, dict))


def describe(v: Any, depth: int) -> str | None:
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
        items = [describe(x, depth - 1) for x in v]
        if t is frozenset:
            items.sort(key=str)
        desc = ("(" if t is tuple else "{") + ",".join(map(str, items)) + (")" if t is tuple else "}")
        # immutable all the way down (scalars, functions, classes): remembered
        if all(type(x) in _SCALARS or type(x) is types.FunctionType or isinstance(x, type) for x in v):
            _remember(v, desc)
        return desc
    if t is list:
        return "[" + ",".join(str(describe(x, depth - 1)) for x in v) + "]"
    if t is set:
        return "{" + ",".join(sorted(str(describe(x, depth - 1)) for x in v)) + "}"
    if t is dict and 0 < len(v) <= 256 and all(type(k) in (str, int) for k in v):
        # tables (op -> function, ...); not runtime caches, whose keys are objects' ids
        return "{" + ",".join(sorted(f"{k!r}:{describe(x, depth - 1)}" for k, x in v.items())) + "}"
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



#: Domains whose op schemas are onnx's own (in ``onnx_build``).
_STANDARD_DOMAINS = frozenset(("", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training"))


def standard_domains(model: onnx.ModelProto) -> bool:
    """Whether no op of ``model`` leans on a schema registered at run time
    (``onnx.defs.register_schema``), which no key covers: its ops are of
    onnx's domains, or of others (onnxruntime's contrib ops) that onnx has
    no schema for, whose meaning is then onnxtrain's rules alone."""
    imports = list(model.opset_import) + [o for f in model.functions for o in f.opset_import]
    if all(o.domain in _STANDARD_DOMAINS for o in imports):
        return True
    return not any(onnx.defs.has(op, domain) for domain, op in _foreign_ops(model))


def _foreign_ops(model: onnx.ModelProto) -> set[tuple[str, str]]:
    """(domain, op type) of every node outside onnx's domains: in the graph,
    the training graphs, the functions and every subgraph."""
    functions = [onnx.GraphProto(node=f.node) for f in model.functions]
    return {(n.domain, n.op_type) for g in walk_graphs(model) + graphs_within(functions)
            for n in g.node if n.domain not in _STANDARD_DOMAINS}
