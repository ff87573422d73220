"""The training loop around a TrainingSession: ``fit``, ``evaluate``, ``predict``.

``TrainingSession.fit/evaluate/predict`` delegate here.  What the loop needs
to know about a model (which inputs the data feeds, which output is the loss,
which algorithm runs on which batch) comes from ``model.metadata_props``
written by ``onnxtrain.build`` (JSON values), and is inferred from the graphs
for hand-built models:

====================== =========================================== ==============================
key                    meaning                                     inferred without metadata
====================== =========================================== ==============================
onnxtrain.inputs       main-graph data inputs, in order            the main graph's inputs
onnxtrain.target       the target feed (the algorithm's extra      the one algorithm input the
                       input)                                      main graph does not have
onnxtrain.loss         the loss output                             'loss', else the one scalar
                                                                   algorithm-only output
onnxtrain.prediction   the main-graph output metrics read          the first main-graph output
onnxtrain.task         "classification" or "regression"            integer target: classification
onnxtrain.cycle        algorithm index per batch, repeated         one spec iteration per batch
                       ([0, 0, 1]: accumulate over 3 batches)      (every algorithm in order)
onnxtrain.classes      {"count": C, "axis": 1|-1, "ignore_index"}  no label range check
                       for class-index losses (label check)
onnxtrain.learning_    {"state": name, "base": lr}: the base       no ``sess.learning_rate``
rate                   learning rate's state variable
onnxtrain.checkpoint   the fit position {"epoch", "batch",         start at epoch 0
                       "step"} (written by export(training=True))
====================== =========================================== ==============================

How ``evaluate`` computes the loss without training: it compiles a third kind
of program, the *loss program*: the combined graph M ⊕ A of the algorithm that
produces the loss, pruned to the loss and the prediction.  The Gradient and
optimizer nodes are dead in it and vanish, so it is a forward pass through the
model's own loss, fed with a pinned snapshot of the current state and writing
nothing back.  The loss is thus exactly the one training minimizes, whatever
its kind, and the state cannot change.

>>> from onnxtrain.demo import build_classifier
>>> from onnxtrain.datasets import load_digits
>>> from onnxtrain import TrainingSession
>>> X, y = load_digits()
>>> sess = TrainingSession(build_classifier(hidden=16))
>>> history = sess.fit(X, y, epochs=2, batch_size=64, progress=False)
>>> len(history["loss"]), history["loss"][1] < history["loss"][0]
(2, True)
>>> sorted(sess.evaluate((X, y)))
['accuracy', 'loss']
>>> sess.predict(X[:5]).shape
(5, 10)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .callbacks import (
    HOOKS,
    Callback,
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    ModelCheckpoint,
    StopTraining,
    TerminateOnNaN,
    check_callbacks,
    check_writable,
)
from .errors import TrainingModelError

__all__ = [
    "CSVLogger",
    "Callback",
    "Checkpoint",
    "EarlyStopping",
    "ModelCheckpoint",
    "TerminateOnNaN",
    "FitSpec",
    "History",
    "NonFiniteLossError",
    "StopTraining",
    "TrainResult",
    "checkpoint_epoch",
    "evaluate",
    "fit",
    "fit_spec",
    "load_npz",
    "model_metadata",
    "predict",
    "train_files",
    "write_checkpoint",
]

#: Prefix of every metadata_props key onnxtrain reads or writes.
PREFIX = "onnxtrain."
#: Written by Checkpoint: where the fit loop stood when the file was written.
CHECKPOINT_KEY = PREFIX + "checkpoint"
TASKS = ("classification", "regression")
DEFAULT_EVAL_BATCH = 256


class NonFiniteLossError(FloatingPointError):
    """``fit`` met a NaN or infinite training loss.

    ``epoch`` and ``batch`` (0-based, within the epoch) and ``step`` (1-based,
    counted over this ``fit`` call) name the step; ``loss`` is its value.
    The step was committed: the session holds the state after it."""

    def __init__(self, message: str, epoch: int, batch: int, step: int, loss: float) -> None:
        super().__init__(message)
        self.epoch, self.batch, self.step, self.loss = epoch, batch, step, loss


# ------------------------------------------------------------------ metadata
def model_metadata(model: onnx.ModelProto) -> dict[str, Any]:
    """The ``onnxtrain.*`` entries of ``model.metadata_props``, JSON-decoded, prefix dropped.

    >>> m = onnx.ModelProto()
    >>> _ = m.metadata_props.add(key="onnxtrain.target", value='"label"')
    >>> _ = m.metadata_props.add(key="author", value="someone")
    >>> model_metadata(m)
    {'target': 'label'}
    """
    out: dict[str, Any] = {}
    for entry in model.metadata_props:
        if not entry.key.startswith(PREFIX):
            continue
        try:
            out[entry.key[len(PREFIX):]] = json.loads(entry.value)
        except json.JSONDecodeError as exc:
            raise TrainingModelError(
                f"metadata_props[{entry.key!r}]: expected a JSON value, found {entry.value!r} ({exc})"
            ) from None
    return out


def set_metadata(model: onnx.ModelProto, key: str, value: Any) -> None:
    """Set ``onnxtrain.<key>`` in ``model.metadata_props`` to ``value`` as JSON (replacing it)."""
    full = PREFIX + key
    kept = [(e.key, e.value) for e in model.metadata_props if e.key != full]
    del model.metadata_props[:]
    for k, v in kept:
        model.metadata_props.add(key=k, value=v)
    model.metadata_props.add(key=full, value=json.dumps(value))


@dataclass(frozen=True)
class FitSpec:
    """What the training loop knows about a model (from metadata, else inferred)."""

    inputs: tuple[str, ...]
    target: str | None
    loss: str | None
    prediction: str | None
    task: str | None
    #: Algorithm index per batch, repeated; None runs every algorithm (one spec iteration).
    cycle: tuple[int | None, ...]
    #: The algorithm whose combined graph computes the loss (for evaluate).
    loss_algorithm: int | None
    from_metadata: tuple[str, ...] = field(default=())


def fit_spec(sess: Any) -> FitSpec:
    """Read the model's ``onnxtrain.*`` metadata, inferring what is missing (see the module doc)."""
    meta = model_metadata(sess.model)
    main_inputs = list(sess.inference_inputs)
    main_outputs = list(sess.inference_outputs)
    algo_inputs = sess.algorithm_inputs
    algo_outputs = sess.algorithm_outputs

    inputs = meta.get("inputs", main_inputs)
    if not isinstance(inputs, list) or not all(isinstance(n, str) for n in inputs):
        raise TrainingModelError(f"metadata onnxtrain.inputs: expected a list of names, got {inputs!r}")

    if "target" in meta:
        target = meta["target"]
    else:
        extra = sorted({n for feeds in algo_inputs for n in feeds} - set(main_inputs))
        target = extra[0] if len(extra) == 1 else None

    if "loss" in meta:
        loss = meta["loss"]
    else:
        loss = _infer_loss(sess, main_outputs, algo_outputs)

    prediction = meta.get("prediction", main_outputs[0] if main_outputs else None)
    if prediction is not None and prediction not in main_outputs:
        raise TrainingModelError(
            f"metadata onnxtrain.prediction: {prediction!r} is not an output of the main graph "
            f"{main_outputs}"
        )

    task = meta.get("task")
    if task is None and target is not None:
        vi = _find_value_info(sess, target)
        if vi is not None:
            dtype = _np_dtype(vi)
            if dtype is not None:
                task = "classification" if dtype.kind in "iub" else "regression"
    if task is not None and task not in TASKS:
        raise TrainingModelError(f"metadata onnxtrain.task: expected one of {TASKS}, got {task!r}")

    n = sess.num_algorithms
    cycle = meta.get("cycle")
    if cycle is None:
        cycle = [None]
    elif (not isinstance(cycle, list) or not cycle
          or not all(isinstance(i, int) and 0 <= i < n for i in cycle)):
        raise TrainingModelError(
            f"metadata onnxtrain.cycle: expected a non-empty list of algorithm indices in "
            f"[0, {n}), got {cycle!r}"
        )

    loss_algorithm = None
    if loss is not None:
        order = [i for i in cycle if i is not None] + list(range(n))
        for i in order:
            if loss in algo_outputs[i]:
                loss_algorithm = i
                break
        if loss_algorithm is None:
            raise TrainingModelError(
                f"the loss {loss!r} is not an output of any algorithm; outputs are {algo_outputs}"
            )
    known = tuple(k for k in ("inputs", "target", "loss", "prediction", "task", "cycle") if k in meta)
    return FitSpec(tuple(inputs), target, loss, prediction, task, tuple(cycle), loss_algorithm, known)


def _infer_loss(sess: Any, main_outputs: list[str], algo_outputs: list[list[str]]) -> str | None:
    """'loss' if an algorithm returns it, else the single algorithm-only output, else None."""
    candidates: list[str] = []
    for outs in algo_outputs:
        for name in outs:
            if name not in main_outputs and name not in candidates:
                candidates.append(name)
    if "loss" in candidates:
        return "loss"
    return candidates[0] if len(candidates) == 1 else None


#: Class-index loss ops of the default domain: (scores, labels, [weights]) inputs.
_CLASS_LOSS_OPS = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


def _classes_from_loss_nodes(model: onnx.ModelProto, target: str) -> dict[str, Any] | None:
    """The label check's facts for a model not made by ``onnxtrain.build``
    (no metadata ``onnxtrain.classes``): an algorithm's SoftmaxCrossEntropyLoss
    or NegativeLogLikelihoodLoss that reads ``target`` as its labels gives C
    (dim 1 of its scores, where a graph declares it statically) and its
    ignore_index.  None when no such node reads the target."""
    declared: dict[str, onnx.ValueInfoProto] = {}
    graphs = [model.graph] + [ti.algorithm for ti in model.training_info]
    for g in graphs:
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            declared.setdefault(vi.name, vi)
    for g in graphs[1:]:
        for node in g.node:
            if node.op_type not in _CLASS_LOSS_OPS or node.domain not in ("", "ai.onnx"):
                continue
            if len(node.input) < 2 or node.input[1] != target:
                continue
            ignore = next((a.i for a in node.attribute if a.name == "ignore_index"), None)
            count = None
            vi = declared.get(node.input[0])
            if vi is not None and vi.type.tensor_type.HasField("shape"):
                dims = vi.type.tensor_type.shape.dim
                if len(dims) >= 2 and dims[1].HasField("dim_value") and dims[1].dim_value > 0:
                    count = int(dims[1].dim_value)
            return {"count": count, "axis": 1, "ignore_index": ignore}
    return None


def _find_value_info(sess: Any, name: str) -> onnx.ValueInfoProto | None:
    for feeds in [sess.inference_inputs, *sess.algorithm_inputs]:
        if name in feeds:
            return feeds[name]
    return None


def _np_dtype(vi: onnx.ValueInfoProto) -> np.dtype | None:
    elem = vi.type.tensor_type.elem_type
    if not elem:
        return None
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    except (KeyError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------------- data
class _Data:
    """Batches of feed dicts: sliced from arrays, or taken from an iterable."""

    def __init__(self, arrays: dict[str, np.ndarray] | None, iterable: Iterable | None) -> None:
        self.arrays = arrays
        self.iterable = iterable
        self.rows = len(next(iter(arrays.values()))) if arrays else None
        self._used = False

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int | None:
        if self.arrays is not None:
            return self.rows // batch_size if drop_last else math.ceil(self.rows / batch_size)
        try:
            return len(self.iterable)  # type: ignore[arg-type]
        except TypeError:
            return None

    def batches(self, batch_size: int, order: np.ndarray | None = None,
                drop_last: bool = False) -> Iterator[dict]:
        if self.arrays is not None:
            end = self.rows - self.rows % batch_size if drop_last else self.rows
            for begin in range(0, end, batch_size):
                if order is None:
                    rows: Any = slice(begin, begin + batch_size)
                else:
                    rows = order[begin:begin + batch_size]
                yield {k: v[rows] for k, v in self.arrays.items()}
            return
        iterator = iter(self.iterable)
        if iterator is self.iterable:
            # A one-shot iterator (a generator): a second pass would be empty.
            if self._used:
                raise ValueError(
                    "data is a one-shot iterator and is exhausted after the first epoch; "
                    "pass a list of batches or a re-iterable object"
                )
            self._used = True
        for i, batch in enumerate(iterator):
            if not isinstance(batch, Mapping):
                raise TypeError(
                    f"batch {i} of the data is a {type(batch).__name__}; "
                    "an iterable of batches must yield dicts of name -> array"
                )
            yield dict(batch)


def _as_data(sess: Any, spec: FitSpec, data: Any, caller: str, need_target: bool,
             y: Any = None) -> _Data:
    """Normalize ``X, y``, ``(X, y)``, ``X``, a dict of feeds or an iterable of batch dicts."""
    if y is not None:
        if isinstance(data, Mapping) and spec.target in data:
            raise ValueError(f"{caller}: y is given twice (as y and as {spec.target!r} in x)")
        if not isinstance(data, (np.ndarray, Mapping, tuple, list)) and not hasattr(data, "__array__"):
            raise TypeError(f"{caller}: with y, x must be an array (or a dict/tuple of arrays), "
                            f"not {type(data).__name__}")
        data = (data if isinstance(data, (Mapping, tuple, list)) else np.asarray(data), y)
        if isinstance(data[0], (tuple, list)) and len(spec.inputs) == 1:
            data = (np.asarray(data[0]), y)
    elif not isinstance(data, (np.ndarray, Mapping, tuple, list, str, bytes)) and hasattr(data, "__array__"):
        data = np.asarray(data)
    if isinstance(data, Mapping):
        arrays = {k: np.asarray(v) for k, v in data.items()}
    elif isinstance(data, (tuple, list)) and len(data) == 2 and not isinstance(data[1], Mapping):
        arrays = _input_arrays(spec, data[0], caller)
        if spec.target is None:
            raise ValueError(
                f"{caller}: cannot tell which feed y is (the model has no onnxtrain.target "
                "metadata and no single target input); pass a dict of feeds"
            )
        arrays[spec.target] = np.asarray(data[1])
    elif isinstance(data, np.ndarray):
        arrays = _input_arrays(spec, data, caller)
    elif isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(
            f"{caller}: data must be (X, y), a dict of feeds or an iterable of batch dicts, "
            f"not {type(data).__name__}"
        )
    else:
        return _Data(None, data)
    if need_target and spec.target is not None and spec.target not in arrays:
        raise ValueError(f"{caller}: the data has no target {spec.target!r}; it has {sorted(arrays)}")
    lengths = {k: len(v) if v.ndim else None for k, v in arrays.items()}
    if not arrays or None in lengths.values() or len(set(lengths.values())) != 1:
        raise ValueError(
            f"{caller}: every array must have the same number of rows (first axis); got {lengths}"
        )
    if next(iter(lengths.values())) == 0:
        raise ValueError(f"{caller}: the data is empty")
    arrays = {k: _cast(sess, k, v, caller) for k, v in arrays.items()}
    if need_target and spec.target is not None and spec.target in arrays:
        check_targets(sess, spec, arrays[spec.target], caller)
    return _Data(arrays, None)


def check_targets(sess: Any, spec: FitSpec, target: np.ndarray, caller: str) -> None:
    """Check the target array against the loss before the first step.

    Class-index losses (metadata ``onnxtrain.classes``: C, the class axis,
    ignore_index): every label is in [0, C) or equals ignore_index, else a
    ValueError naming the target, the value and C (onnxruntime would fail
    deep inside with an out-of-range index, or a negative label would train
    silently to nonsense).  Regression targets: a float dtype, and the rank
    (and fixed dims) the model declares."""
    meta = model_metadata(sess.model)
    name = spec.target
    classes = meta.get("classes") or _classes_from_loss_nodes(sess.model, name)
    if isinstance(classes, dict) and target.dtype.kind in "iu":
        count, ignore = classes.get("count"), classes.get("ignore_index")
        valid = target >= 0
        if count is not None:
            valid &= target < count
        if ignore is not None:
            valid |= target == ignore
        if not valid.all():
            bad = target[~valid].reshape(-1)
            where = tuple(int(i) for i in np.argwhere(~valid)[0])
            allowed = f"[0, {count})" if count is not None else ">= 0"
            also = f" or ignore_index {ignore}" if ignore is not None else ""
            raise ValueError(
                f"{caller}: target {name!r} holds label {int(bad[0])} at index {list(where)} "
                f"({bad.size} bad label(s)); labels must be in {allowed}{also} for C = {count} "
                f"classes" + (" (labels 1..C? subtract 1)" if count is not None
                              and int(target.max()) == count and int(target.min()) >= 1 else "")
            )
        return
    vi = _find_value_info(sess, name)
    if vi is None or spec.task != "regression":
        return
    expected = _np_dtype(vi)
    if expected is not None and expected.kind == "f" and target.dtype.kind not in "f":
        raise ValueError(f"{caller}: target {name!r} has dtype {target.dtype}; the regression "
                         f"loss expects {expected}")
    if vi.type.tensor_type.HasField("shape"):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        shape = target.shape
        if len(dims) != len(shape) or any(d is not None and i > 0 and d != n
                                          for i, (d, n) in enumerate(zip(dims, shape))):
            shown = ["N" if d is None else d for d in dims]
            hint = " (reshape y to (-1, 1)?)" if len(dims) == len(shape) + 1 and dims[-1] == 1 else ""
            raise ValueError(f"{caller}: target {name!r} has shape {list(shape)}; the model "
                             f"expects {shown}{hint}")


def _input_arrays(spec: FitSpec, X: Any, caller: str) -> dict[str, np.ndarray]:
    if isinstance(X, Mapping):
        return {k: np.asarray(v) for k, v in X.items()}
    if len(spec.inputs) == 1:
        return {spec.inputs[0]: np.asarray(X)}
    if isinstance(X, (tuple, list)) and len(X) == len(spec.inputs):
        return {name: np.asarray(v) for name, v in zip(spec.inputs, X)}
    raise ValueError(
        f"{caller}: the model has {len(spec.inputs)} inputs {list(spec.inputs)}; pass X as a dict "
        "or a tuple of that many arrays"
    )


def _cast(sess: Any, name: str, arr: np.ndarray, caller: str) -> np.ndarray:
    """Convert whole data arrays once to the dtype the model declares (same kind only)."""
    vi = _find_value_info(sess, name)
    expected = _np_dtype(vi) if vi is not None else None
    if expected is None or arr.dtype == expected:
        return arr
    if np.can_cast(arr.dtype, expected, casting="same_kind"):
        return arr.astype(expected)
    raise ValueError(f"{caller}: {name!r} has dtype {arr.dtype}, the model expects {expected}")


# ------------------------------------------------------------------- metrics
class _Mean:
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


_METRICS: dict[str, Callable[[np.ndarray, np.ndarray], tuple[float, int]]] = {
    "accuracy": _accuracy,
    "mse": _mse,
    "mae": _mae,
}


def _metric_fns(spec: FitSpec, metrics: Any, caller: str) -> dict[str, Callable]:
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


# ------------------------------------------------------------------- history
class History:
    """Per-epoch training and validation values, as returned by ``fit``.

    ``history["loss"]`` is the list of epoch losses (the batch-size weighted mean
    of the batch losses), ``history["val_accuracy"]`` that of the validation
    accuracy, and so on; ``history.epochs`` holds the (0-based) epoch indices and
    ``history.seconds`` the wall time of each epoch.

    >>> h = History()
    >>> h.append(0, {"loss": 0.5}, 1.0); h.append(1, {"loss": 0.25}, 1.0)
    >>> h["loss"], h.last
    ([0.5, 0.25], {'loss': 0.25})
    """

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.epochs: list[int] = []
        self.seconds: list[float] = []
        self.steps = 0
        self.stopped_early = False

    def append(self, epoch: int, logs: Mapping[str, float], seconds: float) -> None:
        n = len(self.epochs)
        for key in logs:
            if key not in self.history:
                self.history[key] = [float("nan")] * n
        for key, values in self.history.items():
            values.append(float(logs.get(key, float("nan"))))
        self.epochs.append(epoch)
        self.seconds.append(seconds)

    def __getitem__(self, key: str) -> list[float]:
        return self.history[key]

    def __contains__(self, key: object) -> bool:
        return key in self.history

    def __len__(self) -> int:
        return len(self.epochs)

    def keys(self) -> list[str]:
        return list(self.history)

    @property
    def last(self) -> dict[str, float]:
        """The values of the last epoch."""
        return {k: v[-1] for k, v in self.history.items()} if self.epochs else {}

    def __repr__(self) -> str:
        values = ", ".join(f"{k}={v:.4g}" for k, v in self.last.items())
        return f"History({len(self)} epochs{': ' + values if values else ''})"

    def plot(self, keys: Sequence[str] | None = None, ax: Any = None) -> Any:
        """Plot the curves (default: every key; ``val_x`` dashed next to ``x``) with matplotlib.

        Returns the matplotlib Axes.  matplotlib is an optional extra:
        ``pip install 'onnxtrain[plot]'``."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "History.plot needs matplotlib, which is not installed; "
                "install it with: pip install 'onnxtrain[plot]'"
            ) from None
        from matplotlib.ticker import MaxNLocator

        if ax is None:
            _, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
        # lr has another scale: plotted only when asked for.
        names = list(keys) if keys is not None else [k for k in self.keys() if k != "lr"]
        missing = [k for k in names if k not in self.history]
        if missing:
            raise KeyError(f"History.plot: no values for {missing}; available: {self.keys()}")
        x = [e + 1 for e in self.epochs]
        for name in names:
            style = "--" if name.startswith("val_") else "-"
            ax.plot(x, self.history[name], style, marker="o", markersize=3, label=name)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        ax.legend()
        ax.grid(alpha=0.3)
        return ax


# ----------------------------------------------------------------- callbacks
# (Callback, EarlyStopping, TerminateOnNaN, CSVLogger, ModelCheckpoint and
# Checkpoint live in onnxtrain.callbacks; they are re-exported here.)


def write_checkpoint(sess: Any, path: str | os.PathLike, epochs_done: int) -> Path:
    """Export the training model with its fit position at ``epochs_done`` finished epochs."""
    from .io import write_model

    model = sess.to_model(training=True)
    position = dict(sess.fit_position or {})
    if position.get("epoch") != int(epochs_done):
        position = {"epoch": int(epochs_done)}
    write_position(model, position)
    return write_model(model, path)


def read_position(model: onnx.ModelProto) -> dict[str, Any] | None:
    """The fit position a checkpoint records (``onnxtrain.checkpoint``), or None.

    ``{"epoch": epochs finished, "batch": batches done of the next epoch,
    "step": steps done, "source": "checkpoint"}``; older checkpoints hold
    only the epoch."""
    info = model_metadata(model).get("checkpoint")
    if info is None:
        return None
    ok = isinstance(info, dict) and all(
        isinstance(info.get(k, 0), int) and not isinstance(info.get(k, 0), bool) and info.get(k, 0) >= 0
        for k in ("epoch", "batch", "step")) and "epoch" in info
    if not ok:
        raise TrainingModelError(
            f"metadata onnxtrain.checkpoint: expected {{'epoch': N, 'batch': B, 'step': S}}, got {info!r}")
    return {"epoch": info["epoch"], "batch": info.get("batch", 0), "step": info.get("step"),
            "source": "checkpoint"}


def write_position(model: onnx.ModelProto, position: Mapping[str, Any] | None) -> None:
    """Record ``position`` (see ``read_position``) in ``model``'s metadata; None removes it."""
    if position is None:
        kept = [(e.key, e.value) for e in model.metadata_props if e.key != CHECKPOINT_KEY]
        del model.metadata_props[:]
        for k, v in kept:
            model.metadata_props.add(key=k, value=v)
        return
    value = {"epoch": int(position.get("epoch", 0))}
    if position.get("batch"):
        value["batch"] = int(position["batch"])
    if position.get("step") is not None:
        value["step"] = int(position["step"])
    set_metadata(model, "checkpoint", value)


def checkpoint_epoch(model: Any) -> int:
    """How many epochs a checkpoint had finished (0 if it records none).

    ``model`` is a TrainingSession, a ModelProto or a path."""
    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(str(model), load_external_data=False)
    proto = model if isinstance(model, onnx.ModelProto) else model.model
    position = read_position(proto)
    return 0 if position is None else position["epoch"]


def _call(callbacks: Sequence[Any], hook: str, *args: Any) -> bool:
    """Run one hook of every callback; True if one asked to stop."""
    stop = False
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is None:
            continue
        try:
            if fn(*args) is True:
                stop = True
        except StopTraining:
            stop = True
    return stop


# ---------------------------------------------------------------------- fit
def fit(
    sess: Any,
    x: Any,
    y: Any = None,
    *,
    epochs: int = 1,
    batch_size: int = 32,
    validation_data: Any = None,
    validation_split: float = 0.0,
    shuffle: bool = True,
    seed: int = 0,
    callbacks: Sequence[Any] | None = None,
    metrics: Any = None,
    initial_epoch: int | None = None,
    progress: bool | str = True,
    drop_last: bool | None = None,
    log_every: int = 1,
    cycle: Sequence[int | None] | None = None,
) -> History:
    """Train ``sess``; returns a History of per-epoch loss, metrics and lr.

    - ``x, y``: arrays (Keras style; x feeds ``onnxtrain.inputs``, y
      ``onnxtrain.target``; x may be a dict or tuple for several inputs), or
      ``x`` alone as ``(X, y)``, a dict of feeds, or an iterable of batch
      dicts (used as given: no batching, no shuffling).  Arrays are converted
      once to the declared dtype when the kind matches, and class labels are
      checked against the loss before the first step (``check_targets``).
    - ``validation_split``: hold out that fraction of the rows (the last
      ones, before shuffling, as Keras does) as ``validation_data``.
    - Epochs run from ``initial_epoch`` to ``epochs - 1``.  ``initial_epoch=None``:
      where the checkpoint the session was loaded from stood (its epoch, and
      the batch within it), else 0; an explicit number starts at that epoch's
      first batch.  With ``shuffle``, the order of epoch e is a permutation
      drawn from ``(seed, e)``, so a resumed run sees the batches an
      uninterrupted run would.
    - ``drop_last``: skip the last partial batch of each epoch.  None: True
      when the model's inputs have a fixed batch dimension (with a note),
      else False.
    - Batch k of the run (counted from the start of epoch 0, so resuming keeps
      the position) runs algorithm ``cycle[k % len(cycle)]`` through
      ``train_step``; the cycle comes from ``onnxtrain.cycle`` metadata (e.g.
      ``[0, 0, 1]`` for gradient accumulation over 3 batches) or, without it,
      every algorithm in order on each batch.
    - The loss (and the prediction, for training metrics) is fetched on every
      ``log_every``-th batch only; ``log_every=0`` never fetches it.
    - ``metrics``: names (``"accuracy"``, ``"mse"``, ``"mae"``) or callables
      ``fn(y_true, y_pred) -> float``; None is accuracy for classification.
    - ``progress``: a ``tqdm.auto`` bar per epoch (a widget in notebooks)
      with the running loss and lr; ``"epoch"``: one plain line per epoch on
      stderr; False: silent.
    - ``callbacks``: see ``onnxtrain.callbacks`` (Keras hooks).

    ``sess.fit_position`` is updated after every batch, so ``export(training=True)``
    at any point (a callback, after Ctrl-C) records where the run stands.
    A failed step raises and leaves the state as the previous step left it.

    A NaN or infinite training loss raises ``NonFiniteLossError`` naming
    the epoch, batch and step, unless a ``TerminateOnNaN`` callback is
    given: then fit stops there and returns.  Either way that step was
    committed (only its returned loss is checked)."""
    caller = "fit"
    epochs, batch_size = int(epochs), int(batch_size)
    if batch_size < 1:
        raise ValueError(f"fit: batch_size must be >= 1, got {batch_size}")
    if not 0.0 <= float(validation_split) < 1.0:
        raise ValueError(f"fit: validation_split must be in [0, 1), got {validation_split!r}")
    if log_every < 0:
        raise ValueError(f"fit: log_every must be >= 0, got {log_every}")
    if sess.num_algorithms == 0:
        raise TrainingModelError("fit: the model has no training_info: there is nothing to train")
    position = sess.fit_position
    skip = 0
    if initial_epoch is None:
        if position is not None and position.get("source") == "checkpoint":
            initial_epoch, skip = int(position["epoch"]), int(position.get("batch") or 0)
        else:
            initial_epoch = 0
    initial_epoch = int(initial_epoch)
    if epochs < 0 or initial_epoch < 0:
        raise ValueError(f"fit: epochs and initial_epoch must be >= 0, got {epochs}, {initial_epoch}")
    spec = fit_spec(sess)
    if cycle is not None:
        cycle = tuple(cycle)
        n = sess.num_algorithms
        if not cycle or not all(i is None or (isinstance(i, int) and 0 <= i < n) for i in cycle):
            raise ValueError(f"fit: cycle must list algorithm indices in [0, {n}) or None, got {cycle!r}")
    else:
        cycle = spec.cycle
    callbacks = check_callbacks(callbacks)
    train = _as_data(sess, spec, x, caller, need_target=True, y=y)
    if validation_split:
        if train.arrays is None:
            raise ValueError("fit: validation_split needs arrays, not an iterable of batches")
        if validation_data is not None:
            raise ValueError("fit: give validation_data or validation_split, not both")
        n_val = int(train.rows * float(validation_split))
        if not 0 < n_val < train.rows:
            raise ValueError(f"fit: validation_split={validation_split} of {train.rows} rows leaves "
                             "an empty part")
        cut = train.rows - n_val
        validation = _Data({k: v[cut:] for k, v in train.arrays.items()}, None)
        train = _Data({k: v[:cut] for k, v in train.arrays.items()}, None)
    else:
        validation = None
    metric_fns = _metric_fns(spec, metrics, caller)
    if validation_data is not None:
        validation = _as_data(sess, spec, validation_data, "fit(validation_data)", need_target=True)
    if validation is not None and spec.loss is None:
        raise ValueError(
            "fit: validation needs the loss output, and the model names none (no "
            "onnxtrain.loss metadata, no output named 'loss')"
        )
    drop_last = _decide_drop_last(sess, spec, train, batch_size, drop_last)
    for cb in callbacks:
        for path in getattr(cb, "output_paths", lambda: [])():
            check_writable(path, f"fit: {type(cb).__name__}")
    for cb in callbacks:
        if callable(getattr(cb, "set_session", None)):
            cb.set_session(sess)
    terminate_on_nan = any(isinstance(cb, TerminateOnNaN) for cb in callbacks)
    lr_known = _has_learning_rate(sess)

    per_epoch = train.num_batches(batch_size, drop_last)
    # The cycle position continues across epochs (and across a resume).
    cycle_pos = initial_epoch * per_epoch + skip if per_epoch is not None else 0
    done_steps = (position or {}).get("step") if skip or initial_epoch else 0
    base_step = done_steps if isinstance(done_steps, int) else cycle_pos
    hooks = {h: [cb for cb in callbacks if getattr(cb, h, None) is not None] for h in HOOKS}

    history = History()
    step = 0
    stop = broke = nan_stop = False
    _call(hooks["on_train_begin"], "on_train_begin",
          {"epochs": epochs, "initial_epoch": initial_epoch, "steps_per_epoch": per_epoch})
    try:
        for epoch in range(initial_epoch, epochs):
            start = time.perf_counter()
            order = None
            if shuffle and train.arrays is not None:
                order = np.random.default_rng((int(seed), epoch)).permutation(train.rows)
            loss_mean = _Mean()
            metric_means = {name: _Mean() for name in metric_fns}
            if _call(hooks["on_epoch_begin"], "on_epoch_begin", epoch, {}):
                history.stopped_early = True
                break
            first = skip if epoch == initial_epoch else 0
            lr = sess.learning_rate if lr_known else None
            bar = _progress_bar(progress, per_epoch, f"epoch {epoch + 1}/{epochs}", first)
            try:
                for i, batch in enumerate(train.batches(batch_size, order, drop_last)):
                    if i < first:
                        continue
                    if train.arrays is None and spec.target in batch:
                        check_targets(sess, spec, np.asarray(batch[spec.target]), caller)
                    if _call(hooks["on_batch_begin"], "on_batch_begin", i, {"epoch": epoch, "batch": i}):
                        stop = broke = True
                        break
                    algorithm = cycle[cycle_pos % len(cycle)]
                    fetch = bool(log_every) and i % log_every == 0
                    if lr_known:
                        lr = sess.learning_rate
                    out = sess.train_step(batch, algorithm=algorithm, fetch=fetch)
                    cycle_pos += 1
                    step += 1
                    sess.fit_position = {"epoch": epoch, "batch": i + 1, "step": base_step + step,
                                         "source": "fit"}
                    rows = _rows_of(batch)
                    logs: dict[str, Any] = {"epoch": epoch, "batch": i, "step": step, "size": rows}
                    if lr is not None:
                        logs["lr"] = lr
                    if fetch and spec.loss in out:
                        logs["loss"] = float(np.mean(out[spec.loss]))
                        if not math.isfinite(logs["loss"]):
                            if terminate_on_nan:
                                _call(hooks["on_batch_end"], "on_batch_end", i, logs)
                                stop = broke = nan_stop = True
                                break
                            raise NonFiniteLossError(
                                f"fit: the training loss is {logs['loss']} at epoch {epoch + 1}, "
                                f"batch {i + 1} (step {step} of this run); training stopped. The "
                                "step was committed: the state holds the parameters after it",
                                epoch, i, step, logs["loss"],
                            )
                        loss_mean.add(logs["loss"], rows)
                        if spec.prediction in out and spec.target in batch:
                            for name, fn in metric_fns.items():
                                value, weight = fn(batch[spec.target], out[spec.prediction])
                                metric_means[name].add(value, weight)
                    if bar is not None:
                        if "loss" in logs:
                            post = {"loss": f"{loss_mean.result():.4f}"}
                            if lr is not None:
                                post["lr"] = f"{lr:.3g}"
                            bar.set_postfix(post, refresh=False)
                        bar.update(1)
                    if hooks["on_batch_end"] and _call(hooks["on_batch_end"], "on_batch_end", i, logs):
                        stop = broke = True
                        break
                epoch_logs: dict[str, float] = {}
                if loss_mean.weight:
                    epoch_logs["loss"] = loss_mean.result()
                for name, mean in metric_means.items():
                    if mean.weight:
                        epoch_logs[name] = mean.result()
                if validation is not None and not nan_stop:  # no validation of NaN weights
                    val = _evaluate_data(sess, spec, validation, DEFAULT_EVAL_BATCH, metric_fns)
                    epoch_logs.update({f"val_{k}": v for k, v in val.items()})
                if lr is not None:
                    epoch_logs["lr"] = lr
                if bar is not None:
                    bar.set_postfix({k: f"{v:.4g}" for k, v in epoch_logs.items()}, refresh=False)
            finally:
                if bar is not None:
                    bar.close()
            seconds = time.perf_counter() - start
            history.append(epoch, epoch_logs, seconds)
            history.steps = step
            if not broke:
                sess.fit_position = {"epoch": epoch + 1, "batch": 0, "step": base_step + step,
                                     "source": "fit"}
            if progress == "epoch":
                print(epoch_line(epoch, epochs, epoch_logs, seconds), file=sys.stderr, flush=True)
            if _call(hooks["on_epoch_end"], "on_epoch_end", epoch, dict(epoch_logs)):
                stop = True
            if stop:
                history.stopped_early = broke or epoch + 1 < epochs
                break
    finally:
        history.steps = step
    _call(hooks["on_train_end"], "on_train_end", dict(history.last))
    return history


def epoch_line(epoch: int, epochs: int, logs: Mapping[str, float], seconds: float) -> str:
    """``epoch 3/10: loss 0.4123, accuracy 0.9, lr 0.001 (1.2 s)``: one line per epoch."""
    values = ", ".join(f"{k} {v:.4g}" for k, v in logs.items())
    return f"epoch {epoch + 1}/{epochs}: {values or 'done'} ({seconds:.1f} s)"


def _has_learning_rate(sess: Any) -> bool:
    try:
        sess.learning_rate
    except (TrainingModelError, AttributeError):
        return False
    return True


def _fixed_batch(sess: Any, spec: FitSpec) -> int | None:
    """The fixed first dimension of the data inputs, if they declare one."""
    for name in spec.inputs:
        vi = _find_value_info(sess, name)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            continue
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return int(dims[0].dim_value)
    return None


def _decide_drop_last(sess: Any, spec: FitSpec, train: _Data, batch_size: int,
                      drop_last: bool | None) -> bool:
    fixed = _fixed_batch(sess, spec)
    if fixed is not None and train.arrays is not None and batch_size != fixed:
        raise ValueError(f"fit: the model's inputs have a fixed batch dimension of {fixed}; "
                         f"pass batch_size={fixed} (got {batch_size})")
    if drop_last is None:
        drop_last = fixed is not None
        if drop_last and train.arrays is not None and train.rows % batch_size:
            warnings.warn(
                f"fit: the model has a fixed batch size of {fixed}, so the last "
                f"{train.rows % batch_size} row(s) of each epoch (a partial batch) are skipped "
                "(drop_last=True); pass drop_last=False to keep them", UserWarning, stacklevel=3)
    if drop_last and train.arrays is not None and train.rows < batch_size:
        raise ValueError(f"fit: drop_last with {train.rows} rows and batch_size {batch_size} "
                         "leaves no batch")
    return bool(drop_last)


def _progress_bar(progress: bool | str, total: int | None, desc: str, initial: int = 0) -> Any:
    if progress is not True:
        return None
    from tqdm.auto import tqdm  # a widget in notebooks (ipywidgets), text elsewhere

    return tqdm(total=total, desc=desc, unit="batch", file=sys.stderr, leave=True,
                dynamic_ncols=True, mininterval=0.2, initial=initial)


def _rows_of(batch: Mapping[str, Any]) -> int:
    for value in batch.values():
        shape = np.shape(value)
        if shape:
            return int(shape[0])
    return 1


# ------------------------------------------------------------------ evaluate
def evaluate(
    sess: Any, x: Any, y: Any = None, *, batch_size: int = DEFAULT_EVAL_BATCH, metrics: Any = None
) -> dict[str, float]:
    """The loss and metrics over ``data`` at the current state, which stays unchanged.

    The loss is the model's own (its loss program, see the module doc), the
    batch-size weighted mean of the batch losses; ``metrics`` as in ``fit``.
    """
    if int(batch_size) < 1:
        raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
    spec = fit_spec(sess)
    if spec.loss is None:
        raise ValueError(
            "evaluate: cannot tell which output is the loss (no onnxtrain.loss metadata, "
            "no output named 'loss')"
        )
    data_ = _as_data(sess, spec, x, "evaluate", need_target=True, y=y)
    return _evaluate_data(sess, spec, data_, int(batch_size), _metric_fns(spec, metrics, "evaluate"))


def _evaluate_data(sess: Any, spec: FitSpec, data: _Data, batch_size: int,
                   metric_fns: Mapping[str, Callable]) -> dict[str, float]:
    program = _loss_program(sess, spec)
    executor = sess._executor(program)
    names = [n for n in (spec.loss, spec.prediction) if n is not None]
    loss_mean = _Mean()
    metric_means = {name: _Mean() for name in metric_fns}
    fixed = _fixed_batch(sess, spec) if data.arrays is not None else None
    if fixed is not None:
        # A fixed batch dimension: whole batches only (a padded batch would
        # count its padding in the loss); the rest is skipped with a note.
        batch_size = fixed
        if data.rows < fixed:
            raise ValueError(f"evaluate: the model has a fixed batch size of {fixed}, and the data "
                             f"has only {data.rows} rows")
        if data.rows % fixed:
            warnings.warn(f"evaluate: the model has a fixed batch size of {fixed}; the last "
                          f"{data.rows % fixed} row(s) are not evaluated", UserWarning, stacklevel=3)
    for batch in data.batches(batch_size, drop_last=fixed is not None):
        sess._check_names(batch, "evaluate")
        feeds = sess._user_feeds(program, batch, False, "evaluate")
        with sess._store.snapshot(program.state_inputs) as snap:
            out = executor.run_bound(feeds, snap, {}, names)
        rows = _rows_of(batch)
        loss_mean.add(float(np.mean(out[spec.loss])), rows)
        for name, fn in metric_fns.items():
            value, weight = fn(batch[spec.target], out[spec.prediction])
            metric_means[name].add(value, weight)
    result = {"loss": loss_mean.result()}
    result.update({name: mean.result() for name, mean in metric_means.items()})
    return result


def _loss_program(sess: Any, spec: FitSpec) -> Any:
    """The combined graph of the loss algorithm pruned to loss and prediction (cached).

    Pruning happens before lowering: the Gradient and optimizer nodes are dead
    here, and so are the inputs and state (moments, counters) only they read,
    which are dropped so that the program is fed just what the forward pass needs."""
    from .graph import node_inputs, prune
    from .model import combined_graph
    from .programs import build_program

    cache = sess.__dict__.setdefault("_fit_loss_programs", {})
    key = (spec.loss_algorithm, spec.loss, spec.prediction)
    if key in cache:
        return cache[key]
    index = spec.loss_algorithm
    graph = combined_graph(sess._model.proto, index)
    outputs = [n for n in (spec.loss, spec.prediction) if n is not None]
    by_name = {o.name: o for o in graph.output}
    kept_outputs = [by_name[n] for n in outputs]
    del graph.output[:]
    graph.output.extend(kept_outputs)
    # Evaluation is inference: a loss that reads a training-mode copy of the
    # forward pass (Dropout/BatchNormalization active) reads the main graph's
    # prediction instead, and the copy is pruned away.
    train_prediction = model_metadata(sess.model).get("train_prediction", {}).get(str(index))
    if train_prediction and spec.prediction:
        for node in graph.node:
            if train_prediction in node.input:
                node.input[:] = [spec.prediction if i == train_prediction else i for i in node.input]
    live = prune(list(graph.node), outputs)
    del graph.node[:]
    graph.node.extend(live)
    used = set(outputs)
    for node in live:
        used.update(node_inputs(node))
    for fld, name_of in (("input", lambda v: v.name), ("initializer", lambda t: t.name),
                         ("sparse_initializer", lambda t: t.values.name)):
        items = [x for x in getattr(graph, fld) if name_of(x) in used]
        del getattr(graph, fld)[:]
        getattr(graph, fld).extend(items)
    program = build_program(sess._model, f"evaluate(training_info[{index}])", graph, [])
    cache[key] = program
    return program


# ------------------------------------------------------------------- predict
def predict(
    sess: Any, x: Any, *, batch_size: int = DEFAULT_EVAL_BATCH, outputs: Any = None
) -> Any:
    """Run the main graph batch by batch and concatenate along the first axis.

    ``x``: X, (X, y) (y ignored), a dict of feeds or an iterable of batch
    dicts.  Returns the prediction output (``onnxtrain.prediction``, else the
    first main-graph output) as one array, or a dict when ``outputs`` lists
    names."""
    if int(batch_size) < 1:
        raise ValueError(f"predict: batch_size must be >= 1, got {batch_size}")
    spec = fit_spec(sess)
    data_ = _as_data(sess, spec, x, "predict", need_target=False)
    single = outputs is None
    names = [spec.prediction] if single else ([outputs] if isinstance(outputs, str) else list(outputs))
    if names == [None]:
        raise ValueError("predict: the main graph has no outputs")
    targets = _algo_only(sess)
    parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
    fixed = _fixed_batch(sess, spec) if data_.arrays is not None else None
    if fixed is not None:
        batch_size = fixed
    for batch in data_.batches(int(batch_size)):
        rows = _rows_of(batch)
        if fixed is not None and rows < fixed:
            # A fixed batch dimension: pad the last batch by repeating its last
            # row, and keep only the real rows' predictions (rows are independent).
            batch = {k: np.concatenate([v, np.repeat(v[-1:], fixed - rows, axis=0)])
                     for k, v in batch.items()}
        out = sess.run({k: v for k, v in batch.items() if k not in targets}, names)
        for n in names:
            value = out[n]
            parts[n].append(value[:rows] if fixed is not None and np.ndim(value) else value)
    if not parts[names[0]]:
        raise ValueError("predict: the data is empty")
    result = {n: np.concatenate(v, axis=0) if v[0].ndim else np.stack(v) for n, v in parts.items()}
    return result[names[0]] if single else result


def _algo_only(sess: Any) -> set[str]:
    """Feeds only algorithms read (targets): dropped before inference."""
    main = set(sess.inference_inputs)
    return {n for feeds in sess.algorithm_inputs for n in feeds if n not in main}


# ------------------------------------------------------------ files (the CLI)
def load_npz(path: str | os.PathLike, sess: Any | None = None) -> Any:
    """Training data from an .npz file: ``(X, y)`` from arrays ``X`` and ``y``, else a
    dict of the arrays when their names are feeds of ``sess``."""
    import zipfile

    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise FileNotFoundError(f"no such data file: {str(path)!r}") from None
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):  # .npz files are zip archives
        raise ValueError(f"{path}: not a .npz archive (write one with numpy.savez(path, X=..., y=...))")
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"{path}: cannot read it as a .npz archive ({exc})") from None
    with archive:
        try:
            arrays = {k: archive[k] for k in archive.files}
        except (ValueError, OSError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{path}: cannot read its arrays ({exc})") from None
    if "X" in arrays and "y" in arrays:
        return arrays["X"], arrays["y"]
    if sess is not None:
        spec = fit_spec(sess)
        needed = list(spec.inputs) + ([spec.target] if spec.target else [])
        if needed and all(n in arrays for n in needed):
            return {n: arrays[n] for n in needed}
        wanted = f"arrays 'X' and 'y' (or {needed})"
    else:
        wanted = "arrays 'X' and 'y'"
    raise ValueError(f"{path}: expected {wanted}, found {sorted(arrays)}")


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``train_files``; the message says what the checkpoint holds."""


@dataclass
class TrainResult:
    """What ``train_files`` did."""

    history: History
    output: Path | None
    checkpoint: Path | None
    initial_epoch: int
    epochs: int
    seconds: float


def train_files(
    model: str | os.PathLike,
    data: str | os.PathLike,
    epochs: int,
    batch_size: int = 32,
    output: str | os.PathLike | None = None,
    checkpoint: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    validation_data: str | os.PathLike | None = None,
    seed: int = 0,
    progress: bool | str = True,
    callbacks: Sequence[Any] = (),
    terminate_on_nan: bool = True,
) -> TrainResult:
    """``onnxtrain train``: fit a training model file on an .npz file.

    ``resume``: a checkpoint written by ``checkpoint`` (a training model whose
    metadata records the finished epochs); training goes on from there up to
    ``epochs``, exactly as if it had never stopped, provided ``data``,
    ``batch_size`` and ``seed`` are the same.  The checkpoint must hold the
    state variables of ``model``.  ``output``: the trained inference model.

    Every output path is checked before the first step.  ``terminate_on_nan``
    (on, as in the CLI): a NaN/Inf loss stops the run through ``TerminateOnNaN``
    and raises ``NonFiniteLossError`` afterwards, with the checkpoint of the last
    finished epoch left as it was and no output written.  Ctrl-C raises
    ``TrainingInterrupted`` naming the epoch the checkpoint holds."""
    from .model import load, validate
    from .session import TrainingSession

    start = time.perf_counter()
    if int(epochs) < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if output is not None:
        check_writable(output, "-o")
    if checkpoint is not None:
        check_writable(checkpoint, "--checkpoint")
    if resume is not None:
        base = validate(*load(model))
        sess = TrainingSession(resume)
        _check_same_state(base.state, sess.state_info, model, resume)
        initial = checkpoint_epoch(sess)
    else:
        sess = TrainingSession(model)
        initial = 0
    if sess.num_algorithms == 0:
        raise TrainingModelError(
            f"{resume or model}: the model has no training_info, so there is nothing to train; "
            "make a training model first (onnxtrain make-training)"
        )
    train = load_npz(data, sess)
    val = load_npz(validation_data, sess) if validation_data is not None else None
    saver = ModelCheckpoint(checkpoint) if checkpoint is not None else None
    nan_stop = TerminateOnNaN() if terminate_on_nan else None
    all_callbacks = [cb for cb in (saver, nan_stop) if cb is not None] + list(callbacks)
    try:
        history = fit(sess, train, epochs=int(epochs), batch_size=int(batch_size), seed=int(seed),
                      validation_data=val, progress=progress, callbacks=all_callbacks,
                      # A resumed run continues where the checkpoint stood (mid-epoch too).
                      initial_epoch=(None if resume is not None and initial <= int(epochs)
                                     else min(initial, int(epochs))))
    except KeyboardInterrupt:
        at = sess.fit_position or {}
        where = f" during epoch {at.get('epoch', initial) + 1}" if at.get("batch") else ""
        if saver is not None:
            saved = (f"the checkpoint {saver.written[-1]} holds epoch {checkpoint_epoch(saver.written[-1])}"
                     if saver.written else
                     f"no checkpoint was written ({checkpoint} still holds what it held)")
        else:
            saved = "nothing was saved (use --checkpoint to keep finished epochs)"
        raise TrainingInterrupted(f"interrupted{where}: {saved}") from None
    if nan_stop is not None and nan_stop.terminated is not None:
        e, b, st, value = nan_stop.terminated
        kept = (f"; the checkpoint {saver.written[-1]} holds epoch {checkpoint_epoch(saver.written[-1])}"
                if saver is not None and saver.written else "")
        raise NonFiniteLossError(
            f"the training loss is {value} at epoch {e + 1}, batch {b + 1} (step {st} of this "
            f"run); training stopped (TerminateOnNaN), nothing written{kept}", e, b, st, value)
    written_ckpt = None
    if saver is not None:
        if saver.written:
            written_ckpt = saver.written[-1]
        else:  # no epoch ran (the checkpoint was that far already): write it all the same
            written_ckpt = write_checkpoint(sess, checkpoint, initial)
    out = sess.export(output) if output is not None else None
    return TrainResult(history, Path(out) if out else None,
                       Path(written_ckpt) if written_ckpt else None, initial, int(epochs),
                       time.perf_counter() - start)


def _check_same_state(expected: Mapping[str, Any], found: Mapping[str, Any], model: Any,
                      ckpt: Any) -> None:
    for name, var in expected.items():
        other = found.get(name)
        if other is None:
            raise ValueError(f"{ckpt}: not a checkpoint of {model}: it has no state variable {name!r}")
        if other.dtype != var.dtype or tuple(other.shape) != tuple(var.shape):
            raise ValueError(
                f"{ckpt}: not a checkpoint of {model}: {name!r} is {other.dtype}{list(other.shape)} "
                f"there, {var.dtype}{list(var.shape)} in the model"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ValueError(f"{ckpt}: not a checkpoint of {model}: unexpected state variables {extra[:5]}")
