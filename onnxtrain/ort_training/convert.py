"""``import_ort``: a set of ONNX Runtime training artifacts plus a checkpoint ->
one standard ONNX training model that ``TrainingSession``, ``fit`` and the CLI run.

The result (``standard_model.training_model(..., fused=True)``): the main graph is the
forward pass with its loss (parameters as initializers, the checkpoint's
values); one TrainingInfoProto computes the gradient of the loss with
respect to the trainable parameters and applies the optimizer of the
optimizer model (AdamW in 1.19.2's form, or SGD), with the checkpoint's
step count, moments and learning rate as its state (and the running
statistics of training-mode BatchNormalization).  Metadata tells ``fit``
the data inputs, the target (the last user input, where ORT's losses put
labels and targets), the loss and the learning-rate state, and ``export``
the outputs of the inference model: the prediction (and any extra output
of the artifacts), not the loss, so not the labels either.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..io.metadata import set_metadata
from ..io.storage import write_model
from . import checkpoint as ckpt
from . import models
from .standard_model import LR, STEP, OptimizerConfig, moment_name, training_model


def _artifact(folder: Path, prefix: str, name: str, required: bool) -> Path | None:
    path = folder / f"{prefix}{name}"
    if path.is_file():
        return path
    if required:
        raise FileNotFoundError(f"import_ort: {folder} has no {prefix}{name}")
    return None


def import_ort(art_dir: str | os.PathLike, output: str | os.PathLike | None = None,
               prefix: str = "", checkpoint: str | os.PathLike | None = None,
               prediction: str | None = None):
    """Convert the artifacts in ``art_dir`` (``{prefix}training_model.onnx``,
    ``{prefix}eval_model.onnx``, ``{prefix}optimizer_model.onnx``,
    ``{prefix}checkpoint``, or the checkpoint file ``checkpoint``) to one
    training model; write it to ``output`` (atomically) when given.  Returns
    the ModelProto.  Without an optimizer model the model trains with SGD.

    ``prediction``: the value the loss compares with the target, made a
    main-graph output for ``fit``'s metrics; by default the one value the
    loss nodes (those that read the target) take from the model, if there is
    exactly one (otherwise fit needs ``metrics=()``)."""
    folder = Path(os.fspath(art_dir))
    if not folder.is_dir():
        raise FileNotFoundError(f"import_ort: {folder} is not a folder")
    ck_path = Path(checkpoint) if checkpoint is not None else _artifact(folder, prefix, "checkpoint", True)
    ck = ckpt.load(ck_path)
    if ck.nominal:
        raise ValueError(f"import_ort: {ck_path.name} is a nominal checkpoint (no parameter "
                         "values); use the complete checkpoint")
    params = {**ck.trainable, **ck.frozen}
    train_path = _artifact(folder, prefix, "training_model.onnx", False)
    eval_path = _artifact(folder, prefix, "eval_model.onnx", False)
    if train_path is None and eval_path is None:
        raise FileNotFoundError(f"import_ort: {folder} has no {prefix}training_model.onnx")
    try:
        forward = models.forward_model(models.load(train_path or eval_path, "import_ort"),
                                       set(params))
    except NotImplementedError:
        if eval_path is None:
            raise
        forward = models.forward_model(models.load(eval_path, "import_ort"), set(params))
    opt_path = _artifact(folder, prefix, "optimizer_model.onnx", False)
    cfg = (models.optimizer_config(models.load(opt_path, "import_ort")) if opt_path
           else OptimizerConfig("SGD"))
    order = [i.name for i in forward.graph.input if i.name in params]
    order += [n for n in params if n not in order]
    values = {n: params[n] for n in order}
    trainable = [n for n in order if n in ck.trainable]
    extra: dict[str, np.ndarray] = {}
    lr = 0.001
    if ck.optimizer_groups:
        group = ck.optimizer_groups[0]
        lr = group.initial_learning_rate
        extra[STEP] = np.array(group.step, np.int64)
        for p, moments in group.states.items():
            for key, value in moments.items():
                if key.startswith("momentum") and key[8:].isdigit():
                    extra[moment_name(p, int(key[8:]))] = value
    extra[LR] = np.array(lr, np.float32)
    running = models.running_statistics(forward)
    inits = {t.name: t for t in forward.graph.initializer}
    values.update({n: numpy_helper.to_array(inits[n]) for n in running if n not in values})
    model = training_model(forward, values, trainable, cfg, extra, fused=True, running=running)
    user_inputs = [i.name for i in model.graph.input]
    loss = forward.graph.output[0].name
    if len(user_inputs) > 1:
        set_metadata(model, "inputs", user_inputs[:-1])
        set_metadata(model, "target", user_inputs[-1])
        prediction = prediction or _prediction(model.graph, user_inputs[-1])
    if prediction:
        _add_output(model, prediction)
        set_metadata(model, "prediction", prediction)
        # the inference model is the model the artifacts were made from: its
        # outputs without the loss (and so without the labels)
        set_metadata(model, "export_outputs", [o.name for o in model.graph.output if o.name != loss])
    set_metadata(model, "loss", loss)
    set_metadata(model, "trainable", trainable)
    set_metadata(model, "learning_rate", {"state": LR, "base": float(lr)})
    for key, value in ck.properties.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = f"ort_training.property.{key}", str(value)
    if output is not None:
        write_model(model, output)
    return model


def _prediction(graph, target: str) -> str | None:
    """The one model value the target-reading (loss) nodes consume, else None."""
    tainted = {target}
    for node in graph.node:
        if any(i in tainted for i in node.input):
            tainted.update(node.output)
    produced = {o for n in graph.node if not any(i in tainted for i in n.input) for o in n.output}
    found = {i for n in graph.node if any(i in tainted for i in n.input)
             for i in n.input if i in produced}
    return found.pop() if len(found) == 1 else None


def _add_output(model, name: str) -> None:
    graph = model.graph
    if any(o.name == name for o in graph.output):
        return
    if not any(name in n.output for n in graph.node):
        raise ValueError(f"import_ort: prediction {name!r} is not a value of the model")
    graph.output.add().name = name

    inferred = onnx.shape_inference.infer_shapes(model)
    for vi in inferred.graph.value_info:
        if vi.name == name:
            graph.output[-1].CopyFrom(vi)
