"""The learning rate a user sees is the one the step uses.

``TrainingSession.current_learning_rate`` is checked against the schedule's
Python formula and against the rate the update itself applied (a one-weight
SGD model whose gradient is known: w' = w - rate * 2w); fit's ``History["lr"]``
and its epoch lines show the rate of each epoch's last step."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.train.loop import epoch_line


def one_weight_model(w: float = 1.0) -> "onnx.ModelProto":  # noqa: F821
    """y = x @ W with W a 1x1 float64 weight."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "one_weight",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 1])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["N", 1])],
        [numpy_helper.from_array(np.array([[w]]), "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def trained(schedule, lr=0.1, accumulate=1):
    model = build.training_model(one_weight_model(), loss="mse", optimizer=build.SGD(lr=lr), trainable=["W"],
                                 schedule=schedule, accumulate=accumulate)
    return TrainingSession(model)


BATCH = {"x": np.ones((1, 1)), "target": np.zeros((1, 1))}

SCHEDULES = [
    None,
    build.cosine(6),
    build.cosine(7, warmup=3),
    build.step_decay(2, 0.5),
    build.linear_warmup(4),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: repr(s))
def test_current_learning_rate_is_the_rate_each_update_applies(schedule):
    sess = trained(schedule)
    for step in range(9):
        expected = 0.1 * (schedule.factor(step) if schedule is not None else 1.0)
        current = sess.current_learning_rate
        assert current == pytest.approx(expected, rel=1e-12, abs=1e-15), step
        w = float(sess.state["W"][0, 0])
        sess.train_step(BATCH)
        w_new = float(sess.state["W"][0, 0])
        # mse of y = w against 0: gradient 2w, so w' = w - rate * 2w
        applied = (w - w_new) / (2 * w)
        assert applied == pytest.approx(current, rel=1e-9, abs=1e-12), step
        assert sess.learning_rate == 0.1  # the settable base rate is left alone


def test_current_learning_rate_follows_a_new_base_rate_and_a_restored_counter():
    sess = trained(build.cosine(10))
    for _ in range(5):
        sess.train_step(BATCH)
    assert sess.current_learning_rate == pytest.approx(0.1 * 0.5)
    sess.learning_rate = 0.4
    assert sess.current_learning_rate == pytest.approx(0.4 * 0.5)
    sess.initialize()  # the counter back to 0, the base back to 0.1
    assert sess.current_learning_rate == pytest.approx(0.1)
    with pytest.raises(AttributeError):
        sess.current_learning_rate = 1.0  # read-only


def test_current_learning_rate_with_gradient_accumulation():
    sess = trained(build.step_decay(1, 0.5), accumulate=2)
    rates = []
    for k in range(6):  # algorithm 0 accumulates, algorithm 1 updates
        rates.append(sess.current_learning_rate)
        sess.train_step(BATCH, algorithm=k % 2)
    assert rates == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])


def test_history_lr_is_the_rate_of_each_epochs_last_step(capsys):
    schedule = build.cosine(8, warmup=2)
    sess = trained(schedule)
    x, t = np.ones((12, 1)), np.zeros((12, 1))
    history = sess.fit(x, t, epochs=4, batch_size=4, shuffle=False, progress="epoch")
    # 3 steps per epoch: epoch e's last step is step 3e + 2
    expected = [0.1 * schedule.factor(3 * e + 2) for e in range(4)]
    assert history["lr"] == pytest.approx(expected, abs=1e-15)
    assert history["lr"][-1] == 0.0  # annealed to 0: the display says so
    lines = capsys.readouterr().err.splitlines()
    assert f"lr {expected[0]:.4g}" in lines[0]
    assert "lr 0," in lines[-1] or lines[-1].split("lr ")[1].startswith("0 ")


def test_epoch_line_shows_the_scheduled_rate():
    line = epoch_line(0, 1, {"loss": 0.5, "lr": 0.1 * math.cos(1.0)}, 1.0)
    assert "lr 0.05403" in line


@pytest.mark.filterwarnings("ignore:training_model")  # W is one element: trained, as meant
def test_the_cli_epoch_lines_show_the_scheduled_rate(capsys, tmp_path):
    """make-training --schedule cosine:6, then train: 2 steps per epoch, so epoch
    e's last step is step 2e + 1 and its line shows 0.1 * f(2e + 1)."""
    import onnx

    from onnxtrain.cli.app import main

    onnx.save(one_weight_model(), tmp_path / "m.onnx")
    assert main(["make-training", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx"),
                 "--loss", "mse", "--optimizer", "sgd", "--lr", "0.1",
                 "--schedule", "cosine:6"]) == 0
    np.savez(tmp_path / "d.npz", X=np.ones((8, 1)), y=np.zeros((8, 1)))
    capsys.readouterr()
    assert main(["train", str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"),
                 "--epochs", "4", "--batch-size", "4", "-o", str(tmp_path / "out.onnx"),
                 "--no-progress"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("epoch ")]
    schedule = build.cosine(6)
    shown = [float(ln.split("lr ")[1].split(",")[0].split()[0]) for ln in lines]
    expected = [0.1 * schedule.factor(2 * e + 1) for e in range(4)]
    assert shown == pytest.approx(expected, rel=1e-3, abs=1e-12)
    assert shown[-1] == 0.0
