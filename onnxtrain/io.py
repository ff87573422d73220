"""Writing models to disk: atomically, and (for large models) with external data."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx

from .errors import TrainingModelError


def write_model(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    """Serialize atomically: a temp file in the same folder, fsync, then rename."""
    target = Path(path)
    folder = target.resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    try:
        data = model.SerializeToString()
    except ValueError as exc:  # protobuf refuses messages over 2 GB
        raise TrainingModelError(f"cannot serialize the model: {exc}") from exc
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return target
