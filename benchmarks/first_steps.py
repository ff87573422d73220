"""Construction plus first step of W5, W6 and L1 against PyTorch eager, phase by phase, warm and cold.

    python benchmarks/first_steps.py [--workloads W5,W6,L1] [--runs 3] [--baseline DIR] [--json OUT]

Every sample is a fresh process, imports excluded from the clock.  A round
runs each variant of each workload once, one after the other (interleaved,
in the reverse order every other round); round 0 fills the caches and is
not kept.  Variants:

- ``cold`` and ``warm``: onnxtrain with its startup cache emptied before the
  run, and as the rounds before left it (``ONNXTRAIN_CACHE_DIR`` of its own;
  the compiled kernel library is kept, as a user's would be);
- ``before cold`` and ``before warm`` with ``--baseline DIR`` (a folder
  holding an older ``onnxtrain`` package, e.g. ``git archive`` of main): the
  same for it, with a cache of its own;
- the peer, PyTorch eager: W5 and W6 ``worker.py``'s torch trainer (the
  same weights read from their ``torch.save`` file, the model built from
  them, then the first step); L1 peft as ``llm.py``
  runs it (the model from the files on disk, ``get_peft_model``, the first
  step), against onnxtrain as ``llm.py`` runs it (``build.training_model`` of
  the exported file, ``TrainingSession``, the first step).

onnxtrain's phases come from ``startup_phases.instrument`` (timers around
loading, validation, each program, the fused-kernel choice, onnxruntime's
session creation); *the run itself* is the first step less the kernel choice
and session creation.  The second step is timed as well: what the first run
costs beyond a steady one.  Ratios: medians over rounds of onnxtrain's time
over the peer's of the same round.  L1 needs ``benchmarks/.venv-peft``; W5's
and W6's torch peer the interpreter ``run.py`` uses for torch.
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LLM_STEPS = 2  # the first and one steady step

#: Rows, by timer key (labels from startup_phases.PHASES); a key a variant lacks prints empty.
ROW_KEYS = ["startup_ms", "construction", "onnx.load", "training_model()", "TrainingSession()", "session.load",
            "session.validate", "programs.inference_program", "programs.algorithm_programs", "first_step",
            "executed.execute", "ort.InferenceSession", "first_run", "second_step",
            "ort.InferenceSession.ahead"]


def rows() -> list[tuple[str, str]]:
    from startup_phases import PHASES

    labels = {k: label for label, k in PHASES} | {"construction": "  construction",
                                                  "second_step": "second step (steady)"}
    return [(labels[k], k) for k in ROW_KEYS]


# ------------------------------------------------------------------ children
def child_llm(framework: str, work: Path) -> None:
    """L1 as llm.py's worker runs it, with onnxtrain's phases timed."""
    sys.path.insert(0, str(HERE))
    import llm

    spec = llm.spec_of("L1", False)
    files = json.loads((work / "files.json").read_text())
    acc: dict = {}
    if framework == "onnxtrain":
        import onnxruntime  # noqa: F401  (imports are not timed)
        from startup_phases import instrument

        import onnxtrain

        acc, _ = instrument()
        wrap_total(onnxtrain.build, "held_training_model", "training_model()", acc)  # (build.training_session's)
        r = llm.worker_onnxtrain("L1", spec, files, work)
    else:
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401

        r = llm.worker_torch("L1", spec, files, work)
    out = dict(acc)
    out.update(construction=r["setup_s"] * 1e3, first_step=r["step_s"][0] * 1e3,
               second_step=r["step_s"][1] * 1e3, loss=r["losses"][0])
    out["startup_ms"] = out["construction"] + out["first_step"]
    if framework == "onnxtrain":
        out["first_run"] = out["first_step"] - out.get("executed.execute", 0) - out.get("ort.InferenceSession", 0)
    print(json.dumps(out))


def wrap_total(owner, name: str, label: str, acc: dict) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label] = acc.get(label, 0.0) + (time.perf_counter() - t) * 1e3
    setattr(owner, name, wrapper)


def prepare_llm(work: Path) -> None:
    """L1's files (llm.prepare, in the peft venv) and LLM_STEPS batches of tokens."""
    sys.path.insert(0, str(HERE))
    import llm
    import numpy as np

    files = llm.prepare("L1", llm.spec_of("L1", False), work)
    tokens = np.load(work / "L1-tokens.npy")
    np.save(work / "L1-tokens.npy", tokens[:LLM_STEPS])
    (work / "files.json").write_text(json.dumps(files))


# ------------------------------------------------------------------ parent
def run_child(cmd: list[str], env: dict) -> dict:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torch_sample(run, wd: Path, logdir: Path, env: dict) -> dict:
    w = run.Worker("torch", wd, logdir, env=env)
    try:
        ready = w.receive()
        steady = w.ask({"run": 1})["times_ms"][0]
        w.close()
    except BaseException:
        w.kill()
        raise
    return {"construction": ready["build_ms"], "first_step": ready["first_step_ms"],
            "startup_ms": ready["build_ms"] + ready["first_step_ms"], "second_step": steady,
            "loss": ready["losses"][0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="W5,W6,L1")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline", help="folder holding an older onnxtrain package ('before' variants)")
    ap.add_argument("--json")
    ap.add_argument("--child-llm", nargs=2, metavar=("FRAMEWORK", "WORK"), help=argparse.SUPPRESS)
    ap.add_argument("--prepare-llm", metavar="WORK", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_llm:
        child_llm(args.child_llm[0], Path(args.child_llm[1]))
        return 0
    if args.prepare_llm:
        prepare_llm(Path(args.prepare_llm))
        return 0
    sys.path.insert(0, str(HERE))
    import run
    from lora_peft import VENV_PYTHON

    keys = [k for k in args.workloads.split(",") if k]
    trees = {"": str(ROOT)} | ({"before ": str(Path(args.baseline).resolve())} if args.baseline else {})
    variants = [f"{t}{m}" for t in trees for m in ("cold", "warm")] + ["peer"]
    tmp = Path(tempfile.mkdtemp(prefix="onnxtrain-first-steps-"))
    from onnxtrain.kernels import library as kernels

    lib = kernels.library()
    caches = {}  # one per tree and workload: a cold run empties its own only
    for t in trees:
        for key in keys:
            caches[t, key] = tmp / f"cache-{t.strip() or 'now'}-{key}"
            caches[t, key].mkdir()
            if lib:
                shutil.copy2(lib, caches[t, key] / Path(lib).name)
    base_env = run.child_env()
    base_env.pop("ONNXTRAIN_CACHE_DIR", None)
    work = {}
    for key in keys:
        if key == "L1":
            work[key] = tmp / "L1"
            work[key].mkdir()
            env = dict(base_env, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
            subprocess.run([str(VENV_PYTHON), __file__, "--prepare-llm", str(work[key])], env=env, check=True)
        else:
            work[key] = run.prepare(key, tmp / "builder", True)
    results: dict = {k: {v: [] for v in variants} for k in keys}
    loads = []
    try:
        for r in range(args.runs + 1):
            loads.append(os.getloadavg()[0])
            for key in keys:
                # odd rounds run the variants in the reverse order: no variant always follows another
                for variant in (variants if r % 2 == 0 else variants[::-1]):
                    results[key][variant].append(
                        sample(key, variant, work[key], trees, caches, base_env, tmp, run, VENV_PYTHON))
                print(f"round {r} {key}: " + ", ".join(
                    f"{v} {results[key][v][-1]['startup_ms']:.0f}" for v in variants), file=sys.stderr, flush=True)
        for key in keys:
            for variant in variants:
                del results[key][variant][0]  # round 0 filled the caches
        lines = report(results, keys, variants, loads)
        print("\n".join(lines))
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "loads": loads}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def sample(key, variant, wd, trees, caches, base_env, tmp, run, venv_python) -> dict:
    if variant == "peer":
        if key == "L1":
            env = dict(base_env, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
            return run_child([str(venv_python), __file__, "--child-llm", "peft", str(wd)], env)
        return torch_sample(run, wd, tmp, dict(base_env))
    tree = "before " if variant.startswith("before ") else ""
    cache = caches[tree, key]
    if variant.endswith("cold"):
        shutil.rmtree(cache / "startup", ignore_errors=True)
    env = dict(base_env, ONNXTRAIN_CACHE_DIR=str(cache), ONNXTRAIN_PROGRAM_CACHE="1",
               PYTHONPATH=os.pathsep.join([trees[tree], str(HERE)]))
    if key == "L1":
        return run_child([str(venv_python), __file__, "--child-llm", "onnxtrain", str(wd)], env)
    out = run_child([sys.executable, str(HERE / "startup_phases.py"), "--child", str(wd)], env)
    out["construction"] = out["startup_ms"] - out["first_step"]
    return out


def report(results: dict, keys: list[str], variants: list[str], loads: list[float]) -> list[str]:
    def med(rows, k):
        vals = [r[k] for r in rows if k in r]
        return statistics.median(vals) if vals else None

    lines = [f"load average (1 min) at each round's start: {', '.join(f'{x:.1f}' for x in loads)}", ""]
    for key in keys:
        res = results[key]
        lines += [f"### {key} (median ms over {len(res['peer'])} rounds)", "",
                  "| phase | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
        for label, k in rows():
            cells = [med(res[v], k) for v in variants]
            if all(c is None for c in cells):
                continue
            lines.append(f"| {label} | " + " | ".join("" if c is None else f"{c:.0f}" for c in cells) + " |")
        lines += ["", "| variant | first loss | × peer, paired (median over rounds) |", "|---|---|---|"]
        peer = res["peer"]
        for v in variants:
            ratios = [a["startup_ms"] / b["startup_ms"] for a, b in zip(res[v], peer)]
            lines.append(f"| {v} | {res[v][0]['loss']:.6f} | {statistics.median(ratios):.2f} |")
        lines.append("")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
