"""Automatic differentiation: expands Gradient nodes into standard ONNX ops."""

from .expand import expand_gradients, is_gradient
from .registry import REGISTRY, VJPContext, no_grad, refuse, vjp

__all__ = ["REGISTRY", "VJPContext", "expand_gradients", "is_gradient", "no_grad", "refuse", "vjp"]
