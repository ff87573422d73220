"""The program cache: lowered programs, and their fused-kernel rewrites, kept on
disk across processes (docs/startup.md) in the ``core.diskcache`` store.

A ``program-*`` entry holds a lowered inference or training-algorithm
program (``programs.py``): the model the pipeline of ``pipeline.py`` made,
and the fused-kernel rewrite of it (``kernels.fuse.with_fused_kernels``).
It is keyed by the training model's *skeleton* (the model bytes with the
data of its state variables left out: names, types and dims stay; the
initialization graphs left out: see ``model_digest``), the program's label,
onnxtrain's code (``code_digest``: every source file; ``runtime_digest``:
the gradient rules registered and the constants of the lowering layers as
they are now) and the onnx and protobuf versions.  Lowering these programs
never reads a state variable's value (state variables become graph inputs
before any pass runs) nor an initialization graph, so a checkpoint of the
same model finds the entries its initial version wrote.  A model error is
never cached: a program is stored only after it was built.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections import OrderedDict
from typing import Any, Callable

import onnx

from ..autodiff import REGISTRY
from ..core import diskcache
from ..core.fingerprint import code_digest, describe, module_digest, standard_domains
from ..io.tensors import copy_fields, stored_bytes

#: Module state that changes at run time: not part of any cache key.
__fingerprint__ = False

#: The layers whose module-level constants and tables lowering reads (their
#: source is in ``code_digest``; ``runtime_digest`` covers what was changed
#: since they were imported).  Modules that keep run-time state opt out
#: with ``__fingerprint__ = False``.
LOWERING_LAYERS = ("core", "io", "autodiff", "optim", "kernels", "lower")
_lock = threading.Lock()


def runtime_digest() -> bytes:
    """Digest of what lowering reads besides its source files, as it is now:
    every gradient rule registered (``onnxtrain.autodiff.vjp`` and friends,
    user rules by their code), and the module-level constants and tables of
    the lowering layers' modules."""
    h = hashlib.sha256(b"runtime\n")
    root = __name__.partition(".")[0]
    prefixes = tuple(f"{root}.{layer}" for layer in LOWERING_LAYERS)
    names = sorted(n for n in list(sys.modules)
                   if n in prefixes or n.startswith(tuple(p + "." for p in prefixes)))
    for name in names:
        h.update(module_digest(name))
    for rule in REGISTRY.rules():
        h.update(f"\nrule {rule.domain} {rule.op_type} {rule.kind} {rule.reason!r} "
                 f"{sorted(rule.nondiff)} {describe(rule.fn, 0)}".encode())
    return h.digest()


def model_digest(proto: onnx.ModelProto, state: Any) -> bytes | None:
    """SHA-256 of the model's skeleton: its serialization with the data of
    the dense state initializers ``state`` left out (name, type and dims
    kept, in place), and without the initialization graphs (whose programs
    are not cached: they hold a model's initial weights as constants, and
    lowering them is cheap).  Everything else, other initializers, sparse
    ones, metadata and bindings included, is hashed as it is.  None when
    the skeleton is over diskcache.MAX_ENTRY_BYTES (frozen weights: programs that
    large are not cached)."""
    if _frozen_raw_bytes(proto, state) > diskcache.MAX_ENTRY_BYTES:
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
        if total > diskcache.MAX_ENTRY_BYTES:
            return None
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def _frozen_raw_bytes(proto: onnx.ModelProto, state: Any) -> int:
    """A lower bound of the skeleton's size: the raw_data bytes of the
    initializers it keeps (not state, in the graphs it holds), from their
    dims (``load`` checked that raw_data holds exactly that many)."""
    total = 0
    for g in [proto.graph, *(ti.algorithm for ti in proto.training_info)]:
        for t in g.initializer:
            if (t.data_location != onnx.TensorProto.EXTERNAL and t.name not in state
                    and t.HasField("raw_data")):
                total += stored_bytes(t) or 0
    return total


def _graph_skeleton(g: onnx.GraphProto, state: Any) -> onnx.GraphProto:
    out = onnx.GraphProto()
    copy_fields(g, out, skip=("initializer",))
    for t in g.initializer:
        if t.name in state:
            out.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        else:
            out.initializer.append(t)
    return out

def model_key(tm: Any) -> bytes | None:
    """The cache key prefix of a TrainingModel (computed once), or None when
    the cache is off or does not take the model (it imports an op domain of
    its own, or holds over diskcache.MAX_ENTRY_BYTES of non-state data)."""
    if not diskcache.enabled():
        return None
    key = getattr(tm, "cache_key", None)
    if key is None:
        # Another domain's ops may lean on schemas registered at run time
        # (``onnx.defs.register_schema``), which no key covers: not cached.
        digest = model_digest(tm.proto, tm.state) if standard_domains(tm.proto) else None
        key = b"" if digest is None else diskcache.make_key("model", code_digest(), runtime_digest(), digest)
        tm.cache_key = key
    return key or None


def program_model(tm: Any, label: str, build: Callable[[], onnx.ModelProto]) -> onnx.ModelProto:
    """The lowered model of program ``label`` of ``tm``: from the cache, or
    ``build()`` (which raises model errors as usual) then stored.  Either way
    the model may get its fused-kernel rewrite registered (``fused_for``)."""
    prefix = model_key(tm)
    if prefix is None:
        return build()
    key = diskcache.make_key("program", prefix, label)
    entry = diskcache.read("program", key)
    if entry is not None:
        meta, payload = entry
        try:
            model = _parse_program(meta, payload, label)
        except Exception:
            model = None
            diskcache.count("program.corrupt")
            diskcache.remove(diskcache.entry_path("program", key))
        if model is not None:
            diskcache.count("program.hit")
            _watch_fused(model, key, meta, payload)
            return model
    diskcache.count("program.miss")
    model = build()
    if model.ByteSize() > diskcache.MAX_ENTRY_BYTES:
        return model
    blob = model.SerializeToString()
    meta = {"label": label, "program": len(blob)}
    diskcache.write("program", key, meta, blob)
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
        diskcache.count("fused.hit")
        fused, count = known
        return (model if count == 0 else fused), count
    result = compute(model)
    fused, count = result
    diskcache.count("fused.miss")
    if diskcache.enabled():
        n = int(meta["program"])
        extra = b"" if count == 0 or fused is model else fused.SerializeToString()
        new_meta = dict(meta, fused=len(extra), fused_count=int(count), variant=int(variant))
        diskcache.write("program", key, new_meta, payload[:n] + extra)
    return result


