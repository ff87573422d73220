"""Gradient rules, grouped by kind of op.  Importing this package registers them all."""

from . import (  # noqa: F401
    activation,
    contrib_attention,
    contrib_norm,
    contrib_quant,
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
