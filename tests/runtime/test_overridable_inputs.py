"""Inputs with a default: a graph input that also has an initializer (IR >= 4).

Unfed, the initializer is used; fed, the feed wins, for this call only.
Such an input is no state variable unless a binding names it.  Everything
that reads it (the main graph, the algorithm, the Gradient) reads the value
in effect: a gradient with respect to it is the derivative at the fed value
(docs/compatibility.md).  Checked for ``run``, ``train_step``, ``fit``,
export, resume and the data-parallel cut against float64 numpy; the real
two-rank run is in tests/distributed/test_mpi.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from models import F32, PREVIEW, model, overridable_regression, tensor, training_info, vi
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession

RNG = np.random.default_rng(7)
X = RNG.standard_normal((6, 3))
T = RNG.standard_normal((6, 2))


def reference_step(w: np.ndarray, x: np.ndarray, t: np.ndarray, scale: float, lr: float):
    """float64: (loss, d_scale, W_new) of overridable_regression's algorithm."""
    xw = x @ w
    diff = xw * scale - t
    dy = 2 * diff / diff.size  # d mean(diff^2) / dY
    return (diff * diff).mean(), (dy * xw).sum(), w - lr * (x.T @ (dy * scale))


def default_w() -> np.ndarray:
    return numpy_helper.to_array(overridable_regression().graph.initializer[0])


#: (scale fed or None, lr fed or None) per step: fed, unfed, only one, unfed again.
STEPS = [(None, None), (3.0, 0.125), (None, None), (None, 0.25), (-1.0, None), (None, None)]


def feeds_of(x, t, scale, lr) -> dict:
    feeds = {"X": x, "T": t}
    if scale is not None:
        feeds["scale"] = np.float64(scale)
    if lr is not None:
        feeds["lr"] = np.array(lr)
    return feeds


def check_steps(sess: TrainingSession) -> None:
    w = default_w()
    for scale, lr in STEPS:
        out = sess.train_step(feeds_of(X, T, scale, lr))
        loss, d_scale, w = reference_step(w, X, T, 2.0 if scale is None else scale,
                                          0.5 if lr is None else lr)
        np.testing.assert_allclose(out["loss"], loss, rtol=1e-12)
        np.testing.assert_allclose(out["d_scale"], d_scale, rtol=1e-12)
        np.testing.assert_allclose(sess.state["W"], w, rtol=1e-12)
    assert list(sess.state) == ["W"]  # scale and lr are no state variables


def test_train_step_uses_the_feed_when_given_and_the_default_otherwise():
    check_steps(TrainingSession(overridable_regression()))


def test_the_data_parallel_cut_feeds_the_update_its_inputs_with_a_default():
    # memory="lean" runs the data-parallel cut with a world of one: the update
    # program (B) reads lr, which must be the feed when there is one.
    check_steps(TrainingSession(overridable_regression(), memory="lean"))


def test_run_uses_the_default_again_after_a_fed_call():
    sess = TrainingSession(overridable_regression())
    w = default_w()
    for scale in (None, 3.0, None, 0.5, 0.5, None):
        feeds = {"X": X} if scale is None else {"X": X, "scale": np.float64(scale)}
        expected = X @ w * (2.0 if scale is None else scale)
        np.testing.assert_allclose(sess.run(feeds)["Y"], expected, rtol=1e-12)
    assert set(sess.inference_inputs) == {"X"}  # the required ones


def test_programs_keep_the_inputs_and_their_defaults():
    sess = TrainingSession(overridable_regression())
    for label, program in sess.programs().items():
        inputs = {i.name for i in program.graph.input}
        defaults = {t.name: float(numpy_helper.to_array(t)) for t in program.graph.initializer}
        assert {"scale": 2.0}.items() <= defaults.items() and "scale" in inputs, label
        if label != "inference":
            assert defaults["lr"] == 0.5 and "lr" in inputs, label
            # (a constant 0.5 would fold into the weight gradient's Gemm as alpha=-0.5)
            assert all(a.name != "alpha" for n in program.graph.node for a in n.attribute), label


def test_fit_feeds_them_from_the_batches():
    batches = [{"X": X[:3], "T": T[:3], "scale": np.float64(3.0)},
               {"X": X[3:], "T": T[3:]},
               {"X": X[:4], "T": T[:4], "lr": np.float64(0.125)}]
    sess = TrainingSession(overridable_regression())
    history = sess.fit(batches, epochs=2, progress=False)
    w = default_w()
    losses = []
    for _ in range(2):
        for b in batches:
            loss, _, w = reference_step(w, b["X"], b["T"], float(b.get("scale", 2.0)),
                                        float(b.get("lr", 0.5)))
            losses.append(loss)
    np.testing.assert_allclose(sess.state["W"], w, rtol=1e-12)
    rows = [3, 3, 4]  # an epoch's loss: the mean over its rows
    epoch_means = [np.average(losses[:3], weights=rows), np.average(losses[3:], weights=rows)]
    np.testing.assert_allclose(history["loss"], epoch_means, rtol=1e-12)
    for scale in (None, 3.0):  # evaluate: the same forward pass, the state unchanged
        batch = {"X": X, "T": T} if scale is None else {"X": X, "T": T, "scale": np.float64(scale)}
        loss = reference_step(w, X, T, scale or 2.0, 0.5)[0]
        np.testing.assert_allclose(sess.evaluate([batch])["loss"], loss, rtol=1e-12)
    np.testing.assert_allclose(sess.state["W"], w, rtol=1e-12)


def test_export_keeps_the_input_with_its_default(tmp_path):
    sess = TrainingSession(overridable_regression())
    sess.train_step({"X": X, "T": T, "scale": np.float64(5.0)})
    path = sess.export(tmp_path / "inference.onnx")
    exported = onnx.load(path)
    assert [i.name for i in exported.graph.input] == ["X", "scale"]
    assert float(numpy_helper.to_array(next(t for t in exported.graph.initializer
                                            if t.name == "scale"))) == 2.0
    ort_sess = ort.InferenceSession(str(path))
    w = sess.state["W"]
    np.testing.assert_allclose(ort_sess.run(None, {"X": X})[0], X @ w * 2.0, rtol=1e-12)
    np.testing.assert_allclose(ort_sess.run(None, {"X": X, "scale": np.array(4.0)})[0], X @ w * 4.0,
                               rtol=1e-12)


def test_a_resumed_checkpoint_keeps_them_overridable(tmp_path):
    sess = TrainingSession(overridable_regression())
    sess.train_step({"X": X, "T": T, "lr": np.array(0.125)})
    resumed = TrainingSession(sess.export(tmp_path / "ckpt.onnx", training=True))
    np.testing.assert_array_equal(resumed.state["W"], sess.state["W"])
    w = sess.state["W"]
    for scale, lr in STEPS:
        out = resumed.train_step(feeds_of(X, T, scale, lr))
        loss, _, w = reference_step(w, X, T, 2.0 if scale is None else scale,
                                    0.5 if lr is None else lr)
        np.testing.assert_allclose(out["loss"], loss, rtol=1e-12)
    np.testing.assert_allclose(resumed.state["W"], w, rtol=1e-12)
    np.testing.assert_allclose(resumed.run({"X": X, "scale": np.float64(3.0)})["Y"], X @ w * 3.0,
                               rtol=1e-12)


def test_a_fed_training_mode_reaches_the_gradient():
    """Dropout's training_mode with a default of False, fed True: the forward
    pass drops, so the gradient must go through the same mask (a rule that
    took the default for a constant would pass dy straight through)."""
    ratio = 0.5
    main = [helper.make_node("Mul", ["X", "W"], ["XW"]),
            helper.make_node("Dropout", ["XW", "ratio", "training_mode"], ["Y", "mask"], seed=3)]
    algo = [helper.make_node("Mul", ["Y", "T"], ["YT"]),
            helper.make_node("ReduceSum", ["YT"], ["loss"], keepdims=0),
            helper.make_node("Gradient", ["W", "X", "T"], ["d_W"], domain=PREVIEW, xs=["W"],
                             zs=["X", "T"], y="loss"),
            helper.make_node("Sub", ["W", "d_W"], ["W_new"])]
    info = training_info(algo, [], [vi("T", F32, ["N", 4])],
                         [vi("loss", F32, []), vi("d_W", F32, [4]), vi("W_new", F32, [4])],
                         [("W", "W_new")])
    m = model(main, [vi("X", F32, ["N", 4]), vi("training_mode", TensorProto.BOOL, [])],
              [vi("Y", F32, ["N", 4]), vi("mask", TensorProto.BOOL, ["N", 4])],
              [tensor("W", np.ones(4, np.float32)), tensor("ratio", np.float32(ratio)),
               tensor("training_mode", np.bool_(False))], [info])
    sess = TrainingSession(m)
    x = RNG.standard_normal((64, 4)).astype(np.float32)
    t = RNG.standard_normal((64, 4)).astype(np.float32)
    off = sess.train_step({"X": x, "T": t})
    assert off["mask"].all()
    np.testing.assert_allclose(off["d_W"], (x * t).sum(0), rtol=1e-5, atol=1e-6 * np.abs(x * t).sum(0).max())
    on = sess.train_step({"X": x, "T": t, "training_mode": np.bool_(True)})
    mask = on["mask"]
    assert 0 < mask.mean() < 1
    terms = x.astype(np.float64) * t * mask / (1 - ratio)
    # float32 sums of 64 terms: an entry that cancels to near 0 keeps the terms' rounding
    np.testing.assert_allclose(on["d_W"], terms.sum(0), rtol=1e-5, atol=1e-6 * np.abs(terms).sum(0).max())


@pytest.mark.parametrize("fed", ["scale", "lr"])
def test_a_wrong_feed_is_refused_and_changes_nothing(fed):
    sess = TrainingSession(overridable_regression())
    before = sess.state["W"]
    with pytest.raises(ValueError, match=f"feed '{fed}' has dtype float32"):
        sess.train_step({"X": X, "T": T, fed: np.array(1, np.float32)})
    np.testing.assert_array_equal(sess.state["W"], before)
