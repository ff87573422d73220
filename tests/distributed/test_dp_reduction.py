"""How data-parallel training reduces the gradients: buckets and accumulation.

Each test here was checked against the one-line bug it names: planted by
hand, the test fails; reverted, it passes.

- **Bucketing:** the gradient all-reduce goes in buckets of about
  ``bucket_bytes``; a trailing bucket holding a single element (a ``[1]``
  bias) must be reduced too, or that bias drifts apart on every rank.
- **Accumulation weighting:** under ``accumulate=k`` each rank's gradient
  sum is weighted by the rows of all its k micro-batches, not by the rows of
  the last one only.  Equal micro-batches hide the difference; uneven ones
  per rank show it.

The ranks are threads of this process (``onnxtrain.comm.local_group``);
``run_ranks`` joins them with a timeout so a hang fails instead of blocking.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.comm import local_group

GROUP_TIMEOUT = 20.0
JOIN_TIMEOUT = 60.0
PARAMS = ("W1", "b1", "W2", "b2")


def run_ranks(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` in one thread per rank; the results by rank (a hang or an
    exception in a rank fails the test, naming the rank)."""
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        pytest.fail(f"rank(s) {hung} still running after {JOIN_TIMEOUT} s: a collective hangs")
    for rank, exc in enumerate(errors):
        if exc is not None:
            raise AssertionError(f"rank {rank} raised {type(exc).__name__}: {exc}") from exc
    return results


def tanh_mlp(seed: int = 0) -> onnx.ModelProto:
    """float64 X[N,3] -> MatMul W1[3,4] + b1[4] -> Tanh -> MatMul W2[4,1] + b2[1] -> Y[N,1]."""
    rng = np.random.default_rng(seed)
    f = TensorProto.DOUBLE
    params = {"W1": rng.standard_normal((3, 4)), "b1": 0.1 * rng.standard_normal(4),
              "W2": rng.standard_normal((4, 1)), "b2": 0.1 * rng.standard_normal(1)}
    g = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
         helper.make_node("Tanh", ["hb"], ["t"]), helper.make_node("MatMul", ["t", "W2"], ["o"]),
         helper.make_node("Add", ["o", "b2"], ["Y"])], "tanh_mlp",
        [helper.make_tensor_value_info("X", f, ["N", 3])],
        [helper.make_tensor_value_info("Y", f, ["N", 1])],
        [numpy_helper.from_array(v, k) for k, v in params.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def data(rows: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 3)), rng.standard_normal((rows, 1))


def assert_rel_close(got: dict, expected: dict, rel: float = 1e-9) -> None:
    for name in PARAMS:
        a, b = got[name], expected[name]
        diff = float(np.max(np.abs(a - b)))
        scale = max(float(np.max(np.abs(b))), 1e-300)
        assert diff <= rel * scale, f"{name}: relative difference {diff / scale:.3g} > {rel}"


# ------------------------------------------------------------------ bucketing
@pytest.mark.parametrize("bucket_bytes", [16, 40])
def test_a_trailing_one_element_bucket_is_reduced(bucket_bytes):
    """Two ranks, buckets of 16 or 40 bytes: the [1] bias b2 ends up alone in
    the last bucket (8 bytes, under the bucket size).  The ranks must stay
    equal and equal one process on the global batch.

    Bug caught: ``if at > start:`` (the trailing bucket) written as
    ``if at - start > 1:`` in ``GradientBuffers.allocate``."""
    tm = build.training_model(tanh_mlp(), loss="mse", optimizer=build.SGD(lr=0.1, momentum=0.9))
    x, y = data(13)
    local = [{"X": x[:8], "target": y[:8]}, {"X": x[8:], "target": y[8:]}]
    comms = local_group(2, timeout=GROUP_TIMEOUT)
    sizes: list[int] = []
    original = comms[0].allreduce_sum

    def recording(buf: np.ndarray) -> None:
        sizes.append(int(buf.size))
        original(buf)

    comms[0].allreduce_sum = recording  # type: ignore[method-assign]
    ranks = run_ranks(2, lambda r: TrainingSession(tm, comm=comms[r], bucket_bytes=bucket_bytes))
    run_ranks(2, lambda r: [ranks[r].train_step(local[r]) for _ in range(3)])
    one = TrainingSession(tm)
    for _ in range(3):
        one.train_step({"X": x, "target": y})
    s0, s1, ref = dict(ranks[0].state), dict(ranks[1].state), dict(one.state)
    for name in PARAMS:
        assert s0[name].tobytes() == s1[name].tobytes(), f"{name}: the ranks differ"
    assert_rel_close(s0, ref)
    # And the scenario is the one named: a bucket of one element was reduced.
    assert sizes[-1] == 1, f"the last all-reduce of a step is not the [1] bias's: {sizes}"


# ------------------------------------------------------------------ accumulation
def gradients(base: onnx.ModelProto, start: dict, batches: list[dict]) -> list[dict]:
    """The gradient of the mean loss of each batch at the parameters ``start``
    (float64): one plain SGD step with lr = 1 moves a parameter by it."""
    unit = TrainingSession(build.training_model(base, loss="mse", optimizer=build.SGD(lr=1.0)))
    out = []
    for feeds in batches:
        unit.load_state(start)
        unit.train_step(feeds)
        after = dict(unit.state)
        out.append({k: start[k] - after[k] for k in PARAMS})
    return out


@pytest.mark.parametrize("micro", [
    [[8, 2], [3, 3]],           # accumulate=2: cycle [0, 1]
    [[1, 6, 2], [4, 4, 5]],     # accumulate=3: cycle [0, 0, 1]
], ids=["k2", "k3"])
def test_accumulation_weights_each_rank_by_all_its_micro_batches(micro):
    """Rank r runs k micro-batches of uneven sizes n_{r,i}; its gradient sum
    (the mean of its k micro-batch gradients) must weigh n_r / N with
    n_r = sum_i n_{r,i} and N = sum_r n_r ("weighted" reduction):

        p' = p - lr * sum_r (n_r / N) * (1/k) * sum_i g_{r,i}

    Bug caught: the row count of the reduction taken from the last
    micro-batch alone (``weight = rows + (local_rows if split.sums else 0)``
    written as ``weight = rows`` in the data-parallel step)."""
    k = len(micro[0])
    lr = 0.1
    base = tanh_mlp(seed=2)
    tm = build.training_model(base, loss="mse", optimizer=build.SGD(lr=lr), accumulate=k)
    cycle = [0] * (k - 1) + [1]
    x, y = data(sum(map(sum, micro)), seed=3)
    feeds: list[list[dict]] = [[], []]
    at = 0
    for r in range(2):
        for n in micro[r]:
            feeds[r].append({"X": x[at:at + n], "target": y[at:at + n]})
            at += n
    comms = local_group(2, timeout=GROUP_TIMEOUT)
    ranks = run_ranks(2, lambda r: TrainingSession(tm, comm=comms[r]))
    start = {k_: v for k_, v in ranks[0].state.items() if k_ in PARAMS}
    run_ranks(2, lambda r: [ranks[r].train_step(f, algorithm=a) for f, a in zip(feeds[r], cycle)])
    assert int(ranks[0].state["step"]) == 1

    rows = [sum(m) for m in micro]
    total = sum(rows)
    expected = {name: start[name].copy() for name in PARAMS}
    for r in range(2):
        for g in gradients(base, start, feeds[r]):
            for name in PARAMS:
                expected[name] -= lr * (rows[r] / total) / k * g[name]
    s0, s1 = dict(ranks[0].state), dict(ranks[1].state)
    for name in PARAMS:
        assert s0[name].tobytes() == s1[name].tobytes(), f"{name}: the ranks differ"
    assert_rel_close(s0, expected)
