"""What the model shardings share (:mod:`tpcomm.models.hf`, :mod:`tpcomm.models.minimax_m2`,
:mod:`tpcomm.models.moe`): the error, a ``Linear`` cut to its rows or columns in place, a norm's eps, a norm
that hands on a fused call's output."""

from __future__ import annotations

import copy

import torch
from torch import nn


class ShardingError(ValueError):
    """A model that cannot be sharded over this many ranks (heads or intermediate size that do not
    divide by the world size, a bias on a row-parallel projection, an unknown layer shape)."""


def shard_rows(linear: nn.Linear, start: int, stop: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


def shard_columns(linear: nn.Linear, start: int, stop: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone(), requires_grad=False)
    linear.in_features = stop - start


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in eval mode with no parameter requiring grad: what a rank shards."""
    tp = copy.deepcopy(model).eval()
    for p in tp.parameters():
        p.requires_grad_(False)
    return tp


def shard_attention(attn: nn.Module, rank: int, q_width: int, kv_width: int, kv_rank: int | None = None) -> None:
    """This rank's heads of a Hugging Face attention block: rows ``[rank * q_width, (rank + 1) * q_width)``
    of ``q_proj`` (``[kv_rank * kv_width, (kv_rank + 1) * kv_width)`` of ``k_proj`` and ``v_proj``;
    ``kv_rank`` is ``rank`` unless key-value heads are replicated over several ranks), the same columns of
    ``o_proj`` as of ``q_proj`` (its output then a partial sum over the ranks)."""
    kv_rank = rank if kv_rank is None else kv_rank
    shard_rows(attn.q_proj, rank * q_width, (rank + 1) * q_width)
    shard_rows(attn.k_proj, kv_rank * kv_width, (kv_rank + 1) * kv_width)
    shard_rows(attn.v_proj, kv_rank * kv_width, (kv_rank + 1) * kv_width)
    shard_columns(attn.o_proj, rank * q_width, (rank + 1) * q_width)


def norm_eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class FusedNorm(nn.Module):
    """A Llama RMSNorm whose input was already normalised by a fused call: given the residual that call
    returned (the same tensor object), it returns the call's output; anything else it normalises
    itself (the first layer's input)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.weight = norm.weight
        self.eps = norm_eps(norm)
        self._given = None  # (residual, normalised)

    def give(self, residual: torch.Tensor, normalised: torch.Tensor) -> None:
        self._given = (residual, normalised)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given, self._given = self._given, None
        if given is not None and given[0] is x:
            return given[1]
        return self.norm(x)
