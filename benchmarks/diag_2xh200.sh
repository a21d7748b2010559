#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
timeout 120 python3 benchmarks/diag_calls.py > $OUT/diag_calls.log 2>&1; echo "diag rc=$?"; grep -v "^\s*$" $OUT/diag_calls.log | tail -40
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_quant.py -k fast_division > $OUT/division.log 2>&1; echo "division rc=$?"; tail -2 $OUT/division.log
(timeout 100 python3 -m tpcomm soak --steps 100 --device cuda --seed 0 > $OUT/soak100.log 2>&1; echo "soak rc=$?" >> $OUT/soak100.log) &
sleep 70; pkill -ABRT -f multiprocessing.spawn; sleep 5; wait; tail -60 $OUT/soak100.log
