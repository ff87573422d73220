"""onnxtrain's on/off environment variables (``ONNXTRAIN_SPINNING``,
``ONNXTRAIN_SPECIALIZE``, ``ONNXTRAIN_PREFAULT``), read one way."""

from __future__ import annotations

import os


def env_switch(name: str, usage: str) -> bool | None:
    """An on/off environment variable: True (1, true, on, yes), False (0,
    false, off, no), None where unset or empty; a ValueError naming it and
    ``usage`` for anything else."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}={value!r}: {usage}")
