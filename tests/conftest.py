"""The tests are grouped by area (autodiff/, builder/, runtime/, kernels/, fit/, docs/,
distributed/, reliability/, export/, js/).  Their shared helpers are plain modules imported
by name: models.py here, gradcheck.py and grad_cases.py in autodiff/, bundle_runner.py
in export/, and a few test modules that others reuse (builder/test_build.py),
so every area folder goes on sys.path."""

import compileall
import os
import shutil
import sys
import zlib

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for folder in ("", "autodiff", "builder", "runtime", "kernels", "fit", "docs", "reliability", "distributed",
               "export", "js"):
    path = os.path.join(HERE, folder)
    if path not in sys.path:
        sys.path.insert(0, path)

# The on-disk program cache (onnxtrain.core.diskcache) persists across processes and
# runs: tests that patch onnxtrain's internals would leave entries other tests
# then read.  The suite runs without it; tests/runtime/test_startup.py turns it
# on, in a folder of its own, and tests it there.
os.environ.setdefault("ONNXTRAIN_PROGRAM_CACHE", "0")

# One intra-op thread per onnxruntime session: pytest-xdist already runs one
# worker per core, and two workers whose sessions each keep a spinning pool of
# one thread per core fight over the cores (a fifth of the suite's time on 2
# cores).  Tests of the threading itself (tests/reliability/test_determinism.py)
# set or unset ONNXTRAIN_THREADS for the processes they start.
os.environ.setdefault("ONNXTRAIN_THREADS", "1")


def pytest_configure(config):
    """Where the interpreter writes no bytecode (PYTHONDONTWRITEBYTECODE, as in
    some containers), each Python process the tests start (hundreds: the CLI,
    MPI ranks, examples, fresh-process checks) compiled onnxtrain's sources
    again, about 0.3 s each.  The suite's first process compiles them once,
    where Python looks for them (``__pycache__``; other packages keep theirs
    from installation), and removes the folders it made at the end."""
    if not sys.flags.dont_write_bytecode or hasattr(config, "workerinput"):
        return
    root = os.path.dirname(HERE)
    folders = [(os.path.join(root, "onnxtrain"), 10), (HERE, 10), (os.path.join(root, "benchmarks"), 0)]
    before = set(_bytecode_folders(folders))
    for folder, depth in folders:
        compileall.compile_dir(folder, maxlevels=depth, quiet=2)

    def remove():
        for made in set(_bytecode_folders(folders)) - before:
            shutil.rmtree(made, ignore_errors=True)
    config.add_cleanup(remove)


def _bytecode_folders(folders):
    """The ``__pycache__`` folders within ``folders`` (each to its depth; not benchmarks' venvs)."""
    for top, depth in folders:
        base = top.count(os.sep)
        for path, dirs, _ in os.walk(top):
            if os.path.basename(path) == "__pycache__":
                yield path
                dirs[:] = []
            elif path.count(os.sep) - base >= depth:
                dirs[:] = [d for d in dirs if d == "__pycache__"]


@pytest.fixture(autouse=True)
def _seeded_module_rng(request, monkeypatch):
    """A test module's shared generator (``RNG`` or ``rng``, drawn from by
    several tests) restarts for each test from a seed of the test's own id,
    so a test's inputs do not depend on which tests ran before it in the same
    process: pytest-xdist spreads them differently from run to run.
    ``ONNXTRAIN_TEST_SEED`` draws other inputs: a sweep over a few values finds
    tolerances that hold only for the usual draw."""
    module = getattr(request.node, "module", None)
    for name in ("RNG", "rng"):
        if isinstance(getattr(module, name, None), np.random.Generator):
            seed = zlib.crc32((request.node.nodeid + os.environ.get("ONNXTRAIN_TEST_SEED", "")).encode())
            monkeypatch.setattr(module, name, np.random.default_rng(seed))
