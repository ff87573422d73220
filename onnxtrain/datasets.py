"""Small data sets and splitting helpers (public; defined in ``onnxtrain.train.datasets``)."""

from .train.datasets import load_digits, train_test_split

__all__ = ["load_digits", "train_test_split"]
