"""The sweep on one rank (run by :func:`tpcomm.launch.launch`): every op, size and algorithm, in the same
order on every rank, each checked before it is timed.

For each op and message size: one set of ``K`` input slots (:func:`tpcomm.bench.config.calls_per_replay`),
then for each algorithm the dispatch can choose there (:meth:`tpcomm.tune.config.TuneConfig.algorithms`),
interleaved so that a slow drift of the machine touches every algorithm alike:

1. the plan: with the algorithm forced (:meth:`tpcomm.Communicator.use_algorithm`), the communicator must
   run that algorithm at this size, else the cell is ``na`` (the reason is kept);
2. the check: fresh inputs of every rank, one eager call, compared with the numerics contract bit for bit
   (:mod:`tpcomm.bench.checks`; this also compiles the kernel);
3. the timing, with the bench's harness (:mod:`tpcomm.bench.timing`): ``K`` calls captured in one CUDA
   graph, replays started together on every rank, µs per call of each replay on this rank; then the
   check inputs are loaded, the graph replayed once and its last output checked again.

Every step that can fail is agreed between the ranks (:func:`tpcomm.bench.timing.agree`), so every rank
skips together. The parent takes the slowest rank per replay and the median (:mod:`tpcomm.tune.summary`).

Under gloo (CPU ranks, the Triton interpreter) only the eager mode exists (``graph=False``): the tests
run the sweep's logic that way; its times mean nothing and ``tpcomm tune`` never uses them.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from ..bench.checks import Case, compare, expected, make_inputs
from ..bench.config import calls_per_replay
from ..bench.contenders.base import Slots
from ..bench.timing import agree, capture, describe, device, sync, time_replays
from ..progress import Progress
from .config import TuneConfig

#: The bench's name of each op (:data:`tpcomm.bench.config.OPS`), for its inputs and checks.
BENCH_OP = {"all_reduce": "all_reduce", "fused_add_rmsnorm": "fused"}


def case_for(op: str, nbytes: int, tokens: int | None, cfg: TuneConfig, rank: int, dev: str) -> Case:
    """The bench's :class:`~tpcomm.bench.checks.Case` of one message: ``(tokens, hidden)`` for the fused
    op; one flat row of ``nbytes / element size`` elements for the all-reduce (the communicator treats
    any shape as flat rows, so the shape changes nothing)."""
    if op == "all_reduce":
        return Case("all_reduce", 1, nbytes // cfg.element_size, cfg.dtype, cfg.world_size, rank, cfg.eps, dev)
    return Case("fused", tokens, cfg.hidden, cfg.dtype, cfg.world_size, rank, cfg.eps, dev)


def _bound(comm, op: str, algo: str, slots: Slots, eps: float):
    """``(call, outputs)``: ``call(k)`` runs ``op`` on input set ``k`` with ``algo`` forced; ``outputs``
    names the result's tensors as :func:`tpcomm.bench.checks.expected` does."""
    if op == "all_reduce":
        def call(k):
            with comm.use_algorithm(algo):
                return comm.all_reduce(slots.x[k])
        return call, lambda r: {"sum": r}

    def call(k):
        with comm.use_algorithm(algo):
            return comm.fused_add_rmsnorm(slots.x[k], slots.residual, slots.weight, eps)
    return call, lambda r: {"out": r[0], "residual_out": r[1]}


def measure_one(comm, cfg: TuneConfig, case: Case, op: str, algo: str, slots: Slots, refill, K: int,
                salt: int, graph: bool) -> dict:
    """One algorithm at one size on this rank: ``{"us": [µs per call of each timed replay]}``, or
    ``{"na": why}`` (the communicator would not run ``algo`` here), or ``{"error": why}``. Collective."""
    nbytes = case.T * case.H * cfg.element_size
    with comm.use_algorithm(algo):
        plan = comm.plan(op, nbytes, case.H, case.dtype)
    if plan.algorithm != algo:  # a pure function of the shape: the same on every rank
        return {"na": f"the communicator runs {plan.algorithm} here ({plan.reason})"}
    call, outputs = _bound(comm, op, algo, slots, cfg.eps)
    inp = make_inputs(case, cfg.seed, salt)
    want = expected(case, inp)

    def load_check_inputs():
        for k in range(K):
            slots.load(k, inp.xs[case.rank], inp.residual, inp.weight)
        sync()
        dist.barrier()

    err = None
    try:
        load_check_inputs()
        got = outputs(call(0))
        sync()
        err = compare(case, got, want, exact=True)
    except Exception as e:
        err = describe(e)
    err = agree(err)
    if err:
        return {"error": f"check failed: {err}"}
    bcfg = cfg.bench_config()
    if not graph:
        def run():
            for k in range(K):
                call(k)
        try:
            us = time_replays(run, refill, K, bcfg, graph=False)
        except Exception as e:
            us, err = None, describe(e)
        err = agree(err)
        return {"error": f"eager calls failed: {err}"} if err else {"us": us}
    g = outs = None
    try:
        refill()
        g, outs = capture(call, K)
    except Exception as e:
        err = describe(e)
    err = agree(err)
    if err:
        return {"error": f"capture failed: {err}"}
    try:
        us = time_replays(g.replay, refill, K, bcfg, graph=True)
        load_check_inputs()
        g.replay()
        sync()
        err = compare(case, outputs(outs[-1]), want, exact=True)
        err = f"graph replay result wrong: {err}" if err else None
    except Exception as e:
        err = f"graph replays failed: {describe(e)}"
    err = agree(err)
    del g, outs
    return {"error": err} if err else {"us": us}


def measure(comm, cfg: TuneConfig, graph: bool = True, show_progress: bool = True) -> dict:
    """The whole sweep of ``cfg`` on this rank. Collective: every rank of ``comm`` calls it.

    Args:
        comm: a :class:`tpcomm.Communicator` of ``cfg.world_size`` ranks.
        graph: time CUDA-graph replays (``tpcomm tune``); False: eager calls (CPU ranks, tests only).
    Returns:
        ``{"info": {...}, "fallback": why the kernels are not used or None, "items": [...]}``, one item
        per op, size and algorithm: ``{"op", "bytes", "tokens", "algorithm", "calls"}`` and ``us`` (µs
        per call of each timed replay), ``na`` or ``error``.
    Raises:
        ValueError: ``graph`` on ranks without CUDA, or ``comm``'s world size is not ``cfg``'s.
    """
    dev = device()
    if graph and dev.type != "cuda":
        raise ValueError("measure: graph mode needs CUDA ranks (NCCL)")
    if comm.world_size != cfg.world_size:
        raise ValueError(f"measure: the communicator has {comm.world_size} ranks, cfg.world_size is "
                         f"{cfg.world_size}")
    info = environment(comm)
    if not comm.uses_kernels:
        return {"info": info, "fallback": comm.fallback_reason, "items": []}
    bcfg = cfg.bench_config()
    shapes = [(op, n, t) for op in cfg.ops for n, t in cfg.sizes(op)]
    progress = Progress(show_progress and comm.rank == 0, sum(len(cfg.algorithms(n)) for _, n, _ in shapes))
    items = []
    for op, n, tokens in shapes:
        case = case_for(op, n, tokens, cfg, comm.rank, dev.type)
        K = calls_per_replay(n, bcfg)
        src = make_inputs(case, cfg.seed, 0, ranks=[comm.rank])
        x0 = src.xs[comm.rank]
        slots = Slots([torch.empty_like(x0) for _ in range(K)],
                      None if src.residual is None else torch.empty_like(src.residual),
                      None if src.weight is None else torch.empty_like(src.weight))

        def refill(slots=slots, src=src, x0=x0):
            for k in range(len(slots.x)):
                slots.load(k, x0, src.residual, src.weight)

        for salt, algo in enumerate(cfg.algorithms(n), start=1):
            res = measure_one(comm, cfg, case, op, algo, slots, refill, K, salt, graph)
            items.append({"op": op, "bytes": n, "tokens": tokens, "algorithm": algo, "calls": K, **res})
            what = f"{op} {n / 2**20:.3g} MiB" + (f" (T={tokens})" if tokens else "") + f" {algo}"
            progress.advance(what)
        del slots, src, x0
        sync()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    progress.close()
    return {"info": info, "fallback": None, "items": items}


def environment(comm) -> dict:
    """The machine and the versions, for the JSON and the table's ``source``."""
    import triton

    cuda = comm.device.type == "cuda"
    return {"host": socket.gethostname(),
            "gpu": torch.cuda.get_device_name(comm.device) if cuda else "CPU (gloo ranks)",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "communicator": repr(comm), "max_bytes": comm.max_bytes,
            "max_programs": comm.workspace.max_programs if comm.workspace is not None else None,
            "tpcomm_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TPCOMM_")}}


def run_rank(rank: int, world_size: int, cfg: TuneConfig) -> dict:
    """Entry point of each rank under :func:`tpcomm.launch.launch`: a communicator with the defaults a
    user gets, the sweep in CUDA graphs, then ``close``."""
    from ..communicator import Communicator

    comm = Communicator()
    result = measure(comm, cfg, graph=True)
    sync()
    dist.barrier()
    comm.close()
    return result
