"""PyTorch versions of the workloads (``workloads.py``), loaded with the same weights.

ONNX names and layouts map onto torch parameters: Gemm weights are already
torch's [out, in]; the transformer's MatMul weights ``*.weight_t`` are
[in, out] and are transposed.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from workloads import MLP_SIZES, TF_D, TF_FFN, TF_HEADS


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
    else:
        raise ValueError(f"unknown workload {workload_key!r}")
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
    module.load_state_dict(tensors, strict=True)
    return module
