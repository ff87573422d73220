"""Regenerate tests/data/tied/: dynamo exports whose optimizer stored equal weights once.

    PYTHONPATH=. python scripts/make_tied_exports.py     # needs torch, transformers, onnxscript

torch.onnx.export(dynamo=True) deduplicates initializers of equal value, so in
a freshly initialized model every RMSNorm weight (all ones) becomes one
initializer read by several Mul nodes, although PyTorch trains one vector per
module.  The exporter's node records (``pkg.torch.onnx.fx_node`` names the
parameter each node read, ``pkg.torch.onnx.name_scopes`` its module) tell
them apart; onnxtrain's builder unties them from those records and keeps
real sharing (one parameter used twice) as it is.

Cases (``manifest.json``: the file, the loss, every PyTorch parameter with its
size, the total):

- ``llama_fresh__dynamo`` / ``__dynamo23``: a freshly initialized two-layer
  Llama (untied embeddings; no perturbation, unlike tests/data/llm), exported
  at opset 20 (RMSNorm as Mul) and 23 (``RMSNormalization``): five norm
  weights in one initializer;
- ``twice__dynamo``: ``b(tanh(a(lin(a(x)))))`` with ``a`` and ``b`` elementwise
  scales of ones: ``a.weight`` is used twice (real sharing) and ``b.weight``
  was merged into it by the exporter.

Each ``.npz`` holds ``input/<name>``, ``target``, ``loss`` (at the starting
weights), ``grad/<parameter>`` (PyTorch's float64 gradient of every
parameter, in its own layout) and ``loss_sgd1`` (the loss after one
``torch.optim.SGD(lr=0.1)`` step on every parameter).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_llm_corpus import CE_LAST, LM, LR, MSE, export, lm_batch, reference, strip_stack_traces  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "tied"
warnings.filterwarnings("ignore")


def llama_fresh():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return LM(LlamaForCausalLM(cfg))


class Scale(torch.nn.Module):
    """x * weight, weight a vector of ones (as a fresh norm's)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))

    def forward(self, x):
        return x * self.weight


class Twice(torch.nn.Module):
    """``a`` used twice (one parameter, real sharing) and ``b`` equal to it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.lin, self.b = Scale(8), torch.nn.Linear(8, 8), Scale(8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(self.lin(self.a(x)))))


def twice_batch(rng):
    return {"x": rng.standard_normal((3, 8)).astype(np.float32)}, rng.standard_normal((3, 8)).astype(np.float32)


CASES = {  # stem -> (model factory, batch, loss spec, exporter)
    "llama_fresh__dynamo": (llama_fresh, lm_batch, CE_LAST, "dynamo"),
    "llama_fresh__dynamo23": (llama_fresh, lm_batch, CE_LAST, "dynamo23"),
    "twice__dynamo": (Twice, twice_batch, MSE, "dynamo"),
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    cases = []
    for stem, (factory, batch, spec, exporter) in CASES.items():
        torch.manual_seed(0)
        model = factory().float()
        feeds, target = batch(np.random.default_rng(0))
        loss, grads, after = reference(model, feeds, target, spec)
        params = {n: int(p.numel()) for n, p in model.named_parameters() if p.requires_grad}
        proto = strip_stack_traces(export(model, feeds, exporter))
        arrays = {f"input/{k}": v for k, v in feeds.items()}
        arrays.update(target=target, loss=np.array(loss, np.float32),
                      loss_sgd1=np.array(after(set(params)), np.float32))
        arrays.update({f"grad/{n}": g.astype(np.float32) for n, g in grads.items()})
        (OUT / f"{stem}.onnx").write_bytes(proto.SerializeToString())
        np.savez_compressed(OUT / f"{stem}.npz", **arrays)
        cases.append({"file": f"{stem}.onnx", **spec, "parameters": params,
                      "total": sum(params.values())})
        print(f"{stem:24s} {sum(params.values()):6d} parameters", flush=True)
    import transformers
    (OUT / "manifest.json").write_text(json.dumps(
        {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                      "onnx": onnx.__version__},
         "sgd_lr": LR, "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
