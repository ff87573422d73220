"""The package's shape, checked on its source (docs/architecture.md):

- no import cycle between modules, counting imports inside functions and
  explicit imports of a package's own ``__init__`` (``from . import x`` of a
  name the ``__init__`` defines);
- no module reads a private name (``_x``) of another module or of another
  module's object, except onnxruntime's own objects in the runtime layer;
- modules stay readable: none over 800 lines, ``session.py`` under 600.

The layers themselves are import-linter's contract in pyproject.toml, which
.ci/run checks with ``lint-imports``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import onnxtrain

ROOT = Path(onnxtrain.__file__).resolve().parent
PKG = ROOT.name


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        if is_init:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_init)
    return out


MODULES = _modules()


def _target(module: str, is_init: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The onnxtrain modules an import statement loads (the deepest that exists)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.split(".")[0] == PKG]
    else:
        if node.level:
            base = module.split(".")
            if not is_init:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
            if origin.split(".")[0] != PKG:
                return []
        names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in MODULES else origin for a in node.names]
    out = []
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES:
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the onnxtrain modules it imports, anywhere in its source.
    Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``: those
    count too, except the packages the importing module itself sits in
    (Python has already run them)."""
    graph: dict[str, set[str]] = {}
    for module, (path, is_init) in MODULES.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for dep in _target(module, is_init, node):
                    parts = dep.split(".")
                    for i in range(1, len(parts) + 1):
                        name = ".".join(parts[:i])
                        inside = module == name or module.startswith(name + ".")
                        if name in MODULES and not inside:
                            deps.add(name)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan),
    and modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_function_level_imports_and_package_inits():
    graph = {"a": {"b"}, "b": set(), "p": {"p.x"}, "p.x": {"p"}}
    assert cycles(graph) == [["p", "p.x"]]
    graph["b"] = {"a"}
    assert ["a", "b"] in cycles(graph)
    # on the real package: a function-level import is an edge
    real = import_graph()
    assert f"{PKG}.train.loop" in real[f"{PKG}.session"]  # imported inside TrainingSession.fit


def _own_privates(tree: ast.Module) -> set[str]:
    """The private attributes the classes of a module define: methods and
    class attributes, and ``self._x = ...`` in their methods (unpacked
    ``self._x, self._y = ...`` included)."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                names.add(node.name)
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            targets = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
            for t in targets:
                if isinstance(t, ast.Name) and t.id.startswith("_"):
                    names.add(t.id)
                elif (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                      and t.value.id == "self" and t.attr.startswith("_")):
                    names.add(t.attr)
    return names


def _private_uses(path: Path) -> list[str]:
    """``x._name`` where ``_name`` is not an attribute that a class of the same
    module defines, ``self._name`` included (a mixin's use of its host's
    private state counts), and ``from m import _name``."""
    found = []
    label = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path.name
    tree = ast.parse(path.read_text())
    own = _own_privates(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if node.attr in own:
                continue  # an attribute a class of this module defines (``self._x`` included)
            if isinstance(owner, ast.Name) and owner.id in ("os", "sys"):
                continue  # the standard library's documented os._exit, sys._getframe
            found.append(f"{label}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{label}:{node.lineno}: imports {alias.name}")
    return found


#: onnxruntime's own objects, reached into by the runtime layer (its IOBinding
#: and the C++ session behind an InferenceSession, for the hot path).
ONNXRUNTIME_PRIVATES = {"binding._iobinding", "sess._sess", "ort.OrtDevice.make('cpu', 0)._get_c_device"}


def test_no_module_uses_another_modules_private_names():
    found = []
    for module, (path, _) in MODULES.items():
        for use in _private_uses(path):
            runtime = module.startswith(f"{PKG}.runtime.")
            if runtime and use.split(": ", 1)[1] in ONNXRUNTIME_PRIVATES:
                continue
            found.append(use)
    assert found == []


def test_the_private_name_check_sees_a_planted_use(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text("from onnxtrain.core.names import NameGen\nNameGen._clean\n")
    assert [u.split(": ")[1] for u in _private_uses(planted)] == ["NameGen._clean"]


def test_the_private_name_check_sees_a_mixin_using_its_hosts_state(tmp_path):
    """``self._x`` counts unless a class of the module defines ``_x``: a mixin
    reading the private state its host class (in another file) sets is caught."""
    planted = tmp_path / "mixin.py"
    planted.write_text(
        "class Mixin:\n"
        "    def step(self):\n"
        "        return self._store, self._own()\n"
        "    def _own(self):\n"
        "        self._mine, self._also = 1, 2\n"
        "        return self._mine + self._also\n"
    )
    assert [u.split(": ")[1] for u in _private_uses(planted)] == ["self._store"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_are_small_enough_to_read(module):
    path, _ = MODULES[module]
    lines = len(path.read_text().splitlines())
    limit = 600 if module == f"{PKG}.session" else 800
    assert lines < limit, f"{module}: {lines} lines (limit {limit}); split it by concept"


def test_every_import_inside_the_package_resolves():
    """Each ``from .x import y`` (inside functions too, where a moved module
    would otherwise fail only when that function first runs) names a module,
    and ``y`` is one of its names or submodules."""
    import importlib
    import importlib.util

    unresolved = []
    for module, (path, is_init) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = module.split(".")
            if not is_init:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
            try:
                mod = importlib.import_module(origin)
            except ImportError as exc:
                if "onnxruntime_genai" in str(exc) or "flatbuffers" in str(exc):
                    continue  # an optional extra that is not installed
                unresolved.append(f"{module}:{node.lineno}: {origin} ({exc})")
                continue
            for alias in node.names:
                if not hasattr(mod, alias.name) and importlib.util.find_spec(f"{origin}.{alias.name}") is None:
                    unresolved.append(f"{module}:{node.lineno}: {origin}.{alias.name}")
    assert unresolved == []
