"""Write a portable training bundle (docs/bundle.md): a folder that any
ONNX runtime can train from.

``write(source, folder)``: ``source`` is a ``SessionLike`` (its model, its
current state and fit position) or a training model (a path, bytes or a
ModelProto: its state is its initializers' values, its fit position the one
its metadata records).  The folder is written whole or not at all
(``core.files.write_folder``).  ``bundle_read.read`` reads one back.

What goes where:

- ``state.bin``: every state variable, in the model's order, 64-byte aligned;
- ``program_*.onnx``: the standard-op programs (``bundle_programs``), state
  as inputs, constants of 1 KiB or more in ``constants.bin``;
- ``inference.onnx``: the inference program with the state it reads as
  initializers stored in ``state.bin`` (external data), so that a plain
  ``onnxruntime.InferenceSession`` runs it with the bundle's weights;
- ``training_model.onnx``: the training model itself (training_info kept)
  for Python's ``load``, its state initializers external data in
  ``state.bin``, its fit position in its metadata;
- ``manifest.json``: what all of the above is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx

from .._version import __version__
from ..core.files import check_folder_target, write_folder
from ..core.graph import PREVIEW_DOMAIN
from ..core.protos import all_tensors
from ..errors import BundleError
from ..io import mapped
from ..io.combine import copy_graph
from ..io.metadata import model_metadata, read_position, write_position
from ..io.model import ModelLike, TrainingModel, load, validate
from ..io.tensors import copy_fields
from ..lower.programs import Program, algorithm_programs, inference_program, initialization_program
from ..train.metrics import metric_functions
from ..train.spec import fit_spec, label_classes
from .bundle_data import ConstantStore, write_state
from .bundle_format import (
    CONSTANTS_FILE,
    FORMAT,
    INFERENCE_MODEL,
    MANIFEST,
    STATE_FILE,
    TRAINING_MODEL,
    VERSION,
    StateEntry,
    dtype_name,
    program_file,
    state_layout,
)
from .bundle_programs import default_opset, entry, portable
from .session_like import SessionLike


def write(source: SessionLike | ModelLike, folder: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the bundle of ``source`` to ``folder`` (see the module doc); returns its path.

    An existing non-empty ``folder`` is refused unless ``overwrite``, and
    anything that is not a folder always is (FileExistsError, nothing changed)."""
    check_folder_target(folder, overwrite)  # before the work, as after it
    plan = BundlePlan.of(source)
    return write_folder(folder, plan.fill, overwrite)


@dataclass
class BundlePlan:
    """What a bundle holds, before any file is written: the validated model,
    the state values and layout, the lowered programs."""

    tm: TrainingModel
    values: Mapping[str, np.ndarray]
    entries: list[StateEntry]
    state_bytes: int
    position: Mapping[str, Any] | None
    inference: Program
    algorithms: list[Program]
    initializations: list[Program | None]

    @classmethod
    def of(cls, source: SessionLike | ModelLike) -> BundlePlan:
        if isinstance(source, SessionLike):
            proto, base = load(source.model)
            values: Mapping[str, np.ndarray] = dict(source.state)  # one state version (StateView)
            position = source.fit_position
        elif isinstance(source, (str, os.PathLike, bytes, bytearray, onnx.ModelProto)):
            proto, base = load(source)
            values = {}
            position = read_position(proto)
        else:
            raise TypeError(f"bundle: source must be a TrainingSession (or another SessionLike) or a "
                            f"training model (path, bytes, ModelProto), not {type(source).__name__}")
        tm = validate(proto, base, tensors_checked=True)
        if not tm.training_info:
            raise BundleError("the model has no training_info: a bundle holds a training model; make one "
                              "with onnxtrain.build.training_model (onnxtrain make-training)")
        if not values:
            values = tm.initial_values(tm.state, readonly=True)
        trainable = trainable_names(tm)
        entries, size = state_layout(
            (name, dtype_name(var.elem_type, f"state variable {name!r}"), var.shape, name in trainable)
            for name, var in tm.state.items())
        n = len(tm.training_info)
        return cls(tm, values, entries, size, position, inference_program(tm),
                   [algorithm_programs(tm, i)[0] for i in range(n)],
                   [initialization_program(tm, i) for i in range(n)])

    # ------------------------------------------------------------- writing
    def fill(self, folder: Path) -> None:
        """Write every file of the bundle into ``folder`` (empty); the manifest last."""
        with open(folder / CONSTANTS_FILE, "wb") as f:
            store = ConstantStore(f, CONSTANTS_FILE)
            entries, models = self.programs(store)
            models[INFERENCE_MODEL] = self.inference_model(models[program_file("inference")])
            models[TRAINING_MODEL] = self.training_model(store)
            _sync(f)
        if store.size == 0:
            os.unlink(folder / CONSTANTS_FILE)
        with open(folder / STATE_FILE, "wb") as f:
            write_state(f, self.entries, self.values)
            _sync(f)
        for name, model in models.items():
            _write_file(folder / name, model.SerializeToString())
        programs = [m for name, m in models.items() if name.startswith("program_")]
        manifest = self.manifest(entries, programs, store.size > 0)
        _write_file(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())

    def programs(self, store: ConstantStore) -> tuple[dict[str, Any], dict[str, onnx.ModelProto]]:
        """The manifest's ``inference``, ``algorithms`` and ``initializations``,
        and the portable model of each program by file name."""
        state = set(self.tm.state)
        models: dict[str, onnx.ModelProto] = {}

        def add(kind: str, program: Program, index: int | None = None) -> dict[str, Any]:
            file = program_file(kind, index)
            models[file] = portable(program, state, store)
            return entry(kind, program, models[file], file, state)

        entries = {
            "inference": add("inference", self.inference),
            "algorithms": [add("algorithm", p, i) for i, p in enumerate(self.algorithms)],
            "initializations": [None if p is None else add("initialization", p, i)
                                for i, p in enumerate(self.initializations)],
        }
        return entries, models

    def inference_model(self, program: onnx.ModelProto) -> onnx.ModelProto:
        """inference.onnx: the portable inference program with the state it
        reads as initializers in state.bin (its inputs: the data inputs only)."""
        model = onnx.ModelProto()
        model.CopyFrom(program)
        g = model.graph
        places = {e.name: e for e in self.entries}
        kept = [vi for vi in g.input if vi.name not in places]
        for vi in g.input:
            e = places.get(vi.name)
            if e is not None:
                t = g.initializer.add(name=e.name, data_type=e.elem_type, dims=e.shape)
                mapped.point(t, STATE_FILE, e.offset, e.length)
        del g.input[:]
        g.input.extend(kept)
        return model

    def training_model(self, store: ConstantStore) -> onnx.ModelProto:
        """training_model.onnx: the model, its state initializers pointing
        into state.bin (sparse ones dense: training fills them in; their
        initial values never copied), its constants of 1 KiB or more in
        constants.bin."""
        src, places = self.tm.proto, {e.name: e for e in self.entries}
        model = onnx.ModelProto()
        copy_fields(src, model, skip=("graph", "training_info"))
        graphs = [(src.graph, model.graph, "graph")]
        for i, ti in enumerate(src.training_info):
            out = model.training_info.add()
            copy_fields(ti, out, skip=("algorithm",))
            graphs.append((ti.algorithm, out.algorithm, f"training_info[{i}].algorithm"))
        for source, g, origin in graphs:
            copy_graph(source, places, into=g)
            for name, var in self.tm.state.items():
                if var.origin == origin:
                    e = places[name]
                    mapped.point(g.initializer.add(name=name, data_type=e.elem_type, dims=e.shape),
                                 STATE_FILE, e.offset, e.length)
        for t in all_tensors(model):
            if not _in_bundle(t):
                store.put(t)
        write_position(model, self.position)
        return model

    def manifest(self, programs: dict[str, Any], models: list[onnx.ModelProto],
                 constants: bool) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "producer": {"name": "onnxtrain", "version": __version__},
            "opset": max(default_opset(m) for m in models),
            "ir_version": max(m.ir_version for m in models),
            "state_file": STATE_FILE,
            "state_bytes": self.state_bytes,
            "state": [e.to_json() for e in self.entries],
            "constants_file": CONSTANTS_FILE if constants else None,
            **programs,
            "inference_model": INFERENCE_MODEL,
            "training_model": TRAINING_MODEL,
            "training": self.training(),
            "fit_position": position_json(self.position),
        }

    def training(self) -> dict[str, Any]:
        """The fit loop's facts (``train.spec.fit_spec``): metadata of a built
        model, inferred from the graphs for a hand-written one."""
        view = _ProgramsView(self.tm.proto, self.inference, self.algorithms)
        spec = fit_spec(view)
        meta = model_metadata(self.tm.proto)
        lr = meta.get("learning_rate")
        return {
            "inputs": list(spec.inputs),
            "target": spec.target,
            "loss": spec.loss,
            "prediction": spec.prediction,
            "task": spec.task,
            "classes": label_classes(view, spec.target) if spec.target else None,
            "metrics": list(metric_functions(spec, None, "bundle")) if spec.loss else [],
            "cycle": list(spec.cycle) if "cycle" in spec.from_metadata else None,
            "learning_rate": {"state": lr["state"], "base": lr.get("base")} if isinstance(lr, dict) else None,
        }


@dataclass
class _ProgramsView:
    """What ``fit_spec`` reads of a session, from the programs."""

    model: onnx.ModelProto
    inference: Program
    algorithms: list[Program]

    @property
    def inference_inputs(self) -> dict[str, onnx.ValueInfoProto]:
        return dict(self.inference.feeds)

    @property
    def inference_outputs(self) -> list[str]:
        return list(self.inference.outputs)

    @property
    def algorithm_inputs(self) -> list[dict[str, onnx.ValueInfoProto]]:
        return [dict(p.feeds) for p in self.algorithms]

    @property
    def algorithm_outputs(self) -> list[list[str]]:
        return [list(p.returned) for p in self.algorithms]

    @property
    def num_algorithms(self) -> int:
        return len(self.algorithms)


def trainable_names(tm: TrainingModel) -> set[str]:
    """The builder's trainable parameters (metadata ``trainable``); for a
    hand-written model, the state variables some Gradient node differentiates by."""
    listed = model_metadata(tm.proto).get("trainable")
    if isinstance(listed, list):
        return {n for n in listed if n in tm.state}
    names: set[str] = set()
    for g in [tm.proto.graph] + [ti.algorithm for ti in tm.proto.training_info]:
        for node in g.node:
            if node.op_type == "Gradient" and node.domain == PREVIEW_DOMAIN:
                for a in node.attribute:
                    if a.name == "xs":
                        names.update(s.decode() for s in a.strings)
    return names & set(tm.state)


def position_json(position: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The manifest's ``fit_position``: ``{"epoch", "batch", "step"}`` or None."""
    if position is None:
        return None
    step = position.get("step")
    return {"epoch": int(position.get("epoch", 0)), "batch": int(position.get("batch") or 0),
            "step": None if step is None else int(step)}


def _in_bundle(t: onnx.TensorProto) -> bool:
    """Whether ``t`` already refers to a bundle file (a state variable's place in state.bin)."""
    return any(e.key == "location" and e.value in (STATE_FILE, CONSTANTS_FILE) for e in t.external_data)


def _sync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        _sync(f)
