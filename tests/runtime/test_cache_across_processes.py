"""The startup cache serves a second process: nothing that a session does at
run time may enter the key of its lowered programs.

``runtime_digest`` hashes the module-level values of the lowering layers, so
a module there that keeps run-time state (and does not opt out with
``__fingerprint__ = False``) gives every process a key of its own.  Round 27
found one: the locks of the folder of held weights (``core.files``), named
by a path with the process id in it.  Every warm start of a model with held
weights then lowered its programs again and wrote one more entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    sys.path.insert(0, {builder_tests!r})
    import onnxtrain
    from onnxtrain import TrainingSession, build
    from onnxtrain.core import diskcache
    from onnxtrain.core.fingerprint import module_digest
    from onnxtrain.io import mapped, storage
    from onnxtrain.lower import program_cache
    from test_build import blobs, mlp

    def lowering_modules():
        for layer in program_cache.LOWERING_LAYERS:
            package = importlib.import_module("onnxtrain." + layer)
            yield package.__name__
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                importlib.import_module(info.name)
                yield info.name

    names = sorted(set(lowering_modules()))
    before = {{n: module_digest(n) for n in names}}
    storage.HOLD_FROM = 64 << 10  # the frozen weights held, in this process's folder
    model = build.training_model(mlp(sizes=(4, 8192, 3)), loss="cross_entropy", target="label",
                                 optimizer=build.AdamW(lr=0.05), trainable=["b1", "b2"])
    x, label = blobs()
    sess = TrainingSession(model)
    loss = float(sess.train_step({{"X": x, "label": label}})["loss"])
    sess.run({{"X": x}})
    held = sorted(t.name for t in sess.model.graph.initializer if mapped.is_owned(t))
    changed = [n for n in names if module_digest(n) != before[n]]
    diskcache.flush()
    print(json.dumps({{"changed": changed, "held": held, "loss": loss, "stats": dict(diskcache.stats)}}))
""")


def _start(cache: Path) -> dict:
    env = dict(os.environ, ONNXTRAIN_CACHE_DIR=str(cache), ONNXTRAIN_PROGRAM_CACHE="1")
    code = SCRIPT.format(builder_tests=str(Path(__file__).resolve().parents[1] / "builder"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_hits_the_programs_of_a_model_with_held_weights(tmp_path):
    first = _start(tmp_path)
    assert first["held"] == ["W1", "W2"]
    assert first["changed"] == []  # a session changed no value that the key hashes
    assert first["stats"].get("program.miss", 0) >= 1
    second = _start(tmp_path)
    assert second["stats"].get("program.miss", 0) == 0
    assert second["stats"].get("program.hit", 0) == first["stats"]["program.miss"]
    assert second["loss"] == first["loss"]
