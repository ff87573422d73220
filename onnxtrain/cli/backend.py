"""An ``onnx.backend`` for onnxtrain, so ONNX's own conformance cases run through it.

Public as ``onnxtrain.backend``, whose docstring has the example.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from ..runtime.executor import available_providers
from ..session import TrainingSession


class OnnxtrainRep(BackendRep):
    """A prepared model: ``run`` is TrainingSession.run (inference, no state change)."""

    def __init__(self, session: TrainingSession, model: onnx.ModelProto) -> None:
        self.session = session
        inits = {t.name for t in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input if i.name not in inits]
        self.output_names = [o.name for o in model.graph.output]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feeds = dict(zip(self.input_names, inputs))
        out = self.session.run(feeds)
        Outputs = namedtuple("Outputs", [f"o{i}" for i in range(len(self.output_names))])  # noqa: PYI024
        return Outputs(*(out[n] for n in self.output_names))


class OnnxtrainBackend(Backend):
    """onnxtrain as an onnx.backend: Gradient and optimizer ops run through it."""

    @classmethod
    def _providers(cls, device: str) -> list[str]:
        if Device(device).type == DeviceType.CUDA:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> OnnxtrainRep:
        super().prepare(model, device, **kwargs)
        return OnnxtrainRep(TrainingSession(model, providers=cls._providers(device)), model)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node, inputs, device: str = "CPU", outputs_info=None, **kwargs):
        raise NotImplementedError("onnxtrain runs whole models; use run_model")

    @classmethod
    def supports_device(cls, device: str) -> bool:
        d = Device(device)
        if d.type == DeviceType.CPU:
            return True
        if d.type == DeviceType.CUDA:
            return "CUDAExecutionProvider" in available_providers()
        return False


prepare = OnnxtrainBackend.prepare
run_model = OnnxtrainBackend.run_model
run_node = OnnxtrainBackend.run_node
supports_device = OnnxtrainBackend.supports_device
