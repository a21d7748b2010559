#!/bin/bash
# GPU runs for contributors: the GPU test suites, A/B timings of two trees of the package, the loopback and
# quant-form benches, the soak and the model demos. Each command fits in about 10 minutes. From the
# repository root:
#
#   bash dev/gpu_runs.sh gpu-tests       # 2+ GPUs: every multi-GPU test file (four pytest processes at once,
#                                        # each within TEST_S s, default 330), then the hygiene file alone
#                                        # (HYGIENE_S, default 90); TPCOMM_GPU_WORLD ranks (default 2)
#   bash dev/gpu_runs.sh one-gpu-tests   # ONE GPU: every one-GPU test file (loopback ranks, FP8 quant, launch)
#                                        # side by side, each within VERIFY_S s (default 450)
#   TREES=". .old" bash dev/gpu_runs.sh ab
#                                        # ONE GPU: the decode bench (tpcomm bench --loopback; HIDDEN, default
#                                        # 6144; TOKENS, default 1,16,64; WORLD, default 2) of each tree in turn,
#                                        # TRT-LLM beside the first (BENCH=0: none); HOST=1: then the eager host
#                                        # path of each tree (benchmarks/host_profile.py, host_loopback.py);
#                                        # TESTS=1: then the one-GPU tests
#   TREES=". .v" bash dev/gpu_runs.sh worlds
#                                        # ONE GPU: the decode bench at 4 loopback ranks (TRT-LLM beside; then
#                                        # one-shot forced) and at 2 (TRT-LLM beside; then each other tree);
#                                        # WORLDS="4 2" picks the parts; TESTS=1: the 3- and 4-rank tests
#   bash dev/gpu_runs.sh forms           # ONE GPU: the quant forms bench (benchmarks/quant_loopback.py, hidden
#                                        # 6144 and 7168, 1-4096 tokens; QUANT_S, default 540)
#   TREES=". .fa .fb" bash dev/gpu_runs.sh formsab
#                                        # ONE GPU: the quant forms bench (HIDDEN, default 6144; TOKENS, default
#                                        # 1,16,64,256) of each tree in turn
#   bash dev/gpu_runs.sh soak-bench      # 2+ GPUs: the 10,000-step soak, then the full tpcomm bench sweep
#                                        # (FlashInfer from .whl/)
#   bash dev/gpu_runs.sh new-ops         # ONE GPU: the fused QK norm's and the fused MoE finalize's loopback
#                                        # tests side by side (TEST_S, default 200), then their benches
#                                        # (benchmarks/qk_norm_loopback.py; benchmarks/moe_loopback.py with
#                                        # TRT-LLM's MoE fusions beside, FlashInfer from .whl/; MOE=0: no MoE bench,
#                                        # QK=0: no QK bench)
#   bash dev/gpu_runs.sh model           # ONE GPU: tpcomm demo --model llama and gemma on loopback ranks
#                                        # (transformers from .whl-hf/), then the loopback tests
#   bash dev/gpu_runs.sh sweep           # ONE GPU: the deadline sweep (tests/faults/test_gpu_deadline_sweep.py)
#                                        # within SWEEP_S s (default 240; the trials get a third, compiling
#                                        # the rest; SWEEP_TRIALS per op, default 600); its JSON summaries kept
#   bash dev/gpu_runs.sh every-op        # 2+ GPUs: tpcomm demo (every op and quantised form, DEMO_S, default
#                                        # 150), then the soak of every op (STEPS, default 10000; SOAK_S, 400)
#   bash dev/gpu_runs.sh compile-bench   # 2+ GPUs (WORLD, default 2): a Llama (4 layers, hidden 4096, bf16) under
#                                        # transformers' own tensor parallelism, torch.compile with CUDA graphs
#                                        # without and with tpcomm's fusion pass, step time of each at TOKENS
#                                        # (default 1,16,64) (benchmarks/compile_decode.py; transformers and
#                                        # accelerate from .whl-hf/; COMPILE_S, default 540)
#   bash dev/gpu_runs.sh minimax-layer   # ONE GPU: one MiniMax-M2 decoder layer at its real shapes (hidden 3072,
#                                        # 48 and 8 heads of 128, 256 experts top 8), TP 2, 4, 8 as loopback ranks,
#                                        # 1-64 tokens, CUDA graphs: the fused collectives against unfused ones and
#                                        # the local work alone (benchmarks/minimax_layer_loopback.py; LAYER_WORLDS,
#                                        # LAYER_TOKENS; LAYER_S, default 300; KV4=1: then TP 8 with 4 key-value
#                                        # heads, each on 2 ranks: kv_replicas)
#
# A tree is a copy of the package: `mkdir -p .old && git archive <commit> tpcomm | tar -x -C .old`.
# FlashInfer without network: docs/flashinfer-offline.md. Logs go to $OUT/work (OUT defaults to ./out) and are
# tarred into $OUT/results-<command>.tgz at the end (the folder then removed); $OUT/summary.txt gets one line
# per step (of every command run with the same OUT); the exit status is 1 when a step's line records a
# non-zero rc.
OUT=${OUT:-$(pwd)/out}
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

# Run "$@" with FlashInfer importable: its wheels and AOT modules from .whl/ (docs/flashinfer-offline.md)
# installed into a temporary site.
with_flashinfer() {
    site=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" $ROOT/.whl/*.whl
    mkdir -p "$site/flashinfer/data/aot" && cp -r $ROOT/.whl/aot/* "$site/flashinfer/data/aot/"
    PYTHONPATH=.:$site FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_USE_CUDA_NORM=1 FLASHINFER_DISABLE_JIT=1 "$@"
}

# tpcomm demo --model llama and gemma on this GPU's loopback ranks, transformers from .whl-hf/ (its wheels
# and its dependencies' for Python 3.12: docs/models.md).
model_demos() {
    site=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl-hf/*.whl
    for m in llama gemma; do
        PYTHONPATH=.:$site timeout 150 python3 -m tpcomm demo --model $m --device cuda > $W/demo-$m.log 2>&1
        echo "demo-$m rc=$?" >> $W/summary.txt; tail -4 $W/demo-$m.log >> $W/summary.txt
    done
}

# Run "$@" with transformers and accelerate importable: their wheels and their dependencies' from .whl-hf/
# (`pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl-hf
# transformers accelerate` where there is network) installed into a temporary site.
with_transformers() {
    site=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" $ROOT/.whl-hf/*.whl
    PYTHONPATH=.:$site "$@"
}

case "$1" in
gpu-tests)
    all_gpu_tests ${TEST_S:-330} ${HYGIENE_S:-90} ;;
one-gpu-tests)
    one_gpu_tests ${VERIFY_S:-450} ;;
ab)
    # Kernel A/B on one GPU: the decode bench (HIDDEN, TOKENS, WORLD loopback ranks) of each tree of TREES in turn,
    # the first with TRT-LLM beside (FlashInfer from .whl/); each tree is a copy of the package (e.g. `git archive
    # <commit> tpcomm | tar -x -C .old`); then, with TESTS=1, the loopback and FP8 GPU tests of this tree.
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
    # One GPU (FlashInfer from .whl/; every tree of TREES a copy of the package): the decode bench (HIDDEN4, 1-64 tokens) at 4 loopback
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
soak-bench)
    timeout 240 python3 -m tpcomm soak --steps 10000 --device cuda --seed 0 > $W/soak10000.log 2>&1
    echo "soak rc=$?" | tee -a $W/summary.txt; tail -8 $W/soak10000.log >> $W/summary.txt
    with_flashinfer timeout 330 python3 -m tpcomm bench --json $W/bench.json > $W/bench.log 2>&1
    echo "bench rc=$?" | tee -a $W/summary.txt ;;
new-ops)
    for f in qk_tests:tests/qk_norm/test_gpu_qk_norm_loopback.py moe_tests:tests/collectives/test_gpu_moe_loopback.py; do
        (timeout ${TEST_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE ${f#*:} > $W/${f%%:*}.log 2>&1
         echo "${f%%:*} rc=$?" >> $W/summary.txt; tail -3 $W/${f%%:*}.log >> $W/summary.txt) &
    done
    wait
    if [ "${QK:-1}" = 1 ]; then
        timeout 120 python3 benchmarks/qk_norm_loopback.py --worlds 2,4 --tokens 1,16,64,256 \
            --out $W/qk_norm_loopback.json > $W/qk_bench.log 2>&1
        echo "qk_bench rc=$?" >> $W/summary.txt
    fi
    if [ "${MOE:-1}" = 1 ]; then
        with_flashinfer timeout 200 python3 benchmarks/moe_loopback.py --worlds 2,4 --hiddens 3072,7168 \
            --tokens 1,16,64,256 --k 8 --out $W/moe_loopback.json > $W/moe_bench.log 2>&1
        echo "moe_bench rc=$?" >> $W/summary.txt
    fi ;;
every-op)
    timeout ${DEMO_S:-150} python3 -m tpcomm demo --device cuda > $W/demo.log 2>&1
    echo "demo rc=$?" | tee -a $W/summary.txt; tail -3 $W/demo.log >> $W/summary.txt
    timeout ${SOAK_S:-400} python3 -m tpcomm soak --steps ${STEPS:-10000} --device cuda --seed 0 > $W/soak.log 2>&1
    echo "soak rc=$?" | tee -a $W/summary.txt; tail -8 $W/soak.log >> $W/summary.txt ;;
model)
    model_demos
    timeout 290 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/collectives/test_gpu_loopback.py --durations=5 \
        > $W/loopback_tests.log 2>&1
    echo "loopback_tests rc=$?" >> $W/summary.txt; tail -3 $W/loopback_tests.log >> $W/summary.txt ;;
sweep)
    # Every op that waits, rank 1 late by the timeout +-5 us on loopback ranks: each call gives the reference's
    # bits on every rank or fails on every rank as docs/reliability.md says; and a peer with another token
    # count: a mismatch on every rank. The QK norm in a process of its own (a kernel that hangs ends its
    # process through the test's watchdog, not the other ops' runs). The trials of all ops take at most a
    # third of SWEEP_S; outcomes per op into the summary, each process's JSON beside its log.
    S=${SWEEP_S:-240}
    sweep_part() { name=$1; limit=$2; shift 2
        TPCOMM_SWEEP_OUT=$W/sweep-$name.json TPCOMM_SWEEP_S=$((S / 3)) TPCOMM_SWEEP_TRIALS=${SWEEP_TRIALS:-600} \
            timeout $limit python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/faults/test_gpu_deadline_sweep.py \
            --durations=5 "$@" > $W/sweep-$name.log 2>&1
        echo "sweep-$name rc=$?" >> $W/summary.txt; grep -E "passed|failed|^FAILED|^ERROR" $W/sweep-$name.log | tail -20 >> $W/summary.txt
        python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(d['gpu'], d['trials'], 'trials')
for part in ('sweep', 'mismatch'):
    for op, t in d[part].items(): print(part, op, t['trials'], t.get('outcomes', t.get('error')))" $W/sweep-$name.json \
            >> $W/summary.txt 2>&1; }
    sweep_part ops $((S * 2 / 3)) -k "not qk_rmsnorm"
    sweep_part qk $((S / 3)) -k qk_rmsnorm ;;
compile-bench)
    # The same Hugging Face model compiled (CUDA graphs) without and with tpcomm's fusion pass, one process per GPU;
    # loopback ranks cannot carry a compiled model (benchmarks/compile_decode.py says why).
    with_transformers timeout ${COMPILE_S:-540} python3 -m torch.distributed.run --nproc_per_node ${WORLD:-2} \
        benchmarks/compile_decode.py --tokens ${TOKENS:-1,16,64} --out $W/compile_decode.json > $W/compile_decode.log 2>&1
    echo "compile_decode rc=$?" >> $W/summary.txt; grep -E "^\||skips|Error" $W/compile_decode.log | tail -12 >> $W/summary.txt ;;
minimax-layer)
    timeout ${LAYER_S:-300} python3 benchmarks/minimax_layer_loopback.py --worlds ${LAYER_WORLDS:-2,4,8} \
        --tokens ${LAYER_TOKENS:-1,4,16,64} --out $W/minimax_layer.json > $W/minimax_layer.log 2>&1
    echo "minimax_layer rc=$?" >> $W/summary.txt; grep -E "^\||note|NOT TIMED" $W/minimax_layer.log >> $W/summary.txt
    if [ "${KV4:-0}" = 1 ]; then
        timeout 150 python3 benchmarks/minimax_layer_loopback.py --worlds 8 --kv-heads 4 \
            --tokens ${LAYER_TOKENS:-1,4,16,64} --out $W/minimax_layer_kv4.json > $W/minimax_layer_kv4.log 2>&1
        echo "minimax_layer_kv4 rc=$?" >> $W/summary.txt; grep -E "^\||note|NOT TIMED" $W/minimax_layer_kv4.log >> $W/summary.txt
    fi ;;
*)
    echo "usage: bash dev/gpu_runs.sh gpu-tests|one-gpu-tests|ab|worlds|forms|formsab|soak-bench|new-ops|every-op|model|sweep|compile-bench|minimax-layer"
    exit 2 ;;
esac
# What comes back from a lent machine is a few files: the tarball and the summary (a run cut short leaves $OUT/work).
tar czf "$OUT/results-$1.tgz" -C "$W" . && cat "$W/summary.txt" >> "$OUT/summary.txt" && cat "$W/summary.txt"
rc=$(grep -c 'rc=[1-9]' "$W/summary.txt"); rm -rf "$W"; [ "$rc" = 0 ]
