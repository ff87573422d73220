"""Gradient rules, grouped by kind of op.  Importing this package registers them all."""

from . import (
    activation,
    control,
    conv,
    elementwise,
    linalg,
    losses,
    ml,
    norm,
    pool,
    quant,
    recurrent,
    reduce,
    resample,
    sequence,
    shape,
    spectral,
    zero,
)
