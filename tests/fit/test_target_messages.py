"""Issue 34, item 4: the target messages agree, and float class ids are cast.

Every message about the target names its shape and offers the fix, the way
the MSE one did ("reshape y to (-1, 1)"); float labels whose every value is
a whole number are class ids, cast to int64 as Keras casts them; other float
labels keep the ``--loss mse`` advice."""

from __future__ import annotations

import numpy as np
import pytest
from models import gemm_inference

from onnxtrain import TrainingSession, build
from onnxtrain.cli.app import main

ROWS = 64


def linear(out: int):
    return gemm_inference(4, out)


def session(out: int, loss: str) -> TrainingSession:
    return TrainingSession(build.training_model(linear(out), loss=loss, optimizer=build.SGD(lr=0.1)))


def data():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((ROWS, 4)).astype(np.float32)
    return X, rng.integers(0, 3, ROWS)


def message(sess, X, y, **kw) -> str:
    before = {k: v.copy() for k, v in sess.state.items()}
    with pytest.raises(ValueError) as info:
        sess.fit(X, y, epochs=1, batch_size=32, progress=False, **kw)
    for k, v in before.items():  # nothing trained
        np.testing.assert_array_equal(sess.state[k], v)
    text = str(info.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------ shapes
@pytest.mark.parametrize("loss", ["bce_with_logits", "mse", "l1", "huber"])
def test_a_flat_y_on_a_one_column_output_gets_the_reshape(loss):
    """BCE used to fail inside the step: "feed 'target' has shape [32], expected float32['N', 1]"."""
    X, y = data()
    text = message(session(1, loss), X, (y > 0).astype(np.float32))
    assert text == ("fit: target 'target' has shape [64]; the model expects ['N', 1]: "
                    "reshape y to (-1, 1)")


def test_one_hot_labels_are_told_to_take_the_argmax():
    X, y = data()
    text = message(session(3, "cross_entropy"), X, np.eye(3, dtype=np.float32)[y])
    assert text == ("fit: target 'target' has shape [64, 3]; the model expects ['N']: one-hot "
                    "labels? pass the class indices: y.argmax(-1)")


def test_the_cli_says_the_same_in_one_line(tmp_path, capsys):
    import onnx

    X, y = data()
    np.savez(tmp_path / "d.npz", X=X, y=(y > 0).astype(np.float32))
    onnx.save(linear(1), str(tmp_path / "m.onnx"))
    assert main(["make-training", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx"),
                 "--loss", "bce_with_logits"]) == 0
    capsys.readouterr()
    assert main(["train", str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs",
                 "1", "-o", str(tmp_path / "o.onnx"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err == ("onnxtrain: error: fit: target 'target' has shape [64]; the model expects "
                   "['N', 1]: reshape y to (-1, 1)\n")
    assert not (tmp_path / "o.onnx").exists()


# ------------------------------------------------------------------ float labels
def test_float_class_ids_train_as_int64_labels():
    X, y = data()
    as_float = session(3, "cross_entropy")
    as_int = session(3, "cross_entropy")
    h1 = as_float.fit(X, y.astype(np.float64), epochs=2, batch_size=32, shuffle=False, progress=False)
    h2 = as_int.fit(X, y, epochs=2, batch_size=32, shuffle=False, progress=False)
    assert h1["loss"] == h2["loss"]
    for k in as_int.state:
        np.testing.assert_array_equal(as_float.state[k], as_int.state[k])
    assert as_float.evaluate(X, y.astype(np.float32)) == as_int.evaluate(X, y)


def test_float_class_ids_are_range_checked_after_the_cast():
    X, y = data()
    text = message(session(3, "cross_entropy"), X, (y + 1).astype(np.float32))
    assert text.startswith("fit: target 'target' holds label 3 at index [")
    assert "y has shape [64]" in text and "C = 3" in text and "subtract 1: y - 1" in text


def test_other_float_labels_keep_the_mse_advice():
    X, y = data()
    y = y.astype(np.float64)
    y[5] = 1.5
    text = message(session(3, "cross_entropy"), X, y)
    assert text == ("fit: target 'target' holds 1.5 at index [5] (y has shape [64], dtype float64), "
                    "not a class index; its loss takes class indices: for float targets build the "
                    "training model with loss='mse' (onnxtrain make-training --loss mse), or "
                    "bce_with_logits for 0/1 targets")
    y[5] = np.nan
    assert "holds nan at index [5]" in message(session(3, "cross_entropy"), X, y)


def test_batches_of_float_labels_are_told_the_cast():
    """An iterable's batches are used as given (not cast): the message says the cast."""
    X, y = data()
    batches = [{"x": X[:32], "target": y[:32].astype(np.float32)}]
    with pytest.raises(ValueError) as info:
        session(3, "cross_entropy").fit(batches, progress=False)
    assert str(info.value) == ("fit: target 'target' holds class ids as float32 (y has shape [32]); "
                               "its loss takes class indices: pass y.astype('int64')")


# ------------------------------------------------------------------ every message
@pytest.mark.parametrize("out, loss, y, fix", [
    (1, "mse", lambda y: y.astype(np.float32), "reshape y to (-1, 1)"),
    (1, "bce_with_logits", lambda y: y.astype(np.float32), "reshape y to (-1, 1)"),
    (1, "mse", lambda y: np.full((len(y), 1), "a"), ".astype('float32')"),
    (3, "cross_entropy", lambda y: np.eye(3)[y], "y.argmax(-1)"),
    (3, "cross_entropy", lambda y: y + 5, "labels must be in [0, 3)"),
    (3, "cross_entropy", lambda y: y + 1, "subtract 1"),
    (3, "cross_entropy", lambda y: y + 0.5, "--loss mse"),
    (3, "cross_entropy", lambda y: y[:, None], "reshape y to (-1,)"),
])
def test_every_target_message_names_the_shape_and_the_fix(out, loss, y, fix):
    X, labels = data()
    target = y(labels)
    text = message(session(out, loss), X, target)
    assert f"shape {list(target.shape)}" in text, text
    assert fix in text, text
