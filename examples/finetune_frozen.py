"""Fine-tuning with frozen layers: reuse a hidden layer trained on digits 0-4 for digits 5-9.

1. Pretrain an MLP (Gemm -> Relu -> Gemm) on the digits 0-4 only.
2. Export the trained inference model: an ordinary .onnx with the learned weights.
3. Build a new training model from it with ``trainable=["W2", "b2"]``: the hidden
   layer W1, b1 stays a constant of the graph (no gradient, no optimizer state),
   only the output layer learns.
4. Fine-tune on the digits 5-9 and check that W1 did not move by a single bit.

    python examples/finetune_frozen.py            # 10 + 10 epochs
    python examples/finetune_frozen.py --quick    # 2 + 2 epochs
"""

from __future__ import annotations

import argparse

import numpy as np
from inference_models import mlp
from onnx import numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.datasets import load_digits, train_test_split
from onnxtrain.io.metadata import model_metadata


def initializers(model) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (2 + 2 epochs)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (this example shows none anyway)")
    args = parser.parse_args(argv)
    epochs = 2 if args.quick else 10

    X, y = load_digits()
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2, seed=0)
    low_train, low_test = y_train < 5, y_test < 5
    old = (X_train[low_train], y_train[low_train])
    new = (X_train[~low_train], y_train[~low_train])
    new_test = (X_test[~low_test], y_test[~low_test])

    # 1. Pretrain on 0-4 (the head has 10 outputs; 5-9 are simply never the answer yet).
    pretrain = TrainingSession(build.training_model(mlp(hidden=64), loss="cross_entropy",
                                                    target="label", optimizer=build.Adam(lr=1e-2)))
    pretrain.fit(old, epochs=epochs, batch_size=32, progress=False)
    print(f"pretrained on digits 0-4: accuracy on 5-9 = "
          f"{pretrain.evaluate(new_test)['accuracy']:.2%}")

    # 2-3. The trained inference model, then a training model of its head only.
    pretrained = pretrain.to_model()
    finetune = TrainingSession(build.training_model(
        pretrained, loss="cross_entropy", target="label", optimizer=build.Adam(lr=1e-2),
        trainable=["W2", "b2"]))
    trainable = model_metadata(finetune.model)["trainable"]
    print(f"fine-tuning model: trainable {trainable}; "
          f"W1 is {'a state variable' if 'W1' in finetune.state else 'a constant of the graph'}")

    # 4. Fine-tune on 5-9.
    finetune.fit(new, epochs=epochs, batch_size=32, progress=False)
    print(f"fine-tuned head on digits 5-9: accuracy on 5-9 = "
          f"{finetune.evaluate(new_test)['accuracy']:.2%}")

    before, after = initializers(pretrained), initializers(finetune.to_model())
    unchanged = all(np.array_equal(before[n], after[n]) for n in ("W1", "b1"))
    moved = not np.array_equal(before["W2"], after["W2"])
    print(f"hidden layer W1, b1 unchanged: {unchanged}; head W2 changed: {moved}")
    return 0 if unchanged and moved else 1


if __name__ == "__main__":
    raise SystemExit(main())
