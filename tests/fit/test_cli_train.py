"""``onnxtrain make-training`` and ``onnxtrain train``: the happy paths and every user mistake.

The CLI runs in-process through ``main([...])``; a user mistake must give exit
code 1 and exactly one ``onnxtrain: error: ...`` line on stderr, never a
traceback; a command line syntax error exits with 2 (argparse)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession
from onnxtrain.cli.app import main, parse_schedule
from onnxtrain.datasets import load_digits, train_test_split
from onnxtrain.io.metadata import checkpoint_epoch, model_metadata


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("onnxtrain: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def inference_mlp(hidden: int = 16, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = {
        "W1": (rng.standard_normal((64, hidden)) * np.sqrt(2 / 64)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "W2": (rng.standard_normal((hidden, 10)) * np.sqrt(2 / (hidden + 10))).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W1", "b1"], ["h"]),
         helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"])],
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """An inference MLP, its training model (built by the CLI) and digits .npz files."""
    folder = tmp_path_factory.mktemp("cli")
    onnx.save(inference_mlp(), str(folder / "mlp.onnx"))
    X, y = load_digits()
    X_train, X_test, y_train, y_test = train_test_split(X, y, seed=0)
    np.savez(folder / "train.npz", X=X_train[:500], y=y_train[:500])
    np.savez(folder / "test.npz", X=X_test, y=y_test)
    np.savez(folder / "named.npz", X=X_train[:100], label=y_train[:100])
    code = main(["make-training", str(folder / "mlp.onnx"), "-o", str(folder / "train.onnx"),
                 "--target", "label", "--lr", "0.01"])
    assert code == 0
    return folder


# --------------------------------------------------------------- make-training
def test_make_training_writes_a_standard_training_model(capsys, files):
    out = files / "adam.onnx"
    code, stdout, err = run_cli(capsys, "make-training", files / "mlp.onnx", "-o", out,
                                "--loss", "cross_entropy", "--target", "label",
                                "--optimizer", "adam", "--lr", "1e-3")
    assert code == 0, err
    assert f"wrote training model {out}" in stdout
    assert "4 trainable" in stdout and "W1.adam_m" in stdout  # the session summary
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    assert len(model.training_info) == 1
    meta = model_metadata(model)
    assert meta["target"] == "label" and meta["task"] == "classification"
    assert meta["trainable"] == ["W1", "b1", "W2", "b2"]


def test_make_training_frozen_schedule_and_accumulate(capsys, files):
    out = files / "frozen.onnx"
    code, stdout, err = run_cli(capsys, "make-training", files / "mlp.onnx", "-o", out,
                                "--target", "label", "--optimizer", "sgd", "--momentum", "0.9",
                                "--frozen", "W1", "b1", "--schedule", "cosine:1000",
                                "--accumulate", "2", "--clip-grad-norm", "1.0")
    assert code == 0, err
    model = onnx.load(str(out))
    meta = model_metadata(model)
    assert meta["trainable"] == ["W2", "b2"] and meta["cycle"] == [0, 1]
    assert len(model.training_info) == 2
    sess = TrainingSession(model)
    assert "W1" not in sess.state and "W2" in sess.state  # frozen: a constant, not state
    X, y = load_digits()
    before = sess.state["W2"]
    sess.fit((X[:64], y[:64]), batch_size=32, progress=False)
    assert int(sess.state["step"]) == 1  # two batches, one update
    assert not np.array_equal(sess.state["W2"], before)
    exported = {t.name: t for t in sess.to_model().graph.initializer}
    original = {t.name: t for t in onnx.load(str(files / "mlp.onnx")).graph.initializer}
    assert exported["W1"] == original["W1"]


@pytest.mark.parametrize("text, expected", [
    ("cosine:1000", "Cosine(total_steps=1000, warmup=0)"),
    ("cosine:1000:50", "Cosine(total_steps=1000, warmup=50)"),
    ("cosine", "Cosine(total_steps=None, warmup=0)"),
    ("cosine::50", "Cosine(total_steps=None, warmup=50)"),
    ("step_decay:30", "StepDecay(step_size=30, gamma=0.1)"),
    ("step_decay:30:0.5", "StepDecay(step_size=30, gamma=0.5)"),
    ("linear_warmup:10", "LinearWarmup(warmup_steps=10)"),
])
def test_parse_schedule(text, expected):
    assert repr(parse_schedule(text)) == expected


@pytest.mark.parametrize("argv, fragments", [
    (["--frozen", "W9"], ["--frozen: 'W9' is not an initializer", "W1, b1, W2, b2"]),
    (["--frozen", "W1", "b1", "W2", "b2"], ["no trainable parameters"]),
    (["--schedule", "cosine:1:2:3"], ["--schedule: expected one of"]),
    (["--schedule", "cosine:many"], ["--schedule", "cosine:many"]),
    (["--schedule", "warp:3"], ["--schedule", "warp:3"]),
    (["--schedule", "linear_warmup:0"], ["--schedule", "warmup_steps"]),
    (["--momentum", "0.9"], ["--momentum applies to --optimizer sgd"]),
    (["--output-name", "nope"], ["'nope' is not an output"]),
    (["--target", "X"], ["'X' is already used"]),
])
def test_make_training_mistakes(capsys, files, argv, fragments):
    out = files / "never.onnx"
    code, stdout, err = run_cli(capsys, "make-training", files / "mlp.onnx", "-o", out, *argv)
    assert code == 1 and stdout == ""
    assert_one_line_error(err, *fragments)
    assert not out.exists()


def test_make_training_bad_model_files(capsys, files, tmp_path):
    code, _, err = run_cli(capsys, "make-training", tmp_path / "missing.onnx", "-o", tmp_path / "o")
    assert code == 1
    assert_one_line_error(err, "missing.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\xffnot a model" * 8)
    code, _, err = run_cli(capsys, "make-training", garbage, "-o", tmp_path / "o")
    assert code == 1
    assert_one_line_error(err, "cannot parse")


@pytest.mark.parametrize("argv", [
    ["make-training"],
    ["make-training", "m.onnx"],                          # -o is required
    ["make-training", "m.onnx", "-o", "o", "--loss", "hinge"],
    ["make-training", "m.onnx", "-o", "o", "--optimizer", "lbfgs"],
    ["make-training", "m.onnx", "-o", "o", "--lr", "-1"],
    ["make-training", "m.onnx", "-o", "o", "--lr", "fast"],
    ["make-training", "m.onnx", "-o", "o", "--accumulate", "0"],
])
def test_make_training_usage_errors_exit_2(capsys, argv):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "usage:" in err and "Traceback" not in err


# ---------------------------------------------------------------------- train
def test_train_shows_progress_and_writes_an_inference_model(capsys, files, tmp_path):
    out = tmp_path / "trained.onnx"
    code, stdout, err = run_cli(capsys, "train", files / "train.onnx", "--data", files / "train.npz",
                                "--epochs", 3, "--batch-size", 32, "-o", out,
                                "--validation-data", files / "test.npz")
    assert code == 0, err
    assert "epoch 1/3" in err and "epoch 3/3" in err and "16/16" in err and "loss=" in err
    lines = stdout.splitlines()
    assert lines[0].startswith("epoch 1/3: loss ")
    assert "val_accuracy" in lines[2]
    assert f"wrote inference model {out}" in stdout
    model = onnx.load(str(out))
    assert not model.training_info
    plain = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    with np.load(files / "test.npz") as test:
        (logits,) = plain.run(["logits"], {"X": test["X"]})
        accuracy = np.mean(logits.argmax(1) == test["y"])
    assert accuracy > 0.8
    reported = float(lines[2].split("val_accuracy ")[1].split(",")[0])
    assert accuracy == pytest.approx(reported, abs=1e-4)


def test_train_accepts_arrays_named_like_the_feeds(capsys, files, tmp_path):
    code, _, err = run_cli(capsys, "train", files / "train.onnx", "--data", files / "named.npz",
                           "--epochs", 1, "-o", tmp_path / "t.onnx", "--no-progress")
    assert code == 0, err
    assert err == ""


def test_train_checkpoint_and_resume_match_an_uninterrupted_run(capsys, files, tmp_path):
    common = ["--data", files / "train.npz", "--batch-size", 64, "--no-progress", "--seed", 7]
    code, _, err = run_cli(capsys, "train", files / "train.onnx", "--epochs", 4,
                           "-o", tmp_path / "straight.onnx", *common)
    assert code == 0, err

    ckpt = tmp_path / "ckpt.onnx"
    code, _, err = run_cli(capsys, "train", files / "train.onnx", "--epochs", 2,
                           "-o", tmp_path / "half.onnx", "--checkpoint", ckpt, *common)
    assert code == 0, err
    assert checkpoint_epoch(onnx.load(str(ckpt))) == 2
    code, stdout, err = run_cli(capsys, "train", files / "train.onnx", "--epochs", 4,
                                "-o", tmp_path / "resumed.onnx", "--resume", ckpt,
                                "--checkpoint", ckpt, *common)
    assert code == 0, err
    assert f"resumed from {ckpt} after epoch 2" in stdout
    assert "epoch 3/4" in stdout and "epoch 4/4" in stdout and "epoch 2/4" not in stdout
    assert checkpoint_epoch(onnx.load(str(ckpt))) == 4

    straight = {t.name: numpy_helper.to_array(t)
                for t in onnx.load(str(tmp_path / "straight.onnx")).graph.initializer}
    resumed = {t.name: numpy_helper.to_array(t)
               for t in onnx.load(str(tmp_path / "resumed.onnx")).graph.initializer}
    assert set(straight) == set(resumed) == {"W1", "b1", "W2", "b2"}
    for name in straight:
        np.testing.assert_array_equal(straight[name], resumed[name], err_msg=name)

    # Resuming a finished checkpoint trains nothing and still writes the model.
    code, stdout, err = run_cli(capsys, "train", files / "train.onnx", "--epochs", 4,
                                "-o", tmp_path / "again.onnx", "--resume", ckpt, *common)
    assert code == 0, err
    assert "nothing to train: the checkpoint is at epoch 4 of 4" in stdout
    assert (tmp_path / "again.onnx").exists()
    # With progress shown too, the command says it once (fit's own line stays quiet).
    code, stdout, err = run_cli(capsys, "train", files / "train.onnx", "--epochs", 2,
                                "-o", tmp_path / "again.onnx", "--resume", ckpt, "--overwrite",
                                "--data", files / "train.npz", "--batch-size", 64, "--seed", 7)
    assert code == 0, err
    assert (stdout + err).count("nothing to train") == 1, stdout + err
    assert "nothing to train: the checkpoint is at epoch 4 of 2" in stdout


def npz_with(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("case, fragments", [
    ("missing data", ["no such data file", "missing.npz"]),
    ("not npz", ["not a .npz archive"]),
    ("wrong arrays", ["expected arrays 'X' and 'y'", "['A']"]),
    ("wrong features", ["feed 'X' has shape [10, 5]"]),
    ("wrong label dtype", ["target 'label' holds 0.5 at index [0]", "--loss mse"]),
    ("row mismatch", ["same number of rows"]),
    ("missing model", ["nope.onnx"]),
    ("inference model", ["mlp.onnx", "no training_info", "make-training"]),
    ("foreign checkpoint", ["not a checkpoint of", "no state variable 'W1'"]),
    ("missing checkpoint", ["gone.onnx"]),
])
def test_train_mistakes(capsys, files, tmp_path, case, fragments):
    data = files / "train.npz"
    model = files / "train.onnx"
    extra = []
    if case == "missing data":
        data = tmp_path / "missing.npz"
    elif case == "not npz":
        data = tmp_path / "notes.npz"
        data.write_text("X, y\n1, 2\n")
    elif case == "wrong arrays":
        data = npz_with(tmp_path / "a.npz", A=np.zeros(3))
    elif case == "wrong features":
        data = npz_with(tmp_path / "f.npz", X=np.zeros((10, 5), np.float32), y=np.zeros(10, np.int64))
    elif case == "wrong label dtype":
        data = npz_with(tmp_path / "l.npz", X=np.zeros((10, 64), np.float32), y=np.full(10, 0.5, np.float32))
    elif case == "row mismatch":
        data = npz_with(tmp_path / "r.npz", X=np.zeros((10, 64), np.float32), y=np.zeros(9, np.int64))
    elif case == "missing model":
        model = tmp_path / "nope.onnx"
    elif case == "inference model":
        model = files / "mlp.onnx"
    elif case == "foreign checkpoint":
        other = inference_mlp()
        for t in other.graph.initializer:
            t.name = "renamed_" + t.name
        for n in other.graph.node:
            n.input[:] = ["renamed_" + i if i in ("W1", "b1", "W2", "b2") else i for i in n.input]
        onnx.save(other, str(tmp_path / "other.onnx"))
        assert main(["make-training", str(tmp_path / "other.onnx"), "-o", str(tmp_path / "oc.onnx"),
                     "--target", "label"]) == 0
        capsys.readouterr()
        extra = ["--resume", tmp_path / "oc.onnx"]
    elif case == "missing checkpoint":
        extra = ["--resume", tmp_path / "gone.onnx"]
    out = tmp_path / "out.onnx"
    code, stdout, err = run_cli(capsys, "train", model, "--data", data, "--epochs", 1,
                                "-o", out, "--no-progress", *extra)
    assert code == 1, (stdout, err)
    assert_one_line_error(err, *fragments)
    assert not out.exists()


def test_an_adam_checkpoint_is_not_resumed_into_an_sgd_model(capsys, files, tmp_path):
    """The Adam run's checkpoint has every state variable of the SGD model (the
    same weights) and more (the moments, the step count): resuming it there
    would drop them silently, so it is refused in one line naming them.

    Bug caught: the operands of the "unexpected state variables" difference
    swapped in ``cli/train.py`` (the model's variables minus the
    checkpoint's: empty, so it never fires)."""
    for optimizer in ("adam", "sgd"):
        code, _, err = run_cli(capsys, "make-training", files / "mlp.onnx", "-o", tmp_path / f"{optimizer}.onnx",
                               "--target", "label", "--optimizer", optimizer, "--lr", "0.01")
        assert code == 0, err
    ck = tmp_path / "adam_ck.onnx"
    common = ["--data", files / "named.npz", "--epochs", 1, "--no-progress"]
    code, _, err = run_cli(capsys, "train", tmp_path / "adam.onnx", "-o", tmp_path / "a.onnx",
                           "--checkpoint", ck, *common)
    assert code == 0, err
    adam, sgd = TrainingSession(str(ck)).state_info, TrainingSession(str(tmp_path / "sgd.onnx")).state_info
    assert set(sgd) < set(adam)  # the case: nothing missing, something extra
    out = tmp_path / "s.onnx"
    code, stdout, err = run_cli(capsys, "train", tmp_path / "sgd.onnx", "-o", out, "--resume", ck, *common)
    assert code == 1, (stdout, err)
    extra = sorted(set(adam) - set(sgd))
    assert_one_line_error(err, f"{ck}: not a checkpoint of", "unexpected state variables", repr(extra[0]))
    assert not out.exists()


@pytest.mark.parametrize("argv", [
    ["train", "m.onnx", "--epochs", "1", "-o", "o"],           # --data is required
    ["train", "m.onnx", "--data", "d.npz", "-o", "o"],         # --epochs is required
    ["train", "m.onnx", "--data", "d.npz", "--epochs", "1"],   # -o is required
    ["train", "m.onnx", "--data", "d.npz", "--epochs", "0", "-o", "o"],
    ["train", "m.onnx", "--data", "d.npz", "--epochs", "1", "-o", "o", "--batch-size", "x"],
])
def test_train_usage_errors_exit_2(capsys, argv):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "usage:" in err and "Traceback" not in err


def test_checkpoint_metadata_is_json(files, tmp_path, capsys):
    ckpt = tmp_path / "c.onnx"
    assert main(["train", str(files / "train.onnx"), "--data", str(files / "named.npz"),
                 "--epochs", "1", "-o", str(tmp_path / "t.onnx"), "--checkpoint", str(ckpt),
                 "--no-progress"]) == 0
    props = {p.key: p.value for p in onnx.load(str(ckpt)).metadata_props}
    assert json.loads(props["onnxtrain.checkpoint"]) == {"epoch": 1, "step": 4}  # the fit position
    assert json.loads(props["onnxtrain.target"]) == "label"


def test_train_stops_on_a_nan_loss(capsys, tmp_path):
    """y = log(X w): a negative X makes the loss NaN at the first step; one error line, exit 1."""
    from onnxtrain import build

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "w"], ["z"]), helper.make_node("Log", ["z"], ["y"])],
        "log_linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(np.ones((2, 1), np.float32), "w")],
    )
    tm = build.training_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                              loss="mse")
    onnx.save(tm, str(tmp_path / "log.onnx"))
    data = npz_with(tmp_path / "neg.npz", X=-np.ones((8, 2), np.float32), y=np.zeros((8, 1), np.float32))
    out = tmp_path / "out.onnx"
    code, stdout, err = run_cli(capsys, "train", tmp_path / "log.onnx", "--data", data, "--epochs", 2,
                                "--batch-size", 4, "-o", out, "--no-progress")
    assert code == 1, (stdout, err)
    assert_one_line_error(err, "training loss is nan", "epoch 1, batch 1 (step 1")
    assert not out.exists()
