"""The state variables of a session, double-buffered, and the step plans over them.

``StateStore`` keeps every state variable in an OrtValue (made by
``executor.new_buffer``).  A step writes every updated variable into its
spare buffer; ``commit`` swaps the buffers, so a failed step leaves the
current ones untouched.  Readers (inference from other threads, ``state``
lookups) pin the buffers they read, and a writer never writes into a pinned
buffer: it allocates a new one.

Double buffering makes every steady-state step of one program one of two
configurations: state in buffers A written to B, then B written to A.
``plan_cycle`` prepares both once (a ``StepPlan`` each, holding its
binding and the maps its commit installs), so such a step does no
per-variable Python work: ``plan_for_current`` picks the plan whose
expected map is current and ``install`` commits it.  Any other state change
(``replace``, a pinned snapshot, another program) makes the plans miss.
Only this module touches the buffer maps.

``StateView`` is ``TrainingSession.state``: a read-only mapping over one
pinned, consistent version of the store.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from .executor import as_numpy, contiguous, empty_like, new_buffer, wrap_buffer

#: The smallest page size of the systems onnxruntime runs on: ``prefault``
#: writes one byte in every span of it.
PAGE_BYTES = 4096


@dataclass
class StepPlan:
    """One of the two double-buffer configurations of a steady-state step:
    the state map it expects to be current, its binding (and the state inputs
    bound there), and the maps its commit installs."""

    expected: dict
    binding: Any
    state_in: dict
    next_current: dict
    next_spare: dict
    #: The buffers its step writes, and whether ``StateStore.prefault`` has seen them.
    targets: list
    faulted: bool = False


class StateStore:
    """State variables in double-buffered OrtValues (see the module docstring)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], device: tuple[str, int] = ("cpu", 0),
                 adopt: Container[str] = ()):
        """``adopt``: names whose arrays the store may keep as they are (the
        caller hands them over: no copy on the CPU)."""
        self.device = device
        # Reentrant: a StateView collected (its pins released) while this
        # thread holds the mutex must not deadlock.
        self._mutex = threading.RLock()
        self._current: dict[str, Any] = {}
        self._spare: dict[str, Any] = {}
        self._pins: dict[int, int] = {}
        self.version = 0
        #: The ids of the buffers made here, until a step is about to write them
        #: (``prefault``; an id reused by a later buffer costs one more pass, no more).
        self._unwritten: set[int] = set()
        for name, arr in arrays.items():
            if name in adopt and device[0] == "cpu" and arr.flags.c_contiguous and arr.flags.writeable:
                self._current[name] = wrap_buffer(arr)
            else:
                self._current[name] = new_buffer(contiguous(arr), device)
            self._spare[name] = None
            if device[0] == "cpu":
                self._unwritten.add(id(self._current[name]))

    # ----------------------------------------------------------- access
    def names(self) -> list[str]:
        return list(self._current)

    @property
    def pinned(self) -> bool:
        """Whether a reader holds some buffers (then no plan applies)."""
        return bool(self._pins)

    def current(self, names: Sequence[str]) -> dict[str, Any]:
        """The current buffers of ``names`` (for the single writer, under its lock)."""
        return {n: self._current[n] for n in names}

    def targets(self, names: Sequence[str], inplace: Container[str] = ()) -> list[Any]:
        """Spare buffers to write new values of ``names`` into (never a pinned one).

        ``inplace``: names whose current buffer is the target (the caller
        holds ``exclusive()`` while writing it), unless a reader pins it."""
        out = []
        with self._mutex:
            spares, pins = self._spare, self._pins
            fresh = None
            for n in names:
                if n in inplace and not (pins and pins.get(id(self._current[n]))):
                    self._prefault_one(self._current[n])
                    out.append(self._current[n])
                    continue
                spare = spares[n]
                if spare is None or (pins and pins.get(id(spare))):
                    spare = empty_like(self._current[n], self.device)
                    if fresh is None:
                        fresh = dict(spares)  # installed maps are never changed in place
                    fresh[n] = spare
                self._prefault_one(spare)
                out.append(spare)
            if fresh is not None:
                self._spare = fresh
        return out

    def reserve(self, names: Sequence[str]) -> list[Any]:
        """Make the spare buffers of ``names`` that a first step would make
        (CPU only), and return them, unwritten, for a caller to fault in
        before that step (``FirstRun.touch``, which holds them meanwhile:
        a numpy view of one does not keep its memory)."""
        if self.device[0] != "cpu":
            return []
        made = []
        with self._mutex:
            fresh = dict(self._spare)
            for n in dict.fromkeys(names):
                if fresh.get(n, 0) is None:
                    fresh[n] = empty_like(self._current[n], self.device)
                    made.append(fresh[n])
            self._spare = fresh
        return made

    def prefault(self, plan: StepPlan) -> None:
        """Before ``plan``'s first step: fault in the pages of its targets
        that are still the starting buffers.  A state variable that starts at
        zero (a moment) is memory the system has not given yet, read as the
        shared zero page until written, and the optimizer's kernels then pay
        for every page as they write it, at a high price (W6's second step,
        docs/performance.md: 55 ms more than a steady one, where writing one
        byte per page here takes 17)."""
        if not plan.faulted:
            for target in plan.targets:
                self._prefault_one(target)
            plan.faulted = True

    def _prefault_one(self, target: Any) -> None:
        """Write one byte per page of ``target``, a starting buffer the step is
        about to write, its value kept (an update in place writes current state)."""
        if id(target) in self._unwritten:
            self._unwritten.discard(id(target))
            touched = as_numpy(target).reshape(-1).view(np.uint8)[::PAGE_BYTES]
            touched[...] = touched.copy()

    def commit(self, staged: Mapping[str, Any]) -> None:
        """Make the staged buffers current (all at once); the old current
        buffers become the spares.

        The new maps are built aside and installed by one assignment, so an
        exception or KeyboardInterrupt anywhere in here leaves every old
        buffer current or every new one, never a mixture."""
        with self._mutex:
            current, spares = dict(self._current), dict(self._spare)
            for n, value in staged.items():
                if value is current[n]:  # written in place: no second buffer kept
                    spares[n] = None
                    continue
                spares[n] = current[n]
                current[n] = value
            self._current, self._spare, self.version = current, spares, self.version + 1

    @contextmanager
    def exclusive(self, active: bool = True):
        """Hold off readers (``snapshot``) while current buffers are written in
        place; ``active=False``: nothing is (readers go on)."""
        if not active:
            yield
            return
        with self._mutex:
            yield

    def replace(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Set values from numpy arrays (copied into new buffers), all at once."""
        fresh = {n: new_buffer(contiguous(a), self.device) for n, a in arrays.items()}
        with self._mutex:
            current, spares = dict(self._current), dict(self._spare)
            for n, value in fresh.items():
                current[n] = value
                spares[n] = None
            self._current, self._spare, self.version = current, spares, self.version + 1

    @contextmanager
    def snapshot(self, names: Sequence[str] | None = None):
        """Pin the current buffers of ``names`` (default: all) while in use."""
        with self._mutex:
            snap = dict(self._current) if names is None else {n: self._current[n] for n in names}
            for v in snap.values():
                self._pins[id(v)] = self._pins.get(id(v), 0) + 1
        try:
            yield snap
        finally:
            with self._mutex:
                for v in snap.values():
                    left = self._pins[id(v)] - 1
                    if left:
                        self._pins[id(v)] = left
                    else:
                        del self._pins[id(v)]

    def to_numpy(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the current values (a consistent snapshot)."""
        with self.snapshot(names) as snap:
            return {n: np.array(v.numpy(), copy=True) for n, v in snap.items()}

    # ------------------------------------------------------- step plans
    def plan_cycle(
        self,
        state_inputs: Sequence[str],
        bound_keys: Sequence[str],
        bind: Callable[[dict, list], Any],
    ) -> tuple[StepPlan, StepPlan] | None:
        """The two alternating plans of a program that reads ``state_inputs``
        and writes ``bound_keys``, right after a committed step of it (None
        while a spare is missing or a reader pins buffers).  ``bind(state_in,
        targets)`` makes the binding of one configuration."""
        if self._pins:
            return None

        def plan(current: dict, spare: dict) -> StepPlan | None:
            targets = [spare.get(k) for k in bound_keys]
            if any(t is None for t in targets):
                return None
            state_in = {n: current[n] for n in state_inputs}
            nxt_current, nxt_spare = dict(current), dict(spare)
            for key, target in zip(bound_keys, targets):
                nxt_spare[key] = current[key]
                nxt_current[key] = target
            return StepPlan(current, bind(state_in, targets), state_in, nxt_current, nxt_spare, targets)

        first = plan(self._current, self._spare)
        if first is None:
            return None
        second = plan(first.next_current, first.next_spare)
        if second is None:
            return None
        # The cycle closes on the same maps: the second plan installs the first's.
        second.next_current, second.next_spare = first.expected, self._spare
        return first, second

    def plan_for_current(self, cycle: tuple[StepPlan, StepPlan]) -> StepPlan | None:
        """The plan of ``cycle`` that applies to the current buffers, or None."""
        if self._pins:
            return None
        current = self._current
        a, b = cycle
        return a if a.expected is current else b if b.expected is current else None

    def install(self, plan: StepPlan) -> bool:
        """A plan's commit: if its expected map is still current, make the maps
        it prepared the new ones.  The maps are never changed in place once
        installed, so a plan can hold them."""
        with self._mutex:
            if self._current is not plan.expected:
                return False
            self._current, self._spare = plan.next_current, plan.next_spare
            self.version += 1
            return True


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
        return np.array(as_numpy(self._values[name]), copy=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.items())
        return f"StateView({{{items}}})"
