"""Every kernel compiles for sm_90 (H100/H200) without a GPU, down to a cubin with the Triton wheel's
ptxas. The CPU interpreter does not check what the GPU compiler does (for instance that both branches of
an ``if`` give a variable the same type); a kernel that only ever ran on CPU ranks can still fail to
compile on a GPU. Runs in a subprocess with ``TRITON_INTERPRET=0``. Also checks two properties of the
builds that the interpreter cannot show: the FP8 byte store adds no layout conversion, and every wait
decides as one block (the PTX's barriers and single-thread stores sit under no branch on a per-thread
value; ``tests/support/ptx_sync.py``, checked itself on hand-written PTX in ``test_ptx_sync.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ptx_sync

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel has no NVIDIA backend (ptxas)")
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_sm90.py"), "--quick",
                           "--ptx", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kernel variants for sm_90" in proc.stdout
    _check_fp8_store_layout(proc.stdout)
    _check_uniform_waits(sorted(tmp_path.glob("*.ptx")))


def _check_uniform_waits(files):
    """Every wait decides as one block (docs/design.md, "Every wait decides as one block";
    ``tests/support/ptx_sync.py``): in every variant's sm_90 PTX, no barrier and no elected store sits under
    a branch on a per-thread value, every wait loop that holds a barrier leaves it on a block-uniform
    value, and the QK norm's waits (a tile of two words, replicated over warps) are block-wide."""
    assert files
    problems, qk_loops = [], 0
    for f in files:
        ptx = f.read_text()
        problems += [f"{f.name}: {v}" for v in ptx_sync.analyse(ptx)]
        loops = ptx_sync.wait_loops(ptx)
        problems += [f"{f.name}: the wait loop at line {line} holds a barrier and exits on a per-thread value"
                     for line, uniform, barrier in loops if barrier and not uniform]
        if "qk_norm" in f.name:
            qk_loops += len(loops)
            problems += [f"{f.name}: the QK norm's wait at line {line} is not block-wide"
                         for line, uniform, _ in loops if not uniform]
    assert qk_loops, "no QK norm wait loop found in the PTX"
    assert not problems, "\n".join(problems[:20])


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
