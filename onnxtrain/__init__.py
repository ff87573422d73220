"""onnxtrain: run ONNX training models end to end on onnxruntime.

>>> import onnxtrain
>>> sorted(onnxtrain.__all__)[:2]
['GradientError', 'TrainingModelError']
"""

from .errors import GradientError, TrainingModelError
from .session import TrainingSession
from . import build

__all__ = ["GradientError", "TrainingModelError", "TrainingSession", "build"]
__version__ = "0.1.0"
