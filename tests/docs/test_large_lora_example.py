"""examples/decoder_lm.py (the streamed, page-aligned model generator) and
examples/finetune_large_lora.py (LoRA fine-tuning of it) on small configurations.

The example's command line also runs in test_examples_notebooks.py (``--quick``);
here it runs in-process so that its numbers can be checked."""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import decoder_lm  # noqa: E402

TINY = decoder_lm.DecoderConfig(vocab=64, d_model=32, layers=2, heads=2, ffn=64, max_seq=16, seed=3)


def external_fields(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def test_generator_writes_page_aligned_external_data(tmp_path):
    info = decoder_lm.write_decoder_lm(tmp_path / "lm.onnx", TINY)
    assert info["parameters"] == TINY.parameters
    proto = onnx.load(tmp_path / "lm.onnx", load_external_data=False)
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert {t.name for t in external} >= {"tok_emb", "lm_head", "h0.attn.q", "h1.mlp.fc2"}
    end = 0
    for t in external:
        f = external_fields(t)
        assert f["location"] == "lm.onnx.data" and not t.raw_data
        offset, length = int(f["offset"]), int(f["length"])
        assert offset % decoder_lm.ALIGN == 0 and offset >= end, t.name
        assert length == 4 * math.prod(t.dims)
        end = offset + length
    assert end == (tmp_path / "lm.onnx.data").stat().st_size == info["data_bytes"]
    onnx.checker.check_model(str(tmp_path / "lm.onnx"))
    # the values in the file are the generator's, tensor by tensor
    loaded = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(tmp_path)) for t in proto.graph.initializer}
    for name, shape in TINY.weight_shapes():
        np.testing.assert_array_equal(loaded[name], decoder_lm.weight(TINY, name), err_msg=name)


def test_generator_streams_in_chunks(monkeypatch):
    whole = decoder_lm.weight(TINY, "h0.mlp.fc1")  # [32, 64], one chunk
    monkeypatch.setattr(decoder_lm, "CHUNK", 500)
    chunks = list(decoder_lm._fill("h0.mlp.fc1", (32, 64), TINY))
    assert [c.size for c in chunks] == [500, 500, 500, 500, 48]
    np.testing.assert_array_equal(np.concatenate(chunks).reshape(32, 64), whole)  # chunking changes no value


def test_large_config_is_over_a_billion_parameters():
    cfg = decoder_lm.CONFIGS["1b"]
    assert cfg.parameters >= 1_000_000_000 and 4 * cfg.parameters > 2 * 2**30
    assert decoder_lm.CONFIGS["small"].parameters < 10_000_000


def reference_logits(cfg, ids: np.ndarray) -> np.ndarray:
    """The model's forward pass in numpy (float64)."""
    w = {n: decoder_lm.weight(cfg, n).astype(np.float64) for n, _ in cfg.weight_shapes()}
    erf = np.vectorize(math.erf)

    def norm(x, p):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(v + 1e-5) * w[p + ".weight"] + w[p + ".bias"]

    b, t = ids.shape
    h, dh = cfg.heads, cfg.head_dim
    x = w["tok_emb"][ids] + w["pos_emb"][:t]
    for i in range(cfg.layers):
        p = f"h{i}."
        n = norm(x, p + "ln1")
        q, k, v = (
            (n @ w[p + "attn." + c]).reshape(b, t, h, dh).transpose(0, 2, 1, 3) for c in "qkv"
        )
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh) + np.triu(np.full((t, t), -1e9), 1)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + (s @ v).transpose(0, 2, 1, 3).reshape(b, t, -1) @ w[p + "attn.o"]
        u = norm(x, p + "ln2") @ w[p + "mlp.fc1"]
        x = x + (0.5 * u * (1 + erf(u / math.sqrt(2)))) @ w[p + "mlp.fc2"]
    return norm(x, "ln_f") @ w["lm_head"]


def test_generated_model_computes_a_causal_decoder(tmp_path):
    decoder_lm.write_decoder_lm(tmp_path / "lm.onnx", TINY)
    sess = ort.InferenceSession(str(tmp_path / "lm.onnx"), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, TINY.vocab, (2, 11))
    got = sess.run(["logits"], {"input_ids": ids})[0]
    np.testing.assert_allclose(got, reference_logits(TINY, ids), rtol=1e-4, atol=1e-4)
    # causal: changing the last token changes no earlier position
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % TINY.vocab
    again = sess.run(["logits"], {"input_ids": changed})[0]
    np.testing.assert_allclose(again[:, :-1], got[:, :-1], rtol=1e-5, atol=1e-5)


def test_finetune_example_small(capsys):
    import finetune_large_lora

    t0 = time.perf_counter()
    assert finetune_large_lora.main(["--quick", "--no-progress"]) == 0
    seconds = time.perf_counter() - t0
    out = capsys.readouterr().out
    before, after = map(float, re.search(r"loss on the pattern: (\S+) before -> (\S+) after", out).groups())
    assert before > 0.9 * math.log(decoder_lm.CONFIGS["small"].vocab)  # chance level at the start
    assert after < 0.25 * before, out
    diff = float(re.search(r"max \|logit difference\| (\S+)\)", out).group(1))
    assert diff < 1e-3, out
    assert re.search(r"\d+\.\d+ s/step", out) and "peak RSS:" in out
    assert seconds < 60, f"the quick run took {seconds:.0f} s"


def test_pattern_data_is_next_token():
    import finetune_large_lora

    x, y = finetune_large_lora.pattern_data(vocab=100, rows=5, seq=20, period=7, seed=0)
    assert x.shape == y.shape == (5, 20) and x.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    nxt = dict(zip(x.ravel(), y.ravel()))
    assert len(nxt) == 7 and all(nxt[a] == b for a, b in zip(x.ravel(), y.ravel()))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
