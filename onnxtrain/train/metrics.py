"""Metrics of ``fit`` and ``evaluate``: running means weighted by rows,
accuracy, mean squared and absolute errors, and user functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .spec import FitSpec


# ------------------------------------------------------------------- metrics
class Mean:
    """A weighted running mean."""

    def __init__(self) -> None:
        self.total = 0.0
        self.weight = 0.0

    def add(self, value: float, weight: float) -> None:
        self.total += float(value) * weight
        self.weight += weight

    def result(self) -> float:
        return self.total / self.weight if self.weight else float("nan")


def _accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> tuple[float, int]:
    """(fraction correct, rows).  Class scores [N, C] are argmaxed; a single score
    column [N] or [N, 1] against 0/1 targets is a binary logit, positive above 0."""
    y_true = np.asarray(y_true)
    single_column = y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1
    if y_pred.ndim == y_true.ndim + 1 and not single_column:
        predicted = y_pred.argmax(axis=-1)
    elif y_pred.shape == y_true.shape or single_column:
        predicted = (y_pred > 0).astype(y_true.dtype) if y_pred.dtype.kind == "f" else y_pred
    else:
        raise ValueError(
            f"accuracy: cannot compare predictions {list(y_pred.shape)} with targets "
            f"{list(y_true.shape)}"
        )
    predicted = predicted.reshape(y_true.shape)
    return float(np.mean(predicted == y_true)), len(y_true)


def _mse(y_true: np.ndarray, y_pred: np.ndarray) -> tuple[float, int]:
    diff = np.asarray(y_pred, np.float64).reshape(np.shape(y_true)) - y_true
    return float(np.mean(diff**2)), len(diff)


def _mae(y_true: np.ndarray, y_pred: np.ndarray) -> tuple[float, int]:
    diff = np.asarray(y_pred, np.float64).reshape(np.shape(y_true)) - y_true
    return float(np.mean(np.abs(diff))), len(diff)


def metric_functions(spec: FitSpec, metrics: Any, caller: str) -> dict[str, Callable]:
    """name -> fn(y_true, y_pred) -> (value, rows).  None: accuracy for classification."""
    if metrics is None:
        metrics = ("accuracy",) if spec.task == "classification" else ()
    if isinstance(metrics, str) or callable(metrics):
        metrics = (metrics,)
    out: dict[str, Callable] = {}
    for m in metrics:
        if callable(m):
            name = getattr(m, "__name__", type(m).__name__)
            out[name] = _rows_weighted(m)
        elif m in _METRICS:
            out[m] = _METRICS[m]
        else:
            raise ValueError(f"{caller}: unknown metric {m!r}; known: {sorted(_METRICS)} or a callable")
    if out and (spec.prediction is None or spec.target is None):
        raise ValueError(
            f"{caller}: metrics {sorted(out)} need a prediction output and a target; the model "
            "has none (set onnxtrain.prediction/onnxtrain.target metadata, or pass metrics=())"
        )
    return out


def _rows_weighted(fn: Callable) -> Callable:
    def metric(y_true: np.ndarray, y_pred: np.ndarray) -> tuple[float, int]:
        return float(fn(y_true, y_pred)), len(y_true)
    return metric


_METRICS: dict[str, Callable[[np.ndarray, np.ndarray], tuple[float, int]]] = {
    "accuracy": _accuracy,
    "mse": _mse,
    "mae": _mae,
}
