"""The only module that imports onnxruntime: compile a program once, run it many times."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from .errors import TrainingModelError



def _max_ir_version() -> int:
    """The newest IR version this onnxruntime accepts (13 from 1.31 on, else 10)."""
    try:
        major, minor = (int(p) for p in ort.__version__.split(".")[:2])
    except ValueError:
        return 10
    return 13 if (major, minor) >= (1, 31) else 10


#: Programs are lowered to this IR version before onnxruntime sees them.
MAX_IR_VERSION = _max_ir_version()

#: ONNX element type -> onnxruntime's type string, for feed checks.
_ORT_TYPE = {
    onnx.TensorProto.FLOAT: "tensor(float)",
    onnx.TensorProto.DOUBLE: "tensor(double)",
    onnx.TensorProto.FLOAT16: "tensor(float16)",
    onnx.TensorProto.INT64: "tensor(int64)",
    onnx.TensorProto.INT32: "tensor(int32)",
    onnx.TensorProto.BOOL: "tensor(bool)",
}


def available_providers() -> list[str]:
    return list(ort.get_available_providers())


def default_session_options(threads: int | None = None) -> ort.SessionOptions:
    """Session options used unless the caller passes its own.

    Full graph optimizations; intra-op threads from ``threads`` or the
    ``ONNXTRAIN_THREADS`` environment variable (default: onnxruntime's choice);
    one inter-op thread, since programs are chains of dependent kernels."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    env = os.environ.get("ONNXTRAIN_THREADS")
    n = threads if threads is not None else (int(env) if env else 0)
    if n:
        so.intra_op_num_threads = n
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


class Executor:
    """One compiled onnxruntime session of one program."""

    def __init__(
        self,
        model: onnx.ModelProto,
        providers: Sequence[Any] | None = None,
        session_options: ort.SessionOptions | None = None,
        label: str = "program",
    ) -> None:
        self.label = label
        if model.ir_version > MAX_IR_VERSION:
            model.ir_version = MAX_IR_VERSION
        try:
            self._sess = ort.InferenceSession(
                model.SerializeToString(),
                sess_options=session_options or default_session_options(),
                providers=list(providers) if providers else ["CPUExecutionProvider"],
            )
        except Exception as exc:  # onnxruntime raises its own exception types
            raise TrainingModelError(f"{label}: onnxruntime cannot load it: {exc}") from exc
        self.inputs = {i.name: i for i in self._sess.get_inputs()}
        self.output_names = [o.name for o in self._sess.get_outputs()]

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> list[np.ndarray]:
        """Run with numpy feeds and return numpy outputs (in ``output_names`` order)."""
        try:
            return self._sess.run(list(output_names) if output_names else None, dict(feeds))
        except Exception as exc:
            raise RuntimeError(f"{self.label}: onnxruntime failed: {exc}") from exc
