"""Optimizers of the ``ai.onnx.preview.training`` domain: Adam, Momentum, Adagrad.

``lower_optimizers`` rewrites them into standard ONNX ops that onnxruntime can
run; ``reference`` holds the numpy functions the lowerings are tested against.
"""

from . import reference
from .common import SIGNATURES, OptimizerCall, Signature, split_node
from .lower import MIN_OPSET, is_optimizer, lower_optimizers

__all__ = [
    "MIN_OPSET",
    "SIGNATURES",
    "OptimizerCall",
    "Signature",
    "is_optimizer",
    "lower_optimizers",
    "reference",
    "split_node",
]
