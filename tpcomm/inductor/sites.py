"""The sites the fusion pass rewrites: each one a search function (what the model's post-grad graph
computes, in plain torch) and a replacement (tpcomm's fused op), traced into an Inductor pattern.

A site starts at ``_c10d_functional.all_reduce(x, "sum", group)`` and its ``wait_tensor``, on the
communicator's group, and ends at an RMSNorm of one of the styles of :mod:`tpcomm.inductor.norms`:

=========================  =============================================  ====================================
kind                       the graph computes                             rewritten to
=========================  =============================================  ====================================
``add+norm``               ``r = s + residual; out = norm(r)``            ``fused_add_rmsnorm(x, residual)``
``norm``                   ``out = norm(s)``, ``s`` used nowhere else      ``fused_add_rmsnorm(x, None)``
``norm, sum kept``         ``out = norm(s)`` and ``s`` used elsewhere      ``fused_add_rmsnorm(x, zeros)``
=========================  =============================================  ====================================

(``s = wait_tensor(all_reduce(x))``.) The residual add may have its operands in either order: the pass
first puts ``s`` first (:func:`put_sum_first`; IEEE addition commutes) and puts back the adds it did not
rewrite, so one pattern serves both orders. Where the graph then quantises
``out`` with one of tpcomm's standalone FP8 ops (:mod:`tpcomm.ops.quant`), the site takes the quantiser
too and becomes ``fused_add_rmsnorm_fp8`` with that quantiser's form, emitting ``out`` as well where the
graph uses it elsewhere.

The zero residual of ``norm, sum kept`` gives the sum itself as ``residual_out`` bit for bit: contract
item 2 makes ``residual_out = T(f32(s) + 0.0)``, and the contract's ``s`` is never -0.0 (item 1: the
accumulator starts at +0.0), the one value that adding +0.0 would change. It costs one extra read of a
``T x H`` zero tensor in the kernel; the fused op keeps one schema for every site.

Patterns are traced with meta tensors (no collective runs), for each dtype the graph's all-reduces carry:
a bf16 norm has ``convert_element_type`` nodes that a float32 one lacks, so float32-only patterns would
match no bf16 site. Every candidate is traced again with its own shapes and dtypes
(``register_replacement``'s check) before it is accepted, so a pattern traced with ``(T, H)`` examples
also finds ``(B, T, H)`` sites and symbolic token counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._inductor import pattern_matcher as pm
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .norms import NormStyle

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
ADD = torch.ops.aten.add.Tensor
#: Activation dtypes the fused kernels take.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The eps of the traced patterns (``scalar_workaround`` turns it into an argument): exact in float32, so
#: ``torch.rms_norm``'s rounding of eps to float32 keeps it, and no other constant of a norm equals it.
PATTERN_EPS = 2.0 ** -20
#: The largest finite float32: the kernels add eps in float32.
FLOAT32_MAX = 3.4028234663852886e38
#: Shapes of the traced examples (any: sizes are checked per candidate).
_T, _H = 4, 64


@dataclass(frozen=True)
class Quant:
    """A standalone FP8 quantiser of :mod:`tpcomm.ops.quant` applied to the norm's output.

    Attributes:
        mode: the fused op's ``quant=``: ``fp8_per_token``, ``fp8_per_group``, ``fp8_per_group_ue8m0``
            or ``fp8_static``.
        fp8_dtype, group_size, column_major_scales: as the quantiser was called.
    """

    mode: str
    fp8_dtype: torch.dtype
    group_size: int = 128
    column_major_scales: bool = False

    @staticmethod
    def of(node: torch.fx.Node) -> "Quant | None":
        """The quantiser a graph node calls, or None for any other node."""
        if node.op != "call_function":
            return None
        if node.target is torch.ops.tpcomm.per_token_quant_fp8.default:
            return Quant("fp8_per_token", node.args[1])
        if node.target is torch.ops.tpcomm.per_group_quant_fp8.default:
            _, group_size, fp8_dtype, column_major, ue8m0 = node.args
            return Quant("fp8_per_group_ue8m0" if ue8m0 else "fp8_per_group", fp8_dtype, group_size, column_major)
        if node.target is torch.ops.tpcomm.static_quant_fp8.default:
            return Quant("fp8_static", node.args[2])
        return None

    @property
    def static(self) -> bool:
        return self.mode == "fp8_static"

    def apply(self, out: torch.Tensor, scale: torch.Tensor | None) -> list:
        """The quantiser as the graph calls it: ``[q, scales]`` (``[q]`` for static FP8)."""
        if self.static:
            return [torch.ops.tpcomm.static_quant_fp8(out, scale, self.fp8_dtype)]
        if self.mode == "fp8_per_token":
            return list(torch.ops.tpcomm.per_token_quant_fp8(out, self.fp8_dtype))
        return list(torch.ops.tpcomm.per_group_quant_fp8(out, self.group_size, self.fp8_dtype,
                                                         self.column_major_scales,
                                                         self.mode == "fp8_per_group_ue8m0"))

    def __str__(self) -> str:
        group = f", group {self.group_size}" if "group" in self.mode else ""
        return f"{self.mode} ({str(self.fp8_dtype).removeprefix('torch.')}{group})"


@dataclass(frozen=True)
class Site:
    """One kind of site, in one norm style.

    Attributes:
        norm: the RMSNorm style.
        residual: ``r = s + residual`` is normalised (else ``s`` itself).
        keeps_sum: no residual, and ``s`` is used elsewhere too (the fused op gets a zero residual and
            its ``residual_out`` replaces ``s``).
        quant: the quantiser after the norm, or None.
        emit_unquantized: with ``quant``: the norm's output is used elsewhere too.
    """

    norm: NormStyle
    residual: bool = False
    keeps_sum: bool = False
    quant: Quant | None = None
    emit_unquantized: bool = False

    @property
    def kind(self) -> str:
        """The site's name in the pass's report: ``add+norm``, ``norm`` or ``norm, sum kept``, then the
        quantiser."""
        kind = "add+norm" if self.residual else "norm, sum kept" if self.keeps_sum else "norm"
        if self.quant is not None:
            kind += f" -> {self.quant}" + (" (+ out)" if self.emit_unquantized else "")
        return kind

    @property
    def optional_outputs(self) -> tuple[int, ...]:
        """Positions of outputs the graph must use outside the site (else a smaller kind applies): the kept
        sum, and ``out`` beside a quantiser."""
        n_quant = 0 if self.quant is None else 1 if self.quant.static else 2
        first = max(n_quant, 1)
        found = [first] if self.quant is not None and self.emit_unquantized else []
        if self.keeps_sum:
            found.append(first + self.emit_unquantized)
        return tuple(found)

    # -- the search function and the replacement ------------------------------------------------------
    def _search(self, group: str, x, residual, weight, eps, scale) -> tuple:
        s = WAIT(ALL_REDUCE(x, "sum", group))
        r = s + residual if self.residual else None
        out = self.norm.fn(s if r is None else r, weight, eps)
        outs = [out] if self.quant is None else self.quant.apply(out, scale) + ([out] if self.emit_unquantized
                                                                                  else [])
        return tuple(outs + ([r] if r is not None else []) + ([s] if self.keeps_sum else []))

    def _replace(self, handle: int, x, residual, weight, eps, scale) -> tuple:
        gemma = self.norm.gemma
        if self.keeps_sum:
            residual = torch.zeros_like(x)
        if self.quant is None:
            outs = torch.ops.tpcomm.fused_add_rmsnorm(handle, x, residual, weight, eps, gemma)
            return tuple(outs) if residual is not None else (outs[0],)
        q = self.quant
        outs = list(torch.ops.tpcomm.fused_add_rmsnorm_fp8(
            handle, x, residual, weight, eps, gemma, q.mode, q.fp8_dtype, q.group_size, q.column_major_scales,
            self.emit_unquantized, scale, False))
        n_quant = 1 if q.static else 2
        quantised, rest = outs[:n_quant], outs[n_quant:]  # rest: [residual_out] + [out]
        residual_out = rest.pop(0) if residual is not None else None
        return tuple(quantised + rest + ([residual_out] if residual_out is not None else []))

    def functions(self, group: str, handle: int):
        """``(search, replace)`` with the argument names the pattern binds: ``x``, ``residual`` (with a
        residual), ``weight``, ``eps``, ``scale`` (static FP8)."""
        search = _with_arguments(self, lambda x, residual, weight, eps, scale:
                                 self._search(group, x, residual, weight, eps, scale))
        replace = _with_arguments(self, lambda x, residual, weight, eps, scale:
                                  self._replace(handle, x, residual, weight, eps, scale))
        return search, replace

    def example_inputs(self, dtype: torch.dtype) -> list:
        """Meta tensors of ``dtype`` to trace the pattern with, in argument order without ``eps`` (which
        ``scalar_workaround`` supplies as :data:`PATTERN_EPS`)."""
        x = torch.empty(_T, _H, dtype=dtype, device="meta")
        inputs = [x] + ([torch.empty_like(x)] if self.residual else []) + [torch.empty(_H, dtype=dtype,
                                                                                        device="meta")]
        if self.quant is not None and self.quant.static:
            inputs.append(torch.empty((), dtype=torch.float32, device="meta"))
        return inputs


def _with_arguments(site: Site, body):
    """``body(x, residual, weight, eps, scale)`` as a function of the arguments ``site`` has (the pattern
    matcher names a pattern's inputs by the function's parameters, and binds every one of them)."""
    static = site.quant is not None and site.quant.static
    if site.residual and static:
        def fn(x, residual, weight, eps, scale):
            return body(x, residual, weight, eps, scale)
    elif site.residual:
        def fn(x, residual, weight, eps):
            return body(x, residual, weight, eps, None)
    elif static:
        def fn(x, weight, eps, scale):
            return body(x, None, weight, eps, scale)
    else:
        def fn(x, weight, eps):
            return body(x, None, weight, eps, None)
    return fn


def sites_of(norms, quant: Quant | None = None) -> list[Site]:
    """Every kind of site for ``norms``, unquantised or with ``quant`` (then with and without ``out``)."""
    shapes = [(True, False), (False, False), (False, True)]
    emits = (False,) if quant is None else (False, True)
    return [Site(norm, residual, keeps_sum, quant, emit) for norm in norms for residual, keeps_sum in shapes
            for emit in emits]


def register(site: Site, dtype: torch.dtype, group: str, handle: int, patterns: pm.PatternMatcherPass,
             check) -> None:
    """Trace ``site`` with ``dtype`` activations into ``patterns``; a candidate is rewritten when
    ``check(match, site)`` accepts it."""
    search, replace = site.functions(group, handle)
    pm.register_replacement(search, replace, site.example_inputs(dtype), pm.fwd_only, patterns,
                            extra_check=lambda match: check(match, site), scalar_workaround={"eps": PATTERN_EPS})


def put_sum_first(waits) -> list[torch.fx.Node]:
    """Turn each ``add(residual, s)`` of a ``wait_tensor`` node ``s`` in ``waits`` into ``add(s, residual)``
    (IEEE addition commutes: the same value, NaN payloads aside), the order the patterns are traced in.
    Returns the adds turned, for :func:`put_back`."""
    turned = []
    for s in waits:
        for user in list(s.users):
            if user.target is ADD and len(user.args) == 2 and not user.kwargs and user.args[1] is s \
                    and user.args[0] is not s:
                user.args = (s, user.args[0])
                turned.append(user)
    return turned


def put_back(turned: list[torch.fx.Node], graph: torch.fx.Graph) -> None:
    """Restore the operand order of the adds :func:`put_sum_first` turned that are still in ``graph``."""
    present = set(graph.nodes)
    for node in turned:
        if node in present:
            node.args = (node.args[1], node.args[0])


# -- the checks before a rewrite ----------------------------------------------------------------------------
def refusal(match: pm.Match, site: Site, device: torch.device) -> str | None:
    """Why the fused op cannot replace this candidate (None: it can). The fused op needs: ``x`` bf16 /
    fp16 / fp32, contiguous, on the communicator's device; the residual of ``x``'s shape and dtype,
    contiguous; ``weight`` ``(H,)`` of a float dtype; ``0 <= eps <= FLT_MAX``; the norm's output of
    ``x``'s shape, dtype and (contiguous) layout, as the op's outputs have; every other node of the site
    used only inside it (the rewrite removes them); an optional output used outside it."""
    x, weight, eps = (_val(match.kwargs.get(k)) for k in ("x", "weight", "eps"))
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES:
        return f"x has dtype {getattr(x, 'dtype', None)}; the fused op takes {', '.join(map(str, DTYPES))}"
    if x.device != device:
        return f"x is on {x.device}, the communicator on {device}"
    if x.dim() < 1 or not _contiguous(x):
        return "x is not contiguous"
    if site.residual:
        residual = _val(match.kwargs.get("residual"))
        if not (_same_shape(residual, x) and residual.dtype == x.dtype and residual.device == x.device
                and _contiguous(residual)):
            return "the residual differs from x in shape, dtype, device or layout"
    if not (isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 1
            and statically_known_true(weight.shape[0] == x.shape[-1]) and weight.device == x.device):
        return "the norm weight is not a float (H,) tensor on x's device"
    if not isinstance(eps, float) or not 0.0 <= eps <= FLOAT32_MAX:
        return f"eps={eps!r} is not a float in [0, FLT_MAX]"
    if site.quant is not None and "group" in site.quant.mode and not statically_known_true(
            x.shape[-1] % site.quant.group_size == 0):
        return f"H is not a multiple of the quantiser's group size {site.quant.group_size}"
    outputs = match.output_nodes()
    # the norm's output (what a quantiser reads) and the residual or sum: what the fused op writes
    norm_out = outputs[0] if site.quant is None else next(n.args[0] for n in match.nodes if Quant.of(n))
    for node in [norm_out] + outputs[len(outputs) - (1 if site.residual or site.keeps_sum else 0):]:
        v = _val(node)
        if not (_same_shape(v, x) and v.dtype == x.dtype and _contiguous(v)):
            return f"{node.name} differs from x in shape, dtype or layout"
    inside = set(match.nodes)
    for node in match.nodes:
        if node not in outputs and any(user not in inside for user in node.users):
            return f"{node.name} is also used outside the site"
    for i in site.optional_outputs:
        if all(user in inside for user in outputs[i].users):
            return f"{outputs[i].name} is used only inside the site"
    return None


def all_reduce_of(match: pm.Match) -> torch.fx.Node | None:
    """The site's all-reduce node."""
    return next((n for n in match.nodes if n.target is ALL_REDUCE), None)


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _same_shape(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and a.dim() == b.dim()
            and all(statically_known_true(p == q) for p, q in zip(a.shape, b.shape)))


def _contiguous(t: torch.Tensor) -> bool:
    """Row-major strides (sizes of 1 ignored), decided without adding a guard on a symbolic size."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not statically_known_true(size == 1) and not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True
