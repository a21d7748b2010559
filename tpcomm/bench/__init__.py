"""``tpcomm bench``: tpcomm side by side with what a user would pick instead, same run, same shapes, same
method (GPU only).

Ops (:data:`tpcomm.bench.config.OPS`): the fused all-reduce + residual add + RMSNorm (bf16/fp16 out and,
with the fused FP8 output), the plain all-reduce, all-gather and reduce-scatter. Contenders
(:mod:`tpcomm.bench.contenders`): tpcomm, NCCL (+ the torch epilogue), PyTorch symmetric memory one-shot
/ two-shot / all-gather / reduce-scatter, FlashInfer's TensorRT-LLM fusion (one-shot and two-shot) and
vLLM custom all-reduce where FlashInfer is installed, plus reference rows: the torch epilogue alone and
a peer copy (copy bandwidth).

Method (docs/performance.md): every contender is checked against the reference on fresh inputs before
it is timed (tpcomm bit for bit against the contract; a failing contender is reported and not timed; a
failing tpcomm makes the run exit 1); calls run in CUDA graphs (graph mode) and from Python (eager
mode); each replay starts on every rank at once; the slowest rank's time per replay, median over
replays. Bandwidths: :mod:`tpcomm.bench.metrics`.

Modules: ``config`` (what is swept), ``contenders/`` (one module per library), ``checks`` (inputs,
references, comparisons), ``timing`` (capture and timed replays on a rank), ``rank`` (the sweep on a
rank), ``summary`` (slowest rank, medians, bandwidths), ``report`` (tables, JSON), ``plot`` (PNGs),
``progress``, ``estimate`` (expected run time), ``command`` (the command), ``args`` (its options).
"""

from .command import main
from .config import BenchConfig

__all__ = ["BenchConfig", "main"]
