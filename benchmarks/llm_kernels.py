"""The decoder kernels against their standard-op chains, at L1's sizes.

    python benchmarks/llm_kernels.py [--rounds 9] [--runs 20] [--threads 2] [--only rms,xent]

Each chain (tests/kernels/chains.py: the dynamo exporter's forward, a loss
sum(y * t), the rules' gradient) runs as its standard program and as the
kernels' program (``onnxtrain.kernels.llm.rewrite``) in one onnxruntime
session each, with onnxtrain's session options.  Rounds alternate the two
(the order flips every round); each round times ``--runs`` runs of each.
Printed: the median ms per run of each program, and the paired ratio (the
median over rounds of standard / kernels within a round), with the load
average: this machine is shared, and the paired ratio is what cancels it.
``--cpu --threads 1`` counts the process's CPU time instead: the work each
program does, which other processes on the machine change much less than
the wall time.  ``--profile`` compares onnxruntime's kernel times of only
the nodes that differ (the replaced chain against its kernels), runs
alternating, medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))

import chains  # noqa: E402

#: L1's shapes: batch 4 x 256 tokens, hidden 512, FFN 1408, 8 heads of 64 (4 KV heads), vocabulary 8000.
CASES = {
    "rms": ("RMSNorm and its gradient, [4, 256, 512], with the residual", lambda: chains.rms_norm((4, 256, 512), True)),
    "silu": ("SiLU x gate and its gradient, [4, 256, 1408], dh in two parts",
             lambda: chains.silu_mul((4, 256, 1408), True)),
    "rope": ("RoPE and its gradient, [4, 8, 256, 64]", lambda: chains.rope((4, 8, 256, 64), table_rank=4)),
    "softmax": ("guarded softmax and its gradient, [4, 8, 256, 256]",
                lambda: chains.guarded_softmax((4, 8, 256, 256), masked_rows=0)),
    "masked": ("causal-masked softmax (the mask added), guarded, and its gradient, [4, 8, 256, 256]",
               lambda: chains.masked_softmax((4, 8, 256, 256), (4, 1, 256, 256))),
    "xent": ("cross-entropy and its gradient, [1024, 8000]",
             lambda: chains.cross_entropy(1024, 8000, ignored=0, scale=2.0)),
}


def _time(sess, feeds, outputs, runs: int, clock=time.perf_counter) -> float:
    t = clock()
    for _ in range(runs):
        sess.run(outputs, feeds)
    return (clock() - t) / runs * 1e3


def measure(key: str, rounds: int, runs: int, threads: int | None, clock=time.perf_counter) -> dict:
    chain = CASES[key][1]()
    fused, count = chain.fused()
    sessions = {"standard": chains.session(chain.model, threads), "kernels": chains.session(fused, threads)}
    for s in sessions.values():  # warm-up
        _time(s, chain.feeds, chain.outputs, 2)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for r in range(rounds):
        for k in (("standard", "kernels") if r % 2 == 0 else ("kernels", "standard")):
            times[k].append(_time(sessions[k], chain.feeds, chain.outputs, runs, clock))
    paired = statistics.median(s / f for s, f in zip(times["standard"], times["kernels"]))
    return {"case": key, "fusions": count, "standard_ms": statistics.median(times["standard"]),
            "kernels_ms": statistics.median(times["kernels"]), "paired": paired,
            "nodes": (len(chain.model.graph.node), len(fused.graph.node))}


def profile(key: str, rounds: int, threads: int | None) -> dict:
    """onnxruntime's profile of both programs: the kernel time of the nodes
    only the standard program has against that of the nodes only the
    kernels' program has (the chain's shared nodes left out), medians over
    ``rounds`` runs of each, alternating."""
    import json

    chain = CASES[key][1]()
    fused, _ = chain.fused()
    models = {"standard": chain.model, "kernels": fused}
    sessions = {}
    for k, m in models.items():
        so = chains.default_session_options(threads)
        so.enable_profiling = True
        so.profile_file_prefix = f"/tmp/onnxtrain-llm-kernels-{os.getpid()}-{k}"
        lib = chains.library.library()
        if lib:
            so.register_custom_ops_library(lib)
        sessions[k] = chains.ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    for r in range(rounds + 2):
        for k in (("standard", "kernels") if r % 2 == 0 else ("kernels", "standard")):
            sessions[k].run(chain.outputs, chain.feeds)
    events, names = {}, {}
    for k, sess in sessions.items():  # (node names as onnxruntime runs them: functions inlined)
        path = sess.end_profiling()
        events[k] = json.loads(Path(path).read_text())
        os.unlink(path)
        names[k] = {e["name"][:-12] for e in events[k] if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")}
    own = {"standard": names["standard"] - names["kernels"], "kernels": names["kernels"] - names["standard"]}
    out = {}
    for k in sessions:
        runs = sorted(e["ts"] for e in events[k] if e.get("cat") == "Session" and e.get("name") == "model_run")[2:]
        per_run = [0.0] * len(runs)
        for e in events[k]:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["name"][:-12] in own[k]:
                i = max((j for j, t in enumerate(runs) if t <= e["ts"]), default=None)
                if i is not None:
                    per_run[i] += e["dur"] / 1e3
        out[k] = statistics.median(per_run)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--cpu", action="store_true",
                    help="the process's CPU time per run instead of wall time (with --threads 1: the work, "
                         "whatever else the machine runs)")
    ap.add_argument("--profile", action="store_true",
                    help="onnxruntime's kernel times of the nodes each program has and the other does not")
    args = ap.parse_args(argv)
    if args.profile:
        print(f"load average before: {os.getloadavg()[0]:.2f}; {args.threads} intra-op threads", flush=True)
        print("| chain | replaced standard nodes, ms | kernels, ms | ratio |")
        print("|---|---|---|---|")
        for key in args.only.split(","):
            r = profile(key, args.rounds, args.threads)
            print(f"| {CASES[key][0]} | {r['standard']:.2f} | {r['kernels']:.2f} | "
                  f"**{r['standard'] / r['kernels']:.2f}x** |", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}; {'CPU' if args.cpu else 'wall'} time, "
          f"{args.threads} intra-op threads", flush=True)
    print("| chain | standard ms | kernels ms | paired standard / kernels | nodes standard / kernels |")
    print("|---|---|---|---|---|")
    for key in args.only.split(","):
        r = measure(key, args.rounds, args.runs, args.threads, time.process_time if args.cpu else time.perf_counter)
        print(f"| {CASES[key][0]} | {r['standard_ms']:.2f} | {r['kernels_ms']:.2f} | **{r['paired']:.2f}x** "
              f"| {r['nodes'][0]} / {r['nodes'][1]} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
