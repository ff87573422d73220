"""Build standard ONNX training models from inference models.

The public face of ``onnxtrain.builder``: what the README and the docs call
``build``.

>>> from onnxtrain import TrainingSession, build
>>> from onnxtrain.demo import build_classifier
>>> model = TrainingSession(build_classifier()).to_model()   # an inference model: X -> logits
>>> tm = build.training_model(model, loss="cross_entropy", optimizer=build.AdamW(lr=1e-3))
>>> [i.name for i in tm.graph.input], len(tm.training_info)
(['X'], 1)

``model`` may be a path, bytes or a ModelProto.

See ``builder.builder.training_model`` for the arguments, ``losses``,
``optimizers`` and ``schedules`` for the math of each part, ``lora`` for the
adapters and their files (``onnxtrain.lora``: ``builder.lora`` and
``export.adapters``).
"""

from collections.abc import Mapping
from typing import Any

from . import lora
from .builder import (
    L1,
    MSE,
    NLL,
    SGD,
    Adagrad,
    Adam,
    AdamW,
    BCEWithLogits,
    CrossEntropy,
    CustomLoss,
    Huber,
    LoRA,
    Loss,
    Optimizer,
    ParameterChoice,
    Schedule,
    cosine,
    held_training_model,
    linear_warmup,
    losses,
    optimizers,
    parameter_choices,
    parameters,
    schedules,
    step_decay,
    training_model,
)
from .builder.cache import describe_option
from .io.model import Checked, ModelLike
from .lora import export_requantized
from .runtime.firstrun import expected, wanted
from .session import TrainingSession

__all__ = [
    "training_model", "training_session", "parameter_choices", "ParameterChoice", "LoRA", "export_requantized",
    "Loss", "MSE", "L1", "Huber", "CrossEntropy", "BCEWithLogits", "NLL", "CustomLoss",
    "Optimizer", "SGD", "Adagrad", "Adam", "AdamW",
    "Schedule", "cosine", "step_decay", "linear_warmup",
    "lora", "losses", "optimizers", "parameters", "schedules",
]


def training_session(model: ModelLike, session: Mapping[str, Any] | None = None,
                     **options: Any) -> TrainingSession:
    """``TrainingSession(training_model(model, **options), **session)``, which
    starts sooner when the startup cache has the built model: its weights go
    from ``model`` straight to the files the session maps (its starting values
    and frozen weights, as ``TrainingSession`` would hold them), without two
    copies into the built model's protobuf and two out of it, and the session
    does not check the builder's model again as it would a file; the
    memory its first run will take is faulted in on another core from the
    start, while the model is built (docs/startup.md).

    ``session``: ``TrainingSession``'s keyword arguments (``providers``,
    ``memory``, ``comm``, ...).  The built model is the session's
    (``sess.model``); export it with ``sess.export`` or ``sess.to_model``.

    >>> import numpy as np
    >>> from onnxtrain.demo import build_classifier
    >>> model = TrainingSession(build_classifier()).to_model()
    >>> sess = training_session(model, loss="cross_entropy", target="label",
    ...                         optimizer=AdamW(lr=1e-3), session={"memory": "lean"})
    >>> x = np.random.default_rng(0).random((8, 64), np.float32)
    >>> sess.train_step({"X": x, "label": np.arange(8)})["loss"].shape
    ()
    """
    kwargs = dict(session or {})
    # The first run's memory is faulted in while the model is built (``runtime.firstrun``),
    # where the session will use the shared arena (memory="lean" runs the data-parallel cut)
    # and the options have a description (not a callable: no record would be found again).
    descriptions = {k: describe_option(v) for k, v in sorted(options.items())}
    described = "\n".join(f"{k}={d}" for k, d in descriptions.items())
    on = None not in descriptions.values() and wanted(
        kwargs.get("providers"), kwargs.get("session_options"),
        kwargs.get("comm") is not None or kwargs.get("memory") == "lean")
    with expected(model, described, on):
        # (the builder's model: made from one load() checked, or from an entry of one)
        return TrainingSession(Checked(held_training_model(model, **options)), **kwargs)
