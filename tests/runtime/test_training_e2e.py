"""End to end: training models built with onnx.helper train exactly like numpy.

The models (tests/models.py) hold loss -> Gradient -> optimizer -> step counter
in their algorithm graphs.  The oracle computes the same forward pass, the
analytic gradients and the spec's optimizer pseudo-code in numpy."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from models import OPTIMIZER_STATE, linear_regression, mlp_classifier

from onnxtrain import TrainingSession
from onnxtrain.optim import reference

OPTIMIZERS = ["sgd", "momentum", "nesterov", "adam", "adagrad"]
ATTRS = {
    "momentum": dict(alpha=0.9, beta=1.0, mode="standard", norm_coefficient=0.0),
    "nesterov": dict(alpha=0.9, beta=1.0, mode="nesterov", norm_coefficient=0.001),
    "adagrad": dict(epsilon=1e-6, decay_factor=0.1, norm_coefficient=0.0),
    "adam": dict(alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0),
}


class NumpyTrainer:
    """Parameters plus optimizer state, updated with the spec's pseudo-code."""

    def __init__(self, params, optimizer, lr, groups=None):
        self.p = {k: v.astype(np.float64) for k, v in params.items()}
        self.optimizer, self.lr = optimizer, lr
        self.groups = groups or [list(params)]
        self.state = {k: {p: np.zeros_like(v) for p, v in self.p.items()}
                      for k in OPTIMIZER_STATE[optimizer]}
        self.steps = [0] * len(self.groups)

    def apply(self, grads, group_index=0):
        names = self.groups[group_index]
        t = self.steps[group_index]
        xs, gs = [self.p[n] for n in names], [grads[n] for n in names]
        if self.optimizer == "sgd":
            new = [x - self.lr * g for x, g in zip(xs, gs)]
        elif self.optimizer in ("momentum", "nesterov"):
            new, vs = reference.momentum(self.lr, t, xs, gs, [self.state["v"][n] for n in names],
                                         **ATTRS[self.optimizer])
            self.state["v"].update(zip(names, vs))
        elif self.optimizer == "adagrad":
            new, hs = reference.adagrad(self.lr, t, xs, gs, [self.state["h"][n] for n in names],
                                        **ATTRS["adagrad"])
            self.state["h"].update(zip(names, hs))
        else:
            new, vs, hs = reference.adam(self.lr, t, xs, gs, [self.state["v"][n] for n in names],
                                         [self.state["h"][n] for n in names], **ATTRS["adam"])
            self.state["v"].update(zip(names, vs))
            self.state["h"].update(zip(names, hs))
        self.p.update(zip(names, new))
        self.steps[group_index] += 1


def linreg_loss_and_grads(p, x, t):
    diff = x @ p["W"] + p["B"] - t
    n = diff.size
    return np.mean(diff**2), {"W": 2 * x.T @ diff / n, "B": 2 * diff.sum(axis=0) / n}


def mlp_loss_and_grads(p, x, labels):
    h_pre = x @ p["W1"] + p["b1"]
    h = np.maximum(h_pre, 0)
    logits = h @ p["W2"] + p["b2"]
    z = logits - logits.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n = len(labels)
    loss = -np.mean(np.log(prob[np.arange(n), labels]))
    d_logits = prob.copy()
    d_logits[np.arange(n), labels] -= 1
    d_logits /= n
    d_h = d_logits @ p["W2"].T * (h_pre > 0)
    return loss, {"W2": h.T @ d_logits, "b2": d_logits.sum(0), "W1": x.T @ d_h, "b1": d_h.sum(0)}


def regression_data(seed=1, n=16, n_in=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    t = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype(np.float32)
    return x, t


def blobs(seed=2, n=24):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    centers = np.array([[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0]], np.float32)
    x = (centers[labels] + rng.standard_normal((n, 4)) * 0.5).astype(np.float32)
    return x, labels.astype(np.int64)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_linear_regression_matches_numpy(optimizer):
    m = linear_regression(optimizer, lr=0.05)
    sess = TrainingSession(m)
    oracle = NumpyTrainer({k: sess.state[k] for k in ("W", "B")}, optimizer, 0.05)
    x, t = regression_data()
    losses, expected = [], []
    for _ in range(15):
        loss, grads = linreg_loss_and_grads(oracle.p, x.astype(np.float64), t.astype(np.float64))
        expected.append(loss)
        oracle.apply(grads)
        losses.append(float(sess.train_step({"X": x, "T": t})["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    for k in ("W", "B"):
        np.testing.assert_allclose(sess.state[k], oracle.p[k], rtol=1e-4, atol=1e-6)
    assert losses[-1] < losses[0]
    assert sess.state["step0"] == 15


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_mlp_classifier_matches_numpy(optimizer):
    lr = 0.01 if optimizer == "adam" else 0.1
    m = mlp_classifier(optimizer, lr=lr)
    sess = TrainingSession(m)
    oracle = NumpyTrainer({k: sess.state[k] for k in ("W1", "b1", "W2", "b2")}, optimizer, lr)
    x, labels = blobs()
    losses, expected = [], []
    for _ in range(12):
        loss, grads = mlp_loss_and_grads(oracle.p, x.astype(np.float64), labels)
        expected.append(loss)
        oracle.apply(grads)
        out = sess.train_step({"X": x, "label": labels})
        losses.append(float(out["loss"]))
        assert set(out) == {"loss", "logits"}
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert losses[-1] < losses[0]


def test_initialize_resets_training():
    sess = TrainingSession(mlp_classifier("adam", lr=0.01))
    start = dict(sess.state)
    x, labels = blobs()
    first = [float(sess.train_step({"X": x, "label": labels})["loss"]) for _ in range(3)]
    assert any(not np.array_equal(sess.state[k], start[k]) for k in start)
    sess.initialize()
    for k, v in start.items():
        np.testing.assert_array_equal(sess.state[k], v)
    again = [float(sess.train_step({"X": x, "label": labels})["loss"]) for _ in range(3)]
    assert again == first


def test_two_training_infos_interleave_block_coordinate_descent():
    groups = [["W1", "b1"], ["W2", "b2"]]
    sess = TrainingSession(mlp_classifier("momentum", lr=0.1, groups=groups))
    oracle = NumpyTrainer({k: sess.state[k] for k in ("W1", "b1", "W2", "b2")}, "momentum", 0.1, groups)
    x, labels = blobs()
    feeds = {"X": x, "label": labels}
    schedule = [0, 1, 1, 0, None, 0, None]
    for algo in schedule:
        for gi in ([0, 1] if algo is None else [algo]):
            _, grads = mlp_loss_and_grads(oracle.p, x.astype(np.float64), labels)
            oracle.apply(grads, gi)
        sess.train_step(feeds, algorithm=algo)
    for k in ("W1", "b1", "W2", "b2"):
        np.testing.assert_allclose(sess.state[k], oracle.p[k], rtol=1e-4, atol=1e-6)
    assert sess.state["step0"] == 5 and sess.state["step1"] == 4


def test_float64_model_trains_in_float64():
    sess = TrainingSession(linear_regression("adam", dtype=np.float64))
    x, t = regression_data()
    out = sess.train_step({"X": x.astype(np.float64), "T": t.astype(np.float64)})
    assert out["loss"].dtype == np.float64 and sess.state["W"].dtype == np.float64
    assert sess.state["W_v"].dtype == np.float64 and sess.state["step0"].dtype == np.int64


def test_inference_export_predicts_the_same_in_plain_onnxruntime(tmp_path):
    sess = TrainingSession(mlp_classifier("adam", lr=0.01))
    x, labels = blobs()
    for _ in range(5):
        sess.train_step({"X": x, "label": labels})
    path = sess.export(tmp_path / "inference.onnx")
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = plain.run(["logits"], {"X": x})
    np.testing.assert_array_equal(logits, sess.run({"X": x})["logits"])
    import onnx

    exported = onnx.load(str(path))
    assert not exported.training_info
    from onnxtrain.runtime.executor import MAX_IR_VERSION  # probed: the newest IR this onnxruntime loads

    assert exported.ir_version <= MAX_IR_VERSION
    onnx.checker.check_model(exported)


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_training_export_resumes_identically(tmp_path, optimizer):
    x, labels = blobs()
    feeds = {"X": x, "label": labels}
    straight = TrainingSession(mlp_classifier(optimizer, lr=0.05))
    resumed = TrainingSession(mlp_classifier(optimizer, lr=0.05))
    for _ in range(4):
        straight.train_step(feeds)
        resumed.train_step(feeds)
    ckpt = resumed.export(tmp_path / "ckpt.onnx", training=True)
    resumed = TrainingSession(ckpt)
    for _ in range(4):
        a = straight.train_step(feeds)["loss"]
        b = resumed.train_step(feeds)["loss"]
        assert a == b
    assert set(straight.state) == set(resumed.state)
    for k in straight.state:
        np.testing.assert_array_equal(straight.state[k], resumed.state[k])
    assert resumed.state["step0"] == 8


def test_failed_step_leaves_state_exactly_as_it_was():
    sess = TrainingSession(mlp_classifier("adam", lr=0.01))
    x, labels = blobs()
    sess.train_step({"X": x, "label": labels})
    before = dict(sess.state)
    bad_labels = labels.copy()
    bad_labels[0] = 99  # out of range: onnxruntime fails inside the run
    with pytest.raises(Exception):
        sess.train_step({"X": x, "label": bad_labels})
    with pytest.raises(ValueError, match="label"):
        sess.train_step({"X": x, "label": labels.astype(np.int32)})
    for k, v in before.items():
        np.testing.assert_array_equal(sess.state[k], v)


@pytest.mark.parametrize("opset", [9, 11, 12, 13, 15, 18, 21, 26])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_models_of_every_opset_train(opset, optimizer):
    """Emitted ops must be valid in the model's own opset (9 to the newest onnxruntime runs)."""
    sess = TrainingSession(linear_regression(optimizer, opset=opset))
    oracle = NumpyTrainer({k: sess.state[k] for k in ("W", "B")}, optimizer, 0.05)
    x, t = regression_data()
    for _ in range(5):
        loss, grads = linreg_loss_and_grads(oracle.p, x.astype(np.float64), t.astype(np.float64))
        oracle.apply(grads)
        got = float(sess.train_step({"X": x, "T": t})["loss"])
        np.testing.assert_allclose(got, loss, rtol=1e-4)
    for name, program in sess.programs().items():
        assert {o.version for o in program.opset_import if o.domain in ("", "ai.onnx")} == {opset}, name
        onnx_checker(program)


def onnx_checker(program):
    import onnx

    onnx.checker.check_model(program, full_check=True)


def test_programs_are_compiled_once(monkeypatch):
    import onnxtrain.runtime.runner as session_module

    created = []
    real = session_module.Executor

    def counting(*args, **kwargs):
        created.append(kwargs.get("label", args[-1] if args else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "Executor", counting)
    sess = TrainingSession(linear_regression("adam"))
    x, t = regression_data()
    for _ in range(5):
        sess.train_step({"X": x, "T": t})
        sess.run({"X": x})
    sess.initialize()
    sess.initialize()
    assert len(created) == 3  # algorithm, inference, initialization: once each


def test_batch_size_may_change_between_steps_and_runs():
    sess = TrainingSession(mlp_classifier("adam", lr=0.01))
    x, labels = blobs(n=24)
    for n in (8, 8, 6, 24, 1):
        out = sess.train_step({"X": x[:n], "label": labels[:n]})
        assert out["logits"].shape == (n, 3)
        assert sess.run({"X": x[:n]})["logits"].shape == (n, 3)


def test_sgd_updates_fuse_into_the_weight_gradient_gemm():
    """W - lr * Gemm(h, dZ) becomes one Gemm with C=W (no extra pass over W)."""
    sess = TrainingSession(mlp_classifier("sgd", lr=0.1))
    program = sess.programs()["training_info[0].algorithm"]
    fused = [n for n in program.graph.node if n.op_type == "Gemm" and len(n.input) == 3
             and n.input[2] in ("W1", "W2")]
    assert sorted(n.input[2] for n in fused) == ["W1", "W2"]


def test_no_fusion_when_float32_attributes_would_round_a_float64_step():
    sess = TrainingSession(linear_regression("sgd", lr=0.05, dtype=np.float64))
    program = sess.programs()["training_info[0].algorithm"]
    assert not [n for n in program.graph.node if "fused_update" in n.name]
