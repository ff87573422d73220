"""Stop training, write a checkpoint, resume later: the result is bit-for-bit the same.

A checkpoint is just the training model with its current state (weights,
Adam moments, the step counter) written into its initializers, plus the
fit position (finished epochs, steps) in its metadata.  ``fit`` draws epoch
e's shuffle from (seed, e), and a session loaded from a checkpoint starts
``fit`` where it stood (``initial_epoch=None``), so it replays exactly the
batches an uninterrupted run would have seen.

    python examples/resume_checkpoint.py            # 3 epochs, stop, 3 more
    python examples/resume_checkpoint.py --quick    # 1 epoch, stop, 1 more
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from inference_models import mlp

from onnxtrain import ModelCheckpoint, TrainingSession, build, checkpoint_epoch, train_test_split
from onnxtrain.datasets import load_digits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (1 + 1 epochs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    half = 1 if args.quick else 3
    total = 2 * half

    X, y = load_digits()
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2, seed=0)
    model = build.training_model(mlp(hidden=64), loss="cross_entropy", target="label",
                                 optimizer=build.Adam(lr=1e-2), schedule=build.cosine(45 * total))

    uninterrupted = TrainingSession(model)
    uninterrupted.fit(X_train, y_train, epochs=total, batch_size=32, progress=False)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.onnx"
        first = TrainingSession(model)
        first.fit(X_train, y_train, epochs=half, batch_size=32, progress=False,
                  callbacks=[ModelCheckpoint(path)])
        print(f"stopped after epoch {half}; checkpoint {path.name}: "
              f"{path.stat().st_size / 1024:.0f} KiB, step counter {int(first.state['step'])}")
        del first  # the process could end here

        resumed = TrainingSession(path)
        start = checkpoint_epoch(resumed)
        history = resumed.fit(X_train, y_train, epochs=total, batch_size=32,
                              progress=not (args.quick or args.no_progress))  # continues at epoch `start`
        print(f"resumed at epoch {start}, trained epochs {[e + 1 for e in history.epochs]}")

    same = all(np.array_equal(uninterrupted.state[k], resumed.state[k]) for k in resumed.state)
    print(f"identical to the uninterrupted run: {same} "
          f"({len(resumed.state)} state variables compared bit for bit)")
    print(f"test accuracy: {resumed.evaluate(X_test, y_test)['accuracy']:.2%}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
