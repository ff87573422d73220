"""Optimizers as blocks (ONNX Runtime training's ``onnxblock.optim``).

``AdamW`` and ``SGD`` called with the parameters ``(trainable, frozen)``
build an optimizer model: a standard ONNX graph that applies one update to
one parameter tensor (inputs ``learning_rate``, ``step``, ``param``,
``gradient`` and the moments; the rules of ``standard_model``), with the settings
as metadata (``ort_training.optimizer``), which ``api.Optimizer`` reads.
``clip_grad=ClipGradNorm(max_norm)`` clips the gradients' global norm first.
"""

from __future__ import annotations

from typing import Optional, Tuple

import onnx
from onnx import TensorProto, helper

from ...optim.rules import apply
from .. import standard_model
from . import blocks


class ClipGradNorm(blocks.Block):
    """g <- g * min(1, max_norm / (||g||_2 + 1e-6)), the norm over all gradients."""

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        self._max_norm = float(max_norm)

    @property
    def max_norm(self) -> float:
        return self._max_norm

    def build(self, gradients_name: str) -> str:
        raise NotImplementedError(
            "ClipGradNorm is applied through an optimizer: optim.AdamW(clip_grad=ClipGradNorm(c)) "
            "or optim.SGD(clip_grad=...)")


class OptimizerBlock(blocks.Block):
    """Base of AdamW and SGD: builds the optimizer model (see the module docstring)."""

    _kind = ""

    def __init__(self, clip_grad: Optional[ClipGradNorm] = None, **settings) -> None:
        super().__init__()
        if clip_grad is not None and not isinstance(clip_grad, ClipGradNorm):
            raise TypeError(f"clip_grad must be an onnxblock.optim.ClipGradNorm, got {type(clip_grad)}")
        self.config = standard_model.OptimizerConfig(
            self._kind, max_norm=clip_grad.max_norm if clip_grad is not None else None, **settings)
        self._model: onnx.ModelProto | None = None

    def build(self, parameters) -> str:
        trainable, _ = parameters
        if not trainable:
            raise RuntimeError("the optimizer needs at least one trainable parameter")
        et = trainable[0].data_type
        model = self.base
        cfg = self.config
        names = {"learning_rate", "step", "param", "gradient", "momentum0", "momentum1"}
        dtypes = {"learning_rate": TensorProto.FLOAT, "step": TensorProto.INT64, "param": et, "gradient": et,
                  "momentum0": et, "momentum1": et}
        e = standard_model.emitter(names, 17, dtypes, "update")
        lr = e.Cast("learning_rate", to=et)
        t = e.Cast(e.Add("step", e.scalar_int(1)), to=et)
        inputs = [helper.make_tensor_value_info("learning_rate", TensorProto.FLOAT, []),
                  helper.make_tensor_value_info("step", TensorProto.INT64, []),
                  helper.make_tensor_value_info("param", et, None),
                  helper.make_tensor_value_info("gradient", et, None)]
        if cfg.kind == "SGD":
            outputs = {"updated_param": apply(e, "SGD", {"lr": lr, "p": "param", "g": "gradient"})["p_new"]}
        else:
            inputs += [helper.make_tensor_value_info(f"momentum{i}", et, None) for i in (0, 1)]
            p, m0, m1 = standard_model.adamw_update(e, cfg, lr, t, "param", "gradient", "momentum0", "momentum1")
            outputs = {"updated_param": p, "updated_momentum0": m0, "updated_momentum1": m1}
        model.graph.input.extend(inputs)
        model.graph.node.extend(e.nodes)
        model.graph.node.extend(helper.make_node("Identity", [v], [k]) for k, v in outputs.items())
        model.graph.output.extend(helper.make_tensor_value_info(k, et, None) for k in outputs)
        entry = model.metadata_props.add()
        entry.key, entry.value = standard_model.OPTIMIZER_KEY, cfg.to_json()
        self._model = model
        return "updated_param"

    def to_model_proto(self) -> onnx.ModelProto:
        if self._model is None:
            raise RuntimeError("Please build the forward models first before trying to retrieve it.")
        return self._model


class AdamW(OptimizerBlock):
    """AdamW in ONNX Runtime training's form (eps added to sqrt(v) before the
    bias correction, weight decay after the update; see ``standard_model``)."""

    _kind = "AdamW"

    def __init__(self, bias_correction: bool = True, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0,
                 clip_grad: Optional[ClipGradNorm] = None) -> None:
        super().__init__(clip_grad, bias_correction=bool(bias_correction),
                         betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                         weight_decay=float(weight_decay))


class SGD(OptimizerBlock):
    """p <- p - lr g."""

    _kind = "SGD"

    def __init__(self, clip_grad: Optional[ClipGradNorm] = None) -> None:
        super().__init__(clip_grad)


__all__ = ["AdamW", "SGD", "ClipGradNorm", "OptimizerBlock"]
