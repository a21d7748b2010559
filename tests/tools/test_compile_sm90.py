"""Every kernel compiles for sm_90 (H100/H200) without a GPU, down to a cubin with the Triton wheel's
ptxas. The CPU interpreter does not check what the GPU compiler does (for instance that both branches of
an ``if`` give a variable the same type); a kernel that only ever ran on CPU ranks can still fail to
compile on a GPU. Runs in a subprocess with ``TRITON_INTERPRET=0``. Also checks one property
of the builds that the interpreter cannot show: the FP8 byte store adds no layout conversion."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel has no NVIDIA backend (ptxas)")
def test_every_kernel_compiles_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_sm90.py"), "--quick"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kernel variants for sm_90" in proc.stdout
    _check_fp8_store_layout(proc.stdout)


def _check_fp8_store_layout(out: str):
    """The per-token FP8 variant of every fused kernel has no more layout conversions than the variant
    without FP8: its byte store takes the layout of the 16-bit tile (``kernels/quant.store_fp8``; without
    that, Triton moved the tiles through shared memory, docs/design.md, "FP8 stores in the source's layout")."""
    conversions = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) > 6 and words[4] in ("0", "1") and words[5] == "True" and "layout" in line:
            n = int(line.rsplit(" layout conversions", 1)[0].rsplit(" ", 1)[1])
            conversions.setdefault(tuple(words[:4]), {}).setdefault(words[4], set()).add(n)
    assert conversions, out[-2000:]
    for kernel, by_quant in conversions.items():
        assert by_quant.get("1") == by_quant.get("0"), (kernel, by_quant)
