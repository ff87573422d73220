"""onnxblock used directly, as ORT's tutorials do: TrainingBlock, ForwardBlock,
parameters, save_checkpoint / load_checkpoint_to_model, loss_input_names."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from ort_data import PARAMS

from onnxtrain.ort_training import artifacts, onnxblock
from onnxtrain.ort_training.api import CheckpointState, Module


class MSETraining(onnxblock.TrainingBlock):
    def __init__(self):
        super().__init__()
        self.loss = onnxblock.loss.MSELoss()

    def build(self, output_name):
        return self.loss(output_name)


def test_training_block_by_hand(data_dir, tmp_path, ort_runs, torch_ref):
    model = onnx.load(data_dir / "mlp.onnx")
    block = MSETraining()
    for name in PARAMS[2:]:
        block.requires_grad(name)
    block.requires_grad("fc1.weight", False)
    with pytest.raises(RuntimeError, match="build the training model first"):
        block.parameters()
    with onnxblock.base(model) as handle:
        loss = block("output")
        assert handle.model.graph.output[0].name == loss
    trainable, frozen = block.parameters()
    assert [t.name for t in trainable] == ["fc2.weight", "fc2.bias"]
    assert [t.name for t in frozen] == ["fc1.weight"]
    training, evaluation = block.to_model_proto()
    # fc1.bias is neither: a constant of the graph; the others are inputs after the user
    # inputs, in the order of the initializers, frozen and trainable alike (ORT's)
    assert [i.name for i in training.graph.input] == ["input", "target", "fc1.weight", "fc2.weight", "fc2.bias"]
    assert [t.name for t in training.graph.initializer] == ["fc1.bias"]
    assert len(model.graph.input) == 1  # the base model is not changed
    onnx.save(training, tmp_path / "training.onnx")
    onnxblock.save_checkpoint(block.parameters(), tmp_path / "ck")
    state = CheckpointState.load_checkpoint(tmp_path / "ck")
    module = Module(tmp_path / "training.onnx", state)
    np.testing.assert_allclose(module(ort_runs["x"][0], ort_runs["target"][0]), torch_ref["mse_loss"], rtol=1e-6)
    for n in PARAMS[2:]:
        np.testing.assert_allclose(state.parameters[n].grad, torch_ref[f"mse_grad_{n}"], rtol=1e-5, atol=1e-7)
    # load_checkpoint_to_model puts checkpoint values into a model's initializers
    state.parameters["fc2.bias"].data = np.full(5, 3.0, np.float32)
    CheckpointState.save_checkpoint(state, tmp_path / "ck2")
    target = onnx.load(data_dir / "mlp.onnx")
    onnxblock.load_checkpoint_to_model(tmp_path / "ck2", target)
    values = {t.name: numpy_helper.to_array(t) for t in target.graph.initializer}
    np.testing.assert_array_equal(values["fc2.bias"], 3.0)


def test_requires_grad_names_must_be_initializers(data_dir):
    block = MSETraining()
    block.requires_grad("input")
    with onnxblock.base(onnx.load(data_dir / "mlp.onnx")), pytest.raises(ValueError, match="'input'"):
        block("output")


def test_forward_block_and_no_base(data_dir):
    class Doubled(onnxblock.ForwardBlock):
        def build(self, name):
            return onnxblock.blocks.Mul()(name, onnxblock.blocks.Constant(2.0)())

    block = Doubled()
    with pytest.raises(RuntimeError, match="no base model"):
        block("output")
    with onnxblock.base(onnx.load(data_dir / "mlp.onnx")):
        out = block("output")
    model = block.to_model_proto()
    assert [o.name for o in model.graph.output] == [out]
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT


def test_loss_input_names_and_extra_outputs(data_dir, tmp_path, ort_runs):
    model = onnx.load(data_dir / "mlp.onnx")
    artifacts.generate_artifacts(model, requires_grad=PARAMS, loss=artifacts.LossType.CrossEntropyLoss,
                                 loss_input_names=["output"], additional_output_names=["h"],
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    loss, h = module(ort_runs["x"][0], ort_runs["labels"][0])
    p = {n: state.parameters[n].data for n in PARAMS}
    np.testing.assert_allclose(h, ort_runs["x"][0] @ p["fc1.weight"].T + p["fc1.bias"], rtol=1e-5, atol=1e-6)
    assert module.output_names()[1] == "h"
