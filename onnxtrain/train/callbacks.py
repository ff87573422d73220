"""Callbacks of the fit loop, with the hooks and semantics of Keras.

Every hook is optional; a callback must define at least one of them:

=========================== ===================================================
hook                        called
=========================== ===================================================
``on_train_begin(logs)``    once, before the first step (logs: ``epochs``,
                            ``initial_epoch``, ``steps_per_epoch``)
``on_epoch_begin(e, logs)`` before epoch ``e`` (0-based)
``on_batch_begin(b, logs)`` before batch ``b`` (0-based within the epoch)
``on_batch_end(b, logs)``   after it: logs hold ``epoch``, ``batch``, ``step``
                            (1-based over the fit call), ``size`` (rows),
                            ``loss`` when fetched and ``lr`` when known
``on_epoch_end(e, logs)``   after the epoch, with its values (``loss``,
                            metrics, ``val_*``, ``lr``)
``on_train_end(logs)``      once, after the last epoch (also after a stop)
=========================== ===================================================

A hook stops training by returning True or raising ``StopTraining`` (after
the current batch; the partial epoch is still logged).  The loop hands each
callback the session first: ``set_session(sess)`` where defined (the base
class stores it as ``self.session``), so ``ModelCheckpoint`` and
``EarlyStopping(restore_best_weights=True)`` need no session argument.

Callbacks use only the session's public API (``state``, ``load_state``,
``export``/``to_model``, ``fit_position``).  ``History`` (what ``fit``
returns) and ``write_checkpoint`` live here too.
"""

from __future__ import annotations

import csv
import errno
import math
import os
import re
import stat
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "HOOKS",
    "CSVLogger",
    "Callback",
    "Checkpoint",
    "EarlyStopping",
    "History",
    "ModelCheckpoint",
    "StopTraining",
    "TerminateOnNaN",
    "check_callbacks",
    "check_writable",
    "same_file",
    "special_kind",
    "write_checkpoint",
]

#: The hooks the loop calls, in the order of a run.
HOOKS = ("on_train_begin", "on_epoch_begin", "on_batch_begin", "on_batch_end",
         "on_epoch_end", "on_train_end")


class StopTraining(Exception):
    """Raised by a callback to end ``fit`` after the current batch or epoch."""


class Callback:
    """Base class of fit callbacks: every hook does nothing (see the module doc)."""

    session: Any = None

    def set_session(self, sess: Any) -> None:
        self.session = sess

    def output_paths(self) -> list[Path]:
        """Files this callback will write (checked before the first step)."""
        return []

    def on_train_begin(self, logs: dict[str, Any]) -> bool | None:
        return None

    def on_train_end(self, logs: dict[str, Any]) -> bool | None:
        return None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> bool | None:
        return None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> bool | None:
        return None

    def on_batch_begin(self, batch: int, logs: dict[str, Any]) -> bool | None:
        return None

    def on_batch_end(self, batch: int, logs: dict[str, Any]) -> bool | None:
        return None


def check_callbacks(callbacks: Any) -> list[Any]:
    """The callbacks as a list; TypeError for anything that has none of the hooks
    (a lambda or a function passed by mistake would otherwise be ignored)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback) or not isinstance(callbacks, Sequence):
        callbacks = [callbacks]
    out = list(callbacks)
    for i, cb in enumerate(out):
        if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
            raise TypeError(
                f"fit: callbacks[{i}] ({type(cb).__name__}) has none of the hooks {list(HOOKS)}; "
                "subclass onnxtrain.Callback and define one (a plain function is not a callback)"
            )
    return out


def check_writable(path: str | os.PathLike, what: str) -> Path:
    """ValueError unless ``path`` can be written as a file, checked before
    training so that a bad path fails at once, not after the last epoch.

    Refused: an existing path that is not a regular file (a folder, a device,
    a FIFO, a socket: replacing it would destroy it; it is left as it is), a
    missing folder, and a folder where no file can be made (``/proc``, a
    read-only mount: a file is made there and removed again, since
    permissions alone do not say it for root).  Each error is one line
    ``{what} {path}: ...`` naming the path as given."""
    p = Path(path)
    shown = f"{what} {os.fspath(path)}"
    if p.is_dir():
        raise ValueError(f"{shown}: is a folder; give a file path such as {str(p / 'model.onnx')!r}")
    kind = special_kind(p)
    if kind:
        raise ValueError(f"{shown}: exists and is not a regular file (a {kind}); it was left as it "
                         "is: give the path of a file")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{shown}: the folder {str(parent)!r} does not exist")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{shown}: exists and is not writable")
    try:  # can a file be made there?  (the temporary file's name is not shown)
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.{os.getpid()}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise ValueError(f"{shown}: {_no_new_file(str(parent), exc)}") from None
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass
    return p


def _no_new_file(folder: str, exc: OSError) -> str:
    """Why no file can be made in ``folder`` (which exists), in words.

    >>> _no_new_file("/proc", FileNotFoundError(errno.ENOENT, "No such file or directory"))
    "the folder '/proc' takes no new files (its file system refuses them, as /proc and /sys do)"
    """
    reasons = {
        errno.ENOENT: "its file system refuses them, as /proc and /sys do",
        errno.EACCES: "no permission to write there",
        errno.EPERM: "no permission to write there",
        errno.EROFS: "it is on a read-only file system",
        errno.ENOSPC: "its device has no space left",
        errno.EDQUOT: "the disk quota is used up",
    }
    reason = reasons.get(exc.errno) or (exc.strerror or type(exc).__name__).lower()
    return f"the folder {folder!r} takes no new files ({reason})"


def special_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it exists and is not a regular file (following
    links): "folder", "character device", "FIFO", ...; None otherwise."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode):
        return None
    for test, name in ((stat.S_ISDIR, "folder"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file (links and hard links included)."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for
    ``patience`` epochs (Keras and Lightning semantics).

    ``mode``: "min", "max" or "auto" (max for names with accuracy/auc, else
    min).  ``restore_best_weights``: at the end of training, go back to the
    end of the best epoch.  The whole state is restored (weights, optimizer
    moments, the step counter and so on, not the weights alone) and the
    session's ``fit_position`` is set back to that epoch's, so the session,
    its position and a checkpoint written by ``export(training=True)`` all
    describe the same moment; resuming that checkpoint trains on from the best
    epoch.  It needs the session, which the loop gives.
    ``verbose``: print one line when it stops (the epoch, 1-based) and one
    when it restores (Keras's words).  The state is reset at
    ``on_train_begin``, so one object serves several fits.
    ``stopped_epoch`` and ``restored_epoch`` (0-based, None when it did not)
    say what happened.

    >>> es = EarlyStopping("val_loss", patience=1, verbose=False)
    >>> [es.on_epoch_end(e, {"val_loss": v}) for e, v in enumerate([1.0, 0.5, 0.6])]
    [False, False, True]
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 0, mode: str = "auto",
                 min_delta: float = 0.0, restore_best_weights: bool = False,
                 verbose: bool = True) -> None:
        if mode == "auto":
            mode = "max" if any(k in monitor for k in ("acc", "auc")) else "min"
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping: mode must be 'min', 'max' or 'auto', got {mode!r}")
        if int(patience) < 0:
            raise ValueError(f"EarlyStopping: patience must be >= 0, got {patience!r}")
        self.monitor, self.patience, self.mode = monitor, int(patience), mode
        self.min_delta = abs(float(min_delta))
        self.restore_best_weights = bool(restore_best_weights)
        self.verbose = bool(verbose)
        self._reset()

    def _reset(self) -> None:
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch: int | None = None
        self.best_state: dict[str, np.ndarray] | None = None
        self.best_position: dict[str, Any] | None = None
        self.wait = 0
        self.stopped_epoch: int | None = None
        self.restored_epoch: int | None = None
        self._last_epoch: int | None = None

    def on_train_begin(self, logs: dict[str, Any]) -> None:
        self._reset()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> bool:
        if self.monitor not in logs:
            raise ValueError(f"EarlyStopping: no {self.monitor!r} in the epoch logs {sorted(logs)}")
        self._last_epoch = epoch
        value = float(logs[self.monitor])
        better = (value < self.best - self.min_delta if self.mode == "min"
                  else value > self.best + self.min_delta)
        if better:
            self.best, self.best_epoch, self.wait = value, epoch, 0
            if self.restore_best_weights:
                if self.session is None:
                    raise ValueError("EarlyStopping(restore_best_weights=True) needs the session; "
                                     "pass it in fit(callbacks=[...])")
                # The whole state and the position (the loop has set it to the
                # end of this epoch): one moment, restored together.
                self.best_state = dict(self.session.state.items())
                position = getattr(self.session, "fit_position", None)
                self.best_position = dict(position) if position is not None else None
            return False
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            if self.verbose:
                print(f"EarlyStopping: stopped at epoch {epoch + 1}: {self.monitor} has not "
                      f"improved for {self.wait} epoch(s) (best {self.best:.4g} at epoch "
                      f"{(self.best_epoch or 0) + 1})", flush=True)
            return True
        return False

    def on_train_end(self, logs: dict[str, Any]) -> None:
        if not (self.restore_best_weights and self.best_state is not None
                and self.session is not None):
            return
        if self.best_epoch == self._last_epoch:
            return  # the state is the best epoch's already
        self.session.load_state(self.best_state)
        if hasattr(self.session, "fit_position"):
            self.session.fit_position = (dict(self.best_position)
                                         if self.best_position is not None else None)
        self.restored_epoch = self.best_epoch
        if self.verbose:
            print(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.",
                  flush=True)


class TerminateOnNaN(Callback):
    """Stop training cleanly at the first NaN or infinite batch loss.

    Without it, ``fit`` raises ``NonFiniteLossError`` at such a loss (the
    library default); with it, ``fit`` returns its History (``stopped_early``)
    and ``self.terminated`` holds ``(epoch, batch, step, loss)``.  The CLI
    adds it by default and reports the step in one line."""

    def __init__(self) -> None:
        self.terminated: tuple[int, int, int, float] | None = None

    def on_train_begin(self, logs: dict[str, Any]) -> None:
        self.terminated = None

    def on_batch_end(self, batch: int, logs: dict[str, Any]) -> bool:
        loss = logs.get("loss")
        if loss is not None and not math.isfinite(loss):
            self.terminated = (int(logs.get("epoch", 0)), batch, int(logs.get("step", 0)), float(loss))
            return True
        return False


class CSVLogger(Callback):
    """Write one CSV row per epoch: ``epoch`` (1-based) and every logged value.

    ``append=True`` adds to an existing file (for a resumed run) instead of
    replacing it.  Values missing in an epoch are left empty."""

    def __init__(self, path: str | os.PathLike, separator: str = ",", append: bool = False) -> None:
        self.path, self.separator, self.append = Path(path), separator, append
        self._keys: list[str] | None = None

    def output_paths(self) -> list[Path]:
        return [self.path]

    def on_train_begin(self, logs: dict[str, Any]) -> None:
        self._keys = None
        if self.append and self.path.exists() and self.path.stat().st_size:
            with open(self.path, newline="") as f:
                header = next(csv.reader(f, delimiter=self.separator), None)
            self._keys = header[1:] if header else None
        elif not self.append:
            self.path.write_text("")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        values = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
        with open(self.path, "a", newline="") as f:
            writer = csv.writer(f, delimiter=self.separator)
            if self._keys is None:
                self._keys = list(values)
                writer.writerow(["epoch", *self._keys])
            writer.writerow([epoch + 1, *("" if values.get(k) is None else repr(float(values[k]))
                                         for k in self._keys)])


class ModelCheckpoint(Callback):
    """Write a complete training checkpoint after epochs (Keras ``ModelCheckpoint``).

    ``filepath`` may hold ``{epoch}`` (1-based) and any logged value, e.g.
    ``"ckpt-{epoch:02d}-{val_loss:.3f}.onnx"``.  ``monitor`` with
    ``save_best_only=True``: write only when ``monitor`` improved (``mode``
    as in EarlyStopping).  The file is the training model with its state and
    the fit position, so ``TrainingSession(path).fit(...)`` resumes it.
    ``every``: every n-th epoch.  Files written are listed in ``written``.

    It overwrites ``filepath`` when it exists, an earlier run's checkpoint
    included, as Keras's does (a path that is not a regular file is refused
    before the first step).  ``onnxtrain train --checkpoint CK`` refuses an existing
    ``CK`` instead: ``--resume CK`` goes on from it, ``--overwrite`` starts
    again over it."""

    def __init__(self, filepath: str | os.PathLike, monitor: str | None = None,
                 save_best_only: bool = False, mode: str = "auto", every: int = 1) -> None:
        if save_best_only and monitor is None:
            raise ValueError("ModelCheckpoint: save_best_only=True needs a monitor, e.g. 'val_loss'")
        if int(every) < 1:
            raise ValueError(f"ModelCheckpoint: every must be >= 1, got {every!r}")
        if mode == "auto":
            mode = "max" if monitor and any(k in monitor for k in ("acc", "auc")) else "min"
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint: mode must be 'min', 'max' or 'auto', got {mode!r}")
        self.filepath, self.monitor, self.save_best_only = str(filepath), monitor, save_best_only
        self.mode, self.every = mode, int(every)
        self.best = math.inf if mode == "min" else -math.inf
        self.written: list[Path] = []

    def output_paths(self) -> list[Path]:
        return [Path(re.sub(r"\{[^}]*\}", "0", self.filepath))]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        if (epoch + 1) % self.every:
            return
        if self.monitor is not None:
            if self.monitor not in logs:
                raise ValueError(f"ModelCheckpoint: no {self.monitor!r} in the epoch logs {sorted(logs)}")
            value = float(logs[self.monitor])
            better = value < self.best if self.mode == "min" else value > self.best
            if better:
                self.best = value
            elif self.save_best_only:
                return
        if self.session is None:
            raise ValueError("ModelCheckpoint needs the session; pass it in fit(callbacks=[...])")
        path = self.filepath.format(epoch=epoch + 1, **logs) if "{" in self.filepath else self.filepath
        self.written.append(Path(self.session.export(path, training=True)))


class Checkpoint(ModelCheckpoint):
    """``ModelCheckpoint`` bound to a session up front (the older spelling):
    ``Checkpoint(sess, path, every=1)`` writes the checkpoint every ``every`` epochs."""

    def __init__(self, sess: Any, path: str | os.PathLike, every: int = 1) -> None:
        super().__init__(path, every=every)
        self.session = sess
        self.path = Path(path)

    def set_session(self, sess: Any) -> None:
        if sess is not self.session:
            raise ValueError("Checkpoint: it was made for another session")


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

        Losses go on the left y axis, metrics (accuracy, ...) on a second y
        axis on the right (``ax.twinx()``), so that a loss falling near 0 and an
        accuracy near 1 both stay readable; each axis names what it shows.  The
        legend sits above the plot, where it covers no curve.
        Returns the matplotlib Axes of the losses (the first one).  matplotlib is an optional extra:
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
        # Losses and metrics have their own scales: losses on ``ax`` (left),
        # the metrics on a second y axis sharing the epochs (right), each labelled.
        losses = [k for k in names if "loss" in k]
        metrics = [k for k in names if "loss" not in k]
        groups = [(ax, losses or metrics)]
        if losses and metrics:
            groups.append((ax.twinx(), metrics))
        handles = []
        for axes, group in groups:
            for name in group:
                style = "--" if name.startswith("val_") else "-"
                color = f"C{names.index(name)}"
                handles += axes.plot(x, self.history[name], style, marker="o", markersize=3,
                                     label=name, color=color)
            bases = sorted({k.removeprefix("val_") for k in group})
            axes.set_ylabel(bases[0] if len(bases) == 1 else ", ".join(bases))
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        # Above the plot, in one row: placed inside, matplotlib's "best" spot avoids
        # only the left axis' curves and covered the metrics of the right one.
        ax.legend(handles=handles, labels=[h.get_label() for h in handles], loc="lower center",
                  bbox_to_anchor=(0.5, 1.0), ncol=min(len(handles), 4), frameon=False,
                  borderaxespad=0.2)
        ax.grid(alpha=0.3)
        return ax


# --------------------------------------------------------------- checkpoints
def write_checkpoint(sess: Any, path: str | os.PathLike, epochs_done: int) -> Path:
    """Export the training model with its fit position at ``epochs_done`` finished
    epochs (``export(training=True)``: streamed, external data as the model had it)."""
    position = dict(sess.fit_position or {})
    if position.get("epoch") != int(epochs_done):
        position = {"epoch": int(epochs_done)}
    saved = sess.fit_position
    sess.fit_position = position
    try:
        return sess.export(path, training=True)
    finally:
        sess.fit_position = saved
