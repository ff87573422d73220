"""Issue 34, item 6: the command line covers what the API does.

``inspect`` shows the ``lora`` column docs/llm.md promises (and survives
TorchScript's shared initializers)."""

from __future__ import annotations

from pathlib import Path

from onnxtrain import build
from onnxtrain.cli.app import main

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


def table(capsys, path) -> list[dict[str, str]]:
    """The rows of inspect's parameter table, as dicts keyed by the header."""
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("builder's default"))
    header = out[start + 1]
    names = header.split("  ")
    names = [n.strip() for n in names if n.strip()]
    starts = [header.index(f" {n}") + 1 if i else header.index(n) for i, n in enumerate(names)]
    rows = []
    for line in out[start + 2:]:
        if not line.startswith("  ") or line.startswith("  note:"):
            break
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
        rows.append(dict(zip(names, cells)))
    return rows


# ------------------------------------------------------------------ inspect: lora
def test_inspect_shows_what_lora_does_with_each_weight(capsys):
    path = DATA / "llm" / "llama__dynamo.onnx"
    rows = table(capsys, path)
    assert list(rows[0])[:6] == ["name", "dtype", "shape", "choice", "reason", "lora"]
    shown = {r["name"]: r["lora"] for r in rows}
    expected = {c.name: c.lora or "-" for c in build.parameter_choices(str(path))}
    assert shown == expected
    assert shown["val_41"] == "target" and shown["val_181"] == "head"  # q_proj; the LM head


def test_the_docs_promise_the_column():
    text = (ROOT / "docs" / "llm.md").read_text()
    assert "`lora`" in text and "onnxtrain inspect" in text


def test_inspect_lists_torchscripts_shared_initializers(capsys):
    """TorchScript stores a fresh BatchNorm's running_var as Identity(its weight):
    inspect used to fail with a KeyError on it."""
    rows = table(capsys, DATA / "folding" / "mlp_bn__torchscript.onnx")
    names = {r["name"]: r for r in rows}
    assert (names["1.running_var"]["choice"], names["1.running_var"]["reason"]) == ("constant", "statistic")
