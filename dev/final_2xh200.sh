#!/bin/bash
# One device call on 2 H200s: GPU tests, bench, tune --quick, soak, demo; logs tarred into $OUT/results.tgz.
# Usage (from the repository root): bash dev/final_2xh200.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
W=$OUT/work; mkdir -p $W
nvidia-smi --query-gpu=name,driver_version --format=csv > $W/gpus.txt 2>&1
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/communicator/test_gpu.py tests/collectives/test_gpu_collectives.py \
    tests/quant/test_gpu_fused_fp8.py tests/quant/test_quant.py > $W/gpu_tests.log 2>&1; echo "gpu tests rc=$?" | tee -a $W/summary.txt
tail -3 $W/gpu_tests.log >> $W/summary.txt
timeout 150 python3 -m tpcomm bench --world 2 --hidden 6144 --dtype bf16 --modes graph,eager \
    --json $W/bench-w2.json > $W/bench.log 2>&1; echo "bench rc=$?" | tee -a $W/summary.txt
timeout 70 python3 -m tpcomm tune --quick --world 2 --out $W/dispatch-w2.json > $W/tune.log 2>&1; echo "tune rc=$?" | tee -a $W/summary.txt
timeout 240 python3 -m tpcomm soak --steps 10000 --world 2 > $W/soak.log 2>&1; echo "soak rc=$?" | tee -a $W/summary.txt
tail -5 $W/soak.log >> $W/summary.txt
timeout 40 python3 -m tpcomm demo > $W/demo.log 2>&1; echo "demo rc=$?" | tee -a $W/summary.txt
tar czf $OUT/results.tgz -C $W .
cat $W/summary.txt
