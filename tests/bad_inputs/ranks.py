"""Rank bodies of the bad-input matrix (``tests/bad_inputs/test_bad_inputs.py``): :func:`pool_body` on CPU
ranks (through the pool), :func:`gpu_body` on GPUs (through ``tpcomm.launch``). Importing this touches no GPU.

Every case is a function of a :class:`Kit` (this rank, its device, communicators made on demand) that
makes one bad or unusual call and returns the failures it saw, as strings; the runner records what the
call raised instead (type and message), and how many kernel launches it made (the workspace epochs
advance once per launch, so 0 means the call ran no kernel: the fallback, or nothing at all). The tests
hold the expected outcome of each case; this module only observes.

What a case checks when the call returns:
  * the result against the exact expected value: inputs are small integers (``numerics.SMALL_INT``) from
    seeds every rank knows, so every rank computes the sum, and ``residual_out``, exactly, with
    :func:`tpcomm.reduce_in_rank_order`; ``out`` within the contract's ulps of
    :func:`tpcomm.add_rmsnorm_reference`; NaN where the reference has NaN;
  * guard regions: inputs and ``out`` are views into larger buffers filled with a guard value; the
    parts outside the view (and the whole input buffers) must hold the same bits afterwards;
  * the ranks stay in step: the runner makes a correct call after every case.
"""

from __future__ import annotations

import functools
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist

import tpcomm
from tests.support.numerics import (
    assert_same_values,
    assert_within_ulp,
    bits,
    out_ulp_tolerance,
    rank_input,
    residual_input,
    weight_input,
)

#: A value no result of a case can hold (inputs and sums are within +-4 * SMALL_INT): marks guard regions.
GUARD_VALUE = -77.0
#: Elements of guard on each side of a guarded view (at least 16 bytes for every dtype).
GUARD_PAD = 16


class Kit:
    """What a case gets: this rank, the device, and communicators created on demand (cached).

    ``comm(max_bytes, algo)`` is collective the first time a key is asked for (every rank runs the same
    cases in the same order, so they create it together)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, new_comm: Callable):
        self.rank, self.world_size, self.device = rank, world_size, device
        self._new_comm = new_comm
        self.comms: dict = {}

    def comm(self, max_bytes: int | None = None, algo: str | None = None):
        key = (max_bytes, algo)
        if key not in self.comms:
            self.comms[key] = self._new_comm(max_bytes=max_bytes, algo=algo)
        return self.comms[key]

    def epochs(self) -> dict:
        return {k: c.workspace.epoch() for k, c in self.comms.items() if c.workspace is not None}

    def close_all(self) -> None:
        for c in self.comms.values():
            c.close()
        self.comms.clear()

    # -- inputs -----------------------------------------------------------------------------------------
    def xs(self, seed: int, shape, dtype=torch.bfloat16) -> list[torch.Tensor]:
        """Every rank's small-integer input of case ``seed`` on this device, in rank order."""
        return [rank_input(seed, q, shape, dtype, "int").to(self.device) for q in range(self.world_size)]

    def residual(self, seed: int, shape, dtype=torch.bfloat16) -> torch.Tensor:
        return residual_input(seed, shape, dtype, "int").to(self.device)

    def weight(self, seed: int, hidden: int, dtype=torch.bfloat16) -> torch.Tensor:
        return weight_input(seed, hidden, dtype).to(self.device)


# -- guard regions -----------------------------------------------------------------------------------------
class Guarded:
    """``view``: a tensor with ``t``'s values inside a larger buffer filled with GUARD_VALUE.

    ``layout``: ``flat`` (contiguous, GUARD_PAD elements each side, 16-byte aligned start), ``offset``
    (contiguous, one element in: not 16-byte aligned), ``strided`` (every other column of a twice wider
    buffer, like ``x[:, ::2]``), ``transposed`` (``.t()`` of a transposed contiguous buffer with guard
    rows around it), ``expanded`` (``t``'s first row broadcast with stride 0).
    """

    def __init__(self, t: torch.Tensor, layout: str = "flat"):
        fill = GUARD_VALUE if t.is_floating_point() else -77
        n = t.numel()
        self.layout = layout
        if layout in ("flat", "offset"):
            left = GUARD_PAD if layout == "flat" else 1
            self.buf = torch.full((left + n + GUARD_PAD,), fill, dtype=t.dtype, device=t.device)
            self.view = self.buf[left:left + n].view(t.shape)
            self.view.copy_(t)
            self.outside = torch.ones(self.buf.shape, dtype=torch.bool, device=t.device)
            self.outside[left:left + n] = False
        elif layout == "strided":
            self.buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), fill, dtype=t.dtype, device=t.device)
            self.view = self.buf[..., ::2]
            self.view.copy_(t)
            self.outside = torch.ones(self.buf.shape, dtype=torch.bool, device=t.device)
            self.outside[..., ::2] = False
        elif layout == "transposed":  # t is (T, H): storage (H, T + 2) with guard columns, viewed as (T, H)
            T, H = t.shape
            self.buf = torch.full((H, T + 2), fill, dtype=t.dtype, device=t.device)
            self.view = self.buf[:, 1:T + 1].t()
            self.view.copy_(t)
            self.outside = torch.ones(self.buf.shape, dtype=torch.bool, device=t.device)
            self.outside[:, 1:T + 1] = False
        elif layout == "expanded":
            self.buf = torch.full((GUARD_PAD + t.shape[-1] + GUARD_PAD,), fill, dtype=t.dtype, device=t.device)
            row = self.buf[GUARD_PAD:GUARD_PAD + t.shape[-1]]
            row.copy_(t[0])
            self.view = row.expand(t.shape)
            self.outside = torch.ones(self.buf.shape, dtype=torch.bool, device=t.device)
            self.outside[GUARD_PAD:GUARD_PAD + t.shape[-1]] = False
        else:
            raise ValueError(layout)
        self.before = self.buf.clone()

    def changed_outside(self) -> int:
        """Elements of the guard region whose bits changed."""
        a, b = self.buf, self.before
        if a.is_floating_point():
            a, b = bits(a), bits(b)
        return int(((a != b) & self.outside).sum())

    def changed_anywhere(self) -> int:
        """Elements of the whole buffer (view included) whose bits changed: an input must stay as it was."""
        a, b = self.buf, self.before
        if a.is_floating_point():
            a, b = bits(a), bits(b)
        return int((a != b).sum())


def _catch(fails: list, fn, *args) -> None:
    """Run an ``assert_*`` helper; record its message instead of raising."""
    try:
        fn(*args)
    except AssertionError as e:
        fails.append(str(e))


def _input_untouched(fails: list, name: str, *guards: Guarded) -> None:
    for g in guards:
        n = g.changed_anywhere()
        if n:
            fails.append(f"{name}: {n} elements of an input's buffer ({g.layout}) changed")


def _out_guard(fails: list, name: str, g: Guarded) -> None:
    n = g.changed_outside()
    if n:
        fails.append(f"{name}: {n} elements outside out ({g.layout}) were written")


# -- checks of results ---------------------------------------------------------------------------------------
def check_all_reduce(fails: list, y: torch.Tensor, xs: list, what: str = "all_reduce") -> None:
    """``y`` is the exact sum (bits, NaN matching NaN) of ``xs`` in rank order."""
    ref = tpcomm.reduce_in_rank_order(xs) if xs[0].is_floating_point() else \
        sum(x.to(torch.int64) for x in xs).to(xs[0].dtype)
    if y.is_floating_point():
        _catch(fails, assert_same_values, y.cpu(), ref.cpu(), what)
    elif not torch.equal(y.cpu(), ref.cpu()):
        fails.append(f"{what}: {y.cpu().reshape(-1)[:8].tolist()} != {ref.cpu().reshape(-1)[:8].tolist()}")


def check_fused(fails: list, out, ro, xs: list, res, w, eps: float = 1e-6, gemma: bool = False) -> None:
    """``residual_out`` bit-exact (NaN matching NaN), ``out`` within the contract's ulps of the reference."""
    s = tpcomm.reduce_in_rank_order(xs)
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s, res, w, eps, gemma)
    if res is None:
        if ro is not None:
            fails.append("residual_out is not None without a residual")
    else:
        _catch(fails, assert_same_values, ro.cpu(), ro_ref.cpu(), "residual_out")
    tol = out_ulp_tolerance(xs[0].dtype, xs[0].shape[-1])
    o, r = out.cpu(), out_ref.cpu()
    if o.isinf().any() or r.isinf().any():  # ulp distance of +-Inf is meaningless: compare bits there
        inf = o.isinf() | r.isinf()
        if not torch.equal(bits(o)[inf], bits(r)[inf]):
            fails.append("out: Inf at different places or signs than the reference")
        o, r = o.masked_fill(inf, 0.0), r.masked_fill(inf, 0.0)
    _catch(fails, assert_within_ulp, o, r, tol, "out")


# -- cases ---------------------------------------------------------------------------------------------------
CASES: dict[str, Callable[[Kit], list]] = {}


def case(name: str):
    def register(fn):
        CASES[name] = fn
        return fn
    return register


#: Shape of the layout cases: 3 rows (3 programs), H = 40 (rows padded to 48 in the workspace).
LAYOUT_SHAPE = (3, 40)


def _fused_layout(k: Kit, seed: int, layout: str, algo: str | None, shape=LAYOUT_SHAPE, res_layout=None,
                  dtype=torch.bfloat16) -> list:
    fails: list = []
    xs = k.xs(seed, shape, dtype)
    if layout == "expanded":  # every rank's x is its first row repeated
        xs = [x[:1].expand(shape).clone() for x in xs]
    res = k.residual(seed, shape, dtype)
    w = k.weight(seed, shape[-1], dtype)
    gx, gr = Guarded(xs[k.rank], layout), Guarded(res, res_layout or ("flat" if layout == "expanded" else layout))
    out, ro = k.comm(algo=algo).fused_add_rmsnorm(gx.view, gr.view, w)
    check_fused(fails, out, ro, xs, res, w)
    _input_untouched(fails, "fused", gx, gr)
    return fails


def _all_reduce_layout(k: Kit, seed: int, layout: str, algo: str | None, out_layout: str | None = None,
                       shape=LAYOUT_SHAPE, dtype=torch.bfloat16) -> list:
    fails: list = []
    xs = k.xs(seed, shape, dtype)
    gx = Guarded(xs[k.rank], layout)
    if out_layout is None:
        y = k.comm(algo=algo).all_reduce(gx.view)
        _input_untouched(fails, "all_reduce", gx)
    else:
        go = Guarded(torch.full(shape, float("nan"), dtype=dtype, device=k.device), out_layout)
        y = k.comm(algo=algo).all_reduce(gx.view, out=go.view)
        if y is not go.view:
            fails.append("all_reduce did not return the out it was given")
        _out_guard(fails, "all_reduce", go)
        _input_untouched(fails, "all_reduce", gx)
    check_all_reduce(fails, y, xs)
    return fails


# dtypes --------------------------------------------------------------------------------------------------
@case("all_reduce int32 x")
def _(k):
    fails: list = []
    xs = [x.to(torch.int32) for x in k.xs(10, (3, 40), torch.float32)]
    go = Guarded(torch.zeros(3, 40, dtype=torch.int32, device=k.device))
    y = k.comm().all_reduce(xs[k.rank], out=go.view)
    check_all_reduce(fails, y, xs)
    _out_guard(fails, "all_reduce int32", go)
    return fails


@case("all_reduce int64 x")
def _(k):
    fails: list = []
    xs = [x.to(torch.int64) * (1 << 40) + 1 for x in k.xs(11, (7,), torch.float32)]  # beyond float precision
    y = k.comm().all_reduce(xs[k.rank])
    check_all_reduce(fails, y, xs)
    return fails


@case("fused int32 x")
def _(k):
    x = torch.ones(2, 16, dtype=torch.int32, device=k.device)
    k.comm().fused_add_rmsnorm(x, None, torch.ones(16, device=k.device))
    return ["no exception"]


@case("all_reduce float8_e4m3fn x")
def _(k):
    k.comm().all_reduce(torch.ones(2, 16, device=k.device).to(torch.float8_e4m3fn))
    return ["no exception"]


@case("all_reduce float8_e5m2 x")
def _(k):
    k.comm().all_reduce(torch.ones(2, 16, device=k.device).to(torch.float8_e5m2))
    return ["no exception"]


@case("fused float8_e4m3fn x")
def _(k):
    x = torch.ones(2, 16, device=k.device).to(torch.float8_e4m3fn)
    k.comm().fused_add_rmsnorm(x, None, torch.ones(16, device=k.device))
    return ["no exception"]


@case("all_reduce bits8 x")
def _(k):
    k.comm().all_reduce(torch.zeros(2, 16, dtype=torch.uint8, device=k.device).view(torch.bits8))
    return ["no exception"]


@case("all_gather uint1 x")
def _(k):
    k.comm().all_gather(torch.empty(2, 16, dtype=torch.uint1, device=k.device))
    return ["no exception"]


@case("all_reduce float64 x")
def _(k):
    k.comm().all_reduce(torch.ones(2, 16, dtype=torch.float64, device=k.device))
    return ["no exception"]


@case("fused float8_e4m3fn residual")
def _(k):
    x = torch.ones(2, 16, dtype=torch.bfloat16, device=k.device)
    k.comm().fused_add_rmsnorm(x, x.to(torch.float8_e4m3fn), torch.ones(16, device=k.device))
    return ["no exception"]


@case("fused float8_e4m3fn weight")
def _(k):
    fails: list = []
    xs = k.xs(12, (3, 48))
    res = k.residual(12, (3, 48))
    w = k.weight(12, 48, torch.float32).to(torch.float8_e4m3fn)
    out, ro = k.comm().fused_add_rmsnorm(xs[k.rank], res, w)
    check_fused(fails, out, ro, xs, res, w)
    return fails


@case("fused float64 weight")
def _(k):
    fails: list = []
    xs = k.xs(13, (3, 48))
    res = k.residual(13, (3, 48))
    w = k.weight(13, 48, torch.float64)
    out, ro = k.comm().fused_add_rmsnorm(xs[k.rank], res, w)
    check_fused(fails, out, ro, xs, res, w)
    return fails


@case("fused float32 weight, bfloat16 x")
def _(k):
    fails: list = []
    xs = k.xs(14, (3, 48))
    res = k.residual(14, (3, 48))
    w = k.weight(14, 48, torch.float32)
    out, ro = k.comm().fused_add_rmsnorm(xs[k.rank], res, w)
    check_fused(fails, out, ro, xs, res, w)
    return fails


# empty shapes ------------------------------------------------------------------------------------------------
@case("fused zero tokens (0, H)")
def _(k):
    fails: list = []
    x = torch.empty(0, 48, dtype=torch.bfloat16, device=k.device)
    out, ro = k.comm().fused_add_rmsnorm(x, x.clone(), torch.ones(48, dtype=torch.bfloat16, device=k.device))
    out2, ro2 = k.comm().fused_add_rmsnorm(x, None, torch.ones(48, dtype=torch.bfloat16, device=k.device))
    for name, t in (("out", out), ("residual_out", ro), ("out without residual", out2)):
        if tuple(t.shape) != (0, 48) or t.dtype != torch.bfloat16:
            fails.append(f"{name}: {tuple(t.shape)} {t.dtype}")
    if ro2 is not None:
        fails.append("residual_out without residual is not None")
    return fails


@case("all_reduce zero tokens (0, H), out in a guarded buffer")
def _(k):
    fails: list = []
    x = torch.empty(0, 48, dtype=torch.bfloat16, device=k.device)
    go = Guarded(torch.empty(0, 48, dtype=torch.bfloat16, device=k.device))
    y = k.comm().all_reduce(x, out=go.view)
    if y is not go.view or tuple(y.shape) != (0, 48):
        fails.append(f"all_reduce returned {tuple(y.shape)}")
    _out_guard(fails, "all_reduce", go)
    return fails


@case("fused H = 0 (4, 0)")
def _(k):
    fails: list = []
    x = torch.empty(4, 0, dtype=torch.bfloat16, device=k.device)
    out, ro = k.comm().fused_add_rmsnorm(x, x.clone(), torch.empty(0, dtype=torch.bfloat16, device=k.device))
    for name, t in (("out", out), ("residual_out", ro)):
        if tuple(t.shape) != (4, 0):
            fails.append(f"{name}: {tuple(t.shape)}")
    return fails


@case("fused FP8 per token H = 0 (4, 0)")
def _(k):
    x = torch.empty(4, 0, dtype=torch.bfloat16, device=k.device)
    q, scales, _, _ = k.comm().fused_add_rmsnorm(x, None, torch.empty(0, dtype=torch.bfloat16, device=k.device),
                                                 quant="fp8_per_token")
    fails = [] if tuple(q.shape) == (4, 0) else [f"q: {tuple(q.shape)}"]
    if not torch.equal(scales, torch.ones(4, 1, device=k.device)):  # amax of no element is 0: scale 1
        fails.append(f"scales of empty rows: {scales.flatten().tolist()}, expected 1")
    return fails


@case("all_reduce H = 0 (4, 0)")
def _(k):
    y = k.comm().all_reduce(torch.empty(4, 0, dtype=torch.float32, device=k.device))
    return [] if tuple(y.shape) == (4, 0) else [f"all_reduce returned {tuple(y.shape)}"]


# 3-D ---------------------------------------------------------------------------------------------------------
@case("fused 3-D (B, S, H)")
def _(k):
    fails: list = []
    shape = (2, 3, 40)
    xs = k.xs(20, shape)
    res = k.residual(20, shape)
    w = k.weight(20, 40)
    gx, gr = Guarded(xs[k.rank]), Guarded(res)
    out, ro = k.comm().fused_add_rmsnorm(gx.view, gr.view, w)
    if tuple(out.shape) != shape or tuple(ro.shape) != shape:
        fails.append(f"outputs shaped {tuple(out.shape)}, {tuple(ro.shape)}; expected {shape}")
    check_fused(fails, out.reshape(6, 40), ro.reshape(6, 40), [x.reshape(6, 40) for x in xs],
                res.reshape(6, 40), w)
    _input_untouched(fails, "fused", gx, gr)
    return fails


@case("all_reduce 3-D (B, S, H), out in a guarded buffer")
def _(k):
    return _all_reduce_layout(k, 21, "flat", None, out_layout="flat", shape=(2, 3, 40))


# wrong shapes and dtypes of the other arguments -------------------------------------------------------------
def _fused_bad(k, res_fn=None, w_fn=None):
    x = torch.ones(4, 32, dtype=torch.bfloat16, device=k.device)
    res = res_fn(x) if res_fn else x.clone()
    w = w_fn(x) if w_fn else torch.ones(32, dtype=torch.bfloat16, device=k.device)
    k.comm().fused_add_rmsnorm(x, res, w)
    return ["no exception"]


@case("fused weight (H - 1,)")
def _(k):
    return _fused_bad(k, w_fn=lambda x: torch.ones(31, dtype=x.dtype, device=x.device))


@case("fused weight (1, H)")
def _(k):
    return _fused_bad(k, w_fn=lambda x: torch.ones(1, 32, dtype=x.dtype, device=x.device))


@case("fused weight int32")
def _(k):
    return _fused_bad(k, w_fn=lambda x: torch.ones(32, dtype=torch.int32, device=x.device))


@case("fused residual (T, H / 2)")
def _(k):
    return _fused_bad(k, res_fn=lambda x: x[:, :16].clone())


@case("fused residual (T - 1, H)")
def _(k):
    return _fused_bad(k, res_fn=lambda x: x[:3].clone())


@case("fused residual of x's numel, other shape")
def _(k):
    return _fused_bad(k, res_fn=lambda x: x.reshape(8, 16).clone())


@case("fused residual float16, x bfloat16")
def _(k):
    return _fused_bad(k, res_fn=lambda x: x.to(torch.float16))


@case("all_reduce out of another shape")
def _(k):
    x = torch.ones(4, 32, dtype=torch.bfloat16, device=k.device)
    k.comm().all_reduce(x, out=torch.empty(32, 4, dtype=x.dtype, device=k.device))
    return ["no exception"]


@case("all_reduce out of another dtype")
def _(k):
    x = torch.ones(4, 32, dtype=torch.bfloat16, device=k.device)
    k.comm().all_reduce(x, out=torch.empty(4, 32, dtype=torch.float32, device=k.device))
    return ["no exception"]


@case("all_reduce out with a stride of 0 (expand)")
def _(k):
    x = torch.ones(4, 32, dtype=torch.bfloat16, device=k.device)
    k.comm().all_reduce(x, out=torch.empty(1, 32, dtype=x.dtype, device=k.device).expand(4, 32))
    return ["no exception"]


@case("all_reduce out with overlapping strides (1, 1)")
def _(k):
    x = torch.ones(4, 4, dtype=torch.bfloat16, device=k.device)
    k.comm().all_reduce(x, out=torch.zeros(8, dtype=x.dtype, device=k.device).as_strided((4, 4), (1, 1)))
    return ["no exception"]


# layouts -------------------------------------------------------------------------------------------------------
# Inputs are read by each kernel's own push code (so each layout runs under both algorithms); outputs are
# written by the shared epilogue (kernels/epilogue.py), so output layouts run under the default dispatch.
for _algo in ("lamport", "one_shot"):
    for _lay, _desc in (("strided", "x[:, ::2]"), ("transposed", "x.t()"), ("offset", "x[1:] of a flat buffer")):
        CASES[f"fused {_desc} [{_algo}]"] = (
            lambda k, lay=_lay, algo=_algo: _fused_layout(k, 30, lay, algo))
        CASES[f"all_reduce {_desc} [{_algo}]"] = (
            lambda k, lay=_lay, algo=_algo: _all_reduce_layout(k, 31, lay, algo))
CASES["fused expanded x (stride 0)"] = lambda k: _fused_layout(k, 32, "expanded", None)
CASES["fused x[1:] of a flat buffer, residual[:, ::2]"] = (
    lambda k: _fused_layout(k, 33, "offset", None, res_layout="strided"))
CASES["all_reduce out=x[1:] of a flat buffer"] = (
    lambda k: _all_reduce_layout(k, 34, "flat", None, out_layout="offset"))
CASES["all_reduce out=out[:, ::2]"] = lambda k: _all_reduce_layout(k, 35, "flat", None, out_layout="strided")
CASES["all_reduce out=out.t()"] = lambda k: _all_reduce_layout(k, 36, "flat", None, out_layout="transposed")


def _in_place(k: Kit, algo: str | None, layout: str) -> list:
    fails: list = []
    xs = k.xs(37, LAYOUT_SHAPE)
    g = Guarded(xs[k.rank], layout)
    y = k.comm(algo=algo).all_reduce(g.view, out=g.view)
    if y is not g.view:
        fails.append("all_reduce(x, out=x) did not return x")
    _out_guard(fails, "all_reduce in place", g)
    check_all_reduce(fails, y, xs)
    return fails


CASES["all_reduce in place, x[1:] of a flat buffer"] = lambda k: _in_place(k, None, "offset")
CASES["all_reduce in place, x[:, ::2]"] = lambda k: _in_place(k, None, "strided")


@case("fused strided weight w[::2]")
def _(k):
    fails: list = []
    xs = k.xs(38, (3, 48))
    res = k.residual(38, (3, 48))
    wide = k.weight(38, 96)
    w = wide[::2]
    out, ro = k.comm().fused_add_rmsnorm(xs[k.rank], res, w)
    check_fused(fails, out, ro, xs, res, w.contiguous())
    return fails


# sizes at and past the workspace -----------------------------------------------------------------------------
#: max_bytes of the communicator of the boundary cases: the smallest workspace slot (256 bytes) carries 8 rows
#: of 16 bf16 (32 bytes a row, 16-byte aligned, so no padding) or 128 bf16 elements of a flat all_reduce.
SMALL_MAX_BYTES = 256


def _fused_rows(k: Kit, seed: int, rows: int, H: int, algo: str, max_bytes: int, dtype=torch.bfloat16,
                gemma: bool = False) -> list:
    fails: list = []
    xs = k.xs(seed, (rows, H), dtype)
    res = k.residual(seed, (rows, H), dtype)
    w = k.weight(seed, H, dtype)
    gx, gr = Guarded(xs[k.rank]), Guarded(res)
    out, ro = k.comm(max_bytes, algo).fused_add_rmsnorm(gx.view, gr.view, w, gemma=gemma)
    check_fused(fails, out, ro, xs, res, w, gemma=gemma)
    _input_untouched(fails, "fused", gx, gr)
    return fails


def _all_reduce_n(k: Kit, seed: int, n: int, algo: str, max_bytes: int, dtype=torch.bfloat16) -> list:
    fails: list = []
    xs = k.xs(seed, (n,), dtype)
    go = Guarded(torch.full((n,), float("nan"), dtype=dtype, device=k.device))
    y = k.comm(max_bytes, algo).all_reduce(xs[k.rank], out=go.view)
    check_all_reduce(fails, y, xs)
    _out_guard(fails, "all_reduce", go)
    return fails


for _algo in ("lamport", "one_shot"):
    CASES[f"fused exactly max_bytes (8 x 16 bf16, max_bytes 256) [{_algo}]"] = (
        lambda k, a=_algo: _fused_rows(k, 40, 8, 16, a, SMALL_MAX_BYTES))
    CASES[f"fused one row past max_bytes (9 x 16 bf16, max_bytes 256) [{_algo}]"] = (
        lambda k, a=_algo: _fused_rows(k, 41, 9, 16, a, SMALL_MAX_BYTES))
    CASES[f"all_reduce exactly max_bytes (128 bf16, max_bytes 256) [{_algo}]"] = (
        lambda k, a=_algo: _all_reduce_n(k, 42, 128, a, SMALL_MAX_BYTES))
    CASES[f"all_reduce one element past max_bytes (129 bf16, max_bytes 256) [{_algo}]"] = (
        lambda k, a=_algo: _all_reduce_n(k, 43, 129, a, SMALL_MAX_BYTES))
# 6 rows of 40 bf16 are exactly 480 bytes, but rows are padded to 48 elements in the workspace (16-byte
# aligned starts), so the 512-byte slot carries 5 of them: the call takes two launches.
CASES["fused exactly max_bytes, padded rows (6 x 40 bf16, max_bytes 480)"] = (
    lambda k: _fused_rows(k, 44, 6, 40, None, 480))
CASES["fused one row wider than max_bytes (1 x 80 fp32, max_bytes 256)"] = (
    lambda k: _fused_rows(k, 45, 1, 80, None, SMALL_MAX_BYTES, torch.float32))


# NaN and Inf ---------------------------------------------------------------------------------------------------
def _special(k: Kit, algo: str, dtype, where: str) -> list:
    """NaN / Inf placed in x, the residual or the weight (see SPECIAL_PLACES), all ops compared with the
    reference, NaN matching NaN."""
    fails: list = []
    shape = (3, 16)  # 3 rows: a NaN in row 0 must not reach rows 1 and 2
    xs = k.xs(50, shape, dtype)
    res = k.residual(50, shape, dtype)
    w = k.weight(50, 16, dtype)
    nan, inf = float("nan"), float("inf")
    if where == "x":  # row 0: NaN on rank 0; +Inf on every rank; +Inf and -Inf (sum NaN); row 1 finite
        xs[0][0, 0] = nan
        for q in range(k.world_size):
            xs[q][0, 1] = inf
        xs[0][0, 2], xs[-1][0, 2] = inf, -inf
        xs[0][2, 5] = -inf
    elif where == "residual":
        res[0, 3], res[2, 7] = nan, -inf
    elif where == "weight":
        w[4], w[9] = nan, inf
    elif where == "overflow":  # finite inputs whose sum overflows the dtype: +Inf, as IEEE rounding says
        big = torch.finfo(dtype).max
        for q in range(k.world_size):
            xs[q][1, :] = big
    gx = Guarded(xs[k.rank])
    comm = k.comm(algo=algo)
    y = comm.all_reduce(gx.view)
    check_all_reduce(fails, y, xs)
    out, ro = comm.fused_add_rmsnorm(gx.view, res, w)
    check_fused(fails, out, ro, xs, res, w)
    out2, _ = comm.fused_add_rmsnorm(gx.view, None, w)
    check_fused(fails, out2, None, xs, None, w)
    _input_untouched(fails, "NaN/Inf", gx)
    return fails


# x is read by each kernel's push code (and a NaN must not be taken for Lamport's sentinel): both
# algorithms; the residual and the weight are read by the shared epilogue: the default dispatch.
CASES["NaN/Inf in x bfloat16 [lamport]"] = lambda k: _special(k, "lamport", torch.bfloat16, "x")
CASES["NaN/Inf in x bfloat16 [one_shot]"] = lambda k: _special(k, "one_shot", torch.bfloat16, "x")
CASES["NaN/Inf in x float32"] = lambda k: _special(k, None, torch.float32, "x")
CASES["NaN/Inf in residual bfloat16"] = lambda k: _special(k, None, torch.bfloat16, "residual")
CASES["NaN/Inf in weight bfloat16"] = lambda k: _special(k, None, torch.bfloat16, "weight")
CASES["sum overflows to Inf bfloat16"] = lambda k: _special(k, None, torch.bfloat16, "overflow")
CASES["sum overflows to Inf float16"] = lambda k: _special(k, None, torch.float16, "overflow")
CASES["sum overflows to Inf float32"] = lambda k: _special(k, None, torch.float32, "overflow")


# all_gather and reduce_scatter -----------------------------------------------------------------------------
def check_gather(fails: list, y: torch.Tensor, xs: list, dim: int = 0) -> None:
    """``y`` is every rank's ``x`` concatenated along ``dim`` in rank order, bit for bit."""
    want = torch.cat([x.cpu() for x in xs], dim)
    if y.shape != want.shape or y.dtype != want.dtype:
        fails.append(f"all_gather: {tuple(y.shape)} {y.dtype}, expected {tuple(want.shape)} {want.dtype}")
    elif not torch.equal(y.cpu().contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)):
        fails.append("all_gather: bytes differ from torch.cat of the inputs")


def check_scatter(fails: list, y: torch.Tensor, xs: list, rank: int, dim: int = 0) -> None:
    """``y`` is this rank's ``torch.tensor_split`` share of the exact sum along ``dim``."""
    total = tpcomm.reduce_in_rank_order([x.cpu() for x in xs]) if xs[0].is_floating_point() else \
        sum(x.cpu().to(torch.int64) for x in xs).to(xs[0].dtype)
    want = torch.tensor_split(total, len(xs), dim)[rank]
    if y.shape != want.shape or y.dtype != want.dtype:
        fails.append(f"reduce_scatter: {tuple(y.shape)} {y.dtype}, expected {tuple(want.shape)} {want.dtype}")
    elif y.is_floating_point():
        _catch(fails, assert_same_values, y.cpu(), want, "reduce_scatter")
    elif not torch.equal(y.cpu(), want):
        fails.append("reduce_scatter: differs from the exact share")


def _gather_case(k: Kit, seed: int, shape, layout: str = "flat", dtype=torch.bfloat16, dim: int = 0) -> list:
    fails: list = []
    xs = k.xs(seed, shape, torch.float32)
    xs = [x.to(dtype) for x in xs]
    g = Guarded(xs[k.rank], layout) if dtype.is_floating_point and dtype.itemsize > 1 else None
    y = k.comm().all_gather(g.view if g else xs[k.rank], dim=dim)
    check_gather(fails, y, xs, dim)
    if g:
        _input_untouched(fails, "all_gather", g)
    return fails


def _scatter_case(k: Kit, seed: int, shape, layout: str = "flat", dtype=torch.bfloat16, dim: int = 0) -> list:
    fails: list = []
    xs = [x.to(dtype) for x in k.xs(seed, shape, torch.float32)]
    g = Guarded(xs[k.rank], layout) if dtype.is_floating_point else None
    y = k.comm().reduce_scatter(g.view if g else xs[k.rank], dim=dim)
    check_scatter(fails, y, xs, k.rank, dim)
    if g:
        _input_untouched(fails, "reduce_scatter", g)
    return fails


CASES["all_gather int32 x"] = lambda k: _gather_case(k, 70, (3, 16), dtype=torch.int32)
CASES["all_gather float8_e4m3fn x"] = lambda k: _gather_case(k, 71, (3, 16), dtype=torch.float8_e4m3fn)
CASES["all_gather x[:, ::2]"] = lambda k: _gather_case(k, 72, LAYOUT_SHAPE, "strided")
CASES["all_gather x[1:] of a flat buffer"] = lambda k: _gather_case(k, 73, LAYOUT_SHAPE, "offset")
CASES["all_gather x.t()"] = lambda k: _gather_case(k, 74, LAYOUT_SHAPE, "transposed")
CASES["all_gather 3-D (B, S, H), dim=1"] = lambda k: _gather_case(k, 75, (2, 3, 16), dim=1)
CASES["reduce_scatter int32 x"] = lambda k: _scatter_case(k, 76, (4, 16), dtype=torch.int32)
CASES["reduce_scatter 5 rows (T % W != 0)"] = lambda k: _scatter_case(k, 77, (5, 16))
CASES["reduce_scatter 1 row (fewer rows than ranks)"] = lambda k: _scatter_case(k, 78, (1, 16))
CASES["reduce_scatter x[1:] of a flat buffer"] = lambda k: _scatter_case(k, 79, (4, 16), "offset")
CASES["reduce_scatter x[:, ::2]"] = lambda k: _scatter_case(k, 80, (4, 16), "strided")
CASES["reduce_scatter dim=-1"] = lambda k: _scatter_case(k, 81, (3, 32), dim=-1)


@case("all_gather zero rows (0, H)")
def _(k):
    y = k.comm().all_gather(torch.empty(0, 16, dtype=torch.bfloat16, device=k.device))
    return [] if tuple(y.shape) == (0, 16) else [f"all_gather returned {tuple(y.shape)}"]


@case("reduce_scatter zero rows (0, H)")
def _(k):
    y = k.comm().reduce_scatter(torch.empty(0, 16, dtype=torch.bfloat16, device=k.device))
    return [] if tuple(y.shape) == (0, 16) else [f"reduce_scatter returned {tuple(y.shape)}"]


@case("all_gather 0-dim x")
def _(k):
    k.comm().all_gather(torch.tensor(1.0, device=k.device))
    return ["no exception"]


@case("all_gather dim out of range")
def _(k):
    k.comm().all_gather(torch.ones(2, 16, device=k.device), dim=2)
    return ["no exception"]


@case("reduce_scatter dim not an int")
def _(k):
    k.comm().reduce_scatter(torch.ones(2, 16, device=k.device), dim=1.0)
    return ["no exception"]


@case("reduce_scatter float8_e4m3fn x")
def _(k):
    k.comm().reduce_scatter(torch.ones(2, 16, device=k.device).to(torch.float8_e4m3fn))
    return ["no exception"]


# the full-width QK norm and the MoE finalize: their own arguments -----------------------------------------------
def _qk_bad(k, T=4, q=None, kk=None, q_weight=None, k_weight=None, eps=1e-6, kv_replicas=1, **outs) -> list:
    """``fused_qk_rmsnorm`` of q ``(T, 32)`` and k ``(T, 16)`` bf16 with one argument replaced (a callable
    of the good tensors, or a value); a good call returns zero-row outputs of the right shapes."""
    d, bf = k.device, torch.bfloat16
    good = dict(q=torch.ones(T, 32, dtype=bf, device=d), k=torch.ones(T, 16, dtype=bf, device=d),
                q_weight=torch.ones(32, dtype=bf, device=d), k_weight=torch.ones(16, dtype=bf, device=d))
    args = {n: (f(good) if callable(f) else f) if f is not None else good[n]
            for n, f in (("q", q), ("k", kk), ("q_weight", q_weight), ("k_weight", k_weight))}
    outs = {n: f(args) for n, f in outs.items()}
    qo, ko = k.comm().fused_qk_rmsnorm(args["q"], args["k"], args["q_weight"], args["k_weight"], eps,
                                       kv_replicas=kv_replicas, **outs)
    if T:
        return ["no exception"]
    return [] if (tuple(qo.shape), tuple(ko.shape)) == ((0, 32), (0, 16)) else [f"shapes {qo.shape}, {ko.shape}"]


CASES["qk q float64"] = lambda k: _qk_bad(k, q=lambda g: g["q"].double())
CASES["qk k float32, q bfloat16"] = lambda k: _qk_bad(k, kk=lambda g: g["k"].float())
CASES["qk q 3-D (T, heads, head_dim)"] = lambda k: _qk_bad(k, q=lambda g: g["q"].view(4, 2, 16))
CASES["qk k (T - 1, Hk)"] = lambda k: _qk_bad(k, kk=lambda g: g["k"][:3])
CASES["qk q_weight (Hq - 1,)"] = lambda k: _qk_bad(k, q_weight=lambda g: g["q_weight"][:31])
CASES["qk k_weight float16, k bfloat16"] = lambda k: _qk_bad(k, k_weight=lambda g: g["k_weight"].half())
CASES["qk eps -1"] = lambda k: _qk_bad(k, eps=-1.0)
CASES["qk q_out of k's shape"] = lambda k: _qk_bad(k, q_out=lambda a: torch.empty_like(a["k"]))
CASES["qk q_out overlapping k"] = lambda k: _qk_bad(k, q=lambda g: g["q"][:, :16], q_weight=lambda g: g["k_weight"],
                                                  q_out=lambda a: a["k"])
CASES["qk zero tokens (0, H)"] = lambda k: _qk_bad(k, T=0)


@case("qk H = 0 (4, 0)")
def _(k):
    d, bf = k.device, torch.bfloat16
    e = torch.empty(4, 0, dtype=bf, device=d)
    qo, ko = k.comm().fused_qk_rmsnorm(e, e.clone(), torch.empty(0, dtype=bf, device=d),
                                       torch.empty(0, dtype=bf, device=d))
    return [] if (tuple(qo.shape), tuple(ko.shape)) == ((4, 0), (4, 0)) else [f"shapes {qo.shape}, {ko.shape}"]


@case("qk q (4, 0), k (4, 16)")
def _(k):
    """q without columns: its output is empty; k is normalised over every rank's columns, as the reference."""
    d, bf = k.device, torch.bfloat16
    ks = [t.float().div(8).to(bf) for t in k.xs(41, (4, 16))]  # every rank's k, small integers / 8
    w = k.weight(42, 16)
    e = torch.empty(4, 0, dtype=bf, device=d)
    qo, ko = k.comm().fused_qk_rmsnorm(e, ks[k.rank], torch.empty(0, dtype=bf, device=d), w)
    want = tpcomm.fused_qk_rmsnorm_reference([e.cpu()] * k.world_size, [t.cpu() for t in ks],
                                             [torch.empty(0, dtype=bf)] * k.world_size,
                                             [w.cpu()] * k.world_size)[k.rank][1]
    fails = [] if tuple(qo.shape) == (4, 0) else [f"q_out: {tuple(qo.shape)}"]
    if not torch.equal(bits(ko.cpu()), bits(want)):
        fails.append("k_out differs from fused_qk_rmsnorm_reference")
    return fails


CASES["qk kv_replicas 3 (not a divisor of the world size)"] = lambda k: _qk_bad(k, kv_replicas=3)
CASES["qk kv_replicas 0"] = lambda k: _qk_bad(k, kv_replicas=0)
CASES["qk kv_replicas 2.0 (a float)"] = lambda k: _qk_bad(k, kv_replicas=2.0)


def _moe_bad(k, finalize_only=False, T=3, **change) -> list:
    """``fused_moe_finalize_add_rmsnorm`` (or ``tpcomm.moe_finalize``) of T tokens, K = 2 slots, H = 32 bf16
    in the permuted layout with a shared output, one argument replaced (a callable of the good ones)."""
    import tpcomm

    d, bf = k.device, torch.bfloat16
    args = dict(expert_out=torch.ones(T * 2, 32, dtype=bf, device=d), topk_weights=torch.ones(T, 2, device=d),
                index=torch.arange(T * 2, dtype=torch.int32, device=d).view(T, 2),
                shared_out=torch.ones(T, 32, dtype=bf, device=d), residual=torch.ones(T, 32, dtype=bf, device=d),
                weight=torch.ones(32, dtype=bf, device=d), scaling=1.0)
    args.update({n: f(args) for n, f in change.items()})
    if finalize_only:
        del args["residual"], args["weight"]
        outs = [tpcomm.moe_finalize(**args)]
    else:
        outs = k.comm().fused_moe_finalize_add_rmsnorm(**args)
    if T:
        return ["no exception"]
    return [] if all(tuple(o.shape) == (0, 32) for o in outs) else [f"shapes {[o.shape for o in outs]}"]


CASES["moe expert_out float64"] = lambda k: _moe_bad(k, expert_out=lambda a: a["expert_out"].double())
CASES["moe expert_out (T, K, H) with an index"] = lambda k: _moe_bad(
    k, expert_out=lambda a: a["expert_out"].view(3, 2, 32))
CASES["moe expert_out (M, H) without an index"] = lambda k: _moe_bad(k, index=lambda a: None)
CASES["moe topk_weights (T, K + 1)"] = lambda k: _moe_bad(k, topk_weights=lambda a: torch.ones(3, 3, device=k.device))
CASES["moe topk_weights int32"] = lambda k: _moe_bad(k, topk_weights=lambda a: a["topk_weights"].int())
CASES["moe index float32"] = lambda k: _moe_bad(k, index=lambda a: a["index"].float())
CASES["moe index (T, K + 1)"] = lambda k: _moe_bad(k, index=lambda a: torch.zeros(3, 3, dtype=torch.int32,
                                                                                   device=k.device))
CASES["moe shared_out (T, H - 1)"] = lambda k: _moe_bad(k, shared_out=lambda a: a["shared_out"][:, :31])
CASES["moe shared_out float16, expert_out bfloat16"] = lambda k: _moe_bad(
    k, shared_out=lambda a: a["shared_out"].half())
CASES["moe scaling inf"] = lambda k: _moe_bad(k, scaling=lambda a: float("inf"))
CASES["moe residual (T - 1, H)"] = lambda k: _moe_bad(k, residual=lambda a: a["residual"][:2])
CASES["moe weight (H - 1,)"] = lambda k: _moe_bad(k, weight=lambda a: a["weight"][:31])
CASES["moe zero tokens (0, H)"] = lambda k: _moe_bad(k, T=0)
CASES["moe_finalize topk_weights (T, K + 1)"] = lambda k: _moe_bad(k, True, topk_weights=lambda a: torch.ones(
    3, 3, device=k.device))
CASES["moe_finalize index int16"] = lambda k: _moe_bad(k, True, index=lambda a: a["index"].short())
CASES["moe_finalize zero tokens (0, H)"] = lambda k: _moe_bad(k, True, T=0)


# devices (GPU only) ----------------------------------------------------------------------------------------------
def _on(k: Kit, which: str) -> torch.device:
    """``cpu``, or the other GPU of a 2-GPU machine."""
    if which == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", (k.device.index + 1) % torch.cuda.device_count())


def _device_case(k: Kit, op: str, arg: str, where: str) -> list:
    dev = _on(k, where)
    x = torch.ones(4, 32, dtype=torch.bfloat16, device=k.device)
    w = torch.ones(32, dtype=torch.bfloat16, device=k.device)
    args = {"x": x, "residual": x.clone(), "weight": w, "out": torch.empty_like(x)}
    args[arg] = args[arg].to(dev)
    if op == "all_reduce":
        k.comm().all_reduce(args["x"], out=args["out"])
    else:
        k.comm().fused_add_rmsnorm(args["x"], args["residual"], args["weight"])
    return ["no exception"]


#: (op, argument, where): GPU-only cases (a CPU tensor, or one on the other GPU).
DEVICE_CASES = [(op, arg, where) for where in ("cpu", "other GPU")
                for op, arg in (("all_reduce", "x"), ("all_reduce", "out"), ("fused", "x"),
                                ("fused", "residual"), ("fused", "weight"))]
GPU_ONLY: dict[str, Callable] = {
    f"{op} {arg} on {where}": (lambda k, o=op, a=arg, w=where: _device_case(k, o, a, w))
    for op, arg, where in DEVICE_CASES}


# -- the runner ------------------------------------------------------------------------------------------------
def run_cases(rank: int, world_size: int, device: torch.device, names: list[str], new_comm: Callable,
              extra: dict | None = None) -> dict:
    """Run the cases ``names`` (from CASES, or ``extra``) in order on this rank.

    Returns ``{name: {"raised": (type, message) | None, "failures": [...], "launches": int,
    "in_step": bool}}``. ``launches`` counts kernel launches (workspace epoch steps) of the call;
    ``in_step`` says a correct all_reduce right after the case gave the right sum (the ranks still
    agree). A case that left the communicators out of step (a timeout, or an unexpected error)
    closes them and every rank starts the next case on fresh ones.
    """
    table = dict(CASES, **(extra or {}))
    kit = Kit(rank, world_size, device, new_comm)
    results = {}
    for name in names:
        kit.comm()  # every rank has the default communicator before the epochs are read
        before = kit.epochs()
        summary = {"raised": None, "failures": [], "launches": None, "in_step": False}
        t0 = time.perf_counter()
        try:
            summary["failures"] = list(table[name](kit))
        except Exception as e:  # the test decides whether this exception (type and message) is right
            summary["raised"] = (type(e).__name__, str(e))
            if not isinstance(e, (TypeError, ValueError)):
                summary["failures"].append(traceback.format_exc())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        after = kit.epochs()
        summary["seconds"] = time.perf_counter() - t0
        summary["launches"] = sum(after[key] - before.get(key, 1) for key in after)
        try:
            for c in kit.comms.values():
                c.check()
            if summary["raised"] or summary["failures"]:  # a returned result already shows the ranks agree
                y = kit.comm().all_reduce(torch.full((2, 16), float(rank + 1), device=device))
                summary["in_step"] = bool((y.cpu() == sum(range(1, world_size + 1))).all())
            else:
                summary["in_step"] = True
        except Exception:
            summary["failures"].append("the call after the case failed:\n" + traceback.format_exc())
        if summary["failures"] and not summary["in_step"]:
            kit.close_all()
            dist.barrier()
        results[name] = summary
    kit.close_all()
    return results


# -- bodies ----------------------------------------------------------------------------------------------------
#: Kernel timeout of the matrix's communicators: no case waits for a peer that does not come, so this only
#: bounds how long a rank that fell out of step waits before the runner starts afresh.
KIT_TIMEOUT_S = 20.0


def pool_body(ctx, names: list[str]) -> dict:
    """Pool body (CPU ranks): run ``names`` on fresh communicators of this rank."""
    from tests.support.harness import new_communicator

    return run_cases(ctx.rank, ctx.world_size, torch.device("cpu"), names,
                     functools.partial(new_communicator, timeout_s=KIT_TIMEOUT_S))


def gpu_body(rank: int, world_size: int, names: list[str]) -> dict:
    """Launch body (one GPU per rank): the CPU matrix ``names``, then the GPU-only cases and sizes."""
    from tests.support.harness import new_communicator

    device = torch.device("cuda", torch.cuda.current_device())
    extra = dict(GPU_ONLY, **GPU_SIZES)
    return run_cases(rank, world_size, device, list(names) + list(extra),
                     functools.partial(new_communicator, timeout_s=KIT_TIMEOUT_S), extra=extra)


# sizes of the GPU workspace: the default 32 MiB and the Lamport limit ---------------------------------------
def _gpu_sizes() -> dict:
    from tpcomm import dispatch
    from tpcomm.communicator import DEFAULT_MAX_BYTES_CUDA

    H = 4096
    lam_rows = dispatch.LAMPORT_MAX_BYTES // (2 * H)  # 512 rows of 4096 bf16
    ws_rows = DEFAULT_MAX_BYTES_CUDA // (2 * H)  # 4096 rows
    return {
        f"fused exactly the Lamport limit ({lam_rows} x {H} bf16)":
            lambda k: _fused_rows(k, 60, lam_rows, H, None, None),
        f"fused one row past the Lamport limit ({lam_rows + 1} x {H} bf16)":
            lambda k: _fused_rows(k, 61, lam_rows + 1, H, None, None),
        f"fused exactly the default max_bytes ({ws_rows} x {H} bf16) [one_shot]":
            lambda k: _fused_rows(k, 62, ws_rows, H, "one_shot", None),
        f"fused one row past the default max_bytes ({ws_rows + 1} x {H} bf16) [one_shot]":
            lambda k: _fused_rows(k, 63, ws_rows + 1, H, "one_shot", None),
        f"all_reduce exactly the default max_bytes ({ws_rows * H} bf16) [one_shot]":
            lambda k: _all_reduce_n(k, 64, ws_rows * H, "one_shot", None),
        f"all_reduce one element past the default max_bytes ({ws_rows * H + 1} bf16) [one_shot]":
            lambda k: _all_reduce_n(k, 65, ws_rows * H + 1, "one_shot", None),
    }


GPU_SIZES = _gpu_sizes()


# -- the expected outcome of every case (the table of docs/reliability.md) ---------------------------------------
#: How a call that launches no kernel gets its result.
FALLBACK = "through the torch.distributed fallback"
GATHERED = "the all-gather kernel moves every rank's integers, summed exactly in int64"
BYTES = "the all-gather kernel copies the bytes"
NARROW = "rows under 16 elements: the all-gather kernel, then the rank-order sum"
EMPTY = "empty outputs of the right shapes, no communication"
EMPTY_SCALES_1 = "empty outputs, scales 1 (the amax of no element is 0), no communication"


def result(launches: int | None, how: str | None = None) -> dict:
    """The call returns the right result after ``launches`` kernel launches (0: ``how`` says why: the
    torch.distributed fallback, or nothing to send; None: any number >= 1, where the default dispatch
    may pick an algorithm with another launch count)."""
    return {"kind": "result", "launches": launches, "how": how}


def raises(exc: type, arg: str, op: str) -> dict:
    """The call raises ``exc`` with a message prefixed ``op:`` that names ``arg``."""
    return {"kind": "raises", "type": exc.__name__, "arg": arg, "op": op}


AR, FU = "all_reduce", "fused_add_rmsnorm"
QK, MOE = "fused_qk_rmsnorm", "fused_moe_finalize_add_rmsnorm"
EXPECTED: dict[str, dict] = {
    "all_reduce int32 x": result(1, GATHERED),
    "all_reduce int64 x": result(1, GATHERED),
    "fused int32 x": raises(TypeError, "x", FU),
    "all_reduce float8_e4m3fn x": raises(TypeError, "x", AR),
    "all_reduce float8_e5m2 x": raises(TypeError, "x", AR),
    "fused float8_e4m3fn x": raises(TypeError, "x", FU),
    "all_reduce float64 x": raises(TypeError, "x", AR),
    "all_reduce bits8 x": raises(TypeError, "x", AR),
    "all_gather uint1 x": raises(TypeError, "x", "all_gather"),
    "fused float8_e4m3fn residual": raises(TypeError, "residual", FU),
    "fused float8_e4m3fn weight": result(1),
    "fused float64 weight": result(1),
    "fused float32 weight, bfloat16 x": result(1),
    "fused zero tokens (0, H)": result(0, EMPTY),
    "all_reduce zero tokens (0, H), out in a guarded buffer": result(0, EMPTY),
    "fused H = 0 (4, 0)": result(0, EMPTY),
    "fused FP8 per token H = 0 (4, 0)": result(0, EMPTY_SCALES_1),
    "all_reduce H = 0 (4, 0)": result(0, EMPTY),
    "fused 3-D (B, S, H)": result(1),
    "all_reduce 3-D (B, S, H), out in a guarded buffer": result(1),
    "fused weight (H - 1,)": raises(ValueError, "weight", FU),
    "fused weight (1, H)": raises(ValueError, "weight", FU),
    "fused weight int32": raises(TypeError, "weight", FU),
    "fused residual (T, H / 2)": raises(ValueError, "residual", FU),
    "fused residual (T - 1, H)": raises(ValueError, "residual", FU),
    "fused residual of x's numel, other shape": raises(ValueError, "residual", FU),
    "fused residual float16, x bfloat16": raises(TypeError, "residual", FU),
    "all_reduce out of another shape": raises(ValueError, "out", AR),
    "all_reduce out of another dtype": raises(ValueError, "out", AR),
    "all_reduce out with a stride of 0 (expand)": raises(ValueError, "out", AR),
    "all_reduce out with overlapping strides (1, 1)": raises(ValueError, "out", AR),
    **{name: result(1) for name in CASES if "[lamport]" in name or "[one_shot]" in name
       if "x[" in name or "x.t()" in name},
    "fused expanded x (stride 0)": result(1),
    "fused x[1:] of a flat buffer, residual[:, ::2]": result(1),
    "all_reduce out=x[1:] of a flat buffer": result(1),
    "all_reduce out=out[:, ::2]": result(1),
    "all_reduce out=out.t()": result(1),
    "all_reduce in place, x[1:] of a flat buffer": result(1),
    "all_reduce in place, x[:, ::2]": result(1),
    "fused strided weight w[::2]": result(1),
    **{name: result(2 if "past" in name else 1) for name in CASES if "max_bytes 256) [" in name},
    "fused exactly max_bytes, padded rows (6 x 40 bf16, max_bytes 480)": result(2),
    # the fallback's one launch: its signature through the all-gather kernel, before the collective
    "fused one row wider than max_bytes (1 x 80 fp32, max_bytes 256)": result(1, FALLBACK),
    **{name: result(3) for name in CASES if name.startswith(("NaN/Inf", "sum overflows"))},
    "all_gather int32 x": result(1, BYTES),
    "all_gather float8_e4m3fn x": result(1, BYTES),
    "all_gather x[:, ::2]": result(1),
    "all_gather x[1:] of a flat buffer": result(1),
    "all_gather x.t()": result(1),
    "all_gather 3-D (B, S, H), dim=1": result(1),
    "reduce_scatter int32 x": result(1, GATHERED),
    "reduce_scatter 5 rows (T % W != 0)": result(1),
    "reduce_scatter 1 row (fewer rows than ranks)": result(1),
    "reduce_scatter x[1:] of a flat buffer": result(1),
    "reduce_scatter x[:, ::2]": result(1),
    # moved to rows of 3 elements: narrower than MIN_SCATTER_ROW (dispatch.py), so the fallback
    "reduce_scatter dim=-1": result(1, NARROW),
    "all_gather zero rows (0, H)": result(0, EMPTY),
    "reduce_scatter zero rows (0, H)": result(0, EMPTY),
    "all_gather 0-dim x": raises(ValueError, "x", "all_gather"),
    "all_gather dim out of range": raises(ValueError, "dim", "all_gather"),
    "reduce_scatter dim not an int": raises(TypeError, "dim", "reduce_scatter"),
    "reduce_scatter float8_e4m3fn x": raises(TypeError, "x", "reduce_scatter"),
    "qk q float64": raises(TypeError, "q", QK),
    "qk k float32, q bfloat16": raises(TypeError, "k", QK),
    "qk q 3-D (T, heads, head_dim)": raises(ValueError, "q", QK),
    "qk k (T - 1, Hk)": raises(ValueError, "k", QK),
    "qk q_weight (Hq - 1,)": raises(ValueError, "q_weight", QK),
    "qk k_weight float16, k bfloat16": raises(TypeError, "k_weight", QK),
    "qk eps -1": raises(ValueError, "eps", QK),
    "qk q_out of k's shape": raises(ValueError, "q_out", QK),
    "qk q_out overlapping k": raises(ValueError, "q_out", QK),
    "qk zero tokens (0, H)": result(0, EMPTY),
    "qk H = 0 (4, 0)": result(0, EMPTY),
    "qk q (4, 0), k (4, 16)": result(None),
    "qk kv_replicas 3 (not a divisor of the world size)": raises(ValueError, "kv_replicas", QK),
    "qk kv_replicas 0": raises(ValueError, "kv_replicas", QK),
    "qk kv_replicas 2.0 (a float)": raises(TypeError, "kv_replicas", QK),
    "moe expert_out float64": raises(TypeError, "expert_out", MOE),
    "moe expert_out (T, K, H) with an index": raises(ValueError, "expert_out", MOE),
    "moe expert_out (M, H) without an index": raises(ValueError, "expert_out", MOE),
    "moe topk_weights (T, K + 1)": raises(ValueError, "topk_weights", MOE),
    "moe topk_weights int32": raises(TypeError, "topk_weights", MOE),
    "moe index float32": raises(TypeError, "index", MOE),
    "moe index (T, K + 1)": raises(ValueError, "index", MOE),
    "moe shared_out (T, H - 1)": raises(ValueError, "shared_out", MOE),
    "moe shared_out float16, expert_out bfloat16": raises(TypeError, "shared_out", MOE),
    "moe scaling inf": raises(ValueError, "scaling", MOE),
    "moe residual (T - 1, H)": raises(ValueError, "residual", MOE),
    "moe weight (H - 1,)": raises(ValueError, "weight", MOE),
    "moe zero tokens (0, H)": result(0, EMPTY),
    "moe_finalize topk_weights (T, K + 1)": raises(ValueError, "topk_weights", "moe_finalize"),
    "moe_finalize index int16": raises(TypeError, "index", "moe_finalize"),
    "moe_finalize zero tokens (0, H)": result(0, EMPTY),
}

#: GPU-only cases: every tensor argument on the CPU or on the other GPU is refused, naming it.
GPU_EXPECTED: dict[str, dict] = {
    **{f"{op} {arg} on {where}": raises(ValueError, arg, AR if op == "all_reduce" else FU)
       for op, arg, where in DEVICE_CASES},
    **{name: result(2 if "past the default" in name and "[one_shot]" in name else
                    1 if "[one_shot]" in name else None) for name in GPU_SIZES},
}


def describe(outcome: dict) -> str:
    """What the docs table says for an outcome."""
    if outcome["kind"] == "raises":
        return f"`{outcome['type']}` naming `{outcome['arg']}`"
    n = outcome["launches"]
    if outcome["how"] == FALLBACK:
        return f"right result {FALLBACK} (after the one launch that checks the peers make the same call)"
    if n == 0:
        return outcome["how"] if outcome["how"] in (EMPTY, EMPTY_SCALES_1) else f"right result {outcome['how']}"
    if n is None:
        return "right result through a kernel"
    return f"right result through a kernel ({n} launch{'es' if n > 1 else ''})"


def doc_row(name: str, outcome: dict, gpu: bool = False) -> str:
    """The row of ``name`` in the table of docs/reliability.md: op, input, what happens."""
    for prefix, op in (("all_reduce ", "all_reduce"), ("all_gather ", "all_gather"),
                       ("reduce_scatter ", "reduce_scatter"), ("fused ", "fused_add_rmsnorm"), ("qk ", QK),
                       ("moe ", MOE), ("moe_finalize ", "moe_finalize")):
        if name.startswith(prefix):
            return _row(op, name[len(prefix):], outcome, gpu, name)
    return _row("all_reduce and fused (with and without residual)", name, outcome, gpu, name)


def _row(op: str, what: str, outcome: dict, gpu: bool, name: str) -> str:
    # the page is for users: the forced algorithm in parentheses ("[lamport]" would read as a link), no test id
    what = what.replace("[lamport]", "(lamport)").replace("[one_shot]", "(one_shot)")
    return f"| {op} | {what} | {describe(outcome)} |"


def doc_table() -> str:
    """The whole table (CPU rows, then GPU-only rows), as docs/reliability.md holds it."""
    lines = ["| op | input | what happens |", "|---|---|---|"]
    lines += [doc_row(n, o) for n, o in EXPECTED.items()]
    lines += [doc_row(n, o, gpu=True) for n, o in GPU_EXPECTED.items()]
    return "\n".join(lines)


if __name__ == "__main__":  # print the table for docs/reliability.md: python -m tests.bad_inputs.ranks
    print(doc_table())
