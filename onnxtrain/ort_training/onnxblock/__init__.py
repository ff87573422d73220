"""onnxblock: build losses and optimizers from blocks (ONNX Runtime training's
``onnxruntime.training.onnxblock``, standard ONNX only).

>>> from onnxtrain.ort_training import onnxblock
>>> class WeightedMSE(onnxblock.Block):
...     def __init__(self):
...         super().__init__()
...         self.mse = onnxblock.loss.MSELoss()
...     def build(self, output_name):
...         return onnxblock.blocks.Mul()(self.mse(output_name), onnxblock.blocks.Constant(0.5)())
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import numpy_helper

from . import blocks, loss, optim
from .blocks import Block
from .model_accessor import base, custom_op_library, empty_base
from .onnxblock import ForwardBlock, TrainingBlock

__all__ = ["blocks", "loss", "optim", "Block", "ForwardBlock", "TrainingBlock",
           "load_checkpoint_to_model", "save_checkpoint", "base", "custom_op_library",
           "empty_base"]


def save_checkpoint(parameters, path_to_checkpoint: str | os.PathLike,
                    nominal_checkpoint: bool = False) -> None:
    """Write ``(trainable, frozen)`` TensorProtos as an ODTC checkpoint."""
    from .. import checkpoint as ckpt

    if parameters is None:
        raise RuntimeError("No checkpoint parameters provided.")
    trainable, frozen = parameters
    ck = ckpt.Checkpoint(
        trainable={t.name: numpy_helper.to_array(t) for t in trainable},
        frozen={t.name: numpy_helper.to_array(t) for t in frozen},
        nominal=bool(nominal_checkpoint))
    ckpt.save(ck, path_to_checkpoint)


def load_checkpoint_to_model(path_to_checkpoint: str | os.PathLike, model: onnx.ModelProto) -> None:
    """Replace the initializers of ``model`` named in the checkpoint by its values (in place)."""
    from .. import checkpoint as ckpt

    ck = ckpt.load(path_to_checkpoint)
    if ck.nominal:
        raise ValueError("load_checkpoint_to_model: the checkpoint is nominal (no values)")
    values = {**ck.trainable, **ck.frozen}
    for t in model.graph.initializer:
        if t.name in values:
            t.CopyFrom(numpy_helper.from_array(np.asarray(values[t.name]), t.name))
