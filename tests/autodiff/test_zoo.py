"""A model zoo built with onnx.helper: real architectures, trained end to end.

Every model is a standard ONNX training model: the main graph is the inference
graph (rule R10: BatchNormalization in inference mode, Dropout off); the
algorithm graph holds the training forward pass (BatchNormalization and
Dropout in training mode), the loss, one Gradient node over every weight, the
optimizer and the update of BatchNormalization's running statistics, bound
through update_binding like the weights.

For each model:

* every weight's gradient is checked numerically.  The analytic gradients are
  the Gradient outputs that ``TrainingSession.train_step`` returns (lr = 0, so
  the step changes no weight).  The oracle is the loss in float64 on
  ``onnx.reference`` (onnxruntime has no float64 Conv, pooling or LSTM
  kernels), a central difference per weight along a random direction.  Models
  that onnxruntime runs in float64 (MLP, transformer) are checked in float64;
  the others (Conv, pooling, LSTM) in float32 against the float64 oracle.
  The tolerance is relative to sum |g * d| per weight: 1e-6 in float64, 1e-5
  for float32 gradients and for the transformer (its LayerNormalization keeps
  float32 statistics);
* the model trains: its loss falls over 30 ``train_step`` calls.

Then old opsets (7, 9, 11, 12), and regressions for bugs seen in peers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from grad_cases import Erf, Gelu
from models import tensor, training_info, vi
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain import TrainingSession

PREVIEW = "ai.onnx.preview.training"
STEPS = 30


def node(op: str, inputs: Sequence[str], outputs: Sequence[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, list(inputs), list(outputs), **attrs)


def elem(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


# ====================================================================== the harness
@dataclass
class Net:
    """A network and one batch of data, in one dtype.

    ``main`` reads the weights (``params``) and ``buffers`` (BatchNormalization
    running statistics); ``train`` is the algorithm graph's forward pass and
    loss, ending in ``loss``; ``buffer_updates`` binds each buffer to the
    training forward's new value.  ``consts`` are algorithm initializers."""

    main: list[onnx.NodeProto]
    inputs: list[onnx.ValueInfoProto]
    outputs: list[onnx.ValueInfoProto]
    params: dict[str, np.ndarray]
    train: list[onnx.NodeProto]
    target: onnx.ValueInfoProto
    feeds: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    buffer_updates: list[tuple[str, str]] = field(default_factory=list)
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    opset: int = 17

    @property
    def dtype(self) -> np.dtype:
        return next(iter(self.params.values())).dtype


def training_model(net: Net, optimizer: str = "sgd", lr: float = 0.1) -> onnx.ModelProto:
    """main ⊕ algorithm: train forward + loss -> Gradient -> optimizer; the
    gradients are algorithm outputs too, so train_step returns them."""
    names = list(net.params)
    grads = [f"grad_{p}" for p in names]
    zs = [i.name for i in net.inputs] + [net.target.name]
    et = elem(net.dtype)
    nodes = list(net.train)
    nodes.append(node("Gradient", names + zs, grads, domain=PREVIEW, xs=names, zs=zs, y="loss",
                      name="gradient"))
    inits = [tensor("lr", np.asarray(lr, net.dtype)), tensor("step", np.asarray(0, np.int64)),
             tensor("one", np.asarray(1, np.int64))]
    inits += [tensor(k, v) for k, v in net.consts.items()]
    new = [f"{p}_new" for p in names]
    state_new: list[str] = []
    update = list(zip(names, new))
    if optimizer == "sgd":
        for p, g, n in zip(names, grads, new):
            nodes += [node("Mul", ["lr", g], [g + "_lr"]), node("Sub", [p, g + "_lr"], [n])]
    elif optimizer == "adam":
        v = [f"{p}_v" for p in names]
        h = [f"{p}_h" for p in names]
        inits += [tensor(s, np.zeros_like(net.params[p])) for s, p in zip(v + h, names + names)]
        state_new = [s + "_new" for s in v + h]
        nodes.append(node("Adam", ["lr", "step"] + names + grads + v + h, new + state_new, domain=PREVIEW,
                          alpha=0.9, beta=0.999, epsilon=1e-8, norm_coefficient=0.0, name="adam"))
        update += list(zip(v + h, state_new))
    else:
        raise ValueError(optimizer)
    nodes.append(node("Add", ["step", "one"], ["step_new"]))
    update += [("step", "step_new")] + list(net.buffer_updates)
    shapes = {p: list(v.shape) for p, v in net.params.items()}
    outputs = [vi("loss", et, [])]
    outputs += [vi(g, et, shapes[p]) for g, p in zip(grads, names)]
    outputs += [vi(n, et, shapes[p]) for n, p in zip(new, names)]
    outputs += [vi(s, et, shapes[p]) for s, p in zip(state_new, names + names)]
    outputs += [vi("step_new", TensorProto.INT64, [])]
    outputs += [vi(value, et, list(net.buffers[key].shape)) for key, value in net.buffer_updates]
    info = training_info(nodes, inits, [net.target], outputs, update)
    graph = helper.make_graph(
        net.main, "main", net.inputs, net.outputs,
        [tensor(k, v) for k, v in {**net.params, **net.buffers}.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", net.opset), helper.make_opsetid(PREVIEW, 1)]
    )
    model.training_info.append(info)
    onnx.checker.check_model(model)
    return model


def loss_model(net: Net) -> onnx.ModelProto:
    """The training forward pass and loss alone, weights and buffers as inputs."""
    et = elem(net.dtype)
    inputs = list(net.inputs) + [net.target]
    inputs += [vi(k, et, list(v.shape)) for k, v in {**net.params, **net.buffers}.items()]
    graph = helper.make_graph(
        net.main + net.train, "loss", inputs, [vi("loss", et, [])],
        [tensor(k, v) for k, v in net.consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", net.opset)])


def analytic_gradients(session: TrainingSession, net: Net, feeds: dict) -> dict[str, np.ndarray]:
    """The Gradient outputs of one train_step at the session's current state."""
    out = session.train_step(feeds)
    return {p: out[f"grad_{p}"] for p in net.params}


def check_gradients(
    make: Callable[..., Net],
    dtype,
    rtol: float,
    session: TrainingSession | None = None,
    feeds: dict | None = None,
    eps: float = 1e-6,
    **kwargs,
) -> None:
    """Every weight's gradient against float64 central differences on onnx.reference."""
    net = make(dtype, **kwargs)
    feeds = dict(net.feeds if feeds is None else feeds)
    if session is None:
        session = TrainingSession(training_model(net, "sgd", lr=0.0))
    grads = analytic_gradients(session, net, feeds)
    # the float64 oracle, at the very same point as the analytic gradients
    ref_net = make(np.float64, **kwargs)
    point = {k: np.asarray(v).astype(np.float64) if np.asarray(v).dtype.kind == "f" else v
             for k, v in {**net.params, **net.buffers, **feeds}.items()}
    evaluator = ReferenceEvaluator(loss_model(ref_net), new_ops=[Erf, Gelu])

    def loss(values: dict) -> float:
        return float(evaluator.run(["loss"], values)[0])

    rng = np.random.default_rng(7)
    directions = {p: rng.standard_normal(g.shape) for p, g in grads.items()}
    terms = {p: g.astype(np.float64) * directions[p] for p, g in grads.items()}
    # a weight whose true gradient is 0 (a conv bias before BatchNormalization)
    # gets rounding noise: allow rtol of the largest weight's scale
    floor = rtol * 1e-2 * max(float(np.abs(t).sum()) for t in terms.values()) + 1e-9
    wrong = []
    for p, g in grads.items():
        assert g.dtype == net.params[p].dtype and g.shape == net.params[p].shape, p
        d = directions[p]
        numeric = (loss({**point, p: point[p] + eps * d}) - loss({**point, p: point[p] - eps * d})) / (2 * eps)
        predicted, scale = float(terms[p].sum()), float(np.abs(terms[p]).sum())
        if not abs(predicted - numeric) <= rtol * scale + floor:
            wrong.append(f"{p}: analytic {predicted:.8g}, numeric {numeric:.8g}, scale {scale:.3g}")
    assert not wrong, "gradients differ from finite differences: " + "; ".join(wrong)


def train(make: Callable[..., Net], dtype, optimizer: str, lr: float, steps: int = STEPS, **kwargs):
    """Train ``steps`` steps on the net's batch; returns (session, losses)."""
    net = make(dtype, **kwargs)
    session = TrainingSession(training_model(net, optimizer, lr))
    losses = [float(session.train_step(net.feeds)["loss"]) for _ in range(steps)]
    assert all(math.isfinite(v) for v in losses), losses
    return session, net, losses


def assert_falls(losses: Sequence[float], factor: float = 0.7) -> None:
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < factor * first, f"loss did not fall: {first:.4g} -> {last:.4g} ({losses})"


def classes(x: np.ndarray, n_classes: int, seed: int) -> np.ndarray:
    """Labels from a fixed random linear teacher: a learnable task."""
    w = np.random.default_rng(seed).standard_normal((x[0].size, n_classes))
    return np.argmax(x.reshape(len(x), -1) @ w, axis=1).astype(np.int64)


def sce(logits: str) -> list[onnx.NodeProto]:
    return [node("SoftmaxCrossEntropyLoss", [logits, "label"], ["loss"], reduction="mean")]


LABEL = vi("label", TensorProto.INT64, ["N"])


# ====================================================================== the zoo
def mlp(dtype=np.float64, batch: int = 16, opset: int = 17) -> Net:
    """logits = Gemm(Relu(Gemm(X, W1, b1)), W2, b2); softmax cross-entropy."""
    rng = np.random.default_rng(0)
    et = elem(dtype)
    params = {
        "W1": rng.standard_normal((6, 12)) / np.sqrt(6), "b1": rng.standard_normal(12) * 0.1,
        "W2": rng.standard_normal((12, 3)) / np.sqrt(12), "b2": np.zeros(3),
    }
    x = rng.standard_normal((batch, 6))
    main = [node("Gemm", ["X", "W1", "b1"], ["h_pre"]), node("Relu", ["h_pre"], ["h"]),
            node("Gemm", ["h", "W2", "b2"], ["logits"])]
    return Net(
        main, [vi("X", et, ["N", 6])], [vi("logits", et, ["N", 3])],
        {k: v.astype(dtype) for k, v in params.items()}, sce("logits"), LABEL,
        {"X": x.astype(dtype), "label": classes(x, 3, 1)}, opset=opset,
    )


def _bn(prefix: str, x: str, y: str, channels: int, training: bool, rng) -> tuple[list, dict, dict, list]:
    """BatchNormalization: inference (main) or training (algorithm) node.
    Returns (nodes, params, buffers, buffer updates)."""
    s, b, m, v = (f"{prefix}_{k}" for k in ("scale", "bias", "mean", "var"))
    if training:
        nodes = [node("BatchNormalization", [x, s, b, m, v], [y, f"t_{m}", f"t_{v}"], training_mode=1,
                      momentum=0.9, epsilon=1e-5)]
        return nodes, {}, {}, [(m, f"t_{m}"), (v, f"t_{v}")]
    params = {s: 1.0 + 0.1 * rng.standard_normal(channels), b: 0.1 * rng.standard_normal(channels)}
    buffers = {m: np.zeros(channels), v: np.ones(channels)}
    return [node("BatchNormalization", [x, s, b, m, v], [y], epsilon=1e-5)], params, buffers, []


def cnn(dtype=np.float32, batch: int = 8, dropout: float = 0.25) -> Net:
    """Conv -> BatchNormalization -> Relu -> MaxPool -> Flatten -> Dropout -> Gemm."""
    rng = np.random.default_rng(1)
    et = elem(dtype)

    def forward(t: str, training: bool):
        p = (lambda name: f"t_{name}") if training else (lambda name: name)
        bn_nodes, bn_params, bn_buffers, updates = _bn("bn1", p("c1"), p("n1"), 4, training, rng)
        nodes = [node("Conv", ["X", "W1", "b1"], [p("c1")], pads=[1, 1, 1, 1]), *bn_nodes,
                 node("Relu", [p("n1")], [p("r1")]),
                 node("MaxPool", [p("r1")], [p("m1")], kernel_shape=[2, 2], strides=[2, 2]),
                 node("Flatten", [p("m1")], [p("f1")])]
        if training:
            nodes.append(node("Dropout", [p("f1"), "ratio", "training"], [p("d1"), p("mask")]))
        else:
            nodes.append(node("Dropout", [p("f1")], [p("d1")]))
        nodes.append(node("Gemm", [p("d1"), "W2", "b2"], [p("logits")]))
        return nodes, bn_params, bn_buffers, updates

    main, bn_params, buffers, _ = forward("", False)
    train_nodes, _, _, updates = forward("t", True)
    params = {"W1": rng.standard_normal((4, 1, 3, 3)) / 3, "b1": np.zeros(4), **bn_params,
              "W2": rng.standard_normal((64, 3)) / 8, "b2": np.zeros(3)}
    x = rng.standard_normal((batch, 1, 8, 8))
    return Net(
        main, [vi("X", et, ["N", 1, 8, 8])], [vi("logits", et, ["N", 3])],
        {k: np.asarray(v, dtype) for k, v in params.items()}, train_nodes + sce("t_logits"), LABEL,
        {"X": x.astype(dtype), "label": classes(x, 3, 2)},
        {k: np.asarray(v, dtype) for k, v in buffers.items()}, updates,
        {"ratio": np.asarray(dropout, dtype), "training": np.asarray(True)}, opset=15,
    )


def resnet(dtype=np.float32, batch: int = 8) -> Net:
    """Stem Conv/BN/Relu, two residual blocks (Conv/BN/Relu/Conv/BN + skip, Add, Relu),
    GlobalAveragePool, Flatten, Gemm."""
    rng = np.random.default_rng(2)
    et = elem(dtype)
    c = 4

    params: dict = {}
    buffers: dict = {}

    def conv_bn(tag: str, x: str, y: str, training: bool, c_in: int, updates: list) -> list:
        p = (lambda name: f"t_{name}") if training else (lambda name: name)
        if not training:
            params[f"{tag}_W"] = rng.standard_normal((c, c_in, 3, 3)) / np.sqrt(9 * c_in)
        bn_nodes, bn_params, bn_buffers, bn_updates = _bn(f"{tag}_bn", p(f"{tag}_c"), y, c, training, rng)
        params.update(bn_params)
        buffers.update(bn_buffers)
        updates += bn_updates
        return [node("Conv", [x, f"{tag}_W"], [p(f"{tag}_c")], pads=[1, 1, 1, 1]), *bn_nodes]

    def forward(training: bool) -> tuple[list, list]:
        p = (lambda name: f"t_{name}") if training else (lambda name: name)
        updates: list = []
        nodes = conv_bn("stem", "X", p("s_bn"), training, 2, updates)
        nodes.append(node("Relu", [p("s_bn")], [p("a0")]))
        x = p("a0")
        for b in (1, 2):
            nodes += conv_bn(f"b{b}a", x, p(f"b{b}a_bn"), training, c, updates)
            nodes.append(node("Relu", [p(f"b{b}a_bn")], [p(f"b{b}a_r")]))
            nodes += conv_bn(f"b{b}b", p(f"b{b}a_r"), p(f"b{b}b_bn"), training, c, updates)
            nodes += [node("Add", [p(f"b{b}b_bn"), x], [p(f"b{b}_sum")]),
                      node("Relu", [p(f"b{b}_sum")], [p(f"a{b}")])]
            x = p(f"a{b}")
        nodes += [node("GlobalAveragePool", [x], [p("gap")]), node("Flatten", [p("gap")], [p("feat")]),
                  node("Gemm", [p("feat"), "fc_W", "fc_b"], [p("logits")])]
        return nodes, updates

    main, _ = forward(False)
    train_nodes, updates = forward(True)
    params.update({"fc_W": rng.standard_normal((c, 3)), "fc_b": np.zeros(3)})
    x = rng.standard_normal((batch, 2, 6, 6))
    return Net(
        main, [vi("X", et, ["N", 2, 6, 6])], [vi("logits", et, ["N", 3])],
        {k: np.asarray(v, dtype) for k, v in params.items()}, train_nodes + sce("t_logits"), LABEL,
        {"X": x.astype(dtype), "label": classes(x, 3, 3)},
        {k: np.asarray(v, dtype) for k, v in buffers.items()}, updates, opset=15,
    )


def transformer(dtype=np.float64, batch: int = 4) -> Net:
    """One encoder layer: pre-LayerNormalization multi-head self-attention
    (MatMul/Reshape/Transpose/Softmax) + residual, LayerNormalization, Gelu FFN
    + residual; mean over the sequence, Gemm classifier."""
    rng = np.random.default_rng(3)
    et = elem(dtype)
    t, d, heads, hidden = 5, 8, 2, 16
    dh = d // heads
    # onnxruntime has no float64 LayerNormalization kernel that also returns
    # Mean/InvStdDev (which the rule reads) with stash_type=double: the model's
    # statistics stay float32 (the default).  onnx.reference computes them in
    # the input's precision, so the float64 oracle is exact; hence rtol 1e-5.
    stash = TensorProto.FLOAT
    params = {
        "ln1_s": 1 + 0.1 * rng.standard_normal(d), "ln1_b": 0.1 * rng.standard_normal(d),
        "Wq": rng.standard_normal((d, d)) / np.sqrt(d), "Wk": rng.standard_normal((d, d)) / np.sqrt(d),
        "Wv": rng.standard_normal((d, d)) / np.sqrt(d), "Wo": rng.standard_normal((d, d)) / np.sqrt(d),
        "ln2_s": 1 + 0.1 * rng.standard_normal(d), "ln2_b": 0.1 * rng.standard_normal(d),
        "W1": rng.standard_normal((d, hidden)) / np.sqrt(d), "b1": 0.1 * rng.standard_normal(hidden),
        "W2": rng.standard_normal((hidden, d)) / np.sqrt(hidden), "b2": np.zeros(d),
        "Wc": rng.standard_normal((d, 3)) / np.sqrt(d), "bc": np.zeros(3),
    }
    consts = {"heads_shape": np.array([0, 0, heads, dh], np.int64), "model_shape": np.array([0, 0, d], np.int64),
              "inv_sqrt_dh": np.asarray(1 / np.sqrt(dh), dtype), "seq_axis": np.array([1], np.int64)}

    def heads_of(x: str, out: str) -> list:
        return [node("Reshape", [x, "heads_shape"], [out + "_r"]),
                node("Transpose", [out + "_r"], [out], perm=[0, 2, 1, 3])]

    main = [
        node("LayerNormalization", ["X", "ln1_s", "ln1_b"], ["x1"], axis=-1, stash_type=stash),
        node("MatMul", ["x1", "Wq"], ["q"]), node("MatMul", ["x1", "Wk"], ["k"]),
        node("MatMul", ["x1", "Wv"], ["v"]),
        *heads_of("q", "qh"), *heads_of("k", "kh"), *heads_of("v", "vh"),
        node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]),
        node("MatMul", ["qh", "kt"], ["scores_raw"]), node("Mul", ["scores_raw", "inv_sqrt_dh"], ["scores"]),
        node("Softmax", ["scores"], ["attn"], axis=-1), node("MatMul", ["attn", "vh"], ["ctx_h"]),
        node("Transpose", ["ctx_h"], ["ctx_t"], perm=[0, 2, 1, 3]),
        node("Reshape", ["ctx_t", "model_shape"], ["ctx"]), node("MatMul", ["ctx", "Wo"], ["attn_out"]),
        node("Add", ["X", "attn_out"], ["res1"]),
        node("LayerNormalization", ["res1", "ln2_s", "ln2_b"], ["x2"], axis=-1, stash_type=stash),
        node("MatMul", ["x2", "W1"], ["f1"]), node("Add", ["f1", "b1"], ["f1b"]),
        node("Gelu", ["f1b"], ["g1"], approximate="tanh"),
        node("MatMul", ["g1", "W2"], ["f2"]), node("Add", ["f2", "b2"], ["f2b"]),
        node("Add", ["res1", "f2b"], ["res2"]),
        node("ReduceMean", ["res2", "seq_axis"], ["pooled"], keepdims=0),
        node("Gemm", ["pooled", "Wc", "bc"], ["logits"]),
    ]
    constants = [node("Constant", [], [k], value=tensor(k + "_value", v)) for k, v in consts.items()]
    x = rng.standard_normal((batch, t, d))
    return Net(
        constants + main, [vi("X", et, ["N", t, d])], [vi("logits", et, ["N", 3])],
        {k: np.asarray(v, dtype) for k, v in params.items()}, sce("logits"), LABEL,
        {"X": x.astype(dtype), "label": classes(x, 3, 4)}, opset=20,
    )


def lstm(dtype=np.float32, batch: int = 8) -> Net:
    """LSTM over a sequence (layout 0: [T, N, I]) -> last hidden state -> Gemm
    -> a regression of the sequence's mean; mean squared error."""
    rng = np.random.default_rng(4)
    et = elem(dtype)
    t, i, h = 6, 3, 5
    params = {
        "W": rng.standard_normal((1, 4 * h, i)) * 0.4, "R": rng.standard_normal((1, 4 * h, h)) * 0.4,
        "B": rng.standard_normal((1, 8 * h)) * 0.1, "Wo": rng.standard_normal((h, 1)) * 0.5,
        "bo": np.zeros(1),
    }
    main = [node("LSTM", ["X", "W", "R", "B"], ["Y", "Y_h"], hidden_size=h),
            node("Constant", [], ["hshape"], value=tensor("hshape_value", np.array([-1, h], np.int64))),
            node("Reshape", ["Y_h", "hshape"], ["last"]), node("Gemm", ["last", "Wo", "bo"], ["pred"])]
    loss = [node("Sub", ["pred", "target"], ["err"]), node("Mul", ["err", "err"], ["sq"]),
            node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    x = rng.standard_normal((t, batch, i))
    target = x.mean(axis=(0, 2))[:, None] * 3
    return Net(
        main, [vi("X", et, [t, "N", i])], [vi("pred", et, ["N", 1])],
        {k: np.asarray(v, dtype) for k, v in params.items()}, loss, vi("target", et, ["N", 1]),
        {"X": x.astype(dtype), "target": target.astype(dtype)}, opset=14,
    )


ZOO = {
    # name: (builder, analytic dtype, rtol, optimizer, lr)
    "mlp": (mlp, np.float64, 1e-6, "sgd", 0.5),
    "cnn": (cnn, np.float32, 1e-5, "adam", 0.02),
    "resnet": (resnet, np.float32, 1e-5, "adam", 0.02),
    "transformer": (transformer, np.float64, 1e-5, "adam", 0.02),
    "lstm": (lstm, np.float32, 1e-5, "adam", 0.03),
}
#: Gradient checks run with Dropout off (ratio 0): a training-mode mask is
#: random at every run, which finite differences cannot follow.  The mask's
#: own gradient is checked in test_dropout_training_mode_gradient_is_mask.
CHECK_KWARGS = {"cnn": {"dropout": 0.0}}


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_gradients(name):
    make, dtype, rtol, _, _ = ZOO[name]
    check_gradients(make, dtype, rtol, **CHECK_KWARGS.get(name, {}))


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_trains(name):
    make, dtype, _, optimizer, lr = ZOO[name]
    session, net, losses = train(make, dtype, optimizer, lr)
    assert_falls(losses)
    # inference (R10): the main graph with the trained state, no state change
    before = dict(session.state)
    out = session.run({k: v for k, v in net.feeds.items() if k in session.inference_inputs})
    assert all(np.isfinite(v).all() for v in out.values())
    for k, v in session.state.items():
        np.testing.assert_array_equal(v, before[k])
    for key, _ in net.buffer_updates:  # running statistics moved, through update_binding
        assert not np.allclose(session.state[key], net.buffers[key]), key


# ====================================================================== old opsets
OLD_OPSETS = [
    7,
    9, 11, 12,
]


def mlp_mse(dtype=np.float64, batch: int = 16, opset: int = 9) -> Net:
    """The MLP with a mean squared error written in opset-7 ops."""
    net = mlp(dtype, batch, opset)
    rng = np.random.default_rng(5)
    target = rng.standard_normal((batch, 3)).astype(dtype)
    net.train = [node("Sub", ["logits", "T"], ["err"]), node("Mul", ["err", "err"], ["sq"]),
                 node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    net.target = vi("T", elem(dtype), ["N", 3])
    net.feeds = {"X": net.feeds["X"], "T": target}
    return net


@pytest.mark.parametrize("opset", OLD_OPSETS)
def test_old_opset_mlp_trains(opset):
    session, net, losses = train(mlp_mse, np.float64, "sgd", 0.1, opset=opset)
    assert_falls(losses, 0.8)
    check_gradients(mlp_mse, np.float64, 1e-6, opset=opset)


# ====================================================================== peer regressions
def _gradient_model(nodes, inputs, wrt, opset=20, outputs_extra=()):
    """A main-graph Gradient (as ONNX's conformance cases write it) of 'loss'."""
    grads = [f"grad_{x}" for x in wrt]
    graph = helper.make_graph(
        list(nodes) + [node("Gradient", wrt, grads, domain=PREVIEW, xs=wrt, y="loss")], "g", inputs,
        [vi("loss", TensorProto.DOUBLE, [])] + [vi(g, TensorProto.DOUBLE, None) for g in grads]
        + list(outputs_extra),
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW, 1)]
    )


def test_gelu_tanh_gradient_is_exact_at_float64():
    """Gelu(approximate='tanh'): the gradient equals the closed-form derivative
    to float64 rounding (peers approximate or drop to float32)."""
    x = np.linspace(-6, 6, 241)
    r = np.random.default_rng(0).standard_normal(x.shape)
    nodes = [node("Gelu", ["x"], ["y"], approximate="tanh"), node("Mul", ["y", "r"], ["w"]),
             node("ReduceSum", ["w"], ["loss"], keepdims=0)]
    model = _gradient_model(nodes, [vi("x", TensorProto.DOUBLE, [241]), vi("r", TensorProto.DOUBLE, [241])],
                            ["x"])
    out = TrainingSession(model).run({"x": x, "r": r})
    # the closed-form derivative in extended precision (80-bit long double)
    xl, rl = x.astype(np.longdouble), r.astype(np.longdouble)
    c, a = np.sqrt(np.longdouble(2) / np.longdouble(np.pi)), np.longdouble("0.044715")
    t = np.tanh(c * (xl + a * xl**3))
    expected = rl * ((1 + t) / 2 + xl * (1 - t * t) * c * (1 + 3 * a * xl**2) / 2)
    assert out["grad_x"].dtype == np.float64
    # a few ulps of the O(1) terms (an erf-based derivative is off by 2e-3 here)
    err = np.abs(out["grad_x"] - expected.astype(np.float64))
    assert np.all(err <= 3e-14 * np.abs(r)), err.max()


@pytest.mark.parametrize("op", ["Floor", "Round", "Sign"])
def test_zero_gradient_ops_are_accepted(op):
    """Floor/Round/Sign on the path: accepted, gradient 0 through them (not
    refused, not an error); the smooth branch keeps its gradient."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    r = rng.standard_normal((4, 2))
    nodes = [node("MatMul", ["x", "W"], ["y"]), node(op, ["y"], ["q"]), node("Add", ["y", "q"], ["z"]),
             node("Mul", ["z", "r"], ["zr"]), node("ReduceSum", ["zr"], ["loss"], keepdims=0)]
    inputs = [vi("x", TensorProto.DOUBLE, [4, 3]), vi("W", TensorProto.DOUBLE, [3, 2]),
              vi("r", TensorProto.DOUBLE, [4, 2])]
    out = TrainingSession(_gradient_model(nodes, inputs, ["W"])).run({"x": x, "W": w, "r": r})
    np.testing.assert_allclose(out["grad_W"], x.T @ r, rtol=1e-12)
    only = [node("MatMul", ["x", "W"], ["y"]), node(op, ["y"], ["q"]), node("Mul", ["q", "r"], ["qr"]),
            node("ReduceSum", ["qr"], ["loss"], keepdims=0)]
    out = TrainingSession(_gradient_model(only, inputs, ["W"])).run({"x": x, "W": w, "r": r})
    np.testing.assert_array_equal(out["grad_W"], np.zeros((3, 2)))


def test_batchnorm_training_mode_gradient():
    """BatchNormalization(training_mode=1) in the algorithm graph: gradients of
    x's producer, scale and bias match finite differences (the CNN and ResNet
    checks above cover it inside networks; this one is float64 end to end)."""

    def make(dtype=np.float64):
        rng = np.random.default_rng(6)
        et = elem(dtype)
        params = {"W": rng.standard_normal((3, 4)), "s": 1 + 0.1 * rng.standard_normal(4),
                  "b": 0.1 * rng.standard_normal(4)}
        x = rng.standard_normal((10, 3))
        train_nodes = [node("MatMul", ["X", "W"], ["h"]),
                       node("BatchNormalization", ["h", "s", "b", "mean", "var"], ["t_y", "t_mean", "t_var"],
                            training_mode=1),
                       node("Mul", ["t_y", "t_y"], ["sq"]), node("Mul", ["sq", "T"], ["wsq"]),
                       node("ReduceMean", ["wsq"], ["loss"], keepdims=0)]
        return Net(
            [node("MatMul", ["X", "W"], ["h_inf"]),
             node("BatchNormalization", ["h_inf", "s", "b", "mean", "var"], ["Y"])],
            [vi("X", et, ["N", 3])], [vi("Y", et, ["N", 4])],
            {k: np.asarray(v, dtype) for k, v in params.items()}, train_nodes, vi("T", et, ["N", 4]),
            {"X": x.astype(dtype), "T": rng.standard_normal((10, 4)).astype(dtype)},
            {"mean": np.zeros(4, dtype), "var": np.ones(4, dtype)},
            [("mean", "t_mean"), ("var", "t_var")], opset=15,
        )

    check_gradients(make, np.float64, 1e-6)


def test_dropout_training_mode_gradient_is_mask():
    """Dropout(training_mode=True): d loss / d W = X^T (R * mask) / (1 - ratio),
    with the mask the forward pass drew (returned by the same train_step)."""
    rng = np.random.default_rng(8)
    ratio = 0.4
    x, w = rng.standard_normal((6, 3)), rng.standard_normal((3, 5))
    r = rng.standard_normal((6, 5))
    et = TensorProto.DOUBLE
    train_nodes = [node("MatMul", ["X", "W"], ["h"]), node("Dropout", ["h", "ratio", "training"], ["d", "mask"]),
                   node("Mul", ["d", "R"], ["dr"]), node("ReduceSum", ["dr"], ["loss"], keepdims=0)]
    net = Net([node("MatMul", ["X", "W"], ["Y"])], [vi("X", et, ["N", 3])], [vi("Y", et, ["N", 5])],
              {"W": w}, train_nodes, vi("R", et, ["N", 5]), {"X": x, "R": r},
              consts={"ratio": np.asarray(ratio), "training": np.asarray(True)}, opset=15)
    model = training_model(net, "sgd", lr=0.0)
    model.training_info[0].algorithm.output.append(vi("mask", TensorProto.BOOL, ["N", 5]))
    out = TrainingSession(model).train_step(net.feeds)
    mask = out["mask"]
    assert 0 < mask.sum() < mask.size
    np.testing.assert_allclose(out["grad_W"], x.T @ (r * mask) / (1 - ratio), rtol=1e-12)


def test_det_gradient_is_exact_not_a_silent_zero():
    """A peer returns a silent 0 for Det.  onnxtrain differentiates it:
    d det(A) / dA = det(A) * inv(A)^T, checked against numpy for a batch
    (float32: onnxruntime has no float64 Det kernel)."""
    et = TensorProto.FLOAT
    a = np.random.default_rng(9).standard_normal((2, 3, 3)).astype(np.float32)
    train_nodes = [node("Mul", ["A", "X"], ["AX"]), node("Det", ["AX"], ["det"]),
                   node("Mul", ["det", "T"], ["dt"]), node("ReduceSum", ["dt"], ["loss"], keepdims=0)]
    net = Net([node("Mul", ["A", "X"], ["Y"])], [vi("X", et, [1])], [vi("Y", et, [2, 3, 3])],
              {"A": a}, train_nodes, vi("T", et, [2]),
              {"X": np.ones(1, np.float32), "T": np.ones(2, np.float32)}, opset=17)
    lr = 0.1
    session = TrainingSession(training_model(net, "sgd", lr))
    session.train_step({"X": np.ones(1, np.float32), "T": np.ones(2, np.float32)})
    a64 = a.astype(np.float64)
    expected_grad = np.linalg.det(a64)[:, None, None] * np.linalg.inv(a64).transpose(0, 2, 1)
    np.testing.assert_allclose(session.state["A"], a64 - lr * expected_grad, rtol=1e-5, atol=1e-6)


LOSSES = {
    "SoftmaxCrossEntropyLoss": lambda: [node("SoftmaxCrossEntropyLoss", ["logits", "label"], ["loss"])],
    "NegativeLogLikelihoodLoss": lambda: [
        node("LogSoftmax", ["logits"], ["logp"], axis=1),
        node("NegativeLogLikelihoodLoss", ["logp", "label"], ["loss"], reduction="mean")],
    "MeanSquaredError": lambda: [
        node("Sub", ["logits", "T"], ["err"]), node("Mul", ["err", "err"], ["sq"]),
        node("ReduceMean", ["sq"], ["loss"], keepdims=0)],
}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_losses_with_symbolic_batch(loss):
    """Losses over a symbolic batch dimension ('N'): one session trains and
    differentiates batches of 16, 5 and 1 rows; gradients match finite
    differences at each size."""

    def make(dtype=np.float64, batch=16):
        net = mlp_mse(dtype, batch, opset=17) if loss == "MeanSquaredError" else mlp(dtype, batch)
        net.train = LOSSES[loss]()
        return net

    net = make()
    session = TrainingSession(training_model(net, "sgd", lr=0.0))
    for batch in (16, 5, 1):
        feeds = make(batch=batch).feeds
        check_gradients(make, np.float64, 1e-6, session=session, feeds=feeds)
    trainer = TrainingSession(training_model(net, "sgd", lr=0.5))
    losses = []
    for step in range(STEPS):
        feeds = make(batch=(16, 5, 9)[step % 3]).feeds
        losses.append(float(trainer.train_step(feeds)["loss"]))
    assert_falls(losses[::3], 0.8)
