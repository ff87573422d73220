"""The intra-op wait policy chosen per program (``options.spins``): a
program of small kernels spins, a convolutional one blocks, and
``ONNXTRAIN_SPINNING`` decides for every program where it is set."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.runtime.executor import Executor
from onnxtrain.runtime.options import SPINNING_ENV, default_session_options, spins

PREVIEW = "ai.onnx.preview.training"


def training_model(conv: bool) -> onnx.ModelProto:
    """A one-layer model, a convolution or a Gemm, trained by SGD on the mean of its output."""
    rng = np.random.default_rng(0)
    if conv:
        w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
        node = helper.make_node("Conv", ["X", "W"], ["Y"], pads=[1, 1, 1, 1])
        x_shape, y_shape = [2, 3, 8, 8], [2, 4, 8, 8]
    else:
        w = rng.standard_normal((4, 3)).astype(np.float32)
        node = helper.make_node("Gemm", ["X", "W"], ["Y"], transB=1)
        x_shape, y_shape = [2, 3], [2, 4]
    main = helper.make_graph([node], "main", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
                             [helper.make_tensor_value_info("Y", TensorProto.FLOAT, y_shape)],
                             [numpy_helper.from_array(w, "W")])
    algorithm = helper.make_graph(
        [helper.make_node("ReduceMean", ["Y"], ["loss"], keepdims=0),
         helper.make_node("Gradient", ["W", "X"], ["gW"], domain=PREVIEW, xs=["W"], zs=["X"], y="loss"),
         helper.make_node("Mul", ["lr", "gW"], ["sW"]),
         helper.make_node("Sub", ["W", "sW"], ["newW"])],
        "algorithm", [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                          helper.make_tensor_value_info("newW", TensorProto.FLOAT, list(w.shape))],
        [numpy_helper.from_array(np.float32(0.1), "lr")])
    model = helper.make_model(main, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW, 1)])
    ti = model.training_info.add()
    ti.algorithm.CopyFrom(algorithm)
    ti.update_binding.add(key="W", value="newW")
    return model


def step_spins(model: onnx.ModelProto) -> bool:
    """Whether the training step of a session of ``model`` runs with spinning threads."""
    sess = onnxtrain.TrainingSession(model)
    x = np.ones([d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim], np.float32)
    sess.train_step({"X": x})
    return sess._runner.executor(sess._programs.algorithms[0]).spinning


def test_a_small_kernel_program_spins_and_a_convolutional_one_blocks(monkeypatch):
    monkeypatch.delenv(SPINNING_ENV, raising=False)
    assert spins(training_model(conv=False)) and not spins(training_model(conv=True))
    assert step_spins(training_model(conv=False)) is True
    assert step_spins(training_model(conv=True)) is False


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False)])
def test_the_environment_decides_for_every_program(monkeypatch, value, expected):
    monkeypatch.setenv(SPINNING_ENV, value)
    assert step_spins(training_model(conv=False)) is expected
    assert step_spins(training_model(conv=True)) is expected


def test_the_callers_session_options_are_kept(monkeypatch):
    monkeypatch.delenv(SPINNING_ENV, raising=False)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 3, 3]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [1, 1, 1, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert Executor(model).spinning is False
    assert Executor(model, session_options=default_session_options()).spinning is True
