"""Thread and spinning sweep: onnxtrain's step time under each ONNXTRAIN_THREADS
and ONNXTRAIN_SPINNING setting.

Issue 16, item 6 and issue 28, item 2. Each (workload, setting) runs in a fresh
process. The session is made with onnxtrain's own defaults (no session options
passed), so the setting under test is exactly what a user gets:

- ``ONNXTRAIN_THREADS=1`` and ``ONNXTRAIN_THREADS=<cores>``, each with idle
  threads spinning (``ONNXTRAIN_SPINNING=1``, onnxruntime's default) and
  blocking (``ONNXTRAIN_SPINNING=0``);
- both unset: onnxtrain's default (one thread per physical core, spinning).

W5 and W6 need their exports (``run.py`` makes them); L1 needs ``llm.py``'s
(``benchmarks/.cache/llm``).

Settings are interleaved within each repeat, so machine load hits them alike.
The table gives each process's median ms per step (``train_step(fetch=False)``
after warm-up), for each repeat.

    python benchmarks/threads.py                      # W1-W4, 3 repeats
    python benchmarks/threads.py --workloads W2 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def child(key: str, steps: int, warmup: int, use_builder: bool) -> dict:
    """One process: build the workload's training model, time its steps."""
    import numpy as np
    from training_model import training_model
    from workloads import WORKLOADS

    import onnxtrain

    if key.startswith("L"):  # llm.py's model, its own build arguments and token batch
        import llm

        spec = llm.spec_of(key, False)
        path = llm.model_dir(spec["model"]) / f"model-{spec['batch']}x{spec['seq']}.onnx"
        model = onnxtrain.build.training_model(str(path), **llm.build_args(spec))
        ids = np.random.default_rng(0).integers(2, llm.MODELS[spec["model"]]["vocab"],
                                                (spec["batch"], spec["seq"] + 1))
        feeds = {"input_ids": ids[:, :-1].copy(), "labels": ids[:, 1:].copy()}
        sess = onnxtrain.TrainingSession(model)
    else:
        w = WORKLOADS[key]
        inference, _params, batch = w.build()
        model, _how = training_model(inference, w, use_builder=use_builder)
        sess = onnxtrain.TrainingSession(model)
        feeds = dict(batch)
    for _ in range(warmup):
        sess.train_step(feeds, fetch=False)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sess.train_step(feeds, fetch=False)
        times.append(time.perf_counter() - t0)
    return {"median_ms": float(np.median(times)) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W1,W2,W3,W4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="timed steps (default: by workload)")
    ap.add_argument("--hand-written", action="store_true", help="the spec-op training models")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        key, steps, warmup, builder = args.child
        print(json.dumps(child(key, int(steps), int(warmup), builder == "1")))
        return 0
    cores = os.cpu_count() or 1
    counts = ["1", str(cores)] if cores > 1 else ["1"]
    settings = [f"{n},{spin}" for n in counts for spin in ("1", "0")] + [None]
    keys = [k.strip().upper() for k in args.workloads.split(",") if k.strip()]
    results: dict[str, dict[str, list[float]]] = {k: {str(s): [] for s in settings} for k in keys}
    default_steps = {"W3": 20000, "W5": 20, "W6": 40, "W7-LSTM": 60, "W7-GRU": 60, "L1": 4}
    for r in range(args.repeats):
        for key in keys:
            steps = args.steps or default_steps.get(key, 200)
            warmup = 1 if key.startswith("L") else steps // 10 + 5
            for s in settings[r % len(settings):] + settings[: r % len(settings)]:
                env = dict(os.environ)
                env.pop("ONNXTRAIN_THREADS", None)
                env.pop("ONNXTRAIN_SPINNING", None)
                if s is not None:
                    env["ONNXTRAIN_THREADS"], env["ONNXTRAIN_SPINNING"] = s.split(",")
                cmd = [sys.executable, __file__, "--child", key, str(steps), str(warmup),
                       "0" if args.hand_written else "1"]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                results[key][str(s)].append(json.loads(out.stdout.strip().splitlines()[-1])["median_ms"])
    head = "| workload | " + " | ".join(
        "both unset (onnxtrain's default)" if s is None else
        f"{s.split(',')[0]} thread{'s' if s.split(',')[0] != '1' else ''}, spinning "
        f"{'on' if s.endswith(',1') else 'off'}" for s in settings) + " |"
    print(f"{cores} logical CPUs; load average {os.getloadavg()[0]:.2f}; median ms per step, one process "
          "each, in the order run")
    print(head)
    print("|---" * (len(settings) + 1) + "|")
    for key in keys:
        cells = []
        for s in settings:
            vals = results[key][str(s)]
            digits = 3 if max(vals) < 0.1 else (0 if min(vals) > 100 else 2)
            cells.append(", ".join(f"{v:.{digits}f}" for v in vals))
        print(f"| {key} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": cores, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
