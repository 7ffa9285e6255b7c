"""The pools' contracts and what every family shares (the names below are importable from ``kvcore.pools``).

- :mod:`kvcore.pools.base`: the two levels, as in SGLang (:class:`ReqToTokenPool` maps a request slot to its token
  locations; a :class:`KVCache`, one subclass per attention family, holds the keys/values there), the conventions
  every pool follows, and the checks and helpers of the pools' constructors and reads.
- :mod:`kvcore.pools.page_major`: what the page-major pools share (:class:`PageMajorPages`: one buffer whose unit
  is a page of every layer, virtual pages over a unified memory) and :func:`lay_over`.
- :mod:`kvcore.pools.write_loc`: where a store writes (:class:`KVWriteLoc`: a step's write locations, physical
  ones marked so).
"""

from kvcore.pools.base import (
    GB,
    DecodeReqToTokenPool,
    KVCache,
    ReqToTokenPool,
    buf_infos,
    check_memory_saver,
    check_pool_class,
    check_post_capture,
    empty_of,
    gather_outputs,
    host_buffer,
    layer_id_of,
    pair_by_layers,
    unsupported,
)
from kvcore.pools.page_major import PageMajorPages, lay_over
from kvcore.pools.write_loc import KVWriteLoc, WriteLoc, full_write_loc, tokens_of, unwrap_write_loc, write_loc_is_physical

__all__ = [
    "GB", "DecodeReqToTokenPool", "KVCache", "KVWriteLoc", "PageMajorPages", "ReqToTokenPool", "WriteLoc",
    "buf_infos", "check_memory_saver", "check_pool_class", "check_post_capture", "empty_of", "full_write_loc", "gather_outputs",
    "host_buffer", "lay_over", "layer_id_of", "pair_by_layers", "tokens_of", "unsupported", "unwrap_write_loc", "write_loc_is_physical",
]  # fmt: skip
