"""Small datasets bundled with onnxtrain, for demos, examples and tests.

The data lives in ``onnxtrain/data`` (see its README.md for source and
license) and is read with ``importlib.resources``, so it works from a wheel,
a zip or an editable install alike.

>>> X, y = load_digits()
>>> X.shape, X.dtype, y.dtype
((1797, 64), dtype('float32'), dtype('int64'))
"""

from __future__ import annotations

import io
from importlib import resources

import numpy as np

__all__ = ["load_digits", "train_test_split"]


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 handwritten digits: X float32 [1797, 64] in [0, 1], y int64 [1797] in 0..9.

    Pixels are counts 0..16 in the file; they are divided by 16 here so that
    the features lie in [0, 1], which suits a freshly initialized network.

    >>> X, y = load_digits()
    >>> float(X.min()), float(X.max()), sorted(set(y.tolist())) == list(range(10))
    (0.0, 1.0, True)
    """
    data = resources.files("onnxtrain").joinpath("data", "digits.npz").read_bytes()
    with np.load(io.BytesIO(data)) as archive:
        pixels, labels = archive["X"], archive["y"]
    return (pixels.astype(np.float32) / np.float32(16.0), labels.astype(np.int64))


def train_test_split(
    X: np.ndarray, y: np.ndarray, test_size: float = 0.2, seed: int = 0, *,
    random_state: int | None = None, test_fraction: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shuffle the rows with ``seed`` and split them: (X_train, X_test, y_train, y_test).

    ``test_size`` as in scikit-learn: a fraction in (0, 1), or a whole number
    of test rows.  The test part holds ``round(n * test_size)`` rows (at
    least one and at most n - 1 of them), so neither part is ever empty.
    ``random_state`` (scikit-learn's name) is an alias of ``seed`` and
    ``test_fraction`` (the former name) one of ``test_size``.

    >>> X_tr, X_te, y_tr, y_te = train_test_split(np.arange(20).reshape(10, 2), np.arange(10))
    >>> X_tr.shape, X_te.shape, sorted(np.concatenate([y_tr, y_te]).tolist()) == list(range(10))
    ((8, 2), (2, 2), True)
    >>> train_test_split(np.arange(10), np.arange(10), test_size=3)[1].shape
    (3,)
    """
    if test_fraction is not None:
        test_size = test_fraction
    if random_state is not None:
        seed = random_state
    X = np.asarray(X)
    y = np.asarray(y)
    if len(X) != len(y):
        raise ValueError(f"train_test_split: X has {len(X)} rows but y has {len(y)}")
    if len(X) < 2:
        raise ValueError(f"train_test_split: need at least 2 rows to split, got {len(X)}")
    n = len(X)
    if isinstance(test_size, (int, np.integer)) and not isinstance(test_size, bool):
        if not 0 < test_size < n:
            raise ValueError(f"train_test_split: test_size must be in [1, {n - 1}] rows, got {test_size}")
        n_test = int(test_size)
    elif isinstance(test_size, float) and 0.0 < test_size < 1.0:
        n_test = min(max(int(round(n * test_size)), 1), n - 1)
    else:
        raise ValueError(
            f"train_test_split: test_size must be a fraction in (0, 1) or a number of rows, "
            f"got {test_size!r}"
        )
    order = np.random.default_rng(seed).permutation(n)
    test, train = order[:n_test], order[n_test:]
    return X[train], X[test], y[train], y[test]
