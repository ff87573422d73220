"""Regenerate tests/data/genai/: a tiny Llama and a tiny Gemma-2 built by the
onnxruntime-genai model builder (fp32 and int4) and PyTorch's loss, gradients
and one SGD step on the same weights.

Requirements: torch, transformers, tokenizers and onnxruntime-genai (0.18);
no network (random weights from a small config, a BPE tokenizer trained on
one sentence)::

    python scripts/make_genai_fixtures.py

For each family F (llama, gemma2) and precision P (fp32, int4),
``tests/data/genai/F_P/`` holds the builder's ``model.onnx``,
``model.onnx.data`` and ``genai_config.json``, and ``tests/data/genai/F_P.npz``
holds:

- ``input_ids``, ``attention_mask`` (Llama [2, 6], the second row
  right-padded by 2; Gemma-2 [2, 8], no padding: its windowed KV cache takes
  none) and ``labels`` (the next token, -100 at padding and at the last position);
- ``loss``: PyTorch's mean cross-entropy over the labelled tokens;
- ``grad/<init>``: its gradients, keyed by the genai model's initializer
  names (the builder's layout: ``X.MatMul.weight`` is the transposed Linear
  weight, ``qkv_proj`` packs q, k and v along its columns);
- ``sgd/<init>``: the parameters after one ``torch.optim.SGD(lr=LR)`` step.

fp32: the parameters are every float initializer but the rotary caches.
int4: the genai weights are the MatMulNBits codes; PyTorch runs the same
model with each Linear weight dequantized, W = (q - 8) * scale blockwise,
and the parameters are the float ``..._scales`` (W is a function of them),
the norms and (Llama) the float embedding; Gemma-2's tied embedding is the
LM head's dequantized codes (GatherBlockQuantized in the genai graph).
PyTorch runs in float64; the references are stored as float32 values.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
import transformers
from onnx import numpy_helper

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "genai"
LR = 0.5
CONFIG = dict(vocab_size=72, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6)


def save_tokenizer(folder: Path, vocab: int = 90) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(folder)


def build(hf: Path, precision: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", tmp,
               "-p", precision, "-e", "cpu", "-c", str(Path(tmp) / "cache")]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
            shutil.copy(Path(tmp) / name, out / name)


def unpack4(b: np.ndarray, n: int, k: int) -> np.ndarray:
    """MatMulNBits 4-bit codes [N, blocks, blob] -> [N, blocks, block] (low nibble first)."""
    low, high = b & 0x0F, b >> 4
    return np.stack([low, high], -1).reshape(n, b.shape[1], -1).astype(np.float64)


def genai_weights(model: transformers.PreTrainedModel, p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The genai initializer layout of the torch tensors ``p`` (parameters or their gradients)."""
    out = {"model.embed_tokens.weight": p["model.embed_tokens.weight"],
           "model.layers.1.final_norm_layernorm.weight": p["model.norm.weight"],
           "lm_head.MatMul.weight": p["lm_head.weight"].T}
    for i in range(model.config.num_hidden_layers):
        pre = f"model.layers.{i}"
        out[f"{pre}.input_layernorm.weight"] = p[f"{pre}.input_layernorm.weight"]
        out[f"{pre}.post_attention_layernorm.weight"] = p[f"{pre}.post_attention_layernorm.weight"]
        qkv = [p[f"{pre}.self_attn.{x}_proj.weight"] for x in "qkv"]
        out[f"{pre}.attn.qkv_proj.MatMul.weight"] = torch.cat(qkv, 0).T
        out[f"{pre}.attn.o_proj.MatMul.weight"] = p[f"{pre}.self_attn.o_proj.weight"].T
        for m in ("gate", "up", "down"):
            out[f"{pre}.mlp.{m}_proj.MatMul.weight"] = p[f"{pre}.mlp.{m}_proj.weight"].T
    return out


def batch(vocab: int, padded: bool = True, length: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, size=(2, length)).astype(np.int64)
    mask = np.ones((2, length), dtype=np.int64)
    if padded:
        mask[1, -2:] = 0
    labels = np.full_like(ids, -100)
    labels[:, :-1] = np.where(mask[:, 1:] == 1, ids[:, 1:], -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_of(model, data) -> torch.Tensor:
    logits = model(input_ids=torch.tensor(data["input_ids"]),
                   attention_mask=torch.tensor(data["attention_mask"])).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.tensor(data["labels"]).reshape(-1), ignore_index=-100)


def fp32_reference(model, data) -> dict[str, np.ndarray]:
    model = model.double()
    loss = loss_of(model, data)
    loss.backward()
    out = {"loss": np.float32(loss.item())}
    grads = {name: t.grad for name, t in model.named_parameters()}
    for name, t in genai_weights(model, grads).items():
        out[f"grad/{name}"] = t.numpy().astype(np.float32)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.step()
    for name, t in genai_weights(model, dict(model.named_parameters())).items():
        out[f"sgd/{name}"] = t.detach().numpy().astype(np.float32)
    return out


def int4_reference(model, folder: Path, data) -> dict[str, np.ndarray]:
    """PyTorch on the dequantized int4 weights; parameters: scales, norms, embedding."""
    proto = onnx.load(str(folder / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    model = model.double()
    params: dict[str, torch.Tensor] = {}
    codes: dict[str, tuple] = {}
    for node in proto.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["bits"] == 4 and len(node.input) == 3, "default zero point 8 expected"
        k, n = attrs["K"], attrs["N"]
        q = unpack4(inits[node.input[1]], n, k)
        params[node.input[2]] = torch.tensor(inits[node.input[2]].astype(np.float64), requires_grad=True)
        codes[node.input[2]] = (torch.tensor(q - 8.0), n, k)
    for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.post_attention_layernorm.weight", "model.layers.1.final_norm_layernorm.weight"):
        params[name] = torch.tensor(inits[name].astype(np.float64), requires_grad=True)

    def weight(scales: str) -> torch.Tensor:  # [N, K], Linear's layout
        u, n, k = codes[scales]
        return (u * params[scales].reshape(n, -1, 1)).reshape(n, -1)[:, :k]

    def torch_params() -> dict[str, torch.Tensor]:
        pre = "model.layers.0"
        qkv = weight(f"{pre}.attn.qkv_proj.MatMul.weight_scales")
        h, kv = CONFIG["hidden_size"], CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
        out = {"model.embed_tokens.weight": params["model.embed_tokens.weight"],
               "model.norm.weight": params["model.layers.1.final_norm_layernorm.weight"],
               "lm_head.weight": weight("lm_head.MatMul.weight_scales"),
               f"{pre}.input_layernorm.weight": params[f"{pre}.input_layernorm.weight"],
               f"{pre}.post_attention_layernorm.weight": params[f"{pre}.post_attention_layernorm.weight"],
               f"{pre}.self_attn.q_proj.weight": qkv[:h], f"{pre}.self_attn.k_proj.weight": qkv[h:h + kv],
               f"{pre}.self_attn.v_proj.weight": qkv[h + kv:],
               f"{pre}.self_attn.o_proj.weight": weight(f"{pre}.attn.o_proj.MatMul.weight_scales")}
        for m in ("gate", "up", "down"):
            out[f"{pre}.mlp.{m}_proj.weight"] = weight(f"{pre}.mlp.{m}_proj.MatMul.weight_scales")
        return out

    loss = loss_of(lambda **kw: torch.func.functional_call(model, torch_params(), (), kw), data)
    loss.backward()
    out = {"loss": np.float32(loss.item())}
    for name, t in params.items():
        out[f"grad/{name}"] = t.grad.numpy().astype(np.float32)
    opt = torch.optim.SGD(list(params.values()), lr=LR)
    opt.step()
    for name, t in params.items():
        out[f"sgd/{name}"] = t.detach().numpy().astype(np.float32)
    return out


# ------------------------------------------------------------------ Gemma-2
# Softcapped attention with a sliding window (GroupQueryAttention's softcap,
# local_window_size and sliding_window_cache), the tanh Gelu, tied embeddings
# (fp32: Transpose of the LM head; int4: GatherBlockQuantized on its codes),
# RMSNorm weights stored as 1 + w, a softcapped LM head.  hidden_size 64: the
# builder writes the embedding normalizer sqrt(hidden) rounded to 2 decimals
# (5.66 for 32, 1e-4 away from PyTorch's), exact for 64.  vocab_size must
# differ from hidden_size: with a square tied embedding the builder's LM head
# comes out transposed.
GEMMA2 = dict(vocab_size=72, hidden_size=64, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
              sliding_window=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              query_pre_attn_scalar=16, layer_types=["sliding_attention"])


def gemma2_hf_params(leaves: dict[str, torch.Tensor], weight) -> dict[str, torch.Tensor]:
    """Gemma-2's parameters as functions of the genai leaves; ``weight(stem)``
    is the [out, in] weight of genai module ``stem`` (fp32: the transposed
    MatMul weight; int4: the dequantized MatMulNBits codes)."""
    pre = "model.layers.0"
    h, kv = GEMMA2["num_attention_heads"] * GEMMA2["head_dim"], GEMMA2["num_key_value_heads"] * GEMMA2["head_dim"]
    qkv = weight(f"{pre}.attn.qkv_proj")
    out = {"model.embed_tokens.weight": weight("lm_head"),  # tied: the LM head reads it too
           "model.norm.weight": leaves["model.layers.1.final_norm_layernorm.weight"] - 1,
           f"{pre}.self_attn.q_proj.weight": qkv[:h], f"{pre}.self_attn.k_proj.weight": qkv[h:h + kv],
           f"{pre}.self_attn.v_proj.weight": qkv[h + kv:],
           f"{pre}.self_attn.o_proj.weight": weight(f"{pre}.attn.o_proj")}
    for m in ("gate", "up", "down"):
        out[f"{pre}.mlp.{m}_proj.weight"] = weight(f"{pre}.mlp.{m}_proj")
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        out[f"{pre}.{norm}.weight"] = leaves[f"{pre}.{norm}.weight"] - 1  # genai stores 1 + w
    return out


def gemma2_reference(model, folder: Path, precision: str, data, dtype=torch.float64,
                     check: bool = True) -> dict[str, np.ndarray]:
    """PyTorch's loss, gradients and SGD step with the genai initializers as the
    leaves (their own layout): fp32 every float initializer but the rotary
    caches, int4 the MatMulNBits scales (shared with the embedding's
    GatherBlockQuantized) and the norms."""
    proto = onnx.load(str(folder / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    model = model.to(dtype)
    leaves = {n: torch.tensor(a, dtype=dtype, requires_grad=True) for n, a in inits.items()
              if a.dtype == np.float32 and n not in ("cos_cache", "sin_cache")}
    codes = {}
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["bits"] == 4 and len(node.input) == 3, "default zero point 8 expected"
            stem = node.input[2][: -len(".MatMul.weight_scales")]
            codes[stem] = (torch.tensor(unpack4(inits[node.input[1]], attrs["N"], attrs["K"]) - 8.0, dtype=dtype),
                           attrs["N"], attrs["K"], node.input[2])

    def weight(stem: str) -> torch.Tensor:
        if precision == "fp32":
            return leaves[f"{stem}.MatMul.weight"].T
        u, n, k, scales = codes[stem]
        return (u * leaves[scales].reshape(n, -1, 1)).reshape(n, -1)[:, :k]

    def run(**kw):
        return torch.func.functional_call(model, gemma2_hf_params(leaves, weight), (), kw)

    with torch.no_grad():  # the genai model holds the same weights
        for name, t in gemma2_hf_params(leaves, weight).items():
            if check and (precision == "fp32" or "norm" in name):
                np.testing.assert_allclose(t.numpy(), dict(model.named_parameters())[name].detach().numpy(),
                                           atol=1e-6, err_msg=name)
    loss = loss_of(run, data)
    loss.backward()
    out = {"loss": np.float32(loss.item())}
    for name, t in leaves.items():
        out[f"grad/{name}"] = t.grad.numpy().astype(np.float32)
    torch.optim.SGD(list(leaves.values()), lr=LR).step()
    for name, t in leaves.items():
        out[f"sgd/{name}"] = t.detach().numpy().astype(np.float32)
    return out


def make_gemma2(tmp: Path) -> None:
    torch.manual_seed(1)
    cfg = transformers.Gemma2Config(**GEMMA2, attn_implementation="eager")
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    hf = tmp / "hf_gemma2"
    model.save_pretrained(hf)
    save_tokenizer(hf, vocab=60)
    data = batch(cfg.vocab_size, padded=False, length=8)  # a windowed KV cache takes no right padding
    for precision in ("fp32", "int4"):
        folder = OUT / f"gemma2_{precision}"
        build(hf, precision, folder)
        fresh = transformers.Gemma2ForCausalLM.from_pretrained(hf, attn_implementation="eager")
        ref = gemma2_reference(fresh, folder, precision, data)
        np.savez_compressed(OUT / f"gemma2_{precision}.npz", **data, **ref)


def main() -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # RMSNorm weights away from 1, so their gradients are tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    data = batch(cfg.vocab_size)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        model.save_pretrained(hf)
        save_tokenizer(hf, vocab=60)
        for precision in ("fp32", "int4"):
            folder = OUT / f"llama_{precision}"
            build(hf, precision, folder)
            fresh = transformers.LlamaForCausalLM.from_pretrained(hf, attn_implementation="eager")
            ref = fp32_reference(fresh, data) if precision == "fp32" else int4_reference(fresh, folder, data)
            np.savez_compressed(OUT / f"llama_{precision}.npz", **data, **ref)
        make_gemma2(Path(tmp))
    import onnxruntime_genai

    manifest = {"torch": torch.__version__, "transformers": transformers.__version__,
                "onnxruntime_genai": onnxruntime_genai.__version__, "lr": LR, "llama": CONFIG,
                "gemma2": GEMMA2}
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
