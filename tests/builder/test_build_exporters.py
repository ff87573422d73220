"""build.training_model on the graph patterns real exporters produce.

Each model here is written by hand with onnx.helper and reproduces one
pattern of torch.onnx.export / Hugging Face exports (the exporter corpus in
tests/data/exporters/ holds real exports):

- shapes only the exporter's value_info knows (a Reshape to a computed
  shape before BatchNormalization), which the training-mode copy must keep;
- scalar constants stored as initializers (attention scale, mask fill
  values, GELU-tanh coefficients, the Pow exponent 3), which the default
  trainable set must leave alone;
- language-model logits [B, T, V] with [B, T] labels and ignore_index;
- PyTorch's unbiased running variance in BatchNormalization.

The oracles are numpy transcriptions of torch.nn.functional.cross_entropy
and of torch's BatchNorm running-statistics rule, in float64."""

from __future__ import annotations

import json
import math
import re
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_build import numeric_grad

from onnxtrain import TrainingSession, build
from onnxtrain.build import parameter_choices
from onnxtrain.core.graph import infer_types

F32, F64, I64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64


def make_model(nodes, inputs, outputs, inits, opset=17, value_info=(), producer=""):
    graph = helper.make_graph(nodes, "exported", inputs, outputs, inits, value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.producer_name = producer
    return model


def tensor(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def metadata(model):
    prefix = "onnxtrain."
    return {p.key[len(prefix):]: json.loads(p.value) for p in model.metadata_props
            if p.key.startswith(prefix)}


# ------------------------------------------------------------------ 1. value_info kept
def reshape_to_computed_shape(declare=True):
    """X -> Gemm -> Dropout -> Reshape(shape computed at run time) -> BatchNormalization -> Flatten.

    The Reshape's target shape is a Slice whose end is computed, so shape
    inference cannot tell the rank of ``r``; only the declared value_info does
    (as in a dynamo export with optimize=False)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Gemm", ["X", "W", "b"], ["h"]),
        helper.make_node("Dropout", ["h", "ratio"], ["d"]),
        helper.make_node("Shape", ["X"], ["batch"], start=0, end=1),
        helper.make_node("Concat", ["batch", "c42"], ["full"], axis=0),
        helper.make_node("Size", ["X"], ["n"]),
        helper.make_node("Div", ["n", "n"], ["one"]),
        helper.make_node("Mul", ["one", "three"], ["k"]),
        helper.make_node("Unsqueeze", ["k", "axis0"], ["end"]),
        helper.make_node("Slice", ["full", "zero", "end"], ["shape"]),
        helper.make_node("Reshape", ["d", "shape"], ["r"]),
        helper.make_node("BatchNormalization", ["r", "scale", "bias", "mean", "var"], ["y"]),
        helper.make_node("Flatten", ["y"], ["logits"]),
    ]
    inits = [
        tensor("W", rng.standard_normal((3, 8))), tensor("b", np.zeros(8)), tensor("ratio", 0.25),
        tensor("c42", [4, 2], np.int64), tensor("three", 3, np.int64), tensor("axis0", [0], np.int64),
        tensor("zero", [0], np.int64), tensor("scale", np.ones(4)), tensor("bias", np.zeros(4)),
        tensor("mean", np.zeros(4)), tensor("var", np.ones(4)),
    ]
    declared = [helper.make_tensor_value_info("r", F32, ["N", 4, 2])] if declare else []
    return make_model(nodes, [helper.make_tensor_value_info("X", F32, ["N", 3])],
                      [helper.make_tensor_value_info("logits", F32, ["N", 8])], inits,
                      value_info=declared)


def test_training_copy_keeps_the_declared_shapes():
    model = reshape_to_computed_shape()
    bare = reshape_to_computed_shape(declare=False)
    assert infer_types(bare.graph, bare.opset_import)[1].get("r") is None  # only value_info knows

    tm = build.training_model(model, loss="cross_entropy", optimizer=build.Adam(lr=0.01))
    algo = tm.training_info[0].algorithm
    bn = next(n for n in algo.node if n.op_type == "BatchNormalization")
    shapes = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in algo.value_info}
    assert shapes[bn.input[0]] == ["N", 4, 2]  # the copy of 'r', under its new name
    assert shapes[bn.output[1]] == [4] and shapes[bn.output[2]] == [4]  # running statistics
    assert metadata(tm)["trainable"] == ["W", "b", "scale", "bias"]  # the 0-d ratio is a constant

    sess = TrainingSession(tm)
    rng = np.random.default_rng(1)
    x, t = rng.standard_normal((6, 3)).astype(np.float32), rng.integers(0, 8, 6)
    losses = [float(sess.train_step({"X": x, "target": t})["loss"]) for _ in range(3)]
    assert np.isfinite(losses).all()
    assert not np.allclose(sess.state["mean"], 0.0)


# ------------------------------------------------------------------ 2. parameters, not constants
VOCAB, DIM, HIDDEN = 11, 8, 16


def gpt2_like_block(seed=0):
    """A GPT-2 style block as a dynamo export stores it: ids [batch, seq] ->
    logits [batch, seq, VOCAB].

    Scalars are initializers: the attention scale, the causal-mask fill
    (-3.4e38, 0-d, and -inf, shape [1]), the GELU-tanh coefficients 0.5, 1,
    sqrt(2/pi), 0.044715, and the Pow exponent 3 (shape [1])."""
    rng = np.random.default_rng(seed)
    n = helper.make_node
    nodes = [
        n("Gather", ["wte", "ids"], ["x"]),
        # causal mask [seq, seq] from the runtime length
        n("Shape", ["ids"], ["seq"], start=1, end=2),
        n("Concat", ["seq", "seq"], ["square"], axis=0),
        n("ConstantOfShape", ["square"], ["ones"], value=tensor("", [1], np.int64)),
        n("Trilu", ["ones"], ["lower"], upper=0),
        n("Cast", ["lower"], ["causal"], to=TensorProto.BOOL),
        # attention
        n("MatMul", ["x", "Wq"], ["q"]),
        n("MatMul", ["x", "Wk"], ["k"]),
        n("MatMul", ["x", "Wv"], ["v"]),
        n("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        n("MatMul", ["q", "kt"], ["raw"]),
        n("Mul", ["raw", "attn_scale"], ["scaled"]),
        n("Where", ["causal", "scaled", "mask_fill"], ["masked"]),
        n("Where", ["causal", "masked", "mask_neg_inf"], ["masked2"]),
        n("Softmax", ["masked2"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v"], ["ctx"]),
        n("MatMul", ["ctx", "Wo"], ["attn"]),
        n("Add", ["x", "attn"], ["h"]),
        # MLP with GELU-tanh: 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))
        n("MatMul", ["h", "W1"], ["a0"]),
        n("Add", ["a0", "b1"], ["a"]),
        n("Pow", ["a", "three"], ["a3"]),
        n("Mul", ["a3", "gelu_c"], ["ca3"]),
        n("Add", ["a", "ca3"], ["inner0"]),
        n("Mul", ["inner0", "sqrt_2_over_pi"], ["inner"]),
        n("Tanh", ["inner"], ["th"]),
        n("Add", ["th", "one"], ["th1"]),
        n("Mul", ["a", "th1"], ["g0"]),
        n("Mul", ["g0", "half"], ["gelu"]),
        n("MatMul", ["gelu", "W2"], ["m0"]),
        n("Add", ["m0", "b2"], ["m"]),
        n("Add", ["h", "m"], ["out"]),
        n("MatMul", ["out", "Wlm"], ["logits"]),
    ]
    weights = {
        "wte": rng.standard_normal((VOCAB, DIM)) * 0.5,
        "Wq": rng.standard_normal((DIM, DIM)) / math.sqrt(DIM),
        "Wk": rng.standard_normal((DIM, DIM)) / math.sqrt(DIM),
        "Wv": rng.standard_normal((DIM, DIM)) / math.sqrt(DIM),
        "Wo": rng.standard_normal((DIM, DIM)) / math.sqrt(DIM),
        "W1": rng.standard_normal((DIM, HIDDEN)) / math.sqrt(DIM),
        "b1": rng.standard_normal(HIDDEN) * 0.1,
        "W2": rng.standard_normal((HIDDEN, DIM)) / math.sqrt(HIDDEN),
        "b2": rng.standard_normal(DIM) * 0.1,
        "Wlm": rng.standard_normal((DIM, VOCAB)) / math.sqrt(DIM),
    }
    constants = {
        "attn_scale": np.asarray(1 / math.sqrt(DIM)),
        "mask_fill": np.asarray(-3.4028234663852886e38),
        "mask_neg_inf": np.asarray([-np.inf]),
        "three": np.asarray([3.0]),
        "gelu_c": np.asarray(0.044715),
        "sqrt_2_over_pi": np.asarray(math.sqrt(2 / math.pi)),
        "one": np.asarray(1.0),
        "half": np.asarray(0.5),
    }
    inits = [tensor(k, v) for k, v in {**weights, **constants}.items()]
    model = make_model(nodes, [helper.make_tensor_value_info("ids", I64, ["batch", "seq"])],
                       [helper.make_tensor_value_info("logits", F32, ["batch", "seq", VOCAB])], inits,
                       producer="pytorch")
    return model, list(weights), list(constants)


def token_batch(rows=4, seq=6, seed=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (rows, seq)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((rows, 1), -100)], axis=1)  # next token, last ignored
    return ids, labels


def test_gpt2_like_defaults_train_only_the_weights():
    model, weights, constants = gpt2_like_block()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no choice here is doubtful
        tm = build.training_model(model, optimizer=build.Adam(lr=1e-2))
    assert metadata(tm)["trainable"] == weights
    algo_inputs = [i.name for i in tm.training_info[0].algorithm.input]
    target = tm.training_info[0].algorithm.input[algo_inputs.index("target")]
    assert [d.dim_param or d.dim_value for d in target.type.tensor_type.shape.dim] == ["batch", "seq"]

    sess = TrainingSession(tm)
    assert not set(constants) & set(sess.state)
    ids, labels = token_batch()
    losses = [float(sess.train_step({"ids": ids, "target": labels})["loss"]) for _ in range(5)]
    assert np.isfinite(losses).all(), losses
    assert losses[-1] < losses[0]


def test_gpt2_like_choices_and_reasons():
    model, weights, _ = gpt2_like_block()
    reasons = {c.name: (c.trainable, c.reason, c.doubt) for c in parameter_choices(model)}
    assert {k for k, (trained, _, _) in reasons.items() if trained} == set(weights)
    assert reasons["three"][:2] == (False, "exponent")
    assert reasons["mask_neg_inf"][:2] == (False, "fill")
    for name in ("attn_scale", "mask_fill", "gelu_c", "sqrt_2_over_pi", "one", "half"):
        assert reasons[name][:2] == (False, "scalar"), name
    assert not any(doubt for _, _, doubt in reasons.values())


def test_training_every_float_initializer_is_what_broke_gpt2():
    """The old default (every float initializer) moves the exponent off 3: NaN at step 2.

    fit stops there with an error naming the step."""
    from onnxtrain.train.loop import NonFiniteLossError, fit

    model, weights, constants = gpt2_like_block()
    tm = build.training_model(model, trainable=weights + constants, optimizer=build.Adam(lr=1e-3))
    sess = TrainingSession(tm)
    ids, labels = token_batch()
    with pytest.raises(NonFiniteLossError, match=r"epoch 1, batch 2 \(step 2") as info:
        fit(sess, (ids, labels), epochs=2, batch_size=2, shuffle=False, progress=False)
    assert (info.value.epoch, info.value.batch, info.value.step) == (0, 1, 2)
    assert not math.isfinite(info.value.loss)
    assert sess.state["three"][0] != 3.0  # the state after the bad step, as documented


def slot_model():
    """One initializer per kind of use, for the reason words."""
    n = helper.make_node
    nodes = [
        n("Gemm", ["X", "W", "b1"], ["y0"]),             # b1: a [1] bias of a one-output Linear
        n("Mul", ["y0", "gain"], ["y1"]),                # gain: [1], read by Mul (doubtful)
        n("Pow", ["y1", "p"], ["y2"]),                   # p: [1] exponent
        n("Clip", ["y2", "lo", "hi"], ["y3"]),           # lo, hi: bounds
        n("Less", ["y3", "threshold"], ["small"]),       # threshold: comparison only
        n("Where", ["small", "y3", "fill"], ["y4"]),     # fill: [1] fill value
        n("Mul", ["y4", "shared"], ["y5"]),              # shared: a weight ...
        n("Pow", ["y5", "shared"], ["y6"]),              # ... and an exponent (doubtful)
        n("Shape", ["W"], ["w_shape"]),                  # reading W's shape changes nothing
        n("Resize", ["y6", "", "scales"], ["y7"], mode="nearest"),  # scales: shape-like
        n("Cast", ["cast_me"], ["as_int"], to=TensorProto.INT64),  # cast_me: cast to int
        n("Reshape", ["y7", "as_int"], ["y"]),
    ]
    inits = [
        tensor("W", np.ones((3, 1))), tensor("b1", [0.5]), tensor("gain", [2.0]), tensor("p", [2.0]),
        tensor("lo", -1.0), tensor("hi", [1.0]), tensor("threshold", [0.1]), tensor("fill", [0.0]),
        tensor("shared", [[1.5]]), tensor("scales", [1.0, 1.0]), tensor("cast_me", [-1, 1]),
        tensor("unused", np.zeros(2)),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("X", F32, ["N", 3])],
                      [helper.make_tensor_value_info("y", F32, ["N", 1])], inits)


def test_reason_words_and_doubtful_choices():
    choices = {c.name: c for c in parameter_choices(slot_model())}
    expected = {
        "W": (True, "weight"), "b1": (True, "weight"), "gain": (True, "weight"),
        "p": (False, "exponent"), "lo": (False, "scalar"), "hi": (False, "bound"),
        "threshold": (False, "comparison"), "fill": (False, "fill"), "shared": (True, "weight"),
        "scales": (False, "shape"), "cast_me": (False, "cast"), "unused": (True, "weight"),
    }
    assert {k: (c.trainable, c.reason) for k, c in choices.items()} == expected
    assert {k for k, c in choices.items() if c.doubt} == {"gain", "shared"}
    assert "setting (exponent)" in choices["shared"].doubt and "one element" in choices["gain"].doubt

    with pytest.warns(UserWarning) as record:
        tm = build.training_model(slot_model(), loss="mse")
    messages = " ".join(str(w.message) for w in record)
    assert "'gain'" in messages and "'shared'" in messages and "'b1'" not in messages
    assert metadata(tm)["trainable"] == ["W", "b1", "gain", "shared", "unused"]
    # a constant can still be trained by naming it
    named = build.training_model(slot_model(), loss="mse", trainable=["W", "p"])
    assert metadata(named)["trainable"] == ["W", "p"]


def test_inspect_shows_the_builder_choice(tmp_path, capsys):
    from onnxtrain.cli.app import main

    model, _, _ = gpt2_like_block()
    path = tmp_path / "block.onnx"
    onnx.save(model, str(path))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "builder's default (trainable=None): 10 trained" in out and "8 constants" in out
    # name, dtype, shape, choice, reason, then the lora column
    rows = {line.split()[0]: list(re.search(r"\] +(train|constant) +(\S+)", line).groups())
            for line in out.splitlines() if " float32 " in line}
    assert rows["three"] == ["constant", "exponent"]
    assert rows["attn_scale"] == ["constant", "scalar"]
    assert rows["Wq"] == ["train", "weight"]


# ------------------------------------------------------------------ 3. cross-entropy on sequences
def log_softmax(z, axis):
    z = z - z.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


def torch_cross_entropy(z, t, class_axis=1, weight=None, label_smoothing=0.0, ignore_index=-100):
    """torch.nn.functional.cross_entropy(z, t, weight, ignore_index=..., label_smoothing=...)
    with reduction="mean", the class axis moved to ``class_axis`` (float64).

    Per ATen's cross_entropy_loss_label_smoothing: ignored targets count in
    neither sum, and both terms divide by the weights of the kept targets."""
    c = z.shape[class_axis]
    logp = np.moveaxis(log_softmax(z, class_axis), class_axis, -1).reshape(-1, c)
    t = t.reshape(-1)
    kept = t != ignore_index
    w = np.ones(c) if weight is None else np.asarray(weight, np.float64)
    logp, t = logp[kept], t[kept]
    total = w[t].sum()
    nll = -(w[t] * logp[np.arange(len(t)), t]).sum() / total
    smooth = -(logp * w).sum() / total
    return (1 - label_smoothing) * nll + label_smoothing / c * smooth


def torch_nll(logp, t, class_axis=1, weight=None, ignore_index=-100):
    c = logp.shape[class_axis]
    logp = np.moveaxis(logp, class_axis, -1).reshape(-1, c)
    t = t.reshape(-1)
    kept = t != ignore_index
    w = np.ones(c) if weight is None else np.asarray(weight, np.float64)
    logp, t = logp[kept], t[kept]
    return -(w[t] * logp[np.arange(len(t)), t]).sum() / w[t].sum()


def lm_head(batch=3, seq=5, dim=4, vocab=6, seed=0, head=None):
    """logits[b, t, :] = x[b, t] W + bias  (MatMul then Add, classes last), float64."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["z"]),
             helper.make_node("Add", ["z", "bias"], ["logits" if head is None else "s"])]
    if head == "log_softmax":
        nodes.append(helper.make_node("LogSoftmax", ["s"], ["logits"], axis=-1))
    inits = [tensor("W", rng.standard_normal((dim, vocab)), np.float64),
             tensor("bias", rng.standard_normal(vocab) * 0.1, np.float64)]
    return make_model(nodes, [helper.make_tensor_value_info("x", F64, ["batch", "seq", dim])],
                      [helper.make_tensor_value_info("logits", F64, ["batch", "seq", vocab])], inits)


def loss_and_gradient(model, loss, feeds):
    """(loss, dL/dW) of the built model, from one SGD step with lr = 1."""
    tm = build.training_model(model, loss=loss, optimizer=build.SGD(lr=1.0), trainable=["W"])
    sess = TrainingSession(tm)
    w0 = sess.state["W"]
    value = float(sess.train_step(feeds)["loss"])
    return value, w0 - sess.state["W"]


def sequence_data(batch=3, seq=5, dim=4, vocab=6, seed=1, ignore=-100):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq, dim))
    t = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
    t[0, :2] = ignore
    t[2, 4] = ignore
    return x, t


SEQUENCE_CASES = {
    "plain": {},
    "weight": dict(weight=[0.5, 1.0, 2.0, 1.5, 0.2, 3.0]),
    "smoothing": dict(label_smoothing=0.2),
    "weight_smoothing": dict(weight=[0.5, 1.0, 2.0, 1.5, 0.2, 3.0], label_smoothing=0.3),
    "other_ignore_index": dict(ignore_index=3),
}


@pytest.mark.parametrize("name", list(SEQUENCE_CASES))
def test_cross_entropy_on_sequence_logits_matches_torch(name):
    kwargs = SEQUENCE_CASES[name]
    model = lm_head()
    x, t = sequence_data(ignore=kwargs.get("ignore_index", -100))
    w0 = numpy_helper.to_array(model.graph.initializer[0])
    b = numpy_helper.to_array(model.graph.initializer[1])
    f = lambda W: torch_cross_entropy(x @ W + b, t, class_axis=-1, **kwargs)  # noqa: E731
    value, grad = loss_and_gradient(model, build.CrossEntropy(**kwargs), {"x": x, "target": t})
    np.testing.assert_allclose(value, f(w0), rtol=1e-9)
    np.testing.assert_allclose(grad, numeric_grad(f, w0), rtol=1e-5, atol=1e-8)


def test_default_cross_entropy_on_sequence_logits():
    """loss="cross_entropy" picks the last axis for a MatMul + Add head and ignores -100."""
    model = lm_head()
    x, t = sequence_data()
    tm = build.training_model(model, loss="cross_entropy", optimizer=build.SGD(lr=0.1))
    target = next(i for i in tm.training_info[0].algorithm.input if i.name == "target")
    assert [d.dim_param for d in target.type.tensor_type.shape.dim] == ["batch", "seq"]
    value = float(TrainingSession(tm).train_step({"x": x, "target": t})["loss"])
    params = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    np.testing.assert_allclose(value, torch_cross_entropy(x @ params["W"] + params["bias"], t, -1), rtol=1e-9)


def test_cross_entropy_with_ignore_index_on_axis_1():
    """Scores [N, C, d] (class_axis=1) with ignored targets, weights and smoothing."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 5))
    model = make_model([helper.make_node("Mul", ["X", "W"], ["scores"])],
                       [helper.make_tensor_value_info("X", F64, ["N", 4, 5])],
                       [helper.make_tensor_value_info("scores", F64, ["N", 4, 5])],
                       [tensor("W", rng.standard_normal((4, 1)), np.float64)])
    t = rng.integers(0, 4, (3, 5)).astype(np.int64)
    t[1, 1:3] = -100
    w0 = numpy_helper.to_array(model.graph.initializer[0])
    kwargs = dict(weight=[1.0, 2.0, 0.5, 1.5], label_smoothing=0.3)
    f = lambda W: torch_cross_entropy(x * W, t, class_axis=1, **kwargs)  # noqa: E731
    loss = build.CrossEntropy(class_axis=1, **kwargs)
    value, grad = loss_and_gradient(model, loss, {"X": x, "target": t})
    np.testing.assert_allclose(value, f(w0), rtol=1e-9)
    np.testing.assert_allclose(grad, numeric_grad(f, w0), rtol=1e-5, atol=1e-8)


def test_nll_on_sequence_log_probabilities_with_ignore_index():
    model = lm_head(head="log_softmax")
    x, t = sequence_data()
    w0, b = (numpy_helper.to_array(i) for i in model.graph.initializer)
    weight = [0.5, 1.0, 2.0, 1.5, 0.2, 3.0]
    f = lambda W: torch_nll(log_softmax(x @ W + b, -1), t, -1, weight)  # noqa: E731
    value, grad = loss_and_gradient(model, build.NLL(weight=weight), {"x": x, "target": t})
    np.testing.assert_allclose(value, f(w0), rtol=1e-9)
    np.testing.assert_allclose(grad, numeric_grad(f, w0), rtol=1e-5, atol=1e-8)
    # "auto" read the class axis from the LogSoftmax; the same as saying it
    assert np.isclose(loss_and_gradient(model, build.NLL(weight=weight, class_axis=-1),
                                        {"x": x, "target": t})[0], value, rtol=1e-12)


#: class_axis_model's Mul scales by a one-element weight, which the builder flags.
ONE_ELEMENT_WEIGHT = pytest.mark.filterwarnings("ignore:training_model. initializer 'W'")


def class_axis_model(op, out_shape, in_shape=None):
    """One node producing the prediction, for the class-axis decision."""
    rng = np.random.default_rng(0)
    in_shape = in_shape or out_shape
    cols = out_shape[-1] if isinstance(out_shape[-1], int) else 10
    if op == "Conv":
        node = helper.make_node("Conv", ["X", "W"], ["y"], pads=[1, 1, 1, 1])
        w = rng.standard_normal((out_shape[1], in_shape[1], 3, 3))
    elif op == "MatMulReshape":
        node = helper.make_node("MatMul", ["X", "W"], ["flat"])
        w = rng.standard_normal((in_shape[-1], cols))
    else:  # an elementwise op on the input: no structural evidence
        node = helper.make_node("Mul", ["X", "W"], ["y"])
        w = rng.standard_normal([1] * len(out_shape))
    nodes = [node]
    inits = [tensor("W", w)]
    if op == "MatMulReshape":
        nodes += [helper.make_node("Add", ["flat", "b"], ["flat_b"]),
                  helper.make_node("Reshape", ["flat_b", "shape"], ["y"])]
        shape = [0, -1, cols] if isinstance(out_shape[-1], int) else [0, out_shape[1], -1]
        inits += [tensor("b", np.zeros(cols)), tensor("shape", shape, np.int64)]
    return make_model(nodes, [helper.make_tensor_value_info("X", F32, in_shape)],
                      [helper.make_tensor_value_info("y", F32, out_shape)], inits)


def target_dims(tm):
    target = next(i for i in tm.training_info[0].algorithm.input if i.name == "target")
    return [d.dim_param or d.dim_value for d in target.type.tensor_type.shape.dim]


@ONE_ELEMENT_WEIGHT
@pytest.mark.parametrize("model, dims", [
    (lambda: class_axis_model("MatMulReshape", ["B", 7, 5], ["B", 7, 3]), ["B", 7]),  # structure
    (lambda: class_axis_model("Conv", ["N", 6, 4, 4], ["N", 2, 4, 4]), ["N", 4, 4]),   # structure
    (lambda: class_axis_model("Mul", ["batch", "seq", 50257]), ["batch", "seq"]),      # fixed sizes
    (lambda: class_axis_model("Mul", ["N", 10, "h", "w"]), ["N", "h", "w"]),            # fixed sizes
    (lambda: class_axis_model("Mul", ["N", 4]), ["N"]),                                  # rank 2
])
def test_class_axis_auto(model, dims):
    assert target_dims(build.training_model(model(), loss="cross_entropy")) == dims


@ONE_ELEMENT_WEIGHT
@pytest.mark.parametrize("model, loss, match", [
    # [N, 4, 5] from an elementwise op: nothing tells
    (lambda: class_axis_model("Mul", ["N", 4, 5]), "cross_entropy", "nothing in the model tells"),
    # a projection to [B, 7, 5], but 7 class weights: the evidence disagrees
    (lambda: class_axis_model("MatMulReshape", ["B", 7, 5], ["B", 7, 3]),
     build.CrossEntropy(weight=np.ones(7)), "evidence disagrees"),
])
def test_ambiguous_class_axis_is_an_error(model, loss, match):
    with pytest.raises(ValueError, match=match + r".*build\.CrossEntropy\(class_axis=-1\)"):
        build.training_model(model(), loss=loss)


@ONE_ELEMENT_WEIGHT
def test_explicit_class_axis():
    model = class_axis_model("Mul", ["N", 4, 5])
    assert target_dims(build.training_model(model, loss=build.CrossEntropy(class_axis=-1))) == ["N", 4]
    assert target_dims(build.training_model(model, loss=build.CrossEntropy(class_axis=2))) == ["N", 4]
    assert target_dims(build.training_model(model, loss=build.CrossEntropy(class_axis=1))) == ["N", 5]
    # class weights of the length of one axis decide too
    assert target_dims(build.training_model(model, loss=build.CrossEntropy(weight=np.ones(5)))) == ["N", 4]
    with pytest.raises(ValueError, match="class_axis must be 'auto', 1 or -1"):
        build.training_model(model, loss=build.CrossEntropy(class_axis=0))
    with pytest.raises(ValueError, match="ignore_index must be an integer"):
        build.CrossEntropy(ignore_index=1.5)


# ------------------------------------------------------------------ 4. BatchNormalization running_var
def batch_norm_model(opset, producer="", momentum=0.8, tied=False):
    """Y = BatchNormalization(X) on X [N, 3, 2, 2]: the batch statistics are X's.

    ``tied``: a fresh BatchNorm as the TorchScript exporter writes it, its
    identical initializers stored once: var = Identity(scale) (ones) and
    mean = Identity(bias) (zeros)."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("BatchNormalization", ["X", "scale", "bias", "mean", "var"], ["Y"],
                              momentum=momentum, epsilon=1e-5)]
    inits = [tensor("scale", 1 + 0.1 * rng.standard_normal(3), np.float64),
             tensor("bias", 0.1 * rng.standard_normal(3), np.float64),
             tensor("mean", 0.1 * rng.standard_normal(3), np.float64),
             tensor("var", 1 + 0.1 * rng.random(3), np.float64)]
    if tied:
        nodes[:0] = [helper.make_node("Identity", ["scale"], ["var"]),
                     helper.make_node("Identity", ["bias"], ["mean"])]
        inits = [tensor("scale", np.ones(3), np.float64), tensor("bias", np.zeros(3), np.float64)]
    return make_model(nodes, [helper.make_tensor_value_info("X", F64, ["N", 3, 2, 2])],
                      [helper.make_tensor_value_info("Y", F64, ["N", 3, 2, 2])], inits,
                      opset=opset, producer=producer)


def running_stats(rule, mean, var, batches, momentum):
    """torch (unbiased) or ONNX (biased) running statistics after ``batches``.

    torch: r = (1 - a) r + a s with a = 1 - momentum (torch's momentum) and
    the unbiased variance for s; ONNX: r = momentum r + (1 - momentum) s with
    the biased one."""
    for x in batches:
        n = x.size / x.shape[1]
        mu = x.mean(axis=(0, 2, 3))
        biased = x.var(axis=(0, 2, 3))
        batch_var = biased * n / (n - 1) if rule == "unbiased" else biased
        mean = momentum * mean + (1 - momentum) * mu
        var = momentum * var + (1 - momentum) * batch_var
    return mean, var


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("rule", ["biased", "unbiased"])
def test_batchnorm_running_var_rule(opset, rule):
    model = batch_norm_model(opset)
    tm = build.training_model(model, loss="mse", optimizer=build.SGD(lr=0.1), batchnorm_var=rule)
    assert metadata(tm)["batchnorm_var"] == rule
    sess = TrainingSession(tm)
    rng = np.random.default_rng(5)
    batches = [rng.standard_normal((n, 3, 2, 2)) * 2 + 1 for n in (4, 2, 5)]
    for x in batches:
        sess.train_step({"X": x, "target": np.zeros_like(x)}, fetch=False)
    start = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    mean, var = running_stats(rule, start["mean"], start["var"], batches, momentum=float(np.float32(0.8)))
    np.testing.assert_allclose(sess.state["mean"], mean, rtol=1e-10)
    np.testing.assert_allclose(sess.state["var"], var, rtol=1e-10)


@pytest.mark.parametrize("producer, rule", [
    ("pytorch", "unbiased"), ("PyTorch", "unbiased"), ("", "biased"), ("tf2onnx", "biased"),
])
def test_batchnorm_var_auto_follows_the_producer(producer, rule):
    tm = build.training_model(batch_norm_model(17, producer=producer), loss="mse")
    assert metadata(tm)["batchnorm_var"] == rule
    ops = [n.op_type for n in tm.training_info[0].algorithm.node]
    assert ("Size" in ops) == (rule == "unbiased")


def test_batchnorm_var_bad_value():
    with pytest.raises(ValueError, match="batchnorm_var must be one of"):
        build.training_model(batch_norm_model(17), loss="mse", batchnorm_var="torch")


def test_batchnorm_statistics_tied_to_the_weights_are_untied():
    """TorchScript's shared initializers: the statistics get their own state, the
    first loss is the training-mode one, and the statistics follow torch's rule."""
    model = batch_norm_model(17, producer="pytorch", tied=True)
    tm = build.training_model(model, loss="mse", optimizer=build.SGD(lr=0.1))
    assert [n.op_type for n in tm.graph.node] == ["BatchNormalization"]
    assert {"mean", "var"} <= {t.name for t in tm.graph.initializer}
    assert metadata(tm)["trainable"] == ["scale", "bias"]
    sess = TrainingSession(tm)
    rng = np.random.default_rng(6)
    batches = [rng.standard_normal((n, 3, 2, 2)) * 2 + 1 for n in (4, 3)]
    first = float(sess.train_step({"X": batches[0], "target": np.zeros_like(batches[0])})["loss"])
    x = batches[0]
    normalized = (x - x.mean(axis=(0, 2, 3), keepdims=True)) / np.sqrt(x.var(axis=(0, 2, 3), keepdims=True) + 1e-5)
    np.testing.assert_allclose(first, np.mean(normalized ** 2), rtol=1e-6)
    sess.train_step({"X": batches[1], "target": np.zeros_like(batches[1])}, fetch=False)
    mean, var = running_stats("unbiased", np.zeros(3), np.ones(3), batches, momentum=float(np.float32(0.8)))
    np.testing.assert_allclose(sess.state["mean"], mean, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(sess.state["var"], var, rtol=1e-10)


def test_deduplicated_initializers_train_separately():
    """TorchScript stores equal initializers once (B = Identity(A)); torch trains two parameters."""
    model = make_model(
        [helper.make_node("Identity", ["A"], ["B"]), helper.make_node("MatMul", ["X", "A"], ["h"]),
         helper.make_node("MatMul", ["h", "B"], ["y"])],
        [helper.make_tensor_value_info("X", F64, ["N", 2])],
        [helper.make_tensor_value_info("y", F64, ["N", 2])], [tensor("A", [[1.0, 0.5], [0.0, 1.0]], np.float64)])
    tm = build.training_model(model, loss="mse", optimizer=build.SGD(lr=0.1))
    assert [n.op_type for n in tm.graph.node] == ["MatMul", "MatMul"]
    assert metadata(tm)["trainable"] == ["A", "B"]
    sess = TrainingSession(tm)
    x = np.random.default_rng(7).standard_normal((5, 2))
    sess.train_step({"X": x, "target": 2 * x}, fetch=False)
    # dL/dA = X^T dY B^T and dL/dB = h^T dY differ: untied, the two move apart
    assert not np.allclose(sess.state["A"], sess.state["B"])
    np.testing.assert_array_equal(sess.run({"X": x})["y"], x @ sess.state["A"] @ sess.state["B"])
    assert [c.name for c in parameter_choices(model)] == ["A", "B"]


def test_baked_causal_mask_is_a_constant():
    """Dynamo exports of GPT-2 bake the causal mask into a float initializer
    [1, 1, T, T] of 0 and float32's lowest value, added to the scores: it is a
    constant ("mask"), while a weight with a large negative entry stays a weight."""
    model, weights, _ = gpt2_like_block()
    seq = 6
    mask = np.triu(np.full((seq, seq), np.finfo(np.float32).min), k=1)[None, None]
    graph = model.graph
    graph.initializer.append(tensor("baked_mask", mask))
    graph.initializer.append(tensor("big_weight", np.asarray([[-2e9, 0.0], [0.5, 0.0]])))
    for node in graph.node:
        if node.op_type == "Softmax":
            node.input[0] = "masked3"
    at = next(i for i, node in enumerate(graph.node) if node.op_type == "Softmax")
    graph.node.insert(at, helper.make_node("Unsqueeze", ["masked2", "zero_axis"], ["masked2_4d"]))
    graph.node.insert(at + 1, helper.make_node("Add", ["masked2_4d", "baked_mask"], ["masked3_4d"]))
    graph.node.insert(at + 2, helper.make_node("Squeeze", ["masked3_4d", "zero_axis"], ["masked3"]))
    graph.initializer.append(tensor("zero_axis", [0], np.int64))
    graph.node.append(helper.make_node("MatMul", ["ids_f", "big_weight"], ["unused_out"]))
    graph.node.insert(0, helper.make_node("Cast", ["ids"], ["ids_f"], to=TensorProto.FLOAT))
    graph.node.insert(1, helper.make_node("Slice", ["ids_f", "s0", "s2", "s1"], ["ids_f2"]))
    graph.node[-1].input[0] = "ids_f2"
    graph.initializer.extend([tensor("s0", [0], np.int64), tensor("s2", [2], np.int64),
                              tensor("s1", [1], np.int64)])
    reasons = {c.name: (c.trainable, c.reason) for c in parameter_choices(model)}
    assert reasons["baked_mask"] == (False, "mask")
    assert reasons["big_weight"] == (True, "weight")
    tm = build.training_model(model, trainable=None, optimizer=build.Adam(lr=1e-2))
    assert "baked_mask" not in metadata(tm)["trainable"]
    sess = TrainingSession(tm)
    ids, labels = token_batch(seq=seq)
    losses = [float(sess.train_step({"ids": ids, "target": labels})["loss"]) for _ in range(3)]
    assert np.isfinite(losses).all(), losses
