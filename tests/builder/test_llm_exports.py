"""Tiny transformers as people export them, trained with the builder's defaults
and checked against PyTorch (references recorded by scripts/make_llm_corpus.py
in tests/data/llm/; these tests need no torch).

Families: Llama, Qwen2, ViT, DistilBERT, Whisper's encoder, T5's encoder;
exporters: dynamo at opset 20 and 23, TorchScript (T5: TorchScript only).
Models ``<family>_b`` are a held-out set (MQA, biases, two layers,
sinusoidal positions, gated feed-forward), generated once after the code was
written against the first set, and checked by the same tests.
The language models get a left-padded batch with an attention mask, so
causal attention has query rows that see no key (NaN rows before the
exporters' Where): every gradient must still be finite and equal PyTorch's.

- the default trainable set (``trainable=None``) is exactly PyTorch's
  ``requires_grad`` parameters found in the export: RoPE tables, sinusoidal
  tables, attention masks and batch-broadcast copies stay frozen, with their
  reasons in ``build.parameter_choices``;
- every weight is known by its PyTorch name (``known_as``), LoRA targets and
  ``trainable=`` entries select by it, ``targets=None`` leaves the LM head out;
- gradients at the start, the loss after one SGD step, and LoRA's first
  gradients (``dB = s Aᵀ dW``, dA = 0 with B = 0) match PyTorch's;
- the export after one step, run by plain onnxruntime, gives PyTorch's loss
  after that step; after one LoRA step the merged weights are
  ``W - lr s² A Aᵀ dW`` with PyTorch's dW.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxtrain
from onnxtrain import build

DATA = Path(__file__).resolve().parents[1] / "data" / "llm"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
CASES = {c["file"][:-5]: c for c in MANIFEST["cases"]}
LR = MANIFEST["sgd_lr"]
#: PyTorch's attention projections per family (peft's usual LoRA targets).
QV = {"llama": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"], "vit": ["q_proj", "v_proj"],
      "distilbert": ["q_lin", "v_lin"], "whisper_encoder": ["q_proj", "v_proj"], "t5_encoder": ["q", "v"]}


def load(stem: str) -> tuple[dict, onnx.ModelProto, dict[str, np.ndarray]]:
    case = CASES[stem]
    with np.load(DATA / f"{stem}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return case, onnx.load(str(DATA / case["file"])), arrays


def feeds_of(arrays, tm):
    feeds = {k[6:]: v for k, v in arrays.items() if k.startswith("input/")}
    meta = {p.key: p.value for p in tm.metadata_props}
    feeds[json.loads(meta["onnxtrain.target"])] = arrays["target"]
    return feeds, meta


def expose_gradients(tm: onnx.ModelProto) -> dict[str, str]:
    """Make every Gradient output an algorithm output; param -> its gradient."""
    algo = tm.training_info[0].algorithm
    types = {v.name: v for v in algo.value_info}
    for node in algo.node:
        if node.op_type == "Gradient":
            for out in node.output:
                algo.output.append(types[out])
            xs = next(a for a in node.attribute if a.name == "xs").strings
            return {x.decode(): g for x, g in zip(xs, node.output)}
    raise AssertionError("no Gradient node")


@functools.lru_cache(maxsize=None)
def first_steps(stem: str, lora: bool = False):
    """(training model, metadata, step 1 outputs, loss after it) with SGD(lr)."""
    case, model, arrays = load(stem)
    tm = build.training_model(model, loss=case["loss"], optimizer=build.SGD(lr=LR),
                              lora=build.LoRA(rank=2, alpha=4.0) if lora else None)
    grads = expose_gradients(tm)
    sess = onnxtrain.TrainingSession(tm)
    sess.initialize()
    feeds, meta = feeds_of(arrays, tm)
    loss_name = json.loads(meta["onnxtrain.loss"])
    step1 = sess.train_step(feeds)
    step2 = sess.train_step(feeds)  # its loss is the loss after one step
    return tm, meta, grads, step1, float(step1[loss_name]), float(step2[loss_name])


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-12))


@pytest.mark.parametrize("stem", sorted(CASES))
def test_default_trainable_set_is_pytorchs(stem):
    case, model, _ = load(stem)
    choices = build.parameter_choices(model)
    trained = {c.name for c in choices if c.trainable}
    assert trained == set(case["parameters"]), (
        f"extra {sorted(trained - set(case['parameters']))}, missing {sorted(set(case['parameters']) - trained)}")
    frozen = {c.name: c.reason for c in choices if not c.trainable and len(
        next(t for t in model.graph.initializer if t.name == c.name).dims) > 0}
    assert set(frozen.values()) <= {"positional", "mask", "broadcast", "shape"}, frozen


EXPECTED_CONSTANTS = {  # stem -> reasons of its non-scalar constants (what the exporter folded)
    "llama__dynamo": ["positional", "positional"], "llama__dynamo23": ["positional", "positional"],
    "llama__dynamo_dynamic": ["positional"],  # inv_freq: the tables are computed in the graph
    "qwen2__dynamo": ["positional", "positional"], "qwen2__dynamo23": ["positional", "positional"],
    "vit__dynamo": ["broadcast", "mask"], "vit__dynamo23": ["broadcast"],
    "whisper_encoder__dynamo": ["positional"], "whisper_encoder__dynamo23": ["positional"],
    "whisper_encoder__torchscript": ["positional"],
}


@pytest.mark.parametrize("stem", sorted(EXPECTED_CONSTANTS))
def test_exporter_constants_are_named_with_their_reason(stem):
    case, model, _ = load(stem)
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    constants = [c for c in build.parameter_choices(model) if not c.trainable and dims[c.name]]
    assert sorted(c.reason for c in constants) == EXPECTED_CONSTANTS[stem]
    assert not [c.known_as for c in constants if c.known_as]  # no PyTorch parameter name for a mask
    assert case["frozen"] or stem.startswith(("llama", "qwen2", "vit"))  # Whisper's table is frozen in torch


@pytest.mark.parametrize("stem", sorted(CASES))
def test_weights_are_known_by_their_pytorch_names(stem):
    case, model, _ = load(stem)
    known = {c.name: c.known_as or c.name for c in build.parameter_choices(model)}
    checked = 0
    for init, torch_name in case["parameters"].items():
        if "(rows:" in torch_name:
            continue  # a position table cut to the traced length: no record names it
        assert known[init] == torch_name.split(" ")[0], init
        checked += 1
    assert checked >= len(case["parameters"]) - 1


@pytest.mark.parametrize("stem", sorted(CASES))
def test_lora_targets_and_trainable_by_module_name(stem):
    case, model, _ = load(stem)
    family = case["family"]
    choices = {c.name: c for c in build.parameter_choices(model)}
    tm = build.training_model(model, loss=case["loss"], lora=build.LoRA(rank=2, targets=QV[family]))
    meta = {p.key: json.loads(p.value) for p in tm.metadata_props if p.key == "onnxtrain.lora"}
    got = sorted(choices[e["weight"]].known_as or e["weight"] for e in meta["onnxtrain.lora"]["targets"])
    modules = [g.rsplit(".", 2)[-2] for g in got]
    assert got and all(g.endswith(".weight") for g in got), got
    assert sorted(set(modules)) == QV[family] and modules.count(QV[family][0]) == modules.count(QV[family][1])
    layers = set()
    for word in (".block.", ".layers.", ".layer."):  # T5's blocks hold sub-"layer"s
        layers = layers or {n.split(word)[1].split(".")[0] for n in case["requires_grad"] if word in n}
    assert len(got) == 2 * len(layers), (got, layers)
    # trainable= by a module name: that module's parameters only
    tm = build.training_model(model, loss=case["loss"], trainable=[QV[family][0]])
    names = json.loads(next(p.value for p in tm.metadata_props if p.key == "onnxtrain.trainable"))
    assert names and all((choices[n].known_as or n).rsplit(".", 2)[-2] == QV[family][0] for n in names)


LMS = sorted(s for s in CASES if CASES[s]["family"] in ("llama", "qwen2"))


@pytest.mark.parametrize("stem", LMS)
def test_default_lora_targets_leave_the_lm_head_out(stem):
    _, model, _ = load(stem)
    choices = build.parameter_choices(model)
    heads = [c for c in choices if c.lora == "head"]
    targets = [c for c in choices if c.lora == "target"]
    assert len(heads) == 1 and (heads[0].known_as or heads[0].name).endswith("lm_head.weight")
    kinds = [(c.known_as or c.name).rsplit(".", 2)[-2] for c in targets]
    projections = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert sorted(set(kinds)) == projections and len(kinds) == 7 * kinds.count("q_proj")
    tm = build.training_model(model, loss="cross_entropy", lora=build.LoRA(rank=2))
    lora = json.loads(next(p.value for p in tm.metadata_props if p.key == "onnxtrain.lora"))
    assert sorted(e["weight"] for e in lora["targets"]) == sorted(c.name for c in targets)


@pytest.mark.parametrize("stem", sorted(CASES))
def test_gradients_and_sgd_step_match_pytorch(stem):
    case, _, arrays = load(stem)
    tm, meta, grads, step1, loss0, loss1 = first_steps(stem)
    assert set(json.loads(meta["onnxtrain.trainable"])) == set(case["parameters"])
    np.testing.assert_allclose(loss0, arrays["loss"], rtol=1e-5)
    for name in case["parameters"]:
        got, want = step1[grads[name]], arrays[f"grad/{name}"]
        assert np.isfinite(got).all(), name
        err = np.linalg.norm(np.asarray(got, np.float64) - want)
        # float32 precision; an absolute floor for gradients that are zero in exact
        # arithmetic (attention key biases: softmax ignores a per-row shift)
        assert err <= 1e-4 * np.linalg.norm(want) + 1e-6, f"{name}: relative error {rel(got, want):.2e}"
    np.testing.assert_allclose(loss1, arrays["loss_sgd1"], rtol=1e-5)


@pytest.mark.parametrize("stem", sorted(CASES))
def test_lora_first_gradients_match_pytorch(stem):
    """With B = 0: dA = 0 and dB = s Aᵀ dW, dW PyTorch's gradient of the base
    weight in [in, out] layout."""
    case, _, arrays = load(stem)
    tm, meta, grads, step1, loss0, _ = first_steps(stem, lora=True)
    np.testing.assert_allclose(loss0, arrays["loss"], rtol=1e-5)
    start = {t.name: onnx.numpy_helper.to_array(t) for t in tm.graph.initializer}
    info = json.loads(meta["onnxtrain.lora"])
    assert info["targets"]
    for e in info["targets"]:
        a, b = start[e["A"]].astype(np.float64), start[e["B"]]
        assert not b.any()
        dw = arrays[f"grad/{e['weight']}"].astype(np.float64)
        dw = dw.T if e["transposed"] else dw
        want = e["scale"] * a.T @ dw
        got = step1[grads[e["B"]]]
        assert np.isfinite(got).all() and not step1[grads[e["A"]]].any()
        assert rel(got, want) <= 1e-4, f"{e['weight']}: dB relative error {rel(got, want):.2e}"


def test_names_in_errors_and_predicates():
    """An unknown entry lists the known names; a predicate sees them too."""
    _, model, _ = load("llama__dynamo")
    with pytest.raises(ValueError, match=r"unknown name 'qq_proj'.*self_attn\.q_proj\.weight"):
        build.training_model(model, loss="cross_entropy", lora=build.LoRA(targets=["qq_proj"]))
    with pytest.raises(ValueError, match=r"unknown trainable name 'qq_proj'.*q_proj\.weight"):
        build.training_model(model, loss="cross_entropy", trainable=["qq_proj"])
    tm = build.training_model(model, loss="cross_entropy",
                              lora=build.LoRA(targets=lambda n: n.endswith("o_proj.weight")))
    lora = json.loads(next(p.value for p in tm.metadata_props if p.key == "onnxtrain.lora"))
    known = {c.name: c.known_as for c in build.parameter_choices(model)}
    assert [known[e["weight"]] for e in lora["targets"]] == ["model.model.layers.0.self_attn.o_proj.weight"]


def numpy_loss(out: np.ndarray, target: np.ndarray, case: dict) -> float:
    """The case's loss in float64 numpy (cross-entropy with ignore_index -100, or mse)."""
    out = out.astype(np.float64)
    if case["loss"] == "mse":
        return float(np.mean((out - target) ** 2))
    logits = out.reshape(-1, out.shape[-1]) if case["class_axis"] == -1 else out
    labels = target.reshape(-1)
    keep = labels != -100
    z = logits[keep] - logits[keep].max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return float(-logp[np.arange(keep.sum()), labels[keep]].mean())


def one_step_export(stem: str, tmp_path: Path, lora: bool):
    """(session after one SGD step, its export loaded in plain onnxruntime, feeds, training model)."""
    import onnxruntime as ort

    case, model, arrays = load(stem)
    tm = build.training_model(model, loss=case["loss"], optimizer=build.SGD(lr=LR),
                              lora=build.LoRA(rank=2, alpha=4.0) if lora else None)
    sess = onnxtrain.TrainingSession(tm)
    sess.initialize()
    feeds, _ = feeds_of(arrays, tm)
    sess.train_step(feeds)
    path = tmp_path / f"{stem}.onnx"
    sess.export(str(path))
    inputs = {k[6:]: v for k, v in arrays.items() if k.startswith("input/")}
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return case, arrays, plain.run(None, inputs)[0], tm, path


@pytest.mark.parametrize("stem", sorted(CASES))
def test_exported_model_after_one_step_gives_pytorchs_loss(stem, tmp_path):
    """The exported model after one SGD step, run by plain onnxruntime, gives the
    loss PyTorch's model has after the same step."""
    case, arrays, out, _, _ = one_step_export(stem, tmp_path, lora=False)
    np.testing.assert_allclose(numpy_loss(out, arrays["target"], case), arrays["loss_sgd1"], rtol=1e-5)


@pytest.mark.parametrize("stem", LMS)
def test_lora_step_merged_into_the_export_matches_pytorch(stem, tmp_path):
    """One LoRA SGD step from B = 0 moves B by -lr s Aᵀ dW and leaves A; the
    merged export holds W + s A B = W - lr s² A Aᵀ dW (in [in, out] layout),
    dW being PyTorch's gradient."""
    case, arrays, out, tm, path = one_step_export(stem, tmp_path, lora=True)
    assert np.isfinite(out).all()
    start = {t.name: onnx.numpy_helper.to_array(t) for t in tm.graph.initializer}
    merged = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    info = json.loads(next(p.value for p in tm.metadata_props if p.key == "onnxtrain.lora"))
    for e in info["targets"]:
        a = start[e["A"]].astype(np.float64)
        dw = arrays[f"grad/{e['weight']}"].astype(np.float64)
        delta = -LR * e["scale"] ** 2 * a @ a.T @ (dw.T if e["transposed"] else dw)
        want = start[e["weight"]] + (delta.T if e["transposed"] else delta)
        # float32 holds W + delta to W's rounding: the tolerance allows that much
        ulp = np.finfo(np.float32).eps * np.abs(start[e["weight"]]).max()
        assert np.abs(delta).max() > 100 * ulp, e["weight"]  # the step is well above rounding
        np.testing.assert_allclose(merged[e["weight"]], want, rtol=0,
                                   atol=1e-4 * np.abs(delta).max() + 2 * ulp, err_msg=e["weight"])


def test_cli_inspect_shows_the_known_names(capsys):
    from onnxtrain.cli import main

    assert main(["inspect", str(DATA / "llama__dynamo.onnx")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("val_41 "))
    assert "known as" in out and row.split()[-1] == "model.model.layers.0.self_attn.q_proj.weight"
    assert any(line.split()[:1] == ["unsqueeze_14"] and "positional" in line for line in out.splitlines())
