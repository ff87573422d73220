"""Building a training model and a session over it leaves no reference cycle
that holds protobuf messages: a cycle keeps the whole model (every weight)
alive until the cycle collector happens to run, which on a large model is
gigabytes held after the caller let go (memory="lean" measured it).  The
walkers of the builder that call themselves are closures: each would be such
a cycle if it were left bound."""

from __future__ import annotations

import gc

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build


def _attention_like():
    """Q K^T + mask -> Softmax -> @ V over a weight: every walker runs."""
    r = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["X", "Wq"], ["q"]),
        helper.make_node("MatMul", ["X", "Wk"], ["k"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Add", ["s", "mask"], ["sm"]),
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "X"], ["a"]),
        helper.make_node("MatMul", ["a", "Wo"], ["Y"]),
    ]
    inits = [numpy_helper.from_array(r.standard_normal((8, 8)).astype(np.float32), n) for n in ("Wq", "Wk", "Wo")]
    inits.append(numpy_helper.from_array(np.triu(np.full((4, 4), -1e9, np.float32), 1)[None], "mask"))
    g = helper.make_graph(nodes, "att", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4, 8])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_building_and_running_leave_no_cycle_that_holds_the_model():
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        m = _attention_like()
        tm = build.training_model(m, loss="mse", target="T", optimizer=build.AdamW(lr=1e-3),
                                  lora=build.LoRA(rank=2))
        sess = TrainingSession(tm, memory="lean")
        sess.initialize()
        sess.train_step({"X": np.ones((2, 4, 8), np.float32), "T": np.ones((2, 4, 8), np.float32)})
        assert build.parameter_choices(m)
        del m, tm, sess
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        held = [type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("onnx")]
        loops = sorted({f.__qualname__ for f in gc.garbage
                        if type(f).__name__ == "function" and f.__module__.startswith("onnxtrain")})
        # (closures that hold no message, such as the fusion's pattern matcher, are
        # harmless: their cycles are a few small objects)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert held == [], loops
