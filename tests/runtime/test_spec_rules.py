"""The TrainingInfoProto rules R1-R11 (DESIGN.md §2), each positive and negative."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from models import F32, model, tensor, training_info, vi
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain import TrainingModelError, TrainingSession

W0 = np.array([1.0, 2.0], dtype=np.float32)
#: The main graph's input: every combined graph includes the main graph.
FEED = {"X": np.ones((1, 2), np.float32)}


def scale_model(infos, extra_main_inits=(), main_nodes=None, main_outputs=None):
    """Main graph: Y = X * W.  State and updates come from ``infos``."""
    nodes = main_nodes or [helper.make_node("Mul", ["X", "W"], ["Y"], name="mul")]
    outputs = main_outputs or [vi("Y", F32, ["N", 2])]
    return model(nodes, [vi("X", F32, ["N", 2])], outputs,
                 [tensor("W", W0)] + list(extra_main_inits), infos)


def decay_info(key="W", value="W_new", factor=0.5, **kw):
    """Algorithm: W_new = W * factor (reads M's initializer)."""
    return training_info(
        [helper.make_node("Mul", ["W", "f"], ["W_new"], name="decay")],
        [tensor("f", np.float32(factor))],
        [],
        [vi("W_new", F32, [2])],
        [(key, value)],
        **kw,
    )


def error_of(m) -> str:
    with pytest.raises(TrainingModelError) as info:
        TrainingSession(m)
    return str(info.value)


# ---------------------------------------------------------------- R1
def test_r1_update_key_from_main_graph_is_state():
    sess = TrainingSession(scale_model([decay_info()]))
    assert list(sess.state) == ["W"]
    sess.train_step(FEED)
    np.testing.assert_array_equal(sess.state["W"], W0 * 0.5)


def test_r1_update_key_from_algorithm_initializer_is_state():
    ti = training_info(
        [helper.make_node("Add", ["count", "one"], ["count_new"])],
        [tensor("count", np.int64(0)), tensor("one", np.int64(1))],
        [], [vi("count_new", TensorProto.INT64, [])], [("count", "count_new")],
    )
    sess = TrainingSession(scale_model([ti]))
    assert list(sess.state) == ["count"]  # 'one' is a constant, not state
    for _ in range(3):
        sess.train_step(FEED)
    assert sess.state["count"] == 3 and sess.state["count"].dtype == np.int64


def test_r1_unknown_update_key():
    msg = error_of(scale_model([decay_info(key="W9")]))
    assert msg == ("training_info[0].update_binding[0]: key 'W9' is not an initializer of the "
                   "main graph or of training_info[0].algorithm")


def test_r1_key_of_another_algorithm_is_refused():
    other = training_info([helper.make_node("Identity", ["c"], ["c2"])], [tensor("c", np.float32(1))],
                          [], [vi("c2", F32, [])], [("c", "c2")])
    first = decay_info()
    first.update_binding.add(key="c", value="W_new")
    msg = error_of(scale_model([first, other]))
    assert "training_info[0].update_binding[1]: key 'c'" in msg


# ---------------------------------------------------------------- R2 / R4 / R6
def init_graph_info(binding=(("W", "W_init"),), inputs=()):
    return decay_info(
        init_nodes=[helper.make_node("Constant", [], ["W_init"], value=tensor("v", np.float32([7, 8])))],
        init_outputs=[vi("W_init", F32, [2])],
        init_binding=list(binding),
        init_inputs=list(inputs),
    )


def test_r2_r4_initialization_binding_sets_state():
    sess = TrainingSession(scale_model([init_graph_info()]))
    np.testing.assert_array_equal(sess.state["W"], W0)  # R9: starts at the initializer
    sess.initialize()
    np.testing.assert_array_equal(sess.state["W"], [7, 8])


def test_r2_unknown_initialization_key():
    msg = error_of(scale_model([init_graph_info(binding=[("nope", "W_init")])]))
    assert msg.startswith("training_info[0].initialization_binding[0]: key 'nope' is not an initializer")


def test_r4_value_not_an_init_output():
    msg = error_of(scale_model([init_graph_info(binding=[("W", "W_new")])]))
    assert msg == ("training_info[0].initialization_binding[0]: value 'W_new' is not an output of "
                   "training_info[0].initialization")


def test_r6_initialization_with_inputs_is_refused():
    msg = error_of(scale_model([init_graph_info(inputs=[vi("seed", F32, [])])]))
    assert "training_info[0].initialization.input[0]: 'seed'" in msg


def test_r6_missing_initialization_with_bindings():
    ti = decay_info()
    ti.initialization_binding.add(key="W", value="x")
    msg = error_of(scale_model([ti]))
    assert "no initialization graph" in msg and "training_info[0].initialization_binding[0]" in msg


def test_r6_missing_initialization_without_bindings_is_fine():
    sess = TrainingSession(scale_model([decay_info()]))
    sess.initialize()  # nothing to do
    np.testing.assert_array_equal(sess.state["W"], W0)


# ---------------------------------------------------------------- R3
def test_r3_value_may_be_a_main_output():
    main_nodes = [helper.make_node("Mul", ["X", "W"], ["Y"]),
                  helper.make_node("Mul", ["W", "W"], ["W_sq"])]
    ti = training_info([], [], [], [], [("W", "W_sq")])
    m = scale_model([ti], main_nodes=main_nodes,
                    main_outputs=[vi("Y", F32, ["N", 2]), vi("W_sq", F32, [2])])
    sess = TrainingSession(m)
    out = sess.train_step({"X": np.ones((1, 2), np.float32)})
    np.testing.assert_array_equal(sess.state["W"], W0 * W0)
    assert set(out) == {"Y"}  # bound outputs are not returned


def test_r3_value_not_an_output():
    msg = error_of(scale_model([decay_info(value="nowhere")]))
    assert msg == ("training_info[0].update_binding[0]: value 'nowhere' is not an output of "
                   "training_info[0].algorithm or of the main graph")


# ---------------------------------------------------------------- R5
def test_r5_duplicate_key_in_one_binding():
    ti = decay_info()
    ti.update_binding.add(key="W", value="W_new")
    msg = error_of(scale_model([ti]))
    assert "training_info[0].update_binding[1]: key 'W' appears twice" in msg


def test_r5_update_key_unique_across_training_infos():
    msg = error_of(scale_model([decay_info(), decay_info()]))
    assert "training_info[1].update_binding[0]: key 'W' is already updated by training_info[0]" in msg


def test_r5_initialization_keys_may_repeat_across_training_infos_last_wins():
    first = init_graph_info()
    second = training_info(
        [], [], [], [], [],
        init_nodes=[helper.make_node("Constant", [], ["W_i2"], value=tensor("v2", np.float32([-1, -2])))],
        init_outputs=[vi("W_i2", F32, [2])], init_binding=[("W", "W_i2")],
    )
    sess = TrainingSession(scale_model([first, second]))
    sess.initialize()
    np.testing.assert_array_equal(sess.state["W"], [-1, -2])


# ---------------------------------------------------------------- R7 / R8
def test_r7_algorithm_redefining_a_main_value_is_refused():
    ti = training_info([helper.make_node("Identity", ["X"], ["Y"], name="clash")], [], [],
                       [vi("Y2", F32, [2])], [])
    msg = error_of(scale_model([ti]))
    assert "training_info[0].algorithm.node[0]" in msg and "'Y' is already defined" in msg


def test_r7_algorithm_not_topologically_sorted():
    ti = training_info(
        [helper.make_node("Mul", ["a", "W"], ["W_new"], name="late"),
         helper.make_node("Identity", ["W"], ["a"], name="early")],
        [], [], [vi("W_new", F32, [2])], [("W", "W_new")])
    msg = error_of(scale_model([ti]))
    assert "training_info[0].algorithm.node[0]" in msg and "'a'" in msg


def test_r7_duplicate_outputs_in_combined_graph():
    ti = decay_info()
    ti.algorithm.output.append(vi("Y", F32, ["N", 2]))
    msg = error_of(scale_model([ti]))
    assert "training_info[0].algorithm.output[1]: 'Y' is also an output of the main graph" in msg


def test_r7_initializer_name_clash_between_main_and_algorithm():
    ti = decay_info()
    ti.algorithm.initializer.append(tensor("W", W0))
    msg = error_of(scale_model([ti]))
    assert "training_info[0].algorithm.initializer" in msg and "'W'" in msg


def test_r7_cycle_in_main_graph():
    nodes = [helper.make_node("Add", ["X", "b"], ["a"], name="n1"),
             helper.make_node("Mul", ["a", "W"], ["b"], name="n2"),
             helper.make_node("Identity", ["b"], ["Y"])]
    msg = error_of(scale_model([decay_info()], main_nodes=nodes))
    assert msg.startswith("graph.node[0]") and "'b'" in msg


def test_r8_main_graph_cannot_read_algorithm_values():
    nodes = [helper.make_node("Mul", ["X", "f"], ["Y"], name="reads_algo")]
    msg = error_of(scale_model([decay_info()], main_nodes=nodes))
    assert msg.startswith("graph.node[0] ('reads_algo', Mul): input 'f' is not defined")


def test_r8_algorithm_reads_main_values():
    ti = training_info([helper.make_node("ReduceMean", ["Y"], ["m"], keepdims=0),
                        helper.make_node("Sub", ["W", "m"], ["W_new"])],
                       [], [], [vi("W_new", F32, [2])], [("W", "W_new")])
    sess = TrainingSession(scale_model([ti]))
    x = np.array([[1, 1]], np.float32)
    sess.train_step({"X": x})
    np.testing.assert_allclose(sess.state["W"], W0 - np.mean(x * W0))


# ---------------------------------------------------------------- R9
def test_r9_bindings_are_applied_all_at_once():
    """Swapping two state variables needs simultaneous assignment."""
    ti = training_info(
        [helper.make_node("Identity", ["b"], ["a_new"]), helper.make_node("Identity", ["a"], ["b_new"])],
        [tensor("a", np.float32(1)), tensor("b", np.float32(2))], [],
        [vi("a_new", F32, []), vi("b_new", F32, [])], [("a", "a_new"), ("b", "b_new")])
    sess = TrainingSession(scale_model([ti]))
    sess.train_step(FEED)
    assert (sess.state["a"], sess.state["b"]) == (2, 1)


def test_r9_algorithm_none_runs_every_algorithm_in_order():
    double = training_info([helper.make_node("Add", ["c", "c"], ["c2"])], [tensor("c", np.float32(1))],
                           [], [vi("c2", F32, [])], [("c", "c2")])
    plus_one = training_info([helper.make_node("Add", ["W", "one"], ["W1"])], [tensor("one", np.float32(1))],
                             [], [vi("W1", F32, [2])], [("W", "W1")])
    sess = TrainingSession(scale_model([double, plus_one]))
    sess.train_step(FEED)
    assert sess.state["c"] == 2
    np.testing.assert_array_equal(sess.state["W"], W0 + 1)
    sess.train_step(FEED, algorithm=0)
    assert sess.state["c"] == 4
    np.testing.assert_array_equal(sess.state["W"], W0 + 1)
    with pytest.raises(ValueError, match="algorithm must be None or an index"):
        sess.train_step(FEED, algorithm=2)


def test_r9_state_keeps_dtype_float64_and_int64():
    ti = training_info(
        [helper.make_node("Add", ["d", "d"], ["d2"]), helper.make_node("Add", ["k", "k1"], ["k2"])],
        [tensor("d", np.float64(0.1)), tensor("k", np.int64(5)), tensor("k1", np.int64(1))], [],
        [vi("d2", TensorProto.DOUBLE, []), vi("k2", TensorProto.INT64, [])], [("d", "d2"), ("k", "k2")])
    sess = TrainingSession(scale_model([ti]))
    sess.train_step(FEED)
    assert sess.state["d"].dtype == np.float64 and sess.state["d"] == 0.2
    assert sess.state["k"].dtype == np.int64 and sess.state["k"] == 6


# ---------------------------------------------------------------- R10
def test_r10_run_never_changes_state_and_uses_current_weights():
    sess = TrainingSession(scale_model([decay_info()]))
    x = np.ones((3, 2), np.float32)
    before = sess.run({"X": x})["Y"]
    np.testing.assert_array_equal(before, x * W0)
    np.testing.assert_array_equal(sess.state["W"], W0)
    sess.train_step(FEED)
    np.testing.assert_array_equal(sess.run({"X": x})["Y"], x * W0 * 0.5)


def test_state_mapping_is_read_only_copies():
    sess = TrainingSession(scale_model([decay_info()]))
    w = sess.state["W"]
    w[:] = 100
    np.testing.assert_array_equal(sess.state["W"], W0)
    with pytest.raises(TypeError):
        sess.state["W"] = w  # type: ignore[index]


# ---------------------------------------------------------------- R11
def test_r11_static_dtype_mismatch_is_refused():
    ti = training_info([helper.make_node("Cast", ["W"], ["W64"], to=TensorProto.DOUBLE)], [], [],
                       [vi("W64", TensorProto.DOUBLE, [2])], [("W", "W64")])
    msg = error_of(scale_model([ti]))
    assert msg == ("training_info[0].update_binding[0]: value 'W64' has element type DOUBLE, but "
                   "state variable 'W' is FLOAT")


def test_r11_static_shape_mismatch_is_refused():
    ti = training_info([helper.make_node("Concat", ["W", "W"], ["WW"], axis=0)], [], [],
                       [vi("WW", F32, [4])], [("W", "WW")])
    msg = error_of(scale_model([ti]))
    assert "value 'WW' has shape [4], but state variable 'W' has shape [2]" in msg


def test_r11_runtime_shape_mismatch_fails_the_step_and_keeps_state():
    # The shape of W_new depends on the feed, so only the run can tell.
    ti = training_info([helper.make_node("ReduceSum", ["X"], ["s"], axes=[0], keepdims=0),
                        helper.make_node("Mul", ["W", "s"], ["W_new"])], [], [],
                       [vi("W_new", F32, None)], [("W", "W_new")])
    ti.algorithm.node[0].CopyFrom(helper.make_node("ReduceSum", ["X", "ax"], ["s"], keepdims=0))
    ti.algorithm.initializer.append(tensor("ax", np.array([0], np.int64)))
    m = scale_model([ti])
    m.graph.input[0].CopyFrom(vi("X", F32, None))
    sess = TrainingSession(m)
    sess.train_step({"X": np.ones((2, 2), np.float32)})
    good = sess.state["W"]
    with pytest.raises(TrainingModelError, match=r"training_info\[0\].update_binding\[0\]: value 'W_new'"):
        sess.train_step({"X": np.ones((2, 2, 2), np.float32)})
    np.testing.assert_array_equal(sess.state["W"], good)


# ---------------------------------------------------------------- others
def test_graphcall_is_refused_with_a_clear_message():
    ti = decay_info()
    ti.algorithm.node.append(helper.make_node("GraphCall", ["W"], ["z"], graph_name="g"))
    msg = error_of(scale_model([ti]))
    assert "GraphCall" in msg and "training_info[0].algorithm.node[1]" in msg


def test_training_model_error_is_a_value_error():
    assert issubclass(onnxtrain.TrainingModelError, ValueError)


def test_ir3_style_initializer_inputs_use_state_unless_fed():
    m = scale_model([decay_info()])
    m.graph.input.append(vi("W", F32, [2]))
    sess = TrainingSession(m)
    x = np.ones((1, 2), np.float32)
    np.testing.assert_array_equal(sess.run({"X": x})["Y"], x * W0)
    override = np.array([3, 3], np.float32)
    np.testing.assert_array_equal(sess.run({"X": x, "W": override})["Y"], x * override)
    np.testing.assert_array_equal(sess.state["W"], W0)
    sess.train_step(FEED)
    np.testing.assert_array_equal(sess.run({"X": x})["Y"], x * W0 * 0.5)


def test_sparse_initializer_as_state_is_densified_and_exported():
    m = scale_model([decay_info()])
    del m.graph.initializer[:]
    sparse = helper.make_sparse_tensor(
        helper.make_tensor("W", F32, [1], [2.0]), helper.make_tensor("idx", TensorProto.INT64, [1], [1]), [2])
    m.graph.sparse_initializer.append(sparse)
    sess = TrainingSession(m)
    np.testing.assert_array_equal(sess.state["W"], [0, 2])
    sess.train_step(FEED)
    np.testing.assert_array_equal(sess.state["W"], [0, 1])
    out = sess.to_model(training=True)
    assert [t.name for t in out.graph.initializer] == ["W"] and not out.graph.sparse_initializer
    again = TrainingSession(out)
    np.testing.assert_array_equal(again.state["W"], [0, 1])


def test_failed_step_missing_feed_names_the_input_and_keeps_state():
    ti = training_info([helper.make_node("Sub", ["W", "Z"], ["W_new"])], [], [vi("Z", F32, [2])],
                       [vi("W_new", F32, [2])], [("W", "W_new")])
    sess = TrainingSession(scale_model([ti]))
    with pytest.raises(ValueError, match="missing feed 'Z'"):
        sess.train_step(FEED)
    with pytest.raises(ValueError, match="missing feed 'X'"):
        sess.train_step({"Z": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match=r"feed 'Z' has dtype float64, expected float32\[2\]"):
        sess.train_step({**FEED, "Z": np.ones(2)})
    with pytest.raises(ValueError, match=r"feed 'Z' has shape \[3\]"):
        sess.train_step({**FEED, "Z": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="unknown feed 'Q'"):
        sess.train_step({**FEED, "Z": np.ones(2, np.float32), "Q": 1})
    np.testing.assert_array_equal(sess.state["W"], W0)


def test_load_state_checks_names_dtypes_and_shapes():
    sess = TrainingSession(scale_model([decay_info()]))
    sess.load_state({"W": np.array([5, 6], np.float32)})
    np.testing.assert_array_equal(sess.state["W"], [5, 6])
    with pytest.raises(KeyError, match="not a state variable"):
        sess.load_state({"f": np.float32(1)})
    with pytest.raises(ValueError, match="must be float32"):
        sess.load_state({"W": np.array([5, 6], np.float64)})
    with pytest.raises(ValueError, match="shape"):
        sess.load_state({"W": np.array([5, 6, 7], np.float32)})
    np.testing.assert_array_equal(sess.state["W"], [5, 6])


def test_model_without_training_info_runs():
    m = scale_model([])
    sess = TrainingSession(m)
    assert dict(sess.state) == {}
    np.testing.assert_array_equal(sess.run({"X": np.ones((1, 2), np.float32)})["Y"], [W0])
    with pytest.raises(TrainingModelError, match="no training_info"):
        sess.train_step({})


def test_ir14_models_from_make_model_run():
    m = scale_model([decay_info()])
    m.ir_version = 14
    sess = TrainingSession(m.SerializeToString())
    sess.train_step(FEED)
    np.testing.assert_array_equal(sess.state["W"], W0 * 0.5)


def test_bad_bytes_raise_training_model_error():
    with pytest.raises(TrainingModelError, match="cannot parse"):
        TrainingSession(b"\x00\x01garbage\xff")
    with pytest.raises(TrainingModelError, match="cannot read model file"):
        TrainingSession("/nonexistent/model.onnx")
    wrong_type = onnx.helper.make_tensor("t", F32, [1], [1.0]).SerializeToString()
    with pytest.raises(TrainingModelError):
        TrainingSession(wrong_type)


# ---------------------------------------------------------------- R11 without inference
def _no_inference(monkeypatch):
    import onnxtrain.io.model

    def refuse(*a, **k):
        raise AssertionError("shape inference ran")

    monkeypatch.setattr(onnxtrain.io.model, "infer_types", refuse)


def test_r11_declared_types_are_checked_without_shape_inference(monkeypatch):
    # Every bound value declares its element type and shape: the check reads
    # those alone (a builder's models are so), mismatches included.
    _no_inference(monkeypatch)
    sess = TrainingSession(scale_model([decay_info()]))
    sess.train_step(FEED)
    np.testing.assert_array_equal(sess.state["W"], W0 * 0.5)
    ti = training_info([helper.make_node("Cast", ["W"], ["W64"], to=TensorProto.DOUBLE)], [], [],
                       [vi("W64", TensorProto.DOUBLE, [2])], [("W", "W64")])
    assert "value 'W64' has element type DOUBLE" in error_of(scale_model([ti]))
    ti = training_info([helper.make_node("Concat", ["W", "W"], ["WW"], axis=0)], [], [],
                       [vi("WW", F32, [4])], [("W", "WW")])
    assert "value 'WW' has shape [4], but state variable 'W' has shape [2]" in error_of(scale_model([ti]))


def test_r11_a_declared_scalar_bound_to_a_tensor_is_refused():
    # (checked with inference, which keeps the declared shape)
    ti = training_info([helper.make_node("Mul", ["W", "f"], ["W_new"])], [tensor("f", np.float32(0.5))],
                       [], [vi("W_new", F32, [])], [("W", "W_new")])
    assert "value 'W_new' has shape [], but state variable 'W' has shape [2]" in error_of(scale_model([ti]))
