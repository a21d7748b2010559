#!/bin/bash
# Short device call after the last kernel change: the 10,000-step soak, then the graph and hygiene GPU
# tests, then the bad-input matrix while time is left. Logs in $OUT.
# Usage (from the repository root, kind nvidia-h200-x2): bash benchmarks/final_check_2xh200.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 240 python3 -m tpcomm soak --steps 10000 --device cuda --seed 0 > $OUT/soak10000_2xH200.log 2>&1
echo "soak rc=$?"; tail -5 $OUT/soak10000_2xH200.log
timeout 120 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_gpu_graphs.py tests/test_gpu_hygiene.py \
    > $OUT/gpu_graphs_hygiene.log 2>&1; echo "graphs+hygiene rc=$?"; grep -E "PASS|FAIL|XFAIL|ERROR|passed|failed" $OUT/gpu_graphs_hygiene.log | tail -14
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_bad_inputs.py > $OUT/gpu_bad_inputs.log 2>&1
echo "bad inputs rc=$?"; tail -3 $OUT/gpu_bad_inputs.log
