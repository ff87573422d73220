"""``TrainingSession.state``: a read-only view of one consistent state version."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping

import numpy as np

from ..runtime.executor import as_numpy
from ..runtime.state import StateStore


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
