"""Time to first step, side by side: onnxtrain (no cache, cold cache, warm cache) and ONNX Runtime training.

    python benchmarks/startup.py [--workloads W1,W2,W4] [--runs 7] [--hand-built]

Each sample is one fresh child process of ``worker.py train`` (the children of
``run.py``), so the figure is exactly run.py's "first step" column:

- onnxtrain: ``build_ms + first_step_ms`` of the child: the inference model
  loaded, turned into a training model (``onnxtrain.build``, or by hand with
  ``--hand-built``), ``TrainingSession(model)`` and the first ``train_step``;
- ort-training: ``generate_artifacts`` (its own child, like run.py's
  ``artifacts ms``) plus ``build_ms + first_step_ms`` of the trainer child
  (``Module`` + ``Optimizer`` from the artifacts, first step).

onnxtrain runs in three modes (``onnxtrain.core.diskcache``, docs/startup.md):
``no-cache`` (``ONNXTRAIN_PROGRAM_CACHE=0``), ``cold`` (the cache on but
empty: the child lowers every program and writes the entries) and ``warm``
(the entries the cold children wrote); ``--baseline DIR`` adds ``before``:
the onnxtrain package in DIR (e.g. a copy of an earlier version), without
the cache, and ``--baseline-warm`` adds ``before-warm``: that package with a
warm cache of its own.  Every child uses a private cache
directory under the run's temporary folder (the fused-kernel library is
copied there once, so no mode pays for compiling it).  The variants of a
round run one after the other in a rotating order; medians over ``--runs``
rounds are reported, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402
from run import ORT_PYTHON, Worker, ensure_ort_venv, prepare, side_task  # noqa: E402

MODES = ("no-cache", "cold", "warm")


def _onnxtrain_sample(workdir: Path, logdir: Path, mode: str, cache: Path,
                      baseline: str | None = None) -> float:
    env = {"ONNXTRAIN_CACHE_DIR": str(cache),
           "ONNXTRAIN_PROGRAM_CACHE": "0" if mode in ("no-cache", "before") else "1"}
    if mode in ("before", "before-warm"):  # another onnxtrain source tree (a copy of an older version)
        env["PYTHONPATH"] = os.pathsep.join([baseline] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if mode == "cold":
        shutil.rmtree(cache / "startup", ignore_errors=True)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        w = Worker("onnxtrain", workdir, logdir)
        try:
            ready = w.receive()
            w.close()  # a normal exit: the cache writes what it deferred
        finally:
            w.kill()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ready["build_ms"] + ready["first_step_ms"]


def _ort_sample(workdir: Path, logdir: Path, key: str) -> tuple[float, float]:
    art = side_task(str(ORT_PYTHON), ["ort-artifacts", str(workdir)], logdir, f"{key}-ort-artifacts")
    w = Worker("ort-training", workdir, logdir)
    try:
        ready = w.receive()
    finally:
        w.kill()
    return art["generate_ms"], ready["build_ms"] + ready["first_step_ms"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="W1,W2,W4")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--hand-built", action="store_true", help="onnxtrain's hand-written training model")
    ap.add_argument("--modes", default=",".join(MODES), help=f"onnxtrain modes, of {','.join(MODES)}")
    ap.add_argument("--no-ort", action="store_true", help="onnxtrain only")
    ap.add_argument("--json", help="write the samples here")
    ap.add_argument("--baseline", help="a folder holding an older onnxtrain package: adds the mode "
                                       "'onnxtrain before' (that tree on PYTHONPATH)")
    ap.add_argument("--baseline-warm", action="store_true",
                    help="with --baseline: also 'onnxtrain before-warm', the older package with "
                         "a warm cache of its own")
    args = ap.parse_args(argv)
    keys = run.parse_workloads(args.workloads)
    modes = [m for m in args.modes.split(",") if m]
    if args.baseline:
        modes.insert(0, "before")
        if args.baseline_warm:
            modes.insert(1, "before-warm")
    run.CHECK_STEPS = 1
    use_ort = not args.no_ort and ensure_ort_venv(no_setup=True) is None
    tmp = Path(tempfile.mkdtemp(prefix="onnxtrain-startup-"))
    logdir = tmp / "logs"
    logdir.mkdir()
    cache = tmp / "cache"
    cache.mkdir()
    # The fused-kernel library: copied, not compiled, so that no sample pays for cc.
    from onnxtrain.kernels import library as kernels

    lib = kernels.library()
    if lib:
        shutil.copy2(lib, cache / Path(lib).name)
    samples: dict = {}
    try:
        for key in keys:
            workdir = prepare(key, tmp, not args.hand_built)
            variants = [f"onnxtrain {m}" for m in modes] + (["ort-training"] if use_ort else [])
            got: dict[str, list] = {v: [] for v in variants}
            wcache = cache / key
            wcache.mkdir()
            for f in cache.iterdir():
                if f.is_file():
                    shutil.copy2(f, wcache / f.name)
            bcache = cache / f"{key}-before"  # the older package's own entries
            shutil.copytree(wcache, bcache)
            if "warm" in modes:  # fill the cache once
                _onnxtrain_sample(workdir, logdir, "cold", wcache)
            if "before-warm" in modes:
                _onnxtrain_sample(workdir, logdir, "before-warm", bcache, args.baseline)
            for r in range(args.runs):
                order = variants[r % len(variants):] + variants[: r % len(variants)]
                for v in order:
                    if v == "ort-training":
                        got[v].append(_ort_sample(workdir, logdir, key))
                    else:
                        mode = v.split()[1]
                        if mode == "warm" and not (wcache / "startup").exists():
                            _onnxtrain_sample(workdir, logdir, "cold", wcache)
                        where = bcache if mode == "before-warm" else wcache
                        got[v].append(_onnxtrain_sample(workdir, logdir, mode, where, args.baseline))
            samples[key] = got
            line = [f"{key}:"]
            for v, vals in got.items():
                if v == "ort-training":
                    tots = [a + b for a, b in vals]
                    line.append(f"ort-training {statistics.median(tots):.1f} ms ({min(tots):.0f}-{max(tots):.0f}; "
                                f"artifacts {statistics.median(a for a, _ in vals):.1f} "
                                f"+ build/first step {statistics.median(b for _, b in vals):.1f})")
                else:
                    line.append(f"{v} {statistics.median(vals):.1f} ms ({min(vals):.0f}-{max(vals):.0f})")
            print("  ".join(line), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"samples": samples, "runs": args.runs,
                                                   "hand_built": args.hand_built,
                                                   "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                                                   "loadavg": os.getloadavg()}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
