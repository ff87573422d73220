"""ONNX's own training conformance cases, driven by onnx.backend.test.BackendTest.

7 optimizer node cases (Adam, Adagrad, Momentum, Nesterov, single and multiple
tensors) and 2 Gradient model cases (test_gradient_of_add, ..._and_mul)."""

from __future__ import annotations

import unittest

import onnx.backend.test

import onnxtrain.backend

TRAINING_CASES = [
    "test_adagrad",
    "test_adagrad_multiple",
    "test_adam",
    "test_adam_multiple",
    "test_momentum",
    "test_momentum_multiple",
    "test_nesterov_momentum",
    "test_gradient_of_add",
    "test_gradient_of_add_and_mul",
]

_backend_test = onnx.backend.test.BackendTest(onnxtrain.backend, __name__)
_wanted = {f"{c}_cpu" for c in TRAINING_CASES}
_collected = set()
# Only the training cases become tests (BackendTest would list ~4000 skipped ones).
for _category, _items in _backend_test._test_items.items():
    _methods = {name: item.func for name, item in _items.items() if name in _wanted}
    if _methods:
        _collected |= set(_methods)
        globals()[f"OnnxBackend{_category}Test"] = type(
            f"OnnxBackend{_category}Test", (unittest.TestCase,), _methods
        )


def test_all_nine_cases_are_collected():
    assert _collected == _wanted
