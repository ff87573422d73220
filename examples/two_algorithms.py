"""Two TrainingInfoProtos interleaved: the hidden layer with momentum SGD, the head with Adam.

An ONNX training model may hold several TrainingInfoProtos, each with its own
algorithm graph and update_binding.  Here, written by hand with onnx.helper:

- training_info[0]  loss -> Gradient(xs=[W1, b1]) -> Momentum -> W1, b1, their velocities, step0
- training_info[1]  loss -> Gradient(xs=[W2, b2]) -> Adam     -> W2, b2, their moments, step1

``train_step(feeds)`` runs both in order (one spec "iteration");
``train_step(feeds, algorithm=i)`` runs one.  ``fit`` follows the metadata
``onnxtrain.cycle``: ``[0, 1]`` alternates them batch after batch.

    python examples/two_algorithms.py            # 10 epochs
    python examples/two_algorithms.py --quick    # 2 epochs
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import onnx
from inference_models import mlp
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession
from onnxtrain.datasets import load_digits, train_test_split

PREVIEW = "ai.onnx.preview.training"


def tensor(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def training_info(model: onnx.ModelProto, params: list[str], counter: str, optimizer: str,
                  lr: float) -> onnx.TrainingInfoProto:
    """loss -> Gradient over ``params`` -> ``optimizer`` -> counter + 1, with an initialization."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    slots = {"Momentum": ["V"], "Adam": ["V", "H"]}[optimizer]
    state = [f"{p}.{s}" for s in slots for p in params]
    grads = [f"{p}.grad" for p in params]
    new = {name: f"{name}.new" for name in params + state}
    nodes = [
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "label"], ["loss"]),
        helper.make_node("Gradient", params + ["X", "label"], grads, domain=PREVIEW,
                         xs=params, zs=["X", "label"], y="loss"),
        helper.make_node("Add", [counter, "one"], [f"{counter}.new"]),
    ]
    if optimizer == "Momentum":  # R, T, X..., G..., V...
        nodes.append(helper.make_node(
            "Momentum", ["lr", counter] + params + grads + state, [new[n] for n in params + state],
            domain=PREVIEW, alpha=0.9, beta=1.0, mode="standard", norm_coefficient=0.0))
    else:  # Adam with T = counter + 1: bias correction from the first step on
        nodes.append(helper.make_node(
            "Adam", ["lr", f"{counter}.new"] + params + grads + state,
            [new[n] for n in params + state], domain=PREVIEW,
            alpha=0.9, beta=0.999, epsilon=1e-8, norm_coefficient=0.0))
    shapes = {p: values[p].shape for p in params}
    shapes.update({s: values[s.split(".")[0]].shape for s in state})
    inits = [tensor("lr", np.float32(lr)), tensor("one", np.int64(1)),
             tensor(counter, np.int64(0))] + [tensor(s, np.zeros(shapes[s], np.float32)) for s in state]
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    outputs += [helper.make_tensor_value_info(new[n], TensorProto.FLOAT, shapes[n])
                for n in params + state]
    outputs.append(helper.make_tensor_value_info(f"{counter}.new", TensorProto.INT64, []))
    ti = onnx.TrainingInfoProto()
    ti.algorithm.CopyFrom(helper.make_graph(
        nodes, f"train_{counter}",
        [helper.make_tensor_value_info("label", TensorProto.INT64, ["N"])], outputs, inits))
    for name in params + state + [counter]:
        ti.update_binding.add(key=name, value=f"{name}.new")
    # Initialization: parameters back to their starting values, the rest to zero.
    start = {p: values[p] for p in params}
    start.update({s: np.zeros(shapes[s], np.float32) for s in state})
    start[counter] = np.int64(0)
    init_nodes, init_outputs = [], []
    for name, value in start.items():
        init_nodes.append(helper.make_node("Constant", [], [f"{name}.init"],
                                           value=tensor(f"{name}.start", value)))
        init_outputs.append(helper.make_tensor_value_info(
            f"{name}.init", helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype),
            list(np.shape(value))))
        ti.initialization_binding.add(key=name, value=f"{name}.init")
    ti.initialization.CopyFrom(helper.make_graph(init_nodes, f"init_{counter}", [], init_outputs))
    return ti


def build_model() -> onnx.ModelProto:
    model = mlp(hidden=64)
    model.opset_import.append(helper.make_opsetid(PREVIEW, 1))
    model.ir_version = 10
    model.training_info.append(training_info(model, ["W1", "b1"], "step0", "Momentum", lr=0.05))
    model.training_info.append(training_info(model, ["W2", "b2"], "step1", "Adam", lr=0.01))
    for key, value in {"target": "label", "loss": "loss", "cycle": [0, 1]}.items():
        model.metadata_props.add(key=f"onnxtrain.{key}", value=json.dumps(value))
    onnx.checker.check_model(model)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (2 epochs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    epochs = 2 if args.quick else 10

    X, y = load_digits()
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2, seed=0)
    sess = TrainingSession(build_model())
    print(sess)

    batch = {"X": X_train[:32], "label": y_train[:32]}
    sess.train_step(batch)              # one spec iteration: training_info[0] then [1]
    sess.train_step(batch, algorithm=1)  # the head alone
    print(f"after train_step(batch) and train_step(batch, algorithm=1): "
          f"step0 = {int(sess.state['step0'])}, step1 = {int(sess.state['step1'])}")
    sess.initialize()                   # both initialization graphs: a fresh start

    history = sess.fit(X_train, y_train, epochs=epochs, batch_size=32,
                       validation_data=(X_test, y_test),
                       progress=not (args.quick or args.no_progress))
    print(f"fit with cycle [0, 1]: {history.steps} batches -> step0 = {int(sess.state['step0'])}, "
          f"step1 = {int(sess.state['step1'])}")
    print(f"test accuracy after {epochs} epochs: {history['val_accuracy'][-1]:.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
