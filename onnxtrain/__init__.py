"""onnxtrain: run ONNX training models end to end on onnxruntime.

>>> import onnxtrain
>>> sorted(onnxtrain.__all__)[:2]
['GradientError', 'TrainingModelError']
"""

from . import build
from .errors import GradientError, TrainingModelError
from .fit import Callback, Checkpoint, EarlyStopping, History, StopTraining
from .session import TrainingSession

__all__ = [
    "Callback",
    "Checkpoint",
    "EarlyStopping",
    "GradientError",
    "History",
    "StopTraining",
    "TrainingModelError",
    "TrainingSession",
    "build",
]
__version__ = "0.1.0"
