"""Issue 27, point 8: the smaller things a new user meets.

Ctrl-C while the command line starts (both entry points) is one line and exit
130; the demo labels its two losses; huge losses print in scientific notation;
``History.plot`` puts losses and metrics on separate, labelled y axes; every
example takes ``--no-progress`` and ``decoder_lm.py`` writes nowhere near the
repository unless told."""

from __future__ import annotations

import ast
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from onnxtrain import History
from onnxtrain.cli.app import main
from onnxtrain.startup import started_as_cli
from onnxtrain.train.loop import epoch_line, fmt_loss

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


# ------------------------------------------------------------------ Ctrl-C
@pytest.fixture(scope="module")
def interrupting_import(tmp_path_factory) -> Path:
    """A folder whose ``onnxruntime`` sends this process SIGINT when onnxtrain
    imports it: a Ctrl-C at a known moment of the start-up."""
    d = tmp_path_factory.mktemp("sigint")
    (d / "onnxruntime").mkdir()
    (d / "onnxruntime" / "__init__.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n")
    return d


def entry_points() -> list[list[str]]:
    points = [[sys.executable, "-m", "onnxtrain"]]
    script = Path(sys.executable).parent / "onnxtrain"
    if script.exists():
        points.append([str(script)])
    return points


@pytest.mark.parametrize("entry", entry_points(), ids=lambda e: "-m" if "-m" in e else "script")
def test_ctrl_c_during_start_up_is_one_line_and_130(entry, interrupting_import, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(interrupting_import), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(entry + ["train", "m.onnx", "--data", "d.npz", "--epochs", "1", "-o",
                                   "t.onnx"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["onnxtrain: interrupted"], proc.stderr
    assert "Traceback" not in proc.stderr


def test_ctrl_c_is_not_lost_in_an_import_that_swallows_it(tmp_path):
    """An extension whose import clears errors (as C code may) swallows the
    KeyboardInterrupt; the start-up handler exits on the signal itself."""
    d = tmp_path / "swallow"
    (d / "onnxruntime").mkdir(parents=True)
    (d / "onnxruntime" / "__init__.py").write_text(
        "import os, signal, time\ntry:\n    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\nexcept BaseException:\n    pass\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "onnxtrain", "--version"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["onnxtrain: interrupted"]


def test_a_program_importing_onnxtrain_keeps_pythons_own_behaviour(interrupting_import):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(interrupting_import), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", "import onnxtrain"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode != 130 and "KeyboardInterrupt" in proc.stderr


def loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2, 0.5, 1.0])
def test_ctrl_c_at_any_moment_after_the_interpreter_starts_is_one_line(tmp_path, delay):
    """SIGINT once numpy is being loaded (onnxtrain's first heavy import: the
    interpreter's own start-up, before any onnxtrain code, is Python's), then
    ``delay`` later: in the imports (onnx, onnxruntime, whose C code may
    swallow a KeyboardInterrupt), building the session, or training."""
    proc = subprocess.Popen([sys.executable, "-m", "onnxtrain", "demo", "--epochs", "2000",
                             "--no-progress", "-o", str(tmp_path / "d.onnx")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not loaded(proc.pid, "_multiarray_umath") and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnxtrain: ") and "Traceback" not in err


@pytest.mark.parametrize("argv, orig, expected", [
    (["/x/bin/onnxtrain"], ["python", "/x/bin/onnxtrain"], True),
    (["-m"], ["python", "-m", "onnxtrain", "demo"], True),
    (["-m"], ["python", "-monnxtrain"], True),
    (["-m"], ["python", "-m", "onnxtrain.cli"], False),
    (["-c"], ["python", "-c", "import onnxtrain"], False),
    (["t.py"], ["python", "-u", "t.py", "-m", "onnxtrain"], False),
    (["-m"], ["python", "-X", "dev", "-W", "error", "-m", "onnxtrain"], True),
])
def test_started_as_cli(argv, orig, expected):
    assert started_as_cli(argv, orig) is expected


def test_startup_doctests():
    import doctest

    import onnxtrain.startup

    result = doctest.testmod(onnxtrain.startup)
    assert result.failed == 0 and result.attempted >= 3


# ------------------------------------------------------------- demo and numbers
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


def test_huge_losses_print_in_scientific_notation():
    huge = 445944625879819678883241398160588800.0
    assert fmt_loss(huge) == "4.459e+35"
    assert fmt_loss(1e6) == "1e+06" and fmt_loss(999999.0) == "999999.0000"
    assert fmt_loss(0.1234) == "0.1234" and fmt_loss(float("nan")) == "nan"
    assert "4.459e+35" in epoch_line(0, 1, {"loss": huge}, 1.0)


def test_cli_epoch_lines_use_scientific_notation(capsys, tmp_path):
    from onnxtrain.cli.app import _EpochLines  # the CLI's own line printer

    _EpochLines(3).on_epoch_end(0, {"loss": 4.459e35, "accuracy": 0.5, "lr": 0.001})
    line = capsys.readouterr().out.strip()
    assert line == "epoch 1/3: loss 4.459e+35, accuracy 0.5000, lr 0.001"


def test_history_plot_puts_losses_and_metrics_on_labelled_axes():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    h = History()
    for e, (loss, acc) in enumerate([(2.0, 0.3), (0.1, 0.8), (0.01, 0.95)]):
        h.append(e, {"loss": loss, "accuracy": acc, "val_loss": loss * 1.1,
                     "val_accuracy": acc - 0.05, "lr": 0.1}, 1.0)
    ax = h.plot()
    assert [line.get_label() for line in ax.get_lines()] == ["loss", "val_loss"]
    assert ax.get_ylabel() == "loss" and ax.get_xlabel() == "epoch"
    others = [a for a in ax.figure.axes if a is not ax]
    assert len(others) == 1
    assert [line.get_label() for line in others[0].get_lines()] == ["accuracy", "val_accuracy"]
    assert others[0].get_ylabel() == "accuracy"
    np.testing.assert_allclose(others[0].get_lines()[0].get_ydata(), h["accuracy"])
    assert len(ax.get_legend().get_texts()) == 4  # one legend for both axes
    import matplotlib.pyplot as plt

    plt.close(ax.figure)
    only = h.plot(["accuracy"])  # metrics alone: one axis, labelled
    assert only.get_ylabel() == "accuracy" and len(only.figure.axes) == 1
    plt.close(only.figure)


# ------------------------------------------------------------------ examples
def example_scripts() -> list[Path]:
    return sorted(p for p in EXAMPLES.glob("*.py")
                  if "argparse.ArgumentParser" in p.read_text())


@pytest.mark.parametrize("script", example_scripts(), ids=lambda p: p.name)
def test_every_example_takes_no_progress(script):
    tree = ast.parse(script.read_text())
    options = {a.value for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", None) == "add_argument"
               for a in node.args if isinstance(a, ast.Constant)}
    assert "--no-progress" in options


def test_decoder_lm_writes_to_a_temporary_folder_by_default(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("decoder_lm_example", EXAMPLES / "decoder_lm.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "decoder_lm_example", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    written = []

    def fake_write(path, cfg):
        written.append(Path(path))
        return {"path": str(path), "parameters": 1, "data_bytes": 0, "seconds": 0.0}

    monkeypatch.setattr(module, "write_decoder_lm", fake_write)
    monkeypatch.setattr(module.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path)
    assert module.main([]) == 0
    assert written[0].parent.parent == tmp_path / "tmp"
    assert module.main(["--out", "mine"]) == 0
    assert written[1].parent == Path("mine")
