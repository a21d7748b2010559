"""Rank bodies of the fault-injection tests (``tests/faults/test_faults.py``): a peer that skips a call, calls
another op, or calls with another size or dtype. Pool bodies: ``fn(ctx, *args)``.

Each fault is a list of calls per rank (rank 1 is the faulty peer). Every rank runs its calls on a fresh
communicator with a short timeout, after one call both ranks make (so both are in step and warm), and
reports what it saw: the first exception (type, op, epoch, peer, message), how long it took, and any call
that returned a wrong value without raising. Then every rank checks that a new communicator works (the
documented remedy after a timeout).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import tpcomm
from tests.bad_inputs.ranks import _catch, check_all_reduce, check_fused
from tests.support.harness import new_communicator
from tests.support.numerics import all_inputs, assert_same_bits, residual_input, weight_input

BF16, FP16 = torch.bfloat16, torch.float16

#: Grid cap of the faults' communicators (``TPCOMM_MAX_PROGRAMS``): 2, so that "same grid" needs only 3 rows.
MAX_PROGRAMS = 2

#: fault -> (calls of rank 0, calls of rank 1), a call being (op, shape, dtype). The grid is one program
#: per row up to MAX_PROGRAMS.
FAULTS = {
    # rank 1 never makes the call
    "skip": ([("fused", (2, 64), BF16)], []),
    # rank 1 skips one call and makes the next, a smaller one: it meets rank 0's skipped call
    "skip then next": ([("fused", (2, 64), BF16), ("all_reduce", (1, 64), BF16)],
                       [("all_reduce", (1, 64), BF16)]),
    # another op on the same tensor: fused rows of 40 (padded to 48 in the workspace) vs a flat all_reduce
    "other op": ([("fused", (2, 40), BF16)], [("all_reduce", (2, 40), BF16)]),
    # the peer sends fewer rows (grid 2 against 1)
    "fewer rows": ([("fused", (2, 64), BF16)], [("fused", (1, 64), BF16)]),
    # the peer sends more rows (grid 1 against 2)
    "more rows": ([("fused", (1, 64), BF16)], [("fused", (2, 64), BF16)]),
    # more rows on the same grid (2 programs both): every flag and epoch matches
    "more rows, same grid": ([("fused", (2, 64), BF16)], [("fused", (3, 64), BF16)]),
    # same shape and bytes, another dtype
    "other dtype": ([("fused", (2, 64), BF16)], [("fused", (2, 64), FP16)]),
}
#: Faults of the ops with one kernel each (all-gather: push; reduce-scatter: two-shot's first half), run
#: under the default dispatch only.
GATHER_FAULTS = {
    "all_gather, peer fewer rows": ([("all_gather", (2, 16), BF16)], [("all_gather", (1, 16), BF16)]),
    "reduce_scatter, peer more rows": ([("reduce_scatter", (2, 16), BF16)], [("reduce_scatter", (4, 16), BF16)]),
    "reduce_scatter against all_gather": ([("reduce_scatter", (2, 16), BF16)], [("all_gather", (2, 16), BF16)]),
    # the same square tensor along another dim: the same bytes move, with another meaning
    "all_gather, peer another dim": ([("all_gather", (16, 16), BF16)], [("all_gather:1", (16, 16), BF16)]),
    "reduce_scatter, peer another dim": ([("reduce_scatter", (16, 16), BF16)],
                                         [("reduce_scatter:1", (16, 16), BF16)]),
    # an integer all-reduce moves through the all-gather kernel: a peer's all-gather of the same bytes
    "int all_reduce against all_gather": ([("all_reduce", (2, 16), torch.int32)],
                                          [("all_gather", (2, 16), torch.int32)]),
}
FAULTS.update(GATHER_FAULTS)

#: FP8 options of the ``fp8`` calls: (FP8 dtype, group size; 0: per token).
FP8_SPECS = {"fn": (torch.float8_e4m3fn, 0), "fnuz": (torch.float8_e4m3fnuz, 0),
             "fn/g16": (torch.float8_e4m3fn, 16), "fn/g32": (torch.float8_e4m3fn, 32)}
#: Peers whose FP8 options differ: the same rows move, but their FP8 bytes would differ between ranks.
FP8_FAULTS = {
    "fp8, peer another format": ([("fp8:fn", (2, 64), BF16)], [("fp8:fnuz", (2, 64), BF16)]),
    "fp8, peer another group size": ([("fp8:fn/g16", (2, 64), BF16)], [("fp8:fn/g32", (2, 64), BF16)]),
}
FAULTS.update(FP8_FAULTS)
#: How long a late rank sleeps before its call: past the peers' timeout (``test_faults.TIMEOUT_S``) and
#: the grace after it (on CPU ranks the timeout again), with room for a slow machine.
LATE_S = 2.5
#: Faults of timing and of the algorithm, for every world size of ``ORDER_FAULTS``' lists (one list of
#: calls per rank; ``("sleep", seconds, None)`` is a pause before the rank's calls, not a call; ``op@algo`` forces the
#: algorithm
#: of that call): the last rank is late (it arrives after its peers gave up), is late after skipping a
#: call, or runs another algorithm. Expected errors: ``EXPECTED``.
ORDER_FAULTS = {
    2: {
        "late": ([("fused", (2, 64), BF16)], [("sleep", LATE_S, None), ("fused", (2, 64), BF16)]),
        "late after a skipped call": ([("fused", (2, 64), BF16), ("all_reduce", (1, 64), BF16)],
                                      [("sleep", LATE_S, None), ("all_reduce", (1, 64), BF16)]),
        "other algorithm": ([("fused@lamport", (2, 64), BF16)], [("fused@one_shot", (2, 64), BF16)]),
    },
    3: {
        "late": ([("fused", (2, 64), BF16)], [("fused", (2, 64), BF16)],
                 [("sleep", LATE_S, None), ("fused", (2, 64), BF16)]),
        "late after a skipped call": ([("fused", (2, 64), BF16), ("all_reduce", (1, 64), BF16)],
                                      [("fused", (2, 64), BF16), ("all_reduce", (1, 64), BF16)],
                                      [("sleep", LATE_S, None), ("all_reduce", (1, 64), BF16)]),
        "other algorithm": ([("fused@lamport", (2, 64), BF16)], [("fused@lamport", (2, 64), BF16)],
                            [("fused@one_shot", (2, 64), BF16)]),
    },
}
#: ``{world: {fault: {rank: (error types, op, call, peer or None)}}}`` of ``ORDER_FAULTS``: the first
#: call of every rank fails (``call`` counts calls, not pauses), every rank at the same epoch; a late
#: rank raises PeerAbortedError naming a rank that gave up on it (with 3 ranks either one: None), for
#: whichever call it makes at that epoch; its peers PeerTimeoutError naming it. Another algorithm:
#: every rank times out (naming any peer whose kernel it waited for: with 3 ranks, the two Lamport
#: ranks see each other but not the third), or, where its kernel started after a peer's timeout on a
#: busy machine, fails with PeerAbortedError.
FUSED, AR = "fused_add_rmsnorm", "all_reduce"
TIMED_OUT, ABORTED, EITHER = ("PeerTimeoutError",), ("PeerAbortedError",), ("PeerTimeoutError", "PeerAbortedError")
EXPECTED = {
    2: {"late": {0: (TIMED_OUT, FUSED, 0, 1), 1: (ABORTED, FUSED, 0, 0)},
        "late after a skipped call": {0: (TIMED_OUT, FUSED, 0, 1), 1: (ABORTED, AR, 0, 0)},
        "other algorithm": {0: (EITHER, FUSED, 0, 1), 1: (EITHER, FUSED, 0, 0)}},
    3: {"late": {0: (TIMED_OUT, FUSED, 0, 2), 1: (TIMED_OUT, FUSED, 0, 2), 2: (ABORTED, FUSED, 0, None)},
        "late after a skipped call": {0: (TIMED_OUT, FUSED, 0, 2), 1: (TIMED_OUT, FUSED, 0, 2),
                                      2: (ABORTED, AR, 0, None)},
        "other algorithm": {0: (EITHER, FUSED, 0, 2), 1: (EITHER, FUSED, 0, 2), 2: (EITHER, FUSED, 0, None)}},
}
OP_NAMES = {"fp8": "fused_add_rmsnorm", "fused": "fused_add_rmsnorm", "all_reduce": "all_reduce",
            "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}


def expected_errors(fault: str) -> dict[int, tuple[str, int, int]]:
    """``{rank: (op, call index, peer)}`` for every rank that makes a call it cannot complete: each must
    raise PeerTimeoutError for its first call, naming that call's op, epoch and the other rank."""
    calls = FAULTS[fault]
    return {r: (OP_NAMES[calls[r][0][0].split(":")[0]], 0, 1 - r) for r in (0, 1) if calls[r]}


def _call(comm, rank, world_size, seed, op, shape, dtype) -> list[str]:
    """Make one call with seeded small-integer inputs; returns how its result differs from the right one
    (empty when right). ``op`` may name a ``dim`` too: ``"all_gather:1"``, or FP8 options:
    ``"fp8:<FP8_SPECS key>"``."""
    op, _, algo = op.partition("@")
    if algo:
        with comm.use_algorithm(algo):
            return _call(comm, rank, world_size, seed, op, shape, dtype)
    op, _, arg = op.partition(":")
    dim = 0 if op == "fp8" else int(arg or 0)
    xs = all_inputs(seed, world_size, shape, dtype, "int")
    fails: list = []
    if op == "all_reduce":
        y = comm.all_reduce(xs[rank])
        comm.check()
        check_all_reduce(fails, y, xs)
    elif op == "all_gather":
        y = comm.all_gather(xs[rank], dim)
        comm.check()
        if not torch.equal(y, torch.cat(xs, dim)):
            fails.append(f"all_gather: {y.reshape(-1)[:8].tolist()} != {torch.cat(xs, dim).reshape(-1)[:8].tolist()}")
    elif op == "reduce_scatter":
        y = comm.reduce_scatter(xs[rank], dim)
        comm.check()
        share = torch.tensor_split(tpcomm.reduce_in_rank_order(xs), world_size, dim)[rank]
        _catch(fails, assert_same_bits, y, share, "reduce_scatter")
    else:  # fused, or "fp8:<FP8_SPECS key>": fused with FP8 output (per group when a group size is given)
        res = residual_input(seed, shape, dtype, "int")
        w = weight_input(seed, shape[-1], dtype)
        if op == "fp8":
            fmt, group = FP8_SPECS[arg]
            kw = dict(quant="fp8_per_group", group_size=group) if group else dict(quant="fp8_per_token")
            _, _, ro, out = comm.fused_add_rmsnorm(xs[rank], res, w, fp8_dtype=fmt, emit_unquantized=True, **kw)
        else:
            out, ro = comm.fused_add_rmsnorm(xs[rank], res, w)
        comm.check()
        check_fused(fails, out, ro, xs, res, w)
    return fails


def fault_case(ctx, fault: str, algo: str | None, timeout_s: float) -> dict:
    """Run ``fault`` on this rank (see FAULTS) on a fresh communicator forcing ``algo``: what the first
    failing call raised, how long it took, which calls returned, and what the next calls on the same
    communicator raised: a call, an empty one and a fallback one (documented: the same error again, at
    once)."""
    comm = new_communicator(timeout_s=timeout_s, algo=algo, env={"TPCOMM_MAX_PROGRAMS": MAX_PROGRAMS})
    calls = ORDER_FAULTS[ctx.world_size][fault] if fault in ORDER_FAULTS.get(ctx.world_size, {}) else FAULTS[fault]
    try:
        dist.barrier()  # both ranks arrive at the first call together: it must not time out
        warm = _call(comm, ctx.rank, ctx.world_size, 7000, "all_reduce", (1, 16), torch.float32)
        epoch = comm.workspace.epoch()
        seen, returned = None, []
        time.sleep(sum(c[1] for c in calls[ctx.rank] if c[0] == "sleep"))  # a late rank's lateness: not timed
        t0 = time.perf_counter()
        for i, (op, shape, dtype) in enumerate(c for c in calls[ctx.rank] if c[0] != "sleep"):
            try:
                fails = _call(comm, ctx.rank, ctx.world_size, 7100 + i, op, shape, dtype)
            except tpcomm.PeerTimeoutError as e:
                seen = {"type": type(e).__name__, "op": e.op, "epoch": e.epoch, "peer": e.peer, "rank": e.rank,
                        "message": str(e), "call": i}
                break
            except Exception as e:  # a wrong exception type is a finding, not a harness failure
                seen = {"type": type(e).__name__, "message": str(e), "call": i}
                break
            what = f"call {i} ({op} {tuple(shape)} {str(dtype)[6:]}) returned without an error"
            returned.append(f"{what}, and wrong: " + "; ".join(f[:200] for f in fails) if fails
                            else f"{what} (its values happen to be right)")
        elapsed = time.perf_counter() - t0
        agains = {}
        if seen is not None:  # repr says so; a call, an empty call and a fallback call each raise at once
            agains["repr"] = repr(comm)

            def fallback_call():
                with comm.use_algorithm("fallback"):
                    comm.all_reduce(torch.ones(1, 16))

            for name, later in (("again", lambda: comm.all_reduce(torch.ones(1, 16))),
                                ("again_empty", lambda: comm.all_reduce(torch.ones(0, 16))),
                                ("again_fallback", fallback_call)):
                t1 = time.perf_counter()
                agains[name] = None
                try:
                    later()
                except Exception as e:
                    agains[name] = {"type": type(e).__name__, "isinstance": isinstance(e, tpcomm.PeerTimeoutError),
                                    "seconds": time.perf_counter() - t1}
        dist.barrier()  # every rank has finished (or given up on) its calls before the next case
        return {"warm": warm, "epoch": epoch, "seen": seen, "returned": returned, "elapsed": elapsed, **agains}
    finally:
        comm.close()


def fault_batch(ctx, runs: list[tuple[str, str | None]], timeout_s: float) -> dict:
    """``fault_case`` for each ``(fault, algo)`` of ``runs``, in order: ``{"fault[algo]": result}``;
    then a call on a new communicator, the documented remedy (``"after"``: its failures, empty when
    right)."""
    results = {f"{fault}[{algo}]": fault_case(ctx, fault, algo, timeout_s) for fault, algo in runs}
    with new_communicator(timeout_s=timeout_s) as fresh:
        results["after"] = _call(fresh, ctx.rank, ctx.world_size, 7200, "fused", (2, 64), BF16)
    return results


def killed_rank(rank: int, world_size: int, out_dir: str, timeout_s: float) -> int:
    """A :func:`tpcomm.launch.launch` body: every rank makes one call together, then the last rank is
    killed (``SIGKILL``: no handler, no atexit) and every other rank makes the next call. Each survivor
    writes what that call raised (type, op, epoch, peer, rank, seconds) to ``out_dir/rank<r>.json``: the
    killed rank's exit makes ``launch`` raise, so nothing comes back as a return value."""
    import json
    import os
    import signal

    comm = tpcomm.Communicator(timeout_s=timeout_s)
    x = torch.ones(2, 64, dtype=BF16)
    warm = bool((comm.all_reduce(x) == world_size).all())
    epoch = comm.workspace.epoch()
    dist.barrier()
    if rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # the killed rank is gone before the call
    seen = {"type": None, "warm": warm, "epoch_before": epoch}
    t0 = time.perf_counter()
    try:
        comm.all_reduce(x)
        comm.check()
    except tpcomm.PeerTimeoutError as e:
        seen.update(type=type(e).__name__, op=e.op, epoch=e.epoch, peer=e.peer, rank=e.rank, message=str(e))
    seen["seconds"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    comm.close()
    return rank


def fallback_on_one_rank_case(ctx, mode: str, timeout_s: float) -> dict:
    """The last rank's call falls back to ``torch.distributed`` while the others run kernels: ``forced``
    (``use_algorithm("fallback")`` on that rank only) or ``wide`` (``max_bytes`` of 1 KiB and that rank's
    rows 2 KiB wide, where the others' are 128 B: its plan is the fallback). What each rank's fused call
    did (the error's type and op, or "returned"), then a new communicator after ``close()`` on every
    rank, and whether its all-reduce is right (the process group still pairs its collectives)."""
    last = ctx.world_size - 1
    comm = new_communicator(max_bytes=1024 if mode == "wide" else None, timeout_s=timeout_s)
    H = 1024 if mode == "wide" and ctx.rank == last else 64
    x = torch.full((2, H), float(ctx.rank + 1), dtype=torch.bfloat16)
    w = torch.ones(H, dtype=torch.bfloat16)
    seen = "returned"
    try:
        dist.barrier()
        if mode == "forced" and ctx.rank == last:
            with comm.use_algorithm("fallback"):
                comm.fused_add_rmsnorm(x, x.clone(), w)
        else:
            comm.fused_add_rmsnorm(x, x.clone(), w)
    except tpcomm.PeerTimeoutError as e:
        seen = f"{type(e).__name__} {e.op}"
    except Exception as e:  # another type is a finding
        seen = f"{type(e).__name__}: {e}"
    finally:
        comm.close()
    dist.barrier()  # every rank has given up before the new communicator's set-up collective
    with tpcomm.Communicator(timeout_s=timeout_s) as fresh:
        y = fresh.all_reduce(torch.full((2, 64), float(ctx.rank + 1)))
    return {"seen": seen, "after": bool((y == sum(range(1, ctx.world_size + 1))).all())}
