"""Rank bodies of ``tests/ops/test_gpu_graphs.py`` (CUDA graphs, ``torch.compile`` and the custom ops on 2
GPUs), run through ``tpcomm.launch.launch(fn, 2, "cuda")`` as ``fn(rank, world_size, *args)``. Importing
this module touches no GPU.

Spawning ranks, joining NCCL and compiling kernels cost seconds, so one launch runs every case
(:func:`all_cases`); each case returns a small summary (failure messages, counts, digests), never large
tensors, and a case that raises is recorded and the next one runs on fresh communicators.
"""

from __future__ import annotations

import gc
import os
import random
import time
import traceback

import torch
import torch.distributed as dist

import tpcomm
import tpcomm.graphs as tgraphs
import tpcomm.ops as tops
from tests.support.gpu import _digest, _max_ulp, _mismatch, gpu_inputs
from tests.support.gpu_world import GPU_WORLD
from tests.support.numerics import out_ulp_tolerance
from tpcomm.dispatch import DEFAULT_TABLE

#: Failure messages kept per case (the count is always exact).
MAX_MESSAGES = 20


class _Failures:
    def __init__(self):
        self.count, self.messages = 0, []

    def add(self, msg: str) -> None:
        self.count += 1
        if len(self.messages) < MAX_MESSAGES:
            self.messages.append(msg)


def all_cases(rank, world_size, cfg):
    """Run every case named in ``cfg["cases"]`` (``{name: kwargs}``); returns ``{name: summary}``, each
    summary with ``error`` (a traceback or None) and ``seconds``."""
    import sys

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    out = {}
    for name, kwargs in cfg["cases"].items():
        t0 = time.perf_counter()
        try:
            summary = CASES[name](rank, world_size, **kwargs)
            summary["error"] = None
        except Exception:
            summary = {"error": traceback.format_exc()}
        torch.cuda.synchronize()
        summary["seconds"] = time.perf_counter() - t0
        out[name] = summary
        print(f"[rank {rank}] {name}: {summary['seconds']:.1f} s, failures {summary.get('failures')}, "
              f"error: {summary['error'].strip().splitlines()[-1] if summary['error'] else None}", flush=True)
        dist.barrier()  # every rank starts the next case together, even after a failure
    return out


# -- replay soak ----------------------------------------------------------------------------------------
#: Rows of 4096 bf16 that the default table sends to two-shot (fused, GPU_WORLD ranks): the first size
#: above Lamport's and from two-shot's threshold; at 2 ranks 513 rows (4 MiB + 8 KiB) today.
_FUSED = DEFAULT_TABLE.lookup("fused_add_rmsnorm", GPU_WORLD)
TWO_SHOT_ROWS = max(-(-_FUSED.two_shot_min_bytes // (4096 * 2)), _FUSED.lamport_max_bytes // (4096 * 2) + 1)
#: The calls captured in one graph: (kind, (T, H), dtype name). Under the default dispatch at 2 ranks the
#: 16-bit calls up to 4 MiB take Lamport (at 4 ranks those over 16 KiB one-shot), fp32 one-shot, and
#: TWO_SHOT_ROWS x 4096 bf16 two-shot, so all three kernels share the graph with the FP8 form, all-gather
#: and reduce-scatter.
SOAK_CALLS = [("fused", (16, 4096), "bfloat16"), ("all_reduce", (16, 4096), "bfloat16"),
              ("fused", (4, 4096), "float32"), ("fused_no_res", (64, 4096), "float16"),
              ("all_reduce", (3, 4096), "float32"), ("fused", (TWO_SHOT_ROWS, 4096), "bfloat16"),
              ("fp8", (32, 4096), "bfloat16"), ("all_gather", (8, 4096), "bfloat16"),
              ("reduce_scatter", (9, 4096), "bfloat16")]


def _run_call(comm, kind, st):
    """One call of SOAK_CALLS through tpcomm.ops; returns a tuple of output tensors."""
    if kind == "all_reduce":
        return (tops.all_reduce(comm, st["x"]),)
    if kind == "all_gather":
        return (tops.all_gather(comm, st["x"]),)
    if kind == "reduce_scatter":
        return (tops.reduce_scatter(comm, st["x"]),)
    if kind == "fp8":
        q, s, ro, out = tops.fused_add_rmsnorm(comm, st["x"], st["res"], st["w"], quant="fp8_per_token",
                                               emit_unquantized=True)
        return q, s, ro, out
    out, ro = tops.fused_add_rmsnorm(comm, st["x"], st["res"] if kind == "fused" else None, st["w"])
    return (out,) if ro is None else (out, ro)


def _check_call(kind, shape, st, outs, xs, rank, world_size, fail, name):
    """Compare one call's outputs with the plain-torch reference of every rank's inputs ``xs``."""
    dtype = st["x"].dtype
    s_ref = tpcomm.reduce_in_rank_order(xs)
    if kind == "all_reduce":
        n = _mismatch(outs[0], s_ref)
        if n:
            fail.add(f"{name}: {n} elements differ from the reference")
        return
    if kind == "all_gather":
        n = _mismatch(outs[0], torch.cat(xs, 0))
        if n:
            fail.add(f"{name}: {n} elements differ from torch.cat of the inputs")
        return
    if kind == "reduce_scatter":
        share = torch.tensor_split(s_ref, world_size, 0)[rank]
        if outs[0].shape != share.shape or _mismatch(outs[0], share):
            fail.add(f"{name}: share {tuple(outs[0].shape)} differs from tensor_split's {tuple(share.shape)}")
        return
    res = st["res"] if kind in ("fused", "fp8") else None
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, st["w"], 1e-6)
    out = outs[3] if kind == "fp8" else outs[0]
    ro = outs[2] if kind == "fp8" else (outs[1] if res is not None else None)
    tol = out_ulp_tolerance(dtype, shape[-1])
    if _max_ulp(out, out_ref) > tol:
        fail.add(f"{name}: out {_max_ulp(out, out_ref)} ulp from the reference (tolerance {tol})")
    if ro is not None and _mismatch(ro, ro_ref):
        fail.add(f"{name}: residual_out differs from the reference in {_mismatch(ro, ro_ref)} elements")
    if kind == "fp8":
        q_ref, s_ref_q = tpcomm.per_token_quant_reference(out, torch.float8_e4m3fn)
        if not torch.equal(outs[0].view(torch.uint8), q_ref.view(torch.uint8)) or not torch.equal(
                outs[1].reshape(-1), s_ref_q.reshape(-1).to(outs[1].dtype)):
            fail.add(f"{name}: FP8 bytes or scales differ from the unfused quantisation of out")


def replay_soak(rank, world_size, replays, seed, eager_every, second_every, max_sleep_cycles):
    """SOAK_CALLS captured in one CUDA graph (through tpcomm.ops, inside ``capture_guard``); a second
    graph on a second communicator (an all_reduce and an in-place all_reduce of its result). Then
    ``replays`` times: new inputs copied into the captured inputs, one rank (``step % world_size``)
    delayed by a GPU spin of up to ``max_sleep_cycles`` before the replay, the replay checked against the
    reference; every ``second_every`` steps the second graph replays too, and every ``eager_every``
    steps the same calls run eagerly and must equal the replay bit for bit.

    Returns ``{"failures", "messages", "plans", "digests"}``: ``digests`` hashes the all-reduce and
    fused outputs of every 10th replay (identical on every rank)."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm, comm2 = tpcomm.Communicator(), tpcomm.Communicator()
    static = []
    for i, (kind, shape, dtype_name) in enumerate(SOAK_CALLS):
        dtype = getattr(torch, dtype_name)
        xs, res, w = gpu_inputs(seed + i, world_size, shape, dtype, device)
        static.append({"x": xs[rank].clone(), "res": res.clone(), "w": w})
    plans = {f"{k}-{s}-{d}": comm.plan("all_reduce" if k == "all_reduce" else "fused_add_rmsnorm",
                                       s[0] * s[1] * torch.empty((), dtype=getattr(torch, d)).element_size(),
                                       s[1], getattr(torch, d)).algorithm
             for k, s, d in SOAK_CALLS if k in ("fused", "fused_no_res", "all_reduce")}

    def fill(step):
        allx = []
        for i, (kind, shape, _) in enumerate(SOAK_CALLS):
            xs, res, _ = gpu_inputs(seed + 1000 * step + i, world_size, shape, static[i]["x"].dtype, device)
            static[i]["x"].copy_(xs[rank])
            static[i]["res"].copy_(res)
            allx.append(xs)
        return allx

    def run_all():
        return [_run_call(comm, kind, st) for (kind, _, _), st in zip(SOAK_CALLS, static)]

    x2 = torch.zeros(3, 1000, dtype=torch.bfloat16, device=device)

    def second():
        y = tops.all_reduce(comm2, x2)
        tops.all_reduce(comm2, y, out=y)
        return y

    fill(0)
    run_all()  # warm-up: compiles every kernel, records every signature
    second()
    torch.cuda.synchronize()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with tgraphs.capture_guard(comm, comm2):
        with torch.cuda.graph(g1):
            graph_outs = run_all()
        with torch.cuda.graph(g2):
            y2 = second()
    torch.cuda.synchronize()

    fail, digests = _Failures(), []
    rng = random.Random(seed)
    for step in range(1, replays + 1):
        allx = fill(step)
        if rank == step % world_size:
            torch.cuda._sleep(rng.randrange(max_sleep_cycles))
        else:
            rng.randrange(max_sleep_cycles)  # keep the sequence the same on every rank
        g1.replay()
        if step % second_every == 0:
            x2.fill_(float(rank + step))
            g2.replay()
        torch.cuda.synchronize()
        try:
            comm.check()
            comm2.check()
        except Exception as e:
            fail.add(f"step {step}: {e}")
            break
        if step % second_every == 0:
            # the contract's bf16 roundings (past 256 bf16 holds only even integers, and so on)
            bf = lambda v: torch.tensor(v, dtype=torch.float32).to(torch.bfloat16).float().item()  # noqa: E731
            first = bf(sum(bf(float(r + step)) for r in range(world_size)))
            want = bf(world_size * first)
            if not bool((y2.float() == want).all()):
                fail.add(f"step {step}: second graph's chained all_reduce wrong")
        for i, ((kind, shape, dtype_name), st) in enumerate(zip(SOAK_CALLS, static)):
            _check_call(kind, shape, st, graph_outs[i], allx[i], rank, world_size, fail,
                        f"step {step} call {i} {kind} {shape} {dtype_name}")
        if step % eager_every == 0:
            eager = run_all()
            torch.cuda.synchronize()
            for i, (g, e) in enumerate(zip(graph_outs, eager)):
                for j, (a, b) in enumerate(zip(g, e)):
                    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                        fail.add(f"step {step} call {i} output {j}: replay and eager call differ")
        if step % 10 == 0:
            digests.append([_digest(graph_outs[i][0]) for i, (k, _, _) in enumerate(SOAK_CALLS)
                            if k in ("fused", "fused_no_res", "all_reduce", "all_gather")])
    comm.close()
    comm2.close()
    return {"failures": fail.count, "messages": fail.messages, "plans": plans, "digests": digests,
            "replays": replays}


# -- chained in-place calls -------------------------------------------------------------------------------
def chained(rank, world_size, replays, links, seed):
    """One graph holding two chains of ``links`` calls: in-place all_reduce (``out=x``) of small integers
    (each call's output is the next call's input, so the result is ``S * W^(links-1)``, exact), and
    fused add + RMSNorm whose ``out`` and ``residual_out`` feed the next call. Replayed ``replays`` times
    with new inputs; the integer chain against its exact value, the fused chain bit for bit against the
    same chain run eagerly on the same inputs. Returns ``{"failures", "messages"}``."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = tpcomm.Communicator()
    g = torch.Generator(device=device)
    x = torch.zeros(8, 1024, dtype=torch.bfloat16, device=device)
    h0 = torch.zeros(16, 2048, dtype=torch.bfloat16, device=device)
    r0 = torch.zeros_like(h0)
    w = torch.ones(2048, dtype=torch.bfloat16, device=device)

    def new_inputs(step):
        xs = [torch.randint(-8, 9, x.shape, generator=g.manual_seed(seed + 100 * step + q), device=device)
              .to(x.dtype) for q in range(world_size)]
        x.copy_(xs[rank])
        h0.copy_(torch.randn(h0.shape, generator=g.manual_seed(seed + 100 * step + 50 + rank), device=device))
        r0.copy_(torch.randn(r0.shape, generator=g.manual_seed(seed + 100 * step + 99), device=device))
        return xs

    def chain():
        for _ in range(links):
            tops.all_reduce(comm, x, out=x)
        h, r = h0, r0
        for _ in range(links):
            h, r = tops.fused_add_rmsnorm(comm, h, r, w)
        return h, r

    new_inputs(0)
    chain()  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    new_inputs(0)
    with tgraphs.capture_guard(comm):
        with torch.cuda.graph(graph):
            gh, gr = chain()
    fail = _Failures()
    for step in range(1, replays + 1):
        xs = new_inputs(step)
        graph.replay()
        torch.cuda.synchronize()
        want = tpcomm.reduce_in_rank_order(xs).float() * float(world_size) ** (links - 1)
        if not torch.equal(x.float(), want):
            fail.add(f"step {step}: in-place all_reduce chain: {int((x.float() != want).sum())} elements wrong")
        got_h, got_r = gh.clone(), gr.clone()
        new_inputs(step)  # the same inputs again, for the eager chain
        eh, er = chain()
        torch.cuda.synchronize()
        if _mismatch(got_h, eh) or _mismatch(got_r, er):
            fail.add(f"step {step}: fused chain: replay and eager differ ({_mismatch(got_h, eh)} out, "
                     f"{_mismatch(got_r, er)} residual elements)")
    comm.close()
    return {"failures": fail.count, "messages": fail.messages}


# -- capture and destroy ----------------------------------------------------------------------------------
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def capture_destroy(rank, world_size, cycles, sample_at):
    """``cycles`` times: capture a graph of a fused call and an all_reduce (new private memory pool),
    replay it once, check it, destroy it. Device memory (allocated, and reserved by the caching
    allocator after ``empty_cache``) and open file descriptors are sampled after cycle ``sample_at`` and
    after the last.
    Returns the samples and failures."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = tpcomm.Communicator()
    xs, res, w = gpu_inputs(77, world_size, (32, 4096), torch.bfloat16, device)
    x = xs[rank]
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(tpcomm.reduce_in_rank_order(xs), res, w, 1e-6)
    tops.fused_add_rmsnorm(comm, x, res, w)
    tops.all_reduce(comm, x)
    torch.cuda.synchronize()
    fail, samples = _Failures(), {}
    for c in range(1, cycles + 1):
        graph = torch.cuda.CUDAGraph()
        with tgraphs.capture_guard(comm):
            with torch.cuda.graph(graph):
                out, ro = tops.fused_add_rmsnorm(comm, x, res, w)
                s = tops.all_reduce(comm, x)
        graph.replay()
        torch.cuda.synchronize()
        if _mismatch(ro, ro_ref) or _max_ulp(out, out_ref) > 1 or _mismatch(s, tpcomm.reduce_in_rank_order(xs)):
            fail.add(f"cycle {c}: wrong result")
        del graph, out, ro, s
        gc.collect()
        torch.cuda.synchronize()
        if c in (sample_at, cycles):
            torch.cuda.empty_cache()  # reserved then counts what is held, not what is cached for reuse
            samples[c] = {"allocated": torch.cuda.memory_allocated(device),
                          "reserved": torch.cuda.memory_reserved(device), "fds": _open_fds()}
    comm.check()
    comm.close()
    return {"failures": fail.count, "messages": fail.messages, "samples": samples}


# -- torch.compile on the GPU -----------------------------------------------------------------------------
def compile_gpu(rank, world_size, hidden, tokens, graph_replays, seed):
    """(1) ``tests.ops.ranks._Layer`` (every op) compiled with Inductor, ``fullgraph=True``, token dimension
    dynamic: one compilation, each token count bit-identical to eager. (2) The compiled layer captured in
    a CUDA graph (``capture_guard``) and replayed with new inputs: bit-identical to the compiled layer
    outside the graph. (3) ``mode="reduce-overhead"`` (Inductor's own CUDA graphs) of all_reduce + fused:
    each call equals eager; Inductor's count of skipped CUDA graphs. Returns a summary."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from tests.ops.ranks import _Layer, _same
    from tests.support.numerics import all_inputs, residual_input

    device = torch.device("cuda", torch.cuda.current_device())
    comm = tpcomm.Communicator()
    torch._dynamo.reset()
    layer = _Layer(comm, hidden, torch.bfloat16, seed)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    fail = _Failures()

    def inputs(i, T):
        x = all_inputs(seed + i, world_size, (T, hidden), torch.bfloat16)[rank].to(device)
        return x, residual_input(seed + i, (T, hidden), torch.bfloat16).to(device)

    with torch.inference_mode():
        for i, T in enumerate(tokens):
            x, res = inputs(i, T)
            eager = layer(x, res)[0]
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(res, 0)
            comp = compiled(x, res)[0]
            for j, (a, b) in enumerate(zip(comp, eager)):
                if not (_same(a, b) and a.stride() == b.stride()):
                    fail.add(f"compiled T={T}: output {j} differs from eager")
        # (2) the compiled layer in a CUDA graph
        T = tokens[0]
        sx, sres = inputs(0, T)
        torch._dynamo.mark_dynamic(sx, 0)
        torch._dynamo.mark_dynamic(sres, 0)
        compiled(sx, sres)  # warm-up of this exact call
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with tgraphs.capture_guard(comm):
            with torch.cuda.graph(graph):
                gouts = compiled(sx, sres)[0]
        for k in range(1, graph_replays + 1):
            x, res = inputs(100 + k, T)
            sx.copy_(x)
            sres.copy_(res)
            graph.replay()
            outside = compiled(x, res)[0]
            torch.cuda.synchronize()
            for j, (a, b) in enumerate(zip(gouts, outside)):
                if not _same(a, b):
                    fail.add(f"graph replay {k}: output {j} differs from the compiled layer outside the graph")
        # (3) reduce-overhead
        from torch._dynamo.utils import counters

        w = torch.ones(hidden, dtype=torch.bfloat16, device=device)

        def step(x, res):
            s = tops.all_reduce(comm, x)
            return tops.fused_add_rmsnorm(comm, s, res, w)

        ro_fn = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        skips_before = sum(counters["inductor"].get(k, 0) for k in counters["inductor"] if "cudagraph_skips" in k)
        for k in range(6):
            x, res = inputs(200 + k, 16)
            got = [t.clone() for t in ro_fn(x, res)]
            want = step(x, res)
            torch.cuda.synchronize()
            if not all(_same(a, b) for a, b in zip(got, want)):
                fail.add(f"reduce-overhead call {k}: differs from eager")
        skips = sum(counters["inductor"].get(k,
                                             0) for k in counters["inductor"] if "cudagraph_skips" in k) - skips_before
    comm.check()
    comm.close()
    return {"failures": fail.count, "messages": fail.messages, "frames": counter.frame_count,
            "cudagraph_skips": skips}


# -- the guard's refusals ---------------------------------------------------------------------------------
def guard_errors(rank, world_size):
    """What ``capture_guard`` refuses, each time on every rank alike (so the communicator stays in
    step): a first call of a signature during capture; a call from a side stream during capture;
    entering the guard while capturing. After each refusal an eager call still gives the right sum.
    Returns ``{case: (exception type name or None, eager sum right)}``."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = tpcomm.Communicator()
    x = torch.full((4, 256), float(rank + 1), dtype=torch.bfloat16, device=device)
    want = float(sum(range(1, world_size + 1)))
    tops.all_reduce(comm, x)  # warm: (4, 256) bf16
    torch.cuda.synchronize()
    seen = {}

    def after():
        y = tops.all_reduce(comm, x)
        torch.cuda.synchronize()
        return bool((y.float() == want).all())

    def attempt(name, body):
        graph = torch.cuda.CUDAGraph()
        err = None
        try:
            body(graph)
        except Exception as e:
            err = type(e).__name__
        del graph
        torch.cuda.synchronize()
        seen[name] = (err, after())

    def first_use(graph):
        with tgraphs.capture_guard(comm):
            with torch.cuda.graph(graph):
                tops.all_reduce(comm, torch.ones(5, 256, dtype=torch.bfloat16, device=device))  # never warmed

    def side_stream(graph):
        with tgraphs.capture_guard(comm):
            with torch.cuda.graph(graph):
                main = torch.cuda.current_stream()
                tops.all_reduce(comm, x)  # the capture stream: fine
                side = torch.cuda.Stream()
                side.wait_stream(main)
                try:
                    with torch.cuda.stream(side):
                        tops.all_reduce(comm, x)
                finally:
                    main.wait_stream(side)  # join the fork, so the capture can end

    def nested(graph):
        with torch.cuda.graph(graph):
            with tgraphs.capture_guard(comm):
                pass

    attempt("first_use", first_use)
    # side_stream: the first call was captured and the second refused on both ranks, so the graph
    # holds one call of this communicator that is never replayed: the epochs still agree.
    attempt("side_stream", side_stream)
    attempt("nested", nested)
    comm.close()
    return {"seen": seen}


# -- the example ------------------------------------------------------------------------------------------
def example(rank, world_size, cfg_fields):
    """``examples/tp_decoder.py``'s rank body (compiled with Inductor, captured in a CUDA graph)."""
    import tp_decoder

    return tp_decoder.run_rank(rank, world_size, cfg_fields)


CASES = {"replay_soak": replay_soak, "chained": chained, "capture_destroy": capture_destroy,
         "compile_gpu": compile_gpu, "guard_errors": guard_errors, "example": example}
