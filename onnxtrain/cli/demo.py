"""A complete ONNX training model built by hand, and a demo that trains it on digits.

``build_classifier`` writes a standard training model with ``onnx.helper``
only; nothing in it is specific to onnxtrain, so any runtime that implements
TrainingInfoProto could train it:

- main graph      ``X -> Gemm -> Relu -> Gemm -> logits``  (batch dimension ``N``)
- algorithm       ``SoftmaxCrossEntropyLoss(logits, label) -> loss``,
                  ``Gradient(xs=[W1, b1, W2, b2], zs=[X, label], y=loss)``,
                  ``Adam`` (``ai.onnx.preview.training``) with its V/H state,
                  and an int64 step counter; update_binding writes back every
                  parameter, every V/H and the counter
- initialization  Constant/ConstantOfShape nodes that reset every state
                  variable to the model's starting point (seeded He-normal
                  weights, zero biases, zero V/H, counter 0)

``run_demo`` trains it with mini-batch ``TrainingSession.train_step`` on the
bundled 8x8 digits and exports the trained inference model.

>>> model = build_classifier(hidden=8)
>>> [n.op_type for n in model.graph.node]
['Gemm', 'Relu', 'Gemm']
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..session import TrainingSession
from ..train.datasets import load_digits, train_test_split

__all__ = ["build_classifier", "run_demo", "demo_steps"]

PREVIEW_DOMAIN = "ai.onnx.preview.training"

#: Defaults of run_demo, chosen so that the demo reaches >= 95% test accuracy
#: in a few seconds on two CPU cores.
DEFAULT_EPOCHS = 15
DEFAULT_BATCH_SIZE = 32
DEFAULT_LR = 0.01
TEST_FRACTION = 0.2

#: Adam's attributes (the spec's names).  epsilon is added to sqrt(H).
ADAM_ATTRS = dict(alpha=0.9, beta=0.999, epsilon=1e-7, norm_coefficient=0.0)

PARAMS = ("W1", "b1", "W2", "b2")
#: Adam's moments, named as onnxtrain.build names them (V: first, H: second).
MOMENTS_V = [f"{p}.adam_m" for p in PARAMS]
MOMENTS_H = [f"{p}.adam_v" for p in PARAMS]
#: The state variables in binding order: the parameters, V, H and the counter.
STATE = list(PARAMS) + MOMENTS_V + MOMENTS_H + ["step"]


def _tensor(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _initial_params(n_in: int, hidden: int, n_out: int, seed: int) -> dict[str, np.ndarray]:
    """He-normal weights for the Relu layer, Glorot-normal for the output layer, zero biases.

    std(W1) = sqrt(2 / n_in) keeps the variance of the Relu pre-activations
    near that of the inputs; std(W2) = sqrt(2 / (hidden + n_out)) does the
    same for the logits."""
    rng = np.random.default_rng(seed)
    return {
        "W1": (rng.standard_normal((n_in, hidden)) * math.sqrt(2.0 / n_in)).astype(np.float32),
        "b1": np.zeros((hidden,), np.float32),
        "W2": (rng.standard_normal((hidden, n_out)) * math.sqrt(2.0 / (hidden + n_out))).astype(
            np.float32
        ),
        "b2": np.zeros((n_out,), np.float32),
    }


def build_classifier(
    n_in: int = 64,
    hidden: int = 64,
    n_out: int = 10,
    lr: float = DEFAULT_LR,
    seed: int = 0,
) -> onnx.ModelProto:
    """A two-layer Relu classifier as an ONNX training model (Adam, mean cross-entropy).

    Inputs: ``X`` float32 [N, n_in]; the algorithm also reads ``label`` int64 [N].
    Output: ``logits`` float32 [N, n_out].  State variables: W1, b1, W2, b2,
    their Adam moments ``<p>.adam_m`` (the spec's V) and ``<p>.adam_v`` (H), and the int64 counter ``step``.

    The counter holds the number of finished updates.  Adam receives
    ``T = step + 1``, the 1-based index of the update it is making, so its
    bias correction ``R * sqrt(1 - beta**T) / (1 - alpha**T)`` is the usual
    one from the first step on (the spec skips the correction only at T = 0).

    >>> m = build_classifier(n_in=4, hidden=3, n_out=2)
    >>> onnx.checker.check_model(m)
    >>> [b.key for b in m.training_info[0].update_binding][:4]
    ['W1', 'b1', 'W2', 'b2']
    """
    for name, value in (("n_in", n_in), ("hidden", hidden), ("n_out", n_out)):
        if int(value) < 1:
            raise ValueError(f"build_classifier: {name} must be >= 1, got {value!r}")
    if not lr > 0:
        raise ValueError(f"build_classifier: lr must be > 0, got {lr!r}")
    params = _initial_params(n_in, hidden, n_out, seed)
    info = onnx.TrainingInfoProto()
    info.algorithm.CopyFrom(_algorithm_graph(params, lr))
    info.initialization.CopyFrom(_initialization_graph(params))
    for key in STATE:
        info.update_binding.add(key=key, value=f"{key}_new")
    for key in STATE:
        info.initialization_binding.add(key=key, value=f"{key}_init")

    model = helper.make_model(
        _main_graph(params, n_in, n_out),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW_DOMAIN, 1)],
        producer_name="onnxtrain.demo",
        doc_string="Two-layer Relu classifier trained with Adam on mean softmax cross-entropy.",
    )
    model.ir_version = 10
    model.training_info.append(info)
    return model


def _main_graph(params: dict[str, np.ndarray], n_in: int, n_out: int) -> onnx.GraphProto:
    """The inference graph: X -> Gemm -> Relu -> Gemm -> logits, the parameters its initializers."""
    f32 = TensorProto.FLOAT
    return helper.make_graph(
        [
            helper.make_node("Gemm", ["X", "W1", "b1"], ["hidden_pre"], name="dense1"),
            helper.make_node("Relu", ["hidden_pre"], ["hidden"], name="relu1"),
            helper.make_node("Gemm", ["hidden", "W2", "b2"], ["logits"], name="dense2"),
        ],
        "digits_mlp",
        [helper.make_tensor_value_info("X", f32, ["N", n_in])],
        [helper.make_tensor_value_info("logits", f32, ["N", n_out])],
        [_tensor(name, value) for name, value in params.items()],
    )


def _algorithm_graph(params: dict[str, np.ndarray], lr: float) -> onnx.GraphProto:
    """One training step: the loss, its Gradient, the counter and Adam, which write ``<state>_new``."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    grads = [f"{p}_grad" for p in PARAMS]
    new_state = [f"{s}_new" for s in STATE[:-1]]  # the parameters', then V's, then H's
    algorithm_nodes = [
        helper.make_node(
            "SoftmaxCrossEntropyLoss", ["logits", "label"], ["loss"], name="loss",
            reduction="mean",
        ),
        # Gradient's inputs are the points of evaluation: the current xs then zs.
        helper.make_node(
            "Gradient", list(PARAMS) + ["X", "label"], grads, name="gradient",
            domain=PREVIEW_DOMAIN, xs=list(PARAMS), zs=["X", "label"], y="loss",
        ),
        helper.make_node("Add", ["step", "one"], ["step_new"], name="count_step"),
        # Adam's variadic inputs: R, T, X1..Xn, G1..Gn, V1..Vn, H1..Hn.
        helper.make_node(
            "Adam", ["learning_rate", "step_new"] + list(PARAMS) + grads + MOMENTS_V + MOMENTS_H,
            new_state, name="adam", domain=PREVIEW_DOMAIN, **ADAM_ATTRS,
        ),
    ]
    algorithm_initializers = (
        [
            _tensor("learning_rate", np.float32(lr)),
            _tensor("step", np.int64(0)),
            _tensor("one", np.int64(1)),
        ]
        + [_tensor(v, np.zeros_like(params[p])) for v, p in zip(MOMENTS_V, PARAMS)]
        + [_tensor(h, np.zeros_like(params[p])) for h, p in zip(MOMENTS_H, PARAMS)]
    )
    state_shapes = [list(params[p].shape) for p in PARAMS] * 3
    return helper.make_graph(
        algorithm_nodes,
        "digits_mlp_adam",
        [helper.make_tensor_value_info("label", i64, ["N"])],
        [helper.make_tensor_value_info("loss", f32, [])]
        + [helper.make_tensor_value_info(name, f32, shape) for name, shape in zip(new_state, state_shapes)]
        + [helper.make_tensor_value_info("step_new", i64, [])],
        algorithm_initializers,
    )


def _initialization_graph(params: dict[str, np.ndarray]) -> onnx.GraphProto:
    """The state's starting values, ``<state>_init``.

    Parameters come back to the seeded starting point (Constant), so that
    initialize() is reproducible; moments are zeros of their parameter's
    shape (ConstantOfShape keeps the model small); the counter restarts at 0."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    shapes = {name: list(value.shape) for name, value in params.items()}
    init_nodes, init_outputs = [], []
    for p in PARAMS:
        init_nodes.append(helper.make_node("Constant", [], [f"{p}_init"], name=f"init_{p}",
                                           value=_tensor(f"{p}_start", params[p])))
        init_outputs.append(helper.make_tensor_value_info(f"{p}_init", f32, shapes[p]))
    for moment, p in zip(MOMENTS_V + MOMENTS_H, PARAMS + PARAMS):
        init_nodes += [
            helper.make_node("Constant", [], [f"{moment}_shape"], name=f"shape_{moment}",
                             value=_tensor(f"{moment}_dims", np.array(shapes[p], np.int64))),
            helper.make_node("ConstantOfShape", [f"{moment}_shape"], [f"{moment}_init"],
                             name=f"init_{moment}", value=_tensor("zero", np.zeros(1, np.float32))),
        ]
        init_outputs.append(helper.make_tensor_value_info(f"{moment}_init", f32, shapes[p]))
    init_nodes.append(helper.make_node("Constant", [], ["step_init"], name="init_step",
                                       value=_tensor("step_start", np.int64(0))))
    init_outputs.append(helper.make_tensor_value_info("step_init", i64, []))
    return helper.make_graph(init_nodes, "digits_mlp_init", [], init_outputs)


def demo_steps(epochs: int, batch_size: int, n_samples: int = 1797) -> int:
    """The number of train_step calls run_demo makes: epochs * ceil(n_train / batch_size).

    >>> demo_steps(1, 32)
    45
    """
    n_test = min(max(int(round(n_samples * TEST_FRACTION)), 1), n_samples - 1)
    return epochs * math.ceil((n_samples - n_test) / batch_size)


def run_demo(
    epochs: int = DEFAULT_EPOCHS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    out_path: str | os.PathLike | None = "digits_mlp.onnx",
    seed: int = 0,
    progress: Callable[[int, int, float], object] | None = None,
    lr: float = DEFAULT_LR,
) -> dict:
    """Train the digits classifier with Adam, report test accuracy, export the model.

    Splits the 1797 digits 80/20 (``seed``), runs ``epochs`` passes of
    shuffled mini-batches through ``TrainingSession.train_step``, then
    predicts the test set with ``TrainingSession.run`` (argmax of the logits)
    and writes the trained inference model to ``out_path`` (skipped when it
    is None).  ``progress(epoch, step, loss)`` is called after every step,
    with the 1-based epoch, the 1-based global step and the batch loss.

    Returns ``accuracy`` (test, 0..1), ``final_loss`` (mean training loss of
    the last epoch), ``steps``, ``seconds`` (wall time of the whole call),
    ``path`` (a Path or None), ``train_size`` and ``test_size``.

    >>> result = run_demo(epochs=1, out_path=None)
    >>> result["steps"], result["accuracy"] > 0.8
    (45, True)
    """
    if int(epochs) < 1:
        raise ValueError(f"run_demo: epochs must be >= 1, got {epochs!r}")
    if int(batch_size) < 1:
        raise ValueError(f"run_demo: batch_size must be >= 1, got {batch_size!r}")
    start = time.perf_counter()
    X, y = load_digits()
    X_train, X_test, y_train, y_test = train_test_split(X, y, TEST_FRACTION, seed)
    sess = TrainingSession(build_classifier(n_in=X.shape[1], n_out=10, lr=lr, seed=seed))

    order_rng = np.random.default_rng(seed + 1)
    step = 0
    epoch_loss = float("nan")
    for epoch in range(1, int(epochs) + 1):
        order = order_rng.permutation(len(X_train))
        total, count = 0.0, 0
        for begin in range(0, len(order), int(batch_size)):
            batch = order[begin:begin + int(batch_size)]
            out = sess.train_step({"X": X_train[batch], "label": y_train[batch]})
            loss = float(out["loss"])
            # Weight each batch by its size, so the epoch loss is a per-sample mean.
            total += loss * len(batch)
            count += len(batch)
            step += 1
            if progress is not None:
                progress(epoch, step, loss)
        epoch_loss = total / count

    logits = sess.run({"X": X_test}, ["logits"])["logits"]
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    path = sess.export(out_path) if out_path is not None else None
    return {
        "accuracy": accuracy,
        "final_loss": epoch_loss,
        "steps": step,
        "seconds": time.perf_counter() - start,
        "path": Path(path) if path is not None else None,
        "train_size": len(X_train),
        "test_size": len(X_test),
    }
