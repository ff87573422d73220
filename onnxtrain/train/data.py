"""The data ``fit``, ``evaluate`` and ``predict`` take, turned into batches of
feeds: arrays, ``(X, y)`` pairs, dicts and iterables of batch dicts; target
checks that name the bad value; the rows of a batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .spec import FitSpec, find_value_info, label_classes, np_dtype


# ---------------------------------------------------------------------- data
class Data:
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


def as_data(sess: Any, spec: FitSpec, data: Any, caller: str, need_target: bool,
             y: Any = None) -> Data:
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
        arrays = input_arrays(spec, data[0], caller)
        if spec.target is None:
            raise ValueError(
                f"{caller}: cannot tell which feed y is (the model has no onnxtrain.target "
                "metadata and no single target input); pass a dict of feeds"
            )
        arrays[spec.target] = np.asarray(data[1])
    elif isinstance(data, np.ndarray):
        arrays = input_arrays(spec, data, caller)
    elif isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(
            f"{caller}: data must be (X, y), a dict of feeds or an iterable of batch dicts, "
            f"not {type(data).__name__}"
        )
    else:
        return Data(None, data)
    if need_target and spec.target is not None and spec.target not in arrays:
        raise ValueError(f"{caller}: the data has no target {spec.target!r}; it has {sorted(arrays)}")
    lengths = {k: len(v) if v.ndim else None for k, v in arrays.items()}
    if not arrays or None in lengths.values() or len(set(lengths.values())) != 1:
        raise ValueError(
            f"{caller}: every array must have the same number of rows (first axis); got {lengths}"
        )
    if next(iter(lengths.values())) == 0:
        raise ValueError(f"{caller}: the data is empty")
    arrays = {k: cast_feed(sess, k, v, caller, k == spec.target) for k, v in arrays.items()}
    if need_target and spec.target is not None and spec.target in arrays:
        check_targets(sess, spec, arrays[spec.target], caller)
    return Data(arrays, None)


def check_targets(
    sess: Any, spec: FitSpec, target: np.ndarray, caller: str, classes: Any = ...
) -> None:
    """Check the target array against the loss before the first step.

    Every message names the target, its shape and the fix.  The shape: the
    rank and the fixed dims the model declares for the target (any loss).
    Class-index losses (metadata ``onnxtrain.classes``: C, the class axis,
    ignore_index): every label is in [0, C) or equals ignore_index, else a
    ValueError naming the value and C (onnxruntime would fail deep inside
    with an out-of-range index, or a negative label would train silently to
    nonsense); float labels (an iterable's batches, which are not cast) are
    refused with the cast or the loss to use.  Regression targets: a float
    dtype.  ``classes``: ``label_classes``'s answer when the caller already
    has it (checks of every batch)."""
    name = spec.target
    if classes is ...:
        classes = label_classes(sess, name)
    vi = find_value_info(sess, name)
    if vi is not None:
        _check_target_shape(vi, target, name, caller, classes)
    if isinstance(classes, dict) and target.dtype.kind == "f":
        raise ValueError(float_labels_message(caller, name, target))
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
            fix = ("labels 1..C? subtract 1: y - 1" if count is not None
                   and int(target.max()) == count and int(target.min()) >= 1 else
                   f"labels must be in {allowed}{also}")
            raise ValueError(
                f"{caller}: target {name!r} holds label {int(bad[0])} at index {list(where)} "
                f"({bad.size} bad label(s); y has shape {list(target.shape)}) for C = {count} "
                f"classes; {fix}")
        return
    if vi is None or spec.task != "regression":
        return
    expected = np_dtype(vi)
    if expected is not None and expected.kind == "f" and target.dtype.kind not in "f":
        raise ValueError(f"{caller}: target {name!r} has dtype {target.dtype} (y has shape "
                         f"{list(target.shape)}); the regression loss expects {expected}: convert "
                         f"it with y.astype({expected.name!r})")


def _check_target_shape(vi: Any, target: np.ndarray, name: str, caller: str, classes: Any) -> None:
    """The rank and the fixed dims (after the batch axis) the model declares, with the fix."""
    if not vi.type.tensor_type.HasField("shape"):
        return
    dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
    shape = target.shape
    if len(dims) == len(shape) and all(d is None or i == 0 or d == n
                                       for i, (d, n) in enumerate(zip(dims, shape))):
        return
    shown = ["N" if d is None else d for d in dims]
    fix = ""
    per_row = int(np.prod(shape[1:])) if shape else 1
    if isinstance(classes, dict) and len(shape) == len(dims) + 1 and shape[-1] == classes.get("count"):
        fix = "one-hot labels? pass the class indices: y.argmax(-1)"
    elif all(d is not None for d in dims[1:]) and dims and per_row == int(np.prod(dims[1:])):
        fix = f"reshape y to {tuple([-1] + dims[1:])}"
    raise ValueError(f"{caller}: target {name!r} has shape {list(shape)}; the model expects {shown}"
                     + (f": {fix}" if fix else ""))


def float_labels_message(caller: str, name: str, arr: np.ndarray) -> str:
    """Float labels for a class-index loss: the cast when they are whole numbers,
    else the loss that takes float targets."""
    shape = list(arr.shape)
    if integral(arr):
        return (f"{caller}: target {name!r} holds class ids as {arr.dtype} (y has shape {shape}); "
                "its loss takes class indices: pass y.astype('int64')")
    flat = arr.reshape(-1)
    at = int(np.flatnonzero(~_whole(flat))[0])
    where = [int(i) for i in np.unravel_index(at, arr.shape)]
    return (f"{caller}: target {name!r} holds {flat[at]:.4g} at index {where} (y has shape {shape}, "
            f"dtype {arr.dtype}), not a class index; its loss takes class indices: for float targets build "
            "the training model with loss='mse' (onnxtrain make-training --loss mse), or "
            "bce_with_logits for 0/1 targets")


def _whole(arr: np.ndarray) -> np.ndarray:
    return np.isfinite(arr) & (arr == np.round(arr))


def integral(arr: np.ndarray) -> bool:
    """Whether every value of a float array is a whole number (a class id)."""
    return bool(arr.size) and bool(_whole(arr).all())


def input_arrays(spec: FitSpec, X: Any, caller: str) -> dict[str, np.ndarray]:
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


def cast_feed(sess: Any, name: str, arr: np.ndarray, caller: str, target: bool = False) -> np.ndarray:
    """Convert whole data arrays once to the dtype the model declares (same kind
    only; and float class ids to integer labels when every value is a whole
    number, as Keras does)."""
    vi = find_value_info(sess, name)
    expected = np_dtype(vi) if vi is not None else None
    if expected is None or arr.dtype == expected:
        return arr
    if np.can_cast(arr.dtype, expected, casting="same_kind"):
        return arr.astype(expected)
    if target and arr.dtype.kind == "f" and expected.kind in "iu":
        # Float labels on a class-index loss: whole numbers are class ids, cast as
        # Keras casts them; other values are a regression (or yes/no) task.
        if integral(arr):
            return arr.astype(expected)
        raise ValueError(float_labels_message(caller, name, arr))
    what = "target " if target else ""
    raise ValueError(f"{caller}: {what}{name!r} has dtype {arr.dtype} (shape {list(arr.shape)}), the "
                     f"model expects {expected}: convert it with .astype({expected.name!r})")


# ------------------------------------------------------------ data parallel
def comm_sum(comm: Any, values: Sequence[float]) -> list[float]:
    """The sums over the ranks of a few numbers (float64)."""
    buf = np.array(values, dtype=np.float64)
    comm.allreduce_sum(buf)
    return [float(v) for v in buf]


def check_same_rows(comm: Any, data: Data, caller: str) -> None:
    """Data-parallel fit shards one data set: every rank must hold the same rows."""
    rows = -1 if data.rows is None else data.rows
    table = comm.allgather(np.array([rows], dtype=np.int64))[:, 0]
    if len(set(table.tolist())) > 1:
        shown = ", ".join(f"rank {r}: {'an iterable' if n < 0 else f'{n} rows'}"
                          for r, n in enumerate(table))
        raise ValueError(f"{caller}: data-parallel ranks must be given the same data "
                         f"(every rank shards it), got {shown}")


def in_step(comm: Any, batches: Iterator[dict]) -> Iterator[dict]:
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
