"""The training loop around a TrainingSession: ``fit``, ``evaluate``, ``predict``.

``TrainingSession.fit/evaluate/predict`` delegate here.  What the loop needs
to know about a model (which inputs the data feeds, which output is the loss,
which algorithm runs on which batch) comes from ``model.metadata_props``
written by ``onnxtrain.build`` (JSON values, ``onnxtrain.io.metadata`` lists the
keys), and is inferred from the graphs for hand-built models.

How ``evaluate`` computes the loss without training: through the session's
*loss program* (``TrainingSession.evaluate_batch``, built by
``programs.loss_program``): the combined graph M ⊕ A of the algorithm that
produces the loss, pruned to the loss and the prediction, run on a pinned
snapshot of the state and writing nothing back.  The loss is thus exactly the
one training minimizes, whatever its kind, and the state cannot change.

What the loop reads of a model is ``train.spec``'s FitSpec, its data handling
``train.data``, its metrics ``train.metrics``; History, the callbacks and
checkpoints live in ``train.callbacks``, the metadata contract in
``io.metadata``, the file-based training of the CLI in ``cli.train``.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import TrainingModelError
from ..parallel.comm import together
from ..parallel.data_parallel import rows_of
from .callbacks import (
    HOOKS,
    History,
    StopTraining,
    TerminateOnNaN,
    check_callbacks,
    check_writable,
    same_file,
)
from .data import Data, as_data, check_same_rows, check_targets, comm_sum, in_step
from .metrics import Mean, metric_functions
from .schedule import start_schedule
from .spec import FitSpec, find_value_info, fit_spec, label_classes

__all__ = ["NonFiniteLossError", "evaluate", "fit", "predict"]

DEFAULT_EVAL_BATCH = 256


class NonFiniteLossError(FloatingPointError):
    """``fit`` met a NaN or infinite training loss.

    ``epoch`` and ``batch`` (0-based, within the epoch) and ``step`` (1-based,
    counted over this ``fit`` call) name the step; ``loss`` is its value.
    The step was committed: the session holds the state after it."""

    def __init__(self, message: str, epoch: int, batch: int, step: int, loss: float) -> None:
        super().__init__(message)
        self.epoch, self.batch, self.step, self.loss = epoch, batch, step, loss


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
    - Which epochs run (``span``; docs/fit.md): in a live session each
      ``fit(epochs=N)`` trains N more epochs, from where the last one stopped;
      a session loaded from a checkpoint at epoch k continues that run on its
      first fit, epochs k .. N-1 (mid-epoch too); ``initial_epoch=i`` trains
      epochs i .. N-1 from the first batch of i.  Epochs are numbered from
      the start of the run, so four ``fit(epochs=1)`` calls train what one
      ``fit(epochs=4)`` does.  With ``shuffle``, the order of epoch e is a
      permutation drawn from ``(seed, e)``, so a resumed run sees the batches
      an uninterrupted run would.  With nothing to train, fit says so in one
      line (unless ``progress=False``) and returns a History whose keys hold
      empty lists.
    - ``drop_last``: skip the last partial batch of each epoch.  None: True
      when the model's inputs have a fixed batch dimension (with a note),
      else False.
    - Batch k of the run (counted from the start of epoch 0, so resuming keeps
      the position) runs algorithm ``cycle[k % len(cycle)]`` through
      ``train_step``; the cycle comes from ``onnxtrain.cycle`` metadata (e.g.
      ``[0, 0, 1]`` for gradient accumulation over 3 batches) or, without it,
      every algorithm in order on each batch.
    - The loss (and the prediction, for training metrics) is fetched on every
      ``log_every``-th batch only, and nothing else (the step skips what only
      other outputs need); ``log_every=0`` never fetches it.
    - ``metrics``: names (``"accuracy"``, ``"mse"``, ``"mae"``) or callables
      ``fn(y_true, y_pred) -> float``; None is accuracy for classification.
    - ``progress``: a ``tqdm.auto`` bar per epoch (a widget in notebooks)
      with the running loss and lr; ``"epoch"``: one plain line per epoch on
      stderr; False: silent.
    - ``callbacks``: see ``onnxtrain.train.callbacks`` (Keras hooks).

    ``sess.fit_position`` is updated after every batch, so ``export(training=True)``
    at any point (a callback, after Ctrl-C) records where the run stands.
    A failed step raises and leaves the state as the previous step left it.

    A NaN or infinite training loss raises ``NonFiniteLossError`` naming
    the epoch, batch and step, unless a ``TerminateOnNaN`` callback is
    given: then fit stops there and returns.  Either way that step was
    committed (only its returned loss is checked)."""
    epochs, batch_size = int(epochs), int(batch_size)
    _check_fit_arguments(sess, epochs, batch_size, validation_split, log_every, initial_epoch)
    spec = fit_spec(sess)
    cycle = spec.cycle if cycle is None else _checked_cycle(sess, cycle)
    callbacks = check_callbacks(callbacks)
    train, validation, metric_fns = _fit_data(sess, spec, x, y, validation_split, validation_data, metrics)
    drop_last = _decide_drop_last(sess, spec, train, batch_size, drop_last)
    comm = getattr(sess, "comm", None)
    rank, ranks = (comm.rank, comm.size) if comm is not None else (0, 1)
    if ranks > 1:
        check_same_rows(comm, train, "fit")
        if rank != 0:
            # Rank 0 alone shows progress and writes files (checkpoints, logs).
            progress = False
            callbacks = [cb for cb in callbacks if not getattr(cb, "output_paths", None)]
    _start_callbacks(sess, callbacks)
    lr_known = _has_learning_rate(sess)
    classes = label_classes(sess, spec.target) if spec.target is not None else None

    per_epoch = train.num_batches(batch_size, drop_last, ranks)
    run = span(sess.fit_position, epochs, initial_epoch, per_epoch)
    schedule = start_schedule(sess, run.end, per_epoch, cycle) if lr_known and not run.nothing else None
    fitting = _Fit(
        sess=sess, spec=spec, train=train, validation=validation, metric_fns=metric_fns,
        hooks={h: [cb for cb in callbacks if getattr(cb, h, None) is not None] for h in HOOKS},
        terminate_on_nan=any(isinstance(cb, TerminateOnNaN) for cb in callbacks),
        batch_size=batch_size, drop_last=drop_last, shuffle=shuffle, seed=seed, log_every=log_every,
        cycle=cycle, progress=progress, comm=comm, rank=rank, ranks=ranks, per_epoch=per_epoch,
        epochs=run.end, base_step=run.base_step, lr_known=lr_known, schedule=schedule,
        classes=classes,
        # The cycle position continues across epochs (and across fit calls and a resume).
        cycle_pos=run.first * per_epoch + run.skip if per_epoch is not None else 0,
    )
    history = History()
    if run.nothing:
        fitting.nothing_to_train(run.nothing, history)
    _call(fitting.hooks["on_train_begin"], "on_train_begin",
          {"epochs": run.end, "initial_epoch": run.first, "steps_per_epoch": per_epoch})
    try:
        for epoch in range(run.first, run.end):
            if fitting.train_epoch(epoch, run.skip if epoch == run.first else 0, history):
                break
    finally:
        history.steps = fitting.step
    _call(fitting.hooks["on_train_end"], "on_train_end", dict(history.last))
    return history


def _check_fit_arguments(sess: Any, epochs: int, batch_size: int, validation_split: float, log_every: int,
                         initial_epoch: int | None) -> None:
    if batch_size < 1:
        raise ValueError(f"fit: batch_size must be >= 1, got {batch_size}")
    if not 0.0 <= float(validation_split) < 1.0:
        raise ValueError(f"fit: validation_split must be in [0, 1), got {validation_split!r}")
    if log_every < 0:
        raise ValueError(f"fit: log_every must be >= 0, got {log_every}")
    if sess.num_algorithms == 0:
        raise TrainingModelError("fit: the model has no training_info: there is nothing to train")
    if epochs < 0 or (initial_epoch is not None and int(initial_epoch) < 0):
        raise ValueError(f"fit: epochs and initial_epoch must be >= 0, got {epochs}, {initial_epoch}")


def _checked_cycle(sess: Any, cycle: Sequence[int | None]) -> tuple[int | None, ...]:
    """``fit(cycle=...)``: algorithm indices (None: every algorithm in order)."""
    cycle = tuple(cycle)
    n = sess.num_algorithms
    if not cycle or not all(i is None or (isinstance(i, int) and 0 <= i < n) for i in cycle):
        raise ValueError(f"fit: cycle must list algorithm indices in [0, {n}) or None, got {cycle!r}")
    return cycle


def _fit_data(sess: Any, spec: FitSpec, x: Any, y: Any, validation_split: float, validation_data: Any,
              metrics: Any) -> tuple[Data, Data | None, dict[str, Callable]]:
    """The training data, the validation data (held out by ``validation_split``,
    or ``validation_data``) and the metric functions of a ``fit`` call."""
    train = as_data(sess, spec, x, "fit", need_target=True, y=y)
    validation = None
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
        validation = Data({k: v[cut:] for k, v in train.arrays.items()}, None)
        train = Data({k: v[:cut] for k, v in train.arrays.items()}, None)
    metric_fns = metric_functions(spec, metrics, "fit")
    if validation_data is not None:
        validation = as_data(sess, spec, validation_data, "fit(validation_data)", need_target=True)
    if validation is not None and spec.loss is None:
        raise ValueError(
            "fit: validation needs the loss output, and the model names none (no "
            "onnxtrain.loss metadata, no output named 'loss')"
        )
    return train, validation, metric_fns


def _start_callbacks(sess: Any, callbacks: Sequence[Any]) -> None:
    """Check the files the callbacks write (writable, one callback each), then
    hand them the session."""
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


#: Why an epoch ended before its last batch: a callback asked to stop, or a
#: non-finite loss met under TerminateOnNaN.
STOPPED, NAN = "stopped", "nan"


@dataclass
class _Fit:
    """One ``fit`` call: what it decided before the first step, and its counters
    (``step``: steps of this call; ``cycle_pos``: batches of the run so far)."""

    sess: Any
    spec: FitSpec
    train: Data
    validation: Data | None
    metric_fns: dict[str, Callable]
    hooks: dict[str, list[Any]]
    terminate_on_nan: bool
    batch_size: int
    drop_last: bool
    shuffle: bool
    seed: Any
    log_every: int
    cycle: Sequence[int | None]
    progress: bool | str
    comm: Any
    rank: int
    ranks: int
    per_epoch: int | None
    epochs: int
    base_step: int
    lr_known: bool
    schedule: Any
    classes: Any
    cycle_pos: int
    step: int = 0
    #: ``fetched``'s answer by algorithm (the same object each step: checked once).
    fetch_names: dict[int | None, frozenset[str] | bool] = field(default_factory=dict)

    def nothing_to_train(self, why: str, history: History) -> None:
        """Say so (unless silent), and give the History the keys a run would have."""
        if self.progress is not False and self.rank == 0:
            print(f"nothing to train: {why}", file=sys.stderr, flush=True)
        keys = ["loss"] if self.spec.loss is not None and self.log_every else []
        keys += list(self.metric_fns)
        if self.validation is not None:
            keys += ["val_loss"] + [f"val_{name}" for name in self.metric_fns]
        history.history = {key: [] for key in keys + (["lr"] if self.lr_known else [])}

    def train_epoch(self, epoch: int, first: int, history: History) -> bool:
        """Train epoch ``epoch`` from its batch ``first`` and record it in
        ``history``; True when the run stops after it."""
        start = time.perf_counter()
        order = None
        if self.shuffle and self.train.arrays is not None:
            order = np.random.default_rng((int(self.seed), epoch)).permutation(self.train.rows)
        loss_mean = Mean()
        metric_means = {name: Mean() for name in self.metric_fns}
        if _call(self.hooks["on_epoch_begin"], "on_epoch_begin", epoch, {}):
            history.stopped_early = True
            return True
        lr = _current_rate(self.sess) if self.lr_known else None
        bar = _progress_bar(self.progress, self.per_epoch, f"epoch {epoch + 1}/{self.epochs}", first)
        batches = self.train.batches(self.batch_size, order, self.drop_last, (self.rank, self.ranks))
        if self.ranks > 1 and self.train.arrays is None:
            batches = in_step(self.comm, batches)
        ended = ""  # STOPPED or NAN when the epoch ends early
        try:
            for i, batch in enumerate(batches):
                if i < first:
                    continue
                lr, ended = self.train_batch(epoch, i, batch, lr, loss_mean, metric_means, bar)
                if ended:
                    break
            # No validation of NaN weights.
            epoch_logs = self.epoch_logs(loss_mean, metric_means, lr, validate=ended != NAN)
            if bar is not None:
                bar.set_postfix({k: f"{v:.4g}" for k, v in epoch_logs.items()}, refresh=False)
        finally:
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - start
        history.append(epoch, epoch_logs, seconds)
        history.steps = self.step
        if not ended:
            self.sess.fit_position = {"epoch": epoch + 1, "batch": 0, "step": self.base_step + self.step,
                                      "source": "fit"}
        if self.progress == "epoch" and self.rank == 0:
            print(epoch_line(epoch, self.epochs, epoch_logs, seconds), file=sys.stderr, flush=True)
        stop = bool(ended)
        if _call(self.hooks["on_epoch_end"], "on_epoch_end", epoch, dict(epoch_logs)):
            stop = True
        if stop:
            history.stopped_early = bool(ended) or epoch + 1 < self.epochs
        return stop

    def train_batch(self, epoch: int, i: int, batch: Mapping[str, Any], lr: float | None, loss_mean: Mean,
                    metric_means: Mapping[str, Mean], bar: Any) -> tuple[float | None, str]:
        """One step on batch ``i`` of epoch ``epoch``: the rate it used, and
        STOPPED or NAN when the epoch ends there ("" when it goes on)."""
        spec = self.spec
        if self.train.arrays is None and spec.target in batch:
            self.check_batch_targets(np.asarray(batch[spec.target]))
        if _call(self.hooks["on_batch_begin"], "on_batch_begin", i, {"epoch": epoch, "batch": i}):
            return lr, STOPPED
        algorithm = self.cycle[self.cycle_pos % len(self.cycle)]
        fetch = bool(self.log_every) and i % self.log_every == 0 and self.fetched(algorithm)
        if self.lr_known:  # the rate this step uses, schedule included
            lr = _current_rate(self.sess)
            if self.schedule is not None:  # one warning when it has ended
                self.schedule.check(lr, epoch, i)
        out = self.sess.train_step(batch, algorithm=algorithm, fetch=fetch)
        self.cycle_pos += 1
        self.step += 1
        self.sess.fit_position = {"epoch": epoch, "batch": i + 1, "step": self.base_step + self.step,
                                  "source": "fit"}
        logs: dict[str, Any] = {"epoch": epoch, "batch": i, "step": self.step, "size": rows_of(batch)}
        if lr is not None:
            logs["lr"] = lr
        if fetch and spec.loss in out:
            if not self.log_loss(epoch, i, logs, out):
                _call(self.hooks["on_batch_end"], "on_batch_end", i, logs)
                return lr, NAN
            loss_mean.add(logs["loss"], logs["size"])
            if spec.prediction in out and spec.target in batch:
                for name, fn in self.metric_fns.items():
                    value, weight = fn(batch[spec.target], out[spec.prediction])
                    metric_means[name].add(value, weight)
        if bar is not None:
            if "loss" in logs:
                post = {"loss": fmt_loss(loss_mean.result())}
                if lr is not None:
                    post["lr"] = f"{lr:.3g}"
                bar.set_postfix(post, refresh=False)
            bar.update(1)
        if self.hooks["on_batch_end"] and _call(self.hooks["on_batch_end"], "on_batch_end", i, logs):
            return lr, STOPPED
        return lr, ""

    def fetched(self, algorithm: int | None) -> frozenset[str] | bool:
        """What a logging step fetches: the loss, and the prediction where
        training metrics read it, of what the step returns (the rest only
        costs: a BatchNorm model's inference-mode forward pass)."""
        names = self.fetch_names.get(algorithm)
        if names is None:
            outputs = getattr(self.sess, "algorithm_outputs", None)
            returned = {n for i, o in enumerate(outputs or ()) if algorithm is None or i == algorithm for n in o}
            wanted = {self.spec.loss} | ({self.spec.prediction} if self.metric_fns else set())
            names = self.fetch_names[algorithm] = frozenset(wanted & returned) or True
        return names

    def check_batch_targets(self, target: np.ndarray) -> None:
        """The labels of a batch given as a dict (arrays are checked once, up front)."""
        if self.ranks > 1:  # a bad batch on one rank stops every rank
            together(self.comm, "fit: the batch check", check_targets, self.sess, self.spec, target, "fit",
                     self.classes)
        else:
            check_targets(self.sess, self.spec, target, "fit", self.classes)

    def log_loss(self, epoch: int, i: int, logs: dict[str, Any], out: Mapping[str, Any]) -> bool:
        """Put the step's loss into ``logs`` (data-parallel: the global batch's,
        with its rows as ``size``); False when it is not finite under
        TerminateOnNaN, NonFiniteLossError when it is not finite otherwise."""
        logs["loss"] = float(np.mean(out[self.spec.loss]))
        if self.ranks > 1:  # the global batch's loss, the same on every rank
            total, rows = comm_sum(self.comm, [logs["loss"] * logs["size"], logs["size"]])
            logs["loss"], logs["size"] = total / rows, int(rows)
        if math.isfinite(logs["loss"]):
            return True
        if self.terminate_on_nan:
            return False
        raise NonFiniteLossError(
            f"fit: the training loss is {logs['loss']} at epoch {epoch + 1}, "
            f"batch {i + 1} (step {self.step} of this run); training stopped. The "
            "step was committed: the state holds the parameters after it",
            epoch, i, self.step, logs["loss"],
        )

    def epoch_logs(self, loss_mean: Mean, metric_means: Mapping[str, Mean], lr: float | None,
                   validate: bool) -> dict[str, float]:
        """The epoch's loss, metrics (over every rank), validation and rate."""
        epoch_logs: dict[str, float] = {}
        if self.ranks > 1:
            for mean in metric_means.values():
                mean.total, mean.weight = comm_sum(self.comm, [mean.total, mean.weight])
        if loss_mean.weight:
            epoch_logs["loss"] = loss_mean.result()
        for name, mean in metric_means.items():
            if mean.weight:
                epoch_logs[name] = mean.result()
        if self.validation is not None and validate:
            val = _evaluate_data(self.sess, self.spec, self.validation, DEFAULT_EVAL_BATCH, self.metric_fns,
                                 self.comm if self.ranks > 1 else None, stacklevel=5)
            epoch_logs.update({f"val_{k}": v for k, v in val.items()})
        if lr is not None:
            epoch_logs["lr"] = lr
        return epoch_logs


@dataclass(frozen=True)
class Span:
    """The epochs one ``fit`` call trains: epoch ``first`` (from its batch
    ``skip``) up to ``end`` (excluded); ``base_step``: the steps done before
    it; ``nothing``: why nothing is to train ("" when something is)."""

    first: int
    skip: int
    end: int
    base_step: int
    nothing: str = ""


def span(position: Mapping[str, Any] | None, epochs: int, initial_epoch: int | None,
         per_epoch: int | None) -> Span:
    """Which epochs ``fit(epochs=epochs, initial_epoch=initial_epoch)`` trains
    from ``position`` (the session's ``fit_position``; docs/fit.md):

    - ``initial_epoch=i``: epochs i .. epochs-1, from the first batch of i;
    - a position read from a checkpoint (``source`` "checkpoint", the first
      fit of a loaded session): that run goes on, from its epoch and batch up
      to ``epochs`` (exclusive), as Lightning's resume does;
    - a position ``fit`` left (a live session): ``epochs`` more epochs from
      where it stopped, as Keras trains ``epochs`` more on each call;
    - no position: epochs 0 .. epochs-1.

    Steps count on from the position's (cumulative, so that the position,
    epoch and step, agrees with the model's step counter).

    >>> span({"epoch": 2, "batch": 0, "step": 90, "source": "fit"}, 3, None, 45)
    Span(first=2, skip=0, end=5, base_step=90, nothing='')
    >>> span({"epoch": 4, "batch": 0, "step": 180, "source": "checkpoint"}, 2, None, 45).nothing
    'the checkpoint is at epoch 4 of 2'
    """
    position = position or {}
    at, batch = int(position.get("epoch", 0)), int(position.get("batch") or 0)
    step = position.get("step")
    if not isinstance(step, int):  # (a checkpoint that holds its epoch only)
        step = at * per_epoch + batch if per_epoch is not None else 0
    if initial_epoch is not None:
        first, end = int(initial_epoch), epochs
        nothing = f"initial_epoch={first} and epochs={end}" if first >= end else ""
        return Span(first, 0, end, step, nothing)
    source = position.get("source")
    if source == "checkpoint":
        nothing = f"the checkpoint is at epoch {at} of {epochs}" if at >= epochs else ""
        return Span(at, batch, max(at, epochs), step, nothing)
    if source is None:
        return Span(0, 0, epochs, 0, "" if epochs else "epochs=0")
    return Span(at, batch, at + epochs, step, "" if epochs else "epochs=0")


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
        vi = find_value_info(sess, name)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            continue
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return int(dims[0].dim_value)
    return None


def _decide_drop_last(sess: Any, spec: FitSpec, train: Data, batch_size: int,
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
    data_ = as_data(sess, spec, x, "evaluate", need_target=True, y=y)
    return _evaluate_data(sess, spec, data_, int(batch_size), metric_functions(spec, metrics, "evaluate"))


def _evaluate_data(sess: Any, spec: FitSpec, data: Data, batch_size: int,
                   metric_fns: Mapping[str, Callable], comm: Any = None, stacklevel: int = 3) -> dict[str, float]:
    """Loss and metrics over ``data``; with ``comm`` (data-parallel fit), each
    rank evaluates its share of the rows and the means combine over the ranks.
    ``stacklevel``: its warning's, counted from here (``fit`` calls it from deeper)."""
    if comm is not None and data.arrays is not None:
        lo = comm.rank * data.rows // comm.size
        hi = (comm.rank + 1) * data.rows // comm.size
        data = Data({k: v[lo:hi] for k, v in data.arrays.items()}, None)
    loss_mean = Mean()
    metric_means = {name: Mean() for name in metric_fns}
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
                          f"{data.rows % fixed} row(s) are not evaluated", UserWarning, stacklevel=stacklevel)
    for batch in data.batches(batch_size, drop_last=fixed is not None):
        out = sess.evaluate_batch(batch, spec.loss, spec.prediction, spec.loss_algorithm)
        rows = rows_of(batch)
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
    data_ = as_data(sess, spec, x, "predict", need_target=False)
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
        rows = rows_of(batch)
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
