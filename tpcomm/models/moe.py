"""MiniMax-M2's sparse MoE block sharded for tensor parallelism, finalized by one tpcomm call.

Problem: ``MiniMaxM2SparseMoeBlock`` (``transformers.models.minimax_m2.modeling_minimax_m2``) routes each
token to its top-k experts (sigmoid scores plus ``e_score_correction_bias`` choose them; the chosen
sigmoid scores, renormalised to sum to 1, weight them) and sums the experts' outputs. In the decoder
layer its result is added to the residual and normalised by the next layer's ``input_layernorm``.

Sharding: every rank keeps every expert, with the expert's intermediate dimension split over the ranks
(rank ``r`` keeps rows ``[r * I / W, (r + 1) * I / W)`` of the gate and of the up halves of
``gate_up_proj`` and the same columns of ``down_proj``), so each rank's expert output is a partial sum.
The router runs on every rank on the same input bits, so every rank routes alike. The weighted sum
over the K experts, the sum over the ranks, the residual add and the RMSNorm are one
``comm.fused_moe_finalize_add_rmsnorm`` call (docs/numerics.md, "MoE finalize"), fed with the expert
outputs in token order ``(T, K, H)`` or in the experts' permuted order ``(M, H)`` with an index.

Inference only; the original block is not modified.
"""

from __future__ import annotations

import torch
from torch import nn

from .sharding import ShardingError

#: Layouts of the expert outputs handed to the finalize.
LAYOUTS = ("token", "permuted")


class TensorParallelSparseMoe(nn.Module):
    """This rank's shard of a ``MiniMaxM2SparseMoeBlock``, with the finalize, the all-reduce, the residual
    add and the next RMSNorm in one call.

    Plain torch: ``residual_out = residual + block(x)``, ``out = rms_norm(residual_out, norm_weight, eps)``.

    Args:
        block: the unsharded ``MiniMaxM2SparseMoeBlock`` (read, not modified).
        comm: the :class:`tpcomm.Communicator` of the tensor-parallel group (its rank and size pick the
            shard).
        layout: ``"token"`` (expert outputs ``(T, K, H)``) or ``"permuted"`` (``(T * K, H)`` sorted by
            expert, with the ``(T, K)`` index of each slot's row), the same bits either way.
    Raises:
        ShardingError: the intermediate size does not divide by the world size.
        ValueError: ``layout`` is not one of :data:`LAYOUTS`.
    """

    def __init__(self, block: nn.Module, comm, layout: str = "token"):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"TensorParallelSparseMoe: layout must be one of {LAYOUTS}, got {layout!r}")
        experts = block.experts
        inter, W, r = experts.intermediate_dim, comm.world_size, comm.rank
        if inter % W:
            raise ShardingError(f"TensorParallelSparseMoe: intermediate size {inter} does not divide by the world "
                                f"size {W}")
        lo, hi = r * inter // W, (r + 1) * inter // W
        gate_up = experts.gate_up_proj.detach()
        self.comm, self.layout, self.top_k = comm, layout, block.top_k
        self.router = nn.Parameter(block.gate.weight.detach().clone(), requires_grad=False)
        self.register_buffer("bias", block.e_score_correction_bias.detach().clone())
        self.gate_up = nn.Parameter(torch.cat([gate_up[:, lo:hi], gate_up[:, inter + lo:inter + hi]], 1).clone(),
                                    requires_grad=False)
        self.down = nn.Parameter(experts.down_proj.detach()[:, :, lo:hi].clone(), requires_grad=False)
        self.act_fn = experts.act_fn

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights, topk_index)`` ``(T, K)`` of ``x`` ``(T, H)``: the block's router, float32 weights."""
        logits = nn.functional.linear(x.to(self.router.dtype), self.router)
        scores = torch.sigmoid(logits.float())
        _, index = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False)
        weights = scores.gather(1, index)
        return weights / weights.sum(dim=-1, keepdim=True), index

    def expert_outputs(self, x: torch.Tensor, topk_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's partial expert outputs, unweighted: ``(T, K, H)`` in token order, or ``(T * K, H)``
        sorted by expert with the ``(T, K)`` int32 index of each slot's row (``layout``)."""
        T, K = topk_index.shape
        flat = topk_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert: each expert's rows contiguous
        rows = torch.empty((T * K, x.shape[-1]), dtype=x.dtype, device=x.device)
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n:
                slots = order[start:start + n]
                gate, up = nn.functional.linear(x[slots // K], self.gate_up[e]).chunk(2, dim=-1)
                rows[start:start + n] = nn.functional.linear(self.act_fn(gate) * up, self.down[e])
                start += n
        if self.layout == "permuted":
            index = torch.empty(T * K, dtype=torch.int32, device=x.device)
            index[order] = torch.arange(T * K, dtype=torch.int32, device=x.device)
            return rows, index.view(T, K)
        token_order = torch.empty_like(rows)
        token_order[order] = rows
        return token_order.view(T, K, -1), None

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, residual_out)``: ``residual_out = residual + block(x)`` and its RMSNorm, each ``(..., H)``
        like ``x``. Collective: every rank calls it with the same ``x`` and ``residual``."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weights, index = self.route(x2)
        expert_out, rows = self.expert_outputs(x2, index)
        out, residual_out = self.comm.fused_moe_finalize_add_rmsnorm(
            expert_out, weights, residual.reshape(x2.shape), norm_weight, eps, index=rows)
        return out.view(shape), residual_out.view(shape)
