#!/bin/bash
# One device call on 2 H200s after kernel changes: the exhaustive FP8-division check, every GPU test
# file, and the 10,000-step soak; logs under $OUT (tarred into $OUT/tests.tgz).
# Usage (from the repository root, kind nvidia-h200-x2, timeout_s 600): bash benchmarks/session_2xh200.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. PYTHONUNBUFFERED=1
W=$OUT/work; mkdir -p $W
nvidia-smi --query-gpu=name,driver_version --format=csv > $W/gpus.txt 2>&1
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_quant.py -k fast_division \
    > $W/division.log 2>&1; echo "division rc=$?" | tee -a $W/summary.txt; tail -1 $W/division.log >> $W/summary.txt
timeout 310 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not fast_division" tests/test_gpu.py \
    tests/test_gpu_collectives.py tests/test_gpu_fused_fp8.py tests/test_gpu_bad_inputs.py tests/test_gpu_hygiene.py \
    tests/test_gpu_graphs.py tests/test_quant.py --durations=15 > $W/gpu_tests.log 2>&1
echo "gpu tests rc=$?" | tee -a $W/summary.txt; grep -E "passed|failed|FAILED|ERROR" $W/gpu_tests.log | tail -15 >> $W/summary.txt
timeout 175 python3 -m tpcomm soak --steps 10000 --device cuda --seed 0 > $W/soak10000.log 2>&1
echo "soak rc=$?" | tee -a $W/summary.txt; tail -4 $W/soak10000.log >> $W/summary.txt
tar czf $OUT/tests.tgz -C $W .
cat $W/summary.txt
