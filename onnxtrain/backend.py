"""An ``onnx.backend`` for onnxtrain, so ONNX's own conformance cases run through it.

The public face of ``onnxtrain.cli.backend``, where it is defined.

>>> import onnx.backend.test                               # doctest: +SKIP
>>> bt = onnx.backend.test.BackendTest(onnxtrain.backend, __name__)  # doctest: +SKIP
"""

from .cli.backend import (
    OnnxtrainBackend,
    OnnxtrainRep,
    prepare,
    run_model,
    run_node,
    supports_device,
)

__all__ = ["OnnxtrainBackend", "OnnxtrainRep", "prepare", "run_model", "run_node", "supports_device"]
