"""``FusionPass``: the Inductor post-grad pass that rewrites a communicator's all-reduce sites into
tpcomm's fused ops (the sites: :mod:`tpcomm.inductor.sites`).

Where it runs: ``post_grad_custom_post_pass``, after Inductor's own post-grad pattern passes and before
``reinplace_inplaceable_ops``, which would turn the functional ``all_reduce`` and ``add`` into in-place
ops that no pattern of a functional graph matches.

What it does to one graph:

1. finds the ``_c10d_functional.all_reduce(x, "sum", group)`` nodes whose group is the communicator's
   (the graph names a group only by its string name: the communicator's own, or a group of the same
   global ranks in the same order, whose sum is the same);
2. puts each sum first in the residual adds that follow them (:func:`tpcomm.inductor.sites.put_sum_first`);
3. takes the Inductor ``PatternMatcherPass`` of the communicator and group, shared by every pass of that
   communicator in the process, registering in it what the graph needs and it lacks: every site kind in
   every norm style for each dtype of the all-reduces, and the quantised kinds for each FP8 quantiser
   configuration the graph holds (tracing a site takes tens of milliseconds);
4. applies it: each candidate is traced again with its own shapes and dtypes and checked
   (:func:`tpcomm.inductor.sites.refusal`) before it is rewritten; then puts back the operand order of
   the adds it did not rewrite;
5. reports (:class:`FusionReport`: logged on ``tpcomm.inductor`` at INFO, kept in ``FusionPass.reports``)
   and warns (:class:`FusionWarning`) when the graph held all-reduces on the group and none was
   rewritten;
6. runs the pass that was in the slot before it (``chain``), if any.

A rewritten graph calls the communicator through its handle (:mod:`tpcomm.ops`), so ``uuid()`` (the key
of Inductor's FX graph cache) names the handle, the group and the pass's source: a cached graph is
reused only where it would call the same group through the same handle.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._inductor import pattern_matcher as pm
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import ops as _ops  # noqa: F401  (registers the tpcomm:: ops that the sites and replacements name)
from ..ops.registry import lookup
from ..version import __version__
from . import sites as _sites
from .norms import NORM_STYLES

log = logging.getLogger("tpcomm.inductor")

#: The files whose text decides what the pass rewrites (part of ``uuid()``).
_SOURCES = tuple(os.path.join(os.path.dirname(__file__), f) for f in ("fusion_pass.py", "norms.py", "sites.py"))
#: Why an all-reduce on the group stayed as it was when no pattern reached the checks.
NO_PATTERN = "what follows its wait_tensor is not an RMSNorm the pass knows (norm styles: hf, torch, gemma)"


class FusionWarning(UserWarning):
    """A graph held all-reduces on the communicator's group and the fusion pass rewrote none of them (the
    model runs unfused, with the values of the graph as traced)."""


@dataclass
class Rewrite:
    """One rewritten site: its kind (:attr:`tpcomm.inductor.sites.Site.kind`), norm style, dtype, shape
    of ``x`` and the name of the all-reduce node it replaced."""

    kind: str
    norm: str
    dtype: str
    shape: tuple
    all_reduce: str

    def __str__(self) -> str:
        return f"{self.all_reduce}: {self.kind} ({self.norm}, {self.dtype}, {list(self.shape)})"


@dataclass
class FusionReport:
    """What the pass did to one graph.

    Attributes:
        group: the communicator's group name.
        all_reduces: sum all-reduces on the group before the pass.
        rewrites: the sites rewritten, in the order they were found.
        unfused: every all-reduce on the group left as it was, by node name, with the reason.
        other_groups: names of the other groups the graph all-reduces on (never rewritten).
    """

    group: str
    all_reduces: int = 0
    rewrites: list[Rewrite] = field(default_factory=list)
    unfused: dict[str, str] = field(default_factory=dict)
    other_groups: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Rewritten sites by kind."""
        found: dict[str, int] = {}
        for r in self.rewrites:
            found[r.kind] = found.get(r.kind, 0) + 1
        return found

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.counts().items()) or "none"
        lines = [f"tpcomm fusion pass: {len(self.rewrites)} of {self.all_reduces} all-reduce(s) on group "
                 f"{self.group!r} rewritten ({kinds})"]
        lines += [f"  fused   {r}" for r in self.rewrites]
        lines += [f"  unfused {name}: {why}" for name, why in self.unfused.items()]
        if self.other_groups:
            lines.append(f"  all-reduces on other groups, left alone: {', '.join(self.other_groups)}")
        return "\n".join(lines)


class FusionPass(CustomGraphPass):
    """Inductor ``post_grad_custom_post_pass`` that rewrites every ``all_reduce -> wait -> [+ residual] ->
    RMSNorm [-> FP8 quantiser]`` site on ``comm``'s group into ``torch.ops.tpcomm.fused_add_rmsnorm``
    (or ``fused_add_rmsnorm_fp8``), which runs ``comm``'s fused kernel.

    Plain torch: nothing changes in what the graph computes but its rounding, which becomes the numerics
    contract's (docs/numerics.md; docs/compile.md says by how much it can differ from the graph's own).
    Inference only (the fused ops have no autograd formula). Made by :func:`tpcomm.fusion_pass`.

    Args:
        comm: the :class:`~tpcomm.Communicator` whose group's all-reduces are rewritten; the pass keeps it
            alive, and a rewritten graph calls it.
        chain: the pass that was in the slot before (a ``CustomGraphPass``, a callable of the graph, or a
            list of them), run after this one on the rewritten graph; None for none.
    Attributes:
        reports: a :class:`FusionReport` per graph the pass has run on, in order.
    Raises:
        TypeError: ``comm`` is not a Communicator.
        ValueError: ``comm`` has no ``torch.distributed`` group (a :mod:`tpcomm.loopback` rank), or it is
            closed.
    """

    def __init__(self, comm, chain=None):
        from ..communicator import Communicator

        if not isinstance(comm, Communicator):
            raise TypeError(f"fusion_pass: comm must be a tpcomm.Communicator, got {type(comm).__name__}")
        if comm._closed:
            raise ValueError("fusion_pass: comm is closed; make the pass from an open Communicator")
        if comm.group is None:
            raise ValueError("fusion_pass: comm has no torch.distributed group (a loopback rank); a compiled "
                             "graph names its all-reduces by a process group")
        self.comm = comm
        self.handle = comm.handle
        self.device = comm.device
        self.group_name = comm.group.group_name
        self.ranks = tuple(dist.get_process_group_ranks(comm.group))
        self.chain = tuple(chain) if isinstance(chain, (list, tuple)) else () if chain is None else (chain,)
        self.reports: list[FusionReport] = []
        self._same_group: dict[str, bool] = {}

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.reports.append(self._rewrite(graph))
        for chained in self.chain:
            chained(graph)

    def uuid(self):
        """The FX graph cache's key of this pass: the source of the pass, tpcomm's version, the handle, the
        group (name and global ranks) and the chained passes' uuids; None (no caching) when a chained
        pass has none."""
        chained = tuple(p.uuid() if callable(getattr(p, "uuid", None)) else None for p in self.chain)
        if any(u is None for u in chained):
            return None
        return (_source_hash(), self.handle, self.group_name, self.ranks, chained)

    # -- one graph ---------------------------------------------------------------------------------------
    def _rewrite(self, graph: torch.fx.Graph) -> FusionReport:
        report = FusionReport(self.group_name)
        ours, others = [], set()
        for node in graph.nodes:
            if node.op == "call_function" and node.target is _sites.ALL_REDUCE and node.args[1] == "sum":
                (ours.append(node) if self._is_ours(node.args[2]) else others.add(node.args[2]))
        report.all_reduces, report.other_groups = len(ours), sorted(others)
        if not ours:
            return report
        quants = {q for q in map(_sites.Quant.of, graph.nodes) if q is not None}
        dtypes = {v.dtype for v in (n.args[0].meta.get("val") for n in ours) if getattr(v, "dtype", None)
                  in _sites.DTYPES}
        turned = _sites.put_sum_first([u for n in ours for u in n.users if u.target is _sites.WAIT])
        _ACTIVE.append((self, report))
        try:
            for name in sorted({n.args[2] for n in ours}):
                _patterns(self.handle, name, dtypes, quants).apply(graph)
        finally:
            _ACTIVE.pop()
            _sites.put_back(turned, graph)
        order = {n.name: i for i, n in enumerate(ours)}
        report.rewrites.sort(key=lambda r: order[r.all_reduce])  # the matcher walks the graph backwards
        left = {n.name for n in graph.nodes if n.target is _sites.ALL_REDUCE}
        report.unfused = {n.name: report.unfused.get(n.name, NO_PATTERN) for n in ours if n.name in left}
        log.info("%s", report)
        if not report.rewrites:
            warnings.warn(FusionWarning(
                f"tpcomm fusion pass: the graph all-reduces {len(ours)} time(s) on group {self.group_name!r} and "
                f"no site was rewritten; the model runs unfused. {report}"), stacklevel=2)
        return report

    def _check(self, match: pm.Match, site: _sites.Site, report: FusionReport) -> bool:
        """Accept or refuse a candidate (:func:`tpcomm.inductor.sites.refusal`), recording either."""
        node = _sites.all_reduce_of(match)
        why = _sites.refusal(match, site, self.device)
        if why is not None:
            report.unfused[node.name] = why
            return False
        x = match.kwargs["x"].meta["val"]
        report.rewrites.append(Rewrite(site.kind, site.norm.name, str(x.dtype).removeprefix("torch."),
                                       tuple(x.shape), node.name))
        return True

    def _is_ours(self, name: str) -> bool:
        """Whether the group named ``name`` sums over the communicator's ranks in its order."""
        if name == self.group_name:
            return True
        if name not in self._same_group:
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group

                ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(name)))
            except (LookupError, RuntimeError, ValueError):  # a name of no group of this process
                ranks = None
            self._same_group[name] = ranks == self.ranks
        return self._same_group[name]


def _source_hash() -> str:
    """sha256 of tpcomm's version and the text of :data:`_SOURCES`."""
    h = hashlib.sha256(__version__.encode())
    for path in _SOURCES:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


# -- the patterns of each (handle, group), shared by every pass of that communicator in this process --------
#: ``(handle, group name) -> (patterns, the (dtype, quantiser or None) pairs registered in them)``; an entry
#: goes with its communicator.
_REGISTRY: dict[tuple[int, str], tuple[pm.PatternMatcherPass, set]] = {}
#: The pass applying patterns now and its report (the checks of the shared patterns record into it).
_ACTIVE: list[tuple[FusionPass, FusionReport]] = []


def _patterns(handle: int, group: str, dtypes: set, quants: set) -> pm.PatternMatcherPass:
    """The patterns of ``handle`` on ``group``, with every site kind registered for each dtype in ``dtypes``,
    unquantised and with each quantiser in ``quants``."""
    key = (handle, group)
    if key not in _REGISTRY:
        _REGISTRY[key] = (pm.PatternMatcherPass(pass_name="tpcomm_fusion"), set())
        weakref.finalize(lookup(handle), _REGISTRY.pop, key, None)
    patterns, done = _REGISTRY[key]
    for dtype in sorted(dtypes, key=str):
        for quant in [None] + sorted(quants, key=str):
            if (dtype, quant) not in done:
                done.add((dtype, quant))
                for site in _sites.sites_of(NORM_STYLES, quant):
                    _sites.register(site, dtype, group, handle, patterns, _check_active)
    return patterns


def _check_active(match: pm.Match, site: _sites.Site) -> bool:
    fusion, report = _ACTIVE[-1]
    return fusion._check(match, site, report)
