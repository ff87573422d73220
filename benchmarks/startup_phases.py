"""Where the time to first step goes: per-phase wall-clock of onnxtrain's construction and first step.

    python benchmarks/startup_phases.py [--runs 7] [--workloads W1,W2,W4] [--baseline DIR] [--json OUT]

Each sample is a fresh child process doing what ``worker.py``'s onnxtrain
trainer does between its two clocks (imports done first): load the
inference model, make the training model (``onnxtrain.build``, and by hand:
both forms are measured), ``TrainingSession(model)`` and the first
``train_step``.  Inside it, the pipeline's functions are wrapped with
timers: loading, validation, every program built (and its passes), shape
inference, the fused-kernel choice, onnxruntime session creation.  Modes:
``before`` (the package in ``--baseline DIR``, e.g. a copy of an earlier
version, without the cache; ``--baseline-warm`` adds ``before-warm``, with a
warm cache of its own, filled in round 0), ``no-cache``, ``cold`` and
``warm`` (see ``startup.py``).  The
modes of a round run one after the other; medians over ``--runs`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Phases reported, in order: (label, timer key).
PHASES = [
    ("construction + first step", "startup_ms"),
    ("  load the inference model (onnx.load)", "onnx.load"),
    ("  make the training model", "training_model()"),
    ("  TrainingSession(model)", "TrainingSession()"),
    ("    load (parse, hostile-file checks)", "session.load"),
    ("    validate (spec rules, binding types)", "session.validate"),
    ("    inference program", "programs.inference_program"),
    ("    algorithm program", "programs.algorithm_programs"),
    ("      autodiff (Gradient expansion)", "pass.expand_gradient_nodes"),
    ("      optimizer lowering", "pass.lower_optimizer_nodes"),
    ("      fuse Gemm updates", "pass.fuse_gemm_updates"),
    ("      sort and prune", "pass.sort_and_prune"),
    ("    initialization program", "programs.initialization_program"),
    ("  first train_step", "first_step"),
    ("    executed list (fused-kernel choice, rewrite)", "executed.execute"),
    ("    onnxruntime session creation (or the wait for one made ahead)", "ort.InferenceSession"),
    ("    the run itself (binding, kernel library registration)", "first_run"),
    ("onnxruntime sessions made on other threads (ahead, the arena's filler)", "ort.InferenceSession.ahead"),
    ("onnx shape inference, all calls", "onnx.infer_shapes"),
    ("  calls", "onnx.infer_shapes.count"),
]


# ------------------------------------------------------------------ child
def instrument() -> tuple[dict, dict]:
    """Wrap onnxtrain's pipeline functions and onnxruntime's session creation
    with timers; returns (milliseconds so far by label, calls by label), filled
    as the process goes.  ``first_steps.py`` uses it too."""
    import functools
    import threading
    import time
    from collections import defaultdict

    import onnxruntime

    import onnxtrain.autodiff.expand
    import onnxtrain.core.graph
    import onnxtrain.io.model
    import onnxtrain.kernels.library
    import onnxtrain.lower.executed
    import onnxtrain.lower.pipeline
    import onnxtrain.lower.programs
    import onnxtrain.runtime.runner
    import onnxtrain.session

    acc: dict = defaultdict(float)
    count: dict = defaultdict(int)

    def timed(label, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label] += (time.perf_counter() - t) * 1e3
                count[label] += 1
        return wrapper

    def wrap(mod, name, label):
        if hasattr(mod, name):
            setattr(mod, name, timed(label, getattr(mod, name)))

    S, PS = onnxtrain.session, onnxtrain.lower.pipeline
    P, R = onnxtrain.lower.programs, onnxtrain.runtime.runner
    import onnx.shape_inference as SI

    wrap(SI, "infer_shapes", "onnx.infer_shapes")
    for mod, name, label in ((S, "load", "session.load"), (S, "validate", "session.validate"),
                             (P, "inference_program", "programs.inference_program"),
                             (P, "algorithm_programs", "programs.algorithm_programs"),
                             (P, "initialization_program", "programs.initialization_program"),
                             (R, "execute", "executed.execute")):
        wrap(mod, name, label)
    # every step of every declared pass list, timed under its name
    steps = {f for steps in PS.PASS_LISTS.values() for f in steps}
    timed_step = {f: timed("pass." + f.__name__, f) for f in steps}
    for kind, steps in list(PS.PASS_LISTS.items()):
        PS.PASS_LISTS[kind] = tuple(timed_step[f] for f in steps)
    PS.SOURCES = frozenset(timed_step[f] for f in PS.SOURCES)
    PS.READ_ONLY = frozenset(timed_step[f] for f in PS.READ_ONLY)
    # Sessions made on the main thread, and the wait for one made ahead on
    # another (onnxtrain.runtime.ortcache.ahead), are on the first step's
    # path; those made on other threads are reported apart.
    init = onnxruntime.InferenceSession.__init__
    main, threaded = timed("ort.InferenceSession", init), timed("ort.InferenceSession.ahead", init)

    @functools.wraps(init)
    def session_init_any_thread(*a, **k):
        return (main if threading.current_thread() is threading.main_thread() else threaded)(*a, **k)
    onnxruntime.InferenceSession.__init__ = session_init_any_thread
    try:
        import onnxtrain.runtime.ortcache as OC
    except ImportError:  # (an older onnxtrain: no sessions made ahead)
        OC = None
    if OC is not None and hasattr(OC, "ahead"):
        wrap(OC, "ahead", "ort.InferenceSession")
    session_init = onnxtrain.session.TrainingSession.__init__
    onnxtrain.session.TrainingSession.__init__ = timed("TrainingSession()", session_init)
    return acc, count


def child(workdir: Path) -> None:
    import time

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "ONNXTRAIN_THREADS"):
        os.environ.setdefault(var, "2")
    sys.path.insert(0, str(HERE))
    import worker

    worker.import_framework("onnxtrain")
    import onnx
    from training_model import training_session
    from workloads import WORKLOADS


    acc, count = instrument()
    spec, params, batch = worker.load_workdir(workdir)
    worker.onnxtrain_defaults()
    t0 = time.perf_counter()
    inference = onnx.load(str(workdir / "model.onnx"))
    t1 = time.perf_counter()
    sess, how = training_session(inference, WORKLOADS[spec["key"]], use_builder=spec.get("builder", True))
    t3 = time.perf_counter()
    # (the loss only, as the peer computes it: worker.OnnxtrainTrainer.step_loss)
    loss = float(sess.train_step(dict(batch), fetch=["loss"])["loss"])
    t4 = time.perf_counter()
    out = dict(acc)
    sess.train_step(dict(batch), fetch=["loss"])  # a steady step, to compare the first run with
    # (the built model's part: what is not TrainingSession's, timed by instrument)
    out.update({"how": how, "loss": loss, "onnx.load": (t1 - t0) * 1e3,
                "training_model()": (t3 - t1) * 1e3 - acc["TrainingSession()"],
                "first_step": (t4 - t3) * 1e3,
                "second_step": (time.perf_counter() - t4) * 1e3, "startup_ms": (t4 - t0) * 1e3,
                "onnx.infer_shapes.count": float(count.get("onnx.infer_shapes", 0))})
    out["first_run"] = out["first_step"] - out.get("executed.execute", 0) - out.get("ort.InferenceSession", 0)
    print(json.dumps(out))


# ------------------------------------------------------------------ parent
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--workloads", default="W1,W2,W4")
    ap.add_argument("--forms", default="builder,hand-built")
    ap.add_argument("--modes", default="no-cache,cold,warm")
    ap.add_argument("--baseline", help="folder holding an older onnxtrain package (mode 'before')")
    ap.add_argument("--baseline-warm", action="store_true",
                    help="with --baseline: also 'before-warm' (that package, a warm cache of its own)")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(Path(args.child))
        return 0
    sys.path.insert(0, str(HERE))
    import run

    modes = ((["before"] + (["before-warm"] if args.baseline_warm else [])) if args.baseline else []) + [
        m for m in args.modes.split(",") if m]
    tmp = Path(tempfile.mkdtemp(prefix="onnxtrain-phases-"))
    cache = tmp / "cache"
    cache.mkdir()
    from onnxtrain.kernels import library as kernels

    lib = kernels.library()
    if lib:
        shutil.copy2(lib, cache / Path(lib).name)
    bcache = tmp / "cache-before"  # the older package's own entries
    shutil.copytree(cache, bcache)
    results: dict = {}
    try:
        cases = []
        for key in args.workloads.split(","):
            for form in args.forms.split(","):
                wd = run.prepare(key, tmp / form, form == "builder")
                cases.append((f"{key} {form}", wd))
        for r in range(args.runs + 1):  # round 0 fills the cache for "warm" and is not kept
            for label, wd in cases:
                for mode in modes:
                    env = dict(os.environ, ONNXTRAIN_CACHE_DIR=str(bcache if mode == "before-warm" else cache),
                               ONNXTRAIN_PROGRAM_CACHE="0" if mode in ("no-cache", "before") else "1")
                    env["PYTHONPATH"] = os.pathsep.join(
                        ([args.baseline] if mode.startswith("before") else []) + [str(HERE)]
                        + [p for p in [os.environ.get("PYTHONPATH")] if p])
                    if mode == "cold":
                        shutil.rmtree(cache / "startup", ignore_errors=True)
                    if mode == "warm" and r == 0:
                        continue
                    proc = subprocess.run([sys.executable, __file__, "--child", str(wd)], env=env,
                                          capture_output=True, text=True)
                    if proc.returncode:
                        raise SystemExit(proc.stderr[-3000:])
                    if r:
                        results.setdefault(label, {}).setdefault(mode, []).append(
                            json.loads(proc.stdout.strip().splitlines()[-1]))
        header = "| phase (median ms) | " + " | ".join(f"{c} {m}" for c in results for m in modes) + " |"
        print(header)
        print("|---" * (1 + len(results) * len(modes)) + "|")
        for name, key in PHASES:
            cells = []
            for c in results:
                for m in modes:
                    vals = [d.get(key, 0.0) for d in results[c][m]]
                    cells.append(f"{statistics.median(vals):.1f}")
            print(f"| {name} | " + " | ".join(cells) + " |")
        if args.json:
            Path(args.json).write_text(json.dumps({"modes": modes, "runs": args.runs, "results": results}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
