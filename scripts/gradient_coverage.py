"""Write docs/gradient-coverage.md: which ops have verified gradients.

    python scripts/gradient_coverage.py            # -n 2 workers
    python scripts/gradient_coverage.py -n 4 --out /tmp/coverage.md
    python scripts/gradient_coverage.py --old-opsets-only  # no tests: that section only

It runs pytest once over the gradient corpus (tests/autodiff/test_grad_corpus.py, the
ONNX node test cases as gradient checks) and the rule tables
(tests/autodiff/test_grad_*.py), with this module loaded as a pytest plugin.  The
plugin tags every test with the ops it checks and the controller writes one
JSON line per test outcome; the script then counts, per op:

* corpus cases that pass / xfail (with their reasons);
* rule-table checks that pass / xfail / fail.  A rule-table test checks the op
  of the node its harness names "op" (gradcheck.check_vjp, check_vjp_f32,
  grad_cases): the plugin records that node when the engine differentiates
  it, by its rule or through its function body, so no table format is parsed.

An op counts as verified when its rule (kind 'vjp') has at least one passing
check, corpus or table.  Ops are keyed by domain: default-domain ops by their
name, others as "domain:op" (ai.onnx.ml:Scaler), and the default domain and
ai.onnx.ml are counted separately, then together.  Ops without a rule that pass
through their ONNX function body are counted separately, as are zero-gradient
ops.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUT_ENV = "GRADIENT_COVERAGE_RESULTS"
ML = "ai.onnx.ml"
PEERS = (
    "ONNX Runtime training 1.19.2: ~63 ops with gradients; "
    "onnx-ad 0.3.0: ~150 op rules"
)

#: Old opsets (7-9): what the rules still refuse where the forward op exists.
#: (ops, opsets, why, workaround).  Kept by hand: update it with the rules.
OLD_OPSET_LIMITS = [
    ("Conv, ConvTranspose, AveragePool, LpPool", "7-9",
     "spatial dims of the input not known statically: cropping the transposed window needs Slice with "
     "runtime bounds (opset 10)", "give the model input a static shape (or run shape inference with one), "
     "or upgrade to opset >= 10"),
    ("MaxPool with overlapping windows (opset 9); every MaxPool (opsets 7-8)", "7-9",
     "spatial dims of the input not known statically: without Indices-based scatter (strided Slice, opset 10; "
     "Scatter, opset 9) the argmax is recomputed from static window positions", "static input shape, or opset >= 10"),
    ("Conv (weight gradient), AveragePool, ConvTranspose with auto_pad SAME_* over dynamic spatial dims, "
     "ConvTranspose with output_shape cropping (negative pads)", "7-10",
     "the pads are runtime values: Pad with a pads input is opset 11", "static input shape, or opset >= 11"),
    ("Add, Sub, Mul, Div, Pow, PRelu, Max, Min, Sum, Mean (broadcasting inputs)", "7-9 (7-12 for unknown ranks)",
     "static shapes cannot tell whether an input was broadcast: the per-axis fix-up needs Slice with runtime "
     "bounds (opset 10), and unknown ranks need ReduceSum over runtime axes (opset 13)",
     "static shapes (shape inference with a concrete input shape)"),
    ("RNN, GRU, LSTM", "7-8", "the backward pass is a Scan-9 loop", "upgrade to opset >= 9"),
    ("Scan", "8", "Scan-8 (batch axis, sequence_lens) is not supported", "upgrade to opset >= 9"),
    ("Gather, TopK, Pad (edge/reflect)", "7-8",
     "no OneHot, NonZero or integer comparisons before opset 9: the scatter-add is a one-hot built against a "
     "static range", "static size of the gathered / padded axis, or opset >= 9"),
    ("Slice", "7-8", "the gradient is a Pad-2 with static pads; the runtime form needs Scatter (opset 9)",
     "static sliced dims, or opset >= 9"),
    ("Resize / Upsample", "7-8", "no EyeLike before opset 9: the interpolation matrix needs static axis sizes",
     "static input shape, or opset >= 9"),
    ("SequenceConstruct, SequenceAt, SequenceInsert, SplitToSequence, ConcatFromSequence, ...", "11-16",
     "gradients of sequences are built with SequenceMap (opset 17)", "upgrade to opset >= 17"),
    ("GatherND", "11-15", "without ScatterND reduction='add' (opset 16) the last dim of the indices must be "
     "static", "static indices shape, or opset >= 16"),
]
OLD_OPSET_MARK = "## Old opsets (7-9)"


def render_old_opsets() -> str:
    """The section on old opsets: what works, how it is checked, what is refused."""
    out = [
        OLD_OPSET_MARK,
        "",
        "Every rule works at every opset where its forward op exists; where the convenient op is newer, the "
        "rule emits an older equivalent.  MaxPool without Indices (opset 7), Scatter (7-8) or strided Slice "
        "(overlapping windows, 7-9) recomputes the argmax of each window from static window positions "
        "(Gather of the window taps, the first maximum as Indices reports it, and MatMul with one-hot "
        "matrices back; it holds kernel-size copies of the pooled output).  Before they exist, Sign becomes "
        "two comparisons, Expand a Tile, ConstantOfShape a constant, OneHot an Equal against a static range "
        "(Gather, TopK, Pad edge/reflect), Scatter a one-hot product (TopK) or a Pad-2 (Slice-1), and "
        "Max-6 (no broadcasting) a comparison.",
        "",
        "Checked by `tests/autodiff/test_zoo_light.py` (the model zoo's AlexNet, ZFNet-512, ResNet-50, Inception v1/v2, "
        "SqueezeNet, ShuffleNet, DenseNet-121 and VGG-19 as the onnx package ships them, at opset 9 and "
        "relabelled to 7 and 8: gradients of every weight against float64 finite differences; SqueezeNet at "
        "opset 7 also trains through TrainingSession) and by the rule tables at "
        "opsets 7 and 8 (`tests/autodiff/test_grad_nn.py`: MaxPool, AveragePool, GlobalAveragePool, reductions, and "
        "every elementwise / reduction / shape table case).",
        "",
        "What the rules still refuse at old opsets, with a clear error naming the node:",
        "",
        "| ops | opsets | why | workaround |",
        "|---|---|---|---|",
    ]
    for ops, opsets, why, fix in OLD_OPSET_LIMITS:
        out.append(f"| {_md_escape(ops)} | {opsets} | {_md_escape(why)} | {_md_escape(fix)} |")
    out.append("")
    return "\n".join(out)


def splice_old_opsets(text: str) -> str:
    """``text`` (a coverage document) with its old-opset section replaced or appended."""
    section = render_old_opsets()
    if OLD_OPSET_MARK not in text:
        return text.rstrip("\n") + "\n\n" + section
    head, rest = text.split(OLD_OPSET_MARK, 1)
    tail = rest.split("\n## ", 1)
    return head + section + ("\n## " + tail[1] if len(tail) > 1 else "")


def qualified(domain: str, op_type: str) -> str:
    """An op's key: its name in the default domain, "domain:op" elsewhere."""
    return op_type if domain in ("", "ai.onnx") else f"{domain}:{op_type}"


def domain_of(op: str) -> str:
    return op.rsplit(":", 1)[0] if ":" in op else ""


# ====================================================================== plugin
# pytest loads this module with ``-p gradient_coverage`` (scripts/ on PYTHONPATH),
# in the controller and in every xdist worker.  Workers tag their tests; the
# controller (or the only process, without xdist) writes the results.


def pytest_configure(config):  # noqa: D103
    results = os.environ.get(OUT_ENV)
    if results and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_ResultWriter(results), "gradient-coverage-writer")


class _Recorder:
    """Ops of the nodes named "op" that the engine differentiates in one test."""

    def __init__(self) -> None:
        self.ops: set[tuple[str, str]] = set()

    def __enter__(self) -> _Recorder:
        from onnxtrain.autodiff import expand

        self._expand = expand
        self._check_rules = expand._check_rules
        self._inline = expand.inline
        recorder = self

        def check_rules(relevant, active, xs, y):
            for n in relevant:
                if n.name == "op":
                    rule = expand.REGISTRY.get(n.domain, n.op_type)
                    recorder.ops.add((qualified(n.domain, n.op_type), rule.kind if rule else "none"))
            return recorder._check_rules(relevant, active, xs, y)

        def inline(node, body, names):
            if node.name == "op":
                recorder.ops.add((qualified(node.domain, node.op_type), "function"))
            return recorder._inline(node, body, names)

        expand._check_rules = check_rules
        expand.inline = inline
        return self

    def __exit__(self, *exc) -> None:
        self._expand._check_rules = self._check_rules
        self._expand.inline = self._inline


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):  # noqa: D103
    recorder = _Recorder()
    with recorder:
        try:
            return (yield)
        finally:
            case = getattr(getattr(item, "callspec", None), "params", {}).get("corpus_case")
            if case is not None:
                tag = {"op": qualified(case.domain, case.op), "variant": case.variant, "precision": case.precision,
                       "name": case.name}
                item.user_properties.append(("corpus", json.dumps(tag)))
            item.user_properties.append(("ops", json.dumps(sorted(recorder.ops))))


class _ResultWriter:
    """Appends one JSON line per test outcome to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def pytest_runtest_logreport(self, report) -> None:  # noqa: D102
        if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
            return
        if hasattr(report, "wasxfail"):
            outcome = "xfail" if report.outcome == "skipped" else "xpass"
        else:
            outcome = {"passed": "pass", "failed": "fail", "skipped": "skip"}[report.outcome]
        if report.outcome == "failed" and "XPASS(strict)" in str(report.longrepr):
            outcome = "xpass"
        props = dict(report.user_properties)
        reason = getattr(report, "wasxfail", "") or ""
        if outcome == "skip" and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        line = {
            "nodeid": report.nodeid,
            "outcome": outcome,
            "reason": reason,
            "duration": report.duration,
            "ops": json.loads(props.get("ops", "[]")),
            "corpus": json.loads(props["corpus"]) if "corpus" in props else None,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


# ====================================================================== the script
def run_tests(workers: int, results: Path) -> float:
    tests = ["tests/autodiff/test_grad_corpus.py"] + sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "autodiff").glob("test_grad_*.py")
        if p.name != "test_grad_corpus.py"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts"), env.get("PYTHONPATH")]))
    env[OUT_ENV] = str(results)
    cmd = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "gradient_coverage", "-p", "no:cacheprovider"]
    if workers > 1:
        cmd += ["-n", str(workers)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    print(f"pytest exited {proc.returncode} after {wall:.0f} s: {' '.join(tail)}", file=sys.stderr)
    if proc.returncode not in (0, 1):
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"pytest could not run the tests (exit {proc.returncode})")
    return wall


def load(results: Path) -> list[dict]:
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict], wall: float, workers: int) -> str:
    sys.path.insert(0, str(ROOT / "tests" / "autodiff"))
    sys.path.insert(0, str(ROOT / "tests"))
    import onnx
    import onnxruntime
    import test_grad_corpus as corpus_mod

    from onnxtrain.autodiff import REGISTRY

    rules = {qualified(r.domain, r.op_type): r for r in REGISTRY.rules()}
    cases = corpus_mod.corpus()

    corpus_rows = [r for r in rows if r["corpus"]]
    table_rows = [r for r in rows if not r["corpus"] and "test_grad_corpus.py" not in r["nodeid"]]

    # ------------------------------------------------------------ per op counts
    per_op: dict[str, dict] = collections.defaultdict(
        lambda: {"node": collections.Counter(), "expanded": collections.Counter(),
                 "reasons": collections.Counter(), "precision": collections.Counter(),
                 "t_pass": 0, "t_xfail": 0, "t_fail": 0, "t_other": 0, "kinds": set()}
    )
    for r in corpus_rows:
        c = r["corpus"]
        d = per_op[c["op"]]
        d[c["variant"]][r["outcome"]] += 1
        d["precision"][c["precision"]] += 1
        if r["outcome"] == "xfail":
            d["reasons"][r["reason"]] += 1
        # an *_expanded case differentiates the primitive ops of the body, not
        # the op itself: only the node cases verify the op's rule (or body)
        if r["outcome"] == "pass" and c["variant"] == "node":
            d["kinds"].add("function" if c["op"] not in rules else rules[c["op"]].kind)
    unattributed = collections.Counter()
    for r in table_rows:
        if not r["ops"]:
            unattributed[r["outcome"]] += 1
            continue
        for op, kind in r["ops"]:
            d = per_op[op]
            key = {"pass": "t_pass", "xfail": "t_xfail", "fail": "t_fail"}.get(r["outcome"], "t_other")
            d[key] += 1
            if r["outcome"] == "pass":
                d["kinds"].add(kind)

    verified = sorted(op for op, d in per_op.items() if op in rules and rules[op].kind == "vjp"
                      and (d["node"]["pass"] or d["t_pass"]))
    verified_default = [op for op in verified if domain_of(op) == ""]
    verified_ml = [op for op in verified if domain_of(op) == ML]
    verified_other = [op for op in verified if domain_of(op) not in ("", ML)]
    via_body = sorted(op for op, d in per_op.items() if op not in rules and "function" in d["kinds"])
    unverified = sorted(op for op, r in rules.items() if r.kind == "vjp" and op not in verified)
    zero = sorted(op for op, r in rules.items() if r.kind == "zero")
    refused = sorted((op, r.reason) for op, r in rules.items() if r.kind == "refused")
    other_domains = sorted(f"{r.domain}:{r.op_type} ({r.kind})" for r in REGISTRY.rules()
                           if r.domain and r.domain != ML)

    # ------------------------------------------------------------ corpus totals
    categories = collections.Counter(c.category for c in cases)
    outcomes = collections.Counter(r["outcome"] for r in corpus_rows)
    precisions = collections.Counter(r["corpus"]["precision"] for r in corpus_rows)
    prec_pass = collections.Counter(r["corpus"]["precision"] for r in corpus_rows if r["outcome"] == "pass")
    reason_count = collections.Counter(r["reason"] for r in corpus_rows if r["outcome"] == "xfail")
    # skip messages start with the case and the model ("test_x gradient: ..."): group by the rest
    skip_count = collections.Counter(
        re.sub(r"^\S+ (gradient|loss): ", "", r["reason"]) for r in corpus_rows if r["outcome"] == "skip"
    )
    category_count = collections.Counter(
        r["reason"].split(":")[0] for r in corpus_rows if r["outcome"] == "xfail"
    )
    corpus_time = sum(r["duration"] for r in corpus_rows)
    table_outcomes = collections.Counter(r["outcome"] for r in table_rows)
    table_time = sum(r["duration"] for r in table_rows)

    out: list[str] = []
    w = out.append
    w("# Gradient coverage")
    w("")
    w("Reproduce (rewrites this file; about 2-3 minutes on 2 cores):")
    w("")
    w("```")
    w("python scripts/gradient_coverage.py")
    w("```")
    w("")
    w(f"Generated from one pytest run (`-n {workers}`) of `tests/autodiff/test_grad_corpus.py` and the rule "
      f"tables `tests/autodiff/test_grad_*.py`, with onnx {onnx.__version__} and onnxruntime "
      f"{onnxruntime.__version__}.  The numbers change as rules are added; rerun the command.")
    w("")
    w("## Summary")
    w("")
    w(f"- **Ops with verified gradient rules: {len(verified)}**: **{len(verified_default)} in the "
      f"default domain** + **{len(verified_ml)} in ai.onnx.ml**"
      + (f" + {len(verified_other)} in other domains" if verified_other else "")
      + " (a registered 'vjp' rule with at least one passing numerical check: a corpus case or a "
      "rule-table test; ops of other domains are written domain:op).")
    w(f"- Verified ai.onnx.ml rules ({len(verified_ml)}): "
      + (", ".join(op.split(":", 1)[1] for op in verified_ml) or "none") + ".")
    w(f"- Ops without a rule, verified through their ONNX function body: {len(via_body)}"
      + (f" ({', '.join(via_body)})." if via_body else "."))
    w(f"- Total ops whose gradients are verified: {len(verified) + len(via_body)}; plus "
      f"{len(zero)} zero-gradient ops (counted separately, below).")
    w(f"- Registered 'vjp' rules without a passing check: {len(unverified)}"
      + (f" ({', '.join(unverified)})." if unverified else "."))
    w(f"- Zero-gradient ops ({len(zero)}): {', '.join(zero)}.")
    w(f"- Refused ops ({len(refused)}): "
      + ("; ".join(f"{op} ({_md_escape(reason)})" for op, reason in refused) if refused else "none")
      + ".")
    if other_domains:
        w(f"- Rules in other domains: {', '.join(other_domains)}.")
    w(f"- Peers: {PEERS}.  onnxtrain: {len(verified)} verified rules ({len(verified_default)} default "
      f"domain + {len(verified_ml)} ai.onnx.ml"
      + (f" + {len(verified_other)} other domains" if verified_other else "")
      + f") + {len(via_body)} function-body ops (+ {len(zero)} "
      "zero-gradient ops).  Target: 150 verified rules.")
    w("")
    w("## The ONNX node test corpus as gradient checks")
    w("")
    w(f"`onnx.backend.test.case.node.collect_testcases()` holds {len(cases)} cases.  Each case whose op "
      "has a 'vjp' rule or a function body, with floating tensor inputs and outputs, is one gradient "
      "check (`tests/autodiff/test_grad_corpus.py`: loss = sum(R * output) with random R, Gradient w.r.t. every "
      "floating input, one central difference per input along a random direction, on onnxruntime).")
    w("")
    w("| cases | count |")
    w("|---|---:|")
    for cat, n in sorted(categories.items(), key=lambda kv: (kv[0] != "check", kv[0])):
        label = "gradient checks" if cat == "check" else f"excluded: {cat}"
        w(f"| {label} | {n} |")
    w("")
    w(f"Gradient checks run: {len(corpus_rows)}: **{outcomes['pass']} pass**, {outcomes['xfail']} xfail"
      + (f", {outcomes['skip']} skipped (onnxruntime cannot run them, probed)" if outcomes["skip"] else "")
      + (f", {outcomes['fail']} FAIL" if outcomes["fail"] else "")
      + (f", {outcomes['xpass']} XPASS (xfail entries that passed: stale, a failure of the suite)"
         if outcomes["xpass"] else "") + ".")
    w("")
    w("| precision | checks | pass | meaning |")
    w("|---|---:|---:|---|")
    meaning = {
        "f64": "converted to float64, eps 1e-6",
        "f32": "float32 (onnxruntime has no double kernel for an op of the case or of its gradient), eps 1e-3",
        "given": "Cast/CastLike with the case's own types, eps 1 (linear)",
    }
    for p in ("f64", "f32", "given"):
        w(f"| {p} | {precisions[p]} | {prec_pass[p]} | {meaning[p]} |")
    w("")
    w(f"Time: the corpus tests took {corpus_time:.0f} s of test time in this run (wall time for the "
      f"whole run, rule tables included: {wall:.0f} s with {workers} workers).")
    w("")
    w("Expected failures by category:")
    w("")
    w("| category | cases |")
    w("|---|---:|")
    for cat, n in category_count.most_common():
        w(f"| {cat} | {n} |")
    w("")
    w("### Expected failures by reason")
    w("")
    w("| cases | reason |")
    w("|---:|---|")
    for reason, n in sorted(reason_count.items(), key=lambda kv: (-kv[1], kv[0])):
        w(f"| {n} | {_md_escape(reason)} |")
    w("")
    if skip_count:
        w("### Skipped: what this onnxruntime cannot run")
        w("")
        w("Probed per case (tests/autodiff/test_grad_corpus.py): an op version newer than onnxruntime loads, "
          "or no CPU kernel for the case's types.  A newer onnxruntime turns these into checks.")
        w("")
        w("| cases | reason |")
        w("|---:|---|")
        for reason, n in sorted(skip_count.items(), key=lambda kv: (-kv[1], kv[0])):
            w(f"| {n} | {_md_escape(reason)} |")
        w("")
    w("### Float32 cases")
    w("")
    w("Ops whose cases run in float32 (any op of the case's graph listed):")
    w("")
    for op, why in sorted(corpus_mod.FLOAT32_ONLY.items()):
        w(f"- {op}: {why}")
    for name, why in sorted(corpus_mod.FLOAT32_CASES.items()):
        w(f"- case {name}: {why}")
    w("")
    w("## Per op")
    w("")
    w(f"Rule-table checks: the tests of `tests/autodiff/test_grad_*.py` that differentiate a node of the op "
      f"(pass / xfail / fail).  {sum(table_outcomes.values())} table tests ran: "
      f"{table_outcomes['pass']} pass, {table_outcomes['xfail']} xfail, {table_outcomes['fail']} fail, "
      f"{table_outcomes['xpass']} xpass, {table_outcomes['skip']} skip ({table_time:.0f} s of test time); "
      f"{sum(unattributed.values())} of them differentiate no node named 'op' (composite tests) and are "
      "not attributed to an op.")
    w("")
    w("Corpus columns: the op's own cases (one node of the op) and its `*_expanded` twins (the "
      "op's function body as the corpus writes it out: they check the rules of the body's primitive "
      "ops, so they do not count towards verifying the op).  `kind`: the registry's kind, or "
      "'function' for an op differentiated through its body, '-' for neither.")
    w("")
    w("| op | kind | node cases pass / xfail | expanded cases pass / xfail | precision | "
      "table pass / xfail / fail |")
    w("|---|---|---|---|---|---|")
    all_ops = sorted(set(per_op) | {op for op, r in rules.items() if r.kind == "vjp"})
    for op in all_ops:
        d = per_op[op]
        kind = rules[op].kind if op in rules else ("function" if "function" in d["kinds"] else "-")
        mark = " **verified**" if op in verified or op in via_body else ""
        prec = ", ".join(f"{k} {v}" for k, v in sorted(d["precision"].items()))
        node, expanded = d["node"], d["expanded"]
        bad = node["fail"] + node["xpass"] + expanded["fail"] + expanded["xpass"]
        w(f"| {op} | {kind}{mark} | {node['pass']} / {node['xfail']} | "
          f"{expanded['pass']} / {expanded['xfail']} | {prec} | "
          f"{d['t_pass']} / {d['t_xfail']} / {d['t_fail']} |" + (f" ({bad} FAILED)" if bad else ""))
    w("")
    w("### Corpus expected failures per op")
    w("")
    for op in all_ops:
        d = per_op[op]
        if not d["reasons"]:
            continue
        w(f"- **{op}**: " + "; ".join(f"{n} x {_md_escape(reason)}" for reason, n in d["reasons"].most_common()))
    w("")
    w("## Corpus cases that are not gradient checks")
    w("")
    excluded = collections.defaultdict(collections.Counter)
    for c in cases:
        if c.category != "check":
            excluded[c.category][c.op] += 1
    for cat in sorted(excluded):
        ops = excluded[cat]
        w(f"- **{cat}** ({sum(ops.values())} cases): "
          + ", ".join(f"{op} ({n})" for op, n in sorted(ops.items())))
    w("")
    w(render_old_opsets())
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "gradient-coverage.md"))
    parser.add_argument("--results", help="keep the JSON-lines results here (default: a temp file)")
    parser.add_argument("--old-opsets-only", action="store_true",
                        help="run no tests: only rewrite the old-opset section of the existing --out file")
    args = parser.parse_args(argv)
    if args.old_opsets_only:
        out = Path(args.out)
        out.write_text(splice_old_opsets(out.read_text()))
        print(f"updated the old-opset section of {out}", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(args.results) if args.results else Path(tmp) / "results.jsonl"
        results.write_text("")
        wall = run_tests(args.workers, results)
        rows = load(results)
    if not rows:
        raise SystemExit("no test results were recorded")
    text = render(rows, wall, args.workers)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
