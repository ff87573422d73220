"""Communicators and the data-parallel contract around the step: argument
checks, construction agreeing across ranks, fit's data checks, the CLI
without mpi4py.  Ranks are threads of this process (``comm.local_group``)."""

from __future__ import annotations

import builtins
import threading

import numpy as np
import pytest
from onnx import helper, numpy_helper

import onnxtrain
from onnxtrain import build
from onnxtrain.comm import Communicator, as_communicator, local_group
from onnxtrain.errors import DistributedStepError


def each_rank(n: int, fn, timeout: float = 60.0) -> list:
    """fn(rank, comm) on n threads; per rank its result or the exception it raised."""
    comms = local_group(n, timeout=timeout)
    results: list = [None] * n

    def work(r: int) -> None:
        try:
            results[r] = fn(r, comms[r])
        except BaseException as exc:  # noqa: BLE001 - reported per rank
            results[r] = exc

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
        assert not t.is_alive(), "a rank hung"
    return results


def linear(dtype=np.float32) -> object:
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    g = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "lin",
        [helper.make_tensor_value_info("X", et, ["N", 3])], [helper.make_tensor_value_info("Y", et, ["N", 2])],
        [numpy_helper.from_array(np.arange(6, dtype=dtype).reshape(3, 2) / 10, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return build.training_model(m, loss="mse", optimizer=build.SGD(lr=0.1))


def test_collectives_of_a_local_group():
    def fn(r, comm):
        buf = np.array([r + 1.0, 10.0 * r])
        comm.allreduce_sum(buf)
        b = np.array([r, r], dtype=np.int64)
        comm.broadcast(b, root=2)
        return buf, b, comm.allgather(np.array([r, -r])), comm.allgather_object(f"r{r}")

    for buf, b, table, objs in each_rank(3, fn):
        assert buf.tolist() == [6.0, 30.0] and b.tolist() == [2, 2]
        assert table.tolist() == [[0, 0], [1, -1], [2, -2]] and objs == ["r0", "r1", "r2"]


def test_argument_checks():
    with pytest.raises(ValueError, match="size"):
        local_group(0)
    comm = local_group(1)[0]
    assert as_communicator(comm) is comm and "rank=0, size=1" in repr(comm)
    with pytest.raises(ValueError, match="reduction must be one of"):
        onnxtrain.TrainingSession(linear(), comm=comm, reduction="median")
    with pytest.raises(ValueError, match="bucket_bytes"):
        onnxtrain.TrainingSession(linear(), comm=comm, bucket_bytes=0)
    with pytest.raises(ValueError, match="CPU provider"):
        onnxtrain.TrainingSession(linear(), comm=comm, providers=["CUDAExecutionProvider"])
    with pytest.raises(NotImplementedError):
        Communicator().allreduce_sum(np.zeros(1))
    plain = onnxtrain.TrainingSession(linear())
    assert plain.comm is None and plain.communication_seconds == 0.0


def test_mpi4py_communicators_are_wrapped_and_others_refused():
    pytest.importorskip("mpi4py")
    from mpi4py import MPI

    comm = as_communicator(MPI.COMM_SELF)
    assert (comm.rank, comm.size) == (0, 1)
    with pytest.raises(TypeError, match="intracommunicator"):
        as_communicator(object())
    sess = onnxtrain.TrainingSession(linear(), comm=MPI.COMM_SELF)
    sess.train_step({"X": np.ones((4, 3), np.float32), "target": np.zeros((4, 2), np.float32)})
    assert sess.comm.size == 1 and sess.communication_seconds > 0


def test_a_rank_that_cannot_build_the_session_stops_every_rank(tmp_path):
    def fn(r, comm):
        model = linear() if r == 0 else str(tmp_path / "missing.onnx")
        return onnxtrain.TrainingSession(model, comm=comm)

    r0, r1 = each_rank(2, fn)
    assert isinstance(r0, DistributedStepError) and r0.ranks == [1]
    assert "TrainingSession() failed on rank 1" in str(r0) and "missing.onnx" in str(r0)
    assert isinstance(r1, (OSError, ValueError)) and "missing.onnx" in str(r1)


def test_load_state_with_a_bad_value_on_one_rank_changes_nothing():
    def fn(r, comm):
        sess = onnxtrain.TrainingSession(linear(), comm=comm)
        before = sess.state["W"]
        bad = np.zeros((3, 2), np.float64 if r == 1 else np.float32)
        try:
            sess.load_state({"W": bad})
        except (ValueError, DistributedStepError) as exc:
            return type(exc).__name__, np.array_equal(sess.state["W"], before)
        return "no error", False

    assert each_rank(2, fn) == [("DistributedStepError", True), ("ValueError", True)]


def test_fit_refuses_ranks_with_different_data():
    def fn(r, comm):
        sess = onnxtrain.TrainingSession(linear(), comm=comm)
        rows = 20 if r == 0 else 21
        X, y = np.ones((rows, 3), np.float32), np.zeros((rows, 2), np.float32)
        sess.fit(X, y, batch_size=4, progress=False)

    for result in each_rank(2, fn):
        assert isinstance(result, ValueError) and "rank 0: 20 rows, rank 1: 21 rows" in str(result)


def test_fit_checks_that_iterables_run_out_together():
    def fn(r, comm):
        sess = onnxtrain.TrainingSession(linear(), comm=comm)
        batch = {"X": np.ones((4, 3), np.float32), "target": np.zeros((4, 2), np.float32)}
        return sess.fit([batch] * (3 + r), progress=False)

    for result in each_rank(2, fn):
        assert isinstance(result, ValueError) and "ran out after 3 batches" in str(result)

    def same(r, comm):
        sess = onnxtrain.TrainingSession(linear(), comm=comm)
        batch = {"X": np.full((4, 3), r + 1.0, np.float32), "target": np.zeros((4, 2), np.float32)}
        return sess.fit([batch] * 3, epochs=2, progress=False), sess.state["W"]

    (h0, w0), (h1, w1) = each_rank(2, same)
    assert h0.steps == h1.steps == 6 and np.array_equal(w0, w1)
    assert h0["loss"] == h1["loss"]  # the global batch's loss, the same on both


def test_fit_on_rank_zero_only_writes_checkpoints(tmp_path):
    def fn(r, comm):
        sess = onnxtrain.TrainingSession(linear(), comm=comm)
        X, y = np.ones((16, 3), np.float32), np.zeros((16, 2), np.float32)
        ckpt = onnxtrain.ModelCheckpoint(str(tmp_path / f"ckpt{r}.onnx"))
        sess.fit(X, y, batch_size=4, epochs=1, progress=False, callbacks=[ckpt])
        return sess.fit_position

    p0, p1 = each_rank(2, fn)
    assert p0 == p1 and p0["step"] == 2  # 16 rows, global batches of 8
    assert (tmp_path / "ckpt0.onnx").exists() and not (tmp_path / "ckpt1.onnx").exists()


def test_cli_distributed_without_mpi4py_is_one_line(tmp_path, monkeypatch, capsys):
    from onnxtrain.cli import app as cli

    real_import = builtins.__import__

    def no_mpi(name, *args, **kwargs):
        if name.startswith("mpi4py"):
            raise ImportError("No module named 'mpi4py'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpi)
    code = cli.main(["train", "m.onnx", "--data", "d.npz", "--epochs", "1", "-o",
                     str(tmp_path / "o.onnx"), "--distributed"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0].startswith("onnxtrain: error: --distributed needs mpi4py")


def test_train_step_refuses_a_type_error_in_feeds_on_every_rank():
    """A non-mapping feed on one rank: its TypeError there, DistributedStepError elsewhere."""

    def fn(r, comm):
        sess = onnxtrain.TrainingSession(linear(), comm=comm)
        feeds = {"X": np.ones((2, 3), np.float32), "target": np.zeros((2, 2), np.float32)}
        try:
            sess.train_step(feeds if r == 0 else [1, 2])
        except (TypeError, DistributedStepError) as exc:
            return type(exc).__name__, str(exc)

    (n0, m0), (n1, _) = each_rank(2, fn)
    assert (n0, n1) == ("DistributedStepError", "TypeError")
    assert "rank 1: TypeError: train_step: feeds must be a dict" in m0


def test_threads_per_rank_share_the_cores(monkeypatch):
    import os

    from onnxtrain.parallel import data_parallel as distributed

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert [distributed.threads_per_rank(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    # A launcher that bound the rank to 2 cores has decided.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert distributed.threads_per_rank(4) == 2
