"""The bundled digits, the demo classifier, the command line and the examples.

The demo runs once with its defaults (module fixture) and must reach 95% test
accuracy; the CLI is called in-process through ``main([...])`` (one
subprocess run checks ``python -m onnxtrain``); the examples run with
``--quick`` in subprocesses."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxtrain import TrainingSession
from onnxtrain.cli.app import main
from onnxtrain.cli.demo import ADAM_ATTRS, DEFAULT_LR, build_classifier, demo_steps, run_demo
from onnxtrain.datasets import load_digits, train_test_split
from onnxtrain.optim import reference

ROOT = Path(__file__).resolve().parents[2]
PARAMS = ("W1", "b1", "W2", "b2")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("onnxtrain: error: "), err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def demo_result(tmp_path_factory):
    """One run of the demo with its defaults."""
    out = tmp_path_factory.mktemp("demo") / "digits_mlp.onnx"
    calls = []
    result = run_demo(out_path=out, progress=lambda *args: calls.append(args))
    result["progress_calls"] = calls
    print(f"\ndemo: accuracy {result['accuracy']:.4f}, final loss {result['final_loss']:.4f}, "
          f"{result['steps']} steps in {result['seconds']:.2f} s")
    return result


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "classifier.onnx"
    onnx.save(build_classifier(hidden=16), str(path))
    return path


@pytest.fixture(scope="module")
def broken_path(tmp_path_factory) -> Path:
    """A training model whose update_binding writes a name that is no initializer (R1)."""
    model = build_classifier(hidden=16)
    model.training_info[0].update_binding.add(key="not_a_state", value="W1_new")
    path = tmp_path_factory.mktemp("models") / "broken.onnx"
    onnx.save(model, str(path))
    return path


# ------------------------------------------------------------------- dataset
def test_load_digits_shapes_and_ranges():
    X, y = load_digits()
    assert X.shape == (1797, 64) and X.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int64
    assert X.min() == 0.0 and X.max() == 1.0
    # Pixels are counts 0..16 divided by 16.
    np.testing.assert_array_equal(X * 16, np.round(X * 16))
    assert np.bincount(y).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_train_test_split_partitions_rows():
    X = np.arange(100).reshape(50, 2)
    y = np.arange(50)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.2, seed=3)
    assert len(X_te) == 10 and len(X_tr) == 40
    assert sorted(np.concatenate([y_tr, y_te]).tolist()) == list(range(50))
    np.testing.assert_array_equal(X_tr[:, 0] // 2, y_tr)  # rows stay paired with labels
    again = train_test_split(X, y, test_size=0.2, seed=3)
    np.testing.assert_array_equal(again[3], y_te)
    with pytest.raises(ValueError, match="test_size"):
        train_test_split(X, y, test_size=1.0)
    with pytest.raises(ValueError, match="rows"):
        train_test_split(X, y[:-1])


# ---------------------------------------------------------------- classifier
def test_build_classifier_is_a_valid_standard_model():
    model = build_classifier()
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 10
    assert {(o.domain, o.version) for o in model.opset_import} == {
        ("", 17), ("ai.onnx.preview.training", 1)}
    assert [n.op_type for n in model.graph.node] == ["Gemm", "Relu", "Gemm"]
    (info,) = model.training_info
    ops = [n.op_type for n in info.algorithm.node]
    assert ops[:2] == ["SoftmaxCrossEntropyLoss", "Gradient"] and "Adam" in ops
    sess = TrainingSession(model)
    expected = set(PARAMS) | {f"{p}.{k}" for p in PARAMS for k in ("adam_m", "adam_v")} | {"step"}
    assert set(sess.state) == expected
    assert {b.key for b in info.initialization_binding} == expected
    assert sess.state["step"].dtype == np.int64


def test_one_step_matches_numpy_adam():
    """Forward, cross-entropy gradient and Adam (with T = step + 1) against numpy."""
    sess = TrainingSession(build_classifier(hidden=16, seed=5))
    X, y = load_digits()
    x, labels = X[:40].astype(np.float64), y[:40]
    p = {k: sess.state[k].astype(np.float64) for k in PARAMS}
    h_pre = x @ p["W1"] + p["b1"]
    h = np.maximum(h_pre, 0)
    logits = h @ p["W2"] + p["b2"]
    z = logits - logits.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(prob[np.arange(40), labels]))
    d_logits = prob
    d_logits[np.arange(40), labels] -= 1
    d_logits /= 40
    d_h = d_logits @ p["W2"].T * (h_pre > 0)
    grads = {"W2": h.T @ d_logits, "b2": d_logits.sum(0), "W1": x.T @ d_h, "b1": d_h.sum(0)}
    zeros = [np.zeros_like(p[k]) for k in PARAMS]
    new, _, _ = reference.adam(DEFAULT_LR, np.int64(1), [p[k] for k in PARAMS],
                               [grads[k] for k in PARAMS], zeros, zeros, **ADAM_ATTRS)

    out = sess.train_step({"X": X[:40], "label": y[:40]})
    np.testing.assert_allclose(out["loss"], loss, rtol=1e-5)
    for k, value in zip(PARAMS, new):
        np.testing.assert_allclose(sess.state[k], value, rtol=1e-4, atol=1e-6)
    assert sess.state["step"] == 1


def test_initialize_resets_every_state_variable():
    sess = TrainingSession(build_classifier(hidden=16))
    start = dict(sess.state)
    X, y = load_digits()
    for _ in range(3):
        sess.train_step({"X": X[:32], "label": y[:32]})
    assert sess.state["step"] == 3
    sess.initialize()
    for name, value in start.items():
        np.testing.assert_array_equal(sess.state[name], value, err_msg=name)


def test_batch_size_may_change_between_steps():
    """The demo's last batch of an epoch is smaller (1438 = 44 * 32 + 30)."""
    sess = TrainingSession(build_classifier(hidden=16))
    X, y = load_digits()
    for n in (32, 32, 30, 1, 32):
        out = sess.train_step({"X": X[:n], "label": y[:n]})
        assert out["logits"].shape == (n, 10)
    assert sess.run({"X": X[:5]})["logits"].shape == (5, 10)


def test_demo_reaches_95_percent(demo_result):
    assert demo_result["accuracy"] >= 0.95
    assert demo_result["steps"] == demo_steps(15, 32) == len(demo_result["progress_calls"])
    assert demo_result["seconds"] < 60
    assert demo_result["final_loss"] < 0.2
    epoch, step, loss = demo_result["progress_calls"][-1]
    assert (epoch, step) == (15, demo_result["steps"]) and isinstance(loss, float)
    assert demo_result["train_size"] + demo_result["test_size"] == 1797


def test_demo_export_is_a_plain_inference_model(demo_result):
    path = demo_result["path"]
    model = onnx.load(str(path))
    assert not model.training_info
    onnx.checker.check_model(model)
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    X, y = load_digits()
    _, X_test, _, y_test = train_test_split(X, y)
    (logits,) = plain.run(["logits"], {"X": X_test})
    assert np.mean(logits.argmax(axis=1) == y_test) == pytest.approx(demo_result["accuracy"])


def test_run_demo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="epochs"):
        run_demo(epochs=0, out_path=None)
    with pytest.raises(ValueError, match="batch_size"):
        run_demo(batch_size=0, out_path=None)


# ----------------------------------------------------------------------- CLI
def test_cli_demo(capsys, tmp_path):
    out = tmp_path / "demo.onnx"
    code, stdout, _ = run_cli(capsys, "demo", "--epochs", "1", "--batch-size", "64",
                              "-o", str(out))
    assert code == 0
    assert "test accuracy:" in stdout and str(out) in stdout
    assert out.exists() and not onnx.load(str(out)).training_info


def test_cli_inspect(capsys, classifier_path):
    code, out, err = run_cli(capsys, "inspect", str(classifier_path))
    assert code == 0, err
    for expected in ["ir_version: 10", "ai.onnx 17", "ai.onnx.preview.training 1",
                     "X: float32[N, 64]", "logits: float32[N, 10]", "training_info: 1",
                     "label: int64[N]", "W1 <- W1_new", "step <- step_new",
                     "W1 <- W1_init", "state variables: 13", "W1: float32[64, 16]",
                     "W2.adam_v: float32[16, 10]", "step: int64[]", "validation: OK"]:
        assert expected in out, expected


def test_cli_inspect_reports_an_invalid_model(capsys, broken_path):
    code, out, _ = run_cli(capsys, "inspect", str(broken_path))
    assert code == 1
    assert "not_a_state <- W1_new" in out
    assert "validation: INVALID: training_info[0].update_binding" in out


def test_cli_check(capsys, classifier_path):
    code, out, err = run_cli(capsys, "check", str(classifier_path))
    assert (code, out.strip(), err) == (0, "OK", "")


def test_cli_export(capsys, tmp_path, classifier_path):
    sess = TrainingSession(classifier_path)
    X, y = load_digits()
    sess.train_step({"X": X[:64], "label": y[:64]})
    ckpt = sess.export(tmp_path / "ckpt.onnx", training=True)

    out = tmp_path / "inference.onnx"
    code, stdout, err = run_cli(capsys, "export", str(ckpt), "-o", str(out))
    assert code == 0, err
    assert str(out) in stdout
    exported = onnx.load(str(out))
    assert not exported.training_info
    plain = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(plain.run(["logits"], {"X": X[:8]})[0],
                                  sess.run({"X": X[:8]})["logits"])

    again = tmp_path / "again.onnx"
    code, _, err = run_cli(capsys, "export", str(ckpt), "-o", str(again), "--training")
    assert code == 0, err
    assert TrainingSession(again).state["step"] == 1


def test_python_dash_m_check(classifier_path):
    proc = subprocess.run([sys.executable, "-m", "onnxtrain", "check", str(classifier_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"


# ----------------------------------------------------------------- mistakes
@pytest.mark.parametrize("command", ["check", "inspect", "export"])
def test_cli_missing_file(capsys, tmp_path, command):
    argv = [command, str(tmp_path / "missing.onnx")]
    if command == "export":
        argv += ["-o", str(tmp_path / "out.onnx")]
    code, out, err = run_cli(capsys, *argv)
    assert code == 1
    assert_one_line_error(err)
    assert "missing.onnx" in err


@pytest.mark.parametrize("command", ["check", "inspect"])
def test_cli_garbage_bytes(capsys, tmp_path, command):
    path = tmp_path / "garbage.onnx"
    path.write_bytes(b"this is not an onnx model \x00\xff\xfe\x01" * 4)
    code, _, err = run_cli(capsys, command, str(path))
    assert code == 1
    assert_one_line_error(err)
    assert "cannot parse" in err


def test_cli_check_binding_violation(capsys, broken_path):
    code, out, err = run_cli(capsys, "check", str(broken_path))
    assert code == 1 and out == ""
    assert_one_line_error(err)
    assert "update_binding" in err and "not_a_state" in err


def test_cli_export_binding_violation_writes_nothing(capsys, tmp_path, broken_path):
    out = tmp_path / "out.onnx"
    code, _, err = run_cli(capsys, "export", str(broken_path), "-o", str(out))
    assert code == 1
    assert_one_line_error(err)
    assert not out.exists()


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["export", "model.onnx"],
                                  ["demo", "--epochs", "0"], ["check"]])
def test_cli_usage_errors_exit_2(capsys, argv):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert "Traceback" not in err and "usage:" in err


# ------------------------------------------------------------------ examples
@pytest.mark.parametrize("script, expected", [
    ("linear_regression.py", "fitted w ="),
    ("mlp_digits.py", "identical predictions: True"),
])
def test_example_runs_quick(script, expected):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--quick"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout


# ------------------------------------------------------------------ what the demo says
def test_the_demo_labels_its_losses(capsys, tmp_path):
    assert main(["demo", "--epochs", "1", "-o", str(tmp_path / "d.onnx")]) == 0
    captured = capsys.readouterr()
    assert "last batch loss=" in captured.err  # the bar: each batch's own loss
    assert "last epoch's mean loss" in captured.out  # the summary: the epoch mean


def test_the_demo_checks_its_output_before_training(capsys, tmp_path):
    start = time.perf_counter()
    assert main(["demo", "--epochs", "1000", "-o", "/proc/d.onnx", "--no-progress"]) == 1
    assert time.perf_counter() - start < 20
    assert "-o /proc/d.onnx: the folder '/proc' takes no new files" in capsys.readouterr().err
