"""The kernel library's function clones (``ort_api.h``) go by the CPU's
features, not by its model.

``FMA_CLONES`` marks the kernels written with ``fmaf``: their default clone
calls libm's software fmaf, one call per multiply-add, so a CPU with the FMA
instructions must run a clone built for them.  A clone named by ``arch=``
is chosen by the CPU's model (GCC's ``__builtin_cpu_is``): with
``arch=haswell`` an AMD EPYC ran the default clone, and L1's LoRA kernels took
2.5 s of a 4 s step instead of 85 ms.

The probe: one function under ``FMA_CLONES`` computing ``a * b + c``,
compiled with contraction on, gives the fused result exactly where the clone
it runs has the FMA instructions (values whose product rounds away the
difference).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from onnxtrain.kernels import library

HEADER_DIR = Path(library.__file__).parent

PROBE = r"""
#include <stdio.h>
#include "ort_api.h"

FMA_CLONES float product_plus(float a, float b, float c) { return a * b + c; }

int main(void) {
    /* a b = 1 + 2^-11 + 2^-24: rounded alone, the 2^-24 goes (a tie to even) */
    volatile float a = 1.0f + 0x1p-12f, b = 1.0f + 0x1p-12f, c = -(1.0f + 0x1p-11f);
    printf("%a\n", (double)product_plus(a, b, c));
    return 0;
}
"""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return cc if shutil.which(cc) else None


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or _compiler() is None,
                    reason="function clones are built on x86-64 with a C compiler")
def test_fma_clones_run_the_fma_instructions_where_the_cpu_has_them(tmp_path):
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo to read the CPU's features from")
    source, exe = tmp_path / "probe.c", tmp_path / "probe"
    source.write_text(PROBE)
    subprocess.run([_compiler(), "-O2", "-ffp-contract=fast", "-I", str(HEADER_DIR), "-o", str(exe), str(source)],
                   check=True, capture_output=True, timeout=60)
    got = float.fromhex(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.strip())
    fused, separate = 2.0 ** -24, 0.0
    if "fma" in flags or "avx512f" in flags:
        assert got == fused, f"the CPU has {'avx512f' if 'avx512f' in flags else 'fma'}, but FMA_CLONES ran a " \
                             "clone without it (the default: libm's fmaf in every kernel)"
    else:
        assert got == separate
