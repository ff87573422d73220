"""Built training models kept in the startup cache (``core.diskcache``; docs/startup.md).

``build.training_model`` on the same inference model with the same options
and the same code gives the same training model, bit for bit.  A ``built-*``
entry keeps that answer, so that a script run again, the command line
included, skips the builder (about 0.2 s on W5 and W6, more on a
transformer with LoRA).  The key is made of:

- the inference model as loaded: its bytes, with the data of each
  main-graph initializer of ``BY_REFERENCE_BYTES`` or more, or mapped from
  its file (``io.mapped``), replaced by its SHA-256 (the builder reads
  values: a mask, a 0-d constant, equal weights);
- the options, each described by value (``describe_option``): names,
  numbers, lists of them, arrays by their bytes, and onnxtrain's own
  option objects (``build.AdamW(...)``, ``build.LoRA(...)``, losses,
  schedules) field by field;
- the path the model was read from (the built model records it);
- onnxtrain's code (``code_digest``) and the constants and tables of the
  modules the builder reads, as they are now.

What is not cached: a callable option (a loss function, a ``trainable`` or
LoRA ``targets`` predicate, an optimizer subclassed outside onnxtrain), whose
code no key covers; a model of ``storage.SPILL_FROM`` or more (the builder
leaves its weights in their files), or with external data elsewhere than in
mapped main-graph initializers; an op with a schema registered at run time;
and a build during
which the builder warned (``warn``), so that its warnings come again at
every build.

An entry stores the built model without the data of each initializer equal
to one of the inference model's large ones (named by that data's digest),
and a hit copies the data back from the model given: an entry is the size
of the graph, not of the weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
import onnx

from ..core import diskcache
from ..core.fingerprint import code_digest, layers_digest, sha256_all, standard_domains
from ..core.protos import all_tensors
from ..io import mapped, storage
from ..io.tensors import copy_fields, stored_bytes

#: Module state that changes at run time: not part of any cache key.
__fingerprint__ = False

KIND = "built"
#: Initializers of at least this many bytes count by the SHA-256 of their data.
BY_REFERENCE_BYTES = 1 << 16
#: Data hashed on several threads from this many bytes on (``sha256_all``).
PARALLEL_HASH_BYTES = 8 << 20
#: The layers whose module-level constants and tables the builder reads.
BUILDER_LAYERS = ("core", "io", "optim", "builder")


#: The builder's warnings in the build under way (``BuiltModels.recording``).
_warned: ContextVar[list[str] | None] = ContextVar("onnxtrain_builder_warned", default=None)


def warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn`` for the builder, ``stacklevel`` as there (from the
    caller's frame): a build that warns is not cached."""
    noted = _warned.get()
    if noted is not None:
        noted.append(message)
    warnings.warn(message, category, stacklevel=stacklevel + 1)


# ------------------------------------------------------------------ options
def describe_option(v: Any) -> str | None:
    """A deterministic description of an option's value, or None when it
    has none (a callable, an object of a class defined outside onnxtrain)."""
    if v is None or type(v) in (bool, int, float, str):
        return repr(v)
    if isinstance(v, (list, tuple)):
        items = [describe_option(x) for x in v]
        return None if None in items else f"{type(v).__name__}({','.join(items)})"
    if isinstance(v, np.ndarray):
        data = np.ascontiguousarray(v)
        return f"ndarray({data.dtype.str},{data.shape},{hashlib.sha256(data.tobytes()).hexdigest()})"
    if isinstance(v, np.generic):
        return f"{type(v).__name__}({v!r})"
    cls = type(v)
    if dataclasses.is_dataclass(v) and cls.__module__.partition(".")[0] == __name__.partition(".")[0]:
        fields = [(f.name, describe_option(getattr(v, f.name))) for f in dataclasses.fields(v)]
        if any(d is None for _, d in fields):
            return None
        return f"{cls.__module__}.{cls.__qualname__}(" + ",".join(f"{n}={d}" for n, d in fields) + ")"
    return None


# ------------------------------------------------------------------ the model
def _large(t: onnx.TensorProto) -> bool:
    return (t.data_location != onnx.TensorProto.EXTERNAL and t.HasField("raw_data")
            and (stored_bytes(t) or 0) >= BY_REFERENCE_BYTES)


def _nbytes(b) -> int:
    return len(b) if isinstance(b, bytes) else b.nbytes


def source_digest(source: onnx.ModelProto) -> tuple[bytes, dict[str, Any]]:
    """(SHA-256 of the inference model, the data of its large initializers
    by digest: bytes, or the array of a mapped one's file range)."""
    skeleton = onnx.ModelProto()
    copy_fields(source, skeleton, skip=("graph",))
    copy_fields(source.graph, skeleton.graph, skip=("initializer",))
    blobs = []
    for t in source.graph.initializer:
        if mapped.is_mapped(t):
            mapped.check_trusted(t, f"initializer {t.name!r}")  # as load would: the file is unchanged
            blobs.append(mapped.array(t))
            skeleton.graph.initializer.append(t)  # (the placeholder: the data is in the digest)
        elif _large(t):
            blobs.append(t.raw_data)
            copy_fields(t, skeleton.graph.initializer.add(), skip=("raw_data",))
        else:
            skeleton.graph.initializer.append(t)
    digests = sha256_all(blobs, PARALLEL_HASH_BYTES)
    h = hashlib.sha256(b"inference model\n")
    h.update(skeleton.SerializeToString())
    for d in digests:
        h.update(f"\n{d}".encode())
    return h.digest(), dict(zip(digests, blobs))


def detached(built: onnx.ModelProto, known: Mapping[str, int]) -> tuple[bytes, list]:
    """``built`` serialized without the data of its tensors (initializers and
    constants, the initialization graphs' included) whose data is one of
    ``known`` (the inference model's: digest -> size), and where each was:
    [place, digest], by the order of ``all_tensors``.  ``built`` is not
    changed."""
    sizes = set(known.values())
    out = onnx.ModelProto()
    out.CopyFrom(built)
    tensors = list(all_tensors(out))
    places = [i for i, t in enumerate(tensors) if _large(t) and stored_bytes(t) in sizes]
    where = []
    for i, digest in zip(places, sha256_all([tensors[i].raw_data for i in places], PARALLEL_HASH_BYTES)):
        if digest in known:
            tensors[i].ClearField("raw_data")
            where.append([i, digest])
    return out.SerializeToString(), where


def attached(payload: bytes, where: list, data: Mapping[str, Any]) -> onnx.ModelProto | None:
    """The built model of an entry with its data put back, or None when the
    entry does not fit (another model's, or damaged)."""
    out = onnx.ModelProto()
    try:
        out.ParseFromString(payload)
        tensors = list(all_tensors(out)) if where else []
        for i, digest in where:
            t, blob = tensors[i], data[digest]
            if _nbytes(blob) != stored_bytes(t) or t.HasField("raw_data"):
                return None
            t.raw_data = blob if isinstance(blob, bytes) else np.ascontiguousarray(blob).tobytes()
    except Exception:  # a payload that does not parse, a place or a digest it lacks
        return None
    return out


def held_attached(payload: bytes, where: list, data: Mapping[str, Any]) -> onnx.ModelProto | None:
    """``attached``, with the data put in the files of ``storage.hold``
    rather than in the model (written once for a weight and its starting
    value, never copied into a protobuf): a model for ``TrainingSession``
    only.  None when the entry does not fit, or no file could be written."""
    out = onnx.ModelProto()
    try:
        out.ParseFromString(payload)
        tensors = list(all_tensors(out)) if where else []
        given = {}
        for i, digest in where:
            t, blob = tensors[i], data[digest]
            if _nbytes(blob) != stored_bytes(t) or t.HasField("raw_data"):
                return None
            if storage.holds(t):
                given[id(t)] = (t, blob)
            else:  # (smaller than what is held, or of a type no file holds: put back)
                t.raw_data = blob if isinstance(blob, bytes) else np.ascontiguousarray(blob).tobytes()
    except Exception:  # a payload that does not parse, a place or a digest it lacks
        return None
    state = {b.key for ti in out.training_info for b in (*ti.update_binding, *ti.initialization_binding)}
    return storage.hold(out, state, given, in_place=True) if given else out


def _self_contained(model: onnx.ModelProto, mapped_weights: bool = False) -> bool:
    """Whether every tensor of ``model`` is inline (or, with
    ``mapped_weights``, a mapped main-graph initializer), and all of them
    less than ``load`` spills to files and the builder leaves mapped
    (``storage.SPILL_FROM``): so the built model holds its data."""
    external = total = 0
    for t in all_tensors(model):
        external += t.data_location == onnx.TensorProto.EXTERNAL
        total += stored_bytes(t) or 0
    if external and mapped_weights:  # are they all mapped weights?
        external -= sum(1 for t in model.graph.initializer if mapped.is_mapped(t))
    return not external and total < storage.SPILL_FROM


# ------------------------------------------------------------------ the cache
class BuiltModels:
    """The cache's answer for one ``training_model`` call: ``lookup`` (the
    built model or None), then, on a miss, ``recording`` around the build and
    ``store`` of its result.

    ``source`` may be a ModelProto that ``load`` has not checked: a key only
    hashes it (nothing is sized by its dims), and an entry exists only for
    a model that passed ``load`` and the build before, with this code; the
    same key is the same model, so a hit checks nothing again."""

    def __init__(self, source: onnx.ModelProto, path: str | None, options: Mapping[str, Any]) -> None:
        self.key: bytes | None = None
        self._data: dict[str, Any] = {}
        self._known: dict[str, int] = {}
        self._warned = False
        if not diskcache.enabled():
            return
        described = {k: describe_option(v) for k, v in options.items()}
        if None in described.values():
            diskcache.count(f"{KIND}.uncacheable")
            return  # an option described by nothing: its code is in no key
        if not _self_contained(source, mapped_weights=True) or not standard_domains(source):
            diskcache.count(f"{KIND}.uncacheable")
            return
        digest, self._data = source_digest(source)
        self.key = diskcache.make_key(KIND, code_digest(), layers_digest(BUILDER_LAYERS), digest,
                                      repr(path), "\n".join(f"{k}={d}" for k, d in described.items()))

    def lookup(self, held: bool = False) -> onnx.ModelProto | None:
        """The built model, or None; ``held``: its large tensors in the files
        of ``storage.hold`` (``held_attached``) where that can be done."""
        if self.key is None:
            return None
        entry = diskcache.read(KIND, self.key)
        built = None
        if entry is not None:
            where = entry[0].get("detached", [])
            built = held_attached(entry[1], where, self._data) if held else None
            if built is None:
                built = attached(entry[1], where, self._data)
        if built is not None:
            diskcache.count(f"{KIND}.hit")
            return built
        if entry is not None:
            diskcache.count(f"{KIND}.corrupt")
            diskcache.remove(diskcache.entry_path(KIND, self.key))
        diskcache.count(f"{KIND}.miss")
        self._known = {digest: _nbytes(blob) for digest, blob in self._data.items()}
        self._data = {}  # the digests are kept, the data let go
        return None

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Around the build: whether the builder warned (``warn``; such a
        build is not stored, so that its warnings come again at every build)."""
        token = _warned.set([])
        try:
            yield
        finally:
            self._warned = bool(_warned.get())
            _warned.reset(token)

    def store(self, built: onnx.ModelProto) -> None:
        if self.key is None or self._warned or not _self_contained(built):
            return
        payload, where = detached(built, self._known)
        if len(payload) <= diskcache.MAX_ENTRY_BYTES:
            diskcache.write(KIND, self.key, {"detached": where}, payload)
