"""An ``onnx.backend`` for onnxtrain, so ONNX's own conformance cases run through it.

The public face of ``onnxtrain.cli.backend``, where it is defined.  ONNX's
conformance cases run with ``onnx.backend.test.BackendTest(onnxtrain.backend,
__name__)`` (tests/runtime/test_conformance.py picks the training ones); a
model runs as through any backend:

>>> import numpy as np
>>> from onnx import TensorProto, helper
>>> import onnxtrain.backend
>>> graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
...                           [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
...                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
>>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
>>> onnxtrain.backend.run_model(model, [np.array([-1.0, 2.0], np.float32)])
Outputs(o0=array([0., 2.], dtype=float32))
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
