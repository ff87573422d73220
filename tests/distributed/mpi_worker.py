"""One rank of a real-MPI test (run by test_mpi.py under ``mpiexec -n 2``).

``python mpi_worker.py SCENARIO DIR``: every rank reads its inputs from DIR
(written by the test) and writes ``rank<r>.npz`` (state and results) there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import onnxtrain
from onnxtrain.errors import DistributedStepError

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()


def save(folder: Path, state: dict, **extra) -> None:
    arrays = {f"state/{k}": v for k, v in state.items()}
    arrays.update({k: np.asarray(v) for k, v in extra.items()})
    np.savez(folder / f"rank{RANK}.npz", **arrays)


def shards(folder: Path) -> list[dict]:
    """This rank's batches: data.npz holds X, y and 'bounds' (per step: rank 0's
    rows [a, b), rank 1's rows [b, c))."""
    data = np.load(folder / "data.npz")
    out = []
    for a, b, c in data["bounds"]:
        lo, hi = (a, b) if RANK == 0 else (b, c)
        out.append({"X": data["X"][lo:hi], "target": data["y"][lo:hi]})
    return out


def steps(folder: Path) -> None:
    """Train on this rank's shards; record the state and each step's loss."""
    sess = onnxtrain.TrainingSession(str(folder / "model.onnx"), comm=COMM)
    losses = [float(sess.train_step(b)["loss"]) for b in shards(folder)]
    save(folder, dict(sess.state), losses=losses)


def rollback(folder: Path) -> None:
    """Step 2 has a bad feed on rank 1 only: both ranks fail, nothing changes."""
    sess = onnxtrain.TrainingSession(str(folder / "model.onnx"), comm=COMM)
    batches = shards(folder)
    sess.train_step(batches[0])
    before = dict(sess.state)
    bad = dict(batches[1])
    if RANK == 1:
        bad["X"] = bad["X"].astype(np.float32 if bad["X"].dtype == np.float64 else np.float64)
    error = ""
    try:
        sess.train_step(bad)
    except DistributedStepError as exc:
        error = f"DistributedStepError ranks={exc.ranks}: {exc}"
    except ValueError as exc:
        error = f"ValueError: {exc}"
    unchanged = all(np.array_equal(before[k], v) for k, v in sess.state.items())
    sess.train_step(batches[1])  # the ranks go on together
    save(folder, dict(sess.state), error=error, unchanged=unchanged)


def broadcast(folder: Path) -> None:
    """Ranks load different models: rank 0's state wins at construction,
    after initialize() (a random initialization graph) and after load_state."""
    sess = onnxtrain.TrainingSession(str(folder / f"model{RANK}.onnx"), comm=COMM)
    constructed = dict(sess.state)
    sess.initialize()
    initialized = dict(sess.state)
    name = json.loads((folder / "load.json").read_text())["name"]
    value = np.full(sess.state_info[name].shape, 7.0 + RANK, sess.state_info[name].dtype)
    sess.load_state({name: value} if RANK == 0 else {})
    save(folder, dict(sess.state),
         **{f"constructed/{k}": v for k, v in constructed.items()},
         **{f"initialized/{k}": v for k, v in initialized.items()})


def fit(folder: Path) -> None:
    """fit on the whole data set; each rank trains on its share of each global batch."""
    sess = onnxtrain.TrainingSession(str(folder / "model.onnx"), comm=COMM)
    data = np.load(folder / "data.npz")
    options = json.loads((folder / "fit.json").read_text())
    history = sess.fit(data["X"], data["y"], progress=False, **options)
    save(folder, dict(sess.state), loss=history["loss"], steps=history.steps)


def feed_steps(folder: Path) -> None:
    """Like ``steps`` with named feeds: feeds.npz holds, per step k, every
    input as ``k/NAME`` (the global batch, rows first) and 'bounds' as in
    ``shards``; each rank trains on its rows of every input, and on a scalar
    input (an input with a default, fed) as it is."""
    sess = onnxtrain.TrainingSession(str(folder / "model.onnx"), comm=COMM)
    data = np.load(folder / "feeds.npz")
    losses = []
    for k, (a, b, c) in enumerate(data["bounds"]):
        lo, hi = (a, b) if RANK == 0 else (b, c)
        prefix = f"{k}/"
        batch = {name[len(prefix):]: data[name][lo:hi] if data[name].ndim else data[name]
                 for name in data.files if name.startswith(prefix)}
        losses.append(float(sess.train_step(batch)["loss"]))
    save(folder, dict(sess.state), losses=losses)


if __name__ == "__main__":
    scenario, where = sys.argv[1], Path(sys.argv[2])
    {"steps": steps, "rollback": rollback, "broadcast": broadcast, "fit": fit,
     "feed_steps": feed_steps}[scenario](where)
