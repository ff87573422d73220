"""The loss must fit the model.

A class-index loss over one class is refused (it is 0 whatever the weights);
``make-training`` without ``--loss`` asks for one on such a model; float
targets on a cross-entropy model name ``--loss mse``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.cli.app import main


def linear(n_out: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (4, n_out)).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(n_out, np.float32), "b")]
    graph = helper.make_graph([helper.make_node("Gemm", ["X", "W", "b"], ["y"])], "lin",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", n_out])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("loss", ["cross_entropy", "nll", build.CrossEntropy(), build.NLL()])
def test_a_class_index_loss_over_one_class_is_refused(loss):
    with pytest.raises(ValueError, match="one class") as info:
        build.training_model(linear(1), loss=loss)
    assert "mse" in str(info.value) and "bce_with_logits" in str(info.value)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


@pytest.mark.parametrize("n_out, loss, target, reference", [
    (2, "cross_entropy", np.array([0, 1, 1, 0, 1, 0]),
     lambda y, t: np.mean(np.log(np.exp(y).sum(1)) - y[np.arange(len(t)), t])),
    (1, "mse", np.linspace(-1, 2, 6, dtype=np.float32)[:, None], lambda y, t: np.mean((y - t) ** 2)),
    (1, "bce_with_logits", np.array([0, 1, 1, 0, 1, 0], np.float32)[:, None],
     lambda y, t: np.mean(_softplus(y) - t * y)),
])
def test_two_classes_and_regression_losses_still_build(n_out, loss, target, reference):
    """The one-class refusal stops there: two classes with cross entropy and
    one output with mse or bce_with_logits build, and the loss the model
    computes is that loss (numpy, float64, on the same weights)."""
    tm = build.training_model(linear(n_out), loss=loss)
    sess = TrainingSession(tm)
    X = np.random.default_rng(2).standard_normal((6, 4)).astype(np.float32)
    y = (X.astype(np.float64) @ sess.state["W"].astype(np.float64)) + sess.state["b"]
    got = sess.evaluate_batch({"X": X, "target": target}, "loss")["loss"]
    np.testing.assert_allclose(got, reference(y, target), rtol=1e-5)


def test_make_training_without_loss_asks_for_one(capsys, tmp_path):
    onnx.save(linear(1), tmp_path / "reg.onnx")
    code = main(["make-training", str(tmp_path / "reg.onnx"), "-o", str(tmp_path / "t.onnx")])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "--loss mse" in err and "--loss bce_with_logits" in err
    assert not (tmp_path / "t.onnx").exists()
    code = main(["make-training", str(tmp_path / "reg.onnx"), "-o", str(tmp_path / "t.onnx"),
                 "--loss", "mse"])
    assert code == 0
    onnx.save(linear(3), tmp_path / "cls.onnx")  # several classes: cross_entropy by default
    code = main(["make-training", str(tmp_path / "cls.onnx"), "-o", str(tmp_path / "c.onnx")])
    assert code == 0
    assert TrainingSession(str(tmp_path / "c.onnx")).inference_outputs


def test_float_targets_on_a_cross_entropy_model_name_loss_mse():
    sess = TrainingSession(build.training_model(linear(3), loss="cross_entropy"))
    X = np.zeros((8, 4), np.float32)
    with pytest.raises(ValueError, match="--loss mse"):
        sess.fit(X, np.linspace(0, 1, 8, dtype=np.float32), progress=False)
