#!/bin/bash
# Device calls after kernel changes, in parts that each fit one 600 s call (2 H200s unless said):
#   bash dev/gpu_runs.sh tests   # every GPU test file, then decode timings of kernel variants
#   bash dev/gpu_runs.sh sweep   # the 10,000-step soak, then the full bench sweep with FlashInfer
#   bash dev/gpu_runs.sh decode  # a short bench (hidden 6144/7168, graph), then the GPU tests
#   bash dev/gpu_runs.sh w4      # 4 H200s (kind nvidia-h200-x4): every GPU test file with 4 ranks,
#                                        # a 2,000-step soak, the demo, tune --quick, a bench at hidden 6144
#   bash dev/gpu_runs.sh w4b     # 4 H200s: soak, FP8 and chunking tests again, the bench of every op
#   bash dev/gpu_runs.sh check   # a 3,000-step soak, then the graph and cross-algorithm GPU tests
#   bash dev/gpu_runs.sh loopback  # ONE GPU (kind nvidia-h200): the loopback tests (every algorithm,
#                                        # 2 and 3 ranks on one GPU) and the FP8 quant tests, then decode
#                                        # timings of kernel variants
#   bash dev/gpu_runs.sh peer      # ONE GPU (carry [".whl"]): tpcomm bench --loopback (TRT-LLM beside),
#                                        # then benchmarks/host_loopback.py (eager host time per call)
#   bash dev/gpu_runs.sh decode1   # ONE GPU (carry [".whl", ".old"]): the loopback and FP8 GPU tests, then
#                                        # bench --loopback of this tree and of .old/ (the kernels to compare
#                                        # against: `mkdir -p .old && git archive <commit> tpcomm | tar -x -C .old`)
#   bash dev/gpu_runs.sh decode3   # ONE GPU: where the host time of a repeated call goes
#                                        # (benchmarks/host_profile.py), kernel variants (VARIANTS, default
#                                        # base,no_pdl), then the loopback and FP8 GPU tests
#   bash dev/gpu_runs.sh decode4   # ONE GPU (carry [".whl", ".old"]): the replay test, host time per
#                                        # call, then bench --loopback (1-4096 tokens) of this tree and of .old/
#   bash dev/gpu_runs.sh decode5   # ONE GPU (carry [".old2"]): the loopback and FP8 GPU tests, then the
#                                        # decode bench (6144, 1-64 tokens) of this tree and of .old2/, then
#                                        # the host time per call at 1 token
#   bash dev/gpu_runs.sh decode6   # ONE GPU (carry [".old2", ".whl"]): the loopback fault tests and graph
#                                        # replays, then the decode bench (6144, 1-64 tokens, with TRT-LLM) of
#                                        # this tree, of .old2/ and of this tree again
#   bash dev/gpu_runs.sh decode7   # ONE GPU (carry [OLD, default ".old3", and ".whl"]): the loopback and FP8
#                                        # GPU tests, then the decode bench (HIDDEN, default 6144; 1-64 tokens,
#                                        # TRT-LLM beside) of this tree, of $OLD and of this tree again
#   TREES=". .old" bash dev/gpu_runs.sh ab  # ONE GPU (carry [".whl"] and each tree): the decode bench
#                                        # (HIDDEN, TOKENS) of each tree in turn, TRT-LLM beside the first
#                                        # (BENCH=0: none);
#                                        # HOST=1: then the eager host path of each tree
#                                        # (benchmarks/host_profile.py), then of every op of each tree
#                                        # (host_loopback.py);
#                                        # TESTS=1: then the loopback and FP8 GPU tests
#   TREES=". .fa .fb" bash dev/gpu_runs.sh formsab  # ONE GPU (carry each tree): the quant forms bench
#                                        # (HIDDEN, default 6144; TOKENS, default 1,16,64,256) of each tree in turn
#   bash dev/gpu_runs.sh forms     # ONE GPU: the quant forms bench in loopback (hidden 6144 and 7168,
#                                        # 1-4096 tokens)
#   TREES=". .v" bash dev/gpu_runs.sh worlds  # ONE GPU (carry [".whl"] and each tree): the decode bench at 4
#                                        # loopback ranks (TRT-LLM beside; then one-shot forced), at 2 ranks
#                                        # (TRT-LLM beside; then each other tree; WORLDS="4 2" picks the
#                                        # parts); TESTS=1: the 3- and 4-rank tests
#   bash dev/gpu_runs.sh verify    # ONE GPU: every one-GPU test file at once (VERIFY_S each)
#   bash dev/gpu_runs.sh model     # ONE GPU (carry [".whl-hf"]: transformers and its dependencies as
#                                        # wheels for Python 3.12): tpcomm demo --model llama and gemma on
#                                        # loopback ranks, then the loopback GPU tests
#   bash dev/gpu_runs.sh decode2   # ONE GPU (carry [".whl"]): host time at 25 and 200 calls a batch, the
#                                        # loopback bench with a grid cap of 32 (1-4096 tokens), 4 loopback ranks
# (from the repository root; kind nvidia-h200-x2, timeout_s 600; the sweep part needs carry [".whl"],
# see docs/flashinfer-offline.md). Logs are tarred into $OUT/results.tgz; the
# exit status is 1 when a step's summary line records a non-zero rc.
: "${OUT:?OUT must name the folder whose files come back (the device tool sets it)}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. PYTHONUNBUFFERED=1
W="$OUT/work"; mkdir -p "$W"; ROOT=$(pwd)

# Every GPU test file: four pytest processes at once (compiling dominates; 32 cores), each within $1
# seconds, then the hygiene file alone within $2 (it counts this machine's /dev/shm files).
all_gpu_tests() {
    gpu_tests() { name=$1; limit=$2; shift 2
        timeout $limit python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "$@" --durations=5 > $W/$name.log 2>&1
        echo "$name rc=$?" >> $W/summary.txt; grep -E "passed|failed|^FAILED|^ERROR|XPASS" $W/$name.log | tail -8 >> $W/summary.txt; }
    gpu_tests gpu $1 tests/communicator/test_gpu.py & gpu_tests collectives $1 tests/collectives/test_gpu_collectives.py &
    gpu_tests fp8 $1 tests/quant/test_gpu_fused_fp8.py tests/quant/test_quant.py &
    gpu_tests graphs $1 tests/ops/test_gpu_graphs.py tests/bad_inputs/test_bad_inputs.py &
    wait
    timeout $2 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/hygiene/test_gpu_hygiene.py > $W/hygiene.log 2>&1
    echo "hygiene rc=$?" >> $W/summary.txt; tail -1 $W/hygiene.log >> $W/summary.txt
}

# The one-GPU test files (loopback ranks; the FP8 quant tests) side by side, each within $1 seconds.
one_gpu_tests() {
    for f in loopback_tests:tests/collectives/test_gpu_loopback.py quant_tests:tests/quant/test_quant.py \
             loopback_quant_tests:tests/quant/test_gpu_loopback_quant.py launch_tests:tests/host/test_launch.py; do
        (timeout $1 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE ${f#*:} > $W/${f%%:*}.log 2>&1
         echo "${f%%:*} rc=$?" >> $W/summary.txt; grep -E "passed|failed|^FAILED|^ERROR" $W/${f%%:*}.log | tail -8 >> $W/summary.txt) &
    done
    wait
}

# Run "$@" with FlashInfer importable: its wheels and AOT modules from .whl/ (carry [".whl"]; see
# docs/flashinfer-offline.md) installed into a temporary site.
with_flashinfer() {
    site=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" $ROOT/.whl/*.whl
    mkdir -p "$site/flashinfer/data/aot" && cp -r $ROOT/.whl/aot/* "$site/flashinfer/data/aot/"
    PYTHONPATH=.:$site FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_USE_CUDA_NORM=1 FLASHINFER_DISABLE_JIT=1 "$@"
}

# tpcomm demo --model llama and gemma on this GPU's loopback ranks, transformers from .whl-hf/ (carry
# [".whl-hf"]: its wheels and its dependencies' for Python 3.12).
model_demos() {
    site=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl-hf/*.whl
    for m in llama gemma; do
        PYTHONPATH=.:$site timeout 150 python3 -m tpcomm demo --model $m --device cuda > $W/demo-$m.log 2>&1
        echo "demo-$m rc=$?" >> $W/summary.txt; tail -4 $W/demo-$m.log >> $W/summary.txt
    done
}

case "$1" in
tests)
    # Every GPU test file, then decode timings of kernel variants in what time is left.
    all_gpu_tests 330 90
    timeout ${DECODE_S:-100} python3 dev/dev_decode.py --variants ${VARIANTS:-base,warps8} --out $W > $W/dev_decode.log 2>&1
    echo "decode rc=$?" >> $W/summary.txt ;;
sweep)
    timeout 240 python3 -m tpcomm soak --steps 10000 --device cuda --seed 0 > $W/soak10000.log 2>&1
    echo "soak rc=$?" | tee -a $W/summary.txt; tail -8 $W/soak10000.log >> $W/summary.txt
    with_flashinfer timeout 330 python3 -m tpcomm bench --json $W/bench-2xH200.json > $W/bench-2xH200.log 2>&1
    echo "bench rc=$?" | tee -a $W/summary.txt ;;
decode)
    # Short: the decode-relevant bench (fused, FP8, all-reduce, reduce-scatter at hidden 6144 and 7168, graph mode, every
    # contender), then every GPU test file (needs carry [".whl"]).
    with_flashinfer timeout 130 python3 -m tpcomm bench --ops fused,fused_fp8,all_reduce,reduce_scatter --hidden 6144,7168 --dtype bf16 \
        --modes graph --json $W/bench-decode-2xH200.json > $W/bench-decode-2xH200.log 2>&1
    echo "bench rc=$?" | tee -a $W/summary.txt
    all_gpu_tests 220 40 ;;
w4)
    # World size 4 (issue 8): GPU tests with 4 ranks, soak, demo, tune, then the bench of fused, FP8 and
    # all-reduce at hidden 6144 against every contender (needs carry [".whl"]). Each step has its own limit
    # so the call ends within 600 s; logs land in $OUT/work as they are written.
    TPCOMM_GPU_WORLD=4 all_gpu_tests 250 40
    # (70 s was too short for the soak's compilations on 4 ranks: it ran again in w4b)
    timeout 70 python3 -m tpcomm soak --steps 2000 --device cuda --seed 0 > $W/soak2000_w4.log 2>&1
    echo "soak rc=$?" >> $W/summary.txt; tail -6 $W/soak2000_w4.log >> $W/summary.txt
    timeout 40 python3 -m tpcomm demo > $W/demo_w4.log 2>&1
    echo "demo rc=$?" >> $W/summary.txt; tail -3 $W/demo_w4.log >> $W/summary.txt
    timeout 80 python3 -m tpcomm tune --quick --out $W/dispatch-w4.json > $W/tune_w4.log 2>&1
    echo "tune rc=$?" >> $W/summary.txt
    with_flashinfer timeout 85 python3 -m tpcomm bench --ops fused,fused_fp8,all_reduce --hidden 6144 --dtype bf16 \
        --modes graph --json $W/bench-w4.json > $W/bench-w4.log 2>&1
    echo "bench rc=$?" >> $W/summary.txt ;;
w4b)
    # World size 4, second call: the soak and the FP8 and chunking tests that ran out of time in w4 (run
    # side by side, so the soak's wait limit is 30 s), then the bench of every op at hidden 6144 with the
    # 4-rank default table (needs carry [".whl"]).
    export TPCOMM_GPU_WORLD=4
    step() { name=$1; shift; "$@" > $W/$name.log 2>&1; echo "$name rc=$?" >> $W/summary.txt; tail -3 $W/$name.log >> $W/summary.txt; }
    step soak2000_w4 timeout 300 python3 -m tpcomm soak --steps 2000 --device cuda --seed 0 --timeout 30 &
    step fp8 timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/quant/test_gpu_fused_fp8.py tests/quant/test_quant.py &
    step chunked timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/communicator/test_gpu.py -k chunked &
    wait
    with_flashinfer timeout 110 python3 -m tpcomm bench --ops fused,fused_fp8,all_reduce,all_gather,reduce_scatter \
        --hidden 6144 --dtype bf16 --modes graph --json $W/bench-w4.json > $W/bench-w4.log 2>&1
    echo "bench rc=$?" >> $W/summary.txt ;;
check)
    # After a dispatch-table or launch-setting change: a 3,000-step soak, then the graph and
    # cross-algorithm test files side by side.
    timeout 150 python3 -m tpcomm soak --steps 3000 --device cuda --seed 1 > $W/soak3000.log 2>&1
    echo "soak rc=$?" >> $W/summary.txt; tail -4 $W/soak3000.log >> $W/summary.txt
    for f in graphs:tests/ops/test_gpu_graphs.py collectives:tests/collectives/test_gpu_collectives.py; do
        (timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE ${f#*:} > $W/${f%%:*}.log 2>&1
         echo "${f%%:*} rc=$?" >> $W/summary.txt; tail -2 $W/${f%%:*}.log >> $W/summary.txt) &
    done
    wait ;;
loopback)
    # One GPU: tests/collectives/test_gpu_loopback.py (about 150 s, compiling) and the one-GPU FP8 tests side by side,
    # then dev_loopback's variants.
    one_gpu_tests 300
    timeout ${DECODE_S:-240} python3 dev/dev_loopback.py --variants ${VARIANTS:-base,no_pdl} --replays 20 \
        --out $W > $W/dev_loopback.log 2>&1
    echo "dev_loopback rc=$?" >> $W/summary.txt ;;
peer)
    # One GPU (carry [".whl"]): tpcomm beside FlashInfer's TRT-LLM one-shot, both as loopback ranks, graph mode
    # (tpcomm bench --loopback), then the eager host time of every op (benchmarks/host_loopback.py).
    with_flashinfer timeout ${PEER_S:-360} python3 -m tpcomm bench --loopback --json $W/bench-loopback.json \
        > $W/bench-loopback.log 2>&1
    echo "bench-loopback rc=$?" >> $W/summary.txt
    timeout ${HOST_S:-180} python3 benchmarks/host_loopback.py --out $W/host_loopback.json > $W/host_loopback.log 2>&1
    echo "host_loopback rc=$?" >> $W/summary.txt ;;
decode1)
    one_gpu_tests 240
    with_flashinfer timeout 170 python3 -m tpcomm bench --loopback --tokens 1,16,64,256,1024 --json $W/bench-new.json \
        > $W/bench-new.log 2>&1
    echo "bench-new rc=$?" >> $W/summary.txt
    if [ -d .old/tpcomm ]; then
        cp tpcomm/bench/loopback.py tpcomm/bench/args.py .old/tpcomm/bench/  # the same harness for both
        (cd .old && PYTHONPATH=. timeout 120 python3 -m tpcomm bench --loopback --tokens 1,16,64,256,1024 \
            --json $W/bench-old.json > $W/bench-old.log 2>&1; echo "bench-old rc=$?" >> $W/summary.txt)
    fi ;;
decode3)
    timeout 80 python3 benchmarks/host_profile.py > $W/host_profile.log 2>&1
    echo "host_profile rc=$?" >> $W/summary.txt
    timeout ${DECODE_S:-200} python3 dev/dev_loopback.py --variants ${VARIANTS:-base,no_pdl} --replays 20 \
        --out $W > $W/dev_loopback.log 2>&1
    echo "dev_loopback rc=$?" >> $W/summary.txt
    one_gpu_tests 220 ;;
decode4)
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/collectives/test_gpu_loopback.py -k repeated \
        > $W/replay_tests.log 2>&1
    echo "replay_tests rc=$?" >> $W/summary.txt; tail -1 $W/replay_tests.log >> $W/summary.txt
    timeout 90 python3 benchmarks/host_loopback.py --calls 200 --rounds 5 --out $W/host_loopback.json \
        > $W/host_loopback.log 2>&1
    echo "host_loopback rc=$?" >> $W/summary.txt
    with_flashinfer timeout 220 python3 -m tpcomm bench --loopback --tokens 1,16,64,256,1024,4096 --json $W/bench-new.json \
        > $W/bench-new.log 2>&1
    echo "bench-new rc=$?" >> $W/summary.txt
    with_flashinfer timeout 90 python3 -m tpcomm bench --loopback --world 4 --hidden 6144 --tokens 1,16,64,256 \
        --json $W/bench-w4.json > $W/bench-w4.log 2>&1
    echo "bench-w4 rc=$?" >> $W/summary.txt
    cp tpcomm/bench/loopback.py tpcomm/bench/args.py .old/tpcomm/bench/
    (cd .old && PYTHONPATH=. timeout 120 python3 -m tpcomm bench --loopback --tokens 256,1024,4096 \
        --json $W/bench-old.json > $W/bench-old.log 2>&1; echo "bench-old rc=$?" >> $W/summary.txt) ;;
decode5)
    one_gpu_tests 230
    timeout 70 python3 -m tpcomm bench --loopback --hidden 6144 --tokens 1,16,64 --json $W/bench-new.json \
        > $W/bench-new.log 2>&1
    echo "bench-new rc=$?" >> $W/summary.txt
    cp tpcomm/bench/loopback.py tpcomm/bench/args.py .old2/tpcomm/bench/
    (cd .old2 && PYTHONPATH=. timeout 70 python3 -m tpcomm bench --loopback --hidden 6144 --tokens 1,16,64 \
        --json $W/bench-old.json > $W/bench-old.log 2>&1; echo "bench-old rc=$?" >> $W/summary.txt)
    timeout 60 python3 benchmarks/host_loopback.py --calls 200 --rounds 3 --tokens 1 --out $W/host_loopback.json \
        > $W/host_loopback.log 2>&1
    echo "host_loopback rc=$?" >> $W/summary.txt ;;
decode7)
    one_gpu_tests 240
    for run in new old new2; do
        if [ $run = old ]; then
            cp tpcomm/bench/loopback.py tpcomm/bench/args.py ${OLD:-.old3}/tpcomm/bench/
            (cd ${OLD:-.old3} && PYTHONPATH=. timeout 80 python3 -m tpcomm bench --loopback --hidden ${HIDDEN:-6144} \
                --tokens 1,16,64 --json $W/bench-old.json > $W/bench-old.log 2>&1; echo "bench-old rc=$?" >> $W/summary.txt)
        else
            with_flashinfer timeout 100 python3 -m tpcomm bench --loopback --hidden ${HIDDEN:-6144} --tokens 1,16,64 \
                --json $W/bench-$run.json > $W/bench-$run.log 2>&1
            echo "bench-$run rc=$?" >> $W/summary.txt
        fi
    done ;;
ab)
    # Kernel A/B: the decode bench (HIDDEN, TOKENS, WORLD loopback ranks) of each tree of TREES in turn, the first with TRT-LLM
    # beside (carry [".whl"] and every tree: a copy of the package, e.g. `git archive <commit> tpcomm |
    # tar -x -C .old`); then, with TESTS=1, the loopback and FP8 GPU tests of this tree.
    first=1
    for tree in $([ "${BENCH:-1}" = 1 ] && echo ${TREES:-.}); do  # BENCH=0: no decode bench
        name=$(basename $(cd $tree && pwd))
        [ "$tree" = . ] || cp tpcomm/bench/loopback.py tpcomm/bench/args.py $tree/tpcomm/bench/
        if [ $first = 1 ]; then run=with_flashinfer; else run=env; fi; first=0
        (cd $tree && $run timeout ${BENCH_S:-100} python3 -m tpcomm bench --loopback --world ${WORLD:-2} --hidden ${HIDDEN:-6144} \
            --tokens ${TOKENS:-1,16,64} --json $W/bench-$name.json > $W/bench-$name.log 2>&1
         echo "bench-$name rc=$?" >> $W/summary.txt)
    done
    if [ "${HOST:-0}" = 1 ]; then  # the eager host path of each tree (TRT-LLM's call beside), then every op's
        for tree in ${TREES:-.}; do
            name=$(basename $(cd $tree && pwd))
            (cd $tree && with_flashinfer timeout 120 python3 $ROOT/benchmarks/host_profile.py > $W/host_profile-$name.log 2>&1
             echo "host_profile-$name rc=$?" >> $W/summary.txt)
        done
        for tree in ${TREES:-.}; do  # every op's host time, each tree in turn (the first tree's is host_loopback.json)
            name=$(basename $(cd $tree && pwd)); [ "$tree" = . ] && suffix= || suffix=-$name
            (cd $tree && with_flashinfer timeout ${HOST_S:-150} python3 $ROOT/benchmarks/host_loopback.py --calls 200 \
                --rounds 5 --out $W/host_loopback$suffix.json > $W/host_loopback$suffix.log 2>&1
             echo "host_loopback$suffix rc=$?" >> $W/summary.txt)
        done
    fi
    [ "${TESTS:-0}" = 1 ] && one_gpu_tests 240 ;;
forms)
    # The quantised fused forms beside fused bf16 and fused bf16 + the standalone op (quant_loopback.py: hidden
    # 6144 and 7168, 1-4096 tokens); the model demos have their own step (model).
    timeout ${QUANT_S:-540} python3 benchmarks/quant_loopback.py --out $W/quant_loopback.jsonl > $W/quant_loopback.log 2>&1
    echo "quant_loopback rc=$?" >> $W/summary.txt ;;
formsab)
    # Quant-form kernel A/B: benchmarks/quant_loopback.py (the forms beside fused bf16 and the composite) of each
    # tree of TREES in turn, in the same run; each tree is a copy of the package, the script is this tree's.
    for tree in ${TREES:-.}; do
        name=$(basename $(cd $tree && pwd))
        (cd $tree && PYTHONPATH=. timeout ${QUANT_S:-150} python3 $ROOT/benchmarks/quant_loopback.py --hidden ${HIDDEN:-6144} \
            --tokens ${TOKENS:-1,16,64,256} --out $W/quant-$name.jsonl > $W/quant-$name.log 2>&1
         echo "quant-$name rc=$?" >> $W/summary.txt)
    done ;;
worlds)
    # One GPU (carry [".whl"] and every tree of TREES): the decode bench (HIDDEN4, 1-64 tokens) at 4 loopback
    # ranks with TRT-LLM beside, the same with TPCOMM_ALGO=one_shot (the 4-rank crossover), then at 2 ranks
    # (HIDDEN2) with TRT-LLM beside and each other tree of TREES after it (WORLDS="4 2": which of the
    # two parts run); then, with TESTS=1, the loopback tests at 3 and 4 ranks and the fault tests.
    bench() { name=$1; shift; timeout ${BENCH_S:-130} python3 -m tpcomm bench --loopback --tokens 1,16,64 \
        --json $W/bench-$name.json "$@" > $W/bench-$name.log 2>&1; echo "bench-$name rc=$?" >> $W/summary.txt; }
    if [[ " ${WORLDS:-4 2} " == *" 4 "* ]]; then
        with_flashinfer bench w4 --world 4 --hidden ${HIDDEN4:-4096,6144}
        TPCOMM_ALGO=one_shot bench w4-one_shot --world 4 --hidden ${HIDDEN4:-4096,6144}
    fi
    if [[ " ${WORLDS:-4 2} " == *" 2 "* ]]; then
        with_flashinfer bench w2 --world 2 --hidden ${HIDDEN2:-4096,6144,8192}
        for tree in ${TREES:-}; do
            [ "$tree" = . ] && continue
            cp tpcomm/bench/loopback.py tpcomm/bench/args.py $tree/tpcomm/bench/
            (cd $tree && bench w2-$(basename $tree) --world 2 --hidden ${HIDDEN2:-4096,6144,8192})
        done
    fi
    if [ "${TESTS:-0}" = 1 ]; then
        timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/collectives/test_gpu_loopback.py \
            -k "w3 or w4 or missing or late or another" > $W/loopback_tests.log 2>&1
        echo "loopback_tests rc=$?" >> $W/summary.txt; tail -1 $W/loopback_tests.log >> $W/summary.txt
    fi ;;
verify)
    # Every one-GPU test file at once, each within VERIFY_S seconds.
    one_gpu_tests ${VERIFY_S:-450} ;;
decode6)
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/collectives/test_gpu_loopback.py \
        -k "missing_peer or late_rank or another_call or graph_replays or repeated" > $W/fault_tests.log 2>&1
    echo "fault_tests rc=$?" >> $W/summary.txt; tail -1 $W/fault_tests.log >> $W/summary.txt
    for run in new old new2; do
        if [ $run = old ]; then
            cp tpcomm/bench/loopback.py tpcomm/bench/args.py .old2/tpcomm/bench/
            (cd .old2 && PYTHONPATH=. timeout 70 python3 -m tpcomm bench --loopback --hidden 6144 --tokens 1,16,64 \
                --json $W/bench-old.json > $W/bench-old.log 2>&1; echo "bench-old rc=$?" >> $W/summary.txt)
        else
            with_flashinfer timeout 100 python3 -m tpcomm bench --loopback --hidden 6144 --tokens 1,16,64 \
                --json $W/bench-$run.json > $W/bench-$run.log 2>&1
            echo "bench-$run rc=$?" >> $W/summary.txt
        fi
    done ;;
model)
    model_demos
    timeout 290 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/collectives/test_gpu_loopback.py --durations=5 \
        > $W/loopback_tests.log 2>&1
    echo "loopback_tests rc=$?" >> $W/summary.txt; tail -3 $W/loopback_tests.log >> $W/summary.txt ;;
decode2)
    for n in 25 200; do
        timeout 80 python3 benchmarks/host_loopback.py --calls $n --rounds 5 --out $W/host_loopback_$n.json \
            > $W/host_loopback_$n.log 2>&1
        echo "host_loopback $n rc=$?" >> $W/summary.txt
    done
    with_flashinfer timeout 200 python3 -m tpcomm bench --loopback --programs 32 --json $W/bench-p32.json \
        > $W/bench-p32.log 2>&1
    echo "bench-p32 rc=$?" >> $W/summary.txt
    with_flashinfer timeout 90 python3 -m tpcomm bench --loopback --world 4 --hidden 6144 --tokens 1,16,64,256 \
        --json $W/bench-w4.json > $W/bench-w4.log 2>&1
    echo "bench-w4 rc=$?" >> $W/summary.txt ;;
*)
    echo "usage: bash dev/gpu_runs.sh tests|sweep|decode|w4|w4b|check|loopback|peer|decode1|decode2|decode3|decode4|decode5|decode6|decode7|ab|formsab|forms|worlds|verify|model"; exit 2 ;;
esac
tar czf "$OUT/results.tgz" -C "$W" .
cat "$W/summary.txt"
! grep -q 'rc=[1-9]' "$W/summary.txt"
