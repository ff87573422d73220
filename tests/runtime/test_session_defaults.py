"""onnxtrain's own onnxruntime defaults: the spinning switch
(``ONNXTRAIN_SPINNING``) and the memory pattern by model size.

A training step's program runs without onnxruntime's memory pattern (planned
at the first run and held besides the arena's blocks: 0.47 GiB more peak on
the L1 benchmark, docs/performance.md) unless the model's weights are under
``SMALL_MODEL_BYTES``, where the pattern makes steps faster for little
memory; the inference program keeps it, and options the caller passes are
never changed."""

from __future__ import annotations

import numpy as np
import pytest
from models import linear_regression

from onnxtrain import TrainingSession
from onnxtrain.runtime import runner
from onnxtrain.runtime.executor import SMALL_MODEL_BYTES
from onnxtrain.runtime.options import SPINNING_ENV, default_session_options

KEY = "session.intra_op.allow_spinning"


def _entry(so) -> str | None:
    try:
        return so.get_session_config_entry(KEY)
    except Exception:  # onnxruntime raises for an entry never set
        return None


@pytest.mark.parametrize(("value", "expected"), [("0", "0"), ("off", "0"), ("1", "1"), ("yes", "1")])
def test_spinning_variable(monkeypatch, value, expected):
    monkeypatch.setenv(SPINNING_ENV, value)
    assert _entry(default_session_options()) == expected


def test_spinning_unset_leaves_onnxruntime_default(monkeypatch):
    monkeypatch.delenv(SPINNING_ENV, raising=False)
    assert _entry(default_session_options()) in (None, "")


def test_spinning_bad_value_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(SPINNING_ENV, "sometimes")
    with pytest.raises(ValueError, match="ONNXTRAIN_SPINNING='sometimes'"):
        default_session_options()


def _executors_made(monkeypatch) -> list[tuple[str, dict]]:
    made: list[tuple[str, dict]] = []
    real = runner.Executor

    def recording(model, providers, session_options, label, *args, **kwargs):
        made.append((label, dict(kwargs, session_options=session_options)))
        return real(model, providers, session_options, label, *args, **kwargs)

    monkeypatch.setattr(runner, "Executor", recording)
    return made


def _feeds(n_in: int = 3, batch: int = 8):
    rng = np.random.default_rng(0)
    return {"X": rng.standard_normal((batch, n_in)).astype(np.float32),
            "T": rng.standard_normal((batch, 1)).astype(np.float32)}


# n_in inputs: the model holds W twice (the weights, the initialization's Constant), 8 * n_in bytes.
@pytest.mark.parametrize(("n_in", "pattern"), [(3, True), (SMALL_MODEL_BYTES // 8 - 64, True),
                                               (SMALL_MODEL_BYTES // 4, False)])
def test_training_step_memory_pattern_by_size(monkeypatch, n_in, pattern):
    made = _executors_made(monkeypatch)
    sess = TrainingSession(linear_regression(n_in=n_in))
    feeds = _feeds(n_in, batch=2)
    before = sess.state["W"].copy()
    sess.train_step(feeds)
    sess.run({"X": feeds["X"]})
    patterns = {label: kw["mem_pattern"] for label, kw in made}
    algorithm = [label for label in patterns if label.endswith("algorithm")]
    assert algorithm and all(patterns[label] is pattern for label in algorithm), patterns
    assert patterns["inference"] is True, patterns
    assert not np.array_equal(sess.state["W"], before)
