"""The decoder kernels (``onnxtrain.kernels.llm``) against their standard-op
chains and float64.

- SiLU * gate, RoPE and the softmax guard are bit for bit the chains they
  replace, their gradients too: compared byte for byte with onnxruntime
  running the standard program, on random values, special values (+-0, +-inf,
  NaN) and tensors large enough for the kernels' two-thread split.
- RMSNorm, the masked softmax, the guarded softmax's gradient and the
  cross-entropy sum rows in double: compared with float64 references, their error at most about the
  standard chain's (twice it, or a few float32 ulps of the largest value).
- The rewrite applies only to the program onnxruntime runs, only to exact
  matches, and a model trains with the kernels as without them.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from chains import (
    cross_entropy,
    guarded_softmax,
    low_rank,
    low_rank_down,
    masked_softmax,
    rms_norm,
    rope,
    rotation,
    run,
    session,
    silu_mul,
)
from onnx import helper

from onnxtrain.kernels.fuse import KERNEL_DOMAIN

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler for the kernel library")

#: float32 ulps of the largest reference value a row-sum kernel may be off by
#: when the standard chain is closer than that.
ULPS = 4 * np.finfo(np.float32).eps


def _kernels(model) -> list[str]:
    return sorted(n.op_type for n in model.graph.node if n.domain == KERNEL_DOMAIN)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit patterns, any NaN equal to any NaN."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


EXACT = [
    ("silu", lambda: silu_mul(), ["SiluMulF32", "SiluMulGradF32"]),
    ("silu, dh in two parts", lambda: silu_mul(two_readers=True), ["SiluMulF32", "SiluMulGradF32"]),
    ("silu, split over threads", lambda: silu_mul((4, 256, 1408), seed=1), ["SiluMulF32", "SiluMulGradF32"]),
    ("silu, named batch and sequence", lambda: silu_mul(two_readers=True, named=True),
     ["SiluMulF32", "SiluMulGradF32"]),
    ("rope", lambda: rope(), ["RopeF32", "RopeGradF32"]),
    ("rope, [S, D] tables", lambda: rope(table_rank=2), ["RopeF32", "RopeGradF32"]),
    ("rope, [1, S, D] tables", lambda: rope((2, 4, 9, 8), table_rank=3), ["RopeF32", "RopeGradF32"]),
    ("rope, split over threads", lambda: rope((4, 8, 1024, 64), seed=2), ["RopeF32", "RopeGradF32"]),
]


@pytest.mark.parametrize("label,make,kinds", EXACT, ids=[e[0] for e in EXACT])
def test_exact_kernels_are_their_chains_bit_for_bit(label, make, kinds):
    chain = make()
    fused, count = chain.fused()
    assert _kernels(fused) == kinds and count == 2
    standard, ours = run(chain.model, chain), run(fused, chain)
    ref = chain.reference(chain.feeds)
    for out in chain.outputs:
        assert _same_bits(standard[out], ours[out]), out
        np.testing.assert_allclose(ours[out], ref[out], rtol=1e-5, atol=1e-5 * np.abs(ref[out]).max())


def _special(shape, rng) -> np.ndarray:
    v = (rng.standard_normal(int(np.prod(shape))) * 4).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3e38, -3e38], np.float32)
    v[rng.choice(v.size, v.size // 4, replace=False)] = rng.choice(specials, v.size // 4)
    return v.reshape(shape)


@pytest.mark.parametrize("make", [silu_mul, rope], ids=["silu", "rope"])
def test_exact_kernels_keep_the_chains_special_values(make):
    chain = make()
    rng = np.random.default_rng(7)
    for k, v in chain.feeds.items():
        if k not in ("cos", "sin"):
            chain.feeds[k] = _special(v.shape, rng)
    fused, _ = chain.fused()
    standard, ours = run(chain.model, chain), run(fused, chain)
    for out in chain.outputs:
        assert _same_bits(standard[out], ours[out]), out


ROTATIONS = [
    ("the rules' rotation, GQA's tables", lambda: rotation()),
    ("inverse, by Neg(sin)", lambda: rotation(neg_sin=True, seed=1)),
    ("channels past 2 half", lambda: rotation((2, 5, 3, 20), seed=2)),
    ("[S, half] tables", lambda: rotation((2, 7, 16), table=(7, 8), seed=3)),
    ("split over threads", lambda: rotation((4, 256, 8, 64), 32, (256, 1, 32), seed=4)),
]


@pytest.mark.parametrize("make", [r[1] for r in ROTATIONS], ids=[r[0] for r in ROTATIONS])
def test_the_rules_rotation_is_one_kernel_bit_for_bit(make):
    chain = make()
    fused, _ = chain.fused()
    assert "RotateHalvesF32" in _kernels(fused)
    standard, ours = run(chain.model, chain), run(fused, chain)
    ref = chain.reference(chain.feeds)
    for out in chain.outputs:
        assert _same_bits(standard[out], ours[out]), out
        np.testing.assert_allclose(ours[out], ref[out], rtol=1e-5, atol=1e-5 * np.abs(ref[out]).max())
    chain.feeds["x"] = _special(chain.feeds["x"].shape, np.random.default_rng(5))
    assert _same_bits(run(chain.model, chain)["y"], run(fused, chain)["y"])


@pytest.mark.parametrize("order", [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)])
def test_rope_gradient_adds_in_the_sums_order(order):
    """The Sum of RoPE's gradient in any operand order: signed zeros (dy of
    +-0 against the Pads' +0) come out as the standard Sum's."""
    chain = rope((1, 2, 5, 8))
    rng = np.random.default_rng(11)
    t = rng.standard_normal(chain.feeds["t"].shape).astype(np.float32)
    t[rng.random(t.shape) < 0.5] = 0.0
    t[rng.random(t.shape) < 0.5] *= -1
    chain.feeds["t"] = t
    total = next(n for n in chain.model.graph.node if n.op_type == "Sum" and len(n.input) == 3)
    terms = list(total.input)
    total.input[:] = [terms[k] for k in order]
    fused, _ = chain.fused()
    assert "RopeGradF32" in _kernels(fused)
    assert _same_bits(run(chain.model, chain)["grad_x"], run(fused, chain)["grad_x"])


def test_the_guard_is_where_isnan_bit_for_bit():
    """NaN (fully masked query rows) becomes +0; -0 stays -0 as in onnxruntime's
    Where(c, 0, p), which copies its second operand's selections."""
    chain = guarded_softmax((2, 3, 40, 40), masked_rows=3)
    fused, _ = chain.fused()
    assert "SoftmaxGuardF32" in _kernels(fused)
    from onnx import TensorProto

    guard_only = helper.make_model(helper.make_graph(
        [helper.make_node("SoftmaxGuardF32", ["p"], ["q"], domain=KERNEL_DOMAIN)], "g",
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, [64])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    guard_only.ir_version = 8
    standard = helper.make_model(helper.make_graph(
        [helper.make_node("IsNaN", ["p"], ["n"]), helper.make_node("Where", ["n", "zero", "p"], ["q"])], "g",
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, [64])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])]), opset_imports=[helper.make_opsetid("", 17)])
    standard.ir_version = 8
    p = _special((64,), np.random.default_rng(3))
    p[:4] = [-0.0, 0.0, np.nan, -np.nan]
    (ours,) = session(guard_only).run(None, {"p": p})
    (theirs,) = session(standard).run(None, {"p": p})
    assert ours.view(np.uint32)[0] == 0x80000000  # -0 kept
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


LOW_RANK = ["LowRankMatMulAddF32", "LowRankTransAF32"]  # (the second: dB = h^T dY, from 256 rows or named)
ROW_SUMS = [
    ("rms norm", lambda: rms_norm(), ["RmsNormF32", "RmsNormGradF32"]),
    ("rms norm, residual", lambda: rms_norm(residual=True), ["RmsNormF32", "RmsNormGradF32"]),
    ("rms norm, large rows, split", lambda: rms_norm((8, 256, 1280), seed=3), ["RmsNormF32", "RmsNormGradF32"]),
    ("rms norm, odd rows", lambda: rms_norm((3, 7, 13), seed=4), ["RmsNormF32", "RmsNormGradF32"]),
    ("rms norm, dy a Sum of 6 terms", lambda: rms_norm((2, 16, 96), seed=9, readers=6, train_w=False),
     ["RmsNormF32", "RmsNormGradF32"]),
    ("softmax", lambda: guarded_softmax(), ["SoftmaxGradF32", "SoftmaxGuardF32"]),
    ("softmax, split", lambda: guarded_softmax((4, 8, 256, 256), masked_rows=5, seed=5),
     ["SoftmaxGradF32", "SoftmaxGuardF32"]),
    ("masked softmax, guarded", lambda: masked_softmax(),
     ["MaskedSoftmaxF32", "SoftmaxGradF32", "SoftmaxGuardF32"]),
    ("masked softmax, L1's attention, split", lambda: masked_softmax((4, 8, 256, 256), (4, 1, 256, 256), seed=5),
     ["MaskedSoftmaxF32", "SoftmaxGradF32", "SoftmaxGuardF32"]),
    ("masked softmax, an [S, S] mask, odd rows", lambda: masked_softmax((3, 2, 7, 77), (7, 77), seed=6),
     ["MaskedSoftmaxF32", "SoftmaxGradF32", "SoftmaxGuardF32"]),
    ("masked softmax, a row of mask values", lambda: masked_softmax((3, 2, 7, 77), (3, 1, 1, 77), seed=7),
     ["MaskedSoftmaxF32", "SoftmaxGradF32", "SoftmaxGuardF32"]),
    ("masked softmax, alternate keys masked at the end", lambda: masked_softmax((3, 2, 7, 77), (3, 1, 1, 77),
                                                                               seed=10, alternate=True),
     ["MaskedSoftmaxF32", "SoftmaxGradF32", "SoftmaxGuardF32"]),
    ("masked softmax, GQA's 5-D lowest-float mask, no guard",
     lambda: masked_softmax((2, 2, 2, 16, 80), (2, 1, 1, 16, 80), guard=False, seed=8,
                            lowest=float(np.finfo(np.float32).min)), ["MaskedSoftmaxF32", "SoftmaxGradPlainF32"]),
    ("softmax without a guard, split", lambda: masked_softmax((4, 8, 256, 256), (256, 256), guard=False, seed=9,
                                                               lowest=-1e9), ["MaskedSoftmaxF32", "SoftmaxGradPlainF32"]),
    ("low rank, LoRA's up-projection, 10 rows", lambda: low_rank((2, 5, 160)), ["LowRankMatMulAddF32"]),
    ("low rank, L1's gate, split", lambda: low_rank((4, 256, 1408), seed=1), LOW_RANK),
    ("low rank, odd columns and rows, Add(delta, base)", lambda: low_rank((3, 7, 141), 5, seed=2, swap=True),
     ["LowRankMatMulAddF32"]),
    ("low rank, named dims, rank 64", lambda: low_rank((2, 9, 136), 64, seed=3, named=True), LOW_RANK),
    ("low rank, rank 12, 300 rows by chunks, 150 columns", lambda: low_rank((3, 100, 150), 12, seed=4), LOW_RANK),
    ("low rank, LoRA's down-projection, dA transposed", lambda: low_rank_down(), ["LowRankTransAF32"]),
    ("low rank, L1's down-projection of the FFN, split", lambda: low_rank_down((4, 256, 1408), seed=1),
     ["LowRankTransAF32"]),
    ("low rank, down-projection, named rows, rank 48", lambda: low_rank_down((2, 9, 136), 48, seed=2, named=True),
     ["LowRankTransAF32"]),
    ("cross-entropy", lambda: cross_entropy(), ["CrossEntropyF32", "CrossEntropyGradF32"]),
    ("cross-entropy, a vocabulary, split", lambda: cross_entropy(600, 8000, ignored=17, seed=6, scale=4.0),
     ["CrossEntropyF32", "CrossEntropyGradF32"]),
    ("cross-entropy, large logits", lambda: cross_entropy(16, 300, ignored=0, seed=8, scale=60.0),
     ["CrossEntropyF32", "CrossEntropyGradF32"]),
    ("cross-entropy, named rows", lambda: cross_entropy(40, 300, ignored=5, seed=9, named=True),
     ["CrossEntropyF32", "CrossEntropyGradF32"]),
    ("cross-entropy, logits far below 0", lambda: cross_entropy(16, 300, ignored=0, seed=10, offset=-200.0),
     ["CrossEntropyF32", "CrossEntropyGradF32"]),
]


@pytest.mark.parametrize("label,make,kinds", ROW_SUMS, ids=[e[0] for e in ROW_SUMS])
def test_row_sum_kernels_are_as_close_to_float64_as_their_chains(label, make, kinds):
    chain = make()
    fused, _ = chain.fused()
    assert _kernels(fused) == kinds
    standard, ours = run(chain.model, chain), run(fused, chain)
    ref = chain.reference(chain.feeds)
    for out in chain.outputs:
        scale = float(np.abs(ref[out]).max()) or 1.0
        err_std = float(np.abs(standard[out] - ref[out]).max())
        err_ours = float(np.abs(ours[out] - ref[out]).max())
        assert np.isfinite(ours[out]).all(), out
        assert err_ours <= max(2 * err_std, ULPS * scale), (out, err_ours / scale, err_std / scale)


def test_the_gradients_terms_are_summed_in_the_kernel():
    """dy's Sum (y read by q, k and v) goes into the kernel where only the
    norm's gradient reads it; with w trained, dw reads dy too and the Sum stays."""
    for train_w, terms in ((False, 3), (True, 1)):
        fused, _ = rms_norm(readers=3, train_w=train_w).fused()
        grad = next(n for n in fused.graph.node if n.op_type == "RmsNormGradF32")
        assert len(grad.input) == 6 + terms, list(grad.input)
        # (the loss's own Sum stays; dy's goes into the kernel unless dw reads it)
        assert sum(n.op_type == "Sum" for n in fused.graph.node) == 1 + (terms == 1)


def test_fully_masked_rows_get_zero_gradient():
    chain = guarded_softmax((1, 2, 5, 5), masked_rows=2)
    fused, _ = chain.fused()
    grad = run(fused, chain)["grad_scores"]
    assert np.all(grad[..., :2, :] == 0) and np.all(np.signbit(grad[..., :2, :]) == 0)


def test_the_masked_softmax_keeps_the_standard_nans():
    """A fully masked row (all -inf) and a row with a NaN score are NaN rows,
    as onnxruntime's Softmax makes them; the guard then zeroes them."""
    chain = masked_softmax(guard=False)
    chain.feeds["scores"][1, 2, 3, 4] = np.nan
    fused, _ = chain.fused()
    assert _kernels(fused) == ["MaskedSoftmaxF32", "SoftmaxGradPlainF32"]
    standard, ours = run(chain.model, chain)["p"], run(fused, chain)["p"]
    assert np.array_equal(np.isnan(ours), np.isnan(standard))
    assert np.isnan(ours[0, :, -1]).all() and np.isnan(ours[1, 2, 3]).all()
    assert np.isfinite(ours[1, 2, :3]).all()


@pytest.mark.parametrize("shapes", [((2, 1, 6, 70), (1, 3, 6, 70)), ((2, 3, 6, 1), (70,)), ((70,), (2, 3, 1, 70))],
                         ids=["both grow", "scores' last axis grows", "the mask is the larger"])
def test_the_masked_softmax_broadcasts_as_the_add(shapes):
    chain = masked_softmax(*shapes, guard=False, lowest=-30.0)
    fused, _ = chain.fused()
    assert _kernels(fused) == ["MaskedSoftmaxF32", "SoftmaxGradPlainF32"]
    standard, ours = run(chain.model, chain), run(fused, chain)
    for out in chain.outputs:
        assert ours[out].shape == standard[out].shape
        np.testing.assert_allclose(ours[out], standard[out], rtol=1e-5, atol=1e-6)


def test_named_softmax_rows_are_matched_in_a_decoder_only():
    """Rows of a named length are a decoder's sequence in a GroupQueryAttention
    program (``llm.rewrite`` passes ``named``), a small model's elsewhere."""
    from onnxtrain.kernels import attention
    from onnxtrain.kernels.graphmatch import Index

    chain = masked_softmax(guard=False, named=True)
    ix = Index(chain.model.graph, list(chain.model.opset_import))
    for named, count in ((False, 0), (True, 1)):
        assert len(attention.masked_softmaxes(ix, KERNEL_DOMAIN, named)) == count
        assert len(attention.plain_softmax_grads(ix, KERNEL_DOMAIN, named)) == count


def test_cross_entropy_with_every_row_ignored_is_nan_as_the_standard_mean():
    chain = cross_entropy(4, 300, ignored=4)
    fused, _ = chain.fused()
    assert np.isnan(run(fused, chain)["loss"]) and np.isnan(run(chain.model, chain)["loss"])


# ------------------------------------------------------------ what is not rewritten
def _variant(chain, op_type: str, edit):
    for node in chain.model.graph.node:
        if node.op_type == op_type:
            edit(node)
            return chain
    raise AssertionError(op_type)


def _const_value(chain, name, value):
    from onnx import numpy_helper

    for node in chain.model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(np.asarray(value, np.float32), name))
    return chain


def _axes_constant(chain, axes):
    """The gradient's ReduceSum over ``axes`` instead of the last axis."""
    from onnx import numpy_helper

    for node in chain.model.graph.node:
        if node.op_type == "Constant" and node.output[0] == "grad/Constant":
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(np.asarray(axes, np.int64), node.output[0]))
            return chain
    raise AssertionError("no axes constant")


REFUSED = [
    ("a few classes, not a vocabulary", lambda: cross_entropy(8, 20), "loss"),
    ("a cube, not a square", lambda: _const_value(rms_norm(), "two", 3.0), "y"),
    ("a mean over another axis", lambda: _variant(rms_norm(), "ReduceMean", lambda n: n.attribute.append(
        helper.make_attribute("noop_with_empty_axes", 1))), "y"),
    ("a sigmoid of another tensor", lambda: _variant(silu_mul(), "Sigmoid", lambda n: n.input.__setitem__(0, "b")),
     "h"),
    ("a rotation on the other halves", lambda: _variant(rope(), "Concat", lambda n: n.input.__setitem__(1, "hi")),
     "y"),
    ("a guard with 1, not 0", lambda: _const_value(guarded_softmax(), "zero", 1.0), "q"),
    ("short rows (a small model's attention)", lambda: masked_softmax((2, 3, 6, 6), (2, 1, 6, 6), guard=False), "p"),
    ("named rows outside a decoder", lambda: masked_softmax(guard=False, named=True), "p"),
    ("a softmax over another axis", lambda: _variant(masked_softmax(), "Softmax", lambda n: n.attribute[0].__setattr__(
        "i", 2)), "p"),
    ("a product of many columns", lambda: low_rank((2, 5, 160), 65), "y"),
    ("a narrow product", lambda: low_rank((2, 5, 48)), "y"),
    ("a down-projection's gradient over few rows", lambda: low_rank_down((2, 5, 160)), "grad_A"),
    ("a down-projection of many columns", lambda: low_rank_down((3, 100, 160), 65), "grad_A"),
    ("a classifier's few classes", lambda: low_rank_down((3, 100, 160), 4), "grad_A"),
    ("a gradient's sum over another axis", lambda: _axes_constant(masked_softmax(guard=False), [2]), "grad_scores"),
]


@pytest.mark.parametrize("label,make,output", REFUSED, ids=[r[0] for r in REFUSED])
def test_other_chains_keep_their_standard_ops(label, make, output):
    chain = make()
    fused, _ = chain.fused()
    producer = next(n for n in fused.graph.node if output in n.output)
    assert producer.domain != KERNEL_DOMAIN, producer.op_type
    standard, ours = run(chain.model, chain), run(fused, chain)
    for out in chain.outputs:
        np.testing.assert_allclose(ours[out], standard[out], rtol=1e-6, atol=1e-6)


def test_a_value_read_elsewhere_keeps_the_chain():
    """RMSNorm's mean read by another node: the forward stays standard ops,
    and so does the gradient, which reads the forward's intermediates."""
    chain = rms_norm()
    g = chain.model.graph
    g.node.append(helper.make_node("Identity", ["mean"], ["mean_out"]))
    g.output.append(helper.make_tensor_value_info("mean_out", 1, None))
    fused, _ = chain.fused()
    assert "RmsNormF32" not in _kernels(fused)


def test_kernels_report_bad_inputs():
    from onnx import TensorProto, numpy_helper

    model = helper.make_model(helper.make_graph(
        [helper.make_node("RopeGradF32", ["dy", "cos", "sin"], ["dx"], domain=KERNEL_DOMAIN)], "g",
        [helper.make_tensor_value_info("dy", TensorProto.FLOAT, [1, 2, 4])],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((3, 4), np.float32), "cos"),
         numpy_helper.from_array(np.ones((3, 4), np.float32), "sin")]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 8
    with pytest.raises(Exception, match="RopeGradF32: expects an even last axis D and cos, sin of S x D elements"):
        session(model).run(None, {"dy": np.ones((1, 2, 4), np.float32)})
    chain = cross_entropy(4, 300, ignored=0)
    fused, _ = chain.fused()
    chain.feeds["labels"] = np.array([0, 1, 300, 2], np.int64)
    with pytest.raises(Exception, match="CrossEntropyF32: a target is out of range"):
        run(fused, chain)
    # Named dims are matched on trust: the kernels check the sizes they get.
    chain = cross_entropy(4, 300, ignored=0, named=True)
    fused, _ = chain.fused()
    chain.feeds["labels"] = np.array([0, 1, 2], np.int64)
    with pytest.raises(Exception, match="CrossEntropyF32"):
        run(fused, chain)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MaskedSoftmaxF32", ["x", "m"], ["y"], domain=KERNEL_DOMAIN)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("m", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 8
    with pytest.raises(Exception, match="MaskedSoftmaxF32: the inputs do not broadcast together"):
        session(model).run(None, {"x": np.ones((2, 3), np.float32), "m": np.ones((2, 2), np.float32)})
    plain = helper.make_model(helper.make_graph(
        [helper.make_node("SoftmaxGradPlainF32", ["dq", "y"], ["dx"], domain=KERNEL_DOMAIN)], "g",
        [helper.make_tensor_value_info("dq", TensorProto.FLOAT, ["a", 3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 2])],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    plain.ir_version = 8
    rot = helper.make_model(helper.make_graph(
        [helper.make_node("RotateHalvesF32", ["x", "c", "s"], ["y"], domain=KERNEL_DOMAIN)], "g",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, None) for k in ("x", "c", "s")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    rot.ir_version = 8
    x = np.ones((2, 5, 3, 16), np.float32)
    for c, s_ in (((4, 1, 8), (4, 1, 8)), ((5, 1, 9), (5, 1, 9)), ((5, 1, 8), (5, 8))):
        with pytest.raises(Exception, match="RotateHalvesF32: (cos and sin must broadcast|expects x of rank)"):
            session(rot).run(None, {"x": x, "c": np.ones(c, np.float32), "s": np.ones(s_, np.float32)})
    with pytest.raises(Exception, match="SoftmaxGradPlainF32: dq and y must have one shape"):
        session(plain).run(None, {"dq": np.ones((2, 3), np.float32), "y": np.ones((3, 2), np.float32)})
    chain = silu_mul(named=True)
    fused, _ = chain.fused()
    with pytest.raises(Exception, match="SiluMulF32: a, s and b must have one size"):
        session(fused).run(None, {**chain.feeds, "b": chain.feeds["b"][:, :1].copy()})


# ------------------------------------------------------------ in a session
def test_a_decoder_trains_with_the_kernels_only_in_the_executed_program():
    """The tiny dynamo Llama of tests/data/llm: ``programs()`` stays standard
    ops, the program onnxruntime runs has the kernels, and 4 steps with them
    give the losses and weights of 4 steps without, to float32 rounding."""
    from test_llm_exports import feeds_of, load

    from onnxtrain import TrainingSession, build

    case, model, arrays = load("llama__dynamo")
    tm = build.training_model(model, loss=case["loss"], optimizer=build.AdamW(lr=1e-3))
    feeds, _ = feeds_of(arrays, tm)
    runs = {}
    for fused in (None, False):
        sess = TrainingSession(tm, fused_kernels=fused)
        standard = sess.programs()["training_info[0].algorithm"]
        executed = sess.programs(executed=True)["training_info[0].algorithm"]
        assert not any(n.domain == KERNEL_DOMAIN for n in standard.graph.node)
        kinds = {n.op_type for n in executed.graph.node if n.domain == KERNEL_DOMAIN}
        assert (kinds >= {"RmsNormF32", "RmsNormGradF32", "SiluMulGradF32", "RopeGradF32", "SoftmaxGradF32"}) == (
            fused is None), kinds
        losses = [float(sess.train_step(feeds)["loss"]) for _ in range(4)]
        runs[fused] = losses, {k: np.asarray(v) for k, v in sess.state.items()}
    np.testing.assert_allclose(runs[None][0], runs[False][0], rtol=2e-6)
    for k, v in runs[False][1].items():
        np.testing.assert_allclose(runs[None][1][k], v, rtol=1e-4, atol=1e-6, err_msg=k)


def test_lean_memory_runs_the_kernels_in_its_forward_half():
    """memory="lean" (and data-parallel training) runs the algorithm cut in
    two: its forward + backward half gets the decoder kernels as the whole
    algorithm does, and trains as the default session, bit for bit."""
    from test_llm_exports import feeds_of, load

    from onnxtrain import TrainingSession, build

    case, model, arrays = load("llama__dynamo")
    tm = build.training_model(model, loss=case["loss"], optimizer=build.AdamW(lr=1e-3))
    feeds, _ = feeds_of(arrays, tm)
    runs = {}
    for memory in ("safe", "lean"):
        sess = TrainingSession(tm, memory=memory)
        losses = [float(sess.train_step(feeds)["loss"]) for _ in range(3)]
        runs[memory] = losses, {k: np.asarray(v).tobytes() for k, v in sess.state.items()}
    forward = sess.programs(executed=True)["training_info[0].algorithm[forward+backward]"]
    kinds = {n.op_type for n in forward.graph.node if n.domain == KERNEL_DOMAIN}
    assert kinds >= {"RmsNormF32", "RmsNormGradF32", "SiluMulGradF32", "RopeGradF32", "SoftmaxGradF32"}, kinds
    assert runs["lean"] == runs["safe"]
