"""Every dotted ``onnxtrain.`` name the docs mention exists.

The docstrings of the package (modules, classes, functions), README.md and
docs/*.md name modules and their attributes as ``onnxtrain.io.mapped`` or
``onnxtrain.build.training_model``; each such name imports (a module, or an
attribute reached from the deepest module that imports).  The other dotted
``onnxtrain.`` words are the metadata contract's keys (``onnxtrain.cycle``:
``onnxtrain.io.metadata.KEYS``) and the rule-call node names
(``onnxtrain.rule/SGD/...``), which are not Python names.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import onnxtrain
from onnxtrain.io.metadata import KEYS

PACKAGE = Path(onnxtrain.__file__).resolve().parent
ROOT = PACKAGE.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: ``onnxtrain`` then dotted names; not part of a longer word, a path or a URL.
NAME = re.compile(r"(?<![\w./-])onnxtrain(?:\.[A-Za-z_]\w*)+(?![\w/])")


def docstrings(path: Path):
    """(line, text) of every docstring of a module."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield getattr(node, "lineno", 1), text


def mentions() -> list[tuple[str, str]]:
    """(dotted name, where) for every mention in docstrings and docs."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in docstrings(path):
            found += [(m.group(0), f"{path.relative_to(ROOT)}:{line}") for m in NAME.finditer(text)]
    for path in DOCS:
        text = path.read_text()
        found += [(m.group(0), f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
                  for m in NAME.finditer(text)]
    return found


def resolves(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute path of the deepest module of it that imports."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if not (module == exc.name or module.startswith(f"{exc.name}.")):
                raise  # the module exists but fails to import: not a stale name
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def metadata_key(name: str) -> bool:
    return name.count(".") == 1 and name.split(".")[1] in KEYS


def test_the_docs_mention_many_names():
    names = {name for name, _ in mentions()}
    assert len(names) > 40 and "onnxtrain.build" in names and "onnxtrain.cycle" in names


def test_every_dotted_onnxtrain_name_imports():
    stale = sorted({f"{where}: {name}" for name, where in mentions()
                    if not metadata_key(name) and not resolves(name)})
    assert stale == []


@pytest.mark.parametrize("name, ok", [
    ("onnxtrain.io.mapped", True), ("onnxtrain.build.training_model", True),
    ("onnxtrain.mapped", False), ("onnxtrain.build.no_such_thing", False),
    ("onnxtrain.lower.no_such_module", False),
])
def test_resolves_tells_stale_names(name, ok):
    assert resolves(name) is ok


def test_the_pattern_skips_paths_and_node_names():
    text = ("see onnxtrain.io.mapped. Paths: onnxtrain/io/mapped.py, js/onnxtrain.js; node "
            "onnxtrain.rule/SGD/-/float32/c/0; pip install onnxtrain[genai]; `onnxtrain.cycle`")
    assert [m.group(0) for m in NAME.finditer(text)] == ["onnxtrain.io.mapped", "onnxtrain.cycle"]
