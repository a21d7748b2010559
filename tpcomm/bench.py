"""``tpcomm bench``: tpcomm against what a user would pick instead, timed inside CUDA graphs (GPU only).

Columns, per token count ``T`` at one hidden size ``H`` (one rank's message: ``T * H`` elements):

    nccl_ar           torch.distributed.all_reduce(x)                       (NCCL, in place)
    add_rmsnorm       r = x + residual; F.rms_norm(r, (H,), weight, eps)    (torch, no communication)
    nccl_add_rmsnorm  the two above, one after the other                    (the unfused layer)
    tpcomm_fused      comm.fused_add_rmsnorm(x, residual, weight, eps)
    tpcomm_ar         comm.all_reduce(x)
    symm_one_shot     torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)   (PyTorch symmetric memory)
    symm_two_shot     torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)  (in place)

Method (docs/benchmarks.md):
  * tpcomm's results are checked first against the contract (``residual_out`` and the all-reduce
    bit-exact, ``out`` within one ulp, computed from every rank's gathered input); a column whose check
    fails is not timed, and the run exits 1. The graph's own outputs are checked again after timing.
  * Each column is warmed up eagerly on a side stream (NCCL set-up, Triton compilation), then
    ``graph_calls`` calls are captured in one CUDA graph. Call ``k`` reads input set ``k`` (one set per
    call, so in-place columns never reduce the same data twice and large messages are not re-read
    from L2); the sets are refilled before every replay, outside the timed region.
  * Each replay starts on every rank at once: a one-element NCCL all-reduce ends at about the same
    moment on every GPU, then a ``torch.cuda._sleep`` leaves every host time to enqueue the replay. CUDA
    events around the replay give µs per call = elapsed / ``graph_calls``.
  * ``warmup_replays`` replays are dropped, ``replays`` are kept; for each replay the slowest rank's time
    is taken (max over ranks), and the median over replays is reported.
  * Bandwidths use one rank's message of ``n = T * H * element_size`` bytes: algorithm bandwidth
    ``algbw = n / t``, bus bandwidth ``busbw = algbw * 2 (W - 1) / W`` (nccl-tests' convention for an
    all-reduce: what each link carries in a bandwidth-optimal algorithm, comparable across ``W``).

Multicast (NVLS) stays off: :func:`tpcomm.launch.launch` sets ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` for every rank.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .demo import DTYPES, all_gather_flat, bit_equal, out_ulp_tolerance, ulp_distance

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096)

#: Columns in table order, with their headers.
COLUMNS = {
    "nccl_ar": "NCCL AR",
    "add_rmsnorm": "torch add+RMSNorm",
    "nccl_add_rmsnorm": "NCCL AR + add+RMSNorm",
    "tpcomm_fused": "tpcomm fused",
    "tpcomm_ar": "tpcomm AR",
    "symm_one_shot": "symm_mem one-shot",
    "symm_two_shot": "symm_mem two-shot",
}

#: GPU cycles slept between the start-of-replay all-reduce and the replay (~100 µs at 2 GHz): longer
#: than a host needs to record an event and launch a graph (~10-20 µs), so every rank's replay is
#: queued before any starts.
SYNC_SLEEP_CYCLES = 200_000


@dataclass(frozen=True)
class BenchConfig:
    """What ``tpcomm bench`` measures.

    Attributes:
        world_size: GPUs (ranks).
        hidden: elements per row ``H``.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        tokens: token counts ``T``.
        graph_calls: calls captured in one CUDA graph.
        replays: timed replays of each graph (after ``warmup_replays`` untimed ones).
        warmup_replays: replays dropped before timing.
        eps: RMSNorm epsilon.
        seed: base seed of the inputs.
    """

    world_size: int
    hidden: int = 6144
    dtype: str = "bf16"
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    graph_calls: int = 20
    replays: int = 30
    warmup_replays: int = 3
    eps: float = 1e-6
    seed: int = 0


# -- on each rank -------------------------------------------------------------------------------------

def _agree(error: str | None) -> str | None:
    """Collective: the first rank's error, if any rank has one (so every rank skips together)."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    for q, e in enumerate(errors):
        if e:
            return f"rank {q}: {e}"
    return None


def _symm_buffers(cfg: BenchConfig, dtype: torch.dtype, device) -> tuple[list, str | None, str | None]:
    """``graph_calls`` symmetric-memory buffers of the largest message, or why not (agreed by all ranks)."""
    bufs, error, group_name = [], None, None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
            raise RuntimeError("torch.ops.symm_mem.one_shot_all_reduce is not in this torch")
        try:
            with warnings.catch_warnings():  # needed by older torch; deprecated (a no-op) since 2.9
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(group_name)
        except Exception:
            pass
        n = max(cfg.tokens) * cfg.hidden
        for _ in range(cfg.graph_calls):
            b = symm_mem.empty(n, dtype=dtype, device=device)
            symm_mem.rendezvous(b, group_name)
            bufs.append(b)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    error = _agree(error)
    return (bufs if error is None else []), group_name, error


def _capture(call, calls: int):
    """Warm ``call(k)`` up eagerly on a side stream, then capture ``call(0) ... call(calls - 1)`` in a
    graph. Returns ``(graph, outputs of the captured calls)``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for k in range(min(calls, 3)):
            call(k)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [call(k) for k in range(calls)]
    torch.cuda.synchronize()
    return g, outs


def _time_graph(g, refill, cfg: BenchConfig) -> list[float]:
    """µs per call of each timed replay on this rank (collective: every rank replays together)."""
    sync = torch.zeros(1, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(cfg.warmup_replays + cfg.replays):
        refill()
        dist.all_reduce(sync)
        torch.cuda._sleep(SYNC_SLEEP_CYCLES)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        if i >= cfg.warmup_replays:
            times.append(start.elapsed_time(end) * 1000.0 / cfg.graph_calls)
    return times


def _check_tpcomm(out, res_out, ar, exp_out, exp_res, s, H) -> str | None:
    """Why tpcomm's results break the contract, or None."""
    problems = []
    if res_out is not None and not bit_equal(res_out, exp_res):
        problems.append(f"fused residual_out not bit-exact ({ulp_distance(res_out, exp_res)} ulp)")
    if out is not None and ulp_distance(out, exp_out) > out_ulp_tolerance(out.dtype, H):
        problems.append(f"fused out differs by {ulp_distance(out, exp_out)} ulp")
    if ar is not None and not bit_equal(ar, s):
        problems.append(f"all_reduce differs by {ulp_distance(ar, s)} ulp")
    return "; ".join(problems) or None


def _bench_tokens(comm, cfg: BenchConfig, T: int, symm: list, group_name, symm_error) -> dict:
    """Every column at ``T`` tokens on this rank: ``{column: [µs per replay] or {"error": str}}``."""
    from .reference import add_rmsnorm_reference, reduce_in_rank_order

    F = torch.nn.functional
    dev, dtype, H, K = comm.device, DTYPES[cfg.dtype], cfg.hidden, cfg.graph_calls
    n = T * H
    gen = torch.Generator(device=dev)
    gen.manual_seed(cfg.seed * 1_000_003 + T * 101 + comm.rank)
    src = torch.randn((T, H), generator=gen, device=dev).to(dtype)  # this rank's shard of the sum
    gen.manual_seed(cfg.seed * 1_000_003 + T * 101 + 997)           # replicated on every rank
    residual = torch.randn((T, H), generator=gen, device=dev).to(dtype)
    weight = (1.0 + 0.1 * torch.randn((H,), generator=gen, device=dev)).to(dtype)
    xs = [torch.empty_like(src) for _ in range(K)]
    sbufs = [b[:n].view(T, H) for b in symm]

    def refill():
        for x in xs:
            x.copy_(src)
        for b in sbufs:
            b.copy_(src)

    refill()
    # The contract's result, from every rank's input.
    s = reduce_in_rank_order(list(all_gather_flat(src, comm.group)))
    exp_out, exp_res = add_rmsnorm_reference(s, residual, weight, cfg.eps)
    out, res_out = comm.fused_add_rmsnorm(src, residual, weight, cfg.eps)
    fused_error = _agree(_check_tpcomm(out, res_out, None, exp_out, exp_res, s, H))
    ar_error = _agree(_check_tpcomm(None, None, comm.all_reduce(src), None, None, s, H))

    def add_rmsnorm(k):
        return F.rms_norm(xs[k] + residual, (H,), weight, cfg.eps)

    def nccl_add_rmsnorm(k):
        dist.all_reduce(xs[k])
        return add_rmsnorm(k)

    calls = {
        "nccl_ar": (lambda k: dist.all_reduce(xs[k]), None),
        "add_rmsnorm": (add_rmsnorm, None),
        "nccl_add_rmsnorm": (nccl_add_rmsnorm, None),
        "tpcomm_fused": (lambda k: comm.fused_add_rmsnorm(xs[k], residual, weight, cfg.eps), fused_error),
        "tpcomm_ar": (lambda k: comm.all_reduce(xs[k]), ar_error),
        "symm_one_shot": (lambda k: torch.ops.symm_mem.one_shot_all_reduce(sbufs[k], "sum", group_name),
                          symm_error),
        "symm_two_shot": (lambda k: torch.ops.symm_mem.two_shot_all_reduce_(sbufs[k], "sum", group_name),
                          symm_error),
    }
    result: dict = {"algorithm_fused": comm.plan("fused_add_rmsnorm", n * src.element_size(), H, dtype).algorithm}
    for name, (call, error) in calls.items():
        if error:
            result[name] = {"error": error}
            continue
        refill()
        g = outs = None
        try:
            g, outs = _capture(call, K)
        except Exception as e:
            error = f"capture failed: {type(e).__name__}: {e}"
        error = _agree(error)
        if error:
            result[name] = {"error": error}
            continue
        result[name] = _time_graph(g, refill, cfg)
        if name in ("tpcomm_fused", "tpcomm_ar"):  # the graph's last call computed on input set K-1
            o, r = outs[-1] if name == "tpcomm_fused" else (None, None)
            after = _check_tpcomm(o, r, outs[-1] if name == "tpcomm_ar" else None, exp_out, exp_res, s, H)
            after = _agree(after)
            if after:
                result[name] = {"error": f"graph replay result wrong: {after}"}
        del g, outs
    torch.cuda.synchronize()
    return result


def run_rank(rank: int, world_size: int, cfg: BenchConfig) -> dict:
    """Every token count on this rank (run by :func:`tpcomm.launch.launch`)."""
    import triton

    from .communicator import Communicator

    dtype = DTYPES[cfg.dtype]
    comm = Communicator()
    symm, group_name, symm_error = _symm_buffers(cfg, dtype, comm.device)
    results = {}
    for T in cfg.tokens:
        results[T] = _bench_tokens(comm, cfg, T, symm, group_name, symm_error)
        torch.cuda.empty_cache()
    info = {
        "gpu": torch.cuda.get_device_name(comm.device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "communicator": repr(comm),
    }
    torch.cuda.synchronize()
    dist.barrier()
    del symm
    comm.close()
    return {"info": info, "results": results}


def _nccl_version() -> str | None:
    try:
        import torch.cuda.nccl as nccl

        v = nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        return None


# -- in the parent ------------------------------------------------------------------------------------

def summarize(per_rank: list[dict], cfg: BenchConfig) -> dict:
    """The JSON document: for each token count and column, the median over replays of the slowest rank
    (per-replay max over ranks), its spread, and bandwidths."""
    el = torch.empty((), dtype=DTYPES[cfg.dtype]).element_size()
    W = cfg.world_size
    rows = []
    for T in cfg.tokens:
        nbytes = T * cfg.hidden * el
        row = {"tokens": T, "bytes": nbytes, "mib": nbytes / 2**20,
               "algorithm_fused": per_rank[0]["results"][T]["algorithm_fused"], "columns": {}}
        for col in COLUMNS:
            vals = [r["results"][T][col] for r in per_rank]
            err = next((v["error"] for v in vals if isinstance(v, dict)), None)
            if err:
                row["columns"][col] = {"error": err}
                continue
            slowest = [max(rank_times[i] for rank_times in vals) for i in range(len(vals[0]))]
            med = statistics.median(slowest)
            algbw = nbytes / (med * 1e-6) / 1e9
            row["columns"][col] = {
                "median_us": med, "min_us": min(slowest), "max_us": max(slowest),
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (W - 1) / W if col != "add_rmsnorm" else None,
                "slowest_rank_us": slowest,
            }
        rows.append(row)
    return {
        "config": asdict(cfg),
        "environment": per_rank[0]["info"],
        "method": ("CUDA graph of graph_calls calls, one input set per call (refilled before each replay, "
                   "untimed); replays start together on all ranks (NCCL all-reduce + GPU sleep); µs per "
                   "call = replay time / graph_calls; slowest rank per replay, median over replays"),
        "columns": COLUMNS,
        "results": rows,
    }


def _us(row: dict, col: str) -> float | None:
    c = row["columns"].get(col, {})
    return c.get("median_us")


def format_table(doc: dict) -> str:
    """GitHub-style table: µs per call (median, slowest rank) and speed-ups."""
    from tabulate import tabulate

    headers = ["tokens", "MiB"] + list(COLUMNS.values()) + [
        "fused vs NCCL+add+RMSNorm", "tpcomm AR vs NCCL AR", "fused busbw GB/s", "fused algo"]
    body = []
    for row in doc["results"]:
        cells = [str(row["tokens"]), f"{row['mib']:.3g}"]
        for col in COLUMNS:
            v = _us(row, col)
            cells.append("n/a" if v is None else f"{v:.1f}")

        def ratio(a, b):
            va, vb = _us(row, a), _us(row, b)
            return "n/a" if va is None or vb is None else f"{va / vb:.2f}x"

        fused = row["columns"].get("tpcomm_fused", {})
        cells += [ratio("nccl_add_rmsnorm", "tpcomm_fused"), ratio("nccl_ar", "tpcomm_ar"),
                  "n/a" if fused.get("busbw_GBps") is None else f"{fused['busbw_GBps']:.0f}",
                  row["algorithm_fused"]]
        body.append(cells)
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def plot(doc: dict, path: str) -> str | None:
    """Latency against message size, log axes; returns None or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the 'bench' extra)"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for col, label in COLUMNS.items():
        pts = [(r["mib"], _us(r, col)) for r in doc["results"] if _us(r, col) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    cfg, env = doc["config"], doc["environment"]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message per rank (MiB)")
    ax.set_ylabel("µs per call (median, slowest rank)")
    ax.set_title(f"{cfg['world_size']} x {env['gpu']}, hidden {cfg['hidden']} {cfg['dtype']}, CUDA graph")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(world_size: int | None = None, hidden: int = 6144, dtype: str = "bf16",
         tokens: tuple[int, ...] = DEFAULT_TOKENS, json_path: str | None = None, graph_calls: int = 20,
         replays: int = 30, eps: float = 1e-6) -> int:
    """Run the benchmark, print the table, write JSON and PNG. 0 when tpcomm's results were right and
    every tpcomm column was timed; 1 otherwise; 2 when this machine cannot run it."""
    from .launch import RankFailure, launch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(f"tpcomm bench: needs at least 2 CUDA GPUs; this machine has {n} "
              f"({'no CUDA' if not torch.cuda.is_available() else 'one GPU'}). It times CUDA graphs, "
              "so it has no CPU mode: run `tpcomm demo` to check tpcomm on CPU ranks.")
        return 2
    world_size = world_size or n
    if not 2 <= world_size <= n:
        print(f"tpcomm bench: --world must be between 2 and {n} (the visible GPUs), got {world_size}")
        return 2
    if dtype not in DTYPES:
        print(f"tpcomm bench: --dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return 2
    cfg = BenchConfig(world_size=world_size, hidden=hidden, dtype=dtype, tokens=tuple(tokens),
                      graph_calls=graph_calls, replays=replays, eps=eps)
    json_path = json_path or os.path.join("out", f"bench-H{hidden}-{dtype}-w{world_size}.json")
    print(f"tpcomm bench: {world_size} GPUs, hidden {hidden} {dtype}, tokens {','.join(map(str, cfg.tokens))}; "
          f"{graph_calls} calls per CUDA graph, median of {replays} replays, slowest rank", flush=True)
    t0 = time.perf_counter()
    try:
        per_rank = launch(run_rank, world_size, "cuda", args=(cfg,), timeout_s=1800)
    except RankFailure as e:
        print(f"tpcomm bench: a rank failed after {time.perf_counter() - t0:.0f} s:\n{e}")
        return 1
    doc = summarize(per_rank, cfg)
    doc["environment"]["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"{doc['environment']['gpu']}, torch {doc['environment']['torch']}, triton "
          f"{doc['environment']['triton']}; µs per call:")
    print(format_table(doc))
    status = 0
    for row in doc["results"]:
        for col, c in row["columns"].items():
            if "error" in c:
                print(f"  T={row['tokens']} {COLUMNS[col]}: not timed: {c['error']}")
                if col.startswith("tpcomm"):
                    status = 1
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    png = os.path.splitext(json_path)[0] + ".png"
    why = plot(doc, png)
    print(f"wrote {json_path}" + (f" and {png}" if why is None else f" (no plot: {why})"))
    return status
