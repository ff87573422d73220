"""Hyperparameters the builder keeps as state: ``learning_rate``,
``clip_grad_norm`` and ``schedule_total_steps`` read and set through their
state variables."""

from __future__ import annotations

import math

import numpy as np
import onnx

from ..core.graph import node_inputs, prune
from ..errors import TrainingModelError
from ..runtime.executor import Executor


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
                   "; only build.cosine() without a total has one" if key == "schedule" else
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
    def current_learning_rate(self) -> float:
        """The rate the next ``train_step`` update uses (read-only): the base
        ``learning_rate`` times the schedule's factor at the step counter (ONNX
        Runtime training's ``get_learning_rate()``).  It runs the algorithm
        graph's own nodes that compute the rate (metadata
        ``onnxtrain.learning_rate`` names their result) on the current state,
        the values the step reads, so it is exact for every schedule.  A model
        without a schedule, or built before the rate was recorded: the base rate."""
        name = self._lr_state()
        info = self._metadata["learning_rate"]
        value = info.get("value")
        if not value or value == name:
            return float(self._store.to_numpy([name])[name])
        lr_exec = getattr(self, "_lr_exec", None)
        if lr_exec is None:
            lr_exec = self._lr_exec = self._rate_executor(value, int(info.get("algorithm", 0)))
        executor, inputs = lr_exec
        # One state version for every input (fit reads this before each step).
        (out,) = executor.run(self._store.to_numpy(inputs), [value])
        return float(out)

    def _rate_executor(self, value: str, index: int) -> tuple[Executor, list[str]]:
        """An executor of the nodes of training_info[index].algorithm that
        compute ``value`` from state variables and constants, and its inputs."""
        where = f"metadata onnxtrain.learning_rate: training_info[{index}].algorithm"
        proto = self._model.proto
        if not 0 <= index < len(proto.training_info):
            raise TrainingModelError(f"{where}: no such algorithm")
        graph = proto.training_info[index].algorithm
        nodes = prune(list(graph.node), [value])
        if not any(value in n.output for n in nodes):
            raise TrainingModelError(f"{where}: no node computes {value!r}")
        made = {o for n in nodes for o in n.output}
        constants = {t.name: t for t in list(proto.graph.initializer) + list(graph.initializer)}
        needed = sorted({i for n in nodes for i in node_inputs(n)} - made)
        inputs = [i for i in needed if i in self._model.state]
        other = [i for i in needed if i not in self._model.state and i not in constants]
        if other:
            raise TrainingModelError(f"{where}: {value!r} depends on {other}, not on state alone")
        g = onnx.helper.make_graph(
            nodes, "current_learning_rate",
            [onnx.helper.make_tensor_value_info(
                i, self._model.state[i].elem_type,
                list(self._model.state[i].shape)) for i in inputs],
            [onnx.ValueInfoProto(name=value)],
            [constants[i] for i in needed if i not in self._model.state],
        )
        model = onnx.helper.make_model(g, opset_imports=list(proto.opset_import))
        model.ir_version = proto.ir_version
        return Executor(model, label="current_learning_rate"), inputs

    @property
    def schedule_total_steps(self) -> int | None:
        """The updates a schedule built without a total (``build.cosine()``) runs
        over: None until set.  ``fit`` sets it when it starts (epochs x updates
        per epoch) unless it is set; it is state, so a checkpoint keeps it and
        ``initialize()`` unsets it.  A model without such a schedule raises."""
        value = float(self.state[self._setting_state("schedule", "schedule-total")])
        return int(value) if value > 0 else None

    @schedule_total_steps.setter
    def schedule_total_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"schedule_total_steps must be an integer >= 1, got {value!r}")
        self._set_setting("schedule", "schedule-total", int(value), positive=True)

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
