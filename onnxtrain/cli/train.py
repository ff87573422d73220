"""File-based training for the CLI (``onnxtrain train``): a model file, an .npz
data file, checkpoints to resume from.

``train_files`` wraps ``fit`` with what a command line needs: every output
path checked before the first step, a checkpoint per epoch
(``ModelCheckpoint``), a NaN/Inf loss stopping the run (``TerminateOnNaN``),
Ctrl-C reported as ``TrainingInterrupted`` naming what the checkpoint holds,
and a resumed run continuing exactly where the checkpoint stood.
"""

from __future__ import annotations

import os
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TrainingModelError
from ..io.metadata import checkpoint_epoch
from ..io.model import load, validate
from ..parallel.comm import as_communicator, together
from ..session import TrainingSession
from ..train.callbacks import History, ModelCheckpoint, TerminateOnNaN, check_writable, same_file, write_checkpoint
from ..train.loop import NonFiniteLossError, fit, fit_spec

__all__ = ["TrainResult", "TrainingInterrupted", "check_outputs", "load_npz", "train_files"]


def load_npz(path: str | os.PathLike, sess: Any | None = None) -> Any:
    """Training data from an .npz file: ``(X, y)`` from arrays ``X`` and ``y``, else a
    dict of the arrays when their names are feeds of ``sess``."""
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
    """Ctrl-C during ``train_files``; the message says what the checkpoint holds
    and how to go on (``--resume``); ``checkpoint`` is the file to resume from
    (None when none was written)."""

    def __init__(self, message: str, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


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
    comm: Any = None,
    overwrite: bool = False,
    lr: float | None = None,
) -> TrainResult:
    """``onnxtrain train``: fit a training model file on an .npz file.

    ``resume``: a checkpoint written by ``checkpoint`` (a training model whose
    metadata records the finished epochs); training goes on from there up to
    ``epochs``, exactly as if it had never stopped, provided ``data``,
    ``batch_size`` and ``seed`` are the same.  The checkpoint must hold the
    state variables of ``model``.  ``output``: the trained inference model.
    A ``checkpoint`` that exists is refused unless the run resumes
    (``resume``) or ``overwrite`` says to start again over it.

    Every output path is checked before the first step: a file path whose
    folder takes a new file, not the model, the data or another output.  ``terminate_on_nan``
    (on, as in the CLI): a NaN/Inf loss stops the run through ``TerminateOnNaN``
    and raises ``NonFiniteLossError`` afterwards, with the checkpoint of the last
    finished epoch left as it was and no output written.  Ctrl-C raises
    ``TrainingInterrupted`` naming the epoch the checkpoint holds.

    ``comm`` (an ``onnxtrain.comm.Communicator`` or mpi4py communicator):
    data-parallel training; every rank calls this with the same arguments,
    each trains on its shard of every global batch of ``batch_size * ranks``
    rows, and rank 0 alone shows progress and writes the checkpoint and the
    output.  A failure on any rank (a missing file, a bad batch) stops every
    rank.  ``lr``: the base learning rate to train with (``sess.learning_rate``,
    set before the first step, over a resumed checkpoint's too)."""
    start = time.perf_counter()
    if int(epochs) < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    comm = as_communicator(comm) if comm is not None else None
    rank = comm.rank if comm is not None else 0
    writes = rank == 0  # data-parallel: rank 0 alone writes files and shows progress

    def check_paths() -> Any:
        if writes:
            check_outputs(model, data, output, checkpoint, resume, validation_data, overwrite)
        return validate(*load(model)) if resume is not None else None

    base = _everywhere(comm, check_paths)
    sess = TrainingSession(resume if resume is not None else model, comm=comm)

    train, val, initial = _everywhere(
        comm, lambda: _session_ready(sess, base, model, resume, (data, validation_data), lr)
    )
    saver = ModelCheckpoint(checkpoint) if checkpoint is not None and writes else None
    nan_stop = TerminateOnNaN() if terminate_on_nan else None
    all_callbacks = [cb for cb in (saver, nan_stop) if cb is not None] + list(callbacks)
    # (nothing to train: the command says so itself, in its own words)
    quiet = not writes or (resume is not None and initial >= int(epochs))
    try:
        history = fit(sess, train, epochs=int(epochs), batch_size=int(batch_size), seed=int(seed),
                      validation_data=val, progress=False if quiet else progress,
                      callbacks=all_callbacks,
                      # A resumed run continues where the checkpoint stood (mid-epoch
                      # too): the first fit of a session loaded from a checkpoint.
                      initial_epoch=None if resume is not None else 0)
    except KeyboardInterrupt:
        raise _interrupted(sess, saver, checkpoint, resume, initial) from None
    if nan_stop is not None and nan_stop.terminated is not None:
        raise _non_finite(nan_stop, saver)
    written_ckpt = None
    if saver is not None:
        if saver.written:
            written_ckpt = saver.written[-1]
        else:  # no epoch ran (the checkpoint was that far already): write it all the same
            written_ckpt = write_checkpoint(sess, checkpoint, initial)
    out = sess.export(output) if output is not None and writes else None
    return TrainResult(history, Path(out) if out else None,
                       Path(written_ckpt) if written_ckpt else None, initial, int(epochs),
                       time.perf_counter() - start)


def _session_ready(sess: TrainingSession, base: Any, model: Any, resume: Any, data_files: tuple[Any, Any],
                   lr: float | None) -> tuple[Any, Any, int]:
    """The session checked against the model it resumes, its data loaded and its learning rate set:
    (training data, validation data, the epoch it starts at)."""
    data, validation_data = data_files
    initial = 0
    if resume is not None:
        _check_same_state(base.state, sess.state_info, model, resume)
        initial = checkpoint_epoch(sess)
    if sess.num_algorithms == 0:
        raise TrainingModelError(
            f"{resume or model}: the model has no training_info, so there is nothing to "
            "train; make a training model first (onnxtrain make-training)"
        )
    train = load_npz(data, sess)
    val = load_npz(validation_data, sess) if validation_data is not None else None
    if lr is not None:
        sess.learning_rate = lr
    return train, val, initial


def _interrupted(sess: TrainingSession, saver: ModelCheckpoint | None, checkpoint: Any, resume: Any,
                 initial: int) -> TrainingInterrupted:
    """The Ctrl-C error: where the run stopped, what the checkpoint holds and how to go on."""
    at = sess.fit_position or {}
    where = f" during epoch {at.get('epoch', initial) + 1}" if at.get("batch") else ""
    held = None
    if saver is not None and saver.written:
        held = saver.written[-1]
        saved = (f"the checkpoint {held} holds epoch {checkpoint_epoch(held)}; "
                 f"continue with --resume {held}")
    elif saver is not None:
        saved = f"no checkpoint was written ({checkpoint} still holds what it held)"
        if resume is not None:
            held = Path(resume)
            saved += f"; continue with --resume {resume}"
    else:
        saved = "nothing was saved (use --checkpoint to keep finished epochs)"
    return TrainingInterrupted(f"interrupted{where}: {saved}", held)


def _non_finite(nan_stop: TerminateOnNaN, saver: ModelCheckpoint | None) -> NonFiniteLossError:
    """The error of a run TerminateOnNaN stopped: the loss, where it was, and the checkpoint kept."""
    e, b, st, value = nan_stop.terminated
    kept = (f"; the checkpoint {saver.written[-1]} holds epoch {checkpoint_epoch(saver.written[-1])}"
            if saver is not None and saver.written else "")
    return NonFiniteLossError(
        f"the training loss is {value} at epoch {e + 1}, batch {b + 1} (step {st} of this "
        f"run); training stopped (TerminateOnNaN), nothing written{kept}", e, b, st, value)


def check_outputs(model: Any, data: Any, output: Any, checkpoint: Any, resume: Any = None,
                  validation_data: Any = None, overwrite: bool = False) -> None:
    """Refuse, in one line naming the option and the path, an output that
    cannot be written (``check_writable``), that is one of the inputs (the
    model being trained, the data) or another output, and an existing
    checkpoint that the run neither resumes nor may overwrite."""
    outputs = [(w, p) for w, p in (("-o", output), ("--checkpoint", checkpoint)) if p is not None]
    for what, path in outputs:
        check_writable(path, what)
    inputs = [(w, p) for w, p in (("the model being trained (MODEL)", model),
                                  ("the checkpoint being resumed (--resume)", resume),
                                  ("the data (--data)", data),
                                  ("the validation data (--validation-data)", validation_data))
              if isinstance(p, (str, os.PathLike))]
    for i, (what, path) in enumerate(outputs):
        for name, other in inputs:
            if what == "--checkpoint" and "(--resume)" in name:
                continue  # resume a checkpoint and go on writing it: the usual way
            if same_file(path, other):
                raise ValueError(f"{what} {os.fspath(path)}: is {name}; writing there would "
                                 "replace it: give another path")
        for name, other in outputs[:i]:
            if same_file(path, other):
                raise ValueError(f"{what} {os.fspath(path)}: is also the {name} output; give "
                                 "each output its own path")
    if checkpoint is not None and resume is None and not overwrite and os.path.exists(checkpoint):
        try:
            held = f"epoch {checkpoint_epoch(checkpoint)} of an earlier run"
        except Exception:  # not an ONNX model: still not ours to replace
            held = "a file already"
        raise ValueError(f"--checkpoint {os.fspath(checkpoint)}: holds {held}; continue it with "
                         f"--resume {os.fspath(checkpoint)}, or start again over it with --overwrite")


def _everywhere(comm: Any, fn: Any) -> Any:
    """``fn()``; data-parallel, on every rank, failing on all if it fails on one."""
    return fn() if comm is None else together(comm, "onnxtrain train", fn)


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
