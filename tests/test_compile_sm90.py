"""Every kernel compiles for sm_90 (H100/H200) without a GPU, down to a cubin with the Triton wheel's
ptxas. The CPU interpreter does not check what the GPU compiler does (for instance that both branches of
an ``if`` give a variable the same type); a kernel that only ever ran on CPU ranks can still fail to
compile on the GPU machine. Runs in a subprocess with ``TRITON_INTERPRET=0``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel has no NVIDIA backend (ptxas)")
def test_every_kernel_compiles_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_sm90.py"), "--quick"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kernel variants for sm_90" in proc.stdout
