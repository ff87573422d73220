"""Running the JavaScript package from Python's tests (tests/js/).

The tests need Node (>= 18) and ``js/node_modules`` (``cd js &&
ONNXRUNTIME_NODE_INSTALL=skip npm ci``).  Where either is missing they FAIL,
naming what to install, so that CI cannot pass without running them; set
``ONNXTRAIN_JS_TESTS=0`` to skip them on a machine without Node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
JS = ROOT / "js"


def require_node() -> str:
    """The node executable, or a skip (ONNXTRAIN_JS_TESTS=0) or a failure naming what is missing."""
    if os.environ.get("ONNXTRAIN_JS_TESTS") == "0":
        pytest.skip("ONNXTRAIN_JS_TESTS=0: the JavaScript tests are switched off")
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: the JavaScript tests need Node >= 18 "
                    "(or set ONNXTRAIN_JS_TESTS=0 to skip them)")
    for package in ("onnxruntime-node", "onnxruntime-web"):
        if not (JS / "node_modules" / package).is_dir():
            pytest.fail(f"js/node_modules/{package} is missing: run `cd js && "
                        "ONNXRUNTIME_NODE_INSTALL=skip npm ci` (or set ONNXTRAIN_JS_TESTS=0)")
    return node


def run_node(args: list[str], cwd: Path | None = None, timeout: float = 300) -> str:
    """Run node with ``args``; returns stdout, fails the test with both streams on an error."""
    node = require_node()
    proc = subprocess.run([node, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or ROOT)
    if proc.returncode != 0:
        pytest.fail(f"node {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


class Spec:
    """A spec for js/test/train_bundle.mjs: arrays written beside it."""

    def __init__(self, folder: Path, bundle: Path, out: Path, runtime: str = "node"):
        self.folder = folder
        self.count = 0
        self.data: dict[str, Any] = {"bundle": str(bundle), "out": str(out), "runtime": runtime,
                                     "steps": []}

    def array(self, value: np.ndarray) -> dict[str, Any]:
        value = np.asarray(value)
        self.count += 1
        path = self.folder / f"array{self.count}.bin"
        path.write_bytes(value.tobytes())
        return {"file": path.name, "dtype": value.dtype.name, "shape": list(value.shape)}

    def step(self, feeds: dict[str, np.ndarray], algorithm: int | None = None) -> None:
        self.data["steps"].append({"feeds": {k: self.array(v) for k, v in feeds.items()},
                                   "algorithm": algorithm})

    def fit(self, feeds: dict[str, np.ndarray], epochs: int, batch_size: int) -> None:
        self.data["fit"] = {"feeds": {k: self.array(v) for k, v in feeds.items()},
                            "epochs": epochs, "batchSize": batch_size}

    def run(self) -> dict[str, Any]:
        path = self.folder / "spec.json"
        path.write_text(json.dumps(self.data))
        out = run_node([str(JS / "test" / "train_bundle.mjs"), str(path)])
        return json.loads(out.strip().splitlines()[-1])
