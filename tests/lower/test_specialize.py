"""Programs specialized to the shapes of their feeds (``onnxtrain.lower.specialize``):
the shape arithmetic of an unshaped target folds away, and every result
equals the general program's bit for bit."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from models import linear_regression
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.kernels.fuse import KERNEL_DOMAIN
from onnxtrain.lower import specialize
from onnxtrain.runtime import runner
from onnxtrain.runtime.runner import SPECIALIZE_ENV

PREVIEW = "ai.onnx.preview.training"
SHAPE_OPS = {"Shape", "Size", "NonZero", "ConstantOfShape", "Concat", "Equal"}


def w3_like(batch: int | str = "N") -> onnx.ModelProto:
    """Linear regression 10 -> 1, MSE, SGD, its target ``Y`` declared without a shape (W3's form)."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((1, 10)).astype(np.float32), "W")
    b = numpy_helper.from_array(np.zeros(1, np.float32), "B")
    main = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W", "B"], ["pred"], transB=1)], "main",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch, 10])],
        [helper.make_tensor_value_info("pred", TensorProto.FLOAT, [batch, 1])], [w, b])
    nodes = [
        helper.make_node("Sub", ["pred", "Y"], ["diff"]),
        helper.make_node("Mul", ["diff", "diff"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["W", "B", "X", "Y"], ["gW", "gB"], domain=PREVIEW, xs=["W", "B"],
                         zs=["X", "Y"], y="loss"),
    ]
    for p in ("W", "B"):
        nodes += [helper.make_node("Mul", ["lr", f"g{p}"], [f"s{p}"]),
                  helper.make_node("Sub", [p, f"s{p}"], [f"new{p}"])]
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
               helper.make_tensor_value_info("newW", TensorProto.FLOAT, [1, 10]),
               helper.make_tensor_value_info("newB", TensorProto.FLOAT, [1])]
    algorithm = helper.make_graph(
        nodes, "algorithm", [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], outputs,
        [numpy_helper.from_array(np.float32(0.05), "lr")])
    model = helper.make_model(main, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(PREVIEW, 1)])
    ti = model.training_info.add()
    ti.algorithm.CopyFrom(algorithm)
    ti.update_binding.add(key="W", value="newW")
    ti.update_binding.add(key="B", value="newB")
    return model


def session(monkeypatch, on: bool, model: onnx.ModelProto | None = None) -> onnxtrain.TrainingSession:
    monkeypatch.setenv(SPECIALIZE_ENV, "1" if on else "0")
    return onnxtrain.TrainingSession(model if model is not None else w3_like())


def batches(shapes: list[tuple[int, tuple[int, ...]]]) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"X": rng.standard_normal((n, 10)).astype(np.float32),
             "Y": rng.standard_normal(y).astype(np.float32)} for n, y in shapes]


def trace(sess: onnxtrain.TrainingSession, feeds: list[dict[str, np.ndarray]]) -> list[bytes]:
    out = []
    for f in feeds:
        out.append(sess.train_step(f)["loss"].tobytes())
        out += [sess.state[k].tobytes() for k in ("W", "B")]
    return out


def test_the_shape_arithmetic_of_an_unshaped_target_folds_away(monkeypatch):
    general = session(monkeypatch, False).programs()["training_info[0].algorithm"]
    ops = [n.op_type for n in general.graph.node]
    assert SHAPE_OPS <= set(ops)  # the dynamic unbroadcast of the loss's backward
    special = specialize.specialize(general, {"X": (32, 10), "Y": (32, 1)})
    left = [n.op_type for n in special.graph.node]
    assert not SHAPE_OPS & set(left), left
    assert "Reshape" not in left and len(left) < len(ops) - 15
    onnx.checker.check_model(special)
    # the session runs it, and exports the general program all the same
    sess = session(monkeypatch, True)
    feeds = batches([(32, (32, 1))])[0]
    sess.train_step(feeds)
    program = sess._programs.algorithms[0]
    assert sess._runner.executor(program, feeds) is sess._runner.specialized(program, ((32, 10), (32, 1)))
    assert sess._runner.executor(program, feeds) is not sess._runner.executor(program)
    assert SHAPE_OPS <= {n.op_type for n in sess.programs()["training_info[0].algorithm"].graph.node}


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_a_specialization_runs_the_executed_list_of_its_role(monkeypatch):
    """The spec's Adagrad runs as the fused kernel in the specialized program
    too (the algorithm's executed list: the kernel choice), bit for bit as
    without specialization; the standard programs stay as they were."""
    tm = linear_regression("adagrad")
    target = next(i for i in tm.training_info[0].algorithm.input if i.name == "T")
    target.type.tensor_type.ClearField("shape")  # unshaped: its broadcast decided at run time
    made, execute = [], runner.execute

    def spy(program, role, options, check=None):
        made.append(execute(program, role, options, check))
        return made[-1]

    monkeypatch.setattr(runner, "execute", spy)
    rng = np.random.default_rng(1)
    feeds = [{"X": rng.standard_normal((n, 3)).astype(np.float32),
              "T": rng.standard_normal((n, 1)).astype(np.float32)} for n in (16, 16, 9, 16)]
    sess = session(monkeypatch, True, tm)
    losses = [sess.train_step(f)["loss"].tobytes() for f in feeds]
    program = sess._programs.algorithms[0]
    special = [ex for ex in made if ex.program.model is not program.model]
    assert len(special) == 2  # one per feed shape
    for ex in special:
        fused = [n.op_type for n in ex.model.graph.node if n.domain == KERNEL_DOMAIN]
        assert fused and ex.library is not None, fused
        assert not SHAPE_OPS & {n.op_type for n in ex.model.graph.node}
    assert all(sess._runner.specialized(program, ((n, 3), (n, 1))) is not None for n in (16, 9))
    general = session(monkeypatch, False, tm)
    assert losses == [general.train_step(f)["loss"].tobytes() for f in feeds]
    assert all(np.array_equal(sess.state[k], general.state[k]) for k in sess.state)
    standard = sess.programs()["training_info[0].algorithm"]
    assert not any(n.domain == KERNEL_DOMAIN for n in standard.graph.node)
    assert SHAPE_OPS <= {n.op_type for n in standard.graph.node}


def test_bit_for_bit_across_batch_sizes_and_ranks(monkeypatch):
    # batch sizes change between steps; the target's rank changes (its broadcast too)
    shapes = [(8, (8, 1)), (8, (8, 1)), (5, (5, 1)), (8, (8, 1)), (5, (5,)), (3, (1,)), (3, ()),
              (5, (5, 1)), (8, (8, 1))]
    feeds = batches(shapes)
    special = session(monkeypatch, True)
    assert trace(special, feeds) == trace(session(monkeypatch, False), feeds)
    cache = special._runner._special[id(special._programs.algorithms[0])]
    assert len(cache) == len(set(shapes)) and all(ex is not None for ex in cache.values())


def test_the_cache_is_bounded(monkeypatch):
    n_max = specialize.MAX_SPECIALIZATIONS
    shapes = [(n, (n, 1)) for n in range(2, n_max + 5)] + [(2, (2, 1)), (n_max + 4, (n_max + 4, 1))]
    feeds = batches(shapes)
    special = session(monkeypatch, True)
    assert trace(special, feeds) == trace(session(monkeypatch, False), feeds)
    assert len(special._runner._special[id(special._programs.algorithms[0])]) == n_max


def test_an_ill_shaped_feed_raises_and_changes_nothing(monkeypatch):
    sess = session(monkeypatch, True)
    good, bad = batches([(8, (8, 1)), (8, (7, 1))])
    sess.train_step(good)
    before = {k: v.copy() for k, v in sess.state.items()}
    with pytest.raises(RuntimeError, match="algorithm"):
        sess.train_step(bad)
    assert all(np.array_equal(before[k], v) for k, v in sess.state.items())
    after = session(monkeypatch, True)
    after.train_step(good)
    assert trace(sess, [good]) == trace(after, [good])  # and the session still trains


def test_off_by_environment(monkeypatch):
    sess = session(monkeypatch, False)
    sess.train_step(batches([(8, (8, 1))])[0])
    assert not sess._runner._special
    monkeypatch.setenv(SPECIALIZE_ENV, "maybe")
    with pytest.raises(ValueError, match=SPECIALIZE_ENV):
        onnxtrain.TrainingSession(w3_like())


def test_static_feeds_are_not_specialized(monkeypatch):
    model = w3_like(batch=8)
    del model.training_info[0].algorithm.input[:]
    model.training_info[0].algorithm.input.append(
        helper.make_tensor_value_info("Y", TensorProto.FLOAT, [8, 1]))
    sess = session(monkeypatch, True, model)
    sess.train_step(batches([(8, (8, 1))])[0])
    assert sess._runner.open_feeds(sess._programs.algorithms[0]) == ()
    assert not sess._runner._special


def test_nothing_to_fold_gives_none():
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert specialize.specialize(m, {"x": (2, 3)}) is None


def test_a_program_over_max_nodes_runs_general(monkeypatch):
    """A program of more than ``MAX_NODES`` nodes is not specialized (its first
    step would pay shape inference and the kernel choice again, the genai int4
    decoder's 11 s); it trains bit for bit as the specialized one does."""
    feeds = batches([(8, (8, 1)), (8, (8, 1))])
    small = session(monkeypatch, True)
    expected = trace(small, feeds)
    big_model = w3_like()
    monkeypatch.setattr(specialize, "MAX_NODES", len(big_model.training_info[0].algorithm.node) - 1)
    big = session(monkeypatch, True, big_model)
    assert trace(big, feeds) == expected
    assert list(big._runner._special[id(big._programs.algorithms[0])].values()) == [None]
    assert any(v is not None for v in small._runner._special[id(small._programs.algorithms[0])].values())
