"""The fit loop as Keras, Lightning and ORT-training users expect it (issue 15), in Python.

Small models built with ``onnxtrain.build`` (SGD, so runs are exactly
reproducible) on a few dozen rows: the whole file runs in seconds."""

from __future__ import annotations

import csv
import inspect
import math
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import (
    Callback,
    CSVLogger,
    EarlyStopping,
    ModelCheckpoint,
    NonFiniteLossError,
    TerminateOnNaN,
    TrainingModelError,
    TrainingSession,
    build,
    checkpoint_epoch,
    train_test_split,
)
from onnxtrain.demo import build_classifier

F32 = TensorProto.FLOAT


def mlp(n_in=4, hidden=8, classes=3, batch="N", seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (n_in, hidden)).astype(np.float32), "W1"),
        numpy_helper.from_array(np.zeros(hidden, np.float32), "b1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (hidden, classes)).astype(np.float32), "W2"),
        numpy_helper.from_array(np.zeros(classes, np.float32), "b2"),
    ]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W1", "b1"], ["h0"]), helper.make_node("Relu", ["h0"], ["h"]),
         helper.make_node("Gemm", ["h", "W2", "b2"], ["logits"])],
        "mlp", [helper.make_tensor_value_info("X", F32, [batch, n_in])],
        [helper.make_tensor_value_info("logits", F32, [batch, classes])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def data(n=40, seed=1):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    X = (np.eye(4)[y] * 2 + rng.normal(0, 0.5, (n, 4))).astype(np.float32)
    return X, y


def session(lr=0.1, **kw) -> TrainingSession:
    return TrainingSession(build.training_model(mlp(**kw), optimizer=build.SGD(lr=lr)))


def params(sess):
    return {k: v for k, v in sess.state.items()}


def same_state(a, b):
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------ signatures, forms
def test_keras_call_forms_and_explicit_signatures():
    X, y = data()
    results = []
    for args in [(X, y), ((X, y),), ({"X": X, "target": y},)]:
        sess = session()
        h = sess.fit(*args, epochs=2, batch_size=16, progress=False)
        results.append((h["loss"], params(sess)))
    assert results[0][0] == results[1][0] == results[2][0]
    assert same_state(results[0][1], results[2][1])
    batches = [{"X": X[i:i + 16], "target": y[i:i + 16]} for i in range(0, 40, 16)]
    sess = session()
    sess.fit(batches, epochs=2, progress=False)
    assert int(sess.state["step"]) == 6
    assert set(sess.evaluate(X, y)) == {"loss", "accuracy"} and sess.evaluate(X, y) == sess.evaluate((X, y))
    assert sess.predict(X).shape == (40, 3) and np.array_equal(sess.predict(X), sess.predict((X, y)))

    fit_params = inspect.signature(TrainingSession.fit).parameters
    for name in ["x", "y", "epochs", "batch_size", "validation_data", "validation_split", "shuffle",
                 "seed", "callbacks", "metrics", "initial_epoch", "progress", "drop_last"]:
        assert name in fit_params, name
    assert fit_params["y"].default is None and fit_params["initial_epoch"].default is None
    assert fit_params["epochs"].kind is inspect.Parameter.KEYWORD_ONLY
    for method in (TrainingSession.fit, TrainingSession.evaluate, TrainingSession.predict):
        kinds = {p.kind for p in inspect.signature(method).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, method
    assert list(inspect.signature(TrainingSession.evaluate).parameters)[:3] == ["self", "x", "y"]
    assert list(inspect.signature(TrainingSession.predict).parameters)[:2] == ["self", "x"]


def test_validation_split_holds_out_the_last_rows():
    X, y = data()
    a, b = session(), session()
    ha = a.fit(X, y, epochs=2, batch_size=8, validation_split=0.25, progress=False)
    hb = b.fit(X[:30], y[:30], epochs=2, batch_size=8, validation_data=(X[30:], y[30:]), progress=False)
    assert ha["val_loss"] == hb["val_loss"] and same_state(params(a), params(b))
    with pytest.raises(ValueError, match="validation_split"):
        session().fit(X, y, validation_split=1.5, progress=False)


def test_every_epoch_has_its_own_seeded_order(monkeypatch):
    """Epoch e is permuted by default_rng((seed, e)): orders differ between epochs,
    and a resumed run at epoch e sees exactly that order."""
    X, y = data(n=12)
    X[:, 0] = np.arange(12)  # row ids ride in the first feature
    sess = session()
    seen = []
    real = sess.train_step

    def recording(feeds, **kw):
        seen.append(feeds["X"][:, 0].astype(int).tolist())
        return real(feeds, **kw)

    monkeypatch.setattr(sess, "train_step", recording)
    sess.fit(X, y, epochs=3, batch_size=12, seed=7, progress=False)
    assert seen == [np.random.default_rng((7, e)).permutation(12).tolist() for e in range(3)]
    assert seen[0] != seen[1] != seen[2]
    seen.clear()
    sess.fit(X, y, epochs=3, batch_size=12, seed=7, shuffle=False, progress=False)
    assert seen == [list(range(12))] * 3


def test_train_test_split_uses_test_size_and_keeps_the_old_name():
    X, y = data()
    new = train_test_split(X, y, test_size=0.25, seed=3)
    old = train_test_split(X, y, test_fraction=0.25, seed=3)
    assert new[1].shape == (10, 4) and all(np.array_equal(a, b) for a, b in zip(new, old))
    assert train_test_split(X, y, test_size=5)[1].shape == (5, 4)
    assert np.array_equal(train_test_split(X, y, random_state=3)[3], train_test_split(X, y, seed=3)[3])


# ------------------------------------------------------------------ target checks
@pytest.mark.parametrize("bad, value", [(3, 3), (-1, -1), (10, 10)])
def test_labels_out_of_range_are_refused_before_the_first_step(bad, value):
    X, y = data()
    y = y.copy()
    y[5] = bad
    sess = session()
    before = params(sess)
    with pytest.raises(ValueError, match=rf"target 'target' holds label {value}\b.*C = 3"):
        sess.fit(X, y, epochs=1, progress=False)
    assert same_state(before, params(sess))  # nothing changed
    with pytest.raises(ValueError, match="C = 3"):
        sess.evaluate(X, y)


def test_labels_1_to_c_get_a_hint_and_ignore_index_is_accepted():
    X, y = data()
    with pytest.raises(ValueError, match="subtract 1"):
        session().fit(X, np.where(y == 0, 3, y), progress=False)
    y = y.copy()
    y[:4] = -100  # the loss's ignore_index: skipped, not an error
    h = session().fit(X, y, epochs=1, progress=False)
    assert np.isfinite(h["loss"][0])


def test_class_axis_last_labels_are_checked_against_the_last_axis():
    """Scores [B, T, C] (classes last): C is the last dim, not T."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["scores"])], "seq",
        [helper.make_tensor_value_info("X", F32, ["B", 5, 4])],
        [helper.make_tensor_value_info("scores", F32, ["B", 5, 6])],
        [numpy_helper.from_array(rng.normal(size=(4, 6)).astype(np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = TrainingSession(build.training_model(
        model, loss=build.CrossEntropy(class_axis=-1), optimizer=build.SGD(lr=0.1)))
    X = rng.normal(size=(8, 5, 4)).astype(np.float32)
    ok = rng.integers(0, 6, (8, 5))
    sess.fit(X, ok, progress=False, metrics=())  # labels up to 5 (< C = 6, although T = 5)
    with pytest.raises(ValueError, match="label 6 .*C = 6"):
        sess.fit(X, np.full((8, 5), 6), progress=False, metrics=())


def test_regression_targets_get_dtype_and_shape_checks():
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "w"], ["y"])], "lin",
        [helper.make_tensor_value_info("X", F32, ["N", 3])],
        [helper.make_tensor_value_info("y", F32, ["N", 1])],
        [numpy_helper.from_array(np.zeros((3, 1), np.float32), "w")])
    sess = TrainingSession(build.training_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), loss="mse",
        optimizer=build.SGD(lr=0.1)))
    X = rng.normal(size=(16, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=r"shape \[16\].*reshape y"):
        sess.fit(X, X.sum(1), progress=False)
    with pytest.raises(ValueError, match="dtype <U1"):
        sess.fit(X, np.full((16, 1), "a"), progress=False)
    with pytest.raises(ValueError, match="dtype complex"):
        sess.fit(X, np.ones((16, 1), np.complex64), progress=False)
    sess.fit(X, X.sum(1, keepdims=True), progress=False)


# ------------------------------------------------------------------- callbacks
def test_hooks_run_in_keras_order():
    X, y = data(n=20)
    calls = []

    class Recorder(Callback):
        def on_train_begin(self, logs):
            calls.append(("train_begin", logs["epochs"]))

        def on_epoch_begin(self, epoch, logs):
            calls.append(("epoch_begin", epoch))

        def on_batch_begin(self, batch, logs):
            calls.append(("batch_begin", batch))

        def on_batch_end(self, batch, logs):
            calls.append(("batch_end", batch, logs["step"]))

        def on_epoch_end(self, epoch, logs):
            calls.append(("epoch_end", epoch))

        def on_train_end(self, logs):
            calls.append(("train_end", sorted(logs)))

    recorder = Recorder()
    session().fit(X, y, epochs=2, batch_size=10, progress=False, callbacks=[recorder])
    assert recorder.session is not None
    assert calls == [
        ("train_begin", 2),
        ("epoch_begin", 0), ("batch_begin", 0), ("batch_end", 0, 1), ("batch_begin", 1),
        ("batch_end", 1, 2), ("epoch_end", 0),
        ("epoch_begin", 1), ("batch_begin", 0), ("batch_end", 0, 3), ("batch_begin", 1),
        ("batch_end", 1, 4), ("epoch_end", 1),
        ("train_end", ["accuracy", "loss", "lr"]),
    ]


def test_a_callback_without_hooks_is_a_type_error():
    X, y = data()
    for bad in (lambda epoch, logs: None, object()):
        with pytest.raises(TypeError, match="none of the hooks"):
            session().fit(X, y, progress=False, callbacks=[bad])


def test_early_stopping_counts_patience_like_keras_and_restores_the_best():
    es = EarlyStopping("val_loss", patience=2, mode="min")
    values = [1.0, 0.5, 0.6, 0.7]
    assert [es.on_epoch_end(i, {"val_loss": v}) for i, v in enumerate(values)] == [
        False, False, False, True]
    assert es.best == 0.5 and es.best_epoch == 1
    es = EarlyStopping("val_loss", patience=0)
    assert es.on_epoch_end(0, {"val_loss": 1.0}) is False and es.on_epoch_end(1, {"val_loss": 1.0})
    assert EarlyStopping("loss", min_delta=0.1).on_epoch_end(0, {"loss": 5.0}) is False

    X, y = data()
    sess = session(lr=0.5)
    snapshots = []

    class Snap(Callback):
        def on_epoch_end(self, epoch, logs):
            snapshots.append(params(self.session))

    class Monitored(Callback):  # a monitored value: best at the call's epoch 1, worse after it
        def on_train_begin(self, logs):
            self.start = logs["initial_epoch"]

        def on_epoch_end(self, epoch, logs):
            logs["val_metric"] = [3.0, 1.0, 2.0, 2.0, 0.0, 0.0][epoch - self.start]

    es = EarlyStopping("val_metric", patience=2, restore_best_weights=True)
    h = sess.fit(X, y, epochs=10, batch_size=8, progress=False, callbacks=[Snap(), Monitored(), es])
    assert len(h) == 4 and h.stopped_early and es.best_epoch == 1
    assert same_state(params(sess), snapshots[1])
    assert not same_state(params(sess), snapshots[3])
    # One object, a second fit: its state starts afresh (else it would stop at once).
    # The session goes on from the best epoch's end: epochs 2, 3, ...
    snapshots.clear()
    h2 = sess.fit(X, y, epochs=10, batch_size=8, progress=False, callbacks=[Snap(), Monitored(), es])
    assert len(h2) == 4 and h2.epochs == [2, 3, 4, 5] and es.best_epoch == 3 and es.best == 1.0


def test_terminate_on_nan_stops_quietly_while_the_default_raises():
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "w"], ["z"]), helper.make_node("Log", ["z"], ["y"])],
        "log_linear", [helper.make_tensor_value_info("X", F32, ["N", 2])],
        [helper.make_tensor_value_info("y", F32, ["N", 1])],
        [numpy_helper.from_array(np.ones((2, 1), np.float32), "w")])
    tm = build.training_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                              loss="mse", optimizer=build.SGD(lr=1e-3))
    x = np.ones((6, 2), np.float32)
    x[4:] = 0.0
    y = np.zeros((6, 1), np.float32)
    with pytest.raises(NonFiniteLossError):
        TrainingSession(tm).fit(x, y, batch_size=2, shuffle=False, progress=False)
    stop = TerminateOnNaN()
    h = TrainingSession(tm).fit(x, y, epochs=3, batch_size=2, shuffle=False, progress=False,
                                callbacks=[stop])
    assert h.stopped_early and len(h) == 1 and h.steps == 3
    assert stop.terminated[:3] == (0, 2, 3) and np.isinf(stop.terminated[3])


def test_csv_logger_writes_one_row_per_epoch(tmp_path):
    X, y = data()
    path = tmp_path / "log.csv"
    h = session().fit(X, y, epochs=3, batch_size=16, validation_data=(X, y), progress=False,
                      callbacks=[CSVLogger(path)])
    rows = list(csv.DictReader(path.open()))
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    assert [float(r["val_loss"]) for r in rows] == h["val_loss"]
    assert set(rows[0]) == {"epoch", "loss", "accuracy", "val_loss", "val_accuracy", "lr"}


def test_model_checkpoint_needs_no_session_and_keeps_only_the_best(tmp_path):
    X, y = data()
    every = ModelCheckpoint(tmp_path / "ckpt-{epoch}.onnx")

    class Score(Callback):  # a monitored value that improves, then worsens: 3, 2, 1, 2, 3
        def on_epoch_end(self, epoch, logs):
            logs["val_score"] = abs(2 - epoch) + 1.0

    best = ModelCheckpoint(tmp_path / "best.onnx", monitor="val_score", save_best_only=True)
    session().fit(X, y, epochs=5, batch_size=16, progress=False, callbacks=[every, Score(), best])
    assert [p.name for p in every.written] == [f"ckpt-{e}.onnx" for e in range(1, 6)]
    assert len(best.written) == 3  # epochs 1, 2, 3 improved
    assert checkpoint_epoch(tmp_path / "best.onnx") == 3
    resumed = TrainingSession(tmp_path / "ckpt-2.onnx")
    assert checkpoint_epoch(resumed) == 2


def test_output_paths_are_checked_before_training(tmp_path):
    X, y = data()
    sess = session()
    before = params(sess)
    with pytest.raises(ValueError, match="is a folder"):
        sess.fit(X, y, progress=False, callbacks=[ModelCheckpoint(tmp_path)])
    with pytest.raises(ValueError, match="does not exist"):
        sess.fit(X, y, progress=False, callbacks=[CSVLogger(tmp_path / "nope" / "log.csv")])
    assert same_state(before, params(sess))


# --------------------------------------------------------------- learning rate
def test_learning_rate_is_read_write_state_that_changes_the_next_step(tmp_path):
    X, y = data()
    sess = session(lr=0.1)
    assert sess.learning_rate == pytest.approx(0.1)
    sess.fit(X, y, epochs=1, batch_size=40, progress=False)
    sess.learning_rate = 0.0
    frozen = params(sess)
    sess.fit(X, y, epochs=1, batch_size=40, progress=False)
    moved = {k for k in frozen if not np.array_equal(frozen[k], sess.state[k])}
    assert moved == {"step"}  # lr 0: the parameters stay where they were
    sess.learning_rate = 0.05
    h = sess.fit(X, y, epochs=2, batch_size=40, progress=False)
    assert h["lr"] == [0.05, 0.05]
    path = sess.export(tmp_path / "ckpt.onnx", training=True)
    assert TrainingSession(path).learning_rate == pytest.approx(0.05)  # saved with the state
    with pytest.raises(ValueError, match=">= 0"):
        sess.learning_rate = -1.0

    class Halve(Callback):  # a schedule written as a callback, ORT's set_learning_rate style
        def on_epoch_begin(self, epoch, logs):
            self.session.learning_rate = 0.4 / 2 ** epoch

    h = session().fit(X, y, epochs=3, progress=False, callbacks=[Halve()])
    assert h["lr"] == [0.4, 0.2, 0.1]


def test_clip_grad_norm_is_read_write_state_that_changes_the_next_step(tmp_path):
    """The clipping threshold is state like the learning rate: with SGD the
    update is lr * g * min(1, c / (||g|| + 1e-6)), so a tiny c makes the step
    c-sized, and a huge c leaves it the unclipped step."""
    X, y = data()
    feeds = {"X": X, "target": y}

    def step_norm(c):
        sess = TrainingSession(build.training_model(mlp(), optimizer=build.SGD(lr=1.0),
                                                    clip_grad_norm=1.0))
        assert sess.clip_grad_norm == pytest.approx(1.0)
        sess.clip_grad_norm = c
        before = params(sess)
        sess.train_step(feeds, fetch=False)
        return sess, math.sqrt(sum(float(np.sum((sess.state[k].astype(np.float64) - before[k]) ** 2))
                                   for k in ("W1", "b1", "W2", "b2")))

    sess, small = step_norm(1e-3)
    assert small == pytest.approx(1e-3, rel=1e-3)  # clipped to c
    _, large = step_norm(1e6)
    assert large > 10 * small  # not clipped: the raw gradient step
    path = sess.export(tmp_path / "ckpt.onnx", training=True)
    assert TrainingSession(path).clip_grad_norm == pytest.approx(1e-3)  # saved with the state
    with pytest.raises(ValueError, match="> 0"):
        sess.clip_grad_norm = 0.0
    with pytest.raises(TrainingModelError, match="no clipping-threshold state"):
        session().clip_grad_norm


def test_learning_rate_of_a_model_without_the_state_says_why():
    sess = TrainingSession(build_classifier(n_in=4, hidden=3, n_out=3))
    with pytest.raises(TrainingModelError, match="no learning-rate state"):
        sess.learning_rate
    X, y = data()
    h = sess.fit({"X": X, "label": y}, progress=False)  # still trains, no lr in the History
    assert "lr" not in h


# ------------------------------------------------------------------ checkpoints
def test_export_records_the_position_and_a_resumed_fit_continues_exactly(tmp_path):
    X, y = data()
    straight = session()
    straight.fit(X, y, epochs=4, batch_size=16, progress=False)

    first = session()

    class StopMidEpoch(Callback):
        def on_batch_end(self, batch, logs):
            return logs["step"] == 7  # epoch 3 (index 2), after its first batch

    first.fit(X, y, epochs=4, batch_size=16, progress=False, callbacks=[StopMidEpoch()])
    path = first.export(tmp_path / "ckpt.onnx", training=True)
    assert onnxtrain.checkpoint_epoch(path) == 2
    resumed = TrainingSession(path)
    assert resumed.fit_position["batch"] == 1 and resumed.fit_position["step"] == 7
    h = resumed.fit(X, y, epochs=4, batch_size=16, progress=False)  # initial_epoch=None
    assert h.epochs == [2, 3] and h.steps == 5
    assert same_state(params(resumed), params(straight))
    # An explicit initial_epoch starts at that epoch's first batch; a fresh session at 0.
    assert session().fit(X, y, epochs=2, batch_size=16, progress=False).epochs == [0, 1]
    after = TrainingSession(resumed.export(tmp_path / "done.onnx", training=True))
    assert after.fit(X, y, epochs=4, progress=False).epochs == []


def test_initialize_on_a_checkpoint_warns_and_restarts_at_epoch_zero(tmp_path):
    X, y = data()
    sess = session()
    sess.fit(X, y, epochs=2, progress=False)
    loaded = TrainingSession(sess.export(tmp_path / "c.onnx", training=True))
    with pytest.warns(UserWarning, match="resets the training state of a checkpoint"):
        loaded.initialize()
    assert loaded.fit(X, y, epochs=1, progress=False).epochs == [0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session().initialize()  # a fresh session: no warning


# ------------------------------------------------------------------ drop_last
def test_a_fixed_batch_model_drops_the_last_partial_batch_with_a_note():
    X, y = data(n=40)
    sess = TrainingSession(build.training_model(mlp(batch=16), optimizer=build.SGD(lr=0.1)))
    with pytest.warns(UserWarning, match="fixed batch size of 16.*8 row"):
        h = sess.fit(X, y, epochs=1, batch_size=16, progress=False, metrics=())
    assert h.steps == 2
    with pytest.raises(ValueError, match="batch_size=16"):
        sess.fit(X, y, batch_size=32, progress=False)
    assert session().fit(X, y, batch_size=16, drop_last=True, progress=False).steps == 2
    assert session().fit(X, y, batch_size=16, progress=False).steps == 3


# ------------------------------------------------------------------ progress, plot
def test_progress_uses_tqdm_auto(monkeypatch):
    import tqdm.auto

    made = []

    class Bar:
        def __init__(self, **kw):
            made.append(kw)

        def update(self, n):
            pass

        def set_postfix(self, *a, **k):
            pass

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    X, y = data()
    session().fit(X, y, epochs=2, batch_size=20, progress=True)
    assert [m["desc"] for m in made] == ["epoch 1/2", "epoch 2/2"]


def test_history_plot_uses_integer_epochs():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    X, y = data()
    h = session().fit(X, y, epochs=3, progress=False)
    ax = h.plot()
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert "lr" not in [line.get_label() for line in ax.get_lines()]


# ------------------------------------------------------------------ run()
def test_run_with_a_fed_state_override_leaves_the_state_unchanged():
    X, _ = data()
    sess = session()
    before = params(sess)
    zeros = np.zeros_like(before["W2"])
    out = sess.run({"X": X, "W2": zeros})["logits"]
    assert np.allclose(out, before["b2"])  # the override was used...
    assert same_state(before, params(sess))  # ...and not kept
    assert not np.allclose(sess.run({"X": X})["logits"], before["b2"])


def test_accumulation_count_follows_the_cycle_the_loop_is_given():
    """The accumulate graphs average over however many batches precede the update:
    an accumulate=2 model driven with cycle [0, 0, 1] equals an accumulate=3 one."""
    X, y = data(n=48)
    three = TrainingSession(build.training_model(mlp(), optimizer=build.SGD(lr=0.1), accumulate=3))
    two = TrainingSession(build.training_model(mlp(), optimizer=build.SGD(lr=0.1), accumulate=2))
    three.fit(X, y, epochs=2, batch_size=8, progress=False)
    two.fit(X, y, epochs=2, batch_size=8, progress=False, cycle=[0, 0, 1])
    for name in ("W1", "b1", "W2", "b2"):
        np.testing.assert_allclose(two.state[name], three.state[name], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ documentation
def test_readme_fit_section_shows_the_keras_call_and_docs_map_the_names():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = root.joinpath("README.md").read_text()
    section = readme.split("## Training loops", 1)[1].split("\n## ", 1)[0]
    assert "sess.fit(X, y, epochs=" in section and "initial_epoch" in section
    assert "checkpoint_epoch" in section and "learning_rate" in section
    table = root.joinpath("docs", "fit.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| Keras"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "Keras", "PyTorch Lightning", "ORT training (`onnxruntime.training.api`)", "onnxtrain"]
    for name in ("EarlyStopping", "ModelCheckpoint", "CSVLogger", "TerminateOnNaN",
                 "set_learning_rate", "initial_epoch", "validation_split", "test_size"):
        assert name in table, name


def test_notebooks_extra_installs_what_the_notebooks_need():
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads(root.joinpath("pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {req.split(">")[0].split("=")[0].split("[")[0].strip() for req in extras["notebooks"]}
    assert {"nbconvert", "ipykernel", "matplotlib", "ipywidgets"} <= names


def test_a_fixed_batch_model_evaluates_and_predicts_every_row():
    X, y = data(n=40)
    sess = TrainingSession(build.training_model(mlp(batch=16), optimizer=build.SGD(lr=0.1)))
    free = session()
    assert np.allclose(sess.predict(X), free.predict(X), atol=1e-6)  # 40 rows: 16 + 16 + padded 8
    with pytest.warns(UserWarning, match="last 8 row"):
        result = sess.evaluate(X, y, metrics=())
    assert result["loss"] == pytest.approx(free.evaluate(X[:32], y[:32], metrics=())["loss"], rel=1e-5)
    with pytest.warns(UserWarning):
        h = sess.fit(X, y, epochs=1, batch_size=16, validation_data=(X, y), progress=False, metrics=())
    assert "val_loss" in h


@pytest.mark.parametrize("fused", [None, False], ids=["fused-if-available", "standard-ops"])
def test_learning_rate_reaches_adam_with_and_without_fused_kernels(fused):
    X, y = data()
    tm = build.training_model(mlp(), optimizer=build.Adam(lr=0.01))
    sess = TrainingSession(tm, fused_kernels=fused)
    sess.fit(X, y, epochs=1, batch_size=20, progress=False)  # steps through the planned path
    sess.learning_rate = 0.0
    before = params(sess)
    sess.fit(X, y, epochs=1, batch_size=20, progress=False)
    assert all(np.array_equal(before[p], sess.state[p]) for p in ("W1", "b1", "W2", "b2"))
    sess.learning_rate = 0.01
    sess.fit(X, y, epochs=1, batch_size=20, progress=False)
    assert not np.array_equal(before["W1"], sess.state["W1"])


def test_the_learning_rate_state_follows_the_spec_bindings():
    """lr is an initializer of the algorithm graph named by an initialization_binding
    key (so it is state per IR.md) and by no update_binding (training never moves it)."""
    tm = build.training_model(mlp(), optimizer=build.SGD(lr=0.1), schedule=build.cosine(10))
    onnx.checker.check_model(tm)
    (ti,) = tm.training_info
    lr = onnxtrain.io.metadata.model_metadata(tm)["learning_rate"]["state"]
    init = {t.name: t for t in ti.algorithm.initializer}[lr]
    assert numpy_helper.to_array(init).dtype == np.float64 and numpy_helper.to_array(init) == 0.1
    assert lr in {b.key for b in ti.initialization_binding}
    assert lr not in {b.key for b in ti.update_binding}
    assert lr not in {t.name for t in tm.graph.initializer}
