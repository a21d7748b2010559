"""``fused_qk_rmsnorm`` on ONE GPU, every rank a communicator of this process (``tpcomm.loopback``).

Marked ``gpu``; needs one CUDA GPU. MiniMax-M2's widths and odd ones at 2, 3 and 4 ranks, bit for bit
against the plain-torch reference on every rank (packed QKV views as inputs); a CUDA graph of repeated
calls, each on its own inputs, replayed on new inputs (every call checked); a peer with another width
raises ``PeerMismatchError`` and a missing peer ``PeerTimeoutError``, instead of hanging.

    python -m pytest -q -m gpu tests/qk_norm/test_gpu_qk_norm_loopback.py
"""

import pytest
import torch

from tests.support.numerics import bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: (W, T, q columns, k columns, dtype): MiniMax-M2's per rank, odd widths (1, 130, 2880, two tiles), T 1..513.
CASES = [(2, 1, 3072, 512, torch.bfloat16), (2, 64, 3072, 512, torch.float16), (2, 513, 3072, 512, torch.bfloat16),
         (2, 7, 130, 1, torch.float32), (2, 16, 8200, 2880, torch.bfloat16), (3, 7, 2048, 128, torch.bfloat16),
         (4, 1, 1536, 256, torch.bfloat16), (4, 256, 1536, 256, torch.float32)]


def _ids(c):
    W, T, Hq, Hk, d = c
    return f"w{W}-{T}x{Hq}+{Hk}-{str(d)[6:]}"


def _inputs(W, T, Hq, Hk, dtype, seed):
    """Every rank's q and k as column views of one packed QKV tensor, and the weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = [(torch.randn(T, Hq + 2 * Hk, device="cuda", generator=g) * 4).to(dtype) for _ in range(W)]
    wq = [(1 + 0.5 * torch.randn(Hq, device="cuda", generator=g)).to(dtype) for _ in range(W)]
    wk = [(1 + 0.5 * torch.randn(Hk, device="cuda", generator=g)).float() for _ in range(W)]
    return [x[:, :Hq] for x in qkv], [x[:, Hq:Hq + Hk] for x in qkv], wq, wk


def _same(a, b):
    return torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_every_rank_matches_the_reference(case):
    from tpcomm.loopback import close_group, loopback_group, run_ranks
    from tpcomm.reference import fused_qk_rmsnorm_reference

    W, T, Hq, Hk, dtype = case
    ranks = loopback_group(W, max_bytes=8 << 20, timeout_s=20.0)
    try:
        qs, ks, wq, wk = _inputs(W, T, Hq, Hk, dtype, seed=T + Hq)
        for _ in range(3):  # repeated calls: both parities of the buffers, re-armed
            got = run_ranks(ranks, lambda rk: rk.fused_qk_rmsnorm(qs[rk.rank], ks[rk.rank], wq[rk.rank],
                                                                  wk[rk.rank], 1e-6))
        torch.cuda.synchronize()
        want = fused_qk_rmsnorm_reference(qs, ks, wq, wk, 1e-6)
        for r in range(W):
            assert _same(got[r][0], want[r][0]), f"rank {r} q_out"
            assert _same(got[r][1], want[r][1]), f"rank {r} k_out"
        # a bf16 Lamport all-reduce after it: the qk calls left the shared Lamport buffers armed
        x = [torch.full((4, 256), float(r + 1), device="cuda", dtype=torch.bfloat16) for r in range(W)]
        s = run_ranks(ranks, lambda rk: rk.all_reduce(x[rk.rank]))
        torch.cuda.synchronize()
        assert all(bool((t == W * (W + 1) / 2).all()) for t in s)
        for rank in ranks:
            rank.check()
    finally:
        close_group(ranks)


def _replicate(ks, wk, R):
    """``k`` and its weight of the first rank of each group of ``R`` copied to the group's other ranks."""
    for r in range(len(ks)):
        ks[r].copy_(ks[r - r % R])
        wk[r].copy_(wk[r - r % R])


@pytest.mark.parametrize("W, R, Hq, Hk", [(2, 1, 3072, 512), (4, 2, 1536, 512)], ids=["w2", "w4-kv_replicas2"])
def test_graph_replays(W, R, Hq, Hk):
    """A graph of 7 calls (an odd number: the parities alternate across replays), each on its own inputs,
    replayed 4 times with new inputs copied in: every call's outputs match the reference on every rank
    in every replay (a call that read another call's words, or a stale parity's, would give other bits);
    with ``kv_replicas`` (``k`` and its weight the same on the ranks of a group) too."""
    from tests.support.numerics import Checks
    from tpcomm import fused_qk_rmsnorm_reference
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    T = 16
    ranks = loopback_group(W, max_bytes=8 << 20, timeout_s=20.0)
    try:
        calls = [_inputs(W, T, Hq, Hk, torch.bfloat16, seed=1 + i) for i in range(7)]
        for _, ks, _, wk in calls:
            _replicate(ks, wk, R)

        def body():
            return [run_ranks(ranks, lambda rk, c=c: rk.fused_qk_rmsnorm(c[0][rk.rank], c[1][rk.rank], c[2][rk.rank],
                                                                          c[3][rk.rank], 1e-6, kv_replicas=R))
                    for c in calls]

        body()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = body()
        check = Checks()
        for rep in range(4):
            g = torch.Generator(device="cuda").manual_seed(10 + rep)
            for qs, ks, _, wk in calls:
                for q, k in zip(qs, ks):
                    q.copy_(torch.randn(q.shape, device="cuda", generator=g) * 4)
                    k.copy_(torch.randn(k.shape, device="cuda", generator=g) * 4)
                _replicate(ks, wk, R)
            graph.replay()
            torch.cuda.synchronize()
            for i, (qs, ks, wq, wk) in enumerate(calls):
                want = fused_qk_rmsnorm_reference(qs, ks, wq, wk, 1e-6, kv_replicas=R)
                for r in range(W):
                    check.that(_same(outs[i][r][0], want[r][0]) and _same(outs[i][r][1], want[r][1]),
                               f"replay {rep}, call {i}, rank {r}: outputs differ from the reference")
        check.done()
        for rank in ranks:
            rank.check()
    finally:
        close_group(ranks)


def test_a_peer_with_another_width_is_reported():
    """Rank 0 normalises 3072 q columns, rank 1 2048 (the same T: the same grid): both raise
    ``PeerMismatchError``, none hangs."""
    from tpcomm.errors import PeerMismatchError
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    ranks = loopback_group(2, max_bytes=1 << 20, timeout_s=5.0)
    try:
        k = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
        wk = torch.ones(512, device="cuda", dtype=torch.bfloat16)
        q = {H: torch.randn(4, H, device="cuda", dtype=torch.bfloat16) for H in (3072, 2048)}
        w = {H: torch.ones(H, device="cuda", dtype=torch.bfloat16) for H in (3072, 2048)}

        def call(rank, H=None):
            H = H or (3072 if rank.rank == 0 else 2048)
            return rank.fused_qk_rmsnorm(q[H], k, w[H], wk)
        # both widths compiled and loaded first (matching calls): a rank that loads a new binary while its
        # peer's kernel spins would wait for that kernel (tpcomm.loopback), and time out instead
        run_ranks(ranks, lambda rk: call(rk, 3072))
        run_ranks(ranks, lambda rk: call(rk, 2048))
        torch.cuda.synchronize()
        try:
            run_ranks(ranks, call)
        except PeerMismatchError:
            pass
        torch.cuda.synchronize()
        for rank in ranks:
            with pytest.raises(PeerMismatchError):
                rank.check()
    finally:
        close_group(ranks)


def test_a_missing_peer_raises_instead_of_hanging():
    """Only rank 0 calls: its kernel gives up after the timeout and the next call raises."""
    from tpcomm.errors import PeerTimeoutError
    from tpcomm.loopback import close_group, loopback_group

    ranks = loopback_group(2, max_bytes=1 << 20, timeout_s=0.5)
    try:
        q, k = (torch.randn(8, H, device="cuda", dtype=torch.bfloat16) for H in (3072, 512))
        wq, wk = torch.ones(3072, device="cuda", dtype=torch.bfloat16), torch.ones(512, device="cuda")
        with torch.cuda.stream(ranks[0].stream):
            ranks[0].fused_qk_rmsnorm(q, k, wq, wk)
            torch.cuda.synchronize()
            with pytest.raises(PeerTimeoutError):
                ranks[0].fused_qk_rmsnorm(q, k, wq, wk)
    finally:
        close_group(ranks)
