"""Write docs/llm.md's figures for the tiny Llama from a run of the genai example.

    python scripts/make_llm_doc.py              # runs examples/finetune_genai_lora.py --quick
    python scripts/make_llm_doc.py RUN.txt      # or takes the output of such a run

The regions between ``<!-- make_llm_doc: NAME -->`` and
``<!-- /make_llm_doc: NAME -->`` are generated, never edited by hand:

- ``requantized``: what ``build.export_requantized`` lost after training;
- ``table``: the tiny Llama's rows of the memory table;
- ``output``: what the example printed, verbatim.

``figures(text)`` reads the example's output; ``regions(text)`` renders the
regions from it.  tests/docs/test_examples_notebooks.py checks that the doc's
regions are ``regions`` of the doc's own ``output`` block, and that those
figures agree with a fresh ``--quick`` run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "llm.md"
EXAMPLE = ROOT / "examples" / "finetune_genai_lora.py"
MODELS = ROOT / "tests" / "data" / "genai_serve"
MARK = re.compile(r"<!-- make_llm_doc: (\w+) -->\n(.*?)<!-- /make_llm_doc: \1 -->", re.S)

_TRAINED = re.compile(r"\[(\w+)\] [^:]+: (\d+) targets, (\d+) adapter parameters; loss ([\d.]+) -> "
                      r"([\d.]+) in (\d+) steps, ([\d.]+) s/step")
_MEMORY = re.compile(r"\[(\w+)\] peak RSS while training: (\d+) MiB.*; model weights ([\d.]+) MiB")
_AFTER = re.compile(r"\[(\w+)\] after, (sess\.run|genai merged|genai separate): *'(.*)'")
_REQUANTIZED = re.compile(r"\[int4\] requantized .*: update_error (\d+)% to (\d+)% over (\d+) targets "
                          r"\(median (\d+)%\); logits up to ([\d.]+) from sess.run's, next-token "
                          r"argmax agrees on (\d+)%")


def figures(text: str) -> dict:
    """The example's figures per precision (``fp32``, ``int4``) and its requantizing report."""
    out: dict = {}
    for m in _TRAINED.finditer(text):
        p, targets, adapters, first, last, steps, per_step = m.groups()
        out.setdefault(p, {}).update(targets=int(targets), adapters=int(adapters), first=float(first),
                                     last=float(last), steps=int(steps), s_per_step=float(per_step))
    for m in _MEMORY.finditer(text):
        out[m[1]].update(peak_mib=int(m[2]), weights_mib=float(m[3]))
    for m in _AFTER.finditer(text):
        out[m[1]][m[2]] = m[3]
    m = _REQUANTIZED.search(text)
    if m:
        lo, hi, n, median, gap, agree = m.groups()
        out["requantized"] = dict(lo=int(lo), hi=int(hi), targets=int(n), median=int(median),
                                  gap=float(gap), agree=int(agree))
    return out


def output_lines(text: str) -> list[str]:
    """The example's own lines (progress bars and warnings left out)."""
    return [line for line in text.splitlines() if line.startswith("[") or line.startswith("phrase ")]


def tiny_parameters() -> float:
    """The committed tiny Llama's parameter count, in millions."""
    import onnx

    model = onnx.load(str(MODELS / "llama-fp32" / "model.onnx"), load_external_data=False)
    count = 0
    for t in model.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        count += n
    return count / 1e6


def regions(text: str) -> dict[str, str]:
    """The generated regions of docs/llm.md for the example's output ``text``."""
    f = figures(text)
    r, int4 = f["requantized"], f["int4"]
    requantized = (
        f"On the tiny Llama after learning its phrase ({int4['steps']} steps), it ranges from "
        f"{r['lo']}% to {r['hi']}% across the {r['targets']} targets (median {r['median']}%). The "
        f"requantized model's logits are up to {r['gap']} away from `sess.run`'s, and it agrees "
        f"on {r['agree']}% of the next-token argmaxes.\n")
    rows = []
    for p, kind in (("fp32", "fp32 LoRA"), ("int4", "int4 QLoRA")):
        e = f[p]
        model = (f"tiny Llama (hidden 64, 2 layers, {tiny_parameters():.1f} M parameters)"
                 if p == "fp32" else "tiny Llama")
        rows.append(f"| {model} | {kind} | {e['weights_mib']} MiB | {e['adapters']:,} | "
                    f"{e['s_per_step']:.3f} | {e['peak_mib']} MiB |")
    table = ("| model | precision | weights on disk | adapters (r=8) | s/step | peak RSS |\n"
             "| --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")
    output = "```\n" + "\n".join(output_lines(text)) + "\n```\n"
    return {"requantized": requantized, "table": table, "output": output}


def doc_regions(doc: str) -> dict[str, str]:
    """The generated regions as the doc holds them."""
    return {m[1]: m[2] for m in MARK.finditer(doc)}


def doc_output(doc: str) -> str:
    """The example's output as the doc quotes it (its ``output`` region)."""
    return doc_regions(doc)["output"].strip().removeprefix("```").removesuffix("```")


def write(text: str) -> None:
    doc = DOC.read_text()
    new = regions(text)
    missing = set(new) - set(doc_regions(doc))
    if missing:
        raise SystemExit(f"{DOC}: no region(s) {sorted(missing)}")
    doc = MARK.sub(lambda m: f"<!-- make_llm_doc: {m[1]} -->\n{new[m[1]]}<!-- /make_llm_doc: {m[1]} -->",
                   doc)
    DOC.write_text(doc)


def main(argv: list[str]) -> None:
    if argv:
        text = Path(argv[0]).read_text()
    else:
        proc = subprocess.run([sys.executable, str(EXAMPLE), "--quick", "--no-progress"],
                              capture_output=True, text=True, check=True)
        text = proc.stdout
    print("\n".join(output_lines(text)))
    write(text)
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
