"""``tpcomm demo --model llama|gemma|minimax_m2``: a Hugging Face model of seeded random weights (no download) run
with tensor parallelism over tpcomm, against the same model unsharded in one process.

Every rank builds the same model from a small config (``make_model``: a few layers, hidden 1024 on CPU
ranks and 2048 on GPUs, a vocabulary of 2048) and the same seeded prompt, generates greedily with the
unsharded model itself (the reference), then shards it (:func:`tpcomm.models.hf.shard`) and generates
again: prefill of the prompt and ``steps`` decode steps with the KV cache (``model.generate``). Checks:

* the tokens are identical on every rank (an all-gather of them);
* float32: the tokens equal the unsharded model's, and the logits' largest error is reported (the sums
  run in another order: partial sums over the ranks, tpcomm's rank-order float32 all-reduce, its
  RMSNorm's order of operations);
* bf16: how many steps agree with the unsharded model (a flip happens where two logits are closer than
  bf16's rounding of the hidden state moves them; it is reported, not failed, once the tokens agree on
  every rank).

Prints a table, then the communicator calls each decoder layer made per forward pass on rank 0
(:class:`CallCounter`: e.g. MiniMax-M2's ``fused_qk_rmsnorm``, ``fused_add_rmsnorm`` and
``fused_moe_finalize_add_rmsnorm``); exit 1 on a mismatch (tokens, or calls that differ between ranks).
CPU ranks run the kernels under Triton's interpreter (``generate``). GPUs decode with a static KV cache, the
steps after the first replayed from one CUDA graph (:func:`static_decode`; the reference the same loop,
eagerly). On a machine with one GPU the ranks are loopback ranks (:mod:`tpcomm.loopback`,
:func:`run_loopback`): one thread issues each step for every rank in turn, and the graph holds every rank's
step, with a loop of the model's forward that reads nothing back to the host (``generate`` does, each step,
which would hold the peers' launches back while a rank's kernel waits for them).
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: Model kinds of ``--model``.
MODELS = ("llama", "gemma", "minimax_m2")


@dataclass(frozen=True)
class ModelDemoConfig:
    model: str = "llama"
    device: str = "cpu"
    dtype: str = "float32"
    layers: int = 2
    hidden: int = 1024
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 2816
    vocab: int = 2048
    prompt: int = 8
    steps: int = 8
    seed: int = 0


def sized(cfg: ModelDemoConfig, world_size: int, heads: int | None = None,
          kv_heads: int | None = None) -> ModelDemoConfig:
    """``cfg`` with heads, key-value heads and intermediate size that divide by ``world_size``: 128-wide
    heads, ``heads`` of them (default ``4 W`` on CPU ranks, hidden 1024 at 2 ranks, 1536 at 3, and 16 on
    GPUs, hidden 2048), ``kv_heads`` key-value heads (default half as many), an intermediate size of
    about 2.75 x hidden. :func:`heads_problem` says whether the heads can be sharded."""
    from dataclasses import replace

    heads = heads or (16 if cfg.device == "cuda" and 16 % world_size == 0 else 4 * world_size)
    hidden = 128 * heads
    step = 64 * world_size
    return replace(cfg, heads=heads, kv_heads=kv_heads or heads // 2, hidden=hidden,
                   intermediate=-(-(11 * hidden // 4) // step) * step)


def heads_problem(cfg: ModelDemoConfig, world_size: int) -> str | None:
    """Why ``cfg``'s heads cannot be sharded over ``world_size`` ranks, or None: the query heads must
    divide by the world size and by the key-value heads; the key-value heads must divide by the world
    size, or (MiniMax-M2, whose key-value heads are then replicated) divide it."""
    heads = f"--heads {cfg.heads} (given, or the default for {world_size} ranks)"
    if cfg.heads % world_size:
        return f"{heads} is not divisible by the world size {world_size}"
    if cfg.heads % cfg.kv_heads:
        return f"{heads} is not divisible by --kv-heads {cfg.kv_heads}"
    if cfg.kv_heads % world_size and (cfg.model != "minimax_m2" or world_size % cfg.kv_heads):
        also = " nor a divisor of it (MiniMax-M2 replicates key-value heads)" if cfg.model == "minimax_m2" else ""
        return f"--kv-heads {cfg.kv_heads} is not divisible by the world size {world_size}{also}"
    return None


def sliding_window(cfg: ModelDemoConfig) -> int:
    """Gemma's sliding window: on CPU ranks half-way through the decode steps, so that the window fills
    and slides; on GPUs the whole sequence (``transformers``' static sliding-window cache, once full,
    copies a host tensor to the device, a copy that waits for the stream, which on loopback ranks holds
    a kernel waiting for peers whose launches this thread has not issued yet)."""
    return cfg.prompt + (cfg.steps if cfg.device == "cuda" else cfg.steps // 2)


def graph_safe(config) -> bool:
    """Whether a decode step of a model of ``config`` can be captured once and replayed: not with
    sliding-window layers, whose static cache keeps host-side state (its length) that a graph freezes
    (Gemma 3 on one H200: the replays after the first drift from the eager steps, by up to 1.6 in logits
    of size 16, with or without tpcomm)."""
    return "sliding_attention" not in (getattr(config, "layer_types", None) or ())


#: Loggers of libraries that importing a transformers model may load (torchao, with the ``test`` extra),
#: whose warnings say nothing about this demo: torchao's CUDA extensions that do not load on a CPU build,
#: and torch's deprecation of a pytree call torchao makes. Raised to ERROR in the demo's processes.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def make_model(cfg: ModelDemoConfig):
    """The seeded model (the same weights on every rank)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    import transformers

    torch.manual_seed(cfg.seed)
    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                  num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                  max_position_embeddings=4 * (cfg.prompt + cfg.steps), pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    if cfg.model == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif cfg.model == "gemma":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, head_dim=cfg.hidden // cfg.heads, sliding_window=sliding_window(cfg)))
        with torch.no_grad():  # Gemma's norms start at w = 0 (a plain norm): give them weights to test
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(0.5 * torch.randn_like(p))
    elif cfg.model == "minimax_m2":  # 4 experts, 2 a token; half the rotary dims, as the real model
        model = transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(
            **{**common, "intermediate_size": cfg.intermediate // 2}, head_dim=cfg.hidden // cfg.heads,
            num_local_experts=4, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}))
        with torch.no_grad():  # the full-width q_norm and k_norm start at w = 1: give them weights to test
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.copy_(1 + 0.5 * torch.randn_like(p))
    else:
        raise ValueError(f"model must be one of {MODELS}, got {cfg.model!r}")
    dtype = getattr(torch, cfg.dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    return model.to(device=device, dtype=dtype).eval()


class CallCounter:
    """``comm`` seen through a counter: every public method called through it is counted under the
    decoder layer running at the time (:meth:`watch`), or ``None`` outside the layers. Attributes pass
    through (``rank``, ``world_size``), so a shard takes it in place of the communicator."""

    def __init__(self, comm):
        self._comm, self._layer, self.passes, self.counts = comm, None, 0, {}

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args, **kwargs):
            per = self.counts.setdefault(self._layer, {})
            per[name] = per.get(name, 0) + 1
            return attr(*args, **kwargs)
        return call

    def _enter(self, layer) -> None:
        self._layer = layer

    def watch(self, model):
        """Count ``model``'s forward passes and attribute calls to its decoder layers; returns ``model``."""
        model.model.register_forward_pre_hook(lambda *_: setattr(self, "passes", self.passes + 1))
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: self._enter(i))
            layer.register_forward_hook(lambda *_: self._enter(None))
        return model

    def per_pass(self) -> list[tuple]:
        """``[(layer, {method: calls per forward pass})]``, the layers in order, ``"other"`` last if any."""
        keys = sorted(k for k in self.counts if k is not None) + ([None] if None in self.counts else [])
        n = max(self.passes, 1)
        return [("other" if k is None else k, {op: c / n for op, c in self.counts[k].items()}) for k in keys]


def greedy(model, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens (steps,), logits (steps, vocab) float32)`` of greedy decoding with the KV cache."""
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, prompt.shape[1]:], torch.cat([lg.float() for lg in out.logits], 0)


def run_rank(rank: int, world_size: int, cfg: ModelDemoConfig) -> dict:
    """Reference, then the tensor-parallel run, on this rank (:func:`tpcomm.launch.launch`)."""
    from ..communicator import Communicator
    from .hf import shard

    model = make_model(cfg)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(cfg.seed + 1)
    prompt = torch.randint(3, cfg.vocab, (1, cfg.prompt), generator=g).to(device)
    cuda = device.type == "cuda"  # GPUs: a static cache, the decode steps in a CUDA graph (static_decode)
    t0 = time.perf_counter()
    if cuda:
        [(ref_tokens, ref_logits)] = static_decode([model], prompt, cfg.steps, lambda fn: fn(0))
    else:
        ref_tokens, ref_logits = greedy(model, prompt, cfg.steps)
    t_ref = time.perf_counter() - t0
    with Communicator() as comm:
        counter = CallCounter(comm)
        tp = counter.watch(shard(model, counter))
        t0 = time.perf_counter()
        if cuda:
            [(tokens, logits)] = static_decode([tp], prompt, cfg.steps, lambda fn: fn(0), graph=True)
        else:
            tokens, logits = greedy(tp, prompt, cfg.steps)
        t_tp = time.perf_counter() - t0
        gathered = [torch.empty_like(tokens) for _ in range(world_size)]
        dist.all_gather(gathered, tokens.contiguous(), group=comm.group)
        kernels = comm.uses_kernels
        if device.type == "cuda":
            torch.cuda.synchronize()
    same_on_ranks = all(torch.equal(t, gathered[0]) for t in gathered)
    return _result(tokens, logits, ref_tokens, ref_logits, same_on_ranks, kernels, cfg.steps, t_ref, t_tp,
                   _decode_mode(cuda, model.config, cfg), counter.per_pass())


def _result(tokens, logits, ref_tokens, ref_logits, same_on_ranks: bool, kernels: bool, steps: int,
            seconds_ref: float, seconds_tp: float, decode: str = "eager", calls: list | None = None) -> dict:
    """One rank's row of the report; ``decode``: how the decode steps ran (``eager``, ``CUDA graph``);
    ``calls``: :meth:`CallCounter.per_pass`."""
    agree = int((tokens == ref_tokens).long().cumprod(0).sum())  # steps equal before the first difference
    # logits are comparable up to and including the first step that differs (the same prefix before it)
    upto = min(agree + 1, steps)
    return dict(tokens=tokens.tolist(), ref_tokens=ref_tokens.tolist(), same_on_ranks=same_on_ranks,
                steps_agree=agree, first_diff=agree,
                logit_error=float((logits[:upto] - ref_logits[:upto]).abs().max()),
                logit_scale=float(ref_logits.abs().max()), kernels=kernels, seconds_ref=seconds_ref,
                seconds_tp=seconds_tp, decode=decode, calls=calls or [])


def static_decode(models: list, prompt: torch.Tensor, steps: int, issue,
                  graph: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy decoding of every model in ``models`` (one step of all of them at a time, ``issue(fn)``
    running ``fn(i)`` for every model ``i``; no host read inside a step) with a ``transformers.StaticCache``:
    the prefill and the first decode step eagerly, then, with ``graph`` (and :func:`graph_safe`), the
    next decode step of every model captured once in one CUDA graph (``issue`` inside the capture: for loopback ranks
    :func:`tpcomm.loopback.run_ranks`, which forks each rank's stream from the capturing stream and
    joins it) and replayed for the other steps. A step's input token, its logits and the cache position
    are static tensors the step itself advances (the argmax is written into the next step's input inside
    the graph), so a replay reads nothing back to the host. Returns ``(tokens (steps,), logits (steps,
    vocab) float32)`` per model. No logits processor: unlike ``generate(min_new_tokens=...)`` the
    end-of-sequence token may win a step, in the reference and in the shards alike."""
    import transformers

    device = prompt.device
    n = prompt.shape[1]
    name = "cache" if "cache" in inspect.signature(models[0].forward).parameters else "past_key_values"
    caches = [transformers.StaticCache(config=m.config, max_cache_len=n + steps) for m in models]
    for m, cache in zip(models, caches):  # allocated now: a lazy first update copies from the host, and
        # such a copy waits for the stream, which may hold a tpcomm kernel waiting for peers not yet issued
        head_dim = getattr(m.config, "head_dim", None) or m.config.hidden_size // m.config.num_attention_heads
        heads = [layer.self_attn.k_proj.out_features // head_dim for layer in m.model.layers]
        cache.early_initialization(1, heads, head_dim, next(m.parameters()).dtype, device)
    vocab = models[0].config.vocab_size
    ids = [torch.empty(1, 1, dtype=torch.long, device=device) for _ in models]
    last = [torch.empty(1, vocab, dtype=torch.float32, device=device) for _ in models]
    pos = torch.full((1,), n, dtype=torch.long, device=device)
    tokens: list[list] = [[] for _ in models]
    logits: list[list] = [[] for _ in models]

    def prefill(i: int) -> None:
        out = models[i](input_ids=prompt, use_cache=True, cache_position=torch.arange(n, device=device),
                        **{name: caches[i]})
        last[i].copy_(out.logits[:, -1])
        ids[i].copy_(last[i].argmax(-1, keepdim=True))

    def step(i: int) -> None:
        out = models[i](input_ids=ids[i], use_cache=True, cache_position=pos, **{name: caches[i]})
        last[i].copy_(out.logits[:, -1])
        ids[i].copy_(last[i].argmax(-1, keepdim=True))

    def record() -> None:
        for i in range(len(models)):
            tokens[i].append(ids[i].clone())
            logits[i].append(last[i].clone())

    with torch.inference_mode():
        issue(prefill)
        record()
        if steps > 1:
            issue(step)
            pos.add_(1)
            record()
        if steps > 2 and graph and graph_safe(models[0].config):
            g = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(device)
            with torch.cuda.graph(g):
                issue(step)
                pos.add_(1)
            for _ in range(steps - 2):
                g.replay()
                record()
        else:
            for _ in range(steps - 2):
                issue(step)
                pos.add_(1)
                record()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [(torch.cat(t, 1)[0].cpu(), torch.cat(lg, 0).cpu()) for t, lg in zip(tokens, logits)]


def run_loopback(world_size: int, cfg: ModelDemoConfig, timeout_s: float = 60.0, graph: bool = True) -> list[dict]:
    """The reference, then the tensor-parallel run on ``world_size`` loopback ranks of the current GPU
    (:func:`tpcomm.loopback.loopback_group`): prefill and decode steps issued for every rank in turn,
    the decode steps after the first in one CUDA graph of every rank's step (:func:`static_decode`;
    ``graph`` False: eagerly); the reference the same loop, eagerly. Returns :func:`run_rank`'s rows,
    in rank order.

    Raises:
        PeerTimeoutError: a rank's kernel waited past ``timeout_s`` (a host read inside the model's
            forward would hold its peers' launches back).
    """
    from ..loopback import close_group, loopback_group, run_ranks
    from .hf import shard

    model = make_model(cfg)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(cfg.seed + 1)
    prompt = torch.randint(3, cfg.vocab, (1, cfg.prompt), generator=g).to(device)
    t0 = time.perf_counter()
    [(ref_tokens, ref_logits)] = static_decode([model], prompt, cfg.steps, lambda fn: fn(0))
    t_ref = time.perf_counter() - t0
    ranks = loopback_group(world_size, device, timeout_s=timeout_s)
    try:
        counters = [CallCounter(rank) for rank in ranks]
        shards = [c.watch(shard(model, c)) for c in counters]
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        outs = static_decode(shards, prompt, cfg.steps, lambda fn: run_ranks(ranks, lambda rank: fn(rank.rank)),
                             graph=graph)
        t_tp = time.perf_counter() - t0
        kernels = all(rank.uses_kernels for rank in ranks)
        for rank in ranks:
            rank.check()
    finally:
        torch.cuda.synchronize(device)
        close_group(ranks)
    same = all(torch.equal(o[0], outs[0][0]) for o in outs)
    mode = _decode_mode(graph, model.config, cfg)
    return [_result(tokens, logits, ref_tokens, ref_logits, same, kernels, cfg.steps, t_ref, t_tp, mode,
                    c.per_pass()) for (tokens, logits), c in zip(outs, counters)]


def _decode_mode(graph: bool, config, cfg: ModelDemoConfig) -> str:
    """How :func:`static_decode` with ``graph`` runs the decode steps of ``cfg``."""
    return "CUDA graph" if graph and cfg.steps > 2 and graph_safe(config) else "eager"


def verdict(cfg: ModelDemoConfig, per_rank: list[dict]) -> tuple[bool, list[str]]:
    """Whether the run passed, and why not."""
    why = []
    r0 = per_rank[0]
    if not all(r["same_on_ranks"] for r in per_rank):
        why.append("tokens differ between ranks")
    if cfg.dtype == "float32" and r0["steps_agree"] != cfg.steps:
        why.append(f"float32 tokens differ from the unsharded model's from step {r0['first_diff']}")
    if not all(r["kernels"] for r in per_rank):
        why.append("the communicator fell back to torch.distributed")
    if any(r.get("calls") != r0.get("calls") for r in per_rank):
        why.append("the ranks made different communicator calls")
    return not why, why


def main(model: str = "llama", device: str | None = None, world_size: int | None = None, dtype: str | None = None,
         steps: int = 8, heads: int | None = None, kv_heads: int | None = None) -> int:
    """Run it and print the table; 0 when it passed, 1 on a mismatch, 2 when it cannot run here.
    ``heads``, ``kv_heads``: the model's query and key-value heads (:func:`sized`)."""
    from tabulate import tabulate

    from ..launch import RankFailure, default_device, launch

    try:
        import transformers  # noqa: F401
    except ImportError:
        print('tpcomm demo --model: needs transformers (pip install -e ".[hf]")')
        return 2
    device = device or default_device()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < 1:
        print("tpcomm demo --model: --device cuda needs a GPU; this machine has none. Use --device cpu.")
        return 2
    loopback = device == "cuda" and gpus == 1  # one GPU: loopback ranks (run_loopback)
    world_size = world_size or (gpus if device == "cuda" and not loopback else 2)
    problem = heads_problem(sized(ModelDemoConfig(model=model, device=device), world_size, heads, kv_heads),
                            world_size)
    if problem:
        print(f"tpcomm demo --model {model}: {problem}")
        return 2
    results = []
    for dt in ((dtype,) if dtype else ("float32", "bfloat16")):
        cfg = sized(ModelDemoConfig(model=model, device=device, dtype=dt, steps=steps), world_size, heads, kv_heads)
        kind = "loopback ranks on one GPU" if loopback else f"{device} ranks"
        print(f"tpcomm demo --model {model}: {world_size} {kind}, {cfg.layers} layers, hidden {cfg.hidden}, "
              f"{cfg.heads} heads ({cfg.kv_heads} KV), vocab {cfg.vocab}, {dt}, prompt {cfg.prompt}, "
              f"{cfg.steps} greedy steps", flush=True)
        try:
            per_rank = run_loopback(world_size, cfg) if loopback else launch(run_rank, world_size, device, args=(cfg,))
        except (RankFailure, RuntimeError) as e:
            print(f"tpcomm demo --model: a rank failed:\n{e}")
            return 1
        ok, why = verdict(cfg, per_rank)
        results.append((cfg, per_rank, ok, why))
    rows = []
    for cfg, per_rank, ok, why in results:
        r0 = per_rank[0]
        rows.append([cfg.model, cfg.dtype, f"{r0['steps_agree']}/{cfg.steps}",
                     "yes" if all(r["same_on_ranks"] for r in per_rank) else "NO",
                     f"{r0['logit_error']:.2e} (of {r0['logit_scale']:.2g})",
                     f"{max(r['seconds_tp'] for r in per_rank):.1f}", r0["decode"],
                     "ok" if ok else "FAIL: " + "; ".join(why)])
    print(tabulate(rows, headers=["model", "dtype", "steps equal to unsharded", "same tokens on all ranks",
                                  "max logit error (up to the first difference)", "s (TP run)", "decode steps",
                                  "check"],
                   tablefmt="github"))
    print(calls_table(results[0][1][0]["calls"]))
    for cfg, per_rank, ok, _ in results:
        r0 = per_rank[0]
        if cfg.dtype != "float32" and r0["steps_agree"] < cfg.steps:
            print(f"{cfg.dtype}: the tokens differ from the unsharded model's from step {r0['first_diff']} "
                  "(the partial sums round to bf16 in another order, and a greedy step flips where two "
                  "logits are closer than that moves them); every rank has the same tokens.")
    return 0 if all(ok for *_, ok, _ in results) else 1


def calls_table(calls: list) -> str:
    """:meth:`CallCounter.per_pass` of a rank as lines: the calls each layer made per forward pass."""
    def n(x: float) -> str:
        return f"{x:g}" if x == int(x) else f"{x:.2f}"
    lines = ["communicator calls per forward pass (rank 0):"]
    for layer, ops in calls:
        name = f"layer {layer}" if layer != "other" else "outside the layers"
        lines.append(f"  {name}: " + ", ".join(f"{op} x{n(c)}" for op, c in ops.items()))
    return "\n".join(lines)
