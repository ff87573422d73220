"""``CheckpointState``, ``Module``, ``Optimizer``, ``LinearLRScheduler``: ONNX Runtime
training 1.19.2's Python API (``onnxruntime.training.api``) on ``onnxtrain.TrainingSession``.

>>> import os, tempfile
>>> import numpy as np
>>> from onnxtrain import TrainingSession
>>> from onnxtrain.demo import build_classifier
>>> from onnxtrain.ort_training import artifacts
>>> from onnxtrain.ort_training.api import CheckpointState, Module, Optimizer
>>> art = tempfile.TemporaryDirectory()
>>> artifacts.generate_artifacts(TrainingSession(build_classifier()).to_model(),  # X -> logits
...                              requires_grad=["W1", "b1", "W2", "b2"],
...                              loss=artifacts.LossType.CrossEntropyLoss,
...                              optimizer=artifacts.OptimType.AdamW, artifact_directory=art.name)
>>> state = CheckpointState.load_checkpoint(os.path.join(art.name, "checkpoint"))
>>> module = Module(os.path.join(art.name, "training_model.onnx"), state,
...                 os.path.join(art.name, "eval_model.onnx"))
>>> opt = Optimizer(os.path.join(art.name, "optimizer_model.onnx"), module)
>>> x, labels = np.zeros((4, 64), np.float32), np.arange(4)
>>> loss = module(x, labels); opt.step(); module.lazy_reset_grad()
>>> float(loss) > 0
True
>>> art.cleanup()

The step runs as the model ``standard_model.training_model`` builds: training_info[0]
is ``module(...)`` (gradients summed into buffers), training_info[1] is
``optimizer.step()``.  Parameters, gradients, the step count and the moments
live in the session's state; ``CheckpointState`` reads and writes them there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import numpy_helper

from ..io.storage import write_model
from ..runtime.executor import is_ortvalue, owned_ortvalue
from ..session import TrainingSession
from . import checkpoint as ckpt
from . import models
from .standard_model import LR, RESET, STEP, OptimizerConfig, grad_name, moment_name, training_model


# ------------------------------------------------------------------ state
class Parameter:
    """One model parameter of a ``CheckpointState`` (not made directly)."""

    def __init__(self, name: str, state: "CheckpointState") -> None:
        self._name, self._state = name, state

    @property
    def name(self) -> str:
        return self._name

    @property
    def data(self) -> np.ndarray:
        if self._name not in self._state._loaded:
            raise RuntimeError(f"Parameter {self._name}: the state is nominal. Please load the "
                               "parameter states first (Module.copy_buffer_to_parameters)")
        return self._state._value(self._name)

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._state._set(self._name, value)

    @property
    def grad(self) -> np.ndarray | None:
        """The summed gradient of a trainable parameter of a Module (zeros
        before the first step); None for frozen parameters or without a Module."""
        return self._state._grad(self._name)

    @property
    def requires_grad(self) -> bool:
        return self._name in self._state._data.trainable

    def __repr__(self) -> str:
        return f"Parameter(name={self.name}, requires_grad={self.requires_grad})"


class Parameters:
    """The parameters by name; iterating yields ``(name, Parameter)`` pairs as 1.19.2 does."""

    def __init__(self, state: "CheckpointState") -> None:
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        if name not in self:
            raise KeyError(f"Parameter {name} not found.")
        if name not in self._state._loaded:
            raise RuntimeError(f"Parameter {name}: the state is nominal. Please load the parameter "
                               "states first (Module.copy_buffer_to_parameters)")
        return Parameter(name, self._state)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        if name not in self:
            raise KeyError(f"Parameter {name} not found.")
        if self._state._missing():
            raise RuntimeError("the state is nominal. Please load all the parameter states first "
                               "(Module.copy_buffer_to_parameters)")
        self._state._set(name, value)

    def __contains__(self, name: object) -> bool:
        return name in self._state._data.trainable or name in self._state._data.frozen

    def __iter__(self) -> Iterator[tuple[str, Parameter]]:
        for name in self._state._names():
            yield name, Parameter(name, self._state)

    def __len__(self) -> int:
        return len(self._state._names())

    def __repr__(self) -> str:
        return repr(self._state._names())


class Properties:
    """User properties (int, float, str), saved with the checkpoint."""

    def __init__(self, state: "CheckpointState") -> None:
        self._props = state._data.properties

    def __getitem__(self, name: str) -> int | float | str:
        if name not in self._props:
            raise KeyError(f"Property {name} not found.")
        return self._props[name]

    def __setitem__(self, name: str, value: int | float | str) -> None:
        kind = ckpt.property_kind(name, value)  # TypeError for anything but int, float, str
        # stored as the checkpoint stores them: int64, float32, str
        self._props[name] = {"int": int, "float": lambda v: float(np.float32(v)), "str": str}[kind](value)

    def __contains__(self, name: object) -> bool:
        return name in self._props

    def __iter__(self) -> Iterator[tuple[str, int | float | str]]:
        yield from list(self._props.items())

    def __len__(self) -> int:
        return len(self._props)

    def __repr__(self) -> str:
        return repr(list(self._props))


class CheckpointState:
    """Parameters, optimizer state and properties: an ODTC checkpoint in memory.

    Made by ``load_checkpoint``; a ``Module`` built over it keeps the
    parameters in its session from then on (``parameters`` reads them there)."""

    def __init__(self, state: ckpt.Checkpoint) -> None:
        if not isinstance(state, ckpt.Checkpoint):
            raise TypeError(f"Invalid argument for CheckpointState received {type(state)}")
        self._data = state
        self._module: Module | None = None
        self._loaded = set() if state.nominal else set(self._names())

    @classmethod
    def load_checkpoint(cls, checkpoint_uri: str | os.PathLike) -> "CheckpointState":
        """Read a complete or nominal checkpoint (ORT's or ours)."""
        return cls(ckpt.load(os.fspath(checkpoint_uri)))

    @classmethod
    def save_checkpoint(cls, state: "CheckpointState", checkpoint_uri: str | os.PathLike,
                        include_optimizer_state: bool = False) -> None:
        """Write ``state`` (parameters, properties and, when asked, the optimizer
        state) as an ODTC checkpoint that ONNX Runtime 1.19.2 reads too."""
        if not isinstance(state, CheckpointState):
            raise TypeError(f"save_checkpoint: expected a CheckpointState, got {type(state)}")
        missing = state._missing()
        if missing:
            raise RuntimeError(f"save_checkpoint: the state is nominal; load parameter "
                               f"{missing[0]!r} first (copy_buffer_to_parameters)")
        data = state._data
        out = ckpt.Checkpoint(
            trainable={n: state._value(n) for n in data.trainable},
            frozen={n: state._value(n) for n in data.frozen},
            properties=dict(data.properties))
        if include_optimizer_state:
            module = state._module
            out.optimizer_groups = (module._optimizer_groups() if module is not None
                                    and module._optimizer is not None else data.optimizer_groups)
        ckpt.save(out, os.fspath(checkpoint_uri))

    @property
    def parameters(self) -> Parameters:
        return Parameters(self)

    @property
    def properties(self) -> Properties:
        return Properties(self)

    # -- internals shared with Module
    def _names(self) -> list[str]:
        return [*self._data.trainable, *self._data.frozen]

    def _missing(self) -> list[str]:
        return [n for n in self._names() if n not in self._loaded]

    def _value(self, name: str) -> np.ndarray:
        if self._module is not None:
            return np.array(self._module._session.state[name])
        return self._data.trainable.get(name, self._data.frozen.get(name))

    def _grad(self, name: str) -> np.ndarray | None:
        m = self._module
        if m is None or name not in self._data.trainable:
            return None
        return np.array(m._session.state[grad_name(name)])

    def _set(self, name: str, value: np.ndarray) -> None:
        value = np.asarray(value)
        old = self._value(name)
        if value.dtype != old.dtype or value.shape != old.shape:
            raise ValueError(f"parameter {name!r} is {old.dtype}{list(old.shape)}; "
                             f"got {value.dtype}{list(value.shape)}")
        if self._module is not None:
            self._module._session.load_state({name: value})
        else:
            table = self._data.trainable if name in self._data.trainable else self._data.frozen
            table[name] = value.copy()
        self._loaded.add(name)


# ------------------------------------------------------------------ module
class Module:
    """Trains a model from its artifacts; see ``onnxruntime.training.api.Module``.

    ``train_model_uri``: a training model of ONNX Runtime's (its forward pass is
    kept, its gradient ops are rebuilt by onnxtrain's autodiff) or of
    ``artifacts.generate_artifacts``; ``eval_model_uri``: the eval model
    (``eval()`` needs it).  ``device``: "cpu" only.  ``session_options``:
    onnxruntime SessionOptions for the sessions."""

    training: bool

    def __init__(self, train_model_uri: str | os.PathLike, state: CheckpointState,
                 eval_model_uri: str | os.PathLike | None = None, device: str = "cpu",
                 session_options=None) -> None:
        if not isinstance(state, CheckpointState):
            raise TypeError(f"Module: state must be a CheckpointState, got {type(state)}")
        if device.split(":")[0] != "cpu":
            raise ValueError(f"Module: device {device!r} is not supported; onnxtrain.ort_training "
                             "runs on the CPU")
        if state._module is not None:
            raise RuntimeError("Module: this CheckpointState already belongs to a Module")
        self.training = True
        self._options = session_options
        params = set(state._names())
        try:
            self._forward = models.forward_model(models.load(train_model_uri, "Module"), params)
        except NotImplementedError:  # ORT rewrote the forward pass with its own ops
            if eval_model_uri is None:
                raise
            self._forward = models.forward_model(models.load(eval_model_uri, "Module"), params)
        graph = self._forward.graph
        # the parameters in the model's order (ORT's: the training model's
        # initializers, trainable and frozen alike), then any the graph lacks
        self._order = [i.name for i in graph.input if i.name in params]
        self._order += [n for n in state._names() if n not in self._order]
        self._inputs = [i.name for i in graph.input if i.name not in params]
        self._outputs = [o.name for o in graph.output]
        self._trainable = [n for n in self._order if n in state._data.trainable]
        # BatchNormalization's running statistics: updated by training, read by eval
        self._running = models.running_statistics(self._forward)
        self._buffers = [n for n in self._running if n not in params]
        values = self._start_values(state)
        inits = {t.name: t for t in graph.initializer}
        values.update({n: numpy_helper.to_array(inits[n]) for n in self._buffers})
        self._optimizer: OptimizerConfig | None = None
        self._session = self._build(values, None, {})
        self._eval = self._eval_session(eval_model_uri, params)
        self._state = state
        state._module = self

    def _start_values(self, state: CheckpointState) -> dict[str, np.ndarray]:
        types = {i.name: i.type.tensor_type for i in self._forward.graph.input}
        values = {}
        for name in self._order:
            if name in state._loaded:
                values[name] = state._value(name)
                continue
            tt = types.get(name)
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt else None
            if dims is None or None in dims:
                raise ValueError(f"Module: nominal parameter {name!r} has no static shape in the model")
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            values[name] = np.zeros(dims, dtype)
        return values

    def _build(self, values, optimizer, extra) -> TrainingSession:
        model = training_model(self._forward, values, self._trainable, optimizer, extra,
                                      running=self._running)
        return TrainingSession(model, session_options=self._options)

    def _eval_session(self, uri, params) -> TrainingSession | None:
        """The eval model in inference mode, parameters and running statistics
        graph inputs, fed from the training session's state per call."""
        if uri is None:
            return None
        model = models.eval_mode(models.forward_model(models.load(uri, "Module eval model"), params))
        shared = params | set(self._buffers)
        graph = model.graph
        fed = [t for t in graph.initializer if t.name in self._buffers]
        kept = [t for t in graph.initializer if t.name not in self._buffers]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in fed)
        self._eval_model = model
        self._eval_inputs = [i.name for i in graph.input if i.name not in shared]
        self._eval_outputs = [o.name for o in graph.output]
        self._eval_params = [i.name for i in graph.input if i.name in shared]
        return TrainingSession(model, session_options=self._options)  # parameters fed per call

    # -- ORT's Module API
    def __call__(self, *user_inputs):
        missing = self._state._missing()
        if missing:
            raise RuntimeError(
                f"Module: the checkpoint is nominal: parameter {missing[0]!r} has no data yet; "
                "load the parameters with copy_buffer_to_parameters(buffer, trainable_only=False)")
        names = self.input_names()
        if len(user_inputs) != len(names):
            raise ValueError(f"Module: expected {len(names)} inputs {names}, got {len(user_inputs)}")
        # as 1.19.2: numpy outputs for any numpy input, else OrtValues
        as_ortvalue = not any(isinstance(x, np.ndarray) for x in user_inputs) and (
            not user_inputs or any(is_ortvalue(x) for x in user_inputs))
        feeds = {n: (x.numpy() if is_ortvalue(x) else x) for n, x in zip(names, user_inputs)}
        if self.training:
            out = self._session.train_step(feeds, algorithm=0)
            values = [out[n] for n in self._outputs]
        else:
            feeds.update({n: self._session.state[n] for n in self._eval_params})
            out = self._eval.run(feeds, self._eval_outputs)
            values = [out[n] for n in self._eval_outputs]
        if as_ortvalue:
            values = [owned_ortvalue(v) for v in values]
        return values[0] if len(values) == 1 else tuple(values)

    def train(self, mode: bool = True) -> "Module":
        if not mode and self._eval is None:
            raise RuntimeError("Module.eval(): this Module has no eval model; pass "
                               "eval_model_uri= when constructing it")
        self.training = mode
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def lazy_reset_grad(self) -> None:
        """Gradients restart from zero at the next training call."""
        self._session.load_state({RESET: np.array(True)})

    def _selected(self, trainable_only: bool) -> list[str]:
        return list(self._trainable) if trainable_only else list(self._order)

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        return int(sum(self._session.state[n].size for n in self._selected(trainable_only)))

    def get_contiguous_parameters(self, trainable_only: bool = False):
        """The parameters, flattened and concatenated (float32) as an OrtValue."""
        missing = self._state._missing()
        if missing:
            raise RuntimeError(f"get_contiguous_parameters: the state is nominal ({missing[0]!r} has "
                               "no data). Please load the model parameters first.")
        parts = [np.asarray(self._session.state[n], np.float32).ravel()
                 for n in self._selected(trainable_only)]
        flat = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return owned_ortvalue(flat)

    def copy_buffer_to_parameters(self, buffer, trainable_only: bool = True) -> None:
        """Set the parameters from a flat buffer (completes a nominal state)."""
        flat = np.asarray(buffer.numpy() if is_ortvalue(buffer) else buffer).ravel()
        names = self._selected(trainable_only)
        size = self.get_parameters_size(trainable_only)
        if flat.size != size:
            raise ValueError(f"copy_buffer_to_parameters: the buffer has {flat.size} elements, "
                             f"the {'trainable ' if trainable_only else ''}parameters {size}")
        start, values = 0, {}
        for n in names:
            like = self._session.state[n]
            values[n] = flat[start:start + like.size].astype(like.dtype).reshape(like.shape)
            start += like.size
        self._session.load_state(values)
        self._state._loaded.update(names)

    def export_model_for_inferencing(self, inference_model_uri: str | os.PathLike,
                                     graph_output_names: list[str]) -> None:
        """Write the forward pass up to ``graph_output_names``, with the current parameters."""
        from .inference import inference_model

        source = self._eval_model if self._eval is not None else self._forward  # ORT cuts the eval model
        values = {n: np.array(self._session.state[n]) for n in (*self._order, *self._buffers)}
        write_model(inference_model(source, values, graph_output_names), inference_model_uri)

    def input_names(self) -> list[str]:
        return list(self._inputs if self.training else self._eval_inputs)

    def output_names(self) -> list[str]:
        return list(self._outputs if self.training else self._eval_outputs)

    # -- the optimizer's half
    def _set_optimizer(self, cfg: OptimizerConfig) -> float:
        """Rebuild the session with ``cfg``'s update; returns the starting learning rate."""
        extra = {n: np.array(v) for n, v in self._session.state.items()}
        lr = 0.001
        groups = self._state._data.optimizer_groups
        if groups:  # resume: step, moments and the initial learning rate
            group = groups[0]
            lr = group.initial_learning_rate
            extra[STEP] = np.array(group.step, np.int64)
            for p, moments in group.states.items():
                for key, value in moments.items():
                    if key.startswith("momentum") and key[8:].isdigit():
                        extra[moment_name(p, int(key[8:]))] = value
        extra[LR] = np.array(lr, np.float32)
        values = {n: extra.pop(n) for n in (*self._order, *self._buffers)}
        self._session = self._build(values, cfg, extra)
        self._optimizer = cfg
        self._initial_lr = float(lr)
        return lr

    def _optimizer_groups(self) -> list[ckpt.OptimizerGroup]:
        state = self._session.state
        group = ckpt.OptimizerGroup("group0", int(state[STEP]), self._initial_lr)
        for p in self._trainable:
            group.states[p] = {f"momentum{i}": np.array(state[moment_name(p, i)])
                               for i in range(self._optimizer.moments)}
        return [group]


# ------------------------------------------------------------------ optimizer
class Optimizer:
    """Updates the module's parameters from its summed gradients (AdamW or SGD,
    as the optimizer model says); see ``onnxruntime.training.api.Optimizer``."""

    def __init__(self, optimizer_uri: str | os.PathLike, module: Module) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"Optimizer: module must be a Module, got {type(module)}")
        cfg = models.optimizer_config(models.load(optimizer_uri, "Optimizer"))
        self._module = module
        module._set_optimizer(cfg)

    def _check_loaded(self, what: str) -> None:
        missing = self._module._state._missing()
        if missing:
            raise RuntimeError(f"Optimizer.{what}: the checkpoint is nominal: load parameter "
                               f"{missing[0]!r} first (Module.copy_buffer_to_parameters)")

    def step(self) -> None:
        self._check_loaded("step()")
        self._module._session.train_step({}, algorithm=1, fetch=False)

    def set_learning_rate(self, learning_rate: float) -> None:
        self._check_loaded("set_learning_rate()")
        self._module._session.load_state({LR: np.array(learning_rate, np.float32)})

    def get_learning_rate(self) -> float:
        return float(self._module._session.state[LR])

    def _step_count(self) -> int:
        return int(self._module._session.state[STEP])


class LinearLRScheduler:
    """lr = initial_lr * f(step), step = the optimizer's step count:
    f = step / warmup while step < warmup, then (total - step) / (total - warmup),
    never below 0 (as documented; 1.19.2's binding swaps the two counts)."""

    def __init__(self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int,
                 initial_lr: float) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"LinearLRScheduler: expected an Optimizer, got {type(optimizer)}")
        if warmup_step_count < 0 or total_step_count < 0:
            raise ValueError("LinearLRScheduler: step counts must be non-negative")
        self._optimizer = optimizer
        self._warmup, self._total = int(warmup_step_count), int(total_step_count)
        self._initial_lr = float(initial_lr)
        self._apply()

    def _factor(self, step: int) -> float:
        if step < self._warmup:
            return step / max(1, self._warmup)
        return max(0.0, (self._total - step) / max(1, self._total - self._warmup))

    def _apply(self) -> None:
        self._optimizer.set_learning_rate(self._initial_lr * self._factor(self._optimizer._step_count()))

    def step(self) -> None:
        self._apply()
