"""MiniMax-M2 (``transformers``' ``MiniMaxM2ForCausalLM``) with its attention and its experts sharded over a
tpcomm communicator.

MiniMax-M2's ``q_norm`` and ``k_norm`` are RMSNorms over the full width of the query and key projections
(``num_heads * head_dim`` and ``num_kv_heads * head_dim``), not per head, so under tensor parallelism the
mean of squares needs a sum over the ranks. :func:`shard`, per decoder layer:

* attention heads split over the ranks (``q_proj``, ``k_proj``, ``v_proj`` by output rows; ``q_norm`` and
  ``k_norm`` weights by the same columns; ``o_proj`` by input columns), the two norms one
  ``comm.fused_qk_rmsnorm`` (:func:`_attention_forward`). With more ranks than key-value heads
  (``W = R * num_key_value_heads``), as the serving engines shard it, each key-value head, its ``k_proj``
  and ``v_proj`` rows and its ``k_norm`` weight slice are replicated on ``R`` consecutive ranks (rank
  ``r`` holds head ``r // R``, which every query head of rank ``r`` uses), and the QK norm is told so
  (``kv_replicas=R``): the k mean of squares counts each distinct column once, the bits of the
  unreplicated norm;
* ``o_proj``'s partial sums, the residual add and ``post_attention_layernorm`` one
  ``comm.fused_add_rmsnorm`` (as :mod:`tpcomm.models.hf` does for Llama);
* the MoE block a :class:`tpcomm.models.moe.TensorParallelSparseMoe`: every expert on every rank with its
  intermediate dimension split over the ranks, the router on every rank; the weighted sum over the
  chosen experts, the sum over the ranks, the residual add and the NEXT layer's ``input_layernorm`` (the
  model's final ``norm`` after the last layer) one ``comm.fused_moe_finalize_add_rmsnorm``, whose output
  that norm module then returns (:class:`tpcomm.models.sharding.FusedNorm`, as for Llama).

So a layer makes three fused calls and no other collective. Embeddings, rotary embeddings, masks, the
attention itself, the KV cache, the LM head and generation are the model's own code. Inference only; the
original model is not modified.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from .moe import TensorParallelSparseMoe
from .sharding import FusedNorm, ShardingError, frozen_copy, norm_eps, shard_attention

#: Model types this module shards.
MINIMAX_LIKE = ("minimax_m2",)


def _check(model, world_size: int) -> tuple[int, int, int, int]:
    """``(heads, kv_heads, head_dim, kv_replicas)``, or ShardingError for a model this module cannot
    shard. ``kv_replicas``: the ranks holding each key-value head (1 where ``num_key_value_heads`` divides
    by the world size, ``W / num_key_value_heads`` where it divides the world size)."""
    cfg = model.config
    if getattr(cfg, "model_type", "") not in MINIMAX_LIKE:
        raise ShardingError(f"shard: model_type {getattr(cfg, 'model_type', '')!r} is not MiniMax-M2")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    bad = [f"{name} = {value}" for name, value in (("num_attention_heads", heads),
                                                   ("intermediate_size", cfg.intermediate_size)) if value % world_size]
    if bad:
        raise ShardingError(f"shard: {', '.join(bad)} not divisible by the world size {world_size}: attention "
                            "heads and the experts' intermediate columns are split evenly over the ranks")
    if kv_heads % world_size and world_size % kv_heads:
        raise ShardingError(f"shard: num_key_value_heads = {kv_heads} neither divisible by the world size "
                            f"{world_size} nor a divisor of it: key-value heads are split evenly over the ranks, "
                            "or each replicated on world size / num_key_value_heads ranks")
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, name, None), nn.Linear):
                raise ShardingError(f"shard: layer {i} has no self_attn.{name} Linear")
        if attn.o_proj.bias is not None:
            raise ShardingError(f"shard: layer {i}'s self_attn.o_proj has a bias: a row-parallel projection's "
                                "bias would be added once per rank")
    return heads, kv_heads, head_dim, max(1, world_size // kv_heads)


def _slice_norm(norm: nn.Module, start: int, stop: int) -> None:
    norm.weight = nn.Parameter(norm.weight.detach()[start:stop].clone(), requires_grad=False)


def _attention_forward(comm, kv_replicas: int):
    """``MiniMaxM2Attention.forward`` of a shard: ``transformers``' own steps, with ``q_norm`` and ``k_norm``
    in one ``comm.fused_qk_rmsnorm`` over the full width (``kv_replicas``: the ranks holding each
    key-value head). Returns ``(partial, weights)``: ``o_proj``'s partial sum of this rank's heads."""
    from transformers.models.minimax_m2 import modeling_minimax_m2 as mm

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, cache=None,
                past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k = self.q_proj(hidden_states), self.k_proj(hidden_states)
        q, k = comm.fused_qk_rmsnorm(q.reshape(-1, q.shape[-1]), k.reshape(-1, k.shape[-1]), self.q_norm.weight,
                                     self.k_norm.weight, eps=norm_eps(self.q_norm), kv_replicas=kv_replicas)
        query = q.view(hidden_shape).transpose(1, 2)
        key = k.view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = mm.apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attention = mm.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                             mm.eager_attention_forward)
        out, weights = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                                 **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
    return forward


def _layer_forward(comm, next_norm: FusedNorm):
    """``MiniMaxM2DecoderLayer.forward`` of a shard: the attention's partial sum, the residual add and
    ``post_attention_layernorm`` in one ``comm.fused_add_rmsnorm``; the MoE block (a
    :class:`TensorParallelSparseMoe`) with its sum over the ranks, the residual add and ``next_norm`` in one
    ``comm.fused_moe_finalize_add_rmsnorm``, handed to ``next_norm``. Returns the new residual stream."""
    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                position_ids=None, cache=None, past_key_values=None, **kwargs) -> torch.Tensor:
        residual = hidden_states
        partial, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                    position_embeddings=position_embeddings, attention_mask=attention_mask,
                                    position_ids=position_ids,
                                    cache=cache if cache is not None else past_key_values, **kwargs)
        post = self.post_attention_layernorm
        normed, residual = comm.fused_add_rmsnorm(partial, residual, post.weight, eps=norm_eps(post))
        normed, residual = self.mlp(normed, residual, next_norm.weight, next_norm.eps)
        next_norm.give(residual, normed)
        return residual
    return forward


def shard(model, comm, layout: str = "token"):
    """This rank's shard of a ``MiniMaxM2ForCausalLM`` over ``comm`` (a :class:`tpcomm.Communicator`): a deep
    copy with the attention heads and the experts' intermediate columns split, and three fused calls a
    layer (``comm.fused_qk_rmsnorm``, ``comm.fused_add_rmsnorm``, ``comm.fused_moe_finalize_add_rmsnorm``:
    the module docstring says which steps each holds). Collective: run it on every rank with the same model (the same
    weights) and use the shard like the original (``.generate(...)``).

    Args:
        model: a ``transformers`` ``MiniMaxM2ForCausalLM`` on ``comm``'s device.
        comm: the tensor-parallel group's communicator (world size ``W``).
        layout: how the experts' outputs reach the finalize, ``"token"`` or ``"permuted"``
            (:class:`TensorParallelSparseMoe`; the same bits either way).
    Returns:
        The shard, in eval mode, parameters without gradients.
    Raises:
        ShardingError (a ValueError): the heads or the experts' intermediate size are not divisible by
            ``W``, the key-value heads neither divisible by ``W`` nor dividing it, ``o_proj`` has a bias,
            or the model is not MiniMax-M2.
    """
    W, r = comm.world_size, comm.rank
    heads, kv_heads, head_dim, replicas = _check(model, W)
    tp = frozen_copy(model)
    q, kv = heads // W * head_dim, kv_heads * replicas // W * head_dim  # kv: one head a rank when replicated
    kv_rank = r // replicas  # the key-value shard this rank holds (the engines' tp_rank // replicas)
    layers = tp.model.layers
    for layer in layers:
        attn = layer.self_attn
        shard_attention(attn, r, q, kv, kv_rank=kv_rank)
        attn.num_key_value_groups = q // kv  # query heads per key-value head on this rank
        _slice_norm(attn.q_norm, r * q, (r + 1) * q)
        _slice_norm(attn.k_norm, kv_rank * kv, (kv_rank + 1) * kv)
        attn.forward = types.MethodType(_attention_forward(comm, replicas), attn)
        layer.mlp = TensorParallelSparseMoe(layer.mlp, comm, layout=layout)
        layer.input_layernorm = FusedNorm(layer.input_layernorm)  # each layer hands its output to the next norm
    tp.model.norm = FusedNorm(tp.model.norm)
    for n, layer in enumerate(layers):
        following = layers[n + 1].input_layernorm if n + 1 < len(layers) else tp.model.norm
        layer.forward = types.MethodType(_layer_forward(comm, following), layer)
    return tp
