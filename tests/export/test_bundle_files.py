"""The bundle folder as a file format (issue 32): what load refuses (each in
one message naming the version, file or variable), how save treats what is
already at the folder's path, and the command line's output safety."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import mlp_classifier
from test_cli_conventions import cli, one_line_error

from onnxtrain import TrainingSession, bundle
from onnxtrain.export import bundle as bundle_writer

X = np.random.default_rng(3).standard_normal((8, 4)).astype(np.float32)
LABEL = np.arange(8, dtype=np.int64) % 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bundles") / "good"
    # (W1 holds 1 KiB: its initial value goes to constants.bin)
    bundle.save(mlp_classifier("adam", sizes=(4, 64, 3), groups=[["W1", "b1"], ["W2", "b2"]]), folder)
    return folder


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "copy"))


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def rewrite(folder: Path, change) -> None:
    manifest = manifest_of(folder)
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ------------------------------------------------------------------ reading
def test_an_unknown_version_is_refused_naming_it(copy):
    rewrite(copy, lambda m: m.update(version=2))
    with pytest.raises(bundle.BundleError, match=r"bundle version 2 is not known .* reads version 1"):
        bundle.load(copy)
    rewrite(copy, lambda m: m.update(version="1"))
    with pytest.raises(bundle.BundleError, match="version is '1', expected an integer"):
        bundle.load(copy)


def test_another_format_is_refused(copy):
    rewrite(copy, lambda m: m.update(format="something-else"))
    with pytest.raises(bundle.BundleError, match="format is 'something-else', expected 'onnxtrain-bundle'"):
        bundle.load(copy)


@pytest.mark.parametrize("name", ["state.bin", "program_algorithm_1.onnx", "program_initialization_0.onnx",
                                  "training_model.onnx", "inference.onnx", "constants.bin"])
def test_a_missing_file_is_refused_naming_it(copy, name):
    os.unlink(copy / name)
    with pytest.raises(bundle.BundleFileMissing, match=f"missing file '{name}'") as info:
        bundle.load(copy)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    assert len(str(info.value).splitlines()) == 1


def test_a_folder_without_manifest_or_no_folder(tmp_path):
    with pytest.raises(bundle.BundleFileMissing, match="missing file 'manifest.json'"):
        bundle.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        bundle.load(tmp_path / "absent")


@pytest.mark.parametrize("extra", [b"\0", b""])
def test_a_state_bin_of_the_wrong_size_is_refused(copy, extra):
    data = (copy / "state.bin").read_bytes()
    (copy / "state.bin").write_bytes(data + extra if extra else data[:-8])
    with pytest.raises(bundle.BundleError, match=r"state\.bin: \d+ bytes, but the manifest's state_bytes is"):
        bundle.load(copy)


@pytest.mark.parametrize("field, value, message", [
    ("shape", [1], r"length 8, but int64\[1\] takes 8 bytes|not stored as the manifest says"),
    ("dtype", "int32", r"length 8, but int32\[\] takes 4 bytes"),
    ("dtype", "complex64", "dtype 'complex64' is not one of"),
    ("offset", 3, "offset 3 is not a multiple of 64"),
    ("length", 16, r"length 16, but int64\[\] takes 8 bytes"),
    ("shape", [-1], "is not a list of sizes"),
])
def test_a_state_entry_that_does_not_fit_is_refused(copy, field, value, message):
    def change(m):
        step = next(e for e in m["state"] if e["name"] == "step0")
        step[field] = value
    rewrite(copy, change)
    with pytest.raises(bundle.BundleError, match=message):
        bundle.load(copy)


def test_entries_that_overlap_or_pass_the_end_are_refused(copy):
    original = (copy / "manifest.json").read_text()

    def overlap(m):
        m["state"][1]["offset"] = m["state"][0]["offset"]
    rewrite(copy, overlap)
    with pytest.raises(bundle.BundleError, match=r"state variables .* overlap in state\.bin"):
        bundle.load(copy)

    def past_the_end(m):
        m["state"][-1]["offset"] = -(-m["state_bytes"] // 64) * 64
    (copy / "manifest.json").write_text(original)
    rewrite(copy, past_the_end)
    with pytest.raises(bundle.BundleError, match=r"lie past the end of state\.bin"):
        bundle.load(copy)


def test_a_manifest_that_disagrees_with_the_training_model_is_refused(copy):
    def swap(m):  # two float32 variables of one shape, their places exchanged
        a, b = [e for e in m["state"] if e["name"] in ("W1", "W1_v")]
        a["offset"], b["offset"] = b["offset"], a["offset"]
    rewrite(copy, swap)
    with pytest.raises(bundle.BundleError, match="state variable 'W1' is not stored as the manifest says"):
        bundle.load(copy)


def test_the_fit_position_is_the_manifests(tmp_path):
    """Another trainer that goes on updates the manifest's fit_position (the
    training model's copy stays as Python wrote it): load takes the manifest's."""
    sess = TrainingSession(mlp_classifier("sgd"))
    sess.fit((X, LABEL), epochs=1, batch_size=4, progress=False)
    bundle.save(sess, tmp_path / "b")
    assert bundle.load(tmp_path / "b").fit_position == {"epoch": 1, "batch": 0, "step": 2, "source": "checkpoint"}
    rewrite(tmp_path / "b", lambda m: m.update(fit_position={"epoch": 5, "batch": 1, "step": 11}))
    assert bundle.load(tmp_path / "b").fit_position == {"epoch": 5, "batch": 1, "step": 11, "source": "checkpoint"}
    rewrite(tmp_path / "b", lambda m: m.update(fit_position=None))
    assert bundle.load(tmp_path / "b").fit_position is None
    rewrite(tmp_path / "b", lambda m: m.update(fit_position={"epoch": -1}))
    with pytest.raises(bundle.BundleError, match="fit_position is"):
        bundle.load(tmp_path / "b")


def test_a_scalar_counter_stays_a_scalar(saved):
    entry = next(e for e in manifest_of(saved)["state"] if e["name"] == "step0")
    assert entry["shape"] == [] and entry["length"] == 8
    sess = bundle.load(saved)
    assert sess.state["step0"].shape == ()
    sess.train_step({"X": X, "label": LABEL})
    assert sess.state["step0"].shape == () and int(sess.state["step0"]) == 1


def test_the_loaded_session_holds_no_file_of_the_folder(tmp_path):
    """Even the tensors of 1 MiB or more, which a model's own external data
    would leave mapped: the folder may go (or be replaced) while it trains."""
    folder = tmp_path / "big"
    bundle.save(mlp_classifier("sgd", sizes=(256, 1024, 3)), folder)
    assert (folder / "constants.bin").stat().st_size >= 2**20  # W1's initial value
    sess = bundle.load(folder)
    shutil.rmtree(folder)
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    sess.train_step({"X": x, "label": LABEL[:4]})
    sess.initialize()
    sess.export(tmp_path / "out.onnx", training=True)
    assert TrainingSession(tmp_path / "out.onnx").state["W1"].shape == (256, 1024)


def test_session_options_go_to_the_session(saved):
    bad = {"X": np.full_like(X, np.nan), "label": LABEL}
    bundle.load(saved).train_step(bad)  # trains on NaN without complaint
    sess = bundle.load(saved, providers=["CPUExecutionProvider"], check_finite=True)
    with pytest.raises(FloatingPointError):
        sess.train_step(bad)
    assert int(sess.state["step0"]) == 0
    with pytest.raises(TypeError, match="no_such_option"):
        bundle.load(saved, no_such_option=1)


# ------------------------------------------------------------------ writing
def test_a_non_empty_folder_is_refused_and_left_as_it_was(saved, tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        bundle.save(saved / "training_model.onnx", target)
    assert snapshot(target) == {"notes.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no temporary folder left
    bundle.save(bundle.load(saved), target, overwrite=True)
    assert "notes.txt" not in snapshot(target) and "manifest.json" in snapshot(target)
    empty = tmp_path / "empty"
    empty.mkdir()
    bundle.save(bundle.load(saved), empty)  # an empty folder is fine
    assert (empty / "state.bin").is_file()


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_or_a_link_is_never_written_over(saved, tmp_path, overwrite):
    (tmp_path / "file").write_text("keep")
    with pytest.raises(FileExistsError, match="is a file"):
        bundle.save(bundle.load(saved), tmp_path / "file", overwrite=overwrite)
    assert (tmp_path / "file").read_text() == "keep"
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(FileExistsError, match="symbolic link"):
        bundle.save(bundle.load(saved), tmp_path / "link", overwrite=overwrite)
    assert (tmp_path / "link").is_symlink() and not any((tmp_path / "real").iterdir())


def test_a_failed_write_changes_nothing(saved, tmp_path, monkeypatch):
    target = Path(shutil.copytree(saved, tmp_path / "b"))
    before = snapshot(target)
    sess = bundle.load(target)
    sess.train_step({"X": X, "label": LABEL})

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bundle_writer, "write_state", broken)
    with pytest.raises(OSError, match="No space left"):
        bundle.save(sess, target, overwrite=True)
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_saving_back_over_the_folder_it_was_loaded_from(saved, tmp_path):
    target = Path(shutil.copytree(saved, tmp_path / "b"))
    sess = bundle.load(target)
    sess.train_step({"X": X, "label": LABEL})
    bundle.save(sess, target, overwrite=True)
    again = bundle.load(target)
    for name, value in sess.state.items():
        np.testing.assert_array_equal(again.state[name], value)
    sess.train_step({"X": X, "label": LABEL})  # the first session goes on
    assert sess.evaluate((X, LABEL), batch_size=8)["loss"] > 0
    sess.export(tmp_path / "out.onnx")


# ------------------------------------------------------------- command line
def test_cli_bundle_writes_and_refuses_in_one_line(tmp_path):
    sess = TrainingSession(mlp_classifier("sgd"))
    sess.fit((np.tile(X, (2, 1)), np.tile(LABEL, 2)), epochs=1, batch_size=8, progress=False)
    sess.export(tmp_path / "ckpt.onnx", training=True)
    out = cli("bundle", tmp_path / "ckpt.onnx", "-o", tmp_path / "b")
    assert out.returncode == 0, out.stderr
    assert "wrote training bundle" in out.stdout
    assert manifest_of(tmp_path / "b")["fit_position"] == {"epoch": 1, "batch": 0, "step": 2}
    before = snapshot(tmp_path / "b")

    one_line_error(cli("bundle", tmp_path / "ckpt.onnx", "-o", tmp_path / "b"), "-o", "not empty", "--overwrite")
    assert snapshot(tmp_path / "b") == before
    one_line_error(cli("bundle", tmp_path / "ckpt.onnx", "-o", tmp_path / "ckpt.onnx"), "is a file")
    assert onnx.load(tmp_path / "ckpt.onnx").training_info
    one_line_error(cli("bundle", tmp_path / "ckpt.onnx", "-o", tmp_path / "ckpt.onnx", "--overwrite"), "is a file")
    one_line_error(cli("bundle", tmp_path / "missing.onnx", "-o", tmp_path / "c"), "missing.onnx")
    assert not (tmp_path / "c").exists()
    (tmp_path / "plain.onnx").write_bytes(b"not a model")
    one_line_error(cli("bundle", tmp_path / "plain.onnx", "-o", tmp_path / "c"), "cannot parse")
    assert not (tmp_path / "c").exists()

    assert cli("bundle", tmp_path / "ckpt.onnx", "-o", tmp_path / "b", "--overwrite").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "ckpt.onnx", "plain.onnx"]


def test_cli_help_ends_with_two_examples():
    out = cli("bundle", "--help")
    assert out.returncode == 0
    last = out.stdout.strip().splitlines()[-2:]
    assert [line.split()[:2] for line in last] == [["onnxtrain", "bundle"]] * 2
    assert "-o" in last[0] and "--overwrite" in last[1]
