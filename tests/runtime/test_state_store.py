"""The state store's starting buffers: faulted in before a step writes them
(``StateStore.prefault``), their values kept.

A state variable that starts at zero (Adam's moments: sparse initializers)
is memory the system has not given yet; the store writes one byte per page
of each starting buffer right before a step first writes it, faster than the
optimizer's kernels take those page faults (docs/performance.md, round 11).
The byte is written back as it was: an update in place writes the current
state itself."""

from __future__ import annotations

import numpy as np

from onnxtrain.runtime.executor import as_numpy
from onnxtrain.runtime.state import PAGE_BYTES, StateStore


def _values(n: int) -> np.ndarray:
    """Values whose every byte matters (no zero low bytes)."""
    return np.random.default_rng(0).uniform(1.0, 2.0, n).astype(np.float32) + np.float32(1e-7)


def test_an_update_in_place_finds_the_starting_values_kept():
    n = 3 * PAGE_BYTES + 5  # elements: several pages, a ragged end
    store = StateStore({"w": _values(n), "m": np.zeros(n, np.float32)})
    w, m = store.targets(["w", "m"], inplace={"w", "m"})
    np.testing.assert_array_equal(as_numpy(w), _values(n))
    np.testing.assert_array_equal(as_numpy(m), np.zeros(n, np.float32))


def test_the_plans_write_their_spares_once_faulted_and_commit_the_same_values():
    """Two alternating plans over starting buffers: the step writes whole
    targets, so what a plan installs is what was written, whatever the
    faulting wrote before."""
    n = 2 * PAGE_BYTES
    store = StateStore({"w": _values(n)})
    first = store.targets(["w"])[0]
    as_numpy(first)[:] = 1.0
    store.commit({"w": first})
    cycle = store.plan_cycle([], ["w"], lambda state_in, targets: targets)
    assert cycle is not None
    plan = store.plan_for_current(cycle)
    store.prefault(plan)
    assert plan.faulted
    [target] = plan.targets
    np.testing.assert_array_equal(as_numpy(target), _values(n))  # the starting buffer, now the spare
    as_numpy(target)[:] = 2.0
    assert store.install(plan)
    np.testing.assert_array_equal(as_numpy(store.current(["w"])["w"]), np.full(n, 2.0, np.float32))
