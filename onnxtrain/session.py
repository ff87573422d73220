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

import math
import os
import threading
import warnings
import weakref
from collections.abc import Container, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from . import mapped
from .combine import uses_preview_ops
from .errors import TrainingModelError
from .inplace import inplace_keys, with_scratch_outputs
from .executor import LARGE_MODEL_BYTES, Executor, default_session_options, device_of, nchwc_block, state_device
from .storage import came_external, external_data_threshold, materialized, tensor_bytes, write_model
from .metadata import model_metadata, read_position, write_position
from .model import ModelLike, TrainingModel, load, validate
from .passes import KernelChoice, check_fused_kernels, inference_export, kernel_choice
from .programs import (
    Program,
    SplitAlgorithm,
    algorithm_programs,
    check_feed_names,
    inference_program,
    initialization_program,
    loss_program,
)
from .comm import Communicator, SingleProcess, as_communicator
from .distributed import BUCKET_BYTES, DataParallel, rows_of, threads_per_rank
from .state import StateStore


class StateView(Mapping):
    """Read-only view of one consistent state version: each lookup returns a numpy copy.

    Creating the view pins the current buffers (a training step never writes
    into a pinned buffer), so ``dict(sess.state)`` taken while another thread
    trains never mixes two steps; the pins go when the view is collected."""

    def __init__(self, store: StateStore) -> None:
        snap = store.snapshot()
        self._values = snap.__enter__()
        weakref.finalize(self, snap.__exit__, None, None, None)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._values:
            raise KeyError(name)
        return np.array(self._values[name].numpy(), copy=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.items())
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
        self._plans: tuple[Program, tuple] | None = None
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
        dicts (then ``y`` stays None).  See ``onnxtrain.fit.fit`` and docs/fit.md."""
        from .fit import fit

        return fit(self, x, y, epochs=epochs, batch_size=batch_size,
                   validation_data=validation_data, validation_split=validation_split,
                   shuffle=shuffle, seed=seed, callbacks=callbacks, metrics=metrics,
                   initial_epoch=initial_epoch, progress=progress, drop_last=drop_last,
                   log_every=log_every, cycle=cycle)

    def evaluate(
        self, x: Any, y: Any = None, *, batch_size: int = 256, metrics: Any = None
    ) -> dict[str, float]:
        """Loss and metrics over ``x`` (and ``y``) without changing state (``onnxtrain.fit.evaluate``)."""
        from .fit import evaluate

        return evaluate(self, x, y, batch_size=batch_size, metrics=metrics)

    def predict(
        self, x: Any, *, batch_size: int = 256, outputs: str | Sequence[str] | None = None
    ) -> Any:
        """Run the main graph batch by batch (``onnxtrain.fit.predict``)."""
        from .fit import predict

        return predict(self, x, batch_size=batch_size, outputs=outputs)

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

    # ------------------------------------------------------------- execution
    def _program_model(self, program: Program) -> tuple[onnx.ModelProto, str | None]:
        """The model to run for ``program`` and the custom-op library it needs
        (``passes.kernel_choice`` decides, once per training algorithm)."""
        if program not in self._algorithms and not any(program is s.b for s in self._splits):
            return program.model, None
        choice = self._executed.get(id(program))
        if choice is None:
            choice = kernel_choice(program.model, self._fused_kernels, device_of(self._providers)[0],
                                   nchwc_block)
            choice = self._executed[id(program)] = self._lean_rewrite(program, choice)
        if choice.note:
            self.fused_kernels_note = choice.note
        return choice.model, choice.library

    def _lean_rewrite(self, program: Program, choice: KernelChoice) -> KernelChoice:
        """memory="lean": an update program's temporaries over its gradient
        buffers (``inplace.with_scratch_outputs``); other programs as they are."""
        if not self._lean or not any(program is s.b for s in self._splits):
            return choice
        model, scratch = with_scratch_outputs(choice.model, set(program.feeds))
        self._scratch[id(program)] = scratch
        return KernelChoice(model, choice.library, choice.note)

    def _executor(self, program: Program) -> Executor:
        key = id(program)
        ex = self._executors.get(key)
        if ex is None:
            model, library = self._program_model(program)
            # A large model's initialization folded would hold a copy of what it fills.
            fold = not (self._large and any(program is p for p in self._init_programs or ()))
            # MatMulNBits' backward unpacks frozen codes (initializers only): folded,
            # every quantized weight would be held dequantized, in float (QLoRA).
            fold = fold and not _unpacks_codes(model)
            # A step that fetches nothing may skip the outputs only fetching reads
            # (not where lean memory's in-place writes follow the full program's order).
            prune_unfetched = any(program is p for p in self._algorithms) and not (self._lean or self._large)
            try:
                ex = Executor(model, self._providers, self._session_options, program.label, library,
                              large=self._large, fold_constants=fold,
                              mem_pattern=not self._recompute, prune_unfetched=prune_unfetched)
            except TrainingModelError as exc:
                if library is None or self._fused_kernels:
                    raise
                # The standard program always works where the fused one cannot load.
                self.fused_kernels_note = f"onnxruntime did not load the fused kernels: {exc}"
                choice = self._executed[key] = self._lean_rewrite(program, KernelChoice(program.model))
                ex = Executor(choice.model, self._providers, self._session_options, program.label,
                              large=self._large, fold_constants=fold,
                              mem_pattern=not self._recompute)
            self._executors[key] = ex
        return ex

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
            buffer.update_inplace(np.asarray(staged[source].numpy()))  # one output, two variables
            staged[key] = buffer
        if self._check_finite:
            _check_finite(program, staged, field)
        pending.update(staged)
        return outputs

    def _diagnose(
        self, program: Program, feeds: dict[str, np.ndarray], state_in: dict[str, Any], field: str
    ) -> None:
        """After a failed bound run: rerun plainly to name a bad bound value."""
        arrays = dict(feeds)
        arrays.update({n: np.asarray(v.numpy()) for n, v in state_in.items()})
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

    # ------------------------------------------------------- data parallel
    def _cut_options(self, index: int) -> dict | None:
        """How ``training_info[index]`` is cut for data-parallel training
        (None without ``comm``): the rank-local state and the values to
        reduce that the builder recorded (metadata ``onnxtrain.data_parallel``)."""
        if self._dp is None:
            return None
        info = self._metadata.get("data_parallel")
        info = info if isinstance(info, dict) else {}
        bound = {b.key for b in self._model.proto.training_info[index].update_binding}
        local = [n for n in info.get("local", []) if n in bound]
        reduce = (info.get("reduce") or {}).get(str(index))
        return {"local": local, "reduce": list(reduce) if reduce else None}

    def _inplace_keys(self, program: Program) -> set[str]:
        """The variables ``program`` (an update program B) may write in place,
        judged on the model onnxruntime actually runs (``onnxtrain.inplace``)."""
        keys = self._inplace.get(id(program))
        if keys is None:
            self._executor(program)  # settles fused or standard kernels
            choice = self._executed.get(id(program))
            model = choice.model if choice is not None else program.model
            keys = self._inplace[id(program)] = inplace_keys(
                model.graph, list(zip(program.bound_keys, program.bound_values)))
        return keys

    def _broadcast_state(self, names: Sequence[str]) -> None:
        """Rank 0's values of the state variables ``names`` to every rank."""
        dp = self._dp
        assert dp is not None
        if dp.size == 1:
            return
        if dp.rank == 0:
            arrays = self._store.to_numpy(names)
        else:
            arrays = {n: np.empty(self._model.state[n].shape, self._model.state[n].dtype)
                      for n in names}
        dp.broadcast_arrays({n: a.reshape(-1) for n, a in arrays.items()})
        if dp.rank != 0:
            with self._lock:
                self._store.replace(arrays)

    def _agree(self, error: BaseException | None, what: str) -> None:
        """Raise ``error`` here, or DistributedStepError elsewhere, if any rank failed."""
        if self._dp is not None:
            self._dp.agree(error, 0, what)
        elif error is not None:
            raise error

    def _data_parallel_step(self, indices: Sequence[int], feeds: Mapping[str, Any],
                            fetch: bool) -> dict[str, np.ndarray]:
        """``train_step`` of a data-parallel session: per algorithm, program A
        (forward + backward) into the gradient buffers, the ranks agree, the
        buffers are reduced, program B (update), the ranks agree; then every
        rank commits (``onnxtrain.distributed``)."""
        dp = self._dp
        assert dp is not None
        pending: dict[str, Any] = {}
        outputs: dict[str, np.ndarray] = {}
        local_rows = self._local_rows
        with self._lock:
            for i in indices:
                split, buffers = self._splits[i], self._grad_buffers[i]
                where = f"train_step (training_info[{i}])"
                error: BaseException | None = None
                rows = 0
                try:
                    self._check_names(feeds, "train_step")
                    checked = self._algorithms[i].check_feeds(feeds, False, "train_step")
                    rows = rows_of(checked)
                    a = split.a
                    wanted = {n: v for n, v in checked.items() if n in a.feeds or n in a.optional_feeds}
                    outputs.update(self._run_and_stage(
                        a, wanted, pending, fetch, "update_binding",
                        extra_out=buffers.ortvalues))  # every reduced value, by name
                except BaseException as exc:  # KeyboardInterrupt too: the others must hear of it
                    error = exc
                weight = rows + (local_rows if split.sums else 0)
                total = dp.agree(error, weight, where)
                dp.reduce(buffers, weight, total)
                wrote = False  # whether state was written in place (memory="lean")
                try:
                    if split.b is not None:
                        b = split.b
                        inplace = self._inplace_keys(b) if self._lean else set()
                        if inplace and self._check_finite:
                            _check_finite_arrays(b.label, buffers.views, "gradients")
                        scratch = self._scratch.get(id(b), {})
                        with self._store.exclusive(bool(inplace)):
                            wrote = bool(inplace)
                            outputs.update(self._run_and_stage(
                                b, {}, pending, fetch, "update_binding",
                                extra_in={n: buffers.ortvalues[n] for n in b.feeds},
                                extra_out={v: buffers.ortvalues[n] for v, n in scratch.items()},
                                inplace=inplace))
                    if split.bn:
                        targets = self._store.targets([k for k, _ in split.bn])
                        staged = {}
                        for (key, value), target in zip(split.bn, targets):
                            target.update_inplace(buffers.views[value])
                            staged[key] = target
                        if self._check_finite:
                            _check_finite(split.a, staged, "update_binding")
                        pending.update(staged)
                except BaseException as exc:
                    error = exc
                    if wrote:  # nothing to roll back to: keep what the update wrote
                        self._store.commit(pending)
                        pending = {}
                        exc.add_note(f"{where}: memory='lean': the optimizer had started writing "
                                     "the new state in place; the state holds the update as far as it got")
                dp.agree(error, 0, where)
                if split.sums:
                    local_rows = 0
                elif split.a.bindings:
                    local_rows += rows
            self._store.commit(pending)  # all bindings at once, on every rank
            self._local_rows = local_rows
        return outputs

    # ------------------------------------------------------------ step plans
    def _plan_steps(self, program: Program) -> None:
        """Prepare the two alternating steps of ``program`` after a committed
        one (``StateStore.plan_cycle``); the general path runs whenever they miss."""
        self._plans = None
        if self._check_finite or program.bound_copies or self._store.pinned:
            return
        executor = self._executor(program)
        outputs = program.bound_values

        def bind(state_in: dict, targets: list) -> Any:
            return executor.binding(state_in, dict(zip(outputs, targets)))

        cycle = self._store.plan_cycle(program.state_inputs, program.bound_keys, bind)
        if cycle is not None:
            self._plans = (program, cycle)

    def _planned_step(self, program: Program, feeds: dict, fetch: bool) -> dict | None:
        """A step through a plan, or None when no plan applies (see ``_plan_steps``)."""
        plans = self._plans
        if plans is None or plans[0] is not program:
            return None
        store = self._store
        plan = store.plan_for_current(plans[1])
        if plan is None:
            return None
        executor = self._executor(program)
        names = program.returned if fetch else ()
        try:
            outputs = executor.run_binding(plan.binding, feeds, names, len(program.bound_values))
        except RuntimeError:
            self._diagnose(program, feeds, plan.state_in, "update_binding")
            raise
        if not store.install(plan):  # pragma: no cover
            return None  # (cannot happen: the store only changes under our lock)
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
        with self._lock:
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
                    with self._store.exclusive(bool(inplace)):
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

    # ---------------------------------------------------------------- export
    def to_model(self, training: bool = False) -> onnx.ModelProto:
        """The model with the current state written into its initializers.

        ``training=False``: a plain inference model (training_info dropped).
        ``training=True``: the whole training model, a complete checkpoint.
        The result is self-contained, weights the session maps from external
        data included, unless its tensors exceed the external-data threshold
        (``ONNXTRAIN_EXTERNAL_DATA_THRESHOLD``, 1.5 GiB by default; protobuf
        cannot hold 2 GiB): those then stay references to their files
        (``onnxtrain.mapped``), which a ``TrainingSession`` of this process
        accepts.  ``export`` writes any size to a file, streamed."""
        with self._store.snapshot() as snap:
            state = {n: np.array(v.numpy(), copy=True) for n, v in snap.items()}
        out = self._snapshot(training, state, None)
        if tensor_bytes(out) <= external_data_threshold():
            out = materialized(out)
        return out

    def _snapshot(self, training: bool, state: Mapping[str, np.ndarray],
                  deferred: dict[str, mapped.Deferred] | None) -> onnx.ModelProto:
        """``to_model``'s result; with ``deferred``, state values and merged
        weights are placeholders registered there (written by ``export``
        straight from their buffers)."""
        src = self._model.proto
        out = onnx.ModelProto()
        out.CopyFrom(src)
        if not training:
            del out.training_info[:]
        _write_state(out.graph, state, deferred)
        # The fit position: where training stands (none for an inference model).
        write_position(out, self.fit_position if training else None)
        if training:
            for ti in out.training_info:
                _write_state(ti.algorithm, state, deferred)
        else:
            out = inference_export(out, deferred)
        return out

    def export(
        self, path: str | os.PathLike, training: bool = False, external_data: bool | None = None
    ) -> Path:
        """Write the current model to ``path`` atomically (temp file, fsync, rename).

        ``external_data``: None writes tensors to a data file beside the model
        when they exceed ``ONNXTRAIN_EXTERNAL_DATA_THRESHOLD`` (1.5 GiB by
        default; protobuf cannot hold 2 GiB) or the session maps weights
        from external data; True or False forces it.  Tensors are streamed: state from its buffers (pinned meanwhile, so a
        step from another thread writes elsewhere), mapped weights file to
        file, merged LoRA weights block by block."""
        deferred: dict[str, mapped.Deferred] = {}
        if external_data is None and came_external(self._model.proto):
            external_data = True  # a model loaded with external data keeps it
        with self._store.snapshot() as snap:
            state = {n: v.numpy() for n, v in snap.items()}  # views of the pinned buffers
            model = self._snapshot(training, state, deferred)
            return write_model(model, path, external_data=external_data, deferred=deferred)


def _unpacks_codes(model: onnx.ModelProto) -> bool:
    """Whether a program holds a com.microsoft MatMulNBits node (4/8-bit codes)."""
    return any(n.op_type == "MatMulNBits" and n.domain == "com.microsoft" for n in model.graph.node)


def _write_state(graph: onnx.GraphProto, state: Mapping[str, np.ndarray],
                 deferred: dict[str, mapped.Deferred] | None = None) -> None:
    """Write state values into ``graph``'s initializers: copies, or with
    ``deferred`` placeholders for the arrays themselves."""

    def put(t: onnx.TensorProto, name: str) -> None:
        if deferred is None:
            t.CopyFrom(numpy_helper.from_array(state[name], name))
        else:
            t.Clear()
            t.name = name
            mapped.defer(t, f"state/{name}", mapped.of_array(np.asarray(state[name])), deferred)

    for t in graph.initializer:
        if t.name in state:
            put(t, t.name)
    sparse_state = [st for st in graph.sparse_initializer if st.values.name in state]
    if sparse_state:
        # Sparse state variables are written back dense: training fills them in.
        kept = [st for st in graph.sparse_initializer if st.values.name not in state]
        del graph.sparse_initializer[:]
        graph.sparse_initializer.extend(kept)
        for st in sparse_state:
            put(graph.initializer.add(), st.values.name)


def _check_finite_arrays(label: str, arrays: Mapping[str, np.ndarray], what: str) -> None:
    """Refuse non-finite ``what`` (numpy arrays) before they reach the state."""
    bad = [k for k, a in arrays.items() if a.dtype.kind in "fc" and not np.isfinite(a).all()]
    if bad:
        raise FloatingPointError(f"{label}: non-finite {what} {bad}; nothing was committed")


def _check_finite(program: Program, targets: Mapping[str, Any], field: str) -> None:
    """Refuse to commit NaN or Inf into state (check_finite=True)."""
    bad = []
    for key, value in targets.items():
        arr = np.asarray(value.numpy())
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            bad.append(key)
    if bad:
        raise FloatingPointError(
            f"{program.label}: the step would write non-finite values into state "
            f"variable(s) {bad}; nothing was committed"
        )
