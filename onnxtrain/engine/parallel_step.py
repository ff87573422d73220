"""The data-parallel ``train_step``: per algorithm, program A (forward and
backward) into the gradient buffers, the ranks agree, the buffers are
reduced, program B (the update), the ranks agree; then every rank commits
(``parallel.data_parallel``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np

from ..parallel.data_parallel import rows_of
from ..runtime.executor import copy_into
from .checks import check_finite, check_finite_arrays

    # ------------------------------------------------------- data parallel

class DataParallelMixin:
    """``TrainingSession``'s data-parallel step (see ``session.py`` for the attributes)."""

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
        # memory="lean": once an update writes in place, readers wait for the
        # commit (held), so they never see part of the step.
        with self._lock, ExitStack() as held:
            for i in indices:
                split, buffers = self._splits[i], self._grad_buffers[i]
                where = f"train_step (training_info[{i}])"
                error: BaseException | None = None
                rows = 0
                checked: dict[str, np.ndarray] = {}
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
                            check_finite_arrays(b.label, buffers.views, "gradients")
                        scratch = self._scratch.get(id(b), {})
                        if inplace:
                            held.enter_context(self._store.exclusive())
                        wrote = bool(inplace)
                        # (an input with a default that the update reads: its feed too)
                        fed = {n: v for n, v in checked.items() if n in b.optional_feeds}
                        outputs.update(self._run_and_stage(
                            b, fed, pending, fetch, "update_binding",
                            extra_in={n: buffers.ortvalues[n] for n in b.feeds},
                            extra_out={v: buffers.ortvalues[n] for v, n in scratch.items()},
                            inplace=inplace))
                    if split.bn:
                        targets = self._store.targets([k for k, _ in split.bn])
                        staged = {}
                        for (key, value), target in zip(split.bn, targets):
                            copy_into(target, buffers.views[value])
                            staged[key] = target
                        if self._check_finite:
                            check_finite(split.a, staged, "update_binding")
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
