"""The portable training bundle: a folder any ONNX runtime can train from
(docs/bundle.md, format version 1).

``save`` writes one from a session (its current state and fit position) or
from a training model; the JavaScript package ``onnxtrain`` (``js/``) trains
it on onnxruntime-node or onnxruntime-web; ``load`` makes a session of it
again, whatever trained it.  Its ``inference.onnx`` runs in a plain
``onnxruntime.InferenceSession`` with the bundle's weights.

>>> import os, tempfile
>>> from onnxtrain import TrainingSession, bundle
>>> from onnxtrain.datasets import load_digits
>>> from onnxtrain.demo import build_classifier
>>> X, y = load_digits()
>>> tmp = tempfile.TemporaryDirectory()
>>> folder = bundle.save(TrainingSession(build_classifier()), os.path.join(tmp.name, "digits.bundle"))
>>> sess = bundle.load(folder)
>>> history = sess.fit(X, y, epochs=1, progress=False)
>>> len(history["loss"])
1
>>> tmp.cleanup()

The same from the command line: ``onnxtrain bundle MODEL -o FOLDER``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import BundleError, BundleFileMissing, OutputExists
from .export import SessionLike
from .export.bundle import write
from .export.bundle_format import FORMAT, VERSION
from .export.bundle_read import Bundle, read
from .io.model import ModelLike
from .session import TrainingSession

__all__ = ["save", "load", "read", "Bundle", "BundleError", "BundleFileMissing", "OutputExists", "FORMAT",
           "VERSION"]


def save(source: SessionLike | ModelLike, folder: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the bundle of ``source`` to ``folder``; returns the folder's path.

    ``source``: a ``TrainingSession`` (its current state and ``fit_position``)
    or a training model (a path, bytes or ModelProto; its state is its
    initializers' values, its fit position the one a checkpoint records).
    The folder is written whole or not at all: built beside ``folder``,
    then renamed into place.  An existing non-empty folder is refused unless
    ``overwrite=True`` (then replaced); a file or link there always is
    (OutputExists, both a FileExistsError and a ValueError; nothing changed).  A model whose programs need an op
    outside the standard ONNX domains is refused (BundleError naming it)."""
    return write(source, folder, overwrite=overwrite)


def load(folder: str | os.PathLike, **session_options: Any) -> TrainingSession:
    """The ``TrainingSession`` of the bundle in ``folder``, its state the
    bundle's ``state.bin`` (whatever wrote it) and its ``fit_position`` the
    manifest's; ready to ``train_step``, ``fit``, ``run`` and ``export``.

    ``session_options`` go to ``TrainingSession`` (``providers=``,
    ``fused_kernels=``, ...).  A bundle of an unknown version, with a
    missing file or a state.bin that does not fit its manifest is refused
    (BundleError naming the version, file or variable).  The session reads
    no file of the folder afterwards: the folder may be replaced."""
    bundle = read(folder)
    sess = TrainingSession(bundle.model, **session_options)
    sess.fit_position = bundle.fit_position
    return sess
