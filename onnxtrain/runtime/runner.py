"""How a session runs its programs: one compiled executor per program, run
against the state store.

``ProgramRunner`` runs, once per program, the executed list of its role
(``lower.executed.EXECUTED``: fused kernels or standard ops; under
``memory="lean"`` an update's temporaries written over its gradient
buffers and its in-place plan), and compiles what it makes.  It runs a
program with its state read from the store and its bound values written
into spare buffers (``run_and_stage``), which the caller's transaction then
commits, and names the culprit when such a run fails on a bound value of
the wrong type.

The steady state of a plain training loop is cheaper still: after a
committed step ``plan_steps`` prepares the two alternating double-buffer
configurations of its program (``StateStore.plan_cycle``), and
``planned_step`` runs a step through one of them and installs it, with no
per-variable Python work.

A program run with feeds whose shapes its model leaves open (no shape, a
symbolic dimension) runs *specialized* to the shapes of those feeds
(``lower.specialize``): its shape arithmetic folded away, then made by its
role's executed list as the general program is (the kernel choice, with the
options the general one settled on), compiled once per shape seen (at most
``specialize.MAX_SPECIALIZATIONS``; further shapes run the general
program).  ``ONNXTRAIN_SPECIALIZE=0`` turns this off.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx

from ..core.env import env_switch
from ..errors import TrainingModelError
from ..lower import specialize
from ..lower.executed import ExecOptions, Execution, execute
from ..lower.programs import ALGORITHM, FORWARD, INITIALIZATION, UPDATE, Program, ProgramSet
from .executor import (
    LARGE_MODEL_BYTES,
    SMALL_MODEL_BYTES,
    Executor,
    as_numpy,
    copy_into,
    device_of,
    nchwc_block,
)
from .firstrun import FirstRun
from .state import StateStore

#: "0": programs are not specialized to the shapes of their feeds (default: they are).
SPECIALIZE_ENV = "ONNXTRAIN_SPECIALIZE"


def specialize_default() -> bool:
    """Whether programs are specialized to their feed shapes: yes, unless
    ``ONNXTRAIN_SPECIALIZE`` is 0 (or false, off, no)."""
    return env_switch(SPECIALIZE_ENV, "use 1 (specialize programs to their feed shapes) or 0") is not False


@dataclass(frozen=True)
class RunOptions:
    """How a session compiles and runs its programs (``TrainingSession``'s arguments).

    ``lean``: memory="lean" (update programs write over gradient buffers and,
    where the caller asks, state in place).  ``weight_bytes``: the model's
    weights and state (``TrainingModel.tensor_bytes``), which make it
    ``large`` or ``small``.  ``recompute``: built with activation recompute
    (no onnxruntime memory pattern anywhere).  ``specialize``: programs run
    specialized to the shapes of their feeds (``lower.specialize``; not for
    large models, whose copy would cost memory)."""

    providers: list | None = None
    session_options: Any = None
    fused_kernels: bool | None = None
    lean: bool = False
    weight_bytes: int = 0
    recompute: bool = False
    check_finite: bool = False
    specialize: bool = True

    @property
    def large(self) -> bool:
        """Weights past ``LARGE_MODEL_BYTES``: onnxruntime frees step
        temporaries, and no initialization program folds the values it fills."""
        return self.weight_bytes >= LARGE_MODEL_BYTES

    @property
    def small(self) -> bool:
        """Weights under ``SMALL_MODEL_BYTES``: training steps keep
        onnxruntime's memory pattern (``ProgramRunner``)."""
        return self.weight_bytes < SMALL_MODEL_BYTES


class ProgramRunner:
    """Compiles each program of a ``ProgramSet`` once and runs it against a ``StateStore``."""

    def __init__(self, programs: ProgramSet, store: StateStore, options: RunOptions,
                 first_run: FirstRun | None = None) -> None:
        self.programs = programs
        self.store = store
        self.options = options
        #: What the first run needs faulted in ahead, and its measure (``runtime.firstrun``):
        #: the spare buffers of the training steps are made now, faulted in on its thread.
        self.first_run = first_run or FirstRun()
        if self.first_run.on and not options.lean:  # (lean steps write over their buffers instead)
            self.first_run.touch(store.reserve([k for p in programs.algorithms for k in p.target_keys]))
        #: Why fused kernels are not in use (empty while they are, or not yet asked).
        self.fused_kernels_note = ""
        self._how = ExecOptions(options.fused_kernels, device_of(options.providers)[0], nchwc_block, options.lean)
        self._executors: dict[int, Executor] = {}
        #: What onnxruntime runs of each program (its executed list's result), by id.
        self._executed: dict[int, Execution] = {}
        #: The prepared steps of the last committed program: (program, cycle,
        #: executor, the feed shapes it is specialized to or None).
        self._plans: tuple[Program, tuple, Executor, tuple | None] | None = None
        #: Specialization (``lower.specialize``), by id: the feeds whose shapes the
        #: model leaves open, the executors by their shapes (None: the general
        #: one), and the shapes of the last run (its executor: ``plan_steps``).
        self._open_feeds: dict[int, tuple[str, ...]] = {}
        self._special: dict[int, dict[tuple, Executor | None]] = {}
        self._last_shapes: dict[int, tuple] = {}
        #: (program id, the names a step fetches) -> the outputs of the program among them.
        self._fetched: dict[tuple[int, frozenset], list[str]] = {}

    # ------------------------------------------------------------ compiling
    def executed_model(self, program: Program) -> onnx.ModelProto:
        """The model onnxruntime runs for ``program`` (it differs from
        ``program.model`` where fused kernels replace standard ones)."""
        return self._execution(program).model

    def _execution(self, program: Program, how: ExecOptions | None = None) -> Execution:
        """What onnxruntime runs of ``program``: its role's executed list,
        run once (again with ``how``, where the first result cannot load)."""
        ex = self._executed.get(id(program))
        if ex is None or how is not None:
            ex = self._executed[id(program)] = execute(program, self.programs.role(program), how or self._how)
        if ex.note:
            self.fused_kernels_note = ex.note
        return ex

    def executor(self, program: Program, feeds: Mapping[str, Any] | None = None) -> Executor:
        """``program``'s executor, compiled on first use; with ``feeds``, the
        one specialized to their shapes where there is one (``specialized``).
        Ready to run: what ``first_run`` faults in ahead is in place."""
        ex = None
        if feeds is not None and len(feeds) == len(program.feeds):  # (not with overrides)
            names = self.open_feeds(program)
            if names:
                ex = self.specialized(program, specialize.shape_key(feeds, names))
        if ex is None:
            ex = self._executors.get(id(program))
            if ex is None:
                ex = self._executors[id(program)] = self._compile(program)
        self.first_run.wait()
        return ex

    def open_feeds(self, program: Program) -> tuple[str, ...]:
        """The feeds of ``program`` whose shapes its model leaves open, where it
        may be specialized to them (else none)."""
        names = self._open_feeds.get(id(program))
        if names is None:
            names = ()
            if (self.options.specialize and not self.options.large
                    and self.programs.role(program) not in (INITIALIZATION, UPDATE)):
                names = specialize.dynamic_feeds(i for i in program.model.graph.input if i.name in program.feeds)
            self._open_feeds[id(program)] = names
        return names

    def specialized(self, program: Program, shapes: tuple) -> Executor | None:
        """The executor of ``program`` specialized to feeds of ``shapes`` (in
        ``open_feeds`` order), made on first use; None where the general one
        runs them (nothing folds, ``MAX_SPECIALIZATIONS`` reached, or
        onnxruntime refused the specialized model: the general one then says why)."""
        cache = self._special.setdefault(id(program), {})
        if shapes in cache:
            return cache[shapes]
        if len(cache) >= specialize.MAX_SPECIALIZATIONS:
            return None
        general = self._execution(program)  # the general program's kernels, settled at the first run as ever
        model = specialize.specialize(program.model, dict(zip(self.open_feeds(program), shapes)))
        ex = None
        if model is not None:
            # The specialization runs its role's executed list too (the kernel
            # choice...), with the options the general program settled on.
            run = execute(replace(program, model=model), self.programs.role(program), general.options)
            try:
                ex = self._compile(program, run)
            except TrainingModelError:
                ex = None
        cache[shapes] = ex
        return ex

    def _compile(self, program: Program, special: Execution | None = None) -> Executor:
        """Compile ``program`` (or ``special``, what its executed list made of a
        specialization of it)."""
        opts = self.options
        role = self.programs.role(program)
        run = special if special is not None else self._execution(program)
        # A large model's initialization folded would hold a copy of what it fills.
        # MatMulNBits' backward unpacks frozen codes (initializers only): folded,
        # every quantized weight would be held dequantized, in float (QLoRA).
        fold = not (opts.large and role == INITIALIZATION) and not _unpacks_codes(run.model)
        # A step that fetches nothing may skip the outputs only fetching reads
        # (not where lean memory's in-place writes follow the full program's order).
        prune_unfetched = role == ALGORITHM and not (opts.lean or opts.large)
        # A training step keeps no onnxruntime memory pattern unless the model is
        # small: planned at the first run and held besides the arena's blocks, it
        # cost L1 0.47 GiB of peak for no measurable speed, W5 150 MB and a second
        # step that faults all of it in; a small model's steps are as fast or
        # faster with it (W3 0.86, W2 and W4 0.98), for little memory
        # (docs/performance.md, Round 14).
        step = role in (ALGORITHM, FORWARD, UPDATE)
        mem_pattern = not (opts.recompute or (step and not opts.small))
        shared = self.first_run.on
        try:
            ex = Executor(run.model, opts.providers, opts.session_options, program.label, run.library,
                          large=opts.large, fold_constants=fold, mem_pattern=mem_pattern,
                          prune_unfetched=prune_unfetched, shared_arena=shared)
            if role == ALGORITHM:  # (the first one is made ahead next time: runtime.firstrun)
                self.first_run.note(ex.ahead)
            return ex
        except TrainingModelError as exc:
            if run.library is None or opts.fused_kernels or special is not None:
                raise
            # The standard program always works where the fused one cannot load.
            self.fused_kernels_note = f"onnxruntime did not load the fused kernels: {exc}"
            run = self._execution(program, self._how.standard())
            return Executor(run.model, opts.providers, opts.session_options, program.label,
                            large=opts.large, fold_constants=fold, mem_pattern=mem_pattern,
                            shared_arena=shared)

    @property
    def executors(self) -> list[Executor]:
        """The executors compiled so far (specializations included)."""
        special = [ex for cache in self._special.values() for ex in cache.values() if ex is not None]
        return list(self._executors.values()) + special

    def forget(self, programs: Iterable[Program]) -> None:
        """Drop the executors of ``programs`` (rarely run again: their weights' maps may go)."""
        for program in programs:
            self._executors.pop(id(program), None)
            self._special.pop(id(program), None)

    def inplace_keys(self, program: Program) -> frozenset[str]:
        """The variables ``program`` (an update program) may write in place
        (its executed list's in-place plan, on the model onnxruntime runs)."""
        self.executor(program)  # settles fused or standard kernels
        return self._execution(program).inplace

    def scratch(self, program: Program) -> dict[str, str]:
        """memory="lean": ``program``'s temporaries written over its gradient
        buffers ({output: input}; empty unless it was rewritten so)."""
        return self._execution(program).scratch

    # -------------------------------------------------------------- running
    def run_and_stage(
        self,
        program: Program,
        feeds: dict[str, np.ndarray],
        pending: dict[str, Any],
        fetch: bool | frozenset[str],
        field: str,
        extra_in: Mapping[str, Any] | None = None,
        extra_out: Mapping[str, Any] | None = None,
        inplace: Container[str] = (),
    ) -> dict[str, np.ndarray]:
        """Run ``program`` writing its bound values into spare state buffers.

        ``pending`` holds the new (uncommitted) buffers of variables that
        earlier programs of the same transaction wrote; it is extended with
        this program's.  Returns the unbound outputs (numpy): all if ``fetch``
        is True, none if False, else those named in ``fetch`` (``fetched``).
        ``extra_in``/``extra_out``: more OrtValues to bind, by input and
        output name (the reduced values of a data-parallel step).
        ``inplace``: variables whose current buffer is written over (memory="lean").
        ``field``: the binding list the run applies, for messages."""
        store = self.store
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
        executor = self.executor(program, feeds)
        if self._open_feeds.get(id(program)):
            self._last_shapes[id(program)] = specialize.shape_key(feeds, self._open_feeds[id(program)])
        try:
            with self.first_run.measured(self.programs.role(program) == ALGORITHM):
                outputs = executor.run_bound(feeds, state_in, state_out, self.fetched(program, fetch))
        except RuntimeError as exc:
            self._diagnose(program, feeds, state_in, field)
            raise exc
        staged = dict(zip(program.bound_keys, targets))
        for (key, source), buffer in zip(program.bound_copies, targets[len(program.bound_keys):]):
            copy_into(buffer, as_numpy(staged[source]))  # one output, two variables
            staged[key] = buffer
        if self.options.check_finite:
            check_finite(program, staged)
        pending.update(staged)
        return outputs

    def fetched(self, program: Program, fetch: bool | frozenset[str]) -> Sequence[str]:
        """The outputs of ``program`` a step returns: every one (``fetch`` True),
        none (False), or those ``fetch`` names, in the program's order (the
        same list each time: a binding knows it by identity).  Fetching fewer
        runs the program pruned to them (``Executor.pruned_session``)."""
        if fetch is True:
            return program.returned
        if not fetch:
            return ()
        names = self._fetched.get((id(program), fetch))
        if names is None:
            if len(self._fetched) >= 64:  # (a caller asking for ever new names)
                self._fetched.clear()
            names = self._fetched[id(program), fetch] = [n for n in program.returned if n in fetch]
        return names

    def _diagnose(
        self, program: Program, feeds: dict[str, np.ndarray], state_in: dict[str, Any], field: str
    ) -> None:
        """After a failed bound run: rerun plainly to name a bad bound value."""
        arrays = dict(feeds)
        arrays.update({n: as_numpy(v) for n, v in state_in.items()})
        try:
            values = self.executor(program).run(arrays, program.outputs)
        except RuntimeError:
            return  # the original onnxruntime error says it best
        results = dict(zip(program.outputs, values))
        state = self.programs.model.state
        for idx, (key, value) in enumerate(program.bindings):
            var = state[key]
            new = results[value]
            if new.dtype != var.dtype or tuple(new.shape) != var.shape:
                raise TrainingModelError(
                    f"{program.label.rsplit('.', 1)[0]}.{field}[{idx}]: value {value!r} is "
                    f"{new.dtype}{list(new.shape)}, but state variable {key!r} is "
                    f"{var.dtype}{list(var.shape)}"
                )

    # ----------------------------------------------------------- step plans
    def plan_steps(self, program: Program) -> None:
        """Prepare the two alternating steps of ``program`` after a committed
        one (``StateStore.plan_cycle``); the general path runs whenever they miss."""
        self._plans = None
        if self.options.check_finite or program.bound_copies or self.store.pinned:
            return
        shapes = self._last_shapes.get(id(program))
        executor = self.specialized(program, shapes) if shapes is not None else None
        executor = executor or self.executor(program)
        outputs = program.bound_values

        def bind(state_in: dict, targets: list) -> Any:
            return executor.binding(state_in, dict(zip(outputs, targets)))

        cycle = self.store.plan_cycle(program.state_inputs, program.bound_keys, bind)
        if cycle is not None:
            self._plans = (program, cycle, executor, shapes)

    def planned_step(self, program: Program, feeds: dict, fetch: bool | frozenset[str]) -> dict | None:
        """A step through a plan, committed, or None when no plan applies (see
        ``plan_steps``; the caller holds its transaction's lock)."""
        plans = self._plans
        if plans is None or plans[0] is not program:
            return None
        if plans[3] is not None and specialize.shape_key(feeds, self._open_feeds[id(program)]) != plans[3]:
            return None  # feeds of other shapes: another specialization
        store = self.store
        plan = store.plan_for_current(plans[1])
        if plan is None:
            return None
        executor = plans[2]
        store.prefault(plan)
        names = () if fetch is False else self.fetched(program, fetch)  # (the hot path: no call)
        try:
            outputs = executor.run_binding(plan.binding, feeds, names, len(program.bound_values))
        except RuntimeError:
            self._diagnose(program, feeds, plan.state_in, "update_binding")
            raise
        if not store.install(plan):  # pragma: no cover
            return None  # (cannot happen: the store only changes under the caller's lock)
        return outputs


def fetched_names(programs: Sequence[Program], fetch: Any) -> bool | frozenset[str]:
    """``train_step``'s ``fetch``: True or False, or the names of outputs of
    ``programs`` (one name, or several), as ``ProgramRunner.fetched`` takes them."""
    if isinstance(fetch, (bool, np.bool_)):
        return bool(fetch)
    known = {n for p in programs for n in p.returned}
    try:
        names = frozenset((fetch,) if isinstance(fetch, str) else fetch)
    except TypeError:
        raise ValueError(f"train_step: fetch is True, False or output names, not {fetch!r}") from None
    unknown = sorted(str(n) for n in names if not isinstance(n, str) or n not in known)
    if unknown:
        raise ValueError(f"train_step: fetch names outputs the step does not return: {unknown}; "
                         f"it returns {sorted(known)}")
    return names


def check_finite_arrays(label: str, arrays: Mapping[str, np.ndarray], what: str) -> None:
    """Refuse non-finite ``what`` (numpy arrays) before they reach the state."""
    bad = [k for k, a in arrays.items() if a.dtype.kind in "fc" and not np.isfinite(a).all()]
    if bad:
        raise FloatingPointError(f"{label}: non-finite {what} {bad}; nothing was committed")


def check_finite(program: Program, targets: Mapping[str, Any]) -> None:
    """Refuse to commit NaN or Inf into state (``check_finite=True``)."""
    bad = []
    for key, value in targets.items():
        arr = as_numpy(value)
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            bad.append(key)
    if bad:
        raise FloatingPointError(
            f"{program.label}: the step would write non-finite values into state "
            f"variable(s) {bad}; nothing was committed"
        )


def _unpacks_codes(model: onnx.ModelProto) -> bool:
    """Whether a program holds a com.microsoft MatMulNBits node (4/8-bit codes)."""
    return any(n.op_type == "MatMulNBits" and n.domain == "com.microsoft" for n in model.graph.node)
