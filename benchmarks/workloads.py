"""The benchmark workloads, defined once for every framework.

Each workload is one inference ONNX model (static shapes, opset 17, IR 8 so
that onnx 1.16 and onnxruntime 1.19 load it), its initial weights, one fixed
batch, the loss and the optimizer.  W1-W4 are built here with onnx.helper
(numpy weights, torch-style init from one seed); W5 (torchvision ResNet-18)
and W6 (transformers BERT encoder) are PyTorch modules (``torch_models.py``)
exported by ``export_models.py`` in the ORT training environment and cached in
``benchmarks/.cache/`` (their weights are the export's initializers, named as
the module's state_dict, BatchNorm statistics included: ``params`` holds them
all, ``training_model.trainable`` tells the parameters).  Every framework
trains exactly this:

- onnxtrain: the inference model plus a training_info (loss -> Gradient ->
  optimizer), see ``training_model.py``;
- ONNX Runtime training: ``generate_artifacts`` on the same inference model;
- PyTorch: the equivalent ``torch.nn`` module (``torch_models.py``) loaded with
  the same weights.

Weights use ONNX layout and ONNX names; ``torch_models.py`` maps them.
BatchNormalization (W5) trains in training mode everywhere (batch statistics;
torch's running_var update, with the unbiased batch variance).

FLOPs per training step are counted analytically: 2 * multiply-adds of every
MatMul / Gemm / Conv of the forward pass, times 3 for forward + backward (the
backward pass computes the gradient of the input and of the weight, each as
costly as the forward product).

>>> w = WORKLOADS["W3"]
>>> m, params, batch = w.build()
>>> sorted(params), {k: v.shape for k, v in batch.items()}
(['lin.bias', 'lin.weight'], {'X': (32, 10), 'Y': (32, 1)})
>>> w.flops_per_step
1920.0
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
F32 = TensorProto.FLOAT


@dataclass
class Workload:
    """One benchmark workload: model, data, loss and optimizer."""

    key: str
    title: str
    builder: Callable[[int], tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, np.ndarray]]]
    #: "cross_entropy" (logits [N, C], int64 labels [N]) or "mse" (mean over all elements).
    loss: str
    #: Name of the model output the loss reads, and of the target input it adds.
    output: str
    target: str
    #: "adamw" (lr, weight_decay; torch defaults betas 0.9/0.999, eps 1e-8) or "sgd"
    #: (lr, momentum; torch.optim.SGD with dampening 0).
    optimizer: str
    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.0
    flops_per_step: float = 0.0
    #: Timed steps per framework of a full run (``--quick`` divides them by 10).
    default_steps: int = 200
    seed: int = 0
    notes: str = ""
    extra: dict = field(default_factory=dict)

    def build(self):
        """(inference ModelProto, params {name: array}, batch {input or target: array})."""
        return self.builder(self.seed)


# ------------------------------------------------------------------ helpers
def _uniform(rng: np.random.Generator, shape, bound: float) -> np.ndarray:
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def _linear_init(rng, out_features: int, in_features: int):
    """torch.nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias."""
    bound = 1.0 / np.sqrt(in_features)
    return _uniform(rng, (out_features, in_features), bound), _uniform(rng, (out_features,), bound)


def _conv_init(rng, out_ch: int, in_ch: int, k: int):
    bound = 1.0 / np.sqrt(in_ch * k * k)
    return _uniform(rng, (out_ch, in_ch, k, k), bound), _uniform(rng, (out_ch,), bound)


def _const(name: str, value) -> onnx.NodeProto:
    """A Constant node (not an initializer: initializers are exactly the parameters)."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name + "_value"))


def _model(nodes, inputs, outputs, params: dict[str, np.ndarray], name: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, name, inputs, outputs, [numpy_helper.from_array(v, k) for k, v in params.items()]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="onnxtrain-benchmarks")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def _vi(name: str, shape, elem=F32) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def _classification_batch(rng, x_shape, n_classes: int) -> dict[str, np.ndarray]:
    return {
        "X": rng.random(x_shape, dtype=np.float32),
        "label": rng.integers(0, n_classes, size=(x_shape[0],)).astype(np.int64),
    }


# ------------------------------------------------------------------ W1: MLP
MLP_SIZES = (784, 512, 256, 10)
MLP_BATCH = 64


def build_mlp(seed: int):
    """784-512-256-10, ReLU, Gemm with transB=1 (torch layout [out, in])."""
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    nodes = []
    x = "X"
    layers = list(zip(MLP_SIZES[:-1], MLP_SIZES[1:]))
    for i, (n_in, n_out) in enumerate(layers, start=1):
        w, b = _linear_init(rng, n_out, n_in)
        params[f"fc{i}.weight"], params[f"fc{i}.bias"] = w, b
        y = "logits" if i == len(layers) else f"h{i}_pre"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [y], transB=1))
        if i < len(layers):
            nodes.append(helper.make_node("Relu", [y], [f"h{i}"]))
            x = f"h{i}"
    model = _model(nodes, [_vi("X", (MLP_BATCH, MLP_SIZES[0]))],
                   [_vi("logits", (MLP_BATCH, MLP_SIZES[-1]))], params, "mlp")
    return model, params, _classification_batch(rng, (MLP_BATCH, MLP_SIZES[0]), MLP_SIZES[-1])


def mlp_flops() -> float:
    fwd = 2.0 * MLP_BATCH * sum(a * b for a, b in zip(MLP_SIZES[:-1], MLP_SIZES[1:]))
    return 3.0 * fwd


# ------------------------------------------------------------------ W2: CNN
CNN_BATCH = 64


def build_cnn(seed: int):
    """conv32(3x3)-relu-maxpool2-conv64(3x3)-relu-maxpool2-fc128-relu-fc10 on 1x28x28 (no padding)."""
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    params["conv1.weight"], params["conv1.bias"] = _conv_init(rng, 32, 1, 3)
    params["conv2.weight"], params["conv2.bias"] = _conv_init(rng, 64, 32, 3)
    params["fc1.weight"], params["fc1.bias"] = _linear_init(rng, 128, 64 * 5 * 5)
    params["fc2.weight"], params["fc2.bias"] = _linear_init(rng, 10, 128)
    nodes = [
        helper.make_node("Conv", ["X", "conv1.weight", "conv1.bias"], ["c1"], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2.weight", "conv2.bias"], ["c2"], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc1.weight", "fc1.bias"], ["f1"], transB=1),
        helper.make_node("Relu", ["f1"], ["h"]),
        helper.make_node("Gemm", ["h", "fc2.weight", "fc2.bias"], ["logits"], transB=1),
    ]
    model = _model(nodes, [_vi("X", (CNN_BATCH, 1, 28, 28))], [_vi("logits", (CNN_BATCH, 10))],
                   params, "cnn")
    return model, params, _classification_batch(rng, (CNN_BATCH, 1, 28, 28), 10)


def cnn_flops() -> float:
    conv1 = 2.0 * 26 * 26 * 32 * (1 * 3 * 3)
    conv2 = 2.0 * 11 * 11 * 64 * (32 * 3 * 3)
    fc = 2.0 * (1600 * 128 + 128 * 10)
    return 3.0 * CNN_BATCH * (conv1 + conv2 + fc)


# ------------------------------------------------------------------ W3: linear regression
LR_BATCH, LR_IN = 32, 10


def build_linreg(seed: int):
    """Y = X W^T + b, 10 -> 1."""
    rng = np.random.default_rng(seed)
    params = {}
    params["lin.weight"], params["lin.bias"] = _linear_init(rng, 1, LR_IN)
    nodes = [helper.make_node("Gemm", ["X", "lin.weight", "lin.bias"], ["pred"], transB=1)]
    model = _model(nodes, [_vi("X", (LR_BATCH, LR_IN))], [_vi("pred", (LR_BATCH, 1))], params, "linreg")
    x = rng.standard_normal((LR_BATCH, LR_IN)).astype(np.float32)
    w_true = rng.standard_normal((LR_IN, 1)).astype(np.float32)
    y = (x @ w_true + 0.1 * rng.standard_normal((LR_BATCH, 1))).astype(np.float32)
    return model, params, {"X": x, "Y": y}


# ------------------------------------------------------------------ W4: transformer encoder block
TF_BATCH, TF_SEQ, TF_D, TF_HEADS, TF_FFN = 16, 64, 128, 4, 512


def build_transformer(seed: int):
    """Post-norm encoder block, as torch.nn.TransformerEncoderLayer(d_model=128, nhead=4,
    dim_feedforward=512, dropout=0, activation=relu, batch_first=True, norm_first=False):

        qkv = x Wqkv^T + bqkv; per head softmax(q k^T / sqrt(dh)) v; o = attn Wo^T + bo
        h = LayerNorm1(x + o);  y = LayerNorm2(h + W2 relu(W1 h + b1) + b2)

    Weights in torch layout ([out, in]) used by MatMul through a Transpose-free
    [in, out] copy: the ONNX initializers hold W^T, named ``*.weight_t``."""
    rng = np.random.default_rng(seed)
    B, S, D, H, F = TF_BATCH, TF_SEQ, TF_D, TF_HEADS, TF_FFN
    dh = D // H
    params: dict[str, np.ndarray] = {}
    # torch: in_proj xavier_uniform, in_proj_bias 0, out_proj.bias 0; biases are
    # drawn non-zero here so that every gradient path is exercised.
    xavier = np.sqrt(6.0 / (D + 3 * D))
    params["in_proj.weight_t"] = _uniform(rng, (3 * D, D), xavier).T.copy()
    params["in_proj.bias"] = _uniform(rng, (3 * D,), 0.02)
    w, b = _linear_init(rng, D, D)
    params["out_proj.weight_t"], params["out_proj.bias"] = w.T.copy(), b
    w, b = _linear_init(rng, F, D)
    params["linear1.weight_t"], params["linear1.bias"] = w.T.copy(), b
    w, b = _linear_init(rng, D, F)
    params["linear2.weight_t"], params["linear2.bias"] = w.T.copy(), b
    for n in ("norm1", "norm2"):
        params[f"{n}.weight"] = (1.0 + _uniform(rng, (D,), 0.1)).astype(np.float32)
        params[f"{n}.bias"] = _uniform(rng, (D,), 0.1)

    nodes = [
        _const("split_sizes", np.array([D, D, D], np.int64)),
        _const("heads_shape", np.array([B, S, H, dh], np.int64)),
        _const("model_shape", np.array([B, S, D], np.int64)),
        _const("scale", np.array(1.0 / np.sqrt(dh), np.float32)),
        helper.make_node("MatMul", ["X", "in_proj.weight_t"], ["qkv_mm"]),
        helper.make_node("Add", ["qkv_mm", "in_proj.bias"], ["qkv"]),
        helper.make_node("Split", ["qkv", "split_sizes"], ["q", "k", "v"], axis=-1),
        helper.make_node("Reshape", ["q", "heads_shape"], ["q_h"]),
        helper.make_node("Reshape", ["k", "heads_shape"], ["k_h"]),
        helper.make_node("Reshape", ["v", "heads_shape"], ["v_h"]),
        helper.make_node("Transpose", ["q_h"], ["q_t"], perm=[0, 2, 1, 3]),   # B H S dh
        helper.make_node("Transpose", ["k_h"], ["k_t"], perm=[0, 2, 3, 1]),   # B H dh S
        helper.make_node("Transpose", ["v_h"], ["v_t"], perm=[0, 2, 1, 3]),   # B H S dh
        helper.make_node("MatMul", ["q_t", "k_t"], ["scores_raw"]),          # B H S S
        helper.make_node("Mul", ["scores_raw", "scale"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["attn"], axis=-1),
        helper.make_node("MatMul", ["attn", "v_t"], ["ctx_t"]),               # B H S dh
        helper.make_node("Transpose", ["ctx_t"], ["ctx_h"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_h", "model_shape"], ["ctx"]),
        helper.make_node("MatMul", ["ctx", "out_proj.weight_t"], ["o_mm"]),
        helper.make_node("Add", ["o_mm", "out_proj.bias"], ["o"]),
        helper.make_node("Add", ["X", "o"], ["res1"]),
        # Mean and InvStdDev are declared (optional outputs): ORT training's
        # LayerNormalization gradient needs them.
        helper.make_node("LayerNormalization", ["res1", "norm1.weight", "norm1.bias"],
                         ["h1", "ln1_mean", "ln1_invstd"],
                         axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["h1", "linear1.weight_t"], ["f1_mm"]),
        helper.make_node("Add", ["f1_mm", "linear1.bias"], ["f1"]),
        helper.make_node("Relu", ["f1"], ["f1_act"]),
        helper.make_node("MatMul", ["f1_act", "linear2.weight_t"], ["f2_mm"]),
        helper.make_node("Add", ["f2_mm", "linear2.bias"], ["f2"]),
        helper.make_node("Add", ["h1", "f2"], ["res2"]),
        helper.make_node("LayerNormalization", ["res2", "norm2.weight", "norm2.bias"],
                         ["Y_out", "ln2_mean", "ln2_invstd"],
                         axis=-1, epsilon=1e-5),
    ]
    model = _model(nodes, [_vi("X", (B, S, D))], [_vi("Y_out", (B, S, D))], params, "encoder_block")
    batch = {
        "X": rng.standard_normal((B, S, D)).astype(np.float32),
        "target": rng.standard_normal((B, S, D)).astype(np.float32),
    }
    return model, params, batch


def transformer_flops() -> float:
    B, S, D, H, F = TF_BATCH, TF_SEQ, TF_D, TF_HEADS, TF_FFN
    tokens = B * S
    fwd = 2.0 * tokens * D * 3 * D          # qkv projection
    fwd += 2.0 * 2 * B * H * S * S * (D // H)  # q k^T and attn v
    fwd += 2.0 * tokens * D * D             # out projection
    fwd += 2.0 * 2 * tokens * D * F         # FFN
    return 3.0 * fwd


# ------------------------------------------------------------------ W7: recurrent classifiers
RNN_SEQ, RNN_BATCH, RNN_IN, RNN_HIDDEN, RNN_CLASSES = 50, 64, 32, 128, 10


def _build_recurrent(op: str, seed: int):
    """A sequence classifier: one ONNX ``op`` layer (LSTM or GRU, layout 0,
    X [seq, batch, in]), its last hidden state through a Linear to 10 classes.

    As torch.nn.LSTM / nn.GRU(32, 128) + nn.Linear(128, 10): weights drawn as
    torch does (U(-1/sqrt(hidden), 1/sqrt(hidden)) for every recurrent tensor),
    stored in ONNX's gate order (LSTM i o f c, GRU z r h; ``torch_models``
    maps them to torch's i f g o and r z n).  The GRU has linear_before_reset=1,
    torch's form of the candidate gate."""
    rng = np.random.default_rng(seed)
    T, N, I, H, C = RNN_SEQ, RNN_BATCH, RNN_IN, RNN_HIDDEN, RNN_CLASSES
    g = 4 if op == "LSTM" else 3
    bound = 1.0 / np.sqrt(H)
    params = {"rnn.W": _uniform(rng, (1, g * H, I), bound), "rnn.R": _uniform(rng, (1, g * H, H), bound),
              "rnn.B": _uniform(rng, (1, 2 * g * H), bound)}
    params["fc.weight"], params["fc.bias"] = _linear_init(rng, C, H)
    attrs = {"hidden_size": H}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    outs = ["", "h_last"] + ([""] if op == "LSTM" else [])
    nodes = [
        helper.make_node(op, ["X", "rnn.W", "rnn.R", "rnn.B"], outs, name="rnn", **attrs),
        _const("squeeze_axes", np.array([0], np.int64)),
        helper.make_node("Squeeze", ["h_last", "squeeze_axes"], ["h"]),
        helper.make_node("Gemm", ["h", "fc.weight", "fc.bias"], ["logits"], transB=1),
    ]
    model = _model(nodes, [_vi("X", (T, N, I))], [_vi("logits", (N, C))], params, op.lower() + "_classifier")
    batch = {"X": rng.standard_normal((T, N, I)).astype(np.float32),
             "label": rng.integers(0, C, size=N).astype(np.int64)}
    return model, params, batch


def build_lstm(seed: int):
    return _build_recurrent("LSTM", seed)


def build_gru(seed: int):
    return _build_recurrent("GRU", seed)


def recurrent_flops(gates: int) -> float:
    """3 x 2 x the multiply-adds of the input and recurrent products and the head."""
    T, N, I, H = RNN_SEQ, RNN_BATCH, RNN_IN, RNN_HIDDEN
    return 3.0 * 2.0 * (T * N * gates * H * (I + H) + N * H * RNN_CLASSES)


# ------------------------------------------------------------------ W5, W6: exported from PyTorch
# Defined as torch modules (``torch_models.create``) and exported by
# ``export_models.py`` in a torch environment; the exports are cached under
# benchmarks/.cache/, keyed on the content of the files that define them.
CACHE = Path(__file__).resolve().parent / ".cache"
RN_BATCH, RN_CH, RN_SIZE, RN_CLASSES = 16, 3, 112, 10
BERT_BATCH, BERT_SEQ, BERT_D, BERT_HEADS, BERT_LAYERS, BERT_FFN = 8, 128, 256, 4, 4, 1024
BERT_VOCAB, BERT_LABELS = 2048, 2
#: What the exports depend on besides these constants.
EXPORT_SOURCES = ("export_models.py", "torch_models.py")


def export_dir() -> Path:
    """benchmarks/.cache/exports-<hash of the export's sources and settings>/."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in EXPORT_SOURCES:
        h.update((here / name).read_bytes())
    h.update(repr((RN_BATCH, RN_CH, RN_SIZE, RN_CLASSES, BERT_BATCH, BERT_SEQ, BERT_D, BERT_HEADS,
                   BERT_LAYERS, BERT_FFN, BERT_VOCAB, BERT_LABELS)).encode())
    return CACHE / f"exports-{h.hexdigest()[:16]}"


def export_python() -> str:
    """The interpreter that runs ``export_models.py``: $BENCH_EXPORT_PYTHON, else the
    ORT training environment's (setup_ort_training.sh gives it torchvision and transformers)."""
    env = os.environ.get("BENCH_EXPORT_PYTHON")
    if env:
        return env
    python = Path(__file__).resolve().parent / ".venv-ort-training" / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{python} is missing: run benchmarks/setup_ort_training.sh "
                           "(it exports W5/W6 from PyTorch)")
    return str(python)


def exported_model(key: str) -> onnx.ModelProto:
    """The cached export of workload ``key``, made first if missing."""
    d = export_dir()
    path = d / f"{key}.onnx"
    if not path.exists():
        for old in CACHE.glob("exports-*"):  # exports of earlier sources
            if old != d:
                shutil.rmtree(old, ignore_errors=True)
        d.mkdir(parents=True, exist_ok=True)
        here = Path(__file__).resolve().parent
        proc = subprocess.run([export_python(), str(here / "export_models.py"), str(d), key],
                              capture_output=True, text=True)
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"exporting {key} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return onnx.load(str(path))


def _exported(key: str, batch: dict[str, np.ndarray]):
    model = exported_model(key)
    params = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return model, params, batch


def resnet_batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return _classification_batch(rng, (RN_BATCH, RN_CH, RN_SIZE, RN_SIZE), RN_CLASSES)


def build_resnet18(seed: int):
    """torchvision.models.resnet18(num_classes=10), exported (BatchNormalization trains in
    training mode, batch statistics, as in torch's ``module.train()``)."""
    return _exported("W5", resnet_batch(seed))


def bert_batch(seed: int) -> dict[str, np.ndarray]:
    """Token ids from 1: id 0 is BERT's padding token (``padding_idx``), whose embedding row
    torch never trains; the exported Gather does not know it, so a pad token in the batch
    (which real data would mask out) would make the ONNX model train a row torch keeps."""
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(1, BERT_VOCAB, size=(BERT_BATCH, BERT_SEQ)).astype(np.int64),
            "label": rng.integers(0, BERT_LABELS, size=(BERT_BATCH,)).astype(np.int64)}


def build_bert(seed: int):
    """transformers' BertForSequenceClassification (4 layers, hidden 256, 4 heads, FFN 1024,
    GELU erf, dropout 0), logits of input_ids [8, 128] (no mask: every token attends), exported."""
    return _exported("W6", bert_batch(seed))


def conv_macs(h: int, w: int, c_out: int, c_in: int, k: int) -> float:
    return float(h * w * c_out * c_in * k * k)


def resnet18_flops() -> float:
    """3 x 2 x the multiply-adds of resnet18's convolutions and fc at RN_SIZE."""
    size = (RN_SIZE + 2 * 3 - 7) // 2 + 1           # conv1 7x7 stride 2 pad 3
    macs = conv_macs(size, size, 64, RN_CH, 7)
    size = (size + 2 - 3) // 2 + 1                  # maxpool 3x3 stride 2 pad 1
    c_in = 64
    for stage, c_out in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if (stage > 0 and block == 0) else 1
            out = (size + 2 - 3) // stride + 1
            macs += conv_macs(out, out, c_out, c_in, 3) + conv_macs(out, out, c_out, c_out, 3)
            if stride != 1 or c_in != c_out:        # downsample 1x1
                macs += conv_macs(out, out, c_out, c_in, 1)
            size, c_in = out, c_out
    macs += 512 * RN_CLASSES
    return 3.0 * 2.0 * RN_BATCH * macs


def bert_flops() -> float:
    """3 x 2 x the multiply-adds of the encoder's MatMuls, the pooler and the classifier
    (the embedding lookups are no products)."""
    tokens, d, f = BERT_BATCH * BERT_SEQ, BERT_D, BERT_FFN
    per_layer = tokens * d * 4 * d + tokens * 2 * d * f + 2 * BERT_BATCH * BERT_SEQ * BERT_SEQ * d
    macs = BERT_LAYERS * per_layer + BERT_BATCH * (d * d + d * BERT_LABELS)
    return 3.0 * 2.0 * macs


# ------------------------------------------------------------------ the table
WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", "MLP 784-512-256-10, batch 64, AdamW", build_mlp, "cross_entropy",
                   "logits", "label", "adamw", lr=1e-3, weight_decay=1e-2,
                   flops_per_step=mlp_flops(), default_steps=500),
    "W1-SGD": Workload("W1-SGD", "MLP 784-512-256-10, batch 64, SGD lr 0.01", build_mlp,
                       "cross_entropy", "logits", "label", "sgd", lr=0.01,
                       flops_per_step=mlp_flops(), default_steps=500),
    "W2": Workload("W2", "CNN conv32-pool-conv64-pool-fc128-fc10, 1x28x28, batch 64, AdamW",
                   build_cnn, "cross_entropy", "logits", "label", "adamw", lr=1e-3,
                   weight_decay=1e-2, flops_per_step=cnn_flops(), default_steps=200),
    "W3": Workload("W3", "linear regression 10->1, batch 32, MSE, SGD lr 0.01", build_linreg, "mse",
                   "pred", "Y", "sgd", lr=0.01, flops_per_step=3.0 * 2 * LR_BATCH * LR_IN,
                   default_steps=3000),
    "W4": Workload("W4", "transformer encoder block d128 h4 ffn512, seq 64, batch 16, MSE, AdamW",
                   build_transformer, "mse", "Y_out", "target", "adamw", lr=1e-3,
                   weight_decay=1e-2, flops_per_step=transformer_flops(), default_steps=200),
    # lr 0.001: at 0.01 the loss falls 2.35 -> 0.47 in 5 steps and float32 rounding (ReLU
    # masks flipping near zero, amplified by BatchNorm) moves torch's own float32 losses 1e-2
    # from its float64 ones; at 0.001 that drift is ~2e-5, so equal work is checkable to 1e-4.
    "W5": Workload("W5", "torchvision ResNet-18 (10 classes), 3x112x112, batch 16, SGD lr 0.001 "
                   "momentum 0.9 (exported from PyTorch)", build_resnet18, "cross_entropy",
                   "logits", "label", "sgd", lr=0.001, momentum=0.9, flops_per_step=resnet18_flops(),
                   default_steps=30,
                   extra={"inputs": ["X"], "float64_reference": True,
                          "example_inputs": lambda: [resnet_batch(0)["X"]]}),
    # lr 1e-4 (BERT's usual scale): at 1e-3 the loss oscillates (0.68, 0.44, 0.64, 0.10) and
    # the spec Adam op's epsilon convention moves the 5th loss 4e-3 from torch's; at 1e-4, 6e-4.
    "W6": Workload("W6", "BERT-style encoder (transformers BertForSequenceClassification: 4 layers, "
                   "hidden 256, 4 heads, FFN 1024), seq 128, batch 8, AdamW lr 1e-4 "
                   "(exported from PyTorch)",
                   build_bert, "cross_entropy", "logits", "label", "adamw", lr=1e-4,
                   weight_decay=1e-2, flops_per_step=bert_flops(), default_steps=60,
                   extra={"inputs": ["input_ids"],
                          "example_inputs": lambda: [bert_batch(0)["input_ids"]]}),
    "W7-LSTM": Workload("W7-LSTM", "LSTM classifier, seq 50, batch 64, input 32, hidden 128, "
                        "10 classes, Adam lr 1e-3", build_lstm, "cross_entropy", "logits", "label",
                        "adamw", lr=1e-3, weight_decay=0.0, flops_per_step=recurrent_flops(4),
                        default_steps=60),
    "W7-GRU": Workload("W7-GRU", "GRU classifier (linear_before_reset=1), seq 50, batch 64, "
                       "input 32, hidden 128, 10 classes, Adam lr 1e-3", build_gru, "cross_entropy",
                       "logits", "label", "adamw", lr=1e-3, weight_decay=0.0,
                       flops_per_step=recurrent_flops(3), default_steps=60),
}

#: ``--workloads W1`` also runs W1's SGD variant; ``W7`` its LSTM and GRU.
ALIASES = {"W1": ["W1", "W1-SGD"], "W7": ["W7-LSTM", "W7-GRU"]}
