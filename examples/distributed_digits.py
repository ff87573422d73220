"""Data-parallel training over MPI: the digits MLP on several processes.

Every rank builds the same session with ``comm=MPI.COMM_WORLD`` (rank 0's
state is broadcast), and ``fit`` gives each rank its share of every global
batch; gradients are summed across ranks between the backward pass and the
optimizer, so all ranks hold the same weights.  Rank 0 then checks that the
result equals one process trained with the global batch size, and exports.

    mpiexec -n 2 python examples/distributed_digits.py            # 10 epochs
    mpiexec -n 2 python examples/distributed_digits.py --quick    # 2 epochs

(``pip install 'onnxtrain[mpi]'`` gives mpi4py and MPICH's ``mpiexec``.)
Without mpiexec it runs as one rank.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

import onnxtrain
from onnxtrain.datasets import load_digits, train_test_split
from onnxtrain.demo import build_classifier


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (2 epochs)")
    parser.add_argument("--no-progress", action="store_true", help="no per-epoch lines")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    args = parser.parse_args(argv)
    epochs = 2 if args.quick else 10
    try:
        from mpi4py import MPI
    except ImportError:
        print("this example needs mpi4py: pip install 'onnxtrain[mpi]'", file=sys.stderr)
        return 1
    world = MPI.COMM_WORLD
    rank, ranks = world.Get_rank(), world.Get_size()

    X, y = load_digits()
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2, seed=0)
    model = build_classifier(hidden=64, lr=1e-2, seed=0)

    sess = onnxtrain.TrainingSession(model, comm=world)
    history = sess.fit(X_train, y_train, epochs=epochs, batch_size=args.batch_size, seed=1,
                       # rank 0 prints; every rank gets the same logs
                       progress=False if args.no_progress else "epoch")
    if rank != 0:
        return 0
    print(f"ranks: {ranks}, global batch {args.batch_size * ranks}, {history.steps} steps, "
          f"{sess.communication_seconds:.2f} s in collectives on rank 0")
    accuracy = float(np.mean(sess.run({"X": X_test})["logits"].argmax(axis=1) == y_test))
    print(f"test accuracy: {accuracy:.2%}")

    # The same training in this one process, with the global batch size.
    single = onnxtrain.TrainingSession(model)
    single.fit(X_train, y_train, epochs=epochs, batch_size=args.batch_size * ranks, seed=1,
               progress=False)
    diff = max(float(np.max(np.abs(sess.state[k] - v))) for k, v in single.state.items())
    print(f"max |weight difference| to one process with batch {args.batch_size * ranks}: {diff:.1e}")
    same = diff <= 1e-4
    print(f"matches one process with the global batch: {same}")
    with tempfile.TemporaryDirectory() as tmp:
        path = sess.export(Path(tmp) / "digits_dp.onnx")
        print(f"exported {path.name} ({path.stat().st_size // 1024} KiB)")
    return 0 if same and accuracy > 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
