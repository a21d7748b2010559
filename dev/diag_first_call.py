"""Which compiles a loopback rank's first call makes, and when: each rank's call of a fresh shape timed,
every Triton compile logged with the rank being issued and its specialisation key."""
import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
import torch  # noqa: E402
from triton.runtime import jit  # noqa: E402

from tpcomm.loopback import close_group, loopback_group  # noqa: E402

CUR = {"rank": None}
orig = jit.JITFunction._do_compile


def logged(self, key, signature, device, constexprs, options, attrs, warmup):
    t = time.perf_counter()
    k = orig(self, key, signature, device, constexprs, options, attrs, warmup)
    print(f"  compile {self.fn.__name__} while issuing rank {CUR['rank']} warmup={warmup}: "
          f"{time.perf_counter() - t:.2f} s key={str(key)[:400]}", flush=True)
    return k


jit.JITFunction._do_compile = logged
algo, H, T, max_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ranks = loopback_group(2, max_bytes=max_bytes, timeout_s=float(sys.argv[5]))
xs = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in ranks]
res = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
cur = torch.cuda.current_stream()
for rk in ranks:
    rk.stream.wait_stream(cur)
    CUR["rank"] = rk.rank
    t = time.perf_counter()
    with torch.cuda.stream(rk.stream), rk.use_algorithm(algo):
        rk.fused_add_rmsnorm(xs[rk.rank], res, w, 1e-6)
    print(f"rank {rk.rank} issued in {time.perf_counter() - t:.2f} s", flush=True)
for rk in ranks:
    cur.wait_stream(rk.stream)
torch.cuda.synchronize()
try:
    for rk in ranks:
        rk.check()
    print("OK", flush=True)
except Exception as e:  # noqa: BLE001
    print("FAILED", type(e).__name__, e, flush=True)
close_group(ranks)
