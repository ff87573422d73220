"""Small inference models written with onnx.helper, shared by the examples.

They stand for the model you would export from your framework of choice
(``torch.onnx.export`` and friends): plain ONNX, no training in them.
``onnxtrain.build.training_model`` turns any of them into a training model.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _he(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    """He-normal initialization: std = sqrt(2 / fan_in), for layers followed by Relu."""
    return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)


def mlp(n_in: int = 64, hidden: int = 64, n_out: int = 10, seed: int = 0,
        prefix: str = "") -> onnx.ModelProto:
    """X[N, n_in] -> Gemm -> Relu -> Gemm -> logits[N, n_out].

    Initializers: ``{prefix}W1, b1, W2, b2`` (W1 is the hidden layer, W2 the head)."""
    rng = np.random.default_rng(seed)
    p = prefix
    inits = {
        f"{p}W1": _he(rng, (n_in, hidden), n_in),
        f"{p}b1": np.zeros(hidden, np.float32),
        f"{p}W2": _he(rng, (hidden, n_out), hidden + n_out),
        f"{p}b2": np.zeros(n_out, np.float32),
    }
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", f"{p}W1", f"{p}b1"], ["hidden_pre"], name="dense1"),
         helper.make_node("Relu", ["hidden_pre"], ["hidden"], name="relu1"),
         helper.make_node("Gemm", ["hidden", f"{p}W2", f"{p}b2"], ["logits"], name="dense2")],
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", n_out])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def cnn(channels: int = 16, n_out: int = 10, seed: int = 0) -> onnx.ModelProto:
    """image[N, 1, 8, 8] -> Conv 3x3 (pad 1) -> Relu -> MaxPool 2x2 -> Flatten -> Gemm -> logits.

    A LeNet in miniature for the 8x8 digits: ``channels`` feature maps of
    8x8, pooled to 4x4, then one dense layer to the 10 classes."""
    rng = np.random.default_rng(seed)
    flat = channels * 4 * 4
    inits = {
        "conv.W": _he(rng, (channels, 1, 3, 3), 9),
        "conv.b": np.zeros(channels, np.float32),
        "fc.W": _he(rng, (flat, n_out), flat + n_out),
        "fc.b": np.zeros(n_out, np.float32),
    }
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "conv.W", "conv.b"], ["conv"], name="conv",
                          kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["conv"], ["conv_relu"], name="relu"),
         helper.make_node("MaxPool", ["conv_relu"], ["pooled"], name="pool",
                          kernel_shape=[2, 2], strides=[2, 2]),
         helper.make_node("Flatten", ["pooled"], ["features"], name="flatten", axis=1),
         helper.make_node("Gemm", ["features", "fc.W", "fc.b"], ["logits"], name="fc")],
        "cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", n_out])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def linear(n_in: int, n_out: int = 1) -> onnx.ModelProto:
    """X[N, n_in] -> MatMul W + B -> Y[N, n_out], starting from zeros."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["Y"])],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", n_out])],
        [numpy_helper.from_array(np.zeros((n_in, n_out), np.float32), "W"),
         numpy_helper.from_array(np.zeros(n_out, np.float32), "B")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
