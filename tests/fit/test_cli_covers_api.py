"""Issue 34, item 6: the command line covers what the API does.

``inspect`` shows the ``lora`` column docs/llm.md promises (and survives
TorchScript's shared initializers); ``make-training --lora RANK[:ALPHA]
--lora-targets ...`` builds what ``build.LoRA`` builds; ``train --lr`` sets
the rate; every subcommand's ``--help`` ends with examples that parse."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import gemm_inference

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


# ------------------------------------------------------------------ make-training --lora
LLAMA = DATA / "llm" / "llama__dynamo.onnx"


@pytest.mark.parametrize("flags, lora", [
    (["--lora", "4"], build.LoRA(rank=4)),  # alpha: build.LoRA's default
    (["--lora", "4:8", "--lora-targets", "q_proj,v_proj"],
     build.LoRA(rank=4, alpha=8, targets=["q_proj", "v_proj"])),
    (["--lora", "2:3.5", "--lora-targets", "model.model.layers.0.mlp.down_proj.weight"],
     build.LoRA(rank=2, alpha=3.5, targets=["model.model.layers.0.mlp.down_proj.weight"])),
])
def test_make_training_lora_equals_build_lora(capsys, tmp_path, flags, lora):
    out = tmp_path / "lora.onnx"
    assert main(["make-training", str(LLAMA), "-o", str(out), *flags]) == 0
    assert "wrote training model" in capsys.readouterr().out
    api = build.training_model(str(LLAMA), lora=lora)
    assert onnx.load(str(out)).SerializeToString() == api.SerializeToString()


@pytest.mark.parametrize("flags, fragments", [
    (["--lora", "eight"], ["--lora: expected RANK[:ALPHA]", "'eight'"]),
    (["--lora", "0"], ["--lora 0", "rank must be an integer >= 1"]),
    (["--lora", "4:-1"], ["--lora 4:-1", "alpha must be a finite number > 0"]),
    (["--lora-targets", "q_proj"], ["--lora-targets needs --lora"]),
    (["--lora", "4", "--lora-targets", "q_proj,,v_proj"], ["--lora-targets: expected NAME,NAME"]),
    (["--lora", "4", "--lora-targets", "nope"], ["--lora-targets: unknown name 'nope'", "q_proj"]),
    (["--lora", "4", "--frozen", "val_41"], ["--frozen does not go with --lora"]),
])
def test_lora_mistakes_are_one_line(capsys, tmp_path, flags, fragments):
    out = tmp_path / "never.onnx"
    assert main(["make-training", str(LLAMA), "-o", str(out), *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("onnxtrain: error: "), err
    for words in fragments:
        assert words in err, (words, err)
    assert not out.exists()


# ------------------------------------------------------------------ train --lr
def test_train_lr_is_the_sessions_learning_rate(capsys, tmp_path):
    from onnxtrain import TrainingSession

    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 4)).astype(np.float32)
    y = rng.integers(0, 3, 64)
    np.savez(tmp_path / "d.npz", X=X, y=y)
    inference = gemm_inference(4, 3)
    onnx.save(build.training_model(inference, optimizer=build.SGD(lr=0.1)), str(tmp_path / "m.onnx"))
    ckpt = tmp_path / "c.onnx"
    assert main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs",
                 "2", "--lr", "0.02", "-o", str(tmp_path / "o.onnx"), "--checkpoint", str(ckpt),
                 "--no-progress"]) == 0
    assert "lr 0.02" in capsys.readouterr().out
    ref = TrainingSession(tmp_path / "m.onnx")
    assert ref.learning_rate != 0.02
    ref.learning_rate = 0.02
    ref.fit(X, y, epochs=2, batch_size=32, seed=0, progress=False)
    got = TrainingSession(ckpt)
    assert got.learning_rate == 0.02
    for name, value in ref.state.items():
        np.testing.assert_array_equal(got.state[name], value)
    # Over a resumed checkpoint's rate too.
    assert main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs",
                 "3", "--lr", "0.005", "-o", str(tmp_path / "o.onnx"), "--checkpoint", str(ckpt),
                 "--resume", str(ckpt), "--no-progress"]) == 0
    assert "lr 0.005" in capsys.readouterr().out
    assert TrainingSession(ckpt).learning_rate == 0.005


# ------------------------------------------------------------------ --help examples
def subcommands() -> dict[str, argparse.ArgumentParser]:
    from onnxtrain.cli.app import _parser

    (action,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_help_ends_with_examples_after_the_options(capsys, name):
    """Every subcommand, those added later included: at least two example
    command lines, after the options, each of which the parser accepts."""
    assert main([name, "--help"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    assert "examples:" in lines, f"onnxtrain {name} --help has no examples (cli.app.EXAMPLES)"
    at = lines.index("examples:")
    assert at > max(i for i, line in enumerate(lines) if line.lstrip().startswith("-")), \
        "the examples come after the options"
    examples = [line.strip() for line in lines[at + 1:]]
    ours = [line for line in examples if (line + " ").startswith(f"onnxtrain {name} ")]
    assert len(ours) >= 2, examples
    parser = subcommands()[name]
    for line in examples:
        words = shlex.split(line, comments=True)
        words = words[words.index("onnxtrain") + 1:]
        if "&&" in words:
            words = words[:words.index("&&")]
        assert words[0] == name, line
        parser.parse_args(words[1:])  # argparse exits on a line it would refuse
