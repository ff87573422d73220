"""EarlyStopping: it says what it does, a restore leaves one consistent
moment (state, fit_position, an exported checkpoint), and an improvement
counts only when it beats ``min_delta``.

A scripted score makes the best epoch known: [3, 1, 2, 2, 2] with patience 2
is best at epoch 2 and stops at epoch 4 (1-based)."""

from __future__ import annotations

import numpy as np
import pytest
from test_loss_choice import linear

from onnxtrain import Callback, EarlyStopping, TrainingSession, build, checkpoint_epoch


class Scripted(Callback):
    """Puts a scripted ``score`` into the epoch logs and keeps each epoch's state."""

    def __init__(self, scores):
        self.scores = list(scores)
        self.states: list[dict[str, np.ndarray]] = []

    def on_epoch_end(self, epoch, logs):
        logs["score"] = self.scores[epoch]
        self.states.append(dict(self.session.state.items()))


def session() -> TrainingSession:
    return TrainingSession(build.training_model(linear(3), optimizer=build.Adam(lr=0.05)))


def data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, 40)


def test_early_stopping_reports_the_stop_and_the_restore(capsys):
    sess = session()
    script = Scripted([3, 1, 2, 2, 2, 2])
    es = EarlyStopping("score", patience=2, restore_best_weights=True)
    X, y = data()
    history = sess.fit(X, y, epochs=6, batch_size=8, progress=False, callbacks=[script, es])
    out = capsys.readouterr().out
    assert len(history) == 4 and history.stopped_early
    assert "stopped at epoch 4" in out
    assert "Restoring model weights from the end of the best epoch: 2." in out
    assert (es.stopped_epoch, es.restored_epoch) == (3, 1)


def test_a_restore_leaves_state_position_and_checkpoint_at_the_best_epoch(tmp_path, capsys):
    X, y = data()
    sess = session()
    script = Scripted([3, 1, 2, 2, 2, 2])
    sess.fit(X, y, epochs=6, batch_size=8, progress=False, seed=4,
             callbacks=[script, EarlyStopping("score", patience=2, restore_best_weights=True,
                                              verbose=False)])
    assert capsys.readouterr().out == ""  # verbose=False: silent
    best = script.states[1]
    for name, value in best.items():  # the whole state: weights, moments, step counter
        np.testing.assert_array_equal(sess.state[name], value, err_msg=name)
    assert sess.fit_position["epoch"] == 2 and sess.fit_position["batch"] == 0
    assert sess.fit_position["step"] == 2 * 5  # 5 batches per epoch
    ckpt = sess.export(tmp_path / "best.onnx", training=True)
    assert checkpoint_epoch(ckpt) == 2
    # Resuming the checkpoint goes on from the best epoch exactly as an
    # uninterrupted run does after its second epoch.
    resumed = TrainingSession(ckpt)
    resumed.fit(X, y, epochs=4, batch_size=8, progress=False, seed=4)
    straight = session()
    straight.fit(X, y, epochs=4, batch_size=8, progress=False, seed=4)
    for name in straight.state:
        np.testing.assert_array_equal(resumed.state[name], straight.state[name], err_msg=name)


def test_no_restore_message_when_the_last_epoch_was_the_best(capsys):
    sess = session()
    X, y = data()
    es = EarlyStopping("score", patience=2, restore_best_weights=True)
    sess.fit(X, y, epochs=3, batch_size=8, progress=False,
             callbacks=[Scripted([3, 2, 1]), es])
    assert capsys.readouterr().out == "" and es.restored_epoch is None


@pytest.mark.parametrize("restore", [False, True])
def test_without_a_stop_nothing_is_said(capsys, restore):
    sess = session()
    X, y = data()
    sess.fit(X, y, epochs=2, batch_size=8, progress=False,
             callbacks=[Scripted([2, 1]), EarlyStopping("score", patience=5,
                                                         restore_best_weights=restore)])
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------ min_delta
def decisions(es: EarlyStopping, monitor: str, values: list[float]) -> list[bool]:
    es.on_train_begin({})
    return [es.on_epoch_end(e, {monitor: v}) for e, v in enumerate(values)]


def test_early_stopping_min_delta_demands_more_than_min_delta_of_improvement():
    """Bug caught: ``value < self.best - self.min_delta`` written as
    ``value < self.best + self.min_delta`` ("min" mode), which counts small
    worsenings as improvements; likewise for "max" mode."""
    es = EarlyStopping("val_loss", patience=2, min_delta=0.1)
    # 0.05 and 0.08 better than the best: not by more than min_delta.
    assert decisions(es, "val_loss", [1.0, 0.95, 0.92]) == [False, False, True]
    assert es.best == 1.0 and es.best_epoch == 0
    # 0.15 better: an improvement, which resets the patience.
    assert decisions(es, "val_loss", [1.0, 0.85, 0.8, 0.79]) == [False, False, False, True]
    assert es.best == 0.85 and es.best_epoch == 1
    # A worse value never improves, whatever min_delta.
    assert decisions(es, "val_loss", [1.0, 1.05, 1.01]) == [False, False, True]
    # The sign given by the user does not matter.
    neg = EarlyStopping("val_loss", patience=2, min_delta=-0.1)
    assert decisions(neg, "val_loss", [1.0, 0.95, 0.92]) == [False, False, True]

    acc = EarlyStopping("val_accuracy", patience=2, min_delta=0.1)  # mode "auto" -> "max"
    assert decisions(acc, "val_accuracy", [0.5, 0.55, 0.58]) == [False, False, True]
    assert decisions(acc, "val_accuracy", [0.5, 0.65, 0.6, 0.7]) == [False, False, False, True]
    assert acc.best == 0.65 and acc.best_epoch == 1


def test_early_stopping_min_delta_in_fit():
    """In fit: the loss falls, but never by 100 per epoch: with patience=1
    training stops after the second epoch."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((32, 4)).astype(np.float32)
    y = rng.standard_normal((32, 2)).astype(np.float32)
    sess = TrainingSession(build.training_model(linear(2), loss="mse", optimizer=build.SGD(lr=0.01)))
    es = EarlyStopping("loss", patience=1, min_delta=100.0)
    history = sess.fit(X, y, epochs=6, batch_size=8, progress=False, callbacks=[es])
    assert history.epochs == [0, 1] and history.stopped_early
    assert history["loss"][1] < history["loss"][0]  # it did improve, by less than min_delta
