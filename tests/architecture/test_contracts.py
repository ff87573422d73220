"""import-linter's contracts in pyproject.toml cover the whole package.

Its lists are written by hand, so a new top-level module or package could
slip past them: the layers contract must place every one of them, and each
library contract ("X is imported by ... only") must forbid the library to
every top-level module or package but its owners (docs/architecture.md,
"Who owns each outside library").
"""

from __future__ import annotations

from pathlib import Path

import pytest

import onnxtrain

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PACKAGE = Path(onnxtrain.__file__).resolve().parent
PKG = PACKAGE.name

#: Each outside library's owners, as docs/architecture.md lists them.
OWNERS = {
    "onnxruntime": {"runtime"},
    "flatbuffers": {"ort_training"},
    "mpi4py": {"parallel"},
    "google": {"io"},
    "tqdm": {"train", "cli"},
}


def top_level() -> set[str]:
    """The package's top-level modules and subpackages, as ``onnxtrain.x``."""
    names = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    return {f"{PKG}.{n}" for n in names}


def contracts() -> list[dict]:
    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    return config["tool"]["importlinter"]["contracts"]


def test_the_layers_place_every_top_level_module():
    (layers,) = [c for c in contracts() if c["type"] == "layers"]
    placed = [name.strip() for layer in layers["layers"] for name in layer.split("|")]
    assert len(placed) == len(set(placed)), "a module sits in two layers"
    assert set(placed) == top_level()


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_a_library_is_forbidden_to_every_module_but_its_owners(library):
    (contract,) = [c for c in contracts() if c["type"] == "forbidden" and c["forbidden_modules"] == [library]]
    sources = set(contract["source_modules"])
    owners = {f"{PKG}.{o}" for o in OWNERS[library]}
    assert sources.isdisjoint(owners), f"{library}: an owner is among the sources"
    missing = sorted(top_level() - owners - sources)
    assert missing == [], f"{library}: not forbidden to {missing}"
    assert sources <= top_level(), f"{library}: sources that do not exist: {sorted(sources - top_level())}"


def test_every_library_contract_names_its_owners_here():
    """Every forbidden contract about an outside library (one whose modules are
    not onnxtrain's: the contracts between onnxtrain's own packages, such as
    "the builder is pure", are not about owners) has its owners here."""
    libraries = {lib for c in contracts() if c["type"] == "forbidden" for lib in c["forbidden_modules"]
                 if not lib.startswith(f"{PKG}.")}
    assert libraries == set(OWNERS)


def test_the_package_has_the_modules_the_contracts_are_about():
    names = top_level()
    assert {f"{PKG}.{n}" for n in ("runtime", "io", "session", "genai", "ort_training", "__main__")} <= names
    assert f"{PKG}.data" not in names  # a data folder, not a package
