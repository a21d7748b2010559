"""How many GPUs the ``gpu`` tests use: ``TPCOMM_GPU_WORLD`` (default 2), e.g. 4 on a 4-GPU machine.

Every GPU test file launches its ranks with :data:`GPU_WORLD` and is skipped when fewer GPUs are visible
(:data:`NEEDS_GPUS`)."""

import os

import pytest
import torch

GPU_WORLD = int(os.environ.get("TPCOMM_GPU_WORLD") or 2)
if GPU_WORLD < 2:
    raise ValueError(f"TPCOMM_GPU_WORLD={GPU_WORLD}: expected an integer >= 2")

NEEDS_GPUS = pytest.mark.skipif(torch.cuda.device_count() < GPU_WORLD,
                                reason=f"needs at least {GPU_WORLD} CUDA GPUs (TPCOMM_GPU_WORLD)")
