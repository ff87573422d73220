"""A training model with given state values: ``to_model`` and ``export``
(inference or training; LoRA adapters merged for inference), behind
``TrainingSession.to_model`` and ``export``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..builder import lora
from ..io import mapped
from ..io.metadata import write_position
from ..io.storage import came_external, external_data_threshold, materialized, tensor_bytes, write_model
from ..lower.pipeline import inference_export
from ..runtime.executor import MAX_IR_VERSION


def to_model(proto: onnx.ModelProto, state: Mapping[str, np.ndarray], fit_position: dict | None,
             training: bool = False) -> onnx.ModelProto:
    """``proto`` with ``state`` (copies, owned by the result) written into its initializers.

    ``training=False``: a plain inference model (training_info dropped; LoRA
    adapters merged).  ``training=True``: the whole training model, a complete
    checkpoint, with ``fit_position``.  The result is self-contained, weights
    mapped from external data included, unless its tensors exceed the
    external-data threshold (``ONNXTRAIN_EXTERNAL_DATA_THRESHOLD``, 1.5 GiB by
    default; protobuf cannot hold 2 GiB): those then stay references to their
    files (``onnxtrain.io.mapped``)."""
    out = snapshot(proto, state, fit_position, training, None)
    if tensor_bytes(out) <= external_data_threshold():
        out = materialized(out)
    return out


def snapshot(proto: onnx.ModelProto, state: Mapping[str, np.ndarray], fit_position: dict | None,
             training: bool, deferred: dict[str, mapped.Deferred] | None) -> onnx.ModelProto:
    """``to_model``'s result; with ``deferred``, state values and merged
    weights are placeholders registered there (written by ``export``
    straight from their buffers)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    if not training:
        del out.training_info[:]
    write_state(out.graph, state, deferred)
    # The fit position: where training stands (none for an inference model).
    write_position(out, fit_position if training else None)
    if training:
        for ti in out.training_info:
            write_state(ti.algorithm, state, deferred)
    else:
        if lora.info_of(out) is not None:
            # LoRA: the original graph with W + (alpha/r)·A·B in each target.
            out = lora.merge(out, deferred=deferred)
        out = inference_export(out)
        out.ir_version = min(out.ir_version, MAX_IR_VERSION)
    return out


def export(proto: onnx.ModelProto, state: Mapping[str, np.ndarray], fit_position: dict | None,
           path: str | os.PathLike, training: bool = False, external_data: bool | None = None) -> Path:
    """Write ``proto`` with ``state`` (arrays it reads while writing, not
    copies: the caller keeps them unchanged until it returns) to ``path``
    atomically (temp file, fsync, rename).

    ``external_data``: None writes tensors to a data file beside the model
    when they exceed ``ONNXTRAIN_EXTERNAL_DATA_THRESHOLD`` (1.5 GiB by
    default; protobuf cannot hold 2 GiB) or ``proto`` came with external
    data; True or False forces it.  Tensors are streamed: state from its
    arrays, mapped weights file to file, merged LoRA weights block by block."""
    deferred: dict[str, mapped.Deferred] = {}
    if external_data is None and came_external(proto):
        external_data = True  # a model loaded with external data keeps it
    model = snapshot(proto, state, fit_position, training, deferred)
    return write_model(model, path, external_data=external_data, deferred=deferred)


def write_state(graph: onnx.GraphProto, state: Mapping[str, np.ndarray],
                 deferred: dict[str, mapped.Deferred] | None = None) -> None:
    """Write state values into ``graph``'s initializers: copies, or with
    ``deferred`` placeholders for the arrays themselves."""

    def put(t: onnx.TensorProto, name: str) -> None:
        if deferred is None:
            t.CopyFrom(numpy_helper.from_array(state[name], name))
        else:
            t.Clear()
            t.name = name
            mapped.defer(t, f"state/{name}", mapped.of_array(np.asarray(state[name])), deferred)

    for t in graph.initializer:
        if t.name in state:
            put(t, t.name)
    sparse_state = [st for st in graph.sparse_initializer if st.values.name in state]
    if sparse_state:
        # Sparse state variables are written back dense: training fills them in.
        kept = [st for st in graph.sparse_initializer if st.values.name not in state]
        del graph.sparse_initializer[:]
        graph.sparse_initializer.extend(kept)
        for st in sparse_state:
            put(graph.initializer.add(), st.values.name)
