"""``tpcomm demo``: every op checked against its reference on every rank: the all-reduce and the fused norm
at real model shapes, a tensor-parallel MLP block checked against the same block computed unsharded, and
every other op (all-gather, reduce-scatter, the QK norm, the MoE finalize, every quantised form).

Part (a), ops. For each hidden size (2880, 4096, 6144, 7168, 8192) and token count, each rank runs
``all_reduce``, ``fused_add_rmsnorm`` with a residual, without one, and with a Gemma-style weight. Every
rank's input comes from a seed that every rank knows, so each rank computes the contract's result itself
(:func:`tpcomm.reduce_in_rank_order`, :func:`tpcomm.add_rmsnorm_reference`) and checks: ``all_reduce``
and ``residual_out`` bit-exact, ``out`` bit-exact too (the reference sums the squares in the kernels'
order), and every output bit-identical across ranks (an all-gather of the raw bits).

Part (b), a Llama-style MLP block, tensor parallel over the ranks for a few layers::

    g = h @ W_gate[shard].T; u = h @ W_up[shard].T; a = silu(g) * u     (column-parallel, no comm)
    partial = a @ W_down[:, shard].T                                     (row-parallel: a partial sum)
    h, residual = comm.fused_add_rmsnorm(partial, residual, w_norm, eps)

compared with the same layers computed unsharded in float32 from the same weights. At each layer the
fused call is also checked against the contract applied to the gathered partial sums (``residual_out``
bit-exact, ``out`` bit-exact).

Part (c), every other op once per token count at one hidden size (:mod:`tpcomm.demo_other_ops`).

On GPU every call is also timed (CUDA events around ``calls`` eager calls after warm-up, the slowest
rank): eager calls include Python and launch overhead; ``tpcomm bench`` times inside CUDA graphs.
On CPU (Triton's interpreter, ~20-60 ms a call a rank) the sweep is small and nothing is timed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from .demo_checks import (
    DTYPES,
    Row,
    all_gather_flat,
    bit_equal,
    out_ulp_tolerance,
    randn,
    relative_error,
    same_on_all_ranks,
    time_eager,
    ulp_distance,
)

#: Hidden sizes of real models: gpt-oss (2880), Llama-3-8B (4096), Mixtral-8x22B / Qwen (6144),
#: DeepSeek-V3 (7168), Llama-3-70B (8192).
MODEL_HIDDENS = (2880, 4096, 6144, 7168, 8192)
GPU_TOKENS = (1, 16, 64, 256, 1024, 4096)
#: The interpreter costs ~20-60 ms a row a rank at these sizes (docs/performance.md, "CPU demo"): 2 token
#: counts x 5 hiddens x 4 ops keep the CPU demo within seconds. 5 rows on the interpreter's 4 programs
#: give one program two rows (the grid-stride loop) and an odd count.
CPU_TOKENS = (1, 5)

#: Ops of part (a): (name shown, tpcomm method, has residual, gemma).
OPS = (
    ("all_reduce", "all_reduce", False, False),
    ("fused_add_rmsnorm", "fused_add_rmsnorm", True, False),
    ("fused_rmsnorm (no residual)", "fused_add_rmsnorm", False, False),
    ("fused_add_rmsnorm (gemma)", "fused_add_rmsnorm", True, True),
)


@dataclass(frozen=True)
class MlpConfig:
    """The tensor-parallel MLP block of part (b).

    Attributes:
        tokens, hidden, intermediate: ``(T, H)`` activations, ``I`` the MLP width (a multiple of the
            world size; it is rounded up to one).
        layers: blocks applied one after another.
        dtype: activations and weights; bf16 on GPU, fp32 on CPU (see :func:`mlp_tolerance`).
    """

    tokens: int
    hidden: int
    intermediate: int
    layers: int
    dtype: str


@dataclass(frozen=True)
class DemoConfig:
    """What ``tpcomm demo`` runs.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        world_size: ranks.
        hiddens, tokens: the sweep of part (a).
        dtype: dtype of part (a).
        mlp: part (b).
        calls, warmup: eager calls timed per case on GPU, after ``warmup`` calls (0: no timing).
        other_hidden, other_tokens: part (c)'s hidden size (a multiple of every quantised form's block)
            and token counts.
        qk_widths: part (c)'s full-width ``(Nq, Nk)`` of the QK norm (each rank holds ``1 / W`` of each).
        moe_topk: part (c)'s experts a token (K) of the MoE finalize.
        eps: RMSNorm epsilon.
        seed: base seed every rank derives its inputs from.
    """

    device: str
    world_size: int
    hiddens: tuple[int, ...]
    tokens: tuple[int, ...]
    dtype: str
    mlp: MlpConfig
    calls: int
    warmup: int
    other_hidden: int = 1024
    other_tokens: tuple[int, ...] = (5,)
    qk_widths: tuple[int, int] = (1024, 256)
    moe_topk: int = 2
    eps: float = 1e-6
    seed: int = 1234


def make_config(device: str, world_size: int, quick: bool = False) -> DemoConfig:
    """The demo's sweep for ``device``: the full model shapes on GPU, a few rows on CPU."""
    if device == "cuda":
        mlp = MlpConfig(tokens=64, hidden=4096, intermediate=14336, layers=4, dtype="bf16")  # Llama-3-8B
        # part (c): DeepSeek-V3's hidden size; MiniMax-M2's q and k widths (48 and 8 heads of 128) and top-8
        cfg = DemoConfig(device, world_size, MODEL_HIDDENS, GPU_TOKENS, "bf16", mlp, calls=20, warmup=3,
                         other_hidden=7168, other_tokens=(1, 64, 1024), qk_widths=(6144, 1024), moe_topk=8)
        if quick:
            cfg = replace(cfg, hiddens=(2880, 8192), tokens=(1, 64, 1024), mlp=replace(mlp, layers=2),
                          other_tokens=(64,))
    else:
        mlp = MlpConfig(tokens=4, hidden=2880, intermediate=5760, layers=3, dtype="fp32")
        cfg = DemoConfig(device, world_size, MODEL_HIDDENS, CPU_TOKENS, "bf16", mlp, calls=0, warmup=0)
        if quick:
            cfg = replace(cfg, hiddens=(2880, 8192), tokens=(1,), mlp=replace(mlp, layers=2), other_tokens=(1,))
    return cfg


def mlp_tolerance(dtype: torch.dtype, layers: int) -> float:
    """Relative error allowed between the sharded block and the unsharded float32 block.

    bf16/fp16: every layer rounds its activations about six times (h, g, u, silu(g)*u, the partial sums,
    residual_out) to a relative ``u`` = 2^-8 (bf16) or 2^-11 (fp16), and the errors carry from layer
    to layer through the residual stream. Measured: 1.7u after 4 layers (Llama-3-8B shapes, 64 tokens,
    2 and 8 ranks). ``2 * layers * u`` (bf16, 4 layers: 3.1%) leaves a margin of 4 and still fails a
    wrong shard, a missing rank or a wrong order by far (those give O(1) errors).
    fp32: both sides round alike and differ only in the order of the matmuls' sums (a shard's ``I / W``
    terms then the ranks in order, against one sum of ``I`` terms). Measured: 3e-7 after 3 layers, so
    1e-5 is tight. That is why the CPU demo runs the block in fp32: the interpreter's cost is per row,
    not per byte, so fp32 costs nothing there and the check is three hundred times stricter than bf16's.
    """
    if dtype == torch.float32:
        return 1e-5
    u = torch.finfo(dtype).eps / 2  # unit roundoff: eps is the gap above 1.0, 2^-7 for bf16
    return 2 * layers * u


# -- part (a): ops ------------------------------------------------------------------------------------

def _algorithm(comm, method: str, x: torch.Tensor) -> str:
    from . import dispatch

    nbytes = x.numel() * x.element_size()
    hidden = min(x.numel(), dispatch.ALL_REDUCE_ROW) if method == "all_reduce" else x.shape[-1]
    return comm.plan(method, nbytes, hidden, x.dtype).algorithm


def _op_case(comm, cfg: DemoConfig, case: int, name: str, method: str, has_res: bool, gemma: bool,
             T: int, H: int) -> Row:
    from .reference import add_rmsnorm_reference, reduce_in_rank_order

    dev, dtype, W = comm.device, DTYPES[cfg.dtype], comm.world_size
    xs = [randn((T, H), dtype, dev, cfg.seed, case, q) for q in range(W)]
    x = xs[comm.rank]
    residual = randn((T, H), dtype, dev, cfg.seed, case, -1) if has_res else None
    # Gemma weights are stored as w with the norm using 1 + w, so they sit near 0; others near 1.
    weight = randn((H,), dtype, dev, cfg.seed, case, -2, scale=0.1, shift=0.0 if gemma else 1.0)
    s = reduce_in_rank_order(xs)

    if method == "all_reduce":
        def call():
            return comm.all_reduce(x), None
        exp_out, exp_res = s, None
    else:
        def call():
            return comm.fused_add_rmsnorm(x, residual, weight, cfg.eps, gemma=gemma)
        exp_out, exp_res = add_rmsnorm_reference(s, residual, weight, cfg.eps, gemma)

    out, res_out = call()
    notes = []
    exact_out = method == "all_reduce"  # the all-reduce is exact; a norm's out may differ by 1 ulp
    err = ulp_distance(out, exp_out)
    if (exact_out and not bit_equal(out, exp_out)) or err > out_ulp_tolerance(dtype, H):
        notes.append(f"out differs from the reference by {err} ulp")
    if exp_res is not None:
        residual_exact = bit_equal(res_out, exp_res)
        if not residual_exact:
            notes.append(f"residual_out not bit-exact ({ulp_distance(res_out, exp_res)} ulp)")
    elif exact_out:
        residual_exact = bit_equal(out, exp_out)
    else:
        residual_exact = None
    identical = same_on_all_ranks(out, comm.group)
    if res_out is not None:
        identical = same_on_all_ranks(res_out, comm.group) and identical
    if not identical:
        notes.append("outputs differ between ranks")

    time_us = None
    if cfg.calls and comm.device.type == "cuda":
        last = {}

        def timed():
            last["r"] = call()

        time_us = time_eager(timed, cfg.calls, cfg.warmup)
        o2, r2 = last["r"]
        if not bit_equal(o2, out) or (r2 is not None and not bit_equal(r2, res_out)):
            notes.append("a repeated call gave other bits than the first")
    return Row(name, f"{T}x{H}", cfg.dtype, _algorithm(comm, method, x), float(err), "ulp",
               residual_exact, identical, time_us, not notes, "; ".join(notes))


# -- part (b): tensor-parallel MLP block --------------------------------------------------------------

@dataclass
class _MlpWeights:
    gate: list = field(default_factory=list)   # per layer (I, H)
    up: list = field(default_factory=list)     # per layer (I, H)
    down: list = field(default_factory=list)   # per layer (H, I)
    norm: list = field(default_factory=list)   # layers + 1 norm weights (H,): one before the first layer


def _mlp_weights(m: MlpConfig, I: int, dtype, dev, seed: int) -> _MlpWeights:
    w = _MlpWeights()
    for layer in range(m.layers):
        # 1/sqrt(fan_in) keeps the activations O(1) through the layers.
        w.gate.append(randn((I, m.hidden), dtype, dev, seed, 900, layer, 0, scale=m.hidden ** -0.5))
        w.up.append(randn((I, m.hidden), dtype, dev, seed, 900, layer, 1, scale=m.hidden ** -0.5))
        w.down.append(randn((m.hidden, I), dtype, dev, seed, 900, layer, 2, scale=I ** -0.5))
    for layer in range(m.layers + 1):
        w.norm.append(randn((m.hidden,), dtype, dev, seed, 901, layer, scale=0.1, shift=1.0))
    return w


def _mlp_case(comm, cfg: DemoConfig) -> Row:
    from .reference import add_rmsnorm_reference, reduce_in_rank_order

    m, dev, W, rank = cfg.mlp, comm.device, comm.world_size, comm.rank
    dtype = DTYPES[m.dtype]
    I = -(-m.intermediate // W) * W
    shard = slice(rank * (I // W), (rank + 1) * (I // W))
    wts = _mlp_weights(m, I, dtype, dev, cfg.seed)
    x0 = randn((m.tokens, m.hidden), dtype, dev, cfg.seed, 902)
    silu = torch.nn.functional.silu
    notes: list[str] = []
    worst_ulp = 0
    residual_exact = True

    def sharded(check: bool):
        nonlocal worst_ulp, residual_exact
        h, _ = add_rmsnorm_reference(x0, None, wts.norm[0], cfg.eps)  # local: same bits on every rank
        residual = x0
        for layer in range(m.layers):
            a = silu(h @ wts.gate[layer][shard].T) * (h @ wts.up[layer][shard].T)
            partial = a @ wts.down[layer][:, shard].T
            h_new, res_new = comm.fused_add_rmsnorm(partial, residual, wts.norm[layer + 1], cfg.eps)
            if check:  # the fused call against the contract on the gathered partial sums
                parts = all_gather_flat(partial, comm.group)
                exp_h, exp_res = add_rmsnorm_reference(reduce_in_rank_order(list(parts.unbind(0))),
                                                       residual, wts.norm[layer + 1], cfg.eps)
                worst_ulp = max(worst_ulp, ulp_distance(h_new, exp_h))
                residual_exact = residual_exact and bit_equal(res_new, exp_res)
            h, residual = h_new, res_new
        return h, residual

    h, residual = sharded(check=True)
    if worst_ulp > out_ulp_tolerance(dtype, m.hidden):
        notes.append(f"a layer's out differs from the contract by {worst_ulp} ulp")
    if not residual_exact:
        notes.append("a layer's residual_out is not bit-exact")

    # The same block unsharded, in float32, from the same weights.
    f32 = torch.float32
    rh, _ = add_rmsnorm_reference(x0.to(f32), None, wts.norm[0].to(f32), cfg.eps)
    rres = x0.to(f32)
    for layer in range(m.layers):
        a = silu(rh @ wts.gate[layer].to(f32).T) * (rh @ wts.up[layer].to(f32).T)
        full = a @ wts.down[layer].to(f32).T
        rh, rres = add_rmsnorm_reference(full, rres, wts.norm[layer + 1].to(f32), cfg.eps)
    err = max(relative_error(h, rh), relative_error(residual, rres))
    tol = mlp_tolerance(dtype, m.layers)
    if not err <= tol:
        notes.append(f"relative error {err:.2e} against the unsharded block exceeds {tol:.1e}")
    identical = same_on_all_ranks(h, comm.group) and same_on_all_ranks(residual, comm.group)
    if not identical:
        notes.append("outputs differ between ranks")

    time_us = None
    if cfg.calls and dev.type == "cuda":
        time_us = time_eager(lambda: sharded(check=False), max(1, cfg.calls // 4), 1) / m.layers
    name = f"tp_mlp block ({m.layers} layers)"
    shape = f"{m.tokens}x{m.hidden}, I={I}"
    algo = _algorithm(comm, "fused_add_rmsnorm", x0)
    return Row(name, shape, m.dtype, algo, err, "rel", residual_exact, identical, time_us, not notes,
               "; ".join(notes))


# -- the rank function and the parent's side ----------------------------------------------------------

def run_rank(rank: int, world_size: int, cfg: DemoConfig) -> list[Row]:
    """Every case on this rank (run by :func:`tpcomm.launch.launch`); returns this rank's rows."""
    from . import demo_other_ops
    from .communicator import Communicator
    from .progress import Progress

    rows: list[Row] = []
    others = demo_other_ops.cases(cfg)
    progress = Progress(rank == 0, len(cfg.hiddens) * len(cfg.tokens) * len(OPS) + 1 + len(others), "tpcomm demo",
                        every_s=5.0)
    with Communicator() as comm:
        case = 0
        for H in cfg.hiddens:
            for T in cfg.tokens:
                for name, method, has_res, gemma in OPS:
                    case += 1
                    rows.append(_op_case(comm, cfg, case, name, method, has_res, gemma, T, H))
                    progress.advance(f"{name} {T}x{H}")
        rows.append(_mlp_case(comm, cfg))
        progress.advance("tp_mlp")
        for op, T in others:
            case += 1
            rows.append(demo_other_ops.run_case(comm, cfg, case, op, T))
            progress.advance(f"{op} {T}")
        progress.close()
        if comm.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
    return rows


def merge_rows(per_rank: list[list[Row]]) -> list[Row]:
    """One row per case from every rank's rows: every check must pass on every rank, the largest error,
    the slowest rank's time."""
    merged = []
    for rows in zip(*per_rank):
        r0 = rows[0]
        times = [r.time_us for r in rows if r.time_us is not None]
        exact = [r.residual_exact for r in rows if r.residual_exact is not None]
        notes = sorted({f"rank {q}: {r.note}" for q, r in enumerate(rows) if r.note})
        identical = None if r0.ranks_identical is None else all(r.ranks_identical for r in rows)
        merged.append(replace(
            r0, error=max(r.error for r in rows), residual_exact=all(exact) if exact else None,
            ranks_identical=identical, time_us=max(times) if times else None,
            ok=all(r.ok for r in rows), note="; ".join(notes)))
    return merged


def format_table(rows: list[Row]) -> str:
    """The demo's table (GitHub style); the µs/call column only where some row was timed (GPUs)."""
    from tabulate import tabulate

    def yes(v):
        return "-" if v is None else ("yes" if v else "NO")

    timed = any(r.time_us is not None for r in rows)
    body = []
    for r in rows:
        err = f"{r.error:.1e} rel" if r.error_unit == "rel" else f"{int(r.error)} {r.error_unit}"
        time_cell = ["-" if r.time_us is None else f"{r.time_us:.1f}"] if timed else []
        body.append([r.op, r.shape, r.dtype, r.algorithm, err, yes(r.residual_exact), yes(r.ranks_identical),
                     *time_cell, "ok" if r.ok else "FAIL"])
    headers = ["op", "shape (T x H)", "dtype", "algorithm", "max error", "bit-exact sum / residual_out",
               "same bits on all ranks", *(["µs/call"] if timed else []), "check"]
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def main(device: str | None = None, world_size: int | None = None, quick: bool = False) -> int:
    """Run the demo, print the table; 0 when every check passed, 1 otherwise."""
    from .launch import RankFailure, default_device, launch

    device = device or default_device()
    if device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            print(f"tpcomm demo: --device cuda needs at least 2 GPUs; this machine has {n}. "
                  "Use --device cpu.")
            return 2
        world_size = world_size or torch.cuda.device_count()
        if world_size > torch.cuda.device_count():
            print(f"tpcomm demo: --world {world_size} exceeds the {torch.cuda.device_count()} visible GPUs")
            return 2
    else:
        world_size = world_size or 2
    if world_size < 2:
        print(f"tpcomm demo: --world must be >= 2, got {world_size}")
        return 2
    cfg = make_config(device, world_size, quick)
    how = "GPUs (NCCL)" if device == "cuda" else "CPU ranks (gloo, Triton interpreter)"
    m = cfg.mlp
    print(f"tpcomm demo: {world_size} {how}; ops at hidden {', '.join(map(str, cfg.hiddens))} x tokens "
          f"{', '.join(map(str, cfg.tokens))} ({cfg.dtype}); MLP block {m.layers} layers, "
          f"{m.tokens}x{m.hidden}, I={m.intermediate} ({m.dtype}); all-gather, reduce-scatter, QK norm, MoE "
          f"finalize and every quantised form at hidden {cfg.other_hidden} x tokens "
          f"{', '.join(map(str, cfg.other_tokens))}", flush=True)
    t0 = time.perf_counter()
    try:
        per_rank = launch(run_rank, world_size, device, args=(cfg,))
    except RankFailure as e:
        print(f"tpcomm demo: a rank failed after {time.perf_counter() - t0:.1f} s:\n{e}")
        return 1
    elapsed = time.perf_counter() - t0
    rows = merge_rows(per_rank)
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    for r in failed:
        print(f"FAIL {r.op} {r.shape}: {r.note}")
    if device == "cuda":
        print("µs/call: eager calls (Python and launch overhead included), CUDA events, slowest rank; "
              "per layer for tp_mlp. `tpcomm bench` times inside CUDA graphs.")
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed in {elapsed:.1f} s "
          f"({world_size} ranks, {device}).")
    return 1 if failed else 0
