"""Hyperparameters the builder keeps as state: ``learning_rate``,
``clip_grad_norm`` and a schedule's run total (``schedule``), read from
their state variables, and the rate the next
step uses (``current_learning_rate``).

A model made by ``onnxtrain.build`` names each such variable in its metadata
(``onnxtrain.learning_rate``, ``onnxtrain.clip_grad_norm``).  ``Settings``
reads them from the state store and checks a new value; the session writes it
with its own ``load_state`` (so a data-parallel session sets it on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from ..core.graph import node_inputs, prune
from ..errors import TrainingModelError
from ..io.model import TrainingModel
from .executor import Executor
from .state import StateStore

#: Each setting: what the message calls its state variable, and whether 0 is refused.
SETTINGS = {"learning_rate": ("learning-rate", False), "clip_grad_norm": ("clipping-threshold", True),
            "schedule": ("schedule-total", True)}


class Settings:
    """The settings of one model over its state store (see the module docstring)."""

    def __init__(self, model: TrainingModel, metadata: Mapping[str, Any], store: StateStore) -> None:
        self.model = model
        self.metadata = metadata
        self.store = store
        #: current_learning_rate's executor and its inputs, built on first use.
        self._rate: tuple[Executor, list[str]] | None = None

    def state_name(self, key: str) -> str:
        """The state variable that metadata ``onnxtrain.<key>`` names, or a TrainingModelError."""
        info = self.metadata.get(key)
        name = info.get("state") if isinstance(info, dict) else None
        if not name or name not in self.model.state:
            raise TrainingModelError(
                f"{key}: the model has no {SETTINGS[key][0]} state variable (only models made by "
                f"onnxtrain.build record one, in metadata onnxtrain.{key}"
                + ("; build with clip_grad_norm=... to clip" if key == "clip_grad_norm" else
                   "; only build.cosine() without a total has one" if key == "schedule" else
                   "; rebuild older ones with onnxtrain.build.training_model") + ")"
            )
        return name

    def value(self, key: str) -> float:
        """The setting's current value."""
        name = self.state_name(key)
        return float(self.store.to_numpy([name])[name])

    def staged(self, key: str, value: float) -> dict[str, np.ndarray]:
        """``{state variable: value}`` for ``load_state``, once ``value`` is a
        finite number in range (> 0 for clip_grad_norm, >= 0 for learning_rate)."""
        name = self.state_name(key)
        positive = SETTINGS[key][1]
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise TypeError(f"{key} must be a number, got {type(value).__name__}")
        bad = float(value) <= 0 if positive else float(value) < 0
        if not math.isfinite(float(value)) or bad:
            raise ValueError(f"{key} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
        return {name: np.asarray(float(value), dtype=self.model.state[name].dtype)}

    def current_learning_rate(self) -> float:
        """The base rate times the schedule's factor at the step counter: the
        algorithm graph's own nodes that compute the rate (metadata
        ``onnxtrain.learning_rate`` names their result), run on the current
        state; the base rate where no schedule or no result is recorded."""
        name = self.state_name("learning_rate")
        info = self.metadata["learning_rate"]
        value = info.get("value")
        if not value or value == name:
            return float(self.store.to_numpy([name])[name])
        if self._rate is None:
            self._rate = self._rate_executor(value, int(info.get("algorithm", 0)))
        executor, inputs = self._rate
        # One state version for every input (fit reads this before each step).
        (out,) = executor.run(self.store.to_numpy(inputs), [value])
        return float(out)

    def _rate_executor(self, value: str, index: int) -> tuple[Executor, list[str]]:
        """An executor of the nodes of training_info[index].algorithm that
        compute ``value`` from state variables and constants, and its inputs."""
        where = f"metadata onnxtrain.learning_rate: training_info[{index}].algorithm"
        proto, state = self.model.proto, self.model.state
        if not 0 <= index < len(proto.training_info):
            raise TrainingModelError(f"{where}: no such algorithm")
        graph = proto.training_info[index].algorithm
        nodes = prune(list(graph.node), [value])
        if not any(value in n.output for n in nodes):
            raise TrainingModelError(f"{where}: no node computes {value!r}")
        made = {o for n in nodes for o in n.output}
        constants = {t.name: t for t in list(proto.graph.initializer) + list(graph.initializer)}
        needed = sorted({i for n in nodes for i in node_inputs(n)} - made)
        inputs = [i for i in needed if i in state]
        other = [i for i in needed if i not in state and i not in constants]
        if other:
            raise TrainingModelError(f"{where}: {value!r} depends on {other}, not on state alone")
        g = onnx.helper.make_graph(
            nodes, "current_learning_rate",
            [onnx.helper.make_tensor_value_info(i, state[i].elem_type, list(state[i].shape)) for i in inputs],
            [onnx.ValueInfoProto(name=value)],
            [constants[i] for i in needed if i not in state],
        )
        model = onnx.helper.make_model(g, opset_imports=list(proto.opset_import))
        model.ir_version = proto.ir_version
        return Executor(model, label="current_learning_rate"), inputs
