"""``tpcomm soak``: many steps of mixed calls under random rank skew, every result checked exactly.

Each step makes a fixed set of calls in an order, and with sizes, dtypes and algorithms, drawn from a
random generator seeded by ``(seed, step)`` — the same on every rank, so every rank makes the same calls:

  * ``fused_add_rmsnorm`` at a small and a large token count (with a residual), without a residual, and
    with a Gemma weight;
  * ``all_reduce`` of a flat tensor of one of several sizes, and of a 2-D tensor;
  * ``all_gather`` and ``reduce_scatter`` along dim 0 (row counts that the world size does not divide
    included);
  * ``fused_add_rmsnorm`` with a quantised output form drawn from every form (FP8 per token, per group,
    per group with UE8M0 scales, static; MXFP4, NVFP4), its unquantised output returned beside it;
  * ``fused_qk_rmsnorm`` (the full-width QK norm) and ``fused_moe_finalize_add_rmsnorm`` (the MoE
    finalize, in token order or permuted with an index, with or without a shared expert's output);

each under an algorithm forced for that call (:meth:`tpcomm.Communicator.use_algorithm`): ``auto``, every
entry of :data:`tpcomm.dispatch.ALGORITHMS` and ``fallback`` (the all-gather and reduce-scatter have one
kernel each: ``auto`` or ``fallback``), on one of two communicators: one with the default workspace and
one with a small one (so calls also run in chunks, and two communicators interleave). Before every call
each rank waits a random time drawn from its own generator (a spin kernel on the GPU,
``torch.cuda._sleep``; a sleep on the CPU), so ranks arrive in every order.

Inputs are small integers from seeds every rank knows, so each rank computes every expected result
itself: sums, ``residual_out``, all-gathers and reduce-scatter shares exactly (bit for bit), ``out``
within the contract's ulps of :func:`tpcomm.add_rmsnorm_reference` (one for 16-bit outputs), the QK
norm's outputs within as many of :func:`tpcomm.fused_qk_rmsnorm_reference`, the MoE call's against
:func:`tpcomm.moe_finalize_reference` of every rank, and a quantised form's bytes and scales exactly
against the form's reference applied to the call's own ``out``. At the end the ranks compare a checksum
of every output bit they produced (the contract says every rank holds the same bits; reduce-scatter
shares and the QK norm's columns excepted).

A call that raises :class:`~tpcomm.PeerTimeoutError` is a hang: the rank goes on with the step's other
calls (so that the calls through ``torch.distributed`` keep matching; kernel calls on a broken
communicator raise at once), the ranks agree at the end of the step (a ``torch.distributed`` all-reduce
of a flag) and all of them replace their communicators, then go on. Reports steps, calls, mismatches,
hangs, elapsed time and the step rate; exit status 1 on any mismatch, hang or checksum disagreement.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: Call kinds of every step.
KINDS = ("fused_small", "fused_large", "fused_no_residual", "fused_gemma", "all_reduce_flat",
         "all_reduce_2d", "all_gather", "reduce_scatter", "fused_quant", "qk_norm", "moe_finalize")
#: Quantised output forms the ``fused_quant`` calls draw from: every form of the fused ops.
QUANT_FORMS = ("fp8_per_token", "fp8_per_group", "fp8_per_group_ue8m0", "fp8_static", "mxfp4", "nvfp4")
#: Kinds with one kernel (or one path): forced ``auto`` or ``fallback`` only.
ONE_KERNEL = ("all_gather", "reduce_scatter", "qk_norm")
#: Magnitude bound of the integer inputs: a sum of W ranks plus a residual stays exact in bf16 (8
#: significant bits) up to W = 31.
SMALL_INT = 8
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class SoakConfig:
    """What a soak runs (:func:`make_config` fills in the per-device defaults).

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        world_size: ranks.
        steps: steps to run.
        seed: seed of the calls, the inputs and the delays.
        timeout_s: the communicators' kernel timeout (seconds).
        hidden: row width of the fused calls, all-gathers and reduce-scatters.
        small_tokens, large_tokens: token counts of the fused calls.
        flat_sizes: element counts of the flat all-reduces.
        gather_rows, scatter_rows: row counts of the all-gathers and reduce-scatters.
        quant_hidden, group_sizes: row width of the quantised calls (a multiple of 32, every form's
            block) and the per-group forms' group sizes to draw from.
        qk_widths: ``(Hq, Hk)``, each rank's columns of the QK norm's ``q`` and ``k``.
        topk: experts a token (K) of the MoE finalize.
        dtypes: dtype names to draw from (repeats weight the draw).
        small_max_bytes: ``max_bytes`` of the second communicator (calls larger than it run in chunks).
        max_delay: the largest random delay before a call: seconds on the CPU, microseconds on the GPU.
        progress: rank 0 shows progress (a rich bar on a terminal, else a line every few seconds).
    """

    device: str
    world_size: int
    steps: int
    seed: int
    timeout_s: float
    hidden: int
    small_tokens: tuple
    large_tokens: tuple
    flat_sizes: tuple
    gather_rows: tuple
    scatter_rows: tuple
    quant_hidden: int
    group_sizes: tuple
    qk_widths: tuple
    topk: int
    dtypes: tuple
    small_max_bytes: int
    max_delay: float
    progress: bool = False


def make_config(device: str, world_size: int, steps: int, seed: int = 0, timeout_s: float = 10.0,
                max_delay: float | None = None, progress: bool = False) -> SoakConfig:
    """The soak's sizes for ``device``.

    GPU: hidden 4096; fused calls at 1-64 tokens (decode) and 512 or 2048 (prefill: 4 and 16 MiB of bf16;
    at 2 ranks ``auto`` runs Lamport up to 4 MiB and two-shot at 16 MiB, at 4 ranks Lamport up to 1 MiB
    and two-shot from 3 MiB); flat all-reduces from one element to 12 MiB; a second
    communicator of 1 MiB (so the large calls run in chunks there); delays up to 20 µs, several times a
    decode call; quantised calls at hidden 4096, the QK norm at MiniMax-M2's widths on 8 ranks (768 + 128
    columns a rank), the MoE finalize with 8 experts a token. The set of shapes is fixed, so the kernels
    compile once, in the first steps.
    CPU (Triton's interpreter, tens of ms a row): hidden 48 (rows padded to 64 in the workspace), 1-5
    tokens (5: above the interpreter's grid of 4 programs, the grid-stride loop), quantised calls at
    hidden 64, a 4 KiB second workspace, delays up to 30 ms, about a call's duration.
    """
    if device == "cuda":
        return SoakConfig(device, world_size, steps, seed, timeout_s, hidden=4096, small_tokens=(1, 3, 16, 64),
                          large_tokens=(512, 2048), flat_sizes=(1, 3 * 4096 + 5, 1 << 20, 6 << 20),
                          gather_rows=(1, 7, 256), scatter_rows=(2, 7, 256, 1024), quant_hidden=4096,
                          group_sizes=(64, 128), qk_widths=(768, 128), topk=8,
                          dtypes=("bf16", "bf16", "fp16", "fp32"), small_max_bytes=1 << 20,
                          max_delay=20.0 if max_delay is None else max_delay, progress=progress)
    return SoakConfig(device, world_size, steps, seed, timeout_s, hidden=48, small_tokens=(1, 2),
                      large_tokens=(5,), flat_sizes=(1, 37, 4100), gather_rows=(1, 3), scatter_rows=(2, 5),
                      quant_hidden=64, group_sizes=(16, 32), qk_widths=(32, 16), topk=2,
                      dtypes=("bf16", "bf16", "fp16", "fp32"), small_max_bytes=4096,
                      max_delay=0.03 if max_delay is None else max_delay, progress=progress)


# -- one call ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    """One call of a step: ``kind`` (KINDS), ``shape`` of every rank's input, dtype name, the forced
    algorithm, and which communicator (``small``: the one with the small workspace); ``variant``: the
    quantised form and group size (``fused_quant``), or the layout and shared expert (``moe_finalize``)."""

    kind: str
    shape: tuple
    dtype: str
    algorithm: str
    small: bool
    variant: tuple = ()


def step_calls(cfg: SoakConfig, step: int, algorithms: tuple) -> list[Call]:
    """The calls of ``step``: the same list on every rank (drawn from ``(seed, step)`` only)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    H = cfg.hidden
    shapes = {
        "fused_small": (rng.choice(cfg.small_tokens), H),
        "fused_large": (rng.choice(cfg.large_tokens), H),
        "fused_no_residual": (rng.choice(cfg.small_tokens + cfg.large_tokens), H),
        "fused_gemma": (rng.choice(cfg.small_tokens), H),
        "all_reduce_flat": (rng.choice(cfg.flat_sizes),),
        "all_reduce_2d": (rng.choice(cfg.small_tokens), H),
        "all_gather": (rng.choice(cfg.gather_rows), H),
        "reduce_scatter": (rng.choice(cfg.scatter_rows), H),
        "fused_quant": (rng.choice(cfg.small_tokens + cfg.large_tokens), cfg.quant_hidden),
        "qk_norm": (rng.choice(cfg.small_tokens + cfg.large_tokens), *cfg.qk_widths),
        "moe_finalize": (rng.choice(cfg.small_tokens + cfg.large_tokens), cfg.topk, H),
    }
    variants = {"fused_quant": (rng.choice(QUANT_FORMS), rng.choice(cfg.group_sizes)),
                "moe_finalize": (rng.choice(("token", "permuted")), rng.random() < 0.5)}
    kinds = list(KINDS)
    rng.shuffle(kinds)
    calls = []
    for kind in kinds:
        choices = ("auto", "fallback") if kind in ONE_KERNEL else algorithms
        calls.append(Call(kind, shapes[kind], rng.choice(cfg.dtypes), rng.choice(choices), rng.random() < 0.25,
                          variants.get(kind, ())))
    return calls


def _generator(device, *key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + int(k) + 1) % (1 << 62)
    return torch.Generator(device=device).manual_seed(seed)


def _ints(shape, dtype, device, *key: int) -> torch.Tensor:
    g = _generator(device, *key)
    return torch.randint(-SMALL_INT, SMALL_INT + 1, shape, generator=g, device=device).to(dtype)


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """int64 keys that grow with the value, one step per representable float (+0 and -0 both 0)."""
    i = t.contiguous().view(_INT_VIEW[t.dtype]).to(torch.int64)
    mag = i & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(i < 0, -mag, mag)


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Device bool: shapes or any bit differ (no synchronisation when the shapes agree)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return torch.ones((), dtype=torch.bool, device=b.device)
    return (a.contiguous().view(_INT_VIEW[a.dtype]) != b.contiguous().view(_INT_VIEW[b.dtype])).any()


def _far(a: torch.Tensor, b: torch.Tensor, ulps: int) -> torch.Tensor:
    """Device bool: any element more than ``ulps`` representable values from the reference (NaN: far)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return torch.ones((), dtype=torch.bool, device=b.device)
    return ((_ordered(a) - _ordered(b)).abs() > ulps).any() | a.isnan().any()


def out_ulps(dtype: torch.dtype, hidden: int) -> int:
    """How far ``out`` may be from the reference: 1 ulp for 16-bit outputs, ``ceil(log2(hidden))`` for
    float32 (the mean's sum of ``hidden`` squares in another order; see ``tpcomm.demo_checks.out_ulp_tolerance``)."""
    return max(1, math.ceil(math.log2(max(hidden, 2)))) if dtype == torch.float32 else 1


def _differ_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Device bool: shapes, dtypes or any byte differ (quantised bytes and scales of any dtype)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return torch.ones((), dtype=torch.bool, device=b.device)
    return (a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).any()


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """An order-sensitive int64 checksum of ``t``'s bits (device scalar; wraps around)."""
    b = t.contiguous().view(_INT_VIEW.get(t.dtype, torch.uint8)).reshape(-1).to(torch.int64)
    w = torch.arange(1, b.numel() + 1, device=b.device, dtype=torch.int64) * 2654435761
    return (b * w).sum()


def run_call(comm, call: Call, rank: int, world_size: int, step: int, index: int, seed: int):
    """Make ``call`` on ``comm`` and check it. Returns ``(bad, checksum, algorithm)``: a device bool
    (the result differs from the exact expected one), a device int64 checksum of the output bits (0 for
    a reduce-scatter, whose output differs between ranks by design), and the algorithm the
    communicator's plan names for it."""
    from .reference import add_rmsnorm_reference, reduce_in_rank_order

    dtype, dev = _DTYPES[call.dtype], comm.device
    key = (seed, step, index)
    if call.kind in _OTHER_CALLS:
        with comm.use_algorithm(call.algorithm):
            return _OTHER_CALLS[call.kind](comm, call, rank, world_size, key, dtype)
    xs = [_ints(call.shape, dtype, dev, *key, q) for q in range(world_size)]
    x = xs[rank]
    nbytes, H = x.numel() * x.element_size(), call.shape[-1]
    with comm.use_algorithm(call.algorithm):
        if call.kind.startswith("fused"):
            res = None if call.kind == "fused_no_residual" else _ints(call.shape, dtype, dev, *key, 1000)
            gemma = call.kind == "fused_gemma"
            g = _generator(dev, *key, 1001)
            w = (0.5 * torch.randn(H, generator=g, device=dev) + (0.0 if gemma else 1.0)).to(dtype)
            algorithm = comm.plan("fused_add_rmsnorm", nbytes, H, dtype).algorithm
            out, ro = comm.fused_add_rmsnorm(x, res, w, eps=1e-6, gemma=gemma)
            out_ref, ro_ref = add_rmsnorm_reference(reduce_in_rank_order(xs), res, w, 1e-6, gemma)
            bad = _far(out, out_ref, out_ulps(dtype, H))
            if res is not None:
                bad = bad | _differ(ro, ro_ref)
            return bad, _checksum(out), algorithm
        if call.kind.startswith("all_reduce"):
            algorithm = comm.plan("all_reduce", nbytes, H, dtype).algorithm
            y = comm.all_reduce(x)
            return _differ(y, reduce_in_rank_order(xs)), _checksum(y), algorithm
        if call.kind == "all_gather":
            algorithm = comm.plan("all_gather", nbytes, H, dtype).algorithm
            y = comm.all_gather(x, dim=0)
            return _differ(y, torch.cat(xs, 0)), _checksum(y), algorithm
        algorithm = comm.plan("reduce_scatter", nbytes, H, dtype).algorithm
        y = comm.reduce_scatter(x, dim=0)
        share = torch.tensor_split(reduce_in_rank_order(xs), world_size, 0)[rank]
        # every rank holds another share: nothing to compare across ranks
        return _differ(y, share), torch.zeros((), dtype=torch.int64, device=dev), algorithm


def _weight(H: int, dtype, dev, *key: int, gemma: bool = False) -> torch.Tensor:
    g = _generator(dev, *key)
    return (0.5 * torch.randn(H, generator=g, device=dev) + (0.0 if gemma else 1.0)).to(dtype)


def _quant_call(comm, call: Call, rank: int, world_size: int, key: tuple, dtype):
    """``fused_add_rmsnorm`` with ``call.variant``'s quantised form: ``out`` within the contract's ulps,
    ``residual_out`` exact, the bytes and scales exactly the form's reference applied to the call's own
    ``out`` (docs/numerics.md item 4 and the forms' definitions)."""
    from .reference import add_rmsnorm_reference, quant_form_reference, reduce_in_rank_order

    form, group_size = call.variant
    dev, (T, H) = comm.device, call.shape
    xs = [_ints((T, H), dtype, dev, *key, q) for q in range(world_size)]
    res, w = _ints((T, H), dtype, dev, *key, 1000), _weight(H, dtype, dev, *key, 1001)
    scale = torch.full((1,), 0.05, dtype=torch.float32, device=dev) if form in ("fp8_static", "nvfp4") else None
    options = {"group_size": group_size} if "per_group" in form else {}
    algorithm = comm.plan("fused_add_rmsnorm", T * H * xs[0].element_size(), H, dtype).algorithm
    q, scales, ro, out = comm.fused_add_rmsnorm(xs[rank], res, w, eps=1e-6, quant=form, scale=scale,
                                                emit_unquantized=True, **options)
    out_ref, ro_ref = add_rmsnorm_reference(reduce_in_rank_order(xs), res, w, 1e-6)
    q_ref, scales_ref = quant_form_reference(out, form, scale=scale, **options)
    bad = _far(out, out_ref, out_ulps(dtype, H)) | _differ(ro, ro_ref)
    bad = bad | _differ_bytes(q, q_ref) | _differ_bytes(scales, scales_ref)
    return bad, _checksum(q) * 1_000_003 + _checksum(scales), algorithm


def _qk_call(comm, call: Call, rank: int, world_size: int, key: tuple, dtype):
    """``fused_qk_rmsnorm`` of every rank's columns: within the contract's ulps of
    :func:`tpcomm.fused_qk_rmsnorm_reference` (each rank's outputs are its own columns: no checksum)."""
    from .reference import fused_qk_rmsnorm_reference

    dev, (T, Hq, Hk) = comm.device, call.shape
    qs = [_ints((T, Hq), dtype, dev, *key, r) for r in range(world_size)]
    ks = [_ints((T, Hk), dtype, dev, *key, 2000 + r) for r in range(world_size)]
    wqs = list(_weight(world_size * Hq, dtype, dev, *key, 1001).split(Hq))  # slices of the full-width weights
    wks = list(_weight(world_size * Hk, dtype, dev, *key, 1002).split(Hk))
    algorithm = comm.plan("fused_qk_rmsnorm", T * (Hq + Hk) * qs[0].element_size(), Hq + Hk, dtype).algorithm
    q_out, k_out = comm.fused_qk_rmsnorm(qs[rank], ks[rank], wqs[rank], wks[rank], eps=1e-6)
    q_ref, k_ref = fused_qk_rmsnorm_reference(qs, ks, wqs, wks, 1e-6)[rank]
    bad = _far(q_out, q_ref, out_ulps(dtype, world_size * Hq)) | _far(k_out, k_ref, out_ulps(dtype, world_size * Hk))
    return bad, torch.zeros((), dtype=torch.int64, device=dev), algorithm


def _moe_call(comm, call: Call, rank: int, world_size: int, key: tuple, dtype):
    """``fused_moe_finalize_add_rmsnorm`` in ``call.variant``'s layout (token order, or permuted with an
    index) with or without a shared expert's output: against :func:`tpcomm.moe_finalize_reference` of
    every rank's partial expert outputs, summed in rank order and normalised (docs/numerics.md items 6
    and 7); ``out`` within the contract's ulps, ``residual_out`` exact."""
    from .collectives.moe_finalize import moe_finalize_reference
    from .reference import add_rmsnorm_reference, reduce_in_rank_order

    layout, shared = call.variant
    dev, (T, K, H) = comm.device, call.shape
    experts = [_ints((T, K, H), dtype, dev, *key, r) for r in range(world_size)]
    routing = torch.rand((T, K), generator=_generator(dev, *key, 1003), device=dev)  # the same on every rank
    index = None
    if layout == "permuted":  # each slot's row in the experts' order, the same on every rank
        index = torch.randperm(T * K, generator=_generator(dev, *key, 1004), device=dev).view(T, K).to(torch.int32)
        experts = [e.new_empty((T * K, H)).index_copy_(0, index.reshape(-1).long(), e.reshape(T * K, H))
                   for e in experts]
    shares = [_ints((T, H), dtype, dev, *key, 3000 + r) if shared else None for r in range(world_size)]
    res, w = _ints((T, H), dtype, dev, *key, 1000), _weight(H, dtype, dev, *key, 1001)
    algorithm = comm.plan("fused_moe_finalize_add_rmsnorm", T * H * experts[0].element_size(), H, dtype).algorithm
    out, ro = comm.fused_moe_finalize_add_rmsnorm(experts[rank], routing, res, w, 1e-6, index=index,
                                                  shared_out=shares[rank])
    x = reduce_in_rank_order([moe_finalize_reference(e, routing, index=index, shared_out=sh)
                              for e, sh in zip(experts, shares)])
    out_ref, ro_ref = add_rmsnorm_reference(x, res, w, 1e-6)
    return _far(out, out_ref, out_ulps(dtype, H)) | _differ(ro, ro_ref), _checksum(out), algorithm


#: The kinds :func:`run_call` hands to a function of their own.
_OTHER_CALLS = {"fused_quant": _quant_call, "qk_norm": _qk_call, "moe_finalize": _moe_call}


# -- the rank loop ------------------------------------------------------------------------------------------

def _delay(cfg: SoakConfig, rng: random.Random) -> None:
    """This rank's random wait before a call: a spin kernel on the GPU, a sleep on the CPU."""
    if cfg.device == "cuda":
        cycles = int(rng.uniform(0, cfg.max_delay) * _cycles_per_us())
        if cycles:
            torch.cuda._sleep(cycles)
    else:
        time.sleep(rng.uniform(0, cfg.max_delay))


_CYCLES_PER_US: list = []


def _cycles_per_us() -> float:
    """GPU clock cycles per microsecond (``torch.cuda._sleep`` counts cycles); 1.98 GHz (H200's boost
    clock) when the device properties do not say."""
    if not _CYCLES_PER_US:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        khz = getattr(props, "clock_rate", 0) or 1_980_000
        _CYCLES_PER_US.append(khz / 1000.0)
    return _CYCLES_PER_US[0]


def default_make_comms(cfg: SoakConfig) -> list:
    """The two communicators of a soak: the default workspace, and a small one (collective)."""
    from .communicator import Communicator

    return [Communicator(timeout_s=cfg.timeout_s), Communicator(max_bytes=cfg.small_max_bytes,
                                                                  timeout_s=cfg.timeout_s)]


def soak_rank(rank: int, world_size: int, cfg: SoakConfig, make_comms=None) -> dict:
    """Run the soak on this rank (collective: every rank of the default group runs it).

    ``make_comms(cfg)`` returns ``[default, small]`` communicators (default: :func:`default_make_comms`;
    the tests pass wrappers that inject faults). Returns this rank's counts: ``steps``, ``calls``,
    ``mismatches`` (with the first few described in ``first_mismatches``), ``hangs`` (steps in which a
    rank raised PeerTimeoutError; every rank counts them alike), ``tally`` (``{(kind, algorithm): calls}``),
    ``checksum``, ``elapsed_s`` and ``step_s`` (seconds of every step).
    """
    from . import dispatch
    from .errors import PeerTimeoutError
    from .progress import Progress

    make_comms = make_comms or default_make_comms
    algorithms = ("auto",) + tuple(dispatch.ALGORITHMS) + ("fallback",)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    delays = random.Random(cfg.seed * 7919 + 104729 * (rank + 1))  # a different sequence on every rank
    comms = make_comms(cfg)
    checksum = torch.zeros((), dtype=torch.int64, device=device)
    counts = {"steps": 0, "calls": 0, "mismatches": 0, "hangs": 0, "first_mismatches": [], "hang_notes": []}
    tally: Counter = Counter()
    step_s = []
    progress = Progress(rank == 0 and cfg.progress, cfg.steps, "tpcomm soak", every_s=5.0)
    t_start = time.perf_counter()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        calls = step_calls(cfg, step, algorithms)
        bad = torch.zeros(len(calls), dtype=torch.bool, device=device)
        made, hung = [], None
        for i, call in enumerate(calls):
            # After a timeout every rank still makes every call of the step: on a broken communicator every
            # call raises at once (the fallback ones too, before their collective), and those whose peer
            # is broken give up after the timeout.
            _delay(cfg, delays)
            try:
                flag, chk, algorithm = run_call(comms[1 if call.small else 0], call, rank, world_size, step, i,
                                                cfg.seed)
            except PeerTimeoutError as e:
                hung = hung or f"step {step} call {i} ({call.kind}, {call.algorithm}): {e}"
                continue
            bad[i] = flag
            checksum = checksum * 1_000_003 + chk
            tally[(call.kind, algorithm)] += 1
            made.append(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for c in comms:
            try:
                c.check()
            except PeerTimeoutError as e:
                hung = hung or f"step {step}: {e}"
        flags = bad.tolist()
        for i in made:
            if flags[i]:
                counts["mismatches"] += 1
                if len(counts["first_mismatches"]) < 10:
                    counts["first_mismatches"].append(f"step {step} call {i}: {calls[i]}")
        counts["calls"] += len(made)
        # agree on hangs: a rank that saw none may still have its peers' broken calls ahead of it
        status = torch.tensor([1 if hung else 0], dtype=torch.int32, device=device)
        dist.all_reduce(status)
        if int(status.item()):
            counts["hangs"] += 1
            if hung and len(counts["hang_notes"]) < 10:
                counts["hang_notes"].append(hung)
            for c in comms:
                c.close()
            dist.barrier()
            comms = make_comms(cfg)
        counts["steps"] += 1
        step_s.append(time.perf_counter() - t0)
        progress.advance(f"step {step + 1}: calls {counts['calls']}, mismatches {counts['mismatches']} (rank 0), "
                         f"hangs {counts['hangs']}")
    progress.close()
    for c in comms:
        c.close()
    counts.update(tally={f"{k}|{a}": n for (k, a), n in sorted(tally.items())}, checksum=int(checksum.item()),
                  elapsed_s=time.perf_counter() - t_start, step_s=step_s)
    return counts


# -- the parent's side -------------------------------------------------------------------------------------

def summarize(cfg: SoakConfig, per_rank: list[dict], wall_s: float) -> tuple[str, bool]:
    """The report (text) and whether the soak passed (no mismatch, no hang, the same checksum everywhere)."""
    from tabulate import tabulate

    mismatches = sum(r["mismatches"] for r in per_rank)
    hangs = max(r["hangs"] for r in per_rank)
    checksums = {r["checksum"] for r in per_rank}
    steps = min(r["steps"] for r in per_rank)
    calls = per_rank[0]["calls"]
    tally: Counter = Counter(per_rank[0]["tally"])
    rows = [[*k.split("|"), n] for k, n in sorted(tally.items())]
    step_s = [max(s) for s in zip(*(r["step_s"] for r in per_rank))]
    steady = step_s[len(step_s) // 2:]  # the second half: after the kernels have compiled
    rate = len(steady) / sum(steady) if steady and sum(steady) > 0 else float("nan")
    lines = [tabulate(rows, headers=["call", "algorithm (plan)", "calls"], tablefmt="github"), ""]
    agree = "agree" if len(checksums) == 1 else "DIFFER"
    lines.append(f"steps {steps}, calls {calls} per rank ({cfg.world_size} ranks, {cfg.device}), "
                 f"mismatches {mismatches}, hangs {hangs}, checksums {agree}")
    if step_s:
        lines.append(f"elapsed {wall_s:.1f} s (ranks' loop {max(r['elapsed_s'] for r in per_rank):.1f} s; "
                     f"first step {step_s[0]:.2f} s; second half {rate:.1f} steps/s, "
                     f"{1e3 / rate if rate == rate and rate > 0 else float('nan'):.2f} ms/step)")
    for r, res in enumerate(per_rank):
        for m in res["first_mismatches"]:
            lines.append(f"MISMATCH rank {r}: {m}")
        for h in res["hang_notes"]:
            lines.append(f"HANG rank {r}: {h}")
    ok = mismatches == 0 and hangs == 0 and len(checksums) == 1
    return "\n".join(lines), ok


def launch_timeout_s(cfg: SoakConfig) -> float:
    """Seconds the whole soak may take before its ranks are killed: 2 s a step on the GPU (it takes a few
    ms), 20 s on the CPU (about 1-2 s), plus start-up and kernel compilation."""
    return 300.0 + cfg.steps * (2.0 if cfg.device == "cuda" else 20.0)


def main(steps: int = 200, world_size: int | None = None, device: str | None = None, seed: int = 0,
         timeout_s: float = 10.0, max_delay: float | None = None) -> int:
    """``tpcomm soak``: run, print the report; 0 when it passed, 1 on any mismatch or hang, 2 on bad
    arguments (``--device cuda`` without 2 GPUs, ``--world`` beyond them)."""
    from .launch import RankFailure, default_device, launch

    device = device or default_device()
    if device == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        world_size = world_size or n
        if n < 2:
            print(f"tpcomm soak: --device cuda needs at least 2 GPUs; this machine has {n}")
            return 2
        if world_size > n:
            print(f"tpcomm soak: --world {world_size} is more than the {n} GPUs of this machine")
            return 2
    world_size = world_size or 2
    if world_size < 2:
        print(f"tpcomm soak: --world must be >= 2, got {world_size}")
        return 2
    cfg = make_config(device, world_size, steps, seed, timeout_s, max_delay,
                      progress=True)
    unit = "µs" if device == "cuda" else "s"
    print(f"tpcomm soak: {steps} steps of {len(KINDS)} calls on {world_size} {device} ranks, seed {seed}, "
          f"timeout {timeout_s:g} s, delays up to {cfg.max_delay:g} {unit}", flush=True)
    t0 = time.perf_counter()
    try:
        per_rank = launch(soak_rank, world_size, device, args=(cfg,), timeout_s=launch_timeout_s(cfg))
    except RankFailure as e:
        print(f"tpcomm soak: HANG or crash: a rank failed after {time.perf_counter() - t0:.1f} s:\n{e}")
        return 1
    report, ok = summarize(cfg, per_rank, time.perf_counter() - t0)
    print(report)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
