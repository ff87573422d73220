"""Every ``>>>`` example in onnxtrain's docstrings runs, and passes.

This is ``pytest --doctest-modules onnxtrain`` (the same option flags:
pyproject.toml's ``doctest_optionflags``) as tests of the suite, one per
module, so CI runs them in both of its environments.  No example is
skipped: one that needs a file builds it (in a temporary folder), so a
``+SKIP`` directive in the package is a failure here.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import onnxtrain

PACKAGE = Path(onnxtrain.__file__).resolve().parent
#: pyproject.toml's [tool.pytest.ini_options] doctest_optionflags
FLAGS = doctest.ELLIPSIS


def modules() -> list[str]:
    """Every module of the package, by dotted name (``__main__`` runs the CLI when imported)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out.append(".".join(parts))
    return out


def examples(module: str) -> list[doctest.DocTest]:
    tests = doctest.DocTestFinder().find(importlib.import_module(module))
    return [t for t in tests if t.examples]


@pytest.mark.parametrize("module", modules())
def test_the_examples_of_a_module_run(module):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in examples(module):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{module}: {result.failed} of {result.attempted} examples failed (output above)"


def test_no_example_is_skipped():
    skipped = [f"{t.name}:{(t.lineno or 0) + e.lineno + 1}" for m in modules() for t in examples(m)
               for e in t.examples if e.options.get(doctest.SKIP)]
    assert skipped == []


def test_the_package_has_examples_and_the_flags_match_pyproject():
    assert sum(len(t.examples) for m in modules() for t in examples(m)) > 200
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert 'doctest_optionflags = "ELLIPSIS"' in pyproject
