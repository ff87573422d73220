"""PyTorch versions of the workloads (``workloads.py``), loaded with the same weights.

ONNX names and layouts map onto torch parameters: Gemm weights are already
torch's [out, in]; the transformer's MatMul weights ``*.weight_t`` are
[in, out] and are transposed.  W5 and W6 are defined here as torch modules
(torchvision's resnet18, transformers' BERT) and exported by
``export_models.py``; their ONNX initializers carry the state_dict names.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import torch
from torch import nn

# torchvision's registry wheel is a CUDA build: its compiled operator
# registrations cannot load here (and transformers imports torchvision when it
# is installed); the model definitions are pure Python.
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("stub"))

from workloads import (
    BERT_D,
    BERT_FFN,
    BERT_HEADS,
    BERT_LABELS,
    BERT_LAYERS,
    BERT_SEQ,
    BERT_VOCAB,
    MLP_SIZES,
    RN_CLASSES,
    RNN_CLASSES,
    RNN_HIDDEN,
    RNN_IN,
    TF_D,
    TF_FFN,
    TF_HEADS,
)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(MLP_SIZES[0], MLP_SIZES[1])
        self.fc2 = nn.Linear(MLP_SIZES[1], MLP_SIZES[2])
        self.fc3 = nn.Linear(MLP_SIZES[2], MLP_SIZES[3])

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(64 * 5 * 5, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


class LinReg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 1)

    def forward(self, x):
        return self.lin(x)


def encoder_block() -> nn.Module:
    return nn.TransformerEncoderLayer(
        d_model=TF_D, nhead=TF_HEADS, dim_feedforward=TF_FFN, dropout=0.0,
        activation="relu", batch_first=True, norm_first=False,
    )


def _transformer_state(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    t = lambda k: params[k].T  # noqa: E731
    return {
        "self_attn.in_proj_weight": t("in_proj.weight_t"),
        "self_attn.in_proj_bias": params["in_proj.bias"],
        "self_attn.out_proj.weight": t("out_proj.weight_t"),
        "self_attn.out_proj.bias": params["out_proj.bias"],
        "linear1.weight": t("linear1.weight_t"),
        "linear1.bias": params["linear1.bias"],
        "linear2.weight": t("linear2.weight_t"),
        "linear2.bias": params["linear2.bias"],
        "norm1.weight": params["norm1.weight"],
        "norm1.bias": params["norm1.bias"],
        "norm2.weight": params["norm2.weight"],
        "norm2.bias": params["norm2.bias"],
    }


class RecurrentClassifier(nn.Module):
    """W7: nn.LSTM or nn.GRU (sequence first), its last hidden state through a Linear."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.rnn = (nn.LSTM if op == "LSTM" else nn.GRU)(RNN_IN, RNN_HIDDEN)
        self.fc = nn.Linear(RNN_HIDDEN, RNN_CLASSES)

    def forward(self, x):
        _, h = self.rnn(x)
        if isinstance(h, tuple):  # LSTM: (h_n, c_n)
            h = h[0]
        return self.fc(h[0])


#: torch's gate blocks as ONNX's: LSTM i f g o from ONNX's i o f c, GRU r z n from z r h.
_GATE_ORDER = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2]}


def _recurrent_state(op: str, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = _GATE_ORDER[op]

    def blocks(a):  # [gates * hidden, ...] in torch's gate order
        return np.concatenate([np.split(a, len(order), axis=0)[k] for k in order], axis=0)

    wb, rb = np.split(params["rnn.B"][0], 2)
    return {"rnn.weight_ih_l0": blocks(params["rnn.W"][0]), "rnn.weight_hh_l0": blocks(params["rnn.R"][0]),
            "rnn.bias_ih_l0": blocks(wb), "rnn.bias_hh_l0": blocks(rb),
            "fc.weight": params["fc.weight"], "fc.bias": params["fc.bias"]}


def resnet18() -> nn.Module:
    """W5: torchvision's resnet18 with a 10-class head."""
    import torchvision

    return torchvision.models.resnet18(num_classes=RN_CLASSES)


class BertClassifier(nn.Module):
    """W6: transformers' BertForSequenceClassification, returning its logits.

    Random weights from a small config (no pretrained download); dropout 0 so
    that a step is deterministic work; GELU (erf) as BERT's; attention with
    transformers' default implementation (torch's scaled_dot_product_attention)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(vocab_size=BERT_VOCAB, hidden_size=BERT_D, num_hidden_layers=BERT_LAYERS,
                         num_attention_heads=BERT_HEADS, intermediate_size=BERT_FFN,
                         max_position_embeddings=BERT_SEQ, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
                         num_labels=BERT_LABELS)
        self.model = BertForSequenceClassification(cfg)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def import_libraries(workload_key: str) -> None:
    """Import what building W5/W6 needs (the worker does it before timing construction)."""
    if workload_key == "W5":
        import torchvision  # noqa: F401
    elif workload_key == "W6":
        import transformers.models.bert.modeling_bert  # noqa: F401


def create(workload_key: str, seed: int) -> nn.Module:
    """W5/W6's module with its own init from ``seed`` (export_models.py exports it)."""
    torch.manual_seed(seed)
    if workload_key == "W5":
        return resnet18()
    if workload_key == "W6":
        return BertClassifier()
    raise ValueError(f"no torch-defined workload {workload_key!r}")


def _load_exported(module: nn.Module, params: dict[str, np.ndarray]) -> nn.Module:
    """Load an exported workload's initializers (state_dict names: parameters and
    BatchNorm statistics); every parameter must be among them."""
    state = module.state_dict()
    unknown = [k for k in params if k not in state]
    missing = [k for k, _ in module.named_parameters() if k not in params]
    if unknown or missing:
        raise ValueError(f"weights do not match the module: unknown {unknown[:5]}, missing {missing[:5]}")
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}
    module.load_state_dict(tensors, strict=False)
    return module


def build(workload_key: str, params: dict[str, np.ndarray]) -> nn.Module:
    """The torch module of a workload with the given (ONNX-named) weights."""
    base = workload_key.split("-")[0]
    if base == "W1":
        module, state = MLP(), params
    elif base == "W2":
        module, state = CNN(), params
    elif base == "W3":
        module, state = LinReg(), params
    elif base == "W4":
        module, state = encoder_block(), _transformer_state(params)
    elif base == "W7":
        op = workload_key.split("-")[1]
        module, state = RecurrentClassifier(op), _recurrent_state(op, params)
    elif base in ("W5", "W6"):
        return _load_exported(create(base, 0), params)
    else:
        raise ValueError(f"unknown workload {workload_key!r}")
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
    module.load_state_dict(tensors, strict=True)
    return module
