"""Gradient rules, grouped by kind of op.  Importing this package registers them all."""

from . import (  # noqa: F401
    control,
    elementwise,
    linalg,
    losses,
    ml,
    nn,
    quant,
    recurrent,
    sequence,
    reduce,
    shape,
    spectral,
    zero,
)
