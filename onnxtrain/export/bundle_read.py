"""Read a training bundle back (docs/bundle.md): ``read(folder)`` checks the
folder against its manifest and returns the training model, its state and
its fit position (``onnxtrain.bundle.load`` makes a session of them).

Checked before any tensor is read, each failure one BundleError that names
the folder and the file or entry:

- ``manifest.json``: ``"format": "onnxtrain-bundle"`` and a ``version`` this
  module knows (the message names the version found);
- every file the manifest lists is there (else one message naming the
  missing files; ``BundleFileMissing`` is also a FileNotFoundError);
- ``state.bin`` is ``state_bytes`` long, and every state entry's dtype,
  shape, offset and length fit it and each other (a scalar's shape is ``[]``);
- ``training_model.onnx`` stores each state variable at its entry's place in
  ``state.bin``, with its dtype and shape, and has no other state variable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ..core.protos import all_tensors
from ..errors import BundleError, BundleFileMissing
from ..io import mapped
from ..io.model import load, validate
from .bundle_format import (
    ALIGN,
    DTYPES,
    FORMAT,
    MANIFEST,
    VERSION,
    StateEntry,
    external_info,
    nbytes,
    numpy_dtype,
)


@dataclass
class Bundle:
    """A bundle folder, checked: its manifest, training model and fit position."""

    folder: Path
    manifest: dict[str, Any]
    #: The training model, its tensors read into memory (the session needs no file of the folder).
    model: onnx.ModelProto = field(repr=False)
    entries: list[StateEntry] = field(repr=False)
    #: ``{"epoch", "batch", "step", "source": "checkpoint"}`` or None.
    fit_position: dict[str, Any] | None

    @cached_property
    def state(self) -> dict[str, np.ndarray]:
        """Every state variable, read from state.bin as the manifest lays it out."""
        path = self.folder / self.manifest["state_file"]
        out = {}
        with open(path, "rb") as f:
            for e in self.entries:
                f.seek(e.offset)
                data = f.read(e.length)
                if len(data) != e.length:
                    raise BundleError(f"{path}: ended before state variable {e.name!r} did")
                out[e.name] = np.frombuffer(data, numpy_dtype(e.dtype)).reshape(e.shape).copy()
        return out


def read(folder: str | os.PathLike) -> Bundle:
    """Check the bundle in ``folder`` (see the module doc) and read its training model."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    check_files(folder, manifest)
    entries = check_state(folder, manifest)
    model = training_model(folder, manifest, entries)
    return Bundle(folder, manifest, model, entries, fit_position(folder, manifest))


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest, after its format and version are checked."""
    if not folder.is_dir():
        if not folder.exists():
            raise BundleFileMissing(f"bundle {str(folder)!r}: no such folder")
        raise BundleError(f"bundle {str(folder)!r}: not a folder (a bundle is a folder with a {MANIFEST})")
    path = folder / MANIFEST
    if not path.is_file():
        raise BundleFileMissing(f"bundle {str(folder)!r}: missing file {MANIFEST!r} (is it a bundle folder?)")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise BundleError(f"{path}: format is {found!r}, expected {FORMAT!r}: not an onnxtrain bundle")
    version = manifest.get("version")
    if type(version) is not int:
        raise BundleError(f"{path}: version is {version!r}, expected an integer")
    if version != VERSION:
        raise BundleError(f"{path}: bundle version {version} is not known to this onnxtrain, which reads "
                          f"version {VERSION}" + (" (a newer onnxtrain wrote it: update onnxtrain)"
                                                  if version > VERSION else ""))
    return manifest


def _get(manifest: dict[str, Any], key: str, kind: type | tuple, folder: Path) -> Any:
    value = manifest.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BundleError(f"{folder / MANIFEST}: {key!r} is {value!r}, expected {names}")
    return value


def listed_files(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """Every file the manifest names, each a plain name in the folder."""
    names = [_get(manifest, k, str, folder) for k in ("state_file", "inference_model", "training_model")]
    if manifest.get("constants_file") is not None:
        names.append(_get(manifest, "constants_file", str, folder))
    programs = [_get(manifest, "inference", dict, folder)]
    programs += _get(manifest, "algorithms", list, folder)
    programs += [p for p in _get(manifest, "initializations", list, folder) if p is not None]
    for i, p in enumerate(programs):
        if not isinstance(p, dict) or not isinstance(p.get("file"), str):
            raise BundleError(f"{folder / MANIFEST}: program {i} has no 'file' name: {p!r}")
        names.append(p["file"])
    for name in names:
        if not name or name in (".", "..") or "/" in name or "\\" in name or name != os.path.basename(name):
            raise BundleError(f"{folder / MANIFEST}: file name {name!r} is not a plain name in the folder")
    return names


def check_files(folder: Path, manifest: dict[str, Any]) -> None:
    """BundleFileMissing naming every listed file that is not a file in ``folder``."""
    missing = [n for n in dict.fromkeys(listed_files(folder, manifest)) if not (folder / n).is_file()]
    if missing:
        shown = ", ".join(repr(n) for n in missing)
        raise BundleFileMissing(f"bundle {str(folder)!r}: missing file{'s' if len(missing) > 1 else ''} "
                                f"{shown} (listed in {MANIFEST})")


def check_state(folder: Path, manifest: dict[str, Any]) -> list[StateEntry]:
    """The state entries, each checked against its dtype, shape and state.bin."""
    size = _get(manifest, "state_bytes", int, folder)
    path = folder / manifest["state_file"]
    found = path.stat().st_size
    if found != size:
        raise BundleError(f"{path}: {found} bytes, but the manifest's state_bytes is {size} "
                          "(a state.bin of another bundle, or cut short?)")
    entries: list[StateEntry] = []
    for i, item in enumerate(_get(manifest, "state", list, folder)):
        entries.append(_entry(item, f"{folder / MANIFEST}: state[{i}]", size))
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise BundleError(f"{folder / MANIFEST}: state variable {twice!r} is listed twice")
    ordered = sorted(entries, key=lambda e: e.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.length > b.offset:
            raise BundleError(f"{folder / MANIFEST}: state variables {a.name!r} and {b.name!r} overlap "
                              "in state.bin")
    return entries


def _entry(item: Any, where: str, size: int) -> StateEntry:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise BundleError(f"{where}: expected {{'name', 'dtype', 'shape', 'offset', 'length'}}, got {item!r}")
    where = f"{where} ({item['name']!r})"
    dtype, shape = item.get("dtype"), item.get("shape")
    if dtype not in DTYPES:
        raise BundleError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise BundleError(f"{where}: shape {shape!r} is not a list of sizes ([] for a scalar)")
    offset, length = item.get("offset"), item.get("length")
    if type(offset) is not int or offset < 0 or offset % ALIGN:
        raise BundleError(f"{where}: offset {offset!r} is not a multiple of {ALIGN}")
    expected = nbytes(dtype, shape)
    if length != expected or type(length) is not int:
        raise BundleError(f"{where}: length {length!r}, but {dtype}{shape} takes {expected} bytes")
    if offset + length > size:
        raise BundleError(f"{where}: bytes [{offset}, {offset + length}) lie past the end of state.bin "
                          f"({size} bytes)")
    return StateEntry(item["name"], dtype, tuple(shape), offset, length, bool(item.get("trainable", False)))


def training_model(folder: Path, manifest: dict[str, Any], entries: list[StateEntry]) -> onnx.ModelProto:
    """The training model with its data read in; each state variable must be
    stored at its entry's place in state.bin, and there must be no other."""
    path = folder / manifest["training_model"]
    where = f"{path}"
    try:
        skeleton = onnx.load_model(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001  (protobuf's DecodeError and friends)
        raise BundleError(f"{where}: not an ONNX model ({type(exc).__name__}: {exc})") from None
    stored = {t.name: t for g in [skeleton.graph] + [ti.algorithm for ti in skeleton.training_info]
              for t in g.initializer}
    state_file = manifest["state_file"]
    for e in entries:
        t = stored.get(e.name)
        info = external_info(t) if t is not None else {}
        place = (info.get("location"), int(info.get("offset") or 0), int(info.get("length") or -1))
        if t is None or place != (state_file, e.offset, e.length) or t.data_type != e.elem_type \
                or tuple(t.dims) != e.shape:
            raise BundleError(f"{where}: state variable {e.name!r} is not stored as the manifest says "
                              f"({e.dtype}{list(e.shape)} at bytes {e.offset}+{e.length} of {state_file})")
    proto, base = load(path)
    tm = validate(proto, base, tensors_checked=True)
    names = {e.name for e in entries}
    if set(tm.state) != names:
        extra = sorted(set(tm.state) - names) or sorted(names - set(tm.state))
        raise BundleError(f"{where}: its state variables differ from the manifest's ({extra[0]!r})")
    for t in all_tensors(proto):  # read in: the session holds no file of the folder
        if mapped.is_mapped(t):
            data = mapped.read(t).tobytes()
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
            t.raw_data = data
    return proto


def fit_position(folder: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's fit position, as ``TrainingSession.fit_position`` holds it."""
    value = manifest.get("fit_position")
    if value is None:
        return None
    ok = isinstance(value, dict) and all(
        type(value.get(k, 0)) is int and value.get(k, 0) >= 0 for k in ("epoch", "batch")) and (
        value.get("step") is None or type(value["step"]) is int and value["step"] >= 0)
    if not ok:
        raise BundleError(f"{folder / MANIFEST}: fit_position is {value!r}, expected "
                          "{'epoch': N, 'batch': B, 'step': S} or null")
    return {"epoch": value.get("epoch", 0), "batch": value.get("batch", 0), "step": value.get("step"),
            "source": "checkpoint"}
