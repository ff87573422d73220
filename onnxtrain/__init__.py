"""onnxtrain: run ONNX training models end to end on onnxruntime."""

from .errors import GradientError, TrainingModelError

__all__ = ["GradientError", "TrainingModelError"]
__version__ = "0.1.0"
