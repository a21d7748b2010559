"""The cached path of the ops (``tpcomm.call_cache``, ``tpcomm.kernels.launch``): a repeated call replays
its first call's launches with the same bits; a call that changes one key field is planned afresh; input
errors raise on every call; outputs the caller passes; the cache's bound. CPU ranks (2 and 3), plus
launch-level tests in this process under the interpreter.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from tests.call_cache import ranks as cases
from tests.support.numerics import Checks
from tpcomm.kernels.launch import KernelCall, Replay, direct_launch_supported


def _assert_all(results):
    check = Checks()
    for r, pairs in enumerate(results):
        for what, ok in pairs:
            check.that(ok, f"rank {r}: {what}")
    check.done()


@pytest.mark.parametrize("world,shape,dtype", [(2, (3, 32), "bfloat16"), (2, (2, 3, 48), "float32"),
                                               (2, (5, 200), "float16"), (3, (2, 32), "bfloat16")])
def test_repeated_calls_replay_with_the_first_calls_bits(pools, world, shape, dtype):
    _assert_all(pools.get(world).run(cases.repeated_calls_case, 11, shape, dtype))


@pytest.mark.parametrize("world", [2, 3])
def test_a_changed_key_field_is_planned_afresh(pools, world):
    _assert_all(pools.get(world).run(cases.changed_key_case, 5))


def test_input_errors_raise_on_every_call(pool2):
    """Each bad call raises the same exception twice, right after valid calls of a key that differs from
    it only in a type or an address."""
    expected = {"eps=True": "TypeError", "gemma=1": "TypeError", "group_size=True": "TypeError",
                "dim=True": "TypeError", "residual dtype": "TypeError", "weight shape": "ValueError",
                "out overlaps x": "ValueError", "residual_out overlaps weight": "ValueError",
                "closed": "RuntimeError"}
    check = Checks()
    for r, found in enumerate(pool2.run(cases.errors_repeat_case)):
        check.that([name for name, _, _ in found] == list(expected), f"rank {r}: cases {found}")
        for name, first, second in found:
            check.that(first is not None and first[0] == expected[name], f"rank {r}: {name}: first call raised {first}")
            check.that(first == second, f"rank {r}: {name}: second call raised {second}, first {first}")
    check.done()


def test_an_out_that_overlaps_x_in_part_is_still_exact(pool2):
    _assert_all(pool2.run(cases.partial_overlap_case, 3))


@pytest.mark.parametrize("world,shape,dtype", [(2, (3, 32), "bfloat16"), (2, (2, 40), "float32")])
def test_given_outputs_hold_the_allocating_calls_bits(pools, world, shape, dtype):
    _assert_all(pools.get(world).run(cases.given_outputs_case, 9, shape, dtype))


def test_bad_given_outputs_raise_naming_the_argument(pool2):
    names = {"out of another dtype": "out", "out of another shape": "out", "out not contiguous": "out",
             "out is x": "out", "out is residual_out": "out", "residual_out without residual": "residual_out",
             "residual_out is x": "residual_out", "out with quant, no emit": "out",
             "ops: out with quant, no emit": "out",
             "ops: out is residual_out": "out",
             "q_out without quant": "q_out", "q_out of another format": "q_out",
             "scales_out row-major for column-major": "scales_out", "scales_out of another shape": "scales_out",
             "scales_out float16": "scales_out",
             "in-place residual_out inside x, after a clean call": "residual_out",
             "in-place residual_out holding the weight, after a clean call": "residual_out"}
    check = Checks()
    for r, found in enumerate(pool2.run(cases.bad_outputs_case)):
        for name, first, second in found:
            check.that(first is not None and first[0] == "ValueError"
                       and first[1].startswith(f"fused_add_rmsnorm: {names[name]} "),
                       f"rank {r}: {name}: raised {first}")
            check.that(first == second, f"rank {r}: {name}: second call raised {second}")
    check.done()


def test_the_cache_is_bounded(pool2):
    shapes = [(n,) for n in range(8, 80, 8)]
    for most, ok in pool2.run(cases.bounded_cache_case, 4, shapes):
        assert most <= 4 and ok


def test_the_cache_keeps_no_tensor_alive(pool2):
    _assert_all(pool2.run(cases.replay_holds_no_tensor_case))


# -- launches, in this process (the interpreter) ---------------------------------------------------------
@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * factor, mask=mask)


def test_kernel_call_binds_every_parameter_in_the_kernels_order():
    x, out = torch.arange(8.0), torch.empty(8)
    call = KernelCall(_scale_kernel, 2, (x, out), dict(n=8, factor=2.0, BLOCK=4, num_warps=1))
    assert call.params == (x, out, 8, 2.0, 4) and call.options == {"num_warps": 1}
    call.launch()
    assert torch.equal(out, 2 * x)
    with pytest.raises(TypeError, match="missing parameters"):
        KernelCall(_scale_kernel, 1, (x, out), dict(n=8, BLOCK=4))
    with pytest.raises(TypeError, match="given twice"):
        KernelCall(_scale_kernel, 1, (x, out, 8), dict(n=8, factor=1.0, BLOCK=4))


def test_replay_launches_with_the_new_tensors_in_its_slots():
    x, out = torch.arange(8.0), torch.empty(8)
    call = KernelCall(_scale_kernel, 2, (x, out), dict(n=8, factor=3.0, BLOCK=4))
    replay = Replay(call, ((0, 0), (1, 1)), call.launch(), direct=True)
    assert not replay.direct  # never on the CPU: the interpreter has no compiled launcher
    x2, out2 = torch.full((8,), 5.0), torch.zeros(8)
    replay.launch((x2, out2))
    assert torch.equal(out2, torch.full((8,), 15.0)) and torch.equal(out, 3 * x)
    assert call.params[0] is x  # the recorded call is unchanged


class _Memory:
    """A tensor as a repeat sees it: an address."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _Replay:
    """A recorded launch that logs what a repeat launches: through ``launch`` (not direct) or through
    its launcher ``_run`` with the addresses in its parameter slots (direct)."""

    def __init__(self, slots, direct):
        self.grid, self.slots, self.direct = 3, slots, direct
        self._params, self._function, self._meta = [0] * 4 + ["constant"], "function", "metadata"
        self._raw = None  # a launcher called as compiled.run is (not the module's own launch)
        self.log = []

    def launch(self, tensors, stream, ptrs):
        self.log.append(("launch", ptrs))

    def _run(self, *args):
        self.log.append(("run", tuple(args[9:])))


class _Comm:
    _closed, _last_stream = False, None

    def check(self, op):
        raise AssertionError("no error is recorded")


def _fused_hit(replay, given=(3, 4), in_place=(), residues=None, nbytes=(1024, 1024, 64, 1024, 1024, 0, 0, 0)):
    import threading

    from tpcomm.hit_code import HitSpec, compile_hit

    args = ("x", "residual", "weight", "out", "residual_out", "q_out", "scales_out", "scale")
    spec = HitSpec("fused_add_rmsnorm", args, tuple(("arg", a) for a in args[:5]) + (None, None, None),
                   given=given, inputs=(0, 1, 2), in_place=in_place, result=(3, 4))
    hit, source = compile_hit(spec, (replay,), nbytes, residues, threading.Lock(),
                              np.zeros(5, dtype=np.int32), None)
    return hit, source


def test_a_repeat_launches_with_the_addresses_in_their_slots():
    """The generated repeat passes each slot's address to the parameters that take it, through the
    launcher when the replay is direct and through ``Replay.launch`` otherwise, and returns the
    result's slots."""
    base = [_Memory(k << 20) for k in range(1, 6)]
    for direct in (False, True):
        replay = _Replay(((0, 0), (1, 3), (2, 3), (3, 4)), direct)
        hit, source = _fused_hit(replay)
        got = hit(_Comm(), *base, None, None, None)
        assert got == (base[3], base[4]), source
        ptrs = tuple(m.ptr for m in base)
        want = ("run", (ptrs[0], ptrs[3], ptrs[3], ptrs[4], "constant")) if direct else ("launch", ptrs + (0, 0, 0))
        assert replay.log == [want], source


def test_a_repeat_leaves_overlapping_outputs_and_another_alignment_to_the_full_path():
    """The repeat's checks on the addresses it read once: a given output that shares a byte with an
    input or another given output, or an address whose 16-byte residue is not the recording's, returns
    None before any launch; an in-place residual_out (allowed) and an empty output do not."""
    n = 1024
    base = [1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20]

    def run(ptrs, **kw):
        replay = _Replay(((0, 0), (1, 4)), False)
        hit, source = _fused_hit(replay, **kw)
        got = hit(_Comm(), *(_Memory(p) for p in ptrs), None, None, None)
        assert (got is None) == (not replay.log), source
        return got is not None

    assert run(base)
    for k, into in ((3, 0), (3, 1), (3, 2), (4, 0), (4, 3)):  # an output starting inside x, residual, ...
        ptrs = list(base)
        ptrs[k] = base[into] + 2
        assert not run(ptrs), (k, into)
    in_place = list(base)
    in_place[4] = base[1]  # residual_out is residual
    assert run(in_place, in_place=((4, 1),)) and not run(in_place)
    for into in (0, 2, 3):  # an in-place residual is still an output: not inside x, the weight or out
        moved = list(in_place)
        moved[1] = moved[4] = base[into] + 2
        assert not run(moved, in_place=((4, 1),)), into
    empty = list(base)
    empty[3] = base[0]
    assert run(empty, nbytes=(n, n, 64, 0, n, 0, 0, 0))  # an empty out shares nothing
    residues = (0, 0, 0, 0, 8)
    odd = list(base)
    odd[4] += 8
    assert run(odd, residues=residues) and not run(base, residues=residues)
    assert run(base, residues=(0,) * 8) and not run(odd, residues=(0,) * 8)


def test_direct_replay_runs_the_launcher_unless_a_launch_hook_is_set():
    """A direct replay calls the compiled kernel's launcher when Triton's launch hooks run nothing (None,
    or an empty hook chain as Triton 3.5+ keeps them), and goes through ``kernel[grid]`` (which runs
    hooks, on CUDA) when a hook is set."""
    from triton import knobs

    x, out = torch.arange(8.0), torch.empty(8)
    call = KernelCall(_scale_kernel, 2, (x, out), dict(n=8, factor=3.0, BLOCK=4))
    replay = Replay(call, ((0, 0), (1, 1)), call.launch(), direct=False, device_index=0)
    launched = []
    replay.bind_launcher(lambda *args: launched.append(args), "function", "metadata")
    replay._current_device = lambda: 0  # as if on the recording device
    runtime = knobs.runtime
    before = runtime.launch_enter_hook
    x2, out2 = torch.full((8,), 5.0), torch.zeros(8)
    try:
        for idle in (None, type(before)() if hasattr(before, "calls") else None):
            runtime.launch_enter_hook = idle
            replay.launch((x2, out2), stream=7)
            assert len(launched) == 1, f"hook {idle!r}: the launcher was not called"
            grid, gy, gz, stream, fn, meta, _launch_meta, enter, exit_, *params = launched.pop()
            assert (grid, gy, gz, stream, fn, meta, enter, exit_) == (2, 1, 1, 7, "function", "metadata", None, None)
            assert params == [x2.data_ptr(), out2.data_ptr(), 8, 3.0, 4]
        runtime.launch_enter_hook = lambda *a: None  # a profiler's hook
        replay.launch((x2, out2), stream=7)
        assert not launched and torch.equal(out2, torch.full((8,), 15.0))
    finally:
        runtime.launch_enter_hook = before


def test_direct_launch_needs_cuda_and_no_interpreter():
    assert not direct_launch_supported(torch.device("cpu"))
    assert not direct_launch_supported(torch.device("cuda", 0), enabled=False)


def test_arguments_of_the_wrong_type_raise_the_named_errors(pool2):
    for r, (found, numpy_dim) in enumerate(pool2.run(cases.bad_argument_types_case)):
        assert numpy_dim, f"rank {r}: dim=np.int64(0)"
        for name, first, second in found:
            assert first is not None and first[0] in ("TypeError", "ValueError") and first == second, \
                f"rank {r}: {name}: {first} then {second}"
            op = name.split("(")[0].split(" ")[0]
            op = {"fused": "fused_add_rmsnorm"}.get(op, op)
            assert first[1].startswith(f"{op}: "), f"rank {r}: {name}: message {first[1]!r}"


def test_given_outputs_under_torch_compile(pool2):
    _assert_all(pool2.run(cases.compiled_outputs_case))


def test_close_from_another_thread_during_a_call(pool2):
    for r, (seen, alive, closed) in enumerate(pool2.run(cases.close_while_calling_case)):
        assert not alive and closed and len(seen) == 1 and seen[0] in ("completed", "RuntimeError",
                                                                       "PeerTimeoutError"), (r, seen)


def test_negative_bit_views_are_summed_as_their_values(pool2):
    _assert_all(pool2.run(cases.negative_view_case))


class _Launcher36:
    """A launcher of Triton 3.6's form (its ``__call__`` as there)."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def launch(self, *args):
        return args

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


class _OtherLauncher(_Launcher36):
    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, *args):
        self.launch(gridX, gridY, gridZ, stream, function, kernel_metadata, *args)


def test_the_modules_own_launch_only_behind_a_launcher_it_recognises():
    """A direct replay calls the module's launch itself only behind a launcher whose call is Triton 3.6's
    (flags and scratch pointers inserted, nothing else) and only for a kernel without scratch."""
    from tpcomm.kernels.launch import raw_launch

    run = _Launcher36()
    assert raw_launch(run) == (run.launch, False, True)
    run.global_scratch_size = 64
    assert raw_launch(run) is None
    assert raw_launch(_OtherLauncher()) is None and raw_launch(lambda *a: None) is None


def test_a_repeat_allocates_with_its_layout_beside_raw_launches():
    """Two replays through the module's own launch beside a new output: each launch gets its own flags
    and the output its own dtype (the generated code's names do not collide)."""
    import threading

    from tpcomm.hit_code import HitSpec, compile_hit

    replays = []
    for _ in range(2):
        r = _Replay(((0, 0), (1, 1)), True)
        r._raw = (lambda *args, r=r: r.log.append(args[5:7]), False, True)
        replays.append(r)
    spec = HitSpec("reduce_scatter", ("x",), (("arg", "x"), ("new", ((2, 4), (4, 1), torch.bfloat16,
                                                                     torch.device("cpu")))), result=(1,), single=True)
    hit, source = compile_hit(spec, tuple(replays), (64, 16), None, threading.Lock(), np.zeros(5, dtype=np.int32),
                              None)
    got = hit(_Comm(), torch.zeros(8, 4))
    assert got.dtype == torch.bfloat16 and got.shape == (2, 4), source
    assert [r.log for r in replays] == [[(False, True)], [(False, True)]], source
