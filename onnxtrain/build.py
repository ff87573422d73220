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
    linear_warmup,
    losses,
    optimizers,
    parameter_choices,
    parameters,
    schedules,
    step_decay,
    training_model,
)
from .lora import export_requantized

__all__ = [
    "training_model", "parameter_choices", "ParameterChoice", "LoRA", "export_requantized",
    "Loss", "MSE", "L1", "Huber", "CrossEntropy", "BCEWithLogits", "NLL", "CustomLoss",
    "Optimizer", "SGD", "Adagrad", "Adam", "AdamW",
    "Schedule", "cosine", "step_decay", "linear_warmup",
    "lora", "losses", "optimizers", "parameters", "schedules",
]
