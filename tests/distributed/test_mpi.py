"""Data-parallel training on a real MPI: ``mpiexec -n 2`` from this Python's
environment (``pip install 'onnxtrain[mpi]'`` puts mpi4py and MPICH there).

Each test writes a model and data into a temporary folder, runs
``mpi_worker.py SCENARIO FOLDER`` on 2 ranks with a timeout (a hang fails the
test), and compares what the ranks wrote with one process.  Skipped only
where mpi4py is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("mpi4py")

import onnxtrain  # noqa: E402
from onnxtrain import build  # noqa: E402

HERE = Path(__file__).parent
WORKER = HERE / "mpi_worker.py"
TIMEOUT = 240


def mpiexec() -> str:
    """The mpiexec beside this Python (the mpi extra's), else one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpi4py is installed but no mpiexec was found: pip install mpich")
    return found


def launch(args: list[str], cwd: Path, ranks: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, ONNXTRAIN_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [mpiexec(), "-n", str(ranks)]
    if "Open MPI" in subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout:
        cmd += ["--oversubscribe", "--bind-to", "none"]
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    try:
        return subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpiexec did not finish in {TIMEOUT} s (a hang?): {exc.stdout} {exc.stderr}")


def run_worker(scenario: str, folder: Path) -> list[dict]:
    done = launch([sys.executable, str(WORKER), scenario, str(folder)], folder)
    assert done.returncode == 0, done.stdout + done.stderr
    return [dict(np.load(folder / f"rank{r}.npz")) for r in range(2)]


def state_of(result: dict, prefix: str = "state/") -> dict:
    return {k[len(prefix):]: v for k, v in result.items() if k.startswith(prefix)}


def mlp(dtype=np.float64, seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    g = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W1"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
         helper.make_node("MatMul", ["t", "W2"], ["Y"])], "mlp",
        [helper.make_tensor_value_info("X", et, ["N", 6])],
        [helper.make_tensor_value_info("Y", et, ["N", 3])],
        [numpy_helper.from_array(rng.standard_normal((6, 8)).astype(dtype), "W1"),
         numpy_helper.from_array(rng.standard_normal((8, 3)).astype(dtype), "W2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def write_data(folder: Path, rows: list[tuple[int, int]], dtype=np.float64, seed=1) -> tuple:
    """Per step, rank 0 gets rows[k][0] rows and rank 1 rows[k][1]."""
    total = sum(a + b for a, b in rows)
    rng = np.random.default_rng(seed)
    X, y = rng.standard_normal((total, 6)).astype(dtype), rng.standard_normal((total, 3)).astype(dtype)
    bounds, at = [], 0
    for a, b in rows:
        bounds.append((at, at + a, at + a + b))
        at += a + b
    np.savez(folder / "data.npz", X=X, y=y, bounds=np.array(bounds))
    return X, y, bounds


def test_uneven_batches_equal_one_process_on_the_global_batch(tmp_path):
    """Local batches of 8 and 5 rows = one process on the 13 rows (float64,
    SGD with momentum: <= 1e-9 relative); the ranks stay bit-identical."""
    tm = build.training_model(mlp(), loss="mse", optimizer=build.SGD(lr=0.05, momentum=0.9))
    onnx.save(tm, tmp_path / "model.onnx")
    X, y, bounds = write_data(tmp_path, [(8, 5), (8, 5), (6, 7)])
    r0, r1 = run_worker("steps", tmp_path)
    s0, s1 = state_of(r0), state_of(r1)
    for k in s0:
        assert np.array_equal(s0[k], s1[k]), k
    ref = onnxtrain.TrainingSession(tm)
    losses = []
    for a, _, c in bounds:
        losses.append(float(ref.train_step({"X": X[a:c], "target": y[a:c]})["loss"]))
    for k, v in ref.state.items():
        scale = np.max(np.abs(v)) or 1.0
        assert np.max(np.abs(s0[k] - v)) / scale <= 1e-9, k
    # Each rank returns the loss of its own shard; their row-weighted mean is the global loss.
    for (a, b, c), l0, l1, lg in zip(bounds, r0["losses"], r1["losses"], losses):
        assert abs(((b - a) * l0 + (c - b) * l1) / (c - a) - lg) <= 1e-12 * max(1.0, abs(lg))


def test_inputs_with_a_default_fed_on_two_ranks_equal_one_process(tmp_path):
    """scale (main graph) and lr (read by the update) have defaults; fed on
    some steps and not on others, 2 ranks equal one process (float64)."""
    from models import overridable_regression

    tm = overridable_regression()
    onnx.save(tm, tmp_path / "model.onnx")
    rng = np.random.default_rng(3)
    overrides = [{}, {"scale": 3.0, "lr": 0.125}, {}, {"lr": 0.25}]
    arrays, bounds, steps = {}, [], []
    for k, fed in enumerate(overrides):
        batch = {"X": rng.standard_normal((7, 3)), "T": rng.standard_normal((7, 2))}
        batch.update({name: np.array(v) for name, v in fed.items()})
        steps.append(batch)
        arrays.update({f"{k}/{name}": v for name, v in batch.items()})
        bounds.append((0, 4, 7))
    np.savez(tmp_path / "feeds.npz", bounds=np.array(bounds), **arrays)
    r0, r1 = run_worker("feed_steps", tmp_path)
    s0, s1 = state_of(r0), state_of(r1)
    ref = onnxtrain.TrainingSession(tm)
    losses = [float(ref.train_step(b)["loss"]) for b in steps]
    assert list(s0) == ["W"] and np.array_equal(s0["W"], s1["W"])
    np.testing.assert_allclose(s0["W"], ref.state["W"], rtol=1e-12)
    for (a, b, c), l0, l1, lg in zip(bounds, r0["losses"], r1["losses"], losses):
        assert abs(((b - a) * l0 + (c - b) * l1) / (c - a) - lg) <= 1e-12 * max(1.0, abs(lg))


def test_ranks_stay_bit_identical_with_adamw_clipping_and_a_schedule(tmp_path):
    tm = build.training_model(mlp(np.float32), loss="mse", optimizer=build.AdamW(lr=1e-2),
                              clip_grad_norm=0.5, schedule=build.cosine(10))
    onnx.save(tm, tmp_path / "model.onnx")
    write_data(tmp_path, [(4, 4)] * 5, np.float32)
    r0, r1 = run_worker("steps", tmp_path)
    s0, s1 = state_of(r0), state_of(r1)
    assert s0.keys() == s1.keys() and len(s0) > 4
    for k in s0:
        assert np.array_equal(s0[k], s1[k]), k
    assert not np.array_equal(s0["W1"], numpy_helper.to_array(tm.graph.initializer[0]))
    assert r0["losses"].shape == (5,) and not np.array_equal(r0["losses"], r1["losses"])


def test_a_failure_on_one_rank_rolls_back_both(tmp_path):
    tm = build.training_model(mlp(), loss="mse", optimizer=build.SGD(lr=0.05, momentum=0.9))
    onnx.save(tm, tmp_path / "model.onnx")
    write_data(tmp_path, [(4, 4), (4, 4)])
    r0, r1 = run_worker("rollback", tmp_path)
    assert bool(r0["unchanged"]) and bool(r1["unchanged"])
    assert str(r0["error"]).startswith("DistributedStepError ranks=[1]")
    assert "rank 1" in str(r0["error"]) and "dtype" in str(r0["error"])
    assert str(r1["error"]).startswith("ValueError") and "dtype" in str(r1["error"])
    s0, s1 = state_of(r0), state_of(r1)
    for k in s0:  # and the next good step ran on both, together
        assert np.array_equal(s0[k], s1[k]), k


def random_init_model(seed: int) -> onnx.ModelProto:
    """A linear model whose initialization graph draws W at random."""
    rng = np.random.default_rng(seed)
    f = TensorProto.FLOAT
    main = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "main",
        [helper.make_tensor_value_info("X", f, ["N", 3])], [helper.make_tensor_value_info("Y", f, ["N", 2])],
        [numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "W")])
    m = helper.make_model(main, opset_imports=[helper.make_opsetid("", 17)])
    tm = build.training_model(m, loss="mse", optimizer=build.SGD(lr=0.1))
    init = tm.training_info[0].initialization
    for node in init.node:
        if node.output[0] in [b.value for b in tm.training_info[0].initialization_binding
                              if b.key == "W"]:
            node.CopyFrom(helper.make_node("RandomNormal", [], [node.output[0]], shape=[3, 2],
                                           dtype=f))
    return tm


def test_rank_zero_state_is_broadcast(tmp_path):
    onnx.save(random_init_model(0), tmp_path / "model0.onnx")
    onnx.save(random_init_model(1), tmp_path / "model1.onnx")
    (tmp_path / "load.json").write_text(json.dumps({"name": "W"}))
    r0, r1 = run_worker("broadcast", tmp_path)
    for prefix in ("constructed/", "initialized/", "state/"):
        s0, s1 = state_of(r0, prefix), state_of(r1, prefix)
        for k in s0:
            assert np.array_equal(s0[k], s1[k]), (prefix, k)
    own = numpy_helper.to_array(random_init_model(0).graph.initializer[0])
    assert np.array_equal(state_of(r1, "constructed/")["W"], own)
    assert not np.array_equal(state_of(r0, "initialized/")["W"], own)  # RandomNormal ran
    assert np.all(state_of(r1)["W"] == 7.0)  # rank 0's load_state, not rank 1's {}


@pytest.mark.parametrize("batch,rows", [(8, 64), (8, 61)])
def test_fit_on_two_ranks_equals_one_process_with_the_doubled_batch(tmp_path, batch, rows):
    tm = build.training_model(mlp(), loss="mse", optimizer=build.SGD(lr=0.05, momentum=0.9))
    onnx.save(tm, tmp_path / "model.onnx")
    rng = np.random.default_rng(3)
    X, y = rng.standard_normal((rows, 6)), rng.standard_normal((rows, 3))
    np.savez(tmp_path / "data.npz", X=X, y=y)
    options = {"epochs": 2, "batch_size": batch, "seed": 5, "shuffle": True}
    (tmp_path / "fit.json").write_text(json.dumps(options))
    r0, r1 = run_worker("fit", tmp_path)
    ref = onnxtrain.TrainingSession(tm)
    history = ref.fit(X, y, progress=False, **dict(options, batch_size=2 * batch))
    assert int(r0["steps"]) == int(r1["steps"]) == history.steps
    for k, v in ref.state.items():
        assert np.array_equal(state_of(r0)[k], state_of(r1)[k]), k
        assert np.max(np.abs(state_of(r0)[k] - v)) <= 1e-9 * (np.max(np.abs(v)) or 1.0), k
    # The epoch losses are the global batches' (averaged across ranks), the same everywhere.
    assert np.array_equal(r0["loss"], r1["loss"])
    assert np.allclose(r0["loss"], history["loss"], rtol=1e-9)


def test_cli_distributed(tmp_path):
    from onnxtrain.demo import build_classifier

    onnx.save(build_classifier(), tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", X=rng.random((100, 64)).astype(np.float32),
             y=rng.integers(0, 10, 100))
    cli = [str(Path(sys.executable).parent / "onnxtrain")]
    args = ["train", "m.onnx", "--data", "d.npz", "--epochs", "2", "--batch-size", "10",
            "-o", "out.onnx", "--checkpoint", "ck.onnx", "--distributed"]
    done = launch(cli + args, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines if ln.startswith("epoch")] == ["epoch 1/2", "epoch 2/2"]
    assert any(ln.startswith("trained 2 epochs (10 steps on 2 ranks)") for ln in lines), lines
    assert (tmp_path / "out.onnx").exists() and (tmp_path / "ck.onnx").exists()
    # One process with the doubled batch trains the same weights.
    single = subprocess.run(cli + ["train", "m.onnx", "--data", "d.npz", "--epochs", "2",
                                   "--batch-size", "20", "-o", "one.onnx", "--no-progress"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    assert single.returncode == 0, single.stderr
    a = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "out.onnx").graph.initializer}
    b = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "one.onnx").graph.initializer}
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), k
    # A user mistake: one line, from rank 0 only, exit 1.
    bad = launch(cli + ["train", "m.onnx", "--data", "missing.npz", "--epochs", "1", "-o", "x.onnx",
                        "--distributed"], tmp_path)
    assert bad.returncode != 0
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("onnxtrain:")]
    assert errors == ["onnxtrain: error: no such data file: 'missing.npz'"], bad.stderr
    assert "Traceback" not in bad.stderr
