import os, sys, time, faulthandler
import torch

def body(rank, world):
    import tpcomm
    faulthandler.dump_traceback_later(45, exit=True)
    def log(*a):
        print(f"[r{rank} {time.strftime('%H:%M:%S')}]", *a, flush=True)
    t=time.time(); comm = tpcomm.Communicator(); log("comm", comm.uses_kernels, time.time()-t)
    H=4096
    for algo in ("one_shot", "lamport", "two_shot"):
        for T in (1, 3, 64):
            x = torch.randn(T, H, device="cuda").bfloat16(); r = torch.randn_like(x); w = torch.randn(H, device="cuda").bfloat16()
            with comm.use_algorithm(algo):
                t=time.time(); y = comm.all_reduce(x); torch.cuda.synchronize(); log(algo, T, "all_reduce", round(time.time()-t,2))
                t=time.time(); o = comm.fused_add_rmsnorm(x, r, w); torch.cuda.synchronize(); log(algo, T, "fused", round(time.time()-t,2))
                t=time.time(); o = comm.fused_add_rmsnorm(x, r, w, quant="fp8_per_token"); torch.cuda.synchronize(); log(algo, T, "fp8", round(time.time()-t,2))
    t=time.time(); g = comm.all_gather(x); torch.cuda.synchronize(); log("all_gather", round(time.time()-t,2))
    t=time.time(); g = comm.reduce_scatter(x); torch.cuda.synchronize(); log("reduce_scatter", round(time.time()-t,2))
    t=time.time(); g = comm.all_gather(x.to(torch.int32)); torch.cuda.synchronize(); log("all_gather int", round(time.time()-t,2))
    comm.close(); log("closed")
    return 0

if __name__ == "__main__":
    sys.path.insert(0, ".")
    from tpcomm.launch import launch
    print(launch(body, 2, "cuda", timeout_s=50))
