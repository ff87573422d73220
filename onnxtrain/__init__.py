"""onnxtrain: run ONNX training models end to end on onnxruntime.

>>> import onnxtrain
>>> {'TrainingSession', 'EarlyStopping', 'checkpoint_epoch'} <= set(onnxtrain.__all__)
True
"""

# isort: off
# First: in the command line, Ctrl-C during the imports below is one line, exit 130.
from . import startup  # noqa: F401  (it installs that on import)
# isort: on
from . import build, bundle
from ._version import __version__ as __version__
from .errors import ExecutionError, GradientError, TrainingModelError
from .io.metadata import checkpoint_epoch
from .session import TrainingSession
from .train.callbacks import (
    Callback,
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    History,
    ModelCheckpoint,
    StopTraining,
    TerminateOnNaN,
)
from .train.datasets import train_test_split
from .train.loop import NonFiniteLossError

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
    "bundle",
    "checkpoint_epoch",
    "train_test_split",
]
