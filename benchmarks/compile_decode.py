"""Step time of a Hugging Face model under transformers' own tensor parallelism, compiled by
``torch.compile`` (Inductor, CUDA graphs: ``mode="reduce-overhead"``) without and with tpcomm's fusion
pass, on the GPUs of one node: one process per GPU, launched by torchrun.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/compile_decode.py [--tokens 1,16,64]
        [--hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336 --layers 4 --vocab 32000] [--out F]

Model: a Llama of the given sizes with random bf16 weights, built on rank 0's GPU and saved to a temporary
folder, loaded by every rank with ``DistributedConfig(tp_size=world_size)`` (the model's own plan: two
row-parallel all-reduces per decoder layer, a vocabulary-parallel embedding). Variants, in one run:

* ``unfused``: ``torch.compile(model, mode="reduce-overhead", fullgraph=True)``: each all-reduce is
  NCCL's (``_c10d_functional.all_reduce``), then Inductor's kernel for the residual add and RMSNorm;
* ``fused``: ``tpcomm.compile(model, comm, mode="reduce-overhead", fullgraph=True)``: the fusion pass
  rewrites every all-reduce -> add -> RMSNorm into tpcomm's fused kernel (the report is printed).

Method: for each variant (``torch._dynamo.reset()`` before each) and each token count T (one compilation
each, ``dynamic=False``): three warm-up steps (Inductor's CUDA-graph trees run eagerly, then record), then
``--iters`` steps, each between two CUDA events on every rank; a step's time is the largest over the
ranks, the result the median over the steps. A step is one forward of T new tokens with no KV cache
(``use_cache=False``): the all-reduce and norm work of a decode step of T tokens (attention reads no
cache, and the pass changes nothing there). Correctness first: the fused variant's logits against the
unfused variant's at each T (relative max difference within ``4 * layers`` bf16 units), and the pass must
have rewritten every all-reduce but the logits' all-gather. Prints a table (T, unfused and fused µs per
step, speed-up, CUDA-graph skips) and writes JSON to ``--out``.

Why not loopback ranks on one GPU (``tpcomm.loopback``, how the kernel benches run): a compiled graph
names its all-reduce by a ``torch.distributed`` process group, and transformers' tensor parallelism builds a
device mesh of one process per rank; loopback ranks are several communicators in one process, which has
one rank of one group. With a fake process group of world size 2 in one process, the unfused graph's
all-reduce would do nothing (faster than any real one), and a world size of 1 has no collective at all.
So this measurement takes two GPUs, and compares the fused kernel with what such users run today.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tpcomm  # noqa: E402  (before Triton: on a machine without CUDA it turns the interpreter on)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,16,64", help="token counts of a step, comma-separated")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--iters", type=int, default=100, help="timed steps per variant and token count")
    p.add_argument("--out", help="JSON results")
    a = p.parse_args(argv)
    a.tokens = [int(t) for t in a.tokens.split(",")]
    if min(a.tokens) < 1 or a.iters < 1 or a.layers < 1:
        p.error("--tokens, --iters and --layers must be >= 1")
    return a


def save_model(a, path: str, device: torch.device) -> None:
    """A random bf16 Llama of ``a``'s sizes, built on ``device``, saved in ``path``."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                      num_key_value_heads=a.kv_heads, max_position_embeddings=4096)
    torch.manual_seed(0)
    with device:
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def step_times(fn, iters: int, cuda: bool) -> list[float]:
    """µs of each of ``iters`` calls of ``fn``, between CUDA events (host clock on CPU ranks)."""
    import time

    if not cuda:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


def run_variant(name: str, model, comm, a, cuda: bool) -> dict:
    """Compile ``model`` as ``name`` says, then per token count: warm-up, logits, timed steps."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    skips_before = sum(v for k, v in counters["inductor"].items() if "cudagraph_skips" in k)
    kwargs = {"mode": "reduce-overhead"} if cuda else {"backend": "post_grad_eager"}
    fusion = None
    if name == "fused":
        fusion = tpcomm.fusion_pass(comm)
        compiled = tpcomm.compile(model, fusion, fullgraph=True, dynamic=False, **kwargs)
    else:
        compiled = torch.compile(model, fullgraph=True, dynamic=False,
                                 **({"mode": "reduce-overhead"} if cuda else {"backend": "aot_eager"}))
    result = {"steps_us": {}, "logits": {}}
    with torch.no_grad():
        for T in a.tokens:
            ids = torch.randint(0, a.vocab, (1, T), generator=torch.Generator().manual_seed(T)).to(comm.device)

            def step():
                return compiled(ids, use_cache=False).logits

            for _ in range(3):  # cudagraph trees: warm-up, record, first replay
                logits = step()
            result["logits"][T] = logits.float().cpu()
            times = torch.tensor(step_times(step, a.iters, cuda), dtype=torch.float64, device=comm.device)
            gathered = [torch.empty_like(times) for _ in range(comm.world_size)]
            dist.all_gather(gathered, times)
            result["steps_us"][T] = statistics.median(torch.stack(gathered).max(0).values.tolist())
    result["cudagraph_skips"] = sum(v for k, v in counters["inductor"].items() if "cudagraph_skips" in k) - skips_before
    result["reports"] = [str(r) for r in fusion.reports] if fusion else []
    result["sites"] = [len(r.rewrites) for r in fusion.reports] if fusion else []
    return result


def main(argv=None) -> int:
    a = parse(argv)
    if "RANK" not in os.environ:
        raise SystemExit("compile_decode: run it with torchrun (python -m torch.distributed.run --nproc_per_node N)")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    torch._inductor.config.fx_graph_cache = False  # the pass runs, and reports, on every compilation
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    comm = tpcomm.Communicator()
    folder = [tempfile.mkdtemp(prefix="compile_decode-") if comm.rank == 0 else None]
    try:
        if comm.rank == 0:
            save_model(a, folder[0], device)
        dist.broadcast_object_list(folder, src=0)
        from transformers import AutoModelForCausalLM, DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(folder[0], dtype=torch.bfloat16,
                                                     distributed_config=DistributedConfig(tp_size=comm.world_size))
        results = {name: run_variant(name, model, comm, a, cuda) for name in ("unfused", "fused")}
        tol = 4 * a.layers * torch.finfo(torch.bfloat16).eps / 2
        rows, ok = [], True
        for T in a.tokens:
            ref, got = results["unfused"]["logits"][T], results["fused"]["logits"][T]
            diff = ((got - ref).abs().max() / ref.abs().max()).item()
            ok = ok and diff <= tol
            u, f = results["unfused"]["steps_us"][T], results["fused"]["steps_us"][T]
            rows.append({"tokens": T, "unfused_us": u, "fused_us": f, "speedup": u / f, "logits_rel_diff": diff})
        expected_sites = 2 * a.layers + 1  # two per layer, and the embedding's (its sum is the first residual)
        ok = ok and all(s == expected_sites for s in results["fused"]["sites"])
        if comm.rank == 0:
            print("\n".join(results["fused"]["reports"][:1]))
            where = "GPUs" if cuda else "CPU ranks"
            print(f"{comm.world_size} {where}, Llama {a.layers} layers, hidden {a.hidden}, bf16; step = one "
                  "forward of T tokens, no KV cache; median over steps of the max over ranks")
            print("| T | unfused (NCCL + Inductor) µs | fused (tpcomm pass) µs | speed-up | logits rel. diff |")
            print("|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['tokens']} | {r['unfused_us']:.1f} | {r['fused_us']:.1f} | {r['speedup']:.2f}x | "
                      f"{r['logits_rel_diff']:.2g} |")
            print(f"CUDA-graph skips: unfused {results['unfused']['cudagraph_skips']}, fused "
                  f"{results['fused']['cudagraph_skips']}; sites rewritten per graph {results['fused']['sites']} "
                  f"(expected {expected_sites}); {'PASS' if ok else 'FAIL'}")
            if a.out:
                with open(a.out, "w") as f:
                    json.dump({"world_size": comm.world_size, "device": torch.cuda.get_device_name() if cuda
                               else "cpu", "args": {k: v for k, v in vars(a).items() if k != "out"}, "rows": rows,
                               "cudagraph_skips": {k: v["cudagraph_skips"] for k, v in results.items()},
                               "sites": results["fused"]["sites"], "ok": ok}, f, indent=1)
        return 0 if ok else 1
    finally:
        dist.barrier()
        if comm.rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
        comm.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
