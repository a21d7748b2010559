"""``tpcomm tune``: measure the dispatch's crossovers on this machine and write a table the
:class:`~tpcomm.Communicator` loads (``TPCOMM_DISPATCH_TABLE``; rank 0's file is used by every rank).

For the all-reduce (8 KiB..64 MiB per rank) and the fused all-reduce + residual + RMSNorm (1..16384
tokens of ``hidden``), every algorithm the dispatch can choose (``lamport`` for 16-bit messages up to
``LAMPORT_MAX_BYTES``, ``one_shot``, ``two_shot``) is forced with
:meth:`~tpcomm.Communicator.use_algorithm`, checked bit for bit, and timed with ``tpcomm bench``'s
harness (CUDA graphs, replays started together, slowest rank, median). The thresholds
``lamport_max_bytes`` and ``two_shot_min_bytes`` follow from the times by the rule of
:mod:`tpcomm.tune.crossover` (with a tie margin against noise). How to use it: docs/tuning.md.

Modules: ``config`` (the sweep, the output paths, the time estimate), ``rank`` (the sweep on a rank),
``summary`` (slowest rank and median, the table, the differences from the defaults), ``crossover`` (the
rule), ``report`` (what is printed and written), ``command`` (the command and its options).
"""

from .config import TuneConfig, make_config
from .crossover import NEVER, Margin, derive

__all__ = ["NEVER", "Margin", "TuneConfig", "derive", "make_config"]
