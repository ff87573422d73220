"""Every ```python block of README.md runs as written (issue 27, point 6).

The blocks run top to bottom in one fresh interpreter, in a fresh folder, in
one namespace (a later block may use an earlier block's names).  A block whose
first line is ``# needs: MODULE ...`` (torch onnxscript, mpi4py) runs where
those modules are installed and is skipped elsewhere; listings that are not code use another
fence."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

DRIVER = r"""
import importlib.util, json, sys, traceback
blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for i, code in enumerate(blocks):
    first = code.splitlines()[0] if code.strip() else ""
    needs = first.split("needs:", 1)[1].split("(")[0].split() if first.startswith("# needs:") else []
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        print(f"README BLOCK {i} SKIPPED {' '.join(missing)}", flush=True)
        continue
    try:
        exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"README BLOCK {i} FAILED", flush=True)
        sys.exit(1)
    print(f"README BLOCK {i} OK", flush=True)
"""


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_the_second_block_goes_from_an_inference_model_to_export():
    second = python_blocks()[1]
    assert "helper.make_model" in second or ".onnx" in second
    for step in ("build.training_model(", ".fit(", ".evaluate(", ".export("):
        assert step in second, step
    assert "# needs:" not in second  # it runs everywhere


def test_every_python_block_runs_top_to_bottom(tmp_path):
    pytest.importorskip("matplotlib")  # history.plot() in the fit block (the test extra)
    blocks = python_blocks()
    assert len(blocks) >= 6
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(blocks),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    report = proc.stdout + proc.stderr[-6000:]
    assert proc.returncode == 0, report
    done = re.findall(r"README BLOCK (\d+) (OK|SKIPPED)", proc.stdout)
    assert [int(i) for i, _ in done] == list(range(len(blocks))), report
    ran = [int(i) for i, status in done if status == "OK"]
    assert {0, 1} <= set(ran)
    # What the blocks say they write, in the fresh folder.
    for name in ("trained.onnx", "checkpoint.onnx", "model.onnx", "merged.onnx",
                 "adapters.npz", "ckpt.onnx", "log.csv"):
        assert (tmp_path / name).exists(), name
