"""How a session runs its programs: the model to run for each (fused kernels
or standard ops, lean memory's scratch outputs), one compiled executor per
program, the variables an update may write in place, and the pre-bound
alternating steps of a plain training loop."""

from __future__ import annotations

from typing import Any

import onnx

from ..errors import TrainingModelError
from ..lower.inplace import inplace_keys, with_scratch_outputs
from ..lower.pipeline import KernelChoice, kernel_choice
from ..lower.programs import Program
from ..runtime.executor import Executor, device_of, nchwc_block

    # ------------------------------------------------------------- execution

class ExecutionMixin:
    """``TrainingSession``'s programs and executors (see ``session.py`` for the attributes)."""

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
            # A training step keeps no onnxruntime memory pattern: planned at the first
            # run and held besides the arena's blocks, it cost L1 (docs/performance.md)
            # 0.47 GiB of peak for no measurable speed.
            training = any(program is p for p in self._algorithms) or any(
                program is s.a or program is s.b for s in self._splits)
            mem_pattern = not (self._recompute or training)
            try:
                ex = Executor(model, self._providers, self._session_options, program.label, library,
                              large=self._large, fold_constants=fold,
                              mem_pattern=mem_pattern, prune_unfetched=prune_unfetched)
            except TrainingModelError as exc:
                if library is None or self._fused_kernels:
                    raise
                # The standard program always works where the fused one cannot load.
                self.fused_kernels_note = f"onnxruntime did not load the fused kernels: {exc}"
                choice = self._executed[key] = self._lean_rewrite(program, KernelChoice(program.model))
                ex = Executor(choice.model, self._providers, self._session_options, program.label,
                              large=self._large, fold_constants=fold, mem_pattern=mem_pattern)
            self._executors[key] = ex
        return ex

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
            self._plans = (program, cycle, executor)

    def _planned_step(self, program: Program, feeds: dict, fetch: bool) -> dict | None:
        """A step through a plan, or None when no plan applies (see ``_plan_steps``)."""
        plans = self._plans
        if plans is None or plans[0] is not program:
            return None
        store = self._store
        plan = store.plan_for_current(plans[1])
        if plan is None:
            return None
        executor = plans[2]
        names = program.returned if fetch else ()
        try:
            outputs = executor.run_binding(plan.binding, feeds, names, len(program.bound_values))
        except RuntimeError:
            self._diagnose(program, feeds, plan.state_in, "update_binding")
            raise
        if not store.install(plan):  # pragma: no cover
            return None  # (cannot happen: the store only changes under our lock)
        return outputs


def _unpacks_codes(model: onnx.ModelProto) -> bool:
    """Whether a program holds a com.microsoft MatMulNBits node (4/8-bit codes)."""
    return any(n.op_type == "MatMulNBits" and n.domain == "com.microsoft" for n in model.graph.node)
