"""docs/bundle.md is the field-by-field reference the JavaScript package is
written against: its example manifest and its field table name exactly the
fields ``onnxtrain.bundle.save`` writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from models import mlp_classifier

from onnxtrain import TrainingSession, bundle

DOC = Path(__file__).resolve().parents[2] / "docs" / "bundle.md"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    sess = TrainingSession(mlp_classifier("adam", groups=[["W1", "b1"], ["W2", "b2"]]))
    x = np.zeros((4, 4), np.float32)
    sess.fit((x, np.zeros(4, np.int64)), epochs=1, batch_size=4, progress=False)
    folder = tmp_path_factory.mktemp("doc") / "b"
    bundle.save(sess, folder)
    return json.loads((folder / "manifest.json").read_text())


def documented_example() -> dict:
    (block,) = re.findall(r"```json\n(.*?)```", DOC.read_text(), re.S)
    return json.loads(block)


def test_the_example_manifest_has_the_written_fields(written):
    example = documented_example()
    assert list(example) == list(written)
    assert example["format"] == written["format"] and example["version"] == written["version"] == bundle.VERSION
    assert set(example["state"][0]) == set(written["state"][0])
    assert set(example["inference"]) == set(written["inference"])
    assert set(example["algorithms"][0]) == set(written["algorithms"][0])
    assert set(example["initializations"][0]) == set(written["initializations"][0])
    assert set(example["training"]) == set(written["training"])
    assert set(example["fit_position"]) == set(written["fit_position"])


def test_the_field_table_names_every_written_field(written):
    rows = re.findall(r"^\| (`[^|]+`) \|", DOC.read_text(), re.M)
    documented = {name.removesuffix("[i]") for row in rows for name in re.findall(r"`([^`]+)`", row)}
    assert documented == set(written)
