"""Triton imported before tpcomm on a machine without CUDA: tpcomm can no longer turn the interpreter on
for Triton's own library, so kernels would fail with Triton's "Cannot call @triton.jit'd outside of the
scope of a kernel". Instead importing tpcomm warns, naming the fix, the standalone quant raises a
RuntimeError saying what to do, and a Communicator falls back to torch.distributed (exact results) with
that reason. Each case runs in a fresh Python without ``TRITON_INTERPRET`` set.

The same for ``TRITON_INTERPRET=0`` on a machine without CUDA (Triton would fail with its raw "0 active
drivers"): directly, and in ranks that ``tpcomm.launch`` starts from such a process (the ranks import the
script, and tpcomm, before their own ``TRITON_INTERPRET=1`` applies)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only chosen without CUDA")

QUANT = """
import triton, torch, tpcomm
try:
    tpcomm.per_token_quant_fp8(torch.randn(3, 256))
except RuntimeError as e:
    print("RAISED", e)
"""

GROUP = """
import triton, torch, torch.distributed as dist, tpcomm, sys, os

r, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
comm = tpcomm.Communicator()
y = comm.all_reduce(torch.full((4, 64), float(r + 1)))
assert torch.equal(y, torch.full((4, 64), 3.0)), y
print("USES_KERNELS", comm.uses_kernels, "REASON", comm.fallback_reason, flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # gloo's teardown at interpreter exit sometimes aborts ("terminate called"): not under test
"""


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run(tmp_path, code):
    """Run ``code`` as a script in a fresh Python without TRITON_INTERPRET."""
    script = tmp_path / "case.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=300)


def test_standalone_quant_says_to_import_tpcomm_first(tmp_path):
    proc = _run(tmp_path, QUANT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAISED per_token_quant_fp8: Triton was imported before tpcomm" in proc.stdout, proc.stdout


def test_importing_tpcomm_after_triton_warns_with_the_fix(tmp_path):
    proc = _run(tmp_path, "import triton, tpcomm\nimport tpcomm\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [ln for ln in proc.stderr.splitlines() if "RuntimeWarning: tpcomm: Triton was imported before" in ln]
    assert len(warned) == 1, proc.stderr  # once, at the first import
    assert "import tpcomm first" in warned[0] and "TRITON_INTERPRET=1" in warned[0], warned[0]


def test_importing_tpcomm_first_does_not_warn(tmp_path):
    proc = _run(tmp_path, "import tpcomm, triton\n")
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr[-3000:]


def test_a_communicator_falls_back_with_the_reason(tmp_path):
    """Two ranks started as torchrun starts them (fresh processes, nothing set), each importing Triton
    first: both fall back, with the reason, and the all-reduce is exact."""
    from tpcomm.launch import free_port
    script = tmp_path / "rank.py"
    script.write_text(GROUP)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert "USES_KERNELS False REASON on group rank(s) [0, 1]: Triton was imported before tpcomm" in out, out
        assert "in that process" in out, out  # each rank's reason speaks of the ranks it names


LAUNCHED = """
import torch, tpcomm
from tpcomm.launch import launch


def work(rank, world_size):
    with tpcomm.Communicator() as comm:
        y = comm.all_reduce(torch.full((4, 64), float(rank + 1)))
        reason = repr(comm)
    try:
        tpcomm.per_token_quant_fp8(torch.ones(2, 16))
        quant = "returned"
    except RuntimeError as e:
        quant = str(e)
    return torch.equal(y, torch.full((4, 64), 3.0)), reason, quant


if __name__ == "__main__":
    for exact, reason, quant in launch(work, 2, "cpu"):
        print("EXACT", exact, "|", reason, "|", quant)
"""


def test_interpret_0_without_cuda_names_the_variable(tmp_path):
    """``TRITON_INTERPRET=0`` without CUDA: the standalone quant raises a RuntimeError naming the variable
    and the fix, instead of Triton's "0 active drivers"."""
    script = tmp_path / "case.py"
    script.write_text(QUANT.replace("import triton, torch, tpcomm", "import torch, tpcomm"))
    proc = subprocess.run([sys.executable, str(script)], env=dict(_env(), TRITON_INTERPRET="0"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAISED per_token_quant_fp8: TRITON_INTERPRET='0' on a machine without CUDA" in proc.stdout, proc.stdout
    assert "active drivers" not in proc.stdout + proc.stderr


def test_ranks_launched_with_interpret_0_fall_back_with_the_reason(tmp_path):
    """``tpcomm.launch`` from a process with ``TRITON_INTERPRET=0``: each rank's communicator falls back (the
    sum exact) and says why, naming the variable; the standalone quant raises the same reason."""
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    proc = subprocess.run([sys.executable, str(script)], env=dict(_env(), TRITON_INTERPRET="0"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("EXACT")]
    assert len(lines) == 2, proc.stdout
    for ln in lines:
        exact, reason, quant = ln.split(" | ")
        assert exact == "EXACT True", ln
        assert "fallback" in reason and "TRITON_INTERPRET" in reason, ln
        assert quant.startswith("per_token_quant_fp8: TRITON_INTERPRET"), ln


EDITABLE = """
import importlib.machinery, sys

ROOT = sys.argv[1]


class Editable:
    \"\"\"As setuptools' editable finder: on sys.meta_path after the path, so a folder named tpcomm on the
    path wins as a namespace package.\"\"\"

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "tpcomm" or fullname.startswith("tpcomm."):
            where = ROOT if fullname == "tpcomm" else ROOT + "/" + fullname.rpartition(".")[0].replace(".", "/")
            return importlib.machinery.PathFinder.find_spec(fullname, [where])


sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", type(f).__name__)]
sys.meta_path.append(Editable)
import tpcomm

print("NAMESPACE", getattr(tpcomm, "__file__", None) is None)
try:
    from tpcomm.launch import launch
    print("IMPORTED")
except ImportError as e:
    print("REFUSED", e)
"""


def test_a_clone_folder_named_tpcomm_beside_the_script_is_named(tmp_path):
    """A script beside a folder named tpcomm (a clone of the repository under that name) with tpcomm
    installed in editable mode: ``import tpcomm`` gets the empty folder; importing a submodule raises an
    ImportError that says what happened and how to avoid it, instead of an AttributeError later."""
    (tmp_path / "tpcomm").mkdir()
    script = tmp_path / "case.py"
    script.write_text(EDITABLE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(script), str(ROOT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NAMESPACE True" in proc.stdout, proc.stdout
    assert f"REFUSED tpcomm: Python imported the folder {tmp_path / 'tpcomm'} as an empty namespace package" \
        in proc.stdout, proc.stdout
    assert "PYTHONSAFEPATH=1" in proc.stdout, proc.stdout
