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
import threading
import warnings
import weakref
from collections.abc import Container, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from .engine.checks import check_finite
from .engine.execution import ExecutionMixin
from .engine.export import ExportMixin
from .engine.parallel_step import DataParallelMixin
from .engine.settings import SettingsMixin
from .engine.state_view import StateView
from .errors import TrainingModelError
from .io import mapped
from .io.combine import uses_preview_ops
from .io.metadata import model_metadata, read_position
from .io.model import ModelLike, TrainingModel, load, validate
from .lower.pipeline import KernelChoice, check_fused_kernels, note_exact_quantized_products
from .lower.programs import (
    Program,
    SplitAlgorithm,
    algorithm_programs,
    check_feed_names,
    inference_program,
    initialization_program,
    loss_program,
)
from .parallel.comm import Communicator, SingleProcess, as_communicator
from .parallel.data_parallel import BUCKET_BYTES, DataParallel, threads_per_rank
from .runtime.executor import (
    LARGE_MODEL_BYTES,
    Executor,
    as_numpy,
    copy_into,
    default_session_options,
    device_of,
    state_device,
)
from .runtime.state import StateStore
from .train import loop


class TrainingSession(SettingsMixin, ExecutionMixin, DataParallelMixin, ExportMixin):
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
        check_finite: bool = False,
        fused_kernels: bool | None = None,
        comm: Any = None,
        reduction: str = "weighted",
        bucket_bytes: int = BUCKET_BYTES,
        memory: str = "safe",
    ) -> None:
        """``fused_kernels``: run each optimizer update (the builder's Adam/AdamW,
        the spec's Adam, Momentum and Adagrad) as one fused kernel
        (``onnxtrain.kernels``, a custom-op library built on first use) instead
        of a chain of standard ones; same results, bit for bit (docs/fused-kernels.md).  None (the
        default) uses it where it can (CPU, a C compiler, not turned off with
        ``ONNXTRAIN_FUSED_KERNELS=0``); True requires it; False never uses it.

        ``comm``: data-parallel training over an mpi4py communicator (or an
        ``onnxtrain.comm.Communicator``); every rank constructs the session,
        and rank 0's state is broadcast.  ``train_step`` then takes this
        rank's shard of the global batch, and the optimizer sees the gradient
        of the global batch: local gradients combined by ``reduction``
        (``"weighted"`` by each rank's rows, exact for mean-reduced losses;
        ``"mean"``; ``"sum"``) and summed in place in buckets of
        ``bucket_bytes``.  See ``onnxtrain.distributed`` and docs/distributed.md.

        ``memory``: ``"safe"`` (default) double-buffers every state variable a
        step writes, so a failed step changes nothing.  ``"lean"`` keeps one
        buffer where it can (``onnxtrain.inplace``): each algorithm runs as
        forward + backward (into gradient buffers), then the optimizer, which
        writes the new values over the old ones.  A step that fails in the
        forward or backward pass (bad feeds, an onnxruntime error there,
        non-finite gradients with ``check_finite``) still changes nothing; a
        failure inside the optimizer, after it has started writing, leaves the
        update applied as far as it got, and the error says so.  Full
        fine-tuning then needs about the memory PyTorch needs (weights,
        gradients, optimizer state); see docs/large-models.md."""
        if memory not in ("safe", "lean"):
            raise ValueError(f"memory must be 'safe' or 'lean', got {memory!r}")
        self._lean = memory == "lean"
        self._dp: DataParallel | None = None
        if comm is None:
            if self._lean:  # the data-parallel cut, with a world of one
                self._dp = DataParallel(SingleProcess(), "sum", bucket_bytes)
            self._setup(model, providers, session_options, fused_kernels, check_finite)
        else:
            self._dp = DataParallel(as_communicator(comm), reduction, bucket_bytes)
            if session_options is None and not os.environ.get("ONNXTRAIN_THREADS"):
                # Ranks on one machine share its cores (see distributed.threads_per_rank).
                threads = threads_per_rank(self._dp.comm.local_size())
                session_options = default_session_options(threads)
            error: BaseException | None = None
            try:  # a rank that cannot load the model must not leave the others waiting
                if device_of(list(providers) if providers else None)[0] != "cpu":
                    raise ValueError("comm=: data-parallel training runs on the CPU provider")
                self._setup(model, providers, session_options, fused_kernels, check_finite)
            except BaseException as exc:
                error = exc
            self._dp.agree(error, 0, "TrainingSession()")
            self._broadcast_state(list(self._model.state))

    def _setup(self, model: ModelLike, providers: Sequence[Any] | None, session_options: Any,
               fused_kernels: bool | None, check_finite: bool) -> None:
        """Load and validate the model, build every program, seed the state."""
        proto, base = load(model)
        self._model: TrainingModel = validate(proto, base, tensors_checked=True)  # load() did
        # The data files its weights are mapped from stay while it lives (storage).
        weakref.finalize(self, mapped.hold(proto))
        self._providers = list(providers) if providers else None
        self._session_options = session_options
        self._lock = threading.RLock()
        tm = self._model
        #: The model's onnxtrain.* metadata, decoded once (the model never changes).
        self._metadata = model_metadata(proto)
        # Build every program now, so that model errors surface at construction.
        note_exact_quantized_products(tm)
        self._inference = inference_program(tm)
        built = [algorithm_programs(tm, i, self._cut_options(i)) for i in range(len(tm.training_info))]
        self._algorithms = [program for program, _ in built]
        #: Data-parallel: each algorithm cut in two, and the buffers of its reduced values.
        self._splits: list[SplitAlgorithm] = [split for _, split in built if split is not None]
        self._grad_buffers = [self._dp.buffers(s.reduced) for s in self._splits] if self._dp else []
        #: Rows of local accumulation steps since the last reduced sums (data-parallel).
        self._local_rows = 0
        #: The initialization programs, built on first use (``_initializations``):
        #: only ``initialize()`` runs them.  A graph with training ops is built
        #: now, so that its errors surface here; a plain one (a builder's: its
        #: starting values as constants) has nothing to lower that can fail.
        self._init_programs: list[Program | None] | None = None
        if any(ti.HasField("initialization") and uses_preview_ops(ti.initialization)
               for ti in tm.proto.training_info):
            self._init_programs = self._initializations
        #: evaluate_batch's loss programs by (algorithm, loss, prediction).
        self._loss_programs: dict[tuple[int, str, str | None], Program] = {}
        self._executors: dict[int, Executor] = {}
        #: memory="lean": the in-place variables of each update program, by id,
        #: and its temporaries written over gradient buffers ({value: input}).
        self._inplace: dict[int, set[str]] = {}
        self._scratch: dict[int, dict[str, str]] = {}
        self._executed: dict[int, KernelChoice] = {}
        self._plans: tuple[Program, tuple, Executor] | None = None
        check_fused_kernels(fused_kernels, device_of(self._providers)[0])
        self._fused_kernels = fused_kernels
        #: Why fused kernels are not in use (empty while they are, or not yet asked).
        self.fused_kernels_note = ""
        self._check_finite = check_finite
        self._store = StateStore(
            {name: tm.initial_value(name, readonly=True) for name in tm.state},
            state_device(self._providers),
            adopt=tm.fresh_values(),
        )
        #: Large weights: onnxruntime frees step temporaries (``Executor``'s ``large``).
        self._large = tm.tensor_bytes() >= LARGE_MODEL_BYTES
        #: Built with recompute= (saving activation memory): no onnxruntime memory pattern.
        self._recompute = self._metadata.get("recompute") not in (None, False)
        self._input_names = set(self._inference.feeds) | set(self._inference.optional_feeds)
        for p in self._algorithms:
            self._input_names |= set(p.feeds) | set(p.optional_feeds)
        self._known_names = frozenset(self._input_names | set(tm.state))
        #: Where the fit loop stands: {"epoch": epochs done, "batch": batches done
        #: in the next epoch, "step": steps done, "source": "checkpoint" | "fit"}
        #: or None.  Read from a checkpoint's metadata, kept up to date by ``fit``
        #: and written back by ``export(training=True)``.
        self.fit_position: dict[str, Any] | None = read_position(tm.proto)

    # ------------------------------------------------------------ properties
    @property
    def _initializations(self) -> list[Program | None]:
        if self._init_programs is None:
            tm = self._model
            self._init_programs = [initialization_program(tm, i) for i in range(len(tm.training_info))]
        return self._init_programs

    @property
    def state(self) -> Mapping[str, np.ndarray]:
        """Every state variable -> numpy array (copies; the mapping is read-only)."""
        return StateView(self._store)

    @property
    def comm(self) -> Communicator | None:
        """The communicator of a data-parallel session (``comm=``), else None."""
        if self._dp is None or isinstance(self._dp.comm, SingleProcess):
            return None
        return self._dp.comm

    @property
    def communication_seconds(self) -> float:
        """Seconds this rank has spent in the collectives of data-parallel
        steps (waiting for slower ranks included); 0.0 without ``comm``."""
        return self._dp.comm_seconds if self._dp is not None else 0.0

    @property
    def num_algorithms(self) -> int:
        return len(self._algorithms)

    @property
    def model(self) -> onnx.ModelProto:
        """The loaded model as given (initializers hold the initial values)."""
        return self._model.proto

    def programs(self, executed: bool = False) -> dict[str, onnx.ModelProto]:
        """The standard-op ONNX model of every program, by label (for inspection).

        ``executed=True``: the models onnxruntime runs instead, which differ
        where fused kernels replace standard ones (see ``fused_kernels``)."""
        out = {"inference": self._inference.model}
        for p in self._algorithms:
            out[p.label] = self._program_model(p)[0] if executed else p.model
        for split in self._splits:
            for p in (split.a, split.b):
                if p is not None:
                    out[p.label] = self._program_model(p)[0] if executed else p.model
        for p in self._initializations:
            if p is not None:
                out[p.label] = p.model
        return out

    def __repr__(self) -> str:
        from .summary import session_text

        return session_text(self)

    def _repr_html_(self) -> str:
        from .summary import session_html

        return session_html(self)

    # ------------------------------------------------------------- training loop
    def fit(
        self,
        x: Any,
        y: Any = None,
        *,
        epochs: int = 1,
        batch_size: int = 32,
        validation_data: Any = None,
        validation_split: float = 0.0,
        shuffle: bool = True,
        seed: int = 0,
        callbacks: Sequence[Any] | None = None,
        metrics: Any = None,
        initial_epoch: int | None = None,
        progress: bool | str = True,
        drop_last: bool | None = None,
        log_every: int = 1,
        cycle: Sequence[int | None] | None = None,
    ) -> Any:
        """Train for some epochs, Keras style: ``sess.fit(X, y, epochs=5)``; returns a History.

        ``x`` may also be ``(X, y)``, a dict of feeds or an iterable of batch
        dicts (then ``y`` stays None).  See ``train.loop.fit`` and docs/fit.md."""
        return loop.fit(self, x, y, epochs=epochs, batch_size=batch_size,
                        validation_data=validation_data, validation_split=validation_split,
                        shuffle=shuffle, seed=seed, callbacks=callbacks, metrics=metrics,
                        initial_epoch=initial_epoch, progress=progress, drop_last=drop_last,
                        log_every=log_every, cycle=cycle)

    def evaluate(
        self, x: Any, y: Any = None, *, batch_size: int = 256, metrics: Any = None
    ) -> dict[str, float]:
        """Loss and metrics over ``x`` (and ``y``) without changing state (``train.loop.evaluate``)."""
        return loop.evaluate(self, x, y, batch_size=batch_size, metrics=metrics)

    def predict(
        self, x: Any, *, batch_size: int = 256, outputs: str | Sequence[str] | None = None
    ) -> Any:
        """Run the main graph batch by batch (``train.loop.predict``)."""
        return loop.predict(self, x, batch_size=batch_size, outputs=outputs)

    # ------------------------------------------------------------- introspection
    @property
    def algorithm_inputs(self) -> list[dict[str, onnx.ValueInfoProto]]:
        """Per algorithm: the inputs a train_step must feed (name -> ValueInfoProto)."""
        return [dict(p.feeds) for p in self._algorithms]

    @property
    def inference_inputs(self) -> dict[str, onnx.ValueInfoProto]:
        """The inputs run() must feed (name -> ValueInfoProto)."""
        return dict(self._inference.feeds)

    @property
    def inference_outputs(self) -> list[str]:
        return list(self._inference.outputs)

    @property
    def algorithm_outputs(self) -> list[list[str]]:
        """Per algorithm: the outputs train_step returns (those no update_binding consumes)."""
        return [list(p.returned) for p in self._algorithms]

    @property
    def state_info(self) -> dict[str, Any]:
        """Every state variable -> StateVar (name, origin graph, dtype, shape)."""
        return dict(self._model.state)

    def _check_names(self, feeds: Mapping[str, Any], caller: str) -> None:
        check_feed_names(feeds, self._known_names, self._input_names, caller)

    def _run_and_stage(
        self,
        program: Program,
        feeds: dict[str, np.ndarray],
        pending: dict[str, Any],
        fetch: bool,
        field: str,
        extra_in: Mapping[str, Any] | None = None,
        extra_out: Mapping[str, Any] | None = None,
        inplace: Container[str] = (),
    ) -> dict[str, np.ndarray]:
        """Run ``program`` writing its bound values into spare state buffers.

        ``pending`` holds the new (uncommitted) buffers of variables that
        earlier programs of the same transaction wrote; it is extended with
        this program's.  Returns the unbound outputs (numpy) if ``fetch``.
        ``extra_in``/``extra_out``: more OrtValues to bind, by input and
        output name (the reduced values of a data-parallel step).
        ``inplace``: variables whose current buffer is written over (memory="lean")."""
        store = self._store
        state_in = store.current(program.state_inputs)
        if pending:
            for n in program.state_inputs:
                if n in pending:
                    state_in[n] = pending[n]
        if extra_in:
            state_in.update(extra_in)
        targets = store.targets(program.target_keys, inplace)
        state_out = dict(zip(program.bound_values, targets))
        if extra_out:
            state_out.update(extra_out)
        executor = self._executor(program)
        try:
            outputs = executor.run_bound(feeds, state_in, state_out, program.returned if fetch else ())
        except RuntimeError as exc:
            self._diagnose(program, feeds, state_in, field)
            raise exc
        staged = dict(zip(program.bound_keys, targets))
        for (key, source), buffer in zip(program.bound_copies, targets[len(program.bound_keys):]):
            copy_into(buffer, as_numpy(staged[source]))  # one output, two variables
            staged[key] = buffer
        if self._check_finite:
            check_finite(program, staged, field)
        pending.update(staged)
        return outputs

    def _diagnose(
        self, program: Program, feeds: dict[str, np.ndarray], state_in: dict[str, Any], field: str
    ) -> None:
        """After a failed bound run: rerun plainly to name a bad bound value."""
        arrays = dict(feeds)
        arrays.update({n: as_numpy(v) for n, v in state_in.items()})
        try:
            values = self._executor(program).run(arrays, program.outputs)
        except RuntimeError:
            return  # the original onnxruntime error says it best
        results = dict(zip(program.outputs, values))
        for idx, (key, value) in enumerate(program.bindings):
            var = self._model.state[key]
            new = results[value]
            if new.dtype != var.dtype or tuple(new.shape) != var.shape:
                raise TrainingModelError(
                    f"{program.label.rsplit('.', 1)[0]}.{field}[{idx}]: value {value!r} is "
                    f"{new.dtype}{list(new.shape)}, but state variable {key!r} is "
                    f"{var.dtype}{list(var.shape)}"
                )

    def train_step(
        self, feeds: Mapping[str, Any], algorithm: int | None = None, fetch: bool = True
    ) -> dict[str, np.ndarray]:
        """Run one training step and commit its update_binding.

        ``algorithm=i`` runs training_info[i]; ``None`` runs every algorithm in
        order (one spec iteration), each seeing the state its predecessors
        wrote.  The state changes only if every run succeeds.  Returns every
        combined-graph output that no update_binding consumes (later
        algorithms win on equal names); ``fetch=False`` returns nothing and
        skips those transfers, for tight loops."""
        algorithms = self._algorithms
        if algorithm is None:
            if not algorithms:
                raise TrainingModelError(
                    "the model has no training_info: there is nothing to train"
                )
            programs = algorithms
        elif (type(algorithm) is int or isinstance(algorithm, np.integer)) and 0 <= algorithm < len(
            algorithms
        ):
            programs = (algorithms[algorithm],)
        elif not algorithms:
            raise TrainingModelError("the model has no training_info: there is nothing to train")
        else:
            raise ValueError(
                f"train_step: algorithm must be None or an index in "
                f"[0, {len(algorithms)}), got {algorithm!r}"
            )
        if self._dp is not None:
            indices = range(len(algorithms)) if algorithm is None else (int(algorithm),)
            return self._data_parallel_step(indices, feeds, fetch)
        self._check_names(feeds, "train_step")
        checked = [p.check_feeds(feeds, False, "train_step") for p in programs]
        with self._lock:
            if len(programs) == 1:
                outputs = self._planned_step(programs[0], checked[0], fetch)
                if outputs is not None:
                    return outputs
            pending: dict[str, Any] = {}
            if len(programs) == 1:
                outputs = self._run_and_stage(programs[0], checked[0], pending, fetch,
                                              "update_binding")
            else:
                outputs = {}
                for program, program_feeds in zip(programs, checked):
                    outputs.update(
                        self._run_and_stage(program, program_feeds, pending, fetch,
                                            "update_binding")
                    )
            self._store.commit(pending)  # all bindings at once (R9)
            if len(programs) == 1:
                self._plan_steps(programs[0])
        return outputs

    def evaluate_batch(
        self, feeds: Mapping[str, Any], loss: str, prediction: str | None = None,
        algorithm: int = 0,
    ) -> dict[str, np.ndarray]:
        """The ``loss`` (and ``prediction``) of algorithm ``algorithm`` on one
        batch, at the current state, which stays unchanged.

        Runs the loss program (``programs.loss_program``, built on first use
        and kept): the algorithm's combined graph pruned to those outputs, a
        forward pass through the model's own loss on a pinned snapshot of the
        state.  Where the builder recorded a training-mode copy of the forward
        pass (metadata ``train_prediction``), the loss reads the inference-mode
        ``prediction`` instead."""
        n = len(self._algorithms)
        if not (type(algorithm) is int or isinstance(algorithm, np.integer)) or not 0 <= algorithm < n:
            raise ValueError(f"evaluate: algorithm must be an index in [0, {n}), got {algorithm!r}")
        key = (int(algorithm), loss, prediction)
        program = self._loss_programs.get(key)
        if program is None:
            returned = self._algorithms[algorithm].returned
            if loss not in returned:
                raise ValueError(f"evaluate: {loss!r} is not an output of algorithm {algorithm} "
                                 f"{returned}")
            train_prediction = self._metadata.get("train_prediction", {})
            program = loss_program(self._model, int(algorithm), loss, prediction,
                                   train_prediction.get(str(algorithm)))
            self._loss_programs[key] = program
        self._check_names(feeds, "evaluate")
        checked = program.check_feeds(feeds, False, "evaluate")
        executor = self._executor(program)
        with self._store.snapshot(program.state_inputs) as snap:
            return executor.run_bound(checked, snap, {}, program.outputs)

    def initialize(self) -> None:
        """Run every initialization graph in order and apply its initialization_binding.

        On a session loaded from a checkpoint (or trained by ``fit``) this
        discards the training done so far, so it warns."""
        position = self.fit_position
        if position is not None and position.get("source") == "checkpoint":
            warnings.warn(
                f"initialize() resets the training state of a checkpoint that had finished "
                f"{position.get('epoch', 0)} epoch(s); a following fit starts at epoch 0",
                UserWarning, stacklevel=2,
            )
        self.fit_position = None
        # memory="lean": readers wait until the commit (not only the in-place writes).
        with self._lock, self._store.exclusive(self._lean):
            pending: dict[str, Any] = {}
            error: BaseException | None = None
            wrote = False
            try:
                for program in self._initializations:
                    if program is None or not program.bindings:
                        continue
                    # memory="lean": an initialization graph reads no state
                    # (R6), so its values may go straight into the current buffers.
                    inplace = set(program.bound_keys) if self._lean else set()
                    wrote = wrote or bool(inplace)
                    self._run_and_stage(program, {}, pending, False, "initialization_binding",
                                        inplace=inplace)
            except BaseException as exc:
                error = exc
                if wrote:
                    self._store.commit(pending)
                    pending = {}
                    exc.add_note("initialize(): memory='lean': some state was already reset in place")
            self._agree(error, "initialize()")
            self._store.commit(pending)
            if self._large:  # rarely run again: let their weights' maps go
                for program in self._initializations:
                    if program is not None:
                        self._executors.pop(id(program), None)
            self._local_rows = 0  # accumulated gradient sums start over
            if self._dp is not None:  # random initializations differ: rank 0's win
                self._broadcast_state([k for k in self._model.state if k in pending])

    def run(
        self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Inference: the main graph with the current state.  Never changes state.

        Inputs that also have an initializer (IR 3 style), state variables
        included, may be fed to override their value for this call only.
        Safe to call from other threads while training: it reads a pinned,
        consistent snapshot of the state."""
        self._check_names(feeds, "run")
        program = self._inference
        names = list(output_names) if output_names is not None else program.outputs
        bad = [n for n in names if n not in program.outputs]
        if bad:
            raise ValueError(
                f"run: {bad[0]!r} is not an output of the main graph; outputs are {program.outputs}"
            )
        user = program.check_feeds(feeds, True, "run")
        reads = [n for n in program.state_inputs if n not in user]
        executor = self._executor(program)
        with self._store.snapshot(reads) as snap:
            return executor.run_bound(user, snap, {}, names)

    def load_state(self, mapping: Mapping[str, Any]) -> None:
        """Set some state variables.  Names, dtypes and shapes must match.

        Data-parallel (``comm``): every rank calls it, and the variables rank 0
        set take rank 0's values everywhere."""
        error: BaseException | None = None
        staged: dict[str, np.ndarray] = {}
        try:
            staged = self._checked_state(mapping)
        except BaseException as exc:
            error = exc
        self._agree(error, "load_state()")
        with self._lock:
            self._store.replace(staged)
        if self._dp is not None and self._dp.size > 1:
            names = self._dp.comm.allgather_object(sorted(staged))[0]
            self._broadcast_state(names)

    def _checked_state(self, mapping: Mapping[str, Any]) -> dict[str, np.ndarray]:
        staged: dict[str, np.ndarray] = {}
        for name, value in mapping.items():
            var = self._model.state.get(name)
            if var is None:
                raise KeyError(f"load_state: {name!r} is not a state variable")
            arr = value if isinstance(value, np.ndarray) else np.asarray(value, dtype=var.dtype)
            if arr.dtype != var.dtype:
                raise ValueError(f"load_state: {name!r} must be {var.dtype}, got {arr.dtype}")
            if tuple(arr.shape) != var.shape:
                raise ValueError(
                    f"load_state: {name!r} must have shape {list(var.shape)}, got {list(arr.shape)}"
                )
            staged[name] = arr
        return staged


