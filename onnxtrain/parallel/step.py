"""The data-parallel ``train_step``: per algorithm, program A (forward and
backward) into the gradient buffers, the ranks agree, the buffers are
reduced, program B (the update), the ranks agree; then every rank commits
(``parallel.data_parallel`` has the buffers and the collectives).

``memory="lean"`` in one process takes the same path, over a world of one
(``comm.SingleProcess``): the cut lets the update write state in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np

from ..lower.programs import ProgramSet
from ..runtime.executor import copy_into
from ..runtime.runner import ProgramRunner, check_finite, check_finite_arrays
from ..runtime.state import StateStore
from .comm import Communicator, SingleProcess
from .data_parallel import DataParallel, GradientBuffers, rows_of


class DataParallelStep:
    """A data-parallel session's step and its agreements across ranks, over
    the session's programs, runner and state store."""

    def __init__(self, dp: DataParallel, programs: ProgramSet, runner: ProgramRunner,
                 store: StateStore) -> None:
        self.dp = dp
        self.programs = programs
        self.runner = runner
        self.store = store
        #: The buffers of each cut algorithm's reduced values.
        self.buffers: list[GradientBuffers] = [dp.buffers(s.reduced) for s in programs.splits]
        #: Rows of local accumulation steps since the last reduced sums.
        self.local_rows = 0

    @property
    def comm(self) -> Communicator | None:
        """The communicator, or None for a world of one (memory="lean" alone)."""
        return None if isinstance(self.dp.comm, SingleProcess) else self.dp.comm

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise ``error`` here, or DistributedStepError elsewhere, if any rank failed."""
        self.dp.agree(error, 0, what)

    def broadcast(self, names: Sequence[str]) -> dict[str, np.ndarray] | None:
        """Rank 0's values of the state variables ``names``, received by every
        other rank for it to load (None on rank 0 and in a world of one)."""
        dp = self.dp
        if dp.size == 1:
            return None
        state = self.programs.model.state
        if dp.rank == 0:
            arrays = self.store.to_numpy(names)
        else:
            arrays = {n: np.empty(state[n].shape, state[n].dtype) for n in names}
        dp.broadcast_arrays({n: a.reshape(-1) for n, a in arrays.items()})
        return None if dp.rank == 0 else arrays

    def rank0_names(self, names: Sequence[str]) -> list[str]:
        """The names rank 0 gave (every rank calls this with its own)."""
        if self.dp.size == 1:
            return sorted(names)
        return self.dp.comm.allgather_object(sorted(names))[0]

    def step(self, indices: Sequence[int], feeds: Mapping[str, Any],
             fetch: bool | frozenset[str]) -> dict[str, np.ndarray]:
        """``train_step`` of a data-parallel session (the caller holds its
        lock): each algorithm's halves around the reduction, each phase agreed
        by every rank, then one commit on every rank."""
        pending: dict[str, Any] = {}
        outputs: dict[str, np.ndarray] = {}
        local_rows = self.local_rows
        # memory="lean": once an update writes in place, readers wait for the
        # commit (held), so they never see part of the step.
        with ExitStack() as held:
            for i in indices:
                pending, rows, sums = self._algorithm_step(i, feeds, fetch, pending, outputs, local_rows, held)
                if sums:
                    local_rows = 0
                elif self.programs.splits[i].a.bindings:
                    local_rows += rows
            self.store.commit(pending)  # all bindings at once, on every rank
            self.local_rows = local_rows
        return outputs

    def _algorithm_step(self, i: int, feeds: Mapping[str, Any], fetch: bool | frozenset[str], pending: dict[str, Any],
                        outputs: dict[str, np.ndarray], local_rows: int, held: ExitStack
                        ) -> tuple[dict[str, Any], int, bool]:
        """Algorithm ``i``'s part of a step: its pending state after, the rows
        of this rank's batch, and whether its reduced values were sums."""
        dp, split, buffers = self.dp, self.programs.splits[i], self.buffers[i]
        where = f"train_step (training_info[{i}])"
        error, rows, checked = self._forward(i, feeds, fetch, pending, outputs)
        weight = rows + (local_rows if split.sums else 0)
        total = dp.agree(error, weight, where)
        dp.reduce(buffers, weight, total)
        runner, b = self.runner, split.b
        wrote = False  # whether state was written in place (memory="lean")
        try:
            if b is not None:
                inplace = runner.inplace_keys(b) if runner.options.lean else set()
                if inplace and runner.options.check_finite:
                    check_finite_arrays(b.label, buffers.views, "gradients")
                if inplace:
                    held.enter_context(self.store.exclusive())
                wrote = bool(inplace)
                # (an input with a default that the update reads: its feed too)
                fed = {n: v for n, v in checked.items() if n in b.optional_feeds}
                outputs.update(runner.run_and_stage(
                    b, fed, pending, fetch, "update_binding",
                    extra_in={n: buffers.ortvalues[n] for n in b.feeds},
                    extra_out={v: buffers.ortvalues[n] for v, n in runner.scratch(b).items()},
                    inplace=inplace))
            if split.bn:
                self._stage_statistics(i, pending)
        except BaseException as exc:
            error = exc
            if wrote:  # nothing to roll back to: keep what the update wrote
                self.store.commit(pending)
                pending = {}
                exc.add_note(f"{where}: memory='lean': the optimizer had started writing "
                             "the new state in place; the state holds the update as far as it got")
        dp.agree(error, 0, where)
        return pending, rows, split.sums

    def _forward(self, i: int, feeds: Mapping[str, Any], fetch: bool | frozenset[str], pending: dict[str, Any],
                 outputs: dict[str, np.ndarray]
                 ) -> tuple[BaseException | None, int, dict[str, np.ndarray]]:
        """Algorithm ``i``'s program A (forward and backward) into its gradient
        buffers: what went wrong (for the ranks to agree on), the rows fed and
        the checked feeds."""
        rows = 0
        checked: dict[str, np.ndarray] = {}
        try:
            (checked,) = self.programs.checked([self.programs.algorithms[i]], feeds, "train_step")
            rows = rows_of(checked)
            a = self.programs.splits[i].a
            wanted = {n: v for n, v in checked.items() if n in a.feeds or n in a.optional_feeds}
            outputs.update(self.runner.run_and_stage(
                a, wanted, pending, fetch, "update_binding",
                extra_out=self.buffers[i].ortvalues))  # every reduced value, by name
        except BaseException as exc:  # KeyboardInterrupt too: the others must hear of it
            return exc, rows, checked
        return None, rows, checked

    def _stage_statistics(self, i: int, pending: dict[str, Any]) -> None:
        """Stage algorithm ``i``'s reduced BatchNormalization statistics into their state."""
        split, views = self.programs.splits[i], self.buffers[i].views
        targets = self.store.targets([k for k, _ in split.bn])
        staged = {}
        for (key, value), target in zip(split.bn, targets):
            copy_into(target, views[value])
            staged[key] = target
        if self.runner.options.check_finite:
            check_finite(split.a, staged)
        pending.update(staged)
