"""onnxruntime's LoRA adapter files (``.onnx_adapter``, ``onnxruntime.AdapterFormat``),
which onnxruntime-genai's ``og.Adapters`` loads: written atomically."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..core.files import replacing


def write_adapter(path: str | os.PathLike, params: Mapping[str, np.ndarray]) -> Path:
    """Write ``params`` (name -> array) as an adapter file at ``path``."""
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(1)
    fmt.set_parameters({k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v))
                        for k, v in params.items()})
    with replacing(path) as tmp:
        fmt.export_adapter(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    return Path(path)

