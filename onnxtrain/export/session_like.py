"""``SessionLike``: what every way out of onnxtrain takes from a session.

A ``TrainingSession`` is one; so is anything with its three attributes, which
lets an exporter work without the session (and below it in the layers).

>>> import onnx
>>> class Frozen:
...     model = onnx.ModelProto()
...     state = {}
...     fit_position = None
>>> isinstance(Frozen(), SessionLike), isinstance(onnx.ModelProto(), SessionLike)
(True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import onnx


@runtime_checkable
class SessionLike(Protocol):
    """A training model with its current state and where its fit loop stands.

    ``model``: the training model as loaded (initializers hold the initial
    values); ``state``: every state variable's current value, by name;
    ``fit_position``: ``{"epoch", "batch", "step", ...}`` or None."""

    @property
    def model(self) -> onnx.ModelProto: ...

    @property
    def state(self) -> Mapping[str, np.ndarray]: ...

    @property
    def fit_position(self) -> Mapping[str, Any] | None: ...
