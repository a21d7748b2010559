"""A tensor-parallel decoder stack on tpcomm, run eagerly, compiled with ``torch.compile`` and replayed
from a CUDA graph, and checked against a single-process reference.

    python examples/tp_decoder.py                          # every GPU when there are >= 2, else 2 CPU ranks
    python examples/tp_decoder.py --device cpu --world 3 --compile --backend aot_eager

Model: ``layers`` Llama-style blocks over ``T`` tokens of one sequence (no KV cache), weights shared by
every rank and sharded Megatron-style::

    residual = x; h = rms_norm(x, w_in)                                        (local)
    per block:
      q, k, v = h @ W_q[heads].T, h @ W_k[heads].T, h @ W_v[heads].T           column-parallel: this
      a = causal_attention(q, k, v)                                            rank's heads, no comm
      h, residual = fused_add_rmsnorm(a @ W_o[:, heads].T, residual, w_attn)   row-parallel partial sum
      m = silu(h @ W_gate[cols].T) * (h @ W_up[cols].T)                        column-parallel
      h, residual = fused_add_rmsnorm(m @ W_down[:, cols].T, residual, w_mlp)  row-parallel partial sum
    output: h

``fused_add_rmsnorm`` is ``tpcomm.ops.fused_add_rmsnorm``: the sum of the ranks' partial sums, the
residual add and the RMSNorm in one kernel, as one custom op for ``torch.compile``.

Each rank runs the model (1) eagerly; (2) compiled with ``torch.compile(fullgraph=True)`` (GPU by default,
CPU with ``--compile``); (3) on GPU, the compiled model captured once in a CUDA graph, then replayed
``--replays`` times with new inputs copied into the captured input, each replay compared bit for bit with
the compiled model run outside the graph on the same input. The graph follows the rules of
``tpcomm.graphs``: communicator created first, every shape run before capture, capture inside
``tpcomm.graphs.capture_guard``. The launching process then computes the same model unsharded, in
float64, from the same seeds, and checks every rank's every output against it (relative Frobenius error,
tolerance from :func:`tolerance`) and that all ranks hold the same bits. Prints a table and ``PASS`` or
``FAIL``; exits 1 on failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
from dataclasses import dataclass

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, _ROOT)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Config:
    """The model and the run.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        world_size: ranks; must divide ``heads`` and ``intermediate``.
        layers, tokens, hidden, heads, intermediate: the model; ``hidden`` is a multiple of ``heads``.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (activations and weights).
        compile: also run the model compiled (``torch.compile(fullgraph=True)``).
        backend: the ``torch.compile`` backend (``inductor``; ``aot_eager`` traces the same graph
            without generating code, faster on CPU).
        graph: on GPU, capture the compiled (or eager) model in a CUDA graph and replay it.
        replays: replays of the graph, each with a new input.
        eps: RMSNorm epsilon.
        seed: weights and inputs come from it, the same on every rank and in the reference.
    """

    device: str
    world_size: int
    layers: int = 2
    tokens: int = 4
    hidden: int = 64
    heads: int = 4
    intermediate: int = 128
    dtype: str = "fp32"
    compile: bool = False
    backend: str = "inductor"
    graph: bool = False
    replays: int = 3
    eps: float = 1e-6
    seed: int = 2024

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        for name in ("world_size", "layers", "tokens", "hidden", "heads", "intermediate", "replays"):
            if getattr(self, name) < 1:
                raise ValueError(f"tp_decoder: {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"tp_decoder: hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.world_size or self.intermediate % self.world_size:
            raise ValueError(f"tp_decoder: heads ({self.heads}) and intermediate ({self.intermediate}) must be "
                             f"multiples of the world size ({self.world_size})")
        if self.dtype not in DTYPES:
            raise ValueError(f"tp_decoder: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.graph and self.device != "cuda":
            raise ValueError("tp_decoder: CUDA graphs need --device cuda")


def default_config(device: str, world_size: int) -> Config:
    """GPU: a small Llama-like stack in bf16, compiled and graphed. CPU: a few rows in fp32 (Triton's
    interpreter costs tens of ms a row a rank; fp32 makes the check against the reference much tighter
    than bf16, see :func:`tolerance`)."""
    if device == "cuda":
        return Config(device, world_size, layers=4, tokens=64, hidden=2048, heads=16, intermediate=5632,
                      dtype="bf16", compile=True, graph=True, replays=5)
    heads = 2 * world_size  # two heads a rank, 16 wide; any world size divides them
    return Config(device, world_size, hidden=16 * heads, heads=heads, intermediate=32 * world_size)


def tolerance(cfg: Config) -> float:
    """Relative Frobenius error allowed between a rank's output and the float64 unsharded reference.

    fp32: both sides compute the same values; they differ in rounding and in the order of the matmuls'
    sums (a shard's terms, then the ranks in order), about 1e-7 relative per layer, so 1e-5 stays tight
    and fails any wrong shard, missing rank or wrong order (those give errors of order 1).
    bf16 / fp16: every block rounds its activations about a dozen times (q, k, v, scores, probabilities,
    attention, the partial sums, residual, h, gate, up, silu * up) to a relative ``u`` (2^-8 for bf16,
    2^-11 for fp16), and errors carry through the residual stream; the demo's MLP block measured 1.7u after
    4 layers with half as many roundings. ``4 * layers * u`` leaves a margin and is still far below the
    errors of a wrong result.
    """
    if cfg.dtype == "fp32":
        return 1e-5
    u = torch.finfo(DTYPES[cfg.dtype]).eps / 2
    return 4 * cfg.layers * u


# -- weights and inputs ---------------------------------------------------------------------------------
def make_weights(cfg: Config) -> dict[str, torch.Tensor]:
    """Every weight, unsharded, float32 on the CPU, from ``cfg.seed`` (the same on every rank)."""
    g = torch.Generator().manual_seed(cfg.seed)
    H, I = cfg.hidden, cfg.intermediate

    def lin(out_f, in_f):
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

    def norm_w(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w = {"w_in": norm_w(H)}
    for i in range(cfg.layers):
        w.update({f"{i}.q": lin(H, H), f"{i}.k": lin(H, H), f"{i}.v": lin(H, H), f"{i}.o": lin(H, H),
                  f"{i}.gate": lin(I, H), f"{i}.up": lin(I, H), f"{i}.down": lin(H, I),
                  f"{i}.w_attn": norm_w(H), f"{i}.w_mlp": norm_w(H)})
    return w


def make_input(cfg: Config, index: int) -> torch.Tensor:
    """Input ``index`` (0: the first; 1..replays: the graph replays), ``(T, H)`` float32 on the CPU."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + 7 + index)
    return torch.randn(cfg.tokens, cfg.hidden, generator=g)


# -- the tensor-parallel model --------------------------------------------------------------------------
class TPDecoder(torch.nn.Module):
    """The stack above on one rank: this rank's shards of the weights, and the communicator."""

    def __init__(self, comm, cfg: Config, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.comm, self.cfg = comm, cfg
        r, W = comm.rank, comm.world_size
        dt, dev = DTYPES[cfg.dtype], comm.device
        self.heads_local = cfg.heads // W
        self.head_dim = cfg.hidden // cfg.heads
        rows = slice(r * cfg.hidden // W, (r + 1) * cfg.hidden // W)  # this rank's heads' rows of q, k, v
        cols = slice(r * cfg.intermediate // W, (r + 1) * cfg.intermediate // W)

        def p(t):
            return torch.nn.Parameter(t.to(dev, dt).contiguous(), requires_grad=False)

        self.w_in = p(weights["w_in"])
        self.blocks = torch.nn.ModuleList()
        for i in range(cfg.layers):
            b = torch.nn.Module()
            b.qkv = p(torch.cat([weights[f"{i}.q"][rows], weights[f"{i}.k"][rows], weights[f"{i}.v"][rows]]))
            b.o = p(weights[f"{i}.o"][:, rows])
            b.gate_up = p(torch.cat([weights[f"{i}.gate"][cols], weights[f"{i}.up"][cols]]))
            b.down = p(weights[f"{i}.down"][:, cols])
            b.w_attn, b.w_mlp = p(weights[f"{i}.w_attn"]), p(weights[f"{i}.w_mlp"])
            self.blocks.append(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import tpcomm.ops as tops

        T, eps = x.shape[0], self.cfg.eps
        residual = x
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.w_in, eps)
        for b in self.blocks:
            q, k, v = (h @ b.qkv.t()).view(T, 3, self.heads_local, self.head_dim).permute(1, 2, 0, 3).unbind(0)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (heads, T, d)
            a = a.transpose(0, 1).reshape(T, self.heads_local * self.head_dim)
            h, residual = tops.fused_add_rmsnorm(self.comm, a @ b.o.t(), residual, b.w_attn, eps)
            g, u = (h @ b.gate_up.t()).chunk(2, dim=-1)
            h, residual = tops.fused_add_rmsnorm(self.comm, (torch.nn.functional.silu(g) * u) @ b.down.t(),
                                                 residual, b.w_mlp, eps)
        return h


def reference_forward(cfg: Config, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The same stack unsharded, in float64, in one process (no tpcomm): the oracle."""
    W = {k: v.double() for k, v in weights.items()}
    x = x.double()
    T, H, nh = cfg.tokens, cfg.hidden, cfg.heads

    def rms(v, w):
        return v * torch.rsqrt((v * v).mean(-1, keepdim=True) + cfg.eps) * w

    residual, h = x, rms(x, W["w_in"])
    for i in range(cfg.layers):
        q, k, v = ((h @ W[f"{i}.{n}"].t()).view(T, nh, H // nh).transpose(0, 1) for n in "qkv")
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, H)
        residual = residual + a @ W[f"{i}.o"].t()
        h = rms(residual, W[f"{i}.w_attn"])
        m = torch.nn.functional.silu(h @ W[f"{i}.gate"].t()) * (h @ W[f"{i}.up"].t())
        residual = residual + m @ W[f"{i}.down"].t()
        h = rms(residual, W[f"{i}.w_mlp"])
    return h


# -- one rank -------------------------------------------------------------------------------------------
def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def run_rank(rank: int, world_size: int, cfg_fields: dict) -> dict:
    """Body of one rank (``tpcomm.launch.launch`` has joined the process group). ``cfg_fields`` is
    ``dataclasses.asdict(Config)`` (a plain dict, so it unpickles anywhere).

    Returns ``{"outputs": {mode: (T, H) CPU tensor}, "graph_matches": [bool per replay], "uses_kernels",
    "compiles"}``; modes are ``eager``, ``compiled`` and ``graph/<i>`` (``i`` the input index).
    """
    import tpcomm
    import tpcomm.graphs as tgraphs

    cfg = Config(**cfg_fields)
    weights = make_weights(cfg)
    comm = tpcomm.Communicator()  # 1. before any capture
    model = TPDecoder(comm, cfg, weights)
    dev, dt = comm.device, DTYPES[cfg.dtype]
    inputs = [make_input(cfg, i).to(dev, dt) for i in range(cfg.replays + 1)]
    outputs, graph_matches, compiles = {}, [], None
    with torch.inference_mode():
        outputs["eager"] = model(inputs[0])
        run = model
        if cfg.compile:
            from torch._dynamo.testing import CompileCounterWithBackend

            counter = CompileCounterWithBackend(cfg.backend)
            run = torch.compile(model, fullgraph=True, backend=counter)
            outputs["compiled"] = run(inputs[0])  # 2. also the warm-up of the captured shape
            run(inputs[0])
            compiles = counter.frame_count
        if cfg.graph:
            static_x = inputs[0].clone()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with tgraphs.capture_guard(comm):  # 3. checks the warm-up and the single stream
                with torch.cuda.graph(graph):
                    static_out = run(static_x)
            for i in range(1, cfg.replays + 1):
                static_x.copy_(inputs[i])
                graph.replay()
                outside = run(inputs[i])  # the same model outside the graph, on the same input
                torch.cuda.synchronize()
                comm.check()
                graph_matches.append(torch.equal(static_out.view(torch.int16 if dt != torch.float32 else torch.int32),
                                                 outside.view(torch.int16 if dt != torch.float32 else torch.int32)))
                outputs[f"graph/{i}"] = static_out.clone()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    result = {"outputs": {k: v.float().cpu() for k, v in outputs.items()},
              "digests": {k: _digest(v) for k, v in outputs.items()},
              "graph_matches": graph_matches, "uses_kernels": comm.uses_kernels, "compiles": compiles}
    comm.close()
    return result


# -- checking and reporting -----------------------------------------------------------------------------
def check(cfg: Config, results: list[dict]) -> tuple[list[list], bool]:
    """Compare every rank's outputs with :func:`reference_forward` and across ranks.

    Returns table rows ``[mode, relative error, tolerance, ranks identical, ok]`` and whether all pass
    (also failing when a graph replay differed from the model outside the graph, or a mode is missing).
    """
    weights = make_weights(cfg)
    tol = tolerance(cfg)
    modes = ["eager"] + (["compiled"] if cfg.compile else []) + [f"graph/{i}" for i in range(1, cfg.replays + 1)
                                                                  if cfg.graph]
    rows, all_ok = [], True
    refs = {}
    for mode in modes:
        idx = int(mode.split("/")[1]) if mode.startswith("graph/") else 0
        if idx not in refs:
            refs[idx] = reference_forward(cfg, weights, make_input(cfg, idx))
        ref = refs[idx]
        errs = []
        for res in results:
            out = res["outputs"].get(mode)
            errs.append(float("inf") if out is None or out.shape != ref.shape
                        else float((out.double() - ref).norm() / ref.norm()))
        same = len({res["digests"].get(mode) for res in results}) == 1 and mode in results[0]["digests"]
        err = max(errs)
        ok = err <= tol and same
        all_ok &= ok
        rows.append([mode, f"{err:.2e}", f"{tol:.1e}", "yes" if same else "NO", "ok" if ok else "FAIL"])
    if cfg.graph:
        matches = [all(res["graph_matches"]) and len(res["graph_matches"]) == cfg.replays for res in results]
        rows.append(["graph replay == the model outside the graph (bits)", "", "", "",
                     "ok" if all(matches) else "FAIL"])
        all_ok &= all(matches)
    return rows, all_ok


def main(argv=None) -> int:
    from tabulate import tabulate

    from tpcomm.launch import default_device, launch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda with >= 2 GPUs, else cpu")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every GPU, or 2 CPU ranks)")
    for name in ("layers", "tokens", "hidden", "heads", "intermediate", "replays", "seed"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="also run torch.compile(fullgraph=True) (default: on GPU)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (default inductor)")
    ap.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                    help="capture and replay a CUDA graph (default: on GPU)")
    args = ap.parse_args(argv)
    device = args.device or default_device()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < 2:
        ap.error(f"--device cuda needs at least 2 GPUs; this machine has {gpus} (use --device cpu)")
    if device == "cuda" and args.world is not None and args.world > gpus:
        ap.error(f"--world {args.world} is more than the {gpus} GPUs of this machine")
    world = args.world or (gpus if device == "cuda" else 2)
    cfg = default_config(device, world)
    overrides = {k: v for k, v in vars(args).items() if k not in ("device", "world") and v is not None}
    cfg = dataclasses.replace(cfg, **overrides)
    try:
        cfg.validate()
    except ValueError as e:
        ap.error(str(e))
    print(f"tp_decoder: {world} {device} rank{'s' if world > 1 else ''}, {cfg.layers} layers, T={cfg.tokens}, "
          f"H={cfg.hidden}, "
          f"heads={cfg.heads}, I={cfg.intermediate}, {cfg.dtype}, compile={cfg.compile} ({cfg.backend}), "
          f"graph={cfg.graph}")
    results = launch(run_rank, world, device, args=(dataclasses.asdict(cfg),), timeout_s=900)
    rows, ok = check(cfg, results)
    print(tabulate(rows, headers=["output", "rel. error vs reference", "tolerance", "ranks identical", "check"],
                   tablefmt="github"))
    kernels = all(r["uses_kernels"] for r in results)
    compiles = f"; compilations per rank: {[r['compiles'] for r in results]}" if cfg.compile else ""
    print(f"tpcomm kernels: {'yes' if kernels else 'no (fallback)'}{compiles}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
