"""``fused_qk_rmsnorm(..., kv_replicas=R)`` on CPU ranks: ``k`` replicated on groups of ``R`` consecutive ranks
(more ranks than key-value heads). Each rank's ``k_out`` is the bits of the group without replication (the
reference over the ``W / R`` distinct shards alone), through the kernel, a repeat from the call cache, the
fallback and the ``torch.library`` op; a peer with another ``kv_replicas`` is a ``PeerMismatchError``; and
the identity the contract rests on, ``a + (+0.0) == a`` for every non-negative float32. Rank bodies sit
beside the tests that run them."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import new_communicator
from tests.support.numerics import (
    Checks,
    assert_same_bits,
    assert_same_values,
    assert_within_ulp,
    bits,
    dtype_name,
    raised,
)
from tpcomm.reference import fused_qk_rmsnorm_reference

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6
#: The special row whose k sum of squares is finite once but overflows float32 when counted twice.
BIG_ROW = 4
#: As test_qk_norm.ULP: a float32 RMSNorm of the unsharded (distinct) columns is one 16-bit ulp away at most.
ULP = {BF16: 1, FP16: 1, FP32: 4}


def _inputs(seed: int, world: int, R: int, T: int, Hq: int, Hk: int, dtype, special: bool):
    """Every rank's ``(q, k, q_weight, k_weight)``, ``k`` and ``k_weight`` the same on the ``R`` ranks of a
    group (separate tensors). With ``special``: row 0 zero everywhere, row 1 of group 0's ``k`` overflowing
    float32 squares, row 2 of the last group's ``k`` a NaN, row 3 tiny, and (not fp16) row 4 of group 0's
    ``k`` a square of 1.125 * 2**127: finite, but twice it is not (:data:`BIG_ROW`)."""
    g = torch.Generator().manual_seed(seed)

    def draw(rows, cols):
        scale = torch.pow(2.0, torch.randint(-4, 5, (rows, cols), generator=g).double())
        return (torch.randn(rows, cols, generator=g, dtype=torch.float64) * scale).to(dtype)

    qs = [draw(T, Hq) for _ in range(world)]
    distinct = [draw(T, Hk) for _ in range(world // R)]
    if special and T >= 4:
        for x in qs + distinct:
            x[0] = 0
            x[3] = x[3] * 2.0 ** -20 if dtype != FP16 else x[3]
        distinct[0][1, 0] = 6e19 if dtype != FP16 else 6e4
        distinct[-1][2, -1] = float("nan")
        if dtype != FP16 and T > BIG_ROW:
            distinct[0][BIG_ROW, 0] = 1.5 * 2.0 ** 63
    wq = [(1 + 0.1 * torch.randn(Hq, generator=g)).to(dtype) for _ in range(world)]
    wk_distinct = [(1 + 0.1 * torch.randn(Hk, generator=g)).to(FP32) for _ in range(world // R)]
    ks = [distinct[r // R].clone() for r in range(world)]
    wk = [wk_distinct[r // R].clone() for r in range(world)]
    return qs, ks, wq, wk


# -- rank bodies -------------------------------------------------------------------------------------------
def replicas_body(ctx, cases):
    """Each case on this rank: the kernel's outputs, a repeat with new tensors (the call cache), the
    fallback's, the op's under ``torch.compile``, then the same call with ``kv_replicas=1`` (another cache
    entry: every column counted ``R`` times), and the cache entries each call added."""
    import tpcomm.ops as tops

    comm = ctx.comm()
    W, r = ctx.world_size, ctx.rank
    out = []
    for seed, T, Hq, Hk, dtype, R, special in cases:
        qs, ks, wq, wk = _inputs(seed, W, R, T, Hq, Hk, dtype, special)
        args = (wq[r], wk[r], EPS)
        added = []
        before = len(comm._calls)
        kernel = comm.fused_qk_rmsnorm(qs[r], ks[r], *args, kv_replicas=R)
        added.append(len(comm._calls) - before)
        before = len(comm._calls)
        repeat = comm.fused_qk_rmsnorm(qs[r].clone(), ks[r].clone(), *args, kv_replicas=R)
        added.append(len(comm._calls) - before)
        with comm.use_algorithm("fallback"):
            fallback = comm.fused_qk_rmsnorm(qs[r], ks[r], *args, kv_replicas=R)
        compiled = torch.compile(lambda a, b: tops.fused_qk_rmsnorm(comm, a, b, *args, kv_replicas=R),
                                 fullgraph=True, backend="aot_eager")(qs[r], ks[r])
        before = len(comm._calls)
        counted_r_times = comm.fused_qk_rmsnorm(qs[r], ks[r], *args)
        added.append(len(comm._calls) - before)
        out.append(dict(kernel=kernel, repeat=repeat, fallback=fallback, compiled=compiled,
                        counted_r_times=counted_r_times, added=added))
    return out


def mismatch_body(ctx, algo):
    """A fresh communicator (the call breaks it): the same shapes on both ranks, ``kv_replicas`` 1 on rank 0
    and 2 on rank 1, through the kernel or the fallback. Returns the error's type name and message."""
    comm = new_communicator(timeout_s=20)
    try:
        q, k = torch.randn(4, 32, dtype=BF16), torch.ones(4, 16, dtype=BF16)
        wq, wk = torch.ones(32, dtype=BF16), torch.ones(16, dtype=BF16)
        with comm.use_algorithm(algo):
            return raised(lambda: comm.fused_qk_rmsnorm(q, k, wq, wk, kv_replicas=1 + ctx.rank))
    finally:
        comm.close()


def bad_values_body(ctx):
    """``kv_replicas`` values that are not a divisor of the world size, through the method and the op:
    ``(type name, message)`` of each (every rank raises alike, nothing exchanged)."""
    import tpcomm.ops as tops

    comm = ctx.comm()
    q, k = torch.randn(4, 32, dtype=BF16), torch.randn(4, 16, dtype=BF16)
    wq, wk = torch.ones(32, dtype=BF16), torch.ones(16, dtype=BF16)
    values = {"3": 3, "0": 0, "-2": -2, "True": True, "2.0": 2.0}
    got = {name: raised(lambda v=v: comm.fused_qk_rmsnorm(q, k, wq, wk, kv_replicas=v)) for name, v in values.items()}
    got["op 4"] = raised(lambda: tops.fused_qk_rmsnorm(comm, q, k, wq, wk, kv_replicas=4))
    got["zero tokens 3"] = raised(lambda: comm.fused_qk_rmsnorm(q[:0], k[:0], wq, wk, kv_replicas=3))
    return got


# -- tests -------------------------------------------------------------------------------------------------
#: (seed, T, Hq, Hk, dtype, R, special values) per world size: MiniMax-M2's per-rank head widths (48 query
#: heads and 8 key-value heads of 128 at TP 16 and 32, scaled down) and odd ones, 16-bit and float32.
CASES = {2: [(1, 7, 384, 128, BF16, 2, True), (2, 3, 130, 33, FP32, 2, False)],
         4: [(3, 5, 192, 64, BF16, 2, True), (4, 2, 96, 40, FP16, 4, False), (5, 6, 32, 24, FP32, 4, True)]}


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_k_gives_the_unreplicated_groups_bits(pools, world):
    """Each rank's k_out is the bits of the reference of the group without replication (W / R ranks
    holding the distinct shards; NaN payloads aside), the same on the R ranks of a group; q_out as without
    replication; the kernel, the cache's repeat, the fallback and the compiled op agree bit for bit; the
    call with kv_replicas=1 is another cache entry and gives its own reference's bits (replicas counted R
    times over R times the width: the same mean up to rounding, but a row whose sum overflows when counted
    twice comes out zero there and right with kv_replicas)."""
    cases = CASES[world]
    results = pools.get(world).run(replicas_body, cases, timeout_s=300)
    check = Checks()
    for i, (seed, T, Hq, Hk, dtype, R, special) in enumerate(cases):
        qs, ks, wq, wk = _inputs(seed, world, R, T, Hq, Hk, dtype, special)
        want_q = fused_qk_rmsnorm_reference(qs, ks, wq, wk, EPS)  # q: every rank's own columns
        unreplicated = fused_qk_rmsnorm_reference(qs[::R], ks[::R], wq[::R], wk[::R], EPS)
        with_r = fused_qk_rmsnorm_reference(qs, ks, wq, wk, EPS, kv_replicas=R)
        full_k = torch.cat(ks[::R], dim=1).float()
        f32k = ((full_k * torch.rsqrt(full_k.pow(2).mean(-1, keepdim=True) + EPS)) * torch.cat(wk[::R]).float())
        f32k = f32k.to(dtype).split(Hk, dim=1)
        what = f"w{world} R={R} T={T} Hq={Hq} Hk={Hk} {dtype_name(dtype)}{' special' if special else ''}"
        for r, per_case in enumerate(results):
            got = per_case[i]
            check(assert_same_values, got["kernel"][1], unreplicated[r // R][1],
                  f"{what} rank {r} k_out vs the unreplicated group's rank {r // R}")
            check(assert_same_values, with_r[r][1], unreplicated[r // R][1], f"{what} rank {r} reference k_out")
            check(assert_same_values, got["kernel"][0], want_q[r][0], f"{what} rank {r} q_out")
            for form in ("repeat", "fallback", "compiled"):
                check(assert_same_values, got[form][0], got["kernel"][0], f"{what} rank {r} {form} q_out")
                check(assert_same_values, got[form][1], got["kernel"][1], f"{what} rank {r} {form} k_out")
            check(assert_within_ulp, got["kernel"][1], f32k[r // R], ULP[dtype],
                  f"{what} rank {r} k_out vs float32 RMSNorm of the distinct columns")
            check(assert_same_values, got["counted_r_times"][1], want_q[r][1], f"{what} rank {r} kv_replicas=1")
            check.that(got["added"] == [1, 0, 1], f"{what} rank {r}: cache entries added {got['added']}, expected "
                       "[1, 0, 1] (recorded, repeated, kv_replicas=1 another entry)")
            if special:
                check.that(bool(got["kernel"][1][2].isnan().all() and (got["kernel"][1][0] == 0).all()),
                           f"{what} rank {r}: NaN in the last group's k makes its row NaN on every rank")
        same = all(torch.equal(bits(results[g * R][i]["kernel"][1]), bits(results[g * R + j][i]["kernel"][1]))
                   for g in range(world // R) for j in range(R))
        check.that(same, f"{what}: the ranks of a replica group returned different k_out bits")
        if special and dtype != FP16:  # the row that only kv_replicas gets right
            right, wrong = results[0][i]["kernel"][1][BIG_ROW], results[0][i]["counted_r_times"][1][BIG_ROW]
            check.that(bool((right != 0).any() and right.isfinite().all() and (wrong == 0).all()),
                       f"{what}: row {BIG_ROW} (a sum that overflows when counted twice): {right} with "
                       f"kv_replicas, {wrong} without")
    check.done()


@pytest.mark.parametrize("algo", ["lamport", "fallback"])
def test_a_peer_with_another_kv_replicas_is_a_mismatch(pool2, algo):
    """kv_replicas 1 on rank 0 and 2 on rank 1 (the same shapes): PeerMismatchError on both ranks, through
    the kernel and the fallback, never a hang or a norm over the wrong width."""
    for r, got in enumerate(pool2.run(mismatch_body, algo, timeout_s=120)):
        assert got is not None and got[0] == "PeerMismatchError", f"rank {r}: {got}"


def test_bad_kv_replicas_are_named(pool2):
    """Not a divisor of the world size (3, 0, -2; the op too; before the zero-token shortcut): ValueError;
    not an int (True, 2.0): TypeError; each message starts with the op and names kv_replicas."""
    expected = {"3": "ValueError", "0": "ValueError", "-2": "ValueError", "True": "TypeError", "2.0": "TypeError",
                "op 4": "ValueError", "zero tokens 3": "ValueError"}
    check = Checks()
    for r, got in enumerate(pool2.run(bad_values_body)):
        for name, kind in expected.items():
            check.that(got[name] is not None and got[name][0] == kind and "kv_replicas" in got[name][1]
                       and got[name][1].startswith("fused_qk_rmsnorm: "),
                       f"rank {r} kv_replicas={name}: expected {kind} naming kv_replicas, got {got[name]}")
    check.done()


def test_adding_positive_zero_keeps_every_non_negative_float32():
    """The identity the contract's replicated-k item rests on: ``a + (+0.0)`` has ``a``'s bits for every
    float32 ``a`` from +0.0 to +Inf (every 977th bit pattern, a prime stride through each exponent, and both
    ends of each binade), and is NaN for NaN; -0.0, which a sum from +0.0 never is, gives +0.0."""
    stride = torch.arange(0, 0x7F800001, 977, dtype=torch.int64)
    ends = torch.arange(0, 256, dtype=torch.int64) << 23
    patterns = torch.cat([stride, ends, (ends - 1).clamp(min=0), torch.tensor([0x7F800000])]).to(torch.int32)
    a = patterns.view(torch.float32)
    for got in (a + 0.0, 0.0 + a, a + torch.zeros_like(a)):
        assert_same_bits(got, a, "a + (+0.0)")
    nan = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    assert (nan + 0.0).isnan().all()
    assert (torch.tensor([-0.0]) + 0.0).view(torch.int32).item() == 0
