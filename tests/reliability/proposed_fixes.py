"""Fixes proposed for files the reliability work did not own (executor.py, session.py).

Both proposals below have since been merged into onnxtrain (StateStore.commit
and .replace build the new maps aside; TrainingSession.state is a pinned
snapshot view), so the "current code" tests now pass unmarked and ``apply``
installs code equivalent to what onnxtrain runs.  The original description:

Each function here is the proposed replacement, verbatim, of a method in
onnxtrain.  Tests apply them with ``monkeypatch`` to show that the proposal
makes the guarantee hold; the same tests run against the current code are
marked ``xfail(strict=True)``, so they start failing loudly (XPASS) once the
proposal is merged, and the marker must then be removed.

- ``StateStore.commit`` / ``StateStore.replace``: build the new buffer maps
  aside and install them with one assignment.  Today they swap buffers one
  variable at a time in a loop, so a KeyboardInterrupt (delivered at a loop's
  backward jump) can leave some variables new and others old.
- ``TrainingSession.state`` returning a ``SnapshotStateView``: the view pins
  one consistent set of buffers when it is created, so ``dict(sess.state)``
  taken while another thread trains never mixes two steps.  Today each
  lookup reads the then-current buffer of that one variable.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping

import numpy as np

from onnxtrain.executor import StateStore, contiguous


# --------------------------------------------------------- executor.py
def commit(self: StateStore, staged: Mapping[str, object]) -> None:
    """Make the staged buffers current (all at once); the old current
    buffers become the spares.

    The new maps are built aside and installed by one assignment, so an
    exception or KeyboardInterrupt anywhere in here leaves every old buffer
    current or every new one, never a mixture."""
    with self._mutex:
        current, spares = dict(self._current), dict(self._spare)
        for n, value in staged.items():
            spares[n] = current[n]
            current[n] = value
        self._current, self._spare, self.version = current, spares, self.version + 1


def replace(self: StateStore, arrays: Mapping[str, np.ndarray]) -> None:
    """Set values from numpy arrays (copied into new buffers), all at once."""
    fresh = {n: self._new_buffer(contiguous(a)) for n, a in arrays.items()}
    with self._mutex:
        current, spare = dict(self._current), dict(self._spare)
        for n, value in fresh.items():
            current[n] = value
            spare[n] = None
        self._current, self._spare, self.version = current, spare, self.version + 1


# ---------------------------------------------------------- session.py
class SnapshotStateView(Mapping):
    """Read-only view of one consistent state version: each lookup returns a numpy copy.

    Creating the view pins the current buffers (the writer never writes into
    a pinned buffer); they are released when the view is garbage-collected."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
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


def state(self) -> Mapping[str, np.ndarray]:
    """Every state variable -> numpy array (copies of one consistent version; read-only)."""
    return SnapshotStateView(self._store)


def apply(monkeypatch) -> None:
    """Install every proposal (for the duration of a test)."""
    from onnxtrain.session import TrainingSession

    monkeypatch.setattr(StateStore, "commit", commit)
    monkeypatch.setattr(StateStore, "replace", replace)
    monkeypatch.setattr(TrainingSession, "state", property(state))
