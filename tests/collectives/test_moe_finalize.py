"""MoE finalize (``tpcomm.moe_finalize``) and ``Communicator.fused_moe_finalize_add_rmsnorm`` on CPU ranks
(docs/numerics.md, "MoE finalize").

For every case, on each rank: the fused call's outputs (``out``, ``residual_out``, and the quantised bytes
and scales) equal the documented unfused composition ``comm.fused_add_rmsnorm(tpcomm.moe_finalize(...),
...)`` bit for bit, every rank holds the same bits, and the composition's ``residual_out`` and ``out``
equal a plain-torch oracle (``moe_finalize_reference`` per rank, ``reduce_in_rank_order``,
``add_rmsnorm_reference``), which is exact to the bit. The standalone op equals its plain-torch oracle. An
index entry outside ``[0, M)`` (int32 and int64, past the host's check of CPU indices) adds nothing, in the
standalone kernel and in the fused prologue. The ``tpcomm.ops`` forms equal the methods, eagerly and under
``torch.compile(fullgraph=True)``.

The interpreter is slow, so the dimensions (world size 2 / 3 / 4, algorithm, dtype, K in {1, 2, 8}, both
layouts, ``shared_out``, every quant form, H in {3072, 7168, 2880, 130, 64, 8192}, T from 1 to 513,
chunked calls, a negative scaling, rows of one tile in whole vectors (Lamport's spin, with one row or
several a program) and not (its block-wide poll and the staged own row)) are covered by a sample in which
each value occurs, not by their product. Rank bodies sit here, beside the tests (they pickle by this
module's name).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import tpcomm
from tests.support import harness
from tests.support.numerics import Checks, assert_same_bits, dtype_name, raised, residual_input, weight_input
from tpcomm.reference import add_rmsnorm_reference, reduce_in_rank_order

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
#: Kernel timeout of the communicators made here for a grid cap: a peer's kernel under the interpreter on a
#: busy 2-core machine can start tens of seconds after this rank's (the default is 30 s).
SLOW_PEER_S = 100.0


@dataclass(frozen=True)
class MoeCase:
    """One call: ``T`` tokens of ``H``, ``K`` slots; ``perm``: the ``(M, H)`` permuted layout with an index
    (M = T * K + 3 rows, three of them unused); ``shared``: a shared-expert output; ``quant``: a quant form
    (its ``scale`` for static FP8 and NVFP4); ``max_bytes``: small to chunk the call; ``max_programs``: a
    grid cap (``TPCOMM_MAX_PROGRAMS``) under the rows of a launch, so that a program takes several rows."""

    seed: int
    world: int
    algo: str
    dtype: torch.dtype
    T: int
    K: int
    H: int
    perm: bool = False
    shared: bool = False
    quant: str | None = None
    residual: bool = True
    gemma: bool = False
    scaling: float = 1.0
    max_bytes: int | None = None
    w_dtype: torch.dtype = FP32
    max_programs: int | None = None


def _gen(case: MoeCase, rank: int, role: int) -> torch.Generator:
    return torch.Generator().manual_seed(7919 * case.seed + 31 * rank + role)


def moe_inputs(case: MoeCase, rank: int) -> dict:
    """Rank ``rank``'s arguments: its own expert and shared outputs; the routing (weights, index), the same
    on every rank."""
    T, K, H = case.T, case.K, case.H
    e = torch.randn((T, K, H), generator=_gen(case, rank, 1)).to(case.dtype)
    w = torch.rand((T, K), generator=_gen(case, 0, 2)).to(case.w_dtype)
    args = dict(expert_out=e, topk_weights=w, scaling=case.scaling)
    if case.perm:
        M = T * K + 3
        perm = torch.randperm(M, generator=_gen(case, 0, 3))[:T * K]
        ep = torch.randn((M, H), generator=_gen(case, rank, 4)).to(case.dtype)
        ep[perm] = e.reshape(T * K, H)
        args.update(expert_out=ep, index=perm.view(T, K).to(torch.int32 if case.seed % 2 else torch.int64))
    if case.shared:
        args["shared_out"] = torch.randn((T, H), generator=_gen(case, rank, 5)).to(case.dtype)
    return args


def quant_kwargs(case: MoeCase) -> dict:
    if case.quant is None:
        return {}
    kw = dict(quant=case.quant, emit_unquantized=True)
    if case.quant in ("fp8_per_group", "fp8_per_group_ue8m0"):
        kw["group_size"] = 64 if case.H % 128 else 128
    if case.quant == "fp8_static":
        kw["scale"] = torch.tensor([0.01])
    if case.quant == "nvfp4":
        kw["scale"] = torch.tensor([448.0 * 6 / 4.0])
    return kw


def _norm_args(case: MoeCase):
    residual = residual_input(case.seed, (case.T, case.H), case.dtype) if case.residual else None
    return residual, weight_input(case.seed, case.H, case.dtype, case.gemma)


def fused_case(ctx, case: MoeCase) -> dict:
    """The fused call and the unfused composition on the same communicator and algorithm (a new one, closed
    afterwards, for a grid cap)."""
    if case.max_programs is None:
        return _fused_and_composed(ctx.comm(max_bytes=case.max_bytes), ctx.rank, case)
    comm = harness.new_communicator(max_bytes=case.max_bytes, timeout_s=SLOW_PEER_S,
                                    env={"TPCOMM_MAX_PROGRAMS": str(case.max_programs)})
    try:
        return _fused_and_composed(comm, ctx.rank, case)
    finally:
        comm.close()


def _fused_and_composed(comm, rank: int, case: MoeCase) -> dict:
    args = moe_inputs(case, rank)
    residual, weight = _norm_args(case)
    qkw = quant_kwargs(case)
    with comm.use_algorithm(case.algo):
        plan = comm.plan("fused_add_rmsnorm", case.T * case.H * args["expert_out"].element_size(), case.H,
                         case.dtype).algorithm
        before = comm.workspace.epoch() if comm.workspace is not None else 0
        fused = comm.fused_moe_finalize_add_rmsnorm(residual=residual, weight=weight, eps=1e-6, gemma=case.gemma,
                                                    **args, **qkw)
        launches = (comm.workspace.epoch() if comm.workspace is not None else 0) - before
        x = tpcomm.moe_finalize(**args)
        composed = comm.fused_add_rmsnorm(x, residual, weight, eps=1e-6, gemma=case.gemma, **qkw)
    return dict(plan=plan, launches=launches, grid=comm.workspace.max_programs if comm.workspace else None,
                fused=_picklable(fused), composed=_picklable(composed), x=x)


def _picklable(outs) -> list:
    """FP8 tensors as their bytes (the harness pickles results, which FP8 storages are not)."""
    return [t.view(torch.uint8) if t is not None and t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
            else t for t in outs]


def _oracle(case: MoeCase):
    """``(residual_out, out)`` in plain torch: every rank's finalize, the rank-order sum, the norm."""
    xs = [tpcomm.moe_finalize_reference(**moe_inputs(case, r)) for r in range(case.world)]
    residual, weight = _norm_args(case)
    out, ro = add_rmsnorm_reference(reduce_in_rank_order(xs), residual, weight, 1e-6, case.gemma)
    return ro, out, xs


def _same(check, got, want, what):
    if got is None or want is None:
        check.that(got is None and want is None, f"{what}: one of the two is None")
        return
    check.that(got.shape == want.shape and got.dtype == want.dtype,
               f"{what}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}")
    if got.dtype in (BF16, FP16, FP32):
        check(assert_same_bits, got, want, what)
    else:
        check.that(torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)),
                   f"{what}: bytes differ")


def _check(case: MoeCase, results: list) -> None:
    check = Checks()
    ro_ref, out_ref, xs = _oracle(case)
    names = ["out", "residual_out"] if case.quant is None else ["q", "scales", "residual_out", "out"]
    for r, res in enumerate(results):
        p = f"rank {r}"
        check.that(res["plan"] == case.algo, f"{p}: plan {res['plan']!r}, expected {case.algo!r}")
        if case.max_programs is not None:  # Lamport rows of 16-bit elements, H a multiple of 16
            per_launch = case.max_bytes // (2 * case.H)
            want = (-(-case.T // per_launch), case.max_programs)
            check.that((res["launches"], res["grid"]) == want and per_launch > case.max_programs,
                       f"{p}: {res['launches']} launches on a grid cap of {res['grid']}, expected {want} and "
                       f"more rows a launch ({per_launch}) than programs")
        check(assert_same_bits, res["x"], xs[r], f"{p}: moe_finalize vs moe_finalize_reference")
        for name, got, want in zip(names, res["fused"], res["composed"]):
            _same(check, got, want, f"{p}: {name}, fused vs composition")
        for name, got, want in zip(names, res["fused"], results[0]["fused"]):
            _same(check, got, want, f"{p}: {name} vs rank 0")
        comp = dict(zip(names, res["composed"]))
        if case.residual:
            check(assert_same_bits, comp["residual_out"], ro_ref, f"{p}: residual_out vs the plain-torch oracle")
        check(assert_same_bits, comp["out"], out_ref, f"{p}: out vs the plain-torch oracle")
    check.done()


def _c(seed, world, algo, dtype, T, K, H, **kw):
    return MoeCase(seed, world, algo, dtype, T, K, H, **kw)


#: Each world size, algorithm, K, layout, quant form and H occurs; T from 1 to 513. H = 130 rows are not
#: whole 16-byte vectors (Lamport's block-wide poll, with this rank's own row staged in its slot); 8320
#: is two tiles. Small max_bytes (768, 8192) cut a call into launches of a few rows. The last three run
#: Lamport's spin (rows of one tile in whole vectors) with several rows a program (a grid cap under a
#: launch's rows: each program makes its next row's finalize before that row's wait), in launches of
#: 6 / 3 / 2 rows, with a negative scaling: H = 64 (re-armed after a barrier), 3072 (re-armed inside the
#: spin) and 8192 (two vectors a thread).
CASES = [
    _c(1, 2, "lamport", BF16, 3, 8, 3072, perm=True, shared=True, scaling=2.5),
    _c(2, 3, "one_shot", FP16, 5, 2, 130, quant="fp8_per_token", gemma=True),
    _c(3, 4, "lamport", BF16, 2, 1, 2880, shared=True, quant="fp8_per_group", w_dtype=BF16),
    _c(4, 2, "two_shot", BF16, 2, 8, 7168, perm=True, shared=True, quant="nvfp4"),
    _c(5, 3, "fallback", FP32, 4, 2, 130, perm=True, quant="fp8_static", residual=False),
    _c(6, 2, "one_shot", FP32, 1, 8, 7168, shared=True, quant="mxfp4", scaling=0.75),
    _c(7, 2, "one_shot", BF16, 513, 1, 130, perm=True),
    _c(8, 3, "one_shot", BF16, 5, 8, 3072, shared=True, quant="fp8_per_group_ue8m0", max_bytes=8192),
    _c(9, 4, "two_shot", FP16, 17, 1, 130, perm=True, shared=True),
    _c(10, 2, "lamport", FP16, 5, 2, 130, shared=True, quant="fp8_static", max_bytes=768),
    _c(11, 4, "one_shot", FP32, 3, 2, 2880, perm=True, residual=False, quant="mxfp4"),
    _c(12, 2, "lamport", BF16, 2, 2, 8320, perm=True, shared=True, w_dtype=FP16),
    _c(13, 3, "fallback", BF16, 2, 8, 3072, shared=True, quant="nvfp4", perm=True),
    _c(14, 2, "one_shot", BF16, 64, 8, 130, quant="fp8_per_token"),
    _c(15, 2, "lamport", BF16, 13, 2, 64, perm=True, shared=True, scaling=-1.5, max_bytes=768, max_programs=2),
    _c(16, 2, "lamport", FP16, 7, 8, 3072, scaling=-0.75, max_bytes=3 * 6144, max_programs=1, w_dtype=BF16),
    _c(17, 2, "lamport", BF16, 5, 1, 8192, perm=True, shared=True, scaling=-2.0, max_bytes=2 * 16384,
       max_programs=1, residual=False),
]


def _id(case: MoeCase) -> str:
    return (f"w{case.world}-{case.algo}-{dtype_name(case.dtype)}-T{case.T}-K{case.K}-H{case.H}"
            f"{'-perm' if case.perm else ''}{'-shared' if case.shared else ''}-{case.quant or 'plain'}"
            f"{'-chunked' if case.max_bytes else ''}{f'-grid{case.max_programs}' if case.max_programs else ''}")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_equals_composition(pools, case):
    timeout_s = 3 * SLOW_PEER_S if case.max_programs else harness.DEFAULT_TIMEOUT_S
    _check(case, pools.get(case.world).run(fused_case, case, timeout_s=timeout_s))


# -- bad input -----------------------------------------------------------------------------------------
def bad_input_case(ctx) -> dict:
    """Each bad argument raises, naming it, on this rank alone, and writes nothing into a given output."""
    comm = ctx.comm()
    case = MoeCase(1, ctx.world_size, "auto", BF16, 3, 2, 64, perm=True, shared=True)
    good = moe_inputs(case, ctx.rank)
    residual, weight = _norm_args(case)
    out = torch.full((3, 64), float("nan"), dtype=BF16)
    bad_index = good["index"].clone()
    bad_index[1, 1] = good["expert_out"].shape[0]
    variants = {
        "index out of range": dict(index=bad_index),
        "negative index": dict(index=-good["index"] - 1),
        "index shape": dict(index=good["index"][:, :1]),
        "index dtype": dict(index=good["index"].float()),
        "weights shape": dict(topk_weights=good["topk_weights"][:2]),
        "weights dtype": dict(topk_weights=good["topk_weights"].to(torch.int32)),
        "shared_out shape": dict(shared_out=good["shared_out"][:, :32]),
        "shared_out dtype": dict(shared_out=good["shared_out"].float()),
        "expert_out layout": dict(index=None),
        "scaling": dict(scaling=float("inf")),
    }
    got = {}
    for name, change in variants.items():
        args = {**good, **change}
        got[name] = (raised(lambda: comm.fused_moe_finalize_add_rmsnorm(residual=residual, weight=weight, out=out,
                                                                        **args)),
                     raised(lambda: tpcomm.moe_finalize(**args)))
    got["untouched"] = bool(out.isnan().all())
    # the communicator still works after the refusals
    comm.fused_moe_finalize_add_rmsnorm(residual=residual, weight=weight, **good)
    return got


#: Per variant: the exception type and a word the message must hold (the argument's name).
BAD = {"index out of range": ("ValueError", "index[1, 1]"), "negative index": ("ValueError", "index[0, 0]"),
       "index shape": ("ValueError", "index has shape"), "index dtype": ("TypeError", "index"),
       "weights shape": ("ValueError", "topk_weights"), "weights dtype": ("TypeError", "topk_weights"),
       "shared_out shape": ("ValueError", "shared_out"), "shared_out dtype": ("TypeError", "shared_out"),
       "expert_out layout": ("ValueError", "expert_out"), "scaling": ("ValueError", "scaling")}


def test_bad_inputs_are_named_and_write_nothing(pool2):
    check = Checks()
    for r, got in enumerate(pool2.run(bad_input_case)):
        check.that(got["untouched"], f"rank {r}: a refused call wrote into out")
        for name, (kind, word) in BAD.items():
            for where, e in zip(("fused", "moe_finalize"), got[name]):
                check.that(e is not None and e[0] == kind and word in e[1],
                           f"rank {r}: {name} ({where}): expected {kind} naming {word!r}, got {e}")
    check.done()


def mismatch_case(ctx, algo: str, what: str) -> tuple | None:
    """Rank 1 calls with another K (or H): every rank raises PeerMismatchError."""
    comm = harness.new_communicator(algo=algo)
    try:
        K = 4 if what == "K" and ctx.rank == 1 else 2
        H = 72 if what == "H" and ctx.rank == 1 else 64
        case = MoeCase(3, ctx.world_size, algo, BF16, 2, K, H)
        residual, weight = _norm_args(case)
        return raised(lambda: comm.fused_moe_finalize_add_rmsnorm(residual=residual, weight=weight,
                                                                  **moe_inputs(case, ctx.rank)))
    finally:
        comm.close()


@pytest.mark.parametrize("algo, what", [("lamport", "K"), ("one_shot", "H"), ("two_shot", "K"), ("fallback", "K")])
def test_peer_with_another_call_is_a_mismatch(pool2, algo, what):
    for r, e in enumerate(pool2.run(mismatch_case, algo, what)):
        assert e is not None and e[0] == "PeerMismatchError", f"rank {r}: expected PeerMismatchError, got {e}"


def test_standalone_matches_reference_and_masks_nothing_else():
    """The standalone op (this process, the interpreter): bits of the plain-torch oracle, for both layouts,
    every weight dtype, T = 0, a given out."""
    for dtype, w_dtype, perm, K in ((BF16, FP32, True, 8), (FP16, BF16, False, 1), (FP32, FP16, True, 2)):
        case = MoeCase(4, 1, "none", dtype, 5, K, 130, perm=perm, shared=True, scaling=1.5, w_dtype=w_dtype)
        args = moe_inputs(case, 0)
        want = tpcomm.moe_finalize_reference(**args)
        out = torch.full((5, 130), float("nan"), dtype=dtype)
        got = tpcomm.moe_finalize(**args, out=out)
        assert got is out
        assert_same_bits(got, want, f"{dtype_name(dtype)} K={K} perm={perm}")
    empty = tpcomm.moe_finalize(torch.empty((0, 2, 8)), torch.empty((0, 2)))
    assert empty.shape == (0, 8)


# -- an index outside [0, M) --------------------------------------------------------------------------
#: Index entries outside ``[0, M)`` per index dtype, and the flat slots (of ``T * K = 15``) that get them:
#: token 3 has all three slots outside with int64. 2**32 and 2**32 + 1 are rows 0 and 1 if truncated to
#: 32 bits.
MASKED = {torch.int32: ((-1, "M", 2**31 - 1, -2**31), (0, 4, 8, 9)),
          torch.int64: ((-1, "M", 2**31 - 1, 2**32, 2**40, 2**32 + 1, -2**40), (0, 4, 8, 9, 10, 11, 13))}


def masked_inputs(index_dtype, rank: int) -> dict:
    """Rank ``rank``'s finalize arguments (the permuted layout, T = 5, K = 3, H = 64, a shared output, a
    negative scaling) with the entries of ``MASKED[index_dtype]`` in the index; their weights are NaN, so
    a slot that adds anything makes its token's row NaN."""
    case = MoeCase(40, 2, "none", BF16, 5, 3, 64, perm=True, shared=True, scaling=-1.25)
    args = moe_inputs(case, rank)
    M = args["expert_out"].shape[0]
    index, weights = args["index"].to(index_dtype).clone(), args["topk_weights"].clone()
    for value, slot in zip(*MASKED[index_dtype]):
        index.view(-1)[slot] = M if value == "M" else value
        weights.view(-1)[slot] = float("nan")
    return {**args, "index": index, "topk_weights": weights}


def masked_reference(args: dict) -> torch.Tensor:
    """The finalize with every slot outside ``[0, M)`` adding nothing: ``moe_finalize_reference`` with
    those slots' weights 0 and rows clamped (``0 * e`` is a zero, and adding a zero to the sum, never
    -0.0, leaves its bits)."""
    index, M = args["index"], args["expert_out"].shape[0]
    outside = (index < 0) | (index >= M)
    return tpcomm.moe_finalize_reference(
        **{**args, "index": index.clamp(0, M - 1), "topk_weights": args["topk_weights"].masked_fill(outside, 0.0)})


def masked_index_case(ctx) -> dict:
    """The fused call on Lamport (spin, three rows a program: a grid cap of 2) and one-shot with the indices
    of :data:`MASKED`, past the host's range check, which reads CPU indices only (on CUDA the kernels'
    masks are all there is): ``{(index dtype, algo): (out, residual_out)}``."""
    from unittest import mock

    from tpcomm.collectives import moe_finalize as host

    comm = harness.new_communicator(timeout_s=SLOW_PEER_S, env={"TPCOMM_MAX_PROGRAMS": "2"})
    try:
        residual, weight = residual_input(40, (5, 64), BF16), weight_input(40, 64, BF16)
        got = {}
        with mock.patch.object(host, "_tracing", lambda t: True):  # the check's skip for traced indices
            for index_dtype in MASKED:
                args = masked_inputs(index_dtype, ctx.rank)
                for algo in ("lamport", "one_shot"):
                    with comm.use_algorithm(algo):
                        got[index_dtype, algo] = comm.fused_moe_finalize_add_rmsnorm(residual=residual, weight=weight,
                                                                                    **args)
        return got
    finally:
        comm.close()


def test_an_index_outside_the_rows_adds_nothing_in_the_kernel():
    """The standalone finalize kernel launched directly (the host refuses these indices on CPU tensors)
    with int32 and int64 indices of -1, M, 2**31 - 1, 2**32, 2**40 and others: those slots add nothing,
    whatever their (NaN) weights, and the other slots give the reference's bits."""
    from tpcomm.dispatch import row_config
    from tpcomm.kernels.moe import MoeIn, moe_finalize_call

    for index_dtype in MASKED:
        args = masked_inputs(index_dtype, 0)
        (M, H), (T, K) = args["expert_out"].shape, args["index"].shape
        moe = MoeIn(args["expert_out"], args["index"], args["topk_weights"], args["shared_out"], K, M, args["scaling"])
        out = torch.full((T, H), float("nan"), dtype=BF16)
        cfg = row_config(H, 1)
        moe_finalize_call(moe, out, T, H, cfg.block_h, cfg.num_warps).launch()
        assert_same_bits(out, masked_reference(args), f"index {index_dtype}")


def test_an_index_outside_the_rows_adds_nothing_in_the_fused_prologue(pool2):
    """The fused call's prologue (Lamport's spin with several rows a program, and one-shot) with the
    indices of :data:`MASKED`: every rank's ``residual_out`` and ``out`` are the plain-torch oracle's of
    the finalize in which those slots add nothing."""
    residual, weight = residual_input(40, (5, 64), BF16), weight_input(40, 64, BF16)
    check = Checks()
    results = pool2.run(masked_index_case, timeout_s=3 * SLOW_PEER_S)
    for index_dtype in MASKED:
        xs = [masked_reference(masked_inputs(index_dtype, r)) for r in range(2)]
        out_ref, ro_ref = add_rmsnorm_reference(reduce_in_rank_order(xs), residual, weight, 1e-6)
        for r, got in enumerate(results):
            for algo in ("lamport", "one_shot"):
                out, ro = got[index_dtype, algo]
                what = f"rank {r} {algo} index {index_dtype}"
                check(assert_same_bits, ro, ro_ref, f"{what}: residual_out")
                check(assert_same_bits, out, out_ref, f"{what}: out")
    check.done()


# -- torch.library ops ---------------------------------------------------------------------------------
def ops_case(ctx, case: MoeCase) -> dict:
    """The ops (``tpcomm.ops``) and the method, each twice, rank 1 arriving late at the first op call; the
    fake implementation's shapes and dtypes."""
    import time

    from torch._subclasses.fake_tensor import FakeTensorMode

    import tpcomm.ops as tops

    comm = ctx.comm()
    args = moe_inputs(case, ctx.rank)
    residual, weight = _norm_args(case)
    qkw = quant_kwargs(case)
    if ctx.rank == 1:
        time.sleep(0.3)
    by_op = [tops.fused_moe_finalize_add_rmsnorm(comm, residual=residual, weight=weight, **args, **qkw)
             for _ in range(2)]
    by_method = comm.fused_moe_finalize_add_rmsnorm(residual=residual, weight=weight, **args, **qkw)
    x_op = tops.moe_finalize(**args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        fake_qkw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in qkw.items()}
        fake = tops.fused_moe_finalize_add_rmsnorm(comm, residual=mode.from_tensor(residual),
                                                   weight=mode.from_tensor(weight), **fake_args, **fake_qkw)
    meta = [None if t is None else (tuple(t.shape), t.dtype, t.stride()) for t in fake]
    return dict(op=[_picklable(o) for o in by_op], method=_picklable(by_method), x_op=x_op,
                x=tpcomm.moe_finalize(**args), meta=meta,
                real=[None if t is None else (tuple(t.shape), t.dtype, t.stride()) for t in by_method])


@pytest.mark.parametrize("case", [_c(21, 2, "auto", BF16, 3, 2, 130, perm=True, shared=True),
                                  _c(22, 2, "auto", FP16, 2, 8, 3072, quant="fp8_static"),
                                  _c(23, 2, "auto", BF16, 2, 2, 2880, quant="fp8_per_group", scaling=1.25)], ids=_id)
def test_ops_equal_the_method(pool2, case):
    check = Checks()
    for r, res in enumerate(pool2.run(ops_case, case)):
        for k, outs in enumerate(res["op"]):
            for i, (got, want) in enumerate(zip(outs, res["method"])):
                _same(check, got, want, f"rank {r}: op call {k + 1}, output {i}")
        check(assert_same_bits, res["x_op"], res["x"], f"rank {r}: tpcomm::moe_finalize")
        check.that(res["meta"] == res["real"], f"rank {r}: fake outputs {res['meta']} != real {res['real']}")
    check.done()


def compiled_case(ctx, case: MoeCase) -> dict:
    """``tops.moe_finalize`` and ``tops.fused_moe_finalize_add_rmsnorm`` (unquantised, and with an FP8
    output) inside one ``torch.compile(fullgraph=True)`` function (``aot_eager``), and the eager methods on
    the same inputs."""
    import tpcomm.ops as tops

    comm = ctx.comm()
    args = moe_inputs(case, ctx.rank)
    residual, weight = _norm_args(case)
    qkw = dict(quant="fp8_per_token", emit_unquantized=True)

    def model(expert_out, topk_weights, index, shared_out, residual):
        moe = dict(index=index, shared_out=shared_out, scaling=case.scaling)
        x = tops.moe_finalize(expert_out, topk_weights, **moe)
        plain = tops.fused_moe_finalize_add_rmsnorm(comm, expert_out, topk_weights, residual, weight, **moe)
        quant = tops.fused_moe_finalize_add_rmsnorm(comm, expert_out, topk_weights, residual, weight, **moe, **qkw)
        return x, plain, quant

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, plain, quant = compiled(args["expert_out"], args["topk_weights"], args["index"], args["shared_out"], residual)
    eager = dict(x=tpcomm.moe_finalize(**args),
                 plain=comm.fused_moe_finalize_add_rmsnorm(residual=residual, weight=weight, **args),
                 quant=comm.fused_moe_finalize_add_rmsnorm(residual=residual, weight=weight, **args, **qkw))
    return dict(compiled=dict(x=x, plain=_picklable(plain), quant=_picklable(quant)),
                eager={k: v if k == "x" else _picklable(v) for k, v in eager.items()})


def test_ops_under_torch_compile(pool2):
    """The MoE ops under torch.compile(fullgraph=True): the eager methods' bits (the permuted layout with a
    shared output and a scaling; unquantised and FP8 per token with the unquantised output)."""
    case = _c(24, 2, "auto", BF16, 3, 2, 130, perm=True, shared=True, scaling=1.5)
    check = Checks()
    for r, res in enumerate(pool2.run(compiled_case, case)):
        got, want = res["compiled"], res["eager"]
        check(assert_same_bits, got["x"], want["x"], f"rank {r}: moe_finalize")
        for form in ("plain", "quant"):
            check.that(len(got[form]) == len(want[form]), f"rank {r}: {form}: {len(got[form])} outputs")
            for i, (g, w) in enumerate(zip(got[form], want[form])):
                _same(check, g, w, f"rank {r}: {form} output {i}")
    check.done()
