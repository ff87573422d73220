"""TrainingSession(memory="lean"): one buffer per state variable where the
update allows it (onnxtrain.lower.inplace), the same results as the double-buffered
step, and the documented failure semantics; a variable read both before and
after the node that writes its new value is never written in place."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from models import model, tensor, training_info, vi
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.lower.inplace import inplace_keys, with_scratch_outputs


def base_model(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["z"]),
         helper.make_node("Tanh", ["z"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 8])],
        [numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W"),
         numpy_helper.from_array(np.zeros(8, np.float32), "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def feeds(seed: int, n: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    return {"X": rng.standard_normal((n, 16)).astype(np.float32),
            "T": rng.standard_normal((n, 8)).astype(np.float32)}


OPTIMIZERS = {
    "sgd": build.SGD(lr=0.1),
    "momentum": build.SGD(lr=0.1, momentum=0.9, nesterov=True),
    "adam": build.Adam(lr=1e-2),
    "adamw": build.AdamW(lr=1e-2, weight_decay=0.1),
    "adagrad": build.Adagrad(lr=0.1),
}


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "standard"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("extra", [{}, {"clip_grad_norm": 0.5, "schedule": build.cosine(10)},
                                   {"accumulate": 2}], ids=["plain", "clip+cosine", "accumulate"])
def test_lean_equals_safe_bit_for_bit(name, fused, extra):
    tm = build.training_model(base_model(), loss="mse", target="T", optimizer=OPTIMIZERS[name], **extra)
    safe = TrainingSession(tm, fused_kernels=fused)
    lean = TrainingSession(tm, fused_kernels=fused, memory="lean")
    for s in (safe, lean):
        s.initialize()
    for step in range(6):
        a, b = safe.train_step(feeds(step)), lean.train_step(feeds(step))
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    for k in safe.state:
        assert np.array_equal(safe.state[k], lean.state[k]), k
    # The weights really were updated in place: no second buffer is kept.
    keys = lean._runner.inplace_keys(lean._programs.splits[-1].b)
    assert {"W", "b"} <= keys
    assert all(lean._store._spare[k] is None for k in keys)
    if name == "sgd" and not extra:  # lr·g is computed over the gradient's own buffer
        assert len(lean._runner.scratch(lean._programs.splits[-1].b)) == 2


def test_in_place_keeps_the_buffer_and_honours_readers():
    tm = build.training_model(base_model(), loss="mse", target="T", optimizer=build.AdamW(lr=1e-2))
    sess = TrainingSession(tm, memory="lean")
    sess.train_step(feeds(0))
    buffer = sess._store.current(["W"])["W"]
    sess.train_step(feeds(1))
    assert sess._store.current(["W"])["W"] is buffer
    # A reader holding the current buffers: the step writes elsewhere, the view stays.
    with sess._store.snapshot() as snap:
        before = np.array(snap["W"].numpy())
        sess.train_step(feeds(2))
        assert np.array_equal(snap["W"].numpy(), before)
    assert not np.array_equal(sess.state["W"], before)


def test_failures_before_the_update_change_nothing():
    tm = build.training_model(base_model(), loss="mse", target="T", optimizer=build.Adam(lr=1e-2))
    sess = TrainingSession(tm, memory="lean", check_finite=True)
    sess.train_step(feeds(0))
    before = {k: v.copy() for k, v in sess.state.items()}
    bad = feeds(1)
    bad["X"] = bad["X"][:, :5]  # wrong width: the forward pass fails
    with pytest.raises(Exception):
        sess.train_step(bad)
    nan = feeds(1)
    nan["T"][0, 0] = np.nan  # a NaN gradient: refused before the update writes
    with pytest.raises(FloatingPointError, match="gradients"):
        sess.train_step(nan)
    for k, v in before.items():
        assert np.array_equal(sess.state[k], v), k


def test_a_failure_inside_the_update_says_the_state_holds_it():
    """A finite gradient, a learning rate that overflows the weights: the
    update has already written them, and the error says so."""
    tm = build.training_model(base_model(), loss="mse", target="T", optimizer=build.SGD(lr=3e38))
    sess = TrainingSession(tm, memory="lean", check_finite=True)
    big = feeds(0)
    big["T"] *= 1e3
    with pytest.raises(FloatingPointError) as info:
        sess.train_step(big)
    assert any("memory='lean'" in note for note in getattr(info.value, "__notes__", []))
    assert not np.isfinite(sess.state["W"]).all()
    safe = TrainingSession(tm, check_finite=True)
    with pytest.raises(FloatingPointError):
        safe.train_step(big)
    assert np.isfinite(safe.state["W"]).all()  # the default mode rolls back


def test_bad_memory_value():
    with pytest.raises(ValueError, match="memory"):
        TrainingSession(build.training_model(base_model(), loss="mse", target="T"), memory="small")


def test_inplace_analysis_refuses_late_readers():
    """W is read by a node that does not lead to its update: no in-place write."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["g", "lr"], ["d"]), helper.make_node("Sub", ["W", "d"], ["W_new"]),
         helper.make_node("ReduceSum", ["W"], ["norm"]),
         helper.make_node("MatMul", ["W", "W"], ["V_new"])],
        "b", [], [])
    assert inplace_keys(graph, [("W", "W_new")]) == set()
    ok = helper.make_graph(graph.node[:2], "b", [], [])
    assert inplace_keys(ok, [("W", "W_new")]) == {"W"}
    # A non-elementwise producer reading its own variable is refused.
    assert inplace_keys(graph, [("W", "V_new")]) == set()


def test_scratch_outputs_only_where_the_gradient_is_read_no_more():
    g = helper.make_tensor_value_info("g", TensorProto.FLOAT, [4, 3])
    w = helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 3])
    lr = numpy_helper.from_array(np.array(0.1, np.float32), "lr")
    nodes = [helper.make_node("Mul", ["lr", "g"], ["d"]), helper.make_node("Sub", ["W", "d"], ["W_new"])]
    out = [helper.make_tensor_value_info("W_new", TensorProto.FLOAT, [4, 3])]
    model = helper.make_model(helper.make_graph(nodes, "b", [w, g], out, [lr]),
                              opset_imports=[helper.make_opsetid("", 17)])
    rewritten, scratch = with_scratch_outputs(model, {"g"})
    assert scratch == {"d": "g"} and [o.name for o in rewritten.graph.output] == ["W_new", "d"]
    assert [o.name for o in model.graph.output] == ["W_new"]  # not modified
    # g also read after d is made: d may not take g's buffer.
    late = nodes + [helper.make_node("ReduceSum", ["g"], ["s"]), helper.make_node("Add", ["W_new", "s"], ["W2"])]
    model2 = helper.make_model(helper.make_graph(late, "b", [w, g], out, [lr]),
                               opset_imports=[helper.make_opsetid("", 17)])
    assert with_scratch_outputs(model2, {"g"})[1] == {}
    assert with_scratch_outputs(model, set())[1] == {}


LEAN = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnxtrain import TrainingSession, build

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024

    rows, cols, memory, name = 4096, 8192, sys.argv[1], sys.argv[2]
    w = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32) * 0.01
    g = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "big",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", rows])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", cols])],
                          [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    del w
    opt = build.AdamW(lr=1e-3) if name == "adamw" else build.SGD(lr=1e-3)
    tm = build.training_model(m, loss="mse", target="T", optimizer=opt)
    del m
    sess = TrainingSession(tm, memory=memory)
    del tm
    sess.initialize()
    x = np.ones((16, rows), np.float32)
    t = np.ones((16, cols), np.float32)
    sess.train_step({"X": x, "T": t})
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(2):
        sess.train_step({"X": x, "T": t})
    print(json.dumps({"rss": base, "peak": status("VmHWM")}))
    """
)


@pytest.mark.parametrize("name, copies", [("adamw", 4), ("sgd", 2)])
def test_lean_steps_hold_weights_gradients_and_moments_only(tmp_path, name, copies):
    """Steady-state steps on a 128 MiB weight: lean holds W, the gradient and
    the moments (AdamW: 4·S, SGD: 2·S, as PyTorch) and peaks near it; the
    default mode holds a second copy of everything the step writes."""
    script = tmp_path / "lean.py"
    script.write_text(LEAN)
    size = 4096 * 8192 * 4
    out = {}
    for memory in ("lean", "safe"):
        proc = subprocess.run([sys.executable, str(script), memory, name], capture_output=True,
                              text=True, timeout=600, env=dict(os.environ, ONNXTRAIN_THREADS="2"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[memory] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["lean"]["peak"] < out["safe"]["peak"] - (copies // 2) * size, out
    # weights, gradient, moments; small activations, the interpreter and onnxruntime.
    assert out["lean"]["peak"] < (copies + 0.6) * size + 250e6, out


# ------------------------------------------------- every optimizer form, and ranks
from test_split import (  # noqa: E402  (tests/distributed is on sys.path: conftest)
    ONE_RANK_CASES,
    assert_bitwise,
    builder_model,
    cycle_of,
    global_batch,
    one_rank_data,
    one_rank_params,
    run_ranks,
    sessions,
    shards,
)


@pytest.mark.parametrize("name, fused", one_rank_params())
def test_lean_equals_safe_for_every_optimizer_form(name, fused):
    """The data-parallel suite's cases (builder optimizers, the spec's Adam,
    Momentum, Nesterov and Adagrad written by hand, two algorithms,
    accumulation, float64): lean is the default mode, bit for bit."""
    factory, dtype, target, _ = ONE_RANK_CASES[name]
    model = factory()
    cycle = cycle_of(model)
    safe = TrainingSession(model, fused_kernels=fused)
    lean = TrainingSession(model, fused_kernels=fused, memory="lean")
    for step, f in enumerate(one_rank_data(name, dtype, target, 7)):
        algorithm = cycle[step % len(cycle)]
        assert_bitwise(lean.train_step(f, algorithm=algorithm), safe.train_step(f, algorithm=algorithm),
                       f"step {step}: ")
    assert_bitwise(dict(lean.state), dict(safe.state), "state: ")
    assert lean.comm is None  # a world of one inside, no communicator outside


def test_lean_on_two_ranks_equals_safe_on_two_ranks():
    model = builder_model(np.float64, optimizer=build.Adam(lr=0.01), clip_grad_norm=0.1)
    x, labels = global_batch(13)
    local = shards(x, labels, [8, 5])
    out = {}
    for memory in ("safe", "lean"):
        ranks = sessions(model, 2, memory=memory)
        run_ranks(2, lambda r: [ranks[r].train_step(local[r]) for _ in range(4)])
        out[memory] = [dict(s.state) for s in ranks]
    for r in range(2):
        assert_bitwise(out["lean"][r], out["safe"][r], f"rank {r}: ")


def test_an_unfetched_lean_step_whose_forward_pass_outputs_nothing_it_needs():
    """memory="lean" cuts each algorithm into forward+backward and update; on
    a model without gradients the first program feeds no state, and with
    fetch=False nothing is asked of it: the step still runs (onnxruntime
    refuses a run with no output requested, so none is made) and equals the
    safe session's."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reliability"))
    from reliability_models import counter_model

    safe, lean = TrainingSession(counter_model()), TrainingSession(counter_model(), memory="lean")
    for _ in range(3):
        for sess in (safe, lean):
            assert sess.train_step({"X": np.zeros(1)}, fetch=False) in (None, {}, [])
    for name, value in safe.state.items():
        np.testing.assert_array_equal(lean.state[name], value)
    assert int(lean.state["c"]) == 3


# ------------------------------------------------------------------ in-place writes and late readers
def update_graph(late_reader: bool) -> onnx.GraphProto:
    """W_new = W - g * ReduceSum(W) (W read before its update), and with
    ``late_reader`` also ``late = W * 2``, which nothing orders before the
    Sub: onnxruntime may run it after W_new was written."""
    nodes = [
        helper.make_node("ReduceSum", ["W"], ["norm"], keepdims=0),
        helper.make_node("Mul", ["g", "norm"], ["d"]),
        helper.make_node("Sub", ["W", "d"], ["W_new"]),
    ]
    if late_reader:
        nodes.append(helper.make_node("Mul", ["W", "two"], ["late"]))
    return helper.make_graph(nodes, "update", [], [])


def test_a_variable_read_before_and_after_its_update_is_not_written_in_place():
    """Bug caught: ``read_before`` asking that *some* other reader of the
    variable precede the writer instead of *every* one
    (``set(others) <= self.ancestors(index)`` written as
    ``bool(set(others) & self.ancestors(index))``)."""
    assert inplace_keys(update_graph(late_reader=False), [("W", "W_new")]) == {"W"}
    assert inplace_keys(update_graph(late_reader=True), [("W", "W_new")]) == set()
    # A late reader that needs the new value too surely runs after the write.
    g = update_graph(late_reader=False)
    g.node.append(helper.make_node("Sub", ["W_new", "W"], ["delta"]))
    assert inplace_keys(g, [("W", "W_new")]) == set()


def test_lean_steps_of_a_late_reader_equal_safe_steps():
    """The same graph trained: W_new = W - 0.01 * sum(W), D_new = W_new - W.
    memory="lean" must give the double-buffered result bit for bit (D is the
    step, not 0 as when W is overwritten before D_new reads it).  Bug caught:
    the one of the test above, end to end."""
    info = training_info(
        [helper.make_node("ReduceSum", ["W"], ["s"], keepdims=0),
         helper.make_node("Mul", ["s", "rate"], ["d"]),
         helper.make_node("Sub", ["W", "d"], ["W_new"]),
         helper.make_node("Sub", ["W_new", "W"], ["D_new"]),
         helper.make_node("Identity", ["s"], ["total"])],
        [tensor("rate", np.float64(0.01))], [],
        [vi("W_new", TensorProto.DOUBLE, [8]), vi("D_new", TensorProto.DOUBLE, [8]), vi("total", TensorProto.DOUBLE, [])],
        [("W", "W_new"), ("D", "D_new")])
    m = model([helper.make_node("Mul", ["W", "D"], ["Y"])], [], [vi("Y", TensorProto.DOUBLE, [8])],
              [tensor("W", np.arange(8.0)), tensor("D", np.zeros(8))], [info])
    safe, lean = TrainingSession(m), TrainingSession(m, memory="lean")
    for _ in range(3):
        safe.train_step({})
        lean.train_step({})
    assert float(safe.state["D"][0]) < 0
    for name in ("W", "D"):
        assert lean.state[name].tobytes() == safe.state[name].tobytes(), name
