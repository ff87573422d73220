"""The examples in the docstrings of onnxtrain.ort_training run."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("module", ["onnxtrain.ort_training.checkpoint",
                                    "onnxtrain.ort_training.onnxblock",
                                    "onnxtrain.ort_training.onnxblock.blocks"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
