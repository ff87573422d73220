"""TrainingSession: the stateful object of the ONNX training semantics.

State variables are the initializers named as keys by any binding.  They
start at their initializer values (R9); ``initialize()`` runs every
initialization graph in order; ``train_step()`` runs one combined graph
(main ⊕ algorithm) and then assigns every bound output at once; ``run()`` is
side-effect-free inference with the current state (R10).

Every state change is staged on a copy and committed with one assignment,
so a step that fails for any reason (bad feed, onnxruntime error, a bound
value of the wrong type, KeyboardInterrupt) leaves the state as it was.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import TrainingModelError
from .executor import MAX_IR_VERSION, Executor
from .graph import PREVIEW_DOMAIN
from .model import ModelLike, TrainingModel, load, uses_preview_ops, validate
from .programs import Program, algorithm_program, inference_program, initialization_program


class StateView(Mapping):
    """Read-only view of a session's state: each lookup returns a copy."""

    def __init__(self, state: Mapping[str, np.ndarray]) -> None:
        self._state = state

    def __getitem__(self, name: str) -> np.ndarray:
        return self._state[name].copy()

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self._state.items())
        return f"StateView({{{items}}})"


class TrainingSession:
    """Runs an ONNX training model on onnxruntime.

    >>> sess = TrainingSession("model.onnx")          # doctest: +SKIP
    >>> sess.initialize()                              # doctest: +SKIP
    >>> out = sess.train_step({"X": x, "Y": y})        # doctest: +SKIP
    >>> sess.run({"X": x})["Y_pred"]                   # doctest: +SKIP
    >>> sess.export("trained.onnx")                    # doctest: +SKIP
    """

    def __init__(
        self,
        model: ModelLike,
        providers: Sequence[Any] | None = None,
        session_options: Any = None,
    ) -> None:
        proto, base = load(model)
        self._model: TrainingModel = validate(proto, base)
        self._providers = list(providers) if providers else None
        self._session_options = session_options
        self._lock = threading.RLock()
        tm = self._model
        # Build every program now, so that model errors surface at construction.
        self._inference = inference_program(tm)
        self._algorithms = [algorithm_program(tm, i) for i in range(len(tm.training_info))]
        self._initializations = [
            initialization_program(tm, i) for i in range(len(tm.training_info))
        ]
        self._executors: dict[int, Executor] = {}
        self._state: dict[str, np.ndarray] = {name: tm.initial_value(name) for name in tm.state}
        self._input_names = set(self._inference.feeds) | set(self._inference.optional_feeds)
        for p in self._algorithms:
            self._input_names |= set(p.feeds) | set(p.optional_feeds)

    # ------------------------------------------------------------ properties
    @property
    def state(self) -> Mapping[str, np.ndarray]:
        """Every state variable -> numpy array (copies; the mapping is read-only)."""
        return StateView(self._state)

    @property
    def num_algorithms(self) -> int:
        return len(self._algorithms)

    @property
    def model(self) -> onnx.ModelProto:
        """The loaded model as given (initializers hold the initial values)."""
        return self._model.proto

    def programs(self) -> dict[str, onnx.ModelProto]:
        """The standard-op ONNX model of every program, by label (for inspection)."""
        out = {"inference": self._inference.model}
        for p in self._algorithms:
            out[p.label] = p.model
        for p in self._initializations:
            if p is not None:
                out[p.label] = p.model
        return out

    def __repr__(self) -> str:
        return (
            f"TrainingSession(algorithms={len(self._algorithms)}, "
            f"state={len(self._state)} variables, inputs={sorted(self._inference.feeds)})"
        )

    # ------------------------------------------------------------- execution
    def _executor(self, program: Program) -> Executor:
        key = id(program)
        ex = self._executors.get(key)
        if ex is None:
            ex = Executor(program.model, self._providers, self._session_options, program.label)
            self._executors[key] = ex
        return ex

    def _feeds(
        self,
        program: Program,
        feeds: Mapping[str, Any],
        state: Mapping[str, np.ndarray],
        allow_state_override: bool,
        caller: str,
    ) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, vi in program.feeds.items():
            if name not in feeds:
                raise ValueError(
                    f"{caller}: missing feed {name!r} (input of {program.label}, "
                    f"expected {_describe(vi)})"
                )
            out[name] = _check_feed(name, feeds[name], vi, caller)
        for name, vi in program.optional_feeds.items():
            if name in feeds:
                out[name] = _check_feed(name, feeds[name], vi, caller)
        for name in program.state_inputs:
            if name in feeds:
                if not allow_state_override:
                    raise ValueError(
                        f"{caller}: {name!r} is a state variable; set it with load_state(), "
                        "not as a feed"
                    )
                var = self._model.state[name]
                vi = onnx.helper.make_tensor_value_info(name, var.elem_type, list(var.shape))
                out[name] = _check_feed(name, feeds[name], vi, caller)
            else:
                out[name] = state[name]
        return out

    def _check_names(self, feeds: Mapping[str, Any], caller: str) -> None:
        if not isinstance(feeds, Mapping):
            raise TypeError(f"{caller}: feeds must be a dict of name -> array, not {type(feeds).__name__}")
        unknown = [k for k in feeds if k not in self._input_names and k not in self._state]
        if unknown:
            raise ValueError(
                f"{caller}: unknown feed {unknown[0]!r}; the model's inputs are "
                f"{sorted(self._input_names)}"
            )

    @staticmethod
    def _apply(
        program: Program, results: dict[str, np.ndarray], staged: dict[str, np.ndarray],
        field: str,
    ) -> None:
        updates = {}
        for idx, (key, value) in enumerate(program.bindings):
            new = results[value]
            old = staged[key]
            if new.dtype != old.dtype or new.shape != old.shape:
                raise TrainingModelError(
                    f"{program.label.rsplit('.', 1)[0]}.{field}[{idx}]: value {value!r} is "
                    f"{new.dtype}{list(new.shape)}, but state variable {key!r} is "
                    f"{old.dtype}{list(old.shape)}"
                )
            updates[key] = new
        staged.update(updates)  # all bindings of one graph at once (R9)

    def train_step(
        self, feeds: Mapping[str, Any], algorithm: int | None = None
    ) -> dict[str, np.ndarray]:
        """Run one training step and commit its update_binding.

        ``algorithm=i`` runs training_info[i]; ``None`` runs every algorithm in
        order (one spec iteration), each seeing the state its predecessors
        wrote.  The state changes only if every run succeeds.  Returns every
        combined-graph output that no update_binding consumes (later
        algorithms win on equal names)."""
        if not self._algorithms:
            raise TrainingModelError("the model has no training_info: there is nothing to train")
        if algorithm is None:
            indices = list(range(len(self._algorithms)))
        else:
            if not isinstance(algorithm, (int, np.integer)) or not (
                0 <= algorithm < len(self._algorithms)
            ):
                raise ValueError(
                    f"train_step: algorithm must be None or an index in "
                    f"[0, {len(self._algorithms)}), got {algorithm!r}"
                )
            indices = [int(algorithm)]
        self._check_names(feeds, "train_step")
        with self._lock:
            staged = dict(self._state)
            outputs: dict[str, np.ndarray] = {}
            for i in indices:
                program = self._algorithms[i]
                run_feeds = self._feeds(program, feeds, staged, False, "train_step")
                values = self._executor(program).run(run_feeds, program.outputs)
                results = dict(zip(program.outputs, values))
                self._apply(program, results, staged, "update_binding")
                bound = {v for _, v in program.bindings}
                outputs.update({k: v for k, v in results.items() if k not in bound})
            self._state = staged  # the commit
        return outputs

    def initialize(self) -> None:
        """Run every initialization graph in order and apply its initialization_binding."""
        with self._lock:
            staged = dict(self._state)
            for program in self._initializations:
                if program is None or not program.bindings:
                    continue
                values = self._executor(program).run({}, program.outputs)
                self._apply(program, dict(zip(program.outputs, values)), staged,
                            "initialization_binding")
            self._state = staged

    def run(
        self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Inference: the main graph with the current state.  Never changes state.

        Inputs that also have an initializer (IR 3 style), state variables
        included, may be fed to override their value for this call only."""
        self._check_names(feeds, "run")
        program = self._inference
        names = list(output_names) if output_names is not None else program.outputs
        bad = [n for n in names if n not in program.outputs]
        if bad:
            raise ValueError(
                f"run: {bad[0]!r} is not an output of the main graph; outputs are {program.outputs}"
            )
        state = self._state  # a consistent snapshot: commits replace the dict
        run_feeds = self._feeds(program, feeds, state, True, "run")
        values = self._executor(program).run(run_feeds, names)
        return dict(zip(names, values))

    def load_state(self, mapping: Mapping[str, Any]) -> None:
        """Set some state variables.  Names, dtypes and shapes must match."""
        staged = dict(self._state)
        for name, value in mapping.items():
            if name not in self._state:
                raise KeyError(f"load_state: {name!r} is not a state variable")
            old = self._state[name]
            arr = value if isinstance(value, np.ndarray) else np.asarray(value, dtype=old.dtype)
            if arr.dtype != old.dtype:
                raise ValueError(
                    f"load_state: {name!r} must be {old.dtype}, got {arr.dtype}"
                )
            if arr.shape != old.shape:
                raise ValueError(
                    f"load_state: {name!r} must have shape {list(old.shape)}, got {list(arr.shape)}"
                )
            staged[name] = np.array(arr, copy=True)
        with self._lock:
            self._state = staged

    # ---------------------------------------------------------------- export
    def to_model(self, training: bool = False) -> onnx.ModelProto:
        """The model with the current state written into its initializers.

        ``training=False``: a plain inference model (training_info dropped).
        ``training=True``: the whole training model, a complete checkpoint."""
        state = self._state
        src = self._model.proto
        out = onnx.ModelProto()
        if training:
            out.CopyFrom(src)
        else:
            keep = onnx.ModelProto()
            keep.CopyFrom(src)
            del keep.training_info[:]
            out = keep
        _write_state(out.graph, state)
        if training:
            for ti in out.training_info:
                _write_state(ti.algorithm, state)
        else:
            if not uses_preview_ops(out.graph):
                imports = [o for o in out.opset_import if o.domain != PREVIEW_DOMAIN]
                del out.opset_import[:]
                out.opset_import.extend(imports)
            if out.ir_version > MAX_IR_VERSION:
                out.ir_version = MAX_IR_VERSION
        return out

    def export(self, path: str | os.PathLike, training: bool = False) -> Path:
        """Write the current model to ``path`` atomically (temp file, fsync, rename)."""
        model = self.to_model(training=training)
        return write_model(model, path)


def write_model(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    """Serialize atomically: a temp file in the same folder, fsync, then rename."""
    target = Path(path)
    folder = target.resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    try:
        data = model.SerializeToString()
    except ValueError as exc:  # protobuf refuses messages over 2 GB
        raise TrainingModelError(f"cannot serialize the model: {exc}") from exc
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return target


def _write_state(graph: onnx.GraphProto, state: Mapping[str, np.ndarray]) -> None:
    for i, t in enumerate(graph.initializer):
        if t.name in state:
            graph.initializer[i].CopyFrom(numpy_helper.from_array(state[t.name], t.name))
    sparse_state = [st for st in graph.sparse_initializer if st.values.name in state]
    if sparse_state:
        # Sparse state variables are written back dense: training fills them in.
        kept = [st for st in graph.sparse_initializer if st.values.name not in state]
        del graph.sparse_initializer[:]
        graph.sparse_initializer.extend(kept)
        for st in sparse_state:
            graph.initializer.append(numpy_helper.from_array(state[st.values.name], st.values.name))


def _describe(vi: onnx.ValueInfoProto) -> str:
    tt = vi.type.tensor_type
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
    except (KeyError, TypeError):
        dtype = "?"
    if not tt.HasField("shape"):
        return dtype
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    return f"{dtype}{dims}"


def _check_feed(name: str, value: Any, vi: onnx.ValueInfoProto, caller: str) -> np.ndarray:
    """Convert a feed to an array and check it against the declared input."""
    tt = vi.type.tensor_type
    expected = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else None
    if isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(value, dtype=expected)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{caller}: feed {name!r} cannot be converted to {expected}: {exc}") from exc
    if expected is not None and arr.dtype != expected:
        raise ValueError(
            f"{caller}: feed {name!r} has dtype {arr.dtype}, expected {_describe(vi)}"
        )
    if tt.HasField("shape"):
        dims = tt.shape.dim
        if arr.ndim != len(dims):
            raise ValueError(
                f"{caller}: feed {name!r} has shape {list(arr.shape)}, expected {_describe(vi)}"
            )
        for axis, d in enumerate(dims):
            if d.HasField("dim_value") and d.dim_value != arr.shape[axis]:
                raise ValueError(
                    f"{caller}: feed {name!r} has shape {list(arr.shape)}, expected {_describe(vi)}"
                )
    return arr
