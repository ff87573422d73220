"""Regenerate tests/data/llm/: tiny transformers exported the ways people export them.

    PYTHONPATH=. python scripts/make_llm_corpus.py            # needs torch, transformers, onnxscript
    PYTHONPATH=. python scripts/make_llm_corpus.py llama qwen2  # only these models

Families (random weights from small configs, never the hub): Llama
(grouped-query attention, RMSNorm, RoPE), Qwen2, ViT, DistilBERT, Whisper's
encoder and T5's encoder.  Exporters: ``dynamo`` (torch.onnx dynamo, its
default opset 20), ``dynamo23`` (opset 23: ``Attention``,
``RMSNormalization``) and ``torchscript``; T5 by TorchScript only, since the
dynamo exporter fails on it; Llama also ``dynamo_dynamic`` (symbolic batch and
sequence length: RoPE's tables are computed in the graph from ``inv_freq``).  Language models are exported with
``use_cache=False`` and an ``attention_mask`` input, and fed a left-padded
batch (row 0 starts with two padding tokens, their labels -100), so causal
attention has query rows that see no key.

For every file ``<model>__<exporter>.onnx`` the ``.npz`` holds ``input/<name>``,
``target``, ``loss`` (the loss at the starting weights), ``grad/<init>`` (the
float64 PyTorch gradient, in the initializer's layout) and ``loss_sgd1`` (the
loss after one ``torch.optim.SGD(lr=0.1)`` step on the ``requires_grad``
parameters the export holds).  PyTorch runs in
float64 with the math SDPA backend (the exported graph's math; torch's CPU
flash kernel differs on fully masked rows).  ``manifest.json`` lists per case
the initializer <- PyTorch parameter map (relation ``T`` where the exporter
stored the transpose as ``val_N``), the names of PyTorch's ``requires_grad``
parameters, the frozen ones, and the loss.
"""

from __future__ import annotations

import copy
import io
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_exporter_corpus import as_initializer, match_initializers, tensor_kinds  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "llm"
LR = 0.1
warnings.filterwarnings("ignore")


class LM(torch.nn.Module):
    """A causal LM taking (input_ids, attention_mask), returning logits, no cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


class Classifier(torch.nn.Module):
    def __init__(self, model, key):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, *args):
        return self.model(**dict(zip(self.key, args))).logits


class Encoder(torch.nn.Module):
    def __init__(self, model, key):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, *args):
        return self.model(**dict(zip(self.key, args))).last_hidden_state


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return LM(LlamaForCausalLM(cfg))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return LM(Qwen2ForCausalLM(cfg))


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=16, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=20, num_labels=3,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Classifier(ViTForImageClassification(cfg), ["pixel_values"])


def distilbert():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    cfg = DistilBertConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, hidden_dim=20,
                           max_position_embeddings=16, num_labels=3, dropout=0.0,
                           attention_dropout=0.0, seq_classif_dropout=0.0)
    return Classifier(DistilBertForSequenceClassification(cfg), ["input_ids", "attention_mask"])


def whisper_encoder():
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    cfg = WhisperConfig(vocab_size=64, d_model=16, encoder_layers=1, encoder_attention_heads=2,
                        encoder_ffn_dim=20, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=1, num_mel_bins=8, max_source_positions=8, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0)
    return Encoder(WhisperEncoder(cfg), ["input_features"])


def t5_encoder():
    from transformers import T5Config, T5EncoderModel
    cfg = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=20, num_layers=1, num_heads=2,
                   dropout_rate=0.0, relative_attention_num_buckets=8)
    return Encoder(T5EncoderModel(cfg), ["input_ids", "attention_mask"])


# ------------------------------------------------------------------ held-out variants
# Other configurations of the same families, generated once after the code was
# written against the set above: MQA, biases, two layers, sinusoidal positions,
# gated feed-forward.
def llama_b():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      rope_theta=500000.0, attention_bias=True, tie_word_embeddings=False)
    return LM(LlamaForCausalLM(cfg))


def qwen2_b():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=48, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                      tie_word_embeddings=False)
    return LM(Qwen2ForCausalLM(cfg))


def vit_b():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=24, num_labels=3, qkv_bias=False,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Classifier(ViTForImageClassification(cfg), ["pixel_values"])


def distilbert_b():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    cfg = DistilBertConfig(vocab_size=48, dim=16, n_layers=2, n_heads=4, hidden_dim=24,
                           max_position_embeddings=16, num_labels=3, dropout=0.0, attention_dropout=0.0,
                           seq_classif_dropout=0.0, sinusoidal_pos_embds=True)
    return Classifier(DistilBertForSequenceClassification(cfg), ["input_ids", "attention_mask"])


def whisper_encoder_b():
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    cfg = WhisperConfig(vocab_size=48, d_model=16, encoder_layers=2, encoder_attention_heads=4,
                        encoder_ffn_dim=24, num_mel_bins=8, max_source_positions=8, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1)
    return Encoder(WhisperEncoder(cfg), ["input_features"])


def t5_encoder_b():
    from transformers import T5Config, T5EncoderModel
    cfg = T5Config(vocab_size=48, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
                   dropout_rate=0.0, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu")
    return Encoder(T5EncoderModel(cfg), ["input_ids", "attention_mask"])


def lm_batch(rng):
    ids = rng.integers(1, 48, (2, 6)).astype(np.int64)
    mask = np.ones((2, 6), np.int64)
    mask[0, :2] = 0  # left padding
    ids[0, :2] = 0
    labels = np.where(mask == 1, np.roll(ids, -1, axis=1), -100)
    labels[:, -1] = -100
    return {"input_ids": ids, "attention_mask": mask}, labels


def seq_batch(rng):
    ids = rng.integers(1, 48, (2, 6)).astype(np.int64)
    mask = np.ones((2, 6), np.int64)
    mask[0, -2:] = 0  # right padding, as encoders are batched
    return {"input_ids": ids, "attention_mask": mask}, rng.integers(0, 3, 2).astype(np.int64)


def image_batch(rng):
    return {"pixel_values": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)}, \
        rng.integers(0, 3, 2).astype(np.int64)


def audio_batch(rng):
    x = rng.standard_normal((2, 8, 16)).astype(np.float32)
    return {"input_features": x}, rng.standard_normal((2, 8, 16)).astype(np.float32)


def encoder_batch(rng):
    feeds, _ = seq_batch(rng)
    return feeds, rng.standard_normal((2, 6, 16)).astype(np.float32)


CE_LAST = {"loss": "cross_entropy", "class_axis": -1, "ignore_index": -100}
CE = {"loss": "cross_entropy", "class_axis": 1}
MSE = {"loss": "mse"}
DYN = ["dynamo", "dynamo23", "torchscript"]
MODELS = {
    "llama": (llama, lm_batch, CE_LAST, DYN + ["dynamo_dynamic"]),
    "qwen2": (qwen2, lm_batch, CE_LAST, DYN),
    "vit": (vit, image_batch, CE, DYN),
    "distilbert": (distilbert, seq_batch, CE, DYN),
    "whisper_encoder": (whisper_encoder, audio_batch, MSE, DYN),
    "t5_encoder": (t5_encoder, encoder_batch, MSE, ["torchscript"]),
    # held out
    "llama_b": (llama_b, lm_batch, CE_LAST, DYN),
    "qwen2_b": (qwen2_b, lm_batch, CE_LAST, ["dynamo", "torchscript"]),
    "vit_b": (vit_b, image_batch, CE, ["dynamo", "torchscript"]),
    "distilbert_b": (distilbert_b, seq_batch, CE, ["dynamo", "torchscript"]),
    "whisper_encoder_b": (whisper_encoder_b, audio_batch, MSE, ["dynamo", "torchscript"]),
    "t5_encoder_b": (t5_encoder_b, encoder_batch, MSE, ["torchscript"]),
}


def export(model, feeds, exporter):
    model = copy.deepcopy(model).eval()
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    names = list(feeds)
    if exporter.startswith("dynamo"):
        dynamic = None
        if exporter == "dynamo_dynamic":  # batch and sequence length symbolic
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
            dynamic = {n: {0: batch, 1: seq} for n in names}
        prog = torch.onnx.export(model, args, input_names=names, output_names=["out"], dynamo=True,
                                 opset_version=23 if exporter == "dynamo23" else None, verbose=False,
                                 dynamic_shapes=dynamic)
        return prog.model_proto
    buf = io.BytesIO()
    torch.onnx.export(model, args, buf, input_names=names, output_names=["out"], dynamo=False,
                      opset_version=17)
    return onnx.load_from_string(buf.getvalue())


def strip_stack_traces(proto):
    """Drop the exporter's per-node Python stack traces (local paths, most of the file);
    the other records (name scopes, class hierarchy, fx node) stay."""
    for n in proto.graph.node:
        keep = [p for p in n.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        del n.metadata_props[:]
        n.metadata_props.extend(keep)
    return proto


def loss_fn(out, target, spec):
    if spec["loss"] == "mse":
        return F.mse_loss(out, target)
    if spec["class_axis"] == -1:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1), ignore_index=-100)
    return F.cross_entropy(out, target)


def reference(model, feeds, target, spec):
    """(loss, float64 gradients of the requires_grad parameters, fn(names) -> the loss
    after one SGD(lr) step on those parameters)."""
    m = copy.deepcopy(model).double().train()
    args = [torch.from_numpy(v.astype(np.float64) if v.dtype.kind == "f" else v) for v in feeds.values()]
    t = torch.from_numpy(target.astype(np.float64) if target.dtype.kind == "f" else target)
    with sdpa_kernel(SDPBackend.MATH):
        loss = loss_fn(m(*args), t, spec)
        loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in m.named_parameters() if p.requires_grad}

    def after_step(names):
        stepped = copy.deepcopy(m)
        params = dict(stepped.named_parameters())
        opt = torch.optim.SGD([params[n] for n in sorted(names)], lr=LR)
        for n in names:
            params[n].grad = torch.from_numpy(grads[n])
        opt.step()
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            return float(loss_fn(stepped(*args), t, spec))

    return float(loss), grads, after_step


def perturb(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def main(only):
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "manifest.json"
    cases = json.loads(path.read_text())["cases"] if path.exists() and only else []
    for mid, (factory, batch, spec, exporters) in MODELS.items():
        if only and mid not in only:
            continue
        cases = [c for c in cases if c["model"] != mid]
        torch.manual_seed(0)
        model = perturb(factory().float())
        feeds, target = batch(np.random.default_rng(0))
        loss, grads, after = reference(model, feeds, target, spec)
        params = {n: p.detach().numpy() for n, p in model.named_parameters()}
        frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
        trainable = {n: v for n, v in params.items() if n not in frozen}
        for exporter in exporters:
            try:
                proto = export(model, feeds, exporter)
            except Exception as exc:
                print(f"{mid}__{exporter}: export failed: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
                continue
            strip_stack_traces(proto)
            pmap = match_initializers(proto, trainable, kinds=tensor_kinds(model))
            shapes = {t.name: tuple(t.dims) for t in proto.graph.initializer}
            arrays = {f"input/{k}": v for k, v in feeds.items()}
            arrays["target"] = target
            arrays["loss"] = np.array(loss, np.float32)
            # the step trains what the export holds (ViT's dynamo export folds the
            # class token into a batch-sized constant: it stays as it was)
            arrays["loss_sgd1"] = np.array(after({n for n, _ in pmap.values()}), np.float32)
            for init, (name, rel) in pmap.items():
                arrays[f"grad/{init}"] = as_initializer(grads[name], rel, shapes[init]).astype(np.float32)
            stem = f"{mid}__{exporter}"
            (OUT / f"{stem}.onnx").write_bytes(proto.SerializeToString())
            np.savez_compressed(OUT / f"{stem}.npz", **arrays)
            unmatched = sorted(set(trainable) - {n for n, _ in pmap.values()})
            cases.append({"model": mid, "family": mid.removesuffix("_b"), "held_out": mid.endswith("_b"),
                          "exporter": exporter, "file": f"{stem}.onnx", **spec,
                          "parameters": {i: n if r == "same" else f"{n} ({r})" for i, (n, r) in pmap.items()},
                          "requires_grad": sorted(trainable), "frozen": frozen,
                          "unmatched": unmatched})
            size = (OUT / f"{stem}.onnx").stat().st_size + (OUT / f"{stem}.npz").stat().st_size
            print(f"{stem:36s} {size / 1024:7.1f} KiB  unmatched={unmatched}", flush=True)
    import transformers
    path.write_text(json.dumps({"versions": {"torch": torch.__version__,
                                             "transformers": transformers.__version__,
                                             "onnx": onnx.__version__},
                                "sgd_lr": LR, "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
