"""Ctrl-C while the command line starts is one line and exit 130, from both
entry points and at any moment; a program that imports onnxtrain keeps
Python's own KeyboardInterrupt (``onnxtrain.startup``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onnxtrain.startup import started_as_cli

ROOT = Path(__file__).resolve().parents[2]


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
