"""Models and helpers shared by the reliability tests.

The *counter model* makes every state version identifiable: after v steps
every element of every state variable equals v, so any mixture of two
versions (half of one step's update) shows up as unequal elements.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import onnx
from models import model, tensor, training_info, vi
from onnx import TensorProto, helper

F64 = TensorProto.DOUBLE
I64 = TensorProto.INT64

#: The exceptions a TrainingSession call may raise on bad models or feeds:
#: TrainingModelError (a ValueError) for model problems, ValueError for bad
#: feeds, RuntimeError for onnxruntime failures (Executor wraps them),
#: FloatingPointError from check_finite.
ALLOWED = (ValueError, RuntimeError, FloatingPointError)


def counter_model(
    p0_shape=(256,),
    p1_shape=(64, 64),
    with_init: bool = True,
    init_value: float = 7.0,
) -> onnx.ModelProto:
    """State P0 (main graph), P1 (training_info[1].algorithm), c (int64 counter).

    - main graph: ``Y = concat(flatten(P0), flatten(P1), cast(c)) + X`` (feed X = [0.])
    - training_info[0].algorithm: ``P0 += 1``, ``c += 1``, outputs ``seen0 = c`` (before)
    - training_info[1].algorithm: ``P1 += max(P0) - max(P1)``: reads P0 as
      training_info[0] left it in the same iteration, so after
      ``train_step(algorithm=None)`` every element equals the step count;
      outputs ``seen1 = max(P0)``
    - initialization graphs set everything to ``init_value``.
    """
    main_nodes = [
        helper.make_node("Flatten", ["P0"], ["P0f"], axis=0),
        helper.make_node("Flatten", ["P1"], ["P1f"], axis=0),
        helper.make_node("Cast", ["c"], ["cf"], to=F64),
        helper.make_node("Reshape", ["cf", "one_by_one"], ["cf2"]),
        helper.make_node("Concat", ["P0f", "P1f", "cf2"], ["cat"], axis=1),
        helper.make_node("Reshape", ["cat", "minus_one"], ["flat"]),
        helper.make_node("Add", ["flat", "X"], ["Y"]),
    ]
    n = int(np.prod(p0_shape)) + int(np.prod(p1_shape)) + 1
    main_inits = [
        tensor("P0", np.zeros(p0_shape)),
        tensor("P1", np.zeros(p1_shape)),
        tensor("c", np.int64(0)),
        tensor("one_by_one", np.array([1, 1], np.int64)),
        tensor("minus_one", np.array([-1], np.int64)),
    ]
    init0 = dict(
        init_nodes=[
            helper.make_node("Constant", [], ["P0_init"],
                             value=tensor("P0_v", np.full(p0_shape, init_value))),
            helper.make_node("Constant", [], ["c_init"], value=tensor("c_v", np.int64(init_value))),
        ],
        init_outputs=[vi("P0_init", F64, list(p0_shape)), vi("c_init", I64, [])],
        init_binding=[("P0", "P0_init"), ("c", "c_init")],
    ) if with_init else {}
    info0 = training_info(
        [
            helper.make_node("Add", ["P0", "one_f"], ["P0_new"]),
            helper.make_node("Add", ["c", "one_i"], ["c_new"]),
            helper.make_node("Identity", ["c"], ["seen0"]),
        ],
        [tensor("one_f", np.float64(1)), tensor("one_i", np.int64(1))],
        [],
        [vi("P0_new", F64, list(p0_shape)), vi("c_new", I64, []), vi("seen0", I64, [])],
        [("P0", "P0_new"), ("c", "c_new")],
        **init0,
    )
    init1 = dict(
        init_nodes=[
            helper.make_node("Constant", [], ["P1_init"],
                             value=tensor("P1_v", np.full(p1_shape, init_value))),
        ],
        init_outputs=[vi("P1_init", F64, list(p1_shape))],
        init_binding=[("P1", "P1_init")],
    ) if with_init else {}
    info1 = training_info(
        [
            helper.make_node("ReduceMax", ["P0"], ["m0"], keepdims=0),
            helper.make_node("ReduceMax", ["P1"], ["m1"], keepdims=0),
            helper.make_node("Sub", ["m0", "m1"], ["delta"]),
            helper.make_node("Add", ["P1", "delta"], ["P1_new"]),
            helper.make_node("Identity", ["m0"], ["seen1"]),
        ],
        [],
        [],
        [vi("P1_new", F64, list(p1_shape)), vi("seen1", F64, [])],
        [("P1", "P1_new")],
        **init1,
    )
    return model(main_nodes, [vi("X", F64, [1])], [vi("Y", F64, [n])], main_inits,
                 [info0, info1], opset=17)


COUNTER_FEED = {"X": np.zeros(1, np.float64)}


def counter_versions(state: Mapping[str, np.ndarray]) -> dict[str, set[float]]:
    """The distinct values held by each counter-model state variable."""
    return {k: set(np.unique(np.asarray(v, dtype=np.float64)).tolist()) for k, v in state.items()}


def counter_version(state: Mapping[str, np.ndarray]) -> float:
    """The single version every element of the counter state holds (AssertionError if mixed)."""
    values = set()
    for v in counter_versions(state).values():
        values |= v
    assert len(values) == 1, f"mixed state: {counter_versions(state)}"
    return values.pop()


def state_digest(state: Mapping[str, np.ndarray]) -> str:
    """A hash of every state variable's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name in sorted(state):
        arr = np.ascontiguousarray(state[name])
        h.update(name.encode())
        h.update(str(arr.dtype).encode())
        h.update(str(arr.shape).encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def snapshot(sess) -> dict[str, np.ndarray]:
    """Copies of every state variable, read at once (to_model's consistent read)."""
    return sess._store.to_numpy()


def assert_state_equal(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"state variable {k!r} changed"
