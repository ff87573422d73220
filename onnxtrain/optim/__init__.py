"""Update rules, each written once, and the spec's optimizer ops.

``rules``: what an update rule is, how it is applied (``apply``) and found
again by name (``find_calls``); ``updates``: onnxtrain's rules (SGD, Adam,
the spec's Adam, Momentum and Adagrad, ...); ``transforms``: the gradient
transforms every front-end shares (global-norm clipping, L2 weight decay).

``lower_optimizers`` rewrites the ``ai.onnx.preview.training`` ops Adam,
Momentum and Adagrad into calls of the rules (standard ONNX ops that
onnxruntime can run); ``reference`` holds the numpy functions the lowerings
are tested against.
"""

from . import reference, rules, transforms, updates
from .common import SIGNATURES, OptimizerCall, Signature, split_node
from .rules import RULES, FusedKernel, UpdateRule, apply, find_calls, update_rule
from .spec_ops import MIN_OPSET, is_optimizer, lower_optimizers

__all__ = [
    "MIN_OPSET",
    "RULES",
    "SIGNATURES",
    "FusedKernel",
    "OptimizerCall",
    "Signature",
    "UpdateRule",
    "apply",
    "find_calls",
    "is_optimizer",
    "lower_optimizers",
    "reference",
    "rules",
    "split_node",
    "transforms",
    "update_rule",
    "updates",
]
