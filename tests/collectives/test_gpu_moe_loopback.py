"""MoE finalize fused with the all-reduce and the norm on ONE GPU, ranks as loopback communicators.

Marked ``gpu``; needs one CUDA GPU. For each algorithm, K, layout and shared output: the fused call's
outputs equal the unfused composition (``tpcomm.moe_finalize`` then ``fused_add_rmsnorm``) bit for bit
on every rank, and a plain-torch oracle (``moe_finalize_reference``, ``reduce_in_rank_order``,
``add_rmsnorm_reference``); a second call gives the same bits; every quant form at one shape; a CUDA
graph of an odd number of calls of several sizes replayed on new inputs (every call checked); an index
outside ``[0, M)`` on CUDA adds nothing (masked, no fault); ranks calling with another K raise
``PeerMismatchError``. The numerics on CPU ranks: ``tests/collectives/test_moe_finalize.py``.

    python -m pytest -q -m gpu tests/collectives/test_gpu_moe_loopback.py
"""

import zlib

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: (algo, T, H): decode and prefill-like rows, H of DeepSeek-V3 (7168), MiniMax-M2 (3072), gpt-oss (2880).
SHAPES = [("lamport", 1, 7168), ("lamport", 16, 3072), ("one_shot", 64, 2880), ("one_shot", 5, 7168),
          ("two_shot", 256, 3072), ("lamport", 3, 130)]


@pytest.fixture(scope="module")
def groups():
    from tpcomm.loopback import close_group, loopback_group

    made = {}

    def get(world):
        if world not in made:
            made[world] = loopback_group(world, max_bytes=8 << 20, timeout_s=20.0)
        return made[world]
    yield get
    for ranks in made.values():
        close_group(ranks)


def _inputs(W, T, K, H, perm, shared, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.rand(T, K, device="cuda", generator=g)
    res = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    nw = (1 + 0.5 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)
    args = []
    for _ in range(W):
        e = torch.randn(T, K, H, device="cuda", generator=g).to(torch.bfloat16)
        a = dict(expert_out=e, topk_weights=w, scaling=1.5)
        if perm:
            p = torch.randperm(T * K, device="cuda", generator=g)
            ep = torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda")
            ep[p] = e.reshape(T * K, H)
            a.update(expert_out=ep, index=p.view(T, K).to(torch.int32))
        if shared:
            a["shared_out"] = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        args.append(a)
    return args, res, nw


def _oracle(args, res, nw):
    import tpcomm

    xs = [tpcomm.moe_finalize_reference(**a) for a in args]
    out, ro = tpcomm.add_rmsnorm_reference(tpcomm.reduce_in_rank_order(xs), res, nw, 1e-6)
    return out, ro


def _eq(a, b):
    """The same shape and bytes (any dtype: bits, not float equality)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
@pytest.mark.parametrize("perm", [False, True], ids=["token", "permuted"])
@pytest.mark.parametrize("K", [1, 8])
@pytest.mark.parametrize("algo, T, H", SHAPES, ids=[f"{a}-{T}x{H}" for a, T, H in SHAPES])
def test_fused_equals_composition(groups, algo, T, H, K, perm, shared):
    import tpcomm
    from tpcomm.loopback import run_ranks

    ranks = groups(2)
    args, res, nw = _inputs(2, T, K, H, perm, shared, zlib.crc32(f"{algo}{T}{H}{K}{perm}{shared}".encode()))

    def fused(rank):
        with rank.use_algorithm(algo):
            return rank.fused_moe_finalize_add_rmsnorm(residual=res, weight=nw, **args[rank.rank])

    def composed(rank):
        with rank.use_algorithm(algo):
            return rank.fused_add_rmsnorm(xs[rank.rank], res, nw, 1e-6)

    xs = [tpcomm.moe_finalize(**a) for a in args]
    want = run_ranks(ranks, composed)
    oracle = _oracle(args, res, nw)
    for call in range(2):  # the second call after the first (signals reused)
        got = run_ranks(ranks, fused)
        torch.cuda.synchronize()
        for r, (g, w) in enumerate(zip(got, want)):
            for name, a, b, o in zip(("out", "residual_out"), g, w, oracle):
                assert _eq(a, b), f"call {call}, rank {r}: {name} differs from the composition"
                assert _eq(a, o), f"call {call}, rank {r}: {name} differs from the plain-torch oracle"


FORMS = [("fp8_per_token", {}), ("fp8_per_group", {"group_size": 128}), ("fp8_per_group_ue8m0", {"group_size": 128}),
         ("fp8_static", {"scale": 0.02}), ("mxfp4", {}), ("nvfp4", {"scale": 500.0}),
         ("nvfp4", {"scale": 500.0, "swizzled_scales": True})]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f[0] + "".join(f"-{k}" for k in f[1] if k == "swizzled_scales"))
@pytest.mark.parametrize("algo", ["lamport", "one_shot", "two_shot"])
def test_every_quant_form(groups, algo, form):
    from tpcomm.loopback import run_ranks

    quant, kw = form
    kw = {k: (torch.tensor([v], device="cuda") if k == "scale" else v) for k, v in kw.items()}
    ranks = groups(2)
    args, res, nw = _inputs(2, 67, 8, 7168, True, True, zlib.crc32(f"{algo}{quant}{kw}".encode()))

    def fused(rank):
        with rank.use_algorithm(algo):
            return rank.fused_moe_finalize_add_rmsnorm(residual=res, weight=nw, quant=quant, emit_unquantized=True,
                                                       **args[rank.rank], **kw)

    def composed(rank):
        import tpcomm

        with rank.use_algorithm(algo):
            return rank.fused_add_rmsnorm(tpcomm.moe_finalize(**args[rank.rank]), res, nw, 1e-6, quant=quant,
                                          emit_unquantized=True, **kw)

    want, got = run_ranks(ranks, composed), run_ranks(ranks, fused)
    torch.cuda.synchronize()
    for r, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            assert (a is None) == (b is None) and (a is None or _eq(a, b)), f"rank {r}: output {i} differs"
        assert _eq(got[r][0], got[0][0]), f"rank {r}: q differs from rank 0's"


def test_graph_replays_with_new_inputs(groups):
    """Five fused calls of 1 to 256 tokens (the plans the default dispatch gives them), each on its own
    inputs, captured in one graph and replayed three times with new expert outputs copied in: every
    call's outputs equal the oracle's on every rank in every replay."""
    from tests.support.numerics import Checks
    from tpcomm.loopback import run_ranks

    ranks = groups(2)
    K, H = 8, 3072
    calls = [_inputs(2, T, K, H, True, False, 1 + i) for i, T in enumerate((1, 16, 64, 256, 16))]

    def issue(args, res, nw):
        return run_ranks(ranks, lambda rank: rank.fused_moe_finalize_add_rmsnorm(residual=res, weight=nw,
                                                                                 **args[rank.rank]))

    for call in calls:  # compile and load outside the capture, one call per run_ranks
        issue(*call)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [issue(*call) for call in calls]
    check = Checks()
    for replay in range(3):
        for i, (args, _, _) in enumerate(calls):
            new, _, _ = _inputs(2, args[0]["index"].shape[0], K, H, True, False, 100 + 10 * replay + i)
            for s, n in zip(args, new):
                s["expert_out"].copy_(n["expert_out"])
        graph.replay()
        torch.cuda.synchronize()
        for i, (args, res, nw) in enumerate(calls):
            oracle = _oracle(args, res, nw)
            for r, o in enumerate(outs[i]):
                check.that(_eq(o[0], oracle[0]) and _eq(o[1], oracle[1]),
                           f"replay {replay}, call {i} (T={res.shape[0]}), rank {r}: outputs differ from the oracle")
    check.done()


def test_index_out_of_range_adds_nothing_on_cuda(groups):
    """An index past M (and a negative one) on CUDA: the slot adds nothing, nothing outside expert_out is
    read, and the call completes (the host does not read a CUDA index)."""
    import tpcomm
    from tpcomm.loopback import run_ranks

    ranks = groups(2)
    args, res, nw = _inputs(2, 4, 2, 3072, True, False, 7)
    for a in args:
        a["index"] = a["index"].clone()
        a["index"][1, 0] = 1 << 30
        a["index"][2, 1] = -5
    got = run_ranks(ranks, lambda rank: rank.fused_moe_finalize_add_rmsnorm(residual=res, weight=nw, **args[rank.rank]))
    x = tpcomm.moe_finalize(**args[0])
    torch.cuda.synchronize()
    for a in args:  # the oracle: the same slots with weight 0 and any row
        a["topk_weights"] = a["topk_weights"].clone()
        a["topk_weights"][1, 0] = 0.0
        a["topk_weights"][2, 1] = 0.0
        a["index"] = a["index"].clamp(0, a["expert_out"].shape[0] - 1)
    oracle = _oracle(args, res, nw)
    for r, g in enumerate(got):
        assert _eq(g[1], oracle[1]), f"rank {r}: residual_out differs from the masked oracle"
    assert _eq(x, tpcomm.moe_finalize_reference(**args[0])), "moe_finalize differs from the masked oracle"


def test_another_k_is_a_mismatch():
    from tpcomm import PeerMismatchError
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    ranks = loopback_group(2, timeout_s=5.0)
    try:
        a2, res, nw = _inputs(2, 2, 2, 3072, False, False, 3)
        a4, _, _ = _inputs(2, 2, 4, 3072, False, False, 3)
        args = [a2[0], a4[1]]
        seen = set()  # the ranks that raised PeerMismatchError: from the call itself, or when checked after it

        def call(rank):
            try:
                rank.fused_moe_finalize_add_rmsnorm(residual=res, weight=nw, **args[rank.rank])
            except PeerMismatchError:
                seen.add(rank.rank)

        run_ranks(ranks, call)
        torch.cuda.synchronize()
        for rank in ranks:
            try:
                rank.check()
            except PeerMismatchError:
                seen.add(rank.rank)
        assert seen == {0, 1}, f"ranks that raised PeerMismatchError: {sorted(seen)}"
    finally:
        close_group(ranks)
