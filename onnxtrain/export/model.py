"""The ONNX model of a ``SessionLike`` with its current state: an inference
model (LoRA adapters merged) or the whole training model, a checkpoint that
resumes training; ``TrainingSession.to_model`` and ``export`` delegate here.

>>> import numpy as np
>>> from onnx import TensorProto, helper, numpy_helper
>>> from onnxtrain import build
>>> graph = helper.make_graph(
...     [helper.make_node("MatMul", ["X", "W"], ["Y"])], "linear",
...     [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
...     [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
...     [numpy_helper.from_array(np.zeros((2, 1), np.float32), "W")])
>>> class Trained:  # a SessionLike: a training model, its state, its fit position
...     model = build.training_model(helper.make_model(graph), loss="mse", target="T")
...     state = {"W": np.ones((2, 1), np.float32)}
...     fit_position = None
>>> inference = to_model(Trained())
>>> len(inference.training_info), numpy_helper.to_array(inference.graph.initializer[0]).ravel().tolist()
(0, [1.0, 1.0])
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..builder import lora
from ..core.graph import keep_outputs
from ..io import mapped
from ..io.metadata import drop_metadata, model_metadata, write_position
from ..io.storage import came_external, external_data_threshold, materialized, tensor_bytes, write_model
from ..lower.pipeline import inference_export
from ..runtime.executor import MAX_IR_VERSION
from .session_like import SessionLike


def to_model(source: SessionLike, training: bool = False,
             outputs: Sequence[str] | None = None) -> onnx.ModelProto:
    """``source.model`` with ``source.state`` written into its initializers.

    ``training=False``: a plain inference model (training_info dropped; LoRA
    adapters merged), cut to ``outputs`` (see ``export_outputs``).  ``training=True``: the whole training model, a complete
    checkpoint, with ``source.fit_position``.  The result is self-contained,
    weights mapped from external data included, unless its tensors exceed the
    external-data threshold (``ONNXTRAIN_EXTERNAL_DATA_THRESHOLD``, 1.5 GiB by
    default; protobuf cannot hold 2 GiB): those then stay references to their
    files (``onnxtrain.io.mapped``)."""
    out = _with_state(source, training, None, export_outputs(source.model, training, outputs))
    if tensor_bytes(out) <= external_data_threshold():
        out = materialized(out)
    return out


def write(source: SessionLike, path: str | os.PathLike, training: bool = False,
          external_data: bool | None = None, outputs: Sequence[str] | None = None) -> Path:
    """Write ``to_model(source, training)`` to ``path`` atomically (temp file,
    fsync, rename), streamed: each state value is read from ``source.state``
    only while it is written, mapped weights go file to file, merged LoRA
    weights block by block.

    ``external_data``: None writes tensors to a data file beside the model
    when they exceed ``ONNXTRAIN_EXTERNAL_DATA_THRESHOLD`` (1.5 GiB by
    default; protobuf cannot hold 2 GiB) or the model came with external
    data; True or False forces it."""
    outputs = export_outputs(source.model, training, outputs)
    deferred: dict[str, mapped.Deferred] = {}
    if external_data is None and came_external(source.model):
        external_data = True  # a model loaded with external data keeps it
    model = _with_state(source, training, deferred, outputs)
    return write_model(model, path, external_data=external_data, deferred=deferred)


def export_outputs(model: onnx.ModelProto, training: bool,
                   outputs: Sequence[str] | None) -> list[str] | None:
    """The outputs an inference export keeps; None: all of them.

    ``outputs`` when given (main-graph values: the nodes they need stay,
    inputs nothing reads any more go, as ONNX Runtime training's
    ``export_model_for_inferencing(path, outputs)``), else those metadata
    ``onnxtrain.export_outputs`` names (a model imported from ONNX Runtime
    training artifacts exports its prediction, without the loss or labels)."""
    if outputs is not None:
        if training:
            raise ValueError("export: outputs= cuts the inference model; a training checkpoint "
                             "(training=True) keeps the whole model")
        if isinstance(outputs, str):
            raise ValueError(f"export: outputs must be a list of names, got the string {outputs!r}")
        return list(outputs)
    default = model_metadata(model).get("export_outputs")
    return None if training or not default else list(default)


def _with_state(source: SessionLike, training: bool,
                deferred: dict[str, mapped.Deferred] | None,
                outputs: Sequence[str] | None = None) -> onnx.ModelProto:
    """``to_model``'s result; with ``deferred``, state values and merged
    weights are placeholders registered there (produced while ``write``
    writes them)."""
    out = onnx.ModelProto()
    out.CopyFrom(source.model)
    state = source.state  # one state version (a session's view pins it)
    if not training:
        del out.training_info[:]
    write_state(out.graph, state, deferred)
    # The fit position: where training stands (none for an inference model).
    write_position(out, source.fit_position if training else None)
    if training:
        for ti in out.training_info:
            write_state(ti.algorithm, state, deferred)
    else:
        if lora.info_of(out) is not None:
            # LoRA: the original graph with W + (alpha/r)·A·B in each target.
            out = lora.merge(out, deferred=deferred)
        if outputs:
            keep_outputs(out, outputs, "export")
        out = inference_export(out)
        out.ir_version = min(out.ir_version, MAX_IR_VERSION)
        drop_metadata(out, "source")  # where it was built: no business of a served model
    return out


def write_state(graph: onnx.GraphProto, state: Mapping[str, np.ndarray],
                deferred: dict[str, mapped.Deferred] | None = None) -> None:
    """Write state values into ``graph``'s initializers: copies, or with
    ``deferred`` placeholders that read ``state`` when they are written."""

    def put(t: onnx.TensorProto, name: str, dtype: int, dims: list[int]) -> None:
        if deferred is None:
            t.CopyFrom(numpy_helper.from_array(np.asarray(state[name]), name))
        else:
            t.Clear()
            t.name = name
            value = mapped.Deferred(np.dtype(helper.tensor_dtype_to_np_dtype(dtype)), tuple(dims),
                                    lambda: np.asarray(state[name]))
            mapped.defer(t, f"state/{name}", value, deferred)

    for t in graph.initializer:
        if t.name in state:
            put(t, t.name, t.data_type, list(t.dims))
    sparse_state = [st for st in graph.sparse_initializer if st.values.name in state]
    if sparse_state:
        # Sparse state variables are written back dense: training fills them in.
        kept = [st for st in graph.sparse_initializer if st.values.name not in state]
        del graph.sparse_initializer[:]
        graph.sparse_initializer.extend(kept)
        for st in sparse_state:
            put(graph.initializer.add(), st.values.name, st.values.data_type, list(st.dims))
