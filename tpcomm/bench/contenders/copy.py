"""The copy-bandwidth reference: every rank at once writes its ``(T, H)`` input into the next rank's
memory (rank ``r`` into rank ``(r + 1) % W``, a peer-mapped symmetric buffer). No reduction, no flags:
what the links give to a plain push of ``n`` bytes, measured in the same run as the collectives
(:mod:`tpcomm.bench.metrics` defines ``% of copy bandwidth`` from it).

    copy_ce   peer.copy_(x)             cudaMemcpyAsync: the copy engine
    copy_sm   torch.mul(x, 1, out=peer)  an elementwise kernel: SMs store to the peer, as tpcomm does

The check: after a barrier, each rank's own buffer holds the previous rank's input bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Bound, Contender


class _PeerCopy(Contender):
    library = "reference"
    ops = ("copy",)
    modes = ("graph",)
    reference = True

    def setup(self, ctx) -> None:
        self.pool = ctx.symm_pool()

    def _write(self, src, dst):
        raise NotImplementedError

    def bind(self, case, slots, ctx) -> Bound:
        shape, dt, W = tuple(slots.x[0].shape), case.dtype, case.world_size
        peer = (case.rank + 1) % W
        dsts = [self.pool.peer_view(k, peer, shape, dt) for k in range(len(slots.x))]
        mine = [self.pool.view(k, shape, dt) for k in range(len(slots.x))]
        x = slots.x

        def call(k):
            self._write(x[k], dsts[k])
            return k

        def outputs(k):
            torch.cuda.synchronize()
            dist.barrier()
            return {"received": mine[k]}

        return Bound(call=call, outputs=outputs, poison=lambda: [m.fill_(float("nan")) for m in mine])


class CopyEngine(_PeerCopy):
    name = "copy_ce"
    label = "peer copy (copy engine)"

    def _write(self, src, dst):
        dst.copy_(src)


class CopySM(_PeerCopy):
    name = "copy_sm"
    label = "peer copy (SM stores)"

    def _write(self, src, dst):
        torch.mul(src, 1, out=dst)
