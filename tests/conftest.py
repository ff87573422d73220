"""The tests are grouped by area (autodiff/, builder/, runtime/, kernels/, fit/, docs/,
distributed/, reliability/, export/, js/).  Their shared helpers are plain modules imported
by name: models.py here, gradcheck.py and grad_cases.py in autodiff/, bundle_runner.py
in export/, and a few test modules that others reuse (builder/test_build.py),
so every area folder goes on sys.path."""

import os
import sys

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
