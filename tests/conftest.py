"""The tests are grouped by area (autodiff/, builder/, runtime/, fit/, docs/, distributed/,
reliability/).  Their shared helpers are plain modules imported by name:
models.py here, gradcheck.py and grad_cases.py in autodiff/, and a few test
modules that others reuse (builder/test_build.py), so every area folder goes
on sys.path."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for folder in ("", "autodiff", "builder", "runtime", "fit", "docs", "reliability", "distributed"):
    path = os.path.join(HERE, folder)
    if path not in sys.path:
        sys.path.insert(0, path)
