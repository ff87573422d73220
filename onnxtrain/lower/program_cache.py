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

Large constants (``BY_REFERENCE_BYTES`` or more: a LoRA base model's frozen
weights) are kept by reference: the skeleton holds the SHA-256 of their
data instead of the data, an entry stores a program without the data of
each initializer that equals the model's constant of that name, and a hit
takes that data from the model again.  So a model of any size is cached,
and an entry stays the size of its graph.  The placeholders of the files
``storage.hold`` wrote for a session count by their data's SHA-256 too,
in the key and in an entry, and a hit points them at this process's file
(``References``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Callable

import onnx

from ..autodiff import REGISTRY
from ..core import diskcache
from ..core.fingerprint import code_digest, describe, layers_digest, standard_domains
from ..core.protos import all_tensors
from ..io import mapped
from ..io.tensors import copy_fields, stored_bytes

#: Module state that changes at run time: not part of any cache key.
__fingerprint__ = False

#: The layers whose module-level constants and tables lowering reads (their
#: source is in ``code_digest``; ``runtime_digest`` covers what was changed
#: since they were imported).  Modules that keep run-time state opt out
#: with ``__fingerprint__ = False``.
LOWERING_LAYERS = ("core", "io", "autodiff", "optim", "kernels", "lower")
_lock = threading.Lock()
#: Non-state initializers of at least this many bytes of raw_data are kept by reference.
BY_REFERENCE_BYTES = 1 << 16
#: The location a held placeholder names in a key or an entry: then its data's SHA-256.
HELD = mapped.HELD


def runtime_digest() -> bytes:
    """Digest of what lowering reads besides its source files, as it is now:
    every gradient rule registered (``onnxtrain.autodiff.vjp`` and friends,
    user rules by their code), and the module-level constants and tables of
    the lowering layers' modules."""
    h = hashlib.sha256(b"runtime\n")
    h.update(layers_digest(LOWERING_LAYERS))
    for rule in REGISTRY.rules():
        h.update(f"\nrule {rule.domain} {rule.op_type} {rule.kind} {rule.reason!r} "
                 f"{sorted(rule.nondiff)} {describe(rule.fn, 0)}".encode())
    return h.digest()


def model_digest(proto: onnx.ModelProto, state: Any, refs: References | None = None) -> bytes | None:
    """SHA-256 of the model's skeleton: its serialization with the data of
    the dense state initializers ``state`` left out (name, type and dims
    kept, in place), and without the initialization graphs (whose programs
    are not cached: they hold a model's initial weights as constants, and
    lowering them is cheap).  Other initializers of ``BY_REFERENCE_BYTES``
    or more count by the digest of their data, and go into ``refs`` when
    given; so do the placeholders of the files ``storage.hold`` wrote for
    this process, anywhere in the model (``mapped.is_owned``: their location
    differs in every process).  Everything else, the smaller initializers,
    sparse ones, metadata and bindings included, is hashed as it is.  None
    when the skeleton is over diskcache.MAX_ENTRY_BYTES (programs that large
    are not cached)."""
    if _frozen_raw_bytes(proto, state) > diskcache.MAX_ENTRY_BYTES:
        return None  # known without copying the frozen weights into a skeleton
    refs = References() if refs is None else refs
    skeleton = onnx.ModelProto()
    copy_fields(proto, skeleton, skip=("graph", "training_info"))
    big: dict[str, onnx.TensorProto] = {}
    _graph_skeleton(proto.graph, state, big, skeleton.graph)
    for ti in proto.training_info:
        rest = skeleton.training_info.add()
        copy_fields(ti, rest, skip=("algorithm", "initialization"))
        _graph_skeleton(ti.algorithm, state, big, rest.algorithm)
    refs.neutralize(skeleton)
    data = skeleton.SerializeToString()
    if len(data) > diskcache.MAX_ENTRY_BYTES:
        return None
    h = hashlib.sha256(b"model\n")
    h.update(data)
    for name, t in big.items():  # in the skeleton's order
        h.update(f"\nref {name}\n".encode())
        h.update(hashlib.sha256(t.raw_data).digest())
    refs.constants.update(big)
    return h.digest()


class References:
    """What a model's cache key holds by reference, and how a program entry
    leaves it out and a hit puts it back:

    - ``constants``: large inline constants by name (``BY_REFERENCE_BYTES``):
      an entry drops the data of each main-graph initializer equal to the
      model's of that name (``detached``), and a hit copies it back
      (``attached``).
    - held placeholders (``mapped.is_owned``), by the SHA-256 of their data:
      an entry and a key name ``HELD`` + that digest instead of this
      process's file, and a hit points them at this process's file again.
    """

    def __init__(self) -> None:
        self.constants: dict[str, onnx.TensorProto] = {}
        self._sources: dict[str, tuple[str, int, int]] = {}  # digest -> source

    def neutralize(self, model: onnx.ModelProto) -> None:
        """Point every held placeholder of ``model`` at its digest instead of
        its file (in place)."""
        held = [t for t in all_tensors(model) if mapped.is_owned(t)]
        for t, digest in zip(held, mapped.owned_digests(held)):
            source = mapped.source(t)
            self._sources.setdefault(digest, source)
            mapped.point(t, HELD + digest, 0, source[2])

    def restore(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` (parsed from an entry) with each placeholder ``neutralize``
        left pointed at this process's file again (in place)."""
        for t in all_tensors(model):
            if t.data_location == onnx.TensorProto.EXTERNAL:
                location = mapped.location(t)
                if location.startswith(HELD):
                    source = self._sources.get(location[len(HELD):])
                    if source is None:  # the entry is not this model's
                        raise ValueError(f"held data of {t.name!r} not in the model")
                    mapped.point(t, *source)
        return model

    def detached(self, model: onnx.ModelProto) -> tuple[bytes, list[str]]:
        """The serialization of ``model`` without the data of each main-graph
        initializer equal to the constant of its name, and their names, its
        held placeholders neutralized (the model itself is left as it is)."""
        names = [t.name for t in model.graph.initializer
                 if (src := self.constants.get(t.name)) is not None and t.HasField("raw_data")
                 and t.data_type == src.data_type and list(t.dims) == list(src.dims)
                 and t.raw_data == src.raw_data]
        held = any(mapped.is_owned(t) for t in all_tensors(model))
        if not names and not held:
            return model.SerializeToString(), names
        out = onnx.ModelProto()
        copy_fields(model, out, skip=("graph",))
        copy_fields(model.graph, out.graph, skip=("initializer",))
        wanted = set(names)
        for t in model.graph.initializer:
            if t.name in wanted:
                copy_fields(t, out.graph.initializer.add(), skip=("raw_data",))
            else:
                out.graph.initializer.append(t)
        self.neutralize(out)
        return out.SerializeToString(), names

    def attached(self, model: onnx.ModelProto, names: list) -> onnx.ModelProto:
        """``model`` (parsed from an entry) with the data of ``names`` put
        back, and its held placeholders restored (in place)."""
        wanted = set(names)
        for t in model.graph.initializer:
            if t.name in wanted:
                src = self.constants[t.name]  # a KeyError: the entry is not this model's
                if t.HasField("raw_data") or t.data_type != src.data_type or list(t.dims) != list(src.dims):
                    raise ValueError(f"reference {t.name!r} does not match")
                t.raw_data = src.raw_data
                wanted.discard(t.name)
        if wanted:
            raise ValueError(f"references {sorted(wanted)} not in the program")
        return self.restore(model)


def _by_reference(t: onnx.TensorProto) -> bool:
    return t.data_location != onnx.TensorProto.EXTERNAL and (stored_bytes(t) or 0) >= BY_REFERENCE_BYTES \
        and t.HasField("raw_data")


def _frozen_raw_bytes(proto: onnx.ModelProto, state: Any) -> int:
    """A lower bound of the skeleton's size: the raw_data bytes of the
    initializers it keeps (not state, not by reference, in the graphs it
    holds), from their dims (``load`` checked that raw_data holds exactly
    that many)."""
    total = 0
    for g in [proto.graph, *(ti.algorithm for ti in proto.training_info)]:
        for t in g.initializer:
            if (t.data_location != onnx.TensorProto.EXTERNAL and t.name not in state
                    and t.HasField("raw_data")):
                size = stored_bytes(t) or 0
                total += 0 if size >= BY_REFERENCE_BYTES else size
    return total


def _graph_skeleton(g: onnx.GraphProto, state: Any, big: dict, out: onnx.GraphProto) -> None:
    """``g`` into ``out`` with the data of its state initializers left out,
    and of those kept by reference (added to ``big``; a name twice is an
    error of the model that validation reports: its second tensor is hashed
    as it is)."""
    copy_fields(g, out, skip=("initializer",))
    for t in g.initializer:
        if t.name in state:
            out.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        elif _by_reference(t) and t.name not in big:
            big[t.name] = t
            out.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        else:
            out.initializer.append(t)


def model_key(tm: Any) -> bytes | None:
    """The cache key prefix of a TrainingModel (computed once), or None when
    the cache is off or does not take the model (an op of it has a schema
    registered at run time, or it holds over diskcache.MAX_ENTRY_BYTES of
    non-state data)."""
    if not diskcache.enabled():
        return None
    key = getattr(tm, "cache_key", None)
    if key is None:
        # An op may lean on a schema registered at run time
        # (``onnx.defs.register_schema``), which no key covers: not cached.
        refs = References()
        digest = model_digest(tm.proto, tm.state, refs) if standard_domains(tm.proto) else None
        key = b"" if digest is None else diskcache.make_key("model", code_digest(), runtime_digest(), digest)
        tm.cache_key, tm.cache_refs = key, refs
    return key or None


def program_model(tm: Any, label: str, build: Callable[[], onnx.ModelProto]) -> onnx.ModelProto:
    """The lowered model of program ``label`` of ``tm``: from the cache, or
    ``build()`` (which raises model errors as usual) then stored.  Either way
    the model may get its fused-kernel rewrite registered (``fused_for``)."""
    prefix = model_key(tm)
    if prefix is None:
        return build()
    refs = tm.cache_refs
    key = diskcache.make_key("program", prefix, label)
    entry = diskcache.read("program", key)
    if entry is not None:
        meta, payload = entry
        try:
            model = refs.attached(_parse_program(meta, payload, label), meta.get("refs", []))
        except Exception:
            model = None
            diskcache.count("program.corrupt")
            diskcache.remove(diskcache.entry_path("program", key))
        if model is not None:
            diskcache.count("program.hit")
            _watch_fused(model, key, meta, payload, refs)
            return model
    diskcache.count("program.miss")
    model = build()
    blob, names = refs.detached(model)
    if len(blob) > diskcache.MAX_ENTRY_BYTES:
        return model
    meta = {"label": label, "program": len(blob), "refs": names}
    diskcache.write("program", key, meta, blob)
    _watch_fused(model, key, meta, blob, refs)
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


def _watch_fused(model: onnx.ModelProto, key: bytes, meta: dict, payload: bytes, refs: References) -> None:
    known = None
    if "fused" in meta:
        try:
            count = int(meta["fused_count"])
            n, m = int(meta["program"]), int(meta["fused"])
            if count == 0:
                known = (model, 0)
            elif m > 0 and n + m == len(payload):
                fused = onnx.ModelProto.FromString(payload[n:n + m])
                known = (refs.attached(fused, meta.get("fused_refs", [])), count)
        except Exception:
            known = None
    with _lock:
        _fused[id(model)] = (model, key, meta, payload, known, refs)
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
    _, key, meta, payload, known, refs = watched
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
        extra, names = (b"", []) if count == 0 or fused is model else refs.detached(fused)
        if n + len(extra) > diskcache.MAX_ENTRY_BYTES:
            return result
        new_meta = dict(meta, fused=len(extra), fused_count=int(count), variant=int(variant), fused_refs=names)
        diskcache.write("program", key, new_meta, payload[:n] + extra)
    return result


