"""FlashInfer (0.6.18.post1): TensorRT-LLM's all-reduce fusion kernels and its port of vLLM's custom
all-reduce. Installed from wheels where there is no network (docs/flashinfer-offline.md); where
``import flashinfer.comm`` fails, these contenders are reported unavailable and the rest runs.

    fi_trtllm_oneshot / fi_trtllm_twoshot    flashinfer.comm.trtllm_allreduce_fusion(..., use_oneshot=...)
        fused       pattern kARResidualRMSNorm: residual in and out, norm out
        fused_fp8   pattern kARResidualRMSNormDynamicFP8Quant: per-token FP8 out, float32 scales (T, 1)
        all_reduce  pattern kAllReduce
        Settings (as TensorRT-LLM's own benchmarks run it): fp32 accumulation, PDL on, completion triggered at
        the end, one IPC workspace for the sweep's largest T x H (16-bit Lamport buffers). Two-shot needs
        T > world size.
    fi_vllm   flashinfer.comm.vllm_all_reduce with 36 CTAs (its maximum), then the torch epilogue for the
        fused ops. Inside a graph capture the inputs are used in place and registered with the peers
        after capture (vLLM's graph mode); eagerly the input is first copied into the registered IPC
        buffer (vLLM's eager mode). Messages up to the sweep's largest. vLLM registers an input by its
        address, once, with the peers' addresses of the same capture (it expects static graph inputs):
        so its input sets live in buffers kept for the whole run, copied into outside the timed region,
        and the same set ``k`` is always at the same address on every rank.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .base import Bound, Contender, NotApplicable, new_outputs, poison
from .torch_epilogue import epilogue

#: vLLM's custom all-reduce launches at most 36 CTAs (flashinfer.comm.vllm_ar.all_reduce).
VLLM_CTAS = 36
#: Per-rank scratch of vLLM's registered-buffer table: 8 MiB, as FlashInfer's own test allocates.
VLLM_RANK_DATA_BYTES = 8 << 20


def _comm():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.comm as fc
    return fc


class _TrtllmWorkspace:
    """One ``trtllm_create_ipc_workspace_for_all_reduce_fusion`` for the sweep (collective); kept until
    the ranks exit."""

    def __init__(self, ctx):
        fc = _comm()
        self.max_elems = ctx.max_tokens * ctx.max_hidden
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.ipc, self.ptrs, self.meta = fc.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                ctx.rank, ctx.world_size, ctx.max_tokens, ctx.max_hidden, use_fp32_lamport=False,
                group=dist.group.WORLD, create_metadata=True)


class _Trtllm(Contender):
    library = "FlashInfer"
    ops = ("fused", "fused_fp8", "all_reduce")
    oneshot = True

    def setup(self, ctx) -> None:
        self.ws = ctx.shared("trtllm_workspace", lambda: _TrtllmWorkspace(ctx))

    def bind(self, case, slots, ctx) -> Bound:
        fc = _comm()
        P = fc.AllReduceFusionPattern
        T, H, W, K = case.input_rows, case.H, case.world_size, len(slots.x)
        if case.dtype == torch.float32:
            raise NotApplicable("the workspace holds 16-bit Lamport buffers (fp32 needs its own)")
        if T * H > self.ws.max_elems:
            raise NotApplicable(f"T x H exceeds the workspace ({self.ws.max_elems} elements)")
        if not self.oneshot and T <= W:
            raise NotApplicable(f"two-shot needs T > world size ({T} <= {W})")
        x, res, w = slots.x, slots.residual, slots.weight
        common = dict(world_size=W, world_rank=case.rank, token_num=T, hidden_dim=H,
                      workspace_ptrs=self.ws.ptrs, launch_with_pdl=True, trigger_completion_at_end=True,
                      fp32_acc=True, use_oneshot=self.oneshot, scale_factor=None, layout_code=None)
        if case.op == "all_reduce":
            outs = new_outputs(K, (T, H), case.dtype, case.device)
            kw = dict(pattern_code=P.kAllReduce, residual_in=None, residual_out=None, norm_out=None,
                      quant_out=None, scale_out=None, rms_gamma=None, rms_eps=None)

            def call(k):
                fc.trtllm_allreduce_fusion(allreduce_in=x[k], allreduce_out=outs[k], **common, **kw)
                return {"sum": outs[k]}
            keep = outs
        elif case.op == "fused":
            outs = new_outputs(K, (T, H), case.dtype, case.device)
            res_outs = new_outputs(K, (T, H), case.dtype, case.device)

            def call(k):
                fc.trtllm_allreduce_fusion(
                    allreduce_in=x[k], allreduce_out=None, pattern_code=P.kARResidualRMSNorm,
                    residual_in=res, residual_out=res_outs[k], norm_out=outs[k], quant_out=None,
                    scale_out=None, rms_gamma=w, rms_eps=case.eps, **common)
                return {"out": outs[k], "residual_out": res_outs[k]}
            keep = outs + res_outs
        else:
            qs = new_outputs(K, (T, H), torch.float8_e4m3fn, case.device)
            scales = new_outputs(K, (T, 1), torch.float32, case.device)
            res_outs = new_outputs(K, (T, H), case.dtype, case.device)

            def call(k):
                fc.trtllm_allreduce_fusion(
                    allreduce_in=x[k], allreduce_out=None, pattern_code=P.kARResidualRMSNormDynamicFP8Quant,
                    residual_in=res, residual_out=res_outs[k], norm_out=None, quant_out=qs[k],
                    scale_out=scales[k], rms_gamma=w, rms_eps=case.eps, **common)
                return {"q": qs[k], "scale": scales[k], "residual_out": res_outs[k]}
            keep = qs + scales + res_outs

        def quiet(k):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return call(k)
        return Bound(call=quiet, outputs=lambda r: r, poison=lambda: poison(keep), keep=keep,
                     note="one-shot" if self.oneshot else "two-shot")


class TrtllmOneShot(_Trtllm):
    name = "fi_trtllm_oneshot"
    label = "FlashInfer TRT-LLM one-shot"
    oneshot = True


class TrtllmTwoShot(_Trtllm):
    name = "fi_trtllm_twoshot"
    label = "FlashInfer TRT-LLM two-shot"
    oneshot = False


class VllmCustomAllReduce(Contender):
    name = "fi_vllm"
    label = "FlashInfer vLLM AR"
    library = "FlashInfer"
    ops = ("fused", "fused_fp8", "all_reduce")

    def setup(self, ctx) -> None:
        fc = _comm()
        self.max_size = max(16, ctx.max_message_bytes)
        self.meta_ptrs = fc.create_shared_buffer(fc.vllm_meta_size() + self.max_size, group=dist.group.WORLD)
        self.buffer_ptrs = fc.create_shared_buffer(self.max_size, group=dist.group.WORLD)
        self.rank_data = torch.empty(VLLM_RANK_DATA_BYTES, dtype=torch.uint8, device="cuda")
        self.fa = fc.vllm_init_custom_ar(self.meta_ptrs, self.rank_data, ctx.rank, True)
        fc.vllm_register_buffer(self.fa, self.buffer_ptrs)
        self.rank = ctx.rank
        from ..config import set_capacity

        self.inputs = [torch.empty(max(16, set_capacity(k, ctx.max_message_bytes, ctx.cfg)), dtype=torch.uint8,
                                   device="cuda") for k in range(ctx.cfg.graph_calls)]

    def bind(self, case, slots, ctx) -> Bound:
        fc = _comm()
        T, H, K = case.input_rows, case.H, len(slots.x)
        n = T * H * torch.empty((), dtype=case.dtype).element_size()
        if n > self.max_size or n % 16:
            raise NotApplicable(f"{n} bytes: vLLM's all-reduce takes multiples of 16 up to {self.max_size}")
        from .symm import view_as

        x = [view_as(self.inputs[k], (T, H), case.dtype) for k in range(K)]
        res, w = slots.residual, slots.weight
        outs = new_outputs(K, (T, H), case.dtype, case.device)
        fa, reg, size = self.fa, self.buffer_ptrs[self.rank], self.max_size

        def call(k):
            if torch.cuda.is_current_stream_capturing():  # graph mode: registered after capture
                fc.vllm_all_reduce(fa, x[k], outs[k], 0, 0, VLLM_CTAS)
            else:  # eager mode: staged through the registered buffer
                fc.vllm_all_reduce(fa, x[k], outs[k], reg, size, VLLM_CTAS)
            return epilogue(case.op, outs[k], res, w, case.eps)

        def register():
            handles, offsets = fc.vllm_get_graph_buffer_ipc_meta(fa)
            all_handles: list = [None] * case.world_size
            all_offsets: list = [None] * case.world_size
            dist.all_gather_object(all_handles, handles)
            dist.all_gather_object(all_offsets, offsets)
            fc.vllm_register_graph_buffers(fa, all_handles, all_offsets)

        return Bound(call=call, outputs=lambda r: r, load=lambda k: x[k].copy_(slots.x[k]),
                     poison=lambda: poison(outs), after_capture=register, keep=outs, note=f"{VLLM_CTAS} CTAs")

    def close(self) -> None:
        fc = _comm()
        dist.barrier()
        fc.vllm_dispose(self.fa)
        fc.free_shared_buffer(self.buffer_ptrs, dist.group.WORLD)
        fc.free_shared_buffer(self.meta_ptrs, dist.group.WORLD)
