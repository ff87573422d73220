"""``ForwardBlock`` and ``TrainingBlock``: blocks that finish a model.

A ``TrainingBlock``'s ``build`` returns the loss (and any extra outputs); the
call then makes those the graph outputs and splits the initializers into
trainable parameters (``requires_grad(name)``), frozen ones
(``requires_grad(name, False)``) and constants (the rest, which stay in the
graph).  ``to_model_proto()`` returns (training model, eval model): the
forward pass with its loss, parameters as graph inputs after the user
inputs (in the order of the initializers), ONNX Runtime's eval-model form.
onnxtrain builds the backward pass from it when ``api.Module`` loads it; the
eval model is the same graph in inference mode (``models.eval_mode``).
"""

from __future__ import annotations

import copy
from abc import abstractmethod

import onnx

from ..models import KIND_KEY, eval_mode
from . import blocks


def register_graph_outputs(model: onnx.ModelProto, output_names) -> None:
    """Make ``output_names`` (a name or a tuple of names) the graph outputs."""
    names = [output_names] if isinstance(output_names, str) else list(output_names)
    found = []
    for name in names:
        vi = blocks.value_info(model, name)
        if vi is None:
            raise LookupError(f"The provided name {name} is not a graph value info or a graph output.")
        out = copy.deepcopy(vi)
        out.name = name
        found.append(out)
    del model.graph.output[:]
    model.graph.output.extend(found)


class ForwardBlock(blocks.Block):
    """A block whose ``build`` output becomes the graph output of the model."""

    def __init__(self) -> None:
        super().__init__()
        self._model: onnx.ModelProto | None = None

    @abstractmethod
    def build(self, *args, **kwargs):
        """Return the name(s) of the graph output(s)."""

    def to_model_proto(self) -> onnx.ModelProto:
        if self._model is None:
            raise RuntimeError("Please build the forward models first before trying to retrieve it.")
        return self._model

    def __call__(self, *args, **kwargs):
        output = super().__call__(*args, **kwargs)
        register_graph_outputs(self.base, output)
        self._model = copy.deepcopy(self.base)
        return output


class TrainingBlock(blocks.Block):
    """A block whose ``build`` returns the loss to differentiate (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._requires_grad: set[str] = set()
        self._frozen_params: set[str] = set()
        self._parameters = None
        self._training_model: onnx.ModelProto | None = None
        self._eval_model: onnx.ModelProto | None = None

    @abstractmethod
    def build(self, *args, **kwargs):
        """Return the name of the loss (then any extra outputs)."""

    def requires_grad(self, argument_name: str, value: bool = True) -> None:
        if value:
            self._requires_grad.add(argument_name)
            self._frozen_params.discard(argument_name)
        else:
            self._requires_grad.discard(argument_name)
            self._frozen_params.add(argument_name)

    def parameters(self) -> tuple[list[onnx.TensorProto], list[onnx.TensorProto]]:
        if self._parameters is None:
            raise RuntimeError("Please build the training model first before trying to retrieve the parameters.")
        return self._parameters

    def to_model_proto(self) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        if self._training_model is None or self._eval_model is None:
            raise RuntimeError("Please build the training and eval models first before trying to retrieve them.")
        return self._training_model, self._eval_model

    def __call__(self, *args, **kwargs):
        output = super().__call__(*args, **kwargs)
        model = self.base
        register_graph_outputs(model, output)
        inits = {t.name: t for t in model.graph.initializer}
        for name in sorted(self._requires_grad | self._frozen_params):
            if name not in inits:
                raise ValueError(f"requires_grad: {name!r} is not an initializer of the model")
        for name in sorted(self._requires_grad):
            if inits[name].data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                                             onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
                raise ValueError(f"requires_grad: {name!r} is not a floating-point tensor")
        trainable = [t for t in model.graph.initializer if t.name in self._requires_grad]
        frozen = [t for t in model.graph.initializer if t.name in self._frozen_params]
        self._parameters = (trainable, frozen)
        # parameters become graph inputs after the user inputs, in the order of
        # the initializers, trainable and frozen alike (ORT's eval-model form,
        # the order of Module.get_contiguous_parameters)
        names = {t.name for t in (*trainable, *frozen)}
        params = [t for t in model.graph.initializer if t.name in names]
        kept = [t for t in model.graph.initializer if t.name not in names]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        model.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                 for t in params)
        self._training_model = copy.deepcopy(model)
        self._eval_model = eval_mode(model)  # Dropout off, BatchNormalization on running statistics
        for m, kind in ((self._training_model, "training"), (self._eval_model, "eval")):
            entry = m.metadata_props.add()
            entry.key, entry.value = KIND_KEY, kind
        return output
