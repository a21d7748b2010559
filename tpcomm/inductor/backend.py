"""``tpcomm.compile``: ``torch.compile`` with the fusion pass in Inductor's post-grad slot, chained with a
pass already there; and ``post_grad_eager``, a backend that stops Inductor after its post-grad passes.

``post_grad_eager`` runs every step Inductor runs before code generation (its decompositions, joint-graph
and post-grad passes, the fusion pass among them), then runs the resulting FX graph op by op instead of
generating C++ or Triton: the graph the fusion pass rewrote, without the tens of seconds a C++ build of a
model takes on a CPU. It uses Inductor's internal steps (``compile_fx``'s ``inner_compile`` hook,
``fake_tensor_prop``, ``_recursive_post_grad_passes``), which may move between torch releases.
"""

from __future__ import annotations

import torch

from .fusion_pass import FusionPass

#: The backends :func:`compile` takes.
BACKENDS = ("inductor", "post_grad_eager")
SLOT = "post_grad_custom_post_pass"


def compile(model, comm, *, backend: str = "inductor", options: dict | None = None, mode: str | None = None,
            **kwargs):
    """``torch.compile(model, ...)`` with tpcomm's fusion pass
    (:class:`~tpcomm.inductor.fusion_pass.FusionPass`) on ``comm``: every all-reduce -> residual add ->
    RMSNorm site of ``comm``'s group becomes one fused tpcomm kernel.

    The same as ``torch.compile(model, options={"post_grad_custom_post_pass": tpcomm.fusion_pass(comm)},
    ...)``, except that a pass already in the slot (in ``options`` or ``torch._inductor.config``) keeps
    running, after tpcomm's, and that ``mode`` may be given with ``options`` (its settings,
    ``torch._inductor.list_mode_options(mode)``, are merged under them).

    Args:
        model: the module or function (a tensor-parallel model whose row-parallel layers all-reduce on
            ``comm``'s group: ``parallelize_module``, Hugging Face ``DistributedConfig(tp_size=N)``).
        comm: the :class:`~tpcomm.Communicator` of that group, or a pass made by :func:`tpcomm.fusion_pass`
            (to read its reports), used as it is.
        backend: ``"inductor"`` (default), or ``"post_grad_eager"``: Inductor's passes, then the graph run
            op by op, without code generation (module docstring).
        options: Inductor options, as ``torch.compile`` takes them.
        mode: as ``torch.compile`` (``"reduce-overhead"``: CUDA graphs).
        **kwargs: passed to ``torch.compile`` (``fullgraph``, ``dynamic``, ...).
    Returns:
        The compiled model, as ``torch.compile`` returns it.
    Raises:
        ValueError: an unknown ``backend``; a pass given as ``comm`` while the slot holds another pass that
            it does not chain (make it with ``tpcomm.fusion_pass(comm, chain=...)``).
        TypeError, ValueError: as :class:`~tpcomm.inductor.fusion_pass.FusionPass` for ``comm``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"tpcomm.compile: backend={backend!r}; expected one of {', '.join(BACKENDS)}")
    merged = dict(torch._inductor.list_mode_options(mode)) if mode is not None else {}
    merged.update(options or {})
    before = merged.get(SLOT, getattr(torch._inductor.config, SLOT))
    if not isinstance(comm, FusionPass):
        comm = FusionPass(comm, before)
    elif before is not None and before is not comm and not any(before is p for p in comm.chain):
        raise ValueError(f"tpcomm.compile: {SLOT} already holds {before!r}, which the given pass does not run; "
                         "make the pass with tpcomm.fusion_pass(comm, chain=that_pass)")
    merged[SLOT] = comm
    if backend == "inductor":
        return torch.compile(model, options=merged, **kwargs)
    return torch.compile(model, backend=post_grad_eager(merged), **kwargs)


def post_grad_eager(options: dict | None = None):
    """A ``torch.compile`` backend: Inductor's graph passes with ``options`` (its decompositions, the
    joint-graph and post-grad passes, a custom post-grad pass among them), then the post-grad FX graph
    run op by op, with no code generation. For CPU runs and tests of a post-grad pass.

    Returns:
        The backend, a callable ``(gm, example_inputs) -> compiled``.
    """
    patches = dict(options or {})

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=_post_grad_graph, config_patches=patches)

    return backend


def _post_grad_graph(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """``compile_fx``'s inner step without code generation: the steps Inductor takes before its post-grad
    passes (views as reshapes, fake-tensor propagation), the post-grad passes, then ``gm`` itself as the
    compiled function (boxed: AOTAutograd passes it a list of inputs)."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import _recursive_post_grad_passes, fake_tensor_prop
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.virtualized import V

    view_to_reshape(gm)
    with torch.no_grad():
        fake_mode = fake_tensor_prop(gm, example_inputs)
    with V.set_fake_mode(fake_mode):
        _recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", False))
    gm.recompile()
    return make_boxed_func(gm.forward)
