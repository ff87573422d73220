"""Fit y = X w + b with a hand-built ONNX training model (Gradient + Momentum).

The whole training recipe lives in the model, written with onnx.helper:

- main graph      Y = MatMul(X, W) + B
- algorithm       loss = mean((Y - T)^2)
                  dW, dB = Gradient(xs=[W, B], zs=[X, T], y=loss)
                  W', B', VW', VB' = Momentum(lr, step, W, B, dW, dB, VW, VB)
                  step' = step + 1
- update_binding  W <- W', B <- B', VW <- VW', VB <- VB', step <- step'

onnxtrain runs it on onnxruntime; this script only feeds mini-batches.

    python examples/linear_regression.py            # 300 steps
    python examples/linear_regression.py --quick    # 60 steps
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

PREVIEW = "ai.onnx.preview.training"
TRUE_W = np.array([[2.0], [-3.0], [0.5]], np.float32)
TRUE_B = np.float32(1.25)


def build_model(n_features: int, lr: float) -> onnx.ModelProto:
    """The linear model plus one TrainingInfoProto that trains it with momentum SGD."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64

    def tensor(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    main = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]),
         helper.make_node("Add", ["XW", "B"], ["Y"])],
        "linear",
        [helper.make_tensor_value_info("X", f32, ["N", n_features])],
        [helper.make_tensor_value_info("Y", f32, ["N", 1])],
        [tensor("W", np.zeros((n_features, 1), np.float32)), tensor("B", np.zeros((1,), np.float32))],
    )
    algorithm = helper.make_graph(
        [
            helper.make_node("Sub", ["Y", "T"], ["error"]),
            helper.make_node("Mul", ["error", "error"], ["squared"]),
            helper.make_node("ReduceMean", ["squared"], ["loss"], keepdims=0),
            helper.make_node("Gradient", ["W", "B", "X", "T"], ["dW", "dB"], domain=PREVIEW,
                             xs=["W", "B"], zs=["X", "T"], y="loss"),
            # Momentum's inputs: R, T, X1, X2, G1, G2, V1, V2.
            helper.make_node("Momentum", ["lr", "step", "W", "B", "dW", "dB", "VW", "VB"],
                             ["W_new", "B_new", "VW_new", "VB_new"], domain=PREVIEW,
                             alpha=0.9, beta=1.0, mode="standard", norm_coefficient=0.0),
            helper.make_node("Add", ["step", "one"], ["step_new"]),
        ],
        "momentum_sgd",
        [helper.make_tensor_value_info("T", f32, ["N", 1])],
        [helper.make_tensor_value_info("loss", f32, []),
         helper.make_tensor_value_info("W_new", f32, [n_features, 1]),
         helper.make_tensor_value_info("B_new", f32, [1]),
         helper.make_tensor_value_info("VW_new", f32, [n_features, 1]),
         helper.make_tensor_value_info("VB_new", f32, [1]),
         helper.make_tensor_value_info("step_new", i64, [])],
        [tensor("lr", np.float32(lr)), tensor("step", np.int64(0)), tensor("one", np.int64(1)),
         tensor("VW", np.zeros((n_features, 1), np.float32)), tensor("VB", np.zeros((1,), np.float32))],
    )
    info = onnx.TrainingInfoProto()
    info.algorithm.CopyFrom(algorithm)
    for key in ("W", "B", "VW", "VB", "step"):
        info.update_binding.add(key=key, value=f"{key}_new")
    model = helper.make_model(
        main, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW, 1)]
    )
    model.ir_version = 10
    model.training_info.append(info)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (60 steps)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (this example shows none anyway)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 300)")
    args = parser.parse_args(argv)
    steps = args.steps or (60 if args.quick else 300)

    rng = np.random.default_rng(0)
    X = rng.standard_normal((512, 3)).astype(np.float32)
    T = (X @ TRUE_W + TRUE_B + 0.05 * rng.standard_normal((512, 1))).astype(np.float32)

    sess = onnxtrain.TrainingSession(build_model(n_features=3, lr=0.02))
    batch = 64
    for step in range(1, steps + 1):
        rows = rng.integers(0, len(X), batch)
        loss = float(sess.train_step({"X": X[rows], "T": T[rows]})["loss"])
        if step == 1 or step % max(steps // 10, 1) == 0:
            print(f"step {step:4d}  loss {loss:.5f}")

    w, b = sess.state["W"].ravel(), sess.state["B"].ravel()
    print(f"fitted w = {np.array2string(w, precision=3)}  b = {b[0]:.3f}")
    print(f"true   w = {np.array2string(TRUE_W.ravel(), precision=3)}  b = {TRUE_B:.3f}")
    full = float(np.mean((sess.run({"X": X})["Y"] - T) ** 2))
    print(f"mean squared error on all {len(X)} samples: {full:.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
