"""Where ``fit`` stands across calls (docs/fit.md, "Epochs across fit calls").

- a live session: each ``fit(epochs=N)`` trains N more epochs; the recorded
  position (``fit_position``, a checkpoint's metadata) is cumulative: its
  step is the model's step counter, its epoch the epochs trained;
- a session loaded from a checkpoint at epoch k: its first ``fit(epochs=N)``
  trains epochs k .. N-1;
- ``fit(epochs=N, initial_epoch=i)`` trains epochs i .. N-1;
- nothing to train: one line, and a History whose keys hold empty lists.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.datasets import load_digits
from onnxtrain.demo import build_classifier
from onnxtrain.io.metadata import read_position
from onnxtrain.train.callbacks import Callback

X, Y = (a[:200] for a in load_digits())
VALIDATION = tuple(a[200:260] for a in load_digits())
BATCH = 40  # 5 steps an epoch
PER_EPOCH = 5


@pytest.fixture(scope="module")
def model():
    return build_classifier(hidden=8, seed=0)


def fit(sess: TrainingSession, **kw):
    return sess.fit(X, Y, batch_size=BATCH, progress=False, **kw)


def assert_same_state(a: TrainingSession, b: TrainingSession) -> None:
    assert list(a.state) == list(b.state)
    for name in a.state:
        np.testing.assert_array_equal(a.state[name], b.state[name], err_msg=name)


def assert_position(sess: TrainingSession, epoch: int, batch: int = 0) -> None:
    """The position is true: its step is the model's step counter."""
    step = int(sess.state["step"])
    assert step == epoch * PER_EPOCH + batch
    assert sess.fit_position == {"epoch": epoch, "batch": batch, "step": step, "source": "fit"}


@pytest.fixture(scope="module")
def four_epochs(model):
    """One fit of 4 epochs: the run the others must equal."""
    sess = TrainingSession(model)
    history = fit(sess, epochs=4)
    assert history.epochs == [0, 1, 2, 3]
    return sess, history


def test_each_fit_of_a_live_session_trains_more_epochs(model, four_epochs, tmp_path):
    sess = TrainingSession(model)
    losses = []
    for e in range(4):
        history = fit(sess, epochs=1)
        assert history.epochs == [e] and history.steps == PER_EPOCH
        losses += history["loss"]
        assert_position(sess, e + 1)
    assert_same_state(sess, four_epochs[0])
    assert losses == four_epochs[1]["loss"]
    saved = read_position(TrainingSession(sess.export(tmp_path / "ck.onnx", training=True)).model)
    assert saved == {"epoch": 4, "batch": 0, "step": 4 * PER_EPOCH, "source": "checkpoint"}


def test_two_fits_of_three_epochs_are_six_epochs(model):
    sess = TrainingSession(model)
    assert fit(sess, epochs=3).epochs == [0, 1, 2]
    assert fit(sess, epochs=3).epochs == [3, 4, 5]
    assert_position(sess, 6)
    once = TrainingSession(model)
    fit(once, epochs=6)
    assert_same_state(sess, once)


def test_a_loaded_checkpoint_continues_its_run_then_goes_on_as_a_live_session(model, four_epochs,
                                                                              tmp_path):
    first = TrainingSession(model)
    fit(first, epochs=1)
    loaded = TrainingSession(first.export(tmp_path / "ck.onnx", training=True))
    history = fit(loaded, epochs=4)  # epochs 1, 2, 3: the run of 4 epochs, finished
    assert history.epochs == [1, 2, 3] and history["loss"] == four_epochs[1]["loss"][1:]
    assert_same_state(loaded, four_epochs[0])
    assert_position(loaded, 4)
    assert fit(loaded, epochs=2).epochs == [4, 5]  # live now: 2 more
    assert_position(loaded, 6)


def test_initial_epoch_trains_from_it_to_epochs(model, four_epochs):
    sess = TrainingSession(model)
    fit(sess, epochs=2)
    history = fit(sess, epochs=4, initial_epoch=2)
    assert history.epochs == [2, 3]
    assert_same_state(sess, four_epochs[0])
    assert_position(sess, 4)


def test_a_live_fit_stopped_mid_epoch_goes_on_from_that_batch(model, four_epochs):
    class StopAt(Callback):
        def on_batch_end(self, batch, logs):
            return logs["epoch"] == 1 and batch == 2

    sess = TrainingSession(model)
    history = fit(sess, epochs=4, callbacks=[StopAt()])
    assert history.stopped_early and history.steps == PER_EPOCH + 3
    assert_position(sess, 1, 3)
    history = fit(sess, epochs=3)  # the rest of epoch 1, then 2 and 3
    assert history.epochs == [1, 2, 3] and history.steps == 2 * PER_EPOCH + 2
    assert_same_state(sess, four_epochs[0])
    assert_position(sess, 4)


@pytest.mark.parametrize("progress", [True, "epoch", False])
def test_a_checkpoint_past_the_end_trains_nothing_and_says_so(model, four_epochs, tmp_path, capsys,
                                                               progress):
    path = four_epochs[0].export(tmp_path / "ck.onnx", training=True)
    loaded = TrainingSession(path)
    capsys.readouterr()
    history = loaded.fit(X, Y, epochs=2, batch_size=BATCH, validation_data=VALIDATION,
                         progress=progress)
    err = capsys.readouterr().err
    if progress is False:
        assert err == ""
    else:
        assert err == "nothing to train: the checkpoint is at epoch 4 of 2\n"
    assert len(history) == 0 and history.steps == 0 and not history.stopped_early
    trained = TrainingSession(model).fit(X, Y, batch_size=BATCH, validation_data=VALIDATION,
                                         progress=False)
    assert history.keys() == trained.keys() == ["loss", "accuracy", "val_loss", "val_accuracy"]
    assert all(history[k] == [] for k in history.keys())
    assert_same_state(loaded, four_epochs[0])
    assert loaded.fit_position["source"] == "checkpoint"  # its run has not gone on
    assert fit(loaded, epochs=5).epochs == [4]  # so its next fit still continues it


@pytest.mark.parametrize("kw, line", [
    ({"epochs": 0}, "nothing to train: epochs=0"),
    ({"epochs": 2, "initial_epoch": 2}, "nothing to train: initial_epoch=2 and epochs=2"),
])
def test_a_live_fit_with_nothing_to_train_says_so(model, capsys, kw, line):
    sess = TrainingSession(model)
    fit(sess, epochs=1)
    before = dict(sess.state)
    capsys.readouterr()
    history = sess.fit(X, Y, batch_size=BATCH, progress="epoch", **kw)
    assert capsys.readouterr().err == line + "\n"
    assert history.keys() == ["loss", "accuracy"] and history["loss"] == history["accuracy"] == []
    assert all(np.array_equal(before[k], v) for k, v in sess.state.items())
    assert_position(sess, 1)


def test_nothing_to_train_keeps_the_learning_rate_key_of_a_built_model(capsys):
    from onnx import TensorProto, helper, numpy_helper

    from onnxtrain import build

    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W", "b"], ["logits"])], "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(np.zeros((64, 10), np.float32), "W"),
         numpy_helper.from_array(np.zeros(10, np.float32), "b")])
    tm = build.training_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                              loss="cross_entropy", optimizer=build.SGD(lr=0.01))
    sess = TrainingSession(tm)
    trained = sess.fit(X, Y, batch_size=BATCH, progress=False)
    history = sess.fit(X, Y, epochs=0, batch_size=BATCH)
    assert "nothing to train: epochs=0" in capsys.readouterr().err
    assert history.keys() == trained.keys() == ["loss", "accuracy", "lr"]
    assert all(history[k] == [] for k in history.keys())


# ------------------------------------------------------------------ a resume inside an algorithm cycle
def classifier() -> onnx.ModelProto:
    rng = np.random.default_rng(4)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"])], "classifier",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array((rng.standard_normal((4, 8)) / 2).astype(np.float32), "W1"),
         numpy_helper.from_array(np.zeros(8, np.float32), "b1"),
         numpy_helper.from_array((rng.standard_normal((8, 3)) / 3).astype(np.float32), "W2"),
         numpy_helper.from_array(np.zeros(3, np.float32), "b2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


class StopAtStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, batch, logs):
        return logs["step"] == self.step


@pytest.mark.parametrize("stop_step", [4, 7], ids=["epoch0-batch4", "epoch1-batch2"])
def test_mid_epoch_resume_keeps_the_place_in_an_algorithm_cycle(tmp_path, stop_step):
    """5 batches per epoch, cycle [0, 0, 1]: a checkpoint after step 4 or 7
    resumes at cycle position 4 or 7 (not at the epoch's start), so the
    resumed run ends with the uninterrupted run's state, bit for bit.

    Bug caught: the resumed cycle position forgetting the batches already
    done in the epoch (``cycle_pos = initial_epoch * per_epoch + skip``
    written as ``cycle_pos = initial_epoch * per_epoch`` in ``fit``)."""
    rng = np.random.default_rng(5)
    y = rng.integers(0, 3, 40)
    X = (np.eye(3, 4)[y] * 2 + rng.normal(0, 0.5, (40, 4))).astype(np.float32)
    tm = build.training_model(classifier(), loss="cross_entropy",
                              optimizer=build.SGD(lr=0.1, momentum=0.9), accumulate=3)
    options = dict(epochs=3, batch_size=8, seed=3, progress=False)
    straight = TrainingSession(tm)
    straight.fit(X, y, **options)
    assert int(straight.state["step"]) == 15 // 3

    first = TrainingSession(tm)
    first.fit(X, y, callbacks=[StopAtStep(stop_step)], **options)
    path = first.export(tmp_path / "ckpt.onnx", training=True)
    resumed = TrainingSession(path)
    assert resumed.fit_position["batch"] == stop_step % 5
    history = resumed.fit(X, y, **options)
    assert history.steps == 15 - stop_step
    expected = dict(straight.state)
    got = dict(resumed.state)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
