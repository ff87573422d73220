"""Step time of this onnxtrain against another commit's, side by side.

    python benchmarks/ab.py --baseline COMMIT [--workloads W1,W2,W3,W4,W5,W6,W7] [--rounds 8] [--scale 0.5]
                            [--no-builder]

For a restructuring that must not change speed ("the performance of W1-W7
unchanged within noise, measured side by side against the commit before"):
the other commit's package (``git archive COMMIT onnxtrain``) goes into a
temporary folder that leads the PYTHONPATH of its children, and each
workload trains in two children, ``before`` and ``after`` (this tree), on
the same inference model, weights and batch (``run.prepare``), with
``run.py``'s child settings (2 threads, idle threads blocking).  The two
are driven in interleaved rounds, the order alternating, so that a change
of machine load hits both alike.  Reported per workload: the median ms per
step of each, after/before with the spread of the per-round ratios, and
whether the first losses agree (the same training).

W5 and W6 need the ONNX Runtime training environment's exports
(``benchmarks/.cache``, made by ``run.py``); they are skipped without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402
from workloads import WORKLOADS  # noqa: E402


def baseline_package(commit: str, dest: Path) -> str:
    """The commit's onnxtrain package under ``dest``; its full hash."""
    full = subprocess.run(["git", "rev-parse", commit], cwd=HERE.parent, check=True,
                          capture_output=True, text=True).stdout.strip()
    data = subprocess.run(["git", "archive", full, "onnxtrain"], cwd=HERE.parent, check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return full


def worker(version: str, workdir: Path, logdir: Path, baseline: Path) -> run.Worker:
    """A trainer child of ``version`` ("before": the baseline package first on its path)."""
    env = run.child_env()
    if version == "before":
        env["PYTHONPATH"] = f"{baseline}:{env['PYTHONPATH']}"
    return run.Worker("onnxtrain", workdir, logdir / version, env=env)


def which_package(baseline: Path) -> str:
    """Where a before child's ``import onnxtrain`` comes from (run, like them, outside this tree)."""
    env = run.child_env()
    env["PYTHONPATH"] = f"{baseline}:{env['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-c", "import onnxtrain; print(onnxtrain.__file__)"], env=env,
                          cwd=baseline.parent, check=True, capture_output=True, text=True).stdout.strip()


def bench(key: str, workdir: Path, logdir: Path, baseline: Path, rounds: int, scale: float) -> dict:
    steps = max(rounds, int(WORKLOADS[key].default_steps * scale))
    per_round = max(1, steps // rounds)
    workers = {v: worker(v, workdir, logdir, baseline) for v in ("before", "after")}
    try:
        ready = {v: w.receive() for v, w in workers.items()}
        for w in workers.values():
            w.ask({"run": max(3, per_round // 4)})  # warm-up
        medians: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(rounds):
            for v in (("before", "after") if r % 2 == 0 else ("after", "before")):
                medians[v].append(statistics.median(workers[v].ask({"run": per_round})["times_ms"]))
    finally:
        for w in workers.values():
            w.kill()
    ratios = sorted(a / b for a, b in zip(medians["after"], medians["before"]))
    losses = {v: ready[v]["losses"] for v in ready}
    return {
        "before_ms": statistics.median(medians["before"]), "after_ms": statistics.median(medians["after"]),
        "ratio": statistics.median(ratios), "ratio_low": ratios[0], "ratio_high": ratios[-1],
        "same_losses": losses["before"] == losses["after"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["before"], losses["after"])),
        "steps_per_round": per_round,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the commit to compare with (git rev)")
    ap.add_argument("--workloads", default="W1,W2,W3,W4,W5,W6,W7")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--scale", type=float, default=0.5, help="timed steps: the workload's default times this")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--no-builder", action="store_true", help="the hand-written training models, as run.py's")
    args = ap.parse_args(argv)
    keys = run.parse_workloads(args.workloads)
    with tempfile.TemporaryDirectory(prefix="onnxtrain-ab-") as tmp:
        root, baseline, logdir = Path(tmp), Path(tmp) / "before", Path(tmp) / "logs"
        for d in (baseline, logdir / "before", logdir / "after"):
            d.mkdir(parents=True)
        full = baseline_package(args.baseline, baseline)
        found = which_package(baseline)
        if not found.startswith(str(baseline)):
            sys.exit(f"ab: the before children import onnxtrain from {found}, not from {baseline}")
        print(f"before: {full[:12]} (git archive); after: this tree; load {run.uptime()}", flush=True)
        results = {}
        for key in keys:
            try:
                workdir = run.prepare(key, root / "work", use_builder=not args.no_builder)
            except Exception as exc:  # W5/W6 without their exports
                print(f"{key}: skipped ({str(exc).splitlines()[0][:100]})", flush=True)
                continue
            results[key] = r = bench(key, workdir, logdir, baseline, args.rounds, args.scale)
            print(f"{key:8s} before {r['before_ms']:8.3f} ms  after {r['after_ms']:8.3f} ms  "
                  f"after/before {r['ratio']:.3f} (rounds {r['ratio_low']:.3f}-{r['ratio_high']:.3f})  "
                  f"first losses {'identical' if r['same_losses'] else 'max diff %.1e' % r['max_loss_diff']}",
                  flush=True)
        print(f"load {run.uptime()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": full, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
