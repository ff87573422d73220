"""fit / evaluate / predict, History, callbacks, checkpoints and the session summaries.

Models come from onnxtrain.demo (the hand-built digits MLP) and tests/models.py,
with onnxtrain.* metadata added by hand where a test needs it."""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import pytest
from models import linear_regression, mlp_classifier

from onnxtrain import TrainingSession
from onnxtrain.datasets import load_digits, train_test_split
from onnxtrain.demo import build_classifier
from onnxtrain.io.metadata import checkpoint_epoch, model_metadata
from onnxtrain.train.callbacks import Callback, Checkpoint, EarlyStopping, History, StopTraining
from onnxtrain.train.spec import fit_spec


def with_metadata(model: onnx.ModelProto, **entries) -> onnx.ModelProto:
    for key, value in entries.items():
        model.metadata_props.add(key=f"onnxtrain.{key}", value=json.dumps(value))
    return model


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits()
    return train_test_split(X, y, test_size=0.2, seed=0)


def small_mlp(**kw) -> TrainingSession:
    return TrainingSession(build_classifier(hidden=16, **kw))


def assert_same_state(a: TrainingSession, b: TrainingSession) -> None:
    assert set(a.state) == set(b.state)
    for name in a.state:
        np.testing.assert_array_equal(a.state[name], b.state[name], err_msg=name)


# ------------------------------------------------------------------ acceptance
def test_digits_mlp_reaches_95_percent_through_fit(digits):
    X_train, X_test, y_train, y_test = digits
    sess = TrainingSession(build_classifier(hidden=64, lr=0.01, seed=0))
    history = sess.fit((X_train, y_train), epochs=15, batch_size=32,
                       validation_data=(X_test, y_test), progress=False)
    assert history.keys() == ["loss", "accuracy", "val_loss", "val_accuracy"]
    assert len(history) == 15 and history.epochs == list(range(15))
    assert history["loss"][-1] < history["loss"][0] / 5
    result = sess.evaluate((X_test, y_test))
    print(f"\nfit digits MLP: test accuracy {result['accuracy']:.4f}, "
          f"{sum(history.seconds):.2f} s for 15 epochs")
    assert result["accuracy"] >= 0.95
    assert result["accuracy"] == pytest.approx(history["val_accuracy"][-1])
    predicted = sess.predict(X_test, batch_size=100).argmax(axis=1)
    assert np.mean(predicted == y_test) == pytest.approx(result["accuracy"])


def test_resume_from_exported_training_model_matches_exactly(digits, tmp_path):
    X_train, _, y_train, _ = digits
    data = (X_train[:600], y_train[:600])
    straight = small_mlp()
    straight.fit(data, epochs=4, batch_size=64, progress=False)

    first = small_mlp()
    ckpt = Checkpoint(first, tmp_path / "ckpt.onnx")
    first.fit(data, epochs=2, batch_size=64, progress=False, callbacks=[ckpt])
    assert ckpt.written == [tmp_path / "ckpt.onnx"] * 2

    resumed = TrainingSession(tmp_path / "ckpt.onnx")
    assert checkpoint_epoch(resumed) == 2
    history = resumed.fit(data, epochs=4, batch_size=64, progress=False,
                          initial_epoch=checkpoint_epoch(resumed))
    assert history.epochs == [2, 3]
    assert_same_state(straight, resumed)
    assert int(resumed.state["step"]) == 4 * 10


# ------------------------------------------------------------------- data forms
def test_data_forms_give_the_same_training(digits):
    X_train, _, y_train, _ = digits
    X, y = X_train[:256], y_train[:256]
    by_tuple, by_dict, by_batches = small_mlp(), small_mlp(), small_mlp()
    by_tuple.fit((X, y), epochs=1, batch_size=64, shuffle=False, progress=False)
    by_dict.fit({"X": X, "label": y}, epochs=1, batch_size=64, shuffle=False, progress=False)
    batches = [{"X": X[i:i + 64], "label": y[i:i + 64]} for i in range(0, 256, 64)]
    history = by_batches.fit(batches, epochs=1, progress=False)
    assert_same_state(by_tuple, by_dict)
    assert_same_state(by_tuple, by_batches)
    assert history["loss"][0] > 0


def test_arrays_are_cast_to_the_declared_dtype(digits):
    X_train, _, y_train, _ = digits
    sess = small_mlp()
    ref = small_mlp()
    sess.fit((X_train[:64].astype(np.float64), y_train[:64].astype(np.int32)), batch_size=64,
             shuffle=False, progress=False)
    ref.fit((X_train[:64], y_train[:64]), batch_size=64, shuffle=False, progress=False)
    assert_same_state(sess, ref)


@pytest.mark.parametrize("data, message", [
    (({"X": np.zeros((4, 64), np.float32), "label": np.zeros(3, np.int64)}), "same number of rows"),
    ((np.zeros((4, 64), np.float32), np.full(4, 0.5, np.float32)), "'label' holds 0.5 .*--loss mse"),
    ((np.zeros((0, 64), np.float32), np.zeros(0, np.int64)), "empty"),
    ({"X": np.zeros((4, 64), np.float32)}, "no target 'label'"),
    ("digits.npz", "data must be"),
    (42, "data must be"),
])
def test_bad_data_is_a_clear_error(data, message):
    sess = small_mlp()
    before = dict(sess.state)
    with pytest.raises((ValueError, TypeError), match=message):
        sess.fit(data, progress=False)
    for name, value in before.items():
        np.testing.assert_array_equal(sess.state[name], value)


def test_one_shot_iterator_cannot_feed_two_epochs(digits):
    X_train, _, y_train, _ = digits
    gen = ({"X": X_train[i:i + 32], "label": y_train[i:i + 32]} for i in range(0, 96, 32))
    with pytest.raises(ValueError, match="one-shot iterator"):
        small_mlp().fit(gen, epochs=2, progress=False)


def test_bad_arguments():
    sess = small_mlp()
    data = (np.zeros((4, 64), np.float32), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="batch_size"):
        sess.fit(data, batch_size=0)
    with pytest.raises(ValueError, match="unknown metric 'f1'"):
        sess.fit(data, metrics=["f1"], progress=False)
    with pytest.raises(ValueError, match="cycle"):
        sess.fit(data, cycle=[3], progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        sess.evaluate(data, batch_size=0)


# ---------------------------------------------------------------- evaluate
def test_evaluate_changes_no_state_and_equals_the_training_loss(digits):
    X_train, _, y_train, _ = digits
    sess = small_mlp(seed=3)
    sess.fit((X_train[:128], y_train[:128]), epochs=1, batch_size=32, progress=False)
    before = dict(sess.state)
    batch = {"X": X_train[200:264], "label": y_train[200:264]}
    result = sess.evaluate(batch, batch_size=64)
    for name, value in before.items():
        np.testing.assert_array_equal(sess.state[name], value, err_msg=name)
    # train_step returns the loss at the weights before its update: the same number.
    out = sess.train_step(batch)
    assert result["loss"] == pytest.approx(float(out["loss"]), rel=1e-6)
    assert result["accuracy"] == np.mean(out["logits"].argmax(1) == batch["label"])


def test_evaluate_weights_batches_by_size(digits):
    X_train, _, y_train, _ = digits
    sess = small_mlp()
    X, y = X_train[:100], y_train[:100]
    whole = sess.evaluate((X, y), batch_size=100)
    split = sess.evaluate((X, y), batch_size=30)  # 30, 30, 30, 10
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert split["accuracy"] == pytest.approx(whole["accuracy"])


def test_evaluate_regression_loss_matches_numpy():
    sess = TrainingSession(linear_regression(n_in=3))
    rng = np.random.default_rng(0)
    X = rng.standard_normal((50, 3)).astype(np.float32)
    T = rng.standard_normal((50, 1)).astype(np.float32)
    result = sess.evaluate((X, T), batch_size=16, metrics=["mse", "mae"])
    pred = X.astype(np.float64) @ sess.state["W"] + sess.state["B"]
    assert result["loss"] == pytest.approx(np.mean((pred - T) ** 2), rel=1e-5)
    assert result["mse"] == pytest.approx(result["loss"], rel=1e-5)
    assert result["mae"] == pytest.approx(np.mean(np.abs(pred - T)), rel=1e-5)


def test_regression_fit_has_no_accuracy_by_default():
    sess = TrainingSession(linear_regression(n_in=3, lr=0.1))
    rng = np.random.default_rng(1)
    X = rng.standard_normal((256, 3)).astype(np.float32)
    T = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
    history = sess.fit((X, T), epochs=5, batch_size=32, progress=False, validation_data=(X, T))
    assert history.keys() == ["loss", "val_loss"]
    assert history["val_loss"][-1] < 0.01
    spec = fit_spec(sess)
    assert (spec.target, spec.loss, spec.prediction, spec.task) == ("T", "loss", "Y", "regression")


# ------------------------------------------------------------------ predict
def test_predict_concatenates_batches(digits):
    _, X_test, _, y_test = digits
    sess = small_mlp()
    full = sess.run({"X": X_test})["logits"]
    np.testing.assert_allclose(sess.predict(X_test, batch_size=50), full, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sess.predict((X_test, y_test), batch_size=1000), full,
                               rtol=1e-6, atol=1e-6)
    both = sess.predict({"X": X_test, "label": y_test}, outputs=["logits"], batch_size=77)
    assert list(both) == ["logits"] and both["logits"].shape == (len(X_test), 10)


# ------------------------------------------------------------- the cycle
def two_group_mlp(**meta) -> TrainingSession:
    """Two TrainingInfoProtos: [W1, b1] with counter step0, [W2, b2] with step1."""
    model = mlp_classifier("sgd", sizes=(64, 8, 10), groups=[["W1", "b1"], ["W2", "b2"]])
    return TrainingSession(with_metadata(model, **meta))


def test_cycle_from_metadata_runs_one_algorithm_per_batch(digits):
    X_train, _, y_train, _ = digits
    data = (X_train[:256], y_train[:256])
    sess = two_group_mlp(cycle=[0, 0, 1])
    sess.fit(data, epochs=2, batch_size=64, progress=False)  # 8 batches: 0 0 1 0 0 1 0 0
    assert (int(sess.state["step0"]), int(sess.state["step1"])) == (6, 2)

    resumed = two_group_mlp(cycle=[0, 0, 1])
    resumed.fit(data, epochs=1, batch_size=64, progress=False)  # 0 0 1 0
    resumed.fit(data, epochs=2, batch_size=64, progress=False, initial_epoch=1)  # 0 1 0 0
    assert_same_state(sess, resumed)


def test_without_cycle_each_batch_runs_every_algorithm(digits):
    X_train, _, y_train, _ = digits
    sess = two_group_mlp()
    sess.fit((X_train[:256], y_train[:256]), epochs=1, batch_size=64, progress=False)
    assert (int(sess.state["step0"]), int(sess.state["step1"])) == (4, 4)
    override = two_group_mlp()
    override.fit((X_train[:256], y_train[:256]), batch_size=64, progress=False, cycle=[1])
    assert (int(override.state["step0"]), int(override.state["step1"])) == (0, 4)


def test_bad_cycle_metadata_is_reported():
    with pytest.raises(ValueError, match="onnxtrain.cycle"):
        fit_spec(two_group_mlp(cycle=[0, 2]))


# --------------------------------------------------------- fetch and progress
class FetchSpy:
    """Wraps train_step to record the fetch argument of every call."""

    def __init__(self, sess, monkeypatch):
        self.fetches = []
        original = sess.train_step

        def train_step(feeds, algorithm=None, fetch=True):
            self.fetches.append(fetch)
            return original(feeds, algorithm=algorithm, fetch=fetch)

        monkeypatch.setattr(sess, "train_step", train_step)


def test_tight_loop_never_fetches(digits, monkeypatch):
    X_train, _, y_train, _ = digits
    sess = small_mlp()
    spy = FetchSpy(sess, monkeypatch)
    history = sess.fit((X_train[:256], y_train[:256]), epochs=2, batch_size=32,
                       progress=False, log_every=0)
    assert spy.fetches == [False] * 16
    assert "loss" not in history and len(history) == 2


def test_log_every_fetches_some_batches(digits, monkeypatch):
    X_train, _, y_train, _ = digits
    sess = small_mlp()
    spy = FetchSpy(sess, monkeypatch)
    history = sess.fit((X_train[:256], y_train[:256]), batch_size=32, progress=False, log_every=3)
    assert [bool(f) for f in spy.fetches] == [True, False, False] * 2 + [True, False]
    assert np.isfinite(history["loss"][0]) and np.isfinite(history["accuracy"][0])
    # by name: the loss and the prediction the accuracy reads (what this model's step returns)
    (returned,) = sess.algorithm_outputs
    assert {frozenset(f) for f in spy.fetches if f} == {frozenset(returned)} and len(returned) == 2
    spy.fetches.clear()
    sess.fit((X_train[:64], y_train[:64]), batch_size=32, progress=False, metrics=[])
    assert spy.fetches == [frozenset({"loss"})] * 2


def test_progress_bar_shows_epochs_and_loss(digits, capsys):
    X_train, _, y_train, _ = digits
    small_mlp().fit((X_train[:128], y_train[:128]), epochs=2, batch_size=32, progress=True)
    err = capsys.readouterr().err
    assert "epoch 1/2" in err and "epoch 2/2" in err
    assert "4/4" in err and "loss=" in err and "accuracy=" in err


def test_no_progress_prints_nothing(digits, capsys):
    X_train, _, y_train, _ = digits
    small_mlp().fit((X_train[:64], y_train[:64]), batch_size=32, progress=False)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


# ------------------------------------------------------------------ callbacks
def test_callbacks_see_batches_and_epochs(digits):
    X_train, _, y_train, _ = digits
    seen = []

    class Recorder(Callback):
        def on_batch_end(self, batch, logs):  # Keras: batch index within the epoch
            seen.append(("batch", logs["step"], logs["epoch"], batch, logs["size"]))
            assert logs["loss"] > 0

        def on_epoch_end(self, epoch, logs):
            seen.append(("epoch", epoch, sorted(logs)))

    small_mlp().fit((X_train[:80], y_train[:80]), epochs=2, batch_size=32, progress=False,
                    callbacks=[Recorder()], validation_data=(X_train[:10], y_train[:10]))
    assert seen == [
        ("batch", 1, 0, 0, 32), ("batch", 2, 0, 1, 32), ("batch", 3, 0, 2, 16),
        ("epoch", 0, ["accuracy", "loss", "val_accuracy", "val_loss"]),
        ("batch", 4, 1, 0, 32), ("batch", 5, 1, 1, 32), ("batch", 6, 1, 2, 16),
        ("epoch", 1, ["accuracy", "loss", "val_accuracy", "val_loss"]),
    ]


def test_batch_callback_returning_true_stops_after_that_batch(digits):
    X_train, _, y_train, _ = digits
    sess = small_mlp()

    class StopAt(Callback):
        def on_batch_end(self, batch, logs):
            return logs["step"] == 3

    history = sess.fit((X_train[:256], y_train[:256]), epochs=5, batch_size=32, progress=False,
                       callbacks=[StopAt()])
    assert int(sess.state["step"]) == 3
    assert history.stopped_early and len(history) == 1 and history.steps == 3


def test_stop_training_raised_at_epoch_end(digits):
    X_train, _, y_train, _ = digits
    sess = small_mlp()

    def stop_after_second(epoch, logs):
        if epoch == 1:
            raise StopTraining

    class Hook:  # any object with the hook works: no base class needed
        on_epoch_end = staticmethod(stop_after_second)

    history = sess.fit((X_train[:64], y_train[:64]), epochs=10, batch_size=32, progress=False,
                       callbacks=[Hook()])
    assert len(history) == 2 and history.stopped_early
    assert int(sess.state["step"]) == 4


def test_early_stopping():
    es = EarlyStopping("val_loss", patience=2)
    values = [1.0, 0.8, 0.9, 0.85, 0.95]
    # Keras/Lightning: stop at the patience-th epoch without improvement.
    assert [es.on_epoch_end(i, {"val_loss": v}) for i, v in enumerate(values)] == [
        False, False, False, True, True]
    with pytest.raises(ValueError, match="no 'val_accuracy'"):
        EarlyStopping("val_accuracy", mode="max").on_epoch_end(0, {"loss": 1.0})


def test_custom_metric_and_early_stopping_in_fit(digits):
    X_train, _, y_train, _ = digits

    def top2(y_true, y_pred):
        best2 = np.argsort(y_pred, axis=1)[:, -2:]
        return np.mean((best2 == y_true[:, None]).any(axis=1))

    class Worse(EarlyStopping):  # monitor that only ever gets worse: stops after patience
        def on_epoch_end(self, epoch, logs):
            return super().on_epoch_end(epoch, {"val_top2": -epoch})

    history = small_mlp().fit((X_train[:128], y_train[:128]), epochs=10, batch_size=32,
                              progress=False, metrics=["accuracy", top2],
                              validation_data=(X_train[128:192], y_train[128:192]),
                              callbacks=[Worse("val_top2", patience=1, mode="max")])
    assert history.keys() == ["loss", "accuracy", "top2", "val_loss", "val_accuracy", "val_top2"]
    assert all(t >= a for t, a in zip(history["top2"], history["accuracy"]))
    assert len(history) == 2 and history.stopped_early  # patience=1: the first worse epoch stops


def test_failed_step_propagates_and_keeps_state(digits):
    """A batch with a wrong shape fails inside train_step: the state is that of the last good step."""
    X_train, _, y_train, _ = digits
    sess = small_mlp()
    good = [{"X": X_train[:32], "label": y_train[:32]}]
    sess.fit(good, progress=False)
    before = dict(sess.state)
    bad = good + [{"X": X_train[:32, :10], "label": y_train[:32]}]
    with pytest.raises(ValueError, match="feed 'X' has shape"):
        sess.fit(bad, progress=False)
    assert int(sess.state["step"]) == int(before["step"]) + 1


# -------------------------------------------------------------------- history
def test_history_plot(digits, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    X_train, _, y_train, _ = digits
    history = small_mlp().fit((X_train[:64], y_train[:64]), epochs=3, batch_size=32,
                              progress=False, validation_data=(X_train[64:96], y_train[64:96]))
    ax = history.plot(["loss", "val_loss"])
    assert [line.get_label() for line in ax.get_lines()] == ["loss", "val_loss"]
    np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), history["loss"])
    with pytest.raises(KeyError, match="mse"):
        history.plot(["mse"])


def test_history_plot_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    history = History()
    history.append(0, {"loss": 1.0}, 0.1)
    with pytest.raises(ImportError, match=r"pip install 'onnxtrain\[plot\]'"):
        history.plot()


def test_history_fills_missing_values_with_nan():
    history = History()
    history.append(0, {"loss": 1.0}, 0.1)
    history.append(1, {"loss": 0.5, "val_loss": 0.7}, 0.1)
    assert history["loss"] == [1.0, 0.5]
    assert np.isnan(history["val_loss"][0]) and history["val_loss"][1] == 0.7
    assert repr(history) == "History(2 epochs: loss=0.5, val_loss=0.7)"


# ----------------------------------------------------------------- metadata
def test_metadata_overrides_inference():
    model = with_metadata(build_classifier(hidden=4), inputs=["X"], target="label", loss="loss",
                          prediction="logits", task="classification", cycle=[0])
    spec = fit_spec(TrainingSession(model))
    assert spec.cycle == (0,) and spec.task == "classification"
    assert set(spec.from_metadata) == {"inputs", "target", "loss", "prediction", "task", "cycle"}


@pytest.mark.parametrize("key, value, message", [
    ("task", "clustering", "onnxtrain.task"),
    ("prediction", "nope", "onnxtrain.prediction"),
    ("loss", "nope", "the loss 'nope'"),
    ("inputs", "X", "onnxtrain.inputs"),
])
def test_bad_metadata_is_reported(key, value, message):
    model = with_metadata(build_classifier(hidden=4), **{key: value})
    with pytest.raises(ValueError, match=message):
        fit_spec(TrainingSession(model))


def test_metadata_must_be_json():
    model = build_classifier(hidden=4)
    model.metadata_props.add(key="onnxtrain.target", value="label")  # not JSON
    with pytest.raises(ValueError, match="expected a JSON value"):
        model_metadata(model)


def test_checkpoint_epoch_of_a_plain_model_is_zero():
    assert checkpoint_epoch(build_classifier(hidden=4)) == 0


# -------------------------------------------------------------- summaries
def test_repr_lists_algorithms_io_and_state_roles():
    text = repr(small_mlp())
    assert text.splitlines()[0] == (
        "TrainingSession: 1 algorithm, 13 state variables (4 trainable, 1,210 parameters)")
    assert "inputs:   X: float32[N, 64]" in text
    assert "outputs:  logits: float32[N, 10]" in text
    assert "training_info[0]: feeds X, label -> returns" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()[5:]}
    assert rows["W1"] == ["W1", "float32", "[64,", "16]", "trainable"]
    assert rows["W1.adam_m"][-1] == "optimizer" and rows["step"] == ["step", "int64", "[]", "optimizer"]


def test_repr_uses_metadata_roles_and_shows_the_cycle():
    model = with_metadata(build_classifier(hidden=4), trainable=["W2", "b2"],
                          optimizer_state={"adam": ["W2.adam_m", "W2.adam_v", "b2.adam_m", "b2.adam_v"]}, cycle=[0])
    text = repr(TrainingSession(model))
    roles = {line.split()[0]: line.split()[-1] for line in text.splitlines() if "float32  [" in line
             or "int64" in line}
    assert roles["W2"] == "trainable" and roles["W1"] == "state"
    assert roles["W2.adam_m"] == "optimizer" and roles["W1.adam_m"] == "state"
    assert "cycle (algorithm per batch): [0]" in text


def test_repr_of_two_algorithms_and_of_many_variables():
    text = repr(two_group_mlp(cycle=[0, 1]))
    assert "training_info[0]: feeds X, label" in text and "training_info[1]" in text
    params = {f"W{i}": np.zeros((2, 2), np.float32) for i in range(50)}
    from models import trainable_model, vi
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Sum", ["X", *params], ["Y"])]
    loss = [helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0)]
    model = trainable_model(nodes, [vi("X", TensorProto.FLOAT, [2, 2])],
                            [vi("Y", TensorProto.FLOAT, [2, 2])], params, loss,
                            vi("T", TensorProto.FLOAT, [2, 2]))
    sess = TrainingSession(model)
    text = repr(sess)
    assert "... 11 more (sess.state_info lists them all)" in text
    assert "<details>" in sess._repr_html_()


def test_html_summary():
    html = small_mlp()._repr_html_()
    assert html.startswith("<div") and html.endswith("</div>")
    assert "<th>state variable</th>" in html and "<td>W1.adam_v</td>" in html
    assert "float32[N, 64]" in html and "trainable" in html


def test_infinite_loss_stops_fit_naming_the_step():
    """y = log(X w): rows of zeros give log(0) = -inf, an infinite MSE at the third batch."""
    from onnx import TensorProto, helper, numpy_helper

    from onnxtrain import build
    from onnxtrain.train.loop import NonFiniteLossError

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "w"], ["z"]), helper.make_node("Log", ["z"], ["y"])],
        "log_linear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(np.ones((2, 1), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = TrainingSession(build.training_model(model, loss="mse", optimizer=build.SGD(lr=1e-3)))
    x = np.ones((6, 2), np.float32)
    x[4:] = 0.0
    seen = []

    class Record(Callback):
        def on_batch_end(self, batch, logs):
            seen.append(logs["step"])

    with pytest.raises(NonFiniteLossError, match=r"training loss is inf at epoch 1, batch 3 \(step 3"):
        sess.fit((x, np.zeros((6, 1), np.float32)), batch_size=2, shuffle=False, progress=False,
                 callbacks=[Record()])
    assert seen == [1, 2]  # the callbacks never saw the bad step
