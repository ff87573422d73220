"""Every example runs (``--quick``, in a subprocess) and both notebooks execute (nbclient).

The notebooks are stored without outputs; here they run top to bottom in a
kernel of this Python (ipykernel), each cell with a time limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = ROOT / "notebooks"

#: What each example prints when it worked (its own checks also set the exit code).
EXPECTED = {
    "linear_regression.py": ["fitted w ="],
    "mlp_digits.py": ["identical predictions: True"],
    "cnn_digits.py": ["test accuracy"],
    "finetune_frozen.py": ["hidden layer W1, b1 unchanged: True; head W2 changed: True"],
    "gradient_accumulation.py": ["updates: 22 with batches of 64, 22 with 4 x 16 accumulated",
                                 "max |parameter difference| after one epoch"],
    "two_algorithms.py": ["step0 = 1, step1 = 2", "fit with cycle [0, 1]: 90 batches -> "
                          "step0 = 45, step1 = 45"],
    "resume_checkpoint.py": ["identical to the uninterrupted run: True"],
    "distributed_digits.py": ["ranks: 2, global batch 64",
                              "matches one process with the global batch: True"],
    "finetune_large_lora.py": ["loss dropped: True",
                               "merged model in plain onnxruntime matches sess.run: True"],
    # --quick: the committed tiny genai models (tests/data/genai), fp32 LoRA and int4 QLoRA.
    "finetune_genai_lora.py": ["[fp32] after, genai separate: 'the answer is forty two and the sky is blue'",
                               "[int4] after, genai merged:   'the answer is forty two and the sky is blue'",
                               "phrase learned and served by onnxruntime-genai: True"],
}
#: Examples launched on 2 MPI ranks (mpiexec from the mpi extra, beside this Python).
MPI_EXAMPLES = {"distributed_digits.py"}
HELPERS = {"inference_models.py", "decoder_lm.py"}


def test_every_example_is_covered():
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - HELPERS
    assert scripts == set(EXPECTED)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs_quick(script, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    launcher = []
    if script in MPI_EXAMPLES:
        pytest.importorskip("mpi4py")
        mpiexec = Path(sys.executable).parent / "mpiexec"
        if not mpiexec.exists():
            pytest.skip("no mpiexec beside this Python (pip install 'onnxtrain[mpi]')")
        launcher = [str(mpiexec), "-n", "2"]
        env["ONNXTRAIN_THREADS"] = "1"
    proc = subprocess.run(launcher + [sys.executable, str(EXAMPLES / script), "--quick"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for expected in EXPECTED[script]:
        assert expected in proc.stdout, (expected, proc.stdout)
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ notebooks
nbformat = pytest.importorskip("nbformat")


@pytest.mark.parametrize("name", ["quickstart", "anatomy"])
def test_notebook_is_stored_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def execute(name: str, tmp_path: Path):
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    return nb


def text_of(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out["text"])
            elif "data" in out:
                parts.append(out["data"].get("text/plain", ""))
                parts.append(out["data"].get("text/html", ""))
    return "\n".join(parts)


def test_quickstart_notebook_runs(tmp_path):
    nb = execute("quickstart", tmp_path)
    text = text_of(nb)
    assert "accuracy in plain onnxruntime" in text
    assert "History(10 epochs" in text
    assert "state variable" in text  # the session's HTML summary
    assert "epoch 10/10" in text  # the progress bar (stderr)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot:" in text
    else:
        images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
        assert images, "the loss curve was not drawn"


def test_anatomy_notebook_runs(tmp_path):
    text = text_of(execute("anatomy", tmp_path))
    assert "update_binding (13)" in text
    assert "training_info[0].algorithm" in text and "preview ops left: 0" in text
    assert "after initialize(): True" in text
    assert "FitSpec(" in text
