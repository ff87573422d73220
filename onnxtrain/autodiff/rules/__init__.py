"""Gradient rules, grouped by kind of op.  Importing this package registers them all."""

from . import control, elementwise, linalg, losses, nn, recurrent, reduce, shape, zero  # noqa: F401
