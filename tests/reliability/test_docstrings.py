"""The examples in the docstrings of the reliability modules run."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("module", ["onnxtrain.io.loading", "onnxtrain.io.tensors", "onnxtrain.io.storage"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
