"""Training-mode BatchNormalization as standard ops, for the CUDA provider
(onnxruntime's CUDA kernel refuses training_mode=1 from opset 14 on;
benchmarks/cuda.py found it on W5).  The rewrite is checked against
onnxruntime's own CPU kernel on the same inputs, and in the executed list."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from models import inference_mlp
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import build
from onnxtrain.io.metadata import model_metadata
from onnxtrain.io.model import validate
from onnxtrain.lower.batchnorm import is_training_batch_norm, standard_batch_norm
from onnxtrain.lower.executed import ExecOptions, execute
from onnxtrain.lower.lowering import ALGORITHM, EVALUATE
from onnxtrain.lower.programs import ProgramSet


def run(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items()
                                            if k in {i.name for i in model.graph.input}})))


def bn_model(rank: int, opset: int, momentum: float, eps: float) -> onnx.ModelProto:
    shape = [4, 3, 5, 6, 2][:rank]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, shape)] + [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("scale", "B", "mean", "var")]
    outs = ["Y", "running_mean", "running_var"]  # (onnxruntime wants all three in training mode)
    node = helper.make_node("BatchNormalization", ["X", "scale", "B", "mean", "var"], outs, name="bn",
                            training_mode=1, momentum=momentum, epsilon=eps)
    out_vi = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, shape)] + [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in outs[1:]]
    model = helper.make_model(helper.make_graph([node], "bn", inputs, out_vi),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("opset", [15, 18])
@pytest.mark.parametrize("rank", [2, 3, 4, 5])
@pytest.mark.parametrize("momentum,eps", [(0.9, 1e-5), (0.7, 1e-2)])
def test_the_standard_ops_equal_onnxruntimes_kernel(rank, opset, momentum, eps):
    model = bn_model(rank, opset, momentum, eps)
    rewritten, count = standard_batch_norm(model)
    assert count == 1 and not any(is_training_batch_norm(n) for n in rewritten.graph.node)
    assert any(is_training_batch_norm(n) for n in model.graph.node)  # the original is left as it was
    onnx.checker.check_model(rewritten, full_check=True)
    rng = np.random.default_rng(rank)
    feeds = {"X": (rng.standard_normal([4, 3, 5, 6, 2][:rank]) * 2 + 1).astype(np.float32),
             "scale": rng.uniform(0.5, 1.5, 3).astype(np.float32), "B": rng.standard_normal(3).astype(np.float32),
             "mean": rng.standard_normal(3).astype(np.float32), "var": rng.uniform(0.5, 2, 3).astype(np.float32)}
    want, got = run(model, feeds), run(rewritten, feeds)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-6, err_msg=name)


def test_inference_mode_and_unknown_ranks_stay():
    model = bn_model(4, 15, 0.9, 1e-5)
    kept = [a for a in model.graph.node[0].attribute if a.name != "training_mode"]
    del model.graph.node[0].attribute[:]
    model.graph.node[0].attribute.extend(kept)
    assert standard_batch_norm(model) == (model, 0)
    unknown = bn_model(4, 15, 0.9, 1e-5)
    unknown.graph.input[0].type.tensor_type.ClearField("shape")
    assert standard_batch_norm(unknown) == (unknown, 0)


def programs_of(tm: onnx.ModelProto) -> ProgramSet:
    tm = validate(tm)
    return ProgramSet(tm, model_metadata(tm.proto))


def test_the_executed_training_program_has_none_off_cpu():
    """A builder model with BatchNorm: on CUDA the executed algorithm program
    (and the evaluate program) computes the batch statistics with standard
    ops, and gives the standard program's outputs; on CPU it keeps the kernel."""
    tm = build.training_model(inference_mlp(batch_norm=True), loss="mse", target="T",
                              optimizer=build.SGD(lr=0.1, momentum=0.9))
    progs = programs_of(tm)
    program = progs.algorithms[0]
    assert any(is_training_batch_norm(n) for n in program.model.graph.node)
    on_cpu = execute(program, ALGORITHM, ExecOptions(fused_kernels=False, device="cpu"), check=True)
    assert any(is_training_batch_norm(n) for n in on_cpu.model.graph.node)
    on_cuda = execute(program, ALGORITHM, ExecOptions(fused_kernels=False, device="cuda"), check=True)
    assert not any(is_training_batch_norm(n) for n in on_cuda.model.graph.node)
    assert any(is_training_batch_norm(n) for n in program.model.graph.node)  # the standard program stays
    rng = np.random.default_rng(0)
    feeds = {"X": rng.standard_normal((16, 6)).astype(np.float32), "T": rng.standard_normal((16, 3)).astype(np.float32)}
    feeds.update({t.name: numpy_helper.to_array(t) for t in tm.graph.initializer})
    feeds.update({t.name: numpy_helper.to_array(t) for i in tm.training_info for t in i.initialization.initializer})
    for i in program.model.graph.input:  # optimizer state not seeded by an initializer starts at zero
        if i.name not in feeds:
            dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
            feeds[i.name] = np.zeros(dims, helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
    want, got = run(program.model, feeds), run(on_cuda.model, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
    loss = program.returned[0]
    evaluate = progs.loss(0, loss)
    ex = execute(evaluate, EVALUATE, ExecOptions(fused_kernels=False, device="cuda"), check=True)
    assert not any(is_training_batch_norm(n) for n in ex.model.graph.node)
