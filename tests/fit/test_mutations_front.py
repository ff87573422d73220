"""Front-end bugs that slipped past the suite (issue 26, requirement 8).

Each test was checked against the one-line bug it names: planted by hand,
the test fails; reverted, it passes.  Public API only.

- **LoRA init:** A is drawn from uniform(-1/sqrt(in), 1/sqrt(in)); a target
  with ``out < in`` tells ``in`` from ``out``.
- **EarlyStopping min_delta:** an improvement counts only when it is larger
  than ``min_delta``, in "min" and "max" mode.
- **Resume:** a checkpoint written mid-epoch under the algorithm cycle
  [0, 0, 1] (``accumulate=3``) resumes at the right place of the cycle.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import Callback, EarlyStopping, TrainingSession, build

F32 = TensorProto.FLOAT


# ------------------------------------------------------------------ LoRA init
def narrowing_model() -> onnx.ModelProto:
    """X[N,64] -> MatMul W1[64,4] (in 64, out 4) -> Relu -> Gemm(transB=1) with
    W2 stored as [out, in] = [2, 4] (in 4, out 2): both targets have out < in."""
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "W2"], ["Y"], transB=1)], "narrowing",
        [helper.make_tensor_value_info("X", F32, ["N", 64])],
        [helper.make_tensor_value_info("Y", F32, ["N", 2])],
        [numpy_helper.from_array(rng.standard_normal((64, 4)).astype(np.float32), "W1"),
         numpy_helper.from_array(rng.standard_normal((2, 4)).astype(np.float32), "W2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_lora_a_bound_is_one_over_sqrt_of_the_input_features():
    """A of W1 ([in, r] = [64, 16]) within 1/sqrt(64) = 0.125, and filling it
    (its largest |value| above 0.9 of the bound); A of the transposed W2
    ([4, 16]) within 1/sqrt(4) = 0.5.  B is zero.

    Bug caught: ``bound = 1.0 / np.sqrt(n_in)`` written as
    ``bound = 1.0 / np.sqrt(n_out)`` in ``lora.apply``."""
    tm = build.training_model(narrowing_model(), loss="mse",
                              lora=build.LoRA(rank=16, alpha=16, seed=3))
    inits = {t.name: numpy_helper.to_array(t) for t in tm.graph.initializer}
    for weight, n_in, n_out in (("W1", 64, 4), ("W2", 4, 2)):
        a, b = inits[f"{weight}.lora_A"], inits[f"{weight}.lora_B"]
        assert a.shape == (n_in, 16) and b.shape == (16, n_out)
        bound = 1.0 / np.sqrt(n_in)
        largest = float(np.abs(a).max())
        assert 0.9 * bound < largest <= bound, f"{weight}.lora_A: max |A| {largest:.4f}, bound {bound:.4f}"
        assert not b.any()
    # The session starts from the base model's predictions (B = 0).
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    base = TrainingSession(build.training_model(narrowing_model(), loss="mse"))
    np.testing.assert_array_equal(TrainingSession(tm).run({"X": x})["Y"], base.run({"X": x})["Y"])


# ------------------------------------------------------------------ EarlyStopping
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
    X = rng.standard_normal((32, 64)).astype(np.float32)
    y = rng.standard_normal((32, 2)).astype(np.float32)
    sess = TrainingSession(build.training_model(narrowing_model(), loss="mse",
                                                optimizer=build.SGD(lr=0.01)))
    es = EarlyStopping("loss", patience=1, min_delta=100.0)
    history = sess.fit(X, y, epochs=6, batch_size=8, progress=False, callbacks=[es])
    assert history.epochs == [0, 1] and history.stopped_early
    assert history["loss"][1] < history["loss"][0]  # it did improve, by less than min_delta


# ------------------------------------------------------------------ resume
def classifier() -> onnx.ModelProto:
    rng = np.random.default_rng(4)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"])], "classifier",
        [helper.make_tensor_value_info("X", F32, ["N", 4])],
        [helper.make_tensor_value_info("logits", F32, ["N", 3])],
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
