"""Rank bodies of the fusion-pass tests (``tests/inductor/``), run by the CPU rank pool as ``fn(ctx, *args)``:
tensor-parallel models of ``torch.distributed.tensor.parallel.parallelize_module`` and of Hugging Face's
``tp_plan="auto"``, compiled with tpcomm's fusion pass, against the same model unsharded. Weights and inputs
come from seeds, so every rank builds the same unsharded model; the test files hold the assertions.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

import tpcomm
import tpcomm.ops as tops
from tpcomm.inductor.fusion_pass import FusionWarning

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# -- a parallelize_module block stack ----------------------------------------------------------------------
class UnknownRMSNorm(nn.Module):
    """An RMSNorm written in a way the pass does not know (a power -1/2 instead of rsqrt, eps inside the
    mean's sum of squares): the same function, other ops."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        v = x.float()
        return (v * (v.pow(2).mean(-1, keepdim=True) + self.eps) ** -0.5 * self.weight.float()).to(x.dtype)


class FunctionalRMSNorm(nn.RMSNorm):
    """``torch.rms_norm`` called as a function (nn.RMSNorm's parameters)."""

    def forward(self, x):
        return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


NORMS = {"module": nn.RMSNorm, "function": FunctionalRMSNorm, "unknown": UnknownRMSNorm}


#: Group size of the per-group quantiser (the stacks' hidden sizes are multiples of it).
GROUP_SIZE = 16
#: The calibrated scale of the static quantiser: the norm's outputs stay within 448 * 0.02 ~ 9.
STATIC_SCALE = 0.02


class Block(nn.Module):
    """``h, residual -> norm(residual + down(relu(up(h))))``: up column-parallel, down row-parallel (its
    all-reduce then the residual add and the norm: one add+norm site). ``quant`` quantises the norm's
    output with one of tpcomm's FP8 ops (``"token"``, ``"group"``: per group of :data:`GROUP_SIZE`,
    ``"static"``: :data:`STATIC_SCALE`) and feeds the next block the dequantised values; ``"...+out"``
    also returns the norm's output, the FP8 bytes and the scales (the norm's output then has a use beside
    the quantiser)."""

    def __init__(self, hidden: int, inner: int, norm: str, order: str, quant: str | None):
        super().__init__()
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        self.norm = NORMS[norm](hidden, eps=1e-5)
        self.order, self.quant = order, quant
        self.register_buffer("scale", torch.tensor(STATIC_SCALE))

    def forward(self, h, residual):
        y = self.down(torch.relu(self.up(h)))
        residual = residual + y if self.order == "left" else y + residual
        h = self.norm(residual)
        if not self.quant:
            return h, residual, ()
        form = self.quant.removesuffix("+out")
        if form == "token":
            q, scales = tops.per_token_quant_fp8(h)
        elif form == "group":
            q, scales = tops.per_group_quant_fp8(h, GROUP_SIZE)
        else:
            q, scales = tops.static_quant_fp8(h, self.scale), self.scale
        wide = q.float().reshape(h.shape[0], -1, GROUP_SIZE) * scales.reshape(h.shape[0], -1, 1) \
            if form == "group" else q.float() * scales
        more = (h, q, scales) if self.quant.endswith("+out") else ()
        return wide.reshape(h.shape).to(h.dtype), residual, more


class Stack(nn.Module):
    """A row-parallel input projection (its all-reduce, then a norm with no residual: a ``norm`` site, or
    ``norm, sum kept`` when the sum starts the residual stream), then a block per ``(order, quant)`` of
    ``blocks``. Returns the last norm's output and, for each block quantising with ``"...+out"``, its
    unquantised output, FP8 bytes and scales."""

    def __init__(self, hidden: int, inner: int, norm: str, keep_sum: bool, blocks: tuple):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden, bias=False)
        self.norm0 = NORMS[norm](hidden, eps=1e-5)
        self.blocks = nn.ModuleList(Block(hidden, inner, norm, order, quant) for order, quant in blocks)
        self.keep_sum = keep_sum

    def forward(self, x_shard, x):
        s = self.inp(x_shard)
        h, residual = self.norm0(s), (s if self.keep_sum else x)
        extra = []
        for block in self.blocks:
            h, residual, more = block(h, residual)
            extra += list(more)
        return (h, *extra)


def make_stack(seed: int, hidden: int, norm: str, keep_sum: bool, blocks: tuple) -> Stack:
    """The unsharded float32 stack of ``seed`` (weights ~ N(0, 1/fan_in), norm weights around 1, the
    same on every rank)."""
    torch.manual_seed(seed)
    stack = Stack(hidden, 2 * hidden, norm, keep_sum, blocks)
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.25 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return stack


def parallelize(stack: Stack, world_size: int) -> Stack:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    parallelize_module(stack, mesh, {"inp": RowwiseParallel()})
    for block in stack.blocks:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return stack


def stack_case(ctx, seed: int, dtype_name: str, shape: tuple, norm: str, keep_sum: bool = True,
               blocks: tuple = (("left", None), ("right", None)), backend: str = "post_grad_eager",
               dynamic_tokens: tuple = ()):
    """The stack tensor-parallel (``parallelize_module``), run eagerly and compiled with the fusion pass
    (``backend``), against the unsharded stack in float64. ``shape``: the activations, ``(T, H)`` or
    ``(1, T, H)``; ``dynamic_tokens``: more token counts run through the same compiled model
    (``dynamic=True``). Returns the pass's reports (as counts and text), the relative max errors of the
    eager and compiled outputs, the warnings, and for each block quantising with ``"...+out"`` whether
    its FP8 bytes and scales equal those of the standalone quantiser (``tpcomm.per_token_quant_fp8``, ...)
    applied to its unquantised output. With a quantiser the reference is float32 (they take no float64)."""
    torch._dynamo.reset()
    dtype = DTYPES[dtype_name]
    comm = ctx.comm()
    hidden = shape[-1]
    full = make_stack(seed, hidden, norm, keep_sum, blocks)
    quantised = [quant for _, quant in blocks if quant]
    wide = torch.float32 if quantised else torch.float64
    reference = copy.deepcopy(full).to(wide)
    tp = copy.deepcopy(full).to(dtype)
    for block in tp.blocks:  # the static quantiser's scale stays a float32 tensor
        block.scale = torch.tensor(STATIC_SCALE)
    tp = parallelize(tp, ctx.world_size)
    fusion = tpcomm.fusion_pass(comm)
    # no FX graph cache: the pass runs (and reports) on every compilation; one compile thread: no pool of
    # compile workers to start for a few small kernels
    options = {"fx_graph_cache": False} | ({"compile_threads": 1} if backend == "inductor" else {})
    compiled = tpcomm.compile(tp, fusion, backend=backend, fullgraph=True, dynamic=bool(dynamic_tokens) or None,
                              options=options)
    got = {"errors": [], "quant_same": []}
    width = hidden // ctx.world_size
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FusionWarning)
        for i, tokens in enumerate((shape[-2],) + tuple(dynamic_tokens)):
            x = torch.randn(*shape[:-2], tokens, hidden, generator=torch.Generator().manual_seed(seed + 1000 * i))
            x_shard = x[..., ctx.rank * width:(ctx.rank + 1) * width].contiguous()
            ref = reference(x.to(wide), x.to(wide))[0].double()  # unsharded: the projection reads every column
            eager = tp(x_shard.to(dtype), x.to(dtype))
            out = compiled(x_shard.to(dtype), x.to(dtype))
            got["errors"].append({"eager": _rel_error(eager[0], ref), "compiled": _rel_error(out[0], ref),
                                  "vs_eager": _rel_error(out[0], eager[0].double())})
            shown = [quant for quant in quantised if quant.endswith("+out")]
            for quant, h, q, scales in zip(shown, out[1::3], out[2::3], out[3::3]):
                q_ref, s_ref = _quantise(quant, h)
                got["quant_same"].append(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
                                         and torch.equal(scales, s_ref))
    got["warnings"] = [str(w.message) for w in caught if issubclass(w.category, FusionWarning)]
    got["reports"] = [r.counts() for r in fusion.reports]
    got["report_text"] = [str(r) for r in fusion.reports]
    got["unfused"] = [len(r.unfused) for r in fusion.reports]
    return got


def _quantise(quant: str, h: torch.Tensor):
    """The standalone quantiser of ``quant`` (the Triton ops of :mod:`tpcomm.quant`) applied to ``h``."""
    form = quant.removesuffix("+out")
    if form == "token":
        return tpcomm.per_token_quant_fp8(h)
    if form == "group":
        return tpcomm.per_group_quant_fp8(h, GROUP_SIZE)
    scale = torch.tensor(STATIC_SCALE)
    return tpcomm.static_quant_fp8(h, scale), scale


def within_eager(errors: dict, dtype_name: str) -> bool:
    """The compiled output's error against the unsharded model is of eager tensor parallelism's size: at
    most twice eager's, or two units of the dtype's epsilon (relative) where eager's is smaller. The fused
    kernel rounds differently (one rounding where a norm rounds twice, a correctly rounded 1/sqrt where
    rsqrt is not, a float32 rank-order sum), each a rounding of the size eager's own are made of; a wrong
    residual, weight or sum is off by orders of magnitude more."""
    eps = torch.finfo(DTYPES[dtype_name]).eps
    return errors["compiled"] <= max(2 * errors["eager"], 2 * eps)


def _rel_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|, in float64."""
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


# -- Hugging Face transformers' own tensor parallelism -----------------------------------------------------
def hf_case(ctx, path: str, dtype_name: str, tokens: int = 5):
    """The model saved at ``path`` loaded with ``DistributedConfig(tp_size=world_size)`` (transformers shards
    it over the world group by the model's own plan: column- and row-parallel projections, a
    vocabulary-parallel embedding), run eagerly and compiled
    with the fusion pass (``post_grad_eager``), against the unsharded model loaded in float64. Returns the
    pass's report (counts, unfused reasons, text) and the relative max errors of the logits."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    torch._dynamo.reset()
    dtype = DTYPES[dtype_name]
    ids = torch.randint(0, 100, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    tp = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                              distributed_config=DistributedConfig(tp_size=ctx.world_size))
    fusion = tpcomm.fusion_pass(ctx.comm())
    compiled = tpcomm.compile(tp, fusion, backend="post_grad_eager", fullgraph=True,
                              options={"fx_graph_cache": False})
    with torch.no_grad():
        ref = reference(ids).logits
        eager = tp(ids).logits
        out = compiled(ids).logits
    report = fusion.reports[-1]
    return {"counts": report.counts(), "unfused": list(report.unfused.values()), "text": str(report),
            "graphs": len(fusion.reports), "eager": _rel_error(eager, ref), "compiled": _rel_error(out, ref),
            "vs_eager": _rel_error(out, eager.double())}


# -- the pass itself: chaining, its cache key, refusals, groups -------------------------------------------
class Recorder(CustomGraphPass):
    """A pass for the slot: counts the fused ops in each graph it sees."""

    def __init__(self, uuid="recorder"):
        self.seen, self._uuid = [], uuid

    def __call__(self, graph):
        self.seen.append(sum(n.target is torch.ops.tpcomm.fused_add_rmsnorm.default for n in graph.nodes))

    def uuid(self):
        return self._uuid


def _add_norm(group):
    """``rms_norm(all_reduce(x) + residual)`` with funcol's all-reduce on ``group``, as a function to compile
    (a ``(1, H)`` residual broadcasts)."""
    import torch.distributed._functional_collectives as funcol

    weight = 1.0 + 0.25 * torch.randn(32, generator=torch.Generator().manual_seed(3))

    def fn(x, residual):
        r = funcol.all_reduce(x, "sum", group) + residual
        return torch.rms_norm(r, (32,), weight, 1e-6), r

    return fn


def pass_case(ctx):
    """The pass's behaviour around the rewrite, each as a boolean (plus texts to show on failure)."""
    torch._dynamo.reset()
    comm = ctx.comm()
    got, text = {}, {}
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(ctx.rank))
    residual = torch.randn(4, 32, generator=torch.Generator().manual_seed(99))
    fn = _add_norm(dist.group.WORLD)
    with torch.no_grad():
        expected = fn(x, residual)
        # chained: the pass that was in the slot runs after tpcomm's, on the rewritten graph
        before = Recorder()
        out = tpcomm.compile(fn, comm, backend="post_grad_eager",
                             options={"post_grad_custom_post_pass": before, "fx_graph_cache": False})(x, residual)
        got["chained pass ran after the rewrite"] = before.seen == [1]
        got["values"] = all(_rel_error(a, b.double()) < 1e-6 for a, b in zip(out, expected))
        # a pass given to compile() keeps its reports; one that drops the slot's pass is refused
        fusion = tpcomm.fusion_pass(comm, chain=Recorder("other"))
        try:
            tpcomm.compile(fn, fusion, options={"post_grad_custom_post_pass": Recorder()})
            got["a pass that drops the slot's pass is refused"] = False
        except ValueError as e:
            got["a pass that drops the slot's pass is refused"] = "chain=" in str(e)
        torch._dynamo.reset()
        tpcomm.compile(fn, fusion, backend="post_grad_eager", options={"fx_graph_cache": False})(x, residual)
        got["report of a given pass"] = [r.counts() for r in fusion.reports] == [{"add+norm": 1}]
        # the cache key names the handle, the group and the chained passes; no key when a chained pass has none
        key = fusion.uuid()
        got["uuid"] = (key is not None and key[1:] == (comm.handle, comm.group.group_name,
                                                       tuple(range(ctx.world_size)), ("other",))
                       and tpcomm.fusion_pass(comm, chain=lambda g: None).uuid() is None
                       and tpcomm.fusion_pass(comm).uuid()[0] == key[0])
        # a residual that broadcasts is not the fused op's (T, H) residual: refused, the graph runs unfused
        torch._dynamo.reset()
        refusing = tpcomm.fusion_pass(comm)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FusionWarning)
            out = tpcomm.compile(fn, refusing, backend="post_grad_eager",
                                 options={"fx_graph_cache": False})(x, residual[:1])
        text["refused"] = str(refusing.reports[-1])
        got["broadcast residual refused"] = (not refusing.reports[-1].rewrites
                                             and "residual" in text["refused"]
                                             and any(issubclass(w.category, FusionWarning) for w in caught))
        got["refused values"] = all(torch.equal(a, b) for a, b in zip(out, fn(x, residual[:1])))
        # a communicator on another group of the same ranks in the same order sums the same: rewritten
        torch._dynamo.reset()
        same_ranks = tpcomm.Communicator(dist.new_group(list(range(ctx.world_size))))
        other = tpcomm.fusion_pass(same_ranks)
        tpcomm.compile(fn, other, backend="post_grad_eager", options={"fx_graph_cache": False})(x, residual)
        got["same ranks, other group name"] = (same_ranks.group.group_name != comm.group.group_name
                                               and [r.counts() for r in other.reports] == [{"add+norm": 1}])
        same_ranks.close()
    return {"checks": got, "text": text}


# -- examples/tp_compile.py ------------------------------------------------------------------------------------
def example_case(ctx, cfg: dict, path: str):
    """The example's rank body (``tp_compile.run``) on the pool's communicator."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples"))
    import tp_compile

    torch._dynamo.reset()
    return tp_compile.run(tp_compile.Config(**cfg), ctx.comm(), path)
