"""Which initializers the builder trains by default: parameters, not constants.

Exporters store more than weights as initializers: attention scales, mask
fills, GELU coefficients, ``Pow`` exponents, baked causal masks, shape
vectors.  ``parameter_choices`` decides, for every floating-point
initializer of an inference graph, whether ``trainable=None`` trains it and
why (one word), and flags doubtful choices; ``choose_trainable`` applies a
user's ``trainable=`` argument on top of it, on the graph where
``ties.untie_shared_initializers`` has undone the exporters' sharing of
equal initializers, so that each parameter trains as its own, as in the
source model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ..core.emitter import FLOAT_TYPES
from ..core.graph import DEFAULT_DOMAINS, identity_source, node_inputs
from ..io.model import ModelLike, load
from .cache import warn
from .constants import constant_reasons
from .known_names import known_names, matches
from .ties import exporter_ties, needs_untie, untie_shared_initializers

# ------------------------------------------------------------------ parameters vs constants
#: Inputs that are statistics or settings of training-mode ops, never trainable,
#: even when named explicitly: (op_type, input index).
NOT_TRAINABLE_INPUTS = {
    ("BatchNormalization", 3),
    ("BatchNormalization", 4),
    ("Dropout", 1),
    ("Dropout", 2),
}

#: (op_type, input index) -> reason: inputs that set how an op behaves rather
#: than carry a learned value.  An initializer whose every use is one of these
#: is a constant by default.  None as the index means every input.
SETTING_INPUTS: dict[tuple[str, int | None], str] = {
    ("BatchNormalization", 3): "statistic",
    ("BatchNormalization", 4): "statistic",
    ("Dropout", 1): "setting",
    ("Dropout", 2): "setting",
    ("Pow", 1): "exponent",
    ("Clip", 1): "bound",
    ("Clip", 2): "bound",
    ("ConstantOfShape", 0): "shape",
    ("Reshape", 1): "shape",
    ("Expand", 1): "shape",
    ("Tile", 1): "shape",
    ("Slice", 1): "shape",
    ("Slice", 2): "shape",
    ("Slice", 3): "shape",
    ("Slice", 4): "shape",
    ("Pad", 1): "shape",
    ("Pad", 2): "fill",
    ("Pad", 3): "shape",
    ("Resize", 1): "shape",
    ("Resize", 2): "shape",
    ("Resize", 3): "shape",
    ("Upsample", 1): "shape",
    ("Range", None): "shape",
    ("TopK", 1): "shape",
    ("Squeeze", 1): "shape",
    ("Unsqueeze", 1): "shape",
    ("OneHot", 1): "shape",
    ("OneHot", 2): "fill",
    ("Gather", 1): "index",
    ("GatherElements", 1): "index",
    ("GatherND", 1): "index",
    ("ScatterElements", 1): "index",
    ("ScatterND", 1): "index",
    ("Equal", None): "comparison",
    ("Less", None): "comparison",
    ("LessOrEqual", None): "comparison",
    ("Greater", None): "comparison",
    ("GreaterOrEqual", None): "comparison",
    ("ArgMax", None): "nondifferentiable",
    ("ArgMin", None): "nondifferentiable",
    ("Sign", None): "nondifferentiable",
    ("Floor", None): "nondifferentiable",
    ("Ceil", None): "nondifferentiable",
    ("Round", None): "nondifferentiable",
    ("IsNaN", None): "nondifferentiable",
    ("IsInf", None): "nondifferentiable",
    ("NonZero", None): "nondifferentiable",
    **{
        (reduce_op, 1): "shape"  # axes
        for reduce_op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
                          "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
                          "ReduceSumSquare")
    },
}

#: Ops that read only the shape of their input: such a use says nothing about
#: whether the tensor is a parameter (exporters read the shapes of weights).
SHAPE_ONLY_OPS = {"Shape", "Size"}

#: Ops whose input 2 is the bias added to a product (a 1-element bias there is a real parameter).
_BIAS_INPUTS = {("Gemm", 2), ("Conv", 2), ("ConvTranspose", 2)}
_PRODUCT_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"}


@dataclass(frozen=True)
class ParameterChoice:
    """What ``trainable=None`` does with one floating-point initializer.

    ``reason`` is one word: "weight" (trained); for a constant "scalar",
    "mask", "positional", "broadcast", "statistic", "setting", "exponent",
    "bound", "fill", "shape", "index", "comparison", "nondifferentiable" or
    "cast"."""

    name: str
    trainable: bool
    reason: str
    #: Why the choice may be wrong, or "" when it looks sound.
    doubt: str = ""
    #: The PyTorch parameter name the exporter's records give it (``val_41`` ->
    #: ``model.layers.0.self_attn.q_proj.weight``; see ``known_names``), or "".
    known_as: str = ""
    #: What ``LoRA(targets=None)`` does with it: "target" (it gets an adapter),
    #: "head" (a language model's output head, left out as peft does), or ""
    #: (not a MatMul/Gemm weight an adapter can go on).
    lora: str = ""
    #: Where the exporter stored it with other parameters (``ties``): why it
    #: was untied ("untied from 'x': ..."), or why it stays shared; else "".
    tie: str = ""
    #: For an initializer the builder makes by untying one (``tie``): the
    #: model's initializer it copies (same values, dtype and shape); else "".
    copy_of: str = ""


def _setting_reason(node: onnx.NodeProto, index: int, size: int) -> str | None:
    """The reason word when input ``index`` of ``node`` is a setting slot, else None."""
    if node.domain not in DEFAULT_DOMAINS or index >= len(node.input):
        return None
    op = node.op_type
    reason = SETTING_INPUTS.get((op, index)) or SETTING_INPUTS.get((op, None))
    if reason is not None:
        return reason
    if op == "Where" and index in (1, 2) and size == 1:
        return "fill"  # a fill value broadcast over the masked positions
    if op == "Cast":
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if to is not None and to not in FLOAT_TYPES:
            return "cast"
    return None


def parameter_choices(model: ModelLike | onnx.GraphProto) -> list[ParameterChoice]:
    """The default trainable set (``trainable=None``), one entry per floating-point
    initializer of the main graph, in initializer order.

    The rule: an initializer is a **constant** (not trained by default) when

    - it is a 0-d scalar (attention scales, mask fill values, GELU
      coefficients, exponents: exporters store these as initializers), or
    - it is an additive mask: every value is 0 or a huge negative fill
      (<= -1e9 or -inf), at least one of them the fill (causal masks that
      exporters bake into initializers), or
    - it is an exporter constant (see ``constants``): a positional table
      (RoPE cos/sin, sinusoidal tables, cos/sin caches: "positional"), a
      mask added to attention scores before Softmax or fed to
      ``Attention``, whatever its values ("mask"), a copy of a value
      expanded over the batch ("broadcast"), or
    - every use of it (through Identity nodes) is a setting slot: a
      BatchNormalization statistic, a Dropout ratio, a ``Pow`` exponent,
      ``Clip`` bounds, the fill branch of ``Where`` when it has one element,
      a ``Pad``/``OneHot`` fill value, a shape-like input (``Reshape``,
      ``Expand``, ``Tile``, ``Slice``, ``Pad``, ``Resize``, ``Range``, ``TopK``,
      ``ConstantOfShape``, axes of ``Squeeze``/``Unsqueeze``/reductions), an
      index (``Gather`` indices), an input of a comparison (``Equal``,
      ``Less``, ``Greater``, ...) or of a non-differentiable op (``ArgMax``,
      ``Floor``, ...), or a ``Cast`` to a non-float type.  ``Shape`` and
      ``Size`` read only the shape: they count as settings ("shape") for an
      initializer nothing else reads, and are ignored otherwise.

    Every other floating-point initializer is a **weight** and is trained,
    whatever its shape (a ``[1]`` bias of a one-output Linear included).  An
    initializer nothing reads is a weight (its gradient is zero).  An
    initializer the exporter stored once for several parameters (TorchScript's
    Identity copies; dynamo's one initializer read by nodes its records say
    read distinct parameters) is judged as the builder unties it
    (``ties.untie_shared_initializers``): one choice per parameter, the copies
    named after their modules, with ``tie`` saying why and ``copy_of`` which
    initializer each copies; a parameter read several times stays one.

    Each choice also carries ``known_as``, the PyTorch parameter name the
    exporter's records give the initializer (``known_names``), and ``lora``,
    what ``LoRA(targets=None)`` does with it: "target", or "head" for a
    language model's output head, which it leaves out as peft does.

    ``doubt`` flags a choice that may be wrong: a trained initializer with
    one element that is not the bias of a product (Gemm/Conv input 2, or an
    Add to a MatMul/Gemm/Conv output), or one used both as a setting and as
    a weight (it is trained)."""
    graph, ties = _judged_graph(model)
    floats = {t.name: t for t in graph.initializer if t.data_type in FLOAT_TYPES}
    reads = _reads(graph, floats)
    producer = {o: n for n in graph.node for o in n.output if o}
    exporter_constants = constant_reasons(graph, [n for n, t in floats.items() if t.dims])
    out = [_choice(name, t, reads, exporter_constants, producer) for name, t in floats.items()]
    return _with_names(graph, out, ties)


def _judged_graph(model: ModelLike | onnx.GraphProto) -> tuple[onnx.GraphProto, dict[str, tuple[str, str]]]:
    """The graph the builder trains (shared initializers untied, on a copy) and the ties it made."""
    graph = model if isinstance(model, onnx.GraphProto) else load(model)[0].graph
    if needs_untie(graph):  # judge the graph the builder trains
        untied = onnx.GraphProto()
        untied.CopyFrom(graph)
        ties = untie_shared_initializers(untied)
        graph = untied
    else:  # (parameters read several times: nothing to untie, a note each)
        ties = {t.initializer: (t.note(), "") for t in exporter_ties(graph)}
    return graph, ties


@dataclass
class _Reads:
    """How the graph reads its floating initializers (through Identity nodes)."""

    settings: dict[str, str]  # name -> first setting reason
    shape_only: set[str]  # names read by Shape / Size
    weight_uses: dict[str, list[tuple[onnx.NodeProto, int]]]  # name -> (node, input index) reading it


def _reads(graph: onnx.GraphProto, floats: dict[str, onnx.TensorProto]) -> _Reads:
    """Each of ``floats``' reads sorted into settings, shape-only reads and weight uses
    (a graph output is a weight use)."""
    source = identity_source(graph)
    reads = _Reads({}, set(), {})
    for n in graph.node:
        if n.op_type == "Identity" and n.domain in DEFAULT_DOMAINS:
            continue  # its consumers count, not the Identity itself
        for idx, name in enumerate(node_inputs(n)):
            name = source(name)
            if name not in floats:
                continue
            if n.op_type in SHAPE_ONLY_OPS and n.domain in DEFAULT_DOMAINS:
                reads.shape_only.add(name)
                continue
            size = int(np.prod(floats[name].dims)) if floats[name].dims else 1
            reason = _setting_reason(n, idx, size)
            if reason is None:
                reads.weight_uses.setdefault(name, []).append((n, idx))
            else:
                reads.settings.setdefault(name, reason)
    for o in graph.output:
        if source(o.name) in floats:
            reads.weight_uses.setdefault(source(o.name), [])
    return reads


def _is_bias(producer: dict[str, onnx.NodeProto], node: onnx.NodeProto, idx: int) -> bool:
    """Input ``idx`` of ``node`` is the bias of a product (its bias slot, or an Add to its output)."""
    if (node.op_type, idx) in _BIAS_INPUTS:
        return True
    if node.op_type == "Add" and len(node.input) == 2:
        other = producer.get(node.input[1 - idx])
        return other is not None and other.op_type in _PRODUCT_OPS
    return False


def _choice(name: str, t: onnx.TensorProto, reads: _Reads, exporter_constants: dict[str, str],
            producer: dict[str, onnx.NodeProto]) -> ParameterChoice:
    """The choice for the floating initializer ``t`` (the rule of ``parameter_choices``)."""
    if len(t.dims) == 0:
        return ParameterChoice(name, False, "scalar")
    if name in exporter_constants:
        return ParameterChoice(name, False, exporter_constants[name])
    settings = reads.settings
    uses = reads.weight_uses.get(name)
    if uses is None and name in settings:
        return ParameterChoice(name, False, settings[name])
    if uses is None and name in reads.shape_only:
        return ParameterChoice(name, False, "shape")
    # A mask is added to scores; a weight read by a product is never read for this check
    # (reading every weight's values would cost a copy of the model).
    added = uses and all(n.op_type in _MASK_READERS for n, _ in uses)
    if added and _is_additive_mask(t):
        return ParameterChoice(name, False, "mask")
    doubt = ""
    if name in settings:
        doubt = f"it is also used as a setting ({settings[name]})"
    elif int(np.prod(t.dims)) == 1 and uses and not all(_is_bias(producer, n, i) for n, i in uses):
        n, _ = uses[0]
        doubt = (f"it has one element (read by {n.op_type} node "
                 f"{n.name or n.op_type!r}) and may be a constant")
    return ParameterChoice(name, True, "weight", doubt)


def _with_names(graph: onnx.GraphProto, choices: list[ParameterChoice],
                ties: dict[str, tuple[str, str]]) -> list[ParameterChoice]:
    """Each choice with its known name, its part in LoRA's default targets and its tie note."""
    from dataclasses import replace

    from .targets import default_targets, eligible_targets

    known = known_names(graph)
    eligible = eligible_targets(graph)[0]
    targets, skipped = default_targets(graph, eligible, known) if eligible else ([], {})
    lora = {**{n: "target" for n in targets}, **{n: "head" for n in skipped}}
    return [replace(c, known_as=known.get(c.name, "") if known.get(c.name) != c.name else "",
                    lora=lora.get(c.name, ""), tie=ties.get(c.name, ("", ""))[0],
                    copy_of=ties.get(c.name, ("", ""))[1]) for c in choices]


#: Magnitude from which a value counts as "minus infinity" in an additive mask
#: (exporters write float32's lowest value, -3.4e38, or -inf, or -1e9 style fills).
_MASK_MAGNITUDE = 1e9
#: Masks larger than this are not inspected (their values would have to be read).
_MASK_MAX_ELEMENTS = 1 << 22


#: Ops through which an additive mask reaches the scores it masks.
_MASK_READERS = {"Add", "Sub", "Where", "Expand", "Reshape", "Slice", "Unsqueeze", "Cast"}


def _is_additive_mask(t: onnx.TensorProto) -> bool:
    """True for an attention-style additive mask: every value is 0 or a huge
    negative fill (<= -1e9, -inf), and at least one is the fill.  Exporters
    bake causal masks into initializers this way; training one would move a
    "minus infinity" by lr and break the masking."""
    size = int(np.prod(t.dims)) if t.dims else 1
    if size > _MASK_MAX_ELEMENTS or t.data_location == onnx.TensorProto.EXTERNAL:
        return False
    try:
        values = numpy_helper.to_array(t)
    except Exception:  # unreadable storage: judged by its uses alone
        return False
    values = values.astype(np.float64, copy=False)
    fill = values <= -_MASK_MAGNITUDE
    return bool(fill.any()) and bool(np.all(fill | (values == 0.0)))


def _not_trainable_by_default(main: onnx.GraphProto) -> set[str]:
    """Initializers read only as BatchNormalization statistics or Dropout settings
    (directly or through Identity nodes): never trainable, even by name."""
    source = identity_source(main)
    settings: set[str] = set()
    other_uses: set[str] = set()
    for n in main.node:
        if n.op_type == "Identity" and n.domain in DEFAULT_DOMAINS:
            continue
        setting_slots = n.domain in DEFAULT_DOMAINS
        for idx, name in enumerate(node_inputs(n)):
            is_setting = setting_slots and idx < len(n.input) and (n.op_type, idx) in NOT_TRAINABLE_INPUTS
            (settings if is_setting else other_uses).add(source(name))
    other_uses.update(source(o.name) for o in main.output)
    return settings - other_uses


def choose_trainable(main: onnx.GraphProto, trainable: Any) -> list[str]:
    """The trainable parameters, in initializer order (see ``parameter_choices``)."""
    floats = [t.name for t in main.initializer if t.data_type in FLOAT_TYPES]
    if not floats:
        raise ValueError(
            "the main graph has no floating-point initializers: there is nothing to train"
        )
    excluded = _not_trainable_by_default(main)
    choices = {c.name: c for c in parameter_choices(main)}
    candidates = [n for n in floats if choices[n].trainable and n not in excluded]
    if trainable is None:
        chosen = candidates
    elif callable(trainable):
        known = known_names(main)
        chosen = [n for n in candidates if trainable(n) or (n in known and trainable(known[n]))]
    elif isinstance(trainable, str):
        raise TypeError(f"trainable must be a list of names, not the string {trainable!r}")
    elif isinstance(trainable, Iterable):
        known = known_names(main)
        wanted: set[str] = set()
        for entry in dict.fromkeys(trainable):
            hits = [n for n in floats if matches(entry, n, known)]
            if not hits:
                raise ValueError(
                    f"unknown trainable name {entry!r}: not a floating-point initializer of the "
                    f"main graph nor a name the exporter recorded; those are "
                    f"{[n if known.get(n, n) == n else f'{n} ({known[n]})' for n in floats]}"
                )
            for name in hits:
                if name in excluded:
                    raise ValueError(
                        f"{name!r} is a BatchNormalization statistic or a Dropout setting and "
                        "cannot be trainable"
                    )
            wanted.update(hits)
        chosen = [n for n in floats if n in wanted]
    else:
        raise TypeError(
            f"trainable must be None, a list of names or a predicate, not {type(trainable).__name__}"
        )
    if not chosen:
        constants = [f"{n} ({choices[n].reason})" for n in floats if not choices[n].trainable]
        raise ValueError(
            f"no trainable parameters selected among {candidates}"
            + (f"; constants by default: {constants[:8]} (name them in trainable=[...] to "
               "train them)" if constants else "")
        )
    if not isinstance(trainable, Iterable) or callable(trainable):
        for name in chosen:
            if choices[name].doubt:
                warn(
                    f"training_model: initializer {name!r} is trained by default, but "
                    f"{choices[name].doubt}; pass trainable=[...] to choose explicitly",
                    stacklevel=5,  # the caller of training_model
                )
    return chosen
