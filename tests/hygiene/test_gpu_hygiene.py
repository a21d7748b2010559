"""Resource hygiene on ``GPU_WORLD`` GPUs: 50 create/use/close cycles of a Communicator leave device memory in use,
memory allocated by torch and open file descriptors where they were. Marked ``gpu``; run on the GPU
machine: ``python -m pytest -q -m gpu tests/hygiene/test_gpu_hygiene.py``. Measured on 2 H200s:
docs/reliability.md, "Resource hygiene"."""

import pytest

from tests.hygiene import ranks
from tests.support.gpu_world import GPU_WORLD, NEEDS_GPUS
from tests.support.numerics import Checks
from tpcomm.launch import launch

pytestmark = [pytest.mark.gpu, NEEDS_GPUS]

CYCLES = 50
#: Device memory in use may move by allocator and NCCL caches; one leaked workspace (32 MiB slots: about
#: 150 MiB) per cycle would add gigabytes. (Measured on 2 H200s: no change at all.)
DEVICE_SLACK = 256 << 20
#: Open file descriptors may move by a few (CUDA IPC handles are cached per peer by the driver).
FD_SLACK = 4


@pytest.fixture(scope="module")
def cycles():
    results = launch(ranks.gpu_cycles, GPU_WORLD, "cuda", args=(CYCLES,), timeout_s=600)
    for r, res in enumerate(results):
        print(f"rank {r}: {CYCLES} cycles in {res['seconds']:.1f} s; before {res['before']}; after {res['after']}")
    return results


def test_gpu_create_close_cycles_keep_device_memory_and_fds(cycles):
    check = Checks()
    for r, res in enumerate(cycles):
        b, a = res["before"], res["after"]
        check.that(res["kernels"] and res["right"], f"rank {r}: calls fell back or were wrong: {res}")
        check.that(a["device_used"] - b["device_used"] <= DEVICE_SLACK,
                   f"rank {r}: device memory in use grew {(a['device_used'] - b['device_used']) / 2**20:.0f} MiB "
                   f"over {CYCLES} cycles")
        check.that(a["reserved"] == b["reserved"],
                   f"rank {r}: torch.cuda.memory_reserved {b['reserved']} -> {a['reserved']}")
        check.that(a["fds"] - b["fds"] <= FD_SLACK, f"rank {r}: open fds {b['fds']} -> {a['fds']}")
    check.done()


@pytest.mark.xfail(strict=False, reason="on 2 H200s (torch 2.11) torch.cuda.memory_allocated grew by 1024 bytes "
                                        "per cycle (two 512-byte blocks per Communicator stayed allocated after "
                                        "close; docs/design.md, \"Resource hygiene on GPUs\"). Workspace.close "
                                        "drops its device tables and state, which may be those blocks (make it "
                                        "strict, or remove the mark, once a GPU run passes it)")
def test_gpu_create_close_cycles_keep_memory_allocated_flat(cycles):
    check = Checks()
    for r, res in enumerate(cycles):
        b, a = res["before"], res["after"]
        check.that(a["allocated"] == b["allocated"],
                   f"rank {r}: torch.cuda.memory_allocated {b['allocated']} -> {a['allocated']} over {CYCLES} cycles")
    check.done()
