"""Where the ort_training tests' data lives (tests/data/ort_training, written by
scripts/make_ort_artifacts.py) and the MLP's parameter names."""

from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data" / "ort_training"
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
