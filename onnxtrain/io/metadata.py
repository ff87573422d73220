"""The metadata contract: the ``onnxtrain.*`` entries of ``model.metadata_props``.

``onnxtrain.build`` writes them (JSON values), the fit loop, the session and
the summaries read them, and ``export(training=True)`` writes the fit
position back.  This module is the one reader and the one writer:

=========================== =========================================== ==============================
key                         meaning                                     inferred without metadata
=========================== =========================================== ==============================
onnxtrain.inputs            main-graph data inputs, in order            the main graph's inputs
onnxtrain.target            the target feed (the algorithm's extra      the one algorithm input the
                            input)                                      main graph does not have
onnxtrain.loss              the loss output                             'loss', else the one scalar
                                                                        algorithm-only output
onnxtrain.prediction        the main-graph output metrics read          the first main-graph output
onnxtrain.task              "classification" or "regression"            integer target: classification
onnxtrain.cycle             algorithm index per batch, repeated         one spec iteration per batch
                            ([0, 0, 1]: accumulate over 3 batches)      (every algorithm in order)
onnxtrain.classes           {"count": C, "axis": 1|-1, "ignore_index"}  no label range check
                            for class-index losses (label check)
onnxtrain.learning_rate     {"state": name, "base": lr}: the base       no ``sess.learning_rate``
                            learning rate's state variable
onnxtrain.checkpoint        the fit position {"epoch", "batch",         start at epoch 0
                            "step"} (written by export(training=True))
onnxtrain.export_outputs    the main-graph outputs an inference export  every main-graph output
                            keeps (``import_ort``: the prediction, not
                            the loss; ``export(outputs=...)`` overrides)
=========================== =========================================== ==============================

The builder also records ``trainable``, ``optimizer_state``,
``train_prediction`` (per algorithm, the training-mode copy's prediction),
``clip_grad_norm``, ``schedule`` (``{"spec": "cosine:1000", "algorithm": i}``, plus
``"state"``: the variable holding the run's total for ``cosine()``), ``lora``,
``batchnorm_var``, ``recompute`` (the activation recompute a session applies,
``onnxtrain.lower.recompute``), ``source`` (kept by checkpoints, dropped from inference exports: the absolute path of the
file the model was built from, when it was given as a path) and, with ``accumulate=k``,
``data_parallel`` (``{"local": [gradient sums], "reduce": {algorithm: [values]}}``:
what a data-parallel session keeps per rank and reduces instead of the
gradients, ``onnxtrain.lower.split``).  An ML model's adaptation records
``logits_of`` (each probability output's logits output,
``onnxtrain.builder.adapt``).

>>> m = onnx.ModelProto()
>>> set_metadata(m, "target", "label")
>>> write_position(m, {"epoch": 3, "batch": 2})
>>> model_metadata(m)
{'target': 'label', 'checkpoint': {'epoch': 3, 'batch': 2}}
>>> read_position(m)["epoch"], checkpoint_epoch(m)
(3, 3)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx

from ..errors import TrainingModelError

__all__ = [
    "CHECKPOINT_KEY",
    "KEYS",
    "PREFIX",
    "RECOMPUTE_MODES",
    "checkpoint_epoch",
    "model_metadata",
    "read_position",
    "drop_metadata",
    "recompute_option",
    "recompute_spec",
    "replace_metadata",
    "set_metadata",
    "write_position",
]

#: Prefix of every metadata_props key onnxtrain reads or writes.
PREFIX = "onnxtrain."
#: Where the fit loop stood when a checkpoint was written.
CHECKPOINT_KEY = PREFIX + "checkpoint"
#: Every key of the contract (``PREFIX`` dropped): the table above, then what the builder records.
KEYS = frozenset({
    "inputs", "target", "loss", "prediction", "task", "cycle", "classes", "learning_rate", "checkpoint",
    "export_outputs", "trainable", "optimizer_state", "train_prediction", "clip_grad_norm", "schedule",
    "lora", "batchnorm_var", "source", "data_parallel", "recompute", "logits_of",
})


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


def _rewrite(model: onnx.ModelProto, drop: Callable[[str], bool], entries: Mapping[str, Any]) -> None:
    """The one writer: remove the entries whose key ``drop`` selects, keep the
    others in order, then append ``onnxtrain.<key>`` = JSON(value) for ``entries``."""
    kept = [(e.key, e.value) for e in model.metadata_props if not drop(e.key)]
    del model.metadata_props[:]
    for k, v in kept:
        model.metadata_props.add(key=k, value=v)
    for key, value in entries.items():
        model.metadata_props.add(key=PREFIX + key, value=json.dumps(value))


def set_metadata(model: onnx.ModelProto, key: str, value: Any) -> None:
    """Set ``onnxtrain.<key>`` in ``model.metadata_props`` to ``value`` as JSON (replacing it)."""
    full = PREFIX + key
    _rewrite(model, lambda k: k == full, {key: value})


def drop_metadata(model: onnx.ModelProto, key: str) -> None:
    """Remove ``onnxtrain.<key>`` from ``model.metadata_props`` (if present)."""
    full = PREFIX + key
    _rewrite(model, lambda k: k == full, {})


def replace_metadata(model: onnx.ModelProto, entries: Mapping[str, Any]) -> None:
    """Replace every ``onnxtrain.*`` entry by ``entries`` (the builder's record);
    other metadata stays as it was."""
    _rewrite(model, lambda k: k.startswith(PREFIX), entries)


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
        _rewrite(model, lambda k: k == CHECKPOINT_KEY, {})
        return
    value = {"epoch": int(position.get("epoch", 0))}
    if position.get("batch"):
        value["batch"] = int(position["batch"])
    if position.get("step") is not None:
        value["step"] = int(position["step"])
    set_metadata(model, "checkpoint", value)


def checkpoint_epoch(model: Any) -> int:
    """How many epochs a checkpoint had finished (0 if it records none).

    ``model`` is a TrainingSession (anything with a ``model`` ModelProto), a
    ModelProto or a path."""
    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(str(model), load_external_data=False)
    proto = model if isinstance(model, onnx.ModelProto) else model.model
    position = read_position(proto)
    return 0 if position is None else position["epoch"]


# ------------------------------------------------------------------ recompute
#: The named modes of the activation recompute option (``onnxtrain.recompute``:
#: the builder records it, ``lower.recompute`` applies it).
RECOMPUTE_MODES = ("elementwise", "blocks")


def _bad_recompute(value: Any) -> ValueError:
    return ValueError(
        "recompute must be None, False, 'elementwise', 'blocks', a number of segments >= 1 "
        f"or a list of checkpoint value names, not {value!r}"
    )


def recompute_option(value: Any) -> Any:
    """The recompute option (``build.training_model(..., recompute=...)``) as
    recorded in metadata (JSON), or None when off; ValueError naming
    ``recompute`` for anything else.

    >>> recompute_option("blocks"), recompute_option(3), recompute_option(["h1", "h2"])
    ('blocks', {'segments': 3}, {'checkpoints': ['h1', 'h2']})
    >>> recompute_option(None), recompute_option(True)
    (None, 'blocks')
    >>> recompute_option("sometimes")
    Traceback (most recent call last):
    ValueError: recompute must be None, False, 'elementwise', 'blocks', a number of segments >= 1 or a list of checkpoint value names, not 'sometimes'
    """
    if value is None or value is False:
        return None
    if value is True:
        return "blocks"
    if isinstance(value, str):
        if value in RECOMPUTE_MODES:
            return value
        raise _bad_recompute(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"recompute: a number of segments must be >= 1, got {value!r}")
        return {"segments": int(value)}
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(v, str) and v for v in value):
            raise ValueError(
                f"recompute: checkpoints must be a non-empty list of value names, got {value!r}")
        if len(set(value)) != len(value):
            raise ValueError(f"recompute: checkpoint names repeat in {list(value)!r}")
        return {"checkpoints": list(value)}
    raise _bad_recompute(value)


def recompute_spec(model: onnx.ModelProto) -> Any:
    """The recompute option a model's metadata records (``recompute_option``'s
    form; None: off), or TrainingModelError naming the entry."""
    value = model_metadata(model).get("recompute")
    if isinstance(value, dict) and len(value) == 1:
        value = value.get("segments", value.get("checkpoints", value))
    try:
        return recompute_option(value)
    except ValueError as exc:
        raise TrainingModelError(f"metadata onnxtrain.recompute: {exc}") from None
