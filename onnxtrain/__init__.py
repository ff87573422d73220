"""onnxtrain: run ONNX training models end to end on onnxruntime.

>>> import onnxtrain
>>> {'TrainingSession', 'EarlyStopping', 'checkpoint_epoch'} <= set(onnxtrain.__all__)
True
"""

# First: in the command line, Ctrl-C during the imports below is one line, exit 130.
from . import startup  # noqa: F401  (it installs that on import)
from . import build
from .callbacks import (
    Callback,
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    History,
    ModelCheckpoint,
    StopTraining,
    TerminateOnNaN,
)
from .datasets import train_test_split
from .errors import ExecutionError, GradientError, TrainingModelError
from .fit import NonFiniteLossError
from .metadata import checkpoint_epoch
from .session import TrainingSession

__all__ = [
    "CSVLogger",
    "Callback",
    "Checkpoint",
    "EarlyStopping",
    "ExecutionError",
    "GradientError",
    "History",
    "ModelCheckpoint",
    "NonFiniteLossError",
    "StopTraining",
    "TerminateOnNaN",
    "TrainingModelError",
    "TrainingSession",
    "build",
    "checkpoint_epoch",
    "train_test_split",
]
__version__ = "0.1.0"
