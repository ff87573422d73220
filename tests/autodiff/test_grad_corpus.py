"""ONNX's node test corpus, used as a gradient corpus.

Every case of ``onnx.backend.test.case.node.collect_testcases()`` whose op is
differentiable (a 'vjp' rule in ``onnxtrain.autodiff.REGISTRY``, or no rule
but an ONNX function body) and that has floating tensor inputs and outputs
becomes one gradient check:

    loss = sum_k sum(R_k * out_k)           (R_k random, out_k floating outputs)
    G    = Gradient(xs = the floating inputs, y = loss)   expanded by onnxtrain
    <G_x, d_x>  ==  (loss(x + eps d_x) - loss(x - eps d_x)) / (2 eps)

with one random direction d_x per floating input x (so a wrong gradient names
its input), at the inputs the case gives: they are the corpus, so values,
shapes and attributes are kept and only the element type may change.  Both
sides run on onnxruntime: one session for the gradient model, one for the
loss.  Output entries the case expects to be inf or NaN are left out of the
loss; input entries that are inf or NaN are not stepped.

Precision, per case (the suffix of the test id):

* ``f64``: every float16/float/bfloat16 tensor of the case (inputs, outputs,
  initializers, Constant and attribute tensors, subgraphs, dtype attributes)
  becomes double; ``eps=1e-6``, rtol 1e-6.  The default.
* ``f32``: for ops that onnxruntime runs only in float32 (``FLOAT32_ONLY``,
  ``FLOAT32_CASES``): every floating tensor becomes float and the loss is
  summed in double; ``eps=1e-3``, rtol 2e-4 (``eps=1`` for linear ops).
* ``given``: Cast and CastLike keep the case's types (converting them would
  turn every cast into a no-op); they are linear, so ``eps=1`` is exact up to
  the rounding of the narrower type.

Cases at an opset newer than the installed onnxruntime's (``ort_max_opset``,
found by loading probe models) run at its newest opset.

A case is a pass, an ``xfail`` with its reason (``XFAIL`` below), or a skip
when the installed onnxruntime cannot run it.  Skips come from capability
probes, never from version lists: the case's op is newer (in that version)
than the newest opset onnxruntime loads (``_needs_newer_ort``), or onnxruntime,
asked to load the case's loss or gradient model, reports that it has no kernel
for one of its ops (``_no_kernel``; the skip names the op, its version, the
element type and the onnxruntime version).
Cases that are not gradient checks at all (zero-gradient and training-domain
ops, ops without a rule or body, no floating input or output, float8-style
tensors) are listed by ``scripts/gradient_coverage.py`` in
``docs/gradient-coverage.md``.

CI runs the whole corpus (about 45 s under ``pytest -n 2`` on 2 cores);
``ONNXTRAIN_CORPUS_PER_OP=N`` runs the first N cases of every op and variant.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import REGISTRY, expand_gradients
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.runtime.executor import Executor

#: Element types that are differentiated (float8/float4 are storage formats:
#: onnxruntime has no arithmetic on them).
FLOATS = frozenset({TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BFLOAT16})
#: Storage formats (float8, float4, int4, int2) that onnxruntime's Python API
#: does not feed and that no arithmetic kernel takes: cases with them are not
#: gradient checks.
PACKED = frozenset(
    getattr(TensorProto, n)
    for n in (
        "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0",
        "UINT4", "INT4", "FLOAT4E2M1", "UINT2", "INT2",
    )
    if hasattr(TensorProto, n)
)
NP_OF = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}

#: The whole corpus runs in CI (about 45 s under ``pytest -n 2``).  For quick
#: local runs, ``ONNXTRAIN_CORPUS_PER_OP=N`` keeps the first N cases (by name)
#: of every op and variant, a deterministic subset.
PER_OP = int(os.environ.get("ONNXTRAIN_CORPUS_PER_OP", "0") or 0)

#: Ops whose cases run in float32, because onnxruntime has no double kernel
#: for them or for an op their gradient emits (found by loading every case
#: converted to double; an onnxruntime that gains double kernels still runs
#: these cases, in float32, and one that lacks more is caught by the kernel
#: probe).  A case runs in float32 when any op of its graph is listed, or when
#: its op's schema allows no double (``_double_allowed``).
_NO_DOUBLE_KERNEL = (
    "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "AveragePool", "Conv", "ConvTranspose",
    "Cosh", "Elu", "Erf", "GlobalAveragePool", "GlobalMaxPool", "GRU", "HardSigmoid",
    "InstanceNormalization", "LRN", "LpPool", "LSTM", "Mean", "RNN", "Selu", "Sinh", "Softplus",
    "Softsign", "Tan", "ThresholdedRelu", "RotaryEmbedding",
)
FLOAT32_ONLY: dict[str, str] = {op: f"no double kernel for {op}" for op in _NO_DOUBLE_KERNEL}
FLOAT32_ONLY.update({
    "Celu": "Celu is float-only in the ONNX schema; its gradient also emits Elu",
    "DynamicQuantizeLinear": "DynamicQuantizeLinear is float-only in the ONNX schema",
    "Gelu": "the gradient of Gelu (approximate='none') emits Erf, which has no double kernel",
    "HardSwish": "the gradient of HardSwish emits HardSigmoid, which has no double kernel",
    "LayerNormalization": "with double inputs onnxruntime computes the statistics in float32 "
    "(stash_type=1), and has no kernel for stash_type=double with Mean/InvStdDev outputs",
    "MeanVarianceNormalization": "no double kernel, and the function body onnxruntime falls back "
    "to adds a float epsilon",
    "Mish": "the gradient of Mish emits Softplus, which has no double kernel",
    "Shrink": "onnxruntime's double Shrink rounds its result to float32",
    "Resize": "no double kernel for Resize",
    "Upsample": "no double kernel for Upsample",
    "Col2Im": "no double kernel for Col2Im",
    "MaxUnpool": "no double kernel for MaxUnpool",
    "MaxRoiPool": "no double kernel for MaxRoiPool",
    "Det": "no double kernel for Det",
    "DequantizeLinear": "the ONNX schema allows no double scale (float, float16, bfloat16)",
})
#: Single cases that run in float32 (case name -> why).
FLOAT32_CASES: dict[str, str] = {
    "test_pow_types_float32_uint32": "no double kernel for Pow(double, uint32)",
    "test_pow_types_float32_uint64": "no double kernel for Pow(double, uint64)",
    **{
        name: "onnxruntime's Attention (the function body it runs) adds a float causal mask "
        "to double scores"
        for name in (
            "test_attention_4d_attn_mask_3d_causal",
            "test_attention_4d_attn_mask_4d_causal",
            "test_attention_4d_attn_mask_causal_bf16",
            "test_attention_4d_with_past_and_present_qk_matmul_bias_3d_mask_causal",
            "test_attention_4d_with_past_and_present_qk_matmul_bias_4d_mask_causal",
        )
    },
}

#: Linear ops whose cases keep their element types (see the module docstring).
AS_GIVEN = frozenset({"Cast", "CastLike"})

#: Tolerances per precision: eps, rtol (of sum |g * d|), atol.  Every passing
#: case still passes with rtol and atol five times smaller (measured), except
#: one float32 case at a kink of Softsign's second derivative.
PRECISION = {
    "f64": dict(eps=1e-6, rtol=1e-6, atol=1e-8),
    "f32": dict(eps=1e-3, rtol=2e-4, atol=1e-5),
    "given": dict(eps=1.0, rtol=1e-2, atol=1e-4),
}

#: Unit roundoff of the narrowest type the loss passes through, per precision
#: ("given": the Cast cases go through float16 and bfloat16).
UNIT_ROUNDOFF = {"f64": 2.0**-53, "f32": 2.0**-24, "given": 2.0**-8}

#: Per-op overrides of PRECISION.  Float32 ops that are linear in each input
#: (bilinear for Conv's x and W) take eps=1: the loss is then at most quadratic
#: along the direction, where central differences are exact, and a large step
#: keeps float32 rounding small (the case inputs of AveragePool are 1..25).
TOLERANCE: dict[str, dict[str, float]] = {
    op: dict(eps=1.0)
    for op in (
        "AveragePool", "Conv", "ConvTranspose", "GlobalAveragePool", "Mean",
        "Resize", "Upsample", "Col2Im", "MaxUnpool", "DequantizeLinear",
    )
}



def _each(reason: str, *names: str) -> dict[str, str]:
    return {name: reason for name in names}


def _with_expanded(*names: str) -> tuple[str, ...]:
    return tuple(n for name in names for n in (name, name + "_expanded"))


#: Attention cases that onnxruntime releases before 1.32 refuse or compute
#: differently from the op's ONNX definition (checked with 1.31, the declared
#: minimum, and the onnx 1.23 corpus: each fails there; with 1.32 each passes).
ATTENTION_WINDOW = (
    "test_attention_local_window", "test_attention_local_window_default",
    "test_attention_bidirectional_window", "test_attention_3d_local_window",
    "test_attention_local_window_rank1_boolean_mask", "test_attention_local_window_with_past",
    "test_attention_local_window_ext_cache_float16_mask", "test_attention_local_window_ext_cache_rank2_mask",
    "test_attention_local_window_ext_cache_rank3_head_mask",
    "test_attention_local_window_ext_cache_rank4_batch_mask", "test_attention_local_window_gqa_rank4_mask",
)
ATTENTION_NONPAD = (
    "test_attention_4d_causal_nonpad_attn_mask_composition", "test_attention_4d_causal_nonpad_batch_prefill",
    "test_attention_4d_causal_nonpad_continued_prefill", "test_attention_4d_gqa_causal_nonpad_decode",
    "test_attention_4d_gqa_causal_nonpad_decode_fp16",
    "test_attention_4d_causal_nonpad_negative_offset_structural_empty",
)
ATTENTION_PADDED_KV = (
    "test_attention_4d_causal_padded_kv_bf16", "test_attention_4d_diff_heads_mask4d_padded_kv",
    "test_attention_4d_padded_kv_bf16",
)
ATTENTION_MASKED_ROW = (
    "test_attention_causal_boolmask_nan_robustness", "test_attention_23_boolmask_fullymasked_row_nan_robustness",
    "test_attention_23_fullymasked_qk_matmul_output_mode3_zero",
    "test_attention_24_fullymasked_qk_matmul_output_mode3_zero",
    "test_attention_24_qk_matmul_output_mode3_softmax_precision",
)


#: Expected failures: case name -> reason.  A reason starts with its category:
#:   "non-differentiable point" -- the case's input sits on a kink, a tie or the
#:       edge of the op's domain: no derivative for finite differences to match;
#:   "stochastic op" -- every onnxruntime run draws new random numbers;
#:   "onnxruntime" -- some onnxruntime releases compute the op differently from
#:       its ONNX definition or refuse the case;
#:   "rule bug" -- the rule's gradient is wrong (a silent zero, or invalid ops);
#:   "rule limitation" -- the rule or the engine refuses the case loudly;
#:   "function body" -- the op has no rule and its body cannot be used.
#: Every entry is a strict xfail: a pass means the entry is stale.  Most
#: causes are the case's data or our code, whatever onnxruntime is installed.
#: An "onnxruntime" entry that a later release fixed is expected to fail only
#: before that release (``ORT_FIXED_IN``); from it on, the case must pass, so
#: a regression there is seen.  Cases that onnxruntime cannot run at all (no
#: kernel, op too new) are skipped by probes, not listed here.
XFAIL: dict[str, str] = {
    # ---------------------------------------------------------- non-differentiable points
    **_each("non-differentiable point: x = 1 is the end of Acosh's domain (infinite slope; x - eps "
            "is outside it)", "test_acosh_example"),
    **_each("non-differentiable point: x = 0 is Elu's kink (alpha = 2: slopes 2 and 1)",
            "test_elu_example", "test_elu_example_expanded_ver18"),
    **_each("non-differentiable point: x = 0 is Selu's kink (slopes alpha * gamma and gamma)",
            "test_selu_example", "test_selu_example_expanded_ver18"),
    **_each("non-differentiable point: x = 0 is LeakyRelu's kink",
            *_with_expanded("test_leakyrelu_example")),
    **_each("non-differentiable point: x = 2 equals alpha, where ThresholdedRelu jumps",
            "test_thresholdedrelu_example", "test_thresholdedrelu_example_expanded_ver18"),
    **_each("non-differentiable point: depth planes 0 and 2 (1 and 3) of x are equal, so the max "
            "of every dilated window is attained twice (a tie)",
            "test_maxpool_3d_dilations", "test_maxpool_3d_dilations_use_ref_impl"),
    **_each("non-differentiable point: the minimum, 1, occurs three times (a tie)",
            "test_reduce_min_default_axes_keepdims_example"),
    **_each("non-differentiable point: x[:, 1, 2] is all zero, so its L2 norm is 0 (y = x / 0)",
            "test_l2normalization_axis_0"),
    **_each("non-differentiable point: x holds 0 with non-integer exponents, the edge of Pow's domain "
            "(x < 0 gives NaN; d/dy needs log 0)", "test_pow"),
    **_each("non-differentiable point: ratio = 0 is the lower end of Dropout's domain [0, 1); the "
            "finite-difference step makes it negative, which onnxruntime rejects",
            "test_training_dropout_zero_ratio", "test_training_dropout_zero_ratio_mask"),
    **_each("non-differentiable point: grid points at pixel centres (integer coordinates), where "
            "linear interpolation has a kink (the slope jumps between neighbouring pixel differences)",
            "test_gridsample_aligncorners_true", "test_gridsample_bilinear",
            "test_gridsample_bilinear_align_corners_1_additional_1",
            "test_gridsample_volumetric_bilinear_align_corners_0",
            "test_gridsample_volumetric_bilinear_align_corners_1"),
    **_each("non-differentiable point: grid points on rounding ties (half-integer coordinates), where "
            "nearest sampling jumps from one pixel to the next",
            "test_gridsample_nearest", "test_gridsample_nearest_align_corners_0_additional_1",
            "test_gridsample_nearest_align_corners_1_additional_1",
            "test_gridsample_volumetric_nearest_align_corners_0",
            "test_gridsample_volumetric_nearest_align_corners_1"),
    **_each("non-differentiable point: x holds repeated values; any step splits them and changes the "
            "size of Unique's output",
            "test_unique_bfloat16_sorted_without_axis", "test_unique_not_sorted_without_axis",
            "test_unique_sorted_with_axis", "test_unique_sorted_with_axis_3d",
            "test_unique_sorted_with_negative_axis", "test_unique_sorted_without_axis"),
    **_each("non-differentiable point: almost every offset is 0 (sampling points on pixel centres), "
            "where bilinear sampling has a kink in the offsets",
            "test_basic_deform_conv_with_padding", "test_basic_deform_conv_without_padding",
            "test_deform_conv_with_mask_bias", "test_deform_conv_with_multiple_offset_groups"),
    # ---------------------------------------------------------- stochastic ops
    **_each("stochastic op: training-mode Dropout draws a new mask at every onnxruntime run, so the "
            "two finite-difference runs see different masks",
            "test_training_dropout", "test_training_dropout_mask",
            "test_training_dropout_default", "test_training_dropout_default_mask"),
    # ---------------------------------------------------------- onnxruntime (fixed in 1.32)
    **_each("onnxruntime: releases before 1.32 have no left_window_size/right_window_size attributes in "
            "their Attention schema (newer than the ONNX they bundle), so they refuse the case",
            *ATTENTION_WINDOW),
    **_each("onnxruntime: releases before 1.32 handle nonpad_kv_seqlen in their Attention kernel "
            "differently from the ONNX function body that defines the op, which the gradient follows "
            "(the _expanded twin, whose forward pass is that body, passes)", *ATTENTION_NONPAD),
    **_each("onnxruntime: releases before 1.32 reject the case in float64 in their Attention kernel "
            "('Type parameter (T) of Optype (Add) bound to different types'); the _expanded twin passes",
            *ATTENTION_PADDED_KV),
    **_each("onnxruntime: releases before 1.32 output NaN from their Attention kernel for a query row "
            "that sees no key (the op's definition gives zeros), so the case's loss is not finite",
            *ATTENTION_MASKED_ROW),
    # ---------------------------------------------------------- rule bugs
    # ---------------------------------------------------------- rule limitations
    **_each("rule limitation: in the written-out AffineGrid body, an If decided at run time (2-D or "
            "3-D theta) produces grid_3d, so neither onnx shape inference nor rank propagation knows "
            "its rank, which the gradient of the Slice inside the If's branch needs (the AffineGrid "
            "node itself has a direct rule and passes)",
            "test_affine_grid_2d_expanded", "test_affine_grid_2d_align_corners_expanded",
            "test_affine_grid_3d_expanded", "test_affine_grid_3d_align_corners_expanded"),
    **_each("rule limitation: Slice's gradient needs constant axes; the case feeds them as a graph input",
            "test_slice", "test_slice_default_steps", "test_slice_end_out_of_bounds", "test_slice_neg",
            "test_slice_neg_steps", "test_slice_negative_axes", "test_slice_start_out_of_bounds"),
    **_each("rule limitation: ScatterElements has no gradient for reduction mul/max/min",
            "test_scatter_elements_with_reduction_max", "test_scatter_elements_with_reduction_min",
            "test_scatter_elements_with_reduction_mul"),
    **_each("rule limitation: ScatterND has no gradient for reduction mul/max/min",
            "test_scatternd_max", "test_scatternd_min", "test_scatternd_multiply",
            "test_scatternd_max_with_element_indices", "test_scatternd_min_with_element_indices"),
    **_each("rule limitation: float Mod with fmod=0 is refused (the ONNX spec requires fmod=1 for floats)",
            "test_mod_float16_mixed_sign_fmod_0", "test_mod_float32_mixed_sign_fmod_0",
            "test_mod_float64_mixed_sign_fmod_0", "test_mod_float_edge_cases_fmod_0_float16",
            "test_mod_float_edge_cases_fmod_0_float32", "test_mod_float_edge_cases_fmod_0_float64"),
    **_each("rule limitation: Einsum with a repeated subscript in one operand (a diagonal) is refused",
            "test_einsum_batch_diagonal"),
    **_each("onnxruntime limitation: its CPU RNN/GRU/LSTM kernels refuse layout=1 (batch first), so the "
            "forward pass cannot run (the rules cover layout=1: tests/autodiff/test_grad_recurrent.py)",
            "test_gru_batchwise", "test_lstm_batchwise", "test_simple_rnn_batchwise"),
    **_each("rule limitation: LSTM with sequence_lens is refused", "test_lstm_with_peepholes"),
    **_each("rule limitation: Loop at opset 11: a Sum's broadcast ranks are unknown and ReduceSum has "
            "no runtime axes before opset 13", "test_loop11"),
    **_each("rule limitation: Scan-8 (batch axis and sequence_lens) is refused", "test_scan_sum"),
    **_each("rule limitation: a gradient with respect to Resize's scales is refused (sizes, not data); "
            "the case feeds them as a graph input",
            "test_resize_downsample_scales_cubic", "test_resize_downsample_scales_cubic_A_n0p5_exclude_outside",
            "test_resize_downsample_scales_cubic_align_corners", "test_resize_downsample_scales_cubic_antialias",
            "test_resize_downsample_scales_linear", "test_resize_downsample_scales_linear_align_corners",
            "test_resize_downsample_scales_linear_antialias",
            "test_resize_downsample_scales_linear_half_pixel_symmetric", "test_resize_downsample_scales_nearest",
            "test_resize_upsample_scales_cubic", "test_resize_upsample_scales_cubic_A_n0p5_exclude_outside",
            "test_resize_upsample_scales_cubic_align_corners", "test_resize_upsample_scales_cubic_asymmetric",
            "test_resize_upsample_scales_linear", "test_resize_upsample_scales_linear_align_corners",
            "test_resize_upsample_scales_linear_half_pixel_symmetric", "test_resize_upsample_scales_nearest",
            "test_resize_upsample_scales_nearest_axes_2_3", "test_resize_upsample_scales_nearest_axes_3_2",
            "test_upsample_nearest"),
    **_each("rule limitation: a gradient with respect to Resize's roi is refused (box coordinates, "
            "not data); the case feeds it as a graph input",
            "test_resize_tf_crop_and_resize", "test_resize_tf_crop_and_resize_axes_2_3",
            "test_resize_tf_crop_and_resize_axes_3_2", "test_resize_tf_crop_and_resize_extrapolation_value"),
    **_each("rule limitation: a gradient with respect to RoiAlign's rois is refused (box coordinates, "
            "not data); the case feeds them as a graph input",
            "test_roialign_aligned_false", "test_roialign_aligned_true", "test_roialign_mode_max"),
}

#: "onnxruntime" entries of XFAIL that a release fixed: case name -> that
#: release (major, minor).  With it or a newer one installed, the case is a
#: plain check and must pass; with an older one, a strict xfail.
ORT_FIXED_IN: dict[str, tuple[int, int]] = {
    name: (1, 32) for name in (*ATTENTION_WINDOW, *ATTENTION_NONPAD, *ATTENTION_PADDED_KV, *ATTENTION_MASKED_ROW)
}
ORT_VERSION = tuple(int(p) for p in re.findall(r"\d+", ort.__version__)[:2])


def expected_failure(name: str, ort_version: tuple[int, ...] = ORT_VERSION) -> str | None:
    """The XFAIL reason of case ``name`` with onnxruntime ``ort_version``
    installed: None when the case must pass."""
    fixed = ORT_FIXED_IN.get(name)
    if fixed is not None and tuple(ort_version) >= fixed:
        return None
    return XFAIL.get(name)


TRAINING_DOMAINS = frozenset({PREVIEW_DOMAIN, "ai.onnx.training"})


# ------------------------------------------------------------------ loading
@dataclass
class Case:
    """One node test case of the ONNX corpus, classified."""

    name: str
    op: str
    domain: str
    #: "node" (one node of ``op``) or "expanded" (``op``'s function body, as
    #: the corpus gives it in its ``*_expanded`` twin).
    variant: str
    model: onnx.ModelProto
    inputs: list[Any]
    outputs: list[Any]
    #: What the case is: "check" (a gradient check) or an exclusion category.
    category: str = "check"
    #: "f64" | "f32" | "given" for checks.
    precision: str = ""
    #: The kind of the op's derivative: "vjp" (its rule), "function" (its body).
    via: str = ""
    xfail: str | None = None
    #: Why the installed onnxruntime cannot run the case (a probe's finding).
    skip: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.name}-{self.precision}" if self.category == "check" else self.name


def _raw_corpus() -> list[tuple[str, bytes, list, list]]:
    """(name, model bytes, inputs, outputs) of every node test case.

    Generating the corpus takes ~12 s (every ``export`` of onnx's node test
    cases runs its numpy reference), so the result is cached in the user's
    cache directory ($XDG_CACHE_HOME or ~/.cache), keyed by the onnx version."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(cache, "onnxtrain", f"node-corpus-onnx{onnx.__version__}.pkl")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:  # absent, partial or unreadable: rebuild
        pass
    import inspect

    from onnx.backend.test.case.node import collect_testcases

    # older onnx releases take an op-type filter, where None means every op
    takes_filter = bool(inspect.signature(collect_testcases).parameters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases(None) if takes_filter else collect_testcases()
    raw = [(c.name, c.model.SerializeToString(), list(c.data_sets[0][0]), list(c.data_sets[0][1])) for c in cases]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(raw, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)  # atomic: concurrent workers race harmlessly
    except OSError:
        pass  # a read-only home: no cache, same corpus
    return raw


@functools.cache
def ort_max_opset() -> int:
    """The newest ai.onnx opset this onnxruntime loads."""
    for version in range(onnx.defs.onnx_opset_version(), 6, -1):
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "probe",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        )
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", version)])
        m.ir_version = 10
        try:
            ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            return version
        except Exception:
            continue
    return 7


def _opset(model: onnx.ModelProto, domain: str = "") -> int:
    for o in model.opset_import:
        if o.domain == domain or (domain == "" and o.domain == "ai.onnx"):
            return int(o.version)
    return 0


def _walk(graph: onnx.GraphProto):
    """Every node of ``graph`` and of its subgraphs."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _walk(a.g)
            for g in a.graphs:
                yield from _walk(g)


def _elem_type(vi: onnx.ValueInfoProto) -> int:
    return vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0


def _is_float_tensor(vi: onnx.ValueInfoProto) -> bool:
    return vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in FLOATS


def _rule_kind(domain: str, op: str, opset: int) -> str | None:
    """'vjp' | 'zero' | 'refused' (registry), 'function' (no rule, a body), or None."""
    rule = REGISTRY.get(domain, op)
    if rule is not None:
        return rule.kind
    try:
        schema = onnx.defs.get_schema(op, opset, domain)
    except onnx.defs.SchemaError:
        return None
    if schema.has_function or schema.has_context_dependent_function:
        return "function"
    return None


@functools.cache
def corpus() -> tuple[Case, ...]:
    """Every node test case, classified (see ``Case.category``)."""
    raw = _raw_corpus()
    base_ops: dict[str, tuple[str, str]] = {}
    parsed = []
    for name, data, inputs, outputs in raw:
        model = onnx.ModelProto()
        model.ParseFromString(data)
        parsed.append((name, model, inputs, outputs))
        if not re.search(r"_expanded(_ver\d+)?$", name):
            node = model.graph.node[0]
            base_ops[name] = (node.domain, node.op_type)
    cases = []
    for name, model, inputs, outputs in parsed:
        base = re.sub(r"_expanded(_ver\d+)?$", "", name)
        domain, op = base_ops[base]
        variant = "node" if base == name else "expanded"
        case = Case(name, op, domain, variant, model, inputs, outputs)
        _classify(case)
        cases.append(case)
    return tuple(cases)


def _classify(case: Case) -> None:
    g = case.model.graph
    opset = _opset(case.model, case.domain)
    kind = _rule_kind(case.domain, case.op, opset)
    if case.domain in TRAINING_DOMAINS:
        case.category = "training-domain op"
    elif kind == "zero":
        case.category = "zero-gradient op"
    elif kind == "refused":
        case.category = "refused op"
    elif kind is None:
        case.category = "no rule and no function body"
    elif any(_elem_type(vi) in PACKED for vi in list(g.input) + list(g.output)):
        case.category = "float8/float4/int4/int2 tensors"
    elif not any(_is_float_tensor(i) for i in g.input):
        case.category = "no floating input"
    elif not any(_is_float_tensor(o) for o in g.output):
        case.category = "no floating output"
    else:
        case.category = "check"
        case.via = kind
        ops = {case.op} | {n.op_type for n in _walk(g)}
        if case.op in AS_GIVEN:
            case.precision = "given"
        elif ops & set(FLOAT32_ONLY) or case.name in FLOAT32_CASES or not _double_allowed(case):
            case.precision = "f32"
        else:
            case.precision = "f64"
        case.xfail = expected_failure(case.name)
        case.skip = _needs_newer_ort(case)


_FLOAT_TYPE_STRS = frozenset({"tensor(float16)", "tensor(float)", "tensor(bfloat16)", "tensor(double)"})


def _double_allowed(case: Case) -> bool:
    """Whether the op's schema lets its floating tensors be double (LinearAttention,
    CausalConvWithState and DequantizeLinear's scale allow float, float16 and
    bfloat16 only): a case converted to double must still be a valid model."""
    try:
        schema = onnx.defs.get_schema(case.op, _opset(case.model, case.domain), case.domain)
    except onnx.defs.SchemaError:
        return True
    return all(
        "tensor(double)" in tc.allowed_type_strs
        for tc in schema.type_constraints
        if _FLOAT_TYPE_STRS & set(tc.allowed_type_strs)
    )


def _needs_newer_ort(case: Case) -> str | None:
    """Why the installed onnxruntime cannot run the case, or None.

    A case newer than onnxruntime's newest opset runs at that opset, which is
    only the same model when the version of the case's op it uses already
    existed there: an op (or op version, e.g. SpaceToDepth-28's ``mode``)
    newer than onnxruntime's opsets makes the case a skip."""
    if case.variant != "node" or case.domain not in ("", "ai.onnx"):
        return None
    newest = ort_max_opset()
    if _opset(case.model) <= newest:
        return None
    since = onnx.defs.get_schema(case.op, _opset(case.model), "").since_version
    if since <= newest:
        return None
    return f"onnxruntime {ort.__version__} cannot run {case.op}-{since}: it loads opsets up to {newest}"


def checks(per_op: int = PER_OP) -> list[Case]:
    """The gradient-check cases: all of them, or the first ``per_op`` of each op and variant."""
    chosen = [c for c in corpus() if c.category == "check"]
    if per_op <= 0:
        return chosen
    taken: dict[tuple[str, str], int] = defaultdict(int)
    subset = []
    for c in sorted(chosen, key=lambda c: c.name):
        key = (c.op, c.variant)
        if taken[key] < per_op:
            taken[key] += 1
            subset.append(c)
    return subset


# ------------------------------------------------------------------ the harness
def _convert_tensor(t: onnx.TensorProto, target: int) -> None:
    if t.data_type in FLOATS and t.data_type != target:
        arr = numpy_helper.to_array(t).astype(np.float64).astype(NP_OF[target])
        t.CopyFrom(numpy_helper.from_array(arr, t.name))


def _convert_type(tp: onnx.TypeProto, target: int) -> None:
    which = tp.WhichOneof("value")
    if which == "tensor_type":
        if tp.tensor_type.elem_type in FLOATS:
            tp.tensor_type.elem_type = target
    elif which == "sequence_type":
        _convert_type(tp.sequence_type.elem_type, target)
    elif which == "optional_type":
        _convert_type(tp.optional_type.elem_type, target)


#: Attributes that name an element type (a float32 one becomes the target type:
#: Cast's ``to``, LayerNormalization's ``stash_type``, Attention's
#: ``softmax_precision``, ...).
DTYPE_ATTRS = frozenset({"to", "dtype", "output_dtype", "stash_type", "softmax_precision"})


def _convert_graph(g: onnx.GraphProto, target: int) -> None:
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        _convert_type(vi.type, target)
    for t in g.initializer:
        _convert_tensor(t, target)
    for n in g.node:
        if n.op_type == "ConstantOfShape" and not any(a.name == "value" for a in n.attribute):
            # its default value is a float32 zero: make the float explicit, so it converts
            n.attribute.append(helper.make_attribute("value", helper.make_tensor("value", target, [1], [0.0])))
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                _convert_tensor(a.t, target)
            elif a.type == onnx.AttributeProto.GRAPH:
                _convert_graph(a.g, target)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    _convert_graph(sub, target)
            elif a.type == onnx.AttributeProto.INT and a.name in DTYPE_ATTRS and a.i in FLOATS:
                a.i = target


def _set_stash_type(g: onnx.GraphProto, target: int, opset: int) -> None:
    """Give nodes with a ``stash_type`` attribute (LayerNormalization,
    GroupNormalization, RMSNormalization) an explicit one: its default is
    float32, the precision the float32 case computed in; converted to double,
    the case computes its statistics in double too."""
    for n in _walk(g):
        if any(a.name == "stash_type" for a in n.attribute):
            continue
        try:
            schema = onnx.defs.get_schema(n.op_type, opset, n.domain)
        except onnx.defs.SchemaError:
            continue
        if "stash_type" in schema.attributes and n.op_type != "Range":
            n.attribute.append(helper.make_attribute("stash_type", target))


def _convert_value(value: Any, vi: onnx.ValueInfoProto, target: int | None) -> Any:
    if isinstance(value, onnx.TensorProto):
        value = numpy_helper.to_array(value)
    if isinstance(value, np.generic):
        value = np.asarray(value)  # onnxruntime takes 0-d arrays, not numpy scalars
    if target is None or not _is_float_tensor(vi):
        return value
    return np.asarray(value).astype(np.float64).astype(NP_OF[target])


def _session_options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.log_severity_level = 4  # failures come back as exceptions; keep stderr quiet
    return so


def build(case: Case) -> tuple[onnx.ModelProto, onnx.ModelProto, dict[str, Any], list[str]]:
    """(loss model, gradient model, feeds, wrt) for ``case``."""
    target = {"f64": TensorProto.DOUBLE, "f32": TensorProto.FLOAT, "given": None}[case.precision]
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    g = model.graph
    for o in model.opset_import:  # onnxruntime stops at ort_max_opset()
        if o.domain in ("", "ai.onnx") and o.version > ort_max_opset():
            o.version = ort_max_opset()
    if target is not None:
        _convert_graph(g, target)
        _set_stash_type(g, target, _opset(model))
    present = [i for i in g.input]
    feeds = {vi.name: _convert_value(v, vi, target) for vi, v in zip(present, case.inputs)}
    wrt = [vi.name for vi in present if _is_float_tensor(vi)]

    rng = np.random.default_rng(_seed(case.name))
    names = NameGen.from_graph(g)
    terms: list[str] = []
    abs_terms: list[str] = []
    loss_nodes: list[onnx.NodeProto] = []
    for vi, expected in zip(list(g.output), case.outputs):
        if not _is_float_tensor(vi):
            continue
        out = vi.name
        if vi.type.tensor_type.elem_type != TensorProto.DOUBLE:
            cast = names.fresh(f"{out}_f64")
            loss_nodes.append(helper.make_node("Cast", [out], [cast], to=TensorProto.DOUBLE))
            out = cast
        shape = list(np.shape(expected))
        finite = np.isfinite(_as_float64(expected))
        if not finite.all():
            # leave out the entries the case expects to be inf or NaN
            mask, zero, kept = names.fresh(f"finite_{vi.name}"), names.fresh("zero"), names.fresh(f"{vi.name}_finite")
            feeds[mask] = finite
            feeds[zero] = np.zeros((), np.float64)
            g.input.append(helper.make_tensor_value_info(mask, TensorProto.BOOL, shape))
            g.input.append(helper.make_tensor_value_info(zero, TensorProto.DOUBLE, []))
            loss_nodes.append(helper.make_node("Where", [mask, out, zero], [kept]))
            out = kept
        r = names.fresh(f"R_{vi.name}")
        feeds[r] = rng.standard_normal(shape)
        g.input.append(helper.make_tensor_value_info(r, TensorProto.DOUBLE, shape))
        prod, total = names.fresh(f"{vi.name}_R"), names.fresh(f"{vi.name}_sum")
        absolute, abs_total = names.fresh(f"{vi.name}_R_abs"), names.fresh(f"{vi.name}_abs_sum")
        loss_nodes.append(helper.make_node("Mul", [out, r], [prod]))
        loss_nodes.append(helper.make_node("ReduceSum", [prod], [total], keepdims=0))
        loss_nodes.append(helper.make_node("Abs", [prod], [absolute]))
        loss_nodes.append(helper.make_node("ReduceSum", [absolute], [abs_total], keepdims=0))
        terms.append(total)
        abs_terms.append(abs_total)
    loss, loss_abs = names.fresh("loss"), names.fresh("loss_abs")
    loss_nodes.append(helper.make_node("Sum", terms, [loss]))
    # sum |R * out|: the size of the terms the loss adds up (its rounding scale)
    loss_nodes.append(helper.make_node("Sum", abs_terms, [loss_abs]))
    g.node.extend(loss_nodes)
    del g.output[:]
    g.output.append(helper.make_tensor_value_info(loss, TensorProto.DOUBLE, []))
    g.output.append(helper.make_tensor_value_info(loss_abs, TensorProto.DOUBLE, []))
    if not any(o.domain == PREVIEW_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(PREVIEW_DOMAIN, 1))
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        # ai.onnx.ml-only cases: the loss and the gradients are default-domain ops
        model.opset_import.append(helper.make_opsetid("", 17))

    grad_model = onnx.ModelProto()
    grad_model.CopyFrom(model)
    gg = grad_model.graph
    grads = [names.fresh(f"grad_{x}") for x in wrt]
    gg.node.append(
        helper.make_node("Gradient", wrt, grads, domain=PREVIEW_DOMAIN, xs=wrt, y=loss, name="corpus_gradient")
    )
    types = {vi.name: vi for vi in gg.input}
    for x, gname in zip(wrt, grads):
        t = onnx.ValueInfoProto()
        t.CopyFrom(types[x])
        t.name = gname
        gg.output.append(t)
    available = [vi.name for vi in gg.input] + [t.name for t in gg.initializer]
    expand_gradients(gg, grad_model.opset_import, names, available, list(grad_model.functions))
    for out in gg.output:
        if _elem_type(out) == TensorProto.BFLOAT16:
            # onnxruntime returns no bfloat16 numpy arrays: the gradient keeps
            # its declared type (value_info) and leaves the model as float32
            gg.value_info.append(helper.make_tensor_value_info(out.name, TensorProto.BFLOAT16, None))
            as_float = names.fresh(f"{out.name}_f32")
            gg.node.append(helper.make_node("Cast", [out.name], [as_float], to=TensorProto.FLOAT))
            out.name = as_float
            out.type.tensor_type.elem_type = TensorProto.FLOAT
    return model, grad_model, feeds, wrt


def _as_float64(value: Any) -> np.ndarray:
    if isinstance(value, onnx.TensorProto):
        value = numpy_helper.to_array(value)
    return np.asarray(value).astype(np.float64)


def _ort_feeds(feeds: dict[str, Any]) -> dict[str, Any]:
    """bfloat16 arrays go in as OrtValues (onnxruntime's numpy path has no bfloat16).

    Every array is a fresh copy: some onnxruntime releases' training-mode
    BatchNormalization writes its running statistics into its mean/var input
    buffers when those outputs are not graph outputs, which would change the
    case's feeds from one run to the next."""
    out = {}
    for k, v in feeds.items():
        if isinstance(v, np.ndarray):
            v = v.copy()
        if isinstance(v, np.ndarray) and v.dtype.name == "bfloat16":
            v = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(v.view(np.uint16), TensorProto.BFLOAT16)
        out[k] = v
    return out


def _seed(name: str) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate(name)) % (2**31)


#: How onnxruntime says that it has no kernel for an op ("NOT_IMPLEMENTED :
#: Could not find an implementation for Conv(22) node ...", "Failed to find
#: kernel for com.microsoft.X(1) ...") or does not know the op at all.
_NO_KERNEL = re.compile(
    r"Could not find an implementation for (?P<op>[\w.:]+)\((?P<version>-?\d+)\)"
    r"|Failed to find kernel for (?P<op2>[\w.:]+)\((?P<version2>-?\d+)\)"
    r"|(?P<op3>[\w.:]+)\((?P<version3>-?\d+)\) is not a registered function/op"
    r"|No Op registered for (?P<op4>\w+) with domain_version of (?P<version4>\d+)"
)

#: The element type each precision converts the case's floating tensors to.
_PRECISION_TYPE = {"f64": "double", "f32": "float", "given": "the case's own types"}


def _no_kernel(error: BaseException, case: Case) -> str | None:
    """The skip reason when ``error`` (from loading a model of ``case``) says
    that onnxruntime has no kernel for one of its ops, else None."""
    text = f"{error} {error.__cause__ or ''}"
    m = _NO_KERNEL.search(text)
    if m is None:
        return None
    op = next(v for k, v in m.groupdict().items() if k.startswith("op") and v)
    version = next(v for k, v in m.groupdict().items() if k.startswith("version") and v)
    if m.group("op3") or m.group("op4"):
        return f"onnxruntime {ort.__version__} knows no op or function {op} (version {version})"
    return (
        f"onnxruntime {ort.__version__} has no CPU kernel for {op}({version}) for this case's types "
        f"(its floating tensors as {_PRECISION_TYPE[case.precision]})"
    )


def _load(model: onnx.ModelProto, so: ort.SessionOptions, label: str, case: Case) -> Executor:
    """An onnxruntime session for one model of the check: the kernel probe.

    An op onnxruntime has no kernel for makes the case a skip that names the
    kernel; any other load failure is a failure of the case."""
    try:
        return Executor(model, session_options=so, label=label)
    except Exception as exc:
        reason = _no_kernel(exc, case)
        if reason is None:
            raise
        pytest.skip(f"{label}: {reason}")


def check(case: Case) -> None:
    """The gradient check of one corpus case (module docstring).

    Each floating input x gets its own random direction d_x and its own
    central difference, so a wrong or missing gradient names its input:
    |<G_x, d_x> - FD_x| <= rtol * sum|G_x * d_x| + atol + noise, where noise
    bounds the rounding of the loss, unit_roundoff * sum|R * out| / eps."""
    tol = {**PRECISION[case.precision], **TOLERANCE.get(case.op, {})}
    eps, rtol, atol = tol["eps"], tol["rtol"], tol["atol"]
    loss_model, grad_model, feeds, wrt = build(case)
    onnx.checker.check_model(grad_model)
    so = _session_options()
    gradient = _load(grad_model, so, f"{case.name} gradient", case)
    forward = _load(loss_model, so, f"{case.name} loss", case)
    loss_name, abs_name = (o.name for o in loss_model.graph.output)
    grad_names = [o.name for o in grad_model.graph.output[2:]]
    values = gradient.run(_ort_feeds(feeds), [abs_name] + grad_names)
    loss_abs, analytic = float(values[0]), values[1:]
    for x, gvalue in zip(wrt, analytic):
        x_arr = np.asarray(feeds[x])
        assert gvalue.shape == x_arr.shape, f"gradient of {x}: shape {gvalue.shape} != {x_arr.shape}"
        want = np.float32 if x_arr.dtype.name == "bfloat16" else x_arr.dtype  # see build()
        assert gvalue.dtype == want, f"gradient of {x}: dtype {gvalue.dtype} != {x_arr.dtype}"

    rng = np.random.default_rng(_seed(case.name) + 1)
    noise = 10 * UNIT_ROUNDOFF[case.precision] * loss_abs / eps
    wrong = []
    for x, gvalue in zip(wrt, analytic):
        x_arr = np.asarray(feeds[x])
        # inf and NaN entries stay where they are (a step cannot move them)
        d = np.where(np.isfinite(x_arr), rng.standard_normal(x_arr.shape), 0.0)
        plus = {**feeds, x: np.asarray(x_arr.astype(np.float64) + eps * d, dtype=x_arr.dtype)}
        minus = {**feeds, x: np.asarray(x_arr.astype(np.float64) - eps * d, dtype=x_arr.dtype)}
        # the step actually taken, after rounding to the input's type
        with np.errstate(invalid="ignore"):
            d_taken = (plus[x].astype(np.float64) - minus[x].astype(np.float64)) / (2 * eps)
        d_taken = np.where(d == 0.0, 0.0, d_taken)
        term = gvalue.astype(np.float64) * d_taken
        predicted, scale = float(np.sum(term)), float(np.sum(np.abs(term)))
        lp = float(forward.run(_ort_feeds(plus), [loss_name])[0])
        lm = float(forward.run(_ort_feeds(minus), [loss_name])[0])
        numeric = (lp - lm) / (2 * eps)
        assert np.isfinite(numeric), (
            f"{case.name}: the loss is not finite near the case's inputs (stepping {x!r})"
        )
        bound = rtol * scale + atol + noise
        if not abs(predicted - numeric) <= bound:
            wrong.append(f"{x!r}: analytic {predicted:.6g}, numeric {numeric:.6g} (tolerance {bound:.3g})")
    assert not wrong, (
        f"{case.name} ({case.op}, {case.precision}) directional derivatives differ: " + "; ".join(wrong)
    )


# ------------------------------------------------------------------ pytest
def _params(cases: Sequence[Case]) -> list:
    out = []
    for c in cases:
        marks = []
        if c.skip:
            marks.append(pytest.mark.skip(reason=c.skip))
        elif c.xfail:
            marks.append(pytest.mark.xfail(reason=c.xfail, strict=True))  # see XFAIL
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "corpus_case" in metafunc.fixturenames:
        metafunc.parametrize("corpus_case", _params(checks()))


def test_corpus_case(corpus_case: Case) -> None:
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        check(corpus_case)


#: The onnx release whose node test corpus XFAIL and FLOAT32_CASES were written
#: against.  Older releases lack some of its cases (they were added later).
TABLES_ONNX = (1, 23)


def _onnx_version() -> tuple[int, int]:
    return tuple(int(p) for p in re.findall(r"\d+", onnx.__version__)[:2])  # type: ignore[return-value]


def test_tables_name_real_cases() -> None:
    """XFAIL and FLOAT32_CASES name gradient-check cases (a typo or a stale
    entry fails).  With the onnx the tables were written against, or a newer
    one, every entry must be a case; with an older onnx, an entry may be a case
    that onnx does not have yet, but one it has must be a gradient check."""
    cases = {c.name: c for c in corpus()}
    names = set(XFAIL) | set(FLOAT32_CASES)
    if _onnx_version() >= TABLES_ONNX:
        stale = sorted(n for n in names if n not in cases or cases[n].category != "check")
    else:
        stale = sorted(n for n in names if n in cases and cases[n].category != "check")
    assert not stale, f"entries that are not gradient-check cases of onnx {onnx.__version__}: {stale}"
    # a release fixes only onnxruntime's own causes, and each such case is
    # expected to fail before it and to pass from it on
    assert all(XFAIL.get(n, "").startswith("onnxruntime") for n in ORT_FIXED_IN), sorted(ORT_FIXED_IN)
    for name, fixed in ORT_FIXED_IN.items():
        assert expected_failure(name, (fixed[0], fixed[1] - 1)) == XFAIL[name]
        assert expected_failure(name, fixed) is None and expected_failure(name, (fixed[0] + 1, 0)) is None


def test_function_body_takes_schema_attribute_defaults() -> None:
    """Found by the corpus (SwiGLU's body calls Swish without alpha): a schema
    body names its attributes without defaults, so an unset ``@alpha`` must
    take the schema's default, not leave its Constant without a value."""
    from onnxtrain.autodiff.inline import function_body, inline

    node = helper.make_node("Swish", ["x"], ["y"], name="swish")
    types = [helper.make_tensor_type_proto(TensorProto.FLOAT, [2])]
    body = function_body(node, [helper.make_opsetid("", 24)], [], types)
    assert body is not None
    nodes = inline(node, body, NameGen({"x", "y"}))
    alpha = [a for n in nodes if n.op_type == "Constant" for a in n.attribute]
    assert [(a.name, a.f) for a in alpha] == [("value_float", 1.0)]
