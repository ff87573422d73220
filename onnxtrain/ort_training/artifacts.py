"""``generate_artifacts``: ONNX Runtime training's artifact generator, writing
standard ONNX files that ``api.Module`` and ``api.Optimizer`` train.

Same files as 1.19.2 (``{prefix}training_model.onnx``, ``eval_model.onnx``,
``optimizer_model.onnx``, ``checkpoint``, optionally ``nominal_checkpoint``);
the file names are the contract, not the contents: the training and eval
models hold the forward pass and the loss (onnxtrain builds the backward pass
when it loads them), the optimizer model one standard-ONNX update with its
settings as metadata, the checkpoint is ODTC, as ORT's.
"""

from __future__ import annotations

import logging
import os
import pathlib
from enum import Enum
from typing import List, Optional, Union

import onnx

from ..io.storage import write_model
from . import onnxblock

log = logging.getLogger(__name__)


class LossType(Enum):
    """Loss added to the training model (``loss=`` of ``generate_artifacts``)."""

    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


class OptimType(Enum):
    """Optimizer of the optimizer model (``optimizer=`` of ``generate_artifacts``)."""

    AdamW = 1
    SGD = 2


_LOSSES = {
    LossType.MSELoss: onnxblock.loss.MSELoss,
    LossType.CrossEntropyLoss: onnxblock.loss.CrossEntropyLoss,
    LossType.BCEWithLogitsLoss: onnxblock.loss.BCEWithLogitsLoss,
    LossType.L1Loss: onnxblock.loss.L1Loss,
}
_OPTIMIZERS = {OptimType.AdamW: onnxblock.optim.AdamW, OptimType.SGD: onnxblock.optim.SGD}


class _TrainingBlock(onnxblock.TrainingBlock):
    def __init__(self, loss, loss_input_names, additional_output_names) -> None:
        super().__init__()
        self._loss, self._loss_inputs = loss, loss_input_names
        self._extra = additional_output_names

    def build(self, *inputs_to_loss):
        if self._loss_inputs:
            inputs_to_loss = self._loss_inputs
        out = self._loss(*inputs_to_loss)
        if not self._extra:
            return out
        if not isinstance(self._extra, list):
            raise RuntimeError(f"Unknown type provided for additional output names {type(self._extra)}. "
                               "Expected additional output names to be a list of strings.")
        return (*out, *self._extra) if isinstance(out, tuple) else (out, *self._extra)


def generate_artifacts(
    model: Union[onnx.ModelProto, str],
    requires_grad: Optional[List[str]] = None,
    frozen_params: Optional[List[str]] = None,
    loss: Optional[Union[LossType, onnxblock.Block]] = None,
    optimizer: Optional[Union[OptimType, onnxblock.Block]] = None,
    artifact_directory: Optional[Union[str, bytes, os.PathLike]] = None,
    prefix: str = "",
    ort_format: bool = False,
    custom_op_library: Optional[Union[str, bytes, os.PathLike]] = None,
    additional_output_names: Optional[List[str]] = None,
    nominal_checkpoint: bool = False,
    loss_input_names: Optional[List[str]] = None,
) -> None:
    """Write the training, eval and optimizer models and the checkpoint for ``model``.

    ``requires_grad``: the parameters to train; ``frozen_params``: parameters
    kept fixed (both in the checkpoint); other initializers stay constants of
    the graph.  ``loss``: a LossType or an ``onnxblock.Block`` (None: the
    model's first output is the loss).  ``optimizer``: an OptimType or
    ``onnxblock.optim.AdamW/SGD(...)`` (None: no optimizer model).
    ``additional_output_names``: outputs returned after the loss;
    ``loss_input_names``: the values the loss reads (default: the model's
    outputs).  ``ort_format=True`` and ``custom_op_library`` are not
    supported (NotImplementedError)."""
    if ort_format:
        raise NotImplementedError("generate_artifacts: ort_format=True is not supported; onnxtrain "
                                  "reads and writes .onnx files")
    if custom_op_library is not None:
        onnxblock.custom_op_library(custom_op_library)  # raises NotImplementedError
    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(os.fspath(model))
    elif not isinstance(model, onnx.ModelProto):
        raise RuntimeError("Please pass in either a string or an ONNX ModelProto for the model.")
    if loss is None:
        loss_block = onnxblock.blocks.PassThrough()
    elif isinstance(loss, LossType):
        loss_block = _LOSSES[loss]()
    elif isinstance(loss, onnxblock.Block):
        loss_block = loss
    else:
        raise RuntimeError(f"Unknown loss provided {type(loss)}. Expected loss to be either one of "
                           "onnxtrain.ort_training.artifacts.LossType or onnxblock.Block.")
    if optimizer is not None and not isinstance(optimizer, (OptimType, onnxblock.optim.OptimizerBlock)):
        raise TypeError(f"Unknown optimizer provided {type(optimizer)}. Expected optimizer to be either one of "
                        "OptimType or onnxblock.optim.AdamW/SGD.")
    if requires_grad is not None and frozen_params is not None and set(requires_grad) & set(frozen_params):
        raise RuntimeError("A parameter cannot be frozen and require gradient computation at the same "
                           f"time {set(requires_grad) & set(frozen_params)}")
    block = _TrainingBlock(loss_block, loss_input_names, additional_output_names)
    for name in requires_grad or []:
        block.requires_grad(name)
    for name in frozen_params or []:
        block.requires_grad(name, False)
    with onnxblock.base(model):
        block(*[o.name for o in model.graph.output])
        training_model, eval_model = block.to_model_proto()
        params = block.parameters()

    folder = pathlib.Path(os.fspath(artifact_directory)) if artifact_directory is not None else pathlib.Path.cwd()
    folder.mkdir(parents=True, exist_ok=True)
    write_model(training_model, folder / f"{prefix}training_model.onnx", external_data=False)
    write_model(eval_model, folder / f"{prefix}eval_model.onnx", external_data=False)
    onnxblock.save_checkpoint(params, folder / f"{prefix}checkpoint")
    if nominal_checkpoint:
        onnxblock.save_checkpoint(params, folder / f"{prefix}nominal_checkpoint", nominal_checkpoint=True)
    if optimizer is None:
        log.info("No optimizer enum provided. Skipping optimizer model generation.")
        return
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    optim_block = _OPTIMIZERS[optimizer]() if isinstance(optimizer, OptimType) else optimizer
    with onnxblock.empty_base(opset_version=opset):
        optim_block(params)
        optim_model = optim_block.to_model_proto()
    write_model(optim_model, folder / f"{prefix}optimizer_model.onnx", external_data=False)
