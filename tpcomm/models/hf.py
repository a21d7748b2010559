"""Hugging Face ``transformers`` causal LMs sharded for tensor parallelism over a tpcomm communicator.

:func:`shard` turns a Llama-family model (``LlamaForCausalLM``, and any model whose decoder layers have
its shape: ``self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``mlp`` with
``gate_proj``/``up_proj``/``down_proj``, ``input_layernorm`` and ``post_attention_layernorm``) or a
Gemma-3-family model (``Gemma3ForCausalLM``: the same projections, four norms of the ``(1 + w)`` kind,
the post-norms applied to the attention and MLP outputs) into this rank's shard, a model of the same
class that the caller runs as before (``model(...)``, ``model.generate(...)``):

* attention heads split over the ranks (``q_proj``, ``k_proj``, ``v_proj`` by output rows: rank ``r``
  keeps heads ``[r * n / W, (r + 1) * n / W)``; ``o_proj`` by input columns), the MLP's intermediate
  columns likewise (``gate_proj``, ``up_proj`` rows, ``down_proj`` columns); ``o_proj`` and
  ``down_proj`` then return partial sums, which tpcomm adds;
* Llama: each partial sum, the residual add and the norm that follows are one
  ``comm.fused_add_rmsnorm(partial, residual, weight, eps)``: after attention with the layer's
  ``post_attention_layernorm``, after the MLP with the next layer's ``input_layernorm`` (the model's
  final ``norm`` after the last layer), whose module then returns the fused call's output;
* Gemma 3: each partial sum and its post-norm are one ``comm.fused_add_rmsnorm(partial, None, weight,
  eps, gemma=True)`` (the no-residual form with the ``(1 + w)`` weight); the residual add and the
  pre-norms are the model's own.

Everything else (embeddings, rotary embeddings, masks, attention, the KV cache, the LM head, soft-capping,
generation) is the model's own code. Inference only; the original model is not modified.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from .sharding import FusedNorm, ShardingError, frozen_copy, norm_eps, shard_attention, shard_columns, shard_rows

__all__ = ["GEMMA_LIKE", "LLAMA_LIKE", "ShardingError", "shard"]

#: Model types :func:`shard` knows, and the form of their decoder layers.
LLAMA_LIKE = ("llama", "mistral", "qwen2")
GEMMA_LIKE = ("gemma3_text",)


def _check(model, world_size: int) -> tuple[str, int, int, int, int]:
    cfg = model.config
    kind = getattr(cfg, "model_type", "")
    if kind not in LLAMA_LIKE + GEMMA_LIKE:
        raise ShardingError(f"shard: model_type {kind!r} is not one this module shards (Llama-like: "
                            f"{', '.join(LLAMA_LIKE)}; Gemma-3-like: {', '.join(GEMMA_LIKE)}; minimax_m2)")
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    inter = cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    bad = [f"{name} = {value}" for name, value in (("num_attention_heads", heads),
                                                   ("num_key_value_heads", kv_heads),
                                                   ("intermediate_size", inter)) if value % world_size]
    if bad:
        raise ShardingError(f"shard: {', '.join(bad)} not divisible by the world size {world_size}: attention "
                            "heads and MLP columns are split evenly over the ranks")
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, name, None), nn.Linear):
                raise ShardingError(f"shard: layer {i} has no self_attn.{name} Linear")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), nn.Linear):
                raise ShardingError(f"shard: layer {i} has no mlp.{name} Linear")
        for name, proj in (("self_attn.o_proj", attn.o_proj), ("mlp.down_proj", mlp.down_proj)):
            if proj.bias is not None:
                raise ShardingError(f"shard: layer {i}'s {name} has a bias: a row-parallel projection's bias "
                                    "would be added once per rank")
    return kind, heads, kv_heads, inter, head_dim


def _llama_layer_forward(comm, next_norm: FusedNorm):
    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        residual = hidden_states
        normed = self.input_layernorm(hidden_states)
        partial, _ = self.self_attn(hidden_states=normed, **kwargs)
        post = self.post_attention_layernorm
        normed, residual = comm.fused_add_rmsnorm(partial, residual, post.weight, eps=norm_eps(post))
        partial = self.mlp(normed)
        normed, residual = comm.fused_add_rmsnorm(partial, residual, next_norm.weight, eps=next_norm.eps)
        next_norm.give(residual, normed)
        return residual
    return forward


def _gemma_layer_forward(comm):
    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        residual = hidden_states
        partial, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        post = self.post_attention_layernorm
        hidden_states = residual + comm.fused_add_rmsnorm(partial, None, post.weight, eps=norm_eps(post), gemma=True)[0]
        residual = hidden_states
        partial = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        post = self.post_feedforward_layernorm
        return residual + comm.fused_add_rmsnorm(partial, None, post.weight, eps=norm_eps(post), gemma=True)[0]
    return forward


def shard(model, comm):
    """This rank's shard of ``model`` over ``comm`` (a :class:`tpcomm.Communicator`): a deep copy of the
    same class with heads and MLP columns split and the all-reduce + residual + RMSNorm of every decoder
    layer in tpcomm's fused call (the module docstring says which). Run it on every rank with the same
    model (the same weights); it is used like the original (``shard(m, comm)(input_ids)``,
    ``.generate(...)``), collectively: every rank makes the same calls.

    Args:
        model: a ``transformers`` causal LM of a type in ``LLAMA_LIKE`` or ``GEMMA_LIKE``, on
            ``comm``'s device; a MiniMax-M2 goes to :func:`tpcomm.models.minimax_m2.shard`.
        comm: the tensor-parallel group's communicator (world size ``W``).
    Returns:
        The shard, in eval mode, parameters without gradients.
    Raises:
        ShardingError (a ValueError): the heads, key-value heads or intermediate size are not divisible
            by ``W``, a row-parallel projection has a bias, or the model is of another type or shape.
    """
    if getattr(model.config, "model_type", "") == "minimax_m2":  # full-width QK norm: its own module
        from .minimax_m2 import shard as shard_minimax_m2

        return shard_minimax_m2(model, comm)
    W, r = comm.world_size, comm.rank
    kind, heads, kv_heads, inter, head_dim = _check(model, W)
    tp = frozen_copy(model)
    q, kv, i = heads // W * head_dim, kv_heads // W * head_dim, inter // W
    layers = tp.model.layers
    for n, layer in enumerate(layers):
        mlp = layer.mlp
        shard_attention(layer.self_attn, r, q, kv)
        shard_rows(mlp.gate_proj, r * i, (r + 1) * i)
        shard_rows(mlp.up_proj, r * i, (r + 1) * i)
        shard_columns(mlp.down_proj, r * i, (r + 1) * i)
        if kind in GEMMA_LIKE:
            layer.forward = types.MethodType(_gemma_layer_forward(comm), layer)
    if kind in LLAMA_LIKE:
        for n, layer in enumerate(layers):  # each layer hands its output to the next norm
            layer.input_layernorm = FusedNorm(layer.input_layernorm)
        tp.model.norm = FusedNorm(tp.model.norm)
        for n, layer in enumerate(layers):
            following = layers[n + 1].input_layernorm if n + 1 < len(layers) else tp.model.norm
            layer.forward = types.MethodType(_llama_layer_forward(comm, following), layer)
    return tp
