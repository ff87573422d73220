"""Train an MLP on the bundled 8x8 digits, export it, and check it in plain onnxruntime.

``onnxtrain.demo.build_classifier`` writes a standard ONNX training model
(Gemm -> Relu -> Gemm; SoftmaxCrossEntropyLoss -> Gradient -> Adam in its
TrainingInfoProto).  This script trains it with ``TrainingSession``, exports
the trained inference model, loads that file in an ordinary
``onnxruntime.InferenceSession`` and confirms that it predicts exactly what
the training session predicts.

    python examples/mlp_digits.py            # 15 epochs
    python examples/mlp_digits.py --quick    # 2 epochs
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import onnxtrain
from onnxtrain.datasets import load_digits, train_test_split
from onnxtrain.demo import DEFAULT_BATCH_SIZE, DEFAULT_EPOCHS, DEFAULT_LR, build_classifier


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (2 epochs)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (this example shows none anyway)")
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"passes over the data (default {DEFAULT_EPOCHS})")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("-o", "--output", default=None,
                        help="where to write the inference model (default: a temporary folder)")
    args = parser.parse_args(argv)
    epochs = args.epochs or (2 if args.quick else DEFAULT_EPOCHS)

    X, y = load_digits()
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2, seed=0)
    print(f"digits: {len(X_train)} for training, {len(X_test)} for testing")

    sess = onnxtrain.TrainingSession(build_classifier(hidden=64, lr=DEFAULT_LR, seed=0))
    rng = np.random.default_rng(1)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(X_train))
        losses = []
        for begin in range(0, len(order), args.batch_size):
            rows = order[begin:begin + args.batch_size]
            out = sess.train_step({"X": X_train[rows], "label": y_train[rows]})
            losses.append(float(out["loss"]))
        print(f"epoch {epoch:2d}  mean batch loss {np.mean(losses):.4f}")
    print(f"trained {int(sess.state['step'])} steps in {time.perf_counter() - start:.1f} s")

    logits = sess.run({"X": X_test})["logits"]
    predicted = logits.argmax(axis=1)
    print(f"test accuracy: {np.mean(predicted == y_test):.2%}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.output) if args.output else Path(tmp) / "digits_mlp.onnx"
        sess.export(path)
        plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        (plain_logits,) = plain.run(["logits"], {"X": X_test})
    same = np.array_equal(plain_logits.argmax(axis=1), predicted)
    max_diff = float(np.max(np.abs(plain_logits - logits)))
    print(f"exported model in plain onnxruntime: identical predictions: {same} "
          f"(max |logit difference| {max_diff:.2e})")
    if args.output:
        print(f"wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
