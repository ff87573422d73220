"""The checks a step runs before it commits: no NaN or Inf into state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..lower.programs import Program
from ..runtime.executor import as_numpy


def check_finite_arrays(label: str, arrays: Mapping[str, np.ndarray], what: str) -> None:
    """Refuse non-finite ``what`` (numpy arrays) before they reach the state."""
    bad = [k for k, a in arrays.items() if a.dtype.kind in "fc" and not np.isfinite(a).all()]
    if bad:
        raise FloatingPointError(f"{label}: non-finite {what} {bad}; nothing was committed")


def check_finite(program: Program, targets: Mapping[str, Any], field: str) -> None:
    """Refuse to commit NaN or Inf into state (check_finite=True)."""
    bad = []
    for key, value in targets.items():
        arr = as_numpy(value)
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            bad.append(key)
    if bad:
        raise FloatingPointError(
            f"{program.label}: the step would write non-finite values into state "
            f"variable(s) {bad}; nothing was committed"
        )
