"""The sweep on one rank (run by :func:`tpcomm.launch.launch`): every op, shape and contender, in the
same order on every rank, each checked before it is timed.

For each dtype, hidden size and token count, the peer copy first and then each op: one set of input
slots, then for each contender that has the op (:mod:`tpcomm.bench.contenders`):

1. bind it to the case (``n/a`` with a reason when it does not take the shape);
2. check it on fresh inputs of its own, outputs poisoned (:mod:`tpcomm.bench.checks`); a contender that
   fails is reported and not timed;
3. graph mode: capture, time (:mod:`tpcomm.bench.timing`), then load the check inputs into every set,
   replay once and check the last call's outputs again;
4. eager mode: time the same calls issued from Python.

Every step that can fail is agreed between the ranks (:func:`tpcomm.bench.timing.agree`), so all ranks
skip together and no rank waits in a collective that its peer left.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..progress import Progress
from . import contenders as contenders_mod
from .checks import Case, compare, expected, make_inputs
from .config import ELEMENT_SIZE, BenchConfig, calls_per_replay, message_bytes, runs_shape
from .timing import agree, capture, describe, device, sync, time_replays


class RunContext:
    """What contenders share during one run on this rank: the communicator, the sweep's largest shape,
    the symmetric-memory pool and other objects made once (:meth:`shared`)."""

    def __init__(self, cfg: BenchConfig, comm):
        self.cfg, self.comm = cfg, comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.max_tokens, self.max_hidden = max(cfg.tokens), max(cfg.hiddens)
        self.max_message_bytes = self.max_tokens * self.max_hidden * max(ELEMENT_SIZE[d] for d in cfg.dtypes)
        self._shared: dict = {}

    def shared(self, key: str, make):
        """``make()`` the first time ``key`` is asked for (collective when ``make`` is), then the same."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def symm_pool(self):
        from .contenders.symm import SymmPool

        return self.shared("symm_pool", lambda: SymmPool(self.cfg, self.max_message_bytes))


def sweep_items(cfg: BenchConfig) -> list[tuple[str, int, int, str]]:
    """``(dtype, H, T, op)`` in sweep order; ``op`` ``"copy"`` first at each shape."""
    return [(d, H, T, op) for d in cfg.dtypes for H in cfg.hiddens for T in cfg.tokens
            for op in ("copy",) + tuple(cfg.ops)]


def _setup(cfg: BenchConfig, ctx: RunContext) -> tuple[list, dict]:
    """Set every contender up; returns ``(ready, {name: why unavailable})`` (agreed by all ranks)."""
    ready, unavailable = [], {}
    for c in contenders_mod.make(cfg.contenders):
        err = None
        try:
            c.setup(ctx)
        except Exception as e:
            err = describe(e)
        err = agree(err)
        if err:
            unavailable[c.name] = err
        else:
            ready.append(c)
    return ready, unavailable


def _check(case, c, bound, slots, salt, cfg) -> tuple[str | None, dict, object]:
    """Load check inputs (every rank's, seed salt ``salt``) into set 0, call once, compare. Returns
    ``(error, expected outputs, the inputs)``."""
    inp = make_inputs(case, cfg.seed, salt)
    want = c.expected(case, inp) or expected(case, inp)
    err = None
    try:
        if bound.poison:
            bound.poison()
        slots.load(0, inp.xs[case.rank], inp.residual, inp.weight)
        if bound.load:
            bound.load(0)
        sync()
        dist.barrier()
        got = bound.outputs(bound.call(0))
        sync()
        err = compare(case, got, want, c.exact)
    except Exception as e:
        err = describe(e)
    return agree(err), want, inp


def _run_contender(case, c, slots, refill, ctx, salt, K) -> dict:
    """One contender at one case on this rank: ``{mode: {"us": [...]} | {"na": why} | {"error": why}}``
    and ``note``."""
    cfg = ctx.cfg
    modes = [m for m in cfg.modes if m in c.modes]
    out: dict = {}
    clock = _Clock(out)
    if case.device == "cpu" and "graph" in modes:  # gloo ranks (a CPU run of the logic): eager only
        out["graph"] = {"na": "graph mode needs CUDA"}
        modes.remove("graph")
        if not modes:
            return out
    err = None
    try:
        bound = c.bind(case, slots, ctx)
    except contenders_mod.NotApplicable as e:
        out.update({m: {"na": str(e)} for m in modes})
        return out
    except Exception as e:
        bound, err = None, describe(e)
    err = agree(err)
    if err:
        out.update({m: {"error": f"set-up failed: {err}"} for m in modes})
        return out
    out["note"] = bound.note
    clock.lap("bind")
    err, want, inp = _check(case, c, bound, slots, salt, cfg)
    clock.lap("check")
    if err:
        out.update({m: {"error": f"check failed: {err}"} for m in modes})
        return out
    if "graph" in modes:
        refill(bound)
        g = outs = None
        try:
            g, outs = capture(bound.call, K)
        except Exception as e:
            err = describe(e)
        err = agree(err)
        if not err and bound.after_capture:
            bound.after_capture()
        clock.lap("capture")
        if err:
            out["graph"] = {"error": f"capture failed: {err}"}
        else:
            out["graph"] = {"us": time_replays(g.replay, lambda: refill(bound), K, cfg, graph=True)}
            clock.lap("graph")
            try:  # the last call of the graph reads set K - 1: the check inputs go there
                slots.load(K - 1, inp.xs[case.rank], inp.residual, inp.weight)
                if bound.load:
                    bound.load(K - 1)
                sync()
                dist.barrier()
                g.replay()
                err = compare(case, bound.outputs(outs[-1]), want, c.exact)
            except Exception as e:
                err = describe(e)
            err = agree(err)
            if err:
                out["graph"] = {"error": f"graph replay result wrong: {err}"}
            clock.lap("recheck")
        del g, outs
    if "eager" in modes:
        def run():
            for k in range(K):
                bound.call(k)
        err = None
        try:
            out["eager"] = {"us": time_replays(run, lambda: refill(bound), K, cfg, graph=False)}
        except Exception as e:
            err = describe(e)
        err = agree(err)
        if err:
            out["eager"] = {"error": f"eager calls failed: {err}"}
        clock.lap("eager")
    return out


class _Clock:
    """Seconds spent in each phase of a contender's turn, kept in ``out["phases_s"]`` (to fit the run-time
    model of :mod:`tpcomm.bench.estimate`)."""

    def __init__(self, out: dict):
        self.t, self.phases = time.perf_counter(), {}
        out["phases_s"] = self.phases

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self.t, 4)
        self.t = now


def run_rank(rank: int, world_size: int, cfg: BenchConfig) -> dict:
    """The whole sweep on this rank. Returns ``{"info", "unavailable", "items"}``: one item per
    ``(dtype, H, T, op, contender)`` with its times per mode (µs per call, one per replay) or why not."""
    from ..communicator import Communicator

    comm = Communicator()
    ctx = RunContext(cfg, comm)
    ready, unavailable = _setup(cfg, ctx)
    items = []
    shapes = sweep_items(cfg)
    per_op = {op: [c for c in ready if op in c.ops] for op in ("copy",) + tuple(cfg.ops)}
    progress = Progress(rank == 0, sum(len(per_op[op]) for *_, op in shapes))
    dev = device().type
    for d, H, T, op in shapes:
        case = Case(op, T, H, d, world_size, rank, cfg.eps, dev)
        why = runs_shape(op, T, world_size)
        n = message_bytes(T, H, d)
        K = calls_per_replay(n, cfg)
        slots = None
        if why is None:
            src = make_inputs(case, cfg.seed, 0, ranks=[rank])
            x0 = src.xs[rank]
            slots = contenders_mod.Slots([torch.empty_like(x0) for _ in range(K)],
                                         None if src.residual is None else torch.empty_like(src.residual),
                                         None if src.weight is None else torch.empty_like(src.weight))

            def refill(bound, src=src, slots=slots, x0=x0):
                for k in range(len(slots.x)):
                    slots.load(k, x0, *((src.residual, src.weight) if k == 0 else ()))
                    if bound.load:
                        bound.load(k)
        for salt, c in enumerate(per_op[op], start=1):
            t0 = time.perf_counter()
            if why is not None:
                res = {m: {"na": why} for m in cfg.modes if m in c.modes}
            else:
                res = _run_contender(case, c, slots, refill, ctx, salt, K)
            items.append({"dtype": d, "hidden": H, "tokens": T, "op": op, "bytes": n, "calls": K,
                          "contender": c.name, "wall_s": round(time.perf_counter() - t0, 3), **res})
            progress.advance(f"{op} {d} H={H} T={T} {c.name}")
        del slots
        sync()
        if op == cfg.ops[-1] and dev == "cuda":
            torch.cuda.empty_cache()
    progress.close()
    info = environment(comm)
    sync()
    dist.barrier()
    for c in ready:
        try:
            c.close()
        except Exception:
            pass
    comm.close()
    return {"info": info, "unavailable": unavailable, "items": items}


def environment(comm) -> dict:
    """Versions, the machine and tpcomm's settings (its commit, when run from a git checkout, and whether
    its kernels launch with programmatic dependent launch), for the JSON."""
    import triton

    from .results import tpcomm_commit

    gpu = torch.cuda.get_device_name(comm.device) if comm.device.type == "cuda" else "CPU (gloo ranks)"
    info = {"gpu": gpu, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "communicator": repr(comm),
            "pdl": bool(comm.workspace is not None and comm.workspace.pdl)}
    info["tpcomm_commit"] = tpcomm_commit()
    try:
        import torch.cuda.nccl as nccl

        v = nccl.version()
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        info["nccl"] = None
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except Exception as e:
        info["flashinfer"] = f"not importable ({type(e).__name__})"
    return info
