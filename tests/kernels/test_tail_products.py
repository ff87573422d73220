"""The products over a mask's zero tails (kernels/tails.py): attention's four
products of the probabilities and their gradient, against float64 and
onnxruntime's MatMul, and the kernels alone on zero tails of every kind."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from chains import attention, run, session
from onnx import TensorProto, helper

from onnxtrain.kernels.fuse import KERNEL_DOMAIN

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="the kernel library needs a C compiler")

ULPS = 4 * np.finfo(np.float32).eps
TAILS = ["MatMulTailBF32", "TailMatMulF32", "TailMatMulF32", "TailMatMulTransAF32"]
SOFTMAXES = ["MaskedSoftmaxF32", "MatMulMaskedSoftmaxF32"]
ATTENTION = [*SOFTMAXES, "SoftmaxGradF32", "SoftmaxGuardF32"]
SCORES = "MatMulMaskedSoftmaxF32"  # the scores' MatMul taken into the masked softmax

CHAINS = [  # (label, chain, its masked softmax kernel)
    ("causal", lambda: attention(), SCORES),
    ("padding", lambda: attention(mask="padding", seed=1), SCORES),
    ("no mask", lambda: attention(mask="none", seed=2), SCORES),
    ("causal, more keys than queries", lambda: attention((2, 2, 70, 24), keys=100, seed=3), SCORES),
    ("causal, the scale after the product", lambda: attention(split_scale=False, seed=4), "MaskedSoftmaxF32"),
    ("L1's attention, split", lambda: attention((4, 8, 256, 64), seed=5, scale=0.125), SCORES),
]


def _kernels(model) -> list[str]:
    return sorted(n.op_type for n in model.graph.node if n.domain == KERNEL_DOMAIN)


@pytest.mark.parametrize("label,make,softmax", CHAINS, ids=[c[0] for c in CHAINS])
def test_attentions_products_are_as_close_to_float64_as_onnxruntimes(label, make, softmax):
    chain = make()
    fused, _ = chain.fused()
    tails = [k for k in _kernels(fused) if k not in ATTENTION]
    assert tails == TAILS, tails
    assert [k for k in _kernels(fused) if k in SOFTMAXES] == [softmax]
    standard, ours = run(chain.model, chain), run(fused, chain)
    ref = chain.reference(chain.feeds)
    for out in chain.outputs:
        scale = float(np.abs(ref[out]).max())
        err_std = float(np.abs(standard[out] - ref[out]).max())
        err_ours = float(np.abs(ours[out] - ref[out]).max())
        assert np.isfinite(ours[out]).all(), out
        assert err_ours <= max(2 * err_std, ULPS * scale), (out, err_ours / scale, err_std / scale)


def test_short_rows_keep_onnxruntimes_products():
    fused, _ = attention((2, 3, 16, 16)).fused()
    assert not any("Tail" in k for k in _kernels(fused))


def _run_op(op: str, feeds: dict, inputs: list[str], outputs: int = 1) -> list[np.ndarray]:
    """One library node of ``inputs`` (names of ``feeds``, "" for an absent one) alone."""
    names = ["out", "out_kept"][:outputs]
    model = helper.make_model(helper.make_graph(
        [helper.make_node(op, inputs, names, domain=KERNEL_DOMAIN)], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for k, v in feeds.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, [TensorProto.FLOAT, TensorProto.INT64])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 8
    return session(model).run(None, feeds)


def _product(op: str, a: np.ndarray, b: np.ndarray, alpha=None, kept=None) -> np.ndarray:
    feeds = {"a": a, "b": b}
    if alpha is not None:
        feeds["alpha"] = np.atleast_1d(np.asarray(alpha, np.float32))
    if kept is not None:
        feeds["kept"] = np.asarray(kept, np.int64)
    inputs = ["a", "b", "alpha" if alpha is not None else "", "kept" if kept is not None else ""]
    while not inputs[-1]:
        inputs.pop()
    return _run_op(op, feeds, inputs)[0]


def _lengths(x: np.ndarray) -> np.ndarray:
    """Each row's length to its last value that is not +-0 (a NaN counts)."""
    nonzero = x != 0
    return np.where(nonzero.any(-1), x.shape[-1] - np.argmax(nonzero[..., ::-1], axis=-1), 0).astype(np.int64)


def _tailed(rows: int, length: int, rng) -> np.ndarray:
    """[3, rows, length] of rows cut to random lengths, with a fully zero row,
    a tail of -0, a NaN as a row's last element and rows without a tail."""
    x = rng.standard_normal((3, rows, length)).astype(np.float32)
    cut = rng.integers(0, length + 1, (3, rows))
    x[np.arange(length)[None, None, :] >= cut[..., None]] = 0.0
    x[0, 1] = 0.0
    x[0, 2, 3:] = -0.0
    x[1, 0, :] = 1.0
    x[1, 1, 5:] = 0.0
    x[1, 1, 4] = np.nan
    x[2, 3, :-1] = 0.0  # one value, at the end
    return x


CASES = [  # (op, tailed operand, M, K, N): sizes off (and on) the kernels' blocks of 8 x 32
    ("TailMatMulF32", "a", 13, 37, 45),
    ("TailMatMulF32", "a", 64, 70, 64),
    ("TailMatMulTransAF32", "a", 13, 37, 45),
    ("TailMatMulTransAF32", "a", 70, 64, 33),
    ("MatMulTailBF32", "b", 13, 37, 45),
    ("MatMulTailBF32", "b", 64, 70, 96),
]


@pytest.mark.parametrize("op,which,m,k,n", CASES)
@pytest.mark.parametrize("alpha", [None, 0.3])
def test_the_kernels_give_the_product_of_any_zero_tails(op, which, m, k, n, alpha):
    rng = np.random.default_rng(m * k + n)
    if which == "b":
        a, b = rng.standard_normal((3, m, k)).astype(np.float32), _tailed(k, n, rng)
    elif op == "TailMatMulTransAF32":
        a, b = _tailed(k, m, rng), rng.standard_normal((3, k, n)).astype(np.float32)
    else:
        a, b = _tailed(m, k, rng), rng.standard_normal((3, k, n)).astype(np.float32)
    left = np.swapaxes(a, -1, -2) if op == "TailMatMulTransAF32" else a
    ref = left.astype(np.float64) @ b.astype(np.float64) * (1.0 if alpha is None else np.float32(alpha))
    ours = _product(op, a, b, alpha)
    assert ours.shape == ref.shape
    nan = np.isnan(ref)
    assert nan.any() and np.array_equal(np.isnan(ours), nan)  # the NaN reaches what it multiplies, no more
    assert np.abs(ours[~nan] - ref[~nan]).max() <= 8 * ULPS * np.sqrt(k) * np.abs(ref[~nan]).max()


def test_an_infinity_facing_a_skipped_zero_is_left_out():
    """The one difference from the standard product, as documented."""
    a = np.zeros((1, 6, 64), np.float32)
    a[0, :, :8] = 1.0
    b = np.ones((1, 64, 32), np.float32)
    b[0, 40, :] = np.inf
    ours = _product("TailMatMulF32", a, b)
    assert np.array_equal(ours, np.full((1, 6, 32), 8.0, np.float32))
    assert np.isnan(a[0] @ b[0]).all()


def test_the_kernels_report_bad_shapes():
    with pytest.raises(Exception, match="TailMatMulF32: a's and b's inner dims differ"):
        _product("TailMatMulF32", np.ones((2, 4, 5), np.float32), np.ones((2, 6, 3), np.float32))
    with pytest.raises(Exception, match="MatMulTailBF32: expects a .* with one leading shape"):
        _product("MatMulTailBF32", np.ones((2, 4, 5), np.float32), np.ones((3, 5, 3), np.float32))
    with pytest.raises(Exception, match="TailMatMulTransAF32: alpha is one value"):
        _product("TailMatMulTransAF32", np.ones((1, 4, 5), np.float32), np.ones((1, 4, 3), np.float32),
                 np.ones(2, np.float32))


@pytest.mark.parametrize("op,which,m,k,n", CASES)
def test_the_kernels_given_the_rows_lengths_give_the_bits_of_their_scan(op, which, m, k, n):
    """kept (from the kernel that wrote the tailed operand) in place of the
    scan: a bound at or past each row's last nonzero gives the same bits."""
    rng = np.random.default_rng(m + k * n)
    if which == "b":
        a, b = rng.standard_normal((3, m, k)).astype(np.float32), _tailed(k, n, rng)
        tailed = b
    elif op == "TailMatMulTransAF32":
        a, b = _tailed(k, m, rng), rng.standard_normal((3, k, n)).astype(np.float32)
        tailed = a
    else:
        a, b = _tailed(m, k, rng), rng.standard_normal((3, k, n)).astype(np.float32)
        tailed = a
    scanned = _product(op, a, b, 0.3)
    exact = _lengths(tailed)
    loose = np.minimum(exact + rng.integers(0, 3, exact.shape), tailed.shape[-1])
    for kept in (exact, loose):
        assert np.array_equal(_product(op, a, b, 0.3, kept), scanned, equal_nan=True)
    # the bounds are taken as given (whole blocks of products go by them): rows of length 0 add nothing
    assert not _product(op, a, b, 0.3, np.zeros_like(exact)).any()


def test_the_kernels_check_the_rows_lengths():
    a, b = np.ones((2, 4, 5), np.float32), np.ones((2, 5, 3), np.float32)
    with pytest.raises(Exception, match="TailMatMulF32: kept has one value per tailed row"):
        _product("TailMatMulF32", a, b, kept=np.full(4, 5))
    with pytest.raises(Exception, match="MatMulTailBF32: a kept length is out of range"):
        _product("MatMulTailBF32", a, b, kept=np.full(10, 4) - np.eye(10, dtype=np.int64)[3] * 5)
    with pytest.raises(Exception, match="TailMatMulTransAF32: a kept length is out of range"):
        _product("TailMatMulTransAF32", np.ones((2, 5, 4), np.float32), b, kept=np.full(10, 5))


def test_the_masked_softmax_says_where_each_row_is_zero():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 40, 40)).astype(np.float32)
    mask = np.triu(np.full((40, 40), -np.inf, np.float32), 1)[None, None]
    x[0, 1, 5] = np.nan  # a NaN row: NaN throughout
    x[1, 2, 7, 30] = -200.0  # e^(-200 - max) = 0 inside the kept part: the bound stays past it
    y, kept = _run_op("MaskedSoftmaxF32", {"x": x, "m": mask}, ["x", "m"], outputs=2)
    assert kept.shape == (2, 3, 40) and kept.dtype == np.int64
    expected = np.broadcast_to(np.arange(1, 41), kept.shape).copy()
    expected[0, 1, 5] = 40
    assert np.array_equal(kept, expected)
    assert (y[np.arange(40) >= kept[..., None]] == 0).all()
    alone = _run_op("MaskedSoftmaxF32", {"x": x, "m": mask}, ["x", "m"])[0]
    assert np.array_equal(alone, y, equal_nan=True)
    _, scalar = _run_op("MaskedSoftmaxF32", {"x": x[0, 0, 3], "m": mask[0, 0, 3]}, ["x", "m"], outputs=2)
    assert scalar.shape == () and int(scalar) == 4


@pytest.mark.parametrize("op", ["SoftmaxGradF32", "SoftmaxGradPlainF32"])
def test_the_softmax_gradients_say_where_each_row_is_zero(op):
    rng = np.random.default_rng(8)
    y = _tailed(20, 50, rng)
    y[2, 4, :] = 0.0  # a row of zeros
    dq = rng.standard_normal(y.shape).astype(np.float32)
    dq[1, 3, 45] = np.inf  # past the row's last nonzero: 0 * inf, NaN in the gradient
    dx, kept = _run_op(op, {"dq": dq, "y": y}, ["dq", "y"], outputs=2)
    assert kept.shape == (3, 20) and np.array_equal(kept, _lengths(dx))
    assert kept[1, 3] == 50 and kept[2, 4] == 0
    assert np.array_equal(_run_op(op, {"dq": dq, "y": y}, ["dq", "y"])[0], dx, equal_nan=True)


def test_the_products_read_the_lengths_their_operands_kernels_wrote():
    fused, _ = attention((4, 8, 256, 64), seed=5, scale=0.125).fused()
    nodes = [n for n in fused.graph.node if n.domain == KERNEL_DOMAIN]
    writers = {n.output[1]: n.op_type for n in nodes if len(n.output) > 1 and n.output[1]}
    read = {n.op_type: [] for n in nodes}
    for n in nodes:
        if "Tail" in n.op_type:
            assert len(n.input) == 4 and n.input[3] in writers, n
            read[n.op_type].append(writers[n.input[3]])
    assert sorted(writers.values()) == [SCORES, "SoftmaxGradF32"]
    assert sorted(read["TailMatMulF32"]) == [SCORES, "SoftmaxGradF32"]
    assert read["TailMatMulTransAF32"] == [SCORES] and read["MatMulTailBF32"] == ["SoftmaxGradF32"]


def _masks(m: int, n: int, rng) -> dict[str, np.ndarray]:
    causal = np.triu(np.full((m, n), -np.inf, np.float32), n - m + 1)
    holes = np.where(rng.random((m, n)) < 0.3, -np.inf, 0.0).astype(np.float32)
    holes[:, -1] = 0.0  # a kept last key under masked ones
    holes[2, :] = -np.inf  # a fully masked row: NaN, as the standard softmax's
    return {"causal": causal[None], "holes": holes[None], "none": np.zeros((1, 1, n), np.float32),
            "lowest": np.where(causal == 0, 0, np.finfo(np.float32).min).astype(np.float32)[None],
            "one per row": np.where(np.arange(m) % 3 == 0, -np.inf, 0.5).astype(np.float32)[None, :, None]}


@pytest.mark.parametrize("mask_kind", ["causal", "holes", "none", "lowest", "one per row"])
@pytest.mark.parametrize("m,k,n", [(13, 24, 45), (64, 64, 64), (40, 7, 100)])
def test_the_scores_product_in_the_masked_softmax(mask_kind, m, k, n):
    """MatMulMaskedSoftmaxF32(a, b, mask) is MaskedSoftmaxF32 of the tail
    products' sums of a b, bit for bit, and as close to float64 as the standard chain."""
    rng = np.random.default_rng(m + k + n)
    a = rng.standard_normal((3, 2, m, k)).astype(np.float32)
    b = rng.standard_normal((3, 2, k, n)).astype(np.float32)
    mask = _masks(m, n, rng)[mask_kind]
    feeds = {"a": a, "b": b, "mask": mask}
    y, kept = _run_op("MatMulMaskedSoftmaxF32", feeds, ["a", "b", "mask"], outputs=2)
    scores = _product("TailMatMulF32", a, b, kept=np.full((3, 2, m), k))
    y2, kept2 = _run_op("MaskedSoftmaxF32", {"s": scores, "mask": mask}, ["s", "mask"], outputs=2)
    assert np.array_equal(y, y2, equal_nan=True) and np.array_equal(kept, kept2)
    assert np.array_equal(_run_op("MatMulMaskedSoftmaxF32", feeds, ["a", "b", "mask"])[0], y, equal_nan=True)
    s64 = a.astype(np.float64) @ b.astype(np.float64) + mask
    with np.errstate(invalid="ignore"):
        ref = np.exp(s64 - s64.max(-1, keepdims=True))
        ref /= ref.sum(-1, keepdims=True)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(y), nan) and (mask_kind in ("holes", "one per row")) == nan.any()
    assert np.abs(y[~nan] - ref[~nan]).max() <= 16 * ULPS


def test_a_nan_score_facing_the_masks_minus_infinity_is_left_out():
    """The one difference from the standard chain, as the tail products' (documented)."""
    a = np.ones((1, 40, 8), np.float32)
    b = np.ones((1, 8, 40), np.float32)
    b[0, 3, 39] = np.nan  # the last key's score: masked for every query but the last
    mask = np.triu(np.full((40, 40), -np.inf, np.float32), 1)[None]
    y = _run_op("MatMulMaskedSoftmaxF32", {"a": a, "b": b, "mask": mask}, ["a", "b", "mask"])[0]
    assert np.isnan(y[0, -1]).all() and np.array_equal(y[0, :-1], np.tril(1 / np.arange(1, 40)[:, None]
                                                                             * np.ones((39, 40)), 0).astype(np.float32))
    with np.errstate(invalid="ignore"):
        assert np.isnan(a[0] @ b[0] + mask[0]).any(-1).all()  # the standard chain's rows are all NaN


def test_the_scores_product_reports_bad_shapes():
    ones = np.ones
    with pytest.raises(Exception, match="MatMulMaskedSoftmaxF32: a's and b's inner dims differ"):
        _run_op("MatMulMaskedSoftmaxF32", {"a": ones((2, 4, 5), np.float32), "b": ones((2, 6, 3), np.float32),
                                           "m": ones((4, 3), np.float32)}, ["a", "b", "m"])
    with pytest.raises(Exception, match="MatMulMaskedSoftmaxF32: the mask does not broadcast into the scores"):
        _run_op("MatMulMaskedSoftmaxF32", {"a": ones((2, 4, 5), np.float32), "b": ones((2, 5, 3), np.float32),
                                           "m": ones((4, 2), np.float32)}, ["a", "b", "m"])
