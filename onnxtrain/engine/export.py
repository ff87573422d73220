"""A session's model with its current state: ``to_model`` and ``export``
(inference or training; LoRA adapters merged for inference)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..builder import lora
from ..core.graph import keep_outputs
from ..io import mapped
from ..io.metadata import drop_metadata, write_position
from ..io.storage import came_external, external_data_threshold, materialized, tensor_bytes, write_model
from ..lower.pipeline import inference_export
from ..runtime.executor import MAX_IR_VERSION, as_numpy

    # ---------------------------------------------------------------- export

class ExportMixin:
    """``TrainingSession.to_model`` and ``export`` (see ``session.py`` for the attributes)."""

    def to_model(self, training: bool = False, outputs: Sequence[str] | None = None) -> onnx.ModelProto:
        """The model with the current state written into its initializers.

        ``training=False``: a plain inference model (training_info dropped),
        cut to ``outputs`` when given (main-graph values; the nodes they need
        stay, inputs nothing reads any more go, as ONNX Runtime training's
        ``export_model_for_inferencing(path, outputs)``), else to the outputs
        the model's metadata names (``onnxtrain.export_outputs``: a model
        imported from ONNX Runtime training artifacts exports its prediction,
        without the loss or the labels), else whole.
        ``training=True``: the whole training model, a complete checkpoint.
        The result is self-contained, weights the session maps from external
        data included, unless its tensors exceed the external-data threshold
        (``ONNXTRAIN_EXTERNAL_DATA_THRESHOLD``, 1.5 GiB by default; protobuf
        cannot hold 2 GiB): those then stay references to their files
        (``onnxtrain.mapped``), which a ``TrainingSession`` of this process
        accepts.  ``export`` writes any size to a file, streamed."""
        outputs = self._export_outputs(training, outputs)
        with self._store.snapshot() as snap:
            state = {n: np.array(as_numpy(v), copy=True) for n, v in snap.items()}
        out = self._snapshot(training, state, None, outputs)
        if tensor_bytes(out) <= external_data_threshold():
            out = materialized(out)
        return out

    def _export_outputs(self, training: bool, outputs: Sequence[str] | None) -> list[str] | None:
        """The outputs an inference export keeps (see ``to_model``); None: all."""
        if outputs is not None:
            if training:
                raise ValueError("export: outputs= cuts the inference model; a training checkpoint "
                                 "(training=True) keeps the whole model")
            if isinstance(outputs, str):
                raise ValueError(f"export: outputs must be a list of names, got the string {outputs!r}")
            return list(outputs)
        default = self._metadata.get("export_outputs")
        return None if training or not default else list(default)

    def _snapshot(self, training: bool, state: Mapping[str, np.ndarray],
                  deferred: dict[str, mapped.Deferred] | None,
                  outputs: Sequence[str] | None = None) -> onnx.ModelProto:
        """``to_model``'s result; with ``deferred``, state values and merged
        weights are placeholders registered there (written by ``export``
        straight from their buffers)."""
        src = self._model.proto
        out = onnx.ModelProto()
        out.CopyFrom(src)
        if not training:
            del out.training_info[:]
        write_state(out.graph, state, deferred)
        # The fit position: where training stands (none for an inference model).
        write_position(out, self.fit_position if training else None)
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

    def export(
        self, path: str | os.PathLike, training: bool = False, external_data: bool | None = None,
        outputs: Sequence[str] | None = None,
    ) -> Path:
        """Write the current model to ``path`` atomically (temp file, fsync, rename).

        ``training`` and ``outputs``: as ``to_model`` (for example
        ``export("model.onnx", outputs=["logits"])``).
        ``external_data``: None writes tensors to a data file beside the model
        when they exceed ``ONNXTRAIN_EXTERNAL_DATA_THRESHOLD`` (1.5 GiB by
        default; protobuf cannot hold 2 GiB) or the session maps weights
        from external data; True or False forces it.  Tensors are streamed: state from its buffers (pinned meanwhile, so a
        step from another thread writes elsewhere), mapped weights file to
        file, merged LoRA weights block by block."""
        deferred: dict[str, mapped.Deferred] = {}
        outputs = self._export_outputs(training, outputs)
        if external_data is None and came_external(self._model.proto):
            external_data = True  # a model loaded with external data keeps it
        with self._store.snapshot() as snap:
            state = {n: as_numpy(v) for n, v in snap.items()}  # views of the pinned buffers
            model = self._snapshot(training, state, deferred, outputs)
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
