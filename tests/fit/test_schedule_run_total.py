"""Issue 34, item 5: ``--schedule cosine`` alone, and a warning when a schedule has ended.

``build.cosine()`` (``make-training --schedule cosine``) takes its total from
the run: ``fit`` sets it when it starts, to epochs x updates per epoch, and
the rates are then exactly those of ``build.cosine(total)``.  Training on
past a schedule's end with the rate at 0 warns once per run, naming it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from models import gemm_inference

from onnxtrain import TrainingSession, build
from onnxtrain.cli.app import main
from onnxtrain.train.schedule import ScheduleEndedWarning, updates

ROWS, BATCH = 64, 16  # 4 batches per epoch


def model():
    return gemm_inference(4, 3)


def session(schedule, accumulate=1) -> TrainingSession:
    return TrainingSession(build.training_model(model(), optimizer=build.SGD(lr=0.1), schedule=schedule,
                                                accumulate=accumulate))


def data():
    rng = np.random.default_rng(1)
    return rng.standard_normal((ROWS, 4)).astype(np.float32), rng.integers(0, 3, ROWS)


class Rates:
    """The rate of every step (fit's batch logs)."""

    def __init__(self):
        self.rates = []

    def on_batch_end(self, batch, logs):
        self.rates.append(logs["lr"])


def fit(sess, epochs, **kw):
    X, y = data()
    rates = Rates()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess.fit(X, y, epochs=epochs, batch_size=BATCH, shuffle=False, progress=False,
                 callbacks=[rates], **kw)
    ended = [str(w.message) for w in caught if issubclass(w.category, ScheduleEndedWarning)]
    return rates.rates, ended


@pytest.mark.parametrize("warmup", [0, 3])
def test_cosine_alone_spans_the_run(warmup):
    sess = session(build.cosine(warmup=warmup))
    assert sess.schedule_total_steps is None
    rates, ended = fit(sess, epochs=3)
    assert sess.schedule_total_steps == 3 * 4
    explicit, _ = fit(session(build.cosine(12, warmup=warmup)), epochs=3)
    assert rates == explicit  # exactly build.cosine(epochs x steps per epoch)
    assert rates[-1] > 0 and ended == []  # the run ends with the schedule: no warning


def test_the_total_counts_updates_with_accumulation():
    sess = session(build.cosine(), accumulate=2)
    fit(sess, epochs=3)
    assert sess.schedule_total_steps == 6  # 12 batches, one update every 2
    assert updates((0, 1), 12, 1) == 6 and updates((0, 0, 1), 7, 1) == 2


def test_a_checkpoint_keeps_the_total(tmp_path):
    """A resumed run goes on with the total of the run that set it."""
    whole = session(build.cosine())
    rates, _ = fit(whole, epochs=4)
    first = session(build.cosine())
    head, _ = fit(first, epochs=2)
    first.export(tmp_path / "ckpt.onnx", training=True)
    resumed = TrainingSession(tmp_path / "ckpt.onnx")
    assert resumed.schedule_total_steps == 8  # set by the first run: 2 epochs x 4
    tail, ended = fit(resumed, epochs=4)
    assert head != rates[:8]  # a 4-epoch run spans 16 updates, this one 8
    assert head == pytest.approx([0.1 * build.cosine(8).factor(s) for s in range(8)], rel=1e-12)
    assert tail == [0.0] * 8 and len(ended) == 1


def test_initialize_unsets_it_and_it_can_be_set():
    sess = session(build.cosine())
    sess.schedule_total_steps = 20
    rates, _ = fit(sess, epochs=1)
    assert rates == pytest.approx([0.1 * build.cosine(20).factor(s) for s in range(4)], rel=1e-12)
    sess.initialize()
    assert sess.schedule_total_steps is None
    with pytest.raises(ValueError, match="integer >= 1"):
        sess.schedule_total_steps = 0
    with pytest.raises(Exception, match="only build.cosine\\(\\) without a total"):
        session(build.cosine(10)).schedule_total_steps  # noqa: B018


def test_batches_without_a_length_need_the_total():
    sess = session(build.cosine())
    X, y = data()
    batches = ({"x": X[i:i + 16], "target": y[i:i + 16]} for i in range(0, ROWS, 16))
    with pytest.raises(ValueError, match="set sess.schedule_total_steps first"):
        sess.fit(batches, progress=False)
    assert sess.schedule_total_steps is None


@pytest.mark.parametrize("schedule, name", [(build.cosine(6), "cosine:6"),
                                            (build.cosine(6, warmup=2), "cosine:6:2"),
                                            (build.step_decay(5, 0.0), "step_decay:5:0")])
def test_training_past_the_end_warns_once_per_run_naming_the_schedule(schedule, name):
    sess = session(schedule)
    rates, ended = fit(sess, epochs=3)
    assert 0.0 in rates
    assert len(ended) == 1, ended
    assert f"schedule {name} has ended" in ended[0] and "\n" not in ended[0]
    at = rates.index(0.0)
    assert f"from epoch {at // 4 + 1}, batch {at % 4 + 1} on" in ended[0]
    _, again = fit(sess, epochs=3, initial_epoch=0)
    assert len(again) == 1  # once per run


def test_no_warning_while_the_rate_is_not_zero():
    _, ended = fit(session(build.cosine(100)), epochs=3)
    assert ended == []


def test_the_cli_trains_with_cosine_alone_and_warns_in_one_line(tmp_path, capsys):
    import onnx

    onnx.save(model(), str(tmp_path / "m.onnx"))
    X, y = data()
    np.savez(tmp_path / "d.npz", X=X, y=y)
    assert main(["make-training", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx"),
                 "--schedule", "cosine", "--optimizer", "sgd", "--lr", "0.1"]) == 0
    args = ["train", str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--batch-size",
            "16", "-o", str(tmp_path / "o.onnx"), "--checkpoint", str(tmp_path / "c.onnx"),
            "--no-progress"]
    capsys.readouterr()
    assert main(args + ["--epochs", "2"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "lr 0.00" in out.splitlines()[1]  # the second epoch ends near 0
    assert main(args + ["--epochs", "4", "--resume", str(tmp_path / "c.onnx")]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1
    assert err.startswith("onnxtrain: warning: fit: the learning-rate schedule cosine, over the 8 "
                          "updates of the run that set it, has ended: the rate is 0 from epoch 3")
