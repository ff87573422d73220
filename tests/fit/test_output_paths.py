"""Outputs never destroy anything.

Special files (a FIFO, a folder, a character device we only read the
refusal of), an output that is the model or another output, an unwritable
folder, an existing checkpoint without --resume: each refused before the first
step, in one line naming the option and the path as given, with the file left
as it was.  ``ModelCheckpoint`` overwrites its file as Keras's does, while
the CLI refuses, and both are documented.  The CLI runs in-process
(``main``)."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import gemm_inference
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import ModelCheckpoint, TrainingSession, build, checkpoint_epoch
from onnxtrain.cli.app import main
from onnxtrain.core.files import write_atomically
from onnxtrain.io.storage import write_model
from onnxtrain.train.callbacks import CSVLogger, check_writable

ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(code: int, err: str, *fragments: str) -> str:
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("onnxtrain: error: "), err
    assert ".tmp" not in lines[0], lines[0]  # no temporary file name
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def inference_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (4, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(3, np.float32), "b")]
    graph = helper.make_graph([helper.make_node("Gemm", ["X", "W", "b"], ["logits"])], "lin",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture()
def files(tmp_path):
    onnx.save(build.training_model(inference_model(), optimizer=build.SGD(lr=0.05)),
              tmp_path / "train.onnx")
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "ok.npz", X=rng.normal(size=(16, 4)).astype(np.float32),
             y=rng.integers(0, 3, 16))
    return tmp_path


def train(capsys, files, *extra, epochs=100000):
    """A run that would take hours: a refusal must come before the first step."""
    start = time.perf_counter()
    result = run_cli(capsys, "train", files / "train.onnx", "--data", files / "ok.npz",
                     "--epochs", epochs, "--no-progress", *extra)
    assert time.perf_counter() - start < 30
    return result


def test_a_fifo_output_is_refused_and_left_as_it_was(capsys, files):
    fifo = files / "pipe.onnx"
    os.mkfifo(fifo)
    code, out, err = train(capsys, files, "-o", fifo)
    one_line_error(code, err, f"-o {fifo}: ", "not a regular file", "FIFO")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and out == ""
    code, _, err = train(capsys, files, "-o", files / "t.onnx", "--checkpoint", fifo)
    one_line_error(code, err, f"--checkpoint {fifo}: ", "FIFO")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and not (files / "t.onnx").exists()
    # export and make-training too
    code, _, err = run_cli(capsys, "export", files / "train.onnx", "-o", fifo)
    one_line_error(code, err, f"-o {fifo}: ", "FIFO")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_dev_null_and_a_folder_are_refused(capsys, files):
    before = os.stat("/dev/null")
    code, _, err = train(capsys, files, "-o", "/dev/null")
    one_line_error(code, err, "-o /dev/null: ", "character device")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev
    code, _, err = train(capsys, files, "-o", files)
    one_line_error(code, err, f"-o {files}: ", "is a folder")


@pytest.mark.parametrize("folder", ["/proc", "/sys"])
def test_an_unwritable_folder_fails_at_once_naming_the_path_given(capsys, files, folder):
    if not os.path.isdir(folder):
        pytest.skip(f"no {folder} here")
    target = f"{folder}/t.onnx"
    code, out, err = train(capsys, files, "-o", target)
    one_line_error(code, err, f"-o {target}: ", f"the folder '{folder}' takes no new files (")
    assert "No such file or directory" not in err  # errno's words, which read oddly here
    assert out == ""  # no epoch ran


def test_a_read_only_folder_is_refused(capsys, files, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, _, err = train(capsys, files, "-o", ro / "t.onnx")
        one_line_error(code, err, f"-o {ro / 't.onnx'}: ")
    finally:
        ro.chmod(0o700)


def test_an_output_over_the_model_or_another_output_is_refused(capsys, files):
    model = files / "train.onnx"
    before = model.read_bytes()
    code, _, err = train(capsys, files, "-o", model)
    one_line_error(code, err, f"-o {model}: ", "the model being trained")
    code, _, err = train(capsys, files, "-o", files / "x.onnx", "--checkpoint", model)
    one_line_error(code, err, f"--checkpoint {model}: ", "the model being trained")
    code, _, err = train(capsys, files, "-o", files / "x.onnx", "--checkpoint", files / "x.onnx")
    one_line_error(code, err, f"--checkpoint {files / 'x.onnx'}: ", "also the -o output")
    # the same file by another spelling, and a hard link
    code, _, err = train(capsys, files, "-o", str(files / "sub" / ".." / "train.onnx"))
    assert code == 1 and "sub/../train.onnx" in err
    os.link(model, files / "linked.onnx")
    code, _, err = train(capsys, files, "-o", files / "linked.onnx")
    one_line_error(code, err, "the model being trained")
    code, _, err = train(capsys, files, "-o", files / "ok.npz")
    one_line_error(code, err, "the data (--data)")
    assert model.read_bytes() == before and not (files / "x.onnx").exists()
    code, _, err = run_cli(capsys, "export", model, "-o", model)
    one_line_error(code, err, f"-o {model}: ", "the checkpoint read")
    assert model.read_bytes() == before


def test_two_outputs_through_a_folder_link_are_one_file(capsys, files):
    """``-o link/out.onnx --checkpoint real/out.onnx``, ``link`` a symbolic
    link to the folder ``real``, neither file there yet: one file named twice,
    refused before the first step.

    Bug caught: ``same_file`` comparing ``os.path.abspath`` instead of
    ``realpath`` when the files do not exist (links not followed)."""
    from onnxtrain.train.callbacks import same_file

    real = files / "real"
    real.mkdir()
    (files / "link").symlink_to(real, target_is_directory=True)
    out, ck = files / "link" / "out.onnx", real / "out.onnx"
    assert same_file(out, ck) and not same_file(out, real / "other.onnx")
    code, stdout, err = train(capsys, files, "-o", out, "--checkpoint", ck)
    one_line_error(code, err, f"--checkpoint {ck}: ", "also the -o output")
    assert stdout == "" and not ck.exists()


def test_an_existing_checkpoint_needs_resume_or_overwrite(capsys, files):
    ck, out = files / "ck.onnx", files / "t.onnx"
    code, _, err = train(capsys, files, "-o", out, "--checkpoint", ck, epochs=3)
    assert code == 0, err
    held = ck.read_bytes()
    assert checkpoint_epoch(ck) == 3
    code, _, err = train(capsys, files, "-o", out, "--checkpoint", ck, epochs=1)
    line = one_line_error(code, err, f"--checkpoint {ck}: ", "epoch 3", f"--resume {ck}",
                          "--overwrite")
    assert ck.read_bytes() == held, line
    # --resume continues it; --overwrite starts again over it
    code, _, err = train(capsys, files, "-o", out, "--checkpoint", ck, "--resume", ck, epochs=4)
    assert code == 0, err
    assert checkpoint_epoch(ck) == 4
    code, _, err = train(capsys, files, "-o", out, "--checkpoint", ck, "--overwrite", epochs=1)
    assert code == 0, err
    assert checkpoint_epoch(ck) == 1
    # resuming, -o may not be the checkpoint being resumed
    code, _, err = train(capsys, files, "-o", ck, "--resume", ck, epochs=2)
    one_line_error(code, err, f"-o {ck}: ", "the checkpoint being resumed")


def test_fit_file_callbacks_check_their_paths_before_the_first_step(tmp_path):
    sess = TrainingSession(build.training_model(inference_model(), optimizer=build.SGD(lr=0.05)))
    before = {k: v.copy() for k, v in sess.state.items()}
    fifo = tmp_path / "log.csv"
    os.mkfifo(fifo)
    X = np.zeros((4, 4), np.float32)
    y = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match=f"CSVLogger {fifo}: .*FIFO"):
        sess.fit(X, y, progress=False, callbacks=[CSVLogger(fifo)])
    with pytest.raises(ValueError, match="ModelCheckpoint /proc/c.onnx: the folder '/proc' takes no new files"):
        sess.fit(X, y, progress=False, callbacks=[ModelCheckpoint("/proc/c.onnx")])
    for k, v in before.items():
        np.testing.assert_array_equal(sess.state[k], v)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_export_refuses_a_destination_that_is_not_a_regular_file(tmp_path):
    sess = TrainingSession(build.training_model(inference_model(), optimizer=build.SGD(lr=0.05)))
    fifo = tmp_path / "out.onnx"
    os.mkfifo(fifo)
    for training in (False, True):
        with pytest.raises(FileExistsError, match="not a regular file"):
            sess.export(fifo, training=training)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(FileExistsError, match="a folder"):
        sess.export(tmp_path)
    # a link to a special file is refused too; a link to a regular file is replaced
    link = tmp_path / "link.onnx"
    link.symlink_to(fifo)
    with pytest.raises(FileExistsError):
        write_model(sess.to_model(), link)
    with pytest.raises(FileExistsError):
        write_atomically(link, b"x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(FileExistsError):
        sess.export("/dev/null")  # refused before anything is written
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    regular = tmp_path / "ok.onnx"
    regular.write_bytes(b"old")
    sess.export(regular)
    assert onnx.load(str(regular)).graph.initializer


def test_check_writable_names_the_option_and_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"^-o /proc/t.onnx: the folder '/proc' takes no new files "
                                         r"\(its file system refuses them, as /proc and /sys do\)$"):
        check_writable("/proc/t.onnx", "-o")
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    check_writable(tmp_path / "fine.onnx", "-o")
    assert os.listdir(tmp_path) == []  # the probe file is gone


def test_two_fit_callbacks_writing_one_file_are_refused(tmp_path):
    sess = TrainingSession(build.training_model(inference_model(), optimizer=build.SGD(lr=0.05)))
    X, y = np.zeros((4, 4), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match=f"CSVLogger {tmp_path / 'a.onnx'}: is the file of "
                                         "fit: ModelCheckpoint"):
        sess.fit(X, y, progress=False, callbacks=[ModelCheckpoint(tmp_path / "a.onnx"),
                                                  CSVLogger(tmp_path / "a.onnx")])
    assert not (tmp_path / "a.onnx").exists()


def test_ctrl_c_names_the_resume_command_that_goes_on(capsys, files, monkeypatch):
    import shlex

    from onnxtrain.cli import app as cli

    ck, out = files / "ck.onnx", files / "t.onnx"

    def interrupt_after_epoch_2(self, epoch, logs):
        if epoch == 1:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(cli._EpochLines, "on_epoch_end", interrupt_after_epoch_2)
        code, _, err = train(capsys, files, "-o", out, "--checkpoint", ck, epochs=5)
    assert code == 130
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"the checkpoint {ck} holds epoch 2" in lines[0]
    command = lines[0].split("continue with: ", 1)[1]
    words = shlex.split(command)
    assert words[:2] == ["onnxtrain", "train"] and words[words.index("--resume") + 1] == str(ck)
    assert main(words[1:]) == 0  # the command as printed goes on from epoch 2
    assert checkpoint_epoch(ck) == 5
    assert "resumed from" in capsys.readouterr().out


def test_a_failed_write_names_the_destination_not_the_temporary_file(tmp_path):
    with pytest.raises(OSError) as info:
        write_atomically("/proc/t.onnx", b"x")
    assert "/proc/t.onnx" in str(info.value) and ".tmp" not in str(info.value)
    with pytest.raises(OSError) as info:
        write_model(inference_model(), "/proc/t.onnx")
    assert "/proc/t.onnx" in str(info.value) and ".tmp" not in str(info.value)

    def fails(f):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left") as info:
        write_atomically(tmp_path / "full.onnx", fails)
    assert info.value.filename == str(tmp_path / "full.onnx")
    assert os.listdir(tmp_path) == []  # the temporary file is gone


# ------------------------------------------------------------------ ModelCheckpoint and the CLI
def test_model_checkpoint_overwrites_as_keras_does_and_the_cli_refuses(tmp_path, capsys):
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((32, 4)).astype(np.float32), rng.integers(0, 3, 32)
    tm = build.training_model(gemm_inference(4, 3))
    ckpt = tmp_path / "ckpt.onnx"
    TrainingSession(tm).fit(X, y, epochs=3, progress=False, callbacks=[ModelCheckpoint(ckpt)])
    assert checkpoint_epoch(ckpt) == 3
    TrainingSession(tm).fit(X, y, epochs=1, progress=False, callbacks=[ModelCheckpoint(ckpt)])
    assert checkpoint_epoch(ckpt) == 1  # the earlier run's checkpoint is replaced
    np.savez(tmp_path / "d.npz", X=X, y=y)
    onnx.save(tm, str(tmp_path / "t.onnx"))
    assert main(["train", str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs",
                 "1", "-o", str(tmp_path / "o.onnx"), "--checkpoint", str(ckpt)]) == 1
    assert "--resume" in capsys.readouterr().err and checkpoint_epoch(ckpt) == 1


@pytest.mark.parametrize("text", [ModelCheckpoint.__doc__, (ROOT / "docs" / "fit.md").read_text()])
def test_the_difference_is_documented(text):
    words = " ".join(text.split())
    assert re.search(r"overwrites .*as Keras", words)
    assert "--resume" in words and "--overwrite" in words
