"""Real models under tensor parallelism: Hugging Face ``transformers`` causal LMs sharded over tpcomm
(:mod:`tpcomm.models.hf`; needs the optional ``hf`` extra, ``pip install -e ".[hf]"``), and the
``tpcomm demo --model`` run that checks them against the unsharded model (:mod:`tpcomm.models.demo`)."""

from .. import env  # noqa: F401  (its import refuses a tpcomm imported as an empty namespace package)
from .hf import GEMMA_LIKE, LLAMA_LIKE, ShardingError, shard

__all__ = ["GEMMA_LIKE", "LLAMA_LIKE", "ShardingError", "shard"]
