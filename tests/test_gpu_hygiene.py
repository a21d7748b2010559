"""Resource hygiene on 2 GPUs: 50 create/use/close cycles of a Communicator leave memory allocated by
torch, device memory in use and open file descriptors where they were. Marked ``gpu``; run on the GPU
machine: ``python -m pytest -q -m gpu tests/test_gpu_hygiene.py``."""

import pytest
import torch

import hygiene_cases
from numerics import Checks
from tpcomm.launch import launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least two CUDA GPUs")]

CYCLES = 50
#: Device memory in use may move by allocator and NCCL caches; one leaked workspace (32 MiB slots: about
#: 150 MiB) per cycle would add gigabytes.
DEVICE_SLACK = 256 << 20
#: Open file descriptors may move by a few (CUDA IPC handles are cached per peer by the driver).
FD_SLACK = 4


def test_gpu_create_close_cycles_leak_nothing():
    results = launch(hygiene_cases.gpu_cycles, 2, "cuda", args=(CYCLES,), timeout_s=600)
    check = Checks()
    for r, res in enumerate(results):
        b, a = res["before"], res["after"]
        check.that(res["kernels"] and res["right"], f"rank {r}: calls fell back or were wrong: {res}")
        check.that(a["allocated"] == b["allocated"],
                   f"rank {r}: torch.cuda.memory_allocated {b['allocated']} -> {a['allocated']}")
        check.that(a["device_used"] - b["device_used"] <= DEVICE_SLACK,
                   f"rank {r}: device memory in use grew {(a['device_used'] - b['device_used']) / 2**20:.0f} MiB "
                   f"over {CYCLES} cycles")
        check.that(a["fds"] - b["fds"] <= FD_SLACK, f"rank {r}: open fds {b['fds']} -> {a['fds']}")
        print(f"rank {r}: {CYCLES} cycles in {res['seconds']:.1f} s; before {b}; after {a}")
    check.done()
