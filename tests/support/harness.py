"""Multi-rank test harness: a persistent pool of W CPU rank processes.

Starting a rank costs seconds (start a process, import Triton and tpcomm, join a gloo group), so a pool of W ranks
is started once per world size and reused by every test. A test sends a module-level function and its
arguments to every rank and gets back each rank's return value (or every failing rank's traceback):

    results = pool.run(ranks.some_case, arg1, arg2)          # [value of rank 0, value of rank 1, ...]

The function runs as ``fn(ctx, *args)`` where ``ctx`` is the rank's :class:`RankContext` (rank, world
size, and Communicators created on demand and cached for later tests). Functions must live in an
importable module (a folder's ``ranks.py``, e.g. ``tests.collectives.ranks``) so they pickle by name.

Never hang: a call that does not finish within its timeout kills the whole pool and raises
:class:`PoolTimeout`; a call in which any rank raised also restarts the pool (its communicators may no
longer agree on epochs) and raises :class:`RankError` with every failing rank's traceback. The next
test then gets a fresh pool.

Arguments and results travel as ``pickle`` bytes (tensors by value), never as shared-memory tensor
handles, so a killed rank leaves nothing behind.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable

#: Seconds a single pool call may take before the pool is killed: generous for the slowest CPU case
#: (3 ranks on 2 cores, a few calls at H = 8200), far below anything that would look like a hang.
DEFAULT_TIMEOUT_S = 120.0
#: Seconds to wait for ranks to start (spawn + import torch/triton/tpcomm + join the gloo group).
START_TIMEOUT_S = 120.0
#: Once one rank has failed, seconds the others get to report before the pool is killed (a peer may be
#: spinning in a kernel or blocked in a gloo collective waiting for the failed rank).
FAILURE_GRACE_S = 10.0


class RankError(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class PoolTimeout(AssertionError):
    """A pool call ran past its timeout; the pool was killed."""


class RankContext:
    """What a rank body gets as its first argument.

    Attributes:
        rank, world_size: this rank's place in the (gloo) world group.
    """

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self._comms: dict = {}

    def comm(self, max_bytes: int | None = None, timeout_s: float | None = None, algo: str | None = None):
        """A cached ``tpcomm.Communicator`` on the world group; ``algo`` forces ``TPCOMM_ALGO`` while it
        is created (the variable is read then). Collective the first time a given key is asked for:
        every rank runs the same body, so they all create it together."""
        key = (max_bytes, timeout_s, algo)
        if key not in self._comms:
            self._comms[key] = new_communicator(max_bytes=max_bytes, timeout_s=timeout_s, algo=algo)
        return self._comms[key]

    def close_all(self) -> None:
        for c in self._comms.values():
            c.close()
        self._comms.clear()


def new_communicator(max_bytes: int | None = None, timeout_s: float | None = None, algo: str | None = None,
                     env: dict | None = None, group=None):
    """A new ``tpcomm.Communicator`` created with ``TPCOMM_ALGO=algo`` (when given) and the variables
    in ``env`` set (tpcomm reads them at construction); the environment is restored afterwards.
    Collective."""
    import tpcomm
    from tpcomm.launch import environment

    extra = dict(env or {})
    if algo is not None:
        extra["TPCOMM_ALGO"] = algo
    with environment(extra):
        return tpcomm.Communicator(group, max_bytes=max_bytes, timeout_s=timeout_s)


def _rank_main(rank: int, world_size: int, port: int, tasks, results) -> None:
    """Body of one pool process: join the group, then run tasks until told to stop (None)."""
    import torch.distributed as dist

    from tpcomm.launch import init_rank

    try:
        init_rank(rank, world_size, "cpu", port)
        import tpcomm  # noqa: F401  (after TRITON_INTERPRET=1: tpcomm.launch.start_rank set it first)
        ctx = RankContext(rank, world_size)
        results.put((None, rank, True, pickle.dumps("ready")))
    except BaseException:
        results.put((None, rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, payload = task
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = fn(ctx, *args, **kwargs)
            results.put((task_id, rank, True, pickle.dumps(value)))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc()))
    ctx.close_all()
    dist.destroy_process_group()


class RankPool:
    """``world_size`` persistent CPU rank processes (gloo + Triton interpreter)."""

    def __init__(self, world_size: int):
        from tpcomm.launch import free_port, rank_context, rank_environment, start_rank

        self.world_size = world_size
        self.alive = False
        ctx = rank_context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        env = rank_environment("cpu")  # TRITON_INTERPRET=1, OMP_NUM_THREADS=1
        self._procs = [start_rank(ctx, _rank_main, (r, world_size, port), env, (self._tasks[r], self._results))
                       for r in range(world_size)]
        self._next_id = 0
        self.alive = True
        self._collect(None, START_TIMEOUT_S, "start-up")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(self, fn: Callable[..., Any], *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the values in rank order.

        Raises:
            RankError: a rank raised (every failing rank's traceback is in the message); the pool is
                killed so that the next test starts from fresh communicators.
            PoolTimeout: the ranks did not all finish within ``timeout_s``; the pool is killed.
        """
        return self.collect(self.submit(fn, *args, **kwargs), timeout_s)

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> tuple:
        """Start ``fn(ctx, *args, **kwargs)`` on every rank without waiting; :meth:`collect` the
        returned ticket (so that calls on two pools run at the same time)."""
        if not self.alive:
            raise RuntimeError("RankPool.submit: the pool is dead")
        task_id = self._next_id
        self._next_id += 1
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((task_id, payload))
        return task_id, getattr(fn, "__name__", repr(fn))

    def collect(self, ticket: tuple, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
        """The values of a :meth:`submit`-ted call in rank order, as :meth:`run` returns them (and with
        its errors)."""
        task_id, what = ticket
        return self._collect(task_id, timeout_s, what)

    def _collect(self, task_id, timeout_s: float, what: str) -> list:
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                tid, rank, ok, value = self._results.get(timeout=min(left, 0.5))
            except queue.Empty:
                if any(not p.is_alive() for p in self._procs):
                    # a rank died without reporting: give the others the grace period, no more
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            if tid != task_id:
                continue  # a late answer of an earlier call (cannot happen while calls succeed)
            got[rank] = (ok, value)
            if not ok:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
        missing = [r for r in range(self.world_size) if r not in got]
        if failures or missing:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            self.kill()
            msg = f"{what} on {self.world_size} ranks:\n" + "\n".join(failures)
            if missing:
                msg += (f"\nranks {missing} did not answer within {timeout_s:g} s "
                        f"(dead before the pool was killed: {dead}); the pool was killed")
            if failures:
                raise RankError(msg)
            raise PoolTimeout(msg)
        return [pickle.loads(got[r][1]) for r in range(self.world_size)]

    def kill(self) -> None:
        """Kill every rank now (each by its own pid)."""
        self.alive = False
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)

    def close(self) -> None:
        """Stop the ranks politely (they close their communicators), killing any that lingers."""
        if not self.alive:
            return
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=20)
        self.kill()


class PoolManager:
    """One pool per world size for the whole session, restarted after a pool was killed."""

    def __init__(self):
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = RankPool(world_size)
            self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def shm_files(prefix: str = "tpcomm-") -> set[str]:
    """Names in /dev/shm that start with ``prefix``."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except FileNotFoundError:
        return set()
