"""The gradient reduction checks of test_dp_reduction.py on a real MPI
(``mpiexec -n 2``, the ``mpi`` extra): a trailing one-element bucket is
reduced, and accumulation weights each rank by all its micro-batches.

One launch of ``mpi_reduction_worker.py`` runs both scenarios; the test
compares what the ranks wrote with one process.  Skipped where mpi4py is
not installed.  Each check was seen to fail with its bug planted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("mpi4py")

from test_dp_reduction import PARAMS, assert_rel_close, gradients, tanh_mlp  # noqa: E402
from test_mpi import launch  # noqa: E402

from onnxtrain import TrainingSession, build  # noqa: E402

WORKER = Path(__file__).parent / "mpi_reduction_worker.py"


def test_buckets_and_accumulation_on_two_mpi_ranks(tmp_path):
    """Bugs caught: ``if at > start:`` written as ``if at - start > 1:`` in
    ``GradientBuffers.allocate`` (the [1] bias b2, alone in the last bucket,
    is never reduced); ``weight = rows + (local_rows if split.sums else 0)``
    written as ``weight = rows`` (a rank weighted by its last micro-batch)."""
    rng = np.random.default_rng(11)
    # bucketing: 13 rows, rank 0 gets 8, rank 1 gets 5
    bucket_model = build.training_model(tanh_mlp(), loss="mse",
                                        optimizer=build.SGD(lr=0.1, momentum=0.9))
    bx, by = rng.standard_normal((13, 3)), rng.standard_normal((13, 1))
    # accumulation: k = 3, micro-batches of 1, 6, 2 rows on rank 0 and 4, 4, 5 on rank 1
    micro = [[1, 6, 2], [4, 4, 5]]
    k, lr = 3, 0.1
    base = tanh_mlp(seed=2)
    accum_model = build.training_model(base, loss="mse", optimizer=build.SGD(lr=lr), accumulate=k)
    ax, ay = rng.standard_normal((22, 3)), rng.standard_normal((22, 1))
    ranges, at = [], 0
    for sizes in micro:
        ranges.append([(at + sum(sizes[:i]), at + sum(sizes[:i + 1])) for i in range(k)])
        at += sum(sizes)
    onnx.save(bucket_model, tmp_path / "bucket.onnx")
    onnx.save(accum_model, tmp_path / "accum.onnx")
    np.savez(tmp_path / "data.npz", bucket_X=bx, bucket_y=by, bucket_rows=np.array([[0, 8], [8, 13]]),
             accum_X=ax, accum_y=ay, accum_rows=np.array(ranges))

    done = launch([sys.executable, str(WORKER), str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    r0, r1 = (dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2))

    # bucketing: equal ranks, equal to one process on the 13 rows
    one = TrainingSession(bucket_model)
    for _ in range(3):
        one.train_step({"X": bx, "target": by})
    got = {n: r0[f"bucket/{n}"] for n in PARAMS}
    for n in PARAMS:
        assert got[n].tobytes() == r1[f"bucket/{n}"].tobytes(), f"bucket/{n}: the ranks differ"
    assert_rel_close(got, dict(one.state))
    assert r0["bucket_sizes"][-1] == 1, r0["bucket_sizes"]  # b2 alone in the last bucket

    # accumulation: p' = p - lr * sum_r (n_r / N) * (1/k) * sum_i g_{r,i}
    start = {n: v for n, v in TrainingSession(accum_model).state.items() if n in PARAMS}
    rows = [sum(m) for m in micro]
    expected = {n: start[n].copy() for n in PARAMS}
    for r in range(2):
        feeds = [{"X": ax[lo:hi], "target": ay[lo:hi]} for lo, hi in ranges[r]]
        for g in gradients(base, start, feeds):
            for n in PARAMS:
                expected[n] -= lr * (rows[r] / sum(rows)) / k * g[n]
    got = {n: r0[f"accum/{n}"] for n in PARAMS}
    for n in PARAMS:
        assert got[n].tobytes() == r1[f"accum/{n}"].tobytes(), f"accum/{n}: the ranks differ"
    assert_rel_close(got, expected)
