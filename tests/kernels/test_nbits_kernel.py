"""QLoRA's dA = dY W from the int4 codes: ``DequantizeNBitsF32``
(``onnxtrain.kernels.nbits``) writes W from the codes in one pass, bit for
bit the rule's standard-op unpacking, for any block size, 2, 4 and 8 bits,
zero points packed, in float or absent, K a whole number of blocks or not;
checked against a float64 numpy dequantize-then-matmul."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from chains import nbits, run, session
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.kernels.fuse import KERNEL_DOMAIN

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler for the kernel library")

CASES = [
    (4, 32, 64, "none"), (4, 16, 40, "packed"), (4, 16, 48, "float"), (4, 128, 300, "packed"), (4, 32, 45, "float"),
    (4, 64, 64, "float"), (8, 16, 40, "none"), (8, 32, 64, "packed"), (8, 128, 200, "packed"),
    (2, 16, 48, "packed"), (2, 64, 100, "none"), (2, 32, 70, "float"),  # (8 bits: onnxruntime takes no float zero point)
]


@pytest.mark.parametrize("opset", [17, 20])  # (the rule's float unpacking before 18, bytes after)
@pytest.mark.parametrize("bits,block,k,zp", CASES)
def test_the_kernels_gradient_is_the_rules_bit_for_bit(bits, block, k, zp, opset):
    chain = nbits(k=k, n=24, block=block, bits=bits, zp=zp, opset=opset)
    fused, count = chain.fused()
    kinds = [n.op_type for n in fused.graph.node if n.domain == KERNEL_DOMAIN]
    assert kinds == ["DequantizeNBitsF32"] and count == 1
    assert not {"BitShift", "BitwiseAnd", "Mod", "Floor"} & {n.op_type for n in fused.graph.node}
    standard, ours = run(chain.model, chain, fold=False), run(fused, chain, fold=False)
    assert np.array_equal(standard["grad_A"].view(np.uint32), ours["grad_A"].view(np.uint32))
    ref = chain.reference(chain.feeds)["grad_A"]
    np.testing.assert_allclose(ours["grad_A"], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("bits,block,k,zp", CASES)
def test_the_dequantized_weight_is_float64s_rounded(bits, block, k, zp):
    """W from the kernel alone against the float64 weight: (q - z) * s, two
    float32 operations each rounded once, within 2 ulps."""
    chain = nbits(k=k, n=24, block=block, bits=bits, zp=zp, seed=3)
    g = chain.model.graph
    inits = {t.name: t for t in g.initializer}
    inputs = ["B", "scales", "G"] + (["zp"] if zp == "packed" else ["", "zp"] if zp == "float" else [])
    nodes = [helper.make_node("DequantizeNBitsF32", inputs, ["W"], domain=KERNEL_DOMAIN)]
    geometry = numpy_helper.from_array(np.array([k, 24, bits, block], np.int64), "G")
    model = helper.make_model(helper.make_graph(
        nodes, "w", [], [helper.make_tensor_value_info("W", TensorProto.FLOAT, None)],
        [inits["B"], inits["scales"], geometry] + ([inits["zp"]] if zp != "none" else [])),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 8
    (w,) = session(model).run(None, {})
    assert w.shape == (24, k)
    np.testing.assert_allclose(w, chain.weight, rtol=2 * np.finfo(np.float32).eps, atol=1e-30)


def test_large_weights_split_over_threads_the_same():
    chain = nbits(k=1408, n=2816, block=32, bits=4, zp="packed", m=8, seed=5)  # (16 MB of W: two threads)
    fused, _ = chain.fused()
    standard, ours = run(chain.model, chain, fold=False), run(fused, chain, fold=False)
    assert np.array_equal(standard["grad_A"].view(np.uint32), ours["grad_A"].view(np.uint32))


def test_trained_scales_keep_the_standard_unpacking():
    """With the scales trained, the rule reads (q - zp) for dscale too: the
    chain is read outside the weight, so it stays standard ops (and right)."""
    chain = nbits(k=48, n=8, block=16, bits=4, zp="packed", train_scales=True)
    fused, count = chain.fused()
    assert count == 0 and "BitwiseAnd" in {n.op_type for n in fused.graph.node}


def test_the_kernel_reports_bad_geometry():
    b = numpy_helper.from_array(np.zeros((4, 2, 8), np.uint8), "B")
    s = numpy_helper.from_array(np.ones(8, np.float32), "scales")
    geometry = numpy_helper.from_array(np.array([32, 4, 3, 16], np.int64), "G")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("DequantizeNBitsF32", ["B", "scales", "G"], ["W"], domain=KERNEL_DOMAIN)], "w", [],
        [helper.make_tensor_value_info("W", TensorProto.FLOAT, None)], [b, s, geometry]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 8
    with pytest.raises(Exception, match="DequantizeNBitsF32: bad geometry"):
        session(model).run(None, {})
