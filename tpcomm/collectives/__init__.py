"""The ops' host paths, one module per op: :mod:`~tpcomm.collectives.all_reduce`,
:mod:`~tpcomm.collectives.fused_norm` (``fused_add_rmsnorm``), :mod:`~tpcomm.collectives.qk_norm`
(``fused_qk_rmsnorm``), :mod:`~tpcomm.collectives.moe_finalize` (``fused_moe_finalize_add_rmsnorm`` and
the local ``tpcomm.moe_finalize``; it reuses the fused norm's checks, outputs and quant forms),
:mod:`~tpcomm.collectives.all_gather` and :mod:`~tpcomm.collectives.reduce_scatter`.

Each module opens with its op's plain-torch equivalent and reads top to bottom: check the arguments ->
make or check the outputs (a quant form, :mod:`tpcomm.quant.forms`, does its part) -> ask dispatch for
the plan (:meth:`tpcomm.Communicator.plan`, :mod:`tpcomm.dispatch`) -> launch, or fall back to
``torch.distributed`` (:mod:`~tpcomm.collectives.fallback`). Its function takes the
:class:`~tpcomm.Communicator` first: the communicator keeps what every op shares (the group, the
workspace, the failure state, the call cache, the launch, record and sign helpers), looks a call up in
its call cache (:mod:`tpcomm.call_cache`) and hands a first call to the op's module, with the call's key
so the module can record its launches (the QK norm and the MoE finalize have no cached repeats: the
method hands every call over). docs/design.md, "How to add an op", lists the files of an op.
"""
