"""``onnxtrain train`` as a user meets it (issue 15): each case runs the CLI in a subprocess.

Bad labels and bad output paths fail at once in one line; ``--no-progress``
prints a line per epoch; Ctrl-C names the epoch the checkpoint holds; a
closed pipe ends the run quietly; TerminateOnNaN is on by default."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import build, checkpoint_epoch

F32 = TensorProto.FLOAT
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onnxtrain", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=ENV, **kw)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def inference_mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (4, 10)).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(10, np.float32), "b")]
    graph = helper.make_graph([helper.make_node("Gemm", ["X", "W", "b"], ["logits"])], "lin",
                              [helper.make_tensor_value_info("X", F32, ["N", 4])],
                              [helper.make_tensor_value_info("logits", F32, ["N", 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("conv")
    onnx.save(inference_mlp(), d / "plain.onnx")
    onnx.save(build.training_model(inference_mlp(), optimizer=build.SGD(lr=0.05)), d / "train.onnx")
    rng = np.random.default_rng(1)
    X = rng.normal(size=(64, 4)).astype(np.float32)
    y = rng.integers(0, 10, 64)
    np.savez(d / "ok.npz", X=X, y=y)
    np.savez(d / "one_based.npz", X=X, y=y % 10 + 1)  # labels 1..10 for 10 classes
    np.savez(d / "negative.npz", X=X, y=np.where(y == 3, -1, y))
    return d


def test_labels_out_of_range_are_one_line_before_training(files, tmp_path):
    out = tmp_path / "t.onnx"
    proc = cli("train", files / "train.onnx", "--data", files / "one_based.npz", "--epochs", 300,
               "-o", out, "--no-progress")
    one_line_error(proc, "target 'target' holds label 10", "C = 10", "subtract 1")
    assert proc.stdout == "" and not out.exists()
    proc = cli("train", files / "train.onnx", "--data", files / "negative.npz", "--epochs", 300,
               "-o", out, "--no-progress")
    one_line_error(proc, "label -1", "C = 10")


def test_an_output_folder_fails_before_the_first_epoch(files, tmp_path):
    start = time.perf_counter()
    proc = cli("train", files / "train.onnx", "--data", files / "ok.npz", "--epochs", 100000,
               "-o", tmp_path, "--no-progress")
    one_line_error(proc, f"-o {tmp_path}:", "is a folder")
    assert proc.stdout == "" and time.perf_counter() - start < 60
    proc = cli("train", files / "train.onnx", "--data", files / "ok.npz", "--epochs", 1,
               "-o", tmp_path / "t.onnx", "--checkpoint", tmp_path / "missing" / "c.onnx")
    one_line_error(proc, f"--checkpoint {tmp_path / 'missing' / 'c.onnx'}:", "does not exist")
    assert not (tmp_path / "t.onnx").exists()


def test_no_progress_prints_one_line_per_epoch(files, tmp_path):
    proc = cli("train", files / "train.onnx", "--data", files / "ok.npz", "--epochs", 3,
               "-o", tmp_path / "t.onnx", "--no-progress")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    epochs = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert all("loss " in line and "lr 0.05" in line for line in epochs)


def test_ctrl_c_reports_the_epoch_the_checkpoint_holds(files, tmp_path):
    ckpt = tmp_path / "c.onnx"
    proc = subprocess.Popen(
        [sys.executable, "-m", "onnxtrain", "train", str(files / "train.onnx"), "--data",
         str(files / "ok.npz"), "--epochs", "100000", "-o", str(tmp_path / "t.onnx"),
         "--checkpoint", str(ckpt), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        # The first epoch line is printed after the first checkpoint is written.
        assert proc.stdout.readline().startswith("epoch 1/")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    held = checkpoint_epoch(ckpt)
    assert held >= 1 and f"the checkpoint {ckpt} holds epoch {held}" in lines[0]
    assert lines[0].startswith("onnxtrain: interrupted")


def test_a_closed_pipe_ends_quietly(files, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "onnxtrain", "train", str(files / "train.onnx"), "--data",
         str(files / "ok.npz"), "--epochs", "100000", "-o", str(tmp_path / "t.onnx"),
         "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert proc.stdout.readline().startswith("epoch 1/")  # like `| head -1`
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and err == "", err


def test_terminate_on_nan_is_on_by_default(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "w"], ["z"]), helper.make_node("Log", ["z"], ["y"])],
        "log_linear", [helper.make_tensor_value_info("X", F32, ["N", 2])],
        [helper.make_tensor_value_info("y", F32, ["N", 1])],
        [numpy_helper.from_array(np.ones((2, 1), np.float32), "w")])
    onnx.save(build.training_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                   loss="mse"), tmp_path / "log.onnx")
    x = np.ones((8, 2), np.float32)
    x[6:] = -1.0  # the last batch (batch 4) gives log of a negative number
    np.savez(tmp_path / "d.npz", X=x, y=np.zeros((8, 1), np.float32))
    common = ["train", tmp_path / "log.onnx", "--data", tmp_path / "d.npz", "--epochs", 3,
              "--batch-size", 2, "-o", tmp_path / "t.onnx", "--checkpoint", tmp_path / "c.onnx",
              "--no-progress", "--seed", 5]
    line = one_line_error(cli(*common), "training loss is nan", "TerminateOnNaN")
    assert not (tmp_path / "t.onnx").exists()
    assert "epoch 1, batch" in line
    one_line_error(cli(*common, "--no-terminate-on-nan", "--overwrite"), "training loss is nan")


def test_check_says_when_a_model_is_not_a_training_model(files):
    proc = cli("check", files / "plain.onnx")
    assert proc.returncode == 0 and "not a training model" in proc.stdout
    assert cli("check", files / "train.onnx").stdout.strip() == "OK"


def test_every_command_refuses_an_output_folder_in_one_line(files, tmp_path):
    one_line_error(cli("export", files / "train.onnx", "-o", tmp_path), f"-o {tmp_path}:", "is a folder")
    one_line_error(cli("make-training", files / "plain.onnx", "-o", tmp_path), f"-o {tmp_path}:", "is a folder")


def test_labels_of_a_hand_written_training_model_are_checked_too(tmp_path):
    """A training model not made by onnxtrain.build (the demo's, written with
    onnx.helper: SoftmaxCrossEntropyLoss on the main graph's logits) has no
    onnxtrain metadata: the label check takes C from the loss node."""
    from onnxtrain.demo import build_classifier

    model = tmp_path / "demo.onnx"
    onnx.save(build_classifier(), model)
    rng = np.random.default_rng(2)
    X = rng.normal(size=(40, 64)).astype(np.float32)
    np.savez(tmp_path / "one_based.npz", X=X, label=rng.integers(1, 11, 40))
    proc = cli("train", model, "--data", tmp_path / "one_based.npz", "--epochs", 2,
               "-o", tmp_path / "t.onnx", "--no-progress")
    one_line_error(proc, "target 'label' holds label 10", "C = 10", "subtract 1")


def test_an_onnxruntime_failure_is_one_line(tmp_path):
    """A failure inside onnxruntime on the fed data (here a hand-written loss
    that gathers with the labels, GatherElements, with nothing to check them
    against) is one line naming the program and onnxruntime's message."""
    rng = np.random.default_rng(3)
    W = numpy_helper.from_array(rng.normal(0, 0.3, (4, 3)).astype(np.float32), "W")
    main = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["logits"])], "main",
                             [helper.make_tensor_value_info("X", F32, ["N", 4])],
                             [helper.make_tensor_value_info("logits", F32, ["N", 3])], [W])
    nodes = [
        helper.make_node("LogSoftmax", ["logits"], ["logp"], axis=1),
        helper.make_node("Unsqueeze", ["label", "axis1"], ["label2"]),
        helper.make_node("GatherElements", ["logp", "label2"], ["picked"], axis=1),
        helper.make_node("ReduceMean", ["picked"], ["mean"], keepdims=0),
        helper.make_node("Neg", ["mean"], ["loss"]),
        helper.make_node("Gradient", ["W"], ["gW"], domain="ai.onnx.preview.training", xs=["W"], y="loss"),
        helper.make_node("Mul", ["gW", "lr"], ["dW"]),
        helper.make_node("Sub", ["W", "dW"], ["W_new"]),
    ]
    algo = helper.make_graph(
        nodes, "algo", [helper.make_tensor_value_info("label", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", F32, []), helper.make_tensor_value_info("W_new", F32, [4, 3])],
        [numpy_helper.from_array(np.array([1], np.int64), "axis1"),
         numpy_helper.from_array(np.array(0.1, np.float32), "lr")])
    m = helper.make_model(main, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("ai.onnx.preview.training", 1)])
    m.ir_version = 10
    ti = m.training_info.add()
    ti.algorithm.CopyFrom(algo)
    ti.update_binding.add(key="W", value="W_new")
    onnx.save(m, tmp_path / "hand.onnx")
    np.savez(tmp_path / "bad.npz", X=rng.normal(size=(8, 4)).astype(np.float32), label=np.full(8, 7))
    proc = cli("train", tmp_path / "hand.onnx", "--data", tmp_path / "bad.npz", "--epochs", 1,
               "-o", tmp_path / "t.onnx", "--no-progress")
    # (the gather, or its gradient's scatter where the program runs specialized to the feed shapes)
    one_line_error(proc, "training_info[0].algorithm: onnxruntime failed", "Elements")
    assert not (tmp_path / "t.onnx").exists()
