"""Build standard ONNX training models from inference models.

Public as ``onnxtrain.build``, whose docstring has the example.  See
``builder.training_model`` for the arguments, ``losses``, ``optimizers`` and
``schedules`` for the math of each part.
"""

from .builder import held_training_model, training_model
from .lora import LoRA
from .losses import L1, MSE, NLL, BCEWithLogits, CrossEntropy, CustomLoss, Huber, Loss
from .optimizers import SGD, Adagrad, Adam, AdamW, Optimizer
from .parameters import ParameterChoice, parameter_choices
from .schedules import Schedule, cosine, linear_warmup, step_decay

__all__ = [
    "training_model", "held_training_model", "parameter_choices", "ParameterChoice", "LoRA",
    "Loss", "MSE", "L1", "Huber", "CrossEntropy", "BCEWithLogits", "NLL", "CustomLoss",
    "Optimizer", "SGD", "Adagrad", "Adam", "AdamW",
    "Schedule", "cosine", "step_decay", "linear_warmup",
]
