"""Gradient rules: shape."""

from __future__ import annotations

from ..registry import no_grad, vjp  # noqa: F401
