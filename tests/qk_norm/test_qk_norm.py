"""``fused_qk_rmsnorm`` on CPU ranks: bits against the plain-torch reference of every rank's inputs (the same
scale on every rank), the kernel against the fallback, the contract's distance from a float32 RMSNorm of
the unsharded q and k, special values, packed QKV views and in-place outputs, the buffers left armed (every
Lamport word the sentinel again, and Lamport all-reduces on both parities right after the call), a call
cut into launches of a small Lamport slot, bad inputs, a peer with another width or call, and the
``torch.library`` op under ``torch.compile``. Rank bodies sit beside the tests that run them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import new_communicator
from tests.support.numerics import Checks, assert_same_bits, assert_same_values, assert_within_ulp, dtype_name, raised
from tpcomm.reference import fused_qk_rmsnorm_reference

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6

#: How far ``q_out`` may be from a float32 RMSNorm of the unsharded tensors (docs/numerics.md, "Full-width
#: QK norm"): one ulp for 16-bit outputs (the two float32 results differ by a few float32 ulps, which one
#: rounding to 16 bits turns into at most one); float32 outputs a few ulps (the mean's order, and the
#: float32 reference's own rsqrt and products).
ULP = {BF16: 1, FP16: 1, FP32: 4}


def _case_inputs(seed: int, world: int, T: int, Hq: int, Hk: int, dtype, special: bool):
    """Every rank's ``(q, k, q_weight, k_weight)``: normal values times ``2**j`` (``j`` in [-4, 4]); with
    ``special``, row 0 all zero on every rank, row 1 huge on rank 0 (squares overflow float32), row 2 a
    NaN on the last rank, row 3 tiny."""
    g = torch.Generator().manual_seed(seed)

    def draw(rows, cols):
        scale = torch.pow(2.0, torch.randint(-4, 5, (rows, cols), generator=g).double())
        return (torch.randn(rows, cols, generator=g, dtype=torch.float64) * scale).to(dtype)

    qs, ks = [draw(T, Hq) for _ in range(world)], [draw(T, Hk) for _ in range(world)]
    if special and T >= 4:
        for x in qs + ks:
            x[0] = 0
        qs[0][1, 0] = ks[0][1, 0] = 6e19 if dtype != FP16 else 6e4  # fp16: large, squares still finite
        qs[-1][2, -1] = ks[-1][2, 0] = float("nan")
        for x in qs + ks:
            x[3] = x[3] * 2.0 ** -20 if dtype != FP16 else x[3]
    wq = [(1 + 0.1 * torch.randn(Hq, generator=g)).to(dtype) for _ in range(world)]
    wk = [(1 + 0.1 * torch.randn(Hk, generator=g)).to(FP32) for _ in range(world)]  # float32 weights too
    return qs, ks, wq, wk


def _float32_rmsnorm(xs, ws, eps):
    """A plain float32 torch RMSNorm of the unsharded rows (``cat`` of every rank's columns), cut back into
    every rank's columns."""
    full = torch.cat(xs, dim=1).float()
    y = (full * torch.rsqrt(full.pow(2).mean(-1, keepdim=True) + eps)) * torch.cat(ws).float()
    return list(y.to(xs[0].dtype).split(xs[0].shape[1], dim=1))


# -- rank bodies -------------------------------------------------------------------------------------------
def _epoch(comm) -> int:
    """The epoch the communicator's next launch takes (one step per launch)."""
    return comm.workspace.epoch()


def _unarmed_lamport_words(comm) -> int:
    """16-bit words of this rank's Lamport buffers (both parities, every slot) that do not hold the
    sentinel 0x8000, once every rank has finished its calls (a barrier before, and one after, so that no
    peer pushes its next call's words while they are read)."""
    ws = comm.workspace
    dist.barrier()
    base = ws.flag_bytes + ws.data_bytes
    words = ws.buffer[base:base + ws.lamport_bytes].view(torch.int16)
    unarmed = int((words != -32768).sum())
    dist.barrier()
    return unarmed


def _lamport_after(comm, n: int) -> list[tuple[int, str, bool]]:
    """Two bf16 Lamport all-reduces of ``n`` elements (``2 * n`` bytes of each slot) right after a QK
    call: one on each parity, so one of them reads the words the QK kernel used and re-armed. Returns
    ``(epoch, plan, exact)`` of each (every rank adds ``rank + 1``: an exact sum in bf16)."""
    W, r = comm.world_size, comm.rank
    x = torch.full((n,), float(r + 1), dtype=BF16)
    got = []
    with comm.use_algorithm("lamport"):
        for _ in range(2):
            epoch, plan = _epoch(comm), comm.plan("all_reduce", 2 * n, n, BF16).algorithm
            got.append((epoch, plan, bool((comm.all_reduce(x) == W * (W + 1) / 2).all())))
    return got


def cases_body(ctx, cases):
    """Every case on this rank: the kernel's outputs, the epoch of its launch and the launches it took,
    the Lamport words left unarmed after it, two Lamport all-reduces over the words it used (both
    parities, :func:`_lamport_after`), then the fallback's outputs."""
    comm = ctx.comm()
    W, r = ctx.world_size, ctx.rank
    out = []
    for seed, T, Hq, Hk, dtype, special in cases:
        qs, ks, wq, wk = _case_inputs(seed, W, T, Hq, Hk, dtype, special)
        qk_epoch = _epoch(comm)
        kq, kk = comm.fused_qk_rmsnorm(qs[r], ks[r], wq[r], wk[r], EPS)
        launches = _epoch(comm) - qk_epoch
        unarmed = _unarmed_lamport_words(comm)
        after = _lamport_after(comm, 4 * T)  # 8 bytes a row: every word of the QK call's rows
        with comm.use_algorithm("fallback"):
            fq, fk = comm.fused_qk_rmsnorm(qs[r], ks[r], wq[r], wk[r], EPS)
        out.append((kq, kk, fq, fk, dict(epoch=qk_epoch, launches=launches, unarmed=unarmed, after=after)))
    return out


def chunked_body(ctx, T, Hq, Hk, dtype):
    """A call of ``T`` rows on a communicator whose Lamport slot holds 256 bytes (32 rows a launch): its
    outputs, epoch, launches and unarmed words, then two all-reduces filling a whole slot on both
    parities."""
    comm = ctx.comm(max_bytes=256)
    W, r = ctx.world_size, ctx.rank
    qs, ks, wq, wk = _case_inputs(31, W, T, Hq, Hk, dtype, True)
    qk_epoch = _epoch(comm)
    q_out, k_out = comm.fused_qk_rmsnorm(qs[r], ks[r], wq[r], wk[r], EPS)
    launches = _epoch(comm) - qk_epoch
    unarmed = _unarmed_lamport_words(comm)
    after = _lamport_after(comm, comm.workspace.lamport_slot_bytes // 2)
    return q_out, k_out, dict(epoch=qk_epoch, launches=launches, unarmed=unarmed, after=after,
                              slot=comm.workspace.lamport_slot_bytes)


def views_body(ctx, T, Hq, Hk, dtype):
    """q and k as column views of one packed QKV tensor: new outputs, given column-view outputs of another
    packed tensor, and in place (q_out=q, k_out=k); then the op through ``torch.compile``."""
    import tpcomm.ops as tops

    comm = ctx.comm()
    W, r = ctx.world_size, ctx.rank
    qs, ks, wq, wk = _case_inputs(7, W, T, Hq, Hk, dtype, False)
    qkv = torch.cat([qs[r], ks[r], torch.ones(T, Hk, dtype=dtype)], dim=1)
    q, k = qkv[:, :Hq], qkv[:, Hq:Hq + Hk]
    new = comm.fused_qk_rmsnorm(q, k, wq[r], wk[r], EPS)
    packed = torch.full((T, Hq + Hk + 5), 7.0, dtype=dtype)
    given = comm.fused_qk_rmsnorm(q, k, wq[r], wk[r], EPS, q_out=packed[:, :Hq], k_out=packed[:, Hq:Hq + Hk])
    untouched = bool((packed[:, Hq + Hk:] == 7).all())
    comm.fused_qk_rmsnorm(q, k, wq[r], wk[r], EPS, q_out=q, k_out=k)
    in_place = (q.clone(), k.clone(), bool((qkv[:, Hq + Hk:] == 1).all()))
    compiled = torch.compile(lambda a, b: tops.fused_qk_rmsnorm(comm, a, b, wq[r], wk[r], EPS), fullgraph=True,
                             backend="aot_eager")
    return new, given, untouched, in_place, compiled(qs[r], ks[r])


def repeats_body(ctx, T, Hq, Hk, dtype):
    """Contiguous q and k called three times (the first records, the next two repeat it with new tensors of
    the same shapes), with new outputs, given ones and in place; a repeat whose given output overlaps an
    input; packed views (never recorded). Returns the outputs, the cache sizes, what the overlapping call
    raised and the entries the packed call added."""
    comm = ctx.comm()
    W, r = ctx.world_size, ctx.rank
    results, sizes, start = [], [], len(comm._calls)
    for seed in (11, 12, 13):
        qs, ks, wq, wk = _case_inputs(seed, W, T, Hq, Hk, dtype, False)
        q, k = qs[r].clone(), ks[r].clone()
        new = comm.fused_qk_rmsnorm(q, k, wq[r], wk[r], EPS)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        given = comm.fused_qk_rmsnorm(q, k, wq[r], wk[r], EPS, q_out=qo, k_out=ko)
        comm.fused_qk_rmsnorm(q, k, wq[r], wk[r], EPS, q_out=q, k_out=k)
        results.append((new, given, (q, k)))
        sizes.append(len(comm._calls) - start)
    q = torch.randn(T, Hq, dtype=dtype)
    buf = torch.randn(T * max(Hq, Hk), dtype=dtype)
    k, qo, ko = buf[: T * Hk].view(T, Hk), buf[: T * Hq].view(T, Hq), torch.empty(T, Hk, dtype=dtype)
    overlap = raised(lambda: comm.fused_qk_rmsnorm(q, k, wq[r], wk[r], EPS, q_out=qo, k_out=ko))  # q_out over k
    qkv = torch.cat([q, k], dim=1)
    before = len(comm._calls)
    comm.fused_qk_rmsnorm(qkv[:, :Hq], qkv[:, Hq:], wq[r], wk[r], EPS)
    return results, sizes, overlap, len(comm._calls) - before


def bad_inputs_body(ctx):
    """Local bad inputs: ``(type name, message)`` of each (every rank raises alike, nothing exchanged)."""
    comm = ctx.comm()
    q, k = torch.randn(4, 32, dtype=BF16), torch.randn(4, 16, dtype=BF16)
    wq, wk = torch.ones(32, dtype=BF16), torch.ones(16, dtype=BF16)
    calls = {
        "q width vs q_weight": lambda: comm.fused_qk_rmsnorm(q, k, torch.ones(31, dtype=BF16), wk),
        "k width vs k_weight": lambda: comm.fused_qk_rmsnorm(q, k, wq, torch.ones(32, dtype=BF16)),
        "T of k": lambda: comm.fused_qk_rmsnorm(q, k[:3], wq, wk),
        "weight dtype": lambda: comm.fused_qk_rmsnorm(q, k, wq.to(torch.float64), wk),
        "k_weight fp16": lambda: comm.fused_qk_rmsnorm(q, k, wq, wk.half()),
        "k dtype": lambda: comm.fused_qk_rmsnorm(q, k.float(), wq, wk),
        "q 3-D": lambda: comm.fused_qk_rmsnorm(q.view(4, 2, 16), k, wq, wk),
        "eps": lambda: comm.fused_qk_rmsnorm(q, k, wq, wk, -1.0),
        "q_out shape": lambda: comm.fused_qk_rmsnorm(q, k, wq, wk, q_out=torch.empty(4, 16, dtype=BF16)),
        "k_out in q": lambda: comm.fused_qk_rmsnorm(q, k, wq, wk, k_out=q[:, :16]),
        "q_out strided": lambda: comm.fused_qk_rmsnorm(q, k, wq, wk, q_out=torch.empty(32, 4, dtype=BF16).t()),
    }
    return {name: raised(fn) for name, fn in calls.items()}


def mismatch_body(ctx, how):
    """A fresh communicator (the call breaks it): rank 0 normalises 32 q columns, rank 1 another width
    (``width``), another call (``call``: a bf16 Lamport all-reduce), or the same width through the fallback
    with another width (``fallback``). Returns the error's type name and message."""
    comm = new_communicator(timeout_s=20)
    try:
        Hq = 32 if ctx.rank == 0 or how == "call" else 48
        q, k = torch.randn(4, Hq, dtype=BF16), torch.randn(4, 16, dtype=BF16)
        wq, wk = torch.ones(Hq, dtype=BF16), torch.ones(16, dtype=BF16)
        if how == "call" and ctx.rank == 1:
            return raised(lambda: comm.all_reduce(torch.ones(4, 64, dtype=BF16)))
        if how == "fallback":
            with comm.use_algorithm("fallback"):
                return raised(lambda: comm.fused_qk_rmsnorm(q, k, wq, wk))
        return raised(lambda: comm.fused_qk_rmsnorm(q, k, wq, wk))
    finally:
        comm.close()


# -- tests -------------------------------------------------------------------------------------------------
def _minimax(W):
    """MiniMax-M2's widths on one rank: 48 query heads and 8 key-value heads of 128 (a world size that does
    not divide 8 key-value heads takes one of them)."""
    return 6144 // W, (1024 // W if 8 % W == 0 else 128)


def _cases(W):
    """(seed, T, Hq, Hk, dtype, special values): MiniMax-M2's widths and odd ones (1, 130, 2880, and two
    tiles of 8192), T from 1 to 513, every dtype; a spread of them on each world size (the suite's CPU
    time)."""
    Hq, Hk = _minimax(W)
    cases = [(1, 1, Hq, Hk, BF16, False), (2, 7, Hq, Hk, BF16, True), (3, 64, Hq, Hk, FP16, False),
             (4, 513, Hq, Hk, BF16, False), (5, 2, Hq, Hk, FP32, False), (6, 7, 130, 1, FP32, True),
             (7, 64, 1, 130, BF16, False), (8, 7, 2880, 130, FP16, True), (9, 2, 8200, 2880, BF16, False)]
    keep = {2: (0, 1, 3, 5, 6, 7, 8), 3: (1, 2, 5, 7), 4: (0, 1, 4, 6)}[W]
    return [cases[i] for i in keep]


def _check_left_armed(check, what: str, info: dict, launches: int) -> None:
    """The QK call took ``launches`` launches from epoch ``info["epoch"]`` and left every Lamport word of
    every rank armed; the two Lamport all-reduces right after it (the next two epochs: one on the parity
    of the QK call's last launch, one on the other) are exact."""
    check.that(info["launches"] == launches, f"{what}: {info['launches']} launches, expected {launches}")
    check.that(info["unarmed"] == 0, f"{what}: {info['unarmed']} Lamport words not re-armed after the call")
    last = info["epoch"] + launches - 1
    epochs = [e for e, _, _ in info["after"]]
    check.that(epochs == [last + 1, last + 2], f"{what}: all-reduces at epochs {epochs}, expected the two after "
                                               f"the QK call's last launch ({last})")
    for e, plan, exact in info["after"]:
        parity = "the QK call's parity" if e % 2 == last % 2 else "the other parity"
        check.that(plan == "lamport" and exact, f"{what}: the {plan} all-reduce at epoch {e} ({parity}) is "
                                                f"{'exact' if exact else 'wrong'}, expected an exact Lamport one")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bits_on_every_rank(pools, world):
    """Each rank's q_out and k_out are the reference's bits (every rank's sums in rank order: the same
    scale everywhere; NaN payloads aside, as docs/numerics.md), the fallback's bits, and within the
    contract of a float32 RMSNorm of the unsharded tensors; after each kernel call every Lamport word is
    the sentinel again and bf16 Lamport all-reduces over the call's words on both parities are exact."""
    cases = _cases(world)
    results = pools.get(world).run(cases_body, cases, timeout_s=300)
    check = Checks()
    for i, (seed, T, Hq, Hk, dtype, special) in enumerate(cases):
        qs, ks, wq, wk = _case_inputs(seed, world, T, Hq, Hk, dtype, special)
        ref = fused_qk_rmsnorm_reference(qs, ks, wq, wk, EPS)
        f32q, f32k = _float32_rmsnorm(qs, wq, EPS), _float32_rmsnorm(ks, wk, EPS)
        what = f"w{world} T={T} Hq={Hq} Hk={Hk} {dtype_name(dtype)}{' special' if special else ''}"
        for r, per_case in enumerate(results):
            kq, kk, fq, fk, info = per_case[i]
            check(assert_same_values, kq, ref[r][0], f"{what} rank {r} q_out vs reference")
            check(assert_same_values, kk, ref[r][1], f"{what} rank {r} k_out vs reference")
            check(assert_same_values, fq, kq, f"{what} rank {r} q_out fallback vs kernel")
            check(assert_same_values, fk, kk, f"{what} rank {r} k_out fallback vs kernel")
            check(assert_within_ulp, kq, f32q[r], ULP[dtype], f"{what} rank {r} q_out vs float32 RMSNorm")
            check(assert_within_ulp, kk, f32k[r], ULP[dtype], f"{what} rank {r} k_out vs float32 RMSNorm")
            _check_left_armed(check, f"{what} rank {r}", info, 1)
            if special:
                check.that(bool((kq[0] == 0).all() and kq[2].isnan().all() and kk[2].isnan().all()),
                           f"{what} rank {r}: a zero row gives zeros and a NaN anywhere in a row NaN everywhere")
    check.done()


def test_a_call_of_several_launches(pool2):
    """T = 70 rows with a Lamport slot of 256 bytes (32 rows a launch): three launches, each rank's
    outputs the reference's bits (special rows included), every Lamport word armed afterwards, and
    Lamport all-reduces of a whole slot on both parities right after it exact."""
    T, Hq, Hk, dtype = 70, 48, 16, BF16
    results = pool2.run(chunked_body, T, Hq, Hk, dtype)
    qs, ks, wq, wk = _case_inputs(31, 2, T, Hq, Hk, dtype, True)
    ref = fused_qk_rmsnorm_reference(qs, ks, wq, wk, EPS)
    check = Checks()
    for r, (q_out, k_out, info) in enumerate(results):
        check.that(info["slot"] == 256, f"rank {r}: a Lamport slot of {info['slot']} bytes, expected 256")
        check(assert_same_values, q_out, ref[r][0], f"rank {r} q_out vs reference")
        check(assert_same_values, k_out, ref[r][1], f"rank {r} k_out vs reference")
        _check_left_armed(check, f"rank {r}", info, 3)
    check.done()


def test_packed_views_in_place_and_compiled(pool2):
    """Column views of a packed QKV tensor read in place; outputs into column views of another packed
    tensor (its other columns untouched) and in place; the op under torch.compile(fullgraph): the same
    bits as the reference."""
    T, Hq, Hk, dtype = 5, 96, 32, BF16
    results = pool2.run(views_body, T, Hq, Hk, dtype)
    qs, ks, wq, wk = _case_inputs(7, 2, T, Hq, Hk, dtype, False)
    ref = fused_qk_rmsnorm_reference(qs, ks, wq, wk, EPS)
    check = Checks()
    for r, (new, given, untouched, in_place, compiled) in enumerate(results):
        for name, got in (("new", new), ("given", given), ("in place", in_place[:2]), ("compiled", compiled)):
            check(assert_same_bits, got[0], ref[r][0], f"rank {r} {name} q_out")
            check(assert_same_bits, got[1], ref[r][1], f"rank {r} {name} k_out")
        check.that(untouched and in_place[2], f"rank {r}: columns beside the outputs were written")
    check.done()


def test_repeats_give_the_first_calls_bits(pool2):
    """A repeated call of the same shapes (the call cache's recorded launches) with new tensors gives the
    reference's bits with new outputs, given ones and in place; one entry per form; a given output that
    overlaps another input on a repeat is refused as on a first call; packed views are not recorded."""
    T, Hq, Hk, dtype = 3, 64, 32, BF16
    results = pool2.run(repeats_body, T, Hq, Hk, dtype)
    check = Checks()
    for r, (calls, sizes, overlap, packed_entries) in enumerate(results):
        for seed, (new, given, in_place) in zip((11, 12, 13), calls):
            qs, ks, wq, wk = _case_inputs(seed, 2, T, Hq, Hk, dtype, False)
            ref = fused_qk_rmsnorm_reference(qs, ks, wq, wk, EPS)[r]
            for name, got in (("new", new), ("given", given), ("in place", in_place)):
                check(assert_same_bits, got[0], ref[0], f"rank {r} seed {seed} {name} q_out")
                check(assert_same_bits, got[1], ref[1], f"rank {r} seed {seed} {name} k_out")
        check.that(sizes == [3, 3, 3], f"rank {r}: entries added {sizes}, expected three once recorded")
        check.that(overlap is not None and "shares memory" in overlap[1],
                   f"rank {r}: an output over k on a repeat gave {overlap}")
        check.that(packed_entries == 0, f"rank {r}: packed views were recorded ({packed_entries} entries)")
    check.done()


def test_bad_inputs_are_named(pool2):
    results = pool2.run(bad_inputs_body)
    expected = {"q width vs q_weight": ("ValueError", "q_weight"), "k width vs k_weight": ("ValueError", "k_weight"),
                "T of k": ("ValueError", "k has 3 rows"), "weight dtype": ("TypeError", "q_weight has dtype"),
                "k_weight fp16": ("TypeError", "k_weight has dtype"), "k dtype": ("TypeError", "k has dtype"),
                "q 3-D": ("ValueError", "q has shape"), "eps": ("ValueError", "eps"),
                "q_out shape": ("ValueError", "q_out has shape"), "k_out in q": ("ValueError", "k_out shares memory"),
                "q_out strided": ("ValueError", "column stride")}
    check = Checks()
    for r, got in enumerate(results):
        for name, (kind, words) in expected.items():
            check.that(got[name] is not None and got[name][0] == kind and words in got[name][1]
                       and got[name][1].startswith("fused_qk_rmsnorm: "),
                       f"rank {r} {name}: expected {kind} naming {words!r}, got {got[name]}")
    check.done()


@pytest.mark.parametrize("how", ["width", "call", "fallback"])
def test_a_peer_with_another_width_or_call_is_named(pool2, how):
    """Another width on one rank (kernel or fallback) or another call: PeerMismatchError on every rank,
    never a hang or wrong values."""
    results = pool2.run(mismatch_body, how, timeout_s=120)
    for r, got in enumerate(results):
        assert got is not None and got[0] == "PeerMismatchError", f"rank {r}: {got}"

