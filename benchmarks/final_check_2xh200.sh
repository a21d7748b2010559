#!/bin/bash
# Short device call after the last kernel change: the 10,000-step soak and the issue-3 GPU tests.
# Usage (from the repository root): bash benchmarks/final_check_2xh200.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 150 python3 -m tpcomm soak --steps 10000 --device cuda --seed 0 > $OUT/soak10000_2xH200.log 2>&1
echo "soak rc=$?"; tail -4 $OUT/soak10000_2xH200.log
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_collectives.py -k "not graph" \
    > $OUT/gpu_collectives_final.log 2>&1; echo "gpu collectives rc=$?"; tail -3 $OUT/gpu_collectives_final.log
