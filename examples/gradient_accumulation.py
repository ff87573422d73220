"""Gradient accumulation: 4 micro-batches of 16 make the same update as one batch of 64.

``build.training_model(..., accumulate=4)`` writes two TrainingInfoProtos:

- training_info[0] adds the micro-batch gradient into a sum kept in the state;
- training_info[1] adds its own and applies the optimizer to the mean,

and the metadata ``onnxtrain.cycle = [0, 0, 0, 1]`` tells ``fit`` to run them
in that order, batch after batch (you can also call ``train_step(algorithm=i)``
yourself).  With plain SGD the result equals large-batch training up to float
rounding, which this script checks; then it trains a real model with Adam.

    python examples/gradient_accumulation.py            # 1 epoch check + 10 epochs Adam
    python examples/gradient_accumulation.py --quick    # 1 epoch check + 2 epochs Adam
"""

from __future__ import annotations

import argparse

import numpy as np
from inference_models import mlp

from onnxtrain import TrainingSession, build
from onnxtrain.datasets import load_digits, train_test_split


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    X, y = load_digits()
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2, seed=0)
    # 1408 = 22 * 64 rows, so that every big batch is exactly four micro-batches.
    data = (X_train[:1408], y_train[:1408])

    def sgd(accumulate: int) -> TrainingSession:
        return TrainingSession(build.training_model(
            mlp(hidden=32), loss="cross_entropy", target="label",
            optimizer=build.SGD(lr=0.1), accumulate=accumulate))

    big = sgd(1)
    big.fit(data, epochs=1, batch_size=64, progress=False)
    micro = sgd(4)
    print(micro)
    micro.fit(data, epochs=1, batch_size=16, progress=False)  # the same shuffled order
    diff = max(float(np.max(np.abs(big.state[p] - micro.state[p]))) for p in ("W1", "b1", "W2", "b2"))
    print(f"updates: {int(big.state['step'])} with batches of 64, "
          f"{int(micro.state['step'])} with 4 x 16 accumulated")
    print(f"max |parameter difference| after one epoch: {diff:.2e}")

    epochs = 2 if args.quick else 10
    adam = TrainingSession(build.training_model(
        mlp(hidden=64), loss="cross_entropy", target="label",
        optimizer=build.Adam(lr=1e-2), accumulate=4))
    history = adam.fit((X_train, y_train), epochs=epochs, batch_size=8,
                       validation_data=(X_test, y_test),
                       progress=not (args.quick or args.no_progress))
    print(f"Adam, micro-batches of 8 accumulated 4 times: test accuracy "
          f"{history['val_accuracy'][-1]:.2%} after {epochs} epochs")
    return 0 if diff < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
