"""Gradient rules of resampling, region, scan, scatter, spectral, quantization
and selection ops (Resize/Upsample, GridSample, RoiAlign, MaxRoiPool,
MaxUnpool, Col2Im, GlobalLpPool, DeformConv, Compress, ReverseSequence,
Scatter, TensorScatter, Unique, CumProd, Det, DFT, STFT, DequantizeLinear)
and the zero-gradient registrations that come with them.

Where onnxruntime has double kernels, ``check_vjp`` compares with float64
central differences.  Ops onnxruntime runs only in float32 use
``check_vjp_f32``: for ops linear in the checked input (Resize, Upsample,
MaxUnpool, Col2Im, DequantizeLinear's scale) a unit step on the float32 loss
is exact up to rounding; Det runs against onnx.reference in float64;
GlobalLpPool, which onnx.reference lacks, against a numpy oracle here.
"""

from __future__ import annotations

import itertools

import gradcheck
import numpy as np
import onnx
import pytest
from grad_cases import Case, check_vjp_squared, const_node
from gradcheck import check_vjp, check_vjp_f32
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnxtrain.autodiff import REGISTRY, expand_gradients
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.errors import GradientError
from onnxtrain.runtime.executor import Executor


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture
def only_x_symbolic(monkeypatch):
    """check_vjp_f32 with symbolic shapes for the data input only: sizes, scales
    and rois stay static (onnxruntime checks their lengths when loading)."""
    original = gradcheck.value_info

    def value_info(name, arr, symbolic):
        return original(name, arr, symbolic and name == "x")

    monkeypatch.setattr(gradcheck, "value_info", value_info)


# ------------------------------------------------------------ Resize / Upsample
X4 = _rng(1).standard_normal((2, 3, 4, 5))


def _resize(opset, attrs, scales=None, sizes=None, roi=None, symbolic=False):
    """Resize of X4 with the given roi/scales/sizes as (static) inputs; the
    gradient w.r.t. x only, in float32 against a unit step (Resize is linear in x)."""
    inputs = {"x": X4}
    if opset < 11:
        inputs["scales"] = np.asarray(scales, np.float32)
        names = ["x", "scales"]
    else:
        names = ["x", "", "", ""]
        if roi is not None or opset < 13:
            inputs["roi"] = np.asarray([] if roi is None else roi, np.float32)
            names[1] = "roi"
        if scales is not None or opset < 13:
            inputs["scales"] = np.asarray([] if scales is None else scales, np.float32)
            names[2] = "scales"
        if sizes is not None:
            inputs["sizes"] = np.asarray(sizes, np.int64)
            names[3] = "sizes"
        while names[-1] == "":
            names.pop()
    return check_vjp_f32(
        "Resize", inputs, attrs, node_inputs=names, opset=opset, oracle="ort", wrt=["x"],
        symbolic=symbolic,
    )


COORDINATE_MODES = ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"]
RESIZE_CASES = [
    (opset, mode, coord)
    for opset in (11, 13, 18, 19)
    for mode in ("nearest", "linear", "cubic")
    for coord in COORDINATE_MODES
    + (["half_pixel_symmetric"] if opset >= 19 else [])
    + (["tf_half_pixel_for_nn"] if opset == 11 else [])
]


@pytest.mark.parametrize("opset, mode, coord", RESIZE_CASES)
def test_resize_modes(opset, mode, coord):
    attrs = {"mode": mode, "coordinate_transformation_mode": coord}
    _resize(opset, dict(attrs), scales=[1, 1, 1.7, 0.6])
    _resize(opset, dict(attrs), sizes=[2, 3, 7, 3])


@pytest.mark.parametrize("opset", [10, 11, 13, 18, 19])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_up_and_down(opset, mode):
    _resize(opset, {"mode": mode}, scales=[1, 1, 2, 1.5])
    _resize(opset, {"mode": mode}, scales=[1, 1, 0.5, 0.6])


@pytest.mark.parametrize("opset", [11, 13, 19])
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_tf_crop_and_resize(opset, mode):
    """Extrapolated entries are constants: no gradient reaches x from them."""
    attrs = {"mode": mode, "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 3.0}
    _resize(opset, attrs, roi=[0, 0, 0.1, -0.2, 1, 1, 0.8, 1.3], sizes=[2, 3, 5, 6])


@pytest.mark.parametrize("opset", [18, 19])
def test_resize_attribute_variants(opset, only_x_symbolic):
    for mode in ("linear", "cubic"):
        _resize(opset, {"mode": mode, "antialias": 1}, scales=[1, 1, 0.5, 0.6])
        _resize(opset, {"mode": mode, "antialias": 1}, sizes=[2, 3, 3, 2], symbolic=True)
    _resize(opset, {"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, scales=[1, 1, 0.7, 1.6])
    for rounding in ("floor", "ceil", "round_prefer_ceil", "round_prefer_floor"):
        _resize(opset, {"mode": "nearest", "nearest_mode": rounding}, scales=[1, 1, 1.7, 0.6])
    _resize(opset, {"mode": "linear", "axes": [3, 2]}, scales=[0.6, 1.7])
    _resize(opset, {"mode": "linear", "axes": [-1]}, sizes=[8], symbolic=True)
    _resize(
        opset, {"mode": "linear", "axes": [2, 3], "coordinate_transformation_mode": "tf_crop_and_resize"},
        roi=[0.1, -0.2, 0.8, 1.3], sizes=[5, 6],
    )


@pytest.mark.parametrize("policy", ["not_larger", "not_smaller"])
def test_resize_keep_aspect_ratio_nearest(policy, only_x_symbolic):
    """The source of every output entry comes from the op on an index tensor."""
    attrs = {"mode": "nearest", "keep_aspect_ratio_policy": policy}
    _resize(19, {**attrs, "axes": [2, 3]}, sizes=[3, 7])
    _resize(18, {**attrs, "axes": [3, 2]}, sizes=[7, 3], symbolic=True)
    _resize(
        19, {**attrs, "coordinate_transformation_mode": "tf_crop_and_resize"},
        roi=[0, 0, 0.1, -0.2, 1, 1, 0.8, 1.3], sizes=[2, 3, 5, 6],
    )


@pytest.mark.parametrize("opset", [13, 19])
def test_resize_symbolic(opset, only_x_symbolic):
    _resize(opset, {"mode": "linear"}, scales=[1, 1, 2, 1.5], symbolic=True)
    _resize(opset, {"mode": "cubic"}, sizes=[2, 3, 7, 3], symbolic=True)


@pytest.mark.parametrize("opset", [7, 8, 9])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample(opset, mode, only_x_symbolic):
    if opset < 9:  # scales are an attribute; Upsample is deprecated (checker=False)
        for scales in ([1.0, 1.0, 2.0, 1.5], [1.0, 1.0, 1.0, 3.0]):
            check_vjp_f32("Upsample", {"x": X4}, {"mode": mode, "scales": scales}, opset=opset, oracle="ort", checker=False)
        return
    for symbolic in (False, True):
        check_vjp_f32(
            "Upsample", {"x": X4, "scales": np.array([1, 1, 2, 1.5], np.float32)}, {"mode": mode},
            opset=opset, oracle="ort", wrt=["x"], symbolic=symbolic,
        )


def test_resize_refuses_scales_and_roi_gradients():
    inputs = {"x": X4.astype(np.float32), "roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)}
    with pytest.raises(GradientError, match="roi or scales"):
        check_vjp_f32("Resize", inputs, {"mode": "linear"}, opset=13, oracle="ort", wrt=["x", "scales"])


def test_resize_keep_aspect_ratio_linear_is_refused():
    with pytest.raises(GradientError, match="keep_aspect_ratio_policy"):
        _resize(19, {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"}, sizes=[3, 7])


# ------------------------------------------------------------------ GridSample
GRID = _rng(2).uniform(-1.3, 1.3, (2, 3, 2, 2))


@pytest.mark.parametrize(
    "mode, padding, align",
    list(itertools.product(["linear", "nearest", "cubic"], ["zeros", "border", "reflection"], [0, 1])),
)
def test_grid_sample(mode, padding, align):
    """Gradient w.r.t. x and the grid (nearest: the grid gets 0, its output is
    piecewise constant in the grid)."""
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    g = check_vjp("GridSample", {"x": X4, "g": GRID}, attrs, opset=20, symbolic=align == 1)
    if mode == "nearest":
        assert not np.any(g["g"])


@pytest.mark.parametrize("mode, padding", list(itertools.product(["linear", "nearest"], ["zeros", "border", "reflection"])))
def test_grid_sample_volumetric(mode, padding):
    x = _rng(3).standard_normal((1, 2, 3, 4, 5))
    grid = _rng(4).uniform(-1.2, 1.2, (1, 2, 3, 2, 3))
    check_vjp("GridSample", {"x": x, "g": grid}, {"mode": mode, "padding_mode": padding}, opset=22)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_opset16(mode):
    """GridSample-16 runs only in float32: x (linear) against a unit step; the
    grid through the float64 check of the same rule at opset 20 above."""
    for padding, symbolic in (("zeros", False), ("border", True)):
        check_vjp_f32(
            "GridSample", {"x": X4, "g": GRID}, {"mode": mode, "padding_mode": padding},
            opset=16, oracle="ort", wrt=["x"], symbolic=symbolic,
        )


# ----------------------------------------------------- RoiAlign, MaxRoiPool
ROIS = np.array([[0.5, 0.3, 4.2, 5.1], [1.0, 2.0, 3.0, 3.5], [0.0, 0.0, 6.5, 5.5]])
BATCH = np.array([0, 1, 1])
X_ROI = _rng(5).standard_normal((2, 3, 6, 7))


ROI_ALIGN_CASES = [
    (opset, attrs)
    for opset in (10, 16)
    for attrs in (
        {"output_height": 2, "output_width": 3},
        {"output_height": 3, "output_width": 2, "sampling_ratio": 2, "spatial_scale": 0.8},
        {},
    )
] + [(16, {"coordinate_transformation_mode": "output_half_pixel"})]  # the attribute came in opset 16


@pytest.mark.parametrize("opset, attrs", ROI_ALIGN_CASES)
def test_roi_align(opset, attrs):
    """Adaptive (sampling_ratio 0) and fixed sampling; symbolic shapes for the defaults."""
    inputs = {"x": X_ROI, "rois": ROIS, "b": BATCH}
    check_vjp("RoiAlign", inputs, attrs, opset=opset, wrt=["x"], symbolic=not attrs)


def test_roi_align_refusals():
    inputs = {"x": X_ROI, "rois": ROIS, "b": BATCH}
    with pytest.raises(GradientError, match="rois"):
        check_vjp("RoiAlign", inputs, {}, opset=16, wrt=["x", "rois"])
    with pytest.raises(GradientError, match="mode='max'"):
        check_vjp("RoiAlign", inputs, {"mode": "max"}, opset=16, wrt=["x"])


def test_max_roi_pool():
    """Distinct values, so each bin's maximum is unique; a small step keeps it."""
    x = _rng(6).permutation(2 * 3 * 6 * 7).reshape(2, 3, 6, 7) * 0.1
    rois = np.array([[0, 0.5, 0.3, 4.2, 5.1], [1, 1.0, 2.0, 3.0, 3.5], [1, 0, 0, 6.5, 5.5]])
    check_vjp_f32("MaxRoiPool", {"x": x, "rois": rois}, {"pooled_shape": [2, 2]}, opset=13,
                  oracle="ort", wrt=["x"], eps=1e-2, rtol=1e-3)
    check_vjp_f32("MaxRoiPool", {"x": x, "rois": rois}, {"pooled_shape": [3, 2], "spatial_scale": 0.7},
                  opset=21, oracle="ort", wrt=["x"], eps=1e-2, rtol=1e-3, symbolic=True)


def test_max_roi_pool_ties_share():
    """A constant image: every pixel of the bin ties; the gradient is split evenly."""
    x = np.ones((1, 1, 4, 4))
    rois = np.array([[0.0, 0.0, 0.0, 3.0, 3.0]])
    g = check_vjp_f32("MaxRoiPool", {"x": x, "rois": rois}, {"pooled_shape": [1, 1]}, opset=13,
                      oracle="ort", wrt=["x"], directions=0)["x"]
    r = np.random.default_rng(0).standard_normal((1, 1, 1, 1))  # check_vjp_f32's weight R
    np.testing.assert_allclose(g, np.full((1, 1, 4, 4), r.item() / 16), rtol=1e-6)


# ------------------------------------------------------- MaxUnpool, Col2Im
def test_max_unpool():
    x = _rng(7).standard_normal((2, 3, 2, 2))
    idx = np.array([[0, 3], [9, 14]]).reshape(1, 1, 2, 2) + 16 * np.arange(6).reshape(2, 3, 1, 1)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    for opset in (9, 11, 22):
        check_vjp_f32("MaxUnpool", {"x": x, "i": idx}, attrs, opset=opset, oracle="ort", wrt=["x"])
    check_vjp_f32("MaxUnpool", {"x": x, "i": idx, "s": np.array([2, 3, 5, 5])}, attrs, opset=13,
                  oracle="ort", wrt=["x"], symbolic=True)


COL2IM_CASES = [
    ([5, 5], [2, 2], {}),
    ([6, 5], [3, 2], {"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 1, 1]}),
    ([7], [3], {"strides": [2]}),
    ([3, 4, 4], [2, 1, 2], {}),
]


@pytest.mark.parametrize("image, block, attrs", COL2IM_CASES)
def test_col2im(image, block, attrs):
    k = len(image)
    pads = attrs.get("pads", [0] * 2 * k)
    strides = attrs.get("strides", [1] * k)
    dil = attrs.get("dilations", [1] * k)
    blocks = 1
    for i in range(k):
        blocks *= (image[i] + pads[i] + pads[k + i] - (dil[i] * (block[i] - 1) + 1)) // strides[i] + 1
    x = _rng(8).standard_normal((2, 3 * int(np.prod(block)), blocks))
    inputs = {"x": x, "img": np.array(image), "blk": np.array(block)}
    # static block_shape (a Constant) builds the one-hot kernels in Python ...
    check_vjp_f32("Col2Im", inputs, attrs, opset=18, oracle="ort", wrt=["x"], symbolic=True)
    # ... and a runtime one with EyeLike
    check_vjp_f32("Col2Im", {"x": x, "img": np.array(image), "blk": np.array(block)}, attrs, opset=18,
                  oracle="ort", wrt=["x"])


# ---------------------------------------------------------------- GlobalLpPool
class GlobalLpPool(OpRun):
    """numpy GlobalLpPool (onnx.reference has none): (sum over spatial |x|^p)^(1/p)."""

    op_domain = ""

    def _run(self, x, p=None):  # noqa: D102
        p = self.p if p is None else p
        axes = tuple(range(2, x.ndim))
        return ((np.sum(np.abs(x) ** p, axis=axes, keepdims=True)) ** (1.0 / p),)


class _NumpyExecutor:
    def __init__(self, model):
        self._ref = ReferenceEvaluator(model, new_ops=[GlobalLpPool])

    def run(self, feeds, names):
        return [np.asarray(v) for v in self._ref.run(list(names), dict(feeds))]


@pytest.mark.parametrize("p", [1, 2, 3])
def test_global_lp_pool(p, monkeypatch):
    x = _rng(9).standard_normal((2, 3, 4, 5))
    x = np.where(np.abs(x) < 0.1, 0.1 * np.sign(x) + x, x)  # |x| >= 0.1: no sign flip within a step
    # the rule's float32 graph on onnxruntime (dtype, shape, rough values) ...
    for opset in (7, 18):
        check_vjp_f32("GlobalLpPool", {"x": x}, {"p": p}, opset=opset, oracle="ort", eps=1e-2, rtol=1e-2)
    # ... and its math in float64 against numpy (opset 7: Sign built from comparisons)
    monkeypatch.setattr(gradcheck, "Executor", _NumpyExecutor)
    for opset in (7, 18):
        check_vjp("GlobalLpPool", {"x": x}, {"p": p}, opset=opset)
    check_vjp("GlobalLpPool", {"x": x[:, :, 0]}, {"p": p}, opset=18, symbolic=True)


# ------------------------------------------------------------------ DeformConv
def _deform(group=2, offset_group=2, strides=(1, 1), dil=(1, 1), pads=(0, 0, 0, 0), bias=True,
            mask=True, symbolic=False, opset=19):
    rng = _rng(10)
    n, c, h, w, oc, kh, kw = 2, 4, 5, 6, 6, 2, 3
    oh = (h + pads[0] + pads[2] - ((kh - 1) * dil[0] + 1)) // strides[0] + 1
    ow = (w + pads[1] + pads[3] - ((kw - 1) * dil[1] + 1)) // strides[1] + 1
    inputs = {
        "x": rng.standard_normal((n, c, h, w)),
        "w": rng.standard_normal((oc, c // group, kh, kw)),
        "off": rng.uniform(-1.5, 1.5, (n, offset_group * 2 * kh * kw, oh, ow)),
    }
    names = ["x", "w", "off"]
    if bias:
        inputs["b"] = rng.standard_normal(oc)
        names.append("b")
    if mask:
        if not bias:
            names.append("")
        inputs["m"] = rng.uniform(0.2, 1.0, (n, offset_group * kh * kw, oh, ow))
        names.append("m")
    attrs = {"group": group, "offset_group": offset_group, "strides": list(strides),
             "dilations": list(dil), "pads": list(pads)}
    check_vjp("DeformConv", inputs, attrs, node_inputs=names, opset=opset, symbolic=symbolic)


def test_deform_conv():
    """x, W, offsets, bias and mask, through the runtime's double kernel."""
    _deform()
    _deform(group=1, offset_group=1, bias=False, mask=False)
    _deform(strides=(2, 1), dil=(1, 2), pads=(1, 0, 2, 1), offset_group=4, group=1)
    _deform(bias=False, symbolic=True, opset=22)


# ------------------------------------------------------- selections and scans
X3 = _rng(11).standard_normal((3, 4, 5))


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_compress(opset):
    cond = np.array([True, False, True, True])
    check_vjp("Compress", {"x": X3, "c": cond}, {"axis": 1}, opset=opset)
    check_vjp("Compress", {"x": X3, "c": cond}, {"axis": -2}, opset=opset, symbolic=opset >= 13)
    flat = np.array([True, False, True, True, False, True])  # shorter than x: the rest is dropped
    check_vjp("Compress", {"x": X3, "c": flat}, opset=opset, symbolic=opset >= 13)


@pytest.mark.parametrize("opset", [10, 13, 22])
def test_reverse_sequence(opset):
    check_vjp("ReverseSequence", {"x": X3, "l": np.array([1, 3, 2, 3])},
              {"batch_axis": 1, "time_axis": 0}, opset=opset)
    check_vjp("ReverseSequence", {"x": X3, "l": np.array([1, 4, 2])},
              {"batch_axis": 0, "time_axis": 1}, opset=opset, symbolic=opset >= 13)


@pytest.mark.parametrize("op, opset", [("Scatter", 9), ("Scatter", 10), ("ScatterElements", 11)])
def test_scatter(op, opset):
    """Scatter (opsets 9-10) is ScatterElements under its old name; before
    opset 11 the updates' gradient gathers from flat positions."""
    updates = _rng(12).standard_normal((2, 2, 2))
    idx = np.array([[[0, 1], [2, 3]], [[4, 0], [1, 2]]])
    check_vjp(op, {"x": X3, "i": idx, "u": updates}, {"axis": 2}, opset=opset)
    negative = np.array([[[-1, 1], [2, 3]], [[4, 0], [1, -2]]])
    check_vjp(op, {"x": X3, "i": negative, "u": updates}, {"axis": -1}, opset=opset)
    check_vjp(op, {"x": X3, "i": idx.transpose(2, 1, 0).copy() % 3, "u": updates}, {"axis": 0}, opset=opset)


def test_scatter_opset9_symbolic():
    """Opset 9 with symbolic shapes (the loss is sum(y^2): no runtime ReduceSum
    axes before opset 13)."""
    case = Case("Scatter", "Scatter", lambda rng: {"x": X3, "i": np.array([[[0, 1], [2, 3]]]),
                                                   "u": rng.standard_normal((1, 2, 2))}, attrs={"axis": 2})
    check_vjp_squared(case, case.inputs(_rng(23)), opset=9)


def test_tensor_scatter():
    rng = _rng(13)
    past, update = rng.standard_normal((2, 3, 6, 4)), rng.standard_normal((2, 3, 2, 4))
    check_vjp("TensorScatter", {"p": past, "u": update, "w": np.array([1, 4])}, opset=24)
    check_vjp("TensorScatter", {"p": past, "u": update, "w": np.array([1, 5])}, {"mode": "circular"},
              opset=24, symbolic=True)
    check_vjp("TensorScatter", {"p": past, "u": update}, opset=24)  # write_indices default to 0
    check_vjp("TensorScatter", {"p": past.transpose(0, 2, 1, 3).copy(), "u": update.transpose(0, 2, 1, 3).copy(),
                                "w": np.array([3, 0])}, {"axis": 1}, opset=24)


def test_unique():
    rng = _rng(14)
    check_vjp_f32("Unique", {"x": rng.standard_normal((3, 4))}, n_outputs=4, diff_outputs=[0], opset=11,
                  oracle="ort64")
    check_vjp("Unique", {"x": rng.standard_normal((3, 4))}, {"sorted": 0}, opset=11, symbolic=True)
    check_vjp("Unique", {"x": rng.standard_normal((3, 4, 2))}, {"axis": 1}, opset=22)


def test_unique_shares_ties():
    """Equal entries are one output entry: its gradient is split evenly among them."""
    x = np.array([[2.0, 1.0, 3.0, 1.0], [2.0, 5.0, 0.5, 5.0]])
    g = check_vjp("Unique", {"x": x}, opset=11, directions=0)["x"]  # no step: it would split the ties
    r = np.random.default_rng(0).standard_normal(5)  # check_vjp's weights R (seed 0), one per unique value
    dy = dict(zip(np.unique(x), r))
    expected = np.array([dy[v] / np.sum(x == v) for v in x.reshape(-1)]).reshape(x.shape)
    np.testing.assert_allclose(g, expected)


@pytest.mark.parametrize("exclusive, reverse", list(itertools.product([0, 1], [0, 1])))
def test_cumprod(exclusive, reverse):
    """Zeros (one, and two on a line) are exact: no division by them."""
    x = X3.copy()
    x[1, 2, 3] = 0.0
    x[0, 1, 1] = x[0, 1, 2] = 0.0
    x[2, :, 0] = 0.0
    attrs = {"exclusive": exclusive, "reverse": reverse}
    for axis in (0, 1, -1):
        check_vjp("CumProd", {"x": x}, attrs, node_inputs=["x", "a"], extra_nodes=[const_node("a", axis)], opset=26)
    # a runtime axis, symbolic shapes
    check_vjp("CumProd", {"x": x, "a": np.array(1)}, attrs, opset=26, symbolic=True, wrt=["x"])


# ----------------------------------------------------------------------- Det
@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (1, 1), (2, 1, 2, 2)])
def test_det(shape):
    """Det runs only in float32 on onnxruntime: against onnx.reference in float64."""
    x = _rng(15).standard_normal(shape)
    check_vjp_f32("Det", {"x": x}, opset=13, oracle="reference")
    check_vjp_f32("Det", {"x": x}, opset=22, oracle="reference", symbolic=True)


def test_det_singular_matrix():
    """The cofactor matrix stays exact where inv(X) does not exist."""
    x = _rng(16).standard_normal((3, 3))
    x[2] = x[0] + x[1]
    g = check_vjp_f32("Det", {"x": x}, opset=13, oracle="reference")["x"]
    cof = np.array([[(-1) ** (i + j) * np.linalg.det(np.delete(np.delete(x, i, 0), j, 1))
                     for j in range(3)] for i in range(3)])
    r = np.random.default_rng(0).standard_normal(())  # check_vjp_f32's weight R of det(x)
    np.testing.assert_allclose(g, r * cof, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------- DFT and STFT
def _dft_inputs(opset, length=None, axis=None):
    names, extra = ["x"], []
    if length is not None:
        extra.append(const_node("L", length))
        names.append("L")
    if opset >= 20 and axis is not None:
        if length is None:
            names.append("")
        extra.append(const_node("a", axis))
        names.append("a")
    return names, extra


DFT_CASES = [
    (opset, last, inverse, onesided, length)
    for opset in (17, 20)
    for last in (1, 2)
    for inverse in (0, 1)
    for onesided in (0, 1)
    for length in (None, 6, 11)
    if not (onesided and (inverse or last == 2))
]


@pytest.mark.parametrize("opset, last, inverse, onesided, length", DFT_CASES)
def test_dft(opset, last, inverse, onesided, length):
    x = _rng(17).standard_normal((2, 8, last))
    names, extra = _dft_inputs(opset, length, axis=1)
    check_vjp("DFT", {"x": x}, {"inverse": inverse, "onesided": onesided}, node_inputs=names,
              extra_nodes=extra, opset=opset)


def test_dft_axes():
    x = _rng(18).standard_normal((3, 6, 4, 2))
    check_vjp("DFT", {"x": x}, {"axis": 2}, opset=17)
    check_vjp("DFT", {"x": x}, {"axis": -2, "inverse": 1}, opset=17, symbolic=True)
    check_vjp("DFT", {"x": x}, node_inputs=["x", "", "a"], extra_nodes=[const_node("a", 0)], opset=20, symbolic=True)
    # a runtime axis (opset 20): Slice and Pad take it as an input
    real = _rng(19).standard_normal((2, 8, 1))
    for inverse, onesided, signal in ((0, 0, x[:, :, 0]), (1, 0, x[:, :, 0]), (0, 1, real)):
        check_vjp("DFT", {"x": signal, "L": np.array(6), "a": np.array(1)}, {"inverse": inverse, "onesided": onesided}, opset=20)
    check_vjp("DFT", {"x": x, "a": np.array(-3)}, {"inverse": 1}, node_inputs=["x", "", "a"], opset=20, symbolic=True)


@pytest.mark.parametrize("length", [None, 8, 9])
def test_irfft(length):
    """inverse + onesided: a one-sided spectrum of N // 2 + 1 bins to N real samples."""
    x = _rng(20).standard_normal((2, 5, 2))
    names, extra = _dft_inputs(20, length, axis=1)
    check_vjp("DFT", {"x": x}, {"inverse": 1, "onesided": 1}, node_inputs=names, extra_nodes=extra, opset=20)
    check_vjp("DFT", {"x": x, "a": np.array(-2)}, {"inverse": 1, "onesided": 1}, node_inputs=["x", "", "a"], opset=20)


def test_stft():
    rng = _rng(21)
    signal, window = rng.standard_normal((2, 20, 1)), rng.uniform(0.5, 1.5, 8)
    check_vjp("STFT", {"s": signal, "step": np.array(3), "w": window}, opset=17)
    check_vjp("STFT", {"s": signal, "step": np.array(4), "w": window}, {"onesided": 0}, opset=17)
    check_vjp("STFT", {"s": rng.standard_normal((2, 20, 2)), "step": np.array(3), "w": window}, {"onesided": 0}, opset=17)
    check_vjp("STFT", {"s": signal, "step": np.array(3), "w": window, "fl": np.array(8)}, opset=20, symbolic=True)
    check_vjp("STFT", {"s": signal, "step": np.array(5), "fl": np.array(7)}, node_inputs=["s", "step", "", "fl"], opset=17)


# ---------------------------------------------------------------- quantization
@pytest.mark.parametrize("opset", [10, 13, 19, 21, 23])
def test_dequantize_linear_scale(opset):
    """Linear in the scale: per tensor, per axis and (opset 21) per block."""
    rng = _rng(22)
    x = rng.integers(-100, 100, (3, 4)).astype(np.int8)
    kw = dict(opset=opset, oracle="ort", wrt=["s"])
    check_vjp_f32("DequantizeLinear", {"x": x, "s": np.array(0.5), "zp": np.array(3, np.int8)}, **kw)
    check_vjp_f32("DequantizeLinear", {"x": x, "s": np.array(0.5)}, **kw)
    if opset >= 13:
        per_axis = {"x": x, "s": rng.uniform(0.1, 1, 4), "zp": rng.integers(-3, 3, 4).astype(np.int8)}
        check_vjp_f32("DequantizeLinear", per_axis, {"axis": 1}, symbolic=True, **kw)
        check_vjp_f32("DequantizeLinear", {"x": x, "s": rng.uniform(0.1, 1, 3)}, {"axis": 0}, **kw)
        check_vjp_f32("DequantizeLinear", {"x": x, "s": rng.uniform(0.1, 1, 1)}, {"axis": 0}, **kw)
    if opset >= 21:
        x7 = rng.integers(-100, 100, (3, 7)).astype(np.int8)
        blocked = {"x": x7, "s": rng.uniform(0.1, 1, (3, 3)), "zp": rng.integers(-3, 3, (3, 3)).astype(np.int8)}
        check_vjp_f32("DequantizeLinear", blocked, {"axis": 1, "block_size": 3}, **kw)
        check_vjp_f32("DequantizeLinear", {"x": x7, "s": rng.uniform(0.1, 1, (2, 7))}, {"axis": 0, "block_size": 2},
                      symbolic=True, **kw)


def _fake_quant_model(opset: int) -> onnx.ModelProto:
    """y = DequantizeLinear(QuantizeLinear(x, s, zp), s, zp); loss = sum(y * x);
    Gradient w.r.t. x and s."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"]),
        helper.make_node("Mul", ["y", "x"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["x", "s"], ["gx", "gs"], domain=PREVIEW_DOMAIN, xs=["x", "s"], y="loss"),
    ]
    graph = helper.make_graph(
        nodes, "fq",
        [helper.make_tensor_value_info("x", f, [5]), helper.make_tensor_value_info("s", f, []),
         helper.make_tensor_value_info("zp", TensorProto.UINT8, [])],
        [helper.make_tensor_value_info(n, f, shape) for n, shape in (("loss", []), ("gx", [5]), ("gs", []))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW_DOMAIN, 1)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("opset", [13, 21])
def test_fake_quantization(opset):
    """Q -> DQ: QuantizeLinear's integer output carries no gradient (the rounding
    is piecewise constant), so d/dx is the direct term only and d/ds is
    sum(x * (q - zp))."""
    model = _fake_quant_model(opset)
    names = NameGen({n for node in model.graph.node for n in list(node.input) + list(node.output)} | {"x", "s", "zp"})
    expand_gradients(model.graph, model.opset_import, names, ["x", "s", "zp"])
    onnx.checker.check_model(model)
    x = np.array([0.3, 1.7, -0.2, 2.6, 0.9], np.float32)
    s, zp = np.array(0.5, np.float32), np.array(10, np.uint8)
    _, gx, gs = Executor(model).run({"x": x, "s": s, "zp": zp}, ["loss", "gx", "gs"])
    q = np.clip(np.round(x / s) + 10, 0, 255)
    np.testing.assert_allclose(gx, (q - 10) * s, rtol=1e-6)
    np.testing.assert_allclose(gs, np.sum(x * (q - 10)), rtol=1e-5)


def test_bitcast_to_float_is_refused():
    """float16 bits read as bfloat16 have no usable derivative: an error, not a zero."""
    nodes = [
        helper.make_node("BitCast", ["x"], ["b"], to=TensorProto.BFLOAT16),
        helper.make_node("Cast", ["b"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["f"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["x"], ["gx"], domain=PREVIEW_DOMAIN, xs=["x"], y="loss"),
    ]
    graph = helper.make_graph(
        nodes, "bitcast", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [3])],
        [helper.make_tensor_value_info("gx", TensorProto.FLOAT16, [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26), helper.make_opsetid(PREVIEW_DOMAIN, 1)])
    with pytest.raises(GradientError, match="BitCast"):
        expand_gradients(model.graph, model.opset_import, NameGen({"x", "b", "f", "loss", "gx"}), ["x"])


def test_bitcast_to_integer_needs_no_gradient():
    """An integer BitCast output is inactive: loss = sum(x * float(bits(x))) has
    the gradient float(bits(x)), from the Mul alone."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("BitCast", ["x"], ["b"], to=TensorProto.INT32),
        helper.make_node("Cast", ["b"], ["f"], to=f),
        helper.make_node("Mul", ["x", "f"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["x"], ["gx"], domain=PREVIEW_DOMAIN, xs=["x"], y="loss"),
    ]
    graph = helper.make_graph(
        nodes, "bitcast", [helper.make_tensor_value_info("x", f, [3])], [helper.make_tensor_value_info("gx", f, [3])]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26), helper.make_opsetid(PREVIEW_DOMAIN, 1)])
    model.ir_version = 10
    expand_gradients(model.graph, model.opset_import, NameGen({"x", "b", "f", "p", "loss", "gx"}), ["x"])
    x = np.array([1.0, -2.5, 3e-3], np.float32)
    (gx,) = Executor(model).run({"x": x}, ["gx"])
    np.testing.assert_array_equal(gx, x.view(np.int32).astype(np.float32))


def test_zero_gradient_registrations():
    for op in ("QuantizeLinear", "MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv",
               "HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix", "NonMaxSuppression"):
        assert REGISTRY.get("", op).kind == "zero", op
    for op in ("Resize", "Upsample", "GridSample", "RoiAlign", "MaxRoiPool", "MaxUnpool", "Col2Im",
               "GlobalLpPool", "DeformConv", "Compress", "ReverseSequence", "Scatter", "TensorScatter",
               "Unique", "CumProd", "Det", "DFT", "STFT", "DequantizeLinear", "BitCast"):
        assert REGISTRY.get("", op).kind == "vjp", op

