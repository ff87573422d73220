"""The model blocks build on: ``base(model)``, ``empty_base()`` (context managers)."""

from __future__ import annotations

import contextlib
import copy
import itertools

import onnx
from onnx import helper

from ...core.names import NameGen


class ModelAccessor:
    """Holds the model the blocks of a ``with base(...)`` build on (``.model``)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._model = model
        self._counter = itertools.count()
        self._given: set[str] = set()

    @property
    def model(self) -> onnx.ModelProto:
        return self._model

    def fresh(self, hint: str) -> str:
        """A value name not yet used in the model: ``onnx::<hint>::<n>``, as
        ONNX Runtime's blocks name theirs (``core.names.NameGen`` keeps it unused)."""
        names = NameGen.from_graph(self._model.graph)  # the model grows between calls
        names.reserve(self._given)
        name = names.fresh(f"onnx::{hint}::{next(self._counter)}")
        self._given.add(name)
        return name


_ACCESSOR: ModelAccessor | None = None


def current() -> ModelAccessor:
    if _ACCESSOR is None:
        raise RuntimeError("no base model: build blocks inside `with onnxblock.base(model):` or "
                           "`with onnxblock.empty_base():`")
    return _ACCESSOR


@contextlib.contextmanager
def _registered(model: onnx.ModelProto):
    global _ACCESSOR
    previous, _ACCESSOR = _ACCESSOR, ModelAccessor(model)
    try:
        yield _ACCESSOR
    finally:
        _ACCESSOR = previous


def base(model: onnx.ModelProto, model_path: str | None = None):
    """Blocks called inside ``with base(model) as handle:`` add to a copy of
    ``model`` (``handle.model``); ``model`` itself is not changed."""
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"base: expected an onnx.ModelProto, got {type(model)}")
    return _registered(copy.deepcopy(model))


def empty_base(opset_version: int | None = None):
    """Blocks called inside add to a new, empty model (default-domain opset
    ``opset_version``, else onnx's current one)."""
    version = opset_version or onnx.defs.onnx_opset_version()
    model = helper.make_model(helper.make_graph([], "graph", [], []),
                              opset_imports=[helper.make_opsetid("", version)])
    return _registered(model)


def custom_op_library(custom_op_library_path):
    """Custom-op libraries are not supported: onnxtrain differentiates standard ONNX only."""
    raise NotImplementedError(
        "onnxblock.custom_op_library: custom-op libraries are not supported by "
        "onnxtrain.ort_training (gradients are built for standard ONNX ops only)")
