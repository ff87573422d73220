"""What the startup work saves must not change what it computes
(docs/startup.md): the label-free tensor walks visit what the labelled ones
visit, in the same order; the one-pass tensor check finds the error the
labelled walk words; ``raw_length`` is ``len(raw_data)``; ``load`` spills
exactly when ``storage.spill`` would; the builder's initialization graph
holds every starting value bit for bit; the program cache's size bound
refuses what the skeleton's size would; an initialization graph without
training ops is lowered when ``initialize()`` first needs it, one with them
at construction (where its errors surface)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_build import mlp

from onnxtrain import build
from onnxtrain.core import diskcache, protos
from onnxtrain.errors import TrainingModelError
from onnxtrain.io import loading, mapped, storage, tensors
from onnxtrain.io.model import validate
from onnxtrain.lower import program_cache


def _rich_model() -> onnx.ModelProto:
    """Tensors everywhere a model holds them: initializers (raw and typed),
    sparse initializers, Constant values, a TENSORS attribute, sparse
    attributes, If branches (with their own tensors) and training graphs."""
    then_g = helper.make_graph(
        [helper.make_node("Constant", [], ["t_out"], value=numpy_helper.from_array(np.ones(2, np.float32), "tc"))],
        "then", [], [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.zeros(3, np.float32), "then_init")],
    )
    else_g = helper.make_graph(
        [helper.make_node("Constant", [], ["e_out"], sparse_value=helper.make_sparse_tensor(
            numpy_helper.from_array(np.ones(1, np.float32), "sv"),
            numpy_helper.from_array(np.zeros(1, np.int64), "si"), [2]))],
        "else", [], [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [2])],
    )
    custom = helper.make_node("Custom", ["X"], ["c"], domain="my.domain")
    custom.attribute.append(helper.make_attribute("ts", [numpy_helper.from_array(np.ones(2, np.float32), "a"),
                                                         numpy_helper.from_array(np.ones(1, np.int64), "b")]))
    nodes = [
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.arange(4, dtype=np.float32), "kc")),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g),
        custom,
    ]
    g = helper.make_graph(
        nodes, "main",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.ones((2, 2), np.float32), "W"),
         helper.make_tensor("typed", TensorProto.FLOAT, [2], [1.0, 2.0])],
        sparse_initializer=[helper.make_sparse_tensor(
            numpy_helper.from_array(np.ones(2, np.float32), "S"),
            numpy_helper.from_array(np.array([0, 3], np.int64), "S_i"), [4])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1)])
    ti = m.training_info.add()
    ti.initialization.CopyFrom(helper.make_graph(
        [helper.make_node("Constant", [], ["w0"], value=numpy_helper.from_array(np.zeros((2, 2), np.float32)))],
        "init", [], [helper.make_tensor_value_info("w0", TensorProto.FLOAT, [2, 2])]))
    ti.algorithm.CopyFrom(helper.make_graph(
        [], "algo", [], [], [numpy_helper.from_array(np.ones(5, np.float64), "algo_init")]))
    return m


def _nested_model() -> onnx.ModelProto:
    """If branches two levels deep, two If nodes in the main graph and one in
    the algorithm: a walk's order of graphs (roots first, then subgraphs as
    a stack finds them) differs from the order the scans meet them."""
    def branch(name: str, depth: int) -> onnx.GraphProto:
        nodes = [helper.make_node("Constant", [], [f"{name}_c"],
                                  value=numpy_helper.from_array(np.full(2, depth, np.float32), f"{name}_k"))]
        if depth:
            nodes.append(helper.make_node("If", ["cond"], [f"{name}_y"], then_branch=branch(f"{name}t", depth - 1),
                                          else_branch=branch(f"{name}e", depth - 1)))
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_c", TensorProto.FLOAT, [2])],
                                 [numpy_helper.from_array(np.zeros(1, np.float32), f"{name}_i")])

    nodes = [helper.make_node("If", ["cond"], [f"y{i}"], then_branch=branch(f"a{i}", 2), else_branch=branch(f"b{i}", 1))
             for i in range(2)]
    g = helper.make_graph(nodes, "main", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y0", TensorProto.FLOAT, [2])],
                          [numpy_helper.from_array(np.ones(2, np.float32), "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.training_info.add().algorithm.CopyFrom(helper.make_graph(
        [helper.make_node("If", ["cond"], ["z"], then_branch=branch("c", 1), else_branch=branch("d", 0))],
        "algo", [], []))
    return m


@pytest.mark.parametrize("make", [_rich_model, _nested_model])
def test_one_scan_per_graph_gives_each_graphs_contents_in_walk_order(make):
    m = make()
    graphs = protos.walk_graphs(m)
    one_scan = protos.model_graph_contents(m)
    assert len(one_scan) == len(graphs) == len(protos.all_graphs(m))
    for (found, sparse), g in zip(one_scan, graphs):
        want_tensors, want_sparse = protos.graph_contents(g)
        assert [t.name for t in found] == [t.name for t in want_tensors]
        assert all(a is b for a, b in zip(found, want_tensors))
        assert [st.SerializeToString() for st in sparse] == [st.SerializeToString() for st in want_sparse]
    labelled = [t for _, t in protos.labelled_tensors(m)]
    assert [t.name for t in protos.all_tensors(m)] == [t.name for t in labelled]
    assert all(a is b for a, b in zip(protos.all_tensors(m), labelled))


def test_the_label_free_walk_visits_what_the_labelled_walk_visits_in_order():
    m = _rich_model()
    labelled = [t for _, t in protos.labelled_tensors(m)]
    plain = list(protos.all_tensors(m))
    assert len(plain) == len(labelled) == 13
    assert all(a is b for a, b in zip(plain, labelled))  # the same objects, the same order
    assert [g for _, g in protos.all_graphs(m)] == protos.walk_graphs(m)
    sparse = [st for g in protos.walk_graphs(m) for st in protos.graph_contents(g)[1]]
    assert [st.SerializeToString() for st in sparse] == [
        st.SerializeToString() for _, st in protos.labelled_sparse_tensors(m)]


def _labelled_error(m: onnx.ModelProto) -> str:
    """The error of the labelled walk alone (what check_tensors said before)."""
    try:
        for where, t in protos.labelled_tensors(m):
            tensors.check_tensor(t, where)
        for where, st in protos.labelled_sparse_tensors(m):
            tensors.check_sparse_tensor(st, where)
    except TrainingModelError as exc:
        return str(exc)
    raise AssertionError("no error")


@pytest.mark.parametrize("where", ["subgraph", "initializer", "sparse", "typed", "training"])
def test_the_one_pass_check_reports_the_first_bad_tensor_with_its_place(where):
    m = _rich_model()
    if where == "subgraph":  # a short Constant inside an If branch, and a later bad initializer
        m.graph.node[1].attribute[0].g.node[0].attribute[0].t.raw_data = b"\0" * 4
        m.graph.initializer[0].raw_data = b"\0" * 3
    elif where == "initializer":
        m.graph.initializer[0].dims[:] = [2**40, 2**40]
    elif where == "sparse":
        m.graph.sparse_initializer[0].indices.CopyFrom(numpy_helper.from_array(np.array([0, 9], np.int64)))
    elif where == "typed":
        m.graph.initializer[1].float_data.append(3.0)
    else:
        m.training_info[0].algorithm.initializer[0].raw_data = b"\0" * 8
    expected = _labelled_error(m)
    with pytest.raises(TrainingModelError) as info:
        tensors.check_tensors(m)
    assert str(info.value) == expected
    assert not str(info.value).startswith(":")  # it says where


def test_raw_length_is_the_length_of_raw_data():
    m = _rich_model()
    for t in protos.all_tensors(m):
        if t.HasField("raw_data"):
            assert tensors.raw_length(t) == len(t.raw_data)
    big = numpy_helper.from_array(np.zeros(300_000, np.float32), "big")
    assert tensors.raw_length(big) == 1_200_000


def test_load_spills_exactly_when_spill_would(monkeypatch):
    w = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    m = mlp()
    m.graph.initializer.append(numpy_helper.from_array(w, "frozen"))
    monkeypatch.setattr(storage, "SPILL_FROM", 2**40)
    proto, _ = loading.load(m)
    assert proto is m  # nothing to spill: the model itself
    monkeypatch.setattr(storage, "SPILL_FROM", 2**20)
    proto, _ = loading.load(m)
    assert proto is not m
    frozen = next(t for t in proto.graph.initializer if t.name == "frozen")
    assert mapped.is_mapped(frozen)
    np.testing.assert_array_equal(mapped.to_array(frozen), w)


def test_load_still_refuses_external_data_in_a_model_proto():
    m = mlp()
    t = m.graph.initializer[0]
    t.data_location = TensorProto.EXTERNAL
    t.ClearField("raw_data")
    t.external_data.add(key="location", value="weights.bin")
    with pytest.raises(TrainingModelError, match="refers to external data"):
        loading.load(m)


def _expected_initial(t: onnx.TensorProto) -> bytes:
    value = onnx.TensorProto()
    value.CopyFrom(t)
    value.ClearField("name")
    return value.SerializeToString()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_initialization_graph_holds_every_starting_value_bit_for_bit(accumulate):
    source = mlp(batch_norm=True)
    # Storage fields other than raw_data, and fields besides the data, are kept as they are.
    b1 = next(t for t in source.graph.initializer if t.name == "b1")
    values = numpy_helper.to_array(b1).tolist()
    b1.ClearField("raw_data")
    b1.float_data.extend(values)
    b1.doc_string = "a bias"
    before = source.SerializeToString()
    tm = build.training_model(source, optimizer=build.Adam(lr=0.01), accumulate=accumulate)
    assert source.SerializeToString() == before  # the input is not modified
    inits = {t.name: t for t in source.graph.initializer}
    seen = set()
    for ti in tm.training_info:
        g = ti.initialization
        produced = {o: n for n in g.node for o in n.output}
        for b in ti.initialization_binding:
            if b.key in inits:
                node = produced[b.value]
                assert node.op_type == "Constant" and [a.name for a in node.attribute] == ["value"]
                assert node.attribute[0].type == onnx.AttributeProto.TENSOR
                assert node.attribute[0].t.SerializeToString() == _expected_initial(inits[b.key])
                seen.add(b.key)
    assert {"W1", "b1", "W2", "b2"} <= seen
    assert any("running" in k or "mean" in k or "var" in k for k in seen - {"W1", "b1", "W2", "b2"})
    validate(tm, None)  # a valid training model


def test_a_skeleton_over_the_entry_limit_is_refused_before_it_is_made(monkeypatch):
    m = mlp()
    m.graph.initializer.append(numpy_helper.from_array(np.ones(1000, np.float32), "frozen"))
    tm = build.training_model(m, optimizer=build.SGD(lr=0.1), trainable=["W1", "b1", "W2", "b2"])
    state = validate(tm, None).state
    assert "frozen" not in state
    assert program_cache.model_digest(tm, state) is not None
    monkeypatch.setattr(diskcache, "MAX_ENTRY_BYTES", 3999)

    def never(*a, **k):
        raise AssertionError("the skeleton was made")

    monkeypatch.setattr(program_cache, "_graph_skeleton", never)
    assert program_cache.model_digest(tm, state) is None


def _with_marker(where: str) -> onnx.ModelProto:
    """_rich_model with the string "MARKERXY" in one string field."""
    m = _rich_model()
    if where == "node input":
        m.graph.node[2].input[0] = "MARKERXY"
    elif where == "subgraph node name":
        m.graph.node[1].attribute[0].g.node[0].name = "MARKERXY"
    elif where == "tensor name":
        m.graph.initializer[1].name = "MARKERXY"
    elif where == "attribute tensor doc":
        m.graph.node[0].attribute[0].t.doc_string = "MARKERXY"
    elif where == "sparse values name":
        m.graph.sparse_initializer[0].values.name = "MARKERXY"
    elif where == "dim param":
        m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "MARKERXY"
    elif where == "metadata":
        m.metadata_props.add(key="k", value="MARKERXY")
    elif where == "opset domain":
        m.opset_import[1].domain = "MARKERXY"
    elif where == "binding":
        m.training_info[0].update_binding.add(key="MARKERXY", value="v")
    elif where == "external data key":
        t = m.graph.initializer[0]
        t.external_data.add(key="MARKERXY", value="x")
    return m


@pytest.mark.parametrize("where", ["node input", "subgraph node name", "tensor name",
                                   "attribute tensor doc", "sparse values name", "dim param",
                                   "metadata", "opset domain", "binding", "external data key"])
def test_a_bad_string_anywhere_is_found_by_the_fast_path(where):
    m = _with_marker(where)
    loading.check_strings(m)  # valid text passes
    data = m.SerializeToString()
    assert data.count(b"MARKERXY") == 1
    bad = onnx.ModelProto.FromString(data.replace(b"MARKERXY", b"MARKER\xff\xfe"))
    assert not _fast_path_passes(bad)
    with pytest.raises(TrainingModelError, match="is not valid UTF-8"):
        loading.check_strings(bad)


def _fast_path_passes(m) -> bool:
    try:
        return loading._strings_ok(m)
    except Exception:
        return False


def _counting_initialization_programs(monkeypatch) -> list:
    import onnxtrain.lower.programs

    made = []
    real = onnxtrain.lower.programs.initialization_program

    def counted(tm, index, *rest):
        made.append(index)
        return real(tm, index, *rest)

    monkeypatch.setattr(onnxtrain.lower.programs, "initialization_program", counted)
    return made


def test_a_plain_initialization_graph_is_lowered_when_initialize_first_needs_it(monkeypatch):
    from onnxtrain import TrainingSession

    made = _counting_initialization_programs(monkeypatch)
    tm = build.training_model(mlp(), optimizer=build.Adam(lr=0.1), accumulate=2)
    sess = TrainingSession(tm)
    start = {k: v.copy() for k, v in sess.state.items()}
    assert made == []  # construction and training do not need them
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    feeds = {"X": x, "target": np.array([0, 1, 2, 0])}
    sess.train_step(feeds, algorithm=0)
    sess.train_step(feeds, algorithm=1)
    assert made == []
    sess.initialize()
    assert made == [0, 1]
    for k, v in start.items():
        np.testing.assert_array_equal(sess.state[k], v)
    sess.initialize()
    assert made == [0, 1]  # lowered once
    assert {"training_info[0].initialization", "training_info[1].initialization"} <= set(sess.programs())


def test_an_initialization_graph_with_training_ops_is_lowered_at_construction(monkeypatch):
    from onnxtrain import TrainingSession

    made = _counting_initialization_programs(monkeypatch)
    tm = build.training_model(mlp(), optimizer=build.SGD(lr=0.1))
    init = tm.training_info[0].initialization
    # An unknown training op: lowering refuses it, so construction must.
    init.node.append(helper.make_node("Bogus", [], ["extra"], domain="ai.onnx.preview.training"))
    init.output.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [1]))
    with pytest.raises(TrainingModelError, match="Bogus"):
        TrainingSession(tm)
    assert made == [0]


# ------------------------------------------------------------------ what the first step builds
def test_the_inference_program_is_built_when_first_needed(monkeypatch):
    """A training step lowers no inference program (L1's costs 0.3 s cold):
    ``run`` builds it, once."""
    from models import mlp_classifier

    from onnxtrain import TrainingSession
    from onnxtrain.lower import programs

    built = []
    real = programs.inference_program
    monkeypatch.setattr(programs, "inference_program", lambda tm, check=None: built.append(1) or real(tm, check))
    x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    sess = TrainingSession(mlp_classifier())
    sess.train_step({"X": x, "label": np.zeros(6, np.int64)})
    assert built == []
    out = sess.run({"X": x})
    assert built == [1] and out
    sess.run({"X": x})
    assert built == [1]


@pytest.mark.parametrize("make", ["linear_regression", "mlp_classifier", "overridable_regression", "builder"])
def test_the_names_a_model_may_be_fed_need_no_inference_program(make):
    """``input_names``, known before the inference program is built, are what it and the algorithms take."""
    import models

    from onnxtrain.lower.programs import ProgramSet

    if make == "builder":
        model = build.training_model(mlp(batch_norm=True), loss="cross_entropy", target="label",
                                     optimizer=build.AdamW(lr=0.1))
    else:
        model = getattr(models, make)()
    progs = ProgramSet(validate(model, None), {})
    before = progs.input_names
    inf = progs.inference
    names = set(inf.feeds) | set(inf.optional_feeds)
    for p in progs.algorithms:
        names |= set(p.feeds) | set(p.optional_feeds)
    assert before == names
