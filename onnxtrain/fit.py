"""The training loop around a TrainingSession: ``fit``, ``evaluate``, ``predict``.

``TrainingSession.fit/evaluate/predict`` delegate here.  What the loop needs
to know about a model (which inputs the data feeds, which output is the loss,
which algorithm runs on which batch) comes from ``model.metadata_props``
written by ``onnxtrain.build`` (JSON values, ``onnxtrain.metadata`` lists the
keys), and is inferred from the graphs for hand-built models.

How ``evaluate`` computes the loss without training: through the session's
*loss program* (``TrainingSession.evaluate_batch``, built by
``programs.loss_program``): the combined graph M ⊕ A of the algorithm that
produces the loss, pruned to the loss and the prediction, run on a pinned
snapshot of the state and writing nothing back.  The loss is thus exactly the
one training minimizes, whatever its kind, and the state cannot change.

History, the callbacks and checkpoints live in ``onnxtrain.callbacks``, the
metadata contract in ``onnxtrain.metadata``, the file-based training of the
CLI in ``onnxtrain.cli_train``; their names stay importable from here.

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

import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from .callbacks import (
    HOOKS,
    Callback,
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    History,
    ModelCheckpoint,
    StopTraining,
    TerminateOnNaN,
    check_callbacks,
    check_writable,
    same_file,
    write_checkpoint,
)
from .comm import together
from .errors import TrainingModelError
from .metadata import checkpoint_epoch, model_metadata

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
    "checkpoint_epoch",
    "evaluate",
    "fit",
    "fit_spec",
    "model_metadata",
    "predict",
    "write_checkpoint",
]

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

    def num_batches(self, batch_size: int, drop_last: bool = False, ranks: int = 1) -> int | None:
        """Batches per epoch (per rank: a global batch is ``batch_size * ranks`` rows,
        and a last one too small to give every rank a row is dropped)."""
        if self.arrays is not None:
            step = batch_size * ranks
            if drop_last:
                return self.rows // step
            return math.ceil(self.rows / step) - (1 if 0 < self.rows % step < ranks else 0)
        try:
            return len(self.iterable)  # type: ignore[arg-type]
        except TypeError:
            return None

    def batches(self, batch_size: int, order: np.ndarray | None = None,
                drop_last: bool = False, shard: tuple[int, int] = (0, 1)) -> Iterator[dict]:
        """The batches of one epoch in ``order``.  ``shard=(rank, ranks)``:
        data-parallel, rank ``rank``'s part of each global batch of
        ``batch_size * ranks`` rows (parts differ by at most one row)."""
        if self.arrays is not None:
            rank, ranks = shard
            step = batch_size * ranks
            for k in range(self.num_batches(batch_size, drop_last, ranks) or 0):
                begin = k * step
                size = min(step, self.rows - begin)
                lo = begin + rank * (size // ranks) + min(rank, size % ranks)
                hi = lo + size // ranks + (1 if rank < size % ranks else 0)
                rows: Any = slice(lo, hi) if order is None else order[lo:hi]
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
    arrays = {k: _cast(sess, k, v, caller, k == spec.target) for k, v in arrays.items()}
    if need_target and spec.target is not None and spec.target in arrays:
        check_targets(sess, spec, arrays[spec.target], caller)
    return _Data(arrays, None)


def label_classes(sess: Any, target: str) -> dict[str, Any] | None:
    """What labels of ``target`` are checked against: metadata
    ``onnxtrain.classes`` of a built model, else the class-index loss node that
    reads the target (``_classes_from_loss_nodes``); None for other losses."""
    return model_metadata(sess.model).get("classes") or _classes_from_loss_nodes(sess.model, target)


def check_targets(
    sess: Any, spec: FitSpec, target: np.ndarray, caller: str, classes: Any = ...
) -> None:
    """Check the target array against the loss before the first step.

    Class-index losses (metadata ``onnxtrain.classes``: C, the class axis,
    ignore_index): every label is in [0, C) or equals ignore_index, else a
    ValueError naming the target, the value and C (onnxruntime would fail
    deep inside with an out-of-range index, or a negative label would train
    silently to nonsense).  Regression targets: a float dtype, and the rank
    (and fixed dims) the model declares.  ``classes``: ``label_classes``'s
    answer when the caller already has it (checks of every batch)."""
    name = spec.target
    if classes is ...:
        classes = label_classes(sess, name)
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


def _cast(sess: Any, name: str, arr: np.ndarray, caller: str, target: bool = False) -> np.ndarray:
    """Convert whole data arrays once to the dtype the model declares (same kind only)."""
    vi = _find_value_info(sess, name)
    expected = _np_dtype(vi) if vi is not None else None
    if expected is None or arr.dtype == expected:
        return arr
    if np.can_cast(arr.dtype, expected, casting="same_kind"):
        return arr.astype(expected)
    hint = ""
    if target and arr.dtype.kind == "f" and expected.kind in "iu":
        # Float targets on a class-index loss: a regression (or yes/no) task.
        hint = ("; its loss takes class indices: for float targets build the training model "
                "with loss='mse' (onnxtrain make-training --loss mse), or bce_with_logits for "
                "0/1 targets")
    raise ValueError(f"{caller}: {name!r} has dtype {arr.dtype}, the model expects {expected}{hint}")


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
    """Train ``sess``; returns a History of per-epoch loss, metrics and lr
    (the rate the epoch's last step used, schedule included:
    ``sess.current_learning_rate`` before that step).

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
    comm = getattr(sess, "comm", None)
    rank, ranks = (comm.rank, comm.size) if comm is not None else (0, 1)
    if ranks > 1:
        _check_same_rows(comm, train, "fit")
        if rank != 0:
            # Rank 0 alone shows progress and writes files (checkpoints, logs).
            progress = False
            callbacks = [cb for cb in callbacks if not getattr(cb, "output_paths", None)]
    seen: list[tuple[str, Any]] = []
    for cb in callbacks:
        for path in getattr(cb, "output_paths", lambda: [])():
            what = f"fit: {type(cb).__name__}"
            check_writable(path, what)
            for other_what, other in seen:  # two callbacks writing one file
                if same_file(path, other):
                    raise ValueError(f"{what} {os.fspath(path)}: is the file of {other_what} "
                                     "too; give each output its own path")
            seen.append((what, path))
    for cb in callbacks:
        if callable(getattr(cb, "set_session", None)):
            cb.set_session(sess)
    terminate_on_nan = any(isinstance(cb, TerminateOnNaN) for cb in callbacks)
    lr_known = _has_learning_rate(sess)
    classes = label_classes(sess, spec.target) if spec.target is not None else None

    per_epoch = train.num_batches(batch_size, drop_last, ranks)
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
            lr = _current_rate(sess) if lr_known else None
            bar = _progress_bar(progress, per_epoch, f"epoch {epoch + 1}/{epochs}", first)
            batches = train.batches(batch_size, order, drop_last, (rank, ranks))
            if ranks > 1 and train.arrays is None:
                batches = _in_step(comm, batches)
            try:
                for i, batch in enumerate(batches):
                    if i < first:
                        continue
                    if train.arrays is None and spec.target in batch:
                        target = np.asarray(batch[spec.target])
                        if ranks > 1:  # a bad batch on one rank stops every rank
                            together(comm, "fit: the batch check", check_targets, sess, spec,
                                     target, caller, classes)
                        else:
                            check_targets(sess, spec, target, caller, classes)
                    if _call(hooks["on_batch_begin"], "on_batch_begin", i, {"epoch": epoch, "batch": i}):
                        stop = broke = True
                        break
                    algorithm = cycle[cycle_pos % len(cycle)]
                    fetch = bool(log_every) and i % log_every == 0
                    if lr_known:  # the rate this step uses, schedule included
                        lr = _current_rate(sess)
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
                        if ranks > 1:  # the global batch's loss, the same on every rank
                            total, rows = comm_sum(comm, [logs["loss"] * rows, rows])
                            logs["loss"], logs["size"] = total / rows, int(rows)
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
                            post = {"loss": fmt_loss(loss_mean.result())}
                            if lr is not None:
                                post["lr"] = f"{lr:.3g}"
                            bar.set_postfix(post, refresh=False)
                        bar.update(1)
                    if hooks["on_batch_end"] and _call(hooks["on_batch_end"], "on_batch_end", i, logs):
                        stop = broke = True
                        break
                epoch_logs: dict[str, float] = {}
                if ranks > 1:
                    for mean in metric_means.values():
                        mean.total, mean.weight = comm_sum(comm, [mean.total, mean.weight])
                if loss_mean.weight:
                    epoch_logs["loss"] = loss_mean.result()
                for name, mean in metric_means.items():
                    if mean.weight:
                        epoch_logs[name] = mean.result()
                if validation is not None and not nan_stop:  # no validation of NaN weights
                    val = _evaluate_data(sess, spec, validation, DEFAULT_EVAL_BATCH, metric_fns,
                                         comm if ranks > 1 else None)
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
            if progress == "epoch" and rank == 0:
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


def fmt_loss(value: float) -> str:
    """A loss or metric for a line of text: 4 decimals, scientific notation
    beyond 1e6 (a diverging loss stays readable) and below 1e-4.

    >>> fmt_loss(0.41234), fmt_loss(4.459e35), fmt_loss(2e-7), fmt_loss(0.0)
    ('0.4123', '4.459e+35', '2e-07', '0.0000')"""
    value = float(value)
    if value != 0 and math.isfinite(value) and not 1e-4 <= abs(value) < 1e6:
        return f"{value:.4g}"
    return f"{value:.4f}"


def epoch_line(epoch: int, epochs: int, logs: Mapping[str, float], seconds: float) -> str:
    """``epoch 3/10: loss 0.4123, accuracy 0.9, lr 0.001 (1.2 s)``: one line per epoch."""
    values = ", ".join(f"{k} {v:.4g}" for k, v in logs.items())
    return f"epoch {epoch + 1}/{epochs}: {values or 'done'} ({seconds:.1f} s)"


def _current_rate(sess: Any) -> float:
    """The rate the next step uses (``current_learning_rate``, the schedule
    applied), or the base rate for a session that does not offer it."""
    rate = getattr(sess, "current_learning_rate", None)
    return float(sess.learning_rate if rate is None else rate)


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
    from tqdm import tqdm as text_bar
    from tqdm.auto import tqdm  # a widget in notebooks (ipywidgets), text elsewhere

    options = dict(total=total, desc=desc, unit="batch", file=sys.stderr, leave=True,
                   dynamic_ncols=True, mininterval=0.2, initial=initial)
    try:
        return tqdm(**options)
    except ImportError:  # older tqdm picks the widget in any notebook, then misses ipywidgets
        return text_bar(**options)


def _rows_of(batch: Mapping[str, Any]) -> int:
    for value in batch.values():
        shape = np.shape(value)
        if shape:
            return int(shape[0])
    return 1


# ------------------------------------------------------------ data parallel
def comm_sum(comm: Any, values: Sequence[float]) -> list[float]:
    """The sums over the ranks of a few numbers (float64)."""
    buf = np.array(values, dtype=np.float64)
    comm.allreduce_sum(buf)
    return [float(v) for v in buf]


def _check_same_rows(comm: Any, data: _Data, caller: str) -> None:
    """Data-parallel fit shards one data set: every rank must hold the same rows."""
    rows = -1 if data.rows is None else data.rows
    table = comm.allgather(np.array([rows], dtype=np.int64))[:, 0]
    if len(set(table.tolist())) > 1:
        shown = ", ".join(f"rank {r}: {'an iterable' if n < 0 else f'{n} rows'}"
                          for r, n in enumerate(table))
        raise ValueError(f"{caller}: data-parallel ranks must be given the same data "
                         f"(every rank shards it), got {shown}")


def _in_step(comm: Any, batches: Iterator[dict]) -> Iterator[dict]:
    """The batches of a per-rank iterable, checked to run out on every rank
    at the same step (else a rank would wait for the others forever)."""
    taken = 0
    while True:
        try:
            batch, has = next(batches), 1
        except StopIteration:
            batch, has = None, 0
        flags = comm.allgather(np.array([has], dtype=np.int64))[:, 0]
        if flags.all():
            taken += 1
            yield batch
        elif not flags.any():
            return
        else:
            ended = [r for r, f in enumerate(flags) if not f]
            raise ValueError(f"fit: the ranks' batch iterables differ in length: rank(s) {ended} "
                             f"ran out after {taken} batches, the others did not")


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
                   metric_fns: Mapping[str, Callable], comm: Any = None) -> dict[str, float]:
    """Loss and metrics over ``data``; with ``comm`` (data-parallel fit), each
    rank evaluates its share of the rows and the means combine over the ranks."""
    if comm is not None and data.arrays is not None:
        lo = comm.rank * data.rows // comm.size
        hi = (comm.rank + 1) * data.rows // comm.size
        data = _Data({k: v[lo:hi] for k, v in data.arrays.items()}, None)
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
        out = sess.evaluate_batch(batch, spec.loss, spec.prediction, spec.loss_algorithm)
        rows = _rows_of(batch)
        loss_mean.add(float(np.mean(out[spec.loss])), rows)
        for name, fn in metric_fns.items():
            value, weight = fn(batch[spec.target], out[spec.prediction])
            metric_means[name].add(value, weight)
    if comm is not None:
        for mean in [loss_mean, *metric_means.values()]:
            mean.total, mean.weight = comm_sum(comm, [mean.total, mean.weight])
    result = {"loss": loss_mean.result()}
    result.update({name: mean.result() for name, mean in metric_means.items()})
    return result


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
