"""One source of fresh tensor and node names per program."""

from __future__ import annotations

import re
from collections.abc import Iterable

import onnx

from .graph import graph_names


class NameGen:
    """Hands out names that collide with nothing already in use.

    >>> names = NameGen(["x", "x_grad"])
    >>> names.fresh("x_grad")
    'x_grad_1'
    >>> names.fresh("x_grad")
    'x_grad_2'
    """

    _clean = re.compile(r"[^0-9A-Za-z_./:-]")

    @classmethod
    def base(cls, hint: str) -> str:
        """The name ``fresh(hint)`` starts from: ``hint`` with characters
        outside ``[0-9A-Za-z_./:-]`` replaced by ``_``."""
        return cls._clean.sub("_", hint) or "t"

    def __init__(self, used: Iterable[str] = ()) -> None:
        self._used: set[str] = set(used)
        self._counter: dict[str, int] = {}

    @classmethod
    def from_graph(cls, graph: onnx.GraphProto, *more: Iterable[str]) -> NameGen:
        """A generator that avoids every name of ``graph`` (subgraphs included,
        see ``graph.graph_names``) and the names in ``more``."""
        names = cls(graph_names(graph))
        for extra in more:
            names.reserve(extra)
        return names

    def reserve(self, names: Iterable[str]) -> None:
        """Mark names as taken."""
        self._used.update(names)

    def fresh(self, hint: str = "t") -> str:
        """A new unused name that starts with ``hint``."""
        base = self.base(hint)
        if base not in self._used:
            self._used.add(base)
            return base
        n = self._counter.get(base, 0)
        while True:
            n += 1
            candidate = f"{base}_{n}"
            if candidate not in self._used:
                self._counter[base] = n
                self._used.add(candidate)
                return candidate
