"""Hostile or broken model files give a clean error: TrainingModelError naming the problem.

Never a segfault, a hang, a MemoryError from a lying header or a bare
protobuf traceback.  Every case here goes through ``TrainingSession(...)``
(path, bytes or ModelProto), the way users load models.
"""

from __future__ import annotations

import os
import random

import numpy as np
import onnx
import pytest
from models import linear_regression, mlp_classifier, vi
from onnx import TensorProto, helper, numpy_helper
from reliability_models import counter_model

from onnxtrain import TrainingModelError, TrainingSession
from onnxtrain.io.model import load, validate


def refused(model, *needles: str) -> str:
    """The TrainingModelError message for ``model``; it must contain every needle."""
    with pytest.raises(TrainingModelError) as info:
        TrainingSession(model)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def works_or_refused(model) -> None:
    try:
        validate(*load(model))
    except TrainingModelError as exc:
        assert str(exc)


@pytest.fixture(scope="module")
def mlp_bytes() -> bytes:
    return mlp_classifier("adam").SerializeToString()


# ------------------------------------------------------------ parsing
def test_truncated_files_at_every_length(mlp_bytes, tmp_path):
    """Every prefix either parses into a (smaller) valid model or is refused.

    A cut at a field boundary is a valid protobuf, so "works" is allowed."""
    n = len(mlp_bytes)
    cuts = sorted(set(range(0, 200)) | set(range(200, n, 7)) | {n - 1})
    refusals = 0
    for cut in cuts:
        try:
            validate(*load(mlp_bytes[:cut]))
        except TrainingModelError as exc:
            refusals += 1
            assert str(exc)
    assert refusals > len(cuts) // 2
    path = tmp_path / "truncated.onnx"
    path.write_bytes(mlp_bytes[: n // 2])
    refused(path, "cannot parse the model", str(path))


def test_random_bytes():
    rng = random.Random(0)
    for i in range(300):
        data = bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 2, 10, 100, 1000, 5000])))
        works_or_refused(data)


def test_random_bytes_after_a_valid_prefix(mlp_bytes):
    rng = random.Random(1)
    for _ in range(200):
        cut = rng.randrange(len(mlp_bytes))
        tail = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64)))
        works_or_refused(mlp_bytes[:cut] + tail)


@pytest.mark.parametrize(
    "message, kind",
    [
        (numpy_helper.from_array(np.ones((3, 4), np.float32), "t"), "TensorProto"),
        (helper.make_tensor("t", TensorProto.FLOAT, [1], [1.0]), None),
        (helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                           [vi("x", TensorProto.FLOAT, [1])], [vi("y", TensorProto.FLOAT, [1])]),
         "GraphProto"),
        (helper.make_node("Relu", ["x"], ["y"], name="relu"), "NodeProto"),
        (mlp_classifier().training_info[0], "TrainingInfoProto"),
    ],
    ids=["TensorProto", "small-TensorProto", "GraphProto", "NodeProto", "TrainingInfoProto"],
)
def test_valid_protobuf_of_the_wrong_message_type(message, kind):
    msg = refused(message.SerializeToString(), "cannot parse the model")
    if kind is not None:
        assert f"onnx.{kind}" in msg, msg


def test_empty_input():
    refused(b"", "no main graph")


def test_lying_length_prefixes_do_not_allocate():
    """A length-delimited field that claims ~2 GiB (or 2**63) in a few bytes."""
    for tag in (0x3A, 0x0A, 0x72):  # graph (7), field 1, training_info (20 -> 0xA2 0x01)
        for length in (2**31 - 5, 2**40, 2**63 - 1):
            varint = bytearray()
            x = length
            while True:
                b, x = x & 0x7F, x >> 7
                varint.append(b | (0x80 if x else 0))
                if not x:
                    break
            refused(bytes([tag]) + bytes(varint) + b"\0" * 16, "cannot parse the model")


# ------------------------------------------------------------ files
def test_paths_that_are_not_model_files(tmp_path):
    refused(tmp_path, "not a regular file")
    refused(tmp_path / "missing.onnx", "cannot read model file")
    refused(str(tmp_path / "nul\0byte.onnx"), "cannot read model file")
    if os.path.exists("/dev/zero"):
        refused("/dev/zero", "not a regular file")  # would never end if read


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_fifo_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file")


def test_file_over_2gb_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.onnx"
    with open(path, "wb") as f:
        f.truncate(3 * 2**30)  # sparse: no disk space, and must not be read
    refused(path, "2 GiB", "external data")


# ------------------------------------------------- tensors and their data
def _with_initializer(t: onnx.TensorProto, where: str = "graph") -> onnx.ModelProto:
    m = linear_regression()
    graph = {"graph": m.graph, "algorithm": m.training_info[0].algorithm,
             "initialization": m.training_info[0].initialization}[where]
    graph.initializer.append(t)
    return m


@pytest.mark.parametrize("where", ["graph", "algorithm", "initialization"])
def test_absurd_dims_with_little_data_are_refused_before_allocating(where):
    big = TensorProto(name="big", data_type=TensorProto.FLOAT, dims=[2**40, 2**40],
                      raw_data=b"\0" * 16)
    refused(_with_initializer(big, where), "'big'", "raw_data holds 16 bytes",
            "dims [1099511627776, 1099511627776] of FLOAT need")


def test_absurd_dims_of_a_state_variable():
    m = linear_regression()
    m.graph.initializer[0].dims[:] = [2**40, 2**40]
    refused(m, "graph.initializer[0] ('W')", "raw_data holds 12 bytes")


def test_absurd_dims_in_typed_data_and_constant_attributes():
    t = TensorProto(name="big", data_type=TensorProto.INT64, dims=[2**62], int64_data=[1, 2])
    refused(_with_initializer(t), "int64_data holds 2 values", "need 4611686018427387904")
    m = linear_regression()
    const = TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[2**31, 2**31],
                        raw_data=b"\0" * 4)
    m.training_info[0].initialization.node[0].attribute[0].t.CopyFrom(const)
    refused(m, "training_info[0].initialization.node[0]", ".value", "raw_data holds 4 bytes")


def test_raw_data_length_must_match_dims():
    m = linear_regression()
    m.graph.initializer[0].raw_data = m.graph.initializer[0].raw_data[:-4]
    refused(m, "graph.initializer[0] ('W'): raw_data holds 8 bytes, but dims [3, 1] of FLOAT need 12")
    m = linear_regression()
    m.training_info[0].algorithm.initializer[1].raw_data = b"\1" * 16
    refused(m, "training_info[0].algorithm.initializer[1] ('step0')", "holds 16 bytes", "need 8")


@pytest.mark.parametrize(
    "tensor_proto, needle",
    [
        (TensorProto(name="t", data_type=TensorProto.FLOAT, dims=[3], float_data=[1.0]),
         "float_data holds 1 values, but dims [3] of FLOAT need 3"),
        (TensorProto(name="t", data_type=TensorProto.FLOAT, dims=[2], int64_data=[1, 2]),
         "keeps its values in float_data or raw_data, not in int64_data"),
        (TensorProto(name="t", data_type=TensorProto.FLOAT, dims=[1], float_data=[1.0],
                     raw_data=b"\0" * 4), "both in raw_data and in float_data"),
        (TensorProto(name="t", data_type=TensorProto.FLOAT, dims=[4]), "float_data holds 0 values"),
        (TensorProto(name="t", data_type=0, dims=[1], raw_data=b"\0"), "no data_type"),
        (TensorProto(name="t", data_type=999, dims=[1], raw_data=b"\0"), "data_type 999"),
        (TensorProto(name="t", data_type=TensorProto.FLOAT, dims=[-1], raw_data=b""),
         "dims[0] is -1"),
        (TensorProto(name="t", data_type=TensorProto.STRING, dims=[2], raw_data=b"ab"),
         "STRING tensor cannot use raw_data"),
        (TensorProto(name="t", data_type=TensorProto.STRING, dims=[3], string_data=[b"a"]),
         "string_data holds 1 values"),
        (TensorProto(name="t", data_type=TensorProto.INT4, dims=[5], raw_data=b"\0\0"),
         "raw_data holds 2 bytes, but dims [5] of INT4 need 3"),
        (TensorProto(name="t", data_type=TensorProto.COMPLEX64, dims=[2], float_data=[1, 2]),
         "float_data holds 2 values, but dims [2] of COMPLEX64 need 4"),
    ],
    ids=["count", "wrong-field", "raw-and-typed", "no-data", "undefined-type", "unknown-type",
         "negative-dim", "string-raw", "string-count", "int4-packing", "complex-pairs"],
)
def test_tensor_data_must_match_dims_and_type(tensor_proto, needle):
    refused(_with_initializer(tensor_proto), "graph.initializer[2] ('t')", needle)


def _accepted_value(t: onnx.TensorProto) -> np.ndarray:
    """Validate a model holding ``t`` as a constant initializer; return its loaded value."""
    tm = validate(*load(_with_initializer(t)))
    assert "t" not in tm.state  # not bound: a constant, not state
    kept = [x for x in tm.proto.graph.initializer if x.name == "t"]
    assert len(kept) == 1
    return numpy_helper.to_array(kept[0])


def test_empty_tensors_and_every_fixed_size_type_are_accepted():
    for dtype in (np.float32, np.float64, np.float16, np.int8, np.uint8, np.int16, np.uint16,
                  np.int32, np.uint32, np.int64, np.uint64, np.bool_, np.complex64, np.complex128):
        for shape in ((0,), (2, 0), (), (3,), (2, 3)):
            value = np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)
            raw = _accepted_value(numpy_helper.from_array(value, "t"))
            assert raw.dtype == np.dtype(dtype) and raw.shape == shape
            np.testing.assert_array_equal(raw, value)
            typed = helper.make_tensor("t", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                                       shape, value.flatten().tolist())
            loaded = _accepted_value(typed)
            assert loaded.dtype == np.dtype(dtype) and loaded.shape == shape
            np.testing.assert_array_equal(loaded, value)
    strings = helper.make_tensor("t", TensorProto.STRING, [2], [b"a", b"b"])
    assert [v.decode() if isinstance(v, bytes) else v for v in _accepted_value(strings).tolist()] == ["a", "b"]


def test_raw_length_is_measured_without_trusting_unknown_fields():
    """Unknown fields in a TensorProto cannot make a short raw_data pass the check."""
    t = numpy_helper.from_array(np.ones(4, np.float32), "t")
    data = bytearray(t.SerializeToString())
    t2 = TensorProto()
    # field 99 (unknown), length-delimited, 4 bytes: as large as the missing data
    t2.ParseFromString(bytes(data) + bytes([0x9A, 0x06, 4]) + b"abcd")
    t2.raw_data = b"\0" * 12
    refused(_with_initializer(t2), "raw_data holds 12 bytes, but dims [4] of FLOAT need 16")


# ----------------------------------------------------------- sparse tensors
def _sparse_model(values, indices, dims, as_state: bool) -> onnx.ModelProto:
    m = counter_model(p0_shape=(4,), p1_shape=(2, 2), with_init=False)
    st = helper.make_sparse_tensor(values, indices, dims)
    if as_state:
        keep = [t for t in m.graph.initializer if t.name != "P0"]
        del m.graph.initializer[:]
        m.graph.initializer.extend(keep)
        st.values.name = "P0"
    else:
        st.values.name = "S"
    m.graph.sparse_initializer.append(st)
    return m


@pytest.mark.parametrize("as_state", [True, False], ids=["state", "constant"])
def test_sparse_tensors_are_checked(as_state):
    vals = numpy_helper.from_array(np.array([1.0, 2.0]), "v")
    idx = numpy_helper.from_array(np.array([0, 3], np.int64), "i")
    TrainingSession(_sparse_model(vals, idx, [4], as_state))  # valid
    bad_idx = numpy_helper.from_array(np.array([0, 4], np.int64), "i")
    refused(_sparse_model(vals, bad_idx, [4], as_state), "index 4 is out of range for dims [4]")
    neg_idx = numpy_helper.from_array(np.array([-1, 0], np.int64), "i")
    refused(_sparse_model(vals, neg_idx, [4], as_state), "out of range")
    wide = numpy_helper.from_array(np.array([0, 1, 2], np.int64), "i")
    refused(_sparse_model(vals, wide, [4], as_state), "indices dims [3] must be [NNZ]")
    refused(_sparse_model(vals, idx, [2**40, 2**40], as_state), "would need", "dense")


# ----------------------------------------------------------- graph structure
def test_binding_value_dtype_differs_from_its_state_variable():
    m = counter_model(p0_shape=(4,), p1_shape=(2, 2))
    algo = m.training_info[0].algorithm
    algo.node.append(helper.make_node("Cast", ["P0_new"], ["P0_i"], to=TensorProto.INT64))
    algo.output.append(vi("P0_i", TensorProto.INT64, [4]))
    m.training_info[0].update_binding[0].value = "P0_i"
    refused(m, "training_info[0].update_binding[0]: value 'P0_i' has element type INT64, "
               "but state variable 'P0' is DOUBLE")


def test_cycle_undefined_input_duplicate_output_graphcall():
    m = linear_regression()
    m.graph.node[0].input[0] = "Y"  # MatMul reads Add's output: a cycle
    refused(m, "graph.node[0]", "'Y' is not defined before this node")
    m = linear_regression()
    m.graph.node[1].input[1] = "nowhere"
    refused(m, "graph.node[1]", "'nowhere'")
    m = linear_regression()
    m.graph.output.append(m.graph.output[0])
    refused(m, "graph.output[1]: duplicate output 'Y'")
    m = linear_regression()
    m.training_info[0].algorithm.node.append(helper.make_node("GraphCall", ["X"], ["Z"]))
    refused(m, "GraphCall", "removed in ONNX 1.8")


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    n, out = len(payload), bytearray([(field << 3) | 2])
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out) + payload


def _nested_if_model(depth: int) -> bytes:
    """Bytes of a model whose If nodes nest ``depth`` deep (built as bytes:
    protobuf will not even copy messages nested that deep)."""
    f32 = lambda name: vi(name, TensorProto.FLOAT, [2]).SerializeToString()  # noqa: E731
    graph = _ld(1, helper.make_node("Identity", ["X"], ["o0"]).SerializeToString())
    graph += _ld(2, b"b") + _ld(12, f32("o0"))
    for d in range(depth):
        leaf = helper.make_graph([helper.make_node("Identity", ["X"], [f"e{d}"])], "e", [],
                                 [vi(f"e{d}", TensorProto.FLOAT, [2])])
        then_attr = _ld(1, b"then_branch") + bytes([0xA0, 0x01, 5]) + _ld(6, graph)
        else_attr = helper.make_attribute("else_branch", leaf).SerializeToString()
        node = (_ld(1, b"c") + _ld(2, f"o{d + 1}".encode()) + _ld(4, b"If")
                + _ld(5, then_attr) + _ld(5, else_attr))
        graph = _ld(1, node) + _ld(2, b"b") + _ld(12, f32(f"o{d + 1}"))
    main = graph + _ld(11, f32("X")) + _ld(11, vi("c", TensorProto.BOOL, []).SerializeToString())
    model = helper.make_model(helper.make_graph([], "g", [], []),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ClearField("graph")
    return model.SerializeToString() + _ld(7, main)


def test_deeply_nested_subgraphs_are_refused_or_handled():
    """Nesting within protobuf's recursion limit works; beyond it is a parse error."""
    sess = TrainingSession(_nested_if_model(20))
    out = sess.run({"X": np.ones(2, np.float32), "c": np.array(True)})
    np.testing.assert_array_equal(out["o20"], np.ones(2, np.float32))
    # protobuf's own wording differs between releases ("MaxDepth" in newer ones)
    refused(_nested_if_model(200), "cannot parse the model", "not a valid ONNX ModelProto")


def test_recursive_local_function_is_refused():
    f = helper.make_function("local", "F", ["a"], ["b"],
                             [helper.make_node("F", ["a"], ["b"], domain="local")],
                             [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    g = helper.make_graph([helper.make_node("F", ["X"], ["Y"], domain="local")], "g",
                          [vi("X", TensorProto.FLOAT, [2])], [vi("Y", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("local", 1)], functions=[f])
    sess = TrainingSession(m)
    with pytest.raises(TrainingModelError, match="onnxruntime cannot load it"):
        sess.run({"X": np.ones(2, np.float32)})


def test_messages_are_onnxtrain_errors_not_protobuf_tracebacks(mlp_bytes):
    """The cause is chained, but the message itself says what is wrong."""
    with pytest.raises(TrainingModelError) as info:
        TrainingSession(mlp_bytes[:17])
    assert str(info.value).startswith("cannot parse the model (17 bytes): not a valid ONNX ModelProto")
    assert isinstance(info.value, ValueError)


def test_invalid_utf8_in_names_and_attribute_strings():
    """proto2 strings are not checked by protobuf: a bad byte in a name must be
    a TrainingModelError at load (naming the field), not a UnicodeDecodeError later."""
    data = linear_regression().SerializeToString()
    bad = data.replace(b"initialization", b"initia\x87ization", 1)  # same length
    refused(bad, "model.training_info[0].initialization.name", "is not valid UTF-8")
    bad = data.replace(b"XW", b"X\xff", 2)
    refused(bad, "is not valid UTF-8")
    m = linear_regression()
    gradient = next(n for n in m.training_info[0].algorithm.node if n.op_type == "Gradient")
    next(a for a in gradient.attribute if a.name == "y").s = b"lo\xffss"
    refused(m, "training_info[0].algorithm.node[", "Gradient).y", "is not UTF-8 text")


def test_a_model_proto_with_invalid_utf8_gets_the_projects_error():
    """protobuf parses a proto2 string that is not UTF-8 and hands it back as
    bytes; the session must refuse it at construction, naming the field, as it
    does for bytes and paths (not a TypeError from deep inside).

    Bug caught: ``check_strings(proto)`` skipped for a ModelProto argument in
    ``loading.load``."""
    data = linear_regression().SerializeToString()
    bad = onnx.ModelProto.FromString(data.replace(b"initialization", b"initia\x87ization", 1))
    with pytest.raises(TrainingModelError, match=r"training_info\[0\]\.initialization\.name.*UTF-8"):
        TrainingSession(bad)
    bad_name = onnx.ModelProto.FromString(data.replace(b"XW", b"X\xff", 2))
    with pytest.raises(TrainingModelError, match="is not valid UTF-8"):
        TrainingSession(bad_name)
