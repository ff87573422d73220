"""bundle.save is atomic (issue 32): a writer killed with SIGKILL at any
moment of ``save(..., overwrite=True)`` leaves the previous complete bundle or
the new one, never a mix or none; the next save removes what it left.

A child forked from the test process saves a session over and over,
alternating between two states A and B, and is killed at a random moment of a
save after its first one has completed (so that both states become the old
one, whatever the machine's load); then the folder must read back
(``bundle.read``) with A's or B's state.bin."""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest
from models import mlp_classifier

from onnxtrain import TrainingSession, bundle

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a writer")


def _writer_loop(sess, values, path, i: int, done: int) -> None:
    while True:
        sess.load_state(values[i % 2])
        bundle.save(sess, path, overwrite=True)
        os.write(done, b".")  # one byte per completed save
        i += 1


def _kill_loop(sess, values, path, kills: int, seed: int, one: float, known: dict, seen: list) -> None:
    rng = random.Random(seed)
    for k in range(kills):
        read_end, done = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer: never returns into pytest
            try:
                os.close(read_end)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                _writer_loop(sess, values, path, k, done)  # (half of them start with B)
            finally:
                os._exit(1)
        os.close(done)
        try:
            first = os.read(read_end, 1)  # its first save is complete (b"" if it died)
            assert first == b".", "the writer died before completing one save"
            time.sleep(rng.uniform(0.0, 2.0 * one))  # then killed inside a later save, or between
        finally:  # the child must never outlive this loop
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
        read = bundle.read(path)  # complete: every file, the manifest agreeing
        which = known.get((path / "state.bin").read_bytes())
        assert which is not None, "state.bin is neither A's nor B's"
        np.testing.assert_array_equal(read.state["W1"], values[which]["W1"])
        seen[which] += 1


@pytest.mark.heavy  # (a dozen killed writers: CI's newest leg only)
def test_sigkill_during_save_leaves_the_old_or_the_new_bundle(tmp_path):
    sess = TrainingSession(mlp_classifier("sgd", sizes=(128, 512, 3)))  # 256 KiB of weights
    a = dict(sess.state)
    b = {**a, "W1": a["W1"] + 1, "W2": a["W2"] - 1}
    values = [a, b]
    known = {}
    for which, state in enumerate(values):
        sess.load_state(state)
        bundle.save(sess, tmp_path / "ref" / str(which))
        known[(tmp_path / "ref" / str(which) / "state.bin").read_bytes()] = which
    path = tmp_path / "b"
    start = time.perf_counter()
    bundle.save(sess, path)
    one = time.perf_counter() - start
    seen = [0, 0]
    _kill_loop(sess, values, path, 12, 0, one, known, seen)
    assert min(seen) >= 1, seen
    bundle.save(sess, path, overwrite=True)  # removes the killed writers' temporary folders
    assert sorted(os.listdir(tmp_path)) == ["b", "ref"]
