"""``tpcomm bench --loopback``: on ONE GPU, tpcomm's loopback ranks (:mod:`tpcomm.loopback`) beside
TensorRT-LLM's one-shot all-reduce fusion (FlashInfer's ``trtllm_allreduce_fusion``) run as loopback ranks
too, in CUDA graphs, in the same run; every output checked before it is timed.

Both libraries read their peers through tables of device addresses, so every "peer" buffer can be an
allocation on the same GPU. FlashInfer's workspace, per rank ``r``: a CUDA int64 tensor
``[buffer_0 .. buffer_{W-1}, flags_0 .. flags_{W-1}, lamport_0 .. lamport_{W-1}, flag_r]`` (the first 3W
entries the same for every rank): ``buffer_q`` of ``W * max_tokens * H * 2`` bytes, ``flags_q`` ``W *
256`` zeroed int32, ``lamport_q`` three Lamport buffers of ``lamport_comm_size = W * max_tokens * H * 2``
bytes with every 16-bit word the -0.0 sentinel, ``flag_r`` int32 ``[0, 0, 0, lamport_comm_size, 0]``
(read counter, non-Lamport flag, Lamport flag, triple-buffer offset, clear size).

Timing (as ``dev/dev_loopback.py``): each rank issues ``calls`` calls on its own stream (one fork
from the capturing stream, one join), captured in one graph; µs per call is the median over ``replays``
replays of the replay's time divided by ``calls``. The peer's data never crosses NVLink here: these are
the kernels' own costs, to compare kernels on a machine with one GPU.

Never a hang: each (library, hidden size) runs in a child process with a time limit (a kernel that spins
forever ends with its process; ``CHILD_TIMEOUT_S``), which prints each row as it is done, so a child
killed midway keeps the rows it finished and the notes say how many; FlashInfer's loopback rows stop
at ``fi_max_tokens`` (at 256 tokens its grid outgrows what two ranks can keep resident on one GPU, and
it spun), and it runs only at world sizes it supports (2, 4, 8, 16).

    python -m tpcomm bench --loopback [--world 2] [--hidden 4096,6144,8192] [--tokens 1,16,64,256,1024,4096]
                                      [--programs N]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import torch

from . import results

#: Token counts FlashInfer's loopback rows stop at (see the module docstring).
FI_MAX_TOKENS = 64
#: World sizes FlashInfer's all-reduce fusion supports.
FI_WORLDS = (2, 4, 8, 16)
#: Ops, and FlashInfer's pattern for each.
OPS = ("all_reduce", "fused", "fused_fp8")
#: Seconds a child (one library at one hidden size) may take: tpcomm's compiles its kernels; FlashInfer's
#: loads prebuilt modules and takes 10-20 s on one H200, so a longer one is stuck (its loopback at 4 ranks
#: and hidden 8192 never ends: docs/performance.md).
CHILD_TIMEOUT_S = {"tpcomm": 300.0, "trtllm": 90.0}


def _inputs(W: int, T: int, H: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(W)]
    res = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)
    return xs, res, w


def _expected(xs, res, w, eps):
    from tpcomm import reference as R

    s = R.reduce_in_rank_order(xs)
    o, ro = R.add_rmsnorm_reference(s, res, w, eps)
    q, sc = R.per_token_quant_reference(o)
    return {"all_reduce": (s,), "fused": (o, ro), "fused_fp8": (q, sc, ro)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def issue_on_streams(issue, ranks_streams, n: int = 1) -> None:
    """``issue(r)`` (one call of rank ``r``) ``n`` times on each rank's stream, every rank's before any is
    waited for; each stream forks from, and joins, the current stream (inside a capture: the capturing
    stream)."""
    current = torch.cuda.current_stream()
    for r, s in enumerate(ranks_streams):
        s.wait_stream(current)
        with torch.cuda.stream(s):
            for _ in range(n):
                issue(r)
    for s in ranks_streams:
        current.wait_stream(s)


def graph_us(issue, ranks_streams, calls: int, replays: int) -> float:
    """µs per call: ``issue(r)`` (one call of rank ``r``) ``calls`` times on each rank's stream
    (:func:`issue_on_streams`), captured in one graph; median over ``replays`` replays."""
    return replayed_us(lambda n: issue_on_streams(issue, ranks_streams, n), calls, replays)


def replayed_us(issue_calls, calls: int, replays: int) -> float:
    """µs per call of ``issue_calls(n)`` (issue ``n`` calls of every rank): run eagerly with ``n = 2``,
    then ``calls`` of them captured in one graph; the median over ``replays`` replays of a replay's time
    divided by ``calls``."""
    issue_calls(2)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        issue_calls(calls)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(times)


# -- tpcomm ----------------------------------------------------------------------------------------------
def _tpcomm_rows(W: int, H: int, tokens, calls: int, replays: int, eps: float,
                 max_programs: int | None = None) -> list[dict]:
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    ranks = loopback_group(W, timeout_s=20.0, max_programs=max_programs)
    rows = []
    try:
        for T in tokens:
            xs, res, w = _inputs(W, T, H, seed=T * 7 + H)
            want = _expected(xs, res, w, eps)
            fns = {"all_reduce": lambda rk: (rk.all_reduce(xs[rk.rank]),),
                   "fused": lambda rk: rk.fused_add_rmsnorm(xs[rk.rank], res, w, eps),
                   "fused_fp8": lambda rk: rk.fused_add_rmsnorm(xs[rk.rank], res, w, eps, quant="fp8_per_token")}
            for op, fn in fns.items():
                got = run_ranks(ranks, fn)
                torch.cuda.synchronize()
                ok = all(torch.equal(g.view(torch.uint8), e.view(torch.uint8)) for per in got
                         for g, e in zip(per, want[op]))
                row = dict(library="tpcomm", op=op, tokens=T, hidden=H, world=W, checked=ok,
                           max_programs=ranks[0].workspace.max_programs,
                           algorithm=ranks[0].plan("all_reduce" if op == "all_reduce" else "fused_add_rmsnorm",
                                                   T * H * 2, H, torch.bfloat16).algorithm)
                if ok:
                    row["us"] = graph_us(lambda r: fn(ranks[r]), [rk.stream for rk in ranks], calls, replays)
                rows.append(row)
                _emit(row)
        for rk in ranks:
            rk.check()
    finally:
        close_group(ranks)
    return rows


# -- FlashInfer's TensorRT-LLM one-shot ----------------------------------------------------------------------
class TrtllmLoopback:
    """FlashInfer's one-shot fusion kernels as ``W`` loopback ranks (the workspace of the module
    docstring), for up to ``max_tokens`` x ``H`` bf16."""

    def __init__(self, W: int, max_tokens: int, H: int):
        self.W, self.max_tokens, self.H = W, max_tokens, H
        size = W * max_tokens * H * 2
        self.lamport_comm_size = size
        self.buffers = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(W)]
        self.flags = [torch.zeros(W * 256, dtype=torch.int32, device="cuda") for _ in range(W)]
        self.lamport = [torch.full((3 * size // 2,), -32768, dtype=torch.int16, device="cuda") for _ in range(W)]
        self.flag = [torch.tensor([0, 0, 0, size, 0], dtype=torch.int32, device="cuda") for _ in range(W)]
        shared = ([b.data_ptr() for b in self.buffers] + [f.data_ptr() for f in self.flags]
                  + [lb.data_ptr() for lb in self.lamport])
        self.ws = [torch.tensor(shared + [self.flag[r].data_ptr()], dtype=torch.int64, device="cuda")
                   for r in range(W)]

    def call(self, r: int, op: str, x, res, w, eps, outs) -> None:
        import flashinfer.comm as fc

        P = fc.AllReduceFusionPattern
        T, H = x.shape
        common = dict(world_size=self.W, world_rank=r, token_num=T, hidden_dim=H, workspace_ptrs=self.ws[r],
                      launch_with_pdl=True, trigger_completion_at_end=True, fp32_acc=True, use_oneshot=True,
                      scale_factor=None, layout_code=None)
        if op == "all_reduce":
            fc.trtllm_allreduce_fusion(allreduce_in=x, allreduce_out=outs[0], pattern_code=P.kAllReduce,
                                       residual_in=None, residual_out=None, norm_out=None, quant_out=None,
                                       scale_out=None, rms_gamma=None, rms_eps=None, **common)
        elif op == "fused":
            fc.trtllm_allreduce_fusion(allreduce_in=x, allreduce_out=None, pattern_code=P.kARResidualRMSNorm,
                                       residual_in=res, residual_out=outs[1], norm_out=outs[0], quant_out=None,
                                       scale_out=None, rms_gamma=w, rms_eps=eps, **common)
        else:
            fc.trtllm_allreduce_fusion(allreduce_in=x, allreduce_out=None,
                                       pattern_code=P.kARResidualRMSNormDynamicFP8Quant, residual_in=res,
                                       residual_out=outs[2], norm_out=None, quant_out=outs[0], scale_out=outs[1],
                                       rms_gamma=w, rms_eps=eps, **common)


def _trtllm_rows(W: int, H: int, tokens, calls: int, replays: int, eps: float) -> list[dict]:
    import warnings

    warnings.simplefilter("ignore")
    lb = TrtllmLoopback(W, max(tokens), H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    rows = []
    for T in tokens:
        xs, res, w = _inputs(W, T, H, seed=T * 7 + H)
        want = _expected(xs, res, w, eps)
        for op in OPS:
            if op == "all_reduce":
                outs = [(torch.empty(T, H, dtype=torch.bfloat16, device="cuda"),) for _ in range(W)]
            elif op == "fused":
                outs = [(torch.empty(T, H, dtype=torch.bfloat16, device="cuda"),
                         torch.empty(T, H, dtype=torch.bfloat16, device="cuda")) for _ in range(W)]
            else:
                outs = [(torch.empty(T, H, dtype=torch.float8_e4m3fn, device="cuda"),
                         torch.empty(T, 1, dtype=torch.float32, device="cuda"),
                         torch.empty(T, H, dtype=torch.bfloat16, device="cuda")) for _ in range(W)]

            def issue(r, op=op, outs=outs):
                lb.call(r, op, xs[r], res, w, eps, outs[r])

            issue_on_streams(issue, streams)  # one call of every rank, then check
            torch.cuda.synchronize()
            if op == "fused_fp8":  # dequantised against the reference's out; scales and residual_out relative
                o = _expected(xs, res, w, eps)["fused"][0].float()
                errs = [max(_rel(q.float() * sc, o), _rel(sc, want[op][1]), _rel(ro, want[op][2]))
                        for q, sc, ro in outs]
                ok = max(errs) < 6e-2
            else:
                errs = [max(_rel(g, e) for g, e in zip(per, want[op])) for per in outs]
                ok = max(errs) < 8e-3
            row = dict(library="trtllm", op=op, tokens=T, hidden=H, world=W, checked=ok, rel_error=max(errs))
            if ok:
                row["us"] = graph_us(issue, streams, calls, replays)
            rows.append(row)
            _emit(row)
    return rows


def _emit(row: dict) -> None:
    """Print one finished row for the parent (:func:`_run_child`), at once: a child killed later keeps it."""
    print("ROW " + json.dumps(row), flush=True)


# -- driver --------------------------------------------------------------------------------------------------
def child(library: str, W: int, H: int, tokens, calls: int, replays: int, eps: float,
          max_programs: int | None = None) -> list[dict]:
    """One library at one hidden size, in this process (the child of :func:`main`)."""
    if library == "tpcomm":
        return _tpcomm_rows(W, H, tokens, calls, replays, eps, max_programs)
    return _trtllm_rows(W, H, tokens, calls, replays, eps)


def _run_child(library: str, W: int, H: int, tokens, calls: int, replays: int, eps: float,
               max_programs: int | None = None) -> tuple[list, str]:
    cmd = [sys.executable, "-m", "tpcomm.bench.loopback", library, str(W), str(H), ",".join(map(str, tokens)),
           str(calls), str(replays), repr(eps), str(max_programs or 0)]
    return _collect(cmd, CHILD_TIMEOUT_S[library], f"{library} at hidden {H}, tokens {tokens}")


def _collect(cmd: list, limit: float, label: str) -> tuple[list, str]:
    """Run the child ``cmd`` for at most ``limit`` seconds: ``(rows, note)``, the rows it printed
    (:func:`_emit`, those of a killed or failed child included) and, when it was killed, failed or printed
    none, a note that starts with ``label``."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=dict(os.environ))
    except subprocess.TimeoutExpired as e:
        rows = _child_rows(e.stdout)
        return rows, f"{label}: killed after {limit:.0f} s with {len(rows)} rows done"
    rows = _child_rows(done.stdout)
    if done.returncode or not rows:
        return rows, f"{label}: exit {done.returncode}: {done.stderr.strip()[-600:]}"
    return rows, ""


def _child_rows(stdout) -> list[dict]:
    """The rows a child printed (:func:`_emit`); ``stdout`` as text, bytes (a killed child's) or None."""
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    return [json.loads(ln[4:]) for ln in (stdout or "").splitlines() if ln.startswith("ROW ")]


def _version(module: str) -> str | None:
    """``module.__version__``, or None where it cannot be imported."""
    try:
        return __import__(module).__version__
    except Exception:
        return None


def main(world_size: int = 2, hiddens=(4096, 6144, 8192), tokens=(1, 16, 64, 256, 1024, 4096),
         json_path: str | None = None, calls: int = 50, replays: int = 20, eps: float = 1e-6,
         max_programs: int | None = None, results_path: str | None = None) -> int:
    """Run both libraries at every hidden size; print a table of µs per call and tpcomm / TRT-LLM; write
    JSON (and, with ``results_path``, append its rows to that results file: :mod:`tpcomm.bench.results`).
    tpcomm runs one child for the token counts up to 256 and one per larger count, so that a
    failure loses only its own rows. ``max_programs``: tpcomm's loopback grid cap (None: the default
    of :func:`tpcomm.loopback.loopback_group`). Returns 1 when a tpcomm output was wrong or a tpcomm
    child failed, else 0 (FlashInfer missing or failing is reported)."""
    from tabulate import tabulate

    if not torch.cuda.is_available():
        print("tpcomm bench --loopback: needs a CUDA GPU")
        return 2
    rows, notes = [], []
    fi_tokens = tuple(t for t in tokens if t <= FI_MAX_TOKENS)
    try:
        import flashinfer.comm  # noqa: F401
        have_fi = True
    except Exception as e:  # not installed: the tpcomm rows still run
        have_fi, notes = False, [f"FlashInfer not available ({type(e).__name__}: {e})"]
    for H in hiddens:
        groups = [tuple(t for t in tokens if t <= 256)] + [(t,) for t in tokens if t > 256]
        for group in (g for g in groups if g):
            got, note = _run_child("tpcomm", world_size, H, group, calls, replays, eps, max_programs)
            rows += got
            notes += [note] if note else []
        if have_fi and world_size in FI_WORLDS and fi_tokens:
            got, note = _run_child("trtllm", world_size, H, fi_tokens, calls, replays, eps)
            rows += got
            notes += [note] if note else []
    us = {(r["library"], r["op"], r["tokens"], r["hidden"]): r.get("us") for r in rows}
    table = []
    for H in hiddens:
        for op in OPS:
            for T in tokens:
                a, b = us.get(("tpcomm", op, T, H)), us.get(("trtllm", op, T, H))
                table.append([H, op, T, "-" if a is None else f"{a:.2f}", "-" if b is None else f"{b:.2f}",
                              "-" if a is None or b is None else f"{a / b:.2f}"])
    print(tabulate(table, headers=["hidden", "op", "tokens", "tpcomm µs", "TRT-LLM µs", "tpcomm / TRT-LLM"],
                   tablefmt="github"))
    for n in notes:
        print("note:", n)
    bad = [r for r in rows if r["library"] == "tpcomm" and not r["checked"]]
    for r in rows:
        if not r["checked"]:
            print(f"FAIL {r['library']} {r['op']} {r['tokens']}x{r['hidden']}: wrong output, not timed")
    doc = dict(world=world_size, calls=calls, replays=replays, torch=torch.__version__, triton=_version("triton"),
               flashinfer=_version("flashinfer"), commit=results.tpcomm_commit(), max_programs=max_programs,
               device=torch.cuda.get_device_name(), rows=rows, notes=notes)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    if results_path:
        results.append(results.loopback_rows(doc), results_path)
        print(f"appended the run to {results_path}")
    return 1 if bad or any("tpcomm at" in n for n in notes) else 0


if __name__ == "__main__":
    lib, W, H, toks, n_calls, n_replays, e, programs = sys.argv[1:9]
    child(lib, int(W), int(H), [int(t) for t in toks.split(",")], int(n_calls), int(n_replays), float(e),
          int(programs) or None)  # each row printed as it is done
