"""Human-readable summaries of a TrainingSession (text for repr, HTML for notebooks)."""

from __future__ import annotations

import html
from typing import Any


def _rows(sess: Any) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, var in sess.state_info.items():
        rows.append((name, str(var.dtype), str(list(var.shape)), var.origin))
    return rows


def session_text(sess: Any) -> str:
    """A short multi-line description: algorithms, inputs, outputs, state."""
    lines = [f"TrainingSession: {sess.num_algorithms} algorithm(s), {len(sess.state_info)} state variables"]
    lines.append(f"  inference inputs: {sorted(sess.inference_inputs)} -> outputs {sess.inference_outputs}")
    for i, (ins, outs) in enumerate(zip(sess.algorithm_inputs, sess.algorithm_outputs)):
        lines.append(f"  training_info[{i}]: feeds {sorted(ins)} -> returns {outs}")
    for name, dtype, shape, origin in _rows(sess):
        lines.append(f"    {name}: {dtype}{shape} ({origin})")
    return "\n".join(lines)


def session_html(sess: Any) -> str:
    """The same as session_text, as an HTML table for Jupyter."""
    body = "".join(
        f"<tr><td>{html.escape(n)}</td><td>{d}</td><td>{s}</td><td>{html.escape(o)}</td></tr>"
        for n, d, s, o in _rows(sess)
    )
    head = html.escape(session_text(sess).splitlines()[0])
    return (
        f"<div><b>{head}</b><table><tr><th>state</th><th>dtype</th><th>shape</th>"
        f"<th>origin</th></tr>{body}</table></div>"
    )
