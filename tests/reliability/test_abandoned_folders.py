"""Working folders of killed processes do not pile up.

A session keeps its weights' starting values in a folder of the temporary
folder, and large frozen weights in one of ``/dev/shm`` (``io.storage``,
through ``core.files.process_folder``).  An exit hook removes them, but
SIGKILL and the out-of-memory killer run no hook: before round 26 every
killed process left its folder behind, and in ``/dev/shm`` that is memory
kept until the machine restarts.  Now each process locks its folder, and
the next one removes the folders whose lock is free and whose process is
gone.  A child forked from a process runs its parent's exit hooks as it
exits, and no longer removes the parent's folder; a parent that exits
first leaves the folder to the child still holding its lock.  Where no
folder can be made at all, the model stays as it is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from onnxtrain.core.files import process_folder, remove_abandoned_folders

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32",
                                reason="needs fork, SIGKILL and flock")


def _fork(body) -> int:
    """A forked child running ``body()``; it never returns into pytest."""
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(0)
    return pid


def _killed_with_a_folder(parent: Path) -> Path:
    """The folder a child made and left: killed with SIGKILL right after."""
    r, w = os.pipe()

    def child():
        folder = process_folder("held", parent)
        (folder / "weights.data").write_bytes(b"\0" * 4096)
        os.write(w, str(folder).encode())
        os.kill(os.getpid(), signal.SIGKILL)

    pid = _fork(child)
    os.close(w)
    folder = Path(os.read(r, 4096).decode())
    os.close(r)
    os.waitpid(pid, 0)
    return folder


def test_folders_of_killed_processes_are_removed_and_live_ones_kept(tmp_path):
    # A live process's folder, and a folder whose process is gone but whose
    # lock a child it forked still holds.
    go_r, go_w = os.pipe()
    made_r, made_w = os.pipe()

    def live():
        os.write(made_w, str(process_folder("", tmp_path)).encode() + b"\n")
        os.read(go_r, 1)

    def parent_of_a_holder():
        folder = process_folder("", tmp_path)
        if os.fork() == 0:  # the grandchild keeps the lock's descriptor
            os.read(go_r, 1)
            os._exit(0)
        os.write(made_w, str(folder).encode() + b"\n")
        os._exit(0)  # gone, without its exit hooks

    pids = [_fork(live), _fork(parent_of_a_holder)]
    made = b""
    while made.count(b"\n") < 2:
        made += os.read(made_r, 4096)
    kept = [Path(p) for p in made.decode().split()]
    os.waitpid(pids[1], 0)
    other = tmp_path / "onnxtrain-notes"
    other.mkdir()
    try:
        killed = _killed_with_a_folder(tmp_path)  # (its own sweep left the two others)
        assert killed.is_dir() and all(f.is_dir() for f in kept)  # no exit hook ran
        assert remove_abandoned_folders(tmp_path) == [killed.name]
        assert not killed.exists()
        assert all(f.is_dir() for f in kept) and other.is_dir()
    finally:
        os.write(go_w, b"xx")
        os.waitpid(pids[0], 0)
    # Once no process holds them, both go at the next sweep.
    deadline = time.monotonic() + 10
    while any(f.exists() for f in kept) and time.monotonic() < deadline:
        remove_abandoned_folders(tmp_path)
        time.sleep(0.01)
    assert not any(f.exists() for f in kept) and other.is_dir()


SESSION = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from onnx import TensorProto, helper
    sys.path.insert(0, {tests!r})
    from models import model, tensor, training_info, vi
    from onnxtrain import TrainingSession
    w = np.ones((512, 1024), np.float32)  # 2 MiB: its starting value is held in a file
    info = training_info([helper.make_node("Mul", ["W", "half"], ["W_new"])],
                         [tensor("half", np.float32(0.5))], [], [vi("W_new", TensorProto.FLOAT, [512, 1024])],
                         [("W", "W_new")])
    m = model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [vi("X", TensorProto.FLOAT, ["N", 512])],
              [vi("Y", TensorProto.FLOAT, ["N", 1024])], [tensor("W", w)], [info])
    sess = TrainingSession(m)
    sess.train_step({{"X": np.ones((2, 512), np.float32)}})
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_session_killed_leaves_nothing_once_the_next_one_starts(tmp_path):
    """End to end, as a user meets it: a training process killed, then another."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    code = SESSION.format(tests=str(Path(__file__).resolve().parents[1]))
    killed = subprocess.run([sys.executable, "-c", code, "kill"], env=env, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith("onnxtrain-")]
    assert len(left) == 1 and "-held-" in left[0]
    done = subprocess.run([sys.executable, "-c", code, "exit"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("onnxtrain-")] == []


NO_ROOM = textwrap.dedent("""
    import os, sys, tempfile
    import numpy as np
    from onnx import helper, numpy_helper
    tempfile.tempdir = sys.argv[1]  # (a path under a file: no folder can be made there)
    real = os.access
    os.access = lambda path, mode, **kw: False if str(path) == "/dev/shm" else real(path, mode, **kw)
    from onnxtrain.io import storage
    w = numpy_helper.from_array(np.ones((512, 1024), np.float32), "W")
    m = helper.make_model(helper.make_graph([], "g", [], [], [w]))
    print(storage.spill(m, threshold=1) is None, storage.hold(m, {"W"}) is None)
""")


def test_no_folder_to_work_in_leaves_the_model_as_it_is(tmp_path):
    """With neither /dev/shm nor a writable temporary folder, spilling and
    holding keep the model as it is; before, spilling raised the OSError of
    the folder it could not make."""
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    done = subprocess.run([sys.executable, "-c", NO_ROOM, str(blocker / "tmp")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]


FORKED = textwrap.dedent("""
    import atexit, os, sys
    from onnxtrain.core.files import process_folder
    folder = process_folder("held", sys.argv[1])
    pid = os.fork()
    if pid == 0:
        # The hooks a normal exit runs, the parent's included; then out, past
        # onnxruntime's own teardown (which a forked child cannot run).
        atexit._run_exitfuncs()
        os._exit(0)
    os.waitpid(pid, 0)
    print(folder, folder.is_dir())
""")


def test_a_forked_child_exiting_leaves_its_parents_folder(tmp_path):
    """Bug caught: the exit hook removing the folder in whichever process
    exits, so that a child forked from a training process took its parent's
    held weights with it."""
    done = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    folder, alive = done.stdout.split()
    assert alive == "True"  # after the child's exit
    assert not Path(folder).exists()  # after the parent's


OUTLIVED = textwrap.dedent("""
    import atexit, os, sys
    from onnxtrain.core.files import process_folder
    folder = process_folder("held", sys.argv[1])
    (folder / "weights.data").write_bytes(b"w" * 4096)
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(w)
        os.read(r, 1)  # end of file: the parent has exited, its hooks run
        data = folder / "weights.data"
        print("child reads", data.is_file() and data.read_bytes() == b"w" * 4096, flush=True)
        atexit._run_exitfuncs()
        os._exit(0)
    print(folder, flush=True)
""")


def test_a_forked_child_outliving_its_parent_keeps_the_folder_until_it_ends(tmp_path):
    """Bug caught: the parent's exit hook removed the folder while a child it
    forked, still running, read the files in it (the module keeps one folder
    per process, and the child inherits it)."""
    done = subprocess.run([sys.executable, "-c", OUTLIVED, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    folder = Path(lines[0])
    assert lines[1:] == ["child reads True"]
    deadline = time.monotonic() + 10  # the child's exit leaves it; the next sweep takes it
    while folder.exists() and time.monotonic() < deadline:
        remove_abandoned_folders(tmp_path)
        time.sleep(0.01)
    assert not folder.exists()
