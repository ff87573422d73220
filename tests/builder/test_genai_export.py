"""onnxtrain.genai.export: LoRA/QLoRA-trained genai models served by onnxruntime-genai.

Oracles: greedy decoding with ``sess.run`` on the trained session (genai's
greedy generation from the exported folder must equal it, in both modes and
both precisions), the base folder's files and nodes (kept byte for byte),
the adapter file read back with ``onnxruntime.AdapterFormat``."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from genai_cases import FOLDERS, PHRASE, PROMPT, feeds, greedy, og_greedy, og_logits, phrase_batch, training_session
from onnx import numpy_helper

from onnxtrain import genai
from onnxtrain.build import lora as lora_mod

pytest.importorskip("onnxruntime_genai")  # the genai extra (the test extra installs it)

STEPS = 25


@pytest.fixture(scope="module", params=["fp32", "int4"])
def trained(request):
    """(precision, session trained to continue PROMPT with PHRASE, base generation)."""
    precision = request.param
    sess = training_session(precision)
    before = greedy(sess, PROMPT, len(PHRASE))
    batch = phrase_batch()
    for _ in range(STEPS):
        sess.train_step(batch)
    return precision, sess, before


def test_training_memorizes_the_phrase(trained):
    precision, sess, before = trained
    after = greedy(sess, PROMPT, len(PHRASE))
    assert after == PROMPT + PHRASE
    assert before != after
    # The base model's generation is genai's on the base folder.
    assert og_greedy(FOLDERS[precision], PROMPT, len(PHRASE)) == before


@pytest.mark.parametrize("mode", ["merged", "separate"])
def test_genai_generation_equals_session_greedy(trained, mode, tmp_path):
    precision, sess, before = trained
    out = genai.export(sess, tmp_path / "m", base=FOLDERS[precision], adapters=mode)
    expected = greedy(sess, PROMPT, len(PHRASE))
    adapter = out / "adapter.onnx_adapter" if mode == "separate" else None
    assert og_greedy(out, PROMPT, len(PHRASE), adapter=adapter) == expected
    prompt = PROMPT + PHRASE[:3]
    ours = sess.run(feeds(np.array([prompt])))["logits"][0, -1]
    np.testing.assert_allclose(og_logits(out, prompt, adapter), ours, rtol=1e-4, atol=1e-4)
    if mode == "separate":  # no adapter loaded: the base model
        assert og_greedy(out, PROMPT, len(PHRASE)) == before
    else:
        assert not (out / "adapter.onnx_adapter").exists()


def test_exported_folder_keeps_the_builders_graph(trained, tmp_path):
    precision, sess, _ = trained
    base = FOLDERS[precision]
    out = genai.export(sess, tmp_path / "m", base=base, adapters="merged")
    for name in ("genai_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes()
    src, got = onnx.load(str(base / "model.onnx")), onnx.load(str(out / "model.onnx"))
    assert [i.SerializeToString() for i in got.graph.input] == [
        i.SerializeToString() for i in src.graph.input]
    assert [o.name for o in got.graph.output] == [o.name for o in src.graph.output]
    nodes = {n.name: n.SerializeToString() for n in got.graph.node}
    inits = {t.name: numpy_helper.to_array(t) for t in got.graph.initializer}
    info = lora_mod.info_of(sess.model)
    for n in src.graph.node:
        if precision == "fp32":  # merged weights: every node as it was, none added
            assert nodes[n.name] == n.SerializeToString(), n.name
        elif n.op_type != "MatMulNBits":  # side branches: MatMulNBits outputs renamed
            assert nodes[n.name] == n.SerializeToString(), n.name
    ops = [n.op_type for n in got.graph.node]
    assert ops.count("GroupQueryAttention") == 2
    if precision == "fp32":
        assert len(got.graph.node) == len(src.graph.node)
        e = info["targets"][0]
        w = numpy_helper.to_array(next(t for t in src.graph.initializer if t.name == e["weight"]))
        st = sess.state
        np.testing.assert_allclose(
            inits[e["weight"]], w + e["scale"] * st[e["A"]].astype(np.float64) @ st[e["B"]], atol=1e-6)
    else:  # codes and scales bit for bit, the exact side branch added
        for t in src.graph.initializer:
            assert np.array_equal(inits[t.name], numpy_helper.to_array(t)), t.name
        assert ops.count("MatMulNBits") == 11 and ops.count("MatMul") == 2 * len(info["targets"])


def test_separate_adapters_follow_olives_names(trained, tmp_path):
    precision, sess, _ = trained
    out = genai.export(sess, tmp_path / "m", base=FOLDERS[precision], adapters="separate",
                       name="phrase")
    model = onnx.load(str(out / "model.onnx"))
    info = lora_mod.info_of(sess.model)
    packed = [e for e in info["targets"] if "qkv_proj" in e["weight"]][0]
    assert packed["out"] == 128  # q (4 heads) + k + v (2 heads each), 16 wide: one matrix
    params = ort.AdapterFormat.read_adapter(str(out / "phrase.onnx_adapter")).get_parameters()
    inputs = {i.name: i for i in model.graph.input}
    inits = {t.name: t for t in model.graph.initializer}
    expected = set()
    for e in info["targets"]:
        prefix = genai.slot_prefix(e["weight"])
        assert "MatMul" not in prefix and not prefix.endswith("_Q4")
        a, b = f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"
        expected |= {a, b}
        assert list(inits[a].dims) == [e["in"], 0] and list(inits[b].dims) == [0, e["out"]]
        assert a in inputs and b in inputs
        np.testing.assert_array_equal(params[a].numpy(), sess.state[e["A"]])
        np.testing.assert_allclose(params[b].numpy(), e["scale"] * sess.state[e["B"]], rtol=1e-6)
        assert params[b].numpy().dtype == np.float32
    assert "model.layers.0.attn.qkv_proj.lora_A.weight" in expected
    assert set(params) == expected
    assert not any(p.key.startswith("onnxtrain") for p in model.metadata_props)


def test_export_errors(trained, tmp_path):
    precision, sess, _ = trained
    base = FOLDERS[precision]
    with pytest.raises(ValueError, match="adapters must be one of"):
        genai.export(sess, tmp_path / "m", base=base, adapters="both")
    with pytest.raises(FileNotFoundError, match="genai_config.json"):
        genai.export(sess, tmp_path / "m", base=tmp_path)
    with pytest.raises(ValueError, match="folder must differ from base"):
        genai.export(sess, base, base=base)
    other = FOLDERS["int4" if precision == "fp32" else "fp32"]
    with pytest.raises(ValueError, match="must be built from the base folder's own .*model.onnx"):
        genai.export(sess, tmp_path / "m", base=other)
    with pytest.raises(TypeError, match="TrainingSession"):
        genai.export(object(), tmp_path / "m", base=base)
    assert json.loads((base / "genai_config.json").read_text())["model"]["type"] == "llama"


# ------------------------------------------------ a session built from another export
LLAMA_EXPORT = FOLDERS["fp32"].parents[1] / "llm" / "llama__dynamo.onnx"


def test_training_model_records_the_file_it_was_built_from(tmp_path):
    from onnxtrain import TrainingSession, build
    from onnxtrain.io.metadata import model_metadata

    tm = build.training_model(str(FOLDERS["fp32"] / "model.onnx"), lora=build.LoRA(rank=2))
    assert model_metadata(tm)["source"] == str((FOLDERS["fp32"] / "model.onnx").resolve())
    # A checkpoint keeps it: a resumed session exports to genai as the first one did.
    sess = TrainingSession(tm)
    sess.export(tmp_path / "ckpt.onnx", training=True)
    resumed = TrainingSession(tmp_path / "ckpt.onnx")
    assert model_metadata(resumed.model)["source"] == model_metadata(tm)["source"]
    assert genai.export(resumed, tmp_path / "served", base=FOLDERS["fp32"]).is_dir()
    # An inference export does not carry it (the path of the machine it was built on).
    sess.export(tmp_path / "inference.onnx")
    assert "source" not in model_metadata(onnx.load(str(tmp_path / "inference.onnx")))
    # A model given in memory has no file to record.
    assert "source" not in model_metadata(build.training_model(onnx.load(str(LLAMA_EXPORT))))


@pytest.mark.parametrize("given", ["path", "proto"])
def test_a_session_built_from_another_export_is_told_in_one_line(tmp_path, given):
    """Issue 34, item 3: an HF export of the same network names its weights
    otherwise (val_41, ...): one line naming the base's model.onnx and the file
    the session was built from, and nothing written."""
    from onnxtrain import TrainingSession, build

    source = str(LLAMA_EXPORT) if given == "path" else onnx.load(str(LLAMA_EXPORT))
    sess = TrainingSession(build.training_model(source, lora=build.LoRA(rank=2)))
    with pytest.raises(ValueError) as info:
        genai.export(sess, tmp_path / "served", base=FOLDERS["fp32"])
    message = str(info.value)
    assert "\n" not in message
    assert f"the base folder's own {FOLDERS['fp32'] / 'model.onnx'}" in message
    built_from = str(LLAMA_EXPORT.resolve()) if given == "path" else "a model in memory"
    assert f"not from {built_from}" in message
    assert "'val_41'" in message and "build.training_model(" in message
    assert not (tmp_path / "served").exists()
