"""``tpcomm demo --model minimax_m2 --speculative K``: greedy speculative decoding under tensor parallelism,
an Eagle-style draft head (:mod:`tpcomm.models.speculative`) proposing ``K`` tokens a step for a MiniMax-M2
target of seeded random weights, both sharded over tpcomm, against plain greedy decoding of the unsharded
target.

Every rank builds the same target and draft (:func:`tpcomm.models.demo.make_model`,
:func:`~tpcomm.models.speculative.make_draft`), decodes greedily with the unsharded target (the
reference), then shards both and decodes speculatively. Checks, each by gathering over the ranks, never
assumed:

* at every step, every rank's draft tokens, target tokens, accepted count and the bits of both models'
  logits are the same (``agree``);
* the tokens are the same on every rank, and in float32 equal the reference's;
* every rank made the same communicator calls with the same token counts (the draft's ``n + 1`` and 1,
  the target's ``K + 1``, alternating).

Prints a table, the accepted proposals of each step and the token counts of the calls (rank 0); exit 1 on
a mismatch. CPU ranks or one process per GPU; not loopback ranks (a step reads the accepted count back to
the host, which on loopback ranks would hold the other ranks' launches back).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

#: The ops a shard calls, in the order the call log encodes them.
OPS = ("fused_qk_rmsnorm", "fused_add_rmsnorm", "fused_moe_finalize_add_rmsnorm")


def same_everywhere(t: torch.Tensor, group) -> bool:
    """Whether every rank of ``group`` passed the same int64 tensor ``t`` (its lengths compared first, then
    an all-gather of the values). Collective."""
    flat = t.reshape(-1).to(torch.int64).cpu()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else flat.device
    n = torch.tensor([flat.numel()], device=dev)
    sizes = [torch.empty_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    if any(int(s) != flat.numel() for s in sizes):
        return False
    everyone = [torch.empty(flat.numel(), dtype=torch.int64, device=dev) for _ in sizes]
    dist.all_gather(everyone, flat.to(dev), group=group)
    return all(torch.equal(e, everyone[0]) for e in everyone)


def run_rank(rank: int, world_size: int, cfg, k: int) -> dict:
    """The reference, then speculative decoding of the shards, on this rank (:func:`tpcomm.launch.launch`);
    ``cfg``: a :class:`tpcomm.models.demo.ModelDemoConfig` of a MiniMax-M2. Returns this rank's row."""
    from ..communicator import Communicator
    from .demo import make_model
    from .minimax_m2 import shard
    from .speculative import CallLog, greedy_reference, make_draft, shard_draft, speculative_greedy

    model = make_model(cfg)
    draft = make_draft(model, cfg.seed + 2)
    device = next(model.parameters()).device
    prompt = torch.randint(3, cfg.vocab, (1, cfg.prompt), generator=torch.Generator().manual_seed(cfg.seed + 1))
    prompt = prompt.to(device)
    t0 = time.perf_counter()
    ref = greedy_reference(model, prompt, cfg.steps)
    t_ref = time.perf_counter() - t0
    with Communicator() as comm:
        log = CallLog(comm)
        target, tp_draft = shard(model, log), shard_draft(draft, log)
        t0 = time.perf_counter()
        run = speculative_greedy(target, tp_draft, prompt, cfg.steps, k, agree=lambda r: same_everywhere(r, comm.group),
                                 phase=log.phase)
        t_tp = time.perf_counter() - t0
        codes = torch.tensor([(m == "target", OPS.index(op), n) for m, op, n in log.calls], dtype=torch.int64)
        calls_same = same_everywhere(codes, comm.group)
        tokens_same = same_everywhere(run.tokens, comm.group)
        kernels = comm.uses_kernels
    agree = int((run.tokens == ref).long().cumprod(0).sum())
    return dict(tokens=run.tokens.tolist(), ref_tokens=ref.tolist(), steps_agree=agree, proposals=run.proposals,
                accepted=run.accepted, agreed=run.agreed, same_on_ranks=tokens_same, calls_same=calls_same,
                runs=log.runs(), kernels=kernels, seconds_ref=t_ref, seconds_tp=t_tp)


def verdict(cfg, per_rank: list[dict]) -> tuple[bool, list[str]]:
    """Whether the run passed, and why not."""
    why = []
    r0 = per_rank[0]
    if not all(all(r["agreed"]) for r in per_rank):
        step = min(r["agreed"].index(False) for r in per_rank if not all(r["agreed"]))
        why.append(f"the ranks' draft or target tokens or logits differ from step {step}")
    if not all(r["same_on_ranks"] for r in per_rank):
        why.append("tokens differ between ranks")
    if not all(r["calls_same"] for r in per_rank):
        why.append("the ranks made different communicator calls")
    if cfg.dtype == "float32" and r0["steps_agree"] != cfg.steps:
        why.append(f"float32 tokens differ from the unsharded greedy run's from step {r0['steps_agree']}")
    if not all(r["kernels"] for r in per_rank):
        why.append("the communicator fell back to torch.distributed")
    return not why, why


def sizes_line(runs: list, limit: int = 12) -> str:
    """The calls' token counts as runs of one model: ``target 5 x6 | draft 5 x2 | draft 1 x2 ...``."""
    parts = [f"{model} {tokens} x{calls}" for model, tokens, calls in runs[:limit]]
    return " | ".join(parts) + (f" | ... ({len(runs) - limit} more)" if len(runs) > limit else "")


def main(model: str = "minimax_m2", device: str | None = None, world_size: int | None = None,
         dtype: str | None = None, steps: int = 8, heads: int | None = None, kv_heads: int | None = None,
         k: int = 3) -> int:
    """Run it and print the table; 0 when it passed, 1 on a mismatch, 2 when it cannot run here.
    Arguments as :func:`tpcomm.models.demo.main`'s; ``k``: the draft's proposals a step."""
    from tabulate import tabulate

    from ..launch import RankFailure, default_device, launch
    from .demo import ModelDemoConfig, heads_problem, sized

    if model != "minimax_m2":
        print(f"tpcomm demo --speculative: the draft's target is MiniMax-M2 (--model minimax_m2), got {model}")
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print('tpcomm demo --speculative: needs transformers (pip install -e ".[hf]")')
        return 2
    device = device or default_device()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < 2:
        print("tpcomm demo --speculative: --device cuda needs a process per rank, one GPU each (this machine has "
              f"{gpus}; each step reads the accepted count back to the host, which loopback ranks cannot); use "
              "--device cpu")
        return 2
    world_size = world_size or (gpus if device == "cuda" else 2)
    problem = heads_problem(sized(ModelDemoConfig(model=model, device=device), world_size, heads, kv_heads),
                            world_size)
    if problem:
        print(f"tpcomm demo --model {model}: {problem}")
        return 2
    results = []
    for dt in ((dtype,) if dtype else ("float32", "bfloat16")):
        cfg = sized(ModelDemoConfig(model=model, device=device, dtype=dt, steps=steps), world_size, heads, kv_heads)
        print(f"tpcomm demo --model {model} --speculative {k}: {world_size} {device} ranks, {cfg.layers} layers, "
              f"hidden {cfg.hidden}, {cfg.heads} heads ({cfg.kv_heads} KV), vocab {cfg.vocab}, {dt}, prompt "
              f"{cfg.prompt}, {cfg.steps} tokens, an Eagle-style draft of one layer", flush=True)
        try:
            per_rank = launch(run_rank, world_size, device, args=(cfg, k))
        except (RankFailure, RuntimeError) as e:
            print(f"tpcomm demo --speculative: a rank failed:\n{e}")
            return 1
        ok, why = verdict(cfg, per_rank)
        results.append((cfg, per_rank, ok, why))
    rows = []
    for cfg, per_rank, ok, why in results:
        r0 = per_rank[0]
        rows.append([cfg.dtype, f"{r0['steps_agree']}/{cfg.steps}",
                     "yes" if all(r["same_on_ranks"] and all(r["agreed"]) for r in per_rank) else "NO",
                     f"{sum(r0['accepted'])}/{k * len(r0['accepted'])} in {len(r0['accepted'])} steps",
                     f"{max(r['seconds_tp'] for r in per_rank):.1f}", "ok" if ok else "FAIL: " + "; ".join(why)])
    print(tabulate(rows, headers=["dtype", "tokens equal to unsharded greedy", "same on all ranks at every step",
                                  "proposals accepted", "s (TP run)", "check"], tablefmt="github"))
    r0 = results[0][1][0]
    print("accepted proposals per step (rank 0): " + " ".join(str(n) for n in r0["accepted"]))
    if not any(r0["accepted"]):
        print("(the untrained draft proposes the last token again: this target repeated none, so each step kept "
              "the target's own token only)")
    print("communicator calls, by model and token count (rank 0): " + sizes_line(r0["runs"]))
    for cfg, per_rank, ok, _ in results:
        if cfg.dtype != "float32" and per_rank[0]["steps_agree"] < cfg.steps:
            print(f"{cfg.dtype}: the tokens differ from the unsharded model's from step {per_rank[0]['steps_agree']} "
                  "(sums rounded to bf16 in another order); every rank has the same tokens at every step.")
    return 0 if all(ok for *_, ok, _ in results) else 1
