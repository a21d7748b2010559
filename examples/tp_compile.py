"""A Hugging Face model sharded by transformers' own tensor parallelism gets tpcomm's fused all-reduce +
residual add + RMSNorm from ``torch.compile``, with one line and no change to the model.

    torchrun --nproc_per_node 2 examples/tp_compile.py                    # 2 CPU ranks, or 2 GPUs
    torchrun --nproc_per_node 2 examples/tp_compile.py --family gemma3 --dtype bf16
    torchrun --nproc_per_node 4 examples/tp_compile.py --model /path/to/a/local/checkpoint

Every rank loads the model with ``DistributedConfig(tp_size=world_size)`` (a small random-weight Llama or
Gemma 3 built from a config and saved in a temporary directory, unless ``--model`` names a checkpoint),
makes a :class:`tpcomm.Communicator` on the world group and compiles the model with tpcomm's fusion pass::

    model = tpcomm.compile(model, comm)

then runs one forward pass eagerly and compiled. Rank 0 prints the pass's report (every all-reduce of the
graph: rewritten into which fused site, or why not) and the largest difference between the compiled and
eager logits over all ranks; ``PASS`` when it is within :func:`tolerance`, else ``FAIL`` and exit code 1.

On CPU ranks the kernels run under Triton's interpreter, and the default backend is ``post_grad_eager``
(Inductor's passes, the fusion pass among them, without the tens of seconds of a C++ build); on GPUs it
is Inductor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tpcomm  # noqa: E402  (before Triton: on a machine without CUDA it turns the interpreter on)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FAMILIES = ("llama", "gemma3")


@dataclass(frozen=True)
class Config:
    """The run: ``family`` (a random model of it) or ``model`` (a local checkpoint), ``dtype``, decoder
    ``layers`` of the random model, ``tokens`` of the prompt, the ``torch.compile`` ``backend``."""

    family: str = "llama"
    model: str | None = None
    dtype: str = "fp32"
    layers: int = 2
    tokens: int = 5
    backend: str = "post_grad_eager"


def tolerance(cfg: Config) -> float:
    """Relative max difference allowed between compiled and eager logits. fp32: both sides round the
    same values differently (a float32 rank-order sum, a correctly rounded 1/sqrt where the norm takes
    rsqrt), about 1e-7 relative per layer; 1e-5 fails any wrong site. bf16 / fp16: the fused norm rounds
    its output once where Hugging Face's rounds twice, one unit ``u`` of the dtype per site, carried
    through the residual stream: ``4 * layers * u`` (as examples/tp_decoder.py), far below a wrong result."""
    if cfg.dtype == "fp32":
        return 1e-5
    return 4 * cfg.layers * torch.finfo(DTYPES[cfg.dtype]).eps / 2


def save_random_model(cfg: Config, path: str) -> None:
    """A small ``cfg.family`` model with random weights (norm weights moved off their initial value) in
    ``path``; the sizes split over 2 or 4 ranks."""
    import transformers

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=cfg.layers,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    if cfg.family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**sizes, sliding_window=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.25 * torch.randn_like(p))
    model.save_pretrained(path)


def run(cfg: Config, comm, path: str) -> dict:
    """One rank: the model at ``path`` sharded over ``comm``'s group, eager and compiled with the fusion pass.
    Returns the pass's report (text and counts) and the relative max difference of the logits."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.dtype],
                                                 distributed_config=DistributedConfig(tp_size=comm.world_size))
    fusion = tpcomm.fusion_pass(comm)  # kept to read its report; tpcomm.compile(model, comm) is the one line
    compiled = tpcomm.compile(model, fusion, backend=cfg.backend, fullgraph=True)
    ids = torch.randint(0, 100, (1, cfg.tokens), generator=torch.Generator().manual_seed(1)).to(comm.device)
    with torch.no_grad():
        eager = model(ids).logits.double()
        out = compiled(ids).logits.double()
    report = fusion.reports[-1] if fusion.reports else None
    return {"report": str(report), "sites": len(report.rewrites) if report else 0,
            "difference": ((out - eager).abs().max() / eager.abs().max()).item()}


def parse(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, default="llama", help="the random model's family")
    p.add_argument("--model", help="a local Hugging Face checkpoint (directory) instead of a random model")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on GPUs, fp32 on CPU ranks")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the random model")
    p.add_argument("--tokens", type=int, default=5, help="prompt length")
    p.add_argument("--backend", choices=("inductor", "post_grad_eager"),
                   help="default: inductor on GPUs, post_grad_eager on CPU ranks")
    a = p.parse_args(argv)
    if a.layers < 1 or a.tokens < 1:
        p.error(f"--layers and --tokens must be >= 1, got {a.layers} and {a.tokens}")
    if a.model is not None and not os.path.isdir(a.model):
        p.error(f"--model {a.model}: not a directory")
    cuda = torch.cuda.is_available()
    return Config(a.family, a.model, a.dtype or ("bf16" if cuda else "fp32"), a.layers, a.tokens,
                  a.backend or ("inductor" if cuda else "post_grad_eager"))


def main(argv=None) -> int:
    cfg = parse(argv)
    if "RANK" not in os.environ:
        raise SystemExit("tp_compile: run it with torchrun --nproc_per_node N (N ranks of one machine)")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    comm = tpcomm.Communicator()
    made = None
    try:
        path = cfg.model
        if path is None:  # rank 0 saves the random model; every rank loads it
            made = [tempfile.mkdtemp(prefix="tp_compile-") if comm.rank == 0 else None]
            if comm.rank == 0:
                save_random_model(cfg, made[0])
            dist.broadcast_object_list(made, src=0)
            path = made[0]
        result = run(cfg, comm, path)
        results = [None] * comm.world_size
        dist.all_gather_object(results, result)
        worst = max(r["difference"] for r in results)
        ok = worst <= tolerance(cfg) and all(r["sites"] > 0 for r in results)
        if comm.rank == 0:
            print(result["report"])
            print(f"{cfg.family if cfg.model is None else cfg.model}, {cfg.dtype}, {comm.world_size} ranks, "
                  f"{cfg.backend}: compiled vs eager logits, largest relative difference {worst:.3g} "
                  f"(tolerance {tolerance(cfg):.3g}): {'PASS' if ok else 'FAIL'}")
        dist.barrier()
        return 0 if ok else 1
    finally:
        comm.close()
        if made is not None and comm.rank == 0:
            shutil.rmtree(made[0], ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
