"""Speculative decoding under tensor parallelism: an Eagle-style draft head proposes ``K`` tokens a step for
a target model, which verifies them in one forward pass and keeps the longest prefix its own greedy choice
agrees with.

The draft (:class:`EagleDraft`) is one decoder layer on the target's hidden states: ``fc`` maps the
embedding of a token and the target's final hidden state of the position before it (``(2H,) -> (H,)``),
a one-layer Llama model (``transformers``' ``LlamaForCausalLM``: its decoder layer, final norm and LM head)
runs on that, and its own final hidden state stands in for the target's on the next draft position.
Under tensor parallelism (:func:`shard_draft`) the layer is sharded as :func:`tpcomm.models.hf.shard`
shards a Llama model: its two norms after a partial sum (``post_attention_layernorm``, the final norm)
are each one ``comm.fused_add_rmsnorm``; ``fc``, the input norm and the LM head are replicated. The
target is a sharded model (:func:`tpcomm.models.minimax_m2.shard`).

A step of :func:`speculative_greedy`, with ``x`` the last accepted token (not yet in the target's KV
cache) and ``p`` the target's cache length:

1. the draft extends over the tokens accepted last step (``n + 1`` tokens, with the target's hidden states
   of their positions; the prompt at the start), whose last output is the first proposal ``d_1``, then
   ``K - 1`` one-token steps on its own hidden states: ``d_2 .. d_K``;
2. the target runs ``[x, d_1, ..., d_K]`` (``K + 1`` tokens) at positions ``p .. p + K``; its greedy
   choice ``g_i`` after each; ``n`` = the number of leading ``d_i == g_i``;
3. the accepted tokens are ``d_1 .. d_n`` and ``g_{n + 1}`` (so each step emits ``n + 1`` tokens, the
   tokens plain greedy decoding of the target gives); both KV caches are cut back to the accepted
   positions (``DynamicCache.crop``).

So the collectives' sizes alternate as in a serving engine: ``n + 1`` and 1 tokens (the draft), ``K + 1``
(the target). Every rank decides acceptance from its own logits; tpcomm's calls return the same bits on
every rank, so the ranks accept alike — :func:`speculative_greedy` checks it at every step (``agree``)
rather than assuming it: ranks whose speculative states diverge produce wrong tokens with no error.

:func:`make_draft` builds a draft without training: its embedding table is the target's LM head and ``fc``
passes that embedding through at unit scale (the target's hidden state enters at a tenth of it), so the
draft proposes the last token again (a trained head predicts better). A random target often repeats a
token, so some proposals are accepted and others rejected.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn


class EagleDraft(nn.Module):
    """An Eagle-style draft head: ``fc`` over ``[embed(token), hidden]``, then a one-layer causal LM.

    Args:
        fc: ``Linear(2 H, H)``, no bias.
        lm: a ``transformers`` ``LlamaForCausalLM`` of one decoder layer and hidden size ``H`` (or its
            shard, :func:`tpcomm.models.hf.shard`); its ``embed_tokens`` embeds the draft's tokens and its
            ``lm_head`` gives the draft's logits.
    """

    def __init__(self, fc: nn.Linear, lm: nn.Module):
        super().__init__()
        self.fc, self.lm = fc, lm

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits (1, n, V), hidden (1, n, H))`` for ``tokens`` ``(1, n)`` (int64) at the positions after
        ``cache``'s (a ``transformers`` ``DynamicCache``, extended), each with ``hidden`` ``(1, n, H)``, the
        hidden state of the position before it (the target's, or the draft's own)."""
        x = self.fc(torch.cat([self.lm.model.embed_tokens(tokens), hidden], dim=-1))
        h = self.lm.model(inputs_embeds=x, cache=cache, use_cache=True).last_hidden_state
        return self.lm.lm_head(h), h


def make_draft(target, seed: int = 0) -> EagleDraft:
    """A draft head for ``target`` (a ``transformers`` causal LM): its hidden size, vocabulary, heads (as
    many key-value heads as query heads), ``rms_norm_eps``, dtype and device; an MLP of twice the hidden
    size. Seeded weights; the LM head and the embedding table are copies of ``target``'s LM head, ``fc``'s first half
    ``I / rms(table)``, its second half a tenth of a random matrix of unit gain (module docstring: it
    proposes the last token again)."""
    import transformers

    cfg = target.config
    H, V, heads = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    param = next(target.parameters())
    torch.manual_seed(seed)
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=H // heads, rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.max_position_embeddings, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    fc = nn.Linear(2 * H, H, bias=False)
    with torch.no_grad():
        table = target.lm_head.weight.detach().float()
        lm.model.embed_tokens.weight.copy_(table)
        lm.lm_head.weight.copy_(table)  # the target's LM head, as Eagle shares it
        fc.weight.copy_(torch.cat([torch.eye(H) / table.pow(2).mean().sqrt(), 0.1 * torch.randn(H, H) / H ** 0.5],
                                  dim=1))
    return EagleDraft(fc, lm).to(device=param.device, dtype=param.dtype).eval()


def shard_draft(draft: EagleDraft, comm) -> EagleDraft:
    """This rank's shard of ``draft`` over ``comm``: ``fc`` replicated, the one-layer model sharded by
    :func:`tpcomm.models.hf.shard` (heads and MLP columns split; the two norms after a partial sum in
    ``comm.fused_add_rmsnorm``). Collective: every rank shards the same draft. Raises ShardingError as
    that function does."""
    from .hf import shard

    fc = copy.deepcopy(draft.fc).eval().requires_grad_(False)
    return EagleDraft(fc, shard(draft.lm, comm)).eval()


def target_forward(target, tokens: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits (1, n, V), hidden (1, n, H))`` of ``target`` on ``tokens`` ``(1, n)`` after ``cache``
    (extended): the final hidden states (after the final norm) and the LM head's logits."""
    h = target.model(input_ids=tokens, cache=cache, use_cache=True).last_hidden_state
    return target.lm_head(h), h


def greedy_reference(target, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Plain greedy decoding, one token a forward pass with a ``DynamicCache``, no logits processor:
    ``(steps,)`` int64, the tokens :func:`speculative_greedy` must give."""
    import transformers

    cache = transformers.DynamicCache(config=target.config)
    out = []
    with torch.inference_mode():
        logits, _ = target_forward(target, prompt, cache)
        for _ in range(steps):
            out.append(logits[0, -1].argmax())
            if len(out) < steps:
                logits, _ = target_forward(target, out[-1].view(1, 1), cache)
    return torch.stack(out).cpu()


@dataclass
class SpeculativeRun:
    """What :func:`speculative_greedy` returns. ``tokens``: ``(steps,)`` int64; per verification step,
    ``proposals`` (the draft's ``K`` tokens), ``accepted`` (how many of them the target kept) and
    ``agreed`` (whether every rank had the same bits, where checked)."""

    tokens: torch.Tensor
    proposals: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    agreed: list[bool] = field(default_factory=list)


def bits_sum(x: torch.Tensor) -> int:
    """A checksum of ``x``'s bits (its 32- or 16-bit words summed in int64): equal tensors give equal sums."""
    x = x.detach().contiguous()
    words = x.view(torch.int32) if x.element_size() == 4 else x.view(torch.int16)
    return int(words.to(torch.int64).sum())


def speculative_greedy(target, draft: EagleDraft, prompt: torch.Tensor, steps: int, k: int = 3,
                       agree=None, phase=None) -> SpeculativeRun:
    """Greedy speculative decoding of ``steps`` tokens after ``prompt`` ``(1, n)``: ``draft`` proposes
    ``k`` tokens a step, ``target`` verifies them in one pass of ``k + 1`` tokens (module docstring).
    Collective when the models are shards: every rank calls it alike.

    Args:
        target, draft: the target LM and its :class:`EagleDraft` (both unsharded, or both shards).
        k: proposals a step, >= 1.
        agree: called once a step with an int64 tensor of that step's draft tokens, target tokens, the
            accepted count and the bit checksums (:func:`bits_sum`) of the step's draft and target
            logits; returns whether every rank passed the same (e.g. an all-gather). None: not checked.
        phase: called with ``"draft"`` or ``"target"`` before each forward pass of that model (e.g. to
            attribute the communicator's calls).
    Returns:
        A :class:`SpeculativeRun`; its tokens are those of :func:`greedy_reference`.
    Raises:
        ValueError: ``k`` < 1 or ``steps`` < 1.
    """
    import transformers

    if k < 1 or steps < 1:
        raise ValueError(f"speculative_greedy: k and steps must be >= 1, got k={k}, steps={steps}")
    note = phase or (lambda _: None)
    t_cache = transformers.DynamicCache(config=target.config)
    d_cache = transformers.DynamicCache(config=draft.lm.config)
    run = SpeculativeRun(tokens=torch.empty(0, dtype=torch.long))
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        note("target")
        logits, hidden = target_forward(target, prompt, t_cache)
        x = logits[0, -1].argmax().view(1)
        out.append(x)
        # the draft's first extend: position i takes token i + 1 with the target's hidden state of position i
        d_tokens, d_hidden = torch.cat([prompt[0, 1:], x]).view(1, -1), hidden
        while len(out) < steps:
            note("draft")
            d_logits, h = draft(d_tokens, d_hidden, d_cache)
            proposals, sums = [d_logits[0, -1].argmax().view(1)], [bits_sum(d_logits)]
            for _ in range(k - 1):
                d_logits, h = draft(proposals[-1].view(1, 1), h[:, -1:], d_cache)
                proposals.append(d_logits[0, -1].argmax().view(1))
                sums.append(bits_sum(d_logits))
            note("target")
            logits, hidden = target_forward(target, torch.cat([x] + proposals).view(1, -1), t_cache)
            choice = logits[0].argmax(-1)  # (k + 1,): the target's token after x, d_1, ..., d_k
            drafted = torch.cat(proposals)
            n = int((drafted == choice[:k]).long().cumprod(0).sum())
            new = torch.cat([drafted[:n], choice[n:n + 1]])
            if agree is not None:
                record = torch.cat([drafted, choice, torch.tensor([n] + sums + [bits_sum(logits)],
                                                                  device=drafted.device)]).cpu()
                run.agreed.append(bool(agree(record)))
            t_cache.crop(-(k - n))  # keep x and the n accepted proposals
            d_cache.crop(-(k - 1))  # the chain's positions: extended again with the target's hidden states
            d_tokens, d_hidden = new.view(1, -1), hidden[:, :n + 1]
            x = new[-1:]
            out.extend(new.split(1))
            run.proposals.append(drafted.tolist())
            run.accepted.append(n)
    run.tokens = torch.cat(out)[:steps].cpu()
    return run


class CallLog:
    """``comm`` seen through a log of its collectives: ``(model, op, tokens)`` per call whose first argument
    is a tensor, ``model`` the last :meth:`phase` (``"draft"`` or ``"target"``), ``tokens`` the call's token
    count (rows of ``(..., H)``; the routing weights' rows for the MoE finalize). Attributes pass through,
    so a shard takes it in place of the communicator."""

    def __init__(self, comm):
        self._comm, self._model, self.calls = comm, None, []

    def phase(self, model: str) -> None:
        self._model = model

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args, **kwargs):
            if args and isinstance(args[0], torch.Tensor) and args[0].dim():  # a collective on tokens
                x = args[0]
                tokens = args[1].shape[0] if name == "fused_moe_finalize_add_rmsnorm" else x.numel() // x.shape[-1]
                self.calls.append((self._model, name, int(tokens)))
            return attr(*args, **kwargs)
        return call

    def runs(self) -> list[tuple[str, int, int]]:
        """The calls grouped into runs of one model and one token count: ``[(model, tokens, calls)]``."""
        out: list[list] = []
        for model, _, tokens in self.calls:
            if out and out[-1][0] == model and out[-1][1] == tokens:
                out[-1][2] += 1
            else:
                out.append([model, tokens, 1])
        return [tuple(r) for r in out]
