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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .errors import TrainingModelError
from .export import model as model_export
from .io import mapped
from .io.metadata import model_metadata, read_position
from .io.model import ModelLike, held, validate
from .lower.executed import check_fused_kernels
from .lower.pipeline import note_exact_quantized_products
from .lower.programs import ProgramSet
from .parallel.comm import Communicator, SingleProcess, as_communicator
from .parallel.data_parallel import BUCKET_BYTES, DataParallel, threads_per_rank
from .parallel.step import DataParallelStep
from .runtime.executor import as_numpy, device_of, state_device
from .runtime.firstrun import load_faulting_ahead, wanted
from .runtime.options import default_session_options
from .runtime.runner import ProgramRunner, RunOptions, fetched_names, specialize_default
from .runtime.settings import Settings
from .runtime.state import StateStore, StateView
from .train import loop


class TrainingSession:
    """Runs an ONNX training model on onnxruntime.

    >>> import os, tempfile
    >>> import numpy as np
    >>> import onnx
    >>> from onnxtrain.demo import build_classifier
    >>> tmp = tempfile.TemporaryDirectory()
    >>> path = os.path.join(tmp.name, "model.onnx")
    >>> onnx.save(build_classifier(), path)      # any ONNX training model
    >>> sess = TrainingSession(path)
    >>> sess.initialize()
    >>> x = np.random.default_rng(0).random((8, 64), np.float32)
    >>> out = sess.train_step({"X": x, "label": np.arange(8)})
    >>> sess.run({"X": x})["logits"].shape
    (8, 10)
    >>> sess.export(os.path.join(tmp.name, "trained.onnx")).name
    'trained.onnx'
    >>> tmp.cleanup()
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
        the spec's Adam, Momentum and Adagrad), some layers' gradients and a
        decoder's elementwise chains as fused kernels (``onnxtrain.kernels``, a
        custom-op library built on first use) instead of chains of standard
        ones.  The optimizer and layer kernels give the same results bit for
        bit; the row sums of RMSNorm, softmax's gradient and the vocabulary
        cross-entropy run in double, as close to float64 as the standard chain
        or closer, not bit for bit (docs/fused-kernels.md).  None (the
        default) uses it where it can (CPU, a C compiler, not turned off with
        ``ONNXTRAIN_FUSED_KERNELS=0``); True requires it; False never uses it.

        ``comm``: data-parallel training over an mpi4py communicator (or an
        ``onnxtrain.comm.Communicator``); every rank constructs the session,
        and rank 0's state is broadcast.  ``train_step`` then takes this
        rank's shard of the global batch, and the optimizer sees the gradient
        of the global batch: local gradients combined by ``reduction``
        (``"weighted"`` by each rank's rows, exact for mean-reduced losses;
        ``"mean"``; ``"sum"``) and summed in place in buckets of
        ``bucket_bytes``.  See ``onnxtrain.parallel`` and docs/distributed.md.

        ``memory``: ``"safe"`` (default) double-buffers every state variable a
        step writes, so a failed step changes nothing.  ``"lean"`` keeps one
        buffer where it can (``onnxtrain.lower.inplace``): each algorithm runs as
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
        lean = memory == "lean"
        if comm is None:
            # memory="lean" runs the data-parallel cut, with a world of one.
            dp = DataParallel(SingleProcess(), "sum", bucket_bytes) if lean else None
            self._setup(model, providers, session_options, fused_kernels, check_finite, lean, dp)
            return
        dp = DataParallel(as_communicator(comm), reduction, bucket_bytes)
        if session_options is None and not os.environ.get("ONNXTRAIN_THREADS"):
            # Ranks on one machine share its cores (see data_parallel.threads_per_rank).
            session_options = default_session_options(threads_per_rank(dp.comm.local_size()))
        error: BaseException | None = None
        try:  # a rank that cannot load the model must not leave the others waiting
            if device_of(list(providers) if providers else None)[0] != "cpu":
                raise ValueError("comm=: data-parallel training runs on the CPU provider")
            self._setup(model, providers, session_options, fused_kernels, check_finite, lean, dp)
        except BaseException as exc:
            error = exc
        dp.agree(error, 0, "TrainingSession()")
        self._broadcast_state(list(self._model.state))

    def _setup(self, model: ModelLike, providers: Sequence[Any] | None, session_options: Any,
               fused_kernels: bool | None, check_finite: bool, lean: bool, dp: DataParallel | None) -> None:
        """Load and validate the model, build every program and the parts that run them, seed the state."""
        ahead = wanted(providers, session_options, dp is not None)
        proto, base, first = load_faulting_ahead(model, ahead)  # (on another core: runtime.firstrun)
        # (held: no large tensor stays in its protobuf; the caller's model is not kept)
        tm = self._model = held(validate(proto, base, tensors_checked=True))  # load() checked
        # The data files its weights are mapped from stay while it lives (storage).
        weakref.finalize(self, mapped.hold(tm.proto))
        providers = list(providers) if providers else None
        #: The transaction's lock: one writer at a time.
        self._lock = threading.RLock()
        #: The model's onnxtrain.* metadata, decoded once (the model never changes).
        metadata = model_metadata(proto)
        # Build every program now, so that model errors surface at construction.
        note_exact_quantized_products(tm)
        self._programs = ProgramSet(tm, metadata, data_parallel=dp is not None)
        check_fused_kernels(fused_kernels, device_of(providers)[0])
        self._store = StateStore(
            tm.initial_values(tm.state, readonly=True),
            state_device(providers),
            adopt=tm.fresh_values(),
        )
        self._runner = ProgramRunner(self._programs, self._store, RunOptions(
            providers, session_options, fused_kernels, lean=lean,
            # Large weights: onnxruntime frees step temporaries; small: steps keep its memory pattern.
            weight_bytes=tm.tensor_bytes(),
            # Built with recompute= (saving activation memory): no onnxruntime memory pattern.
            recompute=metadata.get("recompute") not in (None, False),
            check_finite=check_finite,
            # Programs specialized to their feed shapes (``lower.specialize``) unless ONNXTRAIN_SPECIALIZE=0.
            specialize=specialize_default()), first)
        self._parallel = DataParallelStep(dp, self._programs, self._runner, self._store) if dp else None
        self._settings = Settings(tm, metadata, self._store)
        #: Where the fit loop stands: {"epoch": epochs done, "batch": batches done
        #: in the next epoch, "step": steps done, "source": "checkpoint" | "fit"}
        #: or None.  Read from a checkpoint's metadata, kept up to date by ``fit``
        #: and written back by ``export(training=True)``.
        self.fit_position: dict[str, Any] | None = read_position(tm.proto)

    # ------------------------------------------------------------ properties
    @property
    def state(self) -> Mapping[str, np.ndarray]:
        """Every state variable -> numpy array (copies; the mapping is read-only)."""
        return StateView(self._store)

    @property
    def comm(self) -> Communicator | None:
        """The communicator of a data-parallel session (``comm=``), else None."""
        return self._parallel.comm if self._parallel is not None else None

    @property
    def communication_seconds(self) -> float:
        """Seconds this rank has spent in the collectives of data-parallel
        steps (waiting for slower ranks included); 0.0 without ``comm``."""
        return self._parallel.dp.comm_seconds if self._parallel is not None else 0.0

    @property
    def num_algorithms(self) -> int:
        return len(self._programs.algorithms)

    @property
    def model(self) -> onnx.ModelProto:
        """The loaded model as given (initializers hold the initial values)."""
        return self._model.proto

    @property
    def fused_kernels_note(self) -> str:
        """Why fused kernels are not in use (empty while they are, or not yet asked)."""
        return self._runner.fused_kernels_note

    def programs(self, executed: bool = False) -> dict[str, onnx.ModelProto]:
        """The standard-op ONNX model of every program, by label (for inspection).

        ``executed=True``: the models onnxruntime runs instead, which differ
        where fused kernels replace standard ones (see ``fused_kernels``)."""
        progs = self._programs

        def shown(p: Any) -> onnx.ModelProto:
            return self._runner.executed_model(p) if executed else p.model

        out = {"inference": progs.inference.model}
        for p in progs.algorithms:
            out[p.label] = shown(p)
        for split in progs.splits:
            for p in (split.a, split.b):
                if p is not None:
                    out[p.label] = shown(p)
        for p in progs.initializations:
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
        return [dict(p.feeds) for p in self._programs.algorithms]

    @property
    def inference_inputs(self) -> dict[str, onnx.ValueInfoProto]:
        """The inputs run() must feed (name -> ValueInfoProto)."""
        return dict(self._programs.inference.feeds)

    @property
    def inference_outputs(self) -> list[str]:
        return list(self._programs.inference.outputs)

    @property
    def algorithm_outputs(self) -> list[list[str]]:
        """Per algorithm: the outputs train_step returns (those no update_binding consumes)."""
        return [list(p.returned) for p in self._programs.algorithms]

    @property
    def state_info(self) -> dict[str, Any]:
        """Every state variable -> StateVar (name, origin graph, dtype, shape)."""
        return dict(self._model.state)

    # ------------------------------------------------------------ the steps
    def train_step(
        self, feeds: Mapping[str, Any], algorithm: int | None = None, fetch: bool | Iterable[str] = True
    ) -> dict[str, np.ndarray]:
        """Run one training step and commit its update_binding.

        ``algorithm=i`` runs training_info[i]; ``None`` runs every algorithm in
        order (one spec iteration), each seeing the state its predecessors
        wrote.  The state changes only if every run succeeds.  Returns every
        combined-graph output that no update_binding consumes (later
        algorithms win on equal names); ``fetch=False`` returns nothing and
        ``fetch=["loss"]`` those named: the step then skips what only the
        others need (e.g. the inference-mode forward pass of BatchNorm)."""
        algorithms = self._programs.algorithms
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
        fetch = fetch if fetch is True or fetch is False else fetched_names(programs, fetch)
        if self._parallel is not None:
            indices = range(len(algorithms)) if algorithm is None else (int(algorithm),)
            with self._lock:
                return self._parallel.step(indices, feeds, fetch)
        checked = self._programs.checked(programs, feeds, "train_step")
        runner = self._runner
        with self._lock:
            if len(programs) == 1:
                # The steady state: one prepared step, committed (``ProgramRunner.plan_steps``).
                outputs = runner.planned_step(programs[0], checked[0], fetch)
                if outputs is not None:
                    return outputs
            pending: dict[str, Any] = {}
            outputs = {}
            for program, program_feeds in zip(programs, checked):
                outputs.update(runner.run_and_stage(program, program_feeds, pending, fetch, "update_binding"))
            self._store.commit(pending)  # all bindings at once (R9)
            if len(programs) == 1:
                runner.plan_steps(programs[0])
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
        n = len(self._programs.algorithms)
        if not (type(algorithm) is int or isinstance(algorithm, np.integer)) or not 0 <= algorithm < n:
            raise ValueError(f"evaluate: algorithm must be an index in [0, {n}), got {algorithm!r}")
        program = self._programs.loss(int(algorithm), loss, prediction)
        self._programs.check_names(feeds, "evaluate")
        checked = program.check_feeds(feeds, False, "evaluate")
        executor = self._runner.executor(program, checked)
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
        runner = self._runner
        lean = runner.options.lean
        # memory="lean": readers wait until the commit (not only the in-place writes).
        with self._lock, self._store.exclusive(lean):
            pending: dict[str, Any] = {}
            error: BaseException | None = None
            wrote = False
            try:
                for program in self._programs.initializations:
                    if program is None or not program.bindings:
                        continue
                    # memory="lean": an initialization graph reads no state
                    # (R6), so its values may go straight into the current buffers.
                    inplace = set(program.bound_keys) if lean else set()
                    wrote = wrote or bool(inplace)
                    runner.run_and_stage(program, {}, pending, False, "initialization_binding",
                                         inplace=inplace)
            except BaseException as exc:
                error = exc
                if wrote:
                    self._store.commit(pending)
                    pending = {}
                    exc.add_note("initialize(): memory='lean': some state was already reset in place")
            self._agree(error, "initialize()")
            self._store.commit(pending)
            if runner.options.large:  # rarely run again: let their weights' maps go
                runner.forget(self._programs.built_initializations)
            if self._parallel is not None:
                self._parallel.local_rows = 0  # accumulated gradient sums start over
                # random initializations differ: rank 0's win
                self._broadcast_state([k for k in self._model.state if k in pending])

    def run(
        self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Inference: the main graph with the current state.  Never changes state.

        Inputs that also have an initializer (IR 3 style), state variables
        included, may be fed to override their value for this call only.
        Safe to call from other threads while training: it reads a pinned,
        consistent snapshot of the state."""
        self._programs.check_names(feeds, "run")
        program = self._programs.inference
        names = list(output_names) if output_names is not None else program.outputs
        bad = [n for n in names if n not in program.outputs]
        if bad:
            raise ValueError(
                f"run: {bad[0]!r} is not an output of the main graph; outputs are {program.outputs}"
            )
        user = program.check_feeds(feeds, True, "run")
        reads = [n for n in program.state_inputs if n not in user]
        executor = self._runner.executor(program, user)
        with self._store.snapshot(reads) as snap:
            return executor.run_bound(user, snap, {}, names)

    # ------------------------------------------------------------------ state
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
        if self._parallel is not None and self._parallel.dp.size > 1:
            self._broadcast_state(self._parallel.rank0_names(staged))

    def _agree(self, error: BaseException | None, what: str) -> None:
        """Raise ``error`` here, or DistributedStepError elsewhere, if any rank failed."""
        if self._parallel is not None:
            self._parallel.agree(error, what)
        elif error is not None:
            raise error

    def _broadcast_state(self, names: Sequence[str]) -> None:
        """Rank 0's values of the state variables ``names`` to every rank."""
        arrays = self._parallel.broadcast(names) if self._parallel is not None else None
        if arrays is not None:
            with self._lock:
                self._store.replace(arrays)

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



    # ---------------------------------------------------------------- settings
    @property
    def learning_rate(self) -> float:
        """The base learning rate (a schedule scales it), read from its state variable.

        Setting it changes the next step and every later one, nothing is
        rebuilt; the value is state, so it is saved in a checkpoint and
        ``initialize()`` resets it to the rate the model was built with."""
        return self._settings.value("learning_rate")

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self.load_state(self._settings.staged("learning_rate", value))

    @property
    def current_learning_rate(self) -> float:
        """The rate the next ``train_step`` update uses (read-only): the base
        ``learning_rate`` times the schedule's factor at the step counter (ONNX
        Runtime training's ``get_learning_rate()``).  It runs the algorithm
        graph's own nodes that compute the rate (metadata
        ``onnxtrain.learning_rate`` names their result) on the current state,
        the values the step reads, so it is exact for every schedule.  A model
        without a schedule, or built before the rate was recorded: the base rate."""
        return self._settings.current_learning_rate()

    @property
    def clip_grad_norm(self) -> float:
        """The global-norm clipping threshold of a model built with
        ``clip_grad_norm=c``, read from its state variable; setting it works
        like ``learning_rate`` (the next step, nothing rebuilt, checkpointed,
        reset by ``initialize()``)."""
        return self._settings.value("clip_grad_norm")

    @clip_grad_norm.setter
    def clip_grad_norm(self, value: float) -> None:
        self.load_state(self._settings.staged("clip_grad_norm", value))

    @property
    def schedule_total_steps(self) -> int | None:
        """The updates a schedule built without a total (``build.cosine()``) runs
        over: None until set.  ``fit`` sets it when it starts (epochs x updates
        per epoch) unless it is set; it is state, so a checkpoint keeps it and
        ``initialize()`` unsets it.  A model without such a schedule raises."""
        value = self._settings.value("schedule")
        return int(value) if value > 0 else None

    @schedule_total_steps.setter
    def schedule_total_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"schedule_total_steps must be an integer >= 1, got {value!r}")
        self.load_state(self._settings.staged("schedule", int(value)))

    # ------------------------------------------------------------------ export
    def to_model(self, training: bool = False, outputs: Sequence[str] | None = None) -> onnx.ModelProto:
        """The model with the current state written into its initializers.

        ``training=False``: a plain inference model (training_info dropped),
        cut to ``outputs`` when given (main-graph values; the nodes they need
        stay, inputs nothing reads any more go, as ONNX Runtime training's
        ``export_model_for_inferencing(path, outputs)``), else to the outputs
        the model's metadata names (``onnxtrain.export_outputs``: a model
        imported from ONNX Runtime training artifacts exports its prediction,
        without the loss or the labels), else whole.
        ``training=True``: the whole training model, a complete checkpoint.
        The result is self-contained, weights the session maps from external
        data included, unless its tensors exceed the external-data threshold
        (``ONNXTRAIN_EXTERNAL_DATA_THRESHOLD``, 1.5 GiB by default; protobuf
        cannot hold 2 GiB): those then stay references to their files
        (``onnxtrain.io.mapped``), which a ``TrainingSession`` of this process
        accepts.  ``export`` writes any size to a file, streamed."""
        return model_export.to_model(self, training, outputs)

    def export(
        self, path: str | os.PathLike, training: bool = False, external_data: bool | None = None,
        outputs: Sequence[str] | None = None,
    ) -> Path:
        """Write the current model to ``path`` atomically (temp file, fsync, rename).

        ``training`` and ``outputs``: as ``to_model`` (for example
        ``export("model.onnx", outputs=["logits"])``).

        ``external_data``: None writes tensors to a data file beside the model
        when they exceed ``ONNXTRAIN_EXTERNAL_DATA_THRESHOLD`` (1.5 GiB by
        default; protobuf cannot hold 2 GiB) or the session maps weights
        from external data; True or False forces it.  Tensors are streamed: state from its buffers (pinned meanwhile, so a
        step from another thread writes elsewhere), mapped weights file to
        file, merged LoRA weights block by block."""
        with self._store.snapshot() as snap:
            pinned = _Pinned(self.model, {n: as_numpy(v) for n, v in snap.items()}, self.fit_position)
            return model_export.write(pinned, path, training, external_data, outputs)


@dataclass(frozen=True)
class _Pinned:
    """A ``SessionLike`` of a session whose state buffers are pinned while
    it is used: its state values are views of them, not copies."""

    model: onnx.ModelProto
    state: Mapping[str, np.ndarray]
    fit_position: dict[str, Any] | None
