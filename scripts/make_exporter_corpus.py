"""Regenerate tests/data/exporters/: exported models nobody on the project wrote, plus references.

Requirements (the ``exporters`` extra of pyproject.toml; the versions used
are recorded in tests/data/exporters/manifest.json)::

    pip install -e '.[exporters]'      # torch, torchvision, transformers, onnxscript,
                                       # skl2onnx, scikit-learn (and pillow for torchvision)
    python scripts/make_exporter_corpus.py                 # everything
    python scripts/make_exporter_corpus.py gpt2_lm sklearn # only these (manifest merged)

No network access is needed: every model is built from a small config with
seeded random weights (never ``from_pretrained``), scikit-learn models are
fitted on onnxtrain's embedded digits data.

For every model file ``<model>__<exporter>.onnx`` an ``.npz`` of the same
stem holds, with N the batch and the loss the builder's default for the
model (cross-entropy for classifiers and language models, class axis last
and ignore_index -100 for the latter; mse for regressors):

- ``input/<name>``: the main-graph inputs of the batch;  ``target``: the target;
- ``grad/<init>``: gradients of the loss at the starting weights,
  keyed by ONNX initializer name (torch parameters are matched to
  initializers by name, else by value: equal, transposed, or the leading
  rows of a position embedding folded for the traced length);
- ``loss``: the 5 losses of 5 steps of ``torch.optim.Adam(lr=1e-3)``
  (PyTorch's defaults: betas (0.9, 0.999), eps 1e-8, no weight decay, which
  is what ``build.Adam(lr=1e-3)`` computes), in float64, each computed before
  its update (what ``train_step`` returns);
- ``param5/<init>``: the parameters after the 5 steps; ``stat5/<init>``: the
  BatchNormalization running statistics after them (PyTorch's rule: unbiased
  batch variance, momentum 0.1);
- ``eval5/<output>`` (``eval5_logprob/<logits output>`` for the scikit-learn
  classifiers, compared after log_softmax): the outputs of the trained model on the batch, in eval
  mode (in training mode for ``training=PRESERVE`` exports, whose inference
  graph computes BatchNormalization with batch statistics).

References are computed in float64 and stored rounded to float32.

Torch models run the loss in training mode (dropout probabilities are 0, so
only BatchNormalization differs from eval mode), as ``build.training_model``
does with ``train_mode=True``.  scikit-learn references are the same loss and
optimizer written in torch float64 over the converted model's math (the
``ai.onnx.ml`` semantics of onnxruntime).

Exporters change the parameterisation in eval mode: Conv+BatchNorm fusion,
one initializer per use of a tied weight.  The reference is then torch
training the model as exported (``fused``, ``untied``), and the case says so
in ``reference_notes``; where no torch model has the export's parameters,
``not_comparable`` says why (the tests then check only finiteness and the
trainable set).  Every parameter gets random values first (``perturb``), so
that no two tensors are equal by accident.

``manifest.json`` lists each case (model, exporter, loss, the prediction
output, the initializer <- torch parameter map, the notes above) and the
generator versions.
"""

from __future__ import annotations

import copy
import io
import json
import sys
import types
import warnings
from pathlib import Path

import numpy as np

# torchvision's meta registrations clash with some torch builds; they are not needed here.
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))

import onnx  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "exporters"
STEPS = 5
LR = 1e-3

warnings.filterwarnings("ignore")


# ------------------------------------------------------------------ torch models
class Logits(torch.nn.Module):
    """A Hugging Face model returning only its logits (a tensor output to export)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def perturb(model: torch.nn.Module) -> torch.nn.Module:
    """Random values for every parameter and BatchNorm statistic.

    Fresh torch modules start with many identical tensors (norm weights 1,
    biases 0); exporters may merge identical initializers, and the reference
    matches parameters to initializers by value, so each one is made distinct."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn_like(b))
            elif name.endswith("running_var"):
                b.copy_(1.0 + 0.2 * torch.rand_like(b))
    return model


def tiny_resnet() -> torch.nn.Module:
    """A small ResNet made of torchvision's BasicBlocks (16 and 32 channels)."""
    from torchvision.models.resnet import BasicBlock

    down = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 1, 2, bias=False), torch.nn.BatchNorm2d(32))
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2, 1),
        BasicBlock(16, 16), BasicBlock(16, 32, stride=2, downsample=down),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    )


def mobilenet() -> torch.nn.Module:
    """torchvision's mobilenet_v3_small at width 0.25 with a 64-wide head (kept small)."""
    from torchvision.models.mobilenetv3 import MobileNetV3, _mobilenet_v3_conf

    setting, _ = _mobilenet_v3_conf("mobilenet_v3_small", width_mult=0.25)
    return MobileNetV3(setting, last_channel=64, num_classes=10, dropout=0.0)


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=37, max_position_embeddings=16, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Logits(BertForSequenceClassification(cfg))


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    return Logits(GPT2LMHeadModel(cfg))


def image_batch(rng: np.random.Generator):
    x = rng.standard_normal((4, 3, 32, 32)).astype(np.float32)
    return {"x": x}, rng.integers(0, 10, 4).astype(np.int64)


def sequence_batch(rng: np.random.Generator):
    ids = rng.integers(0, 100, (2, 8)).astype(np.int64)
    return {"input_ids": ids}, rng.integers(0, 3, 2).astype(np.int64)


def lm_batch(rng: np.random.Generator):
    ids = rng.integers(0, 100, (2, 8)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((2, 1), -100, np.int64)], axis=1)
    labels[0, :2] = -100  # ignored positions, as a padded batch has
    return {"input_ids": ids}, labels


#: model id -> (factory, batch maker, loss description, exporters)
TORCH_MODELS = {
    "resnet_tiny": (tiny_resnet, image_batch, {"loss": "cross_entropy", "class_axis": 1},
                    ["dynamo", "dynamo_noopt", "torchscript", "torchscript_preserve"]),
    "mobilenet_v3_small": (mobilenet, image_batch, {"loss": "cross_entropy", "class_axis": 1},
                           ["dynamo_noopt"]),
    "bert_seqcls": (bert, sequence_batch, {"loss": "cross_entropy", "class_axis": 1},
                    ["dynamo", "torchscript"]),
    "gpt2_lm": (gpt2, lm_batch, {"loss": "cross_entropy", "class_axis": -1, "ignore_index": -100},
                ["dynamo", "torchscript"]),
}


def export(model: torch.nn.Module, feeds: dict, exporter: str) -> onnx.ModelProto:
    """Export with one of the four torch.onnx.export configurations (a copy of ``model``)."""
    model = copy.deepcopy(model)
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    names = list(feeds)
    if exporter.startswith("dynamo"):
        model.eval()
        prog = torch.onnx.export(model, args, input_names=names, output_names=["logits"],
                                 dynamo=True, optimize=exporter == "dynamo", verbose=False)
        return prog.model_proto
    buf = io.BytesIO()
    if exporter == "torchscript_preserve":
        model.train()
        torch.onnx.export(model, args, buf, input_names=names, output_names=["logits"], dynamo=False,
                          training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)
    else:
        model.eval()
        torch.onnx.export(model, args, buf, input_names=names, output_names=["logits"], dynamo=False)
    return onnx.load_from_string(buf.getvalue())


def torch_loss(logits: torch.Tensor, target: torch.Tensor, spec: dict) -> torch.Tensor:
    if spec.get("class_axis", 1) == -1:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               ignore_index=spec.get("ignore_index", -100))
    return F.cross_entropy(logits, target)


def torch_reference(model: torch.nn.Module, feeds: dict, target: np.ndarray, spec: dict,
                    export_mode: str = "eval") -> dict:
    """float64 gradients at the start, 5 Adam steps (losses, params, BN stats), eval outputs."""
    m = copy.deepcopy(model).double().train()
    args = [torch.from_numpy(v.astype(np.float64) if v.dtype.kind == "f" else v) for v in feeds.values()]
    t = torch.from_numpy(target)
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    grads, losses = {}, []
    for step in range(STEPS):
        opt.zero_grad()
        loss = torch_loss(m(*args), t, spec)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().numpy().copy() for n, p in m.named_parameters()}
        losses.append(loss.item())
        opt.step()
    params = {n: p.detach().numpy().copy() for n, p in m.named_parameters()}
    stats = {n: b.detach().numpy().copy() for n, b in m.named_buffers()
             if n.endswith(("running_mean", "running_var"))}
    m.train(export_mode == "train")  # the mode the exported graph computes in
    with torch.no_grad():
        eval_out = m(*args).numpy()
    return {"grads": grads, "losses": np.array(losses), "params": params, "stats": stats,
            "eval": eval_out}


#: How an initializer holds a torch tensor: "same", "T" (transposed) or "rows:k"
#: (its first k rows, with leading unit dims: a position embedding folded for
#: the traced sequence length).
Relation = str


def _relate(arr: np.ndarray, value: np.ndarray, close: bool) -> Relation | None:
    equal = (lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-7)) if close else np.array_equal
    if arr.shape == value.shape and equal(arr, value):
        return "same"
    if value.ndim == 2 and arr.shape == value.T.shape and equal(arr, value.T):
        return "T"
    if value.ndim == 2 and arr.ndim >= 2 and arr.shape[-1] == value.shape[1] and \
            all(d == 1 for d in arr.shape[:-2]) and arr.shape[-2] < value.shape[0]:
        rows = arr.shape[-2]
        if equal(arr.reshape(rows, -1), value[:rows]):
            return f"rows:{rows}"
    return None


def as_initializer(value: np.ndarray, relation: Relation, shape: tuple) -> np.ndarray:
    """A torch tensor (value, gradient, ...) in the layout of the initializer it maps to."""
    if relation == "T":
        return value.T
    if relation.startswith("rows:"):
        return value[: int(relation[5:])].reshape(shape)
    return value


def _init_kinds(proto: onnx.ModelProto) -> dict[str, str]:
    """initializer -> "embedding" when a Gather looks rows up in it, else "other"."""
    kinds: dict[str, str] = {}
    for node in proto.graph.node:
        for i, name in enumerate(node.input):
            kind = "embedding" if node.op_type == "Gather" and i == 0 else "other"
            kinds[name] = "embedding" if kinds.get(name) == "embedding" else kind
    return kinds


def tensor_kinds(model: torch.nn.Module) -> dict[str, set[str]]:
    """torch parameter -> its uses: {"embedding"} for nn.Embedding weights, {"other"}
    for the rest, both for a weight tied between an embedding and a projection."""
    uses: dict[int, set[str]] = {}
    for mod in model.modules():
        for _, p in mod.named_parameters(recurse=False):
            uses.setdefault(id(p), set()).add(
                "embedding" if isinstance(mod, torch.nn.Embedding) else "other")
    return {name: uses[id(p)] for name, p in model.named_parameters()}


def match_initializers(proto: onnx.ModelProto, tensors: dict[str, np.ndarray],
                       close: bool = False, kinds: dict[str, set[str]] | None = None
                       ) -> dict[str, tuple[str, Relation]]:
    """initializer name -> (torch name, relation).

    First by name, then by value (exact, or to float32 rounding with ``close``
    for values the exporter recomputed) for the tensors still unmatched, then
    once more for all, which finds a tensor split into several initializers.
    Where values are equal (tied weights, untied copies), ``kinds`` keeps an
    embedding on the initializer a Gather reads and a projection off it (a
    folded slice of rows is exempt: it is read by the op after the lookup)."""
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer
             if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)}
    init_kind = _init_kinds(proto)

    def fits(name: str, init: str, relation: Relation) -> bool:
        if not kinds or relation.startswith("rows:"):
            return True
        return init_kind.get(init, "other") in kinds.get(name, {"other", "embedding"})

    out: dict[str, tuple[str, Relation]] = {}
    for name, value in tensors.items():
        if name in inits and inits[name].shape == value.shape and fits(name, name, "same"):
            out[name] = (name, "same")
    for only_unmatched in (True, False):
        matched = {n for n, _ in out.values()}
        for name, value in tensors.items():
            if only_unmatched and name in matched:
                continue
            value = value.astype(np.float32)
            for init, arr in inits.items():
                if init in out or arr.size < 2:
                    continue
                relation = _relate(arr, value, close)
                if relation and fits(name, init, relation):
                    out[init] = (name, relation)
    return out


def comparability(proto: onnx.ModelProto, params: dict, pmap: dict) -> str | None:
    """Why this export's training cannot be compared with torch's (None if it can)."""
    reasons = []
    unmatched = sorted(set(params) - {n for n, _ in pmap.values()})
    if unmatched:
        reasons.append(f"{len(unmatched)} parameter(s) folded into computed constants at export "
                       f"(e.g. {unmatched[0]!r})")
    copies: dict[str, list[str]] = {}
    for init, (name, _) in pmap.items():
        copies.setdefault(name, []).append(init)
    for name, inits in copies.items():
        if len(inits) > 1:
            reasons.append(f"{name!r} split into {len(inits)} initializers {sorted(inits)}")
    return "; ".join(reasons) or None


def fused(model: torch.nn.Module) -> torch.nn.Module:
    """A copy with every Conv2d + BatchNorm2d pair fused (eval mode), as exporters do."""
    from torch.ao.quantization import fuse_modules

    m = copy.deepcopy(model).eval()
    mods = list(m.named_modules())
    pairs = [[a, b] for (a, ma), (b, mb) in zip(mods, mods[1:])
             if isinstance(ma, torch.nn.Conv2d) and isinstance(mb, torch.nn.BatchNorm2d)]
    m = fuse_modules(m, pairs)
    for p in m.parameters():  # a fused bias of a bias-free conv starts frozen
        p.requires_grad_(True)
    return m


def untied(model: torch.nn.Module) -> torch.nn.Module:
    """A copy where every parameter shared by several modules becomes one copy per module."""
    m = copy.deepcopy(model)
    seen: set[int] = set()
    for full, p in list(m.named_parameters(remove_duplicate=False)):
        if id(p) in seen:
            owner, _, attr = full.rpartition(".")
            setattr(m.get_submodule(owner), attr, torch.nn.Parameter(p.detach().clone()))
        seen.add(id(p))
    return m


def reference_model(model: torch.nn.Module, proto: onnx.ModelProto) -> tuple[torch.nn.Module, list[str]]:
    """The torch model with the export's parameterisation, and what was changed.

    Eval-mode exports fuse Conv+BatchNorm (a fused model trains differently from
    the original in training mode), and may give each use of a tied weight its
    own initializer: the reference is then torch training the fused / untied
    model, which is what the exported model can train."""
    notes = []
    has_bn = any(isinstance(mod, torch.nn.BatchNorm2d) for mod in model.modules())
    if has_bn and not any(n.op_type == "BatchNormalization" for n in proto.graph.node):
        model = fused(model)
        notes.append("Conv+BatchNorm fused at export: reference is torch training the fused model")
    shared = len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))
    if shared:
        pmap = match_initializers(proto, {n: p.detach().numpy() for n, p in model.named_parameters()},
                                  kinds=tensor_kinds(model))
        names = [n for n, _ in pmap.values()]
        if len(names) > len(set(names)):
            model = untied(model)
            notes.append("tied weights split into separate initializers at export: reference "
                         "is torch training the untied model")
    return model, notes


def make_torch_case(model_id: str, factory, batch, spec: dict, exporter: str, model, feeds, target, ref):
    proto = export(model, feeds, exporter)
    if exporter == "torchscript_preserve":
        # Tracing in training mode ran forward passes that moved the running
        # statistics: the reference starts from the exported values.
        model = copy.deepcopy(model)
        inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in inits:
                    b.copy_(torch.from_numpy(inits[name].copy()))
        ref = torch_reference(model, feeds, target, spec, export_mode="train")
    ref_model, notes = reference_model(model, proto)
    if notes:
        ref = torch_reference(ref_model, feeds, target, spec)
        model = ref_model
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    buffers = {n: b.detach().numpy() for n, b in model.named_buffers()
               if n.endswith(("running_mean", "running_var"))}
    pmap = match_initializers(proto, params, close=bool(notes), kinds=tensor_kinds(model))
    smap = match_initializers(proto, buffers)
    folded = sorted({f"{name} -> {init}" for init, (name, rel) in pmap.items() if rel.startswith("rows:")})
    if folded:
        notes = notes + [f"position embedding rows for the traced length folded at export ({folded[0]}): "
                         "reference trains those rows"]
    shapes = {t.name: tuple(t.dims) for t in proto.graph.initializer}
    arrays: dict[str, np.ndarray] = {f"input/{k}": v for k, v in feeds.items()}
    arrays["target"] = target
    arrays["loss"] = ref["losses"]
    for init, (name, relation) in pmap.items():
        arrays[f"grad/{init}"] = as_initializer(ref["grads"][name], relation, shapes[init])
        arrays[f"param5/{init}"] = as_initializer(ref["params"][name], relation, shapes[init])
    for init, (name, _) in smap.items():
        arrays[f"stat5/{init}"] = ref["stats"][name]
    arrays[f"eval5/{proto.graph.output[0].name}"] = ref["eval"]
    return proto, arrays, {
        "model": model_id, "exporter": exporter, "framework": "torch", **spec,
        "output": proto.graph.output[0].name,
        "parameters": {init: f"{name} ({relation})" if relation != "same" else name
                       for init, (name, relation) in pmap.items()},
        "reference_notes": notes,
        "not_comparable": comparability(proto, params, pmap),
    }


# ------------------------------------------------------------------ scikit-learn
def sklearn_cases():
    """(name, model, proto, reference forward kind) for the skl2onnx conversions."""
    from skl2onnx import to_onnx
    from sklearn.linear_model import LinearRegression, LogisticRegression
    from sklearn.neural_network import MLPClassifier

    from onnxtrain.datasets import load_digits

    x, y = load_digits()
    x = x.astype(np.float32).reshape(len(x), -1)
    x = x / x.max()
    xs, ys = x[:300], y[:300]
    multi = LogisticRegression(max_iter=300).fit(xs, ys)
    binary = LogisticRegression(max_iter=300).fit(xs, (ys > 4).astype(np.int64))
    reg = LinearRegression().fit(xs, xs[:, 20:30].sum(axis=1))
    mlp = MLPClassifier(hidden_layer_sizes=(16,), max_iter=60, random_state=0).fit(xs, ys)
    one = xs[:1]
    variants = {
        "logreg_digits": (multi, "classifier"),
        "logreg_binary": (binary, "classifier"),
        "linreg": (reg, "regressor"),
        "mlp_digits": (mlp, "classifier"),
    }
    black = {"classifier": {"LinearClassifier"}, "regressor": {"LinearRegressor"}}
    for name, (model, kind) in variants.items():
        yield name, "skl2onnx", model, kind, to_onnx(model, one)
        if name == "mlp_digits":
            continue
        yield name, "skl2onnx_opset9", model, kind, to_onnx(model, one, target_opset=9)
        yield name, "skl2onnx_black_op", model, kind, to_onnx(model, one, black_op=black[kind])
        if kind == "classifier":
            yield name, "skl2onnx_nozipmap", model, kind, to_onnx(
                model, one, options={id(model): {"zipmap": False}})


def sklearn_forward(model, kind: str):
    """(torch float64 parameters, fn(params, X) -> scores for the loss, loss kind).

    The math of the converted model: LinearClassifier rows W (E x F), b (E);
    skl2onnx writes a binary LogisticRegression as E = 2 rows [-w, w], [-b, b]
    with LOGISTIC, whose probabilities are sigmoid(s) / sum(sigmoid(s)); a
    multiclass one as SOFTMAX.  The loss reads log-probabilities."""
    from sklearn.neural_network import MLPClassifier

    if isinstance(model, MLPClassifier):
        ps = [torch.tensor(np.asarray(a, np.float32), dtype=torch.float64) for a in
              (model.coefs_[0], model.intercepts_[0], model.coefs_[1], model.intercepts_[1])]
        def fwd(p, X):
            return torch.log_softmax(torch.relu(X @ p[0] + p[1]) @ p[2] + p[3], dim=1)
        return ps, fwd, "nll"
    coef = np.atleast_2d(np.asarray(model.coef_, np.float32))
    inter = np.atleast_1d(np.asarray(model.intercept_, np.float32))
    if kind == "regressor":
        ps = [torch.tensor(coef.T, dtype=torch.float64), torch.tensor(inter, dtype=torch.float64)]
        return ps, (lambda p, X: X @ p[0] + p[1]), "mse"
    if coef.shape[0] == 1:  # binary: two rows [-w, w], LOGISTIC
        coef, inter = np.concatenate([-coef, coef]), np.concatenate([-inter, inter])
        ps = [torch.tensor(coef.T, dtype=torch.float64), torch.tensor(inter, dtype=torch.float64)]
        def fwd(p, X):
            logsig = F.logsigmoid(X @ p[0] + p[1])
            return logsig - torch.logsumexp(logsig, dim=1, keepdim=True)
        return ps, fwd, "nll"
    ps = [torch.tensor(coef.T, dtype=torch.float64), torch.tensor(inter, dtype=torch.float64)]
    return ps, (lambda p, X: torch.log_softmax(X @ p[0] + p[1], dim=1)), "nll"


def make_sklearn_case(name: str, exporter: str, model, kind: str, proto: onnx.ModelProto):
    from onnxtrain.builder import adapt
    from onnxtrain.datasets import load_digits

    x, y = load_digits()
    x = (x.astype(np.float32).reshape(len(x), -1) / x.max())[300:332]
    y = y[300:332].astype(np.int64)
    ps, fwd, loss_kind = sklearn_forward(model, kind)
    if kind == "regressor":
        target = x[:, 20:30].sum(axis=1, keepdims=True).astype(np.float32) + 0.1
        loss_fn = lambda out, t: F.mse_loss(out.reshape(t.shape), t)  # noqa: E731
    else:
        target = (y > 4).astype(np.int64) if name == "logreg_binary" else y
        loss_fn = lambda out, t: F.nll_loss(out, t)  # noqa: E731
    X = torch.tensor(x, dtype=torch.float64)
    t = torch.tensor(target, dtype=torch.float64 if kind == "regressor" else torch.int64)
    start = [p.detach().numpy().copy() for p in ps]
    for p in ps:
        p.requires_grad_(True)
    opt = torch.optim.Adam(ps, lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(fwd(ps, X), t)
        loss.backward()
        if step == 0:
            grads = [p.grad.detach().numpy().copy() for p in ps]
        losses.append(loss.item())
        opt.step()
    # Keys: the initializers of the trainable model (after adapt), matched by value.
    adapted = adapt.adapt(proto)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in adapted.graph.initializer
             if i.data_type == onnx.TensorProto.FLOAT}
    arrays: dict[str, np.ndarray] = {"input/X": x, "target": target, "loss": np.array(losses)}
    mapping = {}
    for k, value in enumerate(start):
        value32 = value.astype(np.float32)
        hits = [n for n, a in inits.items() if a.size == value32.size and
                np.array_equal(a.reshape(-1), value32.reshape(-1)) and n not in mapping]
        if len(hits) != 1:
            raise SystemExit(f"{name}/{exporter}: parameter {k} matches initializers {hits}")
        shape = inits[hits[0]].shape
        mapping[hits[0]] = f"param{k}"
        arrays[f"grad/{hits[0]}"] = grads[k].reshape(shape)
        arrays[f"param5/{hits[0]}"] = ps[k].detach().numpy().reshape(shape)
    with torch.no_grad():
        out = fwd(ps, X).numpy()
    if kind == "regressor":
        arrays["eval5/variable"] = out.reshape(-1, 1)
    else:  # the trained model's log-probabilities: log_softmax of its logits output
        (logits,) = adapt.logits_of(adapted).values()
        arrays[f"eval5_logprob/{logits}"] = out
    prediction = "variable" if kind == "regressor" else None
    return proto, arrays, {
        "model": name, "exporter": exporter, "framework": "sklearn",
        "loss": "mse" if kind == "regressor" else "cross_entropy", "class_axis": 1,
        "output": prediction, "reference_scores": "log-probabilities" if kind != "regressor" else "output",
        "parameters": mapping, "not_comparable": None,
    }


# ------------------------------------------------------------------ driver
def versions() -> dict[str, str]:
    import onnxruntime
    import onnxscript
    import skl2onnx
    import sklearn
    import torchvision
    import transformers

    return {"torch": torch.__version__, "torchvision": torchvision.__version__,
            "transformers": transformers.__version__, "onnxscript": onnxscript.__version__,
            "skl2onnx": skl2onnx.__version__, "scikit-learn": sklearn.__version__,
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "numpy": np.__version__}


def save(proto: onnx.ModelProto, arrays: dict, entry: dict, cases: list) -> None:
    stem = f"{entry['model']}__{entry['exporter']}"
    # skl2onnx lists its opset imports in set order: sort them so that files are reproducible.
    imports = sorted(proto.opset_import, key=lambda o: (o.domain, o.version))
    imports = [onnx.OperatorSetIdProto(domain=o.domain, version=o.version) for o in imports]
    del proto.opset_import[:]
    proto.opset_import.extend(imports)
    data = proto.SerializeToString()
    (OUT / f"{stem}.onnx").write_bytes(data)
    # References are computed in float64 and stored rounded to float32 (ample for
    # float32 models, and half the size).
    np.savez_compressed(OUT / f"{stem}.npz", **{
        k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in arrays.items()})
    entry["file"] = f"{stem}.onnx"
    cases.append(entry)
    size = len(data) + (OUT / f"{stem}.npz").stat().st_size
    print(f"{stem:48s} {size / 1024:8.1f} KiB", flush=True)


def main(only: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    cases: list[dict] = []
    for model_id, (factory, batch, spec, exporters) in TORCH_MODELS.items():
        if only and model_id not in only:
            continue
        torch.manual_seed(0)
        model = perturb(factory().float())
        feeds, target = batch(np.random.default_rng(0))
        ref = torch_reference(model, feeds, target, spec)
        for exporter in exporters:
            try:
                proto, arrays, entry = make_torch_case(model_id, factory, batch, spec, exporter,
                                                       model, feeds, target, ref)
            except Exception as exc:  # an exporter that fails is recorded, not fatal
                print(f"{model_id}__{exporter}: export failed: {exc}", file=sys.stderr)
                cases.append({"model": model_id, "exporter": exporter, "framework": "torch",
                              "export_error": str(exc).splitlines()[0][:200]})
                continue
            save(proto, arrays, entry, cases)
    if not only or "sklearn" in only:
        for name, exporter, model, kind, proto in sklearn_cases():
            save(*make_sklearn_case(name, exporter, model, kind, proto), cases)
    if only and (OUT / "manifest.json").exists():  # keep the entries of the models not regenerated
        done = {(c["model"], c["exporter"]) for c in cases}
        old = json.loads((OUT / "manifest.json").read_text())["cases"]
        cases = [c for c in old if (c["model"], c["exporter"]) not in done] + cases
    manifest = {"versions": versions(), "steps": STEPS, "optimizer": {"name": "Adam", "lr": LR},
                "cases": cases}
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
