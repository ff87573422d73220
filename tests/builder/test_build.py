"""build.training_model: inference model in, standard training model out.

The oracle is numpy: the forward and backward pass of a small MLP written by
hand, and a transcription of PyTorch's documented update rules
(torch.optim.SGD / Adam / AdamW / Adagrad, LambdaLR-style schedules,
torch.nn.utils.clip_grad_norm_) and loss definitions.  tests/builder/test_build_torch.py
checks the same trajectories against torch itself."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.autodiff.registry import REGISTRY
from onnxtrain.io.model import combined_graph

F32, F64 = TensorProto.FLOAT, TensorProto.DOUBLE
STEPS = 50


# ------------------------------------------------------------------ models
def mlp(sizes=(4, 8, 3), dtype=np.float32, seed=0, opset=17, batch_norm=False, dropout=False):
    """Inference MLP: X -> Gemm -> [BatchNormalization] -> Relu -> [Dropout] -> Gemm -> logits."""
    rng = np.random.default_rng(seed)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    n_in, n_hidden, n_out = sizes
    params = {
        "W1": rng.standard_normal((n_in, n_hidden)) / np.sqrt(n_in),
        "b1": rng.standard_normal(n_hidden) * 0.1,
        "W2": rng.standard_normal((n_hidden, n_out)) / np.sqrt(n_hidden),
        "b2": rng.standard_normal(n_out) * 0.1,
    }
    nodes = [helper.make_node("Gemm", ["X", "W1", "b1"], ["h_pre"], name="fc1")]
    h = "h_pre"
    if batch_norm:
        params.update(bn_scale=1 + 0.1 * rng.standard_normal(n_hidden), bn_bias=0.1 * rng.standard_normal(n_hidden),
                      bn_mean=np.zeros(n_hidden), bn_var=np.ones(n_hidden))
        nodes.append(helper.make_node("BatchNormalization", ["h_pre", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
                                      ["h_bn"], name="bn", momentum=0.9, epsilon=1e-5))
        h = "h_bn"
    nodes.append(helper.make_node("Relu", [h], ["h"], name="relu"))
    h = "h"
    if dropout:
        nodes.append(helper.make_node("Dropout", ["h"], ["h_drop"], name="drop"))
        h = "h_drop"
    nodes.append(helper.make_node("Gemm", [h, "W2", "b2"], ["logits"], name="fc2"))
    inits = [numpy_helper.from_array(np.asarray(v, dtype=dtype), k) for k, v in params.items()]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", et, ["N", n_in])],
                              [helper.make_tensor_value_info("logits", et, ["N", n_out])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def affine(n_in=3, n_out=2, dtype=np.float64, seed=0, head=None):
    """pred = X W + b  (optionally followed by LogSoftmax along axis 1)."""
    rng = np.random.default_rng(seed)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("Gemm", ["X", "W", "b"], ["pred" if head is None else "z"])]
    if head == "log_softmax":
        nodes.append(helper.make_node("LogSoftmax", ["z"], ["pred"], axis=1))
    inits = [numpy_helper.from_array(rng.standard_normal((n_in, n_out)).astype(dtype), "W"),
             numpy_helper.from_array((0.1 * rng.standard_normal(n_out)).astype(dtype), "b")]
    graph = helper.make_graph(nodes, "affine", [helper.make_tensor_value_info("X", et, ["N", n_in])],
                              [helper.make_tensor_value_info("pred", et, ["N", n_out])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def blobs(seed=2, n=24, dtype=np.float32):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    centers = np.array([[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0]], np.float64)
    x = centers[labels] + rng.standard_normal((n, 4)) * 0.7
    return x.astype(dtype), labels.astype(np.int64)


def initial_params(model):
    return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}


# ------------------------------------------------------------------ numpy oracle: MLP
def mlp_forward(p, x):
    h_pre = x @ p["W1"] + p["b1"]
    h = np.maximum(h_pre, 0)
    return h_pre, h, h @ p["W2"] + p["b2"]


def cross_entropy_and_grad(logits, labels):
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    n = len(labels)
    d = np.exp(logp)
    d[np.arange(n), labels] -= 1
    return -logp[np.arange(n), labels].mean(), d / n


def mlp_loss_and_grads(p, x, labels):
    h_pre, h, logits = mlp_forward(p, x)
    loss, d_logits = cross_entropy_and_grad(logits, labels)
    d_h = d_logits @ p["W2"].T * (h_pre > 0)
    return loss, {"W1": x.T @ d_h, "b1": d_h.sum(0), "W2": h.T @ d_logits, "b2": d_logits.sum(0)}


# ------------------------------------------------------------------ numpy oracle: torch's rules
class TorchRule:
    """One torch.optim optimizer transcribed from its documented algorithm (float64).

    ``step(params, grads, lr)`` updates params in place; ``lr`` is this step's
    learning rate (a scheduler having set the group's lr)."""

    def __init__(self, kind, **hp):
        self.kind, self.hp, self.state, self.t = kind, hp, {}, 0

    def step(self, p, grads, lr):
        self.t += 1
        hp, t = self.hp, self.t
        for name, g in grads.items():
            s = self.state.setdefault(name, {})
            wd = hp.get("weight_decay", 0.0)
            if self.kind == "sgd":
                g = g + wd * p[name]
                if hp.get("momentum", 0.0):
                    buf = g.copy() if "buf" not in s else hp["momentum"] * s["buf"] + g
                    s["buf"] = buf
                    g = g + hp["momentum"] * buf if hp.get("nesterov") else buf
                p[name] = p[name] - lr * g
            elif self.kind == "adagrad":
                s.setdefault("sum", np.full_like(p[name], hp.get("initial_accumulator_value", 0.0)))
                clr = lr / (1 + (t - 1) * hp.get("lr_decay", 0.0))
                g = g + wd * p[name]
                s["sum"] = s["sum"] + g * g
                p[name] = p[name] - clr * g / (np.sqrt(s["sum"]) + hp.get("eps", 1e-10))
            else:  # adam / adamw
                b1, b2 = hp.get("betas", (0.9, 0.999))
                if self.kind == "adamw":
                    p[name] = p[name] * (1 - lr * wd)
                else:
                    g = g + wd * p[name]
                m = s["m"] = b1 * s.get("m", 0.0) + (1 - b1) * g
                v = s["v"] = b2 * s.get("v", 0.0) + (1 - b2) * g * g
                denom = np.sqrt(v) / math.sqrt(1 - b2**t) + hp.get("eps", 1e-8)
                p[name] = p[name] - lr / (1 - b1**t) * m / denom


def clip_grads(grads, max_norm):
    """torch.nn.utils.clip_grad_norm_."""
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    coef = min(1.0, max_norm / (norm + 1e-6))
    return {k: g * coef for k, g in grads.items()}


OPTIMIZERS = {
    "sgd": (build.SGD(lr=0.1), TorchRule("sgd")),
    "sgd_wd": (build.SGD(lr=0.1, weight_decay=0.01), TorchRule("sgd", weight_decay=0.01)),
    "momentum": (build.SGD(lr=0.05, momentum=0.9), TorchRule("sgd", momentum=0.9)),
    "nesterov_wd": (build.SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3),
                    TorchRule("sgd", momentum=0.8, nesterov=True, weight_decay=1e-3)),
    "adagrad": (build.Adagrad(lr=0.1, lr_decay=0.01, weight_decay=1e-3, initial_accumulator_value=0.1),
                TorchRule("adagrad", lr_decay=0.01, weight_decay=1e-3, initial_accumulator_value=0.1)),
    "adam": (build.Adam(lr=0.01), TorchRule("adam")),
    "adam_wd": (build.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
                TorchRule("adam", betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)),
    "adamw": (build.AdamW(lr=0.01, weight_decay=0.1), TorchRule("adamw", weight_decay=0.1)),
}
LR = {"sgd": 0.1, "sgd_wd": 0.1, "momentum": 0.05, "nesterov_wd": 0.05, "adagrad": 0.1,
      "adam": 0.01, "adam_wd": 0.01, "adamw": 0.01}


def run_oracle(params, rule, lr, x, labels, steps, schedule=None, clip=None):
    """Params after each step (list of dicts) following torch's rules."""
    p = {k: v.copy() for k, v in params.items()}
    out = []
    for s in range(steps):
        _, grads = mlp_loss_and_grads(p, x.astype(np.float64), labels)
        if clip is not None:
            grads = clip_grads(grads, clip)
        rule.step(p, grads, lr * (schedule.factor(s) if schedule else 1.0))
        out.append({k: v.copy() for k, v in p.items()})
    return out


def run_session(model, x, labels, steps, names=("W1", "b1", "W2", "b2")):
    sess = TrainingSession(model)
    out = []
    for _ in range(steps):
        sess.train_step({"X": x, "target": labels}, fetch=False)
        out.append({k: sess.state[k].astype(np.float64) for k in names})
    return sess, out


def assert_trajectories_close(got, expected, rtol=1e-4, atol=1e-6):
    for step, (g, e) in enumerate(zip(got, expected)):
        for k in e:
            np.testing.assert_allclose(g[k], e[k], rtol=rtol, atol=atol, err_msg=f"step {step}, {k}")


# ------------------------------------------------------------------ optimizers
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_trajectory_matches_torch_rule(name):
    optimizer, rule = OPTIMIZERS[name]
    model = mlp()
    x, labels = blobs()
    tm = build.training_model(model, loss="cross_entropy", optimizer=optimizer)
    expected = run_oracle(initial_params(model), rule, LR[name], x, labels, STEPS)
    sess, got = run_session(tm, x, labels, STEPS)
    assert_trajectories_close(got, expected)
    assert sess.state["step"] == STEPS


def test_optimizer_uses_spec_ops_where_they_match():
    ops = {}
    for name, opt in [("sgd", build.SGD(0.1)), ("momentum", build.SGD(0.1, momentum=0.9)),
                      ("adagrad", build.Adagrad(0.1)), ("adam", build.Adam(0.1)), ("adamw", build.AdamW(0.1))]:
        tm = build.training_model(mlp(), optimizer=opt)
        ops[name] = sorted({n.op_type for n in tm.training_info[0].algorithm.node if n.domain})
    assert ops == {"sgd": ["Gradient"], "momentum": ["Gradient", "Momentum"], "adagrad": ["Adagrad", "Gradient"],
                   "adam": ["Gradient"], "adamw": ["Gradient"]}


@pytest.mark.parametrize("optimizer,rule,lr,spec_op", [
    (build.SGD(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
     TorchRule("sgd", momentum=0.9, nesterov=True, weight_decay=1e-3), 0.05, None),
    (build.SGD(0.05, momentum=0.5), TorchRule("sgd", momentum=0.5), 0.05, "Momentum"),
    (build.Adagrad(0.1, lr_decay=0.01), TorchRule("adagrad", lr_decay=0.01), 0.1, None),
    (build.Adagrad(0.1, eps=0.25), TorchRule("adagrad", eps=0.25), 0.1, "Adagrad"),
])
def test_float64_spec_ops_only_where_exact(optimizer, rule, lr, spec_op):
    """float32 attributes cannot hold 0.9 or 0.01: float64 models then get arithmetic."""
    model = mlp(dtype=np.float64)
    x, labels = blobs(dtype=np.float64)
    tm = build.training_model(model, optimizer=optimizer)
    spec = [n.op_type for n in tm.training_info[0].algorithm.node if n.domain and n.op_type != "Gradient"]
    assert spec == ([spec_op] if spec_op else [])
    expected = run_oracle(initial_params(model), rule, lr, x, labels, STEPS)
    _, got = run_session(tm, x, labels, STEPS)
    assert_trajectories_close(got, expected, rtol=1e-9, atol=1e-12)


def test_float64_model_trains_in_float64():
    model = mlp(dtype=np.float64)
    x, labels = blobs(dtype=np.float64)
    tm = build.training_model(model, optimizer=build.Adam(lr=0.01))
    expected = run_oracle(initial_params(model), TorchRule("adam"), 0.01, x, labels, 20)
    sess, got = run_session(tm, x, labels, 20)
    assert sess.state["W1"].dtype == np.float64
    assert_trajectories_close(got, expected, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ losses
def numeric_grad(f, w, h=1e-6):
    g = np.zeros_like(w)
    for i in np.ndindex(w.shape):
        up, down = w.copy(), w.copy()
        up[i] += h
        down[i] -= h
        g[i] = (f(up) - f(down)) / (2 * h)
    return g


def log_softmax(z, axis=1):
    z = z - z.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


def ref_cross_entropy(z, t, weight=None, eps=0.0):
    """torch.nn.functional.cross_entropy(z, t, weight, label_smoothing=eps), class axis 1."""
    logp = np.moveaxis(log_softmax(z, 1), 1, -1).reshape(-1, z.shape[1])
    t = t.reshape(-1)
    w = np.ones(z.shape[1]) if weight is None else np.asarray(weight, np.float64)
    picked = logp[np.arange(len(t)), t]
    total = w[t].sum()
    nll = -(w[t] * picked).sum() / total
    smooth = -(logp * w).sum() / total
    return (1 - eps) * nll + eps / z.shape[1] * smooth


def ref_nll(logp, t, weight=None):
    w = np.ones(logp.shape[1]) if weight is None else np.asarray(weight, np.float64)
    return -(w[t] * logp[np.arange(len(t)), t]).sum() / w[t].sum()


def ref_bce_with_logits(x, t, pos_weight=None):
    pw = 1.0 if pos_weight is None else np.asarray(pos_weight)
    log_sig = -np.logaddexp(0, -x)
    log_one_minus = -np.logaddexp(0, x)
    return np.mean(-(pw * t * log_sig + (1 - t) * log_one_minus))


def ref_huber(d, delta):
    a = np.abs(d)
    return np.mean(np.where(a < delta, 0.5 * d * d, delta * (a - 0.5 * delta)))


REGRESSION_LOSSES = {
    "mse": (lambda p, t: np.mean((p - t) ** 2), "mse"),
    "l1": (lambda p, t: np.mean(np.abs(p - t)), "l1"),
    "huber": (lambda p, t: ref_huber(p - t, 1.0), "huber"),
    "huber_0.3": (lambda p, t: ref_huber(p - t, 0.3), build.Huber(delta=0.3)),
    "bce": (ref_bce_with_logits, "bce_with_logits"),
    "bce_pos_weight": (lambda p, t: ref_bce_with_logits(p, t, [2.0, 0.5]), build.BCEWithLogits(pos_weight=[2.0, 0.5])),
    "bce_large_logits": (lambda p, t: ref_bce_with_logits(30 * p, t), build.BCEWithLogits()),
}
CLASS_LOSSES = {
    "cross_entropy": (ref_cross_entropy, "cross_entropy"),
    "ce_smoothing": (lambda z, t: ref_cross_entropy(z, t, eps=0.2), build.CrossEntropy(label_smoothing=0.2)),
    "ce_weight": (lambda z, t: ref_cross_entropy(z, t, weight=[1.0, 3.0]), build.CrossEntropy(weight=[1.0, 3.0])),
    "ce_weight_smoothing": (lambda z, t: ref_cross_entropy(z, t, weight=[0.5, 2.0], eps=0.1),
                            build.CrossEntropy(label_smoothing=0.1, weight=[0.5, 2.0])),
}


def loss_and_first_gradient(model, loss, feeds):
    """(loss value, dL/dW) of the built model, from one SGD step with lr = 1."""
    tm = build.training_model(model, loss=loss, optimizer=build.SGD(lr=1.0))
    sess = TrainingSession(tm)
    w0 = sess.state["W"]
    value = float(sess.train_step(feeds)["loss"])
    return value, w0 - sess.state["W"]


@pytest.mark.parametrize("name", list(REGRESSION_LOSSES))
def test_regression_loss_matches_numpy(name):
    ref, loss = REGRESSION_LOSSES[name]
    model = affine()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 3))
    t = rng.random((6, 2)) if name.startswith("bce") else rng.standard_normal((6, 2))
    if name == "bce_large_logits":
        x = 30 * x  # logits far beyond exp's float range stay finite
        ref_scaled = REGRESSION_LOSSES[name][0]
        ref = lambda p, t: ref_scaled(p / 30, t)  # noqa: E731
    p = initial_params(model)
    f = lambda w: ref(x @ w + p["b"], t)  # noqa: E731
    value, grad = loss_and_first_gradient(model, loss, {"X": x, "target": t})
    np.testing.assert_allclose(value, f(p["W"]), rtol=1e-9)
    np.testing.assert_allclose(grad, numeric_grad(f, p["W"]), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", list(CLASS_LOSSES))
def test_class_loss_matches_numpy(name):
    ref, loss = CLASS_LOSSES[name]
    model = affine()
    rng = np.random.default_rng(6)
    x = rng.standard_normal((7, 3))
    t = rng.integers(0, 2, 7).astype(np.int64)
    p = initial_params(model)
    f = lambda w: ref(x @ w + p["b"], t)  # noqa: E731
    value, grad = loss_and_first_gradient(model, loss, {"X": x, "target": t})
    np.testing.assert_allclose(value, f(p["W"]), rtol=1e-9)
    np.testing.assert_allclose(grad, numeric_grad(f, p["W"]), rtol=1e-5, atol=1e-8)


def test_nll_with_weights_matches_numpy():
    model = affine(n_out=3, head="log_softmax")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 3))
    t = rng.integers(0, 3, 8).astype(np.int64)
    p = initial_params(model)
    w = [0.2, 1.0, 3.0]
    f = lambda W: ref_nll(log_softmax(x @ W + p["b"]), t, w)  # noqa: E731
    value, grad = loss_and_first_gradient(model, build.NLL(weight=w), {"X": x, "target": t})
    np.testing.assert_allclose(value, f(p["W"]), rtol=1e-9)
    np.testing.assert_allclose(grad, numeric_grad(f, p["W"]), rtol=1e-5, atol=1e-8)


def test_cross_entropy_over_spatial_axes():
    """Scores [N, C, d] with targets [N, d]: weights and smoothing broadcast over d."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 5))
    graph = helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["scores"])], "scale",
        [helper.make_tensor_value_info("X", F64, ["N", 4, 5])],
        [helper.make_tensor_value_info("scores", F64, ["N", 4, 5])],
        [numpy_helper.from_array(rng.standard_normal((4, 1)), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    t = rng.integers(0, 4, (3, 5)).astype(np.int64)
    w0 = numpy_helper.to_array(model.graph.initializer[0])
    weight = [1.0, 2.0, 0.5, 1.5]
    f = lambda W: ref_cross_entropy(x * W, t, weight=weight, eps=0.3)  # noqa: E731
    value, grad = loss_and_first_gradient(model, build.CrossEntropy(0.3, weight), {"X": x, "target": t})
    np.testing.assert_allclose(value, f(w0), rtol=1e-9)
    np.testing.assert_allclose(grad, numeric_grad(f, w0), rtol=1e-5, atol=1e-8)


def test_callable_loss():
    def mean_fourth_power(emit, prediction, target):
        d = emit.Sub(prediction, target)
        d2 = emit.Mul(d, d)
        return emit.reduce_mean(emit.Mul(d2, d2), None, keepdims=False)

    model = affine()
    rng = np.random.default_rng(9)
    x, t = rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    p = initial_params(model)
    f = lambda w: np.mean((x @ w + p["b"] - t) ** 4)  # noqa: E731
    value, grad = loss_and_first_gradient(model, mean_fourth_power, {"X": x, "target": t})
    np.testing.assert_allclose(value, f(p["W"]), rtol=1e-9)
    np.testing.assert_allclose(grad, numeric_grad(f, p["W"]), rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------ schedules
def scalar_model():
    """pred = X * w, w of shape [1]; with loss = sum(pred) and X = 1, dloss/dw = 1."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["X", "w"], ["pred"])], "scalar",
        [helper.make_tensor_value_info("X", F64, [1])], [helper.make_tensor_value_info("pred", F64, [1])],
        [numpy_helper.from_array(np.zeros(1), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def applied_factors(schedule, steps, lr=0.5):
    """The learning rate of each step, read off w under plain SGD with gradient 1."""
    tm = build.training_model(scalar_model(), loss=lambda e, p, t: e.reduce_sum(p, None, keepdims=False),
                              optimizer=build.SGD(lr=lr), schedule=schedule, trainable=["w"])
    sess = TrainingSession(tm)
    ws = [0.0]
    for _ in range(steps):
        sess.train_step({"X": np.ones(1), "target": np.zeros(1)}, fetch=False)
        ws.append(float(sess.state["w"][0]))
    return -np.diff(ws) / lr


SCHEDULES = {
    "linear_warmup": (build.linear_warmup(4), lambda s: min(1.0, (s + 1) / 4)),
    "step_decay": (build.step_decay(3, 0.5), lambda s: 0.5 ** (s // 3)),  # StepLR
    "cosine": (build.cosine(8), lambda s: (1 + math.cos(math.pi * min(s, 8) / 8)) / 2),  # CosineAnnealingLR
    "cosine_warmup": (build.cosine(10, warmup=3),
                      lambda s: (s + 1) / 3 if s < 3 else (1 + math.cos(math.pi * min(1, (s - 3) / 7))) / 2),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_in_graph_matches_formula(name):
    schedule, formula = SCHEDULES[name]
    steps = 14
    expected = [formula(s) for s in range(steps)]
    np.testing.assert_allclose([schedule.factor(s) for s in range(steps)], expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(applied_factors(schedule, steps), expected, rtol=1e-9, atol=1e-12)


def test_schedule_with_adam_matches_torch_rule():
    model = mlp()
    x, labels = blobs()
    schedule = build.cosine(30, warmup=5)
    tm = build.training_model(model, optimizer=build.AdamW(lr=0.02), schedule=schedule)
    expected = run_oracle(initial_params(model), TorchRule("adamw", weight_decay=0.01), 0.02, x, labels, 30,
                          schedule=schedule)
    _, got = run_session(tm, x, labels, 30)
    assert_trajectories_close(got, expected)


# ------------------------------------------------------------------ clipping
@pytest.mark.parametrize("optimizer,rule,lr", [
    (build.SGD(lr=0.2), TorchRule("sgd"), 0.2),
    (build.Adam(lr=0.01), TorchRule("adam"), 0.01),
])
def test_clip_grad_norm_matches_torch_rule(optimizer, rule, lr):
    model = mlp()
    x, labels = blobs()
    params = initial_params(model)
    _, grads = mlp_loss_and_grads(params, x.astype(np.float64), labels)
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    clip = norm / 3  # active from the first step
    tm = build.training_model(model, optimizer=optimizer, clip_grad_norm=clip)
    expected = run_oracle(params, rule, lr, x, labels, 20, clip=clip)
    _, got = run_session(tm, x, labels, 20)
    assert_trajectories_close(got, expected)


def test_clip_grad_norm_leaves_small_gradients_alone():
    model = mlp()
    x, labels = blobs()
    plain = run_session(build.training_model(model, optimizer=build.SGD(0.1)), x, labels, 3)[1]
    clipped = run_session(build.training_model(model, optimizer=build.SGD(0.1), clip_grad_norm=1e6), x, labels, 3)[1]
    assert_trajectories_close(clipped, plain, rtol=1e-6)


# ------------------------------------------------------------------ trainable
@pytest.mark.parametrize("trainable", [["W2", "b2"], lambda name: name.endswith("2")])
def test_frozen_params_stay_bit_identical(trainable):
    model = mlp()
    x, labels = blobs()
    tm = build.training_model(model, optimizer=build.AdamW(lr=0.05, weight_decay=0.1), trainable=trainable)
    algo = tm.training_info[0].algorithm
    gradient = next(n for n in algo.node if n.op_type == "Gradient")
    xs = [s.decode() for a in gradient.attribute if a.name == "xs" for s in a.strings]
    assert xs == ["W2", "b2"]
    keys = {b.key for b in tm.training_info[0].update_binding}
    assert not keys & {"W1", "b1"}
    assert json.loads(dict((p.key, p.value) for p in tm.metadata_props)["onnxtrain.trainable"]) == ["W2", "b2"]
    start = initial_params(model)
    sess, _ = run_session(tm, x, labels, 10, names=("W2", "b2"))
    assert "W1" not in sess.state  # a constant of the model, not a state variable
    trained = {t.name: t for t in sess.to_model().graph.initializer}
    original = {t.name: t for t in model.graph.initializer}
    for k in ("W1", "b1"):
        assert trained[k].SerializeToString() == original[k].SerializeToString()
    assert not np.array_equal(sess.state["W2"], start["W2"].astype(np.float32))


# ------------------------------------------------------------------ accumulation
def accumulated_session(model, k, **kwargs):
    tm = build.training_model(model, accumulate=k, **kwargs)
    cycle = json.loads(dict((p.key, p.value) for p in tm.metadata_props)["onnxtrain.cycle"])
    return TrainingSession(tm), cycle


@pytest.mark.parametrize("kwargs", [
    dict(optimizer=build.Adam(lr=0.02)),
    dict(optimizer=build.SGD(lr=0.1, momentum=0.9), clip_grad_norm=0.5, schedule=build.step_decay(2, 0.5)),
])
def test_accumulate_equals_larger_batch(kwargs):
    k = 3
    model = mlp(dtype=np.float64)
    x, labels = blobs(n=24, dtype=np.float64)
    big = TrainingSession(build.training_model(model, **kwargs))
    small, cycle = accumulated_session(model, k, **kwargs)
    assert cycle == [0, 0, 1]
    for _ in range(4):
        big.train_step({"X": x, "target": labels}, fetch=False)
        for i, algorithm in enumerate(cycle):
            part = slice(8 * i, 8 * (i + 1))
            small.train_step({"X": x[part], "target": labels[part]}, algorithm=algorithm, fetch=False)
    for name in ("W1", "b1", "W2", "b2"):
        np.testing.assert_allclose(small.state[name], big.state[name], rtol=1e-10, atol=1e-12)
    assert small.state["step"] == 4 and small.state["accum.count"] == k - 1


def test_accumulate_out_of_cycle_uses_only_fresh_gradients():
    """After an update, the sums are stale: a second update alone is a plain step."""
    model = mlp(dtype=np.float64)
    x, labels = blobs(dtype=np.float64)
    plain = TrainingSession(build.training_model(model, optimizer=build.SGD(0.1)))
    acc, _ = accumulated_session(model, 2, optimizer=build.SGD(0.1))
    acc.train_step({"X": x, "target": labels}, algorithm=0)
    acc.train_step({"X": x, "target": labels}, algorithm=1)  # mean of two equal gradients
    acc.train_step({"X": x, "target": labels}, algorithm=1)  # sums belong to the last update
    for _ in range(2):
        plain.train_step({"X": x, "target": labels})
    np.testing.assert_allclose(acc.state["W1"], plain.state["W1"], rtol=1e-12)
    # algorithm=None runs [0, 1]: one full cycle of k = 2
    acc.train_step({"X": x, "target": labels})
    plain.train_step({"X": x, "target": labels})
    np.testing.assert_allclose(acc.state["W1"], plain.state["W1"], rtol=1e-12)


# ------------------------------------------------------------------ train mode
def need_rules(*ops):
    missing = [op for op in ops if REGISTRY.get("", op) is None]
    assert not missing, f"no gradient rule for {missing}"


def batch_norm_inference(p, x):
    h_pre = x @ p["W1"] + p["b1"]
    h_bn = (h_pre - p["bn_mean"]) / np.sqrt(p["bn_var"] + 1e-5) * p["bn_scale"] + p["bn_bias"]
    return np.maximum(h_bn, 0) @ p["W2"] + p["b2"]


def test_train_mode_structure():
    model = mlp(batch_norm=True, dropout=True)
    tm = build.training_model(model)
    assert tm.graph.SerializeToString() == model.graph.SerializeToString()
    algo = tm.training_info[0].algorithm
    bn = next(n for n in algo.node if n.op_type == "BatchNormalization")
    assert helper.get_attribute_value(next(a for a in bn.attribute if a.name == "training_mode")) == 1
    assert bn.input[3:] == ["bn_mean", "bn_var"] and bn.input[1] == "bn_scale"
    drop = next(n for n in algo.node if n.op_type == "Dropout")
    assert len(drop.input) == 3 and len(drop.output) == 2
    main_names = {o for n in model.graph.node for o in n.output}
    assert not main_names & {o for n in algo.node for o in n.output}
    # the first Gemm does not depend on a training-mode op: shared, not copied
    assert not any(n.op_type == "Gemm" and "X" in n.input for n in algo.node)
    binding = {b.key: b.value for b in tm.training_info[0].update_binding}
    assert binding["bn_mean"] == bn.output[1] and binding["bn_var"] == bn.output[2]
    trainable = json.loads(dict((p.key, p.value) for p in tm.metadata_props)["onnxtrain.trainable"])
    assert trainable == ["W1", "b1", "W2", "b2", "bn_scale", "bn_bias"]

    plain = build.training_model(model, train_mode=False)
    ops = {n.op_type for n in plain.training_info[0].algorithm.node}
    assert not ops & {"BatchNormalization", "Dropout", "Gemm"}
    assert "bn_mean" not in {b.key for b in plain.training_info[0].update_binding}


def test_train_mode_batch_norm_matches_numpy():
    """BatchNormalization alone is deterministic: compare a few SGD steps with numpy."""
    need_rules("BatchNormalization")
    model = mlp(dtype=np.float64, batch_norm=True)
    x, labels = blobs(dtype=np.float64)
    sess = TrainingSession(build.training_model(model, optimizer=build.SGD(lr=0.1)))
    p = initial_params(model)
    names = ["W1", "b1", "bn_scale", "bn_bias", "W2", "b2"]

    def train_loss(params):
        h_pre = x @ params["W1"] + params["b1"]
        mu, var = h_pre.mean(0), h_pre.var(0)
        h = np.maximum((h_pre - mu) / np.sqrt(var + 1e-5) * params["bn_scale"] + params["bn_bias"], 0)
        return cross_entropy_and_grad(h @ params["W2"] + params["b2"], labels)[0], mu, var

    for _ in range(3):
        grads = {}
        for k in names:
            grads[k] = numeric_grad(lambda w, k=k: train_loss({**p, k: w})[0], p[k])
        _, mu, var = train_loss(p)
        momentum = float(np.float32(0.9))  # a float attribute
        p["bn_mean"] = momentum * p["bn_mean"] + (1 - momentum) * mu
        p["bn_var"] = momentum * p["bn_var"] + (1 - momentum) * var
        for k in names:
            p[k] = p[k] - 0.1 * grads[k]
        sess.train_step({"X": x, "target": labels}, fetch=False)
    for k in names + ["bn_mean", "bn_var"]:
        np.testing.assert_allclose(sess.state[k], p[k], rtol=1e-6, atol=1e-8, err_msg=k)


def test_train_mode_dropout_and_batch_norm_train():
    need_rules("BatchNormalization", "Dropout")
    model = mlp(batch_norm=True, dropout=True)
    x, labels = blobs()
    sess = TrainingSession(build.training_model(model, optimizer=build.Adam(lr=0.02)))
    start_mean = sess.state["bn_mean"]
    losses = [float(sess.train_step({"X": x, "target": labels})["loss"]) for _ in range(40)]
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < np.mean(losses[:5])
    assert not np.allclose(sess.state["bn_mean"], start_mean)
    assert not np.allclose(sess.state["bn_var"], 1.0)
    # the main graph stays in inference mode: running statistics, no dropout, deterministic
    state = {k: sess.state[k].astype(np.float64) for k in sess.state if k in initial_params(model)}
    out = sess.run({"X": x})["logits"]
    np.testing.assert_allclose(out, batch_norm_inference(state, x.astype(np.float64)), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out, sess.run({"X": x})["logits"])


# ------------------------------------------------------------------ initialize
@pytest.mark.parametrize("kwargs", [
    dict(optimizer=build.Adam(lr=0.01)),
    dict(optimizer=build.Adagrad(lr=0.1, initial_accumulator_value=0.5), accumulate=2),
    dict(optimizer=build.SGD(lr=0.1, momentum=0.9), model=dict(batch_norm=True)),
])
def test_initialize_restores_the_start(kwargs):
    kwargs = dict(kwargs)
    model = mlp(dtype=np.float64, **kwargs.pop("model", {}))
    if any(n.op_type == "BatchNormalization" for n in model.graph.node):
        need_rules("BatchNormalization")
    x, labels = blobs(dtype=np.float64)
    sess = TrainingSession(build.training_model(model, **kwargs))
    start = dict(sess.state)

    def run():
        return [float(sess.train_step({"X": x, "target": labels})["loss"]) for _ in range(4)]

    first = run()
    assert any(not np.array_equal(sess.state[k], start[k]) for k in start)
    sess.initialize()
    for k, v in start.items():
        np.testing.assert_array_equal(sess.state[k], v, err_msg=k)
    assert run() == first
    if "Adagrad" in type(kwargs["optimizer"]).__name__:
        assert float(start["W1.adagrad_sum"].flat[0]) == 0.5


# ------------------------------------------------------------------ validity and metadata
CONFIGS = {
    "adam": dict(),
    "sgd_plain_mse": dict(loss="mse", target_kind="float"),
    "momentum_schedule_clip": dict(optimizer=build.SGD(0.1, momentum=0.9, nesterov=True),
                                   schedule=build.cosine(10, 2), clip_grad_norm=1.0),
    "adagrad_accumulate": dict(optimizer=build.Adagrad(0.1), accumulate=3),
    "adamw_train_mode": dict(optimizer=build.AdamW(0.01), model=dict(batch_norm=True, dropout=True)),
    "train_mode_accumulate": dict(accumulate=2, model=dict(batch_norm=True, dropout=True), opset=14),
    "opset13": dict(opset=13, model=dict(batch_norm=True, dropout=True), loss=build.CrossEntropy(0.1, [1, 2, 3])),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_built_model_is_valid_onnx(name):
    cfg = dict(CONFIGS[name])
    cfg.pop("target_kind", None)
    model = mlp(opset=cfg.pop("opset", 17), **cfg.pop("model", {}))
    before = model.SerializeToString()
    tm = build.training_model(model, **cfg)
    assert model.SerializeToString() == before  # never modified in place
    assert tm.ir_version == 10
    assert {(o.domain, o.version) for o in tm.opset_import} >= {("ai.onnx.preview.training", 1)}
    onnx.checker.check_model(tm, full_check=True)
    for i in range(len(tm.training_info)):
        combined = helper.make_model(combined_graph(tm, i), opset_imports=list(tm.opset_import))
        combined.ir_version = tm.ir_version
        onnx.checker.check_model(combined, full_check=True)
    sess = TrainingSession(tm)  # the runtime's own validation
    k = cfg.get("accumulate", 1)
    assert len(tm.training_info) == (1 if k == 1 else 2)
    # every state variable is reset by some initialization graph
    reset = {b.key for ti in tm.training_info for b in ti.initialization_binding}
    assert reset == set(sess.state)


def test_metadata_for_the_fit_loop():
    tm = build.training_model(mlp(), optimizer=build.Adam(0.01), accumulate=3)
    meta = {p.key: json.loads(p.value) for p in tm.metadata_props if p.key.startswith("onnxtrain.")}
    assert meta == {
        "onnxtrain.inputs": ["X"],
        "onnxtrain.target": "target",
        "onnxtrain.loss": "loss",
        "onnxtrain.prediction": "logits",
        "onnxtrain.task": "classification",
        "onnxtrain.cycle": [0, 0, 1],
        "onnxtrain.trainable": ["W1", "b1", "W2", "b2"],
        "onnxtrain.optimizer_state": ["W1.adam_m", "W1.adam_v", "b1.adam_m", "b1.adam_v", "W2.adam_m",
                                      "W2.adam_v", "b2.adam_m", "b2.adam_v", "step", "W1.grad_accum",
                                      "b1.grad_accum", "W2.grad_accum", "b2.grad_accum", "accum.count",
                                      "accum.step", "lr"],
        "onnxtrain.train_prediction": {},
        "onnxtrain.learning_rate": {"state": "lr", "base": 0.01},
        "onnxtrain.classes": {"count": 3, "axis": 1, "ignore_index": -100},
        "onnxtrain.data_parallel": meta.get("onnxtrain.data_parallel"),
    }
    # Data-parallel training keeps the sums per rank and reduces what [1] divides.
    dp = meta["onnxtrain.data_parallel"]
    assert dp["local"] == ["W1.grad_accum", "b1.grad_accum", "W2.grad_accum", "b2.grad_accum"]
    divided = {n.input[0] for n in tm.training_info[1].algorithm.node if n.op_type == "Div"}
    assert list(dp["reduce"]) == ["1"] and len(dp["reduce"]["1"]) == 4
    assert set(dp["reduce"]["1"]) <= divided
    for i, ti in enumerate(tm.training_info):
        assert meta["onnxtrain.loss"] in {o.name for o in ti.algorithm.output}
    reg = build.training_model(affine(), loss="huber", target="y_true", output="pred")
    meta = {p.key: json.loads(p.value) for p in reg.metadata_props}
    assert meta["onnxtrain.task"] == "regression" and meta["onnxtrain.target"] == "y_true"
    assert meta["onnxtrain.cycle"] == [0]
    sess = TrainingSession(reg)
    assert sess.algorithm_inputs[0]["y_true"].type.tensor_type.elem_type == F64


def test_model_from_path(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), path)
    tm = build.training_model(str(path), optimizer=build.SGD(0.1))
    direct = build.training_model(mlp(), optimizer=build.SGD(0.1))
    # The same model as from memory, plus the file it was built from (genai.export names it).
    from onnxtrain.io.metadata import drop_metadata, model_metadata

    assert model_metadata(tm)["source"] == os.path.abspath(path)
    drop_metadata(tm, "source")
    assert tm.SerializeToString() == direct.SerializeToString()
    x, labels = blobs()
    sess = TrainingSession(tm)
    before = dict(sess.state.items())
    out = sess.train_step({"X": x, "target": labels})
    assert np.isfinite(out["loss"]) and int(sess.state["step"]) == 1
    assert not np.array_equal(before["W1"], sess.state["W1"])  # the step trained the weights


def test_checkpoint_resumes_and_inference_export_runs(tmp_path):
    import onnxruntime as ort

    model = mlp(dtype=np.float64, batch_norm=True)
    x, labels = blobs(dtype=np.float64)
    tm = build.training_model(model, optimizer=build.AdamW(0.01), accumulate=2, schedule=build.cosine(20))
    sess = TrainingSession(tm)
    for _ in range(3):
        sess.train_step({"X": x, "target": labels}, fetch=False)
    sess.export(tmp_path / "checkpoint.onnx", training=True)
    resumed = TrainingSession(str(tmp_path / "checkpoint.onnx"))
    for _ in range(3):
        a = sess.train_step({"X": x, "target": labels})["loss"]
        b = resumed.train_step({"X": x, "target": labels})["loss"]
        assert a == b
    sess.export(tmp_path / "inference.onnx")
    plain = ort.InferenceSession(str(tmp_path / "inference.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(plain.run(None, {"X": x})[0], sess.run({"X": x})["logits"], rtol=1e-12)


def test_multiple_outputs_and_warning_for_unbound_statistics():
    model = mlp(batch_norm=True)
    graph = model.graph
    graph.node.append(helper.make_node("Softmax", ["logits"], ["probs"], axis=1))
    graph.output.append(helper.make_tensor_value_info("probs", F32, ["N", 3]))
    # running mean computed by a node instead of read from an initializer
    bn = next(n for n in graph.node if n.op_type == "BatchNormalization")
    graph.node.insert(0, helper.make_node("Identity", ["bn_mean"], ["bn_mean_copy"]))
    bn.input[3] = "bn_mean_copy"
    with pytest.warns(UserWarning, match="running statistic from 'bn_mean_copy'"):
        tm = build.training_model(model, loss="nll", output="probs", optimizer=build.SGD(0.1))
    keys = {b.key for b in tm.training_info[0].update_binding}
    assert "bn_var" in keys and "bn_mean" not in keys
    assert json.loads(dict((p.key, p.value) for p in tm.metadata_props)["onnxtrain.prediction"]) == "probs"
    TrainingSession(tm)


# ------------------------------------------------------------------ errors
def no_float_model():
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "k"], ["Xk"]), helper.make_node("Cast", ["Xk"], ["Y"], to=F32)], "g",
        [helper.make_tensor_value_info("X", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("Y", F32, [2])],
        [numpy_helper.from_array(np.ones(2, np.int64), "k")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("call,error,match", [
    (lambda: build.training_model(mlp(), loss="hinge"), ValueError, "unknown loss 'hinge'.*cross_entropy"),
    (lambda: build.training_model(no_float_model(), loss="mse"), ValueError, "no floating-point initializers"),
    (lambda: build.training_model(mlp(), trainable=["W1", "W9"]), ValueError, "unknown trainable name 'W9'"),
    (lambda: build.training_model(mlp(), trainable=lambda n: False), ValueError, "no trainable parameters"),
    (lambda: build.training_model(mlp(), trainable="W1"), TypeError, "list of names"),
    (lambda: build.training_model(mlp(batch_norm=True), trainable=["bn_mean"]), ValueError, "BatchNormalization"),
    (lambda: build.training_model(mlp(), output="probs"), ValueError, "'probs' is not an output"),
    (lambda: build.training_model(mlp(), target="X"), ValueError, "target name 'X' is already used"),
    (lambda: build.training_model(mlp(), accumulate=0), ValueError, "accumulate must be an integer >= 1"),
    (lambda: build.training_model(mlp(), clip_grad_norm=-1), ValueError, "clip_grad_norm"),
    (lambda: build.training_model(mlp(), optimizer="adam"), TypeError, "optimizer must be"),
    (lambda: build.training_model(mlp(), schedule=0.5), TypeError, "schedule must be"),
    (lambda: build.training_model(build.training_model(mlp())), ValueError, "already has training_info"),
    (lambda: build.SGD(lr=-0.1), ValueError, "lr must be a number >= 0"),
    (lambda: build.SGD(lr=0.1, nesterov=True), ValueError, "nesterov=True needs momentum"),
    (lambda: build.Adam(lr=0.1, betas=(0.9, 1.0)), ValueError, "betas"),
    (lambda: build.cosine(10, warmup=10), ValueError, "warmup"),
    (lambda: build.step_decay(0), ValueError, "step_size"),
    (lambda: build.CrossEntropy(label_smoothing=1.5), ValueError, "label_smoothing"),
    (lambda: build.Huber(delta=0), ValueError, "delta"),
])
def test_bad_arguments_give_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_evaluate_on_a_train_mode_model_uses_inference_mode():
    """evaluate() must not run Dropout/BatchNorm in training mode: its loss
    equals the loss of the main graph's (inference-mode) prediction."""
    model = build.training_model(mlp(batch_norm=True, dropout=True), loss="cross_entropy",
                                 target="label", optimizer=build.SGD(0.1))
    sess = TrainingSession(model)
    x, labels = blobs()
    for _ in range(3):
        sess.train_step({"X": x, "label": labels})
    first = sess.evaluate((x, labels))["loss"]
    again = sess.evaluate((x, labels))["loss"]
    assert first == again  # no dropout randomness
    logits = sess.run({"X": x})["logits"].astype(np.float64)
    expected, _ = cross_entropy_and_grad(logits, labels)
    np.testing.assert_allclose(first, expected, rtol=1e-5)


def test_inference_export_of_an_accumulating_model_drops_training_only_initializers(tmp_path):
    model = build.training_model(mlp(), loss="cross_entropy", target="label",
                                 optimizer=build.Adam(0.01), accumulate=3)
    sess = TrainingSession(model)
    exported = sess.to_model(training=False)
    used = {i for n in exported.graph.node for i in n.input}
    assert all(t.name in used for t in exported.graph.initializer)
    onnx.checker.check_model(exported, full_check=True)


def test_old_opset_model_is_upgraded_by_the_builder():
    """An opset-12 model is upgraded to 13 by the builder (checked against the
    original's outputs) instead of being refused."""
    tm = build.training_model(mlp(opset=12), loss="cross_entropy")
    assert max(o.version for o in tm.opset_import if o.domain in ("", "ai.onnx")) == 13
    sess = TrainingSession(tm)
    sess.initialize()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.integers(0, 3, 8).astype(np.int64)
    assert np.isfinite(float(sess.train_step({"X": x, "target": y})["loss"]))
