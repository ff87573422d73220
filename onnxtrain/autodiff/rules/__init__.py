"""Gradient rules, grouped by kind of op.  Importing this package registers them all."""

from . import elementwise, linalg, losses, nn, reduce, shape, zero  # noqa: F401
