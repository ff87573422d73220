"""Initializers an exporter shared between parameters: which to untie, and how.

Exporters store equal initializers once.  PyTorch trains one tensor per
parameter, so the builder gives each parameter its own initializer again,
and keeps an initializer shared only where one parameter really is used
several times (a module called twice, tied embeddings):

- TorchScript writes the copies as ``Identity(first)`` nodes: each Identity
  whose input is an initializer that something else reads too becomes an
  initializer of its own (``untie_shared_initializers``).
- torch's dynamo exporter reads the one initializer from every node: in a
  freshly initialized Llama all RMSNorm weights (ones) are one initializer
  read by five Mul nodes.  Its node records tell the parameters apart:
  ``pkg.torch.onnx.fx_node`` names the placeholder each node read
  (``%p_model_layers_1_input_layernorm_weight``), ``name_scopes`` its module.
  Where the readers of an initializer name several parameters, each
  parameter's readers get a copy named after it
  (``model.layers.1.input_layernorm.weight``); readers naming one parameter
  keep sharing it.  Without such records for every reader nothing is untied.

``untie_shared_initializers`` returns, per initializer involved, a note that
``build.parameter_choices`` shows (``ParameterChoice.tie``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from ..core.emitter import FLOAT_TYPES
from ..core.graph import DEFAULT_DOMAINS, node_inputs
from ..core.names import NameGen
from .known_names import fx_placeholders, placeholder_name

#: Ops that read only the shape of their input: any copy serves them.
_SHAPE_READERS = {"Shape", "Size"}


def _shared_identities(main: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Identity nodes copying an initializer that something else reads too."""
    inits = {t.name for t in main.initializer}
    readers: dict[str, int] = {}
    for n in main.node:
        for name in node_inputs(n):
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in main.output}
    return [
        n for n in main.node
        if n.op_type == "Identity" and n.domain in DEFAULT_DOMAINS and len(n.input) == 1
        and n.input[0] in inits and len(n.output) == 1 and n.output[0] not in outputs
        and n.output[0] not in inits
        and (readers.get(n.input[0], 0) > 1 or n.input[0] in outputs)
    ]


@dataclass
class Parameter:
    """One parameter the exporter's records name among an initializer's readers."""

    placeholder: str  # p_model_norm_weight
    name: str  # model.norm.weight
    readers: list[onnx.NodeProto] = field(default_factory=list)


@dataclass
class Tie:
    """An initializer read by several nodes, each of which (by the exporter's
    records) reads one of ``parameters``: several of them, an exporter's
    deduplication; one, a parameter used several times."""

    initializer: str
    parameters: list[Parameter]

    @property
    def kept(self) -> Parameter:
        """The parameter that keeps the initializer: the one it is named after, else the first."""
        return next((p for p in self.parameters if p.name == self.initializer), self.parameters[0])

    def note(self) -> str:
        """What becomes of the initializer itself (``ParameterChoice.tie``)."""
        kept = self.kept
        notes = []
        if len(self.parameters) > 1:
            notes.append(f"holds {kept.name}; the {len(self.parameters) - 1} other parameter(s) the "
                         "exporter stored in it are untied")
        if len(kept.readers) > 1:
            notes.append(f"one parameter ({kept.name}) read {len(kept.readers)} times: kept shared")
        return "; ".join(notes)


def needs_untie(main: onnx.GraphProto) -> bool:
    """Whether ``untie_shared_initializers`` would change ``main``."""
    return bool(_shared_identities(main)) or any(len(t.parameters) > 1 for t in exporter_ties(main))


def _placeholder_read(node: onnx.NodeProto, name: str, floats: set[str]) -> str | None:
    """The placeholder the record of ``node`` gives its input ``name``: the
    record lists the parameters and buffers the op read in argument order,
    the node reads the float initializers in input order; when the counts
    agree they pair up (None where they do not, or ``name`` pairs with two)."""
    placeholders = fx_placeholders(node)
    read = [i for i in node.input if i in floats]
    if not placeholders or len(placeholders) != len(read):
        return None
    found = {p for p, i in zip(placeholders, read) if i == name}
    return found.pop() if len(found) == 1 else None


def exporter_ties(main: onnx.GraphProto) -> list[Tie]:
    """Every float initializer that several nodes read, where the exporter's
    records name the parameter each of them reads (see the module doc)."""
    floats = {t.name for t in main.initializer if t.data_type in FLOAT_TYPES}
    readers: dict[str, list[tuple[onnx.NodeProto, str | None]]] = {}
    for n in main.node:
        if n.op_type in _SHAPE_READERS and n.domain in DEFAULT_DOMAINS:
            continue
        for name in dict.fromkeys(node_inputs(n)):
            if name in floats:
                readers.setdefault(name, []).append((n, _placeholder_read(n, name, floats)))
    ties = []
    for name, reads in readers.items():
        if len(reads) < 2 or any(p is None for _, p in reads):
            continue
        parameters: dict[str, Parameter] = {}
        for node, placeholder in reads:
            assert placeholder is not None
            if placeholder not in parameters:
                parameters[placeholder] = Parameter(placeholder, placeholder_name(node, placeholder))
            parameters[placeholder].readers.append(node)
        ties.append(Tie(name, list(parameters.values())))
    return ties


def untie_shared_initializers(main: onnx.GraphProto) -> dict[str, tuple[str, str]]:
    """Give each parameter the exporter stored in a shared initializer its own
    initializer (in place; see the module doc), and return per initializer
    involved (its note: why it was untied, or why it stays shared; the
    initializer a new one copies, or "").

    TorchScript's ``Identity(first)`` copies become initializers of the
    Identity's output name: the BatchNorm weights (ones) of all layers of one
    width, a fresh BatchNorm's running_var ``Identity(its weight)``.  Trained
    as they are, these parameters would be tied (and a running statistic
    would overwrite a weight).  The graph computes the same either way."""
    notes: dict[str, tuple[str, str]] = {}
    inits = {t.name: t for t in main.initializer}
    for n in _shared_identities(main):
        t = onnx.TensorProto()
        t.CopyFrom(inits[n.input[0]])
        t.name = n.output[0]
        main.initializer.append(t)
        main.node.remove(n)
        notes[t.name] = (f"untied from {n.input[0]!r}: the exporter stored equal initializers once "
                         "(an Identity copy)", n.input[0])
    ties = exporter_ties(main)
    names = NameGen.from_graph(main) if any(len(tie.parameters) > 1 for tie in ties) else None
    for tie in ties:
        notes[tie.initializer] = (tie.note(), "")
        others = [p for p in tie.parameters if p is not tie.kept]
        for p in others:
            assert names is not None
            t = onnx.TensorProto()
            t.CopyFrom(inits[tie.initializer])
            t.name = names.fresh(p.name)
            main.initializer.append(t)
            for node in p.readers:
                node.input[:] = [t.name if i == tie.initializer else i for i in node.input]
            notes[t.name] = (f"untied from {tie.initializer!r}: the exporter stored "
                             f"{len(tie.parameters)} equal parameters in it; its records name them "
                             "apart", tie.initializer)
    return notes
