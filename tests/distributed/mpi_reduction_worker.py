"""One rank of test_mpi_reduction.py (run under ``mpiexec -n 2``).

``python mpi_reduction_worker.py DIR``: reads ``bucket.onnx``, ``accum.onnx``
and ``data.npz`` from DIR and writes ``rank<r>.npz`` there:

- ``bucket/<name>``: the state after 3 steps of ``bucket.onnx`` with
  ``bucket_bytes=16`` on this rank's rows of the global batch, and
  ``bucket_sizes``, the element count of every all-reduce this rank made;
- ``accum/<name>``: the state after one cycle [0] * (k - 1) + [1] of
  ``accum.onnx`` (``accumulate=k``) on this rank's uneven micro-batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import onnxtrain
from onnxtrain.comm import MPICommunicator

RANK = MPI.COMM_WORLD.Get_rank()


def main(folder: Path) -> None:
    data = np.load(folder / "data.npz")
    out: dict[str, np.ndarray] = {}

    comm = MPICommunicator(MPI.COMM_WORLD)
    sizes: list[int] = []
    allreduce = comm.allreduce_sum

    def recording(buf: np.ndarray) -> None:
        sizes.append(int(buf.size))
        allreduce(buf)

    comm.allreduce_sum = recording  # type: ignore[method-assign]
    sess = onnxtrain.TrainingSession(str(folder / "bucket.onnx"), comm=comm, bucket_bytes=16)
    lo, hi = data["bucket_rows"][RANK]
    for _ in range(3):
        sess.train_step({"X": data["bucket_X"][lo:hi], "target": data["bucket_y"][lo:hi]})
    out.update({f"bucket/{k}": v for k, v in sess.state.items()})
    out["bucket_sizes"] = np.array(sizes)

    sess = onnxtrain.TrainingSession(str(folder / "accum.onnx"), comm=MPI.COMM_WORLD)
    ranges = data["accum_rows"][RANK]  # [k, 2]: this rank's micro-batches
    k = len(ranges)
    for i, (lo, hi) in enumerate(ranges):
        sess.train_step({"X": data["accum_X"][lo:hi], "target": data["accum_y"][lo:hi]},
                        algorithm=0 if i < k - 1 else 1)
    out.update({f"accum/{k_}": v for k_, v in sess.state.items()})
    np.savez(folder / f"rank{RANK}.npz", **out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
