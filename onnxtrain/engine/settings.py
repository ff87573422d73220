"""Hyperparameters the builder keeps as state: ``learning_rate`` and
``clip_grad_norm`` read and set through their state variables."""

from __future__ import annotations

import math

import numpy as np

from ..errors import TrainingModelError


class SettingsMixin:
    """``TrainingSession``'s settings (see ``session.py`` for the attributes)."""

    # ------------------------------------------------------------- learning rate
    def _setting_state(self, key: str, what: str) -> str:
        """The state variable that metadata ``onnxtrain.<key>`` names (a
        setting the builder keeps as state), or a TrainingModelError."""
        info = self._metadata.get(key)
        name = info.get("state") if isinstance(info, dict) else None
        if not name or name not in self._model.state:
            raise TrainingModelError(
                f"{key}: the model has no {what} state variable (only models made by "
                f"onnxtrain.build record one, in metadata onnxtrain.{key}"
                + ("; build with clip_grad_norm=... to clip" if key == "clip_grad_norm" else
                   "; rebuild older ones with onnxtrain.build.training_model") + ")"
            )
        return name

    def _set_setting(self, key: str, what: str, value: float, positive: bool) -> None:
        name = self._setting_state(key, what)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise TypeError(f"{key} must be a number, got {type(value).__name__}")
        bad = float(value) <= 0 if positive else float(value) < 0
        if not math.isfinite(float(value)) or bad:
            raise ValueError(f"{key} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
        self.load_state({name: np.asarray(float(value), dtype=self._model.state[name].dtype)})

    def _lr_state(self) -> str:
        return self._setting_state("learning_rate", "learning-rate")

    @property
    def learning_rate(self) -> float:
        """The base learning rate (a schedule scales it), read from its state variable.

        Setting it changes the next step and every later one, nothing is
        rebuilt; the value is state, so it is saved in a checkpoint and
        ``initialize()`` resets it to the rate the model was built with."""
        return float(self.state[self._lr_state()])

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self._set_setting("learning_rate", "learning-rate", value, positive=False)

    @property
    def clip_grad_norm(self) -> float:
        """The global-norm clipping threshold of a model built with
        ``clip_grad_norm=c``, read from its state variable; setting it works
        like ``learning_rate`` (the next step, nothing rebuilt, checkpointed,
        reset by ``initialize()``)."""
        return float(self.state[self._setting_state("clip_grad_norm", "clipping-threshold")])

    @clip_grad_norm.setter
    def clip_grad_norm(self, value: float) -> None:
        self._set_setting("clip_grad_norm", "clipping-threshold", value, positive=True)
