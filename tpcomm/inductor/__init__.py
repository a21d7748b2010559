"""tpcomm's fused collectives for any tensor-parallel model under ``torch.compile``, with no change to the
model: an Inductor graph pass that rewrites each all-reduce -> residual add -> RMSNorm of the model's
compiled graph into tpcomm's fused kernel. One line::

    model = tpcomm.compile(model, comm)
    # the same: torch.compile(model, options={"post_grad_custom_post_pass": tpcomm.fusion_pass(comm)})

The layers (docs/compile.md is the user's page):

* :mod:`tpcomm.inductor.norms`: the RMSNorm styles, as models write them;
* :mod:`tpcomm.inductor.sites`: the site kinds, their patterns and the checks before a rewrite;
* :mod:`tpcomm.inductor.fusion_pass`: :class:`FusionPass`, the ``CustomGraphPass`` (which groups, when to
  register, the report and the warning, chaining, the cache key);
* :mod:`tpcomm.inductor.backend`: :func:`compile` and the ``post_grad_eager`` backend.

Importing ``tpcomm`` does not import Inductor: these functions import it on first call.
"""

from __future__ import annotations


def fusion_pass(comm, chain=None):
    """The Inductor pass that rewrites ``comm``'s all-reduce sites into tpcomm's fused ops, for
    ``torch.compile(model, options={"post_grad_custom_post_pass": tpcomm.fusion_pass(comm)})``.

    Args:
        comm: a :class:`~tpcomm.Communicator` on the group the model's row-parallel layers all-reduce on.
        chain: a pass to run after it (what the slot held before), or None.
    Returns:
        A :class:`tpcomm.inductor.fusion_pass.FusionPass`; its ``reports`` say what it rewrote in each graph.
    Raises:
        TypeError: ``comm`` is not a Communicator.
        ValueError: ``comm`` is closed or has no ``torch.distributed`` group.
    """
    from .fusion_pass import FusionPass

    return FusionPass(comm, chain)


def compile(model, comm, *, backend: str = "inductor", options: dict | None = None, mode: str | None = None,
            **kwargs):
    """``torch.compile(model, **kwargs)`` with :func:`fusion_pass` of ``comm`` in Inductor's post-grad slot
    (chained with a pass already there). Arguments, returns and raises:
    :func:`tpcomm.inductor.backend.compile`."""
    from .backend import compile as _compile

    return _compile(model, comm, backend=backend, options=options, mode=mode, **kwargs)


__all__ = ["compile", "fusion_pass"]
