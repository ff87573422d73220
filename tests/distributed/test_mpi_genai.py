"""LoRA and QLoRA on an onnxruntime-genai model under ``comm=`` with 2 MPI
ranks equal one process on the global batch (the tiny genai Llamas of
tests/data/genai_serve, fp32 and int4).  Skipped only where mpi4py is missing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytest.importorskip("mpi4py")

from genai_cases import FOLDERS, feeds  # noqa: E402
from test_mpi import run_worker, state_of  # noqa: E402

import onnxtrain  # noqa: E402
from onnxtrain import build  # noqa: E402


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_genai_lora_on_two_ranks_equals_one_process(tmp_path, precision):
    model = onnx.load(str(FOLDERS[precision] / "model.onnx"))
    tm = build.training_model(model, loss="cross_entropy", optimizer=build.SGD(lr=0.5),
                              lora=build.LoRA(rank=4, alpha=8))
    onnx.save(tm, tmp_path / "model.onnx")
    rng = np.random.default_rng(7)
    rows, arrays, bounds = [(2, 2), (3, 1), (2, 2)], {}, []
    steps = []
    for k, (a, b) in enumerate(rows):
        seq = rng.integers(2, 300, (a + b, 9))
        batch = feeds(seq[:, :-1])
        batch["target"] = seq[:, 1:]
        steps.append(batch)
        arrays.update({f"{k}/{name}": v for name, v in batch.items()})
        bounds.append((0, a, a + b))
    np.savez(tmp_path / "feeds.npz", bounds=np.array(bounds), **arrays)
    r0, r1 = run_worker("feed_steps", tmp_path)
    s0, s1 = state_of(r0), state_of(r1)
    ref = onnxtrain.TrainingSession(tm)
    losses = [float(ref.train_step(b)["loss"]) for b in steps]
    assert sorted(s0) == sorted(ref.state) and any(".lora_B" in k for k in s0)
    for k, v in ref.state.items():
        assert np.array_equal(s0[k], s1[k]), k
        np.testing.assert_allclose(s0[k], v, rtol=1e-4, atol=2e-6 * (np.abs(v).max() or 1.0), err_msg=k)
    codes = "_Q4" if precision == "int4" else ""
    assert np.abs(ref.state[f"model.layers.0.attn.qkv_proj.MatMul.weight{codes}.lora_B"]).max() > 1e-4
    for (a, b, c), l0, l1, lg in zip(bounds, r0["losses"], r1["losses"], losses):
        assert abs(((b - a) * l0 + (c - b) * l1) / (c - a) - lg) <= 1e-5 * max(1.0, abs(lg))
