"""The README: its quick start runs as written, it gives the commands CI runs
and says how long the tests take, and its torch block names onnxscript."""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quick_start_runs(tmp_path):
    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 15
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, "README quick start", "exec"), {})
    finally:
        os.chdir(cwd)
    assert (tmp_path / "trained.onnx").exists() and (tmp_path / "checkpoint.onnx").exists()


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = "python3 -m venv .venv && .venv/bin/pip install -e '.[test,mpi]' && .venv/bin/python -m pytest -q -n 2 --dist loadgroup"
    assert test_cmd in text and test_cmd in ci
    assert "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/onnxtrain demo" in text


def test_the_torch_block_names_onnxscript():
    block = next(b for b in re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
                 if "torch.onnx.export" in b)
    first = block.splitlines()[0]
    assert first.startswith("# needs: torch onnxscript ") and "pip install torch onnxscript" in first
    assert "pip install torch onnxscript" in README.read_text().split("```python\n" + block)[0][-400:]


def test_the_readme_says_how_long_the_tests_take():
    text = README.read_text()
    command = ".venv/bin/python -m pytest -q -n 2 --dist loadgroup\n```"
    after = text[text.index(command) + len(command):][:400]
    assert re.search(r"about \d+-\d+ minutes on 2 cores", after), after
    assert re.search(r"\d[\d,]* tests", after), after
