"""tpcomm's kernels on ONE GPU, every rank a communicator of this process (``tpcomm.loopback``).

Marked ``gpu``; needs one CUDA GPU (runs on the one-GPU machine too). Every algorithm, dtype and op of
the fused op and the all-reduce at 2 ranks (bf16 at 3), all-gather and reduce-scatter in bf16 at 2 and 3
ranks, compared bit for bit with ``tpcomm.reference`` on every rank; CUDA-graph replays of mixed calls
with programmatic dependent launch on and off; a rank whose peer never comes raises
``PeerTimeoutError``, and ranks making different calls raise ``PeerMismatchError``, instead of hanging
(those three at 2 ranks).

    python -m pytest -q -m gpu tests/collectives/test_gpu_loopback.py
"""

import pytest
import torch

from tests.support.numerics import bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: (T, H): decode, prefill-like, two tiles per row (H > 8192), odd H (a partial tile).
SHAPES = [(1, 6144), (64, 7168), (5, 16384), (7, 999)]
ALGOS = {"lamport": (torch.bfloat16, torch.float16),
         "one_shot": (torch.bfloat16, torch.float16, torch.float32),
         "two_shot": (torch.bfloat16, torch.float16, torch.float32)}
#: Every algorithm, dtype and shape at 2 ranks; bf16 at two shapes at 3 ranks, and Lamport's at 4 (a wait
#: on three peers; each world size compiles its own kernels, which dominates this file's time).
CASES = ([(2, a, d, T, H) for a, ds in ALGOS.items() for d in ds for T, H in SHAPES]
         + [(3, a, torch.bfloat16, T, H) for a in ALGOS for T, H in SHAPES[:2]]
         + [(4, "lamport", torch.bfloat16, T, H) for T, H in SHAPES[:2]])


def _ids(c):
    W, a, d, T, H = c
    return f"w{W}-{a}-{str(d)[6:]}-{T}x{H}"


@pytest.fixture(scope="module")
def groups():
    """``{world_size: loopback ranks}``, made on first use."""
    from tpcomm.loopback import close_group, loopback_group

    made = {}

    def get(world):
        ranks = made.get(world)
        if ranks is not None:
            try:
                for rank in ranks:
                    rank.check()
            except Exception:  # an earlier case broke this group: the next case gets a new one
                close_group(ranks)
                ranks = None
        if ranks is None:
            ranks = made[world] = loopback_group(world, max_bytes=8 << 20, timeout_s=20.0)
        return ranks
    yield get
    for ranks in made.values():
        close_group(ranks)


def _inputs(W, T, H, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [(torch.randn(T, H, device="cuda", generator=g) * 4).to(dtype) for _ in range(W)]
    res = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(H, device="cuda", generator=g)).to(dtype)
    return xs, res, w


def _same(a, b):
    return torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_every_rank_matches_the_reference(groups, case):
    from tpcomm import reference as R
    from tpcomm.loopback import run_ranks

    W, algo, dtype, T, H = case
    group = groups(W)
    xs, res, w = _inputs(W, T, H, dtype, seed=T * 131 + H)
    s = R.reduce_in_rank_order(xs)
    o_ref, ro_ref = R.add_rmsnorm_reference(s, res, w, 1e-6)
    og_ref, _ = R.add_rmsnorm_reference(s, None, w, 1e-6, gemma=True)

    def each(fn):  # one op on every rank, then the next (see run_ranks)
        def call(rank):
            with rank.use_algorithm(algo):
                return fn(rank, xs[rank.rank])
        return run_ranks(group, call)

    got = dict(ar=each(lambda rank, x: rank.all_reduce(x)),
               fused=each(lambda rank, x: rank.fused_add_rmsnorm(x, res, w, 1e-6)),
               gemma=each(lambda rank, x: rank.fused_add_rmsnorm(x, None, w, 1e-6, gemma=True)))
    if dtype != torch.float32:
        got["fp8"] = each(lambda rank, x: rank.fused_add_rmsnorm(x, res, w, 1e-6, quant="fp8_per_token"))
    torch.cuda.synchronize()
    for r in range(W):
        assert _same(got["ar"][r], s), f"rank {r}: all_reduce"
        assert _same(got["fused"][r][0], o_ref) and _same(got["fused"][r][1], ro_ref), f"rank {r}: fused"
        assert _same(got["gemma"][r][0], og_ref), f"rank {r}: fused, Gemma norm, no residual"
        if "fp8" in got:
            q_ref, sc_ref = R.per_token_quant_reference(o_ref)
            q, sc = got["fp8"][r][0], got["fp8"][r][1]
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and _same(sc, sc_ref), \
                f"rank {r}: fused FP8"
    for rank in group:
        rank.check()


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("T", [1, 7, 64])
def test_all_gather_and_reduce_scatter(groups, W, T):
    from tpcomm import reference as R
    from tpcomm.loopback import run_ranks

    group = groups(W)
    xs, _, _ = _inputs(W, T, 2048, torch.bfloat16, seed=T)
    s = R.reduce_in_rank_order(xs)
    gathers = run_ranks(group, lambda rank: rank.all_gather(xs[rank.rank]))
    shares = run_ranks(group, lambda rank: rank.reduce_scatter(xs[rank.rank]))
    torch.cuda.synchronize()
    for r, (gathered, share) in enumerate(zip(gathers, shares)):
        assert _same(gathered, torch.cat(xs)), f"rank {r}: all_gather"
        assert _same(share, torch.tensor_split(s, W)[r]), f"rank {r}: reduce_scatter"


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_graph_replays_of_mixed_calls(pdl):
    """A graph of 30 calls mixing algorithms and sizes, replayed 5 times on new inputs: the last call of
    every kind matches the reference on every rank each time."""
    from tpcomm import reference as R
    from tpcomm.loopback import close_group, loopback_group, run_ranks
    from tpcomm.workspace import pdl_supported

    if pdl and not pdl_supported(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("this GPU has no programmatic dependent launch (sm_90+)")
    ranks = loopback_group(2, max_bytes=8 << 20, timeout_s=20.0, pdl=pdl)
    assert all(r.workspace.pdl == pdl for r in ranks)
    try:
        shapes = [(1, 6144), (64, 4096), (3, 6144), (512, 2048)]
        xs = {sh: [torch.zeros(sh, device="cuda", dtype=torch.bfloat16) for _ in ranks] for sh in shapes}
        res = {sh: torch.zeros(sh, device="cuda", dtype=torch.bfloat16) for sh in shapes}
        w = {sh: torch.ones(sh[1], device="cuda", dtype=torch.bfloat16) for sh in shapes}
        algos = ["lamport", "one_shot", "two_shot"]

        def body():
            outs = {}
            for i in range(30):
                sh, algo = shapes[i % len(shapes)], algos[i % len(algos)]

                def call(rank, sh=sh, algo=algo):
                    with rank.use_algorithm(algo):
                        return rank.fused_add_rmsnorm(xs[sh][rank.rank], res[sh], w[sh], 1e-6)
                outs[sh] = run_ranks(ranks, call)
            return outs

        body()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = body()
        for rep in range(5):
            g = torch.Generator(device="cuda").manual_seed(rep)
            for sh in shapes:
                for x in xs[sh]:
                    x.copy_(torch.randn(sh, device="cuda", generator=g))
                res[sh].copy_(torch.randn(sh, device="cuda", generator=g))
                w[sh].copy_(1 + torch.randn(sh[1], device="cuda", generator=g) / 2)
            graph.replay()
            torch.cuda.synchronize()
            for sh in shapes:
                o_ref, ro_ref = R.add_rmsnorm_reference(R.reduce_in_rank_order(xs[sh]), res[sh], w[sh], 1e-6)
                for r, (o, ro) in enumerate(outs[sh]):
                    assert _same(o, o_ref) and _same(ro, ro_ref), f"replay {rep}, {sh}, rank {r}"
        for rank in ranks:
            rank.check()
    finally:
        close_group(ranks)


@pytest.mark.parametrize("algo,W", [("lamport", 2), ("one_shot", 2), ("two_shot", 2), ("lamport", 3)])
def test_a_missing_peer_raises_instead_of_hanging(algo, W):
    """Only rank 0 calls: its kernel gives up after the timeout and the next call raises."""
    from tpcomm.errors import PeerTimeoutError
    from tpcomm.loopback import close_group, loopback_group

    ranks = loopback_group(W, max_bytes=1 << 20, timeout_s=0.5)
    try:
        x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.cuda.stream(ranks[0].stream), ranks[0].use_algorithm(algo):
            ranks[0].all_reduce(x)
            torch.cuda.synchronize()
            with pytest.raises(PeerTimeoutError):
                ranks[0].all_reduce(x)
    finally:
        close_group(ranks)


@pytest.mark.parametrize("algo", ["lamport", "one_shot", "two_shot"])
def test_a_first_call_of_chunks_of_other_sizes_loads_before_it_waits(monkeypatch, tmp_path, algo):
    """The first call of a shape whose last chunk is one row (another specialisation of the kernel than
    the other chunk) with an empty kernel cache and a timeout of 1 s: every chunk's kernel is loaded
    before rank 0's first chunk waits for rank 1, so both ranks complete with the reference's bits."""
    from tpcomm import reference as R
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    H, max_bytes = 1992, 1 << 16  # an H no other test compiles; 16 rows of fp16 a chunk
    T = max_bytes // (2 * H) + 1
    ranks = loopback_group(2, max_bytes=max_bytes, timeout_s=1.0)
    try:
        xs, res, w = _inputs(2, T, H, torch.float16, seed=5)
        o_ref, ro_ref = R.add_rmsnorm_reference(R.reduce_in_rank_order(xs), res, w, 1e-6)

        def call(rank):
            with rank.use_algorithm(algo):
                return rank.fused_add_rmsnorm(xs[rank.rank], res, w, 1e-6)
        got = run_ranks(ranks, call)
        torch.cuda.synchronize()
        for r, (out, res_out) in enumerate(got):
            assert _same(out, o_ref) and _same(res_out, ro_ref), f"rank {r}"
        for rank in ranks:
            rank.check()
    finally:
        close_group(ranks)


@pytest.mark.parametrize("algo,W", [("lamport", 2), ("one_shot", 2), ("two_shot", 2), ("lamport", 3)])
def test_a_late_rank_fails_the_call_its_peer_gave_up_on(algo, W):
    """Rank 1 issues its call after the other ranks' kernels gave up on it (timeout and grace): each of
    them raises ``PeerTimeoutError`` naming rank 1 and rank 1 ``PeerAbortedError`` naming one of them,
    all for the same epoch; none returns a value for that call. At 3 ranks, rank 0's and rank 2's waits
    for each other succeed, so only rank 1 is named."""
    import time

    from tpcomm.errors import PeerAbortedError, PeerTimeoutError
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    ranks = loopback_group(W, max_bytes=1 << 20, timeout_s=0.5)
    try:
        x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)

        def call(rank):
            with rank.use_algorithm(algo):
                return rank.all_reduce(x)
        run_ranks(ranks, call)  # every rank's kernels compiled and loaded first
        torch.cuda.synchronize()
        epoch = ranks[0].workspace.epoch()
        for rank in ranks:
            if rank.rank != 1:
                with torch.cuda.stream(rank.stream):
                    call(rank)
        time.sleep(1.5)  # past the others' timeout and its grace (an eighth of the timeout)
        try:  # its kernel fails at once: the call itself may already raise
            with torch.cuda.stream(ranks[1].stream):
                call(ranks[1])
        except PeerAbortedError:
            pass
        torch.cuda.synchronize()
        for rank in ranks:
            if rank.rank != 1:
                with pytest.raises(PeerTimeoutError) as first:
                    rank.check()
                assert type(first.value) is PeerTimeoutError, str(first.value)
                assert (first.value.peer, first.value.epoch) == (1, epoch), str(first.value)
        with pytest.raises(PeerAbortedError) as late:
            ranks[1].check()
        assert late.value.peer in [r for r in range(W) if r != 1] and late.value.epoch == epoch, str(late.value)
    finally:
        close_group(ranks)


@pytest.mark.parametrize("algo,W", [("lamport", 2), ("one_shot", 2), ("lamport", 3)])
def test_a_peer_making_another_call_is_reported(algo, W):
    """Rank 0 runs the fused op with a residual, the others without (the same rows, bytes and grid):
    every rank raises ``PeerMismatchError`` (Lamport: the call tags; one-shot: the flags' signatures),
    none hangs."""
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    ranks = loopback_group(W, max_bytes=1 << 20, timeout_s=5.0)
    try:
        x = torch.randn(1, 6144, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(6144, device="cuda", dtype=torch.bfloat16)

        def with_residual(rank):
            with rank.use_algorithm(algo):
                return rank.fused_add_rmsnorm(x, x, w, 1e-6)

        def without(rank):
            with rank.use_algorithm(algo):
                return rank.fused_add_rmsnorm(x, None, w, 1e-6)

        def call(rank):
            return with_residual(rank) if rank.rank == 0 else without(rank)
        # Both kernels compiled and loaded first (matching calls): a rank that loaded a new binary while its
        # peer's kernel spun would wait for that kernel (tpcomm.loopback), and time out instead.
        run_ranks(ranks, with_residual)
        run_ranks(ranks, without)
        torch.cuda.synchronize()
        _every_rank_raises_mismatch(ranks, call)
    finally:
        close_group(ranks)


def _every_rank_raises_mismatch(ranks, call):
    """Run ``call`` (ranks making different calls) on every rank: each rank's ``check()`` then raises
    ``PeerMismatchError`` (a rank's call itself may already raise it, from its peer's kernel)."""
    from tpcomm.errors import PeerMismatchError
    from tpcomm.loopback import run_ranks

    try:
        run_ranks(ranks, call)
    except PeerMismatchError:
        pass
    torch.cuda.synchronize()
    for rank in ranks:
        with pytest.raises(PeerMismatchError):
            rank.check()


@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct_launch", "kernel_grid"])
@pytest.mark.parametrize("algo", ["lamport", "one_shot", "two_shot"])
def test_repeated_calls_replay_the_first_calls_bits(monkeypatch, direct, algo):
    """Each op three times on every rank (the first call recorded, the next two replayed: through the
    compiled kernel's launcher, or with ``TPCOMM_DIRECT_LAUNCH=0`` through ``kernel[grid]``), with given
    outputs too: every call matches the reference on every rank, and the replays are direct exactly when
    asked for (Triton's binder confirmed each recorded launch, and no replayed call reached
    ``JITFunction.run``)."""
    from tpcomm import reference as R
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    monkeypatch.setenv("TPCOMM_DIRECT_LAUNCH", direct)
    ranks = loopback_group(2, max_bytes=8 << 20, timeout_s=20.0)
    try:
        T, H = 3, 6144
        xs, res, w = _inputs(2, T, H, torch.bfloat16, seed=77)
        s = R.reduce_in_rank_order(xs)
        o_ref, ro_ref = R.add_rmsnorm_reference(s, res, w, 1e-6)
        q_ref, sc_ref = R.per_token_quant_reference(o_ref)
        outs = [torch.empty_like(o_ref) for _ in ranks]
        residuals = [[res.clone() for _ in range(3)] for _ in ranks]

        def each(fn):
            def call(rank):
                with rank.use_algorithm(algo):
                    return fn(rank, xs[rank.rank])
            return run_ranks(ranks, call)

        from triton.runtime.jit import JITFunction

        through_run = []  # kernel[grid] launches (JITFunction.run) of the replayed calls
        run = JITFunction.run

        def counted(self, *args, **kwargs):
            through_run.append(self.__name__)
            return run(self, *args, **kwargs)

        for rep in range(3):
            if rep == 1:
                monkeypatch.setattr(JITFunction, "run", counted)
            ar = each(lambda rank, x: rank.all_reduce(x))
            fused = each(lambda rank, x: rank.fused_add_rmsnorm(x, res, w, 1e-6))
            given = each(lambda rank, x: rank.fused_add_rmsnorm(x, residuals[rank.rank][rep], w, 1e-6,
                                                                out=outs[rank.rank],
                                                                residual_out=residuals[rank.rank][rep]))
            fp8 = each(lambda rank, x: rank.fused_add_rmsnorm(x, res, w, 1e-6, quant="fp8_per_token"))
            gathered = run_ranks(ranks, lambda rank: rank.all_gather(xs[rank.rank]))
            shares = run_ranks(ranks, lambda rank: rank.reduce_scatter(xs[rank.rank]))
            torch.cuda.synchronize()
            for r in range(2):
                where = f"call {rep}, rank {r}"
                assert _same(ar[r], s), f"{where}: all_reduce"
                assert _same(fused[r][0], o_ref) and _same(fused[r][1], ro_ref), f"{where}: fused"
                assert given[r][0] is outs[r] and given[r][1] is residuals[r][rep], f"{where}: given outputs"
                assert _same(outs[r], o_ref) and _same(residuals[r][rep], ro_ref), f"{where}: given outputs"
                assert torch.equal(fp8[r][0].view(torch.uint8), q_ref.view(torch.uint8)) \
                    and _same(fp8[r][1], sc_ref), f"{where}: fused FP8"
                assert _same(gathered[r], torch.cat(xs)), f"{where}: all_gather"
                assert _same(shares[r], torch.tensor_split(s, 2)[r]), f"{where}: reduce_scatter"
        monkeypatch.setattr(JITFunction, "run", run)
        if direct == "1":
            assert not through_run, f"replays through kernel[grid]: {sorted(set(through_run))}"
        else:
            assert through_run, "TPCOMM_DIRECT_LAUNCH=0, yet no replay went through kernel[grid]"
        for rank in ranks:
            rank.check()
            entries = list(rank._calls._entries.values())
            assert entries, "nothing was recorded"
            assert all(e.direct == (direct == "1") for e in entries), \
                [(e.replays[0].call.kernel.__name__, e.direct) for e in entries]
    finally:
        close_group(ranks)


def test_a_misaligned_input_after_aligned_calls_is_launched_for_its_alignment():
    """Calls recorded with 16-byte-aligned tensors, then the same shapes with ``x`` (and given outputs)
    starting one element into their storage, then aligned again: the misaligned calls take the full
    path (Triton specialises each pointer on its alignment, so a replay of the aligned kernel would read
    the wrong vectors), and every call matches the reference on every rank."""
    from tpcomm import reference as R
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    ranks = loopback_group(2, max_bytes=8 << 20, timeout_s=20.0)
    try:
        T, H = 2, 4096
        xs, res, w = _inputs(2, T, H, torch.bfloat16, seed=91)
        s = R.reduce_in_rank_order(xs)
        o_ref, ro_ref = R.add_rmsnorm_reference(s, res, w, 1e-6)

        def offset(t):  # the same values, contiguous, one element into a larger storage
            buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
            view = buf[1:1 + t.numel()].view(t.shape)
            view.copy_(t)
            return view

        layouts = {"aligned": [x.clone() for x in xs], "offset": [offset(x) for x in xs]}
        outs = {"aligned": [torch.empty_like(o_ref) for _ in ranks], "offset": [offset(o_ref) for _ in ranks]}
        for rep, name in enumerate(("aligned", "aligned", "offset", "offset", "aligned")):
            x_of, out_of = layouts[name], outs[name]
            ar = run_ranks(ranks, lambda rank: rank.all_reduce(x_of[rank.rank]))
            given = run_ranks(ranks, lambda rank: rank.fused_add_rmsnorm(x_of[rank.rank], res, w, 1e-6,
                                                                         out=out_of[rank.rank]))
            torch.cuda.synchronize()
            for r in range(2):
                where = f"call {rep} ({name}), rank {r}"
                assert _same(ar[r], s), f"{where}: all_reduce"
                assert _same(given[r][0], o_ref) and _same(given[r][1], ro_ref), f"{where}: fused"
        for rank in ranks:
            rank.check()
    finally:
        close_group(ranks)


def test_fail_close_create_cycles_leak_nothing():
    """20 times: a loopback group, a right call, a mismatch (rank 0 with a residual, rank 1 without:
    ``PeerMismatchError``), close: every cycle raises, later groups work, and device memory and open files
    come back to where they were."""
    import gc
    import os

    from tpcomm import reference as R
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    x = torch.randn(1, 6144, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(6144, device="cuda", dtype=torch.bfloat16)

    def cycle():
        ranks = loopback_group(2, max_bytes=1 << 20, timeout_s=5.0)
        try:
            right = run_ranks(ranks, lambda rank: rank.all_reduce(x))
            # both kernels loaded by matching calls first (a rank loading a binary while its peer's kernel
            # spins could time out instead of seeing the mismatch)
            run_ranks(ranks, lambda rank: rank.fused_add_rmsnorm(x, x, w))
            run_ranks(ranks, lambda rank: rank.fused_add_rmsnorm(x, None, w))
            torch.cuda.synchronize()
            assert all(_same(y, R.reduce_in_rank_order([x, x])) for y in right)
            _every_rank_raises_mismatch(
                ranks, lambda rank: rank.fused_add_rmsnorm(x, x if rank.rank == 0 else None, w))
        finally:
            close_group(ranks)

    cycle()  # compiles and loads every kernel once
    gc.collect()
    torch.cuda.synchronize()
    before = (torch.cuda.memory_allocated(), len(os.listdir("/proc/self/fd")))
    for _ in range(20):
        cycle()
    gc.collect()
    torch.cuda.synchronize()
    after = (torch.cuda.memory_allocated(), len(os.listdir("/proc/self/fd")))
    assert after[0] <= before[0] and after[1] <= before[1], f"(allocated bytes, open fds) {before} -> {after}"


def test_a_rank_may_run_calls_ahead_of_its_peer_once_their_kernels_are_loaded(monkeypatch, tmp_path):
    """With an empty kernel cache, a fused call and an all-reduce of another size are made once on every
    rank, one call per ``run_ranks`` (their kernels load while no kernel waits); then each rank makes both
    in one ``run_ranks`` function, rank 0 its second call before rank 1 its first: both complete on both
    ranks with the reference's bits, well inside the timeout (tpcomm.loopback, "Limits")."""
    import time

    from tpcomm import reference as R
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ranks = loopback_group(2, max_bytes=1 << 20, timeout_s=10.0)
    try:
        xs, res, w = _inputs(2, 3, 1736, torch.bfloat16, seed=11)  # an H no other test compiles
        ys = [torch.randn(5, 904, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        o_ref, ro_ref = R.add_rmsnorm_reference(R.reduce_in_rank_order(xs), res, w, 1e-6)
        s_ref = R.reduce_in_rank_order(ys)

        def fused(rank):
            return rank.fused_add_rmsnorm(xs[rank.rank], res, w, 1e-6)

        def reduce(rank):
            return rank.all_reduce(ys[rank.rank])
        run_ranks(ranks, fused)
        run_ranks(ranks, reduce)
        torch.cuda.synchronize()
        start = time.monotonic()
        got = run_ranks(ranks, lambda rank: (fused(rank), reduce(rank)))
        torch.cuda.synchronize()
        assert time.monotonic() - start < 9.0, "the calls waited for the timeout"
        for r, ((out, res_out), s) in enumerate(got):
            assert _same(out, o_ref) and _same(res_out, ro_ref) and _same(s, s_ref), f"rank {r}"
        for rank in ranks:
            rank.check()
    finally:
        close_group(ranks)
