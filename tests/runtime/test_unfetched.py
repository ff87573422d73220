"""``train_step(fetch=False)`` runs the algorithm pruned to its state outputs.

onnxruntime computes every output of a graph, bound or not.  A builder model
with BatchNormalization keeps the main graph's inference-mode forward pass
for its outputs (``logits``), beside the training-mode copy the loss reads;
a step that fetches nothing should not pay for it.  The pruned session must
give the same state, bit for bit, on both the general and the planned path."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.core.graph import prune
from onnxtrain.runtime.executor import Executor

ALGORITHM = "training_info[0].algorithm"


def _bn_model(batchnorm=True):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((4, 2, 3, 3)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal((4 * 6 * 6, 3)) * 0.1).astype(np.float32), "fc")]
    nodes = [helper.make_node("Conv", ["X", "w"], ["c"], pads=[1, 1, 1, 1])]
    if batchnorm:
        inits += [numpy_helper.from_array(np.full(4, v, np.float32), n)
                  for n, v in (("scale", 1.0), ("bias", 0.1), ("mean", 0.0), ("var", 1.0))]
        nodes.append(helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["b"]))
    else:
        nodes.append(helper.make_node("Identity", ["c"], ["b"]))
    nodes += [helper.make_node("Relu", ["b"], ["r"]), helper.make_node("Flatten", ["r"], ["f"]),
              helper.make_node("MatMul", ["f", "fc"], ["logits"])]
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [5, 2, 6, 6])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [5, 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return build.training_model(model, loss="cross_entropy", optimizer=build.SGD(lr=0.1, momentum=0.9))


def _feeds(seed):
    rng = np.random.default_rng(seed)
    return {"X": rng.standard_normal((5, 2, 6, 6)).astype(np.float32),
            "target": rng.integers(0, 3, 5).astype(np.int64)}


def _state(sess):
    return {k: np.array(v) for k, v in sess.state.items()}


@pytest.mark.parametrize("same_batch", [True, False])
def test_unfetched_steps_prune_the_inference_forward_and_change_nothing(same_batch, monkeypatch):
    made = []
    original = Executor.pruned_session

    def spy(self, outputs):
        sess = original(self, outputs)
        made.append((self.label, sess is not None))
        return sess

    monkeypatch.setattr(Executor, "pruned_session", spy)
    tm = _bn_model()
    a, b = TrainingSession(tm), TrainingSession(tm)
    for step in range(6):
        feeds = _feeds(0 if same_batch else step)
        a.train_step(feeds)  # fetches: the full program
        assert not b.train_step(feeds, fetch=False)
    state_a, state_b = _state(a), _state(b)
    assert state_a.keys() == state_b.keys()
    for k in state_a:
        assert state_a[k].tobytes() == state_b[k].tobytes(), k
    assert (ALGORITHM, True) in made  # a pruned session was made, for b's steps
    full = b.programs(executed=True)[ALGORITHM]
    pruned = b._runner.executor(b._programs.algorithms[0]).pruned_session(frozenset(
        o.name for o in full.graph.output if o.name not in b._programs.algorithms[0].returned))
    assert pruned is not None
    ops = [n.op_type for n in full.graph.node]
    assert ops.count("BatchNormalization") == 2  # inference-mode main graph + training-mode copy
    assert len(pruned.get_outputs()) < len(full.graph.output)
    # and a fetching step afterwards still returns the outputs
    out = b.train_step(_feeds(9))
    assert set(out) >= {"loss", "logits"}


@pytest.mark.parametrize("batchnorm", [True, False])
def test_what_the_pruned_program_keeps(batchnorm):
    # With BatchNorm the inference-mode forward goes; without it only the
    # loss value's own nodes (the backward reads the log-probabilities).
    sess = TrainingSession(_bn_model(batchnorm))
    full = sess.programs(executed=True)[ALGORITHM]
    program = sess._programs.algorithms[0]
    state_outputs = [o.name for o in full.graph.output if o.name not in program.returned]
    kept = prune(list(full.graph.node), state_outputs)
    ops, kept_ops = [n.op_type for n in full.graph.node], [n.op_type for n in kept]
    assert len(kept) < len(ops)
    assert kept_ops.count("Relu") == ops.count("Relu") - (1 if batchnorm else 0)
    assert kept_ops.count("BatchNormalization") == (1 if batchnorm else 0)
    assert ops.count("BatchNormalization") == (2 if batchnorm else 0)
    a, b = TrainingSession(_bn_model(batchnorm)), TrainingSession(_bn_model(batchnorm))
    for step in range(4):
        a.train_step(_feeds(step))
        b.train_step(_feeds(step), fetch=False)
    for k, v in _state(a).items():
        assert v.tobytes() == _state(b)[k].tobytes(), k


def test_no_pruned_session_where_pruning_drops_nothing():
    # every output asked for: nothing to prune (dead Constants do not count)
    sess = TrainingSession(_bn_model(False))
    executor = sess._runner.executor(sess._programs.algorithms[0])
    everything = frozenset(o.name for o in sess.programs(executed=True)[ALGORITHM].graph.output)
    assert executor.pruned_session(everything) is None


def test_lean_memory_does_not_prune():
    sess = TrainingSession(_bn_model(), memory="lean")
    sess.train_step(_feeds(0), fetch=False)
    assert all(not getattr(ex, "_pruned", {}) for ex in sess._runner.executors)


def test_sessions_are_freed_without_the_cycle_collector():
    # A binding holds its executor's pruned_session weakly: no cycle keeps
    # onnxruntime sessions alive until a collection (which may happen in a
    # forked child, where destroying one hangs).
    import gc
    import weakref

    sess = TrainingSession(_bn_model())
    for _ in range(2):
        sess.train_step(_feeds(0), fetch=False)
        sess.train_step(_feeds(0))
    executor = weakref.ref(sess._runner.executor(sess._programs.algorithms[0]))
    gc.collect()
    gc.disable()
    try:
        del sess
        assert executor() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("fetch", [["loss"], "loss", ("loss", "loss")])
def test_a_step_that_fetches_the_loss_only_skips_the_inference_forward(fetch, monkeypatch):
    """``fetch`` names outputs: the step returns those, from the program
    pruned to them and the state outputs (the inference-mode forward pass
    that only ``logits`` needs goes), with the same values and state, bit
    for bit, as a step fetching everything, on both paths (the planned
    steps from the third on)."""
    made = []
    original = Executor.pruned_session
    monkeypatch.setattr(Executor, "pruned_session", lambda self, outputs: made.append(outputs) or original(self, outputs))
    tm = _bn_model()
    a, b = TrainingSession(tm), TrainingSession(tm)
    for step in range(6):
        full, some = a.train_step(_feeds(step)), b.train_step(_feeds(step), fetch=fetch)
        assert set(full) == {"loss", "logits"} and set(some) == {"loss"}
        assert full["loss"].tobytes() == some["loss"].tobytes()
    for k, v in _state(a).items():
        assert v.tobytes() == _state(b)[k].tobytes(), k
    assert made and all("loss" in o and "logits" not in o for o in made)
    pruned = b._runner.executor(b._programs.algorithms[0]).pruned_session(made[0])
    assert pruned is not None and {o.name for o in pruned.get_outputs()} == made[0]
    assert set(b.train_step(_feeds(0))) == {"loss", "logits"}  # (everything again)


def test_fetching_an_output_the_step_does_not_return_changes_nothing():
    sess = TrainingSession(_bn_model())
    sess.train_step(_feeds(0))
    before = _state(sess)
    for fetch in (["loss", "nope"], [3], None, 2.5):
        with pytest.raises(ValueError, match="fetch"):
            sess.train_step(_feeds(1), fetch=fetch)
    after = _state(sess)
    assert all(before[k].tobytes() == after[k].tobytes() for k in before)
    assert sess.train_step(_feeds(1), fetch=[]) == {}  # (no name: as fetch=False)
