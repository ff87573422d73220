"""The builder's ``Plan`` is frozen: everything is decided before a node is
emitted, and ``Algorithm.build`` returns what it learns while emitting
(``Learned``) instead of writing it into the plan; the metadata is made of
those records."""

from __future__ import annotations

import dataclasses

import pytest
from models import inference_mlp

from onnxtrain import build
from onnxtrain.builder.algorithm import Algorithm
from onnxtrain.builder.plan import Learned
from onnxtrain.io.metadata import model_metadata


@pytest.fixture
def builds(monkeypatch):
    """Every ``Algorithm.build`` call of a training_model: (plan, what the plan
    held before, the record returned)."""
    seen = []
    original = Algorithm.build

    def spy(self, ti):
        before = (dict(self.plan.state), self.plan.taken)
        learned = original(self, ti)
        seen.append((self.plan, before, learned))
        return learned

    monkeypatch.setattr(Algorithm, "build", spy)
    return seen


def test_the_plan_is_frozen_and_build_returns_what_it_learned(builds):
    tm = build.training_model(inference_mlp(batch_norm=True), optimizer=build.Adam(lr=1e-2),
                              clip_grad_norm=0.5, schedule=build.cosine(), accumulate=2)
    meta = model_metadata(tm)
    (plan, before0, first), (same, before1, final) = builds
    assert same is plan
    for name, value in (("loss_name", "other"), ("accumulate", 3), ("params", [])):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, name, value)
    # nothing written into the plan while emitting
    assert before0 == before1 == (dict(plan.state), plan.taken)
    assert isinstance(first, Learned) and isinstance(final, Learned)
    with pytest.raises(dataclasses.FrozenInstanceError):
        final.lr_state = "x"
    # accumulate=2: algorithm 0 adds into the sums and ends; the final one
    # clips, sets the rate and its schedule, and updates
    assert (first.index, first.lr_state, first.clip_state, first.hyperparameters) == (0, "", "", ())
    assert first.running_stats and first.train_prediction == meta["train_prediction"]["0"]
    assert final.index == 1 and not final.running_stats
    assert final.lr_state == meta["learning_rate"]["state"] and final.lr_value == meta["learning_rate"]["value"]
    assert final.clip_state == meta["clip_grad_norm"]["state"]
    assert final.schedule_total == meta["schedule"]["state"]
    assert list(final.reduce_points) == meta["data_parallel"]["reduce"]["1"]
    settings = [h.name for h in final.hyperparameters]
    assert settings == ["clip_grad_norm", "lr", "schedule_total"]
    assert meta["optimizer_state"][-3:] == settings
    assert not set(settings) & plan.taken


def test_one_algorithm_learns_the_rate(builds):
    tm = build.training_model(inference_mlp(), optimizer=build.SGD(lr=0.1))
    meta = model_metadata(tm)
    ((plan, _, learned),) = builds
    assert learned.index == 0 and learned.lr_state == learned.lr_value == meta["learning_rate"]["state"]
    assert not learned.running_stats and not learned.train_prediction and not learned.reduce_points
    assert "batchnorm_var" not in meta and meta.get("train_prediction", {}) == {}
