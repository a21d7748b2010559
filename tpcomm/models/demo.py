"""``tpcomm demo --model llama|gemma``: a Hugging Face model of seeded random weights (no download) run
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

Prints a table; exit 1 on a mismatch. CPU ranks run the kernels under Triton's interpreter; GPUs run
eagerly (CUDA graphs of this loop are not captured here). On a machine with one GPU the ranks are
loopback ranks (:mod:`tpcomm.loopback`, :func:`run_loopback`): one thread issues each step for every
rank in turn, with a loop of the model's forward that reads nothing back to the host (``generate``
does, each step, which would hold the peers' launches back while a rank's kernel waits for them).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: Model kinds of ``--model``.
MODELS = ("llama", "gemma")


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


def sized(cfg: ModelDemoConfig, world_size: int) -> ModelDemoConfig:
    """``cfg`` with heads, key-value heads and intermediate size that divide by ``world_size``: 128-wide
    heads, ``4 W`` of them on CPU ranks (hidden 1024 at 2 ranks, 1536 at 3) and 16 on GPUs (hidden 2048),
    half as many key-value heads, an intermediate size of about 2.75 x hidden."""
    from dataclasses import replace

    heads = 16 if cfg.device == "cuda" and 16 % world_size == 0 else 4 * world_size
    hidden = 128 * heads
    step = 64 * world_size
    return replace(cfg, heads=heads, kv_heads=heads // 2, hidden=hidden,
                   intermediate=-(-(11 * hidden // 4) // step) * step)


def make_model(cfg: ModelDemoConfig):
    """The seeded model (the same weights on every rank)."""
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
            **common, head_dim=cfg.hidden // cfg.heads, sliding_window=cfg.prompt + cfg.steps // 2))
        with torch.no_grad():  # Gemma's norms start at w = 0 (a plain norm): give them weights to test
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(0.5 * torch.randn_like(p))
    else:
        raise ValueError(f"model must be one of {MODELS}, got {cfg.model!r}")
    dtype = getattr(torch, cfg.dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    return model.to(device=device, dtype=dtype).eval()


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
    t0 = time.perf_counter()
    ref_tokens, ref_logits = greedy(model, prompt, cfg.steps)
    t_ref = time.perf_counter() - t0
    with Communicator() as comm:
        tp = shard(model, comm)
        t0 = time.perf_counter()
        tokens, logits = greedy(tp, prompt, cfg.steps)
        t_tp = time.perf_counter() - t0
        gathered = [torch.empty_like(tokens) for _ in range(world_size)]
        dist.all_gather(gathered, tokens.contiguous(), group=comm.group)
        kernels = comm.uses_kernels
        if device.type == "cuda":
            torch.cuda.synchronize()
    same_on_ranks = all(torch.equal(t, gathered[0]) for t in gathered)
    return _result(tokens, logits, ref_tokens, ref_logits, same_on_ranks, kernels, cfg.steps, t_ref, t_tp)


def _result(tokens, logits, ref_tokens, ref_logits, same_on_ranks: bool, kernels: bool, steps: int,
            seconds_ref: float, seconds_tp: float) -> dict:
    """One rank's row of the report."""
    agree = int((tokens == ref_tokens).long().cumprod(0).sum())  # steps equal before the first difference
    # logits are comparable up to and including the first step that differs (the same prefix before it)
    upto = min(agree + 1, steps)
    return dict(tokens=tokens.tolist(), ref_tokens=ref_tokens.tolist(), same_on_ranks=same_on_ranks,
                steps_agree=agree, first_diff=agree,
                logit_error=float((logits[:upto] - ref_logits[:upto]).abs().max()),
                logit_scale=float(ref_logits.abs().max()), kernels=kernels, seconds_ref=seconds_ref,
                seconds_tp=seconds_tp)


def _ready_cache(model, device: torch.device):
    """A KV cache for ``model`` whose layers are initialised already: a layer's first update otherwise
    copies a host scalar to the device (Gemma's sliding-window layers), and such a copy waits for the
    stream, which then holds a tpcomm kernel waiting for peers whose launches this thread has not issued
    yet."""
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    dtype = next(model.parameters()).dtype
    for layer in getattr(cache, "layers", ()):
        if hasattr(layer, "lazy_initialization") and not layer.is_initialized:
            empty = torch.empty(0, dtype=dtype, device=device)
            layer.lazy_initialization(empty, empty)
    return cache


def _lockstep(models: list, prompt: torch.Tensor, steps: int, issue) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy decoding of every model in ``models`` with the KV cache, one step of all of them at a time:
    ``issue(fn)`` runs ``fn(i)`` for every model ``i`` (:func:`tpcomm.loopback.run_ranks` for loopback
    ranks), and a step reads nothing back to the host, so no rank's launches wait for the host while a
    peer's kernel waits for them. Returns ``(tokens (steps,), logits (steps, vocab) float32)`` per model.
    No logits processor: unlike ``generate(min_new_tokens=...)`` the end-of-sequence token may win a
    step, in the reference and in the shards alike."""
    state = [(prompt, _ready_cache(m, prompt.device)) for m in models]
    tokens: list[list] = [[] for _ in models]
    logits: list[list] = [[] for _ in models]
    # the KV cache's argument and output: ``cache`` in recent transformers, ``past_key_values`` before
    name = "cache" if "cache" in inspect.signature(models[0].forward).parameters else "past_key_values"

    def step(i: int) -> None:
        ids, cache = state[i]
        out = models[i](input_ids=ids, use_cache=True, **{name: cache})
        lg = out.logits[:, -1].float()
        tok = lg.argmax(-1, keepdim=True)
        state[i] = (tok, out[name])
        tokens[i].append(tok)
        logits[i].append(lg)

    with torch.inference_mode():
        for _ in range(steps):
            issue(step)
    if prompt.is_cuda:
        torch.cuda.synchronize(prompt.device)
    return [(torch.cat(t, 1)[0].cpu(), torch.cat(lg, 0).cpu()) for t, lg in zip(tokens, logits)]


def run_loopback(world_size: int, cfg: ModelDemoConfig, timeout_s: float = 60.0) -> list[dict]:
    """The reference, then the tensor-parallel run on ``world_size`` loopback ranks of the current GPU
    (:func:`tpcomm.loopback.loopback_group`): prefill and decode steps issued for every rank in turn
    (:func:`_lockstep`, the same loop for the reference). Returns :func:`run_rank`'s rows, in rank
    order.

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
    [(ref_tokens, ref_logits)] = _lockstep([model], prompt, cfg.steps, lambda fn: fn(0))
    t_ref = time.perf_counter() - t0
    ranks = loopback_group(world_size, device, timeout_s=timeout_s)
    try:
        shards = [shard(model, rank) for rank in ranks]
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        outs = _lockstep(shards, prompt, cfg.steps, lambda fn: run_ranks(ranks, lambda rank: fn(rank.rank)))
        t_tp = time.perf_counter() - t0
        kernels = all(rank.uses_kernels for rank in ranks)
        for rank in ranks:
            rank.check()
    finally:
        torch.cuda.synchronize(device)
        close_group(ranks)
    same = all(torch.equal(o[0], outs[0][0]) for o in outs)
    return [_result(tokens, logits, ref_tokens, ref_logits, same, kernels, cfg.steps, t_ref, t_tp)
            for tokens, logits in outs]


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
    return not why, why


def main(model: str = "llama", device: str | None = None, world_size: int | None = None, dtype: str | None = None,
         steps: int = 8) -> int:
    """Run it and print the table; 0 when it passed, 1 on a mismatch, 2 when it cannot run here."""
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
    results = []
    for dt in ((dtype,) if dtype else ("float32", "bfloat16")):
        cfg = sized(ModelDemoConfig(model=model, device=device, dtype=dt, steps=steps), world_size)
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
                     f"{max(r['seconds_tp'] for r in per_rank):.1f}", "ok" if ok else "FAIL: " + "; ".join(why)])
    print(tabulate(rows, headers=["model", "dtype", "steps equal to unsharded", "same tokens on all ranks",
                                  "max logit error (up to the first difference)", "s (TP run)", "check"],
                   tablefmt="github"))
    for cfg, per_rank, ok, _ in results:
        r0 = per_rank[0]
        if cfg.dtype != "float32" and r0["steps_agree"] < cfg.steps:
            print(f"{cfg.dtype}: the tokens differ from the unsharded model's from step {r0['first_diff']} "
                  "(the partial sums round to bf16 in another order, and a greedy step flips where two "
                  "logits are closer than that moves them); every rank has the same tokens.")
    return 0 if all(ok for *_, ok, _ in results) else 1
